"""Engines' tensors as kvstage sees them: the address, shape and byte strides of an array or
tensor, read through its own protocols (numpy's ``__array_interface__``,
``__cuda_array_interface__``, a torch-style ``data_ptr()``/``stride()``/``element_size()``), and
the check that a tensor's strides nest in the order an engine's layout names.

Nothing here imports numpy or torch. Used by :meth:`kvstage.KvLayout.from_tensors`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

from ._buffers import _itemsize
from ._lib import MemoryKind
from .errors import argument_error

__all__ = ["TensorView", "is_tensor", "tensor_view", "check_nesting"]


class TensorView(NamedTuple):
    """One array or tensor: ``address`` of element ``[0, ..., 0]``, ``shape``, ``strides`` in
    bytes, ``itemsize`` in bytes, ``memory`` (host or CUDA), ``device`` (the CUDA ordinal where
    known, else None), ``obj`` (the object itself, to keep referenced)."""

    name: str
    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    memory: MemoryKind
    device: Optional[int]
    obj: Any


def _torch_like(obj: Any) -> bool:
    return callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "stride", None)) and callable(getattr(obj, "element_size", None))


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is an array or tensor (not a list of them)."""
    return _torch_like(obj) or hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__array_interface__")


def _dense(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    out, step = [], itemsize
    for extent in reversed(shape):
        out.append(step)
        step *= extent
    return tuple(reversed(out))


def _from_interface(obj: Any, iface: dict, memory: MemoryKind, name: str) -> TensorView:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise argument_error(name, "has an array interface without a (pointer, read_only) data tuple")
    address, read_only = data
    if read_only:
        raise argument_error(name, "is read-only, but the library writes into the pool")
    shape = tuple(int(x) for x in iface.get("shape", ()))
    itemsize = _itemsize(iface.get("typestr", ""), name)
    strides = iface.get("strides")
    own = getattr(obj, "strides", None)  # numpy's and cupy's own strides (bytes), also where the
    if isinstance(own, tuple) and len(own) == len(shape):  # interface leaves them out (contiguous)
        strides = own
    strides = _dense(shape, itemsize) if strides is None else tuple(int(s) for s in strides)
    device = None
    if memory == MemoryKind.CUDA:
        device = getattr(getattr(obj, "device", None), "id", None)
    return TensorView(name, int(address or 0), shape, strides, itemsize, memory, device, obj)


def tensor_view(obj: Any, name: str) -> TensorView:
    """Reads ``obj``'s address, shape and byte strides. A torch tensor: ``data_ptr()``,
    ``stride()`` (elements) × ``element_size()``, ``is_cuda``; ``__cuda_array_interface__``
    (CUDA) or ``__array_interface__`` (host; numpy). Raises for read-only, empty or negatively
    strided tensors."""
    if _torch_like(obj):
        itemsize = int(obj.element_size())
        shape = tuple(int(x) for x in obj.shape)
        strides = tuple(int(s) * itemsize for s in obj.stride())
        cuda = bool(getattr(obj, "is_cuda", False))
        device = None
        if cuda:
            index = getattr(getattr(obj, "device", None), "index", None)
            device = None if index is None else int(index)
        view = TensorView(name, int(obj.data_ptr()), shape, strides, itemsize, MemoryKind.CUDA if cuda else MemoryKind.HOST, device, obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        view = _from_interface(obj, obj.__cuda_array_interface__, MemoryKind.CUDA, name)
    elif hasattr(obj, "__array_interface__"):
        view = _from_interface(obj, obj.__array_interface__, MemoryKind.HOST, name)
    else:
        raise TypeError(
            f"{name}: expected an array or tensor (numpy, torch, __cuda_array_interface__), got {type(obj).__name__}"
        )
    if any(extent == 0 for extent in view.shape):
        raise argument_error(name, f"is empty (shape {view.shape})")
    if view.address <= 0:
        raise argument_error(name, "has no data pointer")
    bad = [i for i, (s, e) in enumerate(zip(view.strides, view.shape)) if s < 0 and e > 1]
    if bad:
        raise argument_error(name, f"has a negative stride on axis {bad[0]} (strides {view.strides} bytes)")
    return view


def check_nesting(name: str, order: str, axes: Sequence[Tuple[str, int, int]], itemsize: int, what: str) -> None:
    """Checks that axes ``(label, extent, byte stride)``, outermost first as ``order`` names them,
    nest: the innermost is contiguous elements, each other axis of extent > 1 steps over at least
    everything inside it (padding allowed). Raises naming the tensor, the axis, its stride and the
    least stride the order implies."""
    inner = list(reversed(axes))
    label, extent, stride = inner[0]
    if extent > 1 and stride != itemsize:
        raise argument_error(
            name,
            f"the {label} axis has stride {stride} bytes, {what} needs contiguous elements ({itemsize} bytes: "
            f"the {itemsize}-byte dtype); strides {_describe(axes)}",
        )
    span, inside = itemsize * extent, [label]
    for label, extent, stride in inner[1:]:
        if extent > 1 and stride < span:
            raise argument_error(
                name,
                f"the {label} axis has stride {stride} bytes, but {what} puts it outside the {', '.join(inside)} axes "
                f"({span} bytes): the strides do not match the order {order} (strides {_describe(axes)})",
            )
        span = span + (extent - 1) * stride if extent > 1 else span
        inside.insert(0, label)


def _describe(axes: Sequence[Tuple[str, int, int]]) -> str:
    return ", ".join(f"{label} {stride}" for label, _, stride in axes)
