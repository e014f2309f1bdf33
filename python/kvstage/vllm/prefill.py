"""The prefill worker's sending side: the finished requests it holds for their decodes, each push
sent into the decode's room with kvstage, the leases, and the blocks handed back to vLLM."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import kvstage

from .metadata import _Send
from .wire import _Failed

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (time.monotonic()), not below 0."""
    return max(0.0, deadline - time.monotonic())


@dataclass
class _Held:
    send: _Send
    deadline: float
    expected: Optional[set] = None  # decode tp ranks this rank feeds (known at the first push)
    served: set = field(default_factory=set)
    in_flight: int = 0



class _Prefill:
    """Mixed into ``_Worker``; the bootstrap listener (``_Bootstrap``) hands it validated messages."""

    def _init_prefill(self) -> None:
        self._held: dict = {}  # req_id -> _Held
        self._sessions: dict = {}  # (decode kvstage address, repacked) -> kvstage.Session
        self._connecting: dict = {}  # the same keys -> threading.Event set once a connect ends
        self._sessions_lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def _start_sending(self) -> None:
        self._pool = ThreadPoolExecutor(int(self.opts["send_threads"]), thread_name_prefix="kvstage-send")

    def _stop_sending(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._sessions_lock:
            for s in self._sessions.values():
                s.close()
            self._sessions.clear()

    def _hold(self, sends: Any, aborted: set) -> None:
        """The scheduler's finished requests: hold their blocks (and send the pushes parked for
        them); the aborted ones are not held."""
        now = time.monotonic()
        with self._cond:
            for send in sends:
                if send.req_id in self._gone:  # released by its decode before we held it
                    self._finished_send.add(send.req_id)
                    self._parked.pop(send.req_id, None)
                    continue
                self._held[send.req_id] = _Held(send, now + float(self.opts["lease_s"]))
                for conn, msg, _ in self._parked.pop(send.req_id, []):
                    self._dispatch(conn, msg)
            for req_id in aborted:
                self._forget(req_id, "it was aborted on the prefill")

    def _maybe_done(self, req_id: str, held: "_Held") -> None:
        """With the lock: every decode rank was served (or said it needs nothing): free the blocks."""
        if held.expected is not None and held.served >= held.expected and not held.in_flight and self._held.get(req_id) is held:
            del self._held[req_id]
            self._note_gone(req_id, "sent already")
            self._finished_send.add(req_id)
            self._cond.notify_all()

    def _dispatch(self, conn: socket.socket, msg: dict) -> None:
        """With the lock: a validated message for a held request: send it, or note the decode
        rank that needs nothing from this rank. Never raises."""
        req_id = msg["req"]
        held = self._held[req_id]
        if held.expected is None:
            held.expected = msg["_expected"]
        if msg["op"] == "none":
            held.served.add(msg["decode_rank"])
            self._reply(conn, True)
            self._maybe_done(req_id, held)
            return
        held.in_flight += 1
        try:
            self._pool.submit(self._push, held, conn, msg)
        except Exception as e:  # noqa: BLE001 - shut down
            held.in_flight -= 1
            self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id}: {e}")

    def _decode_ranks(self, decode_tp: int, decode_page: int) -> set:
        if decode_tp == self.tp_size:
            return {self.tp_rank}
        me = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=self.block_size, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=self.tp_rank, tp_size=self.tp_size, num_layers=self.layout.num_layers,
        )
        dec = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=decode_page, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=0, tp_size=decode_tp, num_layers=self.layout.num_layers,
        )
        return {tp for tp, _pp in kvstage.pairing_decode_ranks(me, [dec])}

    def _session(self, addr: str, repack: bool, deadline: float) -> kvstage.Session:
        """The session to a decode, connected by the first push that needs it (by ``deadline``)
        outside the lock: a decode slow to answer holds up only the pushes to it. Pushes that
        find a connection under way wait for it, then connect themselves if it failed."""
        key = (addr, repack)
        while True:
            if self._stop.is_set():
                raise _Failed("the prefill is shutting down")
            if _left(deadline) <= 0:
                raise _Failed(f"load_timeout_s {self.opts['load_timeout_s']} s passed before a connection to the decode at {addr}")
            with self._sessions_lock:
                s = self._sessions.get(key)
                if s is not None:
                    return s
                pending = self._connecting.get(key)
                mine = pending is None
                if mine:
                    pending = self._connecting[key] = threading.Event()
            if not mine:
                if not pending.wait(_left(deadline)):
                    raise _Failed(f"the decode's kvstage engine at {addr} is not reachable: another push's connection to it did not end within load_timeout_s")
                continue
            s = None
            try:
                try:
                    engine = self._repacker.ready_engine() if repack else self.engine
                except kvstage.KVStageError as e:  # local: not the decode's fault
                    raise _Failed(f"this prefill's engine for token-major copies did not start: {e}") from e
                name = f"vllm-p{self.tp_rank}{'-repack' if repack else ''}->{addr}"
                s = engine.connect(addr, name, max(1, int(_left(deadline) * 1000)))
            except kvstage.KVStageError as e:
                raise _Failed(f"the decode's kvstage engine at {addr} is not reachable: {e}") from e
            finally:
                with self._sessions_lock:
                    del self._connecting[key]
                    keep = s is not None and not self._stop.is_set()
                    if keep:
                        self._sessions[key] = s
                pending.set()
            if not keep:  # shut down while it connected: _stop_sending has closed the others
                s.close()
                raise _Failed("the prefill is shutting down")
            return s

    def _drop_session_if_dead(self, addr: str, repack: bool) -> None:
        """After a failure: a session whose connection is gone (the peer went, or this side cut it)
        is closed; the next request connects again. Called from error handlers: never raises."""
        try:
            with self._sessions_lock:
                s = self._sessions.get((addr, repack))
                if s is None or s.stats().dead_status == 0:
                    return
                del self._sessions[(addr, repack)]
            s.close()
        except Exception:  # noqa: BLE001 - a closed handle is as good as dropped
            pass

    def _push(self, held: _Held, conn: socket.socket, msg: dict) -> None:
        req_id, addr = held.send.req_id, msg["addr"]
        t0 = time.monotonic()
        # One deadline for the whole push (the decode gives up after load_timeout_s too): each
        # chunk gets what is left of it, not a load_timeout_s of its own.
        deadline = t0 + float(self.opts["load_timeout_s"])
        ok, error, sent, repack, slots = False, "", 0, False, []
        try:
            if self.hooks is not None and hasattr(self.hooks, "before_send"):
                self.hooks.before_send(req_id, msg)
            grid = kvstage.RoomGrid(*msg["grid"])
            total = held.send.num_tokens
            nblocks = math.ceil(total / self.block_size)
            blocks = held.send.block_ids[:nblocks]
            if self.whole_pages:
                # K lies head-dim-major in a block: a token's K is no row kvstage can address.
                # Same in-block order and block size on both sides: whole blocks move as they
                # are (the slots after the prompt carry whatever they held; the decode writes
                # them before it reads them). Otherwise: send a token-major copy, and say so.
                theirs = msg.get("layout")
                repack = grid.page_size != self.block_size or theirs != self.layout_id
                if repack and self.positions == "unknown":
                    raise _Failed(
                        f"the decode's block layout {theirs} differs from this prefill's {self.layout_id} and this backend's block layout is unknown"
                    )
                if not repack:
                    total = nblocks * self.block_size
            session = self._session(addr, repack, deadline)
            for k in range(grid.num_chunks):
                if time.monotonic() >= deadline:
                    raise _Failed(f"load_timeout_s {self.opts['load_timeout_s']} s passed with {k} of the room's {grid.num_chunks} chunks sent")
                timeout_ms = max(1, int(_left(deadline) * 1000))
                sp = kvstage.chunk_span(grid, total, self.block_size, k)
                pages = sp.src_pages(blocks)
                if repack:
                    # Only the blocks this chunk reads, copied token-major just before it goes:
                    # a decode's cached prefix is never copied, and a request of any length
                    # moves through repack_blocks.
                    slots = self._repacker.alloc(len(pages), deadline)
                    self._repacker.out(pages, slots)
                    pages = slots
                kw = dict(room_key=int(msg["key"]), src_token_offset=sp.src_token_offset, num_tokens=sp.num_tokens, trace_id=str(msg["trace"]))
                if session.transfer(int(msg["room"]), k, pages, timeout_ms, **kw) == kvstage.Status.FALLBACK:
                    session.transfer_slices(int(msg["room"]), k, pages, timeout_ms, **kw)
                if slots:
                    self._repacker.release(slots)
                    slots = []
                sent += sp.num_tokens
                if self.hooks is not None and hasattr(self.hooks, "after_chunk"):
                    self.hooks.after_chunk(req_id, k, grid.num_chunks)
            ok = True
        except _Failed as e:
            error = f"prefill {self.bootstrap_addr}: request {req_id}: {e}"
        except kvstage.KVStageError as e:
            self._drop_session_if_dead(addr, repack)
            error = f"prefill {self.bootstrap_addr}: request {req_id}: sending to the decode at {addr} failed: {e}"
        except Exception as e:  # noqa: BLE001 - reported to the decode, never lost
            error = f"prefill {self.bootstrap_addr}: request {req_id}: {type(e).__name__}: {e}"
        finally:
            if slots:
                self._repacker.release(slots)
        ms = (time.monotonic() - t0) * 1000
        if ok:
            logger.debug("kvstage: request %s: sent %d tokens to decode rank %s at %s in %.1f ms", req_id, sent, msg.get("decode_rank"), addr, ms)
        else:
            logger.error("kvstage: %s", error)
        self._reply(conn, ok, error, tokens=sent, ms=ms, token_major=bool(repack or not self.whole_pages))
        with self._cond:
            held.in_flight -= 1
            held.served.add(msg["decode_rank"])
            self._maybe_done(req_id, held)

    def _reap(self) -> None:
        """With the lock: leases that ran out, pushes whose blocks never came."""
        now = time.monotonic()
        lease = float(self.opts["lease_s"])
        for req_id, held in list(self._held.items()):
            if held.deadline <= now and not held.in_flight:
                served = f"{len(held.served)} of {len(held.expected)} decode ranks served" if held.expected else "no decode asked"
                logger.warning(
                    "kvstage: request %s: freeing its %d blocks after the %.0f s lease (%s)", req_id, len(held.send.block_ids), lease, served
                )
                del self._held[req_id]
                self._finished_send.add(req_id)
                self._forget(req_id, f"its lease of {lease:.0f} s ran out")
        for req_id, parked in list(self._parked.items()):
            if parked and now - parked[0][2] > lease:
                self._forget(req_id, "the prefill never finished it")
            elif not parked:
                self._unpark(req_id)
