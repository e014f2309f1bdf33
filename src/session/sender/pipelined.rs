//! A whole chunk's staged write in pieces: while piece `k` goes out on the link, a helper thread
//! gathers piece `k + 1` into its own range of the staging buffer, so the gather hides behind the
//! wire instead of preceding it (and the receiver starts scattering the first layers while later
//! ones travel). The request's parts and the ready follow the last piece, bound to the pieces as
//! for a layer-wise write: the receiver completes the chunk exactly as for one write.

use std::sync::atomic::AtomicBool;

use super::staged::Placement;
use super::*;
use crate::geometry::{CopyPlan, TailPart};
use crate::session::staging::{StagingLease, StagingMemory};

/// The gather of one piece, as the helper reports it: its index, and how long it took.
type Gathered = (usize, Result<Duration>);

impl SenderSession {
    /// Whether a whole chunk's region gathered into `staging` goes out in pieces: host staging
    /// (the CPU gathers while the link writes) and at least two pieces of KV
    /// (`send_piece_bytes`).
    pub(super) fn pipelines(&self, plan: Option<&CopyPlan>, staging: &StagingLease<'_>) -> bool {
        let piece = self.resources.options.send_piece_bytes;
        piece > 0 && staging.memory() == StagingMemory::Host && plan.is_some_and(|p| p.bytes() >= piece.saturating_mul(2))
    }

    /// Gathers `plan` and `tail` into `staging` and writes the region piece by piece, then `ready`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_pipelined(
        &self,
        desc: &TransferDesc,
        (plan, tail): (&CopyPlan, &[TailPart]),
        staging: &mut StagingLease<'_>,
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        deadline: &Deadline,
        op: &Op,
        t: &mut TransferTimings,
    ) -> Result<()> {
        let region_bytes = place.region_bytes;
        let base = staging.bytes(region_bytes as usize)?.as_mut_ptr() as usize;
        let pieces = plan.pieces(self.resources.options.send_piece_bytes);
        let stop = AtomicBool::new(false);
        let (gathered_tx, gathered) = crossbeam_channel::unbounded::<Gathered>();
        // One piece after another, until the writer stops it; a panic is the piece's error.
        let gather_all = || {
            for (i, piece) in pieces.iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let phase = Instant::now();
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // SAFETY: the pool was validated at registration and its pages checked; the
                    // piece's slabs lie inside the region at `base`, and no other thread touches
                    // them until this piece is reported (the writer reads only reported pieces).
                    unsafe { self.resources.copy.gather(piece, &self.pool, base as *mut u8) }
                }))
                .unwrap_or_else(|p| Err(Error::from_panic("gathering a piece of the chunk panicked", &*p)));
                let failed = result.is_err();
                let _ = gathered_tx.send((i, result.map(|()| phase.elapsed())));
                if failed {
                    return;
                }
            }
        };
        op.enter("writing", String::new);
        let phase = Instant::now();
        let written = std::thread::scope(|s| {
            let helper = std::thread::Builder::new().name("kvstage-gather".into()).spawn_scoped(s, gather_all);
            let written = self.write_pieces(desc, &pieces, base, place, &gathered, helper.is_ok(), deadline, t);
            // The helper finishes at most the piece it is on; the staging buffer outlives it.
            stop.store(true, Ordering::Relaxed);
            written
        });
        // Without a helper thread (none could be started), the pieces were gathered in turn.
        let wrote = written.and_then(|()| {
            let kv_bytes = region_bytes - geometry::parts::tail_bytes(tail);
            self.gather_tail(desc, tail, base as *mut u8, region_bytes, t)?;
            let whole = staging.bytes(region_bytes as usize)?;
            if kv_bytes < region_bytes {
                self.link.write_piece(place.grant_offset, &place.data(desc, kv_bytes, region_bytes - kv_bytes), &whole[kv_bytes as usize..], deadline)?;
            }
            let checksum = self.region_checksum(desc, || Ok(checksum(whole)))?;
            self.link.finish_pieces(place.grant_offset, &place.data(desc, 0, region_bytes), whole, &ready(checksum), deadline)
        });
        t.wire_ns = since(phase);
        wrote
    }

    /// The writer's side of [`write_pipelined`](Self::write_pipelined): each piece once the
    /// helper reports it gathered (`helped`), or gathered here first (no helper).
    #[allow(clippy::too_many_arguments)]
    fn write_pieces(
        &self,
        desc: &TransferDesc,
        pieces: &[CopyPlan],
        base: usize,
        place: &Placement,
        gathered: &crossbeam_channel::Receiver<Gathered>,
        helped: bool,
        deadline: &Deadline,
        t: &mut TransferTimings,
    ) -> Result<()> {
        for (i, piece) in pieces.iter().enumerate() {
            if helped {
                let (at, result) = gathered.recv().map_err(|_| Error::internal("the gather helper ended before the chunk's last piece"))?;
                debug_assert_eq!(at, i, "pieces are gathered in order");
                t.gather_ns += result?.as_nanos() as u64;
            } else {
                self.gather(piece, base as *mut u8, t)?;
            }
            for (at, len) in piece.staging_ranges() {
                // SAFETY: the helper reported this piece gathered and writes only later pieces
                // (disjoint ranges of the region); the lease keeps the buffer alive.
                let bytes = unsafe { std::slice::from_raw_parts((base + at as usize) as *const u8, len as usize) };
                self.link.write_piece(place.grant_offset, &place.data(desc, at, len), bytes, deadline)?;
            }
        }
        Ok(())
    }
}
