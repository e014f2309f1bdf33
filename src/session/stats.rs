//! Transfer metrics: per-transfer phase timings and the sender counters kept per session and per
//! engine (lock-free: relaxed atomics, a handful per transfer).
//!
//! Every sender counter is kept twice, once in the session and once in the engine's
//! [`SendResources`](super::sender::SendResources), so engine totals survive the sessions that made
//! them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Result, Status};

/// Where one transfer (one chunk) spent its time, in nanoseconds; a phase that did not happen is 0.
/// The phases run one after the other in this order: `queued`, `watermark_wait`, `alloc_wait`,
/// `gather`, `wire`, `ack`; `total` spans the whole transfer (queueing and planning included), so it
/// is at least their sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferTimings {
    /// Asynchronous transfers: from `transfer_async` to a transfer worker taking it up.
    pub queued_ns: u64,
    /// The allocation request's round trip to the receiver (the grant), plus waiting until the
    /// receiver's watermark lets the granted range be written (back-pressure of its ring).
    pub watermark_wait_ns: u64,
    /// Waiting for a send staging buffer of the engine's pool (and allocating it when new); 0
    /// over TCP from a host pool (no buffer).
    pub alloc_wait_ns: u64,
    /// Gathering the chunk's KV pages into the staging buffer (the CUDA wait for the producer's
    /// ready point included), plus the integrity checksum when the chunk carries one; written in
    /// pieces, the time the write waited for a piece's gather; over TCP from a host pool, the
    /// request's parts and the checksum only.
    pub gather_ns: u64,
    /// The bulk write of the gathered bytes and its ready frame (slice path: every slice write).
    pub wire_ns: u64,
    /// From the end of the write to the receiver's acknowledgement of the arrival.
    pub ack_ns: u64,
    /// The whole transfer, from the call (asynchronous: the submission) to its result.
    pub total_ns: u64,
}

impl TransferTimings {
    pub const ZERO: TransferTimings =
        TransferTimings { queued_ns: 0, watermark_wait_ns: 0, alloc_wait_ns: 0, gather_ns: 0, wire_ns: 0, ack_ns: 0, total_ns: 0 };

    /// The phases together (`total_ns` excluded).
    pub fn phases_ns(&self) -> u64 {
        [self.queued_ns, self.watermark_wait_ns, self.alloc_wait_ns, self.gather_ns, self.wire_ns, self.ack_ns]
            .into_iter()
            .fold(0, u64::saturating_add)
    }

    /// Sets `total_ns` from the transfer's start, at least the sum of the phases (each phase is
    /// rounded up to 1 ns, so a measured total could fall short of them by a few).
    pub(crate) fn finish_total(&mut self, started: Instant) {
        self.total_ns = since(started).max(self.phases_ns());
    }
}

pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds since `t`, at least 1 (a phase that happened is never reported as 0).
pub(crate) fn since(t: Instant) -> u64 {
    nanos(t.elapsed()).max(1)
}

/// Cumulative sender counters (one set per session, one per engine).
#[derive(Debug, Default)]
pub struct SendCounters {
    bytes_sent: AtomicU64,
    chunks_sent: AtomicU64,
    ok: AtomicU64,
    fallback: AtomicU64,
    timeout: AtomicU64,
    canceled: AtomicU64,
    peer_gone: AtomicU64,
    other: AtomicU64,
    in_flight: AtomicU64,
    timed: AtomicU64,
    queued_ns: AtomicU64,
    watermark_wait_ns: AtomicU64,
    alloc_wait_ns: AtomicU64,
    gather_ns: AtomicU64,
    wire_ns: AtomicU64,
    ack_ns: AtomicU64,
    total_ns: AtomicU64,
}

/// A snapshot of [`SendCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Payload bytes written completely to the wire (staged: a writer's region; slices: payloads).
    pub bytes_sent: u64,
    /// Chunks whose bytes were written completely (acknowledged or not).
    pub chunks_sent: u64,
    /// Transfers the receiver acknowledged (`KVSTAGE_OK`).
    pub transfers_ok: u64,
    /// Transfers answered `KVSTAGE_FALLBACK` (nothing was allocated or sent).
    pub transfers_fallback: u64,
    /// Failed transfers, by code: `KVSTAGE_E_TIMEOUT`, `KVSTAGE_E_CANCELED` (with
    /// `KVSTAGE_E_STALE_ROOM`), `KVSTAGE_E_PEER_GONE` and every other error.
    pub transfers_timeout: u64,
    pub transfers_canceled: u64,
    pub transfers_peer_gone: u64,
    pub transfers_failed_other: u64,
    /// Transfers running or queued now (synchronous and asynchronous).
    pub in_flight: u64,
    /// Transfers whose timings are summed below (every finished transfer).
    pub timed_transfers: u64,
    /// Sums of [`TransferTimings`] over the finished transfers.
    pub sum: TransferTimings,
}

impl SendStats {
    /// Every failed transfer (the error counters together).
    pub fn transfers_failed(&self) -> u64 {
        self.transfers_timeout + self.transfers_canceled + self.transfers_peer_gone + self.transfers_failed_other
    }
}

impl SendCounters {
    pub fn snapshot(&self) -> SendStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SendStats {
            bytes_sent: g(&self.bytes_sent),
            chunks_sent: g(&self.chunks_sent),
            transfers_ok: g(&self.ok),
            transfers_fallback: g(&self.fallback),
            transfers_timeout: g(&self.timeout),
            transfers_canceled: g(&self.canceled),
            transfers_peer_gone: g(&self.peer_gone),
            transfers_failed_other: g(&self.other),
            in_flight: g(&self.in_flight),
            timed_transfers: g(&self.timed),
            sum: TransferTimings {
                queued_ns: g(&self.queued_ns),
                watermark_wait_ns: g(&self.watermark_wait_ns),
                alloc_wait_ns: g(&self.alloc_wait_ns),
                gather_ns: g(&self.gather_ns),
                wire_ns: g(&self.wire_ns),
                ack_ns: g(&self.ack_ns),
                total_ns: g(&self.total_ns),
            },
        }
    }
}

/// The counters one transfer updates: its session's and its engine's.
#[derive(Clone)]
pub struct SendMetrics {
    pub session: Arc<SendCounters>,
    pub engine: Arc<SendCounters>,
}

impl SendMetrics {
    fn each(&self, f: impl Fn(&SendCounters)) {
        f(&self.session);
        f(&self.engine);
    }

    /// A chunk's `bytes` were written completely.
    pub fn sent(&self, bytes: u64) {
        self.each(|c| {
            c.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            c.chunks_sent.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// A transfer starts (or is queued): in flight until the guard drops.
    pub fn start(&self) -> InFlight {
        self.each(|c| {
            c.in_flight.fetch_add(1, Ordering::Relaxed);
        });
        InFlight(self.clone())
    }

    /// A transfer ended with `result` after `t`.
    pub fn finished(&self, result: &Result<Status>, t: &TransferTimings) {
        self.each(|c| {
            let counter = match result {
                Ok(Status::KVSTAGE_FALLBACK) => &c.fallback,
                Ok(_) => &c.ok,
                Err(e) => match e.code() {
                    Status::KVSTAGE_E_TIMEOUT => &c.timeout,
                    // The request is gone either way: canceled here, or its room released there.
                    Status::KVSTAGE_E_CANCELED | Status::KVSTAGE_E_STALE_ROOM => &c.canceled,
                    Status::KVSTAGE_E_PEER_GONE => &c.peer_gone,
                    _ => &c.other,
                },
            };
            counter.fetch_add(1, Ordering::Relaxed);
            c.timed.fetch_add(1, Ordering::Relaxed);
            for (sum, v) in [
                (&c.queued_ns, t.queued_ns),
                (&c.watermark_wait_ns, t.watermark_wait_ns),
                (&c.alloc_wait_ns, t.alloc_wait_ns),
                (&c.gather_ns, t.gather_ns),
                (&c.wire_ns, t.wire_ns),
                (&c.ack_ns, t.ack_ns),
                (&c.total_ns, t.total_ns),
            ] {
                if v > 0 {
                    sum.fetch_add(v, Ordering::Relaxed);
                }
            }
        });
    }
}

/// Counts a transfer in flight while alive.
pub struct InFlight(SendMetrics);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.each(|c| {
            c.in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// How a session's chunks move.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinkKind {
    #[default]
    Tcp,
    Rdma,
    /// Written in place through a same-host mapping of the receiver's ring.
    Shm,
}

/// A sender session's counters and the transport it runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub send: SendStats,
    pub link: LinkKind,
    /// A faster path was allowed (transport auto) but failed for this session, which runs on a
    /// slower one (counted in the engine's downgrade counters).
    pub downgraded: bool,
    /// Why the session is dead (its connection gone, reset or closed), `None` while it is not.
    pub dead: Option<Status>,
}

/// Receiver metrics (kept in the receiver's state, under its lock, updated once per chunk).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiveStats {
    /// Payload bytes that arrived for chunks: staged writer regions counted when complete (their
    /// ready frame accepted), slice payloads when landed.
    pub bytes_received: u64,
    /// Chunks scattered into the KV pool (staged) or completed by the slice path, status OK.
    pub chunks_received: u64,
    /// Staged chunks timed from arrival to scatter done (those counted in `chunks_received`).
    pub scatter_count: u64,
    /// Sum and largest of those times, in nanoseconds: from the chunk's last writer's ready frame
    /// (every payload byte in the ring) to the end of its scatter (checksum, acknowledgement, the
    /// scatter queue and the scatter itself).
    pub scatter_ns_sum: u64,
    pub scatter_ns_max: u64,
    /// The largest span of the staging ring ever held by live allocations (bytes from the oldest
    /// live allocation to the end of the newest, wrap-around included; at most the ring's size),
    /// since the current ring was registered (a new ring starts it again from 0).
    pub ring_high_water: u64,
    /// Writer regions whose payload was read from the stream straight into the KV pool (no
    /// ring copy, no scatter), counted when they arrived.
    pub regions_read_into_pool: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn the_total_is_at_least_the_sum_of_the_phases() {
        // Phases rounded up to 1 ns each can add up to more than a measured total.
        let mut t = TransferTimings { watermark_wait_ns: 1 << 40, ack_ns: 1 << 40, ..Default::default() };
        t.finish_total(Instant::now());
        assert_eq!(t.total_ns, 2 << 40);
        assert_eq!(t.phases_ns(), t.total_ns);
    }

    #[test]
    fn results_are_counted_by_code_in_both_sets() {
        let m = SendMetrics { session: Arc::default(), engine: Arc::default() };
        let g = m.start();
        assert_eq!(m.session.snapshot().in_flight, 1);
        let t = TransferTimings { wire_ns: 5, ack_ns: 7, total_ns: 20, ..Default::default() };
        m.sent(100);
        m.finished(&Ok(Status::KVSTAGE_OK), &t);
        m.finished(&Ok(Status::KVSTAGE_FALLBACK), &TransferTimings::default());
        m.finished(&Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "t")), &t);
        m.finished(&Err(Error::new(Status::KVSTAGE_E_PROTOCOL, "p")), &t);
        drop(g);
        for s in [m.session.snapshot(), m.engine.snapshot()] {
            assert_eq!((s.bytes_sent, s.chunks_sent, s.transfers_ok, s.transfers_fallback), (100, 1, 1, 1));
            assert_eq!((s.transfers_timeout, s.transfers_failed_other, s.transfers_failed()), (1, 1, 2));
            assert_eq!((s.in_flight, s.timed_transfers, s.sum.wire_ns, s.sum.total_ns), (0, 4, 15, 60));
        }
    }
}
