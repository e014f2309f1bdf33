//! Integrity checks of staged chunks, one definition for both sides: which chunks carry a
//! checksum (the policy each side states in its hello), and the checksum itself.

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
            Integrity::Sampled => (room.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ chunk as u64).is_multiple_of(INTEGRITY_SAMPLE_PERIOD),
        }
    }
}

/// The integrity checksum of a writer's staged bytes (xxh3-64): the sender computes it over the
/// region it gathered, the receiver over the region that landed in its ring.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// [`checksum`] of the concatenation of `parts` (a region's rows where they lie in a pool).
pub fn checksum_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut sum = xxhash_rust::xxh3::Xxh3::new();
    for part in parts {
        sum.update(part);
    }
    sum.digest()
}

/// [`checksum`] of a plan's pool rows in region order, where direct mode wrote (or reads) them: in
/// place in a host pool, gathered to the host from a device pool through `copy` (one device→host
/// read, as a device ring's check reads its region back).
///
/// # Safety
/// `plan` was checked against `pool` ([`crate::copy::check_plan`]); nobody writes its rows while
/// this reads them.
pub unsafe fn rows_checksum(copy: &dyn crate::copy::CopyEngine, plan: &crate::geometry::CopyPlan, pool: &crate::geometry::KvLayout) -> crate::Result<u64> {
    if pool.memory == crate::geometry::MemoryKind::Host {
        // SAFETY: the caller's contract, for host memory.
        return Ok(checksum_parts(unsafe { crate::copy::rows::pool_rows(plan, pool) }));
    }
    let mut region = vec![0u8; plan.staging_bytes as usize];
    // SAFETY: the caller's contract; `region` holds the plan's staging bytes.
    unsafe { copy.gather(plan, pool, region.as_mut_ptr()) }?;
    Ok(checksum(&region))
}
