//! An engine's counters in one snapshot (`kvstage_engine_stats`).

use super::Engine;
use crate::ring::Watermark;
use crate::session::stats::{ReceiveStats, SendStats};

/// A snapshot of an engine's counters: its receiver (ring, listener, chunks received), its RDMA
/// and same-host sides and every transfer its sender sessions ran (those already freed included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Size of the registered staging ring in bytes (0 = none).
    pub ring_capacity: u64,
    /// Allocations currently live in the ring.
    pub ring_live_allocations: u64,
    pub watermark: Watermark,
    pub rdma_downgrades: u64,
    pub rdma_sessions: u64,
    pub shm_sessions: u64,
    pub shm_downgrades: u64,
    pub shm_direct_sessions: u64,
    pub shm_direct_chunks: u64,
    /// RDMA sessions of CUDA pools staging in host memory (GPUDirect unavailable).
    pub rdma_host_staging_sessions: u64,
    /// Sender connections accepted and past their handshake, now.
    pub connections: u64,
    pub accept_errors: u64,
    pub connections_refused: u64,
    pub handshakes_failed: u64,
    pub events_dropped: u64,
    pub rooms_expired: u64,
    pub thread_panics: u64,
    /// Current span of the ring held by live allocations, in bytes.
    pub ring_used_bytes: u64,
    /// Sender side: every session of this engine together.
    pub send: SendStats,
    /// Receiver side: bytes and chunks received, scatter times, the ring's high-water mark.
    pub receive: ReceiveStats,
}

impl Engine {
    /// The engine's counters now.
    pub fn stats(&self) -> EngineStats {
        let r = self.receiver.stats();
        EngineStats {
            ring_capacity: r.ring_capacity,
            ring_live_allocations: r.ring_live,
            watermark: r.watermark,
            rdma_downgrades: self.rdma.downgrades(),
            rdma_sessions: self.rdma.sessions(),
            shm_sessions: self.shm.sessions(),
            shm_downgrades: self.shm.downgrades(),
            shm_direct_sessions: self.shm.direct_sessions(),
            shm_direct_chunks: self.shm.direct_chunks(),
            rdma_host_staging_sessions: self.rdma.host_bounces().0,
            connections: r.connections,
            accept_errors: r.accept_errors,
            connections_refused: r.connections_refused,
            handshakes_failed: r.handshakes_failed,
            events_dropped: r.events_dropped,
            rooms_expired: r.rooms_expired,
            thread_panics: r.panics,
            ring_used_bytes: r.ring_used,
            send: self.send.counters.snapshot(),
            receive: r.metrics,
        }
    }
}
