"""The sender: one request on one prefill rank. sglang's ``send(kv_indices, ...)`` calls become the
transfers of the decode's chunk grid (``get_max_transfer_tokens`` returns it), one per decode rank
this rank writes to; the last carries the request's aux row and state slots. ``poll()`` maps the
transfers' states onto ``KVPoll``."""

from __future__ import annotations

import logging
import time
from typing import Any, List, Optional, Tuple

import msgspec
import numpy as np

import kvstage
from kvstage import RequestParts, Status

from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric

from .manager import KvstageKVManager
from .messages import RoomMetadata
from .pools import page_list, state_slots
from .status import TransferRequest, describe_error

logger = logging.getLogger(__name__)


class _Target(msgspec.Struct):
    meta: RoomMetadata
    session: Any = None


class KvstageKVSender(TransferRequest, BaseKVSender):
    """One request on one prefill rank: the chunks of the decode's grid, as kvstage transfers."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, int(bootstrap_room))
        self.targets: Optional[List[_Target]] = None
        self.grid: Optional[RoomMetadata] = None
        self.aux_index: Optional[int] = None
        self.ops: List[Tuple[Any, _Target, int]] = []
        self.pending_pages: List[int] = []
        self.pending_tokens = 0
        self.tokens_sent = 0
        self.next_chunk = 0
        self.last_sent = False
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        self.bytes_sent = 0

    # sglang's surface ------------------------------------------------------------------------

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.aux_index = None if aux_index is None else int(aux_index)

    def _resolve_targets(self) -> Optional[List[_Target]]:
        if self.targets is None:
            ready = self.kv_mgr.rooms.room_ready(self.bootstrap_room)
            if ready is not None:
                self.grid = ready[0]
                self.targets = [_Target(m) for m in ready[1]]
        return self.targets

    def get_max_transfer_tokens(self) -> Optional[int]:
        """The decode's chunk grid: every ``send`` covers at most one of its chunks."""
        return None if self._resolve_targets() is None else self.grid.chunk_tokens

    def pop_decode_prefix_len(self) -> int:
        return 0 if self._resolve_targets() is None else self.grid.prefix_tokens

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """As sglang's common sender: the last segment is sent even without pages (it carries
        the request's parts and ends the room)."""
        return num_pages > 0 or last_chunk

    def send(self, kv_indices, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None, **_ignored):
        if self.failed is not None:
            return
        targets = self._resolve_targets()
        if targets is None:
            self._fail("send() before the decode side's metadata arrived (poll() was not WaitingForInput)")
            return
        if self.started is None:
            self.started = time.monotonic()
        page = self.kv_mgr.page_size
        meta0 = self.grid
        grid = meta0.chunk_tokens
        pages = page_list(kv_indices)
        if num_kv_tokens is None:
            num_kv_tokens = len(pages) * page
        start = meta0.prefix_tokens + self.tokens_sent + self.pending_tokens
        # A send that starts inside a page repeats the previous send's last page.
        if start % page and self.pending_pages and pages and pages[0] == self.pending_pages[-1]:
            pages = pages[1:]
        self.pending_pages.extend(pages)
        self.pending_tokens += int(num_kv_tokens)
        is_last = state_indices is not None
        chunk_index = self.next_chunk
        last_chunk = chunk_index == meta0.num_chunks - 1
        if (self.pending_tokens < grid or last_chunk) and not is_last:
            # The rest of this chunk comes with the next send; the grid's last chunk waits for
            # the request's last send (its parts), which may bring no pages at all.
            return
        if is_last:
            # The request's length is known now: the decode's pages must hold exactly its tokens
            # (the grid being the one of those pages, its last chunk is this one).
            tokens = self.tokens_sent + self.pending_tokens
            dpage = meta0.decode.page_size
            need = -(-tokens // dpage)
            if meta0.num_pages != need:
                self._fail(
                    f"the decode opened num_pages {meta0.num_pages} pages of {dpage} tokens for this request's "
                    f"{tokens} tokens after its prefix ({need} pages)"
                )
                return
        if self.pending_tokens > grid:
            self._fail(f"send() of {self.pending_tokens} tokens for chunk {chunk_index}: the decode's grid has {grid} tokens a chunk")
            return
        parts = None
        if last_chunk:
            try:
                slots = state_slots(self.kv_mgr.state_groups, state_indices)
            except ValueError as e:
                self._fail(str(e))
                return
            row = self.aux_index if self.aux_index is not None else 0
            parts = RequestParts(aux_row=row, state_slots=slots)
        chunk_start = meta0.prefix_tokens + self.tokens_sent
        src_offset = chunk_start % page
        for t in targets:
            try:
                if t.session is None:
                    t.session = self.kv_mgr.session_to(t.meta.address)
                op = t.session.transfer_async(
                    self.bootstrap_room, chunk_index, np.asarray(self.pending_pages, dtype=np.uint32),
                    self.kv_mgr.transfer_timeout_ms, room_key=t.meta.room_key,
                    src_token_offset=src_offset, num_tokens=self.pending_tokens,
                    trace_id=t.meta.trace_id, parts=parts,
                )
            except kvstage.KVStageError as e:
                self._fail_chunk(chunk_index, t, e)
                return
            self.ops.append((op, t, chunk_index))
        self.bytes_sent += self.pending_tokens * self.kv_mgr.token_bytes
        self.tokens_sent += self.pending_tokens
        self.pending_pages, self.pending_tokens = [], 0
        self.next_chunk += 1
        if last_chunk:
            self.last_sent = True

    def poll(self) -> KVPoll:
        settled = self.settled()
        if settled is not None:
            return settled
        if self._resolve_targets() is None:
            refused = self.kv_mgr.rooms.refusal(self.bootstrap_room)
            if refused is not None:
                self._fail(refused, notify=False)  # the decode rank was told already
                return KVPoll.Failed
            if time.monotonic() - self.created > self.kv_mgr.bootstrap_timeout_s:
                self._fail(f"no metadata from the decode side within {self.kv_mgr.bootstrap_timeout_s:g}s (bootstrap timeout)")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        if not self.ops and not self.last_sent:
            return KVPoll.WaitingForInput
        still: List[Tuple[Any, _Target, int]] = []
        for op, t, k in self.ops:
            try:
                st = op.poll()
            except kvstage.KVStageError as e:
                self._fail_chunk(k, t, e)
                self._cancel_ops()
                return KVPoll.Failed
            if st == Status.PENDING:
                still.append((op, t, k))
            elif st == Status.FALLBACK:
                self._fail(
                    f"chunk {k}: the decode's staging ring cannot hold one chunk of its grid "
                    "(raise KVSTAGE_SGLANG_RING_BYTES on the decode side or lower KVSTAGE_SGLANG_CHUNK_TOKENS)"
                )
                self._cancel_ops()
                return KVPoll.Failed
            else:
                op.close()
        self.ops = still
        if self.last_sent and not self.ops:
            self.succeeded = True
            self.finished = time.monotonic()
            self.kv_mgr.rooms.forget_room(self.bootstrap_room)
            return KVPoll.Success
        return KVPoll.Transferring

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished is not None:
            latency = self.finished - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes_sent or None)

    def abort(self):
        self._fail("aborted by the prefill scheduler")
        self._cancel_ops()

    def clear(self):
        self._cancel_ops()
        self.kv_mgr.rooms.forget_room(self.bootstrap_room)

    # helpers ------------------------------------------------------------------------------------

    def _fail(self, reason: str, cause: Optional[BaseException] = None, notify: bool = True) -> None:
        if self.failed is None:
            self.failed = (reason, cause)
            logger.error("kvstage backend: room %s (%s): %s", self.bootstrap_room, self.trace_id, reason)
            if notify:  # the decode ranks this rank knows of fail now, not at their room's deadline
                metas = [t.meta for t in self.targets] if self.targets is not None else self.kv_mgr.rooms.room_infos(self.bootstrap_room)
                for m in metas:
                    self.kv_mgr.rooms.notify_decode(m, f"prefill rank {self.kv_mgr.topo.attn_tp_rank}: {reason}")
            self.kv_mgr.rooms.forget_room(self.bootstrap_room)

    def _fail_chunk(self, k: int, t: _Target, e: kvstage.KVStageError) -> None:
        """Chunk ``k``'s transfer to ``t`` failed: a dead session is dropped (the next request
        connects again)."""
        self.kv_mgr.drop_session_if_dead(t.meta.address, t.session)
        self._fail(f"chunk {k} to decode rank {t.meta.decode.tp_rank} at {t.meta.address}: {describe_error(e)}", e)

    def _cancel_ops(self) -> None:
        for op, _t, _k in self.ops:
            try:
                op.cancel()
            except Exception:
                pass
            try:
                op.close()
            except Exception:
                pass
        self.ops = []
