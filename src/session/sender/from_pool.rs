//! A whole chunk over a stream transport straight from a host pool: the region's KV bytes are the
//! plan's pool rows in region order, handed to the link as vectored writes (TCP copies them into
//! the socket itself), so no staging copy is made and no staging buffer is held. The request's
//! parts, small, are gathered into a buffer of their own and follow the rows. The receiver sees
//! the same frames as from a staging buffer.

use super::staged::Placement;
use super::*;
use crate::geometry::{CopyPlan, KvLayout, TailPart};

impl SenderSession {
    /// Whether `plan` goes out from the pool: allowed (`send_from_pool`), a host pool, a link
    /// that streams from memory, and a plan whose slabs tile its KV bytes in region order.
    pub(super) fn writes_from_pool(&self, plan: &CopyPlan) -> bool {
        self.resources.options.send_from_pool && self.pool.memory == MemoryKind::Host && self.link.streams_from_memory() && tiles_in_order(plan)
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
            let mut sum = xxhash_rust::xxh3::Xxh3::new();
            // SAFETY: the plan was checked against the host pool above.
            for row in unsafe { pool_rows(plan, &self.pool) } {
                sum.update(row);
            }
            sum.update(&parts);
            t.gather_ns += since(phase);
            Ok(sum.digest())
        })?;
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = (|| {
            let piece_bytes = self.resources.options.send_piece_bytes;
            let pieces = if piece_bytes > 0 { plan.pieces(piece_bytes) } else { vec![plan.clone()] };
            for piece in &pieces {
                let Some(&(at, len)) = piece.staging_ranges().first() else { continue };
                // SAFETY: as above (a piece is the plan with some of its slabs); the pool's pages
                // stay the caller's to keep until the transfer ends.
                let mut rows = unsafe { pool_rows(piece, &self.pool) };
                self.link.write_piece_from(&place.data(desc, at, len), &mut rows, deadline)?;
            }
            let kv_bytes = place.region_bytes - parts.len() as u64;
            if !parts.is_empty() {
                self.link.write_piece(place.grant_offset, &place.data(desc, kv_bytes, parts.len() as u64), &parts, deadline)?;
            }
            // A stream transport's ready needs no bytes (only RDMA's names its buffer).
            self.link.finish_pieces(place.grant_offset, &place.data(desc, 0, place.region_bytes), &[], &ready(checksum), deadline)
        })();
        t.wire_ns = since(phase);
        wrote
    }
}

/// Whether the plan's slabs, in region order, lie back to back from the region's start (then its
/// rows in that order are the region's bytes).
fn tiles_in_order(plan: &CopyPlan) -> bool {
    let slab = plan.tokens * plan.row_bytes;
    let mut offsets: Vec<u64> = plan.slabs.iter().map(|s| s.staging_offset).collect();
    offsets.sort_unstable();
    offsets.iter().enumerate().all(|(i, &at)| at == i as u64 * slab)
}

/// The plan's pool rows in region order (slabs by region offset, then the segments' tokens),
/// rows adjacent in the pool merged into one slice.
///
/// # Safety
/// `plan` was checked against `pool` ([`crate::copy::check_plan`]), a pool of host memory whose
/// rows nobody writes while the slices live.
unsafe fn pool_rows<'a>(plan: &'a CopyPlan, pool: &'a KvLayout) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut slabs = plan.slabs.clone();
    slabs.sort_by_key(|s| s.staging_offset);
    let contiguous = plan.contiguous();
    // Merged within a slab only: rows of one buffer, never across two allocations.
    slabs.into_iter().flat_map(move |slab| {
        let rows = plan.segments.iter().flat_map(move |seg| {
            let first = pool.bases[slab.buffer as usize] + (seg.pool_token * plan.pool_token_bytes + plan.pool_head_offset) as usize;
            let (count, len) = if contiguous { (1, seg.tokens * plan.row_bytes) } else { (seg.tokens, plan.row_bytes) };
            (0..count).map(move |i| (first + (i * plan.pool_token_bytes) as usize, len as usize))
        });
        // SAFETY: every row lies inside its pool buffer (the caller's contract).
        Adjacent { rows, pending: None }.map(|(at, len)| unsafe { std::slice::from_raw_parts(at as *const u8, len) })
    })
}

/// Merges `(address, length)` ranges that follow each other in memory.
struct Adjacent<I> {
    rows: I,
    pending: Option<(usize, usize)>,
}

impl<I: Iterator<Item = (usize, usize)>> Iterator for Adjacent<I> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        loop {
            match (self.pending, self.rows.next()) {
                (None, None) => return None,
                (Some(p), None) => {
                    self.pending = None;
                    return Some(p);
                }
                (None, Some(r)) => self.pending = Some(r),
                (Some((at, len)), Some((next, n))) if at + len == next => self.pending = Some((at, len + n)),
                (Some(p), Some(r)) => {
                    self.pending = Some(r);
                    return Some(p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{plan_gather, staging_layout, ModelKind, PoolShape};

    #[test]
    fn adjacent_ranges_merge_and_others_do_not() {
        let merged: Vec<_> = Adjacent { rows: [(0, 4), (4, 4), (10, 2), (12, 1), (20, 5)].into_iter(), pending: None }.collect();
        assert_eq!(merged, vec![(0, 8), (10, 3), (20, 5)]);
        assert_eq!(Adjacent { rows: std::iter::empty(), pending: None }.count(), 0);
    }

    /// The pool rows, concatenated, are the bytes the host gather writes into the region: for a
    /// head slice of the token slot (strided rows) and for whole slots (contiguous runs), pages
    /// out of order, a start inside the first page.
    #[test]
    fn pool_rows_are_the_gathered_region() {
        let shape = PoolShape::new(ModelKind::Mha, 4, 8, 2, 4, 3);
        // Whole slots (P2 -> D1), head slices of them (P1 -> D2, either decode rank).
        for (src, dst) in [(shape.clone().with_tp(1, 2), shape.clone()), (shape.clone(), shape.clone().with_tp(0, 2)), (shape.clone(), shape.clone().with_tp(1, 2))] {
            let pages = 6u64;
            let buffer_bytes = (pages * src.page_bytes()) as usize;
            let mut memory: Vec<Vec<u8>> = (0..6).map(|b| (0..buffer_bytes).map(|i| (i * 7 + b * 131) as u8).collect()).collect();
            let pool = KvLayout { shape: src.clone(), capacity_pages: pages, memory: MemoryKind::Host, bases: memory.iter_mut().map(|m| m.as_mut_ptr() as usize).collect() };
            let st = staging_layout(&src, &dst, 14).unwrap();
            let region = st.region_of(&src).unwrap().unwrap();
            let plan = plan_gather(&src, &[4, 1, 3, 0], 1, &st, &region).unwrap();
            crate::copy::check_plan(&plan, &pool).unwrap();
            assert_eq!(plan.contiguous(), src.tp_size == 2, "{src:?} -> {dst:?}");
            assert!(tiles_in_order(&plan));
            let mut gathered = vec![0u8; plan.staging_bytes as usize];
            // SAFETY: the plan was checked against the pool; the buffer holds the region.
            unsafe { crate::copy::HostCopyEngine::new(1).gather(&plan, &pool, gathered.as_mut_ptr()) }.unwrap();
            // SAFETY: as above.
            let streamed: Vec<u8> = unsafe { pool_rows(&plan, &pool) }.flatten().copied().collect();
            assert_eq!(streamed, gathered, "{src:?} -> {dst:?}");
        }
    }
}
