"""Whole requests: the parts of a request besides its paged KV (``kvstage_component``,
``kvstage_request_parts``).

A rank registers its components once, after its KV pool and before its sessions connect
(:meth:`Engine.register_components`, ``kvstage_pool_register_components``): aux buffers (sglang's ``MetadataBuffers``: one row per
request), per-request state (Mamba/GDN conv and SSM slots, per layer, sharded by TP) and extra
paged pools (a sliding window's KV, an indexer's key pages). Both sides register the same
components in the same order. The decode side names a request's row, slots and pool pages when it
opens the room (``Engine.open_room(..., parts=RequestParts(...))``); the prefill side names its own
with the transfer of the room's last chunk (``Session.transfer(..., parts=...)``). They travel in
that chunk's staging write, and the room completes once all of it is in place, the aux rows
written last.
"""

import ctypes
from ctypes import POINTER, byref, c_uint32, c_uint64
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from . import _lib
from ._buffers import buffer_info, page_array
from ._common import check, init_struct

AUX, STATE, POOL = 0, 1, 2


class AuxBuffer(NamedTuple):
    """A metadata buffer: ``rows`` rows of ``row_bytes`` (one per request; each side picks its own
    row). ``buffer``: an int address, a numpy array or a torch tensor (host or CUDA memory)."""

    name: str
    buffer: Any
    row_bytes: int
    rows: int


class StateComponent(NamedTuple):
    """Per-request state on ``layer_ids``: ``buffers[i]`` (layer ``layer_ids[i]``) holds ``slots``
    slots of this rank's share of an item of ``outer`` rows of ``sum(group_dims)`` elements of
    ``dtype_bytes`` (each group sharded across TP on its own; ``replicated``: whole everywhere)."""

    name: str
    buffers: Sequence[Any]
    layer_ids: Sequence[int]
    slots: int
    group_dims: Sequence[int]
    outer: int = 1
    dtype_bytes: int = 2
    replicated: bool = False


class PoolComponent(NamedTuple):
    """An extra paged pool on ``layer_ids``: ``buffers[i]`` holds ``pages`` pages of ``page_size``
    token slots of ``unit_bytes`` per local KV head (``head_sliced``, cut like the KV under a TP
    change) or of ``unit_bytes`` (whole on every rank, sent once)."""

    name: str
    buffers: Sequence[Any]
    layer_ids: Sequence[int]
    pages: int
    page_size: int
    unit_bytes: int
    head_sliced: bool = True


class PoolSpan(NamedTuple):
    """Tokens ``[first_token, first_token + num_tokens)`` of a pool's page list for one request."""

    pages: Any
    num_tokens: int
    first_token: int = 0


class RequestParts(NamedTuple):
    """What one side names of a request besides its KV pages: its aux row, one slot per state
    component and one span per pool component (registration order)."""

    aux_row: int = 0
    state_slots: Sequence[int] = ()
    pool_spans: Sequence[PoolSpan] = ()


def _ids(values: Sequence[int], ctype: Any) -> Any:
    values = [int(v) for v in values]
    return (ctype * max(1, len(values)))(*values)


def components_c(lib: Any, components: Sequence[Any]) -> Tuple[Any, list]:
    """The ``kvstage_component`` array for ``components`` and what keeps its memory alive."""
    array = (_lib.kvstage_component * max(1, len(components)))()
    keep: list = [array]
    for i, comp in enumerate(components):
        label = f"components[{i}]"
        c = array[i]
        check(lib, lib.kvstage_component_init(byref(c), ctypes.sizeof(c)), "kvstage_component_init")
        name = comp.name.encode("utf-8")
        keep.append(name)
        c.name = name
        if isinstance(comp, AuxBuffer):
            c.kind, c.item_bytes, c.num_items = AUX, comp.row_bytes, comp.rows
            buffers: Sequence[Any] = [comp.buffer]
        elif isinstance(comp, StateComponent):
            dims = _ids(comp.group_dims, c_uint32)
            item = init_struct(lib, _lib.kvstage_state_item, "kvstage_state_item_init")
            item.outer, item.dtype_bytes, item.replicated = comp.outer, comp.dtype_bytes, int(bool(comp.replicated))
            item.group_dims, item.num_groups = ctypes.cast(dims, POINTER(c_uint32)), len(comp.group_dims)
            keep += [dims, item]
            c.kind, c.num_items, c.state = STATE, comp.slots, ctypes.pointer(item)
            buffers = comp.buffers
        elif isinstance(comp, PoolComponent):
            c.kind, c.item_bytes, c.num_items = POOL, comp.unit_bytes, comp.pages
            c.page_size, c.head_sliced = comp.page_size, int(bool(comp.head_sliced))
            buffers = comp.buffers
        else:
            raise TypeError(f"{label}: expected an AuxBuffer, StateComponent or PoolComponent, got {type(comp).__name__}")
        if not isinstance(comp, AuxBuffer):
            ids = _ids(comp.layer_ids, c_uint32)
            c.layer_ids, c.num_layers = ctypes.cast(ids, POINTER(c_uint32)), len(comp.layer_ids)
            keep.append(ids)
        infos = [buffer_info(b, f"{label}.buffers[{k}]", writable=True) for k, b in enumerate(buffers)]
        # Host or CUDA memory (numpy arrays, torch tensors on either side): the library asks the
        # driver which.
        keep += [info.keepalive for info in infos]
        bases = _ids([info.address for info in infos], c_uint64)
        c.bases, c.num_bases = ctypes.cast(bases, POINTER(c_uint64)), len(infos)
        keep.append(bases)
    return array, keep


def request_parts_c(lib: Any, parts: Optional[RequestParts]) -> Tuple[Any, list]:
    """A pointer to the ``kvstage_request_parts`` for ``parts`` (NULL for None) and its keepalive."""
    if parts is None:
        return None, []
    c = init_struct(lib, _lib.kvstage_request_parts, "kvstage_request_parts_init")
    slots = _ids(parts.state_slots, c_uint64)
    spans = (_lib.kvstage_pool_span * max(1, len(parts.pool_spans)))()
    keep: list = [c, slots, spans]
    for i, span in enumerate(parts.pool_spans):
        pages, address, count = page_array(span.pages, f"parts.pool_spans[{i}].pages")
        keep.append(pages)
        spans[i].pages, spans[i].num_pages = ctypes.cast(address, POINTER(c_uint32)), count
        spans[i].first_token, spans[i].num_tokens = int(span.first_token), int(span.num_tokens)
    c.aux_row = int(parts.aux_row)
    c.state_slots, c.num_state_slots = ctypes.cast(slots, POINTER(c_uint64)), len(parts.state_slots)
    c.pool_spans, c.num_pool_spans = ctypes.cast(spans, POINTER(_lib.kvstage_pool_span)), len(parts.pool_spans)
    return ctypes.pointer(c), keep


__all__: List[str] = ["AuxBuffer", "StateComponent", "PoolComponent", "PoolSpan", "RequestParts"]
