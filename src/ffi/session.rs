//! The prefill side's sessions: connect, counters, and the decode room's grid asked over one.

use std::ffi::c_char;

use super::args::{out_arg, out_ptr, str_arg, timeout, write_versioned};
use super::ffi_fn;
use super::handle::{self, kvstage_engine, kvstage_session, Handle};
use super::room::{kvstage_room_grid, room_ref};
use super::timings::{kvstage_transfer_timings, send_fields};
use crate::error::Status;
use crate::session::stats::LinkKind;

/// Connects to the decode engine at `peer_address` ("127.0.0.1:5000") and runs the handshake
/// (versions, geometry fingerprints, pairing). A geometry disagreement fails with
/// `KVSTAGE_E_GEOMETRY_MISMATCH`, every differing field listed in the error's causes.
/// `timeout_ms` 0 = the engine default; a receiver at its connection limits is asked again, backing
/// off, until then. Writes `*out` only on success.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_connect(
    engine: *const kvstage_engine,
    peer_address: *const c_char,
    session_id: *const c_char,
    timeout_ms: u64,
    out: *mut *mut kvstage_session,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let addr = unsafe { str_arg(peer_address, "peer_address") }?;
        let id = unsafe { str_arg(session_id, "session_id") }?;
        let out = out_arg(out, "out")?;
        // A connect takes a bound: a century is none.
        let bound = timeout(timeout_ms, engine.default_timeout()).unwrap_or(std::time::Duration::from_secs(100 * 365 * 24 * 3600));
        let session = engine.connect(addr, id, Some(bound))?;
        *out = Handle::into_raw(session)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Closes a session. Operations still running, and calls in flight on other threads, keep it
/// alive until they end; this returns at once. NULL is a no-op. Later calls with the pointer fail
/// with `KVSTAGE_E_INVALID_ARG`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_free(session: *mut kvstage_session) {
    ffi_fn!(value = (), { Handle::free(session, "session") })
}

/// Asks the decode rank of `session` for the grid of the room opening (`room`, `key`): what
/// `kvstage_room_open` answered there (`key`, `chunk_tokens`, `num_chunks`, `num_pages`,
/// `page_size` of the decode pool, `prefix_tokens`), so a prefill engine cuts its transfers on the
/// decode side's grid (`kvstage_chunk_span_compute` takes it) instead of guessing it. One round
/// trip; `timeout_ms` 0 = the engine default. Errors: the room is not open there under that key
/// (`KVSTAGE_E_STALE_ROOM`: released, or another opening), it failed there (its error), the
/// session is gone, the timeout passed. Set `out->struct_size` first; filled only on success.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_room_grid_get(
    session: *const kvstage_session,
    room: u64,
    key: u64,
    timeout_ms: u64,
    out: *mut kvstage_room_grid,
) -> Status {
    ffi_fn!(status {
        let session = unsafe { handle::session(session) }?;
        let out = out_ptr(out, "out")?;
        let at = room_ref(room, key, "key")?;
        let grid = session.room_grid(at, timeout(timeout_ms, session.default_timeout()))?;
        unsafe { write_versioned(out, kvstage_room_grid::from_grid(key, &grid), "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
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
    /// 0 while the session's connection is up; once it is not, the status that ended it
    /// (`KVSTAGE_E_PEER_GONE`: the peer closed, vanished or reset it, or this side cut it: a write
    /// failed midway, or a chunk's deadline passed with its bytes still unacknowledged in the
    /// stream; `KVSTAGE_E_PROTOCOL`: a malformed frame; `KVSTAGE_E_CANCELED`: its engine shut
    /// down; `KVSTAGE_E_PANIC`: its reader thread panicked). Every later call on it fails: free it
    /// and connect again. Check it after a transfer fails with any status.
    pub dead_status: i32,
}

/// Fills `out` (set `out->struct_size` first, to `sizeof(kvstage_session_stats)`) with the
/// session's counters; a smaller, older `struct_size` gets the fields it holds.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_stats_get(session: *const kvstage_session, out: *mut kvstage_session_stats) -> Status {
    ffi_fn!(status {
        let session = unsafe { handle::session(session) }?;
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
            dead_status: s.dead.map_or(0, |code| code.code()),
        };
        unsafe { write_versioned(out, stats, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

