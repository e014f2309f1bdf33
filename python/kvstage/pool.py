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
from ._lib import MemoryKind, ModelKind
from .errors import argument_error
from .library import get_library

__all__ = ["KvLayout"]


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
        self.model = enum_arg(ModelKind, model, "model")
        self.head_dim = u32(head_dim, "head_dim")
        self.global_heads = u32(global_heads, "global_heads")
        self.page_size = u32(page_size, "page_size")
        self.dtype_bytes = u32(dtype_bytes, "dtype_bytes")
        self.tp_rank, self.tp_size = u32(tp_rank, "tp_rank"), u32(tp_size, "tp_size")
        self.pp_rank, self.pp_size = u32(pp_rank, "pp_rank"), u32(pp_size, "pp_size")
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
            self.memory = enum_arg(MemoryKind, memory, "memory")
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
        self.capacity_pages = u64(capacity_pages or 0, "capacity_pages")
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
        c = init_struct(get_library(), _lib.kvstage_kv_layout, "kvstage_kv_layout_init")
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
        check(lib, lib.kvstage_kv_layout_validate(byref(c)), "kvstage_kv_layout_validate")

    def __repr__(self) -> str:
        return (
            f"KvLayout(model={self.model.name.lower()}, heads {self.local_heads}/{self.global_heads}, "
            f"head_dim={self.head_dim}, dtype_bytes={self.dtype_bytes}, page_size={self.page_size}, "
            f"tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}, layers={self.num_layers}, "
            f"capacity_pages={self.capacity_pages}, memory={self.memory.name.lower()}, "
            f"buffers={'yes' if self.has_buffers else 'no'})"
        )


def stage_array(stages: Sequence[KvLayout]):
    """A ``kvstage_kv_layout`` array of ``stages`` and what keeps the memory it points to alive."""
    converted = [s._c() for s in stages]
    array = (_lib.kvstage_kv_layout * max(1, len(converted)))(*[c for c, _ in converted])
    return array, converted
