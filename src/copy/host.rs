//! The host-memory copy engine: memcpy per run, large plans split across threads.

use super::{check_plan, CopyEngine};
use crate::error::{Error, Result, Status};
use crate::geometry::{CopyPlan, KvLayout, MemoryKind};

/// Plans moving fewer bytes than this run on the calling thread only.
const DEFAULT_MIN_PARALLEL_BYTES: u64 = 1 << 20;
/// Plans moving at least this many bytes write with non-temporal (streaming) stores.
const DEFAULT_STREAMING_MIN_BYTES: u64 = 4 << 20;
/// Gather prefetches the first bytes of the segment this many segments ahead.
const PREFETCH_SEGMENTS: usize = 4;
const PREFETCH_BYTES: u64 = 1024;

/// Gather/scatter between host-memory pools and host staging buffers.
///
/// A plan is cut into `threads` byte-balanced parts of its `slabs × tokens` rows (cuts may fall
/// inside a run); the calling thread executes one part and scoped threads the others. Contiguous
/// runs are single copies; strided runs (a head slice of each token slot) copy row by row. Large
/// plans write with non-temporal stores on x86-64 (the destination of a chunk copy is not read
/// again soon: the staging bytes go to the network, the pool rows to a later decode step), which
/// avoids reading every destination line before overwriting it; small plans use `memcpy`.
#[derive(Clone, Debug)]
pub struct HostCopyEngine {
    threads: u32,
    min_parallel_bytes: u64,
    streaming_min_bytes: u64,
}

impl HostCopyEngine {
    /// An engine using up to `threads` threads per plan (clamped to 1..=256).
    pub fn new(threads: u32) -> HostCopyEngine {
        HostCopyEngine {
            threads: threads.clamp(1, 256),
            min_parallel_bytes: DEFAULT_MIN_PARALLEL_BYTES,
            streaming_min_bytes: DEFAULT_STREAMING_MIN_BYTES,
        }
    }

    /// Plans of at least `bytes` use non-temporal stores (default 4 MiB); `u64::MAX` never does.
    pub fn with_streaming_min_bytes(mut self, bytes: u64) -> HostCopyEngine {
        self.streaming_min_bytes = bytes;
        self
    }

    /// Plans smaller than `bytes` run on the calling thread (default 1 MiB); 0 always splits.
    pub fn with_min_parallel_bytes(mut self, bytes: u64) -> HostCopyEngine {
        self.min_parallel_bytes = bytes;
        self
    }

    pub fn threads(&self) -> u32 {
        self.threads
    }

    fn execute(&self, plan: &CopyPlan, pool: &KvLayout, staging: usize, dir: Dir) -> Result<()> {
        if pool.memory != MemoryKind::Host {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!("the host copy engine cannot access a {:?} pool", pool.memory),
            ));
        }
        check_plan(plan, pool)?;
        if plan.tokens == 0 || plan.slabs.is_empty() {
            return Ok(());
        }
        if staging == 0 {
            return Err(Error::invalid_arg("staging", "is NULL"));
        }
        let streaming = plan.bytes() >= self.streaming_min_bytes && nt::AVAILABLE;
        let job = Job { plan, bases: &pool.bases, staging, dir, streaming };
        let units = plan.slabs.len() as u64 * plan.tokens;
        let parts = if plan.bytes() < self.min_parallel_bytes { 1 } else { (self.threads as u64).min(units) };
        if parts <= 1 {
            job.run(0, units);
            return Ok(());
        }
        let cut = |k: u64| (units as u128 * k as u128 / parts as u128) as u64;
        std::thread::scope(|scope| {
            for k in 1..parts {
                let job = &job;
                let (a, b) = (cut(k), cut(k + 1));
                scope.spawn(move || job.run(a, b));
            }
            job.run(0, cut(1));
        });
        Ok(())
    }
}

impl CopyEngine for HostCopyEngine {
    unsafe fn gather(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8) -> Result<()> {
        self.execute(plan, pool, staging as usize, Dir::Gather)
    }

    unsafe fn scatter(&self, plan: &CopyPlan, pool: &KvLayout, staging: *const u8) -> Result<()> {
        self.execute(plan, pool, staging as usize, Dir::Scatter)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Gather,
    Scatter,
}

/// One checked plan on one pool and staging region; addresses as `usize` so it can be shared by
/// the scoped threads (the caller of `gather`/`scatter` vouched for them).
struct Job<'a> {
    plan: &'a CopyPlan,
    bases: &'a [usize],
    staging: usize,
    dir: Dir,
    streaming: bool,
}

impl Job<'_> {
    /// Executes rows `[a, b)` of the flattened `(slab, token)` space.
    fn run(&self, a: u64, b: u64) {
        self.run_rows(a, b);
        if self.streaming {
            // Non-temporal stores are weakly ordered: make them visible before the part ends.
            nt::fence();
        }
    }

    fn run_rows(&self, a: u64, b: u64) {
        let plan = self.plan;
        let t_total = plan.tokens;
        let mut pos = a;
        while pos < b {
            let slab = &plan.slabs[(pos / t_total) as usize];
            let first = pos % t_total;
            let last = t_total.min(first + (b - pos));
            let base = self.bases[slab.buffer as usize];
            let mut g = plan.segments.partition_point(|s| s.staging_token + s.tokens <= first);
            let mut t = first;
            while t < last {
                if self.dir == Dir::Gather {
                    // Random page lists make the pool reads latency-bound: start the reads of a
                    // segment a few segments ahead.
                    if let Some(ahead) = plan.segments.get(g + PREFETCH_SEGMENTS) {
                        let at = base + (ahead.pool_token * plan.pool_token_bytes + plan.pool_head_offset) as usize;
                        nt::prefetch(at, plan.row_bytes.min(PREFETCH_BYTES) as usize);
                    }
                }
                let seg = plan.segments[g];
                let end = last.min(seg.staging_token + seg.tokens);
                let off = t - seg.staging_token;
                let pool_at = base + ((seg.pool_token + off) * plan.pool_token_bytes + plan.pool_head_offset) as usize;
                let stg_at = self.staging + (slab.staging_offset + t * plan.row_bytes) as usize;
                // SAFETY: `check_plan` bounded every segment by the pool capacity and every slab by
                // the staging region; the caller of gather/scatter vouched for both address ranges.
                unsafe { self.copy(pool_at, stg_at, end - t) };
                t = end;
                g += 1;
            }
            pos += last - first;
        }
    }

    /// Copies `rows` token rows between a pool address and a staging address.
    unsafe fn copy(&self, pool_at: usize, stg_at: usize, rows: u64) {
        let plan = self.plan;
        let (row, stride) = (plan.row_bytes as usize, plan.pool_token_bytes as usize);
        let (src, dst, src_stride, dst_stride) = match self.dir {
            Dir::Gather => (pool_at, stg_at, stride, row),
            Dir::Scatter => (stg_at, pool_at, row, stride),
        };
        let rows = rows as usize;
        // SAFETY: see `run`.
        unsafe {
            if self.streaming {
                if row == stride {
                    nt::copy(src as *const u8, dst as *mut u8, row * rows);
                } else {
                    for i in 0..rows {
                        nt::copy((src + i * src_stride) as *const u8, (dst + i * dst_stride) as *mut u8, row);
                    }
                }
                return;
            }
            if row == stride {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, row * rows);
                return;
            }
            match row {
                64 => strided::<64>(src, dst, src_stride, dst_stride, rows),
                128 => strided::<128>(src, dst, src_stride, dst_stride, rows),
                256 => strided::<256>(src, dst, src_stride, dst_stride, rows),
                512 => strided::<512>(src, dst, src_stride, dst_stride, rows),
                1024 => strided::<1024>(src, dst, src_stride, dst_stride, rows),
                _ => {
                    for i in 0..rows {
                        std::ptr::copy_nonoverlapping(
                            (src + i * src_stride) as *const u8,
                            (dst + i * dst_stride) as *mut u8,
                            row,
                        );
                    }
                }
            }
        }
    }
}

/// `rows` copies of `N` bytes with a fixed size the compiler can unroll.
#[inline(always)]
unsafe fn strided<const N: usize>(src: usize, dst: usize, src_stride: usize, dst_stride: usize, rows: usize) {
    for i in 0..rows {
        // SAFETY: the caller guarantees `rows` rows of `N` bytes at both strides.
        unsafe {
            std::ptr::copy_nonoverlapping((src + i * src_stride) as *const u8, (dst + i * dst_stride) as *mut u8, N);
        }
    }
}

/// Copies with non-temporal stores (x86-64 SSE2, part of the baseline ISA); elsewhere `memcpy`.
mod nt {
    #[cfg(target_arch = "x86_64")]
    pub const AVAILABLE: bool = true;
    #[cfg(not(target_arch = "x86_64"))]
    pub const AVAILABLE: bool = false;

    /// `len` bytes from `src` to `dst` (not overlapping): the unaligned head and the tail with
    /// `memcpy`, the 16-byte aligned middle with streaming stores.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // SAFETY: the caller guarantees `len` readable bytes at `src` and writable at `dst`.
        unsafe {
            let head = ((dst as usize).wrapping_neg() & 15).min(len);
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (mut s, mut d, mut n) = (src.add(head), dst.add(head), len - head);
            while n >= 64 {
                let a = _mm_loadu_si128(s as *const __m128i);
                let b = _mm_loadu_si128(s.add(16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(48) as *const __m128i);
                _mm_stream_si128(d as *mut __m128i, a);
                _mm_stream_si128(d.add(16) as *mut __m128i, b);
                _mm_stream_si128(d.add(32) as *mut __m128i, c);
                _mm_stream_si128(d.add(48) as *mut __m128i, e);
                s = s.add(64);
                d = d.add(64);
                n -= 64;
            }
            while n >= 16 {
                _mm_stream_si128(d as *mut __m128i, _mm_loadu_si128(s as *const __m128i));
                s = s.add(16);
                d = d.add(16);
                n -= 16;
            }
            std::ptr::copy_nonoverlapping(s, d, n);
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    #[inline]
    pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }

    /// Hints the cache lines of `[at, at + len)` into the cache (never faults).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub fn prefetch(at: usize, len: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut p = at & !63;
        while p < at + len {
            // SAFETY: prefetch is a hint; it does not fault on any address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
            p += 64;
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn prefetch(_at: usize, _len: usize) {}

    #[cfg(target_arch = "x86_64")]
    pub fn fence() {
        // SAFETY: sfence has no preconditions.
        unsafe { std::arch::x86_64::_mm_sfence() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn fence() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{plan_gather, plan_scatter, staging_layout, ModelKind, PoolShape};

    struct Pool {
        mem: Vec<u8>,
        layout: KvLayout,
    }

    fn pool(shape: PoolShape, capacity_pages: u64, fill: impl Fn(usize) -> u8) -> Pool {
        let bb = (capacity_pages * shape.page_bytes()) as usize;
        let nb = (shape.buffers_per_layer() * shape.layer_count()) as usize;
        let mut mem: Vec<u8> = (0..bb * nb).map(fill).collect();
        let base = mem.as_mut_ptr() as usize;
        let layout = KvLayout { shape, capacity_pages, memory: MemoryKind::Host, bases: (0..nb).map(|i| base + i * bb).collect() };
        Pool { mem, layout }
    }

    #[test]
    fn gather_then_scatter_moves_the_slice_and_nothing_else() {
        let base = PoolShape::new(ModelKind::Mha, 4, 4, 2, 2, 2);
        let (src_shape, dst_shape) = (base.clone().with_tp(1, 2), base.with_tp(0, 1));
        let src = pool(src_shape.clone(), 4, |i| (i % 251) as u8);
        let dst = pool(dst_shape.clone(), 4, |_| 0xEE);
        let st = staging_layout(&src_shape, &dst_shape, 4).unwrap();
        let w = st.writer_for(&src_shape).unwrap().unwrap();
        let (sp, dp) = ([3u32, 0], [1u32, 2]);
        let mut buf = vec![0u8; st.writers[w as usize].bytes as usize];
        for (threads, streaming) in [(1, 0), (3, 0), (2, u64::MAX)] {
            let eng = HostCopyEngine::new(threads).with_min_parallel_bytes(0).with_streaming_min_bytes(streaming);
            let g = plan_gather(&src_shape, &sp, &st, w).unwrap();
            unsafe { eng.gather(&g, &src.layout, buf.as_mut_ptr()) }.unwrap();
            let s = plan_scatter(&dst_shape, &dp, &st, w).unwrap();
            unsafe { eng.scatter(&s, &dst.layout, buf.as_ptr()) }.unwrap();
        }
        // Check by hand: src token slot = 2 heads × 4 × 2 = 16 bytes; dst slot 32 bytes, heads 2..4.
        let (sbb, dbb) = (4 * 2 * 16, 4 * 2 * 32);
        for b in 0..4 {
            for (i, (&s, &d)) in sp.iter().zip(&dp).enumerate() {
                for t in 0..2 {
                    let so = b * sbb + (s as usize * 2 + t) * 16;
                    let doff = b * dbb + (d as usize * 2 + t) * 32;
                    assert_eq!(&dst.mem[doff + 16..doff + 32], &src.mem[so..so + 16], "buffer {b} page {i} token {t}");
                    assert!(dst.mem[doff..doff + 16].iter().all(|&x| x == 0xEE));
                }
            }
            for p in [0usize, 3] {
                assert!(dst.mem[b * dbb + p * 64..b * dbb + p * 64 + 64].iter().all(|&x| x == 0xEE));
            }
        }
    }

    #[test]
    fn engine_rejects_bad_plans_before_copying() {
        let shape = PoolShape::new(ModelKind::Mha, 2, 4, 2, 2, 1);
        let p = pool(shape.clone(), 2, |_| 1);
        let st = staging_layout(&shape, &shape, 4).unwrap();
        let eng = HostCopyEngine::new(2);
        let mut buf = vec![0u8; st.total_bytes as usize];
        let g = plan_gather(&shape, &[1, 2], &st, 0).unwrap();
        let e = unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("pool tokens 2..6 (pages 1..) lie outside the pool's 2 pages"), "{}", e.message());
        let mut g = plan_gather(&shape, &[1, 0], &st, 0).unwrap();
        g.staging_bytes -= 1;
        let e = unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_STAGING_TOO_SMALL);
        let mut g = plan_gather(&shape, &[1, 0], &st, 0).unwrap();
        g.slabs[1].buffer = 2;
        assert_eq!(unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        let g = plan_gather(&shape, &[1, 0], &st, 0).unwrap();
        let e = unsafe { eng.gather(&g, &p.layout, std::ptr::null_mut()) }.unwrap_err();
        assert!(e.message().contains("`staging`: is NULL"));
        let mut cuda = p.layout.clone();
        cuda.memory = MemoryKind::Cuda;
        assert_eq!(unsafe { eng.scatter(&g, &cuda, buf.as_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
        let mut other = p.layout.clone();
        other.shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 2, 1);
        other.bases = vec![other.bases[0], other.bases[0] + 1000];
        assert!(unsafe { eng.scatter(&g, &other, buf.as_ptr()) }.unwrap_err().message().contains("plan token slot 16 bytes != pool token slot 32 bytes"));
        let mut g2 = g.clone();
        g2.segments[0].staging_token = 1;
        assert_eq!(unsafe { eng.gather(&g2, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_INTERNAL);
        let mut g3 = g.clone();
        g3.pool_head_offset = 8;
        assert_eq!(unsafe { eng.gather(&g3, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_INTERNAL);
    }
}
