//! Version, status names, the last-error accessors and the capability report.

use std::ffi::c_char;

use super::last_error::{self, kvstage_error};
use super::{ffi_fn, out_ptr, write_versioned};
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

/// The name of a status code ("KVSTAGE_E_TIMEOUT"), or "KVSTAGE_UNKNOWN" (static storage).
#[no_mangle]
pub unsafe extern "C" fn kvstage_status_name(code: i32) -> *const c_char {
    ffi_fn!(value = c"KVSTAGE_UNKNOWN".as_ptr(), {
        match Status::from_code(code) {
            Some(status) => status.name_c().as_ptr() as *const c_char,
            None => c"KVSTAGE_UNKNOWN".as_ptr(),
        }
    })
}

/// The last error of this thread; never NULL ("no error" sentinel with code `KVSTAGE_OK`).
/// Valid until the next kvstage call on the same thread.
#[no_mangle]
pub unsafe extern "C" fn kvstage_error_last() -> *const kvstage_error {
    ffi_fn!(keep_error, value = last_error::no_error(), { last_error::current() })
}

/// Resets this thread's last error to the "no error" sentinel.
#[no_mangle]
pub unsafe extern "C" fn kvstage_error_clear() {
    ffi_fn!(keep_error, value = (), { last_error::clear() })
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

/// TEST BUILDS ONLY (cargo feature `testing`): the next chunk this process writes by RDMA does
/// something wrong on the wire, to run the failure paths on real verbs: `fault` 1 = a remote key
/// the receiver never issued, 2 = the granted range moved past the end of the registered ring,
/// 3 = QP 0 moved to the error state once the chunk's first work requests are posted, 4 = the
/// writer stops for 10 s once they are posted (to kill the process mid-write), 5 = the
/// write-with-immediate goes as a plain write (the ready arrives without its immediate); 0
/// disarms.
#[cfg(feature = "testing")]
#[no_mangle]
pub unsafe extern "C" fn kvstage_testing_rdma_fault(fault: u32) -> Status {
    ffi_fn!(status {
        use crate::transport::rdma::fault::{arm, WriteFault};
        let armed = WriteFault::from_code(fault)
            .ok_or_else(|| crate::error::Error::invalid_arg("fault", format!("{fault} is not 0..=5")))?;
        arm(armed);
        Ok(Status::KVSTAGE_OK)
    })
}

/// TEST BUILDS ONLY (cargo feature `testing`): panics inside the export after borrowing `engine`,
/// to prove that a panic becomes `KVSTAGE_E_PANIC` and poisons the handle.
#[cfg(feature = "testing")]
#[no_mangle]
pub unsafe extern "C" fn kvstage_testing_panic(engine: *const super::engine::kvstage_engine) -> Status {
    ffi_fn!(status {
        let _engine = unsafe { super::engine::borrow(engine, "engine") }?;
        panic!("kvstage_testing_panic was called");
    })
}
