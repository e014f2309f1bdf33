//! A copy plan's pool rows as memory ranges in region order: what a stream transport writes
//! straight from a host pool instead of copying it through a staging region first, and what
//! direct mode copies from one pool's rows to another's.

use crate::error::{Error, Result};
use super::block::{Block, Side};
use crate::geometry::{CopyPlan, KvLayout, Segment};

/// Whether the plan's slabs lie back to back from the region's start in the order they are listed
/// (as the planner lists them: then its rows in that order are the region's KV bytes).
pub fn tiles_in_order(plan: &CopyPlan) -> bool {
    let mut next = 0;
    plan.slabs.iter().all(|s| {
        let here = s.staging_offset == next;
        next += plan.slab_bytes(s);
        here
    })
}

/// `(address, length)` of the plan's pool rows in region order (its slabs as listed, in region
/// order for the planner's plans: [`tiles_in_order`]; then the segments' tokens), rows adjacent in
/// memory merged within a slab (never across two buffers). Addresses are computed, not
/// dereferenced: a plan checked against the pool ([`super::check_plan`]) keeps every range inside
/// its buffer.
pub fn pool_ranges<'a>(plan: &'a CopyPlan, pool: &'a KvLayout) -> impl Iterator<Item = (usize, usize)> + 'a {
    plan.slabs.iter().flat_map(move |slab| {
        let base = pool.bases[slab.buffer as usize];
        let rows = plan.segments.iter().flat_map(move |seg| {
            let run = plan.run(slab, seg, seg.staging_token, seg.staging_token + seg.tokens);
            let packed = Side { at: 0, row: run.row_bytes() as usize, piece: run.piece_bytes as usize, plane: 0 };
            let pool = Side { at: base + run.pool_offset as usize, row: run.pool_row_stride as usize, piece: run.pool_piece_stride as usize, plane: 0 };
            Block { src: pool, dst: packed, len: run.piece_bytes as usize, rows: run.rows as usize, pieces: run.pieces as usize, planes: 1 }.src_ranges()
        });
        Adjacent { rows, pending: None }
    })
}

/// The part `[at, +len)` (region bytes) of `ranges` (a region's `(address, length)` ranges in
/// region order): the ranges it touches, the first and last cut to it.
pub fn clip(ranges: impl Iterator<Item = (usize, usize)>, at: u64, len: u64) -> impl Iterator<Item = (usize, usize)> {
    let (start, end) = (at as usize, (at + len) as usize);
    let mut seen = 0usize;
    ranges
        .map_while(move |(addr, n)| {
            let from = seen;
            seen += n;
            (from < end).then_some((addr, n, from))
        })
        .filter_map(move |(addr, n, from)| {
            let (lo, hi) = (start.max(from), end.min(from + n));
            (lo < hi).then(|| (addr + (lo - from), hi - lo))
        })
}

/// The plan's pool rows in region order as slices.
///
/// # Safety
/// `plan` was checked against `pool` ([`super::check_plan`]), a pool of host memory whose rows
/// nobody writes while the slices live.
pub unsafe fn pool_rows<'a>(plan: &'a CopyPlan, pool: &'a KvLayout) -> impl Iterator<Item = &'a [u8]> + 'a {
    // SAFETY: every range lies inside its pool buffer (the caller's contract).
    pool_ranges(plan, pool).map(|(at, len)| unsafe { std::slice::from_raw_parts(at as *const u8, len) })
}

/// Direct mode's one pass: copies the region `src` gathers from `src_pool` straight to where
/// `dst` scatters it in `dst_pool`, row by row (each side's head slice of its token slots: the
/// head remap lies in the two plans), whole runs where both sides' rows are whole token slots.
///
/// # Safety
/// Both plans were checked against their pools ([`super::check_plan`]), host memory that does
/// not overlap; nobody else writes `dst`'s rows or reads them as done while this runs.
pub unsafe fn copy_across(src: &CopyPlan, src_pool: &KvLayout, dst: &CopyPlan, dst_pool: &KvLayout) -> Result<()> {
    check_paired(src, dst)?;
    let runs = fused_runs(&src.segments, &dst.segments);
    let (src_bases, dst_bases) = (&src_pool.bases[..], &dst_pool.bases[..]);
    // Where either pool holds K‖V cells, K's and V's rows go in one pass (see `kv_interleaved`).
    let fused = kv_paired(src, src_bases) && kv_paired(dst, dst_bases) && (kv_interleaved(src, src_bases) || kv_interleaved(dst, dst_bases));
    let slabs = if fused { src.slabs.len() / 2 } else { src.slabs.len() };
    let side = |plan: &CopyPlan, bases: &[usize], i: usize, len: u64, slot: u64| {
        let (slab, g) = (&plan.slabs[i], plan.geometry(&plan.slabs[i]));
        let base = bases[slab.buffer as usize];
        Side {
            at: base + (plan.slot_offset(g, slot) + g.pool_head_offset) as usize,
            row: g.pool_token_stride as usize,
            piece: if g.piece_bytes == len { g.pool_piece_stride } else { len } as usize,
            plane: if fused { bases[plan.slabs[i + slabs].buffer as usize] - base } else { 0 },
        }
    };
    for i in 0..slabs {
        let (gs, gd) = (src.geometry(&src.slabs[i]), dst.geometry(&dst.slabs[i]));
        // A piece both sides hold whole: a head where either side puts heads apart.
        let len = gs.piece_bytes.min(gd.piece_bytes);
        for &(src_token, dst_token, tokens) in &runs {
            let (from, to) = (side(src, src_bases, i, len, src_token), side(dst, dst_bases, i, len, dst_token));
            let block = Block { src: from, dst: to, len: len as usize, rows: tokens as usize, pieces: (gs.row_bytes / len) as usize, planes: 1 + usize::from(fused) };
            // The decode pool's rows are not read here again: streaming stores skip reading each
            // destination line before writing it (half the memory traffic of a plain copy).
            // SAFETY: the callers' ranges lie in both pools (checked plans), which do not overlap.
            unsafe { block.copy(true) };
        }
    }
    // Streaming stores are weakly ordered: visible before the writer reports the region written.
    super::nt::fence();
    Ok(())
}

/// Whether the plan's slab `i` and slab `i + n/2` (of `n`) are the K and the V slab of one layer
/// whose rows differ only in where they start, V's after K's in the pool and in the region: then
/// a block of two planes copies both.
fn kv_paired(plan: &CopyPlan, bases: &[usize]) -> bool {
    let half = plan.slabs.len() / 2;
    let (k, v) = plan.slabs.split_at(half);
    half > 0
        && k.len() == v.len()
        && plan.rows[0] == plan.rows[1]
        && k.iter().zip(v).all(|(k, v)| {
            k.kv == 0 && v.kv == 1 && k.layer_id == v.layer_id && bases[v.buffer as usize] > bases[k.buffer as usize] && v.staging_offset > k.staging_offset
        })
}

/// Whether the plan's V rows lie inside K's token slots in the pool (vLLM's K‖V cells, paired as
/// [`kv_paired`] says): a pass over K's rows, then one over V's, would each bring in (or write
/// back) every line of the cells for half their bytes; one pass over both moves each line once.
pub(super) fn kv_interleaved(plan: &CopyPlan, bases: &[usize]) -> bool {
    let half = plan.slabs.len() / 2;
    kv_paired(plan, bases) && plan.slabs[..half].iter().zip(&plan.slabs[half..]).all(|(k, v)| bases[v.buffer as usize] - bases[k.buffer as usize] < plan.rows[0].pool_token_stride as usize)
}

/// Whether `src` (a gather plan) and `dst` (a scatter plan) are of the same region, as direct mode
/// pairs them: the same slabs (kind, staging offset, row size) in the same order, as many tokens.
pub fn check_paired(src: &CopyPlan, dst: &CopyPlan) -> Result<()> {
    let same_slabs = src.slabs.len() == dst.slabs.len()
        && src.slabs.iter().zip(&dst.slabs).all(|(a, b)| a.staging_offset == b.staging_offset && a.kv == b.kv && src.geometry(a).row_bytes == dst.geometry(b).row_bytes);
    if !same_slabs || src.tokens != dst.tokens {
        return Err(Error::internal(format!("a direct copy of {} bytes of rows into {} bytes of rows", src.bytes(), dst.bytes())));
    }
    Ok(())
}

/// Two tilings of the same staging tokens merged: `(src pool token, dst pool token, tokens)`
/// runs consecutive on both sides.
pub fn fused_runs(src: &[Segment], dst: &[Segment]) -> Vec<(u64, u64, u64)> {
    let (mut i, mut j, mut at) = (0, 0, 0u64);
    let mut out = Vec::with_capacity(src.len() + dst.len());
    while i < src.len() && j < dst.len() {
        let (a, b) = (&src[i], &dst[j]);
        let end = (a.staging_token + a.tokens).min(b.staging_token + b.tokens);
        out.push((a.pool_token + (at - a.staging_token), b.pool_token + (at - b.staging_token), end - at));
        at = end;
        i += usize::from(end == a.staging_token + a.tokens);
        j += usize::from(end == b.staging_token + b.tokens);
    }
    out
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
    use crate::copy::CopyEngine;
    use crate::geometry::{plan_gather, staging_layout, MemoryKind, ModelKind, PoolShape};

    #[test]
    fn clip_cuts_the_ranges_to_a_part_of_the_region() {
        let ranges = || [(100, 4), (200, 6), (300, 2)].into_iter();
        assert_eq!(clip(ranges(), 0, 12).collect::<Vec<_>>(), vec![(100, 4), (200, 6), (300, 2)]);
        assert_eq!(clip(ranges(), 2, 5).collect::<Vec<_>>(), vec![(102, 2), (200, 3)]);
        assert_eq!(clip(ranges(), 4, 6).collect::<Vec<_>>(), vec![(200, 6)]);
        assert_eq!(clip(ranges(), 9, 3).collect::<Vec<_>>(), vec![(205, 1), (300, 2)]);
        assert_eq!(clip(ranges(), 11, 1).collect::<Vec<_>>(), vec![(301, 1)]);
        assert_eq!(clip(ranges(), 3, 0).count(), 0);
    }

    #[test]
    fn adjacent_ranges_merge_and_others_do_not() {
        let merged: Vec<_> = Adjacent { rows: [(0, 4), (4, 4), (10, 2), (12, 1), (20, 5)].into_iter(), pending: None }.collect();
        assert_eq!(merged, vec![(0, 8), (10, 3), (20, 5)]);
        assert_eq!(Adjacent { rows: std::iter::empty(), pending: None }.count(), 0);
    }

    /// The pool ranges, concatenated, are the bytes the host gather writes into the region: whole
    /// slots (P2 -> D1) and head slices of them (P1 -> D2, either decode rank), pages out of
    /// order, a start inside the first page.
    #[test]
    fn pool_ranges_are_the_gathered_region() {
        let shape = PoolShape::new(ModelKind::Mha, 4, 8, 2, 4, 3);
        for (src, dst) in [(shape.clone().with_tp(1, 2), shape.clone()), (shape.clone(), shape.clone().with_tp(0, 2)), (shape.clone(), shape.clone().with_tp(1, 2))] {
            let pages = 6u64;
            let buffer_bytes = (pages * src.page_bytes()) as usize;
            let mut memory: Vec<Vec<u8>> = (0..6).map(|b| (0..buffer_bytes).map(|i| (i * 7 + b * 131) as u8).collect()).collect();
            let pool = KvLayout::new(src.clone(), pages, MemoryKind::Host, memory.iter_mut().map(|m| m.as_mut_ptr() as usize).collect());
            let st = staging_layout(&src, &dst, 14).unwrap();
            let region = st.region_of(&src).unwrap().unwrap();
            let plan = plan_gather(&src, &[4, 1, 3, 0], 1, &st, &region).unwrap();
            crate::copy::check_plan(&plan, &pool).unwrap();
            assert_eq!(plan.rows[0].contiguous(), src.tp_size == 2, "{src:?} -> {dst:?}");
            assert!(tiles_in_order(&plan));
            let mut gathered = vec![0u8; plan.staging_bytes as usize];
            // SAFETY: the plan was checked against the pool; the buffer holds the region.
            unsafe { crate::copy::HostCopyEngine::new(1).gather(&plan, &pool, gathered.as_mut_ptr()) }.unwrap();
            // SAFETY: the ranges lie inside the pool's buffers (checked plan), alive here.
            let streamed: Vec<u8> = pool_ranges(&plan, &pool).flat_map(|(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) }.to_vec()).collect();
            assert_eq!(streamed, gathered, "{src:?} -> {dst:?}");
        }
    }
}
