"""What every object module shares: argument conversion, the status check, the versioned
structs' sizes, texts the library writes, and owned handles.

Imports only ``_lib`` and ``errors`` (below it); every object module imports it.
"""

from __future__ import annotations

import ctypes
import json
import threading
from ctypes import byref, c_size_t
from typing import Any, Optional, Type, TypeVar, Union

from ._lib import ErrorClass, Library, Status
from .errors import ClosedHandleError, argument_error, last_error

S = TypeVar("S", bound=ctypes.Structure)


def check(lib: Library, rc: int, what: str) -> Union[Status, int]:
    """Raises the last error for a negative code; returns informational codes as :class:`Status`."""
    if rc < 0:
        raise last_error(lib, rc, what)
    return status_of(rc)


def status_of(code: int) -> Union[Status, int]:
    """``code`` as a :class:`Status`, or the plain int for a code this package does not know."""
    try:
        return Status(code)
    except ValueError:
        return code


def u32(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 32:
        raise argument_error(name, f"{value} is outside 0..2^32")
    return value


def u64(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        raise argument_error(name, f"{value} is outside 0..2^64")
    return value


def enum_arg(cls, value, name: str):
    """An enum member from a member, its value or its name (case-insensitive)."""
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            raise argument_error(name, f"{value!r} is not one of {', '.join(m.name.lower() for m in cls)}") from None
    try:
        return cls(value)
    except ValueError:
        raise argument_error(name, f"{value!r} is not a {cls.__name__} value") from None


def init_struct(lib: Library, cls: Type[S], init: str) -> S:
    """A versioned input struct filled by its ``_init`` function (``init(&x, sizeof x)``)."""
    c = cls()
    check(lib, getattr(lib, init)(byref(c), ctypes.sizeof(c)), init)
    return c


def output_struct(cls: Type[S]) -> S:
    """A versioned output struct with ``struct_size`` set, as the library requires before a call."""
    c = cls()
    c.struct_size = ctypes.sizeof(c)
    return c


def output_array(cls: Type[S], n: int) -> Any:
    """An array of ``n`` versioned output structs (at least one), every ``struct_size`` set."""
    array = (cls * max(1, n))()
    for item in array:
        item.struct_size = ctypes.sizeof(cls)
    return array


def read_text(lib: Library, fn: str, *args: Any) -> str:
    """A text the library writes (``buf, capacity, needed``): size query, then fill (again while
    it grows between the two)."""
    call = getattr(lib, fn)
    needed = c_size_t(0)
    rc = 0
    for _ in range(8):
        check(lib, call(*args, None, 0, byref(needed)), fn)
        buf = ctypes.create_string_buffer(needed.value + 4096)
        rc = call(*args, buf, len(buf), byref(needed))
        if rc == 0:
            return buf.value.decode("utf-8")
    check(lib, rc, fn)
    raise AssertionError("unreachable: a failed fill raises")


def read_json(lib: Library, fn: str, *args: Any) -> dict:
    """A JSON document the library writes, as a dict."""
    return json.loads(read_text(lib, fn, *args))


class Handle:
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
