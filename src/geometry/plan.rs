//! The copy planner: one plan per (pool, writer region, chunk), consumed by every copy engine
//! (host memcpy, the CUDA kernels, the stream and direct paths' pool rows).
//!
//! A plan holds offsets only, never pointers, so it can be shipped to a device. It is factored as
//! `slabs × segments`:
//! - a [`Slab`] is one (buffer, layer) pair: the pool buffer index and the byte offset of its
//!   slab within the writer region;
//! - a [`Segment`] is a run of pool token slots that lie evenly spaced (`pool_token_stride`
//!   apart: one page, or adjacent pages of a pool whose pages are evenly spaced) and map to
//!   consecutive staging rows.
//!
//! Every (slab, segment) pair is one [`CopyRun`]: `rows` staging rows of `row_bytes`, each row
//! `pieces` pieces of `piece_bytes` in the pool (the copied heads: one piece where they are
//! adjacent in the pool, one per head where the pool puts heads apart, as head-major pages do).
//! Staging rows are packed and token-major whatever the pool's layout (docs/GEOMETRY.md, "Pool
//! layouts"). The factored form keeps the plan small (a 70B chunk of 8192 random single-token pages
//! is 8192 segments + 160 slabs, not 1.3 M descriptors).

use super::span::PageSpan;
use super::{mismatch_error, PoolGeometry, StagingLayout, WriterRegion};
use crate::error::{Error, FieldMismatch, Result};

/// Pool token slots `pool_token, …` (`tokens` of them, `pool_token_stride` apart) ↔ staging rows
/// `[staging_token, staging_token + tokens)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub pool_token: u64,
    pub staging_token: u64,
    pub tokens: u64,
}

/// One (buffer, layer) of the plan: pool buffer index (into [`super::KvLayout::bases`]), its
/// kind (0 = K / latent, 1 = V: which [`CopyPlan::rows`] it follows) and the byte offset of its
/// slab within the writer region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slab {
    pub buffer: u32,
    pub kv: u32,
    pub staging_offset: u64,
    /// The model layer it holds (layer-wise sending picks slabs by it).
    pub layer_id: u32,
}

/// `rows × pieces` copies of `piece_bytes`: piece `(i, j)` at `pool_offset + i·pool_row_stride +
/// j·pool_piece_stride` in pool buffer `buffer` and at `staging_offset + i·row_bytes +
/// j·piece_bytes` in the staging region (`row_bytes = pieces · piece_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRun {
    pub buffer: u32,
    pub pool_offset: u64,
    pub staging_offset: u64,
    pub rows: u64,
    pub pool_row_stride: u64,
    pub pieces: u64,
    pub pool_piece_stride: u64,
    pub piece_bytes: u64,
}

impl CopyRun {
    pub fn row_bytes(&self) -> u64 {
        self.pieces * self.piece_bytes
    }
}

/// Where the rows of the slabs of one buffer kind lie: in the pool (its strides, the copied heads'
/// offset) and in staging (packed rows of `row_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowGeometry {
    /// Slot `t` lies at `(t / ps)·page_stride + (t mod ps)·token_stride` in a buffer.
    pub pool_page_stride: u64,
    /// Bytes between the token slots of a segment.
    pub pool_token_stride: u64,
    /// Byte offset of the first copied head within a token slot (`head_start · head_stride`).
    pub pool_head_offset: u64,
    /// Bytes between a row's pieces in the pool (`piece_bytes` where the row is one piece).
    pub pool_piece_stride: u64,
    /// Bytes of a piece: the whole row where the copied heads are adjacent in the pool, else one
    /// head (`D · b`).
    pub piece_bytes: u64,
    /// Bytes copied per token per slab (`n · D · b`), also the staging row stride.
    pub row_bytes: u64,
}

impl RowGeometry {
    /// Rows are contiguous on both sides (whole token slots, back to back): each run is one copy.
    pub fn contiguous(&self) -> bool {
        self.piece_bytes == self.row_bytes && self.pool_token_stride == self.row_bytes
    }

    /// Pieces per row.
    pub fn pieces(&self) -> u64 {
        self.row_bytes / self.piece_bytes.max(1)
    }
}

/// The copy between a pool and one writer region for one chunk. Staging offsets are relative to
/// the start of the writer region, which lies `region_offset` bytes into the allocation and is
/// `staging_bytes` long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPlan {
    /// The pool's page size.
    pub pool_page_size: u32,
    /// The rows of K (or latent) slabs and of V slabs (equal unless V's heads or strides differ
    /// from K's).
    pub rows: [RowGeometry; 2],
    /// Tokens of the chunk (Σ segment tokens).
    pub tokens: u64,
    pub slabs: Vec<Slab>,
    /// In staging order, tiling `[0, tokens)`.
    pub segments: Vec<Segment>,
    pub region_offset: u64,
    pub staging_bytes: u64,
}

impl CopyPlan {
    /// The rows of `slab`.
    pub fn geometry(&self, slab: &Slab) -> &RowGeometry {
        &self.rows[(slab.kv as usize).min(1)]
    }

    /// Every slab's rows are the same ([`Self::uniform_parts`] of one).
    pub fn uniform(&self) -> bool {
        self.rows[0] == self.rows[1] || self.slabs.iter().all(|s| s.kv == self.slabs.first().map_or(0, |f| f.kv))
    }

    /// The plan as parts whose slabs share one [`RowGeometry`] (each part's `rows` both that one):
    /// the plan itself where it is [`Self::uniform`], else its K slabs and its V slabs. Copy
    /// engines that take one row geometry per launch (the CUDA kernels) run each part.
    pub fn uniform_parts(&self) -> Vec<CopyPlan> {
        if self.uniform() {
            let kv = self.slabs.first().map_or(0, |s| s.kv as usize).min(1);
            return vec![CopyPlan { rows: [self.rows[kv]; 2], ..self.clone() }];
        }
        (0..2)
            .map(|kv| CopyPlan { rows: [self.rows[kv]; 2], slabs: self.slabs.iter().filter(|s| s.kv == kv as u32).copied().collect(), ..self.clone() })
            .filter(|p| !p.slabs.is_empty())
            .collect()
    }

    /// The rows of every slab of a [`Self::uniform`] plan (a part of [`Self::uniform_parts`]).
    pub fn uniform_rows(&self) -> &RowGeometry {
        debug_assert!(self.uniform(), "a plan whose K and V rows differ has no one row geometry");
        self.slabs.first().map_or(&self.rows[0], |s| self.geometry(s))
    }

    /// Byte offset of token slot `slot` in a pool buffer whose rows are `g`.
    pub fn slot_offset(&self, g: &RowGeometry, slot: u64) -> u64 {
        super::layout::page_slot_offset(self.pool_page_size as u64, g.pool_page_stride, g.pool_token_stride, slot)
    }

    /// The shortest run of adjacent pool bytes the plan copies at a time: a page of whole token
    /// slots, else a piece (what a read straight into the pool's rows costs per range).
    pub fn min_pool_run(&self) -> u64 {
        let run = |g: &RowGeometry| if g.contiguous() { g.row_bytes * self.pool_page_size as u64 } else { g.piece_bytes };
        self.slabs.iter().map(|s| run(self.geometry(s))).min().unwrap_or_else(|| run(&self.rows[0]))
    }

    /// Bytes of `slab`'s rows.
    pub fn slab_bytes(&self, slab: &Slab) -> u64 {
        self.tokens * self.geometry(slab).row_bytes
    }

    /// Bytes moved by the plan.
    pub fn bytes(&self) -> u64 {
        self.slabs.iter().map(|s| self.slab_bytes(s)).sum()
    }

    /// Number of [`CopyRun`]s (`slabs × segments`).
    pub fn run_count(&self) -> usize {
        self.slabs.len() * self.segments.len()
    }

    /// The part of the plan for the layers `ready` says are ready: the same rows, only those
    /// layers' slabs (at their places in the region).
    pub fn for_layers(&self, ready: impl Fn(u32) -> bool) -> CopyPlan {
        CopyPlan { slabs: self.slabs.iter().filter(|s| ready(s.layer_id)).copied().collect(), ..self.clone() }
    }

    /// The plan cut into consecutive pieces of whole slabs in region order, each at least
    /// `piece_bytes` long but the last: a sender writes piece `k` while it gathers piece `k + 1`.
    /// Each piece's region range is contiguous when the plan's slabs tile the region.
    pub fn pieces_of(&self, piece_bytes: u64) -> Vec<CopyPlan> {
        let mut slabs = self.slabs.clone();
        slabs.sort_by_key(|s| s.staging_offset);
        let mut out: Vec<CopyPlan> = Vec::new();
        let mut bytes = piece_bytes; // of the last piece: a full one starts the next
        for slab in slabs {
            if bytes >= piece_bytes {
                out.push(CopyPlan { slabs: Vec::new(), ..self.clone() });
                bytes = 0;
            }
            out.last_mut().expect("a piece").slabs.push(slab);
            bytes += self.slab_bytes(&slab);
        }
        out
    }

    /// Byte ranges `(offset, len)` of the region the plan writes, in region order, adjacent
    /// slabs merged: what a layer-wise sender reports as written.
    pub fn staging_ranges(&self) -> Vec<(u64, u64)> {
        let mut slabs: Vec<(u64, u64)> = self.slabs.iter().map(|s| (s.staging_offset, self.slab_bytes(s))).collect();
        slabs.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (at, slab) in slabs {
            match out.last_mut() {
                Some((start, len)) if *start + *len == at => *len += slab,
                _ => out.push((at, slab)),
            }
        }
        out
    }

    /// The run of `slab`'s staging rows `[from, to)`, which lie inside segment `seg`.
    pub fn run(&self, slab: &Slab, seg: &Segment, from: u64, to: u64) -> CopyRun {
        let g = self.geometry(slab);
        CopyRun {
            buffer: slab.buffer,
            pool_offset: self.slot_offset(g, seg.pool_token) + (from - seg.staging_token) * g.pool_token_stride + g.pool_head_offset,
            staging_offset: slab.staging_offset + from * g.row_bytes,
            rows: to - from,
            pool_row_stride: g.pool_token_stride,
            pieces: g.pieces(),
            pool_piece_stride: g.pool_piece_stride,
            piece_bytes: g.piece_bytes,
        }
    }

    /// The plan as copy runs, slab-major (one per slab and segment).
    pub fn runs(&self) -> impl Iterator<Item = CopyRun> + '_ {
        self.slabs.iter().flat_map(move |slab| self.segments.iter().map(move |seg| self.run(slab, seg, seg.staging_token, seg.staging_token + seg.tokens)))
    }
}

/// Plans the copy between `pool` (a [`super::PoolShape`], token-major, or a [`super::KvLayout`]
/// with its strides) and `region` of `staging` for one chunk: heads
/// `[head_start, head_start + num_heads)` of the chunk's `staging.tokens` tokens, which start
/// `first_token` slots into `pages[0]` and run on through `pages` (in chunk order), every layer the
/// writer carries (mapped to the pool's buffer indices), K slabs then V slabs.
///
/// Errors: heads outside the pool or disagreeing with the layout, pages that do not hold exactly
/// the chunk's tokens (`KVSTAGE_E_INVALID_ARG`); a pool whose agreed fields differ
/// from the layout or that lacks one of the writer's layers (`KVSTAGE_E_GEOMETRY_MISMATCH`). Page
/// indices are checked against the pool capacity by the engine that executes the plan.
pub fn plan_chunk<P: PoolGeometry + ?Sized>(
    pool: &P,
    head_start: u32,
    num_heads: u32,
    pages: &[u32],
    first_token: u32,
    staging: &StagingLayout,
    region: &WriterRegion,
) -> Result<CopyPlan> {
    let geometry = pool;
    let pool = pool.shape();
    pool.validate()?;
    let layer_bytes = staging.layer_bytes(region.heads.num_heads);
    let sized = region.layers as usize == region.layer_ids.len() && layer_bytes.checked_mul(region.layers as u64) == Some(region.kv_bytes());
    if !sized || region.offset.checked_add(region.bytes).is_none_or(|end| end > staging.total_bytes) {
        return Err(Error::invalid_arg(
            "region",
            format!(
                "[{}, +{}) with {} layers is not a region of this layout ({} bytes, {} per layer)",
                region.offset,
                region.bytes,
                region.layers,
                staging.total_bytes,
                layer_bytes
            ),
        ));
    }
    let list = super::agreed_field_mismatches(pool, &staging.dst);
    if !list.is_empty() {
        return Err(mismatch_error("pool and staging layout", list));
    }
    if num_heads != region.heads.num_heads {
        return Err(Error::invalid_arg("num_heads", format!("{num_heads} != the region's {} heads per row", region.heads.num_heads)));
    }
    if head_start as u64 + num_heads as u64 > pool.local_heads as u64 {
        return Err(Error::invalid_arg(
            "head_start",
            format!("heads {head_start}..{} exceed the pool's {} local heads", head_start as u64 + num_heads as u64, pool.local_heads),
        ));
    }
    let span = PageSpan { pages, first_token, tokens: staging.tokens as u64 };
    span.check(pool.page_size, "pages", "first_token")?;
    let pool_layers = pool.layer_count();
    let mut layer_idx = Vec::with_capacity(region.layer_ids.len());
    for &id in &region.layer_ids {
        let idx = pool.layer_index(id).ok_or_else(|| {
            mismatch_error(
                "pool lacks a layer the writer carries",
                vec![FieldMismatch {
                    field: format!("layer {id} of the region of prefill rank (tp {}, pp {})", region.src_tp_rank, region.src_pp_rank),
                    local: "absent from this pool's layer_ids".into(),
                    remote: format!("carried in {:?}", region.layer_ids),
                }],
            )
        })?;
        layer_idx.push(idx);
    }
    let mut slabs = Vec::with_capacity(layer_idx.len() * staging.buffers_per_layer as usize);
    for kv in 0..staging.buffers_per_layer {
        for (l, &idx) in layer_idx.iter().enumerate() {
            slabs.push(Slab {
                buffer: kv * pool_layers + idx,
                kv,
                staging_offset: staging.slab_in_region(num_heads, region.layers, kv, l as u32),
                layer_id: region.layer_ids[l],
            });
        }
    }
    let rows = |kv: u32| {
        let (strides, row_bytes, hb) = (geometry.strides_of(kv), staging.row_bytes(num_heads, kv), pool.head_bytes_of(kv));
        // Heads `strides.head` apart that are not adjacent make one piece per head.
        let (piece_bytes, piece_stride) = if num_heads == 1 || strides.head == hb { (row_bytes, row_bytes) } else { (hb, strides.head) };
        RowGeometry {
            pool_page_stride: strides.page,
            pool_token_stride: strides.token,
            pool_head_offset: head_start as u64 * strides.head,
            pool_piece_stride: piece_stride,
            piece_bytes,
            row_bytes,
        }
    };
    let last = staging.buffers_per_layer - 1;
    let linear = (0..=last).all(|kv| super::layout::is_linear(pool, geometry.strides_of(kv)));
    Ok(CopyPlan {
        pool_page_size: pool.page_size,
        rows: [rows(0), rows(last)],
        tokens: span.tokens,
        slabs,
        segments: span.segments(pool.page_size, linear),
        region_offset: region.offset,
        staging_bytes: region.kv_bytes(),
    })
}

/// The sender's plan: pool → `region`, using the region's source heads. The chunk may start
/// `first_token` slots into `pages[0]` (where the decode side's cached prefix, or the previous
/// chunk, ends inside a prefill page).
pub fn plan_gather<P: PoolGeometry + ?Sized>(
    pool: &P,
    pages: &[u32],
    first_token: u32,
    staging: &StagingLayout,
    region: &WriterRegion,
) -> Result<CopyPlan> {
    plan_chunk(pool, region.heads.src_head_start, region.heads.num_heads, pages, first_token, staging, region)
}

/// The receiver's plan: `region` → pool, using the region's destination heads. Decode chunks
/// start on a decode page (the grid's base, the cached prefix, is whole decode pages).
pub fn plan_scatter<P: PoolGeometry + ?Sized>(pool: &P, pages: &[u32], staging: &StagingLayout, region: &WriterRegion) -> Result<CopyPlan> {
    plan_chunk(pool, region.heads.dst_head_start, region.heads.num_heads, pages, 0, staging, region)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;
    use crate::geometry::{staging_layout, staging_layout_stages, ModelKind, PoolShape};

    fn shapes() -> (PoolShape, PoolShape) {
        let base = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 3);
        (base.clone().with_tp(3, 4), base.with_tp(1, 2))
    }

    /// Pieces keep every slab once, in region order, each piece one contiguous range of at least
    /// the bytes asked but the last, together the whole region.
    #[test]
    fn pieces_tile_the_region_in_order() {
        let src = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 6).with_tp(0, 2);
        let dst = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 6);
        let st = staging_layout(&src, &dst, 32).unwrap();
        let w = st.region_of(&src).unwrap().unwrap();
        let whole = plan_gather(&src, &[3, 1], 0, &st, &w).unwrap();
        let slab = whole.slab_bytes(&whole.slabs[0]);
        for piece_bytes in [1, slab - 1, slab, slab + 1, 5 * slab, 12 * slab, 100 * slab] {
            let pieces = whole.pieces_of(piece_bytes);
            let mut next = 0;
            for (i, p) in pieces.iter().enumerate() {
                let ranges = p.staging_ranges();
                assert_eq!(ranges.len(), 1, "piece {i} of {piece_bytes}-byte pieces is one range");
                assert_eq!(ranges[0].0, next, "piece {i} follows the one before");
                next += ranges[0].1;
                if i + 1 < pieces.len() {
                    assert!(p.bytes() >= piece_bytes && p.bytes() < piece_bytes + slab, "piece {i}: {} bytes for {piece_bytes}", p.bytes());
                }
            }
            assert_eq!(next, whole.staging_bytes, "{piece_bytes}-byte pieces cover the region");
            let mut slabs: Vec<Slab> = pieces.iter().flat_map(|p| p.slabs.iter().copied()).collect();
            slabs.sort_by_key(|s| s.staging_offset);
            let mut expected = whole.slabs.clone();
            expected.sort_by_key(|s| s.staging_offset);
            assert_eq!(slabs, expected, "every slab once");
        }
    }

    /// Any partition of the writer's layers splits the plan into parts whose ranges tile the
    /// region exactly once; a part holds only its layers' K and V slabs.
    #[test]
    fn layer_parts_tile_the_region_once() {
        let src = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 6).with_tp(0, 2);
        let dst = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 6);
        let st = staging_layout(&src, &dst, 32).unwrap();
        let w = st.region_of(&src).unwrap().unwrap();
        let whole = plan_gather(&src, &[3, 1], 0, &st, &w).unwrap();
        assert_eq!(whole.staging_ranges(), vec![(0, whole.staging_bytes)]);
        for parts in [vec![vec![0, 1, 2, 3, 4, 5]], vec![vec![5], vec![0, 2], vec![1, 3, 4]], vec![vec![4, 5], vec![0, 1, 2, 3]]] {
            let mut covered: Vec<(u64, u64)> = Vec::new();
            for part in &parts {
                let p = whole.for_layers(|l| part.contains(&l));
                assert_eq!(p.slabs.len(), part.len() * 2, "K and V of each layer of {part:?}");
                assert!(p.slabs.iter().all(|s| part.contains(&s.layer_id)));
                covered.extend(p.staging_ranges());
            }
            covered.sort_unstable();
            let mut next = 0;
            for (at, len) in covered {
                assert_eq!(at, next, "{parts:?}: a gap or an overlap at {at}");
                next = at + len;
            }
            assert_eq!(next, whole.staging_bytes, "{parts:?}");
        }
        assert!(whole.for_layers(|_| false).slabs.is_empty());
    }

    #[test]
    fn adjacent_pages_merge_and_full_heads_are_single_copies() {
        let (src, dst) = shapes();
        let st = staging_layout_stages(std::slice::from_ref(&src), &dst, 5 * 16).unwrap();
        let w = &st.writers[st.writer_for(&src).unwrap().unwrap() as usize];
        let pages = [7, 8, 9, 2, 3];
        let g = plan_gather(&src, &pages, 0, &st, w).unwrap();
        assert!(g.rows[0].contiguous());
        assert_eq!(g.segments, vec![
            Segment { pool_token: 7 * 16, staging_token: 0, tokens: 48 },
            Segment { pool_token: 2 * 16, staging_token: 48, tokens: 32 },
        ]);
        assert_eq!(g.slabs.len(), 6);
        assert_eq!(g.run_count(), 12);
        let runs: Vec<CopyRun> = g.runs().collect();
        assert_eq!(runs[1], CopyRun {
            buffer: 0,
            pool_offset: 32 * 512,
            staging_offset: 48 * 512,
            rows: 32,
            pool_row_stride: 512,
            pieces: 1,
            pool_piece_stride: 512,
            piece_bytes: 512,
        });
        assert_eq!(runs[11].buffer, 5);
        assert_eq!(runs[11].staging_offset, 5 * 80 * 512 + 48 * 512);
        assert_eq!(g.bytes(), 6 * 80 * 512);
        assert_eq!((g.region_offset, g.staging_bytes), (st.writers[1].offset, st.writers[1].bytes));
        // The receiver's slice is half of its token slot: strided rows.
        let s = plan_scatter(&dst, &pages, &st, w).unwrap();
        assert!(!s.rows[0].contiguous());
        let r: Vec<CopyRun> = s.runs().collect();
        assert_eq!(r[0], CopyRun {
            buffer: 0,
            pool_offset: 7 * 16 * 1024 + 2 * 256,
            staging_offset: 0,
            rows: 48,
            pool_row_stride: 1024,
            pieces: 1,
            pool_piece_stride: 512,
            piece_bytes: 512,
        });
    }

    /// Head-major pages (TensorRT-LLM's `[head][token][dim]`): a row is one piece per head, heads a
    /// page of tokens apart, and segments stop at every page (pages are not evenly spaced slots).
    #[test]
    fn head_major_pages_make_pieces_per_head() {
        let (src, dst) = shapes();
        let st = staging_layout_stages(std::slice::from_ref(&src), &dst, 5 * 16).unwrap();
        let w = &st.writers[st.writer_for(&src).unwrap().unwrap() as usize];
        let bases: Vec<usize> = (0..6).map(|i| 0x100_0000 * (i + 1)).collect();
        let hm = crate::geometry::Strides { page: 2 * 16 * 1024 * 2, token: 256, head: 16 * 256 };
        let pool = crate::geometry::KvLayout::new(dst.clone(), 16, crate::geometry::MemoryKind::Host, bases).with_strides(hm);
        pool.validate().unwrap();
        let s = plan_scatter(&pool, &[7, 8, 9, 2, 3], &st, w).unwrap();
        assert_eq!((s.rows[0].piece_bytes, s.rows[0].pool_piece_stride, s.rows[0].pieces(), s.rows[0].pool_token_stride), (256, 16 * 256, 2, 256));
        assert_eq!(s.segments.len(), 5, "one per page");
        assert_eq!(s.segments[1], Segment { pool_token: 8 * 16, staging_token: 16, tokens: 16 });
        let r = s.run(&s.slabs[0], &s.segments[1], 20, 24);
        assert_eq!(r, CopyRun {
            buffer: 0,
            pool_offset: 8 * hm.page + 4 * 256 + 2 * 16 * 256,
            staging_offset: 20 * 512,
            rows: 4,
            pool_row_stride: 256,
            pieces: 2,
            pool_piece_stride: 16 * 256,
            piece_bytes: 256,
        });
        assert!(!s.rows[0].contiguous());
    }

    #[test]
    fn plan_errors() {
        let (src, dst) = shapes();
        let st = staging_layout(&src, &dst, 32).unwrap();
        let w = &st.region_of(&src).unwrap().unwrap();
        let mut foreign = w.clone();
        foreign.offset = st.total_bytes - w.bytes + 1;
        let e = plan_chunk(&src, 0, 2, &[1, 2], 0, &st, &foreign).unwrap_err();
        assert!(e.message().contains("`region`") && e.message().contains("is not a region of this layout"), "{}", e.message());
        let e = plan_chunk(&src, 0, 2, &[1, 2, 3], 0, &st, w).unwrap_err();
        assert!(e.message().contains("`pages`: holds 3 pages, the tokens 0..32 of its pages (page_size 16) need 2"), "{}", e.message());
        let e = plan_chunk(&src, 0, 2, &[1, 2], 16, &st, w).unwrap_err();
        assert!(e.message().contains("`first_token`: 16 is not inside the first page"), "{}", e.message());
        let e = plan_chunk(&src, 1, 2, &[1, 2], 0, &st, w).unwrap_err();
        assert!(e.message().contains("`head_start`: heads 1..3 exceed the pool's 2 local heads"), "{}", e.message());
        let e = plan_chunk(&dst, 0, 1, &[1, 2], 0, &st, w).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("`num_heads`: 1 != the region's 2 heads per row"), "{}", e.message());
        let mut other = src.clone();
        other.dtype_bytes = 4;
        let e = plan_chunk(&other, 0, 2, &[1, 2], 0, &st, w).unwrap_err();
        assert_eq!(e.causes(), vec!["dtype_bytes: local 4 != remote 2"]);
        let fewer = src.clone().with_pp(0, 1, vec![0, 2]);
        let e = plan_chunk(&fewer, 0, 2, &[1, 2], 0, &st, w).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert!(e.causes()[0].starts_with("layer 1 of the region of prefill rank (tp 3, pp 0): local absent"), "{:?}", e.causes());
        let mut bad = src.clone();
        bad.page_size = 0;
        assert_eq!(plan_chunk(&bad, 0, 2, &[1, 2], 0, &st, w).unwrap_err().code(), Status::KVSTAGE_E_GEOMETRY_INVALID);
    }
}
