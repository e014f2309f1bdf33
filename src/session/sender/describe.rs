//! The prefill side of `kvstage_engine_describe` and `kvstage_op_describe`: what a session and an
//! operation are doing, as data.

use std::time::Instant;

use serde::Serialize;

use super::SenderSession;
use crate::error::Status;
use crate::session::op::Op;

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct RunningChunkRef {
    pub room: u64,
    pub chunk: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SessionDescription {
    pub session: String,
    pub peer: String,
    /// The transport it runs on, and through what (as the `transport` of `kvstage_engine_describe`).
    pub transport: String,
    /// A faster transport was allowed but failed for it (it runs on a slower one).
    pub downgraded: bool,
    pub bytes_sent: u64,
    pub chunks_sent: u64,
    pub transfers_in_flight: u64,
    /// The chunks its transfers are sending now, by room id.
    pub running: Vec<RunningChunkRef>,
    /// Why the session is unusable, once it is.
    pub dead: Option<String>,
}

/// An operation (`kvstage_op_describe`).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct OpDescription {
    pub version: u32,
    /// The request's trace id (the caller's, or derived from the room's opening).
    pub trace: String,
    pub session: String,
    pub room: u64,
    pub chunk: u32,
    /// `staged` or `slices`.
    pub path: &'static str,
    pub phase: &'static str,
    /// What the phase waits on, in words ("" while it works itself).
    pub waits_on: String,
    pub in_phase_ms: u64,
    /// Milliseconds to its deadline (0 once passed), null without one; null once it ended.
    pub deadline_left_ms: Option<u64>,
    /// `KVSTAGE_PENDING` while it runs, then its status.
    pub status: &'static str,
    /// The error once it failed.
    pub error: Option<String>,
}

impl SenderSession {
    pub fn describe(&self) -> SessionDescription {
        let stats = self.stats();
        let mut running: Vec<RunningChunkRef> = self.running.lock().iter().map(|(room, chunk)| RunningChunkRef { room: room.id, chunk: *chunk }).collect();
        running.sort_unstable_by_key(|r| (r.room, r.chunk));
        SessionDescription {
            session: self.id.clone(),
            peer: self.peer.to_string(),
            transport: self.link.describe(),
            downgraded: stats.downgraded,
            bytes_sent: stats.send.bytes_sent,
            chunks_sent: stats.send.chunks_sent,
            transfers_in_flight: stats.send.in_flight,
            running,
            dead: self.shared.state.lock().dead.as_ref().map(|(code, why)| format!("{}: {why}", code.name())),
        }
    }
}

/// `op` as it stands, `None` before its transfer started.
pub fn describe_op(op: &Op) -> Option<OpDescription> {
    let (p, result) = op.progress()?;
    let now = Instant::now();
    let running = result.is_none();
    let (status, error) = match result {
        None => (Status::KVSTAGE_PENDING.name(), None),
        Some(Ok(s)) => (s.name(), None),
        Some(Err(e)) => (e.code().name(), Some(e.chain())),
    };
    Some(OpDescription {
        version: crate::session::DESCRIBE_VERSION,
        trace: p.trace,
        session: p.session,
        room: p.room,
        chunk: p.chunk,
        path: p.path,
        phase: p.phase,
        waits_on: p.waits_on,
        in_phase_ms: now.saturating_duration_since(p.since).as_millis() as u64,
        deadline_left_ms: p.deadline.filter(|_| running).map(|d| d.saturating_duration_since(now).as_millis() as u64),
        status,
        error,
    })
}
