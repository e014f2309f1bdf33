"""What a rank registers with its kvstage engine, from sglang's ``KVArgs``: its KV pool as a
:class:`kvstage.KvLayout`, its metadata buffers (aux rows) and state pools as components, and a
request's pages, aux row and state slots in the form kvstage takes them."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import msgspec
import numpy as np

import kvstage
from kvstage import AuxBuffer, StateComponent

from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from .topology import Topology

# Bytes per element of sglang's kv_cache_dtype_str; anything else moves as bytes (dtype_bytes 1).
DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "auto": 2,
    "float32": 4, "float": 4, "fp32": 4,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp4_e2m1": 1, "int8": 1,
}


def model_kv_heads(server_args: Any, attn_tp: int) -> Tuple[int, int]:
    """(total KV heads, KV heads of one attention-TP rank) from the model config, as sglang's
    scheduler reads them (``ModelConfig.from_server_args``: ``get_total_num_kv_heads``,
    ``get_num_kv_heads``). sglang's decode fills ``KVArgs.kv_head_num`` only with its staging
    buffer on; its prefill always does."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        return int(mc.get_total_num_kv_heads()), int(mc.get_num_kv_heads(attn_tp))
    except Exception as e:
        raise ValueError(
            "kvstage backend: KVArgs has no kv_head_num and the model config "
            f"({getattr(server_args, 'model_path', None)!r}) gave no KV head count: {e}"
        ) from e


def kv_layout_from_args(args: KVArgs, topo: Topology, is_mla: bool, server_args: Any = None) -> Tuple[kvstage.KvLayout, int]:
    """The rank's KV pool as a :class:`kvstage.KvLayout`, from ``KVArgs`` as sglang fills it
    (``get_kv_transfer_buf_infos``: K of every layer, then V of every layer; ``kv_item_lens``:
    bytes of one page of one layer). Returns the layout and the bytes of one token over all of
    this rank's layers (K and V)."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    num_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if num_draft:
        raise NotImplementedError("kvstage backend: a draft model's KV pool (speculative decoding) is not wired yet")
    page = int(args.page_size)
    dtype_bytes = DTYPE_BYTES.get(str(getattr(args, "kv_cache_dtype_str", "") or "").lower(), 1)
    layer_ids_all = list(getattr(args, "kv_layer_ids", None) or [])
    if is_mla:
        n_layers = len(ptrs)
        k, v, heads, local = ptrs, None, 1, 1
    else:
        if len(ptrs) % 2:
            raise ValueError(f"kvstage backend: {len(ptrs)} KV buffers for an MHA pool (K then V per layer expected)")
        n_layers = len(ptrs) // 2
        k, v = ptrs[:n_layers], ptrs[n_layers:]
        local = int(getattr(args, "kv_head_num", 0) or 0)
        heads = int(getattr(args, "total_kv_head_num", 0) or 0)
        if not local:  # sglang's decode (no staging buffer): from the model config
            heads, local = model_kv_heads(server_args, topo.attn_tp_size)
        heads = heads or local * topo.attn_tp_size
    page_bytes = items[0]
    if any(i != page_bytes for i in items):
        raise NotImplementedError("kvstage backend: layers of different page sizes in one pool are not wired yet")
    if page_bytes % (page * local):
        raise ValueError(f"kvstage backend: a KV page of {page_bytes} bytes is not {page} tokens x {local} heads")
    head_bytes = page_bytes // (page * local)
    head_dim = head_bytes // dtype_bytes
    if head_dim * dtype_bytes * local * page != page_bytes:
        dtype_bytes, head_dim = 1, head_bytes
    layer_ids = layer_ids_all[:n_layers] if len(layer_ids_all) >= n_layers else None
    if layer_ids is None:
        start = int(getattr(args, "prefill_start_layer", 0) or 0)
        layer_ids = list(range(start, start + n_layers))
    layout = kvstage.KvLayout(
        head_dim=head_dim, global_heads=heads, page_size=page, dtype_bytes=dtype_bytes,
        model="mla" if is_mla else "mha",
        tp_rank=topo.attn_tp_rank, tp_size=topo.attn_tp_size,
        pp_rank=topo.pp_rank, pp_size=topo.pp_size, layer_ids=layer_ids,
        k_buffers=k, v_buffers=v, capacity_pages=min(lens) // page_bytes,
    )
    token_bytes = sum(items) // page
    return layout, token_bytes


class StateGroup(msgspec.Struct):
    state_index: int  # index in KVArgs.state_types (and in send/send_metadata's state_indices)
    name: str


def components_from_args(args: KVArgs, state_tp: int) -> Tuple[List[Any], List[StateGroup], int]:
    """sglang's metadata buffers (one :class:`AuxBuffer` each) and state pools (one
    :class:`StateComponent` per state tensor, its layers together) from ``KVArgs``. Returns the
    components, which state type each state component belongs to, and the bytes of the parts of
    one request (aux rows and state slots of this rank)."""
    comps: List[Any] = []
    groups: List[StateGroup] = []
    part_bytes = 0
    for i, (ptr, dlen, ilen) in enumerate(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)):
        comps.append(AuxBuffer(f"aux{i}", int(ptr), int(ilen), int(dlen) // int(ilen)))
        part_bytes += int(ilen)
    state_types = list(getattr(args, "state_types", None) or [])
    for s, st in enumerate(state_types):
        st_value = st.value if hasattr(st, "value") else str(st)
        if st_value != StateType.MAMBA.value:
            raise NotImplementedError(
                f"kvstage backend: state type {st_value!r} is not wired yet (Mamba/GDN state is); "
                "use the mooncake backend for this model"
            )
        ptrs = list(args.state_data_ptrs[s])
        lens = list(args.state_data_lens[s])
        items = list(args.state_item_lens[s])
        layers = list(args.state_layer_ids[s]) if getattr(args, "state_layer_ids", None) else list(range(len(ptrs)))
        dims = list(args.state_dim_per_tensor[s]) if getattr(args, "state_dim_per_tensor", None) else [0] * len(ptrs)
        outers = (
            list(args.state_slice_outer_counts[s])
            if getattr(args, "state_slice_outer_counts", None) and args.state_slice_outer_counts[s]
            else [1] * len(ptrs)
        )
        conv_groups = (
            list(args.state_conv_shard_groups[s])
            if getattr(args, "state_conv_shard_groups", None) and args.state_conv_shard_groups[s]
            else [None] * len(ptrs)
        )
        # Entries are tensor-major x layer: a tensor's run ends where a layer id repeats.
        runs: List[List[int]] = []
        for j, layer in enumerate(layers):
            if not runs or layer in [layers[x] for x in runs[-1]] or (
                items[j], dims[j], outers[j], conv_groups[j]) != (items[runs[-1][0]], dims[runs[-1][0]], outers[runs[-1][0]], conv_groups[runs[-1][0]]):
                runs.append([j])
            else:
                runs[-1].append(j)
        for t, run in enumerate(runs):
            j0 = run[0]
            item, dim, outer = int(items[j0]), int(dims[j0]), int(outers[j0])
            row = item // outer
            if dim == 0:
                group_dims, replicated = [row], True
            else:
                unit = row // dim
                sub = conv_groups[j0]
                group_dims = [int(g) * unit for g in sub] if sub else [dim * state_tp * unit]
                replicated = False
            comps.append(StateComponent(
                f"{st_value}{t}", [int(ptrs[j]) for j in run], [int(layers[j]) for j in run],
                int(lens[j0]) // item, group_dims, outer=outer, dtype_bytes=1, replicated=replicated,
            ))
            groups.append(StateGroup(s, f"{st_value}{t}"))
            part_bytes += item * len(run)
    return comps, groups, part_bytes


def state_slots(groups: List[StateGroup], state_indices: Optional[List]) -> List[int]:
    """One slot per state component from sglang's ``state_indices`` (per state type: for Mamba a
    list with the request's state slot)."""
    if not groups:
        return []
    if state_indices is None:
        raise ValueError("kvstage backend: state_indices missing for a model with state pools")
    slots = []
    for g in groups:
        payload = state_indices[g.state_index]
        if payload is None:
            raise ValueError(f"kvstage backend: no state index for {g.name}")
        flat = np.asarray(payload[0] if isinstance(payload, (list, tuple)) else payload).reshape(-1)
        if flat.size < 1:
            raise ValueError(f"kvstage backend: empty state index for {g.name}")
        slots.append(int(flat[0]))
    return slots


def page_list(indices: Any) -> List[int]:
    """sglang's page indices (any array or tensor shape) as ints."""
    return [int(x) for x in np.asarray(indices).reshape(-1)]
