"""libkvstage's log records in Python's standard :mod:`logging`.

When the package loads the library (:func:`kvstage.load_library`, or the first object that needs
it), it installs a log callback (``kvstage_log_set_callback``) that hands every record to the
logger ``kvstage.<target>``, the target's ``::`` turned into dots without the leading crate name
(``kvstage::transport::rdma`` → ``kvstage.transport.rdma``). Set ``KVSTAGE_PYTHON_LOGGING=0`` to
keep the library's own stderr output instead.

Levels: ``KVSTAGE_LOG_ERROR`` → ``ERROR``, ``WARN`` → ``WARNING``, ``INFO`` → ``INFO``, ``DEBUG``
→ ``DEBUG``, ``TRACE`` → :data:`TRACE` (5). A record about a session reads
``"session <id>: <message>"`` and carries ``kvstage_session`` (the id, ``""`` for none) and
``kvstage_target`` as attributes.

The library only hands over records at or above the level given to :func:`route_logs_to_python`:
by default ``KVSTAGE_LOG`` when set (``off``, ``error``, ``warn``, ``info``, ``debug``,
``trace``), else the effective level of the ``kvstage`` logger at that moment. After changing that
logger's level, call :func:`route_logs_to_python` again so that the library sends what it now
wants. At interpreter exit the records go back to stderr (no callback into a finalizing
interpreter).

Records are delivered on the thread that logs (often a library thread): the handlers of the
``kvstage`` loggers must not call kvstage functions and should not block for long.

This module is the mechanism, for an explicit :class:`~kvstage._lib.Library`; the public
:func:`kvstage.route_logs_to_python` and :func:`kvstage.route_logs_to_stderr` (in
``kvstage/library.py``, above this module) apply it to the process's library.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, Optional, Union

from . import _lib
from ._lib import Library
from .errors import argument_error, last_error

#: Python level of ``KVSTAGE_LOG_TRACE`` records (below ``DEBUG``).
TRACE = 5

#: The environment variable that turns the automatic routing off (``0``).
PYTHON_LOGGING_ENV = "KVSTAGE_PYTHON_LOGGING"

#: ``kvstage_log_level`` values.
LOG_OFF, LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG, LOG_TRACE = range(6)

_TO_PYTHON = {LOG_ERROR: logging.ERROR, LOG_WARN: logging.WARNING, LOG_INFO: logging.INFO, LOG_DEBUG: logging.DEBUG, LOG_TRACE: TRACE}
_NAMES = {"off": LOG_OFF, "error": LOG_ERROR, "warn": LOG_WARN, "warning": LOG_WARN, "info": LOG_INFO, "debug": LOG_DEBUG, "trace": LOG_TRACE}


def python_level(level: int) -> int:
    """The :mod:`logging` level of a ``kvstage_log_level`` value (unknown values: ``ERROR``)."""
    return _TO_PYTHON.get(level, logging.ERROR)


def library_level(level: int) -> int:
    """The ``kvstage_log_level`` that passes records at or above the :mod:`logging` level ``level``."""
    if level <= TRACE:
        return LOG_TRACE
    if level <= logging.DEBUG:
        return LOG_DEBUG
    if level <= logging.INFO:
        return LOG_INFO
    if level <= logging.WARNING:
        return LOG_WARN
    if level <= logging.CRITICAL:
        return LOG_ERROR
    return LOG_OFF


def logger_name(target: str) -> str:
    """``"kvstage::transport::rdma"`` → ``"kvstage.transport.rdma"``."""
    parts = [p for p in target.split("::") if p]
    if parts and parts[0] == "kvstage":
        parts = parts[1:]
    return ".".join(["kvstage", *parts])


def _text(raw: Optional[bytes]) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def _deliver(_user_data: Any, record: Any) -> None:
    # Runs on the thread that logs, with the GIL taken by ctypes. Nothing may escape into C.
    try:
        r = record.contents
        level = python_level(r.level)
        target = _text(r.target)
        logger = logging.getLogger(logger_name(target))
        if not logger.isEnabledFor(level):
            return
        session = _text(r.session)
        message = _text(r.message)
        text = f"session {session}: {message}" if session else message
        logger.log(level, "%s", text, extra={"kvstage_session": session, "kvstage_target": target})
    except BaseException:  # noqa: BLE001 - a logging failure must not unwind into the library
        pass


# Module-level: the library may call it at any time until the callback is removed, so it is
# never collected.
_CALLBACK = _lib.kvstage_log_fn(_deliver)
_NO_CALLBACK = _lib.kvstage_log_fn()

_state_lock = threading.Lock()
# Libraries (by path) whose callback is removed at interpreter exit.
_atexit_registered: set = set()


def _resolve(level: Union[None, int, str]) -> int:
    if level is None:
        env = os.environ.get("KVSTAGE_LOG", "").strip().lower()
        if env in _NAMES:
            return _NAMES[env]
        return library_level(logging.getLogger("kvstage").getEffectiveLevel())
    if isinstance(level, str):
        try:
            return _NAMES[level.strip().lower()]
        except KeyError:
            raise argument_error("level", f"{level!r} is not one of off, error, warn, info, debug, trace") from None
    return library_level(int(level))


def route_to_python(lib: Library, level: Union[None, int, str] = None) -> int:
    """Sends ``lib``'s log records to :mod:`logging` (see :func:`kvstage.route_logs_to_python`);
    returns the ``kvstage_log_level`` in force."""
    c_level = _resolve(level)
    rc = lib.kvstage_log_set_callback(_CALLBACK, None, c_level)
    if rc < 0:
        raise last_error(lib, rc, "kvstage_log_set_callback")
    _register_atexit(lib)
    return c_level


def route_to_stderr(lib: Library) -> None:
    """Gives ``lib``'s log records back to its own stderr output (see
    :func:`kvstage.route_logs_to_stderr`)."""
    rc = lib.kvstage_log_set_callback(_NO_CALLBACK, None, LOG_OFF)
    if rc < 0:
        raise last_error(lib, rc, "kvstage_log_set_callback")


def _register_atexit(lib: Library) -> None:
    with _state_lock:
        if lib.path in _atexit_registered:
            return
        _atexit_registered.add(lib.path)

    def restore() -> None:
        try:
            lib.kvstage_log_set_callback(_NO_CALLBACK, None, LOG_OFF)
        except Exception:  # noqa: BLE001 - at exit, best effort
            pass

    atexit.register(restore)


def install_default(lib: Library) -> None:
    """Called when the package loads its library: routes the records to :mod:`logging` unless
    ``KVSTAGE_PYTHON_LOGGING=0``. Never raises (loading the library must not fail over logs)."""
    if os.environ.get(PYTHON_LOGGING_ENV, "").strip() == "0":
        return
    try:
        route_to_python(lib)
    except Exception:  # noqa: BLE001
        pass
