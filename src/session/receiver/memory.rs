//! The staging ring's memory: caller-provided, or owned by the engine as a sealed memfd that a
//! same-host sender can map.

use crate::error::{Error, Result, Status};
use crate::transport::shm::memory::SharedRing;

pub struct RingMemory {
    ptr: *mut u8,
    len: usize,
    /// Engine-owned memory (shareable); `None` for the caller's.
    owned: Option<SharedRing>,
}

// SAFETY: the memory is only written inside grants the receiver's state handed to one writer (and
// pinned while a read lands there), and read by the scatter of a chunk whose writers all arrived.
unsafe impl Send for RingMemory {}
unsafe impl Sync for RingMemory {}

impl RingMemory {
    /// `ptr == None` allocates `len` bytes owned by the engine. Caller memory must be writable by
    /// the CPU: device memory is refused (the receiver reads payloads into it from sockets).
    pub fn new(ptr: Option<*mut u8>, len: usize) -> Result<RingMemory> {
        match ptr {
            Some(p) => {
                if crate::copy::cuda::is_device_pointer(p as u64) {
                    return Err(Error::new(
                        Status::KVSTAGE_E_UNSUPPORTED,
                        format!("staging memory {p:p} is CUDA device memory; the ring must be host memory the CPU can write"),
                    ));
                }
                Ok(RingMemory { ptr: p, len, owned: None })
            }
            None => {
                let ring = SharedRing::create(len).map_err(|e| e.context(format!("cannot allocate a staging ring of {len} bytes")))?;
                Ok(RingMemory { ptr: ring.ptr(), len, owned: Some(ring) })
            }
        }
    }

    /// The engine-owned ring a same-host sender can map (`None`: caller memory).
    pub fn shareable(&self) -> Option<&SharedRing> {
        self.owned.as_ref()
    }

    pub fn size(&self) -> usize {
        self.len
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr
    }

    /// The address of `len` bytes at `offset`, checked to lie inside the ring. Using them is only
    /// sound under a lease from the receiver's state (a write or ready lease, or a scatter), which
    /// keeps every other writer out of the range.
    pub fn range(&self, offset: u64, len: u64) -> crate::Result<*mut u8> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len as u64);
        if end.is_none() {
            return Err(Error::internal(format!("ring range [{offset}, +{len}) is outside the ring of {} bytes", self.len)));
        }
        // SAFETY: offset is inside the allocation (checked).
        Ok(unsafe { self.ptr.add(offset as usize) })
    }
}
