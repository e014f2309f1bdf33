"""Transfers and operations (header section "operation"): the transfer descriptor every
:class:`Session` transfer fills, and :class:`Operation`, an asynchronous transfer.

Timeouts follow the one rule of the C API: ``timeout_ms`` 0 is the engine's
``default_timeout_ms``, :data:`kvstage.TIMEOUT_INFINITE` is no limit.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_uint32
from typing import Any, Optional

from . import _lib
from ._buffers import page_array
from ._common import Handle, check, init_struct, output_struct, read_json, u32, u64
from ._lib import Library, Status, TIMEOUT_INFINITE
from .parts import request_parts_c
from .stats import TransferTimings

__all__ = ["Operation"]


def transfer_desc(
    lib: Library, room: int, room_key: int, chunk_index: int, pages: Any, timeout_ms: int, tag: int, src_token_offset: int, num_tokens: int,
    trace_id: Optional[str] = None, parts: Any = None,
):
    """A ``kvstage_transfer_desc`` and what keeps the memory it points to alive."""
    keep, address, count = page_array(pages, "pages")
    d = init_struct(lib, _lib.kvstage_transfer_desc, "kvstage_transfer_desc_init")
    d.room = u64(room, "room")
    d.room_key = u64(room_key, "room_key")
    d.chunk_index = u32(chunk_index, "chunk_index")
    d.src_pages = ctypes.cast(address, POINTER(c_uint32))
    d.num_pages = count
    d.timeout_ms = u64(timeout_ms, "timeout_ms")
    d.user_tag = u64(tag, "tag")
    d.src_token_offset = u32(src_token_offset, "src_token_offset")
    d.num_tokens = u32(num_tokens, "num_tokens")
    if trace_id is not None:
        encoded = trace_id.encode("utf-8")
        d.trace_id = encoded
        keep = (keep, encoded)
    if parts is not None:
        d.parts, keep_parts = request_parts_c(lib, parts)
        keep = (keep, keep_parts)
    return d, keep


_CU_STREAM_LEGACY = 0x1


def _cuda_handle(obj: Any, attr: str, what: str) -> Optional[int]:
    """The raw CUDA handle of a torch object (its ``attr``), an int as is, ``None`` for none.
    A torch stream whose handle is 0 is the legacy default stream (NULL would mean "ready now");
    a torch event whose handle is 0 was never recorded."""
    if obj is None:
        return None
    raw = getattr(obj, attr, obj)
    if not isinstance(raw, int):
        raise TypeError(f"{what}: expected a torch CUDA {what} or a raw handle (int), got {type(obj).__name__}")
    if raw == 0 and obj is not raw:
        if what == "stream":
            return _CU_STREAM_LEGACY
        raise ValueError(f"{what}: the torch CUDA event was never recorded")
    return raw or None


class Operation(Handle):
    """``kvstage_op``: a transfer started by :meth:`Session.transfer_async` or
    :meth:`Session.transfer_layerwise_async`. Closing it does not stop it (use :meth:`cancel`)."""

    _kind = "kvstage_op"
    _free_fn = "kvstage_op_free"

    def __init__(self, session: Any, ptr: int):
        super().__init__(session._lib, ptr)
        self.session = session
        self._session_id = session.session_id

    def poll(self) -> Status:
        """``Status.PENDING`` while running, then the result (``OK`` or ``FALLBACK``); raises the
        operation's error (every time it is asked)."""
        return check(self._lib, self._lib.kvstage_op_poll(self._handle()), "kvstage_op_poll")

    def wait(self, timeout_ms: int = TIMEOUT_INFINITE) -> Status:
        """``kvstage_op_wait``: waits up to ``timeout_ms`` (default :data:`TIMEOUT_INFINITE`: until
        it ends, which its own ``timeout_ms`` bounds; 0 = the engine's ``default_timeout_ms``, as
        everywhere: to look without waiting, use :meth:`poll`). Returns ``Status.PENDING`` if it
        is still running, else as :meth:`poll`. Refused from inside a completion callback
        (:class:`ArgumentError` with ``E_UNSUPPORTED``)."""
        rc = self._lib.kvstage_op_wait(self._handle(), u64(timeout_ms, "timeout_ms"))
        return check(self._lib, rc, "kvstage_op_wait")

    def describe(self) -> dict:
        """``kvstage_op_describe``: where the transfer is, as a dict: ``phase`` (``queued``, ``starting``,
        ``waiting_for_allocation``, ``waiting_for_watermark``, ``gathering``, ``writing``,
        ``waiting_for_layers``, ``waiting_for_acknowledgement``, ``done``, ``failed``, ...),
        ``waits_on``, ``in_phase_ms``, ``deadline_left_ms``, ``status``, ``error``."""
        return read_json(self._lib, "kvstage_op_describe", self._handle())

    def cancel(self) -> None:
        """Asks the operation to stop; it ends with ``E_CANCELED`` unless it already finished."""
        check(self._lib, self._lib.kvstage_op_cancel(self._handle()), "kvstage_op_cancel")

    def layers_ready(self, first_layer: int, num_layers: int = 1, event: Any = None, stream: Any = None) -> None:
        """``kvstage_op_layers_ready``: model layers ``[first_layer, first_layer + num_layers)``
        of a layer-wise transfer are ready, after ``event`` (a recorded ``torch.cuda.Event`` or a
        raw ``CUevent``) or the current work of ``stream`` (a ``torch.cuda.Stream`` or a raw
        ``CUstream``), or now when neither is given."""
        if event is not None and stream is not None:
            raise ValueError("layers_ready: give event or stream, not both")
        rc = self._lib.kvstage_op_layers_ready(
            self._handle(),
            u32(first_layer, "first_layer"),
            u32(num_layers, "num_layers"),
            _cuda_handle(stream, "cuda_stream", "stream"),
            _cuda_handle(event, "cuda_event", "event"),
        )
        check(self._lib, rc, "kvstage_op_layers_ready")

    def timings(self) -> Optional[TransferTimings]:
        """``kvstage_op_timings_get``: the phase timings once the operation ended, else ``None``."""
        out = output_struct(_lib.kvstage_transfer_timings)
        rc = check(self._lib, self._lib.kvstage_op_timings_get(self._handle(), byref(out)), "kvstage_op_timings_get")
        return None if rc == Status.PENDING else TransferTimings._from_c(out)

    def __repr__(self) -> str:
        return f"<kvstage.Operation of session {self._session_id!r}{' closed' if self.closed else ''}>"
