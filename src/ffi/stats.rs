//! Metrics: per-transfer phase timings and per-session counters (the engine's are in
//! `kvstage_engine_stats`, src/ffi/engine.rs).

use std::cell::Cell;

use super::transfer::{kvstage_op, kvstage_session};
use super::{ffi_fn, out_ptr, write_versioned};
use crate::error::Status;
use crate::session::stats::{LinkKind, SendStats, TransferTimings};

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

/// Counters of one sender session (a snapshot). Transfers are counted once they end; a transfer
/// is one chunk (`kvstage_transfer`, `kvstage_transfer_slices` or `kvstage_transfer_async`).
/// The snapshot is not atomic across counters: each is read on its own while transfers may be
/// ending, so a concurrent read may see a transfer counted in one field and not yet in another
/// (its result but not its timings, or its result while still in `transfers_in_flight`). It is
/// consistent for every transfer whose end the caller has seen (`kvstage_transfer` returned, or
/// `kvstage_op_wait` or the completion callback reported it).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct kvstage_session_stats {
    pub struct_size: usize,
    /// The transport the session's chunks use: `KVSTAGE_TRANSPORT_TCP`, `_RDMA` or `_SHM`.
    pub transport: i32,
    /// 1 when the engine's transport is AUTO and a faster path failed for this session (counted
    /// in `kvstage_engine_stats.shm_downgrades` or `rdma_downgrades`), else 0.
    pub downgraded: u32,
    /// Payload bytes written completely to the receiver (staged: this writer's share of each
    /// chunk; slice path: the slice payloads).
    pub bytes_sent: u64,
    /// Chunks whose bytes were written completely (acknowledged or not).
    pub chunks_sent: u64,
    /// Transfers the receiver acknowledged (`KVSTAGE_OK`).
    pub transfers_ok: u64,
    /// Transfers answered `KVSTAGE_FALLBACK` (nothing allocated or sent).
    pub transfers_fallback: u64,
    /// Transfers that failed (any error) = the four counters below together.
    pub transfers_failed: u64,
    /// Failed with `KVSTAGE_E_TIMEOUT`.
    pub transfers_timeout: u64,
    /// Failed with `KVSTAGE_E_CANCELED` (the operation canceled, the session or engine freed, a
    /// sender aborted the chunk) or `KVSTAGE_E_STALE_ROOM` (the receiver released the room or does
    /// not have that opening open).
    pub transfers_canceled: u64,
    /// Failed with `KVSTAGE_E_PEER_GONE`.
    pub transfers_peer_gone: u64,
    /// Failed with any other error code.
    pub transfers_failed_other: u64,
    /// Transfers in progress now: synchronous calls running and asynchronous operations queued or
    /// running.
    pub transfers_in_flight: u64,
    /// Transfers whose timings are in `timings_sum` (every ended transfer).
    pub timed_transfers: u64,
    /// Phase timings summed over the ended transfers (divide by `timed_transfers` for means).
    pub timings_sum: kvstage_transfer_timings,
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

/// Fills `out` (set `out->struct_size` first, to `sizeof(kvstage_session_stats)`) with the
/// session's counters; a smaller, older `struct_size` gets the fields it holds.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_stats_get(session: *const kvstage_session, out: *mut kvstage_session_stats) -> Status {
    ffi_fn!(status {
        let session = unsafe { super::transfer::session(session) }?;
        let out = out_ptr(out, "out")?;
        let s = session.stats();
        let f = send_fields(&s.send);
        use super::engine::kvstage_transport as T;
        let transport = match s.link {
            LinkKind::Tcp => T::KVSTAGE_TRANSPORT_TCP,
            LinkKind::Rdma => T::KVSTAGE_TRANSPORT_RDMA,
            LinkKind::Shm => T::KVSTAGE_TRANSPORT_SHM,
        };
        let stats = kvstage_session_stats {
            struct_size: std::mem::size_of::<kvstage_session_stats>(),
            transport: transport as i32,
            downgraded: s.downgraded as u32,
            bytes_sent: f.bytes_sent,
            chunks_sent: f.chunks_sent,
            transfers_ok: f.transfers_ok,
            transfers_fallback: f.transfers_fallback,
            transfers_failed: f.transfers_failed,
            transfers_timeout: f.transfers_timeout,
            transfers_canceled: f.transfers_canceled,
            transfers_peer_gone: f.transfers_peer_gone,
            transfers_failed_other: f.transfers_failed_other,
            transfers_in_flight: f.transfers_in_flight,
            timed_transfers: f.timed_transfers,
            timings_sum: f.timings_sum,
        };
        unsafe { write_versioned(out, stats, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Fills `out` (set `out->struct_size` first) with the phase timings of a finished asynchronous
/// operation and returns `KVSTAGE_OK`; while it runs, returns `KVSTAGE_PENDING` and leaves `out`
/// as it is. The same timings come with the operation's completion (`kvstage_completion.timings`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_timings_get(op: *const kvstage_op, out: *mut kvstage_transfer_timings) -> Status {
    ffi_fn!(status {
        let op = unsafe { super::transfer::op(op) }?;
        let out = out_ptr(out, "out")?;
        match op.timings() {
            None => Ok(Status::KVSTAGE_PENDING),
            Some(t) => {
                unsafe { write_versioned(out, timings_to_c(&t), "out") }?;
                Ok(Status::KVSTAGE_OK)
            }
        }
    })
}

thread_local! {
    /// Timings of this thread's last synchronous transfer.
    static LAST: Cell<TransferTimings> = const { Cell::new(TransferTimings::ZERO) };
}

/// Records the timings of this thread's synchronous transfer (zeros: it did not start).
pub(crate) fn set_last(t: TransferTimings) {
    LAST.with(|c| c.set(t));
}

/// Fills `out` (set `out->struct_size` first) with the phase timings of the last synchronous
/// transfer (`kvstage_transfer` or `kvstage_transfer_slices`) this thread called, whatever its
/// result; zeros before the first one and after one that failed before it started (a bad
/// argument). Other kvstage calls leave them as they are.
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_timings_last(out: *mut kvstage_transfer_timings) -> Status {
    ffi_fn!(status {
        let out = out_ptr(out, "out")?;
        let t = LAST.with(|c| c.get());
        unsafe { write_versioned(out, timings_to_c(&t), "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}
