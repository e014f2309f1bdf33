//! Glue between CUDA device memory (`copy`) and the same-host transport, which moves a device
//! ring's IPC export and writes through it without depending on CUDA itself.

use crate::copy::cuda::DeviceMemory;
use crate::error::{Error, Result, Status};
use crate::transport::rdma::DmaBuf;
use crate::transport::shm::{DeviceExport, DeviceRing};

impl DeviceRing for DeviceMemory {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn to_vec(&self, at: usize, len: usize) -> Result<Vec<u8>> {
        DeviceMemory::to_vec(self, at, len)
    }
}

/// Device memory as a dma-buf for the NIC (GPUDirect RDMA): a ring or a send staging buffer.
pub fn dmabuf(memory: &DeviceMemory) -> Result<DmaBuf> {
    memory.dmabuf().map(|(fd, offset)| DmaBuf { fd, offset })
}

/// The export of a receiver's device ring for a same-host sender. A peer that opens it reaches
/// the whole allocation, so the caller's memory is exported only when the allocation is exactly
/// the ring (not, say, a PyTorch allocator segment that also holds weights or KV).
pub fn export(ring: &DeviceMemory) -> Result<DeviceExport> {
    let (handle, offset, allocation) = ring.export()?;
    if !ring.is_owned() && (offset != 0 || allocation != ring.bytes as u64) {
        return Err(Error::new(
            Status::KVSTAGE_E_UNSUPPORTED,
            format!(
                "the caller's device ring is {} bytes at offset {offset} of a {allocation}-byte allocation: CUDA IPC would give a peer all of it \
                 (register an allocation of exactly the ring's size, or let the engine allocate the ring)",
                ring.bytes
            ),
        ));
    }
    Ok(DeviceExport { handle, offset, ptr: ring.ptr })
}

/// Opens a receiver's exported device ring on CUDA device `ordinal` (a sender's KV pool device).
pub fn open(ordinal: i32, export: &DeviceExport, len: usize, same_process: bool) -> Result<Box<dyn DeviceRing>> {
    let ring = DeviceMemory::open_export(ordinal, &export.handle, export.offset, export.ptr, len, same_process)?;
    Ok(Box::new(ring))
}
