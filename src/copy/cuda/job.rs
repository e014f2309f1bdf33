//! The device form of a [`CopyPlan`]: flat tables the kernels read, the kernel parameter block,
//! the vector width, the grid, and the split of a plan into pieces that fit a scratch buffer; and
//! the same for direct mode's pair of plans (one pool's rows into another's).
//! Pure functions (no driver), tested on the CPU and through the kernel emulator.

use crate::copy::rows::fused_runs;
use crate::geometry::CopyPlan;

/// Staging tokens per block tile (`TILE` in kernels.cu).
pub const TILE: u64 = 32;
/// Slabs per block (`SLABS` in kernels.cu).
pub const SLABS: u64 = 4;
/// Threads per block (`THREADS` in kernels.cu).
pub const THREADS: u32 = 256;

/// `struct KvJob` of kernels.cu, field for field (pointers as device addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvJob {
    pub bases: u64,
    pub slab_buffer: u64,
    pub slab_offset: u64,
    pub seg_start: u64,
    pub seg_pool: u64,
    pub staging: u64,
    pub nslab: u64,
    pub nseg: u64,
    pub tokens: u64,
    pub pool_token_stride: u64,
    pub pool_head_offset: u64,
    pub row_bytes: u64,
    pub piece_bytes: u64,
    pub pool_piece_stride: u64,
}

/// The plan's tables as one array of u64 words, uploaded once per gather/scatter:
/// `bases[nbuf] | slab_buffer[nslab] | slab_offset[nslab] | seg_start[nseg + 1] | seg_pool[nseg]`
/// (`seg_pool`: the byte offset of the segment's first token in a buffer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tables {
    pub words: Vec<u64>,
    nbuf: usize,
    nslab: usize,
    nseg: usize,
}

impl Tables {
    pub fn new(plan: &CopyPlan, bases: &[usize]) -> Tables {
        let (nbuf, nslab, nseg) = (bases.len(), plan.slabs.len(), plan.segments.len());
        let mut words = Vec::with_capacity(nbuf + 2 * nslab + 2 * nseg + 1);
        words.extend(bases.iter().map(|&b| b as u64));
        words.extend(plan.slabs.iter().map(|s| s.buffer as u64));
        words.extend(plan.slabs.iter().map(|s| s.staging_offset));
        words.extend(plan.segments.iter().map(|s| s.staging_token));
        words.push(plan.tokens);
        let g = plan.uniform_rows();
        words.extend(plan.segments.iter().map(|s| plan.slot_offset(g, s.pool_token)));
        Tables { words, nbuf, nslab, nseg }
    }

    pub fn bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }

    /// The kernel parameters for slabs `[s0, s1)` of the plan with the tables at device address
    /// `table`, writing/reading staging byte `slab_offset[s0]` at device address `staging_at`.
    pub fn job(&self, plan: &CopyPlan, table: u64, s0: usize, s1: usize, staging_at: u64) -> KvJob {
        let word = |i: usize| table + 8 * i as u64;
        let slab_buffer = word(self.nbuf);
        let slab_offset = word(self.nbuf + self.nslab);
        let seg_start = word(self.nbuf + 2 * self.nslab);
        let seg_pool = word(self.nbuf + 2 * self.nslab + self.nseg + 1);
        let first = plan.slabs.get(s0).map_or(0, |s| s.staging_offset);
        let g = plan.uniform_rows();
        KvJob {
            bases: word(0),
            slab_buffer: slab_buffer + 8 * s0 as u64,
            slab_offset: slab_offset + 8 * s0 as u64,
            seg_start,
            seg_pool,
            // Wrapping: the kernel adds slab_offset[s] >= first back.
            staging: staging_at.wrapping_sub(first),
            nslab: (s1 - s0) as u64,
            nseg: self.nseg as u64,
            tokens: plan.tokens,
            pool_token_stride: g.pool_token_stride,
            pool_head_offset: g.pool_head_offset,
            row_bytes: g.row_bytes,
            piece_bytes: g.piece_bytes,
            pool_piece_stride: g.pool_piece_stride,
        }
    }
}

/// The widest access (16, 8, 4, 2 or 1 bytes) that every address of the job is aligned to:
/// the bases of the buffers the plan reads, the staging address, every slab offset, the pool's
/// strides, the head offset, the row and piece sizes.
pub fn vector_width(plan: &CopyPlan, bases: &[usize], staging_at: u64) -> u32 {
    let g = plan.uniform_rows();
    let mut acc = g.pool_page_stride | g.pool_token_stride | g.pool_piece_stride | g.pool_head_offset | g.row_bytes | g.piece_bytes | staging_at;
    for s in &plan.slabs {
        acc |= s.staging_offset;
        acc |= bases.get(s.buffer as usize).copied().unwrap_or(1) as u64;
    }
    // Relative to the first slab, as the kernel sees them (staging_at is that slab's address).
    if let Some(first) = plan.slabs.first() {
        for s in &plan.slabs {
            acc |= s.staging_offset.wrapping_sub(first.staging_offset);
        }
    }
    (1u64 << acc.trailing_zeros().min(4)) as u32
}

/// `struct KvAcross` of kernels.cu, field for field (pointers as device addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvAcross {
    pub src_bases: u64,
    pub dst_bases: u64,
    pub slab_src: u64,
    pub slab_dst: u64,
    pub run_start: u64,
    pub run_src: u64,
    pub run_dst: u64,
    pub nslab: u64,
    pub nrun: u64,
    pub tokens: u64,
    pub src_token_stride: u64,
    pub src_head_offset: u64,
    pub dst_token_stride: u64,
    pub dst_head_offset: u64,
    pub row_bytes: u64,
    pub piece_bytes: u64,
    pub src_piece_stride: u64,
    pub dst_piece_stride: u64,
}

/// A gather plan and a scatter plan of the same region (slabs paired, see
/// [`crate::copy::rows::check_paired`]) as one array of u64 words, uploaded once per copy:
/// `src_bases | dst_bases | slab_src[nslab] | slab_dst[nslab] | run_start[nrun + 1] |
/// run_src[nrun] | run_dst[nrun]`, the runs being the two plans' segments merged (`run_src`,
/// `run_dst`: byte offsets of the run's first token in a buffer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcrossTables {
    pub words: Vec<u64>,
    nsrc: usize,
    ndst: usize,
    nslab: usize,
    nrun: usize,
}

impl AcrossTables {
    pub fn new(src: &CopyPlan, src_bases: &[usize], dst: &CopyPlan, dst_bases: &[usize]) -> AcrossTables {
        let runs = fused_runs(&src.segments, &dst.segments);
        let (nsrc, ndst, nslab, nrun) = (src_bases.len(), dst_bases.len(), src.slabs.len(), runs.len());
        let mut words = Vec::with_capacity(nsrc + ndst + 2 * nslab + 3 * nrun + 1);
        words.extend(src_bases.iter().chain(dst_bases).map(|&b| b as u64));
        words.extend(src.slabs.iter().map(|s| s.buffer as u64));
        words.extend(dst.slabs.iter().map(|s| s.buffer as u64));
        let mut at = 0;
        for r in &runs {
            words.push(at);
            at += r.2;
        }
        words.push(at);
        words.extend(runs.iter().map(|r| src.slot_offset(src.uniform_rows(), r.0)));
        words.extend(runs.iter().map(|r| dst.slot_offset(dst.uniform_rows(), r.1)));
        AcrossTables { words, nsrc, ndst, nslab, nrun }
    }

    pub fn bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }

    /// The kernel parameters with the tables at device address `table`.
    pub fn job(&self, src: &CopyPlan, dst: &CopyPlan, table: u64) -> KvAcross {
        let word = |i: usize| table + 8 * i as u64;
        let slabs = self.nsrc + self.ndst;
        let runs = slabs + 2 * self.nslab;
        KvAcross {
            src_bases: word(0),
            dst_bases: word(self.nsrc),
            slab_src: word(slabs),
            slab_dst: word(slabs + self.nslab),
            run_start: word(runs),
            run_src: word(runs + self.nrun + 1),
            run_dst: word(runs + 2 * self.nrun + 1),
            nslab: self.nslab as u64,
            nrun: self.nrun as u64,
            tokens: src.tokens,
            src_token_stride: src.uniform_rows().pool_token_stride,
            src_head_offset: src.uniform_rows().pool_head_offset,
            dst_token_stride: dst.uniform_rows().pool_token_stride,
            dst_head_offset: dst.uniform_rows().pool_head_offset,
            row_bytes: src.uniform_rows().row_bytes,
            piece_bytes: across_piece(src, dst),
            src_piece_stride: across_piece_stride(src, dst),
            dst_piece_stride: across_piece_stride(dst, src),
        }
    }
}

/// The widest access (16, 8, 4, 2 or 1 bytes) every row of a direct copy is aligned to on both
/// sides: the bases of the buffers the plans use, strides, head offsets, the row and piece sizes.
pub fn across_width(src: &CopyPlan, src_bases: &[usize], dst: &CopyPlan, dst_bases: &[usize]) -> u32 {
    let mut acc = src.uniform_rows().row_bytes | across_piece(src, dst);
    for (plan, bases) in [(src, src_bases), (dst, dst_bases)] {
        let g = plan.uniform_rows();
        acc |= g.pool_page_stride | g.pool_token_stride | g.pool_piece_stride | g.pool_head_offset;
        for s in &plan.slabs {
            acc |= bases.get(s.buffer as usize).copied().unwrap_or(1) as u64;
        }
    }
    (1u64 << acc.trailing_zeros().min(4)) as u32
}

/// The piece a direct copy moves at a time: a head where either side puts heads apart.
pub fn across_piece(a: &CopyPlan, b: &CopyPlan) -> u64 {
    a.uniform_rows().piece_bytes.min(b.uniform_rows().piece_bytes)
}

/// `plan`'s stride between the pieces of [`across_piece`] (adjacent where its row is one piece).
fn across_piece_stride(plan: &CopyPlan, other: &CopyPlan) -> u64 {
    let (len, g) = (across_piece(plan, other), plan.uniform_rows());
    if g.piece_bytes == len {
        g.pool_piece_stride
    } else {
        len
    }
}

/// Grid caps (x over token tiles, y over slab groups); the kernels stride over the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridLimits {
    pub x: u32,
    pub y: u32,
}

impl Default for GridLimits {
    fn default() -> Self {
        GridLimits { x: 1 << 20, y: 65_535 }
    }
}

/// Grid for `tokens` staging tokens and `nslab` slabs.
pub fn grid(tokens: u64, nslab: u64, limits: GridLimits) -> (u32, u32) {
    let x = tokens.div_ceil(TILE).clamp(1, limits.x as u64) as u32;
    let y = nslab.div_ceil(SLABS).clamp(1, limits.y as u64) as u32;
    (x, y)
}

/// Slab ranges `[s0, s1)` whose staging bytes are one contiguous range of at most `max_bytes`
/// (a single slab larger than that is a piece of its own): the units a bounded scratch buffer is
/// filled and drained in. Returns `(s0, s1, staging_start, bytes)`.
pub fn pieces(plan: &CopyPlan, max_bytes: u64) -> Vec<(usize, usize, u64, u64)> {
    let slab = plan.tokens * plan.uniform_rows().row_bytes;
    let mut out: Vec<(usize, usize, u64, u64)> = Vec::new();
    for (i, s) in plan.slabs.iter().enumerate() {
        match out.last_mut() {
            Some(p) if p.2 + p.3 == s.staging_offset && p.3 + slab <= max_bytes => {
                p.1 = i + 1;
                p.3 += slab;
            }
            _ => out.push((i, i + 1, s.staging_offset, slab)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{plan_gather, plan_scatter, staging_layout, ModelKind, PoolShape};

    fn plans() -> (CopyPlan, CopyPlan) {
        let base = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 3);
        let (src, dst) = (base.clone().with_tp(3, 4), base.with_tp(1, 2));
        let st = staging_layout(&src, &dst, 5 * 16).unwrap();
        let w = &st.region_of(&src).unwrap().unwrap();
        let pages = [7, 8, 9, 2, 3];
        (plan_gather(&src, &pages, 0, &st, w).unwrap(), plan_scatter(&dst, &pages, &st, w).unwrap())
    }

    #[test]
    fn tables_and_job_point_at_the_plan() {
        let (g, _) = plans();
        let bases: Vec<usize> = (0..6).map(|i| 0x1000_0000 + i * 0x10_0000).collect();
        let t = Tables::new(&g, &bases);
        assert_eq!(t.words.len(), 6 + 2 * 6 + 2 * 2 + 1);
        assert_eq!(&t.words[..6], &bases.iter().map(|&b| b as u64).collect::<Vec<_>>()[..]);
        assert_eq!(t.words[6..12], [0, 1, 2, 3, 4, 5]);
        assert_eq!(t.words[12], g.slabs[0].staging_offset);
        assert_eq!(t.words[18..21], [0, 48, 80]);
        assert_eq!(t.words[21..23], [7 * 16 * 512, 2 * 16 * 512]);
        let j = t.job(&g, 0x9000, 2, 5, 0x5_0000);
        assert_eq!(j.bases, 0x9000);
        assert_eq!(j.slab_buffer, 0x9000 + 8 * (6 + 2));
        assert_eq!(j.slab_offset, 0x9000 + 8 * (12 + 2));
        assert_eq!(j.seg_start, 0x9000 + 8 * 18);
        assert_eq!(j.seg_pool, 0x9000 + 8 * 21);
        assert_eq!(j.nslab, 3);
        assert_eq!(j.staging.wrapping_add(g.slabs[2].staging_offset), 0x5_0000);
        assert_eq!((j.tokens, j.row_bytes, j.pool_token_stride, j.piece_bytes), (80, 512, 512, 512));
        assert_eq!(std::mem::size_of::<KvJob>(), 112);
    }

    #[test]
    fn vector_width_is_the_common_alignment() {
        let (g, s) = plans();
        let bases: Vec<usize> = (0..6).map(|i| 0x1000_0000 + i * 0x10_0000).collect();
        assert_eq!(vector_width(&g, &bases, 0x7000_0000), 16);
        assert_eq!(vector_width(&s, &bases, 0x7000_0000), 16);
        assert_eq!(vector_width(&g, &bases, 0x7000_0008), 8);
        let mut odd = bases.clone();
        odd[5] += 2;
        assert_eq!(vector_width(&g, &odd, 0x7000_0000), 2);
        let mut g3 = g.clone();
        for r in &mut g3.rows {
            (r.row_bytes, r.piece_bytes) = (12, 12);
        }
        assert_eq!(vector_width(&g3, &bases, 0), 4);
        for r in &mut g3.rows {
            r.pool_head_offset = 1;
        }
        assert_eq!(vector_width(&g3, &bases, 0), 1);
    }

    /// Strided pools: TensorRT-LLM's blocks (heads a page of tokens apart, pages not evenly
    /// spaced) gathering a head slice, sglang's token-major pool scattering it; the tables hold
    /// byte offsets by page and token stride, the jobs the pieces, and a direct copy either way
    /// moves one head at a time with each side's own piece stride.
    #[test]
    fn tables_and_jobs_of_strided_pools() {
        use crate::geometry::{KvLayout, LayoutPreset, MemoryKind};
        let shape = PoolShape::new(ModelKind::Mha, 4, 32, 2, 4, 2);
        let (full, half) = (shape.clone(), shape.with_tp(1, 2));
        let pool = |shape: &PoolShape, preset: LayoutPreset, base: usize| {
            KvLayout::new(shape.clone(), 8, MemoryKind::Cuda, preset.bases(shape, 8, base)).with_strides(preset.placement(shape, 8).strides)
        };
        let trt = pool(&full, LayoutPreset::Trtllm, 0x100_0000);
        let sgl = pool(&half, LayoutPreset::Sglang, 0x200_0000);
        // TensorRT-LLM, 4 heads of 64 bytes, pages of 4 tokens, 2 layers: a block is
        // [layer][K/V][head][token] = 2·2·4·4·64 bytes, heads 4·64 apart, tokens 64 apart.
        assert_eq!((trt.strides.page, trt.strides.token, trt.strides.head), (4096, 64, 256));
        let st = staging_layout(&full, &half, 12).unwrap();
        let w = st.region_of(&full).unwrap().unwrap();
        let g = plan_gather(&trt, &[5, 2, 3], 0, &st, &w).unwrap();
        let s = plan_scatter(&sgl, &[6, 7, 1], &st, &w).unwrap();
        let t = Tables::new(&g, &trt.bases);
        assert_eq!(t.words[12..16], [0, 4, 8, 12], "one segment per page");
        assert_eq!(t.words[16..19], [5 * 4096, 2 * 4096, 3 * 4096], "seg_pool: page · page stride");
        let j = t.job(&g, 0x9000, 0, 4, 0x5_0000);
        assert_eq!((j.nseg, j.tokens, j.row_bytes), (3, 12, 128));
        assert_eq!((j.pool_token_stride, j.pool_head_offset, j.piece_bytes, j.pool_piece_stride), (64, 2 * 256, 64, 256));
        assert_eq!(vector_width(&g, &trt.bases, 0x5_0000), 16);
        let ts = Tables::new(&s, &sgl.bases);
        assert_eq!(ts.words[12..15], [0, 8, 12], "adjacent pages of a token-major pool merge");
        assert_eq!(ts.words[15..17], [6 * 4 * 128, 4 * 128]);
        let js = ts.job(&s, 0x9000, 0, 4, 0x5_0000);
        assert_eq!((js.pool_token_stride, js.pool_head_offset, js.piece_bytes, js.pool_piece_stride), (128, 0, 128, 128));

        // Direct, trtllm -> sglang: runs where either side's segment ends; a head at a time.
        let a = AcrossTables::new(&g, &trt.bases, &s, &sgl.bases);
        assert_eq!(a.words[16..20], [0, 4, 8, 12]);
        assert_eq!(a.words[20..23], [5 * 4096, 2 * 4096, 3 * 4096]);
        assert_eq!(a.words[23..26], [24 * 128, 28 * 128, 4 * 128]);
        let ja = a.job(&g, &s, 0x9000);
        assert_eq!((ja.nrun, ja.tokens, ja.row_bytes, ja.piece_bytes), (3, 12, 128, 64));
        assert_eq!((ja.src_token_stride, ja.src_head_offset, ja.src_piece_stride), (64, 512, 256));
        assert_eq!((ja.dst_token_stride, ja.dst_head_offset, ja.dst_piece_stride), (128, 0, 64));
        assert_eq!(across_width(&g, &trt.bases, &s, &sgl.bases), 16);
        let mut odd = sgl.bases.clone();
        odd[3] += 8;
        assert_eq!(across_width(&g, &trt.bases, &s, &odd), 8);

        // The other way, sglang -> trtllm: the sglang side's heads are adjacent (stride 64).
        let sgl_full = pool(&full, LayoutPreset::Sglang, 0x300_0000);
        let trt_half = pool(&half, LayoutPreset::Trtllm, 0x400_0000);
        let g2 = plan_gather(&sgl_full, &[5, 2, 3], 0, &st, &w).unwrap();
        let s2 = plan_scatter(&trt_half, &[6, 7, 1], &st, &w).unwrap();
        assert_eq!((g2.rows[0].piece_bytes, g2.rows[0].pool_head_offset), (128, 2 * 64));
        let j2 = AcrossTables::new(&g2, &sgl_full.bases, &s2, &trt_half.bases).job(&g2, &s2, 0x9000);
        assert_eq!((j2.piece_bytes, j2.src_piece_stride, j2.dst_piece_stride), (64, 64, 4 * 64));
        assert_eq!((j2.src_token_stride, j2.dst_token_stride, j2.dst_head_offset), (256, 64, 0));
    }

    #[test]
    fn grid_and_pieces() {
        assert_eq!(grid(80, 6, GridLimits::default()), (3, 2));
        assert_eq!(grid(0, 0, GridLimits::default()), (1, 1));
        assert_eq!(grid(1 << 30, 1 << 20, GridLimits { x: 7, y: 3 }), (7, 3));
        let (g, _) = plans();
        let slab = 80 * 512;
        assert_eq!(pieces(&g, u64::MAX), vec![(0, 6, g.slabs[0].staging_offset, 6 * slab)]);
        let p = pieces(&g, 2 * slab + 1);
        assert_eq!(p.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), vec![(0, 2), (2, 4), (4, 6)]);
        assert_eq!(p[1].2, g.slabs[2].staging_offset);
        assert_eq!(pieces(&g, 1).len(), 6);
        let mut gap = g.clone();
        gap.slabs[3].staging_offset += 512;
        assert_eq!(pieces(&gap, u64::MAX).iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), vec![(0, 3), (3, 4), (4, 6)]);
    }
}
