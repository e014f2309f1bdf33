"""Typed wrappers of the C objects: KV layout, engine (pool, staging ring, rooms), session,
operation; the geometry helpers as functions."""

from __future__ import annotations

import ctypes
import json
import threading
import weakref
from ctypes import POINTER, byref, c_int32, c_size_t, c_uint32, c_uint64, c_void_p
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _lib
from ._buffers import buffer_info, page_array
from ._lib import (
    DEADLINE_INFINITE,
    Library,
    MemoryKind,
    ModelKind,
    Status,
    Transport,
    get_library,
)
from ._lib import ErrorClass
from .errors import ClosedHandleError, argument_error, last_error

# How deep this thread is inside completion callbacks (a replacement from inside one must keep
# the running callback's thunk alive).
_IN_CALLBACK = threading.local()

__all__ = [
    "Capabilities",
    "ChunkEvent",
    "Engine",
    "EngineStats",
    "HeadSlice",
    "KvLayout",
    "Operation",
    "Room",
    "Session",
    "SessionStats",
    "StagingLayout",
    "StagingWriter",
    "TransferTimings",
    "capabilities",
    "grid_tokens",
    "chunk_span",
    "ChunkSpan",
    "head_slice",
    "staging_layout",
    "transfer_timings_last",
    "version",
    "writers_per_chunk",
    "pairing_decode_ranks",
    "pairing_prefill_ranks",
]


def _check(lib: Library, rc: int, what: str) -> Status:
    """Raises the last error for a negative code; returns informational codes as :class:`Status`."""
    if rc < 0:
        raise last_error(lib, rc, what)
    try:
        return Status(rc)
    except ValueError:  # a future informational code
        return rc  # type: ignore[return-value]


def _u32(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 32:
        raise argument_error(name, f"{value} is outside 0..2^32")
    return value


def _u64(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        raise argument_error(name, f"{value} is outside 0..2^64")
    return value


def _enum(cls, value, name: str):
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            raise argument_error(name, f"{value!r} is not one of {', '.join(m.name.lower() for m in cls)}") from None
    try:
        return cls(value)
    except ValueError:
        raise argument_error(name, f"{value!r} is not a {cls.__name__} value") from None


# --- version and capabilities ----------------------------------------------------------------------


def version() -> str:
    """The loaded library's version (``kvstage_version_string()``)."""
    return get_library().version


class Capabilities(NamedTuple):
    """What the library can use on this host (``kvstage_capabilities_get``)."""

    tcp: bool
    rdma: bool
    host_memory: bool
    cuda_memory: bool


def capabilities() -> Capabilities:
    lib = get_library()
    caps = _lib.kvstage_capabilities()
    caps.struct_size = ctypes.sizeof(caps)
    _check(lib, lib.kvstage_capabilities_get(byref(caps)), "kvstage_capabilities_get")
    return Capabilities(bool(caps.tcp), bool(caps.rdma), bool(caps.host_memory), bool(caps.cuda_memory))


# --- KV layout -------------------------------------------------------------------------------------


class KvLayout:
    """One rank's KV pool (``kvstage_kv_layout``): its shape, and optionally its buffers.

    Buffers are token-major: token slot ``t`` of a buffer starts ``t * token_bytes`` bytes after its
    base, page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``. ``k_buffers`` (the latent
    buffers for MLA) and ``v_buffers`` hold one buffer per layer, each an int address or an array
    object (see :func:`kvstage.buffer_info`); the layout keeps them referenced.

    A layout without buffers describes a shape only: enough for :func:`staging_layout`, not for
    :meth:`Engine.register_pool`. ``num_layers`` defaults to ``len(layer_ids)`` or
    ``len(k_buffers)``; ``local_heads`` to ``max(1, global_heads // tp_size)`` (1 for MLA);
    ``capacity_pages`` to what the smallest buffer holds; ``memory`` to the buffers' kind.
    """

    def __init__(
        self,
        *,
        head_dim: int,
        global_heads: int = 1,
        local_heads: Optional[int] = None,
        page_size: int = 1,
        dtype_bytes: int = 2,
        model: Union[str, int, ModelKind] = ModelKind.MHA,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        layer_ids: Optional[Sequence[int]] = None,
        num_layers: Optional[int] = None,
        k_buffers: Optional[Sequence[Any]] = None,
        v_buffers: Optional[Sequence[Any]] = None,
        capacity_pages: Optional[int] = None,
        memory: Union[None, str, int, MemoryKind] = None,
    ):
        self.model = _enum(ModelKind, model, "model")
        self.head_dim = _u32(head_dim, "head_dim")
        self.global_heads = _u32(global_heads, "global_heads")
        self.page_size = _u32(page_size, "page_size")
        self.dtype_bytes = _u32(dtype_bytes, "dtype_bytes")
        self.tp_rank, self.tp_size = _u32(tp_rank, "tp_rank"), _u32(tp_size, "tp_size")
        self.pp_rank, self.pp_size = _u32(pp_rank, "pp_rank"), _u32(pp_size, "pp_size")
        if local_heads is None:
            local_heads = 1 if self.model == ModelKind.MLA else max(1, global_heads // max(1, tp_size))
        self.local_heads = _u32(local_heads, "local_heads")
        self.layer_ids = None if layer_ids is None else tuple(_u32(x, f"layer_ids[{i}]") for i, x in enumerate(layer_ids))
        if num_layers is None:
            if self.layer_ids is not None:
                num_layers = len(self.layer_ids)
            elif k_buffers is not None:
                num_layers = len(k_buffers)
            else:
                raise argument_error("num_layers", "is not given and neither layer_ids nor k_buffers tells it")
        self.num_layers = int(num_layers)
        if self.layer_ids is not None and len(self.layer_ids) != self.num_layers:
            raise argument_error("layer_ids", f"has {len(self.layer_ids)} entries, num_layers is {self.num_layers}")

        self._k: Optional[List[Any]] = None
        self._v: Optional[List[Any]] = None
        kinds = set()
        sizes: List[int] = []
        if k_buffers is not None:
            self._k = self._infos(k_buffers, "k_buffers", kinds, sizes)
            if self.model == ModelKind.MHA:
                if v_buffers is None:
                    raise argument_error("v_buffers", "is required for an MHA pool")
                self._v = self._infos(v_buffers, "v_buffers", kinds, sizes)
            elif v_buffers is not None:
                raise argument_error("v_buffers", "must be None for an MLA pool (one latent buffer per layer)")
        elif v_buffers is not None:
            raise argument_error("v_buffers", "given without k_buffers")

        if memory is not None:
            self.memory = _enum(MemoryKind, memory, "memory")
            if kinds and kinds != {self.memory}:
                raise argument_error("memory", f"is {self.memory.name.lower()} but the buffers are {sorted(k.name.lower() for k in kinds)}")
        elif len(kinds) > 1:
            raise argument_error("k_buffers", "mixes host and CUDA buffers")
        else:
            self.memory = next(iter(kinds)) if kinds else MemoryKind.HOST

        slot_bytes = self.page_size * self.token_bytes
        if capacity_pages is None and sizes and len(sizes) == len(self._k or []) + len(self._v or []) and slot_bytes:
            capacity_pages = min(sizes) // slot_bytes
        if capacity_pages is None and self._k is not None:
            raise argument_error("capacity_pages", "is required when the buffers are int addresses")
        self.capacity_pages = _u64(capacity_pages or 0, "capacity_pages")
        need = self.capacity_pages * slot_bytes
        for label, infos in (("k_buffers", self._k), ("v_buffers", self._v)):
            for i, info in enumerate(infos or []):
                if info.nbytes is not None and info.nbytes < need:
                    raise argument_error(
                        f"{label}[{i}]",
                        f"holds {info.nbytes} bytes, {self.capacity_pages} pages of {slot_bytes} bytes need {need}",
                    )

    def _infos(self, buffers: Sequence[Any], label: str, kinds: set, sizes: List[int]):
        buffers = list(buffers)
        if len(buffers) != self.num_layers:
            raise argument_error(label, f"has {len(buffers)} buffers, num_layers is {self.num_layers}")
        infos = [buffer_info(b, f"{label}[{i}]", writable=True) for i, b in enumerate(buffers)]
        for info in infos:
            if info.memory is not None:
                kinds.add(info.memory)
            if info.nbytes is not None:
                sizes.append(info.nbytes)
        return infos

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot of one buffer."""
        return self.local_heads * self.head_dim * self.dtype_bytes

    @property
    def buffer_bytes(self) -> int:
        """Bytes each buffer must hold: ``capacity_pages * page_size * token_bytes``."""
        return self.capacity_pages * self.page_size * self.token_bytes

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.model == ModelKind.MHA else 1

    @property
    def has_buffers(self) -> bool:
        return self._k is not None

    def _c(self) -> Tuple[_lib.kvstage_kv_layout, tuple]:
        """The C struct and the objects that must stay alive while it is used."""
        lib = get_library()
        c = _lib.kvstage_kv_layout()
        _check(lib, lib.kvstage_kv_layout_init(byref(c)), "kvstage_kv_layout_init")
        c.model_kind = int(self.model)
        c.page_size = self.page_size
        c.local_heads = self.local_heads
        c.global_heads = self.global_heads
        c.head_dim = self.head_dim
        c.dtype_bytes = self.dtype_bytes
        c.tp_rank, c.tp_size = self.tp_rank, self.tp_size
        c.pp_rank, c.pp_size = self.pp_rank, self.pp_size
        c.num_layers = self.num_layers
        c.capacity_pages = self.capacity_pages
        c.memory_kind = int(self.memory)
        keep: list = []
        if self.layer_ids is not None:
            ids = (c_uint32 * self.num_layers)(*self.layer_ids)
            c.layer_ids = ctypes.cast(ids, POINTER(c_uint32))
            keep.append(ids)
        if self._k is not None:
            ks = (c_uint64 * self.num_layers)(*(i.address for i in self._k))
            c.k_bases = ctypes.cast(ks, POINTER(c_uint64))
            keep.append(ks)
        if self._v is not None:
            vs = (c_uint64 * self.num_layers)(*(i.address for i in self._v))
            c.v_bases = ctypes.cast(vs, POINTER(c_uint64))
            keep.append(vs)
        return c, tuple(keep)

    def validate(self) -> None:
        """``kvstage_kv_layout_validate``: raises (naming the field) when the layout is unusable."""
        lib = get_library()
        c, _keep = self._c()
        _check(lib, lib.kvstage_kv_layout_validate(byref(c)), "kvstage_kv_layout_validate")

    def __repr__(self) -> str:
        return (
            f"KvLayout(model={self.model.name.lower()}, heads {self.local_heads}/{self.global_heads}, "
            f"head_dim={self.head_dim}, dtype_bytes={self.dtype_bytes}, page_size={self.page_size}, "
            f"tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}, layers={self.num_layers}, "
            f"capacity_pages={self.capacity_pages}, memory={self.memory.name.lower()}, "
            f"buffers={'yes' if self.has_buffers else 'no'})"
        )


# --- geometry helpers ------------------------------------------------------------------------------


class HeadSlice(NamedTuple):
    """Heads a prefill rank sends to a decode rank, in local head units."""

    src_head_start: int
    num_heads: int
    dst_head_start: int


def head_slice(src_tp: int, dst_tp: int, src_rank: int, dst_rank: int, total_kv_heads: int) -> HeadSlice:
    """``kvstage_head_slice_compute``: raises :class:`ArgumentError` (naming the argument) for ranks that do
    not exchange data and for unsupported TP combinations."""
    lib = get_library()
    out = _lib.kvstage_head_slice()
    args = [_u32(v, n) for v, n in ((src_tp, "src_tp"), (dst_tp, "dst_tp"), (src_rank, "src_rank"), (dst_rank, "dst_rank"), (total_kv_heads, "total_kv_heads"))]
    _check(lib, lib.kvstage_head_slice_compute(*args, byref(out)), "kvstage_head_slice_compute")
    return HeadSlice(out.src_head_start, out.num_heads, out.dst_head_start)


def writers_per_chunk(src_tp: int, dst_tp: int, src_pp: int = 1, dst_pp: int = 1, *, total_kv_heads: int, model="mha") -> int:
    """``kvstage_writers_per_chunk``: writers per chunk on a decode rank with equal pipeline stages
    (one per distinct head group under prefill-side replication; MLA: one TP writer)."""
    lib = get_library()
    out = c_uint32()
    kind = int(_enum(ModelKind, model, "model"))
    values = ((total_kv_heads, "total_kv_heads"), (src_tp, "src_tp"), (dst_tp, "dst_tp"), (src_pp, "src_pp"), (dst_pp, "dst_pp"))
    args = [_u32(v, n) for v, n in values]
    _check(lib, lib.kvstage_writers_per_chunk(kind, *args, byref(out)), "kvstage_writers_per_chunk")
    return out.value


class ByteRange(NamedTuple):
    """``kvstage_byte_range``: ``length`` bytes at ``src_offset`` of the prefill slot go to
    ``dst_offset`` of the decode slot."""

    src_offset: int
    dst_offset: int
    length: int


def state_slice(
    group_dims: Sequence[int], src_tp: int, dst_tp: int, src_rank: int, dst_rank: int, *, outer: int = 1, dtype_bytes: int = 2, replicated: bool = False
) -> List[ByteRange]:
    """``kvstage_state_slice_compute``: which bytes of prefill rank ``src_rank``'s state slot go
    where in decode rank ``dst_rank``'s, for an item of ``outer`` rows of ``sum(group_dims)``
    elements (each group sharded on its own across TP; ``replicated``: whole on every rank, sent
    from prefill rank ``dst_rank * src_tp // dst_tp`` alone). An empty list: the two ranks share
    nothing."""
    lib = get_library()
    dims = (c_uint32 * max(1, len(group_dims)))(*[_u32(g, "group_dims") for g in group_dims])
    item = _lib.kvstage_state_item()
    _check(lib, lib.kvstage_state_item_init(byref(item)), "kvstage_state_item_init")
    item.outer, item.dtype_bytes = _u32(outer, "outer"), _u32(dtype_bytes, "dtype_bytes")
    item.group_dims, item.num_groups, item.replicated = ctypes.cast(dims, POINTER(c_uint32)), len(group_dims), int(bool(replicated))
    ranks = [_u32(v, n) for v, n in ((src_tp, "src_tp"), (dst_tp, "dst_tp"), (src_rank, "src_rank"), (dst_rank, "dst_rank"))]
    count = c_size_t(0)
    _check(lib, lib.kvstage_state_slice_compute(byref(item), *ranks, None, 0, byref(count)), "kvstage_state_slice_compute")
    if count.value == 0:
        return []
    out = (_lib.kvstage_byte_range * count.value)()
    _check(lib, lib.kvstage_state_slice_compute(byref(item), *ranks, out, count.value, byref(count)), "kvstage_state_slice_compute")
    return [ByteRange(r.src_offset, r.dst_offset, r.len) for r in out[: count.value]]


def _stage_array(stages: Sequence[KvLayout]):
    """A ``kvstage_kv_layout`` array of ``stages`` and what keeps the memory it points to alive."""
    converted = [s._c() for s in stages]
    array = (_lib.kvstage_kv_layout * max(1, len(converted)))(*[c for c, _ in converted])
    return array, converted


def _pairing(fn: str, local: KvLayout, stages: Sequence[KvLayout]) -> List[Tuple[int, int]]:
    lib = get_library()
    clocal, _keep_local = local._c()
    array, keep = _stage_array(stages)
    count = c_size_t(0)
    _check(lib, getattr(lib, fn)(byref(clocal), array, len(keep), None, 0, byref(count)), fn)  # the count
    if count.value == 0:
        return []
    out = (_lib.kvstage_rank * count.value)()
    _check(lib, getattr(lib, fn)(byref(clocal), array, len(keep), out, count.value, byref(count)), fn)
    return [(out[i].tp_rank, out[i].pp_rank) for i in range(count.value)]


def pairing_decode_ranks(prefill: KvLayout, decode_stages: Sequence[KvLayout]) -> List[Tuple[int, int]]:
    """``kvstage_pairing_decode_ranks``: the ``(tp_rank, pp_rank)`` decode ranks prefill rank
    ``prefill`` must open sessions to; ``decode_stages[j]`` is a shape-only layout of decode stage ``j``."""
    return _pairing("kvstage_pairing_decode_ranks", prefill, decode_stages)


def pairing_prefill_ranks(decode: KvLayout, prefill_stages: Sequence[KvLayout]) -> List[Tuple[int, int]]:
    """``kvstage_pairing_prefill_ranks``: the ``(tp_rank, pp_rank)`` prefill ranks that write to decode
    rank ``decode``; ``prefill_stages[j]`` describes prefill stage ``j``."""
    return _pairing("kvstage_pairing_prefill_ranks", decode, prefill_stages)


def grid_tokens(chunk_tokens: int, page_size: int) -> int:
    """``kvstage_grid_tokens``: tokens per chunk of the chunk grid."""
    lib = get_library()
    out = c_uint32()
    rc = lib.kvstage_grid_tokens(_u32(chunk_tokens, "chunk_tokens"), _u32(page_size, "page_size"), byref(out))
    _check(lib, rc, "kvstage_grid_tokens")
    return out.value


class ChunkSpan(NamedTuple):
    """``kvstage_chunk_span``: where one chunk of a request lies on both sides."""

    #: Chunks of the request (the room's chunk count).
    num_chunks: int
    #: The chunk carries request tokens ``[first_token, first_token + num_tokens)``.
    first_token: int
    num_tokens: int
    #: Prefill: pages ``[src_first_page, src_first_page + src_num_pages)`` of the request's page
    #: list, the chunk starting ``src_token_offset`` slots into the first (pass both on to the
    #: transfer with ``num_tokens``).
    src_first_page: int
    src_num_pages: int
    src_token_offset: int
    #: Decode: pages ``[dst_first_page, dst_first_page + dst_num_pages)`` of the room's pages.
    dst_first_page: int
    dst_num_pages: int

    def src_pages(self, request_pages: Any) -> Any:
        """The transfer's ``pages``: this chunk's slice of the request's prefill page list."""
        return request_pages[self.src_first_page : self.src_first_page + self.src_num_pages]


def chunk_span(total_tokens: int, decode_prefix_tokens: int, src_page_size: int, dst_page_size: int, chunk_tokens: int, chunk_index: int) -> ChunkSpan:
    """``kvstage_chunk_span_compute``: chunk ``chunk_index`` of a request of ``total_tokens`` tokens whose
    first ``decode_prefix_tokens`` (whole decode pages) the decode side holds, on the room's chunk
    grid of ``chunk_tokens``, prefill pages of ``src_page_size`` and decode pages of
    ``dst_page_size`` tokens. Raises :class:`ArgumentError` naming a bad argument."""
    lib = get_library()
    out = _lib.kvstage_chunk_span()
    out.struct_size = ctypes.sizeof(out)
    rc = lib.kvstage_chunk_span_compute(
        _u64(total_tokens, "total_tokens"),
        _u64(decode_prefix_tokens, "decode_prefix_tokens"),
        _u32(src_page_size, "src_page_size"),
        _u32(dst_page_size, "dst_page_size"),
        _u32(chunk_tokens, "chunk_tokens"),
        _u32(chunk_index, "chunk_index"),
        byref(out),
    )
    _check(lib, rc, "kvstage_chunk_span_compute")
    return ChunkSpan(
        out.num_chunks, out.first_token, out.num_tokens, out.src_first_page, out.src_num_pages, out.src_token_offset, out.dst_first_page, out.dst_num_pages
    )


class StagingWriter(NamedTuple):
    """One writer's region of a staging allocation."""

    offset: int
    bytes: int
    layers: int
    src_tp_rank: int
    src_pp_rank: int
    tp_writer: int
    src_head_start: int
    num_heads: int
    dst_head_start: int


class StagingLayout(NamedTuple):
    """Layout of one staging allocation (one decode rank, one chunk). Writer ``w``'s slab for
    buffer ``kv`` and layer index ``l`` starts at
    ``writers[w].offset + (kv * writers[w].layers + l) * slab_bytes``."""

    total_bytes: int
    row_bytes: int
    slab_bytes: int
    tokens: int
    num_heads: int
    buffers_per_layer: int
    num_tp_writers: int
    writers: Tuple[StagingWriter, ...]


def staging_layout(prefill_stages: Union[KvLayout, Sequence[KvLayout]], dst: KvLayout, tokens: int) -> StagingLayout:
    """``kvstage_staging_layout_compute``: the staging allocation decode rank ``dst`` needs for a chunk of
    ``tokens`` tokens written by the prefill side; ``prefill_stages[j]`` is a shape-only layout of
    prefill stage ``j`` (one layout for a prefill side without pipeline stages). Writers are listed
    in (stage, head group) order; a receiver places them in arrival order, so run-time offsets may
    differ (sizes do not)."""
    lib = get_library()
    array, keep = _stage_array([prefill_stages] if isinstance(prefill_stages, KvLayout) else list(prefill_stages))
    cdst, _kd = dst._c()
    out = _lib.kvstage_staging_layout()
    out.struct_size = ctypes.sizeof(out)
    tokens = _u32(tokens, "tokens")
    fn = lib.kvstage_staging_layout_compute
    _check(lib, fn(array, len(keep), byref(cdst), tokens, byref(out), None, 0), "kvstage_staging_layout_compute")
    writers = (_lib.kvstage_staging_writer * max(1, out.num_writers))()
    rc = fn(array, len(keep), byref(cdst), tokens, byref(out), writers, out.num_writers)
    _check(lib, rc, "kvstage_staging_layout_compute")
    return StagingLayout(
        out.total_bytes,
        out.row_bytes,
        out.slab_bytes,
        out.tokens,
        out.num_heads,
        out.buffers_per_layer,
        out.num_tp_writers,
        tuple(
            StagingWriter(w.offset, w.bytes, w.layers, w.src_tp_rank, w.src_pp_rank, w.tp_writer, w.src_head_start, w.num_heads, w.dst_head_start)
            for w in writers[: out.num_writers]
        ),
    )


# --- handles ---------------------------------------------------------------------------------------


class _Handle:
    """An owned C handle: freed by close() (idempotent), the context manager, or garbage collection.

    Like the C API, close() must not race with other calls on the same object.
    """

    _kind = "kvstage handle"
    _free_fn = ""

    def __init__(self, lib: Library, ptr: int):
        self._lib = lib
        self._ptr: Optional[int] = ptr
        self._close_lock = threading.Lock()

    def _handle(self) -> int:
        ptr = self._ptr
        if ptr is None:
            raise ClosedHandleError(
                f"`{type(self).__name__.lower()}` ({self._kind}) is closed",
                code=Status.E_INVALID_ARG,
                klass=ErrorClass.CONFIG,
                session=getattr(self, "_session_id", ""),
            )
        return ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _before_free(self) -> None:
        pass

    def close(self) -> None:
        """Frees the handle. Idempotent; later calls on the object raise :class:`ClosedHandleError`."""
        with self._close_lock:
            if self._ptr is None:
                return
            self._before_free()
            ptr, self._ptr = self._ptr, None
            getattr(self._lib, self._free_fn)(ptr)

    def __enter__(self):
        self._handle()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


class TransferTimings(NamedTuple):
    """``kvstage_transfer_timings``: where one transfer (one chunk) spent its time, in
    nanoseconds; 0 for a phase that did not happen. The phases run in this order and ``total_ns``
    spans them all. In ``timings_sum`` of the stats, each field is summed over the transfers."""

    queued_ns: int = 0
    watermark_wait_ns: int = 0
    alloc_wait_ns: int = 0
    gather_ns: int = 0
    wire_ns: int = 0
    ack_ns: int = 0
    total_ns: int = 0

    @classmethod
    def _from_c(cls, c: Any) -> "TransferTimings":
        return cls(*(getattr(c, name) for name in cls._fields))


def _fields_from_c(cls: Any, c: Any) -> Any:
    """A NamedTuple of ``cls`` from the C struct ``c`` (same field names; nested timings too)."""
    values = []
    for name in cls._fields:
        v = getattr(c, name)
        values.append(TransferTimings._from_c(v) if isinstance(v, _lib.kvstage_transfer_timings) else v)
    return cls(*values)


class RoomOpening(NamedTuple):
    """What ``kvstage_room_open`` returns: the room's chunk count and this opening's key."""

    num_chunks: int
    key: int

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        return f"RoomOpening(num_chunks={self.num_chunks}, key=<hidden>)"


class RoomGrid(NamedTuple):
    """``kvstage_room_grid``: a room's chunk grid on the decode side."""

    chunk_tokens: int
    num_chunks: int
    num_pages: int


class SessionStats(NamedTuple):
    """``kvstage_session_stats``: a sender session's counters (see the README's Metrics)."""

    transport: Union[Transport, int]
    downgraded: int
    bytes_sent: int
    chunks_sent: int
    transfers_ok: int
    transfers_fallback: int
    transfers_failed: int
    transfers_timeout: int
    transfers_canceled: int
    transfers_peer_gone: int
    transfers_failed_other: int
    transfers_in_flight: int
    timed_transfers: int
    timings_sum: TransferTimings


def transfer_timings_last() -> TransferTimings:
    """``kvstage_transfer_timings_last``: the phase timings of the last synchronous transfer
    (:meth:`Session.transfer` or :meth:`Session.transfer_slices`) made on this thread."""
    lib = get_library()
    out = _lib.kvstage_transfer_timings()
    out.struct_size = ctypes.sizeof(out)
    _check(lib, lib.kvstage_transfer_timings_last(byref(out)), "kvstage_transfer_timings_last")
    return TransferTimings._from_c(out)


class EngineStats(NamedTuple):
    """``kvstage_engine_stats``."""

    ring_capacity: int
    ring_live_allocations: int
    watermark_round: int
    watermark_offset: int
    rdma_downgrades: int = 0
    rdma_sessions: int = 0
    connections: int = 0
    accept_errors: int = 0
    connections_refused: int = 0
    handshakes_failed: int = 0
    events_dropped: int = 0
    rooms_expired: int = 0
    thread_panics: int = 0
    # metrics
    bytes_sent: int = 0
    chunks_sent: int = 0
    transfers_ok: int = 0
    transfers_fallback: int = 0
    transfers_failed: int = 0
    transfers_timeout: int = 0
    transfers_canceled: int = 0
    transfers_peer_gone: int = 0
    transfers_failed_other: int = 0
    transfers_in_flight: int = 0
    timed_transfers: int = 0
    timings_sum: TransferTimings = TransferTimings()
    bytes_received: int = 0
    chunks_received: int = 0
    scatter_count: int = 0
    scatter_ns_sum: int = 0
    scatter_ns_max: int = 0
    ring_used_bytes: int = 0
    ring_high_water_bytes: int = 0
    shm_sessions: int = 0
    shm_downgrades: int = 0
    rdma_host_staging_sessions: int = 0
    shm_direct_sessions: int = 0
    shm_direct_chunks: int = 0
    regions_read_into_pool: int = 0


class ChunkEvent(NamedTuple):
    """A chunk that reached the decode KV pool (``status`` OK) or failed."""

    room: int
    chunk_index: int
    status: Union[Status, int]
    #: The key of the room's opening the chunk belongs to (tells a released request's late event
    #: apart from the next request's under the same room id).
    room_key: int = 0
    #: The request's trace id (the prefill caller's ``trace_id``, else derived from the opening).
    trace: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        return f"ChunkEvent(room={self.room}, chunk_index={self.chunk_index}, status={self.status!r})"


def _status(code: int) -> Union[Status, int]:
    try:
        return Status(code)
    except ValueError:
        return code


class Engine(_Handle):
    """``kvstage_engine``: listener, peers, the registered pool and staging ring, rooms.

    Options left ``None`` keep the library's defaults (``kvstage_engine_options_init``); the
    default listen address is ``"127.0.0.1:0"`` (a free port on loopback). The engine keeps the
    pool and ring memory objects referenced until it is closed.
    """

    _kind = "kvstage_engine"
    _free_fn = "kvstage_engine_free"

    def __init__(
        self,
        listen_address: Optional[str] = None,
        *,
        transport: Union[None, str, int, Transport] = None,
        worker_threads: Optional[int] = None,
        default_deadline_ms: Optional[int] = None,
        chunk_tokens: Optional[int] = None,
        send_staging_bytes: Optional[int] = None,
        cluster_token: Optional[str] = None,
        integrity: Optional[int] = None,
        max_connections: Optional[int] = None,
        max_handshakes: Optional[int] = None,
        handshake_timeout_ms: Optional[int] = None,
        max_events: Optional[int] = None,
        dead_peer_timeout_ms: Optional[int] = None,
        room_timeout_ms: Optional[int] = None,
        send_staging_buffers: Optional[int] = None,
        send_staging_total_bytes: Optional[int] = None,
        transfer_threads: Optional[int] = None,
        same_host: Optional[bool] = None,
        stall_warn_ms: Optional[int] = None,
        send_piece_bytes: Optional[int] = None,
        send_from_pool: Optional[bool] = None,
        same_host_direct: Optional[bool] = None,
        library: Optional[Library] = None,
    ):
        lib = library or get_library()
        opts = _lib.kvstage_engine_options()
        _check(lib, lib.kvstage_engine_options_init(byref(opts)), "kvstage_engine_options_init")
        address = None if listen_address is None else listen_address.encode("utf-8")
        opts.listen_address = address
        if transport is not None:
            opts.transport = int(_enum(Transport, transport, "transport"))
        if worker_threads is not None:
            opts.worker_threads = _u32(worker_threads, "worker_threads")
        if default_deadline_ms is not None:
            opts.default_deadline_ms = _u64(default_deadline_ms, "default_deadline_ms")
        if chunk_tokens is not None:
            opts.chunk_tokens = _u32(chunk_tokens, "chunk_tokens")
        if send_staging_bytes is not None:
            opts.send_staging_bytes = _u64(send_staging_bytes, "send_staging_bytes")
        token = None if cluster_token is None else cluster_token.encode("utf-8")
        opts.cluster_token = token
        if integrity is not None:
            opts.integrity = int(integrity)
        if same_host is not None:
            # kvstage_same_host: AUTO (0) lets transport AUTO take the same-host path, OFF (1) never.
            opts.same_host = 0 if same_host else 1
        if send_from_pool is not None:
            opts.send_from_pool = 1 if send_from_pool else 0
        if same_host_direct is not None:
            opts.same_host_direct = 1 if same_host_direct else 0
        for name, value, conv in (
            ("max_connections", max_connections, _u32),
            ("max_handshakes", max_handshakes, _u32),
            ("handshake_timeout_ms", handshake_timeout_ms, _u32),
            ("max_events", max_events, _u32),
            ("dead_peer_timeout_ms", dead_peer_timeout_ms, _u64),
            ("room_timeout_ms", room_timeout_ms, _u64),
            ("send_staging_buffers", send_staging_buffers, _u32),
            ("send_staging_total_bytes", send_staging_total_bytes, _u64),
            ("transfer_threads", transfer_threads, _u32),
            ("stall_warn_ms", stall_warn_ms, _u64),
            ("send_piece_bytes", send_piece_bytes, _u64),
        ):
            if value is not None:
                setattr(opts, name, conv(value, name))
        out = c_void_p()
        _check(lib, lib.kvstage_engine_new(byref(opts), byref(out)), "kvstage_engine_new")
        super().__init__(lib, out.value)
        self._pool: Optional[KvLayout] = None
        self._staging: List[Any] = []
        self._components: list = []
        self._callback: Any = None
        # Callbacks replaced from inside a callback, kept until a replacement from outside one.
        self._retired_callbacks: List[Any] = []
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()

    # -- identity ---------------------------------------------------------------------------------

    @property
    def listen_address(self) -> str:
        """The address the engine listens on (``"127.0.0.1:40123"``)."""
        buf = ctypes.create_string_buffer(256)
        rc = self._lib.kvstage_engine_listen_address(self._handle(), buf, len(buf), None)
        _check(self._lib, rc, "kvstage_engine_listen_address")
        return buf.value.decode("utf-8")

    def describe(self) -> dict:
        """``kvstage_engine_describe``: the engine as a dict (transport, the decode side's ring
        with its live allocations oldest first, connections and rooms, the sessions it opened with
        the chunks they are sending); README "Troubleshooting" has the schema."""
        return _describe(self._lib, "kvstage_engine_describe", self._handle())

    def transport_describe(self) -> str:
        """``kvstage_engine_transport_describe``: the engine's transport in one line (the same-host
        path with its sessions, those in direct mode and their chunks, RDMA, the last downgrades)."""
        return _text(self._lib, "kvstage_engine_transport_describe", self._handle())

    def room_describe(self, room: int) -> dict:
        """``kvstage_room_describe``: decode room ``room`` as a dict: its state and, per chunk,
        its phase, ring allocation (and the older one it waits behind), writers and bytes landed."""
        return _describe(self._lib, "kvstage_room_describe", self._handle(), _u64(room, "room"))

    def stats(self) -> EngineStats:
        out = _lib.kvstage_engine_stats()
        out.struct_size = ctypes.sizeof(out)
        _check(self._lib, self._lib.kvstage_engine_stats_get(self._handle(), byref(out)), "kvstage_engine_stats_get")
        return _fields_from_c(EngineStats, out)

    # -- registration -----------------------------------------------------------------------------

    def register_pool(self, layout: KvLayout) -> None:
        """Registers this rank's KV pool (``layout`` must carry its buffers). The memory must stay
        valid while the engine lives; the engine keeps ``layout`` (and so its buffers) referenced."""
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout: expected a KvLayout, got {type(layout).__name__}")
        if not layout.has_buffers:
            raise argument_error("layout", "has no buffers (pass k_buffers/v_buffers to KvLayout)")
        c, _keep = layout._c()
        _check(self._lib, self._lib.kvstage_engine_register_pool(self._handle(), byref(c)), "kvstage_engine_register_pool")
        self._pool = layout

    def register_components(self, components: Sequence[Any]) -> None:
        """``kvstage_engine_register_components``: this rank's request parts besides the KV
        (:class:`kvstage.parts.AuxBuffer`, :class:`~kvstage.parts.StateComponent`,
        :class:`~kvstage.parts.PoolComponent`; host memory), once, after :meth:`register_pool` and
        before sessions connect. Both sides register the same components in the same order (the
        handshake compares them field by field). The engine keeps the buffers referenced."""
        from .parts import components_c

        array, keep = components_c(self._lib, components)
        rc = self._lib.kvstage_engine_register_components(self._handle(), array, len(components))
        _check(self._lib, rc, "kvstage_engine_register_components")
        self._components = keep

    def register_staging(self, size: int, memory: Any = None, device: Optional[int] = None) -> None:
        """Registers the decode-side staging ring of ``size`` bytes
        (``kvstage_engine_register_staging_memory``).

        ``memory`` None: the engine allocates it, in host memory, or on CUDA device ``device``
        when one is named. Else ``memory`` (an int address, or an array/buffer/tensor of at least
        ``size`` bytes, kept referenced by the engine): device memory when it says so (a CUDA
        tensor, ``__cuda_array_interface__``) or when ``device`` is named for an int address. A
        device ring needs a CUDA pool on the same device; its sessions run over TCP."""
        size = _u64(size, "size")
        c = _lib.kvstage_staging_memory()
        _check(self._lib, self._lib.kvstage_staging_memory_init(byref(c)), "kvstage_staging_memory_init")
        c.bytes = size
        kind = MemoryKind.HOST if device is None else MemoryKind.CUDA
        keep = None
        if memory is not None:
            info = buffer_info(memory, "memory", writable=True)
            if info.nbytes is not None and info.nbytes < size:
                raise argument_error("memory", f"holds {info.nbytes} bytes, the ring needs {size}")
            if info.memory is not None:
                if device is not None and info.memory != MemoryKind.CUDA:
                    raise argument_error("device", "is set but memory is host memory")
                kind = info.memory
            c.memory, keep = info.address, info.keepalive
        c.memory_kind = int(kind)
        if device is not None:
            if _u32(device, "device") >= 1 << 31:
                raise argument_error("device", f"{device} is not a CUDA device ordinal")
            c.cuda_device = device
        rc = self._lib.kvstage_engine_register_staging_memory(self._handle(), byref(c))
        _check(self._lib, rc, "kvstage_engine_register_staging_memory")
        self._staging.append(keep)

    # -- sender side ------------------------------------------------------------------------------

    def connect(self, peer_address: str, session_id: str, timeout_ms: int = 0) -> "Session":
        """``kvstage_session_connect``: a session to the decode engine at ``peer_address``
        (handshake: versions, geometry fingerprints, pairing). ``timeout_ms`` 0 = engine default.
        A geometry disagreement raises :class:`GeometryError`, one cause per differing field."""
        out = c_void_p()
        rc = self._lib.kvstage_session_connect(
            self._handle(), peer_address.encode("utf-8"), session_id.encode("utf-8"), _u64(timeout_ms, "timeout_ms"), byref(out)
        )
        _check(self._lib, rc, "kvstage_session_connect")
        session = Session(self, out.value, peer_address, session_id)
        self._sessions.add(session)
        return session

    # -- receiver side: rooms ---------------------------------------------------------------------

    def room_open(self, room: int, dst_pages: Any, chunk_tokens: int = 0, *, parts: Any = None) -> RoomOpening:
        """``kvstage_room_open``: the room's new tokens land in ``dst_pages`` (token order), cut into
        chunks of ``chunk_tokens`` (0 = engine default). Returns the number of chunks and this
        opening's key: send the key to the prefill ranks with the room id (in the engine's own
        bootstrap message); their transfers pass it as ``room_key``. ``parts``
        (:class:`kvstage.parts.RequestParts`): the request's aux row, state slots and extra pools'
        pages on this rank (``kvstage_room_open_parts``); the room then completes only once they
        are in place too, the aux rows written last."""
        from .parts import request_parts_c

        keep, address, count = page_array(dst_pages, "dst_pages")
        c_parts, keep_parts = request_parts_c(self._lib, parts)
        n, key = c_uint32(), c_uint64()
        rc = self._lib.kvstage_room_open_parts(
            self._handle(), _u64(room, "room"), ctypes.cast(address, POINTER(c_uint32)), count, _u32(chunk_tokens, "chunk_tokens"), c_parts, byref(n), byref(key)
        )
        del keep, keep_parts
        _check(self._lib, rc, "kvstage_room_open_parts" if parts is not None else "kvstage_room_open")
        return RoomOpening(n.value, key.value)

    def shutdown(self, timeout_ms: int = DEADLINE_INFINITE) -> None:
        """``kvstage_engine_shutdown``: stops the engine (sessions closed, rooms failing, nothing
        accepted), then waits up to ``timeout_ms`` (0 = only look, ``DEADLINE_INFINITE`` = no
        limit) until no same-host peer maps its staging ring or KV pool. Returns when none does:
        the pool's memory (a :class:`SharedMemory`, a CUDA allocation) may then be freed. Raises
        :class:`TimeError` naming the peers' processes when some still do (call again to wait
        more). Close the engine afterwards as usual."""
        rc = self._lib.kvstage_engine_shutdown(self._handle(), _u64(timeout_ms, "timeout_ms"), None)
        _check(self._lib, rc, "kvstage_engine_shutdown")

    def room_wait(self, room: int, timeout_ms: int = 0) -> None:
        """``kvstage_room_wait``: returns when every chunk of the room is in the pool; raises the
        room's error (:class:`TransportError` for a dead peer, ...) or :class:`TimeError` after
        ``timeout_ms`` (0 = engine default, ``DEADLINE_INFINITE`` = none)."""
        rc = self._lib.kvstage_room_wait(self._handle(), _u64(room, "room"), _u64(timeout_ms, "timeout_ms"))
        _check(self._lib, rc, "kvstage_room_wait")

    def room_release(self, room: int) -> None:
        """``kvstage_room_release``: forgets the room and frees its ring space (idempotent).
        Raises :class:`TimeError` when a same-host writer that cannot end (a stopped prefill
        process) still holds the room's pages after the engine's default deadline: do not reuse
        them until a later release returns."""
        rc = self._lib.kvstage_room_release(self._handle(), _u64(room, "room"))
        _check(self._lib, rc, "kvstage_room_release")

    def room(self, room: int, dst_pages: Any, chunk_tokens: int = 0, *, parts: Any = None) -> "Room":
        """Opens a room as a context manager that releases it on exit."""
        return Room(self, room, *self.room_open(room, dst_pages, chunk_tokens, parts=parts))

    def poll_events(self, max_events: int = 256, room: Optional[int] = None) -> List[ChunkEvent]:
        """``kvstage_engine_poll_events`` (or ``kvstage_room_poll_events`` with ``room``): up to
        ``max_events`` chunk events, of every room or of one (non-blocking)."""
        if max_events <= 0:
            raise argument_error("max_events", f"{max_events} is not positive")
        events = (_lib.kvstage_chunk_event * max_events)()
        count = c_size_t()
        if room is None:
            rc = self._lib.kvstage_engine_poll_events(self._handle(), events, max_events, byref(count))
            _check(self._lib, rc, "kvstage_engine_poll_events")
        else:
            rc = self._lib.kvstage_room_poll_events(self._handle(), _u64(room, "room"), events, max_events, byref(count))
            _check(self._lib, rc, "kvstage_room_poll_events")
        return [ChunkEvent(e.room, e.chunk_index, _status(e.status), e.room_key, e.trace_id.decode("ascii")) for e in events[: count.value]]

    # -- completions ------------------------------------------------------------------------------

    def completion_fd(self) -> int:
        """``kvstage_engine_completion_fd``: readable whenever an operation of this engine ends or
        a chunk event is queued. Owned by the engine (do not close it)."""
        fd = c_int32()
        _check(self._lib, self._lib.kvstage_engine_completion_fd(self._handle(), byref(fd)), "kvstage_engine_completion_fd")
        return fd.value

    def drain_completions(self) -> int:
        """``kvstage_engine_completions_drain``: resets the descriptor; completions since the last
        drain."""
        n = c_uint64()
        _check(self._lib, self._lib.kvstage_engine_completions_drain(self._handle(), byref(n)), "kvstage_engine_completions_drain")
        return n.value

    async def completions(self) -> int:
        """Waits (asyncio) until the completion descriptor is readable, then drains it; returns
        how many completions were signalled. Then poll operations and events."""
        import asyncio

        loop = asyncio.get_running_loop()
        fd = self.completion_fd()
        while True:
            n = self.drain_completions()
            if n:
                return n
            ready = loop.create_future()
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(fd)

    def set_completion_callback(self, callback: Optional[Any], metrics: bool = False, trace: bool = False) -> None:
        """``kvstage_engine_set_completion_callback``: ``callback(kind, status, tag, room, chunk)``
        runs on a library thread for every completion (keep it short; it must not close this
        engine). With ``metrics=True`` it also gets ``timings`` (a :class:`TransferTimings`, for
        operations) and ``scatter_ns`` (for chunks); with ``trace=True`` the keyword ``trace`` (the
        request's trace id). ``None`` removes it. Returns once no call of
        the previous callback runs any more (the library waits for them; do not hold a lock the
        callback takes meanwhile), except when called from inside a completion callback, which
        never waits."""
        if callback is None:
            c_fn = _lib.kvstage_completion_fn()
        else:

            def trampoline(_user: Any, c: Any) -> None:
                v = c.contents
                extra = {"trace": v.trace_id.decode("ascii")} if trace else {}
                _IN_CALLBACK.depth = getattr(_IN_CALLBACK, "depth", 0) + 1
                try:
                    if metrics:
                        timings = TransferTimings._from_c(v.timings)
                        callback(v.kind, _status(v.status), v.tag, v.room, v.chunk_index, timings, v.scatter_ns, **extra)
                        return
                    callback(v.kind, _status(v.status), v.tag, v.room, v.chunk_index, **extra)
                except Exception:  # never unwind into the library's thread
                    import traceback

                    traceback.print_exc()
                finally:
                    _IN_CALLBACK.depth -= 1

            c_fn = _lib.kvstage_completion_fn(trampoline)
        rc = self._lib.kvstage_engine_set_completion_callback(self._handle(), c_fn, None)
        _check(self._lib, rc, "kvstage_engine_set_completion_callback")
        if getattr(_IN_CALLBACK, "depth", 0) > 0:
            # From inside a callback the library does not wait for the calls of the previous
            # callback still running (this one among them): their thunks must outlive them.
            self._retired_callbacks.append(self._callback)
        else:
            # The library waited for every call of the previous callbacks.
            self._retired_callbacks.clear()
        self._callback = c_fn  # kept alive while the library may call it

    # -- testing ----------------------------------------------------------------------------------

    def _testing_panic(self) -> None:
        """Test builds only: panics inside the library (``kvstage_testing_panic``)."""
        fn = getattr(self._lib, "kvstage_testing_panic", None)
        if fn is None:
            raise argument_error("library", "has no test-only exports (build with the feature `testing`)")
        _check(self._lib, fn(self._handle()), "kvstage_testing_panic")

    def _before_free(self) -> None:
        for session in list(self._sessions):
            session.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<kvstage.Engine closed>"
        return f"<kvstage.Engine {self.listen_address}>"


class Room:
    """An open room (decode side); ``with engine.room(...) as room:`` releases it on exit."""

    def __init__(self, engine: Engine, room: int, num_chunks: int, key: int):
        self.engine = engine
        self.room = room
        self.num_chunks = num_chunks
        #: This opening's key: the prefill ranks pass it as ``room_key``.
        self.key = key
        self._released = False

    def wait(self, timeout_ms: int = 0) -> None:
        self.engine.room_wait(self.room, timeout_ms)

    def release(self) -> None:
        """Releases this opening once: a second call (or the ``with`` block's exit after an
        explicit release) does nothing, so it never releases the id's next opening."""
        if not self._released:
            self._released = True
            self.engine.room_release(self.room)

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        return f"<kvstage.Room {self.room} ({self.num_chunks} chunks){' released' if self._released else ''}>"

    def __enter__(self) -> "Room":
        return self

    def __exit__(self, *exc) -> None:
        if not self.engine.closed:
            self.release()


_CU_STREAM_LEGACY = 0x1


def _cuda_handle(obj: Any, attr: str, what: str) -> Optional[int]:
    """The raw CUDA handle of a torch object (its ``attr``), an int as is, ``None`` for none.
    A torch stream whose handle is 0 is the legacy default stream (NULL would mean "ready now");
    a torch event whose handle is 0 was never recorded."""
    if obj is None:
        return None
    raw = getattr(obj, attr, obj)
    if not isinstance(raw, int):
        raise TypeError(f"{what}: expected a torch CUDA {what} or a raw handle (int), got {type(obj).__name__}")
    if raw == 0 and obj is not raw:
        if what == "stream":
            return _CU_STREAM_LEGACY
        raise ValueError(f"{what}: the torch CUDA event was never recorded")
    return raw or None


def _describe(lib: Library, fn: str, *args: Any) -> dict:
    """A describe document (JSON) as a dict."""
    return json.loads(_text(lib, fn, *args))


def _text(lib: Library, fn: str, *args: Any) -> str:
    """A text the library writes: size query, then fill (again while it grows between the two)."""
    call = getattr(lib, fn)
    needed = c_size_t(0)
    for _ in range(8):
        _check(lib, call(*args, None, 0, byref(needed)), fn)
        buf = ctypes.create_string_buffer(needed.value + 4096)
        rc = call(*args, buf, len(buf), byref(needed))
        if rc == 0:
            return buf.value.decode("utf-8")
    _check(lib, rc, fn)
    raise AssertionError("unreachable: a failed fill raises")


def _desc(
    lib: Library, room: int, room_key: int, chunk_index: int, pages: Any, deadline_ms: int, tag: int, src_token_offset: int, num_tokens: int,
    trace_id: Optional[str] = None, parts: Any = None,
):
    keep, address, count = page_array(pages, "pages")
    d = _lib.kvstage_transfer_desc()
    _check(lib, lib.kvstage_transfer_desc_init(byref(d)), "kvstage_transfer_desc_init")
    d.room = _u64(room, "room")
    d.room_key = _u64(room_key, "room_key")
    d.chunk_index = _u32(chunk_index, "chunk_index")
    d.src_pages = ctypes.cast(address, POINTER(c_uint32))
    d.num_pages = count
    d.deadline_ms = _u64(deadline_ms, "deadline_ms")
    d.user_tag = _u64(tag, "tag")
    d.src_token_offset = _u32(src_token_offset, "src_token_offset")
    d.num_tokens = _u32(num_tokens, "num_tokens")
    if trace_id is not None:
        encoded = trace_id.encode("utf-8")
        d.trace_id = encoded
        keep = (keep, encoded)
    if parts is not None:
        from .parts import request_parts_c

        d.parts, keep_parts = request_parts_c(lib, parts)
        keep = (keep, keep_parts)
    return d, keep


class Session(_Handle):
    """``kvstage_session``: one (prefill rank -> decode rank) peering. Thread-safe: transfers on
    one session may run concurrently from several Python threads (the GIL is released)."""

    _kind = "kvstage_session"
    _free_fn = "kvstage_session_free"

    def __init__(self, engine: Engine, ptr: int, peer_address: str, session_id: str):
        super().__init__(engine._lib, ptr)
        self.engine = engine
        self.peer_address = peer_address
        self._session_id = session_id

    @property
    def session_id(self) -> str:
        return self._session_id

    def transfer(
        self, room: int, chunk_index: int, pages: Any, deadline_ms: int = 0, *, room_key: int, src_token_offset: int = 0, num_tokens: int = 0,
        trace_id: Optional[str] = None, parts: Any = None,
    ) -> Status:
        """``kvstage_transfer``: the staged path for one chunk (``pages``: the prefill pages of the
        chunk in token order) into ``room``, opened on the decode side with the key ``room_key``
        (what its ``room_open`` returned). Returns ``Status.OK``, or ``Status.FALLBACK`` when
        staging is impossible for this chunk (nothing was allocated; use :meth:`transfer_slices`).
        A key of another opening of the room raises :class:`TimeError` with ``E_STALE_ROOM``.
        ``src_token_offset`` and ``num_tokens``: where the chunk starts in ``pages[0]`` and how
        many tokens it holds (0: all the pages hold from there), as :func:`chunk_span` says when
        the prefill and decode page sizes differ or a prefix ends inside a prefill page.
        ``trace_id``: the request's id in both sides' log lines, describe documents and
        completions (your engine's request id; default: derived from the room's opening).
        ``parts`` (:class:`kvstage.parts.RequestParts`, the room's last chunk only): this rank's aux
        row, state slots and extra pools' pages of the request, sent in the same write."""
        d, keep = _desc(self._lib, room, room_key, chunk_index, pages, deadline_ms, 0, src_token_offset, num_tokens, trace_id, parts)
        rc = self._lib.kvstage_transfer(self._handle(), byref(d))
        del keep
        return _check(self._lib, rc, "kvstage_transfer")

    def transfer_slices(
        self, room: int, chunk_index: int, pages: Any, deadline_ms: int = 0, *, room_key: int, src_token_offset: int = 0, num_tokens: int = 0,
        trace_id: Optional[str] = None,
    ) -> Status:
        """``kvstage_transfer_slices``: the slice path for the same chunk (one write per token,
        layer and K/V); the fallback of :meth:`transfer`. It moves whole decode pages only."""
        d, keep = _desc(self._lib, room, room_key, chunk_index, pages, deadline_ms, 0, src_token_offset, num_tokens, trace_id)
        rc = self._lib.kvstage_transfer_slices(self._handle(), byref(d))
        del keep
        return _check(self._lib, rc, "kvstage_transfer_slices")

    def transfer_async(
        self,
        room: int,
        chunk_index: int,
        pages: Any,
        deadline_ms: int = 0,
        tag: int = 0,
        *,
        room_key: int,
        src_token_offset: int = 0,
        num_tokens: int = 0,
        trace_id: Optional[str] = None,
        parts: Any = None,
    ) -> "Operation":
        """``kvstage_transfer_async``: starts the staged path on the engine's transfer workers;
        ``tag`` comes back with its completion (callback). ``parts``: as for :meth:`transfer`."""
        d, keep = _desc(self._lib, room, room_key, chunk_index, pages, deadline_ms, tag, src_token_offset, num_tokens, trace_id, parts)
        out = c_void_p()
        rc = self._lib.kvstage_transfer_async(self._handle(), byref(d), byref(out))
        del keep
        _check(self._lib, rc, "kvstage_transfer_async")
        return Operation(self, out.value)

    def transfer_layerwise_async(
        self,
        room: int,
        chunk_index: int,
        pages: Any,
        deadline_ms: int = 0,
        tag: int = 0,
        *,
        room_key: int,
        src_token_offset: int = 0,
        num_tokens: int = 0,
        trace_id: Optional[str] = None,
    ) -> "Operation":
        """``kvstage_transfer_layerwise_async``: starts the staged path for a chunk whose layers
        are still being computed; mark them with :meth:`Operation.layers_ready` (every layer of
        the pool before the deadline). The ring space is requested at once."""
        d, keep = _desc(self._lib, room, room_key, chunk_index, pages, deadline_ms, tag, src_token_offset, num_tokens, trace_id)
        out = c_void_p()
        rc = self._lib.kvstage_transfer_layerwise_async(self._handle(), byref(d), byref(out))
        del keep
        _check(self._lib, rc, "kvstage_transfer_layerwise_async")
        return Operation(self, out.value)

    def room_grid(self, room: int, timeout_ms: int = 0, *, room_key: int) -> RoomGrid:
        """``kvstage_session_room_grid``: the chunk grid of ``room`` (the opening ``room_key``) as
        the decode side opened it (chunk ``k`` carries the room's tokens
        ``[k * chunk_tokens, ...)``); one round trip."""
        out = _lib.kvstage_room_grid()
        out.struct_size = ctypes.sizeof(out)
        rc = self._lib.kvstage_session_room_grid(
            self._handle(), _u64(room, "room"), _u64(room_key, "room_key"), _u64(timeout_ms, "timeout_ms"), byref(out)
        )
        _check(self._lib, rc, "kvstage_session_room_grid")
        return RoomGrid(out.chunk_tokens, out.num_chunks, out.num_pages)

    def stats(self) -> SessionStats:
        """``kvstage_session_stats_get``: this session's counters and transport."""
        out = _lib.kvstage_session_stats()
        out.struct_size = ctypes.sizeof(out)
        _check(self._lib, self._lib.kvstage_session_stats_get(self._handle(), byref(out)), "kvstage_session_stats_get")
        stats = _fields_from_c(SessionStats, out)
        try:
            return stats._replace(transport=Transport(stats.transport))
        except ValueError:
            return stats

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"to {self.peer_address}"
        return f"<kvstage.Session {self._session_id!r} {state}>"


class Operation(_Handle):
    """``kvstage_op``: a transfer started by :meth:`Session.transfer_async`. Closing it does not stop
    it (use :meth:`cancel`)."""

    _kind = "kvstage_op"
    _free_fn = "kvstage_op_free"

    def __init__(self, session: Session, ptr: int):
        super().__init__(session._lib, ptr)
        self.session = session
        self._session_id = session.session_id

    def poll(self) -> Status:
        """``Status.PENDING`` while running, then the result (``OK`` or ``FALLBACK``); raises the
        operation's error (every time it is asked)."""
        return _check(self._lib, self._lib.kvstage_op_poll(self._handle()), "kvstage_op_poll")

    def wait(self, timeout_ms: int = DEADLINE_INFINITE) -> Status:
        """Waits up to ``timeout_ms`` (default: until it ends; the operation's own deadline still
        bounds it). Returns ``Status.PENDING`` if it is still running, else as :meth:`poll`."""
        rc = self._lib.kvstage_op_wait(self._handle(), _u64(timeout_ms, "timeout_ms"))
        return _check(self._lib, rc, "kvstage_op_wait")

    def describe(self) -> dict:
        """``kvstage_op_describe``: where the transfer is, as a dict: ``phase`` (``queued``, ``starting``,
        ``waiting_for_allocation``, ``waiting_for_watermark``, ``gathering``, ``writing``,
        ``waiting_for_layers``, ``waiting_for_acknowledgement``, ``done``, ``failed``, ...),
        ``waits_on``, ``in_phase_ms``, ``deadline_left_ms``, ``status``, ``error``."""
        return _describe(self._lib, "kvstage_op_describe", self._handle())

    def cancel(self) -> None:
        """Asks the operation to stop; it ends with ``E_CANCELED`` unless it already finished."""
        _check(self._lib, self._lib.kvstage_op_cancel(self._handle()), "kvstage_op_cancel")

    def layers_ready(self, first_layer: int, num_layers: int = 1, event: Any = None, stream: Any = None) -> None:
        """``kvstage_op_layers_ready``: model layers ``[first_layer, first_layer + num_layers)``
        of a layer-wise transfer are ready, after ``event`` (a recorded ``torch.cuda.Event`` or a
        raw ``CUevent``) or the current work of ``stream`` (a ``torch.cuda.Stream`` or a raw
        ``CUstream``), or now when neither is given."""
        if event is not None and stream is not None:
            raise ValueError("layers_ready: give event or stream, not both")
        rc = self._lib.kvstage_op_layers_ready(
            self._handle(),
            _u32(first_layer, "first_layer"),
            _u32(num_layers, "num_layers"),
            _cuda_handle(stream, "cuda_stream", "stream"),
            _cuda_handle(event, "cuda_event", "event"),
        )
        _check(self._lib, rc, "kvstage_op_layers_ready")

    def timings(self) -> Optional[TransferTimings]:
        """``kvstage_op_timings_get``: the phase timings once the operation ended, else ``None``."""
        out = _lib.kvstage_transfer_timings()
        out.struct_size = ctypes.sizeof(out)
        rc = _check(self._lib, self._lib.kvstage_op_timings_get(self._handle(), byref(out)), "kvstage_op_timings_get")
        return None if rc == Status.PENDING else TransferTimings._from_c(out)

    def __repr__(self) -> str:
        return f"<kvstage.Operation of session {self._session_id!r}{' closed' if self.closed else ''}>"
