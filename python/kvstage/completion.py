"""Completion callbacks (header section "engine", ``kvstage_engine_set_completion_callback``): the
C callback that calls a Python function for every completion of an engine.

The Python callback is ``callback(kind, status, tag, room, chunk)``: ``kind`` a
:class:`CompletionKind` (``OP``: an asynchronous operation ended, ``tag`` its tag; ``CHUNK``: a
decode chunk landed or failed, ``room`` and ``chunk``; ``ROOM``: a decode room ended, every chunk
and part in place or the room failed, ``room``, and ``chunk`` is the room's chunk count),
``status`` a :class:`Status`. With
``metrics=True`` it also gets ``timings`` (a :class:`TransferTimings`, for ``OP``) and
``scatter_ns`` (for ``CHUNK``); with ``trace=True`` the keyword ``trace`` (the request's trace id);
with ``keys=True`` the keyword ``room_key`` (``CHUNK`` and ``ROOM``: the room's opening).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable, Optional

from . import _lib
from ._common import status_of
from ._lib import CompletionKind
from .stats import TransferTimings

__all__ = ["CompletionKind"]

# How deep this thread is inside completion callbacks (a replacement from inside one must keep
# the running callback's thunk alive).
_IN_CALLBACK = threading.local()


def in_callback() -> bool:
    """True on a thread that is running a completion callback now."""
    return getattr(_IN_CALLBACK, "depth", 0) > 0


def _kind(value: int) -> Any:
    try:
        return CompletionKind(value)
    except ValueError:
        return value


def c_callback(callback: Optional[Callable[..., Any]], metrics: bool = False, trace: bool = False, keys: bool = False) -> Any:
    """The ``kvstage_completion_fn`` that calls ``callback`` (a NULL one for ``None``). The caller
    keeps it alive while the library may call it."""
    if callback is None:
        return _lib.kvstage_completion_fn()

    def trampoline(_user: Any, c: Any) -> None:
        v = c.contents
        extra = {}
        if trace:
            extra["trace"] = v.trace_id.decode("ascii")
        if keys:
            extra["room_key"] = v.room_key
        _IN_CALLBACK.depth = getattr(_IN_CALLBACK, "depth", 0) + 1
        try:
            args = [_kind(v.kind), status_of(v.status), v.tag, v.room, v.chunk_index]
            if metrics:
                args += [TransferTimings._from_c(v.timings), v.scatter_ns]
            callback(*args, **extra)
        except Exception:  # never unwind into the library's thread
            traceback.print_exc()
        finally:
            _IN_CALLBACK.depth -= 1

    return _lib.kvstage_completion_fn(trampoline)
