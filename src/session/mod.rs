//! Per-peer state machines: the sender side (prefill: allocate, gather, write) and the receiver
//! side (decode: grant, receive, count writers, scatter, free), plus deadlines and operations.

mod device_ring;
mod integrity;
pub mod layers;
pub mod notify;
pub mod op;
pub mod receiver;
pub mod sender;
pub mod staging;
pub mod stats;
mod wake;
pub mod workers;

pub use crate::deadline::Deadline;

/// A room opening's chunk grid: what the decode side's `open_room` answers, and the prefill side
/// asks over a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomGrid {
    /// Tokens of every chunk but possibly the last.
    pub chunk_tokens: u32,
    pub num_chunks: u32,
    /// Pages of the room (its tokens are `num_pages · page_size`).
    pub num_pages: u32,
    /// Token slots per decode page.
    pub page_size: u32,
    /// Tokens the decode rank already held in front of the room's pages.
    pub prefix_tokens: u64,
}
pub use integrity::{checksum, checksum_parts, rows_checksum, Integrity, INTEGRITY_SAMPLE_PERIOD};
use crate::error::{Error, Status};
use crate::geometry::{self, HeadSlice, PoolShape};

/// How a (prefill rank, decode rank) pair exchanges data; fixed for the life of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// The prefill rank's TP writer (head group) among the decode rank's; `None` when another
    /// prefill rank holding the same heads sends them (prefill-side GQA replication): the session
    /// exists, its transfers have nothing to send.
    pub writer: Option<u32>,
    /// Head groups of the decode rank (one prefill writer each per layer of a chunk).
    pub tp_writers: u32,
    /// Heads it carries (source heads for the gather, destination heads for the scatter).
    pub heads: HeadSlice,
}

impl Pairing {
    /// The TP writer, or the protocol error a receiver replies to a rank that sends nothing.
    pub fn writer(&self) -> crate::Result<u32> {
        self.writer.ok_or_else(|| {
            Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                "this prefill rank is not a writer here: another rank holding the same heads sends them",
            )
        })
    }

    /// The writer id its frames name: its head group, or [`geometry::TAIL_ONLY`] for a replica
    /// (which writes only a region of request parts, its state shares, in a room's last chunk).
    pub fn frame_writer(&self) -> u32 {
        self.writer.unwrap_or(geometry::TAIL_ONLY)
    }

    /// "head group 1 of 2", or "no writer (its heads are sent by another prefill rank) of 2".
    pub fn describe(&self) -> String {
        match self.writer {
            Some(w) => format!("head group {w} of {}", self.tp_writers),
            None => format!("no writer (its heads are sent by another prefill rank) of {} head groups", self.tp_writers),
        }
    }
}

/// Layout version of the describe documents (`kvstage_room_describe`, `kvstage_op_describe`,
/// `kvstage_engine_describe`; README "Troubleshooting"): raised when a field changes meaning or
/// goes away (fields may be added without it).
pub const DESCRIBE_VERSION: u32 = 1;

/// The pairing of prefill rank `src` with decode rank `dst`; an error when that prefill rank does
/// not feed that decode rank at all (another TP group, or a stage holding none of its layers).
pub fn pairing(src: &PoolShape, dst: &PoolShape) -> crate::Result<Pairing> {
    let layout = geometry::staging_layout(src, dst, src.page_size)?;
    if let Some(region) = layout.region_of(src)? {
        return Ok(Pairing { writer: Some(region.tp_writer), tp_writers: layout.tp_writers(), heads: region.heads });
    }
    // Paired by TP and PP, but a replica: the first rank of its head group sends.
    let shares_layers = src.layer_ids.iter().any(|id| dst.layer_ids.binary_search(id).is_ok());
    let tp_paired = src.kind == geometry::ModelKind::Mha
        && geometry::prefill_ranks_for_decode(dst.tp_rank, src.tp_size, dst.tp_size)?.contains(&src.tp_rank);
    if shares_layers && tp_paired {
        let heads = geometry::head_slice(src.tp_size, dst.tp_size, src.tp_rank, dst.tp_rank, dst.global_heads)?;
        return Ok(Pairing { writer: None, tp_writers: layout.tp_writers(), heads });
    }
    Err(Error::new(
        Status::KVSTAGE_E_GEOMETRY_MISMATCH,
        format!(
            "prefill rank (tp {}/{}, pp {}/{}) does not feed decode rank (tp {}/{}, pp {}/{})",
            src.tp_rank, src.tp_size, src.pp_rank, src.pp_size, dst.tp_rank, dst.tp_size, dst.pp_rank, dst.pp_size
        ),
    ))
}

/// Checks the two sides' components at the handshake (`ours` registered here, `theirs` in the
/// peer's hello): the same components, field by field (`KVSTAGE_E_GEOMETRY_MISMATCH` listing every
/// differing field; layer ids only when neither side has pipeline stages), and a decode rank's
/// state held by the prefill ranks that send it KV (`KVSTAGE_E_UNSUPPORTED`).
pub fn check_components(src: &PoolShape, dst: &PoolShape, ours: &[geometry::ComponentSpec], theirs: &[geometry::ComponentSpec]) -> crate::Result<()> {
    let list = geometry::parts::component_mismatches(ours, theirs, src.pp_size == 1 && dst.pp_size == 1);
    if !list.is_empty() {
        return Err(geometry::mismatch_error("request parts: the two sides registered different components", list));
    }
    if !ours.is_empty() {
        geometry::parts::check_state_carried(ours, &geometry::staging_layout(src, dst, 1)?)?;
    }
    Ok(())
}

/// Rate sense for records a peer (or a port scanner) can cause at will: the first record goes
/// out, then at most one per `period`; the ones held back in between are counted and the next
/// record says how many.
pub struct LogLimiter {
    period: std::time::Duration,
    /// When the last record went out, and how many were held back since.
    state: parking_lot::Mutex<(Option<std::time::Instant>, u64)>,
}

impl LogLimiter {
    pub const fn new(period: std::time::Duration) -> LogLimiter {
        LogLimiter { period, state: parking_lot::Mutex::new((None, 0)) }
    }

    /// `Some(held back since the last record)` when a record may go out at `now`, else `None`
    /// (counted).
    pub fn allow_at(&self, now: std::time::Instant) -> Option<u64> {
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < self.period => {
                s.1 += 1;
                None
            }
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }

    /// As [`allow_at`](Self::allow_at) now, as a suffix for the message: "" or
    /// " (N similar records suppressed)".
    pub fn allow(&self) -> Option<String> {
        self.allow_at(std::time::Instant::now())
            .map(|n| if n == 0 { String::new() } else { format!(" ({n} similar records suppressed)") })
    }
}

/// Compares cluster tokens in time independent of where they differ.
pub fn tokens_match(expected: &[u8], presented: &[u8]) -> bool {
    let mut diff = (expected.len() != presented.len()) as u8;
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ presented.get(i).copied().unwrap_or(!e);
    }
    diff == 0
}

#[cfg(test)]
mod log_limiter_tests {
    use super::LogLimiter;
    use std::time::{Duration, Instant};

    #[test]
    fn the_first_record_goes_out_then_one_per_period_counting_the_rest() {
        let l = LogLimiter::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(l.allow_at(t), Some(0));
        assert_eq!(l.allow_at(t + Duration::from_secs(1)), None);
        assert_eq!(l.allow_at(t + Duration::from_secs(9)), None);
        assert_eq!(l.allow_at(t + Duration::from_secs(10)), Some(2));
        assert_eq!(l.allow_at(t + Duration::from_secs(11)), None);
        assert_eq!(l.allow_at(t + Duration::from_secs(25)), Some(1));
        assert_eq!(l.allow_at(t + Duration::from_secs(40)), Some(0));
        assert_eq!(LogLimiter::new(Duration::from_secs(10)).allow().as_deref(), Some(""));
    }
}
