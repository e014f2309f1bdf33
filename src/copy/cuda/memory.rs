//! Device memory as kvstage holds it: allocations of its own (device staging rings, tools and
//! tests) and the caller's device memory it was handed (a caller-provided device ring), with the
//! synchronous host↔device copies the CPU side needs to reach it.

use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{cu, Device};
use super::{pool_device_of, Backend, CudaBackend, HostPin};
use crate::error::{Error, Result};

/// A range of device memory: allocated here (freed on drop) or borrowed from the caller. Its
/// copies run on a stream of its own (non-blocking): never behind the application's work on the
/// legacy default stream, which PyTorch and others use.
pub struct DeviceMemory {
    pub ptr: u64,
    pub bytes: usize,
    dev: Arc<Device>,
    stream: usize,
    owned: bool,
}

// SAFETY: device addresses and CUDA streams may be used from any thread.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Allocates `bytes` on device `ordinal` (freed on drop).
    pub fn alloc(ordinal: i32, bytes: usize) -> Result<DeviceMemory> {
        let dev = Device::open(ordinal)?;
        let _g = dev.enter()?;
        let stream = super::driver::create_stream()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: context current.
        let allocated = cu("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) });
        if let Err(e) = allocated {
            // SAFETY: our stream, unused.
            unsafe { sys::cuStreamDestroy_v2(stream as sys::CUstream) };
            return Err(e.context(format!("cannot allocate {bytes} bytes on CUDA device {ordinal}")));
        }
        Ok(DeviceMemory { ptr: p, bytes, dev, stream, owned: true })
    }

    /// The caller's `bytes` at `ptr`, checked to be device memory of one device over the whole
    /// range (`device`: the ordinal the caller names, checked against the memory, `arg` names it in
    /// errors; `None`: the device holding `ptr`). Never freed here: the caller keeps it alive while
    /// kvstage uses it.
    pub fn borrow(device: Option<u32>, ptr: u64, bytes: usize, arg: &str) -> Result<DeviceMemory> {
        let ordinal = pool_device_of(ptr, device, arg)?;
        let backend = CudaBackend { dev: Device::open(ordinal)? };
        let stream = backend.scoped(|| {
            backend.check_device_range(ptr, bytes as u64)?;
            super::driver::create_stream()
        })?;
        Ok(DeviceMemory { ptr, bytes, dev: backend.dev, stream, owned: false })
    }

    pub fn ordinal(&self) -> i32 {
        self.dev.ordinal
    }

    /// Whether this memory was allocated here (and is freed on drop).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Copies `src` to offset `at` (synchronous).
    pub fn write(&self, at: usize, src: &[u8]) -> Result<()> {
        self.check(at, src.len())?;
        self.copy_sync(self.ptr + at as u64, src.as_ptr() as u64, src.len())
    }

    /// Copies `dst.len()` bytes from offset `at` (synchronous).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<()> {
        self.check(at, dst.len())?;
        self.copy_sync(dst.as_mut_ptr() as u64, self.ptr + at as u64, dst.len())
    }

    /// Copies `bytes` from the start of `src` to the start of `self` (device to device, synchronous).
    pub fn copy_from(&self, src: &DeviceMemory, bytes: usize) -> Result<()> {
        self.check(0, bytes)?;
        src.check(0, bytes)?;
        self.copy_sync(self.ptr, src.ptr, bytes)
    }

    /// Page-locks host memory for copies to and from this device (see [`HostPin`]).
    pub fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        HostPin::new(&self.dev, ptr, len)
    }

    fn check(&self, at: usize, len: usize) -> Result<()> {
        if at.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::internal(format!("device range [{at}, +{len}) is outside the {} bytes at {:#x}", self.bytes, self.ptr)));
        }
        Ok(())
    }

    fn copy_sync(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        let _g = self.dev.enter()?;
        let stream = self.stream as sys::CUstream;
        // SAFETY: both ranges checked by the callers; the stream is synchronized before returning
        // (also when the copy could not be queued, so that nothing queued outlives the call).
        unsafe {
            let queued = cu("cuMemcpyAsync", sys::cuMemcpyAsync(dst, src, n, stream));
            let synced = cu("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
            queued.and(synced)
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: our stream (every copy on it was synchronous) and, when owned, our allocation.
            unsafe {
                sys::cuStreamDestroy_v2(self.stream as sys::CUstream);
                if self.owned {
                    sys::cuMemFree_v2(self.ptr);
                }
            }
        }
    }
}
