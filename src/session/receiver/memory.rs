//! The staging ring's memory: host memory (the caller's, or the engine's own sealed memfd that a
//! same-host sender can map) or CUDA device memory (the caller's, or allocated by the engine on a
//! named device), which the scatter kernels read directly. The CPU cannot touch device memory, so
//! payloads read from a socket land there through a pinned host bounce buffer, and the integrity
//! check reads a region back.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::copy::cuda::{DeviceMemory, HostPin};
use crate::error::{Error, Result, Status};
use crate::geometry::{KvLayout, MemoryKind};
use crate::transport::shm::memory::SharedRing;
use crate::transport::shm::OfferedRing;

/// Bytes of each pinned host buffer socket payloads land through on their way to a device ring.
pub const DEVICE_BOUNCE_BYTES: usize = 4 << 20;

/// Bounce buffers a device ring keeps between payloads (each payload lands through two; more are
/// made while more connections land payloads at once, and freed afterwards): pinned memory held
/// at rest is bounded by `BOUNCES_KEPT * DEVICE_BOUNCE_BYTES`.
const BOUNCES_KEPT: usize = 4;

/// The bounce size: [`DEVICE_BOUNCE_BYTES`], or in test builds `KVSTAGE_TESTING_BOUNCE_BYTES` (so
/// that small test chunks cross several pieces).
fn bounce_bytes() -> usize {
    #[cfg(feature = "testing")]
    if let Some(n) = std::env::var("KVSTAGE_TESTING_BOUNCE_BYTES").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    DEVICE_BOUNCE_BYTES
}

/// Where the ring lives and who owns it.
enum Backing {
    /// The caller's host memory.
    Caller,
    /// The engine's memfd (shareable with a same-host sender).
    Shared(SharedRing),
    /// Device memory (the caller's or the engine's: [`DeviceMemory`] frees only its own), and
    /// the idle bounce buffers payloads land through.
    Device(DeviceMemory, Mutex<Vec<Bounce>>),
}

/// What the caller asks for when registering a ring.
#[derive(Clone, Copy, Debug)]
pub struct RingSpec {
    pub memory: MemoryKind,
    /// CUDA rings: the device (required when the engine allocates; checked against caller memory).
    pub cuda_device: Option<u32>,
    /// `None`: the engine allocates.
    pub ptr: Option<*mut u8>,
    pub bytes: usize,
}

pub struct RingMemory {
    ptr: *mut u8,
    len: usize,
    backing: Backing,
    /// A NIC was given the ring (GPUDirect RDMA): device work that reads it flushes the NIC's
    /// writes first where the device does not order them.
    nic_writes: AtomicBool,
}

// SAFETY: the memory is only written inside grants the receiver's state handed to one writer (and
// pinned while a read lands there), and read by the scatter of a chunk whose writers all arrived.
unsafe impl Send for RingMemory {}
unsafe impl Sync for RingMemory {}

/// Whether `seen`, the ring an exchange started with, is still the registered one (`current`):
/// a ring registered meanwhile makes what the exchange set up describe dead memory.
pub fn still_current(seen: Option<&Arc<RingMemory>>, current: Option<&Arc<RingMemory>>) -> bool {
    matches!((seen, current), (Some(a), Some(b)) if Arc::ptr_eq(a, b))
}

impl RingMemory {
    pub fn new(spec: RingSpec) -> Result<RingMemory> {
        let len = spec.bytes;
        match (spec.memory, spec.ptr) {
            (MemoryKind::Host, Some(p)) => {
                if crate::copy::cuda::is_device_pointer(p as u64) {
                    return Err(Error::new(
                        Status::KVSTAGE_E_INVALID_ARG,
                        format!("staging memory {p:p} is CUDA device memory but was registered as host memory (memory_kind HOST)"),
                    ));
                }
                Ok(RingMemory { ptr: p, len, backing: Backing::Caller, nic_writes: AtomicBool::new(false) })
            }
            (MemoryKind::Host, None) => {
                let ring = SharedRing::create(len).map_err(|e| e.context(format!("cannot allocate a staging ring of {len} bytes")))?;
                Ok(RingMemory { ptr: ring.ptr(), len, backing: Backing::Shared(ring), nic_writes: AtomicBool::new(false) })
            }
            (MemoryKind::Cuda, Some(p)) => {
                let mem = DeviceMemory::borrow(spec.cuda_device, p as u64, len, "staging->cuda_device")
                    .map_err(|e| e.context(format!("staging memory {p:p} ({len} bytes) is not usable as a device ring")))?;
                Ok(RingMemory { ptr: p, len, backing: Backing::Device(mem, Mutex::default()), nic_writes: AtomicBool::new(false) })
            }
            (MemoryKind::Cuda, None) => {
                let device = spec.cuda_device.ok_or_else(|| {
                    Error::invalid_arg("staging->cuda_device", "is negative: an engine-allocated device ring needs a device ordinal")
                })?;
                let mem = DeviceMemory::alloc(device as i32, len)
                    .map_err(|e| e.context(format!("cannot allocate a staging ring of {len} bytes on CUDA device {device}")))?;
                Ok(RingMemory { ptr: mem.ptr as *mut u8, len, backing: Backing::Device(mem, Mutex::default()), nic_writes: AtomicBool::new(false) })
            }
        }
    }

    /// What a same-host sender is handed to write this ring: the engine's memfd, or a device
    /// ring's CUDA IPC export. `KVSTAGE_E_UNSUPPORTED` with the reason for caller host memory
    /// (not shareable) and device memory legacy IPC cannot share.
    pub fn offer(&self) -> Result<OfferedRing<'_>> {
        match &self.backing {
            Backing::Shared(r) => Ok(OfferedRing::Memfd(r.fd())),
            Backing::Device(m, _) => crate::session::device_ring::export(m)
                .map(OfferedRing::Device)
                .map_err(|e| e.context(format!("the receiver's staging ring ({}) cannot be shared with a process on this node", self.describe()))),
            Backing::Caller => Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                "the receiver's staging ring is caller memory (register it with ptr = NULL to let the engine own a shareable one)",
            )),
        }
    }

    /// A device ring's dma-buf, for the NIC to register it (GPUDirect RDMA).
    pub fn dmabuf(&self) -> Result<crate::transport::rdma::DmaBuf> {
        match &self.backing {
            Backing::Device(m, _) => crate::session::device_ring::dmabuf(m),
            _ => Err(Error::internal("a host ring has no dma-buf")),
        }
    }

    /// A NIC writes the ring from now on (an RDMA peer was accepted).
    pub fn mark_nic_writes(&self) {
        self.nic_writes.store(true, Ordering::SeqCst);
    }

    /// Before device work reads the ring (a scatter, a checksum's read-back): a device ring that a
    /// NIC writes, on a device that does not order those writes for its own kernels, is flushed
    /// (`cuFlushGPUDirectRDMAWrites`; the CPU already saw the writes complete).
    pub fn before_device_read(&self) -> Result<()> {
        match &self.backing {
            Backing::Device(mem, _) if self.nic_writes.load(Ordering::SeqCst) => mem.flush_rdma_writes().map(drop),
            _ => Ok(()),
        }
    }

    /// The CUDA device holding the ring (`None`: host memory).
    pub fn device(&self) -> Option<i32> {
        match &self.backing {
            Backing::Device(m, _) => Some(m.ordinal()),
            _ => None,
        }
    }

    /// "host memory (engine-owned, shareable)", "CUDA device 0 memory (caller's)" for logs.
    pub fn describe(&self) -> String {
        match &self.backing {
            Backing::Caller => "host memory (caller's)".to_owned(),
            Backing::Shared(_) => "host memory (engine-owned memfd, shareable on this host)".to_owned(),
            Backing::Device(m, _) => format!("CUDA device {} memory ({})", m.ordinal(), if m.is_owned() { "engine-owned" } else { "caller's" }),
        }
    }

    /// Checks that the scatter can read this ring into `pool`: a device ring needs a CUDA pool on
    /// the same device (the kernels read the ring directly); a host ring serves any pool.
    pub fn check_pool(&self, pool: &KvLayout) -> Result<()> {
        let Some(ring_device) = self.device() else { return Ok(()) };
        if pool.memory != MemoryKind::Cuda {
            return Err(Error::invalid_arg(
                "staging",
                format!("is CUDA device {ring_device} memory but the KV pool is host memory: the scatter reads the ring from the CPU; register a host ring"),
            ));
        }
        let pool_device = crate::copy::cuda::pool_device(pool, None)?;
        if pool_device != ring_device {
            return Err(Error::invalid_arg(
                "staging",
                format!("is memory of CUDA device {ring_device} but the KV pool is on device {pool_device}: the scatter kernels read the ring directly; put it on the pool's device"),
            ));
        }
        Ok(())
    }

    pub fn size(&self) -> usize {
        self.len
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr
    }

    /// The address of `len` bytes at `offset` (device memory for a device ring), checked to lie
    /// inside the ring. Using them is only sound under a lease from the receiver's state (a write
    /// or ready lease, or a scatter), which keeps every other writer out of the range.
    pub fn range(&self, offset: u64, len: u64) -> crate::Result<*mut u8> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len as u64);
        if end.is_none() {
            return Err(Error::internal(format!("ring range [{offset}, +{len}) is outside the ring of {} bytes", self.len)));
        }
        // Not `add`: a device ring's address is no allocation of this process.
        Ok(self.ptr.wrapping_add(offset as usize))
    }

    /// Lands `len` bytes at `offset` from `read` (which fills each slice it is given, in order):
    /// directly for host memory; for device memory through two pinned bounce buffers in turn, so
    /// that the copy of one piece to the device runs while `read` fills the other. Returns once
    /// every byte is in the ring (also on failure, nothing is left queued).
    ///
    /// # Safety
    /// The caller holds a write lease on the range (see [`range`](Self::range)).
    pub unsafe fn land(&self, offset: u64, len: u64, mut read: impl FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        let p = self.range(offset, len)?;
        let Backing::Device(mem, idle) = &self.backing else {
            // SAFETY: inside the ring (checked) and leased to this writer (the caller's contract).
            return read(unsafe { std::slice::from_raw_parts_mut(p, len as usize) });
        };
        let take = || idle.lock().pop().unwrap_or_else(|| Bounce::new(mem));
        let mut pair = [take(), take()];
        let (mut done, mut piece) = (0u64, 0usize);
        let mut landed = Ok(());
        while done < len && landed.is_ok() {
            let bounce = &mut pair[piece % 2].buf;
            let n = (len - done).min(bounce.len() as u64) as usize;
            // From the third piece on, this buffer's previous copy may still run: wait for it.
            landed = if piece >= 2 { mem.sync() } else { Ok(()) };
            landed = landed.and_then(|()| read(&mut bounce[..n])).and_then(|()| {
                // SAFETY: the buffer is not written again before the next sync (above, or below).
                unsafe { mem.write_queued((offset + done) as usize, &bounce[..n]) }
            });
            done += n as u64;
            piece += 1;
        }
        // The bytes are in the ring, and no copy still reads a bounce buffer, before either goes.
        let synced = mem.sync();
        let mut idle = idle.lock();
        for b in pair {
            if idle.len() < BOUNCES_KEPT {
                idle.push(b);
            }
        }
        landed.and(synced)
    }

    /// The `len` bytes at `offset` as the CPU sees them: borrowed from host memory, copied back
    /// from device memory.
    ///
    /// # Safety
    /// The caller holds a lease that keeps writers out of the range.
    pub unsafe fn read_back(&self, offset: u64, len: u64) -> Result<Cow<'_, [u8]>> {
        let p = self.range(offset, len)?;
        match &self.backing {
            Backing::Device(mem, _) => {
                self.before_device_read()?;
                Ok(Cow::Owned(mem.to_vec(offset as usize, len as usize)?))
            }
            // SAFETY: inside the ring (checked); no writer (the caller's contract).
            _ => Ok(Cow::Borrowed(unsafe { std::slice::from_raw_parts(p, len as usize) })),
        }
    }
}

/// A pinned host buffer for payloads bound for a device ring.
struct Bounce {
    /// Declared before `buf`: unpinned before the memory is freed.
    _pin: Option<HostPin>,
    buf: Vec<u8>,
}

impl Bounce {
    fn new(mem: &DeviceMemory) -> Bounce {
        let mut buf = vec![0u8; bounce_bytes()];
        // Unpinned copies still work (slower): a failed pin is logged, not fatal.
        let pin = mem.pin_host(buf.as_mut_ptr(), buf.len()).unwrap_or_else(|e| {
            log::warn!("cannot page-lock a {}-byte bounce buffer of a device ring: {}", buf.len(), e.chain());
            None
        });
        Bounce { _pin: pin, buf }
    }
}
