//! The device copy engine, generic over the few operations it needs from a device ([`Backend`]):
//! the CUDA driver in production, a host-memory emulator of the same kernels in the CPU tests.
//!
//! Gather: wait for the caller's fence on the lane's stream, upload the plan tables, run the
//! gather kernel into the staging pointer when it is device memory, else into a device scratch
//! buffer piece by piece followed by a device→host copy of each piece; synchronize the stream.
//! Scatter: the same in reverse (host→device copy, scatter kernel). Both return only after the
//! stream completed, so the caller may hand the staging bytes to the transport (gather) or free the
//! ring allocation (scatter) at once.

use parking_lot::Mutex;

use super::driver::KernelOp;
use super::job::{across_width, grid, pieces, vector_width, AcrossTables, GridLimits, KvAcross, KvJob, Tables};
use super::{HostPin, Kernel, ReadyFence};
use crate::copy::{check_plan, CopyEngine};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::geometry::{CopyPlan, KvLayout, MemoryKind};

/// Default bound of each lane's device scratch buffer (staging that is not device memory goes
/// through it piece by piece).
pub const DEFAULT_SCRATCH_BYTES: u64 = 256 << 20;

/// What the engine needs from a device. All copies and launches are asynchronous on `stream`;
/// `sync` waits for them. Addresses are device (UVA) addresses.
pub trait Backend: Send + Sync {
    /// Runs `f` with the device's context current.
    fn scoped<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R>;
    fn create_stream(&self) -> Result<usize>;
    /// # Safety
    /// `stream` came from `create_stream` and is synchronized.
    unsafe fn destroy_stream(&self, stream: usize);
    fn alloc(&self, bytes: u64) -> Result<u64>;
    /// # Safety
    /// `ptr` came from `alloc` and no queued work uses it.
    unsafe fn free(&self, ptr: u64);
    /// Copies `bytes` from `src` to `dst`, either of which may be host or device memory.
    ///
    /// # Safety
    /// Both ranges are valid until the stream is synchronized.
    unsafe fn copy(&self, stream: usize, dst: u64, src: u64, bytes: u64) -> Result<()>;
    /// Launches `kernel` with the parameter block at `params` (a [`KvJob`] for gather and
    /// scatter, a [`KvAcross`] for across).
    ///
    /// # Safety
    /// `params` is that kernel's block; the tables and every address in it are valid device
    /// memory until the stream is synchronized.
    unsafe fn launch(&self, stream: usize, kernel: Kernel, grid: (u32, u32), params: *const std::ffi::c_void) -> Result<()>;
    /// Makes `stream` wait for the fence (device side, no host blocking).
    fn wait(&self, stream: usize, fence: &ReadyFence) -> Result<()>;
    fn sync(&self, stream: usize) -> Result<()>;
    /// True when the kernels can address `ptr` directly (device memory of this device).
    fn is_device(&self, ptr: u64) -> bool;
    /// Checks that `bytes` at `ptr` are device memory of this device; the error says what they are.
    fn check_device_range(&self, ptr: u64, bytes: u64) -> Result<()>;
    fn describe(&self) -> String;
    /// Page-locks host memory for this device's copies (`Ok(None)`: nothing to do).
    fn pin_host(&self, _ptr: *mut u8, _len: usize) -> Result<Option<HostPin>> {
        Ok(None)
    }
}

/// A device buffer that grows on demand (never shrinks).
struct Buffer {
    ptr: u64,
    bytes: u64,
}

/// One stream with its scratch and table buffers; one gather or scatter at a time.
struct Lane {
    stream: usize,
    scratch: Buffer,
    table: Buffer,
}

/// Gather/scatter between device-memory pools and staging memory (device or host).
pub struct DeviceCopyEngine<B: Backend> {
    backend: B,
    gather: Mutex<Lane>,
    scatter: Mutex<Lane>,
    scratch_limit: u64,
    limits: GridLimits,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Gather,
    Scatter,
}

impl<B: Backend> DeviceCopyEngine<B> {
    pub fn new(backend: B) -> Result<DeviceCopyEngine<B>> {
        let (gs, ss) = backend.scoped(|| Ok((backend.create_stream()?, backend.create_stream()?)))?;
        let lane = |stream| Lane { stream, scratch: Buffer { ptr: 0, bytes: 0 }, table: Buffer { ptr: 0, bytes: 0 } };
        Ok(DeviceCopyEngine {
            backend,
            gather: Mutex::new(lane(gs)),
            scatter: Mutex::new(lane(ss)),
            scratch_limit: DEFAULT_SCRATCH_BYTES,
            limits: GridLimits::default(),
        })
    }

    /// Bounds each lane's scratch buffer (a single slab larger than this still gets its room).
    pub fn with_scratch_limit(mut self, bytes: u64) -> Self {
        self.scratch_limit = bytes.max(1);
        self
    }

    /// Caps the grid (tests use tiny grids to exercise the kernels' grid-stride loops).
    pub fn with_grid_limits(mut self, limits: GridLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Checks that every buffer of `pool` is device memory of this device over its whole extent.
    pub fn check_pool(&self, pool: &KvLayout) -> Result<()> {
        pool.validate()?;
        if pool.memory != MemoryKind::Cuda {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!("the CUDA copy engine cannot use a {:?} pool", pool.memory),
            ));
        }
        self.backend.scoped(|| {
            for (i, &base) in pool.bases.iter().enumerate() {
                let bytes = pool.buffer_bytes(i as u32);
                self.backend.check_device_range(base as u64, bytes).map_err(|e| {
                    e.context(format!("KV pool buffer bases[{i}] ({base:#x}, {bytes} bytes) is not usable by the CUDA copy engine"))
                })?;
            }
            Ok(())
        })
    }

    fn grow(&self, buf: &mut Buffer, bytes: u64) -> Result<()> {
        if buf.bytes >= bytes {
            return Ok(());
        }
        if buf.ptr != 0 {
            // SAFETY: the lane is locked and its stream synchronized after every operation.
            unsafe { self.backend.free(buf.ptr) };
            *buf = Buffer { ptr: 0, bytes: 0 };
        }
        let bytes = bytes.next_multiple_of(1 << 16);
        buf.ptr = self.backend.alloc(bytes)?;
        buf.bytes = bytes;
        Ok(())
    }

    /// The lane, once no other copy holds it, or `KVSTAGE_E_TIMEOUT` at `deadline`.
    fn take<'a>(&self, lane: &'a Mutex<Lane>, deadline: &Deadline) -> Result<parking_lot::MutexGuard<'a, Lane>> {
        match deadline.instant() {
            None => Ok(lane.lock()),
            Some(until) => lane.try_lock_until(until).ok_or_else(|| deadline.timeout_error("waiting for the device's copy lane (other copies hold it)")),
        }
    }

    fn execute(&self, plan: &CopyPlan, pool: &KvLayout, staging: u64, dir: Dir, fence: Option<&ReadyFence>, deadline: &Deadline) -> Result<()> {
        if pool.memory != MemoryKind::Cuda {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!("the CUDA copy engine cannot access a {:?} pool", pool.memory),
            ));
        }
        check_plan(plan, pool)?;
        if plan.tokens == 0 || plan.slabs.is_empty() {
            return match fence {
                Some(f) => f.wait_host(),
                None => Ok(()),
            };
        }
        if staging == 0 {
            return Err(Error::invalid_arg("staging", "is NULL"));
        }
        let lane = match dir {
            Dir::Gather => &self.gather,
            Dir::Scatter => &self.scatter,
        };
        let mut lane = self.take(lane, deadline)?;
        let lane = &mut *lane;
        self.backend.scoped(|| {
            // One launch (or scratch round) per row geometry: K and V rows differ in size where
            // V's heads do.
            let result = plan.uniform_parts().iter().enumerate().try_for_each(|(i, part)| self.run(part, pool, staging, dir, fence.filter(|_| i == 0), lane));
            // Whatever happened, nothing queued may outlive the call (it uses caller memory).
            let synced = self.backend.sync(lane.stream);
            result.and(synced)
        })
    }

    fn run(&self, plan: &CopyPlan, pool: &KvLayout, staging: u64, dir: Dir, fence: Option<&ReadyFence>, lane: &mut Lane) -> Result<()> {
        let stream = lane.stream;
        if let Some(f) = fence {
            self.backend.wait(stream, f)?;
        }
        let tables = Tables::new(plan, &pool.bases);
        self.grow(&mut lane.table, tables.bytes())?;
        let table = lane.table.ptr;
        // SAFETY: the table buffer holds `tables.bytes()`; `tables` lives until the sync in `execute`.
        unsafe { self.backend.copy(stream, table, tables.words.as_ptr() as u64, tables.bytes()) }?;
        let gather = dir == Dir::Gather;
        let op = if gather { KernelOp::Gather } else { KernelOp::Scatter };
        let launch = |s0: usize, s1: usize, at: u64| -> Result<()> {
            let job = tables.job(plan, table, s0, s1, at);
            let width = vector_width(plan, &pool.bases, at);
            let g = grid(plan.tokens, (s1 - s0) as u64, self.limits);
            // SAFETY: check_plan bounded every row by the pool and the staging region; the caller
            // vouched for both; the tables were uploaded above on the same stream.
            unsafe { self.backend.launch(stream, Kernel { op, width }, g, (&job as *const KvJob).cast()) }
        };
        if self.backend.is_device(staging) {
            let last = plan.slabs.len();
            return launch(0, last, staging + plan.slabs[0].staging_offset);
        }
        let parts = pieces(plan, self.scratch_limit);
        let largest = parts.iter().map(|p| p.3).max().unwrap_or(0);
        self.grow(&mut lane.scratch, largest)?;
        let scratch = lane.scratch.ptr;
        for (s0, s1, start, bytes) in parts {
            // Stream order makes each piece wait for the previous piece's copy out of scratch.
            // SAFETY: `start + bytes` lies in the writer region (check_plan); scratch holds `bytes`.
            unsafe {
                if gather {
                    launch(s0, s1, scratch)?;
                    self.backend.copy(stream, staging + start, scratch, bytes)?;
                } else {
                    self.backend.copy(stream, scratch, staging + start, bytes)?;
                    launch(s0, s1, scratch)?;
                }
            }
        }
        Ok(())
    }
}

impl<B: Backend> CopyEngine for DeviceCopyEngine<B> {
    /// Direct mode on the device: one launch copies the rows `src` reads in `src_pool` to where
    /// `dst` puts them in `dst_pool` (both device memory this device addresses: the other pool
    /// opened here), on the gather lane; returns after the stream completed.
    unsafe fn copy_across(&self, src: &CopyPlan, src_pool: &KvLayout, dst: &CopyPlan, dst_pool: &KvLayout, deadline: &Deadline) -> Result<()> {
        if src_pool.memory != MemoryKind::Cuda || dst_pool.memory != MemoryKind::Cuda {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!("the CUDA copy engine copies between device pools, not from a {:?} pool into a {:?} pool", src_pool.memory, dst_pool.memory),
            ));
        }
        check_plan(src, src_pool)?;
        check_plan(dst, dst_pool)?;
        crate::copy::rows::check_paired(src, dst)?;
        if src.tokens == 0 || src.slabs.is_empty() {
            return Ok(());
        }
        let mut lane = self.take(&self.gather, deadline)?;
        let lane = &mut *lane;
        self.backend.scoped(|| {
            // Paired slabs are of one kind on both sides: a launch per kind where K and V rows differ.
            let result = src.uniform_parts().iter().zip(dst.uniform_parts().iter()).try_for_each(|(src, dst)| {
                let tables = AcrossTables::new(src, &src_pool.bases, dst, &dst_pool.bases);
                self.grow(&mut lane.table, tables.bytes())?;
                let table = lane.table.ptr;
                // SAFETY: the table buffer holds `tables.bytes()`; a copy from pageable memory
                // returns once it has read `tables`, and the next part's upload is stream-ordered
                // after this part's launch.
                unsafe { self.backend.copy(lane.stream, table, tables.words.as_ptr() as u64, tables.bytes()) }?;
                let job: KvAcross = tables.job(src, dst, table);
                let kernel = Kernel { op: KernelOp::Across, width: across_width(src, &src_pool.bases, dst, &dst_pool.bases) };
                let g = grid(src.tokens, src.slabs.len() as u64, self.limits);
                // SAFETY: both plans were checked against their pools, which the caller vouches
                // for; the tables were uploaded above on the same stream.
                unsafe { self.backend.launch(lane.stream, kernel, g, (&job as *const KvAcross).cast()) }
            });
            // Whatever happened, nothing queued may outlive the call (it uses both pools).
            let synced = self.backend.sync(lane.stream);
            result.and(synced)
        })
    }

    unsafe fn gather(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8) -> Result<()> {
        self.execute(plan, pool, staging as u64, Dir::Gather, None, &Deadline::after(None))
    }

    unsafe fn gather_after(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8, ready: Option<&ReadyFence>, deadline: &Deadline) -> Result<()> {
        self.execute(plan, pool, staging as u64, Dir::Gather, ready, deadline)
    }

    /// The scatter lane has one user, the receiver's scatter thread: nothing to wait for.
    unsafe fn scatter(&self, plan: &CopyPlan, pool: &KvLayout, staging: *const u8) -> Result<()> {
        self.execute(plan, pool, staging as u64, Dir::Scatter, None, &Deadline::after(None))
    }

    fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        self.backend.pin_host(ptr, len)
    }
}

impl<B: Backend> Drop for DeviceCopyEngine<B> {
    fn drop(&mut self) {
        let backend = &self.backend;
        let _ = backend.scoped(|| {
            for lane in [self.gather.get_mut(), self.scatter.get_mut()] {
                let _ = backend.sync(lane.stream);
                for b in [&lane.scratch, &lane.table] {
                    if b.ptr != 0 {
                        // SAFETY: the stream is synchronized; nothing else holds the buffer.
                        unsafe { backend.free(b.ptr) };
                    }
                }
                // SAFETY: synchronized above; the engine is going away.
                unsafe { backend.destroy_stream(lane.stream) };
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{plan_gather, staging_layout, ModelKind, PoolShape};

    /// A copy that waits for the device's gather lane while another copy holds it gives up at its
    /// deadline (before, it waited for the lane without bound, past any deadline), touching
    /// nothing.
    #[test]
    fn a_copy_waits_for_a_held_lane_only_until_its_deadline() {
        let engine = DeviceCopyEngine::new(super::super::emu::EmuBackend::default()).unwrap();
        let shape = PoolShape::new(ModelKind::Mha, 2, 4, 2, 2, 1);
        let dev = Backend::alloc(engine.backend(), 1024).unwrap() as usize;
        let pool = KvLayout::new(shape.clone(), 4, MemoryKind::Cuda, vec![dev, dev + 512]);
        let st = staging_layout(&shape, &shape, 4).unwrap();
        let g = plan_gather(&shape, &[1, 0], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        let mut buf = vec![0u8; st.total_bytes as usize];
        let held = engine.gather.lock();
        let soon = Deadline::after(Some(std::time::Duration::from_millis(50)));
        // SAFETY: the plan lies in the emulated pool and `buf` holds its region.
        let e = unsafe { engine.gather_after(&g, &pool, buf.as_mut_ptr(), None, &soon) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT, "{}", e.chain());
        assert!(e.chain().contains("copy lane"), "{}", e.chain());
        let s = crate::geometry::plan_scatter(&shape, &[2, 3], &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
        // SAFETY: both plans lie in the emulated pool (rows of other pages).
        let e = unsafe { engine.copy_across(&g, &pool, &s, &pool, &soon) }.unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT, "{}", e.chain());
        drop(held);
    }
}
