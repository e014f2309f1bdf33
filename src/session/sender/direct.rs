//! Direct mode (same host, the decode pool mapped here): a chunk the receiver granted directly is
//! copied in one pass from this pool's pages into the decode pages its grant names, both head
//! slices remapped by one pair of plans; no ring range is written and the receiver scatters
//! nothing. Then the `Written` report and the ready go over the control stream, as after an
//! in-place gather.

use super::staged::Placement;
use super::*;
use crate::copy::rows;
use crate::geometry::{CopyPlan, StagingLayout, WriterRegion};

impl SenderSession {
    /// Whether a chunk of `plan` may be asked for directly: a whole chunk (not layer-wise) of
    /// this host pool's KV without request parts, on a session that maps the decode pool.
    pub(super) fn may_write_direct(&self, desc: &TransferDesc, plan: Option<&CopyPlan>, region: &WriterRegion) -> bool {
        plan.is_some() && region.tail.is_empty() && desc.layers.is_none() && self.pool.memory == MemoryKind::Host && self.link.maps_pool()
    }

    /// Copies `plan`'s rows into the decode `pages` the grant named (this writer's `region` of
    /// `layout` there), then reports the region written and sends `ready`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_direct(
        &self,
        desc: &TransferDesc,
        (plan, layout, region): (&CopyPlan, &StagingLayout, &WriterRegion),
        pages: &[u32],
        place: &Placement,
        ready: impl Fn(Option<u64>) -> Message,
        deadline: &Deadline,
        op: &Op,
        t: &mut TransferTimings,
    ) -> Result<()> {
        let pool = self.link.direct_pool().ok_or_else(|| Error::internal("a direct grant on a session that does not map the receiver's pool"))??;
        // The pages are the receiver's word: checked against its pool as mapped here, so a lying
        // receiver can at most have its own pool written.
        let dst = geometry::plan_scatter(&pool.layout().shape, pages, layout, region)
            .and_then(|dst| crate::copy::check_plan(&dst, pool.layout()).map(|()| dst))
            .map_err(|e| Error::new(Status::KVSTAGE_E_PROTOCOL, "the receiver granted decode pages that do not hold this chunk").with_source(e))?;
        crate::copy::check_plan(plan, &self.pool)?;
        op.enter("gathering", String::new);
        let phase = Instant::now();
        if let Some(pause) = self.resources.options.faults.as_ref().map(|f| f.plan.direct_pause_ms).filter(|&ms| ms > 0) {
            std::thread::sleep(Duration::from_millis(pause.into()));
        }
        // SAFETY: both plans were checked against their pools, host memory of two processes'
        // pools (never the same pages); the grant gives this writer these rows of the decode pages
        // until its ready, and the mapping stays while `pool` is held.
        let copied = unsafe { rows::copy_across(plan, &self.pool, &dst, pool.layout()) };
        t.gather_ns += since(phase);
        copied?;
        // SAFETY: `plan` was checked against the host pool above.
        let checksum = self.region_checksum(desc, || Ok(crate::session::checksum_parts(unsafe { rows::pool_rows(plan, &self.pool) })))?;
        drop(pool);
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = self.link.finish_in_place(&place.data(desc, 0, place.region_bytes), &ready(checksum), deadline);
        t.wire_ns = since(phase);
        wrote?;
        self.resources.shm.count_direct_chunk();
        Ok(())
    }
}
