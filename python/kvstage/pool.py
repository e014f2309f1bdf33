"""The KV pool's layout (header section "pool and layout"): :class:`KvLayout`, one rank's pool
shape and optionally its buffers. :meth:`Engine.register_pool` registers it
(``kvstage_pool_register``); the geometry helpers take shape-only layouts.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_uint32, c_uint64
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._buffers import buffer_info
from ._common import check, enum_arg, init_struct, u32, u64
from ._lib import LayoutPreset, MemoryKind, ModelKind
from ._tensors import sglang_tensors, trtllm_tensors, vllm_tensors
from .errors import argument_error
from .library import get_library

__all__ = ["KvLayout", "layout_preset"]

_VLLM_ORDERS = tuple(p.order for p in LayoutPreset if p.order)


def layout_preset(value: Union[str, int, LayoutPreset], name: str = "layout") -> LayoutPreset:
    """A :class:`LayoutPreset` from a member, its C value or a name: ``"sglang"``,
    ``"vllm-lbhnc"`` (or the bare order ``"LBHNC"``; any case, ``_`` for ``-``), ``"trtllm"``."""
    if isinstance(value, LayoutPreset):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("_", "-")
        if key.upper() in _VLLM_ORDERS:
            key = "vllm-" + key
        for p in LayoutPreset:
            if p.preset_name == key:
                return p
        names = ", ".join(p.preset_name for p in LayoutPreset)
        raise argument_error(name, f"{value!r} is not a layout name ({names}; or a vLLM order such as 'LBHNC')")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a layout name or a LayoutPreset, got {type(value).__name__}")
    try:
        return LayoutPreset(value)
    except ValueError:
        raise argument_error(name, f"{value} is not a kvstage_layout_preset value") from None


class KvLayout:
    """One rank's KV pool (``kvstage_kv_layout``): its shape, and optionally its buffers.

    Byte ``e`` of local head ``h`` of token ``s`` of page ``p`` of a buffer lies at ``base +
    p * page_stride + s * token_stride + h * head_stride + e``. The strides left 0 are sglang's
    token-major layout: token slot ``t`` of a buffer starts ``t * token_bytes`` bytes after its
    base, page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``. ``k_buffers`` (the latent
    buffers for MLA) and ``v_buffers`` hold one buffer per layer, each an int address or an array
    object (see :func:`kvstage.buffer_info`); the layout keeps them referenced. An MHA pool whose
    V lies in K's cell or block gives ``v_offset`` (V of layer ``i`` lies ``v_offset`` bytes after
    ``k_buffers[i]``) instead of ``v_buffers``.

    Engines' own layouts: :meth:`preset` (by name, from the shape) and :meth:`from_tensors` (from
    the engine's tensors, strides and pointers read from them).

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
        page_stride: int = 0,
        token_stride: int = 0,
        head_stride: int = 0,
        v_offset: int = 0,
        head_dim_v: Optional[int] = None,
        v_page_stride: int = 0,
        v_token_stride: int = 0,
        v_head_stride: int = 0,
    ):
        self.model = enum_arg(ModelKind, model, "model")
        self.head_dim = u32(head_dim, "head_dim")
        #: Elements per V head (vLLM ``head_size_v``, sglang ``v_head_dim``): ``head_dim`` unless given.
        self.head_dim_v = self.head_dim if head_dim_v is None else u32(head_dim_v, "head_dim_v")
        self.global_heads = u32(global_heads, "global_heads")
        self.page_size = u32(page_size, "page_size")
        self.dtype_bytes = u32(dtype_bytes, "dtype_bytes")
        self.tp_rank, self.tp_size = u32(tp_rank, "tp_rank"), u32(tp_size, "tp_size")
        self.pp_rank, self.pp_size = u32(pp_rank, "pp_rank"), u32(pp_size, "pp_size")
        #: Bytes between pages, token slots and heads of a buffer (0: the token-major default).
        self.page_stride = u64(page_stride, "page_stride")
        self.token_stride = u64(token_stride, "token_stride")
        self.head_stride = u64(head_stride, "head_stride")
        #: MHA without ``v_buffers``: V of layer ``i`` lies this many bytes after K's base.
        self.v_offset = u64(v_offset, "v_offset")
        #: V's strides where they differ from K's (0: K's where K's are set, else V's token-major
        #: default).
        self.v_page_stride = u64(v_page_stride, "v_page_stride")
        self.v_token_stride = u64(v_token_stride, "v_token_stride")
        self.v_head_stride = u64(v_head_stride, "v_head_stride")
        #: Bytes between consecutive layers' K where every layer lies in one tensor (set by
        #: :meth:`preset` and :meth:`from_tensors`; None when unknown or the layers lie apart).
        self.layer_stride: Optional[int] = None
        #: The engine layout's name (``"vllm-lbhnc"``) for :meth:`preset` and :meth:`from_tensors`.
        self.preset_name: Optional[str] = None
        #: :meth:`preset`: bytes of one tensor holding the whole pool (what the engine allocates).
        self.tensor_bytes: Optional[int] = None
        self._tensors: tuple = ()  # the engine tensors the addresses point into (kept referenced)
        if local_heads is None:
            local_heads = 1 if self.model == ModelKind.MLA else max(1, global_heads // max(1, tp_size))
        self.local_heads = u32(local_heads, "local_heads")
        self.layer_ids = None if layer_ids is None else tuple(u32(x, f"layer_ids[{i}]") for i, x in enumerate(layer_ids))
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
        if self.model == ModelKind.MLA and self.v_offset:
            raise argument_error("v_offset", f"is {self.v_offset}, but an MLA pool has no V (one latent per layer)")

        self._k: Optional[List[Any]] = None
        self._v: Optional[List[Any]] = None
        kinds = set()
        if k_buffers is not None:
            self._k = self._infos(k_buffers, "k_buffers", kinds)
            if self.model == ModelKind.MHA:
                if v_buffers is None and not self.v_offset:
                    raise argument_error("v_buffers", "is required for an MHA pool (or v_offset, where V lies in K's cell or block)")
                if v_buffers is not None and self.v_offset:
                    raise argument_error("v_offset", f"is {self.v_offset} and v_buffers are given: V lies in buffers of its own or v_offset bytes after K, not both")
                if v_buffers is not None:
                    self._v = self._infos(v_buffers, "v_buffers", kinds)
            elif v_buffers is not None:
                raise argument_error("v_buffers", "must be None for an MLA pool (one latent buffer per layer)")
        elif v_buffers is not None:
            raise argument_error("v_buffers", "given without k_buffers")

        if memory is not None:
            self.memory = enum_arg(MemoryKind, memory, "memory")
            if kinds and kinds != {self.memory}:
                raise argument_error("memory", f"is {self.memory.name.lower()} but the buffers are {sorted(k.name.lower() for k in kinds)}")
        elif len(kinds) > 1:
            raise argument_error("k_buffers", "mixes host and CUDA buffers")
        else:
            self.memory = next(iter(kinds)) if kinds else MemoryKind.HOST

        # Each buffer object holds its kind's rows; K's also V's (at v_offset) where V lies in
        # K's cell or block: (label, index, info, kind, bytes before the kind's rows).
        labelled = [("k_buffers", i, info, 0, 0) for i, info in enumerate(self._k or [])]
        if self.model == ModelKind.MHA and self.v_offset:
            labelled += [("k_buffers", i, info, 1, self.v_offset) for i, info in enumerate(self._k or [])]
        labelled += [("v_buffers", i, info, 1, 0) for i, info in enumerate(self._v or [])]
        sizes = [(info.nbytes - more, kv) for _, _, info, kv, more in labelled if info.nbytes is not None]
        if capacity_pages is None and labelled and len(sizes) == len(labelled) and self.head_bytes:
            capacity_pages = min(self._pages_in(size, kv) for size, kv in sizes)
        if capacity_pages is None and self._k is not None:
            raise argument_error("capacity_pages", "is required when the buffers are int addresses")
        self.capacity_pages = u64(capacity_pages or 0, "capacity_pages")
        for label, i, info, kv, more in labelled:
            need = self.buffer_bytes_of(kv)
            if info.nbytes is not None and info.nbytes < need + more:
                within = f" (V's rows lie v_offset {more} bytes after K's)" if more else ""
                raise argument_error(
                    f"{label}[{i}]",
                    f"holds {info.nbytes} bytes, {self.capacity_pages} pages of {self.page_size} token slots need {need + more}{within}",
                )

    def _infos(self, buffers: Sequence[Any], label: str, kinds: set):
        buffers = list(buffers)
        if len(buffers) != self.num_layers:
            raise argument_error(label, f"has {len(buffers)} buffers, num_layers is {self.num_layers}")
        infos = [buffer_info(b, f"{label}[{i}]", writable=True) for i, b in enumerate(buffers)]
        for info in infos:
            if info.memory is not None:
                kinds.add(info.memory)
        return infos

    def _span(self, pages: int, kv: int = 0) -> int:
        """Bytes from the base of a buffer of kind ``kv`` (0: K or the latent, 1: V) to the end of
        the last row of its first ``pages`` pages."""
        hb = self.head_bytes_of(kv)
        if pages <= 0 or not hb:
            return 0
        page, token, head = self.strides_of(kv)
        return (pages - 1) * page + (self.page_size - 1) * token + (self.local_heads - 1) * head + hb

    def _pages_in(self, size: int, kv: int = 0) -> int:
        """Pages whose rows fit in ``size`` bytes from the base of a buffer of kind ``kv``."""
        first = self._span(1, kv)
        return 0 if size < first or not first else (size - first) // self.strides_of(kv)[0] + 1

    def head_bytes_of(self, kv: int) -> int:
        """Bytes of one head's row of buffer kind ``kv`` (0: K or the latent, 1: V)."""
        return (self.head_dim if kv == 0 else self.head_dim_v) * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one K (or latent) head's row: ``head_dim * dtype_bytes``."""
        return self.head_bytes_of(0)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot of one K (or latent) buffer (its heads' rows, without gaps)."""
        return self.local_heads * self.head_bytes

    def strides_of(self, kv: int) -> Tuple[int, int, int]:
        """The strides in force for buffer kind ``kv``, ``(page, token, head)`` bytes: as the
        library resolves them (the defaults where left 0; V's follow K's where K's are set)."""
        if kv == 0:
            token = self.token_stride or self.token_bytes
            head = self.head_stride or self.head_bytes
            return (self.page_stride or self.page_size * token, token, head)
        hb = self.head_bytes_of(1)
        token = self.v_token_stride or self.token_stride or self.local_heads * hb
        head = self.v_head_stride or self.head_stride or hb
        return (self.v_page_stride or self.page_stride or self.page_size * token, token, head)

    @property
    def strides(self) -> Tuple[int, int, int]:
        """The strides in force for K (or the latent), ``(page, token, head)`` bytes."""
        return self.strides_of(0)

    def buffer_bytes_of(self, kv: int) -> int:
        """Bytes from the base of a buffer of kind ``kv`` to the end of its last row."""
        return self._span(self.capacity_pages, kv)

    @property
    def buffer_bytes(self) -> int:
        """Bytes from a K (or latent) buffer's base to the end of its last row (token-major:
        ``capacity_pages * page_size * token_bytes``)."""
        return self._span(self.capacity_pages)

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.model == ModelKind.MHA else 1

    @property
    def has_buffers(self) -> bool:
        return self._k is not None

    @property
    def k_addresses(self) -> Optional[Tuple[int, ...]]:
        """Per layer, the address of K (the latent for MLA); None for a shape-only layout."""
        return None if self._k is None else tuple(i.address for i in self._k)

    @property
    def v_addresses(self) -> Optional[Tuple[int, ...]]:
        """Per layer, the address of V (``v_offset`` after K where set); None for MLA or a
        shape-only layout."""
        if self._v is not None:
            return tuple(i.address for i in self._v)
        if self._k is not None and self.model == ModelKind.MHA:
            return tuple(i.address + self.v_offset for i in self._k)
        return None

    @classmethod
    def preset(
        cls,
        name: Union[str, int, LayoutPreset],
        *,
        head_dim: int,
        capacity_pages: int,
        head_dim_v: Optional[int] = None,
        global_heads: int = 1,
        page_size: int = 1,
        dtype_bytes: int = 2,
        model: Union[str, int, ModelKind] = ModelKind.MHA,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        layer_ids: Optional[Sequence[int]] = None,
        num_layers: Optional[int] = None,
        base: Any = None,
        memory: Union[None, str, int, MemoryKind] = None,
    ) -> "KvLayout":
        """``kvstage_kv_layout_preset``: the layout of an engine's pool by name (``"sglang"``,
        ``"vllm-lbhnc"`` … ``"vllm-bhlnc"`` or the bare order ``"LBHNC"``, ``"trtllm"``; a
        :class:`LayoutPreset`), its strides and ``v_offset`` computed by the library from the shape.

        ``base`` (an int address, or an array/buffer of at least :attr:`tensor_bytes`): one
        tensor holding the whole pool as the engine allocates it; the layers' buffers are placed
        in it (layer ``i``'s K at ``base + i * layer_stride``; sglang's V buffers after all K
        buffers). Without ``base`` the layout is shape-only. :attr:`layer_stride` and
        :attr:`tensor_bytes` tell where the layers lie. Padded pages: :meth:`from_tensors`.
        """
        which = layout_preset(name, "name")
        shape = cls(
            head_dim=head_dim, head_dim_v=head_dim_v, global_heads=global_heads, page_size=page_size, dtype_bytes=dtype_bytes,
            model=model, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, layer_ids=layer_ids,
            num_layers=num_layers, capacity_pages=capacity_pages,
        )
        lib = get_library()
        c, _keep = shape._c()
        layer_stride = c_uint64(0)
        check(lib, lib.kvstage_kv_layout_preset(byref(c), int(which), byref(layer_stride)), "kvstage_kv_layout_preset")
        placed = dict(
            page_stride=c.page_stride, token_stride=c.token_stride, head_stride=c.head_stride, v_offset=c.v_offset,
            v_page_stride=c.v_page_stride, v_token_stride=c.v_token_stride, v_head_stride=c.v_head_stride,
        )
        ls, n = layer_stride.value, shape.num_layers
        common = dict(
            head_dim=head_dim, head_dim_v=shape.head_dim_v, global_heads=global_heads, local_heads=shape.local_heads,
            page_size=page_size, dtype_bytes=dtype_bytes, model=shape.model, tp_rank=tp_rank, tp_size=tp_size,
            pp_rank=pp_rank, pp_size=pp_size, layer_ids=layer_ids, num_layers=n, capacity_pages=capacity_pages, **placed,
        )
        sized = cls(**common, memory=memory if base is None else None)
        k_offsets = [i * ls for i in range(n)]
        v_offsets: Optional[List[int]] = None
        if shape.model == ModelKind.MHA and not c.v_offset:
            # sglang: the V buffers (of their own page size) after all K buffers.
            v_layer = sized.capacity_pages * sized.strides_of(1)[0]
            v_offsets = [n * ls + i * v_layer for i in range(n)]
        ends = [o + sized.buffer_bytes_of(0) for o in k_offsets] + [o + sized.buffer_bytes_of(1) for o in v_offsets or []]
        if shape.model == ModelKind.MHA and c.v_offset:
            ends += [o + c.v_offset + sized.buffer_bytes_of(1) for o in k_offsets]
        total = max(ends)
        if base is None:
            layout = sized
        else:
            info = buffer_info(base, "base", writable=True)
            if info.nbytes is not None and info.nbytes < total:
                raise argument_error(
                    "base", f"holds {info.nbytes} bytes, a {which.preset_name} pool of {capacity_pages} pages needs {total} (tensor_bytes)"
                )
            layout = cls(
                k_buffers=[info.address + o for o in k_offsets],
                v_buffers=None if v_offsets is None else [info.address + o for o in v_offsets],
                memory=memory if memory is not None else info.memory,
                **common,
            )
            layout._tensors = (info.keepalive,)
        layout.layer_stride, layout.preset_name, layout.tensor_bytes = ls, which.preset_name, total
        return layout

    @classmethod
    def from_tensors(
        cls,
        tensors: Any,
        *,
        layout: Union[str, int, LayoutPreset],
        global_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        dtype_bytes: Optional[int] = None,
        page_size: Optional[int] = None,
        model: Union[str, int, ModelKind] = ModelKind.MHA,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        layer_ids: Optional[Sequence[int]] = None,
        capacity_pages: Optional[int] = None,
        head_dim_v: Optional[int] = None,
    ) -> "KvLayout":
        """The layout of an engine's pool from the engine's own tensors: the addresses, shapes and
        strides are read from them (numpy arrays, torch tensors, ``__cuda_array_interface__``
        objects; torch is never imported), so padded pages and strided views come through.

        ``layout`` names the engine's layout (as :meth:`preset`) and so what ``tensors`` is:

        - ``"sglang"``: ``(k_tensors, v_tensors)``, per layer ``[slots, heads, head_dim]`` (MLA:
          the latent tensors alone, ``[slots, 1, latent]``); ``page_size`` defaults to 1, the
          capacity is ``slots // page_size`` pages.
        - ``"vllm-<order>"`` (or ``"LBHNC"`` …): the per-layer views ``[B, H, N, C]`` a
          connector gets, or one ``[L, B, H, N, C]`` tensor (the logical view; its strides name
          the physical order). ``C`` is ``K‖V``: K the first ``head_dim`` elements, V the rest
          (MLA: ``C`` is the latent). The strides must nest in the named order. Where V's heads
          differ in size (vLLM ``head_size_v``), give ``head_dim`` (V gets ``C - head_dim``).
        - ``"trtllm"``: one ``[blocks, L, 2, H, N, D]`` tensor (MLA: ``[blocks, L, 1, 1, N, D]``)
          or its per-layer slices ``[blocks, 2, H, N, D]``.

        A per-layer list may also be one tensor with a leading layer axis. The element size is
        the pool's ``dtype_bytes``; ``head_dim``, ``page_size``, ``dtype_bytes`` and
        ``capacity_pages`` (at most the tensors' blocks) are checked against the tensors where
        given; ``global_heads`` defaults to the tensors' heads × ``tp_size`` (1 for MLA). A
        mismatch raises :class:`ArgumentError` naming the tensor and both values. The layout
        keeps the tensors referenced; they must outlive the engine that registers it.
        """
        which = layout_preset(layout, "layout")
        kind = enum_arg(ModelKind, model, "model")
        if head_dim is not None:
            head_dim = u32(head_dim, "head_dim")
        if head_dim_v is not None:
            head_dim_v = u32(head_dim_v, "head_dim_v")
        if which == LayoutPreset.SGLANG:
            pool = sglang_tensors(tensors, kind, u32(1 if page_size is None else page_size, "page_size"))
        elif which.order:
            pool = vllm_tensors(tensors, which, kind, head_dim)
        else:
            pool = trtllm_tensors(tensors, kind)
        first = pool.views[0]
        if dtype_bytes is not None and u32(dtype_bytes, "dtype_bytes") != first.itemsize:
            raise argument_error(pool.label, f"has {first.itemsize}-byte elements, dtype_bytes is {dtype_bytes}")
        if head_dim is not None and head_dim != pool.head_dim:
            raise argument_error(pool.label, f"has rows of {pool.head_dim} elements ({pool.head_axis}), head_dim is {head_dim}")
        pool_dv = pool.head_dim if pool.head_dim_v is None else pool.head_dim_v
        if head_dim_v is not None and kind == ModelKind.MHA and head_dim_v != pool_dv:
            raise argument_error(pool.label, f"has V rows of {pool_dv} elements ({pool.head_axis}), head_dim_v is {head_dim_v}")
        if page_size is not None and u32(page_size, "page_size") != pool.page_size:
            raise argument_error(pool.label, f"has {pool.page_size} tokens per block ({pool.token_axis}), page_size is {page_size}")
        if kind == ModelKind.MLA:
            if pool.local_heads != 1:
                raise argument_error(pool.label, f"has {pool.local_heads} heads ({pool.heads_axis}), an MLA pool has one latent per token")
            global_heads = 1 if global_heads is None else u32(global_heads, "global_heads")
        else:
            global_heads = pool.local_heads * max(1, tp_size) if global_heads is None else u32(global_heads, "global_heads")
            want = max(1, global_heads // max(1, tp_size))
            if pool.local_heads != want:
                raise argument_error(
                    pool.label,
                    f"has {pool.local_heads} heads ({pool.heads_axis}), global_heads {global_heads} over tp_size {tp_size} puts {want} on a rank",
                )
        if capacity_pages is None:
            capacity_pages = pool.blocks
        elif u64(capacity_pages, "capacity_pages") > pool.blocks:
            raise argument_error(pool.label, f"holds {pool.blocks} pages ({pool.blocks_axis}), capacity_pages is {capacity_pages}")
        for v in pool.views[1:]:
            if (v.memory, v.device) != (first.memory, first.device):
                where = lambda t: t.memory.name.lower() + ("" if t.device is None else f" device {t.device}")  # noqa: E731
                raise argument_error(v.name, f"is in {where(v)} memory, {first.name} in {where(first)}")
        if layer_ids is not None and len(layer_ids) != len(pool.k):
            raise argument_error("layer_ids", f"has {len(layer_ids)} entries, the tensors hold {len(pool.k)} layers")
        out = cls(
            head_dim=pool.head_dim,
            head_dim_v=pool_dv,
            global_heads=global_heads,
            local_heads=pool.local_heads,
            page_size=pool.page_size,
            dtype_bytes=first.itemsize,
            model=kind,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            layer_ids=layer_ids,
            num_layers=len(pool.k),
            k_buffers=pool.k,
            v_buffers=pool.v,
            capacity_pages=capacity_pages,
            memory=first.memory,
            page_stride=pool.page_stride,
            token_stride=pool.token_stride,
            head_stride=pool.head_stride,
            v_offset=pool.v_offset,
            v_page_stride=pool.v_strides[0],
            v_token_stride=pool.v_strides[1],
            v_head_stride=pool.v_strides[2],
        )
        out._tensors = tuple({id(v.obj): v.obj for v in pool.views}.values())
        out.layer_stride, out.preset_name = pool.layer_stride, which.preset_name
        return out

    def _c(self) -> Tuple[_lib.kvstage_kv_layout, tuple]:
        """The C struct and the objects that must stay alive while it is used."""
        c = init_struct(get_library(), _lib.kvstage_kv_layout, "kvstage_kv_layout_init")
        c.model_kind = int(self.model)
        c.page_size = self.page_size
        c.local_heads = self.local_heads
        c.global_heads = self.global_heads
        c.head_dim = self.head_dim
        c.head_dim_v = self.head_dim_v
        c.dtype_bytes = self.dtype_bytes
        c.tp_rank, c.tp_size = self.tp_rank, self.tp_size
        c.pp_rank, c.pp_size = self.pp_rank, self.pp_size
        c.num_layers = self.num_layers
        c.capacity_pages = self.capacity_pages
        c.memory_kind = int(self.memory)
        c.page_stride, c.token_stride, c.head_stride = self.page_stride, self.token_stride, self.head_stride
        c.v_offset = self.v_offset
        c.v_page_stride, c.v_token_stride, c.v_head_stride = self.v_page_stride, self.v_token_stride, self.v_head_stride
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
        check(lib, lib.kvstage_kv_layout_validate(byref(c)), "kvstage_kv_layout_validate")

    def __repr__(self) -> str:
        placed = ""
        if self.page_stride or self.token_stride or self.head_stride or self.v_offset:
            page, token, head = self.strides
            placed = f", strides page {page} token {token} head {head}" + (f", v_offset={self.v_offset}" if self.v_offset else "")
        return (
            f"KvLayout({'' if self.preset_name is None else self.preset_name + ', '}model={self.model.name.lower()}, "
            f"heads {self.local_heads}/{self.global_heads}, "
            f"head_dim={self.head_dim}{'' if self.head_dim_v == self.head_dim else f', head_dim_v={self.head_dim_v}'}, dtype_bytes={self.dtype_bytes}, page_size={self.page_size}, "
            f"tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}, layers={self.num_layers}, "
            f"capacity_pages={self.capacity_pages}, memory={self.memory.name.lower()}{placed}, "
            f"buffers={'yes' if self.has_buffers else 'no'})"
        )


def stage_array(stages: Sequence[KvLayout]):
    """A ``kvstage_kv_layout`` array of ``stages`` and what keeps the memory it points to alive."""
    converted = [s._c() for s in stages]
    array = (_lib.kvstage_kv_layout * max(1, len(converted)))(*[c for c, _ in converted])
    return array, converted
