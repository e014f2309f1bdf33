"""kvstage as sglang's transfer backend, driven by sglang's own code, in several processes.

Run by tests/engines/sglang/run.sh inside the venv install.sh builds (sglang from the registry,
no GPU packages). Every rank is its own process (forked from this one with sglang imported;
``KVSTAGE_SGLANG_TEST_MP=spawn`` starts each from scratch) that:

* loads sglang's plugins (``sglang.srt.plugins.load_plugins``) and so kvstage's through the
  ``sglang.srt.plugins`` entry point (the installed wheel's, from python/pyproject.toml; for a
  checkout run without the wheel, run.sh puts a dist-info declaring the same entry point on the
  path);
* gets the backend's classes from sglang's ``get_kv_class(TransferBackend("kvstage"), ...)``;
* builds its pools with sglang's own classes on the CPU: ``MHATokenToKVPool`` (KV),
  ``MLATokenToKVPool``, ``MetadataBuffers`` (aux rows), ``MambaPool`` (conv/SSM state), ``KVArgs`` filled as ``prefill.py``/``decode.py``
  ``_init_kv_manager`` fill it (``get_kv_transfer_buf_infos``, ``get_buf_infos``);
* calls the backend in the order sglang's schedulers do (the loops are this file's; the order,
  arguments and helpers are sglang's): decode ``receiver(mgr=, bootstrap_addr=,
  bootstrap_room=)``, ``mgr.try_ensure_parallel_info(addr)`` per cycle (``abort()`` after too
  many misses), ``init(prefill_dp_rank)``, poll to WaitingForInput, ``send_metadata(page_indices, aux_index,
  state_indices)``, poll to Success/Failed; prefill ``sender(mgr, addr, room)``, poll to
  WaitingForInput, ``init(num_pages, aux_index)``, then per scheduler chunk the segments of
  ``compute_grid_segments(..., sender.get_max_transfer_tokens())`` with
  ``kv_to_page_indices`` and ``send(page_indices, state_indices on the last, num_kv_tokens)``,
  poll to Success.

Stand-ins (each needs a GPU or a model config, none moves a byte differently):
* STAND-IN hybrid pool: sglang's own ``MambaPool`` (``Mamba2StateShape.create``, conv groups
  ``[x | B | C]``) and ``MHATokenToKVPool`` side by side instead of the ``HybridLinearKVPool``
  that wraps them; the ``KVArgs`` state fields come from that ``MambaPool``'s methods through
  sglang's ``append_state_component``, as ``setup_state_kv_args`` does for a hybrid pool;
* STAND-IN runtime context: ``ServerArgs`` comes from sglang's own parser
  (``prepare_server_args``, with ``--disaggregation-transfer-backend kvstage``); publishing it
  needs a model config, so each rank stamps sglang's ``ParallelContext``
  (``get_parallel().override_permanently``, which checks the names) with its ranks as the
  launcher's publish would, and the manager reads them from ``get_parallel()``; the
  kill scenario stamps nothing (the manager then reads ``ServerArgs`` and ``KVArgs``);
* STAND-IN model: ``--model-path`` is a directory with only a ``config.json`` (Llama-shaped,
  ``Model.kv_heads`` KV heads of ``HEAD_DIM``): the decode manager reads its KV head count from it
  through sglang's ``ModelConfig``, as sglang's decode leaves ``KVArgs.kv_head_num`` unset;
* STAND-IN stuck writer (``HeldRoom``): the decode's real room, whose release answers kvstage's
  "pages not free yet" a few times (a stopped same-host prefill mid-copy needs exact timing);
* STAND-IN model forward: the prefill writes a known pattern into its KV pages, rows and slots;
  the decode recomputes the pattern for its own heads and shares (numpy, not kvstage) and
  compares every byte;
* STAND-IN hostile decode (``HOSTILE_CASES``): a real decode rank whose manager's
  ``send_to_prefill`` (the backend's metadata path) lies in one field of the message, or whose
  ``send_metadata`` gets indices outside its own pools.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import List, NamedTuple

# -- the model (tiny, hybrid: attention on 1 and 3, Mamba on 0 and 2) -----------------------------

ATTN_LAYERS = [1, 3]
MAMBA_LAYERS = [0, 2]
ATTN_HEADS, HEAD_DIM = 8, 64
# Mamba2 (sglang's Mamba2StateShape.create): conv channels [x | B | C] = [intermediate,
# n_groups * state, n_groups * state], each sharded across TP on its own (conv_shard_groups);
# intermediate = SSM heads x SSM head dim.
CONV_K = 4
SSM_STATE, SSM_HEAD_DIM = 16, 16
MAX_REQS = 16                         # metadata rows, mamba slots
HIDDEN = 64
MLA_LORA, MLA_ROPE = 64, 32           # MLA latent per token per layer: 96 bf16


class Model(NamedTuple):
    """The head counts that change with the scenario."""

    kv_heads: int = 8
    ssm_heads: int = 8
    mamba_groups: int = 4
    attn_heads: int = ATTN_HEADS

    @property
    def mamba_inter(self) -> int:
        return self.ssm_heads * SSM_HEAD_DIM

    @property
    def conv_groups(self) -> List[int]:
        return [self.mamba_inter, self.mamba_groups * SSM_STATE, self.mamba_groups * SSM_STATE]

    def kv_heads_of(self, rank: int, tp: int) -> List[int]:
        """The global KV heads TP rank ``rank`` of ``tp`` holds: its share, or the one head it
        replicates when there are fewer heads than ranks (sglang: ``max(1, heads // tp)``)."""
        if self.kv_heads >= tp:
            n = self.kv_heads // tp
            return list(range(rank * n, (rank + 1) * n))
        return [rank * self.kv_heads // tp]


HYBRID = Model()
# MQA attention (one KV head, replicated on every rank) beside Mamba state of 6 heads and 6
# groups: shards of 2 heads on TP 3, of 3 on TP 2.
MQA_HYBRID = Model(kv_heads=1, ssm_heads=6, mamba_groups=6)
# The same state beside GQA attention of 6 KV heads (12 query heads): 2 per rank on TP 3, 3 on
# TP 2, so under P3->D2 decode rank 0 takes 2 KV heads from prefill rank 0 and 1 from rank 1.
GQA6_HYBRID = Model(kv_heads=6, ssm_heads=6, mamba_groups=6, attn_heads=12)


def model_dir(model: Model = HYBRID) -> str:
    """A model directory with only the config sglang's ``ModelConfig`` reads (see STAND-IN)."""
    import json
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"kvstage-sglang-model-{os.getuid()}-kv{model.kv_heads}-a{model.attn_heads}")
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": model.attn_heads * (HIDDEN // ATTN_HEADS),
           "num_attention_heads": model.attn_heads, "num_key_value_heads": model.kv_heads, "head_dim": HEAD_DIM,
           "num_hidden_layers": len(ATTN_LAYERS) + len(MAMBA_LAYERS), "intermediate_size": 256,
           "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    tmp = os.path.join(d, f"config.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, os.path.join(d, "config.json"))
    return d


def _u64(x: int) -> int:
    return x & 0xFFFFFFFFFFFFFFFF


# -- the pattern (the stand-in forward) and the reference --------------------------------------------


def kv_pattern(np, room: int, layer: int, kv: int, tokens, heads, dim: int):
    """uint16 [len(tokens), len(heads), dim]: what the prefill's forward writes."""
    t = np.asarray(tokens, dtype=np.uint64)[:, None, None]
    h = np.asarray(heads, dtype=np.uint64)[None, :, None]
    e = np.arange(dim, dtype=np.uint64)[None, None, :]
    seed = np.uint64(_u64(room * 0x9E3779B97F4A7C15 + layer * 0x100000001B3 + kv * 0xC2B2AE3D27D4EB4F))
    x = seed ^ (t * np.uint64(0x9E3779B1)) ^ (h * np.uint64(0x85EBCA77)) ^ (e * np.uint64(0x27D4EB2F))
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return (x & np.uint64(0xFFFF)).astype(np.uint16)


def byte_pattern(np, room: int, what: int, n: int):
    i = np.arange(n, dtype=np.uint64)
    x = np.uint64(_u64(room * 0x9E3779B97F4A7C15 + what * 0x100000001B3)) + i * np.uint64(0x9E3779B1)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def conv_global(np, room: int, layer: int, model: Model):
    """uint8 view of the conv state [conv_dim, K-1] bf16 of one request, all TP ranks together."""
    dim = sum(model.conv_groups)
    return byte_pattern(np, room, 1000 + layer, dim * (CONV_K - 1) * 2).reshape(dim, (CONV_K - 1) * 2)


def conv_share(np, glob, rank: int, tp: int, model: Model):
    """Rank ``rank`` of ``tp``'s conv channels: its share of each of key, key, value."""
    parts, at = [], 0
    for g in model.conv_groups:
        n = g // tp
        parts.append(glob[at + rank * n: at + (rank + 1) * n])
        at += g
    return np.concatenate(parts)


def ssm_global(np, room: int, layer: int, model: Model):
    """uint8 view of the SSM state [heads, head_dim x state] fp32 of one request, all TP ranks."""
    n = model.ssm_heads
    return byte_pattern(np, room, 2000 + layer, n * SSM_HEAD_DIM * SSM_STATE * 4).reshape(n, SSM_HEAD_DIM * SSM_STATE * 4)


def ssm_share(np, glob, rank: int, tp: int):
    """Rank ``rank`` of ``tp``'s SSM heads."""
    n = glob.shape[0] // tp
    return glob[rank * n: (rank + 1) * n]


def mamba_pool(model: Model, tp: int):
    """sglang's own MambaPool (as a HybridLinearKVPool holds it), Mamba2-shaped for ``tp``."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=model.mamba_inter, n_groups=model.mamba_groups, num_heads=model.ssm_heads,
        head_dim=SSM_HEAD_DIM, state_size=SSM_STATE, conv_kernel=CONV_K, conv_shard_groups=model.conv_groups,
    )
    return MambaPool(size=MAX_REQS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS),
                     mamba_layer_ids=MAMBA_LAYERS, device="cpu")


def set_state_args(args, pool) -> None:
    """``KVArgs``' state fields as setup_state_kv_args' HybridLinearKVPool branch fills them, on the
    MambaPool it delegates to (``pool``; None: no state)."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    for field in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor",
                  "state_slice_outer_counts", "state_layer_ids", "state_conv_shard_groups"):
        setattr(args, field, [])
    if pool is not None:
        append_state_component(args, StateType.MAMBA, *pool.get_contiguous_buf_infos(), pool.get_state_dim_per_tensor(),
                               pool.get_state_conv_shard_groups(), pool.get_state_slice_outer_counts(), pool.get_state_layer_ids())


# -- one rank ---------------------------------------------------------------------------------------------


class Rank:
    """One sglang rank's pools and the backend's manager, built the way sglang builds them."""

    def __init__(self, mode: str, tp: int, rank: int, page: int, capacity_tokens: int, bootstrap_port: int, mla: bool = False,
                 stamp_parallel: bool = True, dp: int = 1, model: Model = HYBRID):
        """``tp``: attention TP (per DP group); ``rank``: the scheduler's TP rank (global, as
        sglang passes it in ``KVArgs.engine_rank``); ``dp``: attention DP groups."""
        import numpy as np
        import torch
        from sglang.srt.plugins import load_plugins

        load_plugins()  # sglang's own plugin loading: registers kvstage through its entry point
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
            get_kv_transfer_buf_infos,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        self.np, self.torch = np, torch
        self.mode, self.tp, self.page, self.mla, self.model = mode, tp, page, mla, model
        self.rank, self.dp_rank, self.dp = rank % tp, rank // tp, dp  # attention TP rank, DP group
        backend = TransferBackend("kvstage")
        if mla:  # DeepSeek-shaped latent: kv_lora_rank 64 + rope 32, one "head" on every rank
            self.kv_pool = MLATokenToKVPool(
                size=capacity_tokens, page_size=page, dtype=torch.bfloat16, kv_lora_rank=MLA_LORA,
                qk_rope_head_dim=MLA_ROPE, layer_num=len(ATTN_LAYERS), device="cpu", enable_memory_saver=False,
            )
        else:
            self.kv_pool = MHATokenToKVPool(
                size=capacity_tokens, page_size=page, dtype=torch.bfloat16, head_num=max(1, model.kv_heads // tp),
                head_dim=HEAD_DIM, layer_num=len(ATTN_LAYERS), device="cpu", enable_memory_saver=False,
                enable_alt_stream=False,
            )
        self.meta = MetadataBuffers(size=MAX_REQS, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
                                    max_sampling_mask_tokens=4, max_top_logprobs_num=8)
        self.mamba_pool = mamba_pool(model, tp)
        self.conv = self.mamba_pool.mamba_cache.conv[0]   # [layers, slots+1, conv_dim/tp, K-1] bf16
        self.ssm = self.mamba_pool.mamba_cache.temporal   # [layers, slots+1, heads/tp, head_dim, state] fp32
        assert tuple(self.conv.shape[2:]) == (sum(model.conv_groups) // tp, CONV_K - 1), self.conv.shape
        assert tuple(self.ssm.shape[2:]) == (model.ssm_heads // tp, SSM_HEAD_DIM, SSM_STATE), self.ssm.shape

        args = get_kv_class(backend, KVClassType.KVARGS)()
        args.engine_rank = rank
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.kv_cache_dtype_str = "bfloat16"
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(self.kv_pool)
        args.num_draft_entries = 0
        args.kv_layer_ids = list(ATTN_LAYERS) * (1 if mla else 2)  # build_kv_layer_ids for a hybrid model (K then V)
        if not mla and mode == "prefill":  # prefill.py sets these for MHA; decode.py does not
            args.kv_head_num = self.kv_pool.head_num
            args.total_kv_head_num = model.kv_heads
        args.page_size = page
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.ib_device = None
        args.gpu_id = 0
        args.prefill_start_layer = 0
        # MLA with a TP change and sharded state is refused (README): KV and aux rows only.
        set_state_args(args, None if mla else self.mamba_pool)
        args.is_hybrid_mla_backend = False
        self.kv_args = args
        # sglang's own ServerArgs from its own command line parser (the runtime context a
        # launched server publishes is not: the manager reads these fields then).
        from sglang.srt.server_args import prepare_server_args

        server_args = prepare_server_args([
            "--model-path", model_dir(model), "--tp-size", str(tp * dp), "--host", "127.0.0.1",
            *(["--attn-dp-size", str(dp)] if dp > 1 else []),
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "kvstage",
            "--disaggregation-bootstrap-port", str(bootstrap_port), "--page-size", str(page),
        ])
        if stamp_parallel:
            # What sglang's launcher records for each scheduler process (publish's rank bundle):
            # the manager reads its place from get_parallel(), as in a launched server.
            from sglang.srt.runtime_context import get_parallel

            get_parallel().override_permanently(
                tp_size=tp * dp, tp_rank=rank, attn_tp_size=tp, attn_tp_rank=self.rank, attn_cp_size=1, attn_cp_rank=0,
                attn_dp_size=dp, attn_dp_rank=self.dp_rank, pp_size=1, pp_rank=0, dp_size=1,  # dp_size: replicas
                load_balance_method="follow_bootstrap_room",
            )
        dmode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
        self.mgr = get_kv_class(backend, KVClassType.MANAGER)(args, dmode, server_args, mla)
        self.Sender = get_kv_class(backend, KVClassType.SENDER)
        self.Receiver = get_kv_class(backend, KVClassType.RECEIVER)
        self.free_pages = list(range(1, capacity_tokens // page + 1))  # page 0: sglang's padding page
        self.free_rows = list(range(MAX_REQS))
        self.free_slots = list(range(MAX_REQS))

    def alloc(self, tokens: int, rng):
        n = -(-tokens // self.page)
        assert len(self.free_pages) >= n, "test pool too small"
        idx = rng.choice(len(self.free_pages), n, replace=False)
        pages = [self.free_pages[i] for i in idx]
        for p in pages:
            self.free_pages.remove(p)
        row, slot = self.free_rows.pop(0), self.free_slots.pop(0)
        np = self.np
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * self.page + np.arange(self.page)[None, :]).reshape(-1)[:tokens]
        return dict(pages=pages, row=row, slot=slot, req_to_token=self.torch.from_numpy(slots.copy()))

    def free(self, a) -> None:
        self.free_pages.extend(a["pages"])
        self.free_rows.append(a["row"])
        self.free_slots.append(a["slot"])

    def kv_buffers(self):
        if self.mla:
            return [(li, layer, [(0, self.kv_pool.kv_buffer[li])]) for li, layer in enumerate(ATTN_LAYERS)]
        return [(li, layer, [(0, self.kv_pool.k_buffer[li]), (1, self.kv_pool.v_buffer[li])]) for li, layer in enumerate(ATTN_LAYERS)]

    def head_dim(self):
        return MLA_LORA + MLA_ROPE if self.mla else HEAD_DIM

    def my_heads(self):
        if self.mla:
            return [0]
        return self.model.kv_heads_of(self.rank, self.tp)

    # -- the stand-in forward ------------------------------------------------------------------

    def write_request(self, room: int, tokens: int, a) -> None:
        np = self.np
        slots = a["req_to_token"].numpy()
        for li, layer, bufs in self.kv_buffers():
            for kv, buf in bufs:
                view = buf.view(self.torch.int16).numpy().view(np.uint16)
                view[slots] = kv_pattern(np, room, layer, kv, range(tokens), self.my_heads(), self.head_dim())
        for b, buf in enumerate(self.meta_bufs()):
            row = buf[a["row"]]
            row.view(np.uint8)[...] = byte_pattern(np, room, b, row.nbytes).reshape(row.view(np.uint8).shape)
        for i, layer in enumerate([] if self.mla else MAMBA_LAYERS):
            conv = self.conv[i, a["slot"]].view(self.torch.int16).numpy().view(np.uint8)
            conv[...] = conv_share(np, conv_global(np, room, layer, self.model), self.rank, self.tp, self.model).reshape(conv.shape)
            ssm = self.ssm[i, a["slot"]].view(self.torch.int32).numpy().view(np.uint8)
            ssm[...] = ssm_share(np, ssm_global(np, room, layer, self.model), self.rank, self.tp).reshape(ssm.shape)

    def meta_bufs(self):
        bufs = []
        for name in ("output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
                     "output_top_logprobs_val", "output_top_logprobs_idx", "output_token_sampling_mask_len",
                     "output_token_sampling_mask_idx", "output_token_sampling_logprobs", "output_topk_p",
                     "output_topk_index", "output_hidden_states", "output_dsa_topk_indices", "bootstrap_room",
                     "kv_checksum"):
            t = getattr(self.meta, name, None)
            if t is not None:
                bufs.append(t.view(self.torch.uint8).numpy() if t.dtype != self.torch.uint8 else t.numpy())
        ptrs = [b.ctypes.data for b in bufs]
        assert ptrs == list(self.kv_args.aux_data_ptrs), "metadata buffer order differs from get_buf_infos"
        return bufs

    def check_request(self, room: int, tokens: int, a, first: int = 0) -> str:
        """'' if every byte of the request on this decode rank (its tokens from ``first``: a
        cached prefix before) is the reference's, else what differs."""
        np = self.np
        slots = a["req_to_token"].numpy()
        for li, layer, bufs in self.kv_buffers():
            for kv, buf in bufs:
                got = buf.view(self.torch.int16).numpy().view(np.uint16)[slots]
                want = kv_pattern(np, room, layer, kv, range(first, tokens), self.my_heads(), self.head_dim())
                if not np.array_equal(got, want):
                    bad = np.argwhere(got != want)[0]
                    return f"KV layer {layer} {'KV'[kv]} token {bad[0]} head {self.my_heads()[bad[1]]} differs"
        for b, buf in enumerate(self.meta_bufs()):
            row = buf[a["row"]]
            if not np.array_equal(row.reshape(-1), byte_pattern(np, room, b, row.nbytes)):
                return f"metadata buffer {b} row differs"
        for i, layer in enumerate([] if self.mla else MAMBA_LAYERS):
            conv = self.conv[i, a["slot"]].view(self.torch.int16).numpy().view(np.uint8)
            want = conv_share(np, conv_global(np, room, layer, self.model), self.rank, self.tp, self.model).reshape(conv.shape)
            if not np.array_equal(conv, want):
                return f"conv state layer {layer} differs"
            ssm = self.ssm[i, a["slot"]].view(self.torch.int32).numpy().view(np.uint8)
            want = ssm_share(np, ssm_global(np, room, layer, self.model), self.rank, self.tp).reshape(ssm.shape)
            if not np.array_equal(ssm, want):
                return f"SSM state layer {layer} differs"
        return ""


# -- the scheduler loops ---------------------------------------------------------------------------------


def serve_prefill(r, cfg, requests, rng, out=None, landed=None):
    """The prefill scheduler's loop over ``requests`` ((room, tokens)), all in flight at once, until
    each ended or ``cfg["deadline_s"]``: room -> (state, reason). An exception out of a backend
    call ends that request as "Escaped" (with its traceback); the others go on."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.staging_buffer import compute_grid_segments
    from sglang.srt.mem_cache.common import kv_to_page_indices, kv_to_page_num

    np = r.np
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    reqs = {room: dict(tokens=tokens, sender=r.Sender(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=room,
                                                      req_has_disagg_prefill_dp_rank=False), state="bootstrap")
            for room, tokens in requests}
    die_after = cfg.get("die_after_sends")
    sends = 0
    results = {}
    deadline = time.monotonic() + cfg["deadline_s"]
    cps = cfg["chunked_prefill_size"]
    while len(results) < len(reqs) and time.monotonic() < deadline:
        for room, q in reqs.items():
            if room in results:
                continue
            s = q["sender"]
            try:
                poll = s.poll()
                if q["state"] == "bootstrap":
                    if poll == KVPoll.Failed:
                        results[room] = ("Failed", _exc_text(s))
                    elif poll == KVPoll.WaitingForInput:
                        # finalize_bootstrap: the metadata row, then init(num_pages, row)
                        a = r.alloc(q["tokens"], rng)
                        q["alloc"] = a
                        prefix = s.pop_decode_prefix_len()
                        s.init(kv_to_page_num(q["tokens"] - prefix, r.page), a["row"])
                        # the forward, then send_kv_chunk per scheduler chunk
                        r.write_request(room, q["tokens"], a)
                        chunk_start = 0  # the scheduler's chunked prefill runs from token 0;
                        # A room in empty_last_rooms gets all its tokens in non-last sends and then
                        # a last send_kv_chunk with nothing new (start == end: compute_grid_segments'
                        # one empty segment), as prefill.py does when the last call has no new KV.
                        empty_last = room in cfg.get("empty_last_rooms", ())
                        while chunk_start < q["tokens"] or (empty_last and chunk_start == q["tokens"] and not q.get("ended")):
                            end = min(chunk_start + cps, q["tokens"])
                            last = end == q["tokens"] and (not empty_last or end == chunk_start)
                            q["ended"] = last
                            start = max(chunk_start, prefix)
                            chunk_start = end
                            if start >= end and not last:
                                continue  # a chunk the decode side already caches
                            state_indices = ([] if r.mla else [[np.array([a["slot"]], dtype=np.int64)]]) if last else None
                            grid = s.get_max_transfer_tokens()
                            segs = compute_grid_segments(start, end, prefix, grid) if grid is not None else [(start, end)]
                            for seg_start, seg_end in segs:
                                kv_indices = a["req_to_token"][seg_start:seg_end]
                                page_indices = kv_to_page_indices(kv_indices, r.page)
                                seg_last = last and seg_end == end
                                if not s.should_send_kv_chunk(len(page_indices), seg_last):
                                    continue
                                s.send(page_indices, state_indices if seg_last else None, num_kv_tokens=seg_end - seg_start)
                                sends += 1
                                if die_after is not None and sends >= die_after:
                                    # Die mid-request once the decode saw a chunk land (its poll said
                                    # Transferring): the room is known to be in flight.
                                    if landed is not None and not landed.wait(cfg["deadline_s"]):
                                        out.put(("error", f"prefill {r.rank}", "the decode never saw a chunk land"))
                                        os._exit(18)
                                    out.put(("dying", r.rank))
                                    os._exit(17)
                        q["state"] = "inflight"
                elif poll == KVPoll.Success:
                    results[room] = ("Success", "")
                    s.clear()
                    r.free(q["alloc"])
                elif poll == KVPoll.Failed:
                    results[room] = ("Failed", _exc_text(s))
            except Exception:  # noqa: BLE001 - what escaped into the scheduler's call
                results[room] = ("Escaped", traceback.format_exc())
        time.sleep(0.002)
    for room in reqs:
        results.setdefault(room, ("Timeout", "prefill loop deadline"))
    return results


def prefill_worker(cfg, rank, out, landed=None, done=None):
    """``done``: the driver's event that every rank reported; the rank serves (its metadata
    socket, failure notices to the decode ranks) until then, else ``linger_s`` after its report."""
    try:
        os.environ.update(cfg.get("env", {}))
        dp = cfg.get("prefill_dp", 1)
        r = Rank("prefill", cfg["prefill_tp"], rank, cfg["prefill_page"], cfg["prefill_capacity"], cfg["bootstrap_port"], cfg.get("mla", False),
                 cfg.get("stamp_parallel", True), dp, cfg.get("model", HYBRID))
        out.put(("registered", rank))
        # With attention DP, a request runs on one DP group: room % dp (follow_bootstrap_room).
        mine = [(room, tokens) for room, tokens in cfg["requests"] if room % dp == r.dp_rank]
        results = serve_prefill(r, cfg, mine, r.np.random.default_rng(1000 + rank), out, landed)
        out.put(("prefill", rank, results, f"{r.mgr.local_ip}:{r.mgr.rank_port}"))
        if done is not None:
            done.wait(cfg["deadline_s"])
        else:
            time.sleep(cfg.get("linger_s", 0.5))
        r.mgr.close()
    except BaseException:
        out.put(("error", f"prefill {rank}", traceback.format_exc()))


def _exc_text(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as e:  # noqa: BLE001 - we report whatever it raised
        return f"{type(e).__name__}: {e}"
    return "failure_exception() raised nothing"


def send_metadata(r, recv, page_indices, row, state_indices, prefix) -> None:
    """decode.py's pre-allocation call: the request's pages, metadata row and state slots."""
    recv.send_metadata(page_indices, row, state_indices, decode_prefix_len=prefix)


def serve_decode(r, cfg, wave, rng, landed=None, send=send_metadata, until=None):
    """The decode scheduler's loop over ``wave`` ((room, tokens)), all in flight at once, until
    each ended or ``cfg["deadline_s"]`` (or, given ``until``, one pass after it is set: the
    requests still open then are aborted): room -> (state, reason, seconds, polls, registry call
    seconds). A Success is checked byte for byte ("Corrupt" else)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.mem_cache.common import kv_to_page_indices

    np = r.np
    addr = cfg.get("bootstrap_addr") or f"127.0.0.1:{cfg['bootstrap_port']}"
    results = {}
    reqs = {}
    for room, tokens in wave:  # decode.py _create_receiver_and_enqueue
        recv = r.Receiver(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=room)
        reqs[room] = dict(tokens=tokens, recv=recv, state="bootstrap", t0=time.monotonic(), polls=[int(recv.poll())])
    # decode.py _ensure_prefill_info: one try_ensure_parallel_info per cycle and server,
    # the server's requests aborted after too many failed cycles (sglang: 15 of 1s).
    ensure_s = []  # how long each try_ensure_parallel_info held the scheduler loop
    for attempt in range(cfg.get("max_ensure_retries", 15)):
        t_call = time.monotonic()
        ok = r.mgr.try_ensure_parallel_info(addr)
        ensure_s.append(time.monotonic() - t_call)
        if ok:
            info = r.mgr.prefill_info_table[addr]
            for room, q in reqs.items():  # _resolve_prefill_dp_rank, then _init_receiver
                q["recv"].init(0 if info.dp_size == 1 else room % info.dp_size)
            break
        time.sleep(cfg.get("ensure_retry_interval_s", 1.0))
    else:
        for q in reqs.values():
            q["recv"].abort()
    deadline = time.monotonic() + cfg["deadline_s"]
    while any(room not in results for room in reqs) and time.monotonic() < deadline:
        last_pass = until is not None and until.is_set()
        for room, q in reqs.items():
            if room in results:
                continue
            recv = q["recv"]
            poll = recv.poll()
            if not q["polls"] or q["polls"][-1] != int(poll):
                q["polls"].append(int(poll))
            if landed is not None and poll == KVPoll.Transferring:
                landed.set()
            if poll == KVPoll.Failed:
                results[room] = ("Failed", _exc_text(recv), time.monotonic() - q["t0"], q["polls"], ensure_s)
                recv.clear()
                if "alloc" in q:
                    r.free(q["alloc"])
            elif q["state"] == "bootstrap" and poll == KVPoll.WaitingForInput:
                # pre-allocation: pages (after a cached prefix, whole decode pages), row, slot
                prefix = cfg.get("decode_prefix", 0) if q["tokens"] > cfg.get("decode_prefix", 0) else 0
                q["prefix"] = prefix
                a = r.alloc(q["tokens"] - prefix, rng)
                q["alloc"] = a
                page_indices = kv_to_page_indices(a["req_to_token"], r.page)
                send(r, recv, page_indices, a["row"], [] if r.mla else [[np.array([a["slot"]], dtype=np.int64)]], prefix)
                q["state"] = "transfer"
                if room in cfg.get("abort_rooms", ()):
                    recv.abort()  # the request was aborted on the decode side
            elif poll == KVPoll.Success:
                err = r.check_request(room, q["tokens"], q["alloc"], q.get("prefix", 0))
                results[room] = ("Success" if not err else "Corrupt", err, time.monotonic() - q["t0"], q["polls"], ensure_s)
                recv.clear()
                r.free(q["alloc"])
        if last_pass:
            break
        time.sleep(0.002)
    for room, q in reqs.items():
        if room not in results and until is not None and until.is_set():
            q["recv"].abort()
            q["recv"].clear()
            results[room] = ("Open", f"still {q['polls'][-1]} when the prefill side ended; aborted", time.monotonic() - q["t0"], q["polls"], ensure_s)
            if "alloc" in q:
                r.free(q["alloc"])
        results.setdefault(room, ("Timeout", f"still {q['polls'][-1] if q['polls'] else '?'} after {cfg['deadline_s']}s", time.monotonic() - q["t0"], q["polls"], ensure_s))
    return results


def decode_worker(cfg, rank, out, go=None, landed=None):
    try:
        os.environ.update(cfg.get("env", {}))
        r = Rank("decode", cfg["decode_tp"], rank, cfg["decode_page"], cfg["decode_capacity"], cfg["bootstrap_port"], cfg.get("mla", False),
                 cfg.get("stamp_parallel", True), model=cfg.get("model", HYBRID))
        rng = r.np.random.default_rng(2000 + rank)
        results = {}
        waves = cfg.get("waves") or [cfg["requests"]]
        for w, wave in enumerate(waves):
            if w and go is not None:
                go.wait(cfg["deadline_s"])
            results.update(serve_decode(r, cfg, wave, rng, landed))
            out.put(("wave", rank, w))
        out.put(("decode", rank, results, r.mgr.address))
        time.sleep(cfg.get("linger_s", 0.5) + 0.5)  # the prefill ranks close their sessions first
        r.mgr.close()
    except BaseException:
        out.put(("error", f"decode {rank}", traceback.format_exc()))


# -- scenarios (in the driver process) ---------------------------------------------------------------


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_bootstrap(port: int):
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as sglang's launcher does before it starts the bootstrap server
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    cls = get_kv_class(TransferBackend("kvstage"), KVClassType.BOOTSTRAP_SERVER)
    server = cls(host="127.0.0.1", port=port)
    import requests

    for _ in range(100):
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except requests.RequestException:
            time.sleep(0.05)
    raise RuntimeError("bootstrap server did not come up")


def collect(out, n_expected, kinds, deadline_s):
    got, errors = [], []
    end = time.monotonic() + deadline_s
    while len(got) < n_expected and time.monotonic() < end:
        try:
            msg = out.get(timeout=0.5)
        except queue_mod.Empty:
            continue
        if msg[0] == "error":
            errors.append(f"{msg[1]}: {msg[2]}")
            n_expected -= 1
        elif msg[0] in kinds:
            got.append(msg)
    return got, errors


def stop(procs):
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(ctx, cfg, n_prefill, n_decode, collect_s):
    """Starts ``cfg``'s prefill and decode ranks, collects their reports (bounded by
    ``collect_s``) and stops them. The prefill ranks serve until every rank reported: a decode
    rank's metadata may arrive after the prefill ranks' own requests ended (refused ones)."""
    out = ctx.Queue()
    done = ctx.Event()
    procs = [ctx.Process(target=prefill_worker, args=(cfg, r, out, None, done)) for r in range(n_prefill)]
    procs += [ctx.Process(target=decode_worker, args=(cfg, r, out)) for r in range(n_decode)]
    for p in procs:
        p.start()
    got, errors = collect(out, n_prefill + n_decode, ("prefill", "decode"), collect_s)
    done.set()
    stop(procs)
    return got, errors


def scenario_transfer(ctx, prefill_tp, decode_tp, mla=False, transport=None, decode_prefix=0, prefill_dp=1, host_ip=None,
                      empty_last=False):
    """``host_ip``: every rank's SGLANG_HOST_IP (what sglang's get_local_ip_auto answers), an
    address other than the HTTP ``--host`` 127.0.0.1: the ranks must register and listen there.
    ``empty_last``: the 640-token request (5 grid chunks) ends with a pageless last send."""
    port = free_port()
    server = start_bootstrap(port)
    rooms = [(_u64(0xA000_0000_0000 + 7919 * i + prefill_tp * 100 + decode_tp), tokens)
             for i, tokens in enumerate([37, 128, 129, 200, 333, 511, 640, 700])]  # 8 in flight
    env = {"KVSTAGE_SGLANG_CHUNK_TOKENS": "128"}
    if transport:
        env["KVSTAGE_SGLANG_TRANSPORT"] = transport
    if host_ip:
        env["SGLANG_HOST_IP"] = host_ip
    cfg = dict(
        prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_page=16, decode_page=32,
        prefill_capacity=16 * 512, decode_capacity=32 * 256, bootstrap_port=port, requests=rooms,
        chunked_prefill_size=192, deadline_s=90, mla=mla, decode_prefix=decode_prefix, prefill_dp=prefill_dp,
        empty_last_rooms=[room for room, tokens in rooms if tokens == 640] if empty_last else [], env=env,
    )
    n_prefill = prefill_tp * prefill_dp
    t0 = time.monotonic()
    got, errors = run_ranks(ctx, cfg, n_prefill, decode_tp, 150)
    problems = list(errors)
    if host_ip:
        # What the registry hands the decode (sglang's GET /route) and where each rank listens.
        import requests

        for tp in range(prefill_tp):
            r = requests.get(f"http://127.0.0.1:{port}/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                                         "target_tp_rank": tp, "target_pp_rank": 0}, timeout=5)
            if r.status_code != 200 or r.json().get("rank_ip") != host_ip:
                problems.append(f"prefill rank {tp} registered rank_ip {r.text.strip()[:120]}, not {host_ip}")
        for kind, rank, _results, where in got:
            if not where.startswith(host_ip + ":"):
                problems.append(f"{kind} rank {rank} listens at {where}, not on {host_ip}")
    server.close() if hasattr(server, "close") else None
    n_bytes_checked = 0
    slowest = 0.0
    for kind, rank, results, _where in got:
        for room, res in results.items():
            if res[0] != "Success":
                problems.append(f"{kind} {rank} room {room:x}: {res[0]} {res[1]}")
            elif kind == "decode":
                n_bytes_checked += 1
                slowest = max(slowest, res[2])
    if len(got) < n_prefill + decode_tp and not errors:
        problems.append(f"only {len(got)} of {n_prefill + decode_tp} ranks reported")
    if problems:
        raise AssertionError("; ".join(problems[:6]))
    extra = f"; ranks registered and listening on SGLANG_HOST_IP {host_ip}, not --host 127.0.0.1" if host_ip else ""
    extra += "; the 640-token request ended with a pageless last send" if empty_last else ""
    return f"{len(rooms)} requests in flight, {n_bytes_checked} decode (rank, request) pairs byte-exact, slowest request {slowest:.1f}s from receiver.init to Success, {time.monotonic() - t0:.1f}s with process start-up{extra}"


def state_slot_reference(np, kind: str, room: int, layer: int, rank: int, tp: int, model: Model):
    """The reference bytes of one request's ``kind`` ("conv" or "ssm") slot of ``layer`` on TP rank
    ``rank`` of ``tp``, from the global channel/head index (what Rank.write_request writes)."""
    if kind == "conv":
        return conv_share(np, conv_global(np, room, layer, model), rank, tp, model).reshape(-1)
    return ssm_share(np, ssm_global(np, room, layer, model), rank, tp).reshape(-1)


def state_args(model: Model, tp: int):
    """``KVArgs`` with only the state fields, from sglang's own MambaPool for ``tp``."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    args = KVArgs()
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    pool = mamba_pool(model, tp)
    set_state_args(args, pool)
    return args, pool


def state_plan_problems(model: Model, prefill_tp: int, decode_tp: int) -> list:
    """Each decode rank's conv and SSM slots assembled from the prefill ranks' reference slots by
    kvstage's state plan (``kvstage.state_slice``) for the state components as the backend
    describes them (``components_from_args`` on sglang's KVArgs state fields), compared byte for
    byte with the reference: what differs (empty: all equal)."""
    import numpy as np

    import kvstage
    from kvstage.sglang.pools import components_from_args

    comps = {}
    for tp in (prefill_tp, decode_tp):
        args, _pool = state_args(model, tp)
        comps[tp] = components_from_args(args, tp)[0]
    problems = []
    room = 0x5747_E000
    # sglang's MambaPool lists the conv tensors, then the temporal (SSM) ones: one component each.
    for c, kind in enumerate(("conv", "ssm")):
        src_c, dst_c = comps[prefill_tp][c], comps[decode_tp][c]
        if list(src_c.group_dims) != list(dst_c.group_dims):  # the handshake would refuse the pair
            problems.append(f"{kind}: group dims {list(src_c.group_dims)} (TP {prefill_tp}) != {list(dst_c.group_dims)} (TP {decode_tp})")
            continue
        for layer in MAMBA_LAYERS:
            for d in range(decode_tp):
                want = state_slot_reference(np, kind, room, layer, d, decode_tp, model)
                got, written = np.zeros_like(want), np.zeros(want.size, dtype=bool)
                for p_ in range(prefill_tp):
                    src = state_slot_reference(np, kind, room, layer, p_, prefill_tp, model)
                    for r in kvstage.state_slice(src_c.group_dims, prefill_tp, decode_tp, p_, d, outer=src_c.outer,
                                                 dtype_bytes=src_c.dtype_bytes, replicated=src_c.replicated):
                        got[r.dst_offset:r.dst_offset + r.length] = src[r.src_offset:r.src_offset + r.length]
                        written[r.dst_offset:r.dst_offset + r.length] = True
                if not written.all():
                    problems.append(f"{kind} layer {layer} decode rank {d}: {int((~written).sum())} of {want.size} bytes written by no prefill rank")
                elif not np.array_equal(got, want):
                    problems.append(f"{kind} layer {layer} decode rank {d}: byte {int(np.argmax(got != want))} differs from the reference")
    return problems


def sglang_state_slicing_defects(model: Model, prefill_tp: int, decode_tp: int) -> list:
    """What sglang's own state slicing (``compute_mamba_state_slice_byte_blocks``, with the
    arguments mooncake's ``_send_mamba_state_slice`` passes from KVArgs) does wrong for this TP
    pair whichever prefill ranks it pairs a decode rank with: decode slot bytes no prefill rank
    writes, or blocks that read past the prefill rank's slot."""
    import numpy as np
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    (src, _p), (dst, _d) = state_args(model, prefill_tp), state_args(model, decode_tp)
    defects = []
    for i in range(len(src.state_item_lens[0])):
        kind = "conv" if src.state_conv_shard_groups[0][i] else "ssm"
        src_len, dst_len = src.state_item_lens[0][i], dst.state_item_lens[0][i]
        for d in range(decode_tp):
            covered = np.zeros(dst_len, dtype=bool)
            for p_ in range(prefill_tp):
                blocks = compute_mamba_state_slice_byte_blocks(
                    src_item_len=src_len, dst_item_len=dst_len, src_dim=src.state_dim_per_tensor[0][i],
                    dst_dim=dst.state_dim_per_tensor[0][i], outer_count=src.state_slice_outer_counts[0][i],
                    src_attn_tp_size=prefill_tp, dst_attn_tp_size=decode_tp, dst_tp_rank_in_group=d,
                    local_tp_rank_in_group=p_, conv_shard_groups=src.state_conv_shard_groups[0][i] or None,
                )
                for so, do, n in blocks:
                    if so + n > src_len:
                        defects.append(f"{kind} tensor {i} to decode rank {d}: reads bytes [{so}, {so + n}) of a {src_len}-byte prefill slot")
                    covered[do:do + n] = True
            if not covered.all():
                defects.append(f"{kind} tensor {i}: {int((~covered).sum())} of {dst_len} bytes of decode rank {d}'s slot written by no prefill rank")
    return defects


def scenario_state_non_dividing_tp(ctx, prefill_tp, decode_tp, model=MQA_HYBRID):
    """Issue 42: state under a TP pair where neither size divides the other. Attention of
    ``model``'s KV heads (MQA: one, replicated on every rank; GQA6: six, so a decode rank's head
    groups differ in size) beside Mamba2 state sharded over 6 heads and 6 groups, with aux rows. Checked: (1) kvstage's state plan for the components as the backend describes them
    assembles every decode conv/SSM byte as the reference; (2) sglang's own slicing cannot; (3)
    end to end through the backend: every request succeeds on every rank and every decode byte (KV,
    aux rows, state) equals the reference."""
    plan = state_plan_problems(model, prefill_tp, decode_tp)
    if plan:
        raise AssertionError("kvstage's state plan vs the reference: " + "; ".join(plan[:4]))
    sglang_wrong = sglang_state_slicing_defects(model, prefill_tp, decode_tp)
    if not sglang_wrong:
        raise AssertionError("sglang's own state slicing gives every reference byte for this pair: the scenario shows nothing")
    port = free_port()
    server = start_bootstrap(port)
    rooms = [(_u64(0x42_0000_0000 + 7919 * i + prefill_tp * 100 + decode_tp), tokens) for i, tokens in enumerate([37, 200, 333, 700])]
    cfg = dict(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_page=16, decode_page=32, prefill_capacity=16 * 512,
               decode_capacity=32 * 256, bootstrap_port=port, requests=rooms, chunked_prefill_size=192, deadline_s=60,
               model=model, env={"KVSTAGE_SGLANG_CHUNK_TOKENS": "128"})
    got, errors = run_ranks(ctx, cfg, prefill_tp, decode_tp, 120)
    server.close()
    if errors:
        raise AssertionError("; ".join(errors))
    if len(got) < prefill_tp + decode_tp:
        raise AssertionError(f"only {len(got)} of {prefill_tp + decode_tp} ranks reported")
    outcomes = [(kind, rank, room, res) for kind, rank, results, _where in got for room, res in results.items()]
    bad = [f"{kind} {rank} room {room:x}: {res[0]} {res[1][:200]}" for kind, rank, room, res in outcomes if res[0] != "Success"]
    if bad:
        raise AssertionError("; ".join(bad[:6]))
    n = sum(1 for kind, *_ in outcomes if kind == "decode")
    return (f"{n} decode (rank, request) pairs byte-exact (KV, aux rows, conv and SSM state); kvstage's state plan "
            f"byte-exact for every decode conv/SSM slot; sglang's own slicing: {sglang_wrong[0]} ({len(sglang_wrong)} defects)")


def scenario_prefill_killed(ctx):
    port = free_port()
    server = start_bootstrap(port)
    doomed, survivor = (_u64(0xDEAD_0000_0001), 700), (_u64(0xBEEF_0000_0002), 300)
    # Every timeout that could end the doomed request bounded well inside the deadline, so a
    # slow machine still ends it in time: the dead peer (3 s), the room (20 s), the bootstrap.
    env = {"KVSTAGE_SGLANG_CHUNK_TOKENS": "128", "KVSTAGE_SGLANG_DEAD_PEER_TIMEOUT_MS": "3000",
           "KVSTAGE_SGLANG_WAITING_TIMEOUT_S": "20", "KVSTAGE_SGLANG_BOOTSTRAP_TIMEOUT_S": "20"}
    base = dict(prefill_tp=1, decode_tp=1, prefill_page=16, decode_page=32, prefill_capacity=16 * 256,
                decode_capacity=32 * 128, bootstrap_port=port, chunked_prefill_size=192, deadline_s=40, env=env,
                stamp_parallel=False)  # the managers read their place from ServerArgs here
    out = ctx.Queue()
    go = ctx.Event()
    landed = ctx.Event()  # the decode saw the doomed request's first chunk land
    dec = ctx.Process(target=decode_worker, args=(dict(base, waves=[[doomed], [survivor]]), 0, out, go, landed))
    pre1 = ctx.Process(target=prefill_worker, args=(dict(base, requests=[doomed], die_after_sends=2), 0, out, landed))
    t0 = time.monotonic()
    dec.start()
    pre1.start()
    got, errors = collect(out, 1, ("wave",), 120)  # wave 0 of the decode ends (Failed, we hope)
    if errors:
        stop([dec, pre1])
        raise AssertionError("; ".join(errors))
    pre1.join(timeout=10)
    pre2 = ctx.Process(target=prefill_worker, args=(dict(base, requests=[survivor]), 0, out))
    pre2.start()
    reg, errors = collect(out, 1, ("registered",), 120)
    time.sleep(0.5)  # its PUT /route is in before the decode looks it up again
    go.set()
    got, errors2 = collect(out, 2, ("decode", "prefill"), 120)
    stop([dec, pre1, pre2])
    server.close() if hasattr(server, "close") else None
    errors += errors2
    if errors:
        raise AssertionError("; ".join(errors))
    dres = [m[2] for m in got if m[0] == "decode"]
    if not dres:
        raise AssertionError("decode did not report")
    d = dres[0]
    st, why, secs, polls = d[doomed[0]][:4]
    if 3 not in polls:
        raise AssertionError(f"killed prefill: the decode never saw the request in flight (polls {polls})")
    if st != "Failed":
        raise AssertionError(f"killed prefill: decode said {st} ({why}), polls {polls}")
    if secs > 30:
        raise AssertionError(f"killed prefill: Failed only after {secs:.1f}s")
    if "kvstage trace" not in why:
        raise AssertionError(f"failure_exception lacks the trace id: {why}")
    st2, why2, secs2 = d[survivor[0]][:3]
    if st2 != "Success":
        raise AssertionError(f"next request after the kill: {st2} ({why2})")
    return f"poll Failed {secs:.1f}s after the request began ({why[:160]}...); next request byte-exact in {secs2 * 1000:.0f}ms; {time.monotonic() - t0:.1f}s"


def scenario_decode_abort(ctx):
    port = free_port()
    server = start_bootstrap(port)
    rooms = [(_u64(0xAB00_0000_0000 + i), tokens) for i, tokens in enumerate([300, 400, 500, 260])]
    aborted = rooms[1][0]
    cfg = dict(prefill_tp=2, decode_tp=2, prefill_page=16, decode_page=32, prefill_capacity=16 * 256,
               decode_capacity=32 * 128, bootstrap_port=port, requests=rooms, chunked_prefill_size=192,
               deadline_s=40, abort_rooms=[aborted], env={"KVSTAGE_SGLANG_CHUNK_TOKENS": "128"})
    got, errors = run_ranks(ctx, cfg, 2, 2, 90)
    server.close()
    if errors:
        raise AssertionError("; ".join(errors))
    problems, seen = [], ""
    for kind, rank, results, _where in got:
        for room, res in results.items():
            want = "Failed" if room == aborted else "Success"
            if res[0] != want:
                problems.append(f"{kind} {rank} room {room:x}: {res[0]} (wanted {want}) {res[1][:200]}")
            elif room == aborted and kind == "prefill":
                seen = res[1]
    if len(got) < 4:
        problems.append(f"only {len(got)} of 4 ranks reported")
    if problems:
        raise AssertionError("; ".join(problems[:6]))
    return f"aborted request Failed on both sides (prefill: {seen[:150]}...), the other 3 byte-exact"


def scenario_unservable(ctx):
    """A request the prefill ranks cannot serve (here a decode-side cached prefix of 32 tokens,
    inside a prefill page of 64): the prefill refuses the decode's metadata and tells the decode,
    so both sides fail at once with the reason instead of waiting for their timeouts."""
    port = free_port()
    server = start_bootstrap(port)
    rooms = [(_u64(0x5E7F_0000_0001), 300)]
    cfg = dict(prefill_tp=2, decode_tp=2, prefill_page=64, decode_page=32, prefill_capacity=64 * 64,
               decode_capacity=32 * 128, bootstrap_port=port, requests=rooms, chunked_prefill_size=192,
               deadline_s=40, decode_prefix=32, env={"KVSTAGE_SGLANG_CHUNK_TOKENS": "128"})
    got, errors = run_ranks(ctx, cfg, 2, 2, 90)
    server.close()
    if errors:
        raise AssertionError("; ".join(errors))
    problems, slowest, seen = [], 0.0, ""
    for kind, rank, results, _where in got:
        res = results[rooms[0][0]]
        if res[0] != "Failed" or "cached prefix" not in res[1]:
            problems.append(f"{kind} {rank}: {res[0]} {res[1][:200]}")
        elif kind == "decode":
            slowest, seen = max(slowest, res[2]), res[1]
    if len(got) < 4:
        problems.append(f"only {len(got)} of 4 ranks reported")
    if not problems and slowest > 15:
        problems.append(f"the decode said Failed only after {slowest:.1f}s")
    if problems:
        raise AssertionError("; ".join(problems[:6]))
    return f"both sides Failed, the decode within {slowest:.1f}s: {seen[:200]}"


def scenario_bootstrap_silent(ctx):
    # A bootstrap port that accepts connections and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    room = _u64(0x51_1E47)
    cfg = dict(decode_tp=1, decode_page=32, decode_capacity=32 * 64, bootstrap_port=port, bootstrap_addr=f"127.0.0.1:{port}",
               requests=[(room, 100)], deadline_s=30, max_ensure_retries=3, ensure_retry_interval_s=0.5,
               env={"KVSTAGE_SGLANG_HTTP_TIMEOUT_S": "2"})
    out = ctx.Queue()
    p = ctx.Process(target=decode_worker, args=(cfg, 0, out))
    t0 = time.monotonic()
    p.start()
    got, errors = collect(out, 1, ("decode",), 90)
    stop([p])
    silent.close()
    if errors:
        raise AssertionError("; ".join(errors))
    if not got:
        raise AssertionError("decode rank hung (no report within 90s)")
    st, why, secs, polls, ensure_s = got[0][2][room]
    if st != "Failed":
        raise AssertionError(f"silent bootstrap: {st} ({why})")
    if "did not answer" not in why or f"127.0.0.1:{port}" not in why:
        raise AssertionError(f"unclear error: {why}")
    # The scheduler loop's registry calls each held it no longer than the HTTP timeout (2 s).
    if len(ensure_s) != 3 or max(ensure_s) > 2 + 1.5:
        raise AssertionError(f"try_ensure_parallel_info calls took {[round(x, 1) for x in ensure_s]}s (bound 2s each)")
    return f"Failed after {secs:.1f}s, each registry call within {max(ensure_s):.1f}s: {why[:200]}"


# -- a hostile decode peer ---------------------------------------------------------------------------------

# Each case: what the lying decode rank does to one request (its receiver's send_metadata, through
# the backend's own metadata path), what the prefill side's request must end as, and the words its
# reason (Failed) or the prefill rank's log (a refused message) must hold: the field it names.
# Page indices, the aux row and the state slots never travel (the decode's own room holds them,
# kvstage checks them when it opens the room): those cases pass them to send_metadata.
HOSTILE_CASES = [
    # (case, prefill request's end, words of its reason, words of the prefill rank's log)
    ("room_key", "Failed", ("room key",), ()),
    ("pages_outside_pool", "Failed", ("could not open", "desc->pages"), ()),
    ("num_pages", "Failed", ("num_pages",), ()),
    ("num_pages_and_chunks", "Failed", ("num_pages",), ()),
    ("chunk_tokens", "Failed", ("receiver expects",), ()),
    ("aux_index", "Failed", ("could not open", "aux_row"), ()),
    ("state_index", "Failed", ("could not open", "state_slots"), ()),
    ("decode_tp_rank", "Failed", ("tp_rank",), ()),
    ("address", "Failed", ("connect to 127.0.0.1:",), ()),
    # A refused message whose failure socket zmq cannot connect to: refused all the same.
    ("notify_endpoint", "Failed", ("num_pages",), ("failure not delivered to tcp://no-port",)),
    # Nothing in these names a request: its metadata never came (the bootstrap timeout ends it).
    ("garbage", "Failed", ("bootstrap timeout",), ("bad metadata message",)),
    ("truncated", "Failed", ("bootstrap timeout",), ("bad metadata message", "truncated")),
    # Kept, not refused: a decode rank's message may come before the prefill has the request.
    ("unknown_room", "Failed", ("bootstrap timeout",), ()),
    ("duplicate", "Success", (), ()),
    ("duplicate_other_grid", "Success", (), ("metadata refused: grid",)),
]


def hostile_send(case: str):
    """decode.py's send_metadata call, lying as ``case`` says."""

    def send(r, recv, page_indices, row, state_indices, prefix):
        import numpy as np
        from kvstage.sglang.messages import decode_metadata, encode

        if case == "pages_outside_pool":
            page_indices = np.append(np.asarray(page_indices)[:-1], r.mgr.layout.capacity_pages + 7)
        elif case == "aux_index":
            row = MAX_REQS + 3
        elif case == "state_index":
            state_indices = [[np.array([MAX_REQS + 3], dtype=np.int64)]]
        honest = r.mgr.send_to_prefill

        def lying(addr, payload):
            if case == "garbage":
                return honest(addr, b"\x93\xa7garbage\x01\xc1")
            if case == "truncated":
                return honest(addr, payload[: len(payload) // 2])
            meta = decode_metadata(payload)
            if case == "room_key":
                meta.room_key ^= 0x5A5A5A5A
            elif case == "num_pages":
                meta.num_pages += 7
            elif case == "notify_endpoint":
                meta.num_pages += 7
                meta.notify = "tcp://no-port"
            elif case == "num_pages_and_chunks":  # consistent with each other, not with the request
                meta.num_pages, meta.num_chunks = 4, 1
            elif case == "chunk_tokens":  # half the room's chunks, the count to match
                meta.chunk_tokens //= 2
                meta.num_chunks = -(-meta.num_pages * meta.decode.page_size // meta.chunk_tokens)
            elif case == "decode_tp_rank":
                meta.decode.tp_rank = 5
            elif case == "address":
                meta.address = f"127.0.0.1:{free_port()}"
            elif case == "unknown_room":
                meta.room ^= 0xFFFF_0000
            honest(addr, encode(meta))
            if case == "duplicate":
                honest(addr, encode(meta))
            elif case == "duplicate_other_grid":
                meta.chunk_tokens *= 2
                meta.num_chunks = -(-meta.num_pages * meta.decode.page_size // meta.chunk_tokens)
                honest(addr, encode(meta))

        r.mgr.send_to_prefill = lying
        try:
            recv.send_metadata(page_indices, row, state_indices, decode_prefix_len=prefix)
        finally:
            del r.mgr.send_to_prefill

    return send


class LogCapture:
    """The kvstage.sglang log records of one process (WARNING and above), as text."""

    def __init__(self):
        import logging

        self.lines = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda rec: self.lines.append(rec.getMessage())
        logging.getLogger("kvstage.sglang").addHandler(handler)


def hostile_prefill_worker(cfg, out, started, hostile_done):
    """One prefill rank serving each case's lied-about request, then its honest one."""
    try:
        os.environ.update(cfg.get("env", {}))
        r = Rank("prefill", 1, 0, cfg["prefill_page"], cfg["prefill_capacity"], cfg["bootstrap_port"])
        rng = r.np.random.default_rng(1000)
        log = LogCapture()
        report = {}
        for i, (case, hostile, honest, tokens) in enumerate(cfg["cases"]):
            mark = len(log.lines)
            started[i].set()
            t0 = time.monotonic()
            bad = serve_prefill(r, cfg, [(hostile, tokens)], rng)[hostile]
            secs = time.monotonic() - t0
            hostile_done[i].set()
            good = serve_prefill(r, cfg, [(honest, tokens)], rng)[honest]
            report[case] = dict(hostile=bad, secs=secs, honest=good, log=log.lines[mark:])
        out.put(("prefill", 0, report, ""))
        time.sleep(1.0)  # the decode rank releases its last rooms first
        r.mgr.close()
    except BaseException:
        out.put(("error", "prefill 0", traceback.format_exc()))


def hostile_decode_worker(cfg, out, started, hostile_done):
    """One decode rank lying in each case's first request, honest in its second."""
    try:
        os.environ.update(cfg.get("env", {}))
        r = Rank("decode", 1, 0, cfg["decode_page"], cfg["decode_capacity"], cfg["bootstrap_port"])
        rng = r.np.random.default_rng(2000)
        report = {}
        for i, (case, hostile, honest, tokens) in enumerate(cfg["cases"]):
            if not started[i].wait(cfg["deadline_s"] * 3):
                raise RuntimeError(f"case {case}: the prefill rank never started it")
            # The liar's own request: waited for only until the prefill side ended it (a lie that
            # leaves it open is aborted then), but a duplicate's is a normal request to the end.
            until = None if case.startswith("duplicate") else hostile_done[i]
            bad = serve_decode(r, cfg, [(hostile, tokens)], rng, send=hostile_send(case), until=until)[hostile]
            good = serve_decode(r, cfg, [(honest, tokens)], rng)[honest]
            report[case] = dict(hostile=bad[:2], honest=good[:2])
        out.put(("decode", 0, report, r.mgr.address))
        time.sleep(0.5)
        r.mgr.close()
    except BaseException:
        out.put(("error", "decode 0", traceback.format_exc()))


def scenario_hostile_decode(ctx):
    """A decode rank that lies in its metadata message toward a real prefill rank of this backend,
    one lie at a time, each followed by an honest request."""
    port = free_port()
    server = start_bootstrap(port)
    cases = [(case, _u64(0x4057_0000_0000 + 2 * i), _u64(0x4057_0000_0001 + 2 * i), 333) for i, (case, *_x) in enumerate(HOSTILE_CASES)]
    bootstrap_s = 4
    cfg = dict(prefill_page=16, decode_page=32, prefill_capacity=16 * 256, decode_capacity=32 * 128, bootstrap_port=port,
               chunked_prefill_size=192, deadline_s=bootstrap_s + 16, cases=cases,
               env={"KVSTAGE_SGLANG_CHUNK_TOKENS": "128", "KVSTAGE_SGLANG_BOOTSTRAP_TIMEOUT_S": str(bootstrap_s)})
    out = ctx.Queue()
    started = [ctx.Event() for _ in cases]
    hostile_done = [ctx.Event() for _ in cases]
    procs = [ctx.Process(target=hostile_prefill_worker, args=(cfg, out, started, hostile_done)),
             ctx.Process(target=hostile_decode_worker, args=(cfg, out, started, hostile_done))]
    for p in procs:
        p.start()
    got, errors = collect(out, 2, ("prefill", "decode"), len(cases) * 2 * cfg["deadline_s"] + 30)
    stop(procs)
    server.close()
    if errors:
        raise AssertionError("; ".join(errors))
    reports = {kind: rep for kind, _rank, rep, _where in got}
    if set(reports) != {"prefill", "decode"}:
        raise AssertionError(f"only {sorted(reports)} reported")
    pre, dec = reports["prefill"], reports["decode"]
    problems, seen = [], []
    for case, want, reason_words, log_words in HOSTILE_CASES:
        p_, d = pre[case], dec[case]
        (state, reason), log = p_["hostile"], p_["log"]
        if state != want:
            problems.append(f"{case}: the prefill's request ended {state}, not {want}: {reason[:300]}")
        missing = [w for w in reason_words if w not in reason] + [w for w in log_words if not any(w in line for line in log)]
        if missing:
            problems.append(f"{case}: {missing} not named (reason: {reason[:300]!r}; log: {[line[:200] for line in log]})")
        if want == "Success" and d["hostile"][0] != "Success":
            problems.append(f"{case}: the decode's request ended {d['hostile'][0]}: {d['hostile'][1][:200]}")
        if p_["honest"][0] != "Success" or d["honest"][0] != "Success":
            problems.append(f"{case}: the honest request after it: prefill {p_['honest'][0]} {p_['honest'][1][:200]}, "
                            f"decode {d['honest'][0]} {d['honest'][1][:200]}")
        seen.append(f"{case}: {state} in {p_['secs']:.1f}s" + (f" ({reason.split('): ', 1)[-1][:110]})" if state == "Failed" else ""))
    if problems:
        raise AssertionError("; ".join(problems))
    return f"each lie, then an honest request byte-exact: " + "; ".join(seen)


class HeldRoom:
    """STAND-IN for a writer that cannot end (a same-host prefill process stopped mid-copy,
    which needs precise timing to produce): the decode's real kvstage room, whose release
    answers kvstage's "pages not free yet" ``E_TIMEOUT`` ``held`` times before it goes through."""

    def __init__(self, room, held: int):
        self.inner, self.held, self.calls, self.freed = room, held, 0, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def release(self):
        import kvstage

        self.calls += 1
        if self.calls <= self.held:
            raise kvstage.TimeError("releasing room: connection(s) [7] still hold its pages and may write them "
                                    "(do not reuse them yet)", code=kvstage.Status.E_TIMEOUT)
        self.inner.release()
        self.freed = True


def release_worker(cfg, out):
    try:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        r = Rank("decode", 1, 0, 32, 32 * 64, cfg["bootstrap_port"])
        info = PrefillServerInfo(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=16,
                                 kv_cache_dtype="bfloat16", follow_bootstrap_room=True)
        report = {}
        for case, room in (("abort", 0x4E1D_0001), ("clear", 0x4E1D_0002)):
            recv = r.Receiver(mgr=r.mgr, bootstrap_addr="127.0.0.1:1", bootstrap_room=room)
            recv.prefill = (info, [])  # the registry answered: a prefill DP group with no ranks to tell
            a = r.alloc(100, r.np.random.default_rng(room))
            recv.send_metadata(r.np.asarray(a["pages"]), a["row"], [[r.np.array([a["slot"]])]])
            held = HeldRoom(recv.room, 3)
            recv.room = held
            polls = [int(recv.poll())]
            if case == "abort":
                recv.abort()  # decode.py: the request was aborted; sglang frees its pages on Failed
                for _ in range(10):
                    polls.append(int(recv.poll()))
                    if polls[-1] == KVPoll.Failed:
                        break
                report[case] = dict(polls=polls, calls=held.calls, freed=held.freed)
            else:
                recv.clear()  # sglang clears a receiver it gives up on: the backend must keep retrying
                end = time.monotonic() + 10
                while not held.freed and time.monotonic() < end:
                    time.sleep(0.05)
                report[case] = dict(polls=polls, calls=held.calls, freed=held.freed)
        out.put(("release", 0, report))
        r.mgr.close()
    except BaseException:
        out.put(("error", "decode 0", traceback.format_exc()))


def scenario_release_not_free(ctx):
    out = ctx.Queue()
    p = ctx.Process(target=release_worker, args=(dict(bootstrap_port=free_port()), out))
    p.start()
    got, errors = collect(out, 1, ("release",), 90)
    stop([p])
    if errors:
        raise AssertionError("; ".join(errors))
    if not got:
        raise AssertionError("no report")
    rep = got[0][2]
    a, c = rep["abort"], rep["clear"]
    # Failed (0) only after the release went through: never while kvstage says the pages are held.
    if a["polls"][-1] != 0 or 0 in a["polls"][:-1] or not a["freed"] or a["calls"] != 4:
        raise AssertionError(f"abort with pages held: polls {a['polls']}, release calls {a['calls']}, freed {a['freed']}")
    if not c["freed"] or c["calls"] != 4:
        raise AssertionError(f"clear with pages held: release calls {c['calls']}, freed {c['freed']} (not retried)")
    return (f"abort: poll said {a['polls'][1:-1]} for 3 refused releases, Failed after the 4th; "
            f"clear: retried in the background until freed ({c['calls']} calls)")


def scenario_plugin():
    """The entry point, the flag and get_kv_class, in sglang's own code paths."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvstage"]
    if not eps or eps[0].value != "kvstage.sglang.plugin:register":
        raise AssertionError(f"entry point sglang.srt.plugins/kvstage missing: {eps}")
    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers import disagg_service
    from sglang.srt.server_args import prepare_server_args

    import kvstage.sglang.conn as conn

    tb = TransferBackend("kvstage")
    want = {KVClassType.MANAGER: conn.KvstageKVManager, KVClassType.SENDER: conn.KvstageKVSender,
            KVClassType.RECEIVER: conn.KvstageKVReceiver, KVClassType.BOOTSTRAP_SERVER: conn.KvstageKVBootstrapServer}
    for ct, cls in want.items():
        if get_kv_class(tb, ct) is not cls or disagg_service.get_kv_class(tb, ct) is not cls:
            raise AssertionError(f"get_kv_class(kvstage, {ct}) is not {cls.__name__}")
    if get_kv_class(TransferBackend("fake"), KVClassType.SENDER).__name__ != "FakeKVSender":
        raise AssertionError("other backends no longer resolve")
    sa = prepare_server_args(["--model-path", "unused", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvstage"])
    if sa.disaggregation_transfer_backend != "kvstage":
        raise AssertionError("flag not parsed")
    if not disagg_service.rust_server_serves_kv_bootstrap("kvstage"):
        raise AssertionError("kvstage's bootstrap server should be sglang's registry")
    # sglang's own staging buffer is refused at manager start, before any engine exists.
    from sglang.srt.disaggregation.utils import DisaggregationMode

    os.environ["SGLANG_DISAGG_STAGING_BUFFER"] = "1"
    try:
        conn.KvstageKVManager(get_kv_class(tb, KVClassType.KVARGS)(), DisaggregationMode.DECODE, sa, False)
    except ValueError as e:
        if "SGLANG_DISAGG_STAGING_BUFFER" not in str(e):
            raise AssertionError(f"staging buffer refused without naming it: {e}")
    else:
        raise AssertionError("SGLANG_DISAGG_STAGING_BUFFER=1 accepted")
    finally:
        del os.environ["SGLANG_DISAGG_STAGING_BUFFER"]
    return ("entry point loaded by load_plugins(); --disaggregation-transfer-backend kvstage parsed; get_kv_class answers "
            "kvstage's classes; SGLANG_DISAGG_STAGING_BUFFER=1 refused at manager start")


def main() -> int:
    started = time.monotonic()
    only = set(sys.argv[1:])
    # fork (default): the ranks start from this process with torch and sglang's modules imported
    # (no library loaded, no kvstage engine, no zmq context here), seconds instead of a minute
    # of imports per rank on two cores; KVSTAGE_SGLANG_TEST_MP=spawn starts them from scratch.
    method = os.environ.get("KVSTAGE_SGLANG_TEST_MP", "fork")
    if method == "fork":
        import torch  # noqa: F401
        import sglang.srt.disaggregation.common.staging_buffer  # noqa: F401
        import sglang.srt.disaggregation.utils  # noqa: F401
        import sglang.srt.mem_cache.common  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
        import sglang.srt.configs.model_config  # noqa: F401
        from sglang.srt.plugins import load_plugins

        load_plugins()
    import logging

    if not os.environ.get("KVSTAGE_SGLANG_TEST_VERBOSE"):
        logging.disable(logging.INFO)  # sglang's and kvstage's INFO lines, in every rank (fork)
    ctx = mp.get_context(method)
    scenarios = [
        ("plugin_entry_point_and_flag", scenario_plugin),
        ("P4_to_D2_page16_to_32_aux_mamba_8_in_flight_pageless_last_send", lambda: scenario_transfer(ctx, 4, 2, empty_last=True)),
        ("P2_to_D4_page16_to_32_aux_mamba_8_in_flight", lambda: scenario_transfer(ctx, 2, 4)),
        ("P4_to_D2_over_tcp_on_SGLANG_HOST_IP_not_http_host", lambda: scenario_transfer(ctx, 4, 2, transport="tcp", host_ip="127.0.0.2")),
        ("P2_to_D4_decode_prefix_cached", lambda: scenario_transfer(ctx, 2, 4, decode_prefix=224)),
        ("P_dp2xtp2_to_D2_attention_dp", lambda: scenario_transfer(ctx, 2, 2, prefill_dp=2)),
        ("MLA_P4_to_D2_dummy_prefill_ranks_page16_to_32", lambda: scenario_transfer(ctx, 4, 2, mla=True)),
        ("P3_to_D2_MQA_mamba6_state_non_dividing_tp", lambda: scenario_state_non_dividing_tp(ctx, 3, 2)),
        ("P2_to_D3_MQA_mamba6_state_non_dividing_tp", lambda: scenario_state_non_dividing_tp(ctx, 2, 3)),
        ("P3_to_D2_GQA6_mamba6_non_dividing_tp", lambda: scenario_state_non_dividing_tp(ctx, 3, 2, GQA6_HYBRID)),
        ("P2_to_D3_GQA6_mamba6_non_dividing_tp", lambda: scenario_state_non_dividing_tp(ctx, 2, 3, GQA6_HYBRID)),
        ("decode_abort_fails_that_request_only", lambda: scenario_decode_abort(ctx)),
        ("prefill_killed_mid_request_then_next_succeeds", lambda: scenario_prefill_killed(ctx)),
        ("unservable_request_fails_both_sides_at_once", lambda: scenario_unservable(ctx)),
        ("bootstrap_never_answers", lambda: scenario_bootstrap_silent(ctx)),
        ("room_release_not_free_keeps_request", lambda: scenario_release_not_free(ctx)),
        ("hostile_decode_metadata_each_lie_then_an_honest_request", lambda: scenario_hostile_decode(ctx)),
    ]
    passed = failed = 0
    for name, fn in scenarios:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            detail = fn()
            passed += 1
            print(f"PASS {name} ({time.monotonic() - t0:.1f}s): {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 - a scenario's failure is reported, the rest still run
            failed += 1
            print(f"FAIL {name} ({time.monotonic() - t0:.1f}s): {e}", flush=True)
            if os.environ.get("KVSTAGE_SGLANG_TEST_VERBOSE"):
                traceback.print_exc()
    print(f"sglang engine tests: {time.monotonic() - started:.0f}s", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The summary stays the last line: no interpreter teardown (sglang's bootstrap servers'
    # event-loop threads print "Task was destroyed" when collected).
    os._exit(rc)
