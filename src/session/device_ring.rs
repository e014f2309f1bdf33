//! Glue between CUDA device memory (`copy`) and the same-host transport, which moves a device
//! ring's IPC export and writes through it without depending on CUDA itself.

use crate::copy::cuda::DeviceMemory;
use crate::error::Result;
use crate::transport::shm::{DeviceExport, DeviceRing};

impl DeviceRing for DeviceMemory {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn read(&self, at: usize, dst: &mut [u8]) -> Result<()> {
        DeviceMemory::read(self, at, dst)
    }

    fn write(&self, at: usize, src: &[u8]) -> Result<()> {
        DeviceMemory::write(self, at, src)
    }
}

/// The export of a receiver's device ring for a same-host sender.
pub fn export(ring: &DeviceMemory) -> Result<DeviceExport> {
    let (handle, offset) = ring.export()?;
    Ok(DeviceExport { handle, offset, ptr: ring.ptr })
}

/// Opens a receiver's exported device ring on CUDA device `ordinal` (a sender's KV pool device).
pub fn open(ordinal: i32, export: &DeviceExport, len: usize, same_process: bool) -> Result<Box<dyn DeviceRing>> {
    let ring = DeviceMemory::open_export(ordinal, &export.handle, export.offset, export.ptr, len, same_process)?;
    Ok(Box::new(ring))
}
