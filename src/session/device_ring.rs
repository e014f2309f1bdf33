//! Glue between CUDA device memory (`copy`) and the same-host transport, which moves a device
//! ring's (and, in direct mode, a device pool's) IPC exports and writes through them without
//! depending on CUDA itself.

use crate::copy::cuda::DeviceMemory;
use crate::error::{Error, Result, Status};
use crate::geometry::KvLayout;
use crate::transport::rdma::DmaBuf;
use crate::transport::shm::pool::PoolShare;
use crate::transport::shm::{DeviceExport, PeerDevice};

impl PeerDevice for DeviceMemory {
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
pub fn open(ordinal: i32, export: &DeviceExport, len: usize, same_process: bool) -> Result<Box<dyn PeerDevice>> {
    let ring = DeviceMemory::open_export(ordinal, &export.handle, export.offset, export.ptr, len, same_process)?;
    Ok(Box::new(ring))
}

/// Direct mode's share of a CUDA KV pool: the IPC export of every allocation holding its buffers,
/// each of which must hold nothing else (see [`PoolShare::device`]); `Err` says why not (the pool
/// is then served through the ring).
pub fn pool_share(pool: &KvLayout) -> std::result::Result<PoolShare, String> {
    let ordinal = crate::copy::cuda::pool_device(pool, None).map_err(|e| e.chain())?;
    let allocation = |base: usize| DeviceMemory::allocation_holding(ordinal, base as u64).map(|(start, size)| (start as usize, size)).map_err(|e| e.chain());
    let export = |start: usize| {
        DeviceMemory::export_allocation(ordinal, start as u64).map(|handle| DeviceExport { handle, offset: 0, ptr: start as u64 }).map_err(|e| e.chain())
    };
    PoolShare::device(pool, allocation, export)
}
