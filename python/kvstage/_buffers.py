"""Memory arguments: integers, buffer-protocol objects, ``__array_interface__``,
``__cuda_array_interface__`` and torch-style ``data_ptr()`` tensors, and page-index lists.

Nothing here imports numpy or torch: the objects are inspected through their own protocols.
"""

from __future__ import annotations

import array
import ctypes
import re
from typing import Any, NamedTuple, Optional, Tuple

from ._lib import MemoryKind
from .errors import argument_error

__all__ = ["BufferInfo", "buffer_info", "buffer_address", "page_array"]


class BufferInfo(NamedTuple):
    """Where a buffer argument lives.

    ``memory`` is ``None`` for a bare integer (the caller says where it points), ``nbytes`` is
    ``None`` when unknown (integers). ``keepalive`` must be kept referenced while the library may
    use the memory (it holds the buffer export of buffer-protocol objects).
    """

    address: int
    nbytes: Optional[int]
    memory: Optional[MemoryKind]
    keepalive: Any


_TYPESTR = re.compile(r"^[<>|=]?[a-zA-Z](\d+)$")


def _itemsize(typestr: str, name: str) -> int:
    m = _TYPESTR.match(typestr or "")
    if not m:
        raise argument_error(name, f"unsupported array typestr {typestr!r}")
    return int(m.group(1))


def _from_interface(obj: Any, iface: dict, memory: MemoryKind, name: str, writable: bool) -> BufferInfo:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise argument_error(name, "array interface without a (pointer, read_only) data tuple")
    address, read_only = data
    shape = tuple(iface.get("shape", ()))
    itemsize = _itemsize(iface.get("typestr", ""), name)
    strides = iface.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        # Extents of 1 may carry any stride; every other stride must be the C-contiguous one.
        if any(s != e and extent != 1 for s, e, extent in zip(strides, reversed(expected), shape)):
            raise argument_error(name, f"is not C-contiguous (shape {shape}, strides {tuple(strides)})")
    if read_only and writable:
        raise argument_error(name, "is read-only, but the library writes into it")
    nbytes = itemsize
    for extent in shape:
        nbytes *= extent
    if nbytes == 0:
        raise argument_error(name, "is empty")
    return BufferInfo(int(address), nbytes, memory, obj)


def buffer_info(obj: Any, name: str = "buffer", *, writable: bool = True) -> BufferInfo:
    """Describes a memory argument.

    Accepted, in this order: ``int`` (an address, host or device); objects with ``data_ptr()``
    (torch tensors: ``is_cuda`` tells the memory kind; must be contiguous); objects with
    ``__cuda_array_interface__`` (CUDA memory) or ``__array_interface__`` (host memory), which must
    be C-contiguous; objects with the buffer protocol (``bytearray``, ``mmap``, ``array.array``;
    host memory, writable and contiguous). ``writable=False`` accepts read-only arrays.
    """
    if isinstance(obj, bool):
        raise TypeError(f"{name}: a bool is not a memory address")
    if isinstance(obj, int):
        if obj <= 0 or obj >= 1 << 64:
            raise argument_error(name, f"address {obj:#x} is not a valid pointer")
        return BufferInfo(obj, None, None, None)
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise argument_error(name, "is not contiguous (call .contiguous())")
        nbytes = int(obj.numel()) * int(obj.element_size())
        if nbytes == 0:
            raise argument_error(name, "is empty")
        memory = MemoryKind.CUDA if getattr(obj, "is_cuda", False) else MemoryKind.HOST
        return BufferInfo(int(data_ptr()), nbytes, memory, obj)
    if hasattr(type(obj), "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__"):
        return _from_interface(obj, obj.__cuda_array_interface__, MemoryKind.CUDA, name, writable)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        if tuple(iface.get("shape", ())) == () and hasattr(obj, "__index__"):
            return buffer_info(int(obj.__index__()), name, writable=writable)  # a numpy integer scalar
        if iface.get("data") is not None:
            return _from_interface(obj, iface, MemoryKind.HOST, name, writable)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{name}: expected an int address or an object with the buffer protocol, __array_interface__, "
            f"__cuda_array_interface__ or data_ptr(), got {type(obj).__name__}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise argument_error(name, "is not C-contiguous")
        if view.nbytes == 0:
            raise argument_error(name, "is empty")
        if view.readonly:
            raise argument_error(
                name, "is a read-only buffer; pass a writable one (bytearray, numpy array) or an int address"
            )
        nbytes = view.nbytes
    holder = (ctypes.c_char * nbytes).from_buffer(obj)  # holds the export while the library uses it
    return BufferInfo(ctypes.addressof(holder), nbytes, MemoryKind.HOST, (obj, holder))


def buffer_address(obj: Any, name: str = "buffer", *, writable: bool = True) -> int:
    """The address of a memory argument (see :func:`buffer_info`)."""
    return buffer_info(obj, name, writable=writable).address


def page_array(pages: Any, name: str) -> Tuple[Any, int, int]:
    """Page indices as a C ``uint32_t`` array: ``(keepalive, address, count)``.

    Accepts any iterable of ints, numpy arrays and torch tensors (through ``tolist()``).
    """
    if isinstance(pages, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence of page indices, got {type(pages).__name__}")
    try:
        values = list(pages.tolist() if hasattr(pages, "tolist") else pages)  # a copy: never the caller's list
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of page indices, got {type(pages).__name__}") from None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            if hasattr(v, "__index__") and not isinstance(v, bool):
                values[i] = v.__index__()
                continue
            raise TypeError(f"{name}[{i}]: expected an int page index, got {type(v).__name__}")
    try:
        arr = array.array("I", values)
    except OverflowError:
        bad = next(v for v in values if not 0 <= v < 1 << 32)
        raise argument_error(name, f"page index {bad} is outside 0..2^32") from None
    assert arr.itemsize == 4, "array('I') is 32-bit on every supported platform"
    address, count = arr.buffer_info()
    return arr, address, count
