"""The receiver: one request on one decode rank. ``send_metadata`` opens the request's kvstage room
with its KV pages, aux row and state slots and sends the room id, its key and its chunk grid to
the prefill ranks (:class:`~.messages.RoomMetadata`); ``poll()`` maps the room's events (and the
prefill ranks' failure notices) onto ``KVPoll``."""

from __future__ import annotations

import concurrent.futures
import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import zmq

import kvstage
from kvstage import RequestParts

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from .manager import KvstageKVManager
from .messages import RoomMetadata, encode
from .pools import page_list, state_slots
from .releases import release_room
from .status import TransferRequest, describe_error

logger = logging.getLogger(__name__)


class KvstageKVReceiver(TransferRequest, BaseKVReceiver):
    """One request on one decode rank: a kvstage room with its pages, aux row and state slots."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, prefill_dp_rank: Optional[int] = None):
        super().__init__(mgr, bootstrap_addr, int(bootstrap_room or 0))
        self.resolving: Optional[concurrent.futures.Future] = None
        self.prefill: Optional[Tuple[Dict[str, Any], List[Tuple[str, int]]]] = None
        self.room: Optional[kvstage.Room] = None
        self.got_chunk = False
        self.conclude_state: Optional[int] = None
        # Read by sglang's decode scheduler (staging handler, deferred KV release): neither applies.
        self.require_staging = False
        self.abort_notified = False
        # A room whose release kvstage refused (a writer still holds its pages): poll() keeps
        # the request in flight until a release succeeds (sglang frees the pages on Failed or
        # Success), clear() hands it to the manager's retries.
        self.unreleased = False
        self.last_state = KVPoll.Bootstrapping
        if prefill_dp_rank is not None:
            self.init(prefill_dp_rank)

    def init(self, prefill_dp_rank: int = 0):
        """Looks the prefill server up in its bootstrap registry (in the background: ``poll()``
        says Bootstrapping until it answered, Failed with the reason if it did not)."""
        if self.resolving is None:
            dp = int(prefill_dp_rank or 0)
            self.resolving = self.kv_mgr.executor.submit(self.kv_mgr.registry.resolve, self.bootstrap_addr, dp)

    def _check_resolved(self, wait_s: Optional[float] = None) -> bool:
        """Whether the registry answered (waiting up to ``wait_s`` for it; without, not at all);
        a lookup that failed fails the request."""
        if self.prefill is not None:
            return True
        if self.resolving is None or (wait_s is None and not self.resolving.done()):
            return False
        try:
            self.prefill = self.resolving.result(timeout=wait_s)
        except Exception as e:
            self._fail(f"bootstrap of room {self.bootstrap_room} failed: {e}", e)
            return False
        return True

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None, **_ignored):
        if self.failed is not None:
            return
        if not self._check_resolved(wait_s=self.kv_mgr.bootstrap_timeout_s):
            if self.resolving is None:
                self._fail("send_metadata() before init()")
            return
        info, ranks = self.prefill
        mgr = self.kv_mgr
        if destination is not None and getattr(destination, "value", destination) not in ("device", None):
            self._fail_opening(ranks, "kvstage backend: host KV destinations are not supported")
            return
        pages = page_list(kv_indices)
        prefix = int(decode_prefix_len or 0)
        prefill_page = int(info.page_size or mgr.page_size)
        step = mgr.page_size * prefill_page // math.gcd(mgr.page_size, prefill_page)
        chunk = max(step, (mgr.chunk_tokens_wanted // step) * step)
        try:
            slots = state_slots(mgr.state_groups, state_indices)
            parts = RequestParts(aux_row=int(aux_index) if aux_index is not None else 0, state_slots=slots)
            self.room = mgr.engine.open_room(self.bootstrap_room, np.asarray(pages, dtype=np.uint32), chunk,
                                             parts=parts, prefix_tokens=prefix, trace_id=self.trace_id)
        except (kvstage.KVStageError, ValueError) as e:
            self._fail_opening(ranks, f"opening room {self.bootstrap_room} ({len(pages)} pages) failed: {describe_error(e)}", e)
            return
        g = self.room.grid
        self._tell_prefill(ranks, RoomMetadata(
            room=self.bootstrap_room, room_key=self.room.key, address=mgr.address, decode=mgr.decode_layout,
            chunk_tokens=g.chunk_tokens, num_chunks=g.num_chunks, num_pages=g.num_pages,
            prefix_tokens=g.prefix_tokens, trace_id=self.trace_id, notify=mgr.failures.address,
        ))

    def poll(self) -> KVPoll:
        state = self._poll()
        if state in (KVPoll.Failed, KVPoll.Success) and not self._try_release():
            # kvstage says a writer may still write the room's pages: sglang frees them on
            # Failed/Success, so the request stays in flight until a release succeeds.
            return self.last_state
        self.last_state = state
        return state

    def _poll(self) -> KVPoll:
        settled = self.settled()
        if settled is not None:
            return settled
        if not self._check_resolved():
            return KVPoll.Failed if self.failed is not None else KVPoll.Bootstrapping
        if self.room is None:
            return KVPoll.WaitingForInput
        why = self.kv_mgr.failures.pop(self.bootstrap_room, self.room.key)
        if why is not None:
            self._fail(why, invalidate=False)
            return KVPoll.Failed
        try:
            events = self.room.poll_events()
        except kvstage.KVStageError as e:
            self._fail(f"room {self.bootstrap_room}: {describe_error(e)}", e)
            return KVPoll.Failed
        for ev in events:
            if ev.kind == kvstage.RoomEventKind.ROOM:
                if ev.ok:
                    self.succeeded = True
                    self.conclude_state = KVPoll.Success
                    return KVPoll.Success
                self._fail_from_room(ev)
                return KVPoll.Failed
            if not ev.ok:
                self._fail_from_room(ev)
                return KVPoll.Failed
            self.got_chunk = True
        return KVPoll.Transferring if self.got_chunk else KVPoll.WaitingForInput

    def abort(self):
        reason = "aborted by the decode scheduler"
        if self.prefill is None:
            last = self.kv_mgr.registry.errors.get(self.bootstrap_addr)
            reason += f" before the prefill server's bootstrap registry at {self.bootstrap_addr} answered"
            if last:
                reason += f" (last attempt: {last})"
        self._fail(reason, invalidate=False)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Deferred decode KV release is not supported (the manager says so): nothing to notify."""

    def clear(self):
        if not self._try_release():
            self.kv_mgr.late_releases.add(self.room, self.bootstrap_room, self.trace_id)
            self.room = None

    @property
    def supports_host_destination(self) -> bool:
        return False

    # helpers ---------------------------------------------------------------------------------

    def _tell_prefill(self, ranks: List[Tuple[str, int]], meta: RoomMetadata) -> None:
        """``meta`` to every prefill rank of the request's DP group (one not delivered fails the
        request)."""
        payload = encode(meta)
        try:
            for addr in ranks:
                self.kv_mgr.send_to_prefill(addr, payload)
        except zmq.ZMQError as e:
            self._fail(f"metadata to prefill rank {addr[0]}:{addr[1]} not delivered: {e}", e)

    def _fail_opening(self, ranks: List[Tuple[str, int]], reason: str, cause: Optional[BaseException] = None) -> None:
        """The room could not be opened on this rank: the request fails, and the prefill ranks are
        told (they would wait for its metadata until their bootstrap timeout)."""
        self._fail(reason, cause)
        mgr = self.kv_mgr
        self._tell_prefill(ranks, RoomMetadata(
            room=self.bootstrap_room, room_key=0, address=mgr.address, decode=mgr.decode_layout, chunk_tokens=0,
            num_chunks=0, num_pages=0, prefix_tokens=0, trace_id=self.trace_id, notify=mgr.failures.address, failed=reason,
        ))

    def _fail_from_room(self, ev: Any) -> None:
        cause: Optional[BaseException] = None
        reason = f"room {self.bootstrap_room}: {ev!r}"
        try:
            self.room.wait(1)
        except kvstage.KVStageError as e:
            cause = e
            reason = f"room {self.bootstrap_room} failed: {describe_error(e)}"
        except Exception:
            pass
        self._fail(reason, cause)

    def _fail(self, reason: str, cause: Optional[BaseException] = None, invalidate: bool = True) -> None:
        if self.failed is None:
            self.failed = (reason, cause)
            self.conclude_state = KVPoll.Failed
            if invalidate:
                logger.error("kvstage backend: room %s (%s): %s", self.bootstrap_room, self.trace_id, reason)
                self.kv_mgr.registry.invalidate(self.bootstrap_addr)
        self._try_release()

    def _try_release(self) -> bool:
        """Releases the room (bounded by KVSTAGE_SGLANG_RELEASE_TIMEOUT_MS): True once kvstage
        says nothing writes its pages any more, False while a writer still holds them."""
        room = self.room
        if room is None:
            return True
        ok, why = release_room(room)
        if ok:
            self.room = None
            if self.unreleased:
                logger.warning("kvstage backend: room %s (%s): released, its pages are free", self.bootstrap_room, self.trace_id)
            return True
        if not self.unreleased:
            self.unreleased = True
            logger.error("kvstage backend: room %s (%s): pages not free yet, kept and retried: %s", self.bootstrap_room, self.trace_id, why)
        return False
