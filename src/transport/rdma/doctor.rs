//! What this host offers kvstage: libibverbs, RDMA devices and ports, dma-buf / peer memory,
//! libcuda and GPUs. As readable text and as JSON (`kvstage_doctor`, `kvstage-bench --doctor`).
//! Detection only: nothing here opens a queue pair or registers memory.

use std::fmt::Write as _;

use super::attrs::{port_state_name, LinkLayer, PORT_ACTIVE};
use super::hw::HwProvider;
use super::verbs::{PortInfo, Provider};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortReport {
    pub info: PortInfo,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceReport {
    pub name: String,
    pub ports: Vec<PortReport>,
    /// Why the device or a port could not be queried.
    pub error: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub version: String,
    /// `Err(dlerror text)` when libibverbs.so.1 cannot be loaded.
    pub libibverbs: Result<(), String>,
    /// The device list, or the error chain of `ibv_get_device_list` (down to the OS error).
    pub devices: Result<Vec<DeviceReport>, String>,
    /// libibverbs exports `ibv_reg_dmabuf_mr` (GPU memory registration through dma-buf).
    pub dmabuf_mr: bool,
    /// Loaded peer-memory kernel module (`nvidia_peermem` or `nv_peer_mem`), if any.
    pub peer_memory: Option<String>,
    pub kernel: String,
    pub libcuda: Result<(), String>,
    pub gpus: usize,
    /// The same-host path works here: a sealed memfd passed over an abstract Unix socket and
    /// mapped again (`Err`: why not, e.g. a seccomp profile refusing memfd_create).
    pub same_host: Result<(), String>,
}

impl Report {
    /// True when at least one device has an ACTIVE port.
    pub fn rdma_usable(&self) -> bool {
        self.devices.as_ref().is_ok_and(|d| d.iter().any(|d| d.ports.iter().any(|p| p.info.state == PORT_ACTIVE)))
    }

    pub fn verdict(&self) -> String {
        if self.rdma_usable() {
            "RDMA usable: transport auto and rdma use it when the peer can too".to_owned()
        } else {
            "no RDMA: transport auto uses TCP (counted in rdma_downgrades); transport rdma fails with KVSTAGE_E_NO_DEVICE".to_owned()
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_else(|_| "unknown".into())
}

fn peer_memory_module() -> Option<String> {
    ["nvidia_peermem", "nv_peer_mem"].iter().find(|m| std::path::Path::new(&format!("/sys/module/{m}")).exists()).map(|m| m.to_string())
}

fn probe_devices(provider: &dyn Provider) -> Result<Vec<DeviceReport>, String> {
    let names = super::list_devices(provider).map_err(|e| e.chain())?;
    Ok(names
        .into_iter()
        .map(|name| {
            let mut report = DeviceReport { name: name.clone(), ports: Vec::new(), error: None };
            let queried = provider.open(&name).and_then(|dev| {
                for p in 1..=dev.port_count()? {
                    report.ports.push(PortReport { info: dev.port(p)? });
                }
                Ok(())
            });
            if let Err(e) = queried {
                report.error = Some(e.chain());
            }
            report
        })
        .collect())
}

/// Probes this host.
pub fn probe() -> Report {
    let libibverbs = match crate::dynlib::load_error(c"libibverbs.so.1") {
        None => Ok(()),
        Some(e) => Err(e),
    };
    let devices = probe_devices(&HwProvider);
    let libcuda = match crate::dynlib::load_error(c"libcuda.so.1") {
        None => Ok(()),
        Some(e) => Err(e),
    };
    let gpus = if libcuda.is_ok() { crate::dynlib::cuda_device_count() } else { 0 };
    Report {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        dmabuf_mr: libibverbs.is_ok() && crate::dynlib::has_symbol(c"libibverbs.so.1", c"ibv_reg_dmabuf_mr"),
        libibverbs,
        devices,
        peer_memory: peer_memory_module(),
        kernel: kernel_release(),
        libcuda,
        gpus,
        same_host: crate::transport::shm::probe().map_err(|e| e.chain()),
    }
}

fn link_layer_text(ll: LinkLayer) -> &'static str {
    match ll {
        LinkLayer::InfiniBand => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
        LinkLayer::Unspecified => "unspecified",
    }
}

/// The readable report.
pub fn text(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "kvstage {} doctor", r.version);
    let _ = writeln!(s, "RDMA");
    match &r.libibverbs {
        Ok(()) => {
            let _ = writeln!(s, "  libibverbs.so.1: found");
        }
        Err(e) => {
            let _ = writeln!(s, "  libibverbs.so.1: not found ({e})");
        }
    }
    match &r.devices {
        Err(e) => {
            let _ = writeln!(s, "  devices: none ({e})");
        }
        Ok(d) if d.is_empty() => {
            let _ = writeln!(s, "  devices: none (ibv_get_device_list returned an empty list)");
        }
        Ok(devices) => {
            let _ = writeln!(s, "  devices: {}", devices.len());
            for d in devices {
                let _ = writeln!(s, "    {}", d.name);
                for p in &d.ports {
                    let i = &p.info;
                    let _ = writeln!(
                        s,
                        "      port {}: {}, active MTU {} (max {}), link layer {}, LID {:#06x}, GID table {}",
                        i.port,
                        port_state_name(i.state),
                        i.active_mtu,
                        i.max_mtu,
                        link_layer_text(i.link_layer),
                        i.lid,
                        i.gid_table_len
                    );
                }
                if let Some(e) = &d.error {
                    let _ = writeln!(s, "      error: {e}");
                }
            }
        }
    }
    let _ = writeln!(s, "  ibv_reg_dmabuf_mr (GPU memory by dma-buf): {}", if r.dmabuf_mr { "available" } else { "unavailable" });
    let _ = writeln!(s, "  peer memory module: {}", r.peer_memory.as_deref().unwrap_or("not loaded"));
    let _ = writeln!(s, "  kernel: {}", r.kernel);
    let _ = writeln!(s, "  verdict: {}", r.verdict());
    let _ = writeln!(s, "CUDA");
    match &r.libcuda {
        Ok(()) => {
            let _ = writeln!(s, "  libcuda.so.1: found");
        }
        Err(e) => {
            let _ = writeln!(s, "  libcuda.so.1: not found ({e})");
        }
    }
    let _ = writeln!(s, "  GPUs: {}", r.gpus);
    let _ = writeln!(s, "Same host");
    match &r.same_host {
        Ok(()) => {
            let _ = writeln!(s, "  shared-memory path: usable (transport auto and shm use it for peers on this host with an engine-owned ring)");
        }
        Err(e) => {
            let _ = writeln!(s, "  shared-memory path: unusable ({e}); same-host peers use RDMA or TCP");
        }
    }
    s
}

/// A JSON string literal.
pub fn json_str(v: &str) -> String {
    let mut s = String::with_capacity(v.len() + 2);
    s.push('"');
    for c in v.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '\r' => s.push_str("\\r"),
            '\t' => s.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(s, "\\u{:04x}", c as u32);
            }
            c => s.push(c),
        }
    }
    s.push('"');
    s
}

fn found_json(r: &Result<(), String>) -> String {
    match r {
        Ok(()) => "{\"found\":true,\"error\":null}".to_owned(),
        Err(e) => format!("{{\"found\":false,\"error\":{}}}", json_str(e)),
    }
}

/// The report as one JSON object.
pub fn json(r: &Report) -> String {
    let devices = match &r.devices {
        Ok(d) => d
            .iter()
            .map(|d| {
                let ports = d
                    .ports
                    .iter()
                    .map(|p| {
                        let i = &p.info;
                        format!(
                            "{{\"port\":{},\"state\":{},\"active_mtu\":{},\"max_mtu\":{},\"link_layer\":{},\"lid\":{},\"gid_table_len\":{}}}",
                            i.port,
                            json_str(port_state_name(i.state)),
                            i.active_mtu.bytes(),
                            i.max_mtu.bytes(),
                            json_str(link_layer_text(i.link_layer)),
                            i.lid,
                            i.gid_table_len
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                let err = d.error.as_deref().map_or("null".to_owned(), json_str);
                format!("{{\"name\":{},\"ports\":[{ports}],\"error\":{err}}}", json_str(&d.name))
            })
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => String::new(),
    };
    let list_error = r.devices.as_ref().err().map_or("null".to_owned(), |e| json_str(e));
    format!(
        concat!(
            "{{\"version\":{},\"rdma\":{{\"libibverbs\":{},\"device_list_error\":{},\"devices\":[{}],",
            "\"dmabuf_mr\":{},\"peer_memory\":{},\"kernel\":{},\"usable\":{},\"verdict\":{}}},",
            "\"cuda\":{{\"libcuda\":{},\"gpus\":{}}},",
            "\"same_host\":{{\"available\":{},\"error\":{}}}}}"
        ),
        json_str(&r.version),
        found_json(&r.libibverbs),
        list_error,
        devices,
        r.dmabuf_mr,
        r.peer_memory.as_deref().map_or("null".to_owned(), json_str),
        json_str(&r.kernel),
        r.rdma_usable(),
        json_str(&r.verdict()),
        found_json(&r.libcuda),
        r.gpus,
        r.same_host.is_ok(),
        r.same_host.as_ref().err().map_or("null".to_owned(), |e| json_str(e))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::attrs::Mtu;

    fn sample(devices: Result<Vec<DeviceReport>, String>) -> Report {
        Report {
            version: "0.1.0".into(),
            libibverbs: Err("libibverbs.so.1: cannot open shared object file".into()),
            devices,
            dmabuf_mr: false,
            peer_memory: None,
            kernel: "6.1.0".into(),
            libcuda: Ok(()),
            gpus: 2,
            same_host: Err("memfd_create failed: Operation not permitted (os error 1)".into()),
        }
    }

    #[test]
    fn no_rdma_report() {
        let r = sample(Err("ibv_get_device_list failed: Operation not supported (os error 95)".into()));
        assert!(!r.rdma_usable());
        let t = text(&r);
        assert!(t.contains("libibverbs.so.1: not found (libibverbs.so.1: cannot open"), "{t}");
        assert!(t.contains("devices: none (ibv_get_device_list failed: Operation not supported (os error 95))"), "{t}");
        assert!(t.contains("verdict: no RDMA"));
        assert!(t.contains("GPUs: 2"));
        let j = json(&r);
        assert!(j.contains("\"libibverbs\":{\"found\":false,"), "{j}");
        assert!(j.contains("\"devices\":[]"));
        assert!(j.contains("\"usable\":false"));
        assert!(j.contains("\"cuda\":{\"libcuda\":{\"found\":true,\"error\":null},\"gpus\":2}"), "{j}");
        assert!(t.contains("shared-memory path: unusable (memfd_create failed"), "{t}");
        assert!(j.contains("\"same_host\":{\"available\":false,\"error\":\"memfd_create failed"), "{j}");
    }

    #[test]
    fn device_report() {
        let port = PortInfo { port: 1, state: PORT_ACTIVE, active_mtu: Mtu::M4096, max_mtu: Mtu::M4096, link_layer: LinkLayer::Ethernet, lid: 0, gid_table_len: 255 };
        let r = sample(Ok(vec![DeviceReport { name: "mlx5_0".into(), ports: vec![PortReport { info: port }], error: None }]));
        assert!(r.rdma_usable());
        let t = text(&r);
        assert!(t.contains("port 1: ACTIVE, active MTU 4096 (max 4096), link layer Ethernet, LID 0x0000, GID table 255"), "{t}");
        let j = json(&r);
        assert!(j.contains("{\"name\":\"mlx5_0\",\"ports\":[{\"port\":1,\"state\":\"ACTIVE\",\"active_mtu\":4096,"), "{j}");
        assert!(j.contains("\"device_list_error\":null"));
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
    }

    #[test]
    fn this_host_probes_without_panicking() {
        let r = probe();
        let t = text(&r);
        assert!(t.starts_with("kvstage "));
        assert!(json(&r).starts_with("{\"version\":"));
    }
}
