//! Per-peer state machines: the sender side (prefill: allocate, gather, write) and the receiver
//! side (decode: grant, receive, count writers, scatter, free), plus deadlines and operations.

pub mod op;
pub mod receiver;
pub mod sender;

pub use crate::deadline::Deadline;
use crate::error::{Error, Status};
use crate::geometry::{self, HeadSlice, PoolShape};

/// How a (prefill rank, decode rank) pair exchanges data; fixed for the life of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// The prefill rank's writer index in the decode rank's allocations.
    pub writer: u32,
    /// Writers expected per chunk.
    pub writers: u32,
    /// Heads it carries (source heads for the gather, destination heads for the scatter).
    pub heads: HeadSlice,
}

/// The pairing of prefill rank `src` with decode rank `dst`; an error when that prefill rank does
/// not feed that decode rank at all.
pub fn pairing(src: &PoolShape, dst: &PoolShape) -> crate::Result<Pairing> {
    let layout = geometry::staging_layout(src, dst, src.page_size)?;
    let writer = layout.writer_for(src)?.ok_or_else(|| {
        Error::new(
            Status::KVSTAGE_E_GEOMETRY_MISMATCH,
            format!(
                "prefill rank (tp {}/{}, pp {}/{}) does not feed decode rank (tp {}/{}, pp {}/{})",
                src.tp_rank, src.tp_size, src.pp_rank, src.pp_size, dst.tp_rank, dst.tp_size, dst.pp_rank, dst.pp_size
            ),
        )
    })?;
    Ok(Pairing { writer, writers: layout.writer_count(), heads: layout.writers[writer as usize].heads })
}

/// Compares cluster tokens in time independent of where they differ.
pub fn tokens_match(expected: &[u8], presented: &[u8]) -> bool {
    let mut diff = (expected.len() != presented.len()) as u8;
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ presented.get(i).copied().unwrap_or(!e);
    }
    diff == 0
}
