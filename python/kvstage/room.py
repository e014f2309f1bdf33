"""Rooms, the decode side of a request (header section "room").

:meth:`Engine.open_room` opens a room (``kvstage_room_open``) and returns a :class:`Room`: the
opening, with the room id, its key and its chunk grid. Everything about the room goes through that
object (``kvstage_room_wait``, ``_release``, ``_describe`` and ``_poll_events`` all name the
opening by room id *and* key), so a call can never reach a later opening of the same room id::

    with engine.open_room(room_id, decode_pages, chunk_tokens=2048) as room:
        bootstrap.send(room_id, room.key, decode_pages)   # the prefill ranks need the key
        room.wait(timeout_ms=30_000)
        for event in room.poll_events():                  # its chunks' events, then one ROOM event
            ...
    # released on exit (a second release of an opening no longer open does nothing)
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_size_t, c_uint32
from typing import Any, List, NamedTuple, Optional, Union

from . import _lib
from ._buffers import page_array
from ._common import check, init_struct, output_array, output_struct, read_json, status_of, u32, u64
from ._lib import RoomEventKind, Status
from .errors import argument_error
from .parts import request_parts_c

__all__ = ["Room", "RoomGrid", "RoomEvent"]


class RoomGrid(NamedTuple):
    """``kvstage_room_grid``: a room's chunk grid, as the decode side opened it
    (:attr:`Room.grid`, or :meth:`Session.room_grid` on the prefill side). Chunk ``k`` carries the
    room's tokens ``[k * chunk_tokens, (k + 1) * chunk_tokens)`` after the decode side's cached
    prefix; :func:`kvstage.chunk_span` says where each chunk lies on both sides."""

    #: The opening's key (the prefill side's transfers pass it as ``room_key``).
    key: int
    #: Tokens of every chunk but possibly the last (the room's ``chunk_tokens`` in whole pages).
    chunk_tokens: int
    #: Chunks of the room: a transfer's ``chunk_index`` is below this.
    num_chunks: int
    #: Decode pages of the room.
    num_pages: int
    #: The decode side's page size (tokens per page).
    page_size: int
    #: Tokens the decode side already held (whole decode pages), as the room was opened with.
    prefix_tokens: int

    def _c(self) -> _lib.kvstage_room_grid:
        c = output_struct(_lib.kvstage_room_grid)
        c.key = u64(self.key, "grid.key")
        c.chunk_tokens = u32(self.chunk_tokens, "grid.chunk_tokens")
        c.num_chunks = u32(self.num_chunks, "grid.num_chunks")
        c.num_pages = u32(self.num_pages, "grid.num_pages")
        c.page_size = u32(self.page_size, "grid.page_size")
        c.prefix_tokens = u64(self.prefix_tokens, "grid.prefix_tokens")
        return c

    @classmethod
    def _from_c(cls, c: Any) -> "RoomGrid":
        return cls(c.key, c.chunk_tokens, c.num_chunks, c.num_pages, c.page_size, c.prefix_tokens)

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        return (
            f"RoomGrid(key=<hidden>, chunk_tokens={self.chunk_tokens}, num_chunks={self.num_chunks}, "
            f"num_pages={self.num_pages}, page_size={self.page_size}, prefix_tokens={self.prefix_tokens})"
        )


class RoomEvent(NamedTuple):
    """``kvstage_room_event``: a chunk of a room that reached the decode KV pool (``kind`` CHUNK,
    ``status`` OK) or failed, or the whole room (``kind`` ROOM: every chunk and part landed, or
    the room failed), queued after the room's last chunk event (or its failed chunks' events)."""

    kind: Union[RoomEventKind, int]
    status: Union[Status, int]
    room: int
    #: The key of the room's opening the event belongs to (tells a released request's late event
    #: apart from the next request's under the same room id).
    room_key: int
    #: CHUNK: the chunk's index in the room's grid; ROOM: the room's chunk count.
    chunk_index: int
    #: CHUNK with status OK, staged path: nanoseconds from the arrival of the chunk's last writer
    #: to the end of its scatter; 0 otherwise.
    scatter_ns: int = 0
    #: The request's trace id (the prefill caller's ``trace_id``, else derived from the opening).
    trace: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        kind = self.kind.name if isinstance(self.kind, RoomEventKind) else self.kind
        chunk = f", chunk_index={self.chunk_index}" if self.kind == RoomEventKind.CHUNK else f", num_chunks={self.chunk_index}"
        return f"RoomEvent({kind}, room={self.room}{chunk}, status={self.status!r})"


def _kind(value: int) -> Union[RoomEventKind, int]:
    try:
        return RoomEventKind(value)
    except ValueError:
        return value


def read_events(lib: _lib.Library, fn: str, args: tuple, max_events: int) -> List[RoomEvent]:
    """Up to ``max_events`` events from ``fn(*args, events, capacity, &count)`` (non-blocking)."""
    if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events <= 0:
        raise argument_error("max_events", f"{max_events!r} is not a positive int")
    events = output_array(_lib.kvstage_room_event, max_events)
    count = c_size_t()
    check(lib, getattr(lib, fn)(*args, events, max_events, byref(count)), fn)
    return [
        RoomEvent(_kind(e.kind), status_of(e.status), e.room, e.room_key, e.chunk_index, e.scatter_ns, e.trace_id.decode("ascii"))
        for e in events[: count.value]
    ]


class Room:
    """One opening of a decode room (what :meth:`Engine.open_room` returns).

    ``room`` is the room id, ``key`` this opening's key (send both to the prefill ranks; their
    transfers pass the key as ``room_key``) and ``grid`` its chunk grid. Its methods name the
    opening by id and key: after a release they never reach the id's next opening. As a context
    manager it releases the opening on exit (unless the engine is closed).
    """

    def __init__(self, engine: Any, room: int, grid: RoomGrid):
        self.engine = engine
        self.room = room
        self.grid = grid

    @property
    def key(self) -> int:
        """This opening's key: the prefill ranks pass it as ``room_key``."""
        return self.grid.key

    @property
    def num_chunks(self) -> int:
        """Chunks of the room (``grid.num_chunks``)."""
        return self.grid.num_chunks

    def _call(self, fn: str, *args: Any) -> None:
        engine = self.engine
        check(engine._lib, getattr(engine._lib, fn)(engine._handle(), self.room, self.key, *args), fn)

    def wait(self, timeout_ms: int = 0) -> None:
        """``kvstage_room_wait``: returns once every chunk and part of the room is in place; raises
        the room's error (:class:`TransportError` for a dead peer, :class:`TimeError` with
        ``E_CANCELED`` once this opening is released, ...) or :class:`TimeError` after
        ``timeout_ms`` (0 = the engine's ``default_timeout_ms``, :data:`kvstage.TIMEOUT_INFINITE` = no
        limit). An opening no longer open raises :class:`TimeError` with ``E_STALE_ROOM``.
        Refused from inside a completion callback (``E_UNSUPPORTED``)."""
        self._call("kvstage_room_wait", u64(timeout_ms, "timeout_ms"))

    def release(self) -> None:
        """``kvstage_room_release``: forgets this opening (its events not polled yet included) and
        frees its ring space. An opening no longer open is left alone: a second release does
        nothing, and never touches a later opening of the id. Raises
        :class:`TimeError` when a same-host writer that cannot end (a stopped prefill process)
        still holds the room's pages after the engine's default timeout: do not reuse them until
        a later release returns."""
        self._call("kvstage_room_release")

    def describe(self) -> dict:
        """``kvstage_room_describe``: this opening as a dict: its state and, per chunk, its phase,
        ring allocation (and the older one it waits behind), writers and bytes landed."""
        engine = self.engine
        return read_json(engine._lib, "kvstage_room_describe", engine._handle(), self.room, self.key)

    def poll_events(self, max_events: int = 256) -> List[RoomEvent]:
        """``kvstage_room_poll_events``: up to ``max_events`` of this opening's queued events
        (non-blocking): its chunks' events, then one ROOM event once the room ended. Events of
        other rooms and openings stay queued for them and :meth:`Engine.poll_events`. An opening
        no longer open raises :class:`~kvstage.TimeError` ``E_STALE_ROOM`` (its release dropped
        the events it had not polled)."""
        engine = self.engine
        return read_events(engine._lib, "kvstage_room_poll_events", (engine._handle(), self.room, self.key), max_events)

    def __repr__(self) -> str:  # the key is a capability: kept out of logs
        return f"<kvstage.Room {self.room} ({self.num_chunks} chunks)>"

    def __enter__(self) -> "Room":
        return self

    def __exit__(self, *exc) -> None:
        if not self.engine.closed:
            self.release()


def open_room(
    engine: Any,
    room: int,
    pages: Any,
    chunk_tokens: int = 0,
    *,
    parts: Any = None,
    prefix_tokens: int = 0,
    trace_id: Optional[str] = None,
) -> Room:
    """``kvstage_room_open`` on ``engine`` (see :meth:`Engine.open_room`)."""
    lib = engine._lib
    keep, address, count = page_array(pages, "pages")
    desc = init_struct(lib, _lib.kvstage_room_desc, "kvstage_room_desc_init")
    desc.room = u64(room, "room")
    desc.pages = ctypes.cast(address, POINTER(c_uint32))
    desc.num_pages = count
    desc.chunk_tokens = u32(chunk_tokens, "chunk_tokens")
    desc.prefix_tokens = u64(prefix_tokens, "prefix_tokens")
    c_parts, keep_parts = request_parts_c(lib, parts)
    desc.parts = c_parts
    encoded = None if trace_id is None else trace_id.encode("utf-8")
    desc.trace_id = encoded
    grid = output_struct(_lib.kvstage_room_grid)
    rc = lib.kvstage_room_open(engine._handle(), byref(desc), byref(grid))
    del keep, keep_parts, encoded
    check(lib, rc, "kvstage_room_open")
    return Room(engine, room, RoomGrid._from_c(grid))
