//! Memory registered with the engine's RDMA devices: the receiver's ring (remote write), send
//! staging buffers (each for its lifetime), and device memory through its dma-buf (GPUDirect) or
//! as a plain pointer (peer memory).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::verbs::MemoryRegion;
use super::Rdma;
use crate::error::{Error, Result, Status};

/// A registered buffer (one memory region per device).
pub(super) struct Registration {
    pub(super) addr: usize,
    len: usize,
    mrs: Vec<Box<dyn MemoryRegion>>,
    /// The dma-buf device memory was registered through (after `mrs`: it outlives them).
    _dmabuf: Option<OwnedFd>,
}

/// Device memory exported for the NIC: a dma-buf and the memory's offset in it.
pub struct DmaBuf {
    pub fd: OwnedFd,
    pub offset: u64,
}

/// Memory for the NIC to reach: host memory, or device memory with a way to export it as a
/// dma-buf (GPUDirect RDMA).
pub struct NicMemory<'a> {
    pub ptr: *mut u8,
    pub len: usize,
    /// Device memory: its dma-buf export (called only when a registration is made).
    pub dmabuf: Option<&'a dyn Fn() -> Result<DmaBuf>>,
}

impl Registration {
    fn covers(&self, addr: *mut u8, len: usize) -> bool {
        self.addr <= addr as usize && addr as usize + len <= self.addr + self.len
    }
}

/// The local keys of the send staging memory one write reads, held until the write completed.
pub struct StagingKeys(Arc<Registration>);

impl StagingKeys {
    /// The lkey on the engine's `nic`-th device.
    pub fn lkey(&self, nic: usize) -> u32 {
        self.0.mrs[nic].lkey()
    }
}

/// A send staging buffer's registration with every device, until the buffer is freed.
/// Dropped before the buffer is freed, it leaves the lookup: memory allocated later at the same
/// addresses is never read through the old regions, which pin the freed pages (the NIC would
/// send their stale bytes).
pub struct StagingRegistration {
    rdma: Arc<Rdma>,
    reg: Arc<Registration>,
}

impl Drop for StagingRegistration {
    fn drop(&mut self) {
        self.rdma.staging.lock().retain(|r| !Arc::ptr_eq(r, &self.reg));
    }
}

impl Rdma {
    /// `[addr, +len)` registered on every device. The caller keeps the memory allocated while the
    /// registration lives.
    fn register(&self, addr: *mut u8, len: usize, remote_write: bool) -> Result<Registration> {
        let mut mrs = Vec::new();
        for nic in &self.nics {
            // SAFETY: the caller keeps the memory allocated while the registration lives.
            mrs.push(unsafe { nic.dev.reg_mr(addr, len, remote_write) }?);
        }
        Ok(Registration { addr: addr as usize, len, mrs, _dmabuf: None })
    }

    /// `memory` registered on every device: host memory as such; device memory through its
    /// dma-buf (`ibv_reg_dmabuf_mr`, the address as IOVA), else as a plain pointer (which only a
    /// peer-memory module such as nvidia-peermem makes work). Neither: `KVSTAGE_E_UNSUPPORTED`
    /// naming both reasons.
    fn register_memory(&self, memory: &NicMemory<'_>, remote_write: bool) -> Result<Registration> {
        let Some(dmabuf) = memory.dmabuf else {
            return self.register(memory.ptr, memory.len, remote_write);
        };
        let by_dmabuf = dmabuf().and_then(|buf| {
            let mut mrs = Vec::new();
            for nic in &self.nics {
                // SAFETY: the dma-buf covers the memory and is kept with the registration.
                mrs.push(unsafe { nic.dev.reg_dmabuf_mr(buf.fd.as_raw_fd(), buf.offset, memory.len, memory.ptr as u64, remote_write) }?);
            }
            Ok(Registration { addr: memory.ptr as usize, len: memory.len, mrs, _dmabuf: Some(buf.fd) })
        });
        let dmabuf_failed = match by_dmabuf {
            Ok(reg) => {
                log::info!("device memory at {:p} ({} bytes) registered with the RDMA devices through dma-buf", memory.ptr, memory.len);
                return Ok(reg);
            }
            Err(e) => e,
        };
        match self.register(memory.ptr, memory.len, remote_write) {
            Ok(reg) => {
                log::info!(
                    "device memory at {:p} ({} bytes) registered with the RDMA devices as a plain pointer (peer memory); dma-buf failed: {}",
                    memory.ptr,
                    memory.len,
                    dmabuf_failed.chain()
                );
                Ok(reg)
            }
            Err(plain) => Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!(
                    "device memory at {:p} cannot be registered for GPUDirect RDMA: by dma-buf: {}; as a plain pointer (needs a peer-memory module such as nvidia-peermem): {}",
                    memory.ptr,
                    dmabuf_failed.chain(),
                    plain.chain()
                ),
            )),
        }
    }

    /// Registers a send staging buffer until it is freed (`None` without a device); drop the
    /// result before freeing the buffer.
    pub fn register_staging(self: &Arc<Self>, memory: &NicMemory<'_>) -> Result<Option<StagingRegistration>> {
        if !self.active() || memory.len == 0 {
            return Ok(None);
        }
        let reg = Arc::new(self.register_memory(memory, false)?);
        self.staging.lock().push(reg.clone());
        Ok(Some(StagingRegistration { rdma: self.clone(), reg }))
    }

    /// Send staging buffers registered now.
    pub fn staging_registrations(&self) -> usize {
        self.staging.lock().len()
    }

    /// lkeys (per device) for a write from `[addr, addr + len)`: its staging buffer's, or when the
    /// buffer has none (its registration failed), a registration for this write only.
    pub fn staging_keys(&self, addr: *mut u8, len: usize) -> Result<StagingKeys> {
        let len = len.max(1);
        if let Some(r) = self.staging.lock().iter().find(|r| r.covers(addr, len)) {
            return Ok(StagingKeys(r.clone()));
        }
        Ok(StagingKeys(Arc::new(self.register(addr, len, false)?)))
    }

    /// rkeys (per device) of the receiver's ring, registered for remote write (kept until the
    /// ring is forgotten or a ring elsewhere is registered).
    pub fn ring_keys(&self, ring: &NicMemory<'_>) -> Result<Vec<u32>> {
        let mut reg = self.ring.lock();
        if !reg.as_ref().is_some_and(|r| r.covers(ring.ptr, ring.len)) {
            *reg = None; // deregister the old ring first
            *reg = Some(self.register_memory(ring, true)?);
        }
        Ok(reg.as_ref().expect("registered above").mrs.iter().map(|m| m.rkey()).collect())
    }

    /// Forgets the ring registration (the ring memory is about to be replaced or freed).
    pub fn forget_ring(&self) {
        self.ring.lock().take();
    }

    /// Forgets the ring registration if it is the one of the ring at `addr` (a ring replaced while
    /// a connection registered it: the registration of its successor, if any, stays).
    pub fn forget_ring_at(&self, addr: *mut u8) {
        let mut reg = self.ring.lock();
        if reg.as_ref().is_some_and(|r| r.addr == addr as usize) {
            reg.take();
        }
    }

}
