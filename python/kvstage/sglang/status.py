"""What sglang reads off one request of this backend: ``poll()``'s settled states and
``failure_exception()`` (:class:`KvstageTransferError`, with kvstage's message and the request's
trace id). Shared by the sender (prefill) and the receiver (decode)."""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

import kvstage

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError


class KvstageTransferError(KVTransferError):
    """A failed kvstage transfer of one sglang request: ``failure_reason`` has kvstage's message
    (and causes), ``trace_id`` the id both sides' kvstage logs and describe documents use, and
    ``__cause__`` the :class:`kvstage.KVStageError` when there was one."""

    def __init__(self, bootstrap_room: int, failure_reason: str, trace_id: str = "", cause: Optional[BaseException] = None):
        reason = f"{failure_reason} [kvstage trace {trace_id}]" if trace_id else failure_reason
        super().__init__(bootstrap_room, reason)
        self.trace_id = trace_id
        self.kvstage_error = cause
        if cause is not None:
            self.__cause__ = cause


def describe_error(err: BaseException) -> str:
    """One line for a failure reason: kvstage's code, message and causes, else the exception."""
    if isinstance(err, kvstage.KVStageError):
        code = err.code.name if hasattr(err.code, "name") else err.code
        text = f"{code}: {err.message}"
        if err.causes:
            text += " (" + "; ".join(err.causes) + ")"
        return text
    return f"{type(err).__name__}: {err}"


def trace_id_of(room: int) -> str:
    """The kvstage trace id of sglang request ``bootstrap_room`` (same on both sides)."""
    return f"sglang-{int(room) & 0xFFFFFFFFFFFFFFFF:x}"


class TransferRequest:
    """One request on one rank, as both its sender and its receiver track it: failed (with the
    reason and the kvstage error) or succeeded, once and for good."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.trace_id = trace_id_of(bootstrap_room)
        self.created = time.monotonic()
        self.failed: Optional[Tuple[str, Optional[BaseException]]] = None
        self.succeeded = False

    def settled(self) -> Optional[int]:
        """``KVPoll.Failed`` or ``KVPoll.Success`` once the request ended, else None."""
        if self.failed is not None:
            return KVPoll.Failed
        if self.succeeded:
            return KVPoll.Success
        return None

    def failure_exception(self):
        reason, cause = self.failed or ("transfer failed", None)
        raise KvstageTransferError(self.bootstrap_room, reason, self.trace_id, cause)
