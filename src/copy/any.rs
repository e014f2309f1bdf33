//! Picking the copy engine for a pool: host memory → [`HostCopyEngine`], CUDA device memory →
//! [`CudaCopyEngine`] of the device that holds the pool.

use std::sync::Arc;

use parking_lot::Mutex;

use super::cuda::{pool_device, CudaCopyEngine, HostPin, ReadyFence};
use super::{CopyEngine, HostCopyEngine};
use crate::deadline::Deadline;
use crate::error::Result;
use crate::geometry::{CopyPlan, KvLayout, MemoryKind};

/// The engine for `layout`: a [`HostCopyEngine`] with `threads` threads for host memory; for CUDA
/// memory a [`CudaCopyEngine`] on the device holding the pool, after checking that every buffer
/// is device memory of that device over its whole extent.
///
/// Errors (CUDA pools): `KVSTAGE_E_NO_DEVICE` without libcuda or without a device (the cause
/// names the CUDA error, e.g. `CUDA_ERROR_NO_DEVICE`), `KVSTAGE_E_GEOMETRY_INVALID` for buffers
/// that are not device memory, `KVSTAGE_E_CUDA` for other driver failures.
pub fn engine_for(layout: &KvLayout, threads: u32) -> Result<Arc<dyn CopyEngine>> {
    match layout.memory {
        MemoryKind::Host => Ok(Arc::new(HostCopyEngine::new(threads))),
        MemoryKind::Cuda => Ok(Arc::new(CudaCopyEngine::for_pool(layout, None)?)),
    }
}

/// Checks at registration that the engine chosen for `layout` can use it: nothing for host
/// memory; for CUDA memory see [`super::cuda::check_pool`]. Errors as [`engine_for`].
pub fn check_pool(layout: &KvLayout, cuda_device: Option<u32>) -> Result<()> {
    match layout.memory {
        MemoryKind::Host => Ok(()),
        MemoryKind::Cuda => super::cuda::check_pool(layout, cuda_device),
    }
}

/// One engine for every pool kind: dispatches each call on `pool.memory` (host pools to a
/// [`HostCopyEngine`], CUDA pools to one [`CudaCopyEngine`] per device, opened on first use).
/// Lets a component that is built before its pool is registered (the engine's sender and
/// receiver) hold a single `Arc<dyn CopyEngine>`. Call [`prepare`](Self::prepare) when a pool is
/// registered so that an unusable CUDA pool is refused there, not at the first transfer.
pub struct AnyCopyEngine {
    host: HostCopyEngine,
    /// (bases[0] of a prepared pool, its engine); at most one engine per device.
    cuda: Mutex<Vec<(usize, Arc<CudaCopyEngine>)>>,
}

impl AnyCopyEngine {
    pub fn new(threads: u32) -> AnyCopyEngine {
        AnyCopyEngine { host: HostCopyEngine::new(threads), cuda: Mutex::new(Vec::new()) }
    }

    /// Checks `pool` and readies its engine: nothing for host pools; for CUDA pools opens the
    /// device (driver, kernels) and checks the pool's memory. `device`: the ordinal the caller
    /// names, `None` to take the device of the memory. Errors as [`engine_for`].
    pub fn prepare(&self, pool: &KvLayout, device: Option<u32>) -> Result<()> {
        if pool.memory == MemoryKind::Host {
            return Ok(());
        }
        let ordinal = pool_device(pool, device)?;
        let mut list = self.cuda.lock();
        let engine = match list.iter().find(|(_, e)| e.ordinal() == ordinal) {
            Some((_, e)) => e.clone(),
            None => Arc::new(CudaCopyEngine::open(ordinal)?),
        };
        engine.check_pool(pool)?;
        let base = pool.bases[0];
        list.retain(|(b, _)| *b != base);
        list.push((base, engine));
        Ok(())
    }

    fn cuda_for(&self, pool: &KvLayout) -> Result<Arc<CudaCopyEngine>> {
        let base = pool.bases.first().copied().unwrap_or(0);
        if let Some((_, e)) = self.cuda.lock().iter().find(|(b, _)| *b == base) {
            return Ok(e.clone());
        }
        self.prepare(pool, None)?;
        self.cuda_for(pool)
    }
}

impl CopyEngine for AnyCopyEngine {
    unsafe fn gather(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match pool.memory {
                MemoryKind::Host => self.host.gather(plan, pool, staging),
                MemoryKind::Cuda => self.cuda_for(pool)?.gather(plan, pool, staging),
            }
        }
    }

    unsafe fn gather_after(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8, ready: Option<&ReadyFence>, deadline: &Deadline) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match pool.memory {
                MemoryKind::Host => self.host.gather_after(plan, pool, staging, ready, deadline),
                MemoryKind::Cuda => self.cuda_for(pool)?.gather_after(plan, pool, staging, ready, deadline),
            }
        }
    }

    unsafe fn scatter(&self, plan: &CopyPlan, pool: &KvLayout, staging: *const u8) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match pool.memory {
                MemoryKind::Host => self.host.scatter(plan, pool, staging),
                MemoryKind::Cuda => self.cuda_for(pool)?.scatter(plan, pool, staging),
            }
        }
    }

    unsafe fn copy_across(&self, src: &CopyPlan, src_pool: &KvLayout, dst: &CopyPlan, dst_pool: &KvLayout, deadline: &Deadline) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match src_pool.memory {
                MemoryKind::Host => self.host.copy_across(src, src_pool, dst, dst_pool, deadline),
                MemoryKind::Cuda => self.cuda_for(src_pool)?.copy_across(src, src_pool, dst, dst_pool, deadline),
            }
        }
    }

    /// Joins the host engine's workers (see [`CopyEngine::shutdown`]).
    fn shutdown(&self) {
        self.host.shutdown();
    }

    /// Pins through the first prepared CUDA engine (the registration is portable: every device's
    /// copies benefit); `Ok(None)` while no CUDA pool was prepared.
    fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        let engine = self.cuda.lock().first().map(|(_, e)| e.clone());
        match engine {
            Some(e) => e.pin_host(ptr, len),
            None => Ok(None),
        }
    }
}
