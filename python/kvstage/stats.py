"""Metrics (header sections "engine" and "session"): an engine's and a session's counters, and
the phase timings of a transfer (:meth:`Operation.timings`, an ``OP`` completion with
``metrics=True``, the ``timings_sum`` of the stats).

There is no "timings of the last synchronous transfer" any more (``kvstage_transfer_timings_last``
was removed in 0.4): time one transfer with :meth:`Session.transfer_async` and
:meth:`Operation.timings`, or read the sums of :meth:`Session.stats`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

from . import _lib
from ._lib import Transport

__all__ = ["TransferTimings", "EngineStats", "SessionStats"]


class TransferTimings(NamedTuple):
    """``kvstage_transfer_timings``: where one transfer (one chunk) spent its time, in
    nanoseconds; 0 for a phase that did not happen. The phases run in this order and ``total_ns``
    spans them all. In ``timings_sum`` of the stats, each field is summed over the transfers."""

    queued_ns: int = 0
    watermark_wait_ns: int = 0
    alloc_wait_ns: int = 0
    gather_ns: int = 0
    wire_ns: int = 0
    ack_ns: int = 0
    total_ns: int = 0

    @classmethod
    def _from_c(cls, c: Any) -> "TransferTimings":
        return cls(*(getattr(c, name) for name in cls._fields))


class SessionStats(NamedTuple):
    """``kvstage_session_stats``: a sender session's counters (see the README's Metrics)."""

    transport: Union[Transport, int]
    downgraded: int
    bytes_sent: int
    chunks_sent: int
    transfers_ok: int
    transfers_fallback: int
    transfers_failed: int
    transfers_timeout: int
    transfers_canceled: int
    transfers_peer_gone: int
    transfers_failed_other: int
    transfers_in_flight: int
    timed_transfers: int
    timings_sum: TransferTimings
    #: 0 while the connection is up, else the status that ended it (free the session, connect again).
    dead_status: int


class EngineStats(NamedTuple):
    """``kvstage_engine_stats``."""

    ring_capacity: int
    ring_live_allocations: int
    watermark_round: int
    watermark_offset: int
    rdma_downgrades: int = 0
    rdma_sessions: int = 0
    connections: int = 0
    accept_errors: int = 0
    connections_refused: int = 0
    handshakes_failed: int = 0
    events_dropped: int = 0
    rooms_expired: int = 0
    thread_panics: int = 0
    # metrics
    bytes_sent: int = 0
    chunks_sent: int = 0
    transfers_ok: int = 0
    transfers_fallback: int = 0
    transfers_failed: int = 0
    transfers_timeout: int = 0
    transfers_canceled: int = 0
    transfers_peer_gone: int = 0
    transfers_failed_other: int = 0
    transfers_in_flight: int = 0
    timed_transfers: int = 0
    timings_sum: TransferTimings = TransferTimings()
    bytes_received: int = 0
    chunks_received: int = 0
    scatter_count: int = 0
    scatter_ns_sum: int = 0
    scatter_ns_max: int = 0
    ring_used_bytes: int = 0
    ring_high_water_bytes: int = 0
    shm_sessions: int = 0
    shm_downgrades: int = 0
    rdma_host_staging_sessions: int = 0
    shm_direct_sessions: int = 0
    shm_direct_chunks: int = 0
    regions_read_into_pool: int = 0


def from_c(cls: Any, c: Any) -> Any:
    """A NamedTuple of ``cls`` from the C struct ``c`` (same field names; nested timings too)."""
    values = []
    for name in cls._fields:
        v = getattr(c, name)
        values.append(TransferTimings._from_c(v) if isinstance(v, _lib.kvstage_transfer_timings) else v)
    return cls(*values)


def session_stats_from_c(c: Any) -> SessionStats:
    stats = from_c(SessionStats, c)
    try:
        return stats._replace(transport=Transport(stats.transport))
    except ValueError:
        return stats
