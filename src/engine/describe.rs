//! `kvstage_engine_describe`: the whole engine as data, for an operator asking where requests are.

use serde::Serialize;

use super::Engine;
use crate::transport::rdma::RdmaMode;
use crate::transport::shm::ShmMode;
use crate::session::receiver::state::ReceiverDescription;
use crate::session::sender::describe::SessionDescription;
use crate::session::DESCRIBE_VERSION;


#[derive(Clone, Debug, Serialize)]
pub struct EngineDescription {
    pub version: u32,
    pub listen_address: String,
    pub transport: String,
    /// The decode side: ring, accepted connections, rooms.
    pub receiver: ReceiverDescription,
    /// The prefill side: the sessions this engine opened and still holds.
    pub sessions: Vec<SessionDescription>,
}

impl Engine {
    pub fn describe(&self) -> EngineDescription {
        let sessions = self.sessions.lock().iter().filter_map(|w| w.upgrade()).collect::<Vec<_>>();
        EngineDescription {
            version: DESCRIBE_VERSION,
            listen_address: self.local_addr.to_string(),
            transport: self.transport_state(),
            receiver: self.receiver().describe(),
            sessions: sessions.iter().map(|s| s.describe()).collect(),
        }
    }

    /// The transport in one line: the same-host path (mode, sessions, those in direct mode and
    /// their chunk regions copied page to page, the last downgrade), then "rdma: mlx5_0:1
    /// (InfiniBand, MTU 4096), ..." or why RDMA is not used and the last downgrade to TCP.
    pub fn transport_state(&self) -> String {
        let rdma = self.rdma();
        let shm = self.shm();
        let mut parts = Vec::new();
        let same_host = match shm.mode() {
            ShmMode::Required => Some("shm (required): same-host peers only"),
            ShmMode::Auto => Some("same host: shm (auto)"),
            ShmMode::Off if self.options().transport == crate::engine::TransportKind::Auto => Some("same host: off (same_host OFF)"),
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
        parts.join("; other hosts: ")
    }
}
