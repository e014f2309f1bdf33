"""Exceptions built from the C library's thread-local last error.

Every failing call raises a subclass of :class:`KVStageError` chosen by the family of its status
code (the tens digit). The C cause chain (``kvstage_error.causes``, outermost first) becomes a
chain of :class:`KVStageCause` exceptions linked through ``__cause__``::

    try:
        session = engine.connect(addr, "req-42/p0-d1")
    except kvstage.GeometryError as e:
        e.session        # "req-42/p0-d1"
        e.__cause__      # the outermost cause; its __cause__ the next one, down to the root
        e.causes         # the same texts as a tuple of strings, outermost first
        e.root_cause     # the innermost exception of the chain

``KVSTAGE_FALLBACK`` and ``KVSTAGE_PENDING`` are return values, never exceptions.
"""

from __future__ import annotations

from typing import Optional, Sequence, Type

from ._lib import ErrorClass, LibraryLoadError, LibraryVersionError, Status, status_name

__all__ = [
    "KVStageError",
    "KVStageCause",
    "ArgumentError",
    "ClosedHandleError",
    "GeometryError",
    "TimeError",
    "TransportError",
    "ProtocolError",
    "DeviceError",
    "InternalError",
    "LibraryLoadError",
    "LibraryVersionError",
    "error_class_for",
]


class KVStageError(Exception):
    """A failed kvstage call.

    Attributes: ``code`` (:class:`Status`, or a plain int for a code this package does not know),
    ``klass`` (:class:`ErrorClass`), ``session`` (the session id the failure belongs to, ``""``
    when none), ``message`` (the library's one-line message), ``causes`` (tuple of strings,
    outermost first; also chained as ``__cause__`` exceptions).
    """

    def __init__(
        self,
        message: str,
        *,
        code: int = Status.E_INTERNAL,
        klass: int = ErrorClass.NONE,
        session: str = "",
        causes: Sequence[str] = (),
    ):
        super().__init__(message)
        self.message = message
        try:
            self.code = Status(code)
        except ValueError:
            self.code = int(code)
        try:
            self.klass = ErrorClass(klass)
        except ValueError:
            self.klass = int(klass)
        self.session = session
        self.causes = tuple(causes)
        previous: BaseException = self
        for depth, text in enumerate(self.causes):
            cause = KVStageCause(text, depth)
            previous.__cause__ = cause
            previous.__suppress_context__ = True
            previous = cause

    @property
    def code_name(self) -> str:
        """The C name of ``code`` (``"KVSTAGE_E_GEOMETRY_MISMATCH"``)."""
        return status_name(self.code)

    @property
    def root_cause(self) -> BaseException:
        """The innermost exception of the ``__cause__`` chain (this error when it has no cause)."""
        e: BaseException = self
        while e.__cause__ is not None:
            e = e.__cause__
        return e

    def __reduce__(self):
        # Picklable (multiprocessing, logging handlers) with every attribute and the chain.
        return (_rebuild, (type(self), self.message, int(self.code), int(self.klass), self.session, self.causes))

    def __str__(self) -> str:
        where = f", session {self.session!r}" if self.session else ""
        return f"{self.message} ({self.code_name}{where})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code_name}, session={self.session!r})"


class KVStageCause(Exception):
    """One entry of a C cause chain; ``depth`` 0 is the outermost cause."""

    def __init__(self, message: str, depth: int):
        super().__init__(message)
        self.message = message
        self.depth = depth

    def __reduce__(self):
        return (KVStageCause, (self.message, self.depth))


def _rebuild(cls, message, code, klass, session, causes):
    return cls(message, code=code, klass=klass, session=session, causes=causes)


class ArgumentError(KVStageError, ValueError):
    """Arguments and build (-1..-9): invalid argument, unsupported, out of memory."""


class ClosedHandleError(ArgumentError):
    """A method was called on an object whose handle was already closed (raised by Python; the
    freed handle is never passed to the library)."""


class GeometryError(KVStageError):
    """Geometry and staging (-1x): mismatch (field diff in the causes), invalid layout, staging too
    small, oversized chunk."""


class TimeError(KVStageError):
    """Time (-2x): the timeout passed (``E_TIMEOUT``), the operation was canceled
    (``E_CANCELED``), or the transfer named an opening of its room that is no longer the open one
    (``E_STALE_ROOM``: released, maybe reopened for another request, or a wrong room key)."""


class TransportError(KVStageError):
    """Transport (-3x): socket failure, connection refused, peer gone."""


class ProtocolError(KVStageError):
    """Protocol (-4x): malformed or unexpected message, integrity, authentication."""


class DeviceError(KVStageError):
    """Devices (-5x): CUDA, RDMA, device absent."""


class InternalError(KVStageError):
    """Library faults (-9x): a caught panic, a poisoned handle, a violated invariant."""


_FAMILIES = {
    0: ArgumentError,
    1: GeometryError,
    2: TimeError,
    3: TransportError,
    4: ProtocolError,
    5: DeviceError,
    9: InternalError,
}


def error_class_for(code: int) -> Type[KVStageError]:
    """The exception class of a negative status code (its family, by the tens digit)."""
    if code >= 0:
        return KVStageError
    return _FAMILIES.get((-code) // 10, KVStageError)


def _text(raw: Optional[bytes]) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def last_error(lib, code: int, what: str) -> KVStageError:
    """Builds the exception for a call that returned ``code`` (< 0) from this thread's last error.

    Everything is copied out of the library's storage before anything else is called (the strings
    live only until the next kvstage call on this thread).
    """
    e = lib.kvstage_error_last().contents
    err_code = int(e.code)
    klass = int(e.klass)
    session = _text(e.session)
    message = _text(e.message)
    causes = [_text(e.causes[i]) for i in range(int(e.cause_count))] if e.causes else []
    if err_code == Status.OK:
        # The library returned an error without leaving details: say so rather than "no error".
        message = f"{what} returned {status_name(code)} without setting the last error"
        klass = ErrorClass.INTERNAL
    elif err_code != code:
        causes.append(f"{what} returned {status_name(code)} but the last error says {status_name(err_code)}")
    return error_class_for(code)(message, code=code, klass=klass, session=session, causes=causes)


def argument_error(argument: str, problem: str) -> ArgumentError:
    """An :class:`ArgumentError` raised by the binding itself, worded like the library's."""
    return ArgumentError(
        f"invalid argument `{argument}`: {problem}", code=Status.E_INVALID_ARG, klass=ErrorClass.CONFIG
    )
