"""Sender sessions (header section "session"): :class:`Session`, one (prefill rank -> decode
rank) peering, opened by :meth:`Engine.connect`; its transfers (the descriptor is in
:mod:`kvstage.op`), the room grid it asks the decode side for, and its counters.

Every ``timeout_ms`` is 0 for the engine's ``default_timeout_ms`` and
:data:`kvstage.TIMEOUT_INFINITE` for no limit.
"""

from __future__ import annotations

from ctypes import byref, c_void_p
from typing import Any, Optional

from . import _lib
from ._common import Handle, check, output_struct, u64
from ._lib import Status
from .op import Operation, transfer_desc
from .room import RoomGrid
from .stats import SessionStats, session_stats_from_c

__all__ = ["Session"]


class Session(Handle):
    """``kvstage_session``: one (prefill rank -> decode rank) peering. Thread-safe: transfers on
    one session may run concurrently from several Python threads (the GIL is released)."""

    _kind = "kvstage_session"
    _free_fn = "kvstage_session_free"

    def __init__(self, engine: Any, ptr: int, peer_address: str, session_id: str):
        super().__init__(engine._lib, ptr)
        self.engine = engine
        self.peer_address = peer_address
        self._session_id = session_id

    @property
    def session_id(self) -> str:
        return self._session_id

    def transfer(
        self, room: int, chunk_index: int, pages: Any, timeout_ms: int = 0, *, room_key: int, src_token_offset: int = 0, num_tokens: int = 0,
        trace_id: Optional[str] = None, parts: Any = None,
    ) -> Status:
        """``kvstage_transfer``: the staged path for one chunk (``pages``: the prefill pages of the
        chunk in token order) into ``room``, opened on the decode side with the key ``room_key``
        (:attr:`Room.key` of its :meth:`Engine.open_room`). Returns ``Status.OK``, or ``Status.FALLBACK`` when
        staging is impossible for this chunk (nothing was allocated; use :meth:`transfer_slices`).
        A key of another opening of the room raises :class:`TimeError` with ``E_STALE_ROOM``.
        ``src_token_offset`` and ``num_tokens``: where the chunk starts in ``pages[0]`` and how
        many tokens it holds (0: all the pages hold from there), as :func:`chunk_span` says (on
        the room's grid, :meth:`room_grid`) when the prefill and decode page sizes differ or a
        prefix ends inside a prefill page.
        ``trace_id``: the request's id in both sides' log lines, describe documents and
        completions (your engine's request id; default: derived from the room's opening).
        ``parts`` (:class:`kvstage.parts.RequestParts`, the room's last chunk only): this rank's aux
        row, state slots and extra pools' pages of the request, sent in the same write.
        ``timeout_ms``: the transfer's timeout (0 = the engine's ``default_timeout_ms``,
        :data:`kvstage.TIMEOUT_INFINITE` = none). There are no timings of a synchronous transfer:
        time one with :meth:`transfer_async` and :meth:`Operation.timings`, or read the sums of
        :meth:`stats`."""
        d, keep = transfer_desc(self._lib, room, room_key, chunk_index, pages, timeout_ms, 0, src_token_offset, num_tokens, trace_id, parts)
        rc = self._lib.kvstage_transfer(self._handle(), byref(d))
        del keep
        return check(self._lib, rc, "kvstage_transfer")

    def transfer_slices(
        self, room: int, chunk_index: int, pages: Any, timeout_ms: int = 0, *, room_key: int, src_token_offset: int = 0, num_tokens: int = 0,
        trace_id: Optional[str] = None,
    ) -> Status:
        """``kvstage_transfer_slices``: the slice path for the same chunk (one write per token,
        layer and K/V); the fallback of :meth:`transfer`. It moves whole decode pages only."""
        d, keep = transfer_desc(self._lib, room, room_key, chunk_index, pages, timeout_ms, 0, src_token_offset, num_tokens, trace_id)
        rc = self._lib.kvstage_transfer_slices(self._handle(), byref(d))
        del keep
        return check(self._lib, rc, "kvstage_transfer_slices")

    def transfer_async(
        self,
        room: int,
        chunk_index: int,
        pages: Any,
        timeout_ms: int = 0,
        tag: int = 0,
        *,
        room_key: int,
        src_token_offset: int = 0,
        num_tokens: int = 0,
        trace_id: Optional[str] = None,
        parts: Any = None,
    ) -> Operation:
        """``kvstage_transfer_async``: starts the staged path on the engine's transfer workers;
        ``tag`` comes back with its completion (callback). ``parts``: as for :meth:`transfer`."""
        d, keep = transfer_desc(self._lib, room, room_key, chunk_index, pages, timeout_ms, tag, src_token_offset, num_tokens, trace_id, parts)
        out = c_void_p()
        rc = self._lib.kvstage_transfer_async(self._handle(), byref(d), byref(out))
        del keep
        check(self._lib, rc, "kvstage_transfer_async")
        return Operation(self, out.value)

    def transfer_layerwise_async(
        self,
        room: int,
        chunk_index: int,
        pages: Any,
        timeout_ms: int = 0,
        tag: int = 0,
        *,
        room_key: int,
        src_token_offset: int = 0,
        num_tokens: int = 0,
        trace_id: Optional[str] = None,
    ) -> Operation:
        """``kvstage_transfer_layerwise_async``: starts the staged path for a chunk whose layers
        are still being computed; mark them with :meth:`Operation.layers_ready` (every layer of
        the pool before its timeout). The ring space is requested at once."""
        d, keep = transfer_desc(self._lib, room, room_key, chunk_index, pages, timeout_ms, tag, src_token_offset, num_tokens, trace_id)
        out = c_void_p()
        rc = self._lib.kvstage_transfer_layerwise_async(self._handle(), byref(d), byref(out))
        del keep
        check(self._lib, rc, "kvstage_transfer_layerwise_async")
        return Operation(self, out.value)

    def room_grid(self, room: int, timeout_ms: int = 0, *, room_key: int) -> RoomGrid:
        """``kvstage_session_room_grid_get``: the chunk grid of ``room`` (the opening ``room_key``)
        as the decode side opened it: its chunk tokens, chunk and page counts, the decode page
        size and the decode side's cached prefix; one round trip, bounded by ``timeout_ms`` (0 =
        the engine default). Pass it to :func:`kvstage.chunk_span` to cut the request. A key of
        another opening raises :class:`TimeError` with ``E_STALE_ROOM``."""
        out = output_struct(_lib.kvstage_room_grid)
        rc = self._lib.kvstage_session_room_grid_get(
            self._handle(), u64(room, "room"), u64(room_key, "room_key"), u64(timeout_ms, "timeout_ms"), byref(out)
        )
        check(self._lib, rc, "kvstage_session_room_grid_get")
        return RoomGrid._from_c(out)

    def stats(self) -> SessionStats:
        """``kvstage_session_stats_get``: this session's counters and transport."""
        out = output_struct(_lib.kvstage_session_stats)
        check(self._lib, self._lib.kvstage_session_stats_get(self._handle(), byref(out)), "kvstage_session_stats_get")
        return session_stats_from_c(out)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"to {self.peer_address}"
        return f"<kvstage.Session {self._session_id!r} {state}>"
