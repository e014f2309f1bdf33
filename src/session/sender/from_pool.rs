//! A whole chunk over a stream transport straight from a host pool: the region's KV bytes are the
//! plan's pool rows in region order, handed to the link as vectored writes (TCP copies them into
//! the socket itself), so no staging copy is made and no staging buffer is held. The request's
//! parts, small, are gathered into a buffer of their own and follow the rows. The receiver sees
//! the same frames as from a staging buffer.

use super::staged::Placement;
use super::*;
use crate::copy::rows;
use crate::geometry::{CopyPlan, TailPart};

/// Shortest run of adjacent pool bytes a chunk is sent from the pool with (whole token-major pages
/// of 4 KiB or more: sglang's pool when the prefill rank's heads are the row).
pub const SEND_FROM_POOL_MIN_RUN: u64 = 4 << 10;

impl SenderSession {
    /// Whether `plan` goes out from the pool: allowed (`send_from_pool`), a host pool, a link
    /// that streams from memory, a plan whose slabs tile its KV bytes in region order, and pool
    /// rows in runs of at least [`SEND_FROM_POOL_MIN_RUN`] (a vectored write of head slices or of
    /// one head per piece costs the kernel more than a gather into staging first:
    /// `kvstage-bench --layout vllm-lbhnc`, and sglang P2→D4, `--no-send-from-pool` 1.3× faster).
    pub(super) fn writes_from_pool(&self, plan: &CopyPlan) -> bool {
        self.resources.options.send_from_pool
            && self.pool.memory == MemoryKind::Host
            && self.link.streams_from_memory()
            && rows::tiles_in_order(plan)
            && plan.min_pool_run() >= self.resources.options.faults.as_ref().and_then(|f| f.plan.send_from_pool_min_run).unwrap_or(SEND_FROM_POOL_MIN_RUN)
    }

    /// Writes the region of `place`: `plan`'s pool rows in pieces of `send_piece_bytes` (the
    /// session's stream is free between them), then `tail` gathered, then `ready`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_from_pool(
        &self,
        desc: &TransferDesc,
        (plan, tail): (&CopyPlan, &[TailPart]),
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        deadline: &Deadline,
        op: &Op,
        t: &mut TransferTimings,
    ) -> Result<()> {
        crate::copy::check_plan(plan, &self.pool)?;
        op.enter("gathering", String::new);
        let mut parts = vec![0u8; geometry::parts::tail_bytes(tail) as usize];
        self.gather_tail(desc, tail, parts.as_mut_ptr(), t)?;
        let checksum = self.region_checksum(desc, || {
            let phase = Instant::now();
            // SAFETY: the plan was checked against the host pool above.
            let sum = crate::session::checksum_parts(unsafe { rows::pool_rows(plan, &self.pool) }.chain([parts.as_slice()]));
            t.gather_ns += since(phase);
            Ok(sum)
        })?;
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = (|| {
            let piece_bytes = self.resources.options.send_piece_bytes;
            let pieces = if piece_bytes > 0 { plan.pieces_of(piece_bytes) } else { vec![plan.clone()] };
            for piece in &pieces {
                let Some(&(at, len)) = piece.staging_ranges().first() else { continue };
                // SAFETY: as above (a piece is the plan with some of its slabs); the pool's pages
                // stay the caller's to keep until the transfer ends.
                let mut rows = unsafe { rows::pool_rows(piece, &self.pool) };
                self.link.write_piece_from(&place.data(desc, at, len), &mut rows, deadline)?;
            }
            // A stream transport's ready needs no bytes (only RDMA's names its buffer).
            self.finish_region(desc, place, &parts, &[], &ready(checksum), deadline)
        })();
        t.wire_ns = since(phase);
        wrote
    }
}
