"""A drop-in for engines whose staged path is ``transfer(session_id, prefill_kv_indices,
dst_staging_ptr, dst_staging_size, target_info) -> 0 | -1`` (the shape sglang's staging strategy
uses): 0 on success, -1 to tell the caller to fall back to its slice path.

Differences from a hand-rolled staged path, which is why ``target_info`` looks the way it does:

- kvstage's receiver owns its staging ring and grants each chunk a range of it during the
  transfer, so the sender never chooses a destination address. ``dst_staging_ptr`` and
  ``dst_staging_size`` are accepted for signature compatibility (ints, or None) and not used.
- Head slices, writer regions and the decode layout come from the session handshake, so
  ``target_info`` does not carry the decode TP rank, TP size or item length either. It names
  where the chunk goes: the decode engine (``peer``), the request (``room``, and ``room_key``, the
  key of that decode rank's opening of the room, :attr:`Room.key` of its :meth:`Engine.open_room`)
  and the chunk of the room's chunk grid (``chunk_index``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from ._common import u64
from ._lib import Status
from .engine import Engine
from .errors import ProtocolError, TransportError, argument_error
from .session import Session

__all__ = ["StagingTransfer", "TransferTarget"]


@dataclass(frozen=True)
class TransferTarget:
    """Where one chunk goes (the ``target_info`` of :meth:`StagingTransfer.transfer`).

    ``peer``: the decode rank engine's address (its :attr:`Engine.listen_address`), used to connect
    the first time a ``session_id`` is seen; ``room``: the request's room id, opened on the decode
    side with :meth:`Engine.open_room`; ``room_key``: that opening's key (:attr:`Room.key`; it
    travels with the room id and the decode pages in the engine's bootstrap); ``chunk_index``: the
    chunk within that room's chunk grid; ``timeout_ms``: the transfer's timeout, 0 = the engine
    default, ``TIMEOUT_INFINITE`` = none;
    ``src_token_offset`` and ``num_tokens``: where the chunk starts in its first prefill page and
    its token count (0: every slot of the pages from there), from :func:`chunk_span` when the two
    sides' page sizes differ or the decode prefix ends inside a prefill page; ``trace_id``: the
    request's id in both sides' log lines (default: derived from the room's opening).

    ``target_info`` may also be a mapping with these keys, or any object with these attributes
    (an engine's own per-request record); ``room`` and ``room_key`` are required, ``peer`` the
    first time a session id is seen.
    """

    room: int
    room_key: int = field(repr=False)  # a capability: kept out of logs
    chunk_index: int = 0
    peer: Optional[str] = None
    timeout_ms: int = 0
    src_token_offset: int = 0
    num_tokens: int = 0
    trace_id: Optional[str] = None


def _field(info: Any, name: str, default: Any) -> Any:
    if isinstance(info, Mapping):
        return info.get(name, default)
    return getattr(info, name, default)


def _target(info: Any) -> TransferTarget:
    if isinstance(info, TransferTarget):
        return info
    room = _field(info, "room", None)
    if room is None:
        raise argument_error("target_info", f"has no `room` ({type(info).__name__})")
    room_key = _field(info, "room_key", None)
    if room_key is None:
        raise argument_error("target_info", f"has no `room_key` for room {room} ({type(info).__name__}): pass the key of the decode side's opening (Room.key)")
    return TransferTarget(
        room=room,
        room_key=room_key,
        chunk_index=_field(info, "chunk_index", 0),
        peer=_field(info, "peer", None),
        timeout_ms=_field(info, "timeout_ms", 0),
        src_token_offset=_field(info, "src_token_offset", 0),
        num_tokens=_field(info, "num_tokens", 0),
        trace_id=_field(info, "trace_id", None),
    )


class StagingTransfer:
    """Staged transfers of one prefill rank, one cached :class:`Session` per ``session_id``.

    ``transfer`` connects on first use of a ``session_id`` (to ``target_info.peer``), returns 0
    when the decode side acknowledged the chunk and -1 when staging is impossible for it
    (``KVSTAGE_FALLBACK``: nothing was allocated; the caller may use its slice path, or
    :meth:`transfer_slices`). Failures raise :class:`KVStageError` subclasses whose ``session`` is
    the session id and whose ``__cause__`` chain holds the C causes; after a transport or protocol
    failure the cached session is dropped, so the next call reconnects.
    """

    def __init__(self, engine: Engine, *, connect_timeout_ms: int = 0):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected a kvstage.Engine, got {type(engine).__name__}")
        self.engine = engine
        self.connect_timeout_ms = u64(connect_timeout_ms, "connect_timeout_ms")
        self._sessions: Dict[str, Session] = {}
        self._lock = threading.Lock()

    def session(self, session_id: str, peer: Optional[str] = None) -> Session:
        """The cached session ``session_id``, connected to ``peer`` when it is not cached yet."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None and not s.closed:
                return s
            if not peer:
                raise argument_error(
                    "target_info.peer", f"is needed to connect session {session_id!r} (no session is cached under that id)"
                )
            s = self.engine.connect(peer, session_id, self.connect_timeout_ms)
            self._sessions[session_id] = s
            return s

    def _run(self, staged: bool, session_id: str, prefill_kv_indices: Any, target_info: Any) -> Status:
        if not isinstance(session_id, str):
            raise TypeError(f"session_id: expected a str, got {type(session_id).__name__}")
        target = _target(target_info)
        session = self.session(session_id, target.peer)
        run = session.transfer if staged else session.transfer_slices
        try:
            return run(
                target.room,
                target.chunk_index,
                prefill_kv_indices,
                target.timeout_ms,
                room_key=target.room_key,
                src_token_offset=target.src_token_offset,
                num_tokens=target.num_tokens,
                trace_id=target.trace_id,
            )
        except (TransportError, ProtocolError):
            self.close_session(session_id)
            raise

    def transfer(
        self,
        session_id: str,
        prefill_kv_indices: Any,
        dst_staging_ptr: Optional[int],
        dst_staging_size: Optional[int],
        target_info: Any,
    ) -> int:
        """Staged transfer of one chunk: 0 on success, -1 to signal fallback to the slice path.

        ``prefill_kv_indices``: the prefill pool pages holding the chunk's tokens, in token order
        (a list, numpy array or tensor of ints). ``dst_staging_ptr``/``dst_staging_size``: unused
        (the receiver places the chunk in its own ring). ``target_info``: a
        :class:`TransferTarget`, mapping or object with ``room``, ``room_key``, ``chunk_index``,
        ``peer``, ``timeout_ms``.
        """
        for name, value in (("dst_staging_ptr", dst_staging_ptr), ("dst_staging_size", dst_staging_size)):
            if value is not None:
                u64(value, name)
        status = self._run(True, session_id, prefill_kv_indices, target_info)
        if status == Status.OK:
            return 0
        if status == Status.FALLBACK:
            return -1
        raise argument_error("kvstage_transfer", f"returned the unexpected status {status!r}")  # pragma: no cover

    def transfer_slices(self, session_id: str, prefill_kv_indices: Any, target_info: Any) -> int:
        """The slice path for the same chunk through the same session; 0 on success."""
        self._run(False, session_id, prefill_kv_indices, target_info)
        return 0

    def close_session(self, session_id: str) -> None:
        """Closes and forgets one cached session (no-op when unknown)."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is not None:
            s.close()

    def close(self) -> None:
        """Closes every cached session (the engine stays open)."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.close()

    def __enter__(self) -> "StagingTransfer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def session_ids(self):
        with self._lock:
            return tuple(self._sessions)
