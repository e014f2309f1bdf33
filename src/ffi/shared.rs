//! Host memory a same-host sender can map: where a decode rank puts its KV pool for direct mode.

use std::ffi::c_void;

use super::{ffi_fn, out_arg};
use crate::error::Status;

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
        let out = unsafe { out_arg(out, "out") }?;
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
