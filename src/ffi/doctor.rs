//! Host capability report (`kvstage_doctor`) and an engine's transport state.

use std::ffi::c_char;

use super::{engine, ffi_fn, write_text};
use crate::error::{Error, Status};
use crate::transport::rdma::RdmaMode;
use crate::transport::shm::ShmMode;

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
pub unsafe extern "C" fn kvstage_doctor(buf: *mut c_char, capacity: usize, needed: *mut usize, json: i32) -> Status {
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

/// Describes the engine's transport in one line: the same-host path (mode, sessions, those in
/// direct mode and their chunk regions copied page to page, the last downgrade), then "rdma: mlx5_0:1 (InfiniBand, MTU 4096), ..." or why RDMA is not used and the
/// last downgrade of a session to TCP. Same buffer rules as `kvstage_doctor`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_transport_describe(
    engine: *const engine::kvstage_engine,
    buf: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { engine::borrow(engine, "engine") }?;
        let rdma = engine.rdma();
        let shm = engine.shm();
        let mut parts = Vec::new();
        let same_host = match shm.mode() {
            ShmMode::Required => Some("shm (required): same-host peers only"),
            ShmMode::Auto => Some("same host: shm (auto)"),
            ShmMode::Off if engine.options().transport == crate::engine::TransportKind::Auto => Some("same host: off (same_host OFF)"),
            ShmMode::Off => None,
        };
        if let Some(what) = same_host {
            let mut part = format!("{what}, {} session(s)", shm.sessions());
            if !shm.direct() {
                part.push_str(", direct mode off (same_host_direct 0)");
            } else if shm.direct_sessions() > 0 {
                part.push_str(&format!(", {} direct (decode pool mapped, {} chunk region(s) copied page to page)", shm.direct_sessions(), shm.direct_chunks()));
            }
            let n = shm.downgrades();
            if n > 0 {
                part.push_str(&format!(", {n} same-host session(s) not on shm, last: {}", shm.last_downgrade()));
            }
            parts.push(part);
        }
        let rdma_part = match rdma.mode() {
            RdmaMode::Off if shm.mode() == ShmMode::Required => None,
            RdmaMode::Off => Some("tcp (transport tcp)".to_owned()),
            mode if rdma.active() => {
                let nics: Vec<String> = rdma
                    .nics()
                    .iter()
                    .map(|n| format!("{} ({}, MTU {}, GID index {})", n.attrs.describe(), n.attrs.link_layer, n.attrs.active_mtu, n.attrs.gid_index))
                    .collect();
                let how = if mode == RdmaMode::Required { "required" } else { "auto" };
                Some(format!("rdma ({how}): {}, {} QP(s) per device", nics.join(", "), rdma.options().qps_per_device))
            }
            _ => Some(format!("tcp (transport auto, no usable RDMA device: {})", rdma.unavailable_reason())),
        };
        if let Some(mut part) = rdma_part {
            let (n, last) = (rdma.downgrades(), rdma.last_downgrade());
            if n > 0 {
                part.push_str(&format!("; {n} session(s) downgraded to tcp, last: {last}"));
            }
            let (n, last) = rdma.host_bounces();
            if n > 0 {
                part.push_str(&format!("; {n} session(s) staging GPU data in host memory (no GPUDirect), last: {last}"));
            }
            parts.push(part);
        }
        let text = parts.join("; other hosts: ");
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}
