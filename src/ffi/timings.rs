//! Phase timings of one transfer, and the sender counters a session and an engine share.

use crate::session::stats::{SendStats, TransferTimings};

/// Where one transfer (one chunk) spent its time, in nanoseconds (monotonic clock). A phase that
/// did not happen is 0 (a fallback has only `total_ns`; a failure has the phases it reached, the
/// one it failed in included). The phases run one after the other in the order below, so
/// `total_ns` >= the sum of the others. In sums (`timings_sum` of the stats structs) each field is
/// the sum over the counted transfers.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct kvstage_transfer_timings {
    pub struct_size: usize,
    /// Asynchronous transfers: from `kvstage_transfer_async` to a transfer worker taking it up.
    pub queued_ns: u64,
    /// The allocation request's round trip to the receiver (the grant of ring space), plus waiting
    /// until the receiver's watermark lets the granted range be written (its ring is full).
    pub watermark_wait_ns: u64,
    /// Waiting for a send staging buffer of the engine (all in use by other chunks), or
    /// allocating a new one; 0 over TCP from a host pool (no buffer).
    pub alloc_wait_ns: u64,
    /// Gathering the chunk's pages into the staging buffer (for CUDA pools the wait for the
    /// producer's ready point included), plus the integrity checksum when the chunk carries one;
    /// written in pieces, the time the write waited for a piece's gather; over TCP from a host
    /// pool, the request's parts and the checksum only.
    pub gather_ns: u64,
    /// The bulk write of the gathered bytes and the ready frame (slice path: all slice writes).
    pub wire_ns: u64,
    /// From the end of the write to the receiver's acknowledgement of the arrival.
    pub ack_ns: u64,
    /// The whole transfer, from the call (asynchronous: `kvstage_transfer_async`) to its result.
    pub total_ns: u64,
}

pub(crate) fn timings_to_c(t: &TransferTimings) -> kvstage_transfer_timings {
    kvstage_transfer_timings {
        struct_size: std::mem::size_of::<kvstage_transfer_timings>(),
        queued_ns: t.queued_ns,
        watermark_wait_ns: t.watermark_wait_ns,
        alloc_wait_ns: t.alloc_wait_ns,
        gather_ns: t.gather_ns,
        wire_ns: t.wire_ns,
        ack_ns: t.ack_ns,
        total_ns: t.total_ns,
    }
}

/// The sender counters shared by `kvstage_session_stats` and `kvstage_engine_stats`.
pub(crate) struct SendFields {
    pub bytes_sent: u64,
    pub chunks_sent: u64,
    pub transfers_ok: u64,
    pub transfers_fallback: u64,
    pub transfers_failed: u64,
    pub transfers_timeout: u64,
    pub transfers_canceled: u64,
    pub transfers_peer_gone: u64,
    pub transfers_failed_other: u64,
    pub transfers_in_flight: u64,
    pub timed_transfers: u64,
    pub timings_sum: kvstage_transfer_timings,
}

pub(crate) fn send_fields(s: &SendStats) -> SendFields {
    SendFields {
        bytes_sent: s.bytes_sent,
        chunks_sent: s.chunks_sent,
        transfers_ok: s.transfers_ok,
        transfers_fallback: s.transfers_fallback,
        transfers_failed: s.transfers_failed(),
        transfers_timeout: s.transfers_timeout,
        transfers_canceled: s.transfers_canceled,
        transfers_peer_gone: s.transfers_peer_gone,
        transfers_failed_other: s.transfers_failed_other,
        transfers_in_flight: s.in_flight,
        timed_transfers: s.timed_transfers,
        timings_sum: timings_to_c(&s.sum),
    }
}

