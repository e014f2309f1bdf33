"""The library this process uses (header section "library"): loading it, its version and
capabilities, and where its log records go.

Importing the package does not load the library; the first object or helper that needs it does
(:func:`get_library`), or :func:`load_library`, which also takes an explicit path. Once loaded, its
log records go to the :mod:`logging` loggers ``kvstage.<target>`` (``KVSTAGE_PYTHON_LOGGING=0``
keeps the library's own stderr output).
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Optional, Union

from . import _lib, _logging
from ._common import check, output_struct
from ._lib import Library, find_and_load

__all__ = [
    "load_library",
    "get_library",
    "version",
    "capabilities",
    "Capabilities",
    "route_logs_to_python",
    "route_logs_to_stderr",
]

_lock = threading.Lock()
_default: Optional[Library] = None


def load_library(path: Optional[str] = None) -> Library:
    """Loads ``libkvstage.so`` and makes it the library that new kvstage objects use.

    ``path`` (a file or a directory) wins over ``KVSTAGE_LIBRARY``, the package directory and the
    system loader (see :mod:`kvstage._lib`). Without ``path`` an already loaded library is
    returned as is. Raises :class:`LibraryLoadError` (an ``ImportError``) when the library cannot
    be loaded and :class:`LibraryVersionError` when its version differs from the package's.
    """
    global _default
    with _lock:
        if path is None and _default is not None:
            return _default
        lib = find_and_load(path)
        _default = lib
        # Its log records go to the `logging` module from now on (opt out with
        # KVSTAGE_PYTHON_LOGGING=0).
        _logging.install_default(lib)
        return lib


def get_library() -> Library:
    """The library new objects use: the loaded one, else :func:`load_library` without a path."""
    lib = _default
    return lib if lib is not None else load_library()


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
    """``kvstage_capabilities_get``."""
    lib = get_library()
    caps = output_struct(_lib.kvstage_capabilities)
    check(lib, lib.kvstage_capabilities_get(ctypes.byref(caps)), "kvstage_capabilities_get")
    return Capabilities(bool(caps.tcp), bool(caps.rdma), bool(caps.host_memory), bool(caps.cuda_memory))


def route_logs_to_python(level: Union[None, int, str] = None, *, library: Optional[Library] = None) -> int:
    """Sends the library's log records to :mod:`logging` (loggers ``kvstage.<target>``).

    ``level``: a :mod:`logging` level (``logging.DEBUG``), a ``KVSTAGE_LOG`` name (``"debug"``),
    or ``None`` for ``KVSTAGE_LOG`` when set, else the ``kvstage`` logger's effective level. The
    library hands over records at or above it; the loggers' own levels and handlers then apply.
    Returns the ``kvstage_log_level`` in force. Process-wide (one callback for every engine).
    """
    return _logging.route_to_python(library or get_library(), level)


def route_logs_to_stderr(*, library: Optional[Library] = None) -> None:
    """Gives the library's log records back to its own stderr output (at the ``KVSTAGE_LOG`` level).

    Returns once no record is being delivered to Python any more.
    """
    _logging.route_to_stderr(library or get_library())
