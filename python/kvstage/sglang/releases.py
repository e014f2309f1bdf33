"""Releasing a decode rank's rooms: a release waits a bounded time for a same-host writer that
still holds the room's pages; kvstage's "not free yet" (``E_TIMEOUT``) is retried, by the
receiver's poll or, once sglang cleared the receiver, here in the background. A room's pages are
never reported free while kvstage says a writer may write them."""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional, Tuple

import kvstage
from kvstage import Status

from .status import describe_error

logger = logging.getLogger(__name__)


def release_room(room: "kvstage.Room") -> Tuple[bool, str]:
    """(True, "") once ``room`` is released and its pages free; (False, why) while kvstage says a
    writer still holds them ("not free yet": call again). The bound is the decode engine's
    ``default_timeout_ms`` (KVSTAGE_SGLANG_RELEASE_TIMEOUT_MS)."""
    try:
        room.release()
    except kvstage.KVStageError as e:
        if e.code == Status.E_TIMEOUT:
            return False, describe_error(e)
        logger.warning("kvstage backend: releasing room %s: %s", room.room, describe_error(e))
    return True, ""


class LateReleases:
    """Rooms sglang cleared while kvstage still said their pages are held: retried in the
    background until free (logged both ways), until ``closed`` is set."""

    def __init__(self, closed: threading.Event):
        self.closed = closed
        self.lock = threading.Lock()
        self.pending: List[Tuple[Any, int, str]] = []
        self.thread: Optional[threading.Thread] = None

    def add(self, room: "kvstage.Room", bootstrap_room: int, trace_id: str) -> None:
        with self.lock:
            self.pending.append((room, bootstrap_room, trace_id))
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="kvstage-sglang-release", daemon=True)
                self.thread.start()

    def _loop(self) -> None:
        while not self.closed.wait(0.2):
            with self.lock:
                pending, self.pending = self.pending, []
            keep = []
            for room, br, trace in pending:
                ok, _why = release_room(room)
                if ok:
                    logger.warning("kvstage backend: room %s (%s): released late, its pages are free", br, trace)
                else:
                    keep.append((room, br, trace))
            with self.lock:
                self.pending.extend(keep)
