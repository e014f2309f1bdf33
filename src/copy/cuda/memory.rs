//! Device memory as kvstage holds it: allocations of its own (device staging rings, tools and
//! tests), the caller's device memory it was handed (a caller-provided device ring) and a peer
//! process's device ring opened through CUDA IPC (same node), with the synchronous host↔device
//! copies the CPU side needs to reach it.

use std::sync::Arc;

use cudarc::driver::sys;

use super::api;
use super::driver::{allocation_of, cu, device_of, has_symbol, Device};
use super::{pool_device_of, Backend, CudaBackend, HostPin};
use crate::error::{Error, Result, Status};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Who frees the memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Allocated here: `cuMemFree` on drop.
    Engine,
    /// The caller's, or the exporting process's when it is this one: never freed here.
    Caller,
    /// Opened from a peer's IPC handle at this allocation base: `cuIpcCloseMemHandle` on drop.
    Ipc(u64),
}

/// A range of device memory: allocated here (freed on drop) or borrowed from the caller. Its
/// copies run on a stream of its own (non-blocking): never behind the application's work on the
/// legacy default stream, which PyTorch and others use.
pub struct DeviceMemory {
    pub ptr: u64,
    pub bytes: usize,
    dev: Arc<Device>,
    stream: usize,
    owner: Owner,
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
        let allocated = cu("cuMemAlloc_v2", unsafe { api::cuMemAlloc_v2(&mut p, bytes.max(1)) });
        if let Err(e) = allocated {
            // SAFETY: our stream, unused.
            unsafe { api::cuStreamDestroy_v2(stream as sys::CUstream) };
            return Err(e.context(format!("cannot allocate {bytes} bytes on CUDA device {ordinal}")));
        }
        Ok(DeviceMemory { ptr: p, bytes, dev, stream, owner: Owner::Engine })
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
        Ok(DeviceMemory { ptr, bytes, dev: backend.dev, stream, owner: Owner::Caller })
    }

    pub fn ordinal(&self) -> i32 {
        self.dev.ordinal
    }

    /// Before device work reads bytes a NIC wrote here: see [`Device::flush_rdma_writes`].
    pub fn flush_rdma_writes(&self) -> Result<bool> {
        self.dev.flush_rdma_writes()
    }

    /// Whether this memory was allocated here (and is freed on drop).
    pub fn is_owned(&self) -> bool {
        self.owner == Owner::Engine
    }

    /// Exports this memory for a process on the same node ([`open_export`](Self::open_export)):
    /// the IPC handle of the allocation holding it, its offset there and the allocation's size
    /// (a peer that opens the handle reaches all of the allocation). Fails
    /// (`KVSTAGE_E_UNSUPPORTED`) for memory legacy IPC cannot share, such as VMM (`cuMemCreate`)
    /// allocations, and without the driver entry points.
    pub fn export(&self) -> Result<([u8; IPC_HANDLE_BYTES], u64, u64)> {
        let _g = self.dev.enter()?;
        let handle = ipc_handle(self.ptr)?;
        let (base, size) = allocation_of(self.ptr).ok_or_else(|| Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the driver cannot name the allocation holding the ring"))?;
        Ok((handle, self.ptr - base, size))
    }

    /// The allocation holding `ptr` on CUDA device `ordinal`: its first byte and size.
    /// `KVSTAGE_E_UNSUPPORTED` for memory the driver does not know.
    pub fn allocation_holding(ordinal: i32, ptr: u64) -> Result<(u64, u64)> {
        let dev = Device::open(ordinal)?;
        let _g = dev.enter()?;
        allocation_of(ptr).ok_or_else(|| Error::new(Status::KVSTAGE_E_UNSUPPORTED, format!("the driver cannot name the allocation holding {ptr:#x}")))
    }

    /// The allocation starting at `base` on CUDA device `ordinal`, exported whole for a process on
    /// the same node (direct mode's pool share): its IPC handle. Errors as [`export`](Self::export).
    pub fn export_allocation(ordinal: i32, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
        let dev = Device::open(ordinal)?;
        let _g = dev.enter()?;
        ipc_handle(base)
    }

    /// A dma-buf of the allocation holding this memory, for a NIC to register it
    /// (`ibv_reg_dmabuf_mr`), and this memory's offset in it. The range is the whole allocation,
    /// rounded up to host pages (as `cuMemGetHandleForAddressRange` asks). Fails
    /// (`KVSTAGE_E_UNSUPPORTED`) where the driver or device cannot export dma-bufs.
    pub fn dmabuf(&self) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        if !has_symbol("cuMemGetHandleForAddressRange") {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the CUDA driver lacks cuMemGetHandleForAddressRange (dma-buf export, CUDA 11.7+)"));
        }
        let _g = self.dev.enter()?;
        let (base, size) = allocation_of(self.ptr).ok_or_else(|| Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the driver cannot name the allocation holding the memory"))?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: context current; the handle is an int for DMA_BUF_FD.
        cu("cuMemGetHandleForAddressRange", unsafe {
            api::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                base,
                size.next_multiple_of(page) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })
        .map_err(|e| e.wrap(Status::KVSTAGE_E_UNSUPPORTED, format!("device memory at {:#x} cannot be exported as a dma-buf", self.ptr)))?;
        if fd < 0 {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, format!("the driver exported device memory at {:#x} as descriptor {fd}", self.ptr)));
        }
        // SAFETY: a fresh descriptor the driver handed us.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, self.ptr - base))
    }

    /// The `bytes` another process exported ([`export`](Self::export): `handle`, `offset`; `ptr`
    /// is its address there), reached from CUDA device `ordinal`: `same_process` (the peer is
    /// this very process) borrows `ptr` as is, else the handle is opened (closed on drop). The
    /// memory must lie on `ordinal` (peer access between devices is not set up here) and hold
    /// `bytes` past the offset; otherwise `KVSTAGE_E_UNSUPPORTED` with the reason.
    pub fn open_export(ordinal: i32, handle: &[u8; IPC_HANDLE_BYTES], offset: u64, ptr: u64, bytes: usize, same_process: bool) -> Result<DeviceMemory> {
        if same_process {
            return DeviceMemory::borrow(Some(ordinal as u32), ptr, bytes, "the peer's device ring")
                .map_err(|e| e.wrap(Status::KVSTAGE_E_UNSUPPORTED, format!("the peer's device ring is not usable from CUDA device {ordinal}")));
        }
        if !has_symbol("cuIpcOpenMemHandle_v2") || !has_symbol("cuIpcCloseMemHandle") {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the CUDA driver lacks the IPC entry points (cuIpcOpenMemHandle_v2)"));
        }
        let dev = Device::open(ordinal)?;
        let _g = dev.enter()?;
        let handle = sys::CUipcMemHandle { reserved: handle.map(|b| b as _) };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: context current; `base` is written on success.
        cu("cuIpcOpenMemHandle_v2", unsafe {
            api::cuIpcOpenMemHandle_v2(&mut base, handle, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
        })
        .map_err(|e| e.wrap(Status::KVSTAGE_E_UNSUPPORTED, "cannot open the peer's CUDA IPC handle"))?;
        let close = |why: String| {
            // SAFETY: opened above, nothing uses it yet.
            unsafe { api::cuIpcCloseMemHandle(base) };
            Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, why))
        };
        let held = allocation_of(base).map_or(0, |(b, size)| if b == base { size } else { 0 });
        if offset.checked_add(bytes as u64).is_none_or(|end| end > held) {
            return close(format!("the peer's allocation holds {held} bytes, not {bytes} at offset {offset}"));
        }
        match device_of(base) {
            Some(o) if o == ordinal => {}
            other => {
                return close(format!(
                    "the peer's device ring is on {}, the KV pool on device {ordinal}: peer access between devices is not used",
                    other.map_or("an unknown device".to_owned(), |o| format!("device {o}"))
                ))
            }
        }
        let stream = match super::driver::create_stream() {
            Ok(s) => s,
            Err(e) => return close(e.chain()),
        };
        Ok(DeviceMemory { ptr: base + offset, bytes, dev, stream, owner: Owner::Ipc(base) })
    }

    /// Copies `src` to offset `at` (synchronous).
    pub fn write(&self, at: usize, src: &[u8]) -> Result<()> {
        self.check(at, src.len())?;
        self.copy_sync(self.ptr + at as u64, src.as_ptr() as u64, src.len())
    }

    /// Queues a copy of `src` to offset `at` on this memory's stream and returns at once (it
    /// overlaps with whatever the caller does next; with pinned `src`, truly asynchronous).
    ///
    /// # Safety
    /// `src` stays allocated and unchanged until [`sync`](Self::sync) returned.
    pub unsafe fn write_queued(&self, at: usize, src: &[u8]) -> Result<()> {
        self.check(at, src.len())?;
        let _g = self.dev.enter()?;
        // SAFETY: range checked; `src` outlives the copy (the caller's contract).
        cu("cuMemcpyAsync", unsafe { api::cuMemcpyAsync(self.ptr + at as u64, src.as_ptr() as u64, src.len(), self.stream as sys::CUstream) })
    }

    /// Waits for every copy queued on this memory's stream.
    pub fn sync(&self) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: our stream.
        cu("cuStreamSynchronize", unsafe { api::cuStreamSynchronize(self.stream as sys::CUstream) })
    }

    /// The `len` bytes at offset `at` copied to a new host buffer (synchronous).
    /// `KVSTAGE_E_OUT_OF_MEMORY` when the buffer cannot be had.
    pub fn to_vec(&self, at: usize, len: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        out.try_reserve_exact(len)
            .map_err(|_| Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("cannot allocate {len} bytes to read device memory back")))?;
        out.resize(len, 0);
        self.read(at, &mut out)?;
        Ok(out)
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
            let queued = cu("cuMemcpyAsync", api::cuMemcpyAsync(dst, src, n, stream));
            let synced = cu("cuStreamSynchronize", api::cuStreamSynchronize(stream));
            queued.and(synced)
        }
    }
}

/// The CUDA IPC handle of the allocation holding `ptr` (the context current): a peer that opens
/// it reaches the whole allocation. `KVSTAGE_E_UNSUPPORTED` without the driver's IPC entry points
/// or for memory legacy IPC cannot share.
fn ipc_handle(ptr: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
    if !has_symbol("cuIpcGetMemHandle") || !has_symbol("cuIpcOpenMemHandle_v2") || !has_symbol("cuIpcCloseMemHandle") {
        return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the CUDA driver lacks the IPC entry points (cuIpcGetMemHandle)"));
    }
    let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
    // SAFETY: the caller made a context current; the handle is written in full.
    cu("cuIpcGetMemHandle", unsafe { api::cuIpcGetMemHandle(&mut handle, ptr) })
        .map_err(|e| e.wrap(Status::KVSTAGE_E_UNSUPPORTED, format!("device memory at {ptr:#x} cannot be shared by CUDA IPC")))?;
    Ok(handle.reserved.map(|b| b as u8))
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: our stream (every copy on it was synchronous) and, when owned, our allocation
            // or our opening of a peer's.
            unsafe {
                api::cuStreamDestroy_v2(self.stream as sys::CUstream);
                match self.owner {
                    Owner::Engine => {
                        api::cuMemFree_v2(self.ptr);
                    }
                    Owner::Ipc(base) => {
                        api::cuIpcCloseMemHandle(base);
                    }
                    Owner::Caller => {}
                }
            }
        }
    }
}
