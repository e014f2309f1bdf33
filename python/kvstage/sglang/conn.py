"""kvstage as an sglang PD-disaggregation transfer backend.

sglang's schedulers drive four classes per backend (``get_kv_class``): a manager per rank, a
sender per prefill request, a receiver per decode request and one bootstrap server per prefill
server. Here:

* the bootstrap server is sglang's own HTTP registry (:class:`CommonKVBootstrapServer`); every
  prefill rank registers its address there exactly as the built-in backends do (``PUT /route``)
  and decode ranks look it up the same way (``GET /route``);
* the manager owns one :class:`kvstage.Engine` per rank with the rank's KV pool, metadata buffers
  (aux rows) and state pools (Mamba conv/SSM) registered from sglang's ``KVArgs``;
* the receiver (decode) opens the request's kvstage room with its KV pages, ``aux_index`` and
  ``state_indices`` and hands the room id, the room's key and its chunk grid to the prefill ranks
  in its metadata message (``send_metadata``);
* the sender (prefill) turns ``send(kv_indices, ...)`` into the transfers of the decode's chunk
  grid (``get_max_transfer_tokens`` returns it); the last carries the request's parts.

``poll()`` maps kvstage operations and room events onto ``KVPoll``; ``failure_exception()``
raises :class:`KvstageTransferError` (an sglang ``KVTransferError``) with kvstage's message and
the request's trace id.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import msgspec
import numpy as np
import requests
import zmq

import kvstage
from kvstage import AuxBuffer, RequestParts, StateComponent, Status

from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
    StateType,
)
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

logger = logging.getLogger(__name__)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _sglang_env(name: str, default: float) -> float:
    """An sglang ``SGLANG_DISAGGREGATION_*`` setting through its own ``envs`` when present."""
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except Exception:  # an sglang without that setting
        return _env_float(name, default)


# Bytes per element of sglang's kv_cache_dtype_str; anything else moves as bytes (dtype_bytes 1).
_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "auto": 2,
    "float32": 4, "float": 4, "fp32": 4,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp4_e2m1": 1, "int8": 1,
}


class KvstageTransferError(KVTransferError):
    """A failed kvstage transfer of one sglang request: ``failure_reason`` has kvstage's message
    (and causes), ``trace_id`` the id both sides' kvstage logs and describe documents use, and
    ``__cause__`` the :class:`kvstage.KVStageError` when there was one."""

    def __init__(self, bootstrap_room: int, failure_reason: str, trace_id: str = "", cause: Optional[BaseException] = None):
        reason = f"{failure_reason} [kvstage trace {trace_id}]" if trace_id else failure_reason
        super().__init__(bootstrap_room, reason)
        self.trace_id = trace_id
        self.kvstage_error = cause
        if cause is not None:
            self.__cause__ = cause


def _describe_error(err: BaseException) -> str:
    if isinstance(err, kvstage.KVStageError):
        code = err.code.name if hasattr(err.code, "name") else err.code
        text = f"{code}: {err.message}"
        if err.causes:
            text += " (" + "; ".join(err.causes) + ")"
        return text
    return f"{type(err).__name__}: {err}"


def trace_id_of(room: int) -> str:
    """The kvstage trace id of sglang request ``bootstrap_room`` (same on both sides)."""
    return f"sglang-{int(room) & 0xFFFFFFFFFFFFFFFF:x}"


# -- topology ---------------------------------------------------------------------------------------


class _Topology(msgspec.Struct):
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    host: str
    bootstrap_port: int


def _topology(server_args: Any, args: KVArgs) -> _Topology:
    """This rank's place: from sglang's ``ParallelContext`` (``get_parallel()``: what a launched
    server publishes for each scheduler process) and its serving/disagg config, each read where
    it can be; else from ``server_args``' fields and ``KVArgs.engine_rank`` (a process that builds
    a manager by hand, without publishing)."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    attn_dp = int(getattr(server_args, "attn_dp_size", 0) or 0) or (dp if getattr(server_args, "enable_dp_attention", False) else 1)
    attn_tp = max(1, tp // attn_dp)
    rank = int(args.engine_rank)
    values = dict(
        attn_tp_size=attn_tp, attn_tp_rank=rank % attn_tp, attn_dp_size=attn_dp, attn_dp_rank=rank // attn_tp,
        pp_size=int(getattr(server_args, "pp_size", 1) or 1), system_dp_size=1 if attn_dp > 1 else dp,
    )
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        values = dict(
            attn_tp_size=int(p.attn_tp_size), attn_tp_rank=int(p.attn_tp_rank),
            attn_dp_size=int(p.attn_dp_size), attn_dp_rank=int(p.attn_dp_rank),
            pp_size=int(p.pp_size), system_dp_size=int(p.dp_size),
        )
    except Exception:  # nothing published or stamped in this process
        pass
    # The HTTP host: only the bootstrap registry's URL follows it (as in sglang's common
    # manager); the rank's own address is _local_ip().
    host = str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1")
    port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
    try:
        from sglang.srt.runtime_context import get_disagg, get_serving

        host, port = str(get_serving().host), int(get_disagg().disaggregation_bootstrap_port)
    except Exception:
        pass
    return _Topology(
        pp_rank=int(getattr(args, "pp_rank", 0) or 0), system_dp_rank=int(getattr(args, "system_dp_rank", 0) or 0),
        host=host, bootstrap_port=port, **values,
    )


def _load_balance_method(server_args: Any) -> str:
    try:
        from sglang.srt.runtime_context import get_parallel

        return str(get_parallel().load_balance_method)
    except Exception:
        return str(getattr(server_args, "load_balance_method", "follow_bootstrap_room"))


def _local_ip() -> str:
    """The address other hosts reach this rank at: sglang's own ``get_local_ip_auto()`` (what its
    common manager registers as ``rank_ip`` and binds to; ``SGLANG_HOST_IP``/``HOST_IP`` override
    it), never the HTTP ``--host`` (127.0.0.1 by default)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except ImportError:  # an sglang without it: the interface the default route leaves by
        get_local_ip_auto = None
    if get_local_ip_auto is not None:
        return get_local_ip_auto()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent
        return s.getsockname()[0]
    finally:
        s.close()


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"


def _model_kv_heads(server_args: Any, attn_tp: int) -> Tuple[int, int]:
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


def _refuse_staging_buffer() -> None:
    """sglang's staging buffer (``SGLANG_DISAGG_STAGING_BUFFER=1``) replaces the sender's chunk
    grid with its own (``get_max_transfer_tokens`` is overridden in prefill.py) and runs its own
    staging handler on the decode: kvstage stages itself, the two cannot be combined."""
    try:
        from sglang.srt.environ import envs

        on = bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get())
    except Exception:
        on = os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true", "yes", "on")
    if on:
        raise ValueError(
            "kvstage backend: SGLANG_DISAGG_STAGING_BUFFER=1 is sglang's own staging path (for the "
            "mooncake/nixl backends); kvstage stages heterogeneous TP itself: unset it"
        )


# -- what a rank registers ----------------------------------------------------------------------------


def kv_layout_from_args(args: KVArgs, topo: _Topology, is_mla: bool, server_args: Any = None) -> Tuple[kvstage.KvLayout, int]:
    """The rank's KV pool as a :class:`kvstage.KvLayout`, from ``KVArgs`` as sglang fills it
    (``get_kv_transfer_buf_infos``: K of every layer, then V of every layer; ``kv_item_lens``:
    bytes of one page of one layer). Returns the layout and the bytes of one token over all of
    this rank's layers (K and V)."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    num_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if num_draft:
        raise NotImplementedError("kvstage backend: a draft model's KV pool (speculative decoding) is not wired yet")
    page = int(args.page_size)
    dtype_bytes = _DTYPE_BYTES.get(str(getattr(args, "kv_cache_dtype_str", "") or "").lower(), 1)
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
            heads, local = _model_kv_heads(server_args, topo.attn_tp_size)
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


class _StateGroup(msgspec.Struct):
    state_index: int  # index in KVArgs.state_types (and in send/send_metadata's state_indices)
    name: str


def components_from_args(args: KVArgs, state_tp: int) -> Tuple[List[Any], List[_StateGroup], int]:
    """sglang's metadata buffers (one :class:`AuxBuffer` each) and state pools (one
    :class:`StateComponent` per state tensor, its layers together) from ``KVArgs``. Returns the
    components, which state type each state component belongs to, and the bytes of the parts of
    one request (aux rows and state slots of this rank)."""
    comps: List[Any] = []
    groups: List[_StateGroup] = []
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
            groups.append(_StateGroup(s, f"{st_value}{t}"))
            part_bytes += item * len(run)
    return comps, groups, part_bytes


def _state_slots(groups: List[_StateGroup], state_indices: Optional[List]) -> List[int]:
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


def _pages(indices: Any) -> List[int]:
    return [int(x) for x in np.asarray(indices).reshape(-1)]


# -- the decode -> prefill metadata message ----------------------------------------------------------


class DecodeLayout(msgspec.Struct):
    """A decode rank's KV shape (what the prefill side pairs with; no addresses)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layer_ids: List[int]
    global_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    model: str


class RoomMetadata(msgspec.Struct):
    """sglang's pre-allocation message, kvstage edition: one per (decode rank, prefill rank)."""

    room: int
    room_key: int
    address: str  # the decode rank's kvstage engine
    decode: DecodeLayout
    chunk_tokens: int
    num_chunks: int
    num_pages: int
    prefix_tokens: int
    trace_id: str
    notify: str = ""  # the decode rank's failure socket (zmq PULL): "tcp://ip:port"


class RoomFailure(msgspec.Struct):
    """prefill -> decode: this rank cannot serve (or gave up on) the decode rank's opening."""

    room: int
    room_key: int
    reason: str


def _grid_of(meta: RoomMetadata) -> Tuple[int, int, int, int]:
    return (meta.chunk_tokens, meta.num_chunks, meta.num_pages, meta.prefix_tokens)


def _check_grid(meta: RoomMetadata, prefill_page: int) -> None:
    """A message's grid is one this rank can fill (refused else: a peer's bug, a stray sender, or
    a decode-side cached prefix that ends inside a prefill page, which sglang's
    ``kv_to_page_indices`` cannot start a send at)."""
    d = meta.decode
    if min(meta.chunk_tokens, meta.num_chunks, meta.num_pages, d.page_size) <= 0 or meta.prefix_tokens < 0:
        raise ValueError(f"room {meta.room}: grid {_grid_of(meta)} (chunk tokens, chunks, pages, prefix) out of range")
    if meta.prefix_tokens % d.page_size or meta.prefix_tokens % prefill_page:
        raise ValueError(
            f"room {meta.room}: a decode-side cached prefix of {meta.prefix_tokens} tokens is not on a page of "
            f"both sides (decode {d.page_size}, prefill {prefill_page})"
        )


_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(RoomMetadata)
_failure_decoder = msgspec.msgpack.Decoder(RoomFailure)


# -- manager --------------------------------------------------------------------------------------------


class KvstageKVManager(BaseKVManager):
    """One rank's kvstage engine, built from sglang's ``KVArgs``."""

    supports_role_switch = False
    # What sglang's schedulers read off every manager (context parallelism is not wired).
    attn_cp_size = 1
    attn_cp_rank = 0
    enable_all_cp_ranks_for_transfer = False
    enable_staging = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any, is_mla_backend: Optional[bool] = False):
        _refuse_staging_buffer()
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.topo = _topology(server_args, args)
        policy = getattr(server_args, "disaggregation_decode_allocation_policy", "early") or "early"
        if policy != "early":
            raise NotImplementedError(f"kvstage backend: --disaggregation-decode-allocation-policy {policy} is not wired yet (early is)")
        self.local_ip = _local_ip()
        self.layout, self.token_bytes = kv_layout_from_args(args, self.topo, self.is_mla_backend, server_args)
        self.components, self.state_groups, self.part_bytes = components_from_args(args, self.topo.attn_tp_size)
        self.page_size = int(args.page_size)
        self.bootstrap_timeout_s = _env_float("KVSTAGE_SGLANG_BOOTSTRAP_TIMEOUT_S", _sglang_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0))
        self.waiting_timeout_s = _env_float("KVSTAGE_SGLANG_WAITING_TIMEOUT_S", _sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0))
        self.http_timeout_s = _env_float("KVSTAGE_SGLANG_HTTP_TIMEOUT_S", 5.0)
        self.transfer_timeout_ms = _env_int("KVSTAGE_SGLANG_TRANSFER_TIMEOUT_MS", 60_000)
        self.connect_timeout_ms = _env_int("KVSTAGE_SGLANG_CONNECT_TIMEOUT_MS", 5_000)
        # A decode room's release waits this long for a writer that still holds its pages, then
        # says "not free yet" and is retried (the scheduler thread is never held longer).
        self.release_timeout_ms = _env_int("KVSTAGE_SGLANG_RELEASE_TIMEOUT_MS", 100)
        self.lock = threading.Lock()
        transport = os.environ.get("KVSTAGE_SGLANG_TRANSPORT") or None
        decode = disaggregation_mode == DisaggregationMode.DECODE
        engine_kwargs: Dict[str, Any] = dict(
            transport=transport,
            # Decode: the only call that takes the default is the room release (its bound).
            default_timeout_ms=self.release_timeout_ms if decode else self.transfer_timeout_ms,
            dead_peer_timeout_ms=_env_int("KVSTAGE_SGLANG_DEAD_PEER_TIMEOUT_MS", 10_000),
            room_timeout_ms=int(self.waiting_timeout_s * 1000),
        )
        listen = _host_port(self.local_ip, _env_int("KVSTAGE_SGLANG_PORT", 0)) if decode else None
        self.engine = kvstage.Engine(listen, **{k: v for k, v in engine_kwargs.items() if v is not None})
        self.engine.register_pool(self.layout)
        if self.components:
            self.engine.register_components(self.components)
        self._zmq = zmq.Context()
        self._closed = threading.Event()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._init_prefill()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self._init_decode()
        else:
            raise ValueError(f"kvstage backend: unsupported disaggregation mode {disaggregation_mode}")

    # -- prefill side --------------------------------------------------------------------------

    def _init_prefill(self) -> None:
        self.transfer_infos: Dict[int, Dict[Any, RoomMetadata]] = {}
        self.expected: Dict[int, int] = {}
        self.arrived: Dict[int, float] = {}
        # Rooms this rank finished with: a decode rank's message that arrives after (one this
        # rank does not write to) is dropped instead of waiting for a request that is gone.
        self.finished: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self.sessions: Dict[str, kvstage.Session] = {}
        self.session_lock = threading.Lock()
        # Rooms this rank cannot serve (room -> reason): their sender fails at once.
        self.refused: "collections.OrderedDict[int, str]" = collections.OrderedDict()
        self.notify_push: Dict[str, zmq.Socket] = {}
        self.notify_lock = threading.Lock()
        self.pull = self._zmq.socket(zmq.PULL)
        if ":" in self.local_ip:
            self.pull.setsockopt(zmq.IPV6, 1)
        self.rank_port = self.pull.bind_to_random_port(f"tcp://{self.local_ip if ':' not in self.local_ip else '[' + self.local_ip + ']'}")
        self._thread = threading.Thread(target=self._recv_loop, name="kvstage-sglang-meta", daemon=True)
        self._thread.start()
        self.register_to_bootstrap()

    def register_to_bootstrap(self) -> None:
        """``PUT /route`` on the prefill server's bootstrap registry (sglang's own payload)."""
        t = self.topo
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(t.host, t.host)
        dist = getattr(self.server_args, "dist_init_addr", None)
        if dist:
            host = str(dist).rsplit(":", 1)[0]
        url = f"http://{host}:{t.bootstrap_port}/route"
        payload = {
            "attn_tp_size": t.attn_tp_size, "attn_tp_rank": t.attn_tp_rank,
            "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": t.attn_dp_size, "attn_dp_rank": t.attn_dp_rank,
            "pp_size": t.pp_size, "pp_rank": t.pp_rank,
            "system_dp_size": t.system_dp_size, "system_dp_rank": t.system_dp_rank,
            "rank_ip": self.local_ip, "rank_port": self.rank_port,
            "page_size": self.page_size,
            "kv_cache_dtype": getattr(self.kv_args, "kv_cache_dtype_str", None),
            "load_balance_method": _load_balance_method(self.server_args),
            "prefill_http_port": getattr(self.server_args, "port", None),
            "decode_allocation_policy": "early",
        }
        deadline = time.monotonic() + _env_float("KVSTAGE_SGLANG_REGISTER_TIMEOUT_S", 60.0)
        last = ""
        while time.monotonic() < deadline:
            try:
                r = requests.put(url, json=payload, timeout=self.http_timeout_s)
                if r.status_code == 200:
                    logger.debug("kvstage: registered prefill rank %s at %s", payload, url)
                    return
                last = f"HTTP {r.status_code}: {r.text}"
            except requests.RequestException as e:
                last = str(e)
            time.sleep(0.2)
        raise RuntimeError(f"kvstage backend: prefill rank could not register at the bootstrap server {url}: {last}")

    def _prefill_pairs(self, meta: RoomMetadata) -> List[Tuple[int, int]]:
        d = meta.decode
        stage = kvstage.KvLayout(
            head_dim=d.head_dim, global_heads=d.global_heads, page_size=d.page_size, dtype_bytes=d.dtype_bytes,
            model=d.model, tp_rank=0, tp_size=d.tp_size, pp_rank=d.pp_rank, pp_size=d.pp_size,
            layer_ids=d.layer_ids, capacity_pages=1,
        )
        if d.pp_size != 1:
            raise NotImplementedError("kvstage backend: decode pipeline parallelism is not wired yet")
        return kvstage.pairing_decode_ranks(self.layout, [stage], self.components)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        next_purge = time.monotonic() + 10
        while not self._closed.is_set():
            if time.monotonic() > next_purge:
                self._purge_stale()
                next_purge = time.monotonic() + 10
            try:
                if not poller.poll(200):
                    continue
                raw = self.pull.recv()
            except zmq.ZMQError:
                return
            meta = None
            try:
                meta = _meta_decoder.decode(raw)
                _check_grid(meta, self.page_size)
                pairs = self._prefill_pairs(meta)
            except Exception as e:  # a message this rank cannot use: say so, keep serving
                if meta is None:
                    logger.error("kvstage backend: bad metadata message: %s", e)
                    continue
                reason = f"prefill rank {self.topo.attn_tp_rank} cannot serve this request: {type(e).__name__}: {e}"
                logger.error("kvstage backend: room %s (%s): %s", meta.room, meta.trace_id, reason)
                with self.lock:
                    self.refused[meta.room] = reason
                    while len(self.refused) > 4096:
                        self.refused.popitem(last=False)
                self.notify_decode(meta, reason)
                continue
            key = (meta.decode.tp_rank, meta.decode.pp_rank)
            with self.lock:
                if meta.room in self.finished:
                    continue
                # Every decode rank writes to every prefill rank of the DP group; a rank keeps the
                # ones it writes to (none at all for a dummy rank: MLA or replicated heads with a
                # decode TP below the prefill's), and any one for the grid. One record per room:
                # a message whose grid differs from the room's, or a second opening of a decode
                # rank (another key), is refused, never mixed in.
                infos = self.transfer_infos.get(meta.room)
                if infos is not None:
                    first = infos[None]
                    clash = ""
                    if _grid_of(first) != _grid_of(meta):
                        clash = f"grid {_grid_of(meta)} differs from the room's {_grid_of(first)}"
                    elif key in infos and infos[key].room_key != meta.room_key:
                        clash = f"decode rank {key[0]} opened the room a second time (another key)"
                    if clash:
                        logger.error("kvstage backend: room %s (%s): metadata refused: %s", meta.room, meta.trace_id, clash)
                        continue
                self.arrived.setdefault(meta.room, time.monotonic())
                infos = self.transfer_infos.setdefault(meta.room, {})
                infos.setdefault(None, meta)
                if key in pairs:
                    infos[key] = meta
                self.expected[meta.room] = len(pairs)

    def notify_decode(self, meta: RoomMetadata, reason: str) -> None:
        """Tells the decode rank of ``meta`` that its opening failed here (its poll says Failed
        with ``reason`` instead of waiting for its room's deadline). Best effort."""
        if not meta.notify:
            return
        try:
            with self.notify_lock:
                sock = self.notify_push.get(meta.notify)
                if sock is None:
                    sock = self._zmq.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 1000)
                    sock.setsockopt(zmq.SNDTIMEO, 200)
                    if "[" in meta.notify:
                        sock.setsockopt(zmq.IPV6, 1)
                    sock.connect(meta.notify)
                    self.notify_push[meta.notify] = sock
                sock.send(_encoder.encode(RoomFailure(meta.room, meta.room_key, reason)))
        except zmq.ZMQError as e:
            logger.warning("kvstage backend: room %s: failure not delivered to %s: %s", meta.room, meta.notify, e)

    def refusal(self, room: int) -> Optional[str]:
        with self.lock:
            return self.refused.get(room)

    def room_infos(self, room: int) -> List[RoomMetadata]:
        """Every decode rank's message of ``room`` this rank has (for failure notices)."""
        with self.lock:
            infos = self.transfer_infos.get(room) or {}
            return [m for k, m in infos.items() if k is not None] or ([infos[None]] if None in infos else [])

    def room_ready(self, room: int) -> Optional[Tuple[RoomMetadata, List[RoomMetadata]]]:
        """Once every decode rank this prefill rank writes to has sent its metadata: the grid
        (any decode rank's message) and those ranks' messages (empty for a dummy rank)."""
        with self.lock:
            infos = self.transfer_infos.get(room)
            if infos is None:
                return None
            targets = [m for k, m in sorted((k, m) for k, m in infos.items() if k is not None)]
            if len(targets) < self.expected.get(room, 1 << 30):
                return None
            return infos[None], targets

    def forget_room(self, room: int) -> None:
        with self.lock:
            self.transfer_infos.pop(room, None)
            self.expected.pop(room, None)
            self.arrived.pop(room, None)
            self.finished[room] = None
            while len(self.finished) > 65536:
                self.finished.popitem(last=False)

    def _purge_stale(self) -> None:
        """Metadata of rooms no sender took up within the bootstrap and waiting timeouts (the
        request went to another DP group, or was aborted on this side before its sender)."""
        limit = time.monotonic() - (self.bootstrap_timeout_s + self.waiting_timeout_s)
        with self.lock:
            for room in [r for r, t in self.arrived.items() if t < limit]:
                self.transfer_infos.pop(room, None)
                self.expected.pop(room, None)
                self.arrived.pop(room, None)

    def session_to(self, address: str) -> kvstage.Session:
        with self.session_lock:
            s = self.sessions.get(address)
            if s is None:
                t = self.topo
                sid = f"sglang-p{t.attn_dp_rank}.{t.attn_tp_rank}.{t.pp_rank}-{address}"
                s = self.engine.connect(address, sid, self.connect_timeout_ms)
                self.sessions[address] = s
            return s

    def drop_session(self, address: str) -> None:
        with self.session_lock:
            s = self.sessions.pop(address, None)
        if s is not None:
            try:
                s.close()
            except Exception:
                pass

    # -- decode side ---------------------------------------------------------------------------

    def _init_decode(self) -> None:
        chunk = _env_int("KVSTAGE_SGLANG_CHUNK_TOKENS", 2048)
        self.chunk_tokens_wanted = max(chunk, self.page_size)
        ring = _env_int("KVSTAGE_SGLANG_RING_BYTES", 0)
        if ring <= 0:
            # A chunk of the grid (its tokens rounded to whole pages of both sides: prefill pages
            # up to 4x ours assumed here) with a request's parts; room for 4 of them in flight,
            # at least 2, at most 2 GiB beyond those 2, at least 16 MiB.
            chunk = (self.chunk_tokens_wanted + 4 * self.page_size) * self.token_bytes + self.part_bytes
            ring = max(2 * chunk, min(4 * chunk, 2 << 30), 16 << 20)
        self.engine.register_staging(ring)
        self.address = self.engine.listen_address
        # sglang's decode scheduler reads this table (bootstrap addr -> PrefillServerInfo) to
        # pick a request's prefill DP rank, and fills it through try_ensure_parallel_info.
        self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
        self.bootstrap_errors: Dict[str, str] = {}
        self.rank_info: Dict[Tuple[str, int, int, int], Tuple[str, int]] = {}
        self.push: Dict[Tuple[str, int], zmq.Socket] = {}
        self.push_lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvstage-sglang-bootstrap")
        self.unreleased: List[Tuple[Any, int, str]] = []
        self.release_thread: Optional[threading.Thread] = None
        # Failure notices of the prefill ranks ((room, key) -> reason), read by the receivers' poll.
        self.notify_pull = self._zmq.socket(zmq.PULL)
        if ":" in self.local_ip:
            self.notify_pull.setsockopt(zmq.IPV6, 1)
        bind_ip = self.local_ip if ":" not in self.local_ip else f"[{self.local_ip}]"
        self.notify_addr = f"tcp://{bind_ip}:{self.notify_pull.bind_to_random_port(f'tcp://{bind_ip}')}"
        self.remote_failures: "collections.OrderedDict[Tuple[int, int], str]" = collections.OrderedDict()
        self.notify_lock = threading.Lock()

    def decode_layout(self) -> DecodeLayout:
        L = self.layout
        return DecodeLayout(
            tp_rank=L.tp_rank, tp_size=L.tp_size, pp_rank=L.pp_rank, pp_size=L.pp_size,
            layer_ids=list(L.layer_ids) if L.layer_ids is not None else [],
            global_heads=L.global_heads, head_dim=L.head_dim, dtype_bytes=L.dtype_bytes,
            page_size=L.page_size, model="mla" if self.is_mla_backend else "mha",
        )

    def _get(self, bootstrap_addr: str, params: Dict[str, int]) -> Any:
        url = f"http://{bootstrap_addr}/route"
        deadline = time.monotonic() + self.bootstrap_timeout_s
        last = ""
        while True:
            try:
                r = requests.get(url, params=params, timeout=(min(self.http_timeout_s, 2.0), self.http_timeout_s))
            except requests.Timeout:
                raise RuntimeError(
                    f"bootstrap server {bootstrap_addr} did not answer GET /route within {self.http_timeout_s:g}s "
                    "(is it an sglang prefill server's bootstrap port, and is it alive?)"
                )
            except requests.RequestException as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return r.json()
                last = f"HTTP {r.status_code}: {r.text.strip()}"
                if r.status_code not in (503,):
                    raise RuntimeError(f"bootstrap server {bootstrap_addr} refused GET /route {params}: {last}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"bootstrap server {bootstrap_addr}: no prefill ranks within {self.bootstrap_timeout_s:g}s ({last})")
            time.sleep(0.2)

    @staticmethod
    def _server_info(data: Dict[str, Any]) -> PrefillServerInfo:
        known = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        info = PrefillServerInfo(**{k: v for k, v in data.items() if k in known})
        if info.attn_cp_size != 1:
            raise NotImplementedError("kvstage backend: prefill context parallelism is not wired yet")
        return info

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """sglang's decode scheduler calls this once per scheduling cycle for a prefill server it
        has no info on yet (one registry request, bounded by KVSTAGE_SGLANG_HTTP_TIMEOUT_S); it
        aborts the server's requests after enough False answers."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = f"http://{bootstrap_addr}/route"
        params = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
        try:
            r = requests.get(url, params=params, timeout=(min(self.http_timeout_s, 2.0), self.http_timeout_s))
            if r.status_code != 200:
                self.bootstrap_errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} answered HTTP {r.status_code}: {r.text.strip()}"
                return False
            self.prefill_info_table[bootstrap_addr] = self._server_info(r.json())
        except requests.Timeout:
            self.bootstrap_errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} did not answer GET /route within {self.http_timeout_s:g}s"
            return False
        except requests.RequestException as e:
            self.bootstrap_errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} unreachable: {type(e).__name__}: {e}"
            return False
        self.bootstrap_errors.pop(bootstrap_addr, None)
        return True

    def resolve_prefill(self, bootstrap_addr: str, prefill_dp_rank: int) -> Tuple[PrefillServerInfo, List[Tuple[str, int]]]:
        """The prefill server's layout and every rank of its DP group (address of its metadata
        socket), from sglang's bootstrap registry; cached per server until a request fails."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            data = self._get(bootstrap_addr, {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1})
            info = self._server_info(data)
            self.prefill_info_table[bootstrap_addr] = info
        ranks = []
        for tp in range(info.attn_tp_size):
            for pp in range(info.pp_size):
                k = (bootstrap_addr, prefill_dp_rank, tp, pp)
                addr = self.rank_info.get(k)
                if addr is None:
                    r = self._get(bootstrap_addr, {"prefill_dp_rank": prefill_dp_rank, "prefill_cp_rank": 0, "target_tp_rank": tp, "target_pp_rank": pp})
                    addr = (str(r["rank_ip"]), int(r["rank_port"]))
                    with self.lock:
                        self.rank_info[k] = addr
                ranks.append(addr)
        return info, ranks

    def invalidate(self, bootstrap_addr: str) -> None:
        """Forget what the registry said about a prefill server (after a request from it failed:
        the next request looks it up again, a restarted prefill rank has a new address). The
        metadata sockets stay: other requests' messages may still be on their way."""
        with self.lock:
            self.prefill_info_table.pop(bootstrap_addr, None)
            for k in [k for k in self.rank_info if k[0] == bootstrap_addr]:
                self.rank_info.pop(k, None)

    def remote_failure(self, room: int, key: int) -> Optional[str]:
        """A prefill rank's failure notice for the opening (``room``, ``key``), if one came."""
        with self.notify_lock:
            while True:
                try:
                    raw = self.notify_pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                try:
                    f = _failure_decoder.decode(raw)
                except Exception as e:
                    logger.error("kvstage backend: bad failure notice: %s", e)
                    continue
                self.remote_failures.setdefault((f.room, f.room_key), f.reason)
                while len(self.remote_failures) > 4096:
                    self.remote_failures.popitem(last=False)
            return self.remote_failures.pop((room, key), None)

    def release_room(self, room: "kvstage.Room") -> Tuple[bool, str]:
        """(True, "") once ``room`` is released and its pages free; (False, why) while kvstage
        says a writer still holds them ("not free yet": call again)."""
        try:
            room.release()
        except kvstage.KVStageError as e:
            if e.code == Status.E_TIMEOUT:
                return False, _describe_error(e)
            logger.warning("kvstage backend: releasing room %s: %s", room.room, _describe_error(e))
        return True, ""

    def release_later(self, room: "kvstage.Room", bootstrap_room: int, trace_id: str) -> None:
        """A room sglang cleared while kvstage still said its pages are held: retried in the
        background until free (logged both ways)."""
        with self.lock:
            self.unreleased.append((room, bootstrap_room, trace_id))
            if self.release_thread is None:
                self.release_thread = threading.Thread(target=self._release_loop, name="kvstage-sglang-release", daemon=True)
                self.release_thread.start()

    def _release_loop(self) -> None:
        while not self._closed.wait(0.2):
            with self.lock:
                pending, self.unreleased = self.unreleased, []
            keep = []
            for room, br, trace in pending:
                ok, why = self.release_room(room)
                if ok:
                    logger.warning("kvstage backend: room %s (%s): released late, its pages are free", br, trace)
                else:
                    keep.append((room, br, trace))
            with self.lock:
                self.unreleased.extend(keep)

    def send_to_prefill(self, addr: Tuple[str, int], payload: bytes) -> None:
        with self.push_lock:
            sock = self.push.get(addr)
            if sock is None:
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, int(self.http_timeout_s * 1000))
                if ":" in addr[0]:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(f"tcp://{_host_port(addr[0], addr[1])}")
                self.push[addr] = sock
            sock.send(payload)

    # -- shared ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._thread.join(timeout=2)
            for sock in self.notify_push.values():
                sock.close(linger=0)
            for s in list(self.sessions.values()):
                try:
                    s.close()
                except Exception:
                    pass
        else:
            self.executor.shutdown(wait=False, cancel_futures=True)
            for sock in self.push.values():
                sock.close(linger=0)
            self.notify_pull.close(linger=0)
        try:
            self.engine.close()
        finally:
            self._zmq.destroy(linger=0)


# -- sender (prefill) -------------------------------------------------------------------------------------


class _Target(msgspec.Struct):
    meta: RoomMetadata
    session: Any = None


class KvstageKVSender(BaseKVSender):
    """One request on one prefill rank: the chunks of the decode's grid, as kvstage transfers."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.trace_id = trace_id_of(self.bootstrap_room)
        self.created = time.monotonic()
        self.targets: Optional[List[_Target]] = None
        self.grid: Optional[RoomMetadata] = None
        self.aux_index: Optional[int] = None
        self.ops: List[Tuple[Any, _Target, int]] = []
        self.pending_pages: List[int] = []
        self.pending_tokens = 0
        self.tokens_sent = 0
        self.next_chunk = 0
        self.last_sent = False
        self.failed: Optional[Tuple[str, Optional[BaseException]]] = None
        self.succeeded = False
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        self.bytes_sent = 0

    # sglang's surface ------------------------------------------------------------------------

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.aux_index = None if aux_index is None else int(aux_index)

    def _resolve_targets(self) -> Optional[List[_Target]]:
        if self.targets is None:
            ready = self.kv_mgr.room_ready(self.bootstrap_room)
            if ready is not None:
                self.grid = ready[0]
                self.targets = [_Target(m) for m in ready[1]]
        return self.targets

    def get_max_transfer_tokens(self) -> Optional[int]:
        """The decode's chunk grid: every ``send`` covers at most one of its chunks."""
        return None if self._resolve_targets() is None else self.grid.chunk_tokens

    def pop_decode_prefix_len(self) -> int:
        return 0 if self._resolve_targets() is None else self.grid.prefix_tokens

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """As sglang's common sender: the last segment is sent even without pages (it carries
        the request's parts and ends the room)."""
        return num_pages > 0 or last_chunk

    def send(self, kv_indices, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None, **_ignored):
        if self.failed is not None:
            return
        targets = self._resolve_targets()
        if targets is None:
            self._fail("send() before the decode side's metadata arrived (poll() was not WaitingForInput)")
            return
        if self.started is None:
            self.started = time.monotonic()
        page = self.kv_mgr.page_size
        meta0 = self.grid
        grid = meta0.chunk_tokens
        pages = _pages(kv_indices)
        if num_kv_tokens is None:
            num_kv_tokens = len(pages) * page
        start = meta0.prefix_tokens + self.tokens_sent + self.pending_tokens
        # A send that starts inside a page repeats the previous send's last page.
        if start % page and self.pending_pages and pages and pages[0] == self.pending_pages[-1]:
            pages = pages[1:]
        self.pending_pages.extend(pages)
        self.pending_tokens += int(num_kv_tokens)
        is_last = state_indices is not None
        chunk_index = self.next_chunk
        last_chunk = chunk_index == meta0.num_chunks - 1
        if (self.pending_tokens < grid or last_chunk) and not is_last:
            # The rest of this chunk comes with the next send; the grid's last chunk waits for
            # the request's last send (its parts), which may bring no pages at all.
            return
        if self.pending_tokens > grid:
            self._fail(f"send() of {self.pending_tokens} tokens for chunk {chunk_index}: the decode's grid has {grid} tokens a chunk")
            return
        if is_last and not last_chunk:
            self._fail(
                f"the request ended at chunk {chunk_index} of a grid of {meta0.num_chunks} chunks "
                f"({self.tokens_sent + self.pending_tokens} tokens sent, decode opened {meta0.num_pages} pages)"
            )
            return
        parts = None
        if last_chunk:
            try:
                slots = _state_slots(self.kv_mgr.state_groups, state_indices)
            except ValueError as e:
                self._fail(str(e))
                return
            row = self.aux_index if self.aux_index is not None else 0
            parts = RequestParts(aux_row=row, state_slots=slots)
        chunk_start = meta0.prefix_tokens + self.tokens_sent
        src_offset = chunk_start % page
        for t in targets:
            try:
                if t.session is None:
                    t.session = self.kv_mgr.session_to(t.meta.address)
                op = t.session.transfer_async(
                    self.bootstrap_room, chunk_index, np.asarray(self.pending_pages, dtype=np.uint32),
                    self.kv_mgr.transfer_timeout_ms, room_key=t.meta.room_key,
                    src_token_offset=src_offset, num_tokens=self.pending_tokens,
                    trace_id=t.meta.trace_id, parts=parts,
                )
            except kvstage.KVStageError as e:
                if isinstance(e, (kvstage.TransportError, kvstage.ProtocolError)):
                    self.kv_mgr.drop_session(t.meta.address)
                self._fail(f"chunk {chunk_index} to decode rank {t.meta.decode.tp_rank} at {t.meta.address}: {_describe_error(e)}", e)
                return
            self.ops.append((op, t, chunk_index))
        self.bytes_sent += self.pending_tokens * self.kv_mgr.token_bytes
        self.tokens_sent += self.pending_tokens
        self.pending_pages, self.pending_tokens = [], 0
        self.next_chunk += 1
        if last_chunk:
            self.last_sent = True

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.succeeded:
            return KVPoll.Success
        if self._resolve_targets() is None:
            refused = self.kv_mgr.refusal(self.bootstrap_room)
            if refused is not None:
                self._fail(refused, notify=False)  # the decode rank was told already
                return KVPoll.Failed
            if time.monotonic() - self.created > self.kv_mgr.bootstrap_timeout_s:
                self._fail(f"no metadata from the decode side within {self.kv_mgr.bootstrap_timeout_s:g}s (bootstrap timeout)")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        if not self.ops and not self.last_sent:
            return KVPoll.WaitingForInput
        still: List[Tuple[Any, _Target, int]] = []
        for op, t, k in self.ops:
            try:
                st = op.poll()
            except kvstage.KVStageError as e:
                if isinstance(e, (kvstage.TransportError, kvstage.ProtocolError)):
                    self.kv_mgr.drop_session(t.meta.address)
                self._fail(f"chunk {k} to decode rank {t.meta.decode.tp_rank} at {t.meta.address}: {_describe_error(e)}", e)
                self._cancel_ops()
                return KVPoll.Failed
            if st == Status.PENDING:
                still.append((op, t, k))
            elif st == Status.FALLBACK:
                self._fail(
                    f"chunk {k}: the decode's staging ring cannot hold one chunk of its grid "
                    "(raise KVSTAGE_SGLANG_RING_BYTES on the decode side or lower KVSTAGE_SGLANG_CHUNK_TOKENS)"
                )
                self._cancel_ops()
                return KVPoll.Failed
            else:
                op.close()
        self.ops = still
        if self.last_sent and not self.ops:
            self.succeeded = True
            self.finished = time.monotonic()
            self.kv_mgr.forget_room(self.bootstrap_room)
            return KVPoll.Success
        return KVPoll.Transferring

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished is not None:
            latency = self.finished - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes_sent or None)

    def failure_exception(self):
        reason, cause = self.failed or ("transfer failed", None)
        raise KvstageTransferError(self.bootstrap_room, reason, self.trace_id, cause)

    def abort(self):
        self._fail("aborted by the prefill scheduler")
        self._cancel_ops()

    def clear(self):
        self._cancel_ops()
        self.kv_mgr.forget_room(self.bootstrap_room)

    # helpers ------------------------------------------------------------------------------------

    def _fail(self, reason: str, cause: Optional[BaseException] = None, notify: bool = True) -> None:
        if self.failed is None:
            self.failed = (reason, cause)
            logger.error("kvstage backend: room %s (%s): %s", self.bootstrap_room, self.trace_id, reason)
            if notify:  # the decode ranks this rank knows of fail now, not at their room's deadline
                metas = [t.meta for t in self.targets] if self.targets is not None else self.kv_mgr.room_infos(self.bootstrap_room)
                for m in metas:
                    self.kv_mgr.notify_decode(m, f"prefill rank {self.kv_mgr.topo.attn_tp_rank}: {reason}")
            self.kv_mgr.forget_room(self.bootstrap_room)

    def _cancel_ops(self) -> None:
        for op, _t, _k in self.ops:
            try:
                op.cancel()
            except Exception:
                pass
            try:
                op.close()
            except Exception:
                pass
        self.ops = []


# -- receiver (decode) ---------------------------------------------------------------------------------------


class KvstageKVReceiver(BaseKVReceiver):
    """One request on one decode rank: a kvstage room with its pages, aux row and state slots."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, prefill_dp_rank: Optional[int] = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.trace_id = trace_id_of(self.bootstrap_room)
        self.created = time.monotonic()
        self.resolving: Optional[concurrent.futures.Future] = None
        self.prefill: Optional[Tuple[Dict[str, Any], List[Tuple[str, int]]]] = None
        self.room: Optional[kvstage.Room] = None
        self.failed: Optional[Tuple[str, Optional[BaseException]]] = None
        self.succeeded = False
        self.got_chunk = False
        self.conclude_state: Optional[int] = None
        # Read by sglang's decode scheduler (staging handler, deferred KV release): neither applies.
        self.require_staging = False
        self.abort_notified = False
        # A room whose release kvstage refused (a writer still holds its pages): poll() keeps
        # the request in flight until a release succeeds (sglang frees the pages on Failed or
        # Success), clear() hands it to the manager's retries.
        self.unreleased = False
        self.last_state = KVPoll.Bootstrapping
        if prefill_dp_rank is not None:
            self.init(prefill_dp_rank)

    def init(self, prefill_dp_rank: int = 0):
        """Looks the prefill server up in its bootstrap registry (in the background: ``poll()``
        says Bootstrapping until it answered, Failed with the reason if it did not)."""
        if self.resolving is None:
            dp = int(prefill_dp_rank or 0)
            self.resolving = self.kv_mgr.executor.submit(self.kv_mgr.resolve_prefill, self.bootstrap_addr, dp)

    def _check_resolved(self) -> bool:
        if self.prefill is not None:
            return True
        if self.resolving is None or not self.resolving.done():
            return False
        try:
            self.prefill = self.resolving.result()
        except Exception as e:
            self._fail(f"bootstrap of room {self.bootstrap_room} failed: {e}", e)
            return False
        return True

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None, **_ignored):
        if self.failed is not None:
            return
        if not self._check_resolved():
            if self.resolving is not None:
                try:
                    self.prefill = self.resolving.result(timeout=self.kv_mgr.bootstrap_timeout_s)
                except Exception as e:
                    self._fail(f"bootstrap of room {self.bootstrap_room} failed: {e}", e)
                    return
            else:
                self._fail("send_metadata() before init()")
                return
        if destination is not None and getattr(destination, "value", destination) not in ("device", None):
            self._fail("kvstage backend: host KV destinations are not supported")
            return
        info, ranks = self.prefill
        mgr = self.kv_mgr
        pages = _pages(kv_indices)
        prefix = int(decode_prefix_len or 0)
        prefill_page = int(info.page_size or mgr.page_size)
        step = mgr.page_size * prefill_page // math.gcd(mgr.page_size, prefill_page)
        chunk = max(step, (mgr.chunk_tokens_wanted // step) * step)
        try:
            slots = _state_slots(mgr.state_groups, state_indices)
            parts = RequestParts(aux_row=int(aux_index) if aux_index is not None else 0, state_slots=slots)
            self.room = mgr.engine.open_room(self.bootstrap_room, np.asarray(pages, dtype=np.uint32), chunk,
                                             parts=parts, prefix_tokens=prefix, trace_id=self.trace_id)
        except (kvstage.KVStageError, ValueError) as e:
            self._fail(f"opening room {self.bootstrap_room} ({len(pages)} pages) failed: {_describe_error(e)}", e)
            return
        g = self.room.grid
        meta = RoomMetadata(
            room=self.bootstrap_room, room_key=self.room.key, address=mgr.address, decode=mgr.decode_layout(),
            chunk_tokens=g.chunk_tokens, num_chunks=g.num_chunks, num_pages=g.num_pages,
            prefix_tokens=g.prefix_tokens, trace_id=self.trace_id, notify=mgr.notify_addr,
        )
        payload = _encoder.encode(meta)
        try:
            for addr in ranks:
                mgr.send_to_prefill(addr, payload)
        except zmq.ZMQError as e:
            self._fail(f"metadata to prefill rank {addr[0]}:{addr[1]} not delivered: {e}", e)
            return

    def poll(self) -> KVPoll:
        state = self._poll()
        if state in (KVPoll.Failed, KVPoll.Success) and not self._try_release():
            # kvstage says a writer may still write the room's pages: sglang frees them on
            # Failed/Success, so the request stays in flight until a release succeeds.
            return self.last_state
        self.last_state = state
        return state

    def _poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.succeeded:
            return KVPoll.Success
        if not self._check_resolved():
            return KVPoll.Failed if self.failed is not None else KVPoll.Bootstrapping
        if self.room is None:
            return KVPoll.WaitingForInput
        why = self.kv_mgr.remote_failure(self.bootstrap_room, self.room.key)
        if why is not None:
            self._fail(why, invalidate=False)
            return KVPoll.Failed
        try:
            events = self.room.poll_events()
        except kvstage.KVStageError as e:
            self._fail(f"room {self.bootstrap_room}: {_describe_error(e)}", e)
            return KVPoll.Failed
        for ev in events:
            if ev.kind == kvstage.RoomEventKind.ROOM:
                if ev.ok:
                    self.succeeded = True
                    self.conclude_state = KVPoll.Success
                    return KVPoll.Success
                self._fail_from_room(ev)
                return KVPoll.Failed
            if not ev.ok:
                self._fail_from_room(ev)
                return KVPoll.Failed
            self.got_chunk = True
        return KVPoll.Transferring if self.got_chunk else KVPoll.WaitingForInput

    def failure_exception(self):
        reason, cause = self.failed or ("transfer failed", None)
        raise KvstageTransferError(self.bootstrap_room, reason, self.trace_id, cause)

    def abort(self):
        reason = "aborted by the decode scheduler"
        if self.prefill is None:
            last = self.kv_mgr.bootstrap_errors.get(self.bootstrap_addr) if self.kv_mgr.disaggregation_mode == DisaggregationMode.DECODE else None
            reason += f" before the prefill server's bootstrap registry at {self.bootstrap_addr} answered"
            if last:
                reason += f" (last attempt: {last})"
        self._fail(reason, invalidate=False)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Deferred decode KV release is not supported (the manager says so): nothing to notify."""

    def clear(self):
        if not self._try_release():
            self.kv_mgr.release_later(self.room, self.bootstrap_room, self.trace_id)
            self.room = None

    @property
    def supports_host_destination(self) -> bool:
        return False

    # helpers ---------------------------------------------------------------------------------

    def _fail_from_room(self, ev: Any) -> None:
        cause: Optional[BaseException] = None
        reason = f"room {self.bootstrap_room}: {ev!r}"
        try:
            self.room.wait(1)
        except kvstage.KVStageError as e:
            cause = e
            reason = f"room {self.bootstrap_room} failed: {_describe_error(e)}"
        except Exception:
            pass
        self._fail(reason, cause)

    def _fail(self, reason: str, cause: Optional[BaseException] = None, invalidate: bool = True) -> None:
        if self.failed is None:
            self.failed = (reason, cause)
            self.conclude_state = KVPoll.Failed
            if invalidate:
                logger.error("kvstage backend: room %s (%s): %s", self.bootstrap_room, self.trace_id, reason)
                self.kv_mgr.invalidate(self.bootstrap_addr)
        self._try_release()

    def _try_release(self) -> bool:
        """Releases the room (bounded by KVSTAGE_SGLANG_RELEASE_TIMEOUT_MS): True once kvstage
        says nothing writes its pages any more, False while a writer still holds them."""
        room = self.room
        if room is None:
            return True
        ok, why = self.kv_mgr.release_room(room)
        if ok:
            self.room = None
            if self.unreleased:
                logger.warning("kvstage backend: room %s (%s): released, its pages are free", self.bootstrap_room, self.trace_id)
            return True
        if not self.unreleased:
            self.unreleased = True
            logger.error("kvstage backend: room %s (%s): pages not free yet, kept and retried: %s", self.bootstrap_room, self.trace_id, why)
        return False


class KvstageKVBootstrapServer(CommonKVBootstrapServer):
    """sglang's own bootstrap registry (prefill ranks register with ``PUT /route``, decode ranks
    look them up with ``GET /route``): kvstage needs nothing else from it."""
