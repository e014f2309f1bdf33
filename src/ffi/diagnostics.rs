//! Diagnostics of the host: what it offers kvstage (`kvstage_doctor_run`). An engine's own state
//! is in its describe document (`kvstage_engine_describe`).

use std::ffi::c_char;

use super::args::write_text;
use super::ffi_fn;
use crate::error::{Error, Status};

/// Reports what this host offers kvstage: whether libibverbs loads, the RDMA devices and their
/// ports (state, active and max MTU, link layer, LID, GID table size), dma-buf registration and
/// peer-memory support, whether libcuda loads and the GPU count, a verdict, and whether the same-host
/// (shared-memory) path works here. `json` 0: readable
/// text; 1: one JSON object. The report is written NUL-terminated into `buf`; `*needed` (may be
/// NULL) receives its size including the NUL. `buf` NULL with `capacity` 0 is a size query
/// (`KVSTAGE_OK`, `needed` required); a too small buffer is `KVSTAGE_E_INVALID_ARG` naming both
/// sizes.
/// Hosts without rdma-core or without a device get a clean "no RDMA" report, not an error.
#[no_mangle]
pub unsafe extern "C" fn kvstage_doctor_run(json: i32, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Status {
    ffi_fn!(status {
        let report = crate::transport::rdma::doctor::probe();
        let text = match json {
            0 => crate::transport::rdma::doctor::text(&report),
            1 => crate::transport::rdma::doctor::json(&report),
            other => return Err(Error::invalid_arg("json", format!("{other} is neither 0 (text) nor 1 (JSON)"))),
        };
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}

