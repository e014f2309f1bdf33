"""The decode worker's side: one load per request (open a kvstage room on the blocks vLLM
allocated, push it to the prefill ranks that feed this rank, wait for the room), report it to
vLLM, and tell prefill ranks what they need not send."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any

import kvstage

from .metadata import _Recv
from .threads import _Pool
from .wire import _Failed, _read_line, _send_line, _sign

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


# Threads running loads (each waits for its prefill, up to load_timeout_s; loads beyond them wait
# in order, their deadline counted from when they were started), and sending "none"/"release".
_LOAD_THREADS = 64
_NOTIFY_THREADS = 4


class _Decode:
    """Mixed into ``_Worker`` (it holds the engine, layout, lock and finished sets)."""

    def _init_decode(self) -> None:
        self._rooms = itertools.count(1)
        self._stats_lock = threading.Lock()
        self._receiving = 0  # loads in flight
        self._unreleased: list = []  # (recv, ok, room) whose room.release() raised: retried
        self._loads = _Pool(_LOAD_THREADS, "kvstage-recv")
        self._notify = _Pool(_NOTIFY_THREADS, "kvstage-notify")
        # This run of the decode, named in its pushes: a prefill refuses a push from a run that
        # started before the one that asked it for the same request and rank (left over).
        self.incarnation = uuid.uuid4().hex[:16]
        self.started = time.time()

    def _stop_decode(self) -> None:
        self._loads.close()
        self._notify.close()

    def _prefill_ranks(self, recv: _Recv) -> list:
        if recv.remote_tp_size == self.tp_size:
            return [self.tp_rank]
        pre = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=recv.remote_block_size, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=0, tp_size=recv.remote_tp_size, num_layers=self.layout.num_layers,
        )
        return sorted({tp for tp, _pp in kvstage.pairing_prefill_ranks(self.layout, [pre])})

    def _start_recv(self, recv: _Recv) -> None:
        with self._cond:
            self._receiving += 1
        self._loads.submit(self._recv, recv, time.monotonic())

    def _recv(self, recv: _Recv, t0: float) -> None:
        """One request's load (started at ``t0``), on a load thread. Every step is inside the
        try: whatever happens, the request finishes receiving (failed or not): none stays waiting."""
        deadline = t0 + float(self.opts["load_timeout_s"])
        left = lambda: max(0.001, deadline - time.monotonic())  # noqa: E731
        room = None
        socks = []
        ok, error, landed = False, "", 0
        contacted: set = set()
        ranks: list = []
        try:
            if recv.error:
                raise _Failed(recv.error)
            host, port = recv.bootstrap.rsplit(":", 1)
            port = int(port)
            ranks = self._prefill_ranks(recv)
            try:
                room = self.engine.open_room(
                    next(self._rooms), recv.block_ids, int(self.opts["chunk_tokens"]), prefix_tokens=recv.prefix_tokens, trace_id=recv.req_id
                )
            except kvstage.KVStageError as e:
                raise _Failed(f"opening its kvstage room failed: {e}") from e
            msg = {
                "op": "push",
                "req": recv.remote_request_id,
                "trace": recv.req_id,
                "room": room.room,
                "key": room.key,
                "grid": list(room.grid),
                "addr": self.engine.listen_address,
                "decode_rank": self.tp_rank,
                "decode_tp": self.tp_size,
                "layout": self.layout_id,
                "incarnation": self.incarnation,
                "started": self.started,
                "block_size": self.block_size,
            }
            msg = _sign(msg, self.opts["cluster_token"])
            for p in ranks:
                where = f"{host}:{port + p}"
                try:
                    s = socket.create_connection((host, port + p), timeout=min(left(), 10.0))
                except OSError as e:
                    raise _Failed(f"the prefill's kvstage bootstrap at {where} (prefill rank {p}) is not reachable: {e}") from e
                socks.append((where, s))
                contacted.add(p)
                _send_line(s, msg)
            token_major = set()
            for where, s in socks:
                s.settimeout(left())
                try:
                    rep = _read_line(s, deadline=deadline)
                except socket.timeout:
                    raise _Failed(f"the prefill at {where} did not send request {recv.remote_request_id} within load_timeout_s {self.opts['load_timeout_s']} s") from None
                except (OSError, ValueError) as e:
                    raise _Failed(f"the bootstrap connection to the prefill at {where} failed: {e}") from e
                if rep is None:
                    raise _Failed(f"the prefill at {where} closed the bootstrap connection before it sent request {recv.remote_request_id}: it is gone or restarting")
                if not isinstance(rep, dict) or not rep.get("ok"):
                    raise _Failed(str(rep.get("error") if isinstance(rep, dict) else rep) or f"the prefill at {where} refused the request")
                # Whether it sent token-major data (a repacked copy) or whole blocks in the
                # in-block order both sides share (the push named ours).
                token_major.add(bool(rep.get("token_major", recv.remote_block_size != self.block_size)))
            if len(token_major) > 1:
                raise _Failed("the prefill ranks disagree on whether they sent token-major blocks")
            try:
                room.wait(int(left() * 1000))
                d = room.describe()
            except kvstage.KVStageError as e:
                raise _Failed(f"its kvstage room failed: {e}") from e
            landed = sum(w.get("landed", 0) for c in d.get("chunks", ()) for w in c.get("writers", ()))
            if self.whole_pages and token_major == {True}:
                if self.positions == "unknown":
                    raise _Failed("the prefill sent token-major blocks and this backend's block layout is unknown")
                self._repacker.back(recv.block_ids)
            if self.hooks is not None and hasattr(self.hooks, "on_arrival"):
                self.hooks.on_arrival(recv.req_id, self.tensors, recv.block_ids, self.layout)
            ok = True
        except _Failed as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a failed load, never a hung request
            error = f"{type(e).__name__}: {e}"
        finally:
            for _, s in socks:
                try:
                    s.close()
                except Exception:  # noqa: BLE001
                    pass
        try:
            ms = (time.monotonic() - t0) * 1000
            moved = recv.num_tokens - recv.prefix_tokens
            if ok:
                logger.info(
                    "kvstage: request %s: %d tokens (%d cached here) in %d blocks, %d bytes from %s in %.1f ms",
                    recv.req_id, moved, recv.prefix_tokens, len(recv.block_ids), landed, recv.bootstrap, ms,
                )
            else:
                logger.error("kvstage: request %s: loading its KV from the prefill at %s failed: %s", recv.req_id, recv.bootstrap, error)
                # The prefill ranks this rank did not reach yet would hold the blocks until
                # their lease: tell them it needs nothing (best effort, off this thread's path).
                rest = [p for p in range(recv.remote_tp_size) if p not in contacted] if recv.bootstrap else []
                if rest:
                    self._notify.submit(self._send_none, recv, rest, error)
            if ok and ranks:
                rest = [p for p in range(recv.remote_tp_size) if p not in ranks]
                if rest:  # left out by the pairing (they replicate heads another rank sent)
                    self._notify.submit(self._send_none, recv, rest, "")
            self._stat(
                {"request": recv.req_id, "ok": ok, "tokens": moved, "prefix_tokens": recv.prefix_tokens, "blocks": len(recv.block_ids),
                 "bytes": landed, "ms": round(ms, 3), "error": error}
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstage: request %s: after its load: %s", recv.req_id, e)
        self._complete_recv(recv, ok, room)

    def _complete_recv(self, recv: _Recv, ok: bool, room: Any) -> None:
        """The load ended: release its room, then report it to vLLM. A release that raises
        (a same-host writer still holds the pages) is retried on later steps: until it
        succeeds vLLM must not get the blocks back."""
        released = self._try_release(recv, room, first=True)
        with self._cond:
            self._receiving -= 1
            if released:
                self._report_recv(recv, ok)
            else:
                self._unreleased.append((recv, ok, room))

    def _try_release(self, recv: _Recv, room: Any, first: bool = False) -> bool:
        if room is None:
            return True
        try:
            room.release()
            return True
        except Exception as e:  # noqa: BLE001
            if first:
                logger.warning("kvstage: request %s: releasing its room: %s: its blocks stay out until a later release succeeds", recv.req_id, e)
            return False

    def _report_recv(self, recv: _Recv, ok: bool) -> None:
        """With the lock."""
        self._finished_recv.add(recv.req_id)
        if not ok:
            if recv.block_ids:
                self._failed_blocks.update(recv.block_ids)
            else:
                self._failed_recv.add(recv.req_id)
        self._cond.notify_all()

    def _retry_releases(self) -> None:
        """With the lock: rooms whose release raised before."""
        if not self._unreleased:
            return
        still = []
        for recv, ok, room in self._unreleased:
            if self._try_release(recv, room):
                logger.info("kvstage: request %s: its room is released now", recv.req_id)
                self._report_recv(recv, ok)
            else:
                still.append((recv, ok, room))
        self._unreleased = still

    def _send_none(self, recv: _Recv, ranks: list, error: str) -> None:
        """Tell prefill ranks that this decode rank needs nothing from them for the request."""
        try:
            host, port = recv.bootstrap.rsplit(":", 1)
            msg = {"op": "none", "req": recv.remote_request_id, "decode_rank": self.tp_rank, "decode_tp": self.tp_size,
                   "grid": [0, 1, 1, 1, self.block_size, 0], "error": error[:512],
                   "incarnation": self.incarnation, "started": self.started}
            msg = _sign(msg, self.opts["cluster_token"])
        except Exception:  # noqa: BLE001
            return
        for p in ranks:
            try:
                with socket.create_connection((host, int(port) + p), timeout=2) as s:
                    _send_line(s, msg)
                    s.settimeout(2)
                    _read_line(s, deadline=time.monotonic() + 2)
            except Exception as e:  # noqa: BLE001 - its lease frees them
                logger.debug("kvstage: request %s: telling prefill rank %d at %s: %s", recv.remote_request_id, p, recv.bootstrap, e)

    def _send_release(self, bootstrap: str, remote_id: str, remote_tp: int) -> None:
        try:
            host, port = bootstrap.rsplit(":", 1)
            port = int(port)
        except Exception:  # noqa: BLE001
            return
        for p in range(remote_tp):
            try:
                with socket.create_connection((host, port + p), timeout=5) as s:
                    _send_line(s, _sign({"op": "release", "req": remote_id}, self.opts["cluster_token"]))
            except OSError as e:
                logger.warning("kvstage: releasing request %s on the prefill at %s:%d: %s", remote_id, host, port + p, e)

    def _stat(self, row: dict) -> None:
        path = self.opts["stats_file"]
        if path:
            with self._stats_lock, open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
