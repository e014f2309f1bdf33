//! Per-peer state machines: the sender side (prefill: allocate, gather, write) and the receiver
//! side (decode: grant, receive, count writers, scatter, free), plus deadlines and operations.

pub mod notify;
pub mod op;
pub mod receiver;
pub mod sender;
pub mod staging;
pub mod workers;

pub use crate::deadline::Deadline;
use crate::error::{Error, Status};
use crate::geometry::{self, HeadSlice, PoolShape};

/// When chunks carry a checksum (xxh3-64 of the writer's staged bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Integrity {
    Off,
    /// One chunk in [`INTEGRITY_SAMPLE_PERIOD`], chosen by (room, chunk): catches systematic
    /// corruption at a small fraction of the cost.
    Sampled,
    Always,
}

pub const INTEGRITY_SAMPLE_PERIOD: u64 = 16;

impl Integrity {
    /// The policy's code in the hello (0 off, 1 sampled, 2 always); unknown codes read as always.
    pub fn wire(self) -> u8 {
        match self {
            Integrity::Off => 0,
            Integrity::Sampled => 1,
            Integrity::Always => 2,
        }
    }

    pub fn from_wire(code: u8) -> Integrity {
        match code {
            0 => Integrity::Off,
            1 => Integrity::Sampled,
            _ => Integrity::Always,
        }
    }

    /// The stronger of two policies (each side may demand more checking, never less).
    pub fn stronger(self, other: Integrity) -> Integrity {
        Integrity::from_wire(self.wire().max(other.wire()))
    }

    pub fn covers(self, room: u64, chunk: u32) -> bool {
        match self {
            Integrity::Off => false,
            Integrity::Always => true,
            Integrity::Sampled => (room.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ chunk as u64) % INTEGRITY_SAMPLE_PERIOD == 0,
        }
    }
}

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
