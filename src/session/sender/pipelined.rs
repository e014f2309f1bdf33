//! A whole chunk's staged write in pieces: while a piece goes out on the link, a helper thread
//! gathers the next ones into their own ranges of the staging buffer, so the gather hides behind
//! the wire instead of preceding it. The request's parts and the ready follow the last piece,
//! bound to the pieces as for a layer-wise write: the receiver completes the chunk exactly as for
//! one write. A helper lives for one chunk's write, which holds a staging buffer: an engine runs
//! at most `send_staging_buffers` of them at once.
//!
//! Timings stay sequential on the writing thread: `gather_ns` is the time it waited for pieces
//! (the gather not hidden) and the tail's gather, `wire_ns` the time it spent writing.

use super::staged::Placement;
use super::*;
use crate::geometry::{CopyPlan, TailPart};
use crate::session::staging::{StagingLease, StagingMemory};

/// The gather of one piece, as the helper reports it.
type Gathered = Result<()>;

impl SenderSession {
    /// The pieces a whole chunk's region gathered into `staging` goes out in: host staging (the
    /// CPU gathers while the link writes) and at least two pieces of `send_piece_bytes`.
    pub(super) fn pipeline_pieces(&self, plan: Option<&CopyPlan>, staging: &StagingLease<'_>) -> Option<Vec<CopyPlan>> {
        let piece = self.resources.options.send_piece_bytes;
        let plan = plan.filter(|_| piece > 0 && staging.memory() == StagingMemory::Host)?;
        Some(plan.pieces_of(piece)).filter(|pieces| pieces.len() >= 2)
    }

    /// Gathers `pieces` (the KV plan, in region order) and `tail` into `staging` and writes the
    /// region piece by piece, then `ready`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_pipelined(
        &self,
        desc: &TransferDesc,
        (pieces, tail): (&[CopyPlan], &[TailPart]),
        staging: &mut StagingLease<'_>,
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        deadline: &Deadline,
        op: &Op,
        t: &mut TransferTimings,
    ) -> Result<()> {
        let region_bytes = place.region_bytes;
        let base = staging.bytes(region_bytes as usize)?.as_mut_ptr() as usize;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (gathered_tx, gathered) = crossbeam_channel::unbounded::<Gathered>();
        let (copy, pool, stop_ref) = (&self.resources.copy, &self.pool, &stop);
        // One piece after another until the writer stops it; a panic is the piece's error. The
        // sender moves in: the writer sees the channel close if the helper ends without a report.
        let gather_all = move || {
            for piece in pieces {
                if stop_ref.load(Ordering::Relaxed) {
                    return;
                }
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // SAFETY: the pool was validated at registration and its pages checked; the
                    // piece's slabs lie inside the region at `base`, and no other thread touches
                    // them until this piece is reported (the writer reads only reported pieces).
                    unsafe { copy.gather_after(piece, pool, base as *mut u8, None, deadline) }
                }))
                .unwrap_or_else(|_| Err(Error::new(Status::KVSTAGE_E_PANIC, "gathering a piece of the chunk panicked")));
                let failed = result.is_err();
                if gathered_tx.send(result).is_err() || failed {
                    return;
                }
            }
        };
        op.enter("writing", String::new);
        let written = std::thread::scope(|s| {
            let helper = std::thread::Builder::new().name("kvstage-gather".into()).spawn_scoped(s, gather_all);
            // Without a helper (none could be started) each piece is gathered here, in turn.
            let from = helper.is_ok().then_some(&gathered);
            let written = self.write_pieces(desc, pieces, base, place, from, deadline, t);
            // The helper finishes at most the piece it is on; the staging buffer outlives it.
            stop.store(true, Ordering::Relaxed);
            written
        });
        written?;
        self.gather_tail(desc, tail, Self::tail_at(base as *mut u8, region_bytes, tail), t)?;
        let whole = staging.bytes(region_bytes as usize)?;
        let phase = Instant::now();
        let checksum = self.region_checksum(desc, || Ok(checksum(whole)));
        t.gather_ns += since(phase);
        let phase = Instant::now();
        let kv_bytes = region_bytes - geometry::parts::tail_bytes(tail);
        let wrote = checksum.and_then(|checksum| self.finish_region(desc, place, &whole[kv_bytes as usize..], whole, &ready(checksum), deadline));
        t.wire_ns += since(phase);
        wrote
    }

    /// The writer's side of [`write_pipelined`](Self::write_pipelined): each piece once the helper
    /// reported it gathered (`from`), or gathered here first (no helper).
    #[allow(clippy::too_many_arguments)]
    fn write_pieces(
        &self,
        desc: &TransferDesc,
        pieces: &[CopyPlan],
        base: usize,
        place: &Placement,
        from: Option<&crossbeam_channel::Receiver<Gathered>>,
        deadline: &Deadline,
        t: &mut TransferTimings,
    ) -> Result<()> {
        for piece in pieces {
            match from {
                Some(gathered) => {
                    let waited = Instant::now();
                    let result = match deadline.instant() {
                        Some(until) => gathered.recv_deadline(until).map_err(|e| match e {
                            crossbeam_channel::RecvTimeoutError::Timeout => deadline.timeout_error("waiting for the gather of the chunk's next piece"),
                            crossbeam_channel::RecvTimeoutError::Disconnected => Error::internal("the gather helper ended before the chunk's last piece"),
                        }),
                        None => gathered.recv().map_err(|_| Error::internal("the gather helper ended before the chunk's last piece")),
                    };
                    t.gather_ns += since(waited);
                    result??;
                }
                None => self.gather(piece, base as *mut u8, deadline, t)?,
            }
            for (at, len) in piece.staging_ranges() {
                let phase = Instant::now();
                // SAFETY: this piece was reported gathered and the helper writes only later pieces
                // (disjoint ranges of the region); the lease keeps the buffer alive.
                let bytes = unsafe { std::slice::from_raw_parts((base + at as usize) as *const u8, len as usize) };
                let wrote = self.link.write_piece(place.grant_offset, &place.data(desc, at, len), bytes, deadline);
                t.wire_ns += since(phase);
                wrote?;
            }
        }
        Ok(())
    }
}
