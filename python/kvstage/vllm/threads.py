"""A bounded pool of daemon threads: the connector's loads and notifications run on at most a
fixed number of threads each, whatever a flood of requests asks."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


class _Pool:
    """At most ``size`` daemon threads named ``name-<i>``, started as work comes while no idle one is
    free for it, and kept; calls beyond them wait in order. Daemon threads: a process that exits does not
    wait for a call blocked on a peer."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a call
        self._queued = 0  # calls not taken by a thread yet
        self._closed = False

    def submit(self, fn: Callable, *args: Any) -> None:
        """Runs ``fn(*args)`` on a pool thread; raises (and ``fn`` never runs) once closed, or when
        no thread exists and none can start. Deciding, starting and queueing under one lock: a
        call is never queued behind a thread start that then fails, nor after ``close``."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            # Idle threads may not have taken the calls queued before this one yet.
            if self._queued >= self._idle and self._threads < self.size:
                try:
                    threading.Thread(target=self._run, name=f"{self.name}-{self._threads + 1}", daemon=True).start()
                    self._threads += 1
                except RuntimeError:
                    if not self._threads:
                        raise
            self._queued += 1
            self._queue.put((fn, args))

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._queued -= item is not None
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - the calls report their own failures
                logger.warning("kvstage: %s: %s: %s", self.name, type(e).__name__, e)

    def close(self) -> None:
        """Ends the threads once the calls queued before it ran; later calls are refused."""
        with self._lock:
            self._closed = True
            for _ in range(self._threads):
                self._queue.put(None)
