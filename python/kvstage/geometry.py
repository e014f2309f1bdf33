"""Geometry helpers (header section "geometry helpers"): pure functions of layouts and grids,
no engine needed. Head slices, state slices, rank pairing, the staging layout of a chunk (its
writers: ``staging_layout(...).num_writers`` is the number of writers per chunk), the chunk grid
and where a chunk lies on both sides (:func:`chunk_span`, from the room's :class:`RoomGrid`)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_size_t, c_uint32
from typing import Any, List, NamedTuple, Sequence, Tuple, Union

from . import _lib
from ._common import check, init_struct, output_array, output_struct, u32, u64
from .library import get_library
from .parts import components_c
from .pool import KvLayout, stage_array
from .room import RoomGrid

__all__ = [
    "HeadSlice",
    "head_slice",
    "ByteRange",
    "state_slice",
    "pairing_decode_ranks",
    "pairing_prefill_ranks",
    "grid_tokens",
    "ChunkSpan",
    "chunk_span",
    "StagingWriter",
    "StagingLayout",
    "staging_layout",
]


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
    args = [u32(v, n) for v, n in ((src_tp, "src_tp"), (dst_tp, "dst_tp"), (src_rank, "src_rank"), (dst_rank, "dst_rank"), (total_kv_heads, "total_kv_heads"))]
    check(lib, lib.kvstage_head_slice_compute(*args, byref(out)), "kvstage_head_slice_compute")
    return HeadSlice(out.src_head_start, out.num_heads, out.dst_head_start)


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
    dims = (c_uint32 * max(1, len(group_dims)))(*[u32(g, "group_dims") for g in group_dims])
    item = init_struct(lib, _lib.kvstage_state_item, "kvstage_state_item_init")
    item.outer, item.dtype_bytes = u32(outer, "outer"), u32(dtype_bytes, "dtype_bytes")
    item.group_dims, item.num_groups, item.replicated = ctypes.cast(dims, POINTER(c_uint32)), len(group_dims), int(bool(replicated))
    ranks = [u32(v, n) for v, n in ((src_tp, "src_tp"), (dst_tp, "dst_tp"), (src_rank, "src_rank"), (dst_rank, "dst_rank"))]
    count = c_size_t(0)
    check(lib, lib.kvstage_state_slice_compute(byref(item), *ranks, None, 0, byref(count)), "kvstage_state_slice_compute")
    if count.value == 0:
        return []
    out = (_lib.kvstage_byte_range * count.value)()
    check(lib, lib.kvstage_state_slice_compute(byref(item), *ranks, out, count.value, byref(count)), "kvstage_state_slice_compute")
    return [ByteRange(r.src_offset, r.dst_offset, r.len) for r in out[: count.value]]


def _pairing(fn: str, local: KvLayout, stages: Sequence[KvLayout], components: Sequence[Any]) -> List[Tuple[int, int]]:
    lib = get_library()
    clocal, _keep_local = local._c()
    comps, _keep_comps = components_c(lib, components)
    array, keep = stage_array(stages)
    count = c_size_t(0)
    args = (byref(clocal), comps, len(components), array, len(keep))
    check(lib, getattr(lib, fn)(*args, None, 0, byref(count)), fn)  # the count
    if count.value == 0:
        return []
    out = (_lib.kvstage_rank * count.value)()
    check(lib, getattr(lib, fn)(*args, out, count.value, byref(count)), fn)
    return [(out[i].tp_rank, out[i].pp_rank) for i in range(count.value)]


def pairing_decode_ranks(prefill: KvLayout, decode_stages: Sequence[KvLayout], components: Sequence[Any] = ()) -> List[Tuple[int, int]]:
    """``kvstage_pairing_decode_ranks``: the ``(tp_rank, pp_rank)`` decode ranks prefill rank
    ``prefill`` must open sessions to for whole requests; ``decode_stages[j]`` is a shape-only
    layout of decode stage ``j``; ``components`` are the rank's (as for
    :meth:`Engine.register_components`): with a sharded :class:`~kvstage.parts.StateComponent`, a
    rank that only replicates heads still opens the sessions its state shares go over."""
    return _pairing("kvstage_pairing_decode_ranks", prefill, decode_stages, components)


def pairing_prefill_ranks(decode: KvLayout, prefill_stages: Sequence[KvLayout], components: Sequence[Any] = ()) -> List[Tuple[int, int]]:
    """``kvstage_pairing_prefill_ranks``: the ``(tp_rank, pp_rank)`` prefill ranks that write to decode
    rank ``decode`` for whole requests (the inverse of :func:`pairing_decode_ranks`);
    ``prefill_stages[j]`` describes prefill stage ``j``."""
    return _pairing("kvstage_pairing_prefill_ranks", decode, prefill_stages, components)


def grid_tokens(chunk_tokens: int, page_size: int) -> int:
    """``kvstage_grid_tokens_compute``: tokens per chunk of the chunk grid a room opened with
    ``chunk_tokens`` (0: the engine default is not known here, pass the real value) on pages of
    ``page_size`` tokens has (whole pages)."""
    lib = get_library()
    out = c_uint32()
    rc = lib.kvstage_grid_tokens_compute(u32(chunk_tokens, "chunk_tokens"), u32(page_size, "page_size"), byref(out))
    check(lib, rc, "kvstage_grid_tokens_compute")
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


def chunk_span(grid: RoomGrid, total_tokens: int, src_page_size: int, chunk_index: int) -> ChunkSpan:
    """``kvstage_chunk_span_compute``: chunk ``chunk_index`` of a request of ``total_tokens``
    tokens on the room's chunk grid ``grid`` (:meth:`Session.room_grid` on the prefill side,
    :attr:`Room.grid` on the decode side: its chunk tokens, decode page size and the decode side's
    cached prefix), with prefill pages of ``src_page_size`` tokens. Raises :class:`ArgumentError`
    naming a bad argument."""
    if not isinstance(grid, RoomGrid):
        raise TypeError(f"grid: expected a kvstage.RoomGrid, got {type(grid).__name__}")
    lib = get_library()
    c_grid = grid._c()
    out = output_struct(_lib.kvstage_chunk_span)
    rc = lib.kvstage_chunk_span_compute(
        byref(c_grid), u64(total_tokens, "total_tokens"), u32(src_page_size, "src_page_size"), u32(chunk_index, "chunk_index"), byref(out)
    )
    check(lib, rc, "kvstage_chunk_span_compute")
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
    #: Bytes of one of its K (or latent) slabs, and of one of its V slabs (0 for MLA).
    slab_bytes: int = 0
    v_slab_bytes: int = 0


class StagingLayout(NamedTuple):
    """Layout of one staging allocation (one decode rank, one chunk). Writer ``w``'s K slab for
    layer index ``l`` starts at ``writers[w].offset + l * writers[w].slab_bytes``, its V slab at
    ``writers[w].offset + writers[w].layers * writers[w].slab_bytes + l * writers[w].v_slab_bytes``.
    ``row_bytes``, ``slab_bytes`` and ``num_heads`` are every writer's, or 0 where the decode
    rank's head groups differ in size (TP sizes that do not divide one another: P3→D2 with 12
    heads sends decode rank 0 four heads from prefill rank 0 and two from prefill rank 1)."""

    total_bytes: int
    row_bytes: int
    slab_bytes: int
    tokens: int
    num_heads: int
    buffers_per_layer: int
    num_tp_writers: int
    writers: Tuple[StagingWriter, ...]
    #: Bytes of the request's parts the room's last chunk carries (included in ``total_bytes``).
    parts_bytes: int = 0

    @property
    def num_writers(self) -> int:
        """Writers whose arrival completes the chunk (``kvstage_staging_layout.num_writers``)."""
        return len(self.writers)


def staging_layout(
    prefill_stages: Union[KvLayout, Sequence[KvLayout]],
    dst: KvLayout,
    tokens: int,
    components: Sequence[Any] = (),
    pool_tokens: Sequence[int] = (),
) -> StagingLayout:
    """``kvstage_staging_layout_compute``: the staging allocation decode rank ``dst`` needs for a chunk of
    ``tokens`` tokens written by the prefill side; ``prefill_stages[j]`` is a shape-only layout of
    prefill stage ``j`` (one layout for a prefill side without pipeline stages). Writers are listed
    in (stage, head group) order; a receiver places them in arrival order, so run-time offsets may
    differ (sizes do not). With ``components`` (the decode rank's) it is the layout of a room's last
    chunk, which carries the request's parts too (``parts_bytes``, included in ``total_bytes``):
    one query sizes the ring for a whole request; ``pool_tokens`` names the tokens of the request's
    span in each :class:`~kvstage.parts.PoolComponent`, in order."""
    lib = get_library()
    array, keep = stage_array([prefill_stages] if isinstance(prefill_stages, KvLayout) else list(prefill_stages))
    cdst, _kd = dst._c()
    comps, _kc = components_c(lib, components)
    ptoks = (c_uint32 * max(1, len(pool_tokens)))(*[u32(t, "pool_tokens") for t in pool_tokens])
    out = output_struct(_lib.kvstage_staging_layout)
    tokens = u32(tokens, "tokens")
    fn = lib.kvstage_staging_layout_compute
    args = (array, len(keep), byref(cdst), comps, len(components), ptoks, len(pool_tokens), tokens, byref(out))
    check(lib, fn(*args, None, 0), "kvstage_staging_layout_compute")
    writers = output_array(_lib.kvstage_staging_writer, out.num_writers)
    rc = fn(*args, writers, out.num_writers)
    check(lib, rc, "kvstage_staging_layout_compute")
    return StagingLayout(
        out.total_bytes,
        out.row_bytes,
        out.slab_bytes,
        out.tokens,
        out.num_heads,
        out.buffers_per_layer,
        out.num_tp_writers,
        tuple(
            StagingWriter(w.offset, w.bytes, w.layers, w.src_tp_rank, w.src_pp_rank, w.tp_writer, w.src_head_start, w.num_heads, w.dst_head_start,
                          w.slab_bytes, w.v_slab_bytes)
            for w in writers[: out.num_writers]
        ),
        out.parts_bytes,
    )
