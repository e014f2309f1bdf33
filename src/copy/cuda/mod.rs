//! The CUDA copy engine: gather/scatter kernels (kernels.cu → committed kernels.ptx, embedded),
//! run through the CUDA driver that cudarc loads at run time.
//!
//! - [`CudaCopyEngine`] executes a [`crate::geometry::CopyPlan`] — the very plan the host engine
//!   executes — on device-memory pools, with host or device staging memory.
//! - [`ReadyFence`] is the producer's "KV valid after this" point (a `CUstream` or `CUevent` of the
//!   caller), captured when a transfer is submitted; the gather stream waits for it.
//! - [`HostPin`] page-locks host staging memory so that device↔host copies run at full speed.
//! - [`report`] is the doctor's view: driver version, devices, whether the PTX loads on each.
//!
//! Nothing here is linked against libcuda: without the library (or without a device) every entry
//! point returns `KVSTAGE_E_NO_DEVICE`, never a panic.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use crate::error::{Error, ErrorClass, Result, Status};
use crate::geometry::{KvLayout, MemoryKind};

mod api;
mod driver;
mod engine;
mod memory;
pub mod job;
pub mod selftest;

#[cfg(test)]
mod emu;

pub use driver::{available, driver, CudaError, DriverInfo, Kernel, KernelOp, KERNELS_PTX};
pub use engine::{Backend, DeviceCopyEngine, DEFAULT_SCRATCH_BYTES};
pub use memory::DeviceMemory;

use driver::{cu, CtxGuard, Device, Event};

/// The production backend: one CUDA device through the driver API.
pub struct CudaBackend {
    dev: Arc<Device>,
}

/// The CUDA copy engine (see [`DeviceCopyEngine`]).
pub type CudaCopyEngine = DeviceCopyEngine<CudaBackend>;

impl CudaBackend {
    pub fn ordinal(&self) -> i32 {
        self.dev.ordinal
    }
}

impl Backend for CudaBackend {
    fn scoped<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let _g = self.dev.enter()?;
        f()
    }

    fn create_stream(&self) -> Result<usize> {
        driver::create_stream()
    }

    unsafe fn destroy_stream(&self, stream: usize) {
        // SAFETY: the caller's contract.
        unsafe { api::cuStreamDestroy_v2(stream as sys::CUstream) };
    }

    fn alloc(&self, bytes: u64) -> Result<u64> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: the device context is current (scoped).
        cu("cuMemAlloc_v2", unsafe { api::cuMemAlloc_v2(&mut p, bytes as usize) })
            .map_err(|e| e.context(format!("cannot allocate {bytes} bytes of device scratch on CUDA device {}", self.dev.ordinal)))?;
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller's contract.
        unsafe { api::cuMemFree_v2(ptr) };
    }

    unsafe fn copy(&self, stream: usize, dst: u64, src: u64, bytes: u64) -> Result<()> {
        // SAFETY: the caller's contract; unified addressing tells host from device memory.
        cu("cuMemcpyAsync", unsafe { api::cuMemcpyAsync(dst, src, bytes as usize, stream as sys::CUstream) })
    }

    unsafe fn launch(&self, stream: usize, kernel: Kernel, grid: (u32, u32), job: *const c_void) -> Result<()> {
        let mut params = [job as *mut c_void];
        // SAFETY: the function takes one parameter block by value (`struct KvJob` or `struct
        // KvAcross`, the caller's contract), which `params[0]` points to.
        let r = unsafe {
            api::cuLaunchKernel(
                self.dev.function(kernel) as sys::CUfunction,
                grid.0,
                grid.1,
                1,
                job::THREADS,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        cu("cuLaunchKernel", r).map_err(|e| e.context(format!("cannot launch {} on CUDA device {}", kernel.name(), self.dev.ordinal)))
    }

    fn wait(&self, stream: usize, fence: &ReadyFence) -> Result<()> {
        // SAFETY: a live stream; the fence's event is live (owned or vouched for by the caller).
        cu("cuStreamWaitEvent", unsafe { api::cuStreamWaitEvent(stream as sys::CUstream, fence.raw() as sys::CUevent, 0) })
    }

    fn sync(&self, stream: usize) -> Result<()> {
        // SAFETY: a live stream.
        cu("cuStreamSynchronize", unsafe { api::cuStreamSynchronize(stream as sys::CUstream) })
    }

    fn is_device(&self, ptr: u64) -> bool {
        driver::device_of(ptr) == Some(self.dev.ordinal)
    }

    fn check_device_range(&self, ptr: u64, bytes: u64) -> Result<()> {
        let last = ptr.checked_add(bytes.max(1) - 1).ok_or_else(|| Error::invalid_arg("bases", "range overflows"))?;
        for (what, at) in [("first", ptr), ("last", last)] {
            match driver::device_of(at) {
                Some(o) if o == self.dev.ordinal => {}
                Some(o) => {
                    return Err(Error::new(
                        Status::KVSTAGE_E_GEOMETRY_INVALID,
                        format!("its {what} byte {at:#x} is memory of CUDA device {o}, not of device {}", self.dev.ordinal),
                    ))
                }
                None => {
                    return Err(Error::new(
                        Status::KVSTAGE_E_GEOMETRY_INVALID,
                        format!(
                            "its {what} byte {at:#x} is not CUDA device memory (host memory needs memory_kind HOST; \
                             a capacity beyond the allocation ends outside it)"
                        ),
                    ))
                }
            }
        }
        // First and last byte on the device can still span two allocations with a gap between
        // them: the whole range must lie in the allocation that holds its first byte.
        if let Some((base, size)) = driver::allocation_of(ptr) {
            if last >= base.saturating_add(size) {
                return Err(Error::new(
                    Status::KVSTAGE_E_GEOMETRY_INVALID,
                    format!(
                        "it spans more than one allocation: its first byte {ptr:#x} lies in the {size}-byte allocation at {base:#x}, \
                         which ends {} bytes before its last byte",
                        last + 1 - (base + size)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("CUDA device {} ({})", self.dev.ordinal, self.dev.name)
    }

    fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        HostPin::new(&self.dev, ptr, len)
    }
}

pub use job::KvJob;

impl DeviceCopyEngine<CudaBackend> {
    /// An engine on CUDA device `ordinal` (initializes the driver and loads the kernels on first
    /// use). `KVSTAGE_E_NO_DEVICE` without a driver or device.
    pub fn open(ordinal: i32) -> Result<CudaCopyEngine> {
        let dev = Device::open(ordinal)?;
        DeviceCopyEngine::new(CudaBackend { dev })
    }

    /// An engine for the device holding `pool`, after checking that every buffer is device memory
    /// of that device over its whole extent. `device`: the ordinal the caller names
    /// (`kvstage_kv_layout.cuda_device`), `None` to take it from the pool's memory.
    pub fn for_pool(pool: &KvLayout, device: Option<u32>) -> Result<CudaCopyEngine> {
        let ordinal = pool_device(pool, device)?;
        let engine = CudaCopyEngine::open(ordinal)?;
        engine.check_pool(pool)?;
        Ok(engine)
    }

    pub fn ordinal(&self) -> i32 {
        self.backend().ordinal()
    }
}

/// Checks a CUDA pool at registration, without creating streams or buffers: the driver loads and
/// has the device, the kernels load on it, and every buffer is device memory of that device over
/// its whole extent. `device` as in [`CudaCopyEngine::for_pool`].
pub fn check_pool(pool: &KvLayout, device: Option<u32>) -> Result<()> {
    let ordinal = pool_device(pool, device)?;
    let backend = CudaBackend { dev: Device::open(ordinal)? };
    backend.scoped(|| {
        for (i, &base) in pool.bases.iter().enumerate() {
            let bytes = pool.buffer_bytes(i as u32);
            backend.check_device_range(base as u64, bytes).map_err(|e| {
                e.context(format!("KV pool buffer bases[{i}] ({base:#x}, {bytes} bytes) is not usable by the CUDA copy engine"))
            })?;
        }
        Ok(())
    })
}

/// The device that holds `pool` (`device` when given, checked against the memory; else the
/// device owning `bases[0]`). Errors: no driver / device (`KVSTAGE_E_NO_DEVICE`), a host pool or
/// memory that is not CUDA device memory (`KVSTAGE_E_GEOMETRY_INVALID`).
pub fn pool_device(pool: &KvLayout, device: Option<u32>) -> Result<i32> {
    driver()?;
    if pool.memory != MemoryKind::Cuda {
        return Err(Error::invalid_arg("layout->memory_kind", "is not KVSTAGE_MEMORY_CUDA"));
    }
    let base = *pool.bases.first().ok_or_else(|| Error::invalid_arg("layout->k_bases", "is empty"))? as u64;
    pool_device_of(base, device, "layout->cuda_device").map_err(|e| e.context(format!("KV pool bases[0] ({base:#x})")))
}

/// The device holding `ptr` (`device` when given, checked against the memory; `arg` names it in
/// errors). Errors as [`pool_device`].
pub fn pool_device_of(ptr: u64, device: Option<u32>, arg: &str) -> Result<i32> {
    let info = driver()?;
    if let Some(d) = device {
        if d as i64 >= info.devices as i64 {
            return Err(Error::invalid_arg(arg, format!("{d} is not below the {} CUDA devices of this host", info.devices)));
        }
    }
    match (driver::device_of(ptr), device) {
        (Some(o), None) => Ok(o),
        (Some(o), Some(d)) if o == d as i32 => Ok(o),
        (Some(o), Some(d)) => Err(Error::invalid_arg(arg, format!("is {d} but {ptr:#x} is memory of CUDA device {o}"))),
        (None, _) => Err(Error::new(
            Status::KVSTAGE_E_GEOMETRY_INVALID,
            format!("{ptr:#x} is not CUDA device memory (use memory_kind HOST for host memory)"),
        )
        .with_class(ErrorClass::KVSTAGE_CLASS_CUDA)),
    }
}

/// The point after which the KV pool holds the chunk's data: an event kvstage waits for before it
/// reads the pool. Captured when the transfer is submitted, on the caller's thread:
/// - from a `CUstream`: kvstage records its own event on that stream at capture time;
/// - from a `CUevent` (CUDA pool): kvstage's fence stream waits for the event's current record and
///   records its own event, so re-recording the caller's event afterwards changes nothing;
/// - from a `CUevent` (host pool): the event itself, synchronized before the host gather (the
///   caller must not re-record it until the transfer completes).
pub struct ReadyFence {
    owned: Option<Event>,
    raw: usize,
}

// SAFETY: CUDA events may be used from any thread; the owned event is destroyed once.
unsafe impl Send for ReadyFence {}
unsafe impl Sync for ReadyFence {}

impl std::fmt::Debug for ReadyFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadyFence({:#x}{})", self.raw, if self.owned.is_some() { ", owned" } else { "" })
    }
}

impl ReadyFence {
    /// Captures the ready point for a transfer from `pool`: `cuda_stream` or `cuda_event` (at
    /// most one non-zero; both zero = the KV is valid now: `Ok(None)`).
    pub fn capture(pool: &KvLayout, cuda_stream: usize, cuda_event: usize) -> Result<Option<ReadyFence>> {
        match (cuda_stream, cuda_event) {
            (0, 0) => Ok(None),
            (s, 0) => {
                driver()?;
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: the caller's stream handle.
                cu("cuStreamGetCtx", unsafe { api::cuStreamGetCtx(s as sys::CUstream, &mut ctx) })
                    .map_err(|e| e.context("cannot use desc->cuda_stream"))?;
                let _g = CtxGuard::push(ctx as usize)?;
                let ev = Event::new(ctx as usize)?;
                // SAFETY: our event and the caller's stream share the context.
                cu("cuEventRecord", unsafe { api::cuEventRecord(ev.raw as sys::CUevent, s as sys::CUstream) })
                    .map_err(|e| e.context("cannot record an event on desc->cuda_stream"))?;
                Ok(Some(ReadyFence { raw: ev.raw, owned: Some(ev) }))
            }
            (0, e) => {
                driver()?;
                if pool.memory == MemoryKind::Cuda {
                    let dev = Device::open(pool_device(pool, None)?)?;
                    let ev = dev.snapshot_event(e).map_err(|err| err.context("cannot wait for desc->cuda_event"))?;
                    Ok(Some(ReadyFence { raw: ev.raw, owned: Some(ev) }))
                } else {
                    Ok(Some(ReadyFence { raw: e, owned: None }))
                }
            }
            _ => Err(Error::invalid_arg("desc->cuda_event", "set together with desc->cuda_stream (set at most one)")),
        }
    }

    /// Blocks the calling thread until the fence fired.
    pub fn wait_host(&self) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: a live event.
        cu("cuEventSynchronize", unsafe { api::cuEventSynchronize(self.raw as sys::CUevent) })
    }

    /// Blocks the calling thread until the fence fired, `deadline` passed (`KVSTAGE_E_TIMEOUT`)
    /// or `canceled` says so (`KVSTAGE_E_CANCELED`), holding nothing: a transfer whose KV is not
    /// ready waits here, before it takes a ring grant, copy lane or staging buffer another
    /// transfer may need. Polls the event, sleeping between polls (from 20 µs, doubling up to
    /// 1 ms).
    pub fn wait_until(&self, deadline: &crate::deadline::Deadline, canceled: impl Fn() -> bool) -> Result<()> {
        let mut pause = Duration::from_micros(20);
        loop {
            let r = {
                let _g = self.enter()?;
                // SAFETY: a live event.
                unsafe { api::cuEventQuery(self.raw as sys::CUevent) }
            };
            if r != sys::CUresult::CUDA_ERROR_NOT_READY {
                return cu("cuEventQuery", r).map_err(|e| e.context("cannot wait for the KV's ready point"));
            }
            if deadline.expired() {
                return Err(deadline.timeout_error("waiting for the KV's ready point (desc->cuda_stream or desc->cuda_event)"));
            }
            if canceled() {
                return Err(Error::new(Status::KVSTAGE_E_CANCELED, "canceled while waiting for the KV's ready point"));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// The owned event's context made current (a caller's event needs none).
    fn enter(&self) -> Result<Option<CtxGuard>> {
        self.owned.as_ref().map(|ev| CtxGuard::push(ev.ctx())).transpose()
    }

    pub(crate) fn raw(&self) -> usize {
        self.raw
    }
}

/// Host memory page-locked with `cuMemHostRegister` (portable: usable by every context) until
/// dropped. The memory must stay allocated, and must not be reallocated, while the pin lives:
/// drop the pin before freeing or growing the buffer.
pub struct HostPin {
    ptr: usize,
    ctx: usize,
}

impl HostPin {
    /// `Ok(None)` when the range is already page-locked (by the application or an earlier pin).
    fn new(dev: &Device, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        if ptr.is_null() || len == 0 {
            return Err(Error::invalid_arg("ptr", "is NULL or empty"));
        }
        let _g = dev.enter()?;
        // SAFETY: the caller vouches for `len` bytes at `ptr`.
        let r = unsafe {
            api::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE as std::ffi::c_uint)
        };
        if r == sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
            return Ok(None);
        }
        cu("cuMemHostRegister_v2", r).map_err(|e| e.context(format!("cannot page-lock {len} bytes of host staging memory")))?;
        Ok(Some(HostPin { ptr: ptr as usize, ctx: dev.ctx() }))
    }
}

// SAFETY: the registration is process-wide; unregistering from any thread is fine.
unsafe impl Send for HostPin {}
unsafe impl Sync for HostPin {}

impl Drop for HostPin {
    fn drop(&mut self) {
        if let Ok(_g) = CtxGuard::push(self.ctx) {
            // SAFETY: our registration.
            unsafe { api::cuMemHostUnregister(self.ptr as *mut c_void) };
        }
    }
}

/// One device as the doctor sees it.
#[derive(Clone, Debug)]
pub struct DeviceReport {
    pub ordinal: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// `Ok` when the embedded PTX JIT-compiled and loaded; else the error chain.
    pub kernels: std::result::Result<(), String>,
    /// Whether a NIC can reach the device's memory: dma-buf export, GPUDirect RDMA support.
    pub dma_buf: bool,
    pub gpudirect_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` (-1: unknown to the driver).
    pub gpudirect_rdma_writes_ordering: i32,
}

/// The doctor's CUDA report.
#[derive(Clone, Debug)]
pub struct CudaReport {
    /// The driver (`Err`: why it is unusable, e.g. no libcuda, `CUDA_ERROR_NO_DEVICE`).
    pub driver: std::result::Result<DriverInfo, String>,
    pub devices: Vec<DeviceReport>,
    /// `.version` and `.target` lines of the embedded PTX.
    pub ptx: String,
}

/// Driver version, devices, and whether the embedded PTX loads on each (opens every device).
pub fn report() -> CudaReport {
    let ptx = KERNELS_PTX
        .lines()
        .filter(|l| l.starts_with(".version") || l.starts_with(".target"))
        .collect::<Vec<_>>()
        .join(", ");
    let info = match driver() {
        Ok(i) => i.clone(),
        Err(e) => return CudaReport { driver: Err(e.chain()), devices: Vec::new(), ptx },
    };
    let devices = (0..info.devices)
        .map(|o| match Device::open(o) {
            Ok(d) => DeviceReport {
                ordinal: o,
                name: d.name.clone(),
                compute_capability: d.compute_capability,
                kernels: Ok(()),
                dma_buf: d.dma_buf,
                gpudirect_rdma: d.gpudirect_rdma,
                gpudirect_rdma_writes_ordering: d.gpudirect_rdma_writes_ordering,
            },
            Err(e) => DeviceReport {
                ordinal: o,
                name: String::new(),
                compute_capability: (0, 0),
                kernels: Err(e.chain()),
                dma_buf: false,
                gpudirect_rdma: false,
                gpudirect_rdma_writes_ordering: -1,
            },
        })
        .collect();
    CudaReport { driver: Ok(info), devices, ptx }
}

impl std::fmt::Display for CudaReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.driver {
            Err(e) => writeln!(f, "cuda: unavailable: {e}")?,
            Ok(i) => writeln!(f, "cuda: driver {}.{} ({}), {} device(s)", i.version / 1000, (i.version % 1000) / 10, i.version, i.devices)?,
        }
        writeln!(f, "cuda: embedded PTX {}", self.ptx)?;
        for d in &self.devices {
            match &d.kernels {
                Ok(()) => writeln!(
                    f,
                    "cuda: device {}: {} (sm_{}{}), kernels load: yes, dma-buf export: {}, GPUDirect RDMA: {}, RDMA writes ordering: {}",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    if d.dma_buf { "yes" } else { "no" },
                    if d.gpudirect_rdma { "yes" } else { "no" },
                    match d.gpudirect_rdma_writes_ordering {
                        -1 => "unknown".to_string(),
                        0 => "none (0: kernels need cuFlushGPUDirectRDMAWrites)".to_string(),
                        100 => "owner (100)".to_string(),
                        200 => "all devices (200)".to_string(),
                        v => format!("{v}"),
                    }
                )?,
                Err(e) => writeln!(f, "cuda: device {}: kernels load: NO: {e}", d.ordinal)?,
            }
        }
        Ok(())
    }
}

/// A stream of a device, as an application would hand one to kvstage (tools and GPU tests).
pub struct ToolStream {
    dev: Arc<Device>,
    raw: usize,
}

// SAFETY: CUDA streams may be used from any thread.
unsafe impl Send for ToolStream {}
unsafe impl Sync for ToolStream {}

/// An event recorded on a [`ToolStream`].
pub struct ToolEvent(Event);

impl ToolEvent {
    pub fn raw(&self) -> usize {
        self.0.raw
    }
}

impl ToolStream {
    pub fn new(ordinal: i32) -> Result<ToolStream> {
        let dev = Device::open(ordinal)?;
        let raw = {
            let _g = dev.enter()?;
            driver::create_stream()?
        };
        Ok(ToolStream { dev, raw })
    }

    pub fn raw(&self) -> usize {
        self.raw
    }

    /// Queues `bytes` bytes of value `byte` at device address `ptr`.
    pub fn memset(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        let _g = self.dev.enter()?;
        if !driver::has_symbol("cuMemsetD8Async") {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the CUDA driver lacks cuMemsetD8Async"));
        }
        // SAFETY: the caller names device memory of this device.
        cu("cuMemsetD8Async", unsafe { api::cuMemsetD8Async(ptr, byte, bytes, self.raw as sys::CUstream) })
    }

    /// Records a new event on the stream.
    pub fn record(&self) -> Result<ToolEvent> {
        let _g = self.dev.enter()?;
        let ev = Event::new(self.dev.ctx())?;
        // SAFETY: both live in this context.
        cu("cuEventRecord", unsafe { api::cuEventRecord(ev.raw as sys::CUevent, self.raw as sys::CUstream) })?;
        Ok(ToolEvent(ev))
    }

    pub fn sync(&self) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: a live stream.
        cu("cuStreamSynchronize", unsafe { api::cuStreamSynchronize(self.raw as sys::CUstream) })
    }
}

impl Drop for ToolStream {
    fn drop(&mut self) {
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: our stream; synchronize first so no queued work refers to freed memory.
            unsafe {
                api::cuStreamSynchronize(self.raw as sys::CUstream);
                api::cuStreamDestroy_v2(self.raw as sys::CUstream);
            }
        }
    }
}

/// [`selftest::TestMemory`] on a CUDA device: allocations live until this is dropped.
pub struct CudaTestMemory {
    ordinal: i32,
    allocs: parking_lot::Mutex<Vec<DeviceMemory>>,
}

impl CudaTestMemory {
    pub fn new(ordinal: i32) -> CudaTestMemory {
        CudaTestMemory { ordinal, allocs: parking_lot::Mutex::new(Vec::new()) }
    }

    fn locate<R>(&self, at: u64, len: usize, f: impl FnOnce(&DeviceMemory, usize) -> Result<R>) -> Result<R> {
        let list = self.allocs.lock();
        let m = list
            .iter()
            .find(|m| at >= m.ptr && at + len as u64 <= m.ptr + m.bytes as u64)
            .ok_or_else(|| Error::internal(format!("{at:#x} + {len} is not test device memory")))?;
        f(m, (at - m.ptr) as usize)
    }
}

impl selftest::TestMemory for CudaTestMemory {
    fn alloc(&self, bytes: usize) -> Result<u64> {
        let m = DeviceMemory::alloc(self.ordinal, bytes)?;
        let p = m.ptr;
        self.allocs.lock().push(m);
        Ok(p)
    }

    fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        self.locate(at, data.len(), |m, off| m.write(off, data))
    }

    fn read(&self, at: u64, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.locate(at, len, |m, off| m.read(off, out))
    }
}

/// Whether `ptr` is CUDA device memory (false without a driver, and for host memory).
pub fn is_device_pointer(ptr: u64) -> bool {
    driver().is_ok() && driver::device_of(ptr).is_some()
}
