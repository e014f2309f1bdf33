//! Layer-wise writing of a granted region: each batch of layers the caller marks ready is gathered
//! into its slabs' places and written at once (TCP: one `Data` frame per run of adjacent slabs;
//! same host: in place (host ring, or a device ring from a CUDA pool), then a `Written` report;
//! RDMA from a CUDA pool with GPUDirect: gathered into device staging memory the NIC reads; RDMA: a plain RDMA WRITE per run, then a
//! `Written` report), while later layers are still being computed. The ready goes after the last
//! batch (over RDMA behind a zero-length write-with-immediate that follows every piece), so the
//! receiver completes the chunk exactly as for a whole-chunk write.

use std::collections::BTreeSet;

use super::direct::DirectTarget;
use super::staged::Placement;
use crate::session::staging::StagingMemory;
use super::*;

impl SenderSession {
    /// Writes `place` batch by batch as `gate` hands out layers, then `ready`. Layers of the pool
    /// this writer does not carry (the decode rank lacks them) are accepted and skipped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_by_layers(
        &self,
        desc: &TransferDesc,
        gate: &LayerGate,
        op: &Op,
        deadline: &Deadline,
        plan: &geometry::CopyPlan,
        direct: Option<DirectTarget<'_>>,
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        t: &mut TransferTimings,
        stall: &mut Stall,
    ) -> Result<()> {
        let region_bytes = place.region_bytes;
        let ring_offset = place.grant_offset + place.region_offset;
        let mut missing: BTreeSet<u32> = plan.slabs.iter().map(|s| s.layer_id).collect();
        // Same host, a ring in the pool's kind of memory (or the decode pool, granted directly):
        // in place, the range (or the pool's mapping) taken per batch only (teardown waits for a
        // copy in progress, not for the caller's compute).
        let in_place = self.writes_in_place() || direct.is_some();
        let direct = direct.map(|to| self.direct_plan(plan, to)).transpose()?;
        let mut staging = if in_place {
            None
        } else {
            Some(self.staging_buffer(region_bytes, deadline, op, t)?)
        };
        while !missing.is_empty() {
            for batch in self.wait_layers(gate, deadline, op, &missing, stall)? {
                let layers: Vec<u32> = batch.layers.iter().copied().filter(|l| missing.remove(l)).collect();
                if layers.is_empty() {
                    continue;
                }
                let batch_has = |l: u32| layers.binary_search(&l).is_ok();
                let part = plan.for_layers(batch_has);
                match staging.as_mut() {
                    None => {
                        // The batch's ready point first: teardown waits for the range, not for
                        // the caller's compute.
                        self.await_ready(batch.ready.as_ref(), deadline, op, t)?;
                        op.enter("writing", String::new);
                        match &direct {
                            Some(dst) => self.copy_direct(&part, &dst.for_layers(batch_has), deadline, op, t)?,
                            None => {
                                let mut range = self.link.in_place(ring_offset, region_bytes).expect("probed above")?;
                                self.gather(&part, range.as_mut_ptr(), deadline, t)?;
                            }
                        }
                        let phase = Instant::now();
                        for (at, len) in part.staging_ranges() {
                            self.link.send(&place.written(desc, at, len), deadline)?;
                        }
                        t.wire_ns += since(phase);
                    }
                    Some(buffer) => {
                        self.await_ready(batch.ready.as_ref(), deadline, op, t)?;
                        op.enter("writing", String::new);
                        self.gather(&part, buffer.as_mut_ptr(), deadline, t)?;
                        let phase = Instant::now();
                        for piece in part.staging_ranges() {
                            self.write_staged(buffer, place, desc, piece, None, deadline)?;
                        }
                        t.wire_ns += since(phase);
                    }
                }
            }
        }
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = match staging.as_mut() {
            None if direct.is_some() => {
                let checksum = self.direct_checksum(desc, plan)?;
                self.link.send(&ready(checksum), deadline).inspect(|()| self.resources.shm.count_direct_chunk())
            }
            None => {
                let checksum = self.region_checksum(desc, || {
                    let mut range = self.link.in_place(ring_offset, region_bytes).expect("probed above")?;
                    Ok(checksum(&range.to_host()?))
                })?;
                self.link.send(&ready(checksum), deadline)
            }
            Some(buffer) => {
                let checksum = self.region_checksum(desc, || Ok(checksum(&buffer.to_host(region_bytes as usize)?)))?;
                let header = place.data(desc, 0, region_bytes);
                match buffer.memory() {
                    StagingMemory::Host => {
                        self.link.finish_pieces(place.grant_offset, &header, buffer.bytes(region_bytes as usize)?, &ready(checksum), deadline)
                    }
                    // The zero-length write names the buffer (its registration), reads nothing.
                    // SAFETY: an empty slice at a non-null address is never dereferenced.
                    StagingMemory::Device(_) => self.link.finish_pieces(
                        place.grant_offset,
                        &header,
                        unsafe { std::slice::from_raw_parts(buffer.as_mut_ptr(), 0) },
                        &ready(checksum),
                        deadline,
                    ),
                }
            }
        };
        t.wire_ns += since(phase);
        wrote?;
        self.metrics.sent(region_bytes);
        Ok(())
    }

    /// Blocks until the caller marked more layers (or the deadline, a cancel, the session's end).
    fn wait_layers(&self, gate: &LayerGate, deadline: &Deadline, op: &Op, missing: &BTreeSet<u32>, stall: &mut Stall) -> Result<Vec<crate::session::layers::LayerBatch>> {
        // The gate is read under the session lock: a mark lands either before the read or wakes
        // the wait below (marking wakes the session after its own lock is released).
        op.enter("waiting_for_layers", || format!("layers {} of the chunk are not marked ready (kvstage_op_layers_ready)", layer_list(missing)));
        let mut st = self.shared.state.lock();
        stall.progress();
        loop {
            let batches = gate.take();
            if !batches.is_empty() {
                return Ok(batches);
            }
            self.check_alive(&st, deadline, op, "waiting for the caller to mark the chunk's layers ready")?;
            stall.wait(deadline, &self.shared.cv, &mut st, |_| {
                format!("waiting for the caller to mark layers ready (kvstage_op_layers_ready): layers {} of this chunk are not marked", layer_list(missing))
            });
        }
    }
}

/// "3, 5, 7" (the first 16, then "and N more").
fn layer_list(layers: &BTreeSet<u32>) -> String {
    let shown: Vec<String> = layers.iter().take(16).map(u32::to_string).collect();
    let more = if layers.len() > 16 { format!(" and {} more", layers.len() - 16) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}
