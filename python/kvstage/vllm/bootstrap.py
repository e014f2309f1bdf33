"""The prefill's bootstrap listener: one TCP port per rank inside the vLLM worker, reading decode
messages (``push``, ``none``, ``release``) within a deadline, checking them, and parking the ones
for requests the prefill does not hold yet; bounded in connections, parked messages and memory.
One thread reads every connection (a selector): peers that connect and send nothing hold no
thread and delay no other peer's message."""

from __future__ import annotations

import json
import logging
import queue
import selectors
import socket
import threading
import time
from typing import Any, Optional

import kvstage

from .wire import _authentic, _check_addr, _is_int, _send_line

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")

# The prefill's bootstrap listener: seconds a peer has to send its whole message, connections
# open at once (being read or parked until the request's blocks are held: beyond it the oldest
# parked one is answered with an error), and how many / how long finished request ids are kept.
_MSG_DEADLINE_S = 10.0
_MAX_MSG_BYTES = 1 << 16
_MAX_ERROR_CHARS = 1024
_MAX_CONNS = 512
_MAX_PARKED = 256
_GONE_MAX = 4096
_GONE_MIN_AGE_S = 600.0


class _Bootstrap:
    """Mixed into ``_Worker``: the listener, the parked messages and the requests gone."""

    def _init_bootstrap(self) -> None:
        self.bootstrap_addr = f"{self.host}:{int(self.opts['bootstrap_port']) + self.tp_rank}"
        self._listener: Optional[socket.socket] = None
        self._parked: dict = {}  # req_id -> [(conn, msg, since)] pushes before the blocks
        self._gone: dict = {}  # req_id -> why it is not held (recent ones)
        # req_id -> {decode rank: (incarnation, started)}: the decode run each rank's messages
        # for a parked or held request come from (the latest one to ask).
        self._runs: dict = {}
        self._conns = 0  # bootstrap connections being read
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()  # accepted, for the reader
        self._wake_w: Optional[socket.socket] = None  # wakes the reader (with _listen)
        self._reading = True  # the reader takes accepted connections (until it ends)
        self._accept_errors = 0

    def _listen(self) -> None:
        host, port = self.bootstrap_addr.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as e:
            raise RuntimeError(f"KvstageConnector: prefill rank {self.tp_rank} cannot listen for its bootstrap on {self.bootstrap_addr}: {e}") from e
        sock.listen(256)
        sock.settimeout(0.5)
        self._listener = sock
        wake_r, self._wake_w = socket.socketpair()
        threading.Thread(target=self._read_loop, args=(wake_r,), name="kvstage-bootstrap-read", daemon=True).start()
        threading.Thread(target=self._accept_loop, name="kvstage-bootstrap", daemon=True).start()

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self._wake()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set() or self._listener.fileno() < 0:
                    return  # shut down
                # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: transient, keep listening.
                self._accept_errors += 1
                if self._accept_errors in (1, 10, 100) or self._accept_errors % 1000 == 0:
                    logger.warning("kvstage: bootstrap %s: accept failed (%d so far): %s", self.bootstrap_addr, self._accept_errors, e)
                time.sleep(0.05)
                continue
            try:
                with self._cond:
                    if not self._reading:
                        conn.close()
                        continue
                    if self._conns + self._parked_count() >= _MAX_CONNS and not self._drop_oldest_parked("too many bootstrap connections"):
                        self._reply(conn, False, f"prefill {self.bootstrap_addr}: too many bootstrap connections")
                        continue
                    self._conns += 1
                    self._incoming.put(conn)  # under the lock: never after the reader's last look
                self._wake()
            except Exception as e:  # noqa: BLE001 - drop this one, keep listening
                logger.warning("kvstage: bootstrap %s: %s", self.bootstrap_addr, e)
                conn.close()

    def _wake(self) -> None:
        try:
            if self._wake_w is not None:
                self._wake_w.send(b"x", socket.MSG_DONTWAIT)
        except OSError:  # its buffer is full (the reader is awake already) or it has ended
            pass

    def _read_loop(self, wake: socket.socket) -> None:
        """Every accepted connection's message, each within ``_MSG_DEADLINE_S`` of its accept
        (a peer that trickles bytes is cut then too), read without blocking on any of them."""
        sel = selectors.DefaultSelector()
        sel.register(wake, selectors.EVENT_READ, None)
        reading: dict = {}  # conn -> [bytes so far, deadline]
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                first = min((v[1] for v in reading.values()), default=now + 0.5)
                for key, _ in sel.select(min(0.5, max(0.0, first - now))):
                    try:
                        if key.data is None:
                            self._take_incoming(sel, reading, wake)
                        else:
                            self._read_some(sel, reading, key.data)
                    except Exception as e:  # noqa: BLE001 - one peer never ends the reads of all
                        logger.warning("kvstage: bootstrap %s: reading a message: %s: %s", self.bootstrap_addr, type(e).__name__, e)
                        if key.data in reading:
                            self._finish(sel, reading, key.data, error=f"{type(e).__name__}: {e}")
                now = time.monotonic()
                for conn in [c for c, v in reading.items() if v[1] <= now]:
                    self._finish(sel, reading, conn, error="the bootstrap message did not arrive in time")
        finally:
            with self._cond:
                self._reading = False  # the accept loop closes what it accepts from now on
            self._take_incoming(sel, reading, wake)
            for conn in list(reading):
                self._finish(sel, reading, conn, error="the prefill is shutting down")
            sel.close()
            wake.close()
            self._wake_w.close()

    def _take_incoming(self, sel: selectors.BaseSelector, reading: dict, wake: socket.socket) -> None:
        try:
            while wake.recv(4096, socket.MSG_DONTWAIT):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn = self._incoming.get_nowait()
            except queue.Empty:
                return
            conn.setblocking(False)
            reading[conn] = [b"", time.monotonic() + _MSG_DEADLINE_S]
            sel.register(conn, selectors.EVENT_READ, conn)

    def _read_some(self, sel: selectors.BaseSelector, reading: dict, conn: socket.socket) -> None:
        try:
            part = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._finish(sel, reading, conn, error=str(e))
            return
        if not part:  # the peer closed before a whole message: nothing to answer
            self._finish(sel, reading, conn, closed=True)
            return
        buf = reading[conn][0] + part
        reading[conn][0] = buf
        line, nl, _ = buf.partition(b"\n")
        if nl:
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested deep
                self._finish(sel, reading, conn, error=str(e))
                return
            self._finish(sel, reading, conn, msg=msg)
        elif len(buf) > _MAX_MSG_BYTES:
            self._finish(sel, reading, conn, error=f"bootstrap message over {_MAX_MSG_BYTES} bytes")

    def _finish(self, sel: selectors.BaseSelector, reading: dict, conn: socket.socket, msg: Any = None, error: str = "", closed: bool = False) -> None:
        """The connection's read is over: its message handled, or the error answered."""
        sel.unregister(conn)
        del reading[conn]
        try:
            conn.setblocking(True)
            conn.settimeout(10)  # its answer (here, or from a send thread) is a short line
            if closed:
                conn.close()
            elif error:
                logger.warning("kvstage: bootstrap %s: a bad or slow message: %s", self.bootstrap_addr, error)
                self._reply(conn, False, f"prefill {self.bootstrap_addr}: a bad or slow message: {error}")
            else:
                self._handle(conn, msg)
        except Exception as e:  # noqa: BLE001 - a malformed peer must not take the listener down
            logger.warning("kvstage: bootstrap %s: a bad message: %s", self.bootstrap_addr, e)
            conn.close()
        finally:
            with self._cond:
                self._conns -= 1

    def _parked_count(self) -> int:
        return sum(len(v) for v in self._parked.values())

    def _drop_oldest_parked(self, why: str) -> bool:
        """With the lock: answer the oldest parked message with an error; False when none is."""
        oldest = None
        for req_id, entries in self._parked.items():
            for i, (_, _, since) in enumerate(entries):
                if oldest is None or since < oldest[2]:
                    oldest = (req_id, i, since)
        if oldest is None:
            return False
        req_id, i, _ = oldest
        conn, _, _ = self._parked[req_id].pop(i)
        if not self._parked[req_id]:
            self._unpark(req_id)
        self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id} is not held and {why}: dropped")
        return True

    def _validate(self, msg: Any) -> str:
        """What is wrong with a bootstrap message ("" when nothing); fills msg["_expected"]."""
        if not isinstance(msg, dict):
            return "the message is not a JSON object"
        op, req = msg.get("op"), msg.get("req")
        if op not in ("push", "release", "none"):
            return f"unknown bootstrap op {op!r}"
        if not isinstance(req, str) or not req or len(req) > 1024:
            return f"req is {req!r}, expected a request id"
        if op == "release":
            return ""
        tp, rank, grid = msg.get("decode_tp"), msg.get("decode_rank"), msg.get("grid")
        if not _is_int(tp, 1, 1 << 16):
            return f"decode_tp is {tp!r}"
        if not _is_int(rank, 0, tp - 1):
            return f"decode_rank is {rank!r} (decode_tp {tp})"
        if not isinstance(grid, list) or len(grid) != len(kvstage.RoomGrid._fields) or not all(_is_int(x) for x in grid):
            return f"grid is {grid!r}"
        g = kvstage.RoomGrid(*grid)
        if not (1 <= g.page_size <= 1 << 20 and 1 <= g.num_chunks <= 1 << 20 and g.chunk_tokens >= 1):
            return f"grid is {grid!r}"
        try:
            feeds = self._decode_ranks(tp, g.page_size)
        except Exception as e:  # noqa: BLE001
            return f"decode_tp {tp} with page size {g.page_size} does not pair with this prefill (TP {self.tp_size}): {e}"
        if op == "push":
            if rank not in feeds:
                return f"prefill rank {self.tp_rank} of {self.tp_size} does not feed decode rank {rank} of {tp} (it feeds {sorted(feeds)})"
            if not _is_int(msg.get("room")) or not _is_int(msg.get("key")):
                return f"room {msg.get('room')!r} / key is not an unsigned integer"
            if not _check_addr(msg.get("addr")):
                return f"addr is {msg.get('addr')!r}, expected 'host:port'"
            if not isinstance(msg.get("trace", ""), str) or len(msg.get("trace", "")) > 1024:
                return "trace is not a string"
            if "layout" in msg and not isinstance(msg["layout"], str):
                return f"layout is {msg['layout']!r}"
        inc, started = msg.get("incarnation"), msg.get("started")
        if inc is not None and not (isinstance(inc, str) and 0 < len(inc) <= 64):
            return f"incarnation is {inc!r}"
        if (inc is None) != (started is None) or (started is not None and (isinstance(started, bool) or not isinstance(started, (int, float)))):
            return f"incarnation {inc!r} started {started!r}: expected both (a string and a time) or neither"
        # Every decode rank sends each prefill rank a push or a "none": all of them are expected.
        msg["_expected"] = set(range(tp))
        return ""

    def _handle(self, conn: socket.socket, msg: Any) -> None:
        """A whole message read from ``conn``: refused, answered, dispatched or parked."""
        bad = "" if _authentic(msg, self.opts["cluster_token"]) else "the message is not authenticated (cluster_token is set: it needs its MAC)"
        bad = bad or self._validate(msg)
        if bad:
            logger.warning("kvstage: bootstrap %s: refused a message: %s", self.bootstrap_addr, bad)
            self._reply(conn, False, f"prefill {self.bootstrap_addr}: {bad}")
            return
        op, req_id = msg["op"], msg["req"]
        with self._cond:
            if op == "release":
                if req_id in self._held and not self._held[req_id].in_flight:
                    del self._held[req_id]
                    self._finished_send.add(req_id)
                    self._cond.notify_all()
                for c, _, _ in self._parked.pop(req_id, []):
                    self._reply(c, False, f"prefill {self.bootstrap_addr}: request {req_id} was released by the decode")
                self._note_gone(req_id, "released by the decode")
                conn.close()
            elif req_id not in self._held and req_id in self._gone:
                self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id} is not held: {self._gone[req_id][0]}")
            elif self._refuse_stale(conn, msg):
                pass
            elif req_id in self._held:
                self._dispatch(conn, msg)
            else:  # the decode was faster than the prefill's next step: wait for the blocks
                if self._parked_count() >= _MAX_PARKED:
                    self._drop_oldest_parked("too many messages wait for requests not held yet")
                self._parked.setdefault(req_id, []).append((conn, msg, time.monotonic()))

    def _reply(self, conn: socket.socket, ok: bool, error: str = "", **more: Any) -> None:
        # Errors quote what the peer sent: a short line always fits the socket's buffer, so a
        # peer that does not read cannot hold the one reader thread in the send.
        if len(error) > _MAX_ERROR_CHARS:
            error = error[: _MAX_ERROR_CHARS - 3] + "..."
        try:
            _send_line(conn, {"ok": ok, "error": error, **more})
        except OSError:
            pass
        finally:
            conn.close()

    def _unpark(self, req_id: str) -> None:
        """With the lock: ``req_id`` has no parked message left."""
        del self._parked[req_id]
        if req_id not in self._held:
            self._runs.pop(req_id, None)

    def _refuse_stale(self, conn: socket.socket, msg: dict) -> bool:
        """With the lock: a message from a run of the decode older than the latest one that asked
        for this request and decode rank is refused (True); a newer run's message refuses the
        older run's parked ones, and becomes the latest. Messages without an incarnation pass."""
        req_id, rank, run = msg["req"], msg["decode_rank"], (msg.get("incarnation"), msg.get("started"))
        if run[0] is None:
            return False
        runs = self._runs.setdefault(req_id, {})
        last = runs.get(rank)
        if last is None or last[0] == run[0]:
            runs[rank] = run
            return False

        def stale(old: tuple, new: tuple) -> str:
            return (
                f"prefill {self.bootstrap_addr}: request {req_id}: a stale message from decode rank {rank}: its decode run "
                f"{old[0]} (started {old[1]:.3f}) was followed by run {new[0]} (started {new[1]:.3f}), which asked for it since"
                if old[1] < new[1]
                else f"prefill {self.bootstrap_addr}: request {req_id}: decode rank {rank} runs {old[0]} and {new[0]} both started at {old[1]:.3f}: refused"
            )

        if run[1] <= last[1]:
            logger.warning("kvstage: bootstrap: %s", stale(run, last))
            self._reply(conn, False, stale(run, last))
            return True
        runs[rank] = run
        kept = []
        for entry in self._parked.get(req_id, []):
            c, m, _ = entry
            if m["decode_rank"] == rank and m.get("incarnation") == last[0]:
                logger.warning("kvstage: bootstrap: %s", stale(last, run))
                self._reply(c, False, stale(last, run))
            else:
                kept.append(entry)
        if req_id in self._parked:
            self._parked[req_id] = kept
        return False

    def _note_gone(self, req_id: str, why: str) -> None:
        """With the lock: remember why ``req_id`` is not held (bounded: old entries expire)."""
        now = time.monotonic()
        self._gone.pop(req_id, None)
        self._gone[req_id] = (why, now)
        self._runs.pop(req_id, None)
        min_age = max(_GONE_MIN_AGE_S, 2 * float(self.opts["lease_s"]))
        while self._gone:
            k = next(iter(self._gone))
            if len(self._gone) > _GONE_MAX or now - self._gone[k][1] > min_age:
                del self._gone[k]
            else:
                break

    def _forget(self, req_id: str, why: str) -> None:
        """With the lock: ``req_id`` will not be sent; tell the decodes that asked."""
        self._note_gone(req_id, why)
        for conn, msg, _ in self._parked.pop(req_id, []):
            self._reply(conn, msg.get("op") == "none", f"prefill {self.bootstrap_addr}: request {req_id} is not held: {why}")
