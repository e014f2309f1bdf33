//! Staging memory: the decode ring a rank registers, and host memory a same-host sender can map
//! (where a decode rank puts its KV pool for direct mode).

use std::ffi::c_void;

use super::args::{init_versioned, out_arg, read_versioned, versioned};
use super::ffi_fn;
use super::handle;
use crate::error::Status;
use crate::session::receiver::RingSpec;

/// A staging ring to register (`kvstage_staging_register`). Set `struct_size`
/// first (`kvstage_staging_memory_init`): fields appended later keep their defaults for callers
/// built with an older header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_staging_memory {
    pub struct_size: usize,
    /// A `kvstage_memory_kind` value (`_init`: HOST).
    pub memory_kind: i32,
    /// KVSTAGE_MEMORY_CUDA: the device ordinal. Required (>= 0) when the engine allocates the ring;
    /// for caller memory, checked against the memory (negative: the device holding `memory`).
    /// Ignored for host memory. `_init`: -1.
    pub cuda_device: i32,
    /// The ring's memory; NULL: the engine allocates it (host: a memfd a same-host sender can
    /// map; CUDA: device memory on `cuda_device`) and frees it with the engine or the next ring.
    pub memory: *mut std::ffi::c_void,
    /// Ring size in bytes (> 0).
    pub bytes: usize,
}

impl Default for kvstage_staging_memory {
    fn default() -> Self {
        kvstage_staging_memory {
            struct_size: std::mem::size_of::<Self>(),
            memory_kind: 0,
            cuda_device: -1,
            memory: std::ptr::null_mut(),
            bytes: 0,
        }
    }
}

versioned!(kvstage_staging_memory, bytes: usize);

/// Fills `staging` (`size`: the caller's `sizeof(*staging)`) with defaults (sets `struct_size`; host memory, engine-allocated, cuda_device
/// -1, bytes 0: set `bytes`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_staging_memory_init(staging: *mut kvstage_staging_memory, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(staging, size, "staging") } })
}

/// Registers the decode-side staging ring described by `staging` (host or CUDA device memory,
/// the caller's or the engine's). A device ring is read directly by the scatter kernels, so the
/// KV pool must be CUDA memory of the same device (checked here and when the pool is registered
/// second: `KVSTAGE_E_INVALID_ARG`); payloads arriving over TCP land through a 4 MiB pinned host
/// buffer per connection. Same-host and RDMA sessions need CUDA IPC and GPUDirect registration,
/// not implemented yet: a device ring refuses them, so AUTO senders downgrade to TCP (counted in
/// their `shm_downgrades` / `rdma_downgrades`) and SHM or RDMA senders fail at connect.
/// Errors: `KVSTAGE_E_NO_DEVICE` without libcuda or without a device, `KVSTAGE_E_INVALID_ARG`
/// for a `cuda_device` this host lacks or that differs from the memory's device,
/// `KVSTAGE_E_GEOMETRY_INVALID` when caller memory is not device memory of one allocation over its
/// whole extent, `KVSTAGE_E_OUT_OF_MEMORY` or `KVSTAGE_E_CUDA` when the engine's allocation
/// fails. Host memory of the caller's must stay valid until the engine is freed (after
/// `kvstage_engine_shutdown` said no same-host peer maps it); engine-owned memory lives as long as
/// the engine or until the next registration. Senders learn the ring's size in the handshake.
#[no_mangle]
pub unsafe extern "C" fn kvstage_staging_register(
    engine: *const handle::kvstage_engine,
    staging: *const kvstage_staging_memory,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let raw: kvstage_staging_memory = unsafe { read_versioned(staging, "staging") }?;
        let memory = super::pool::memory_kind_from_c(raw.memory_kind, "staging->memory_kind")?;
        let ptr = (!raw.memory.is_null()).then_some(raw.memory as *mut u8);
        let cuda_device = (raw.cuda_device >= 0).then_some(raw.cuda_device as u32);
        engine.register_staging_memory(RingSpec { memory, cuda_device, ptr, bytes: raw.bytes })?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Allocates `bytes` of zeroed, resident host memory that a same-host sender can map (a sealed
/// memfd mapped here; page-aligned): a decode rank whose KV pool buffers all lie in such
/// allocations serves direct mode, where a same-host prefill copies each chunk from its pages
/// straight into the decode pages (no ring, no scatter). `*out` receives the address. Errors:
/// `KVSTAGE_E_INVALID_ARG` for 0 bytes or a NULL `out`, `KVSTAGE_E_OUT_OF_MEMORY` when the
/// memory cannot be had (the cause names the OS error). Free with `kvstage_shared_free`, after
/// the engine whose pool it holds was freed.
#[no_mangle]
pub unsafe extern "C" fn kvstage_shared_alloc(bytes: usize, out: *mut *mut c_void) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        *out = crate::transport::shm::pool::alloc(bytes)?.cast();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Frees an allocation of `kvstage_shared_alloc` (`ptr` as it returned it). A same-host sender
/// that still maps it keeps the pages until it unmaps; this process no longer has them.
/// `KVSTAGE_E_INVALID_ARG` for any other pointer (NULL, an address inside an allocation, or one
/// freed already), and for an allocation that holds the KV pool of an engine not yet freed.
#[no_mangle]
pub unsafe extern "C" fn kvstage_shared_free(ptr: *mut c_void) -> Status {
    ffi_fn!(status {
        crate::transport::shm::pool::free(ptr.cast())?;
        Ok(Status::KVSTAGE_OK)
    })
}
