//! The library as a whole: its version and what this host offers it.

use std::ffi::c_char;

use super::args::{out_ptr, write_versioned};
use super::ffi_fn;
use crate::error::Status;

/// Version string of the library, e.g. "0.3.0".
const VERSION_C: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The library's version as "MAJOR.MINOR.PATCH" (static storage).
#[no_mangle]
pub unsafe extern "C" fn kvstage_version_string() -> *const c_char {
    ffi_fn!(value = std::ptr::null(), { VERSION_C.as_ptr() as *const c_char })
}

/// The library's version as `MAJOR << 16 | MINOR << 8 | PATCH`, comparable with `KVSTAGE_VERSION`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_version() -> u32 {
    ffi_fn!(value = 0, { crate::version_number() })
}

/// What this build can use on this host, as detected at run time.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct kvstage_capabilities {
    pub struct_size: usize,
    /// Always 1: TCP needs nothing but the OS.
    pub tcp: u8,
    /// 1 when libibverbs is loadable and lists at least one device.
    pub rdma: u8,
    /// Always 1: host-memory KV pools.
    pub host_memory: u8,
    /// 1 when libcuda is loadable and reports at least one device.
    pub cuda_memory: u8,
}

/// Fills `out` with what this build can use on this host. Set `out->struct_size` first.
#[no_mangle]
pub unsafe extern "C" fn kvstage_capabilities_get(out: *mut kvstage_capabilities) -> Status {
    ffi_fn!(status {
        let out = out_ptr(out, "out")?;
        let caps = crate::engine::Capabilities::detect();
        let filled = kvstage_capabilities {
            struct_size: std::mem::size_of::<kvstage_capabilities>(),
            tcp: 1,
            rdma: caps.rdma as u8,
            host_memory: 1,
            cuda_memory: caps.cuda as u8,
        };
        unsafe { write_versioned(out, filled, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

