"""A prefill rank's side of the metadata exchange: its metadata socket (the decode ranks' messages
arrive there, on a thread of its own), the per-room records its senders wait for, the rooms it
refused, and the failure notices it sends back to the decode ranks."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import zmq

import kvstage

from .channels import PushSockets, bind_pull
from .messages import RoomFailure, RoomMetadata, check_metadata, decode_metadata, encode, grid_of

logger = logging.getLogger(__name__)


class PrefillRooms:
    """The decode ranks' metadata messages of each room this prefill rank may serve."""

    def __init__(self, ctx: zmq.Context, ip: str, layout: kvstage.KvLayout, components: Sequence[Any], page_size: int,
                 tp_rank: int, stale_after_s: float, closed: threading.Event):
        self.layout = layout
        self.components = components
        self.page_size = page_size
        self.tp_rank = tp_rank
        self.stale_after_s = stale_after_s
        self.closed = closed
        self.lock = threading.Lock()
        self.transfer_infos: Dict[int, Dict[Any, RoomMetadata]] = {}
        self.expected: Dict[int, int] = {}
        self.arrived: Dict[int, float] = {}
        # Rooms this rank finished with: a decode rank's message that arrives after (one this
        # rank does not write to) is dropped instead of waiting for a request that is gone.
        self.finished: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        # Rooms this rank cannot serve (room -> reason): their sender fails at once.
        self.refused: "collections.OrderedDict[int, str]" = collections.OrderedDict()
        self.notices = PushSockets(ctx, linger_ms=1000, send_timeout_ms=200)
        self.pull, self.port = bind_pull(ctx, ip)
        self.thread = threading.Thread(target=self._recv_loop, name="kvstage-sglang-meta", daemon=True)
        self.thread.start()

    def _pairs(self, meta: RoomMetadata) -> List[Tuple[int, int]]:
        """The decode ranks (of ``meta``'s decode side) this rank writes to."""
        d = meta.decode
        stage = d.stage()
        if d.pp_size != 1:
            raise NotImplementedError("kvstage backend: decode pipeline parallelism is not wired yet")
        return kvstage.pairing_decode_ranks(self.layout, [stage], self.components)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        next_purge = time.monotonic() + 10
        while not self.closed.is_set():
            if time.monotonic() > next_purge:
                self._purge_stale()
                next_purge = time.monotonic() + 10
            try:
                if not poller.poll(200):
                    continue
                raw = self.pull.recv()
            except zmq.ZMQError:
                return
            self.accept(raw)

    def accept(self, raw: bytes) -> None:
        """One decode rank's metadata message: recorded for its room, or refused (logged, and the
        decode rank told when the message says who it is)."""
        try:
            meta = decode_metadata(raw)
        except Exception as e:  # nothing says whose: logged, the rank keeps serving
            logger.error("kvstage backend: bad metadata message: %s", e)
            return
        if meta.failed:  # the decode rank knows: no notice back
            self._refuse(meta, f"decode rank {meta.decode.tp_rank} could not open the room: {meta.failed}", notify=False)
            return
        try:
            check_metadata(meta, self.page_size)
            pairs = self._pairs(meta)
        except Exception as e:  # a message this rank cannot use: say so, keep serving
            self._refuse(meta, f"prefill rank {self.tp_rank} cannot serve this request: {type(e).__name__}: {e}")
            return
        key = (meta.decode.tp_rank, meta.decode.pp_rank)
        with self.lock:
            if meta.room in self.finished:
                return
            # Every decode rank writes to every prefill rank of the DP group; a rank keeps the
            # ones it writes to (none at all for a dummy rank: MLA or replicated heads with a
            # decode TP below the prefill's), and any one for the grid. One record per room:
            # a message whose grid differs from the room's, or a second opening of a decode
            # rank (another key), is refused, never mixed in.
            infos = self.transfer_infos.get(meta.room)
            if infos is not None:
                first = infos[None]
                clash = ""
                if grid_of(first) != grid_of(meta):
                    clash = f"grid {grid_of(meta)} differs from the room's {grid_of(first)}"
                elif key in infos and infos[key].room_key != meta.room_key:
                    clash = f"decode rank {key[0]} opened the room a second time (another key)"
                if clash:
                    logger.error("kvstage backend: room %s (%s): metadata refused: %s", meta.room, meta.trace_id, clash)
                    return
            self.arrived.setdefault(meta.room, time.monotonic())
            infos = self.transfer_infos.setdefault(meta.room, {})
            infos.setdefault(None, meta)
            if key in pairs:
                infos[key] = meta
            self.expected[meta.room] = len(pairs)

    def _refuse(self, meta: RoomMetadata, reason: str, notify: bool = True) -> None:
        """``meta``'s room fails here: its sender fails at once with ``reason``."""
        logger.error("kvstage backend: room %s (%s): %s", meta.room, meta.trace_id, reason)
        with self.lock:
            self.refused[meta.room] = reason
            while len(self.refused) > 4096:
                self.refused.popitem(last=False)
        if notify:
            self.notify_decode(meta, reason)

    def notify_decode(self, meta: RoomMetadata, reason: str) -> None:
        """Tells the decode rank of ``meta`` that its opening failed here (its poll says Failed
        with ``reason`` instead of waiting for its room's deadline). Best effort."""
        if not meta.notify:
            return
        try:
            self.notices.send(meta.notify, encode(RoomFailure(meta.room, meta.room_key, reason)))
        except zmq.ZMQError as e:
            logger.warning("kvstage backend: room %s: failure not delivered to %s: %s", meta.room, meta.notify, e)

    def refusal(self, room: int) -> Optional[str]:
        with self.lock:
            return self.refused.get(room)

    def room_infos(self, room: int) -> List[RoomMetadata]:
        """Every decode rank's message of ``room`` this rank has (for failure notices)."""
        with self.lock:
            infos = self.transfer_infos.get(room) or {}
            return [m for k, m in infos.items() if k is not None] or ([infos[None]] if None in infos else [])

    def room_ready(self, room: int) -> Optional[Tuple[RoomMetadata, List[RoomMetadata]]]:
        """Once every decode rank this prefill rank writes to has sent its metadata: the grid
        (any decode rank's message) and those ranks' messages (empty for a dummy rank)."""
        with self.lock:
            infos = self.transfer_infos.get(room)
            if infos is None:
                return None
            targets = [m for k, m in sorted((k, m) for k, m in infos.items() if k is not None)]
            if len(targets) < self.expected.get(room, 1 << 30):
                return None
            return infos[None], targets

    def forget_room(self, room: int) -> None:
        with self.lock:
            self.transfer_infos.pop(room, None)
            self.expected.pop(room, None)
            self.arrived.pop(room, None)
            self.finished[room] = None
            while len(self.finished) > 65536:
                self.finished.popitem(last=False)

    def _purge_stale(self) -> None:
        """Metadata of rooms no sender took up within the bootstrap and waiting timeouts (the
        request went to another DP group, or was aborted on this side before its sender)."""
        limit = time.monotonic() - self.stale_after_s
        with self.lock:
            for room in [r for r, t in self.arrived.items() if t < limit]:
                self.transfer_infos.pop(room, None)
                self.expected.pop(room, None)
                self.arrived.pop(room, None)

    def close(self) -> None:
        """After ``closed`` is set: the receiving thread ends, the notice sockets close."""
        self.thread.join(timeout=2)
        self.notices.close()
