//! Direct mode (same host, the decode pool mapped here): a chunk the receiver granted directly is
//! copied in one pass from this pool's pages into the decode pages its grant names, both head
//! slices remapped by one pair of plans (host pools: by this thread; device pools: one kernel on
//! this pool's device, the decode pool opened there through CUDA IPC); no ring range is written
//! and the receiver scatters nothing. Then the `Written` report and the ready go over the control stream, as after an
//! in-place gather (layer-wise: a copy and a `Written` report per batch of layers).

use super::staged::Placement;
use super::*;
use crate::geometry::{CopyPlan, StagingLayout, WriterRegion};

/// Where a direct grant puts this writer's region: the decode pages it named, and the layout and
/// region they are planned with.
#[derive(Clone, Copy)]
pub(super) struct DirectTarget<'a> {
    pub layout: &'a StagingLayout,
    pub region: &'a WriterRegion,
    pub pages: &'a [u32],
}

impl SenderSession {
    /// Whether a chunk of `plan` may be asked for directly: this pool's KV without request parts
    /// (whole or layer-wise), on a session that maps the decode pool (in this pool's memory).
    pub(super) fn may_write_direct(&self, plan: Option<&CopyPlan>, region: &WriterRegion) -> bool {
        plan.is_some() && region.tail.is_empty() && self.link.maps_pool()
    }

    /// The decode side of `plan` in the pages of `to`, checked with `plan` against both pools as
    /// mapped here: the pages are the receiver's word, so a lying receiver can at most have its
    /// own pool written. Once per chunk: a mapping's layout never changes.
    pub(super) fn direct_plan(&self, plan: &CopyPlan, to: DirectTarget<'_>) -> Result<CopyPlan> {
        crate::copy::check_plan(plan, &self.pool)?;
        let pool = self.link.direct_pool().ok_or_else(|| Error::internal("a direct grant on a session that does not map the receiver's pool"))??;
        geometry::plan_scatter(pool.layout(), to.pages, to.layout, to.region)
            .and_then(|dst| crate::copy::check_plan(&dst, pool.layout()).map(|()| dst))
            .map_err(|e| Error::new(Status::KVSTAGE_E_PROTOCOL, "the receiver granted decode pages that do not hold this chunk").with_source(e))
    }

    /// Copies `part` (a plan of [`direct_plan`](Self::direct_plan), or a batch of its layers)
    /// into `dst` (the decode side's plan of the same layers), holding the mapping of the
    /// receiver's pool only meanwhile.
    pub(super) fn copy_direct(&self, part: &CopyPlan, dst: &CopyPlan, deadline: &Deadline, op: &Op, t: &mut TransferTimings) -> Result<()> {
        let pool = self.link.direct_pool().ok_or_else(|| Error::internal("a direct grant on a session that does not map the receiver's pool"))??;
        op.enter("gathering", String::new);
        let phase = Instant::now();
        if let Some(pause) = self.resources.options.faults.as_ref().map(|f| f.plan.direct_pause_ms).filter(|&ms| ms > 0) {
            std::thread::sleep(Duration::from_millis(pause.into()));
        }
        // SAFETY: both plans (of the checked ones, some of their slabs) were checked against
        // their pools, two processes' pools of one kind (never the same pages); the grant gives
        // this writer these rows of the decode pages until its ready, and the mapping (whose
        // layout `dst` was checked against) stays while `pool` is held.
        let copied = unsafe { self.resources.copy.copy_across(part, &self.pool, dst, pool.layout(), deadline) };
        t.gather_ns += since(phase);
        copied
    }

    /// The checksum of a direct region (the rows of `plan`, checked by
    /// [`direct_plan`](Self::direct_plan), as the receiver's pool now holds them) when integrity
    /// covers the chunk.
    pub(super) fn direct_checksum(&self, desc: &TransferDesc, plan: &CopyPlan) -> Result<Option<u64>> {
        // SAFETY: `plan` was checked against the pool, whose rows the caller keeps valid.
        self.region_checksum(desc, || unsafe { crate::session::rows_checksum(&*self.resources.copy, plan, &self.pool) })
    }

    /// A whole chunk: copies `plan`'s rows into the decode pages of `to`, then reports the region
    /// written and sends `ready`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_direct(
        &self,
        desc: &TransferDesc,
        plan: &CopyPlan,
        to: DirectTarget<'_>,
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        deadline: &Deadline,
        op: &Op,
        t: &mut TransferTimings,
    ) -> Result<()> {
        let dst = self.direct_plan(plan, to)?;
        self.copy_direct(plan, &dst, deadline, op, t)?;
        let checksum = self.direct_checksum(desc, plan)?;
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = self.link.finish_in_place(&place.data(desc, 0, place.region_bytes), &ready(checksum), deadline);
        t.wire_ns = since(phase);
        wrote?;
        self.resources.shm.count_direct_chunk();
        Ok(())
    }
}
