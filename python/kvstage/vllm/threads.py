"""A bounded pool of daemon threads: the connector's bootstrap readers, loads and notifications
run on at most a fixed number of threads each, whatever a flood of peers or requests asks."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


class _Pool:
    """At most ``size`` daemon threads named ``name-<i>``, started as work comes (never more
    than the calls submitted) and kept; calls beyond them wait in order. Daemon threads: a
    process that exits does not wait for a call blocked on a peer."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, fn: Callable, *args: Any) -> None:
        """Runs ``fn(*args)`` on a pool thread; raises only when no thread exists or can start
        (then ``fn`` never runs)."""
        with self._lock:
            if self._threads < self.size:
                try:
                    threading.Thread(target=self._run, name=f"{self.name}-{self._threads + 1}", daemon=True).start()
                    self._threads += 1
                except RuntimeError:
                    if not self._threads:
                        raise
            self._queue.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - the calls report their own failures
                logger.warning("kvstage: %s: %s: %s", self.name, type(e).__name__, e)

    def close(self) -> None:
        """Ends the threads once the calls queued before it ran."""
        with self._lock:
            for _ in range(self._threads):
                self._queue.put(None)
            self._threads = 0
