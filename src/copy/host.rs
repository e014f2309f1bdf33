//! The host-memory copy engine: memcpy per run, large plans split across persistent workers.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use super::block::{Block, Side};
use super::nt;
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
/// Name of the worker threads (at most 15 bytes: the kernel's `comm`).
const WORKER_NAME: &str = "kvstage-copy";

/// Test-only hook called with the part index at the start of every part, on the thread running it.
#[cfg(test)]
type PartHook = Arc<dyn Fn(u64) + Send + Sync>;

/// Gather/scatter between host-memory pools and host staging buffers.
///
/// A plan is cut into `threads` byte-balanced parts of its `slabs × tokens` rows (cuts may fall
/// inside a run). The engine owns `threads - 1` persistent worker threads (`kvstage-copy`), started
/// by [`new`](Self::new) and joined when the last clone of the engine is dropped (or by
/// [`shutdown`](Self::shutdown)); every caller shares them. A parallel copy posts one ticket per
/// helper to the workers' queue, and then the calling thread itself claims and runs parts until
/// none is left: a part is run by whichever thread claims it first, so a caller never waits for a
/// part that no thread has started (workers busy with other callers' copies only mean that the
/// caller runs more of its parts itself), and returns once every claimed part has finished. A
/// panicking part is caught on the thread that ran it (the workers survive), the remaining parts
/// are skipped, and the panic is resumed on the calling thread after every other part ended.
///
/// Contiguous runs are single copies; strided runs (a head slice of each token slot) copy row by
/// row. Large plans write with non-temporal stores on x86-64 (the destination of a chunk copy is
/// not read again soon: the staging bytes go to the network, the pool rows to a later decode
/// step), which avoids reading every destination line before overwriting it; small plans use
/// `memcpy`.
#[derive(Clone)]
pub struct HostCopyEngine {
    threads: u32,
    min_parallel_bytes: u64,
    streaming_min_bytes: u64,
    workers: Arc<Workers>,
    #[cfg(test)]
    hook: Option<PartHook>,
}

impl fmt::Debug for HostCopyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCopyEngine")
            .field("threads", &self.threads)
            .field("min_parallel_bytes", &self.min_parallel_bytes)
            .field("streaming_min_bytes", &self.streaming_min_bytes)
            .field("workers", &self.workers.count)
            .finish()
    }
}

impl HostCopyEngine {
    /// An engine using up to `threads` threads per plan (clamped to 1..=256): the calling thread
    /// and `threads - 1` worker threads started here. When the OS refuses a thread, the engine
    /// runs with the workers it got (callers then run more parts themselves).
    pub fn new(threads: u32) -> HostCopyEngine {
        let threads = threads.clamp(1, 256);
        HostCopyEngine {
            threads,
            min_parallel_bytes: DEFAULT_MIN_PARALLEL_BYTES,
            streaming_min_bytes: DEFAULT_STREAMING_MIN_BYTES,
            workers: Arc::new(Workers::start(threads as usize - 1)),
            #[cfg(test)]
            hook: None,
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

    #[cfg(test)]
    fn with_part_hook(mut self, hook: impl Fn(u64) + Send + Sync + 'static) -> HostCopyEngine {
        self.hook = Some(Arc::new(hook));
        self
    }

    pub fn threads(&self) -> u32 {
        self.threads
    }

    /// Worker threads running (`threads - 1` unless the OS refused some; 0 after `shutdown`).
    pub fn worker_count(&self) -> usize {
        if self.workers.queue.lock().is_some() {
            self.workers.count
        } else {
            0
        }
    }

    /// Stops the workers and joins them (for this engine and every clone of it), after they
    /// finished every part already queued; returns when they have exited. Copies still work
    /// afterwards, on the calling thread alone. Dropping the last clone does the same.
    pub fn shutdown(&self) {
        self.workers.shutdown();
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
        let fused = super::rows::kv_interleaved(plan, &pool.bases);
        let units = (plan.slabs.len() >> u32::from(fused)) as u64 * plan.tokens;
        let parts = if plan.bytes() < self.min_parallel_bytes { 1 } else { (self.threads as u64).min(units) };
        let task = Task {
            plan,
            bases: &pool.bases[..],
            staging,
            dir,
            streaming,
            fused,
            units,
            parts,
            next: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            progress: Mutex::new(Progress { done: 0, panic: None }),
            finished: Condvar::new(),
            #[cfg(test)]
            hook: self.hook.clone(),
        };
        if parts <= 1 {
            // SAFETY: the caller's memory is live for this call, which runs the only part.
            unsafe { task.run_part(0) };
            return Ok(());
        }
        let task = Arc::new(task);
        self.workers.post(&task, parts - 1);
        task.work();
        // Every part was claimed (`work` returns once the claims ran out): wait for those running
        // on workers. Only then may the caller's memory go away; the tickets still queued hold the
        // task alive and find nothing left to claim.
        let panic = task.wait();
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
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

    fn shutdown(&self) {
        HostCopyEngine::shutdown(self);
    }
}

/// The persistent workers shared by an engine and its clones.
struct Workers {
    /// The workers' queue of tasks (one entry per helper wanted); `None` once shut down.
    queue: Mutex<Option<Sender<Arc<Task>>>>,
    /// Joined by `shutdown` (the lock is held while joining, so a concurrent `shutdown` returns
    /// only after the workers exited too).
    handles: Mutex<Vec<JoinHandle<()>>>,
    count: usize,
}

impl Workers {
    fn start(n: usize) -> Workers {
        if n == 0 {
            return Workers { queue: Mutex::new(None), handles: Mutex::new(Vec::new()), count: 0 };
        }
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<Task>>();
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let rx = rx.clone();
            match std::thread::Builder::new().name(WORKER_NAME.into()).spawn(move || worker_loop(rx)) {
                Ok(h) => handles.push(h),
                // Fewer workers only means that callers run more parts themselves.
                Err(_) => break,
            }
        }
        let count = handles.len();
        let queue = if count == 0 { None } else { Some(tx) };
        Workers { queue: Mutex::new(queue), handles: Mutex::new(handles), count }
    }

    /// Asks up to `helpers` workers to help with `task`.
    fn post(&self, task: &Arc<Task>, helpers: u64) {
        let queue = self.queue.lock();
        if let Some(tx) = queue.as_ref() {
            for _ in 0..helpers.min(self.count as u64) {
                // The workers hold the receiver until the queue closes (which needs this lock).
                let _ = tx.send(task.clone());
            }
        }
    }

    fn shutdown(&self) {
        // Closing the queue ends each worker's loop once the queue is empty.
        drop(self.queue.lock().take());
        let mut handles = self.handles.lock();
        let me = std::thread::current().id();
        for h in handles.drain(..) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker_loop(rx: Receiver<Arc<Task>>) {
    for task in rx.iter() {
        // `work` catches the panics of the parts it runs and counts every claimed part done
        // before anything else could panic; the outer catch only keeps the worker alive.
        let _ = catch_unwind(AssertUnwindSafe(|| task.work()));
    }
}

/// One parallel copy: the checked plan, the caller's addresses and the claim/finish counters.
/// Held by the caller and by each queued ticket (an `Arc`), so a ticket a worker takes after the
/// copy ended still finds valid counters; the addresses are only used by a thread that claimed a
/// part, and the caller does not return before every claimed part finished.
struct Task {
    plan: *const CopyPlan,
    bases: *const [usize],
    staging: usize,
    dir: Dir,
    streaming: bool,
    fused: bool,
    /// Rows of the flattened `(slab, token)` space (`(layer, token)` where `fused`).
    units: u64,
    parts: u64,
    /// The next part to claim; claims at or past `parts` find nothing.
    next: AtomicU64,
    /// A part panicked: the parts claimed later are skipped.
    failed: AtomicBool,
    progress: Mutex<Progress>,
    /// Signalled when the last part finished.
    finished: Condvar,
    #[cfg(test)]
    hook: Option<PartHook>,
}

struct Progress {
    /// Parts finished (run, panicked or skipped).
    done: u64,
    /// The first panic of a part.
    panic: Option<Box<dyn Any + Send>>,
}

// SAFETY: the raw pointers (the caller's plan and pool bases, and the memory the caller vouched
// for) are only dereferenced in `run_part`, by a thread that claimed a part that is not counted
// done yet; the caller stays inside `execute`, its borrows live, until every part is done.
unsafe impl Send for Task {}
// SAFETY: as for `Send`; the counters are atomics or behind a mutex.
unsafe impl Sync for Task {}

impl Task {
    /// Claims and runs parts until none is left; each finished part is counted, a panic is caught
    /// and kept for the caller.
    fn work(&self) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= self.parts {
                return;
            }
            let mut panic = None;
            if !self.failed.load(Ordering::Relaxed) {
                // SAFETY: part `k` is claimed by this thread and not yet counted done, so the
                // caller is still inside `execute` (see `Task`).
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { self.run_part(k) })) {
                    self.failed.store(true, Ordering::Relaxed);
                    panic = Some(payload);
                }
            }
            let mut progress = self.progress.lock();
            if progress.panic.is_none() {
                progress.panic = panic;
            }
            progress.done += 1;
            if progress.done == self.parts {
                self.finished.notify_all();
            }
            // After this unlock the caller may return: nothing below touches its memory.
        }
    }

    /// Blocks until every part finished; returns the first panic of a part.
    fn wait(&self) -> Option<Box<dyn Any + Send>> {
        let mut progress = self.progress.lock();
        while progress.done < self.parts {
            self.finished.wait(&mut progress);
        }
        progress.panic.take()
    }

    /// Runs part `k`: rows `[units·k/parts, units·(k+1)/parts)`.
    ///
    /// # Safety
    /// The caller of `execute` must still be inside it (its plan, pool and memory live).
    unsafe fn run_part(&self, k: u64) {
        #[cfg(test)]
        if let Some(hook) = &self.hook {
            hook(k);
        }
        let cut = |k: u64| (self.units as u128 * k as u128 / self.parts as u128) as u64;
        // SAFETY: the function's contract: both borrows of `execute` are live.
        let job = unsafe { Job { plan: &*self.plan, bases: &*self.bases, staging: self.staging, dir: self.dir, streaming: self.streaming, fused: self.fused } };
        job.run(cut(k), cut(k + 1));
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Gather,
    Scatter,
}

/// One checked plan on one pool and staging region; the staging address as `usize` (the caller of
/// `gather`/`scatter` vouched for it).
struct Job<'a> {
    plan: &'a CopyPlan,
    bases: &'a [usize],
    staging: usize,
    dir: Dir,
    streaming: bool,
    /// The K slab `i` and the V slab `i + slabs/2` run as one, two planes ([`super::rows::kv_interleaved`]).
    fused: bool,
}

impl Job<'_> {
    /// Executes rows `[a, b)` of the flattened `(slab, token)` space (`(layer, token)` where
    /// `fused`).
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
        let half = plan.slabs.len() / 2;
        let mut pos = a;
        while pos < b {
            let i = (pos / t_total) as usize;
            let slab = &plan.slabs[i];
            let first = pos % t_total;
            let last = t_total.min(first + (b - pos));
            let base = self.bases[slab.buffer as usize];
            let rows = plan.geometry(slab);
            // The V slab's rows, the same but for where they start on each side.
            let (planes, pool_plane, staged_plane) = match self.fused {
                true => {
                    let v = &plan.slabs[i + half];
                    (2, self.bases[v.buffer as usize] - base, (v.staging_offset - slab.staging_offset) as usize)
                }
                false => (1, 0, 0),
            };
            let mut g = plan.segments.partition_point(|s| s.staging_token + s.tokens <= first);
            let mut t = first;
            while t < last {
                if self.dir == Dir::Gather {
                    // Random page lists make the pool reads latency-bound: start the reads of a
                    // segment a few segments ahead.
                    // Every piece's: head-major pages put each head's tokens in a stream of its own.
                    if let Some(ahead) = plan.segments.get(g + PREFETCH_SEGMENTS) {
                        let at = base + (plan.slot_offset(rows, ahead.pool_token) + rows.pool_head_offset) as usize;
                        for j in 0..rows.pieces() as usize {
                            nt::prefetch(at + j * rows.pool_piece_stride as usize, rows.piece_bytes.min(PREFETCH_BYTES) as usize);
                        }
                    }
                }
                let seg = plan.segments[g];
                let end = last.min(seg.staging_token + seg.tokens);
                let run = plan.run(slab, &seg, t, end);
                let pool = Side { at: base + run.pool_offset as usize, row: run.pool_row_stride as usize, piece: run.pool_piece_stride as usize, plane: pool_plane };
                let staged = Side { at: self.staging + run.staging_offset as usize, row: run.row_bytes() as usize, piece: run.piece_bytes as usize, plane: staged_plane };
                let (src, dst) = match self.dir {
                    Dir::Gather => (pool, staged),
                    Dir::Scatter => (staged, pool),
                };
                let block = Block { src, dst, len: run.piece_bytes as usize, rows: run.rows as usize, pieces: run.pieces as usize, planes };
                // SAFETY: `check_plan` bounded every segment by the pool capacity and every slab by
                // the staging region; the caller of gather/scatter vouched for both address ranges.
                unsafe { block.copy(self.streaming) };
                t = end;
                g += 1;
            }
            pos += last - first;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{plan_gather, plan_scatter, staging_layout, ModelKind, PoolShape};
    use std::collections::HashSet;
    use std::sync::atomic::AtomicI64;
    use std::time::{Duration, Instant};

    struct Pool {
        mem: Vec<u8>,
        layout: KvLayout,
    }

    fn pool(shape: PoolShape, capacity_pages: u64, fill: impl Fn(usize) -> u8) -> Pool {
        let bb = (capacity_pages * shape.page_bytes()) as usize;
        let nb = (shape.buffers_per_layer() * shape.layer_count()) as usize;
        let mut mem: Vec<u8> = (0..bb * nb).map(fill).collect();
        let base = mem.as_mut_ptr() as usize;
        let layout = KvLayout::new(shape, capacity_pages, MemoryKind::Host, (0..nb).map(|i| base + i * bb).collect());
        Pool { mem, layout }
    }

    #[test]
    fn gather_then_scatter_moves_the_slice_and_nothing_else() {
        let base = PoolShape::new(ModelKind::Mha, 4, 4, 2, 2, 2);
        let (src_shape, dst_shape) = (base.clone().with_tp(1, 2), base.with_tp(0, 1));
        let src = pool(src_shape.clone(), 4, |i| (i % 251) as u8);
        let dst = pool(dst_shape.clone(), 4, |_| 0xEE);
        let st = staging_layout(&src_shape, &dst_shape, 4).unwrap();
        let w = &st.region_of(&src_shape).unwrap().unwrap();
        let (sp, dp) = ([3u32, 0], [1u32, 2]);
        let mut buf = vec![0u8; w.bytes as usize];
        for (threads, streaming) in [(1, 0), (3, 0), (2, u64::MAX)] {
            let eng = HostCopyEngine::new(threads).with_min_parallel_bytes(0).with_streaming_min_bytes(streaming);
            let g = plan_gather(&src_shape, &sp, 0, &st, w).unwrap();
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
        let g = plan_gather(&shape, &[1, 2], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        let e = unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("pool tokens 2..6 (pages 1..) lie outside the pool's 2 pages"), "{}", e.message());
        let mut g = plan_gather(&shape, &[1, 0], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        g.staging_bytes -= 1;
        let e = unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_STAGING_TOO_SMALL);
        let mut g = plan_gather(&shape, &[1, 0], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        g.slabs[1].buffer = 2;
        assert_eq!(unsafe { eng.gather(&g, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        let g = plan_gather(&shape, &[1, 0], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        let e = unsafe { eng.gather(&g, &p.layout, std::ptr::null_mut()) }.unwrap_err();
        assert!(e.message().contains("`staging`: is NULL"));
        let mut cuda = p.layout.clone();
        cuda.memory = MemoryKind::Cuda;
        assert_eq!(unsafe { eng.scatter(&g, &cuda, buf.as_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
        let mut other = p.layout.clone();
        other.shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 2, 1);
        other.bases = vec![other.bases[0], other.bases[0] + 1000];
        other.strides = crate::geometry::Strides::token_major(&other.shape);
        other.v_strides = other.strides;
        let e = unsafe { eng.scatter(&g, &other, buf.as_ptr()) }.unwrap_err();
        assert!(e.message().contains("page stride 32, token stride 16 != the pool's 2, 64, 32"), "{}", e.message());
        let mut g2 = g.clone();
        g2.segments[0].staging_token = 1;
        assert_eq!(unsafe { eng.gather(&g2, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_INTERNAL);
        let mut g3 = g.clone();
        g3.rows[0].pool_head_offset = 8;
        assert_eq!(unsafe { eng.gather(&g3, &p.layout, buf.as_mut_ptr()) }.unwrap_err().code(), Status::KVSTAGE_E_INTERNAL);
    }

    /// xorshift64*: deterministic pseudo-random numbers.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// `n` distinct pages out of `capacity`, in random order.
        fn pages(&mut self, n: usize, capacity: u32) -> Vec<u32> {
            let mut all: Vec<u32> = (0..capacity).collect();
            for i in (1..all.len()).rev() {
                all.swap(i, (self.next() % (i as u64 + 1)) as usize);
            }
            all.truncate(n);
            all
        }
    }

    /// The plan executed one row at a time, one byte at a time, on the calling thread.
    unsafe fn naive(plan: &CopyPlan, pool: &KvLayout, staging: *mut u8, dir: Dir) {
        for slab in &plan.slabs {
            let base = pool.bases[slab.buffer as usize];
            let g = plan.geometry(slab);
            for t in 0..plan.tokens {
                let seg = plan.segments.iter().find(|s| s.staging_token <= t && t < s.staging_token + s.tokens).unwrap();
                let slot = seg.pool_token + t - seg.staging_token;
                for i in 0..g.row_bytes {
                    let (head, byte) = (i / g.piece_bytes, i % g.piece_bytes);
                    let p = (base as u64 + pool.slot_offset(slab.kv, slot) + g.pool_head_offset + head * g.pool_piece_stride + byte) as *mut u8;
                    let st = unsafe { staging.add((slab.staging_offset + t * g.row_bytes + i) as usize) };
                    unsafe {
                        match dir {
                            Dir::Gather => *st = *p,
                            Dir::Scatter => *p = *st,
                        }
                    }
                }
            }
        }
    }

    /// The process's threads: (tid, comm) per entry of /proc/self/task.
    fn tasks() -> Vec<(i32, String)> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                let tid: i32 = e.file_name().to_str()?.parse().ok()?;
                let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
                Some((tid, comm.trim_end().to_string()))
            })
            .collect()
    }

    /// Reads one thread's name directly: listing /proc/self/task skips entries while other
    /// tests' threads exit, so a known thread is looked up by id.
    fn comm(tid: i32) -> Option<String> {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok().map(|c| c.trim_end().to_string())
    }

    fn tid() -> i32 {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() }
    }

    fn on_worker() -> bool {
        std::thread::current().name() == Some(WORKER_NAME)
    }

    /// Spins (sleeping) until `cond` or a generous deadline; returns `cond()`.
    fn wait_until(cond: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cond() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        cond()
    }

    /// Two directions over a 6-layer, 8-head pool: TP2 → TP1 (contiguous gather, strided
    /// scatter) and TP1 → TP2 (strided gather, contiguous scatter).
    fn pairs() -> [(PoolShape, PoolShape); 2] {
        let base = PoolShape::new(ModelKind::Mha, 8, 16, 2, 4, 6);
        [(base.clone().with_tp(1, 2), base.clone().with_tp(0, 1)), (base.clone().with_tp(0, 1), base.with_tp(1, 2))]
    }

    const CAPACITY: u32 = 64;

    /// One gather and one scatter of `pages_n` random pages with `eng`, each compared against the
    /// naive reference (the scatter on a twin of `dst` that saw the same history); planned on the
    /// pools' layouts.
    fn check_round_trip(eng: &HostCopyEngine, pair: &(PoolShape, PoolShape), src: &Pool, dst: &mut Pool, dst_ref: &mut Pool, rng: &mut Rng, pages_n: usize) {
        let (src_shape, dst_shape) = pair;
        let tokens = pages_n as u32 * src_shape.page_size;
        let st = staging_layout(src_shape, dst_shape, tokens).unwrap();
        let w = &st.region_of(src_shape).unwrap().unwrap();
        let g = plan_gather(&src.layout, &rng.pages(pages_n, CAPACITY), 0, &st, w).unwrap();
        let s = plan_scatter(&dst.layout, &rng.pages(pages_n, CAPACITY), &st, w).unwrap();
        let bytes = w.bytes as usize;
        let (mut buf, mut want) = (vec![0u8; bytes], vec![0u8; bytes]);
        unsafe {
            eng.gather(&g, &src.layout, buf.as_mut_ptr()).unwrap();
            naive(&g, &src.layout, want.as_mut_ptr(), Dir::Gather);
        }
        assert!(buf == want, "gather differs from the reference");
        unsafe {
            eng.scatter(&s, &dst.layout, buf.as_ptr()).unwrap();
            naive(&s, &dst_ref.layout, want.as_mut_ptr(), Dir::Scatter);
        }
        assert!(dst.mem == dst_ref.mem, "scatter differs from the reference");
    }

    /// Every engine's pool layout copies what the naive walk copies, K and V in one pass where
    /// vLLM's cells interleave them (parts cut inside a layer, streaming or not, both directions).
    #[test]
    fn every_pool_layout_copies_as_the_naive_walk() {
        use crate::geometry::LayoutPreset;
        let laid = |preset: LayoutPreset, shape: &PoolShape, fill: fn(usize) -> u8| {
            let mut mem: Vec<u8> = (0..preset.tensor_bytes(shape, CAPACITY as u64) as usize).map(fill).collect();
            let layout = preset.layout(shape, CAPACITY as u64, MemoryKind::Host, mem.as_mut_ptr() as usize);
            Pool { mem, layout }
        };
        let engines = [HostCopyEngine::new(1), HostCopyEngine::new(3).with_min_parallel_bytes(0).with_streaming_min_bytes(0)];
        let mut rng = Rng(5);
        for pair in pairs() {
            for preset in LayoutPreset::ALL {
                let src = laid(preset, &pair.0, |i| (i * 7 % 253) as u8);
                let (mut dst, mut dst_ref) = (laid(preset, &pair.1, |i| (i % 97) as u8), laid(preset, &pair.1, |i| (i % 97) as u8));
                let st = staging_layout(&pair.0, &pair.1, 16).unwrap();
                let g = plan_gather(&src.layout, &rng.pages(4, CAPACITY), 0, &st, &st.region_of(&pair.0).unwrap().unwrap()).unwrap();
                assert_eq!(super::super::rows::kv_interleaved(&g, &src.layout.bases), preset.name().starts_with("vllm"), "{}", preset.name());
                for eng in &engines {
                    check_round_trip(eng, &pair, &src, &mut dst, &mut dst_ref, &mut rng, 7);
                }
            }
        }
    }

    #[test]
    fn concurrent_callers_share_the_workers_and_copy_correctly() {
        let pairs = pairs();
        let srcs: Vec<Pool> = pairs.iter().map(|(s, _)| pool(s.clone(), CAPACITY as u64, |i| (i * 7 % 253) as u8)).collect();
        // One set of workers for three configurations: clones share them.
        let eng = HostCopyEngine::new(3).with_min_parallel_bytes(0).with_streaming_min_bytes(u64::MAX);
        let engines = [eng.clone(), eng.clone().with_streaming_min_bytes(0), eng.clone().with_min_parallel_bytes(u64::MAX)];
        assert_eq!(eng.worker_count(), 2);
        std::thread::scope(|scope| {
            for c in 0..6u64 {
                let (pairs, srcs, engines) = (&pairs, &srcs, &engines);
                scope.spawn(move || {
                    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
                    let mut dsts: Vec<(Pool, Pool)> = pairs
                        .iter()
                        .map(|(_, d)| (pool(d.clone(), CAPACITY as u64, |i| (i % 97) as u8), pool(d.clone(), CAPACITY as u64, |i| (i % 97) as u8)))
                        .collect();
                    for i in 0..30u64 {
                        let p = ((c + i) % 2) as usize;
                        let (dst, dst_ref) = &mut dsts[p];
                        let pages_n = 1 + (rng.next() % 32) as usize;
                        check_round_trip(&engines[((c + i) % 3) as usize], &pairs[p], &srcs[p], dst, dst_ref, &mut rng, pages_n);
                    }
                });
            }
        });
    }

    #[test]
    fn workers_are_persistent_and_process_threads_do_not_grow() {
        const CALLER: &str = "kvstage-cptest";
        const CALLERS: usize = 3;
        const COPIES: usize = 1000;
        let seen = Arc::new(Mutex::new(HashSet::new()));
        let seen2 = seen.clone();
        let eng = HostCopyEngine::new(4).with_min_parallel_bytes(0).with_part_hook(move |_| {
            seen2.lock().insert(tid());
        });
        let pair = &pairs()[0];
        let src = pool(pair.0.clone(), CAPACITY as u64, |i| i as u8);
        let tokens = 16 * pair.0.page_size;
        let st = staging_layout(&pair.0, &pair.1, tokens).unwrap();
        let w = &st.region_of(&pair.0).unwrap().unwrap();
        let g = plan_gather(&pair.0, &Rng(7).pages(16, CAPACITY), 0, &st, w).unwrap();
        let mut want = vec![0u8; w.bytes as usize];
        unsafe { naive(&g, &src.layout, want.as_mut_ptr(), Dir::Gather) };

        let named = |name: &str| tasks().iter().filter(|(_, c)| c == name).count();
        // `ready`: every caller runs (named) and waits; `start`: copies begin. Sampling the names
        // between the two cannot race with a caller that already finished its copies.
        let ready = std::sync::Barrier::new(CALLERS + 1);
        let start = std::sync::Barrier::new(CALLERS + 1);
        let done = AtomicU64::new(0);
        let callers = Mutex::new(HashSet::new());
        let (mut before, mut peak) = (0, 0);
        std::thread::scope(|scope| {
            for _ in 0..CALLERS {
                let (eng, g, src, want, ready, start, done, callers) = (&eng, &g, &src, &want, &ready, &start, &done, &callers);
                std::thread::Builder::new()
                    .name(CALLER.into())
                    .spawn_scoped(scope, move || {
                        callers.lock().insert(tid());
                        let mut buf = vec![0u8; want.len()];
                        ready.wait();
                        start.wait();
                        for _ in 0..COPIES / CALLERS + 1 {
                            buf.fill(0);
                            unsafe { eng.gather(g, &src.layout, buf.as_mut_ptr()) }.unwrap();
                            assert!(&buf == want);
                        }
                        done.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
            }
            ready.wait();
            before = callers.lock().iter().filter(|t| comm(**t).as_deref() == Some(CALLER)).count();
            start.wait();
            // Threads started by a thread inherit its name unless given one: helper threads of a
            // copy would show up under the callers' name while the copies run. (A listing can
            // miss threads that exit meanwhile, never invent one, so `peak` is a lower bound.)
            while done.load(Ordering::SeqCst) < CALLERS as u64 {
                peak = peak.max(named(CALLER));
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        assert_eq!(before, CALLERS);
        assert!(peak <= CALLERS, "{peak} threads named {CALLER} seen while {CALLERS} callers copied");
        // Every part ran on a caller or on one of the engine's three workers, all still alive.
        let callers = callers.into_inner();
        let seen = seen.lock().clone();
        let workers: HashSet<i32> = seen.difference(&callers).copied().collect();
        assert!(workers.len() <= 3, "parts ran on {} distinct non-caller threads", workers.len());
        for t in &workers {
            assert_eq!(comm(*t).as_deref(), Some(WORKER_NAME), "thread {t} that ran a part is gone");
        }
        drop(eng);
        for t in &workers {
            // Bounded wait: a joined thread can stay listed in /proc for a moment.
            assert!(wait_until(|| comm(*t).is_none()), "worker {t} still runs after the engine dropped");
        }
    }

    #[test]
    fn a_panicking_part_neither_kills_the_pool_nor_returns_early() {
        // Modes: 0 no fault; 1 the caller's part panics while both workers are inside theirs;
        // 2 a worker's part panics while the caller is inside its own; 3 every part sleeps.
        let mode = Arc::new(AtomicU64::new(0));
        let caller_in = Arc::new(AtomicBool::new(false));
        let inside = Arc::new(AtomicI64::new(0));
        let finished = Arc::new(AtomicU64::new(0));
        let worker_parts = Arc::new(AtomicU64::new(0));
        let hook = {
            let (mode, caller_in, inside, finished, worker_parts) = (mode.clone(), caller_in.clone(), inside.clone(), finished.clone(), worker_parts.clone());
            move |_k: u64| match mode.load(Ordering::SeqCst) {
                1 if on_worker() => {
                    inside.fetch_add(1, Ordering::SeqCst);
                    assert!(wait_until(|| caller_in.load(Ordering::SeqCst)));
                    std::thread::sleep(Duration::from_millis(100));
                    finished.fetch_add(1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
                1 => {
                    caller_in.store(true, Ordering::SeqCst);
                    assert!(wait_until(|| inside.load(Ordering::SeqCst) == 2));
                    panic!("injected panic on the caller");
                }
                2 if on_worker() => {
                    assert!(wait_until(|| caller_in.load(Ordering::SeqCst)));
                    panic!("injected panic on a worker");
                }
                2 => {
                    caller_in.store(true, Ordering::SeqCst);
                    inside.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(100));
                    finished.fetch_add(1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
                3 => {
                    if on_worker() {
                        worker_parts.fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                _ => {}
            }
        };
        // Three parts on three threads: the caller and both workers each hold one.
        let eng = HostCopyEngine::new(3).with_min_parallel_bytes(0).with_part_hook(hook);
        let pair = &pairs()[1];
        let src = pool(pair.0.clone(), CAPACITY as u64, |i| (i % 241) as u8);
        let st = staging_layout(&pair.0, &pair.1, 8 * pair.0.page_size).unwrap();
        let w = &st.region_of(&pair.0).unwrap().unwrap();
        let g = plan_gather(&pair.0, &Rng(3).pages(8, CAPACITY), 0, &st, w).unwrap();
        let mut buf = vec![0u8; w.bytes as usize];
        let text = |p: Box<dyn Any + Send>| crate::error::panic_text(&*p);

        for m in [1, 2, 1, 2] {
            mode.store(m, Ordering::SeqCst);
            caller_in.store(false, Ordering::SeqCst);
            finished.store(0, Ordering::SeqCst);
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { eng.gather(&g, &src.layout, buf.as_mut_ptr()) }));
            // Returned (by unwinding) only after the other parts ended.
            assert_eq!(inside.load(Ordering::SeqCst), 0, "mode {m}: a part still ran when the call returned");
            let want = if m == 1 { (2, "injected panic on the caller") } else { (1, "injected panic on a worker") };
            assert_eq!(finished.load(Ordering::SeqCst), want.0, "mode {m}");
            assert_eq!(text(r.expect_err("the panic reaches the caller")), want.1);
        }

        // The pool survived: both workers still run parts, and the bytes are right.
        mode.store(3, Ordering::SeqCst);
        assert_eq!(eng.worker_count(), 2);
        let mut want = vec![0u8; buf.len()];
        unsafe { naive(&g, &src.layout, want.as_mut_ptr(), Dir::Gather) };
        for _ in 0..20 {
            buf.fill(0);
            unsafe { eng.gather(&g, &src.layout, buf.as_mut_ptr()) }.unwrap();
            assert!(buf == want);
        }
        assert!(worker_parts.load(Ordering::SeqCst) > 0, "no part ran on a worker after the panics");
    }

    #[test]
    fn shutdown_joins_the_workers_and_copies_still_work() {
        let seen = Arc::new(Mutex::new(HashSet::new()));
        let seen2 = seen.clone();
        let eng = HostCopyEngine::new(3).with_min_parallel_bytes(0).with_part_hook(move |_| {
            if on_worker() {
                seen2.lock().insert(tid());
            }
            std::thread::sleep(Duration::from_millis(2));
        });
        let pairs = pairs();
        let src = pool(pairs[0].0.clone(), CAPACITY as u64, |i| (i % 13) as u8);
        let mut dst = pool(pairs[0].1.clone(), CAPACITY as u64, |_| 0);
        let mut dst_ref = pool(pairs[0].1.clone(), CAPACITY as u64, |_| 0);
        let mut rng = Rng(11);
        for _ in 0..5 {
            check_round_trip(&eng, &pairs[0], &src, &mut dst, &mut dst_ref, &mut rng, 8);
        }
        let workers = seen.lock().clone();
        assert!(!workers.is_empty());
        // Through the trait object, as an owner holding `Arc<dyn CopyEngine>` would.
        let dynamic: &dyn CopyEngine = &eng;
        dynamic.shutdown();
        assert_eq!(eng.worker_count(), 0);
        // A joined thread may stay listed in /proc for a moment (pthread_join returns when the
        // kernel clears its tid, before the task is reaped): bounded wait, not a sleep.
        assert!(wait_until(|| workers.iter().all(|t| comm(*t).is_none())), "workers still run after shutdown");
        seen.lock().clear();
        for _ in 0..5 {
            check_round_trip(&eng, &pairs[0], &src, &mut dst, &mut dst_ref, &mut rng, 8);
        }
        assert!(seen.lock().is_empty(), "a part ran on a worker after shutdown");
        eng.shutdown();
    }
}
