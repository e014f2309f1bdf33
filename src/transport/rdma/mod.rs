//! RDMA transport: RC queue pairs over libibverbs (through sideway, loaded at run time), connected
//! through the session's TCP control stream. The chunk's bytes move by RDMA WRITE into the range
//! the receiver granted in its registered staging ring, split into work requests of
//! `wr_bytes` with one signalled completion per `signal_every`, striped over `qps_per_device`
//! QPs on each selected device; the chunk's completion is a WRITE_WITH_IMM (imm = the
//! `ChunkReady` request id) on QP 0 after every other QP's data completed, so it can neither
//! overtake nor be separated from the data. Control frames (allocation, `Written`,
//! `ChunkReady`, acks, watermarks) stay on TCP: the ring, control plane and deadlines are shared.
//!
//! Only the staging ring (receiver) and the send staging buffers (sender, each from the first RDMA
//! session that takes it until it is freed) are registered, never a KV pool; the ring is
//! registered for remote write as a whole (see README "RDMA" for the limits). A layer-wise region goes in plain RDMA WRITEs, one per marked batch's
//! run of slabs, and its completion is a zero-length WRITE_WITH_IMM after all of them completed.
//!
//! Files: `attrs` (pure: attribute exchange, MTU, port diff, wc names), `split` (pure: WR planning),
//! `verbs` (the verbs as traits), `hw` (sideway), `soft` (test builds: an in-process fabric),
//! `link` (QP slots, CQ poller, sender transport, receiver peer), `registration` (memory
//! registered with the devices: the ring, send staging, device memory by dma-buf), `doctor` (host
//! report), `fault` (test builds: faults injected into real writes).

pub mod attrs;
pub mod doctor;
pub mod fault;
mod hw;
pub mod link;
mod registration;
#[cfg(any(test, feature = "testing"))]
pub mod soft;
pub mod split;
pub mod verbs;
#[cfg(test)]
mod tests;

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use self::attrs::{negotiate_mtu, transition_error, PortAttrs, QpEndpoint, RdmaOffer, OFFER_VERSION, PORT_ACTIVE};
use self::link::{Arrivals, Notify, Poller, QpSlot, RdmaPeer, RdmaTransport, RemoteRing, RECV_DEPTH};
use self::registration::Registration;
pub use self::registration::{DmaBuf, NicMemory, StagingKeys, StagingRegistration};
use self::verbs::{Connect, Device, Provider, QpCaps};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::{self, Message};
use crate::transport::Transport;

/// One selected device, optionally with its port ("mlx5_0:1").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSel {
    pub name: String,
    pub port: Option<u8>,
}

/// RDMA settings of an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaOptions {
    /// Devices to use, striped; empty = automatic (the first device with an ACTIVE port).
    pub devices: Vec<DeviceSel>,
    /// GID index (RoCE); `None` = automatic (a RoCE v2 IPv4-mapped GID when there is one).
    pub gid_index: Option<u32>,
    /// Queue pairs per device and session (1..=16).
    pub qps_per_device: u32,
    /// Largest RDMA WRITE work request in bytes (4 KiB..=1 GiB).
    pub wr_bytes: u32,
    /// One signalled completion per this many work requests (1..=1024).
    pub signal_every: u32,
}

pub const DEFAULT_WR_BYTES: u32 = 1 << 20;
pub const DEFAULT_SIGNAL_EVERY: u32 = 16;

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions { devices: Vec::new(), gid_index: None, qps_per_device: 1, wr_bytes: DEFAULT_WR_BYTES, signal_every: DEFAULT_SIGNAL_EVERY }
    }
}

/// Parses "mlx5_0:1,mlx5_1" (device names with an optional port, comma-separated; "" = automatic).
pub fn parse_devices(text: &str) -> Result<Vec<DeviceSel>> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, port) = match part.rsplit_once(':') {
            Some((n, p)) => {
                let port = p.parse::<u8>().ok().filter(|&p| p > 0).ok_or_else(|| {
                    Error::invalid_arg("options->rdma_devices", format!("port \"{p}\" of \"{part}\" is not 1..=255"))
                })?;
                (n, Some(port))
            }
            None => (part, None),
        };
        if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
            return Err(Error::invalid_arg("options->rdma_devices", format!("\"{name}\" is not a device name")));
        }
        if out.iter().any(|d: &DeviceSel| d.name == name && d.port == port) {
            return Err(Error::invalid_arg("options->rdma_devices", format!("\"{part}\" is listed twice")));
        }
        out.push(DeviceSel { name: name.to_owned(), port });
    }
    Ok(out)
}

impl RdmaOptions {
    pub fn validate(&self) -> Result<()> {
        if !(1..=16).contains(&self.qps_per_device) {
            return Err(Error::invalid_arg("options->rdma_qps_per_device", format!("{} is outside 1..=16", self.qps_per_device)));
        }
        let endpoints = self.devices.len().max(1) * self.qps_per_device as usize;
        if endpoints > attrs::MAX_ENDPOINTS {
            return Err(Error::invalid_arg(
                "options->rdma_devices",
                format!("{} devices x {} QPs = {endpoints} QPs per session exceeds {}", self.devices.len(), self.qps_per_device, attrs::MAX_ENDPOINTS),
            ));
        }
        if !(4096..=1 << 30).contains(&self.wr_bytes) {
            return Err(Error::invalid_arg("options->rdma_wr_bytes", format!("{} is outside 4096..=1073741824", self.wr_bytes)));
        }
        if !(1..=1024).contains(&self.signal_every) {
            return Err(Error::invalid_arg("options->rdma_signal_every", format!("{} is outside 1..=1024", self.signal_every)));
        }
        Ok(())
    }
}

/// What the engine's `transport` option asks of RDMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaMode {
    /// `tcp`: never touch verbs.
    Off,
    /// `auto`: RDMA when both sides can, else TCP (counted in `rdma_downgrades`).
    Auto,
    /// `rdma`: RDMA or an error (`KVSTAGE_E_NO_DEVICE`), at engine creation and at connect.
    Required,
}

/// The verbs provider for a device selection: the software fabric for `soft*` names in test
/// builds, libibverbs otherwise.
fn provider_for(sel: &[DeviceSel]) -> Box<dyn Provider> {
    #[cfg(any(test, feature = "testing"))]
    {
        let names: Vec<String> = sel.iter().map(|d| d.name.clone()).collect();
        if soft::serves(&names) {
            return Box::new(soft::SoftProvider);
        }
    }
    let _ = sel;
    Box::new(hw::HwProvider)
}

/// Why libibverbs cannot be used, when it cannot even be loaded (`dlopen` text).
fn libibverbs_load_error() -> Option<String> {
    crate::dynlib::load_error(c"libibverbs.so.1")
}

/// The device list, with the loader's view added to a failure.
fn list_devices(provider: &dyn Provider) -> Result<Vec<String>> {
    provider.device_names().map_err(|e| {
        if provider.name() == "libibverbs" {
            match libibverbs_load_error() {
                Some(why) => e.context(format!("libibverbs.so.1 could not be loaded ({why})")),
                None => e.context("libibverbs.so.1 is loaded but lists no RDMA device (no kernel support or no NIC)"),
            }
        } else {
            e
        }
    })
}

/// One device the engine uses, with the chosen port.
pub struct Nic {
    pub dev: Arc<dyn Device>,
    pub attrs: PortAttrs,
}

/// Opens a port of `dev` for RC traffic: state ACTIVE, GID chosen.
fn open_port(dev: &Arc<dyn Device>, port: Option<u8>, gid_index: Option<u32>) -> Result<PortAttrs> {
    let ports: Vec<u8> = match port {
        Some(p) => vec![p],
        None => (1..=dev.port_count()?).collect(),
    };
    let mut seen = Vec::new();
    for p in ports {
        let info = dev.port(p)?;
        if info.state != PORT_ACTIVE {
            seen.push(format!("{}:{p} is {}", dev.name(), attrs::port_state_name(info.state)));
            continue;
        }
        let index = match gid_index {
            Some(i) => i,
            None if info.link_layer.uses_lid() => 0,
            None => {
                let n = info.gid_table_len.min(256);
                let table: Vec<(u32, [u8; 16], bool)> =
                    (0..n).filter_map(|i| dev.gid(p, i).ok().map(|(g, v2)| (i, g, v2))).collect();
                match attrs::choose_gid_index(info.link_layer, &table) {
                    Some(i) => i,
                    None => {
                        seen.push(format!("{}:{p} has no usable GID (RoCE)", dev.name()));
                        continue;
                    }
                }
            }
        };
        let (gid, _) = if info.link_layer.uses_lid() && gid_index.is_none() {
            dev.gid(p, index).unwrap_or(([0; 16], false))
        } else {
            dev.gid(p, index)?
        };
        return Ok(PortAttrs {
            device: dev.name().to_owned(),
            port: p,
            link_layer: info.link_layer,
            active_mtu: info.active_mtu,
            lid: info.lid,
            gid_index: index,
            gid,
            state: info.state,
        });
    }
    Err(Error::new(Status::KVSTAGE_E_NO_DEVICE, format!("no usable port: {}", seen.join(", "))))
}

/// Opens the devices the options select.
fn select_nics(options: &RdmaOptions) -> Result<Vec<Nic>> {
    let provider = provider_for(&options.devices);
    let names = list_devices(provider.as_ref())?;
    if names.is_empty() {
        return Err(Error::new(Status::KVSTAGE_E_NO_DEVICE, "ibv_get_device_list returned no devices"));
    }
    let mut nics = Vec::new();
    if options.devices.is_empty() {
        let mut why = Vec::new();
        for name in &names {
            let found = provider.open(name).and_then(|dev| Ok(Nic { attrs: open_port(&dev, None, options.gid_index)?, dev }));
            match found {
                Ok(nic) => {
                    nics.push(nic);
                    break;
                }
                Err(e) => why.push(format!("{name}: {}", e.chain())),
            }
        }
        if nics.is_empty() {
            return Err(Error::new(Status::KVSTAGE_E_NO_DEVICE, format!("no RDMA device has an ACTIVE, usable port ({})", why.join("; "))));
        }
    } else {
        for sel in &options.devices {
            if !names.contains(&sel.name) {
                return Err(Error::new(
                    Status::KVSTAGE_E_NO_DEVICE,
                    format!("no RDMA device named {} (this host has: {})", sel.name, names.join(", ")),
                ));
            }
            let dev = provider.open(&sel.name)?;
            let attrs = open_port(&dev, sel.port, options.gid_index)?;
            nics.push(Nic { dev, attrs });
        }
    }
    Ok(nics)
}


/// The RDMA side of an engine: devices, completion thread, registrations, counters.
pub struct Rdma {
    mode: RdmaMode,
    options: RdmaOptions,
    nics: Vec<Nic>,
    /// Why RDMA is unavailable (mode `Auto` without a device).
    unavailable: Option<String>,
    poller: Arc<Poller>,
    downgrades: AtomicU64,
    sessions: AtomicU64,
    last_downgrade: Mutex<String>,
    /// Sessions of CUDA pools that stage in host memory because device staging memory could not
    /// be registered (no GPUDirect), and why the last one did.
    host_bounces: AtomicU64,
    last_host_bounce: Mutex<String>,
    ring: Mutex<Option<Registration>>,
    /// One registration per registered send staging buffer not yet freed: writes of several
    /// sessions from different buffers never re-register one under another's work requests.
    staging: Mutex<Vec<Arc<Registration>>>,
    salt: u64,
}

impl Rdma {
    /// Verbs never touched (transport `tcp`).
    pub fn off() -> Arc<Rdma> {
        Arc::new(Rdma::with(RdmaMode::Off, RdmaOptions::default(), Vec::new(), Some("transport tcp".into())))
    }

    fn with(mode: RdmaMode, options: RdmaOptions, nics: Vec<Nic>, unavailable: Option<String>) -> Rdma {
        let salt = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Rdma {
            mode,
            options,
            nics,
            unavailable,
            poller: Arc::new(Poller::default()),
            downgrades: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            last_downgrade: Mutex::new(String::new()),
            host_bounces: AtomicU64::new(0),
            last_host_bounce: Mutex::new(String::new()),
            ring: Mutex::new(None),
            staging: Mutex::new(Vec::new()),
            salt,
        }
    }

    /// Opens the devices for `mode`. `Required` without a usable device is `KVSTAGE_E_NO_DEVICE`
    /// whose causes end with the OS error of the device-list call; `Auto` then runs on TCP.
    pub fn open(mode: RdmaMode, options: RdmaOptions) -> Result<Arc<Rdma>> {
        options.validate()?;
        if mode == RdmaMode::Off {
            return Ok(Rdma::off());
        }
        match select_nics(&options) {
            Ok(nics) => Ok(Arc::new(Rdma::with(mode, options, nics, None))),
            Err(e) if mode == RdmaMode::Required => {
                Err(e.wrap(Status::KVSTAGE_E_NO_DEVICE, "transport rdma: no usable RDMA device on this host").with_class(crate::ErrorClass::KVSTAGE_CLASS_RDMA))
            }
            Err(e) => Ok(Arc::new(Rdma::with(mode, options, Vec::new(), Some(e.chain())))),
        }
    }

    pub fn mode(&self) -> RdmaMode {
        self.mode
    }

    pub fn options(&self) -> &RdmaOptions {
        &self.options
    }

    /// True when this engine has RDMA devices open.
    pub fn active(&self) -> bool {
        !self.nics.is_empty()
    }

    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Why RDMA is not used (empty when it is).
    pub fn unavailable_reason(&self) -> String {
        self.unavailable.clone().unwrap_or_default()
    }

    /// Sessions that fell back to TCP although the engine's transport is `auto`.
    pub fn downgrades(&self) -> u64 {
        self.downgrades.load(Ordering::Relaxed)
    }

    pub fn last_downgrade(&self) -> String {
        self.last_downgrade.lock().clone()
    }

    /// Sessions connected over RDMA (both directions).
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Session `session` to `peer` runs on TCP although RDMA was asked for (`auto`): counted,
    /// remembered for the `transport` of `kvstage_engine_describe` and logged (warn).
    fn downgrade(&self, session: &str, peer: &str, why: &str) {
        log::warn!(session = session; "downgraded from rdma to tcp (transport auto) for the session to {peer}: {why}");
        self.downgrades.fetch_add(1, Ordering::Relaxed);
        *self.last_downgrade.lock() = format!("session {session} to {peer}: {why}");
    }

    /// Session `session` stages its CUDA pool's chunks in host memory (a device→host crossing
    /// before each write) because device staging memory could not be registered: counted,
    /// remembered for the `transport` of `kvstage_engine_describe` and logged (warn).
    pub fn host_bounce(&self, session: &str, why: &str) {
        log::warn!(session = session; "GPUDirect RDMA unavailable, the session stages GPU data in host memory: {why}");
        self.host_bounces.fetch_add(1, Ordering::Relaxed);
        *self.last_host_bounce.lock() = format!("session {session}: {why}");
    }

    /// Sessions counted by [`host_bounce`](Self::host_bounce), and the last one's reason.
    pub fn host_bounces(&self) -> (u64, String) {
        (self.host_bounces.load(Ordering::Relaxed), self.last_host_bounce.lock().clone())
    }

    /// Send-queue depth of a sender QP.
    pub fn send_depth(&self) -> u32 {
        (self.options.signal_every * 4).clamp(16, 1024)
    }

    fn new_slot(&self, nic: usize, notify: &Arc<Notify>, arrivals: Option<Arc<Arrivals>>) -> Result<Arc<QpSlot>> {
        let n = &self.nics[nic];
        let caps = QpCaps { max_send_wr: self.send_depth(), max_recv_wr: RECV_DEPTH };
        let (mut qp, cq) = n.dev.create_qp(caps)?;
        let qpn = qp.qpn();
        qp.to_init(n.attrs.port).map_err(|e| {
            Error::new(Status::KVSTAGE_E_RDMA, format!("failed to modify QP {qpn:#x} on {} to INIT", n.attrs.describe())).with_source(e)
        })?;
        let psn = attrs::initial_psn(qpn, self.salt);
        let slot = Arc::new(QpSlot::new(qp, cq, nic, n.attrs.clone(), psn, notify.clone(), arrivals));
        self.poller.add(&slot)?;
        Ok(slot)
    }

    fn endpoint(slot: &QpSlot, rkey: u32) -> QpEndpoint {
        QpEndpoint { qpn: slot.qpn, psn: slot.psn, port: slot.local.clone(), rkey }
    }

    /// INIT → RTR → RTS against `remote`; a failure names every disagreeing port attribute.
    fn connect_slot(slot: &QpSlot, remote: &QpEndpoint, peer: &str) -> Result<()> {
        let path_mtu = negotiate_mtu(slot.local.active_mtu, remote.port.active_mtu);
        let c = Connect { local: &slot.local, local_psn: slot.psn, remote, path_mtu };
        let mut qp = slot.qp.lock();
        qp.to_rtr(&c).map_err(|e| transition_error("RTR", slot.qpn, &slot.local, &remote.port, path_mtu, peer, &e))?;
        qp.to_rts(&c).map_err(|e| transition_error("RTS", slot.qpn, &slot.local, &remote.port, path_mtu, peer, &e))
    }

    /// Sender side, right after the handshake: offers this engine's QPs, reads the answer from
    /// `reader` (the session's stream, before its reader thread starts) and connects. Returns the
    /// transport to use (RDMA, or `tcp` when `auto` downgrades) and frames that arrived meanwhile
    /// (watermarks) for the caller to apply.
    pub fn negotiate(
        self: &Arc<Self>,
        tcp: Arc<dyn Transport>,
        reader: &mut impl Read,
        peer: &str,
        session: &str,
        deadline: &Deadline,
    ) -> Result<(Arc<dyn Transport>, Vec<Message>)> {
        match self.mode {
            RdmaMode::Off => return Ok((tcp, Vec::new())),
            RdmaMode::Auto if !self.active() => {
                self.downgrade(session, peer, &format!("no local RDMA device ({})", self.unavailable_reason()));
                return Ok((tcp, Vec::new()));
            }
            _ => {}
        }
        let mut early = Vec::new();
        match self.try_negotiate(&tcp, reader, peer, session, deadline, &mut early) {
            Ok(link) => {
                self.sessions.fetch_add(1, Ordering::Relaxed);
                Ok((link, early))
            }
            Err(e) if self.mode == RdmaMode::Auto && e.code() != Status::KVSTAGE_E_PEER_GONE && e.code() != Status::KVSTAGE_E_TIMEOUT => {
                self.downgrade(session, peer, &e.chain());
                Ok((tcp, early))
            }
            Err(e) => {
                // Returned to the caller too; logged because an RDMA failure is an operator's matter.
                if matches!(e.code(), Status::KVSTAGE_E_PEER_GONE | Status::KVSTAGE_E_TIMEOUT) {
                    log::debug!(session = session; "RDMA exchange with {peer} failed: {}", e.chain());
                } else {
                    log::error!(session = session; "RDMA connection to {peer} failed (transport rdma: no fallback to tcp): {}", e.chain());
                }
                Err(e)
            }
        }
    }

    fn try_negotiate(
        self: &Arc<Self>,
        tcp: &Arc<dyn Transport>,
        reader: &mut impl Read,
        peer: &str,
        session: &str,
        deadline: &Deadline,
        early: &mut Vec<Message>,
    ) -> Result<Arc<dyn Transport>> {
        let notify = Arc::new(Notify::default());
        let mut slots = Vec::new();
        for nic in 0..self.nics.len() {
            for _ in 0..self.options.qps_per_device {
                let slot = self.new_slot(nic, &notify, None)?;
                slot.set_peer(peer, session);
                slots.push(slot);
            }
        }
        let offer = RdmaOffer {
            version: OFFER_VERSION,
            status: 0,
            reason: String::new(),
            endpoints: slots.iter().map(|s| Rdma::endpoint(s, 0)).collect(),
            ring_addr: 0,
            ring_len: 0,
        };
        tcp.send(&Message::RdmaOffer(offer), deadline)?;
        let answer = loop {
            match protocol::read_frame(reader) {
                Ok(Some(Message::RdmaAnswer(a))) => break a,
                Ok(Some(m @ Message::Watermark(_))) => early.push(m),
                Ok(Some(other)) => {
                    return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("expected an RDMA answer from {peer}, got {other:?}")))
                }
                Ok(None) => return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("{peer} closed the connection during the RDMA exchange"))),
                Err(e) => return Err(e.context(format!("RDMA exchange with {peer} failed"))),
            }
        };
        if answer.status != 0 {
            let code = match Status::from_code(answer.status) {
                Some(Status::KVSTAGE_E_NO_DEVICE) | None => Status::KVSTAGE_E_NO_DEVICE,
                Some(c) => c,
            };
            return Err(Error::new(code, format!("peer {peer} cannot serve RDMA: {}", answer.reason)));
        }
        if answer.endpoints.len() != slots.len() {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("peer {peer} answered {} QPs for {} offered", answer.endpoints.len(), slots.len()),
            ));
        }
        let connected = slots.iter().zip(&answer.endpoints).try_for_each(|(slot, remote)| {
            if fault::take_sender_rtr_failure() {
                return Err(Error::new(Status::KVSTAGE_E_RDMA, format!("test fault: QP {:#x} failed its transition to RTR", slot.qpn)));
            }
            Rdma::connect_slot(slot, remote, peer).map_err(|e| e.with_session(session))
        });
        // Both sides settle the transport before the first grant: the receiver uses RDMA for this
        // session only once it reads the confirmation, and stays on TCP after a refusal.
        let confirm = match &connected {
            Ok(()) => RdmaOffer::confirmation(),
            Err(e) => RdmaOffer::refusal(e.code(), e.chain()),
        };
        tcp.send(&Message::RdmaOffer(confirm), deadline)?;
        connected?;
        let remote = RemoteRing { addr: answer.ring_addr, len: answer.ring_len, rkeys: answer.endpoints.iter().map(|e| e.rkey).collect() };
        Ok(Arc::new(RdmaTransport::new(tcp.clone(), self.clone(), slots, remote, notify, session)))
    }

    /// Receiver side: answers a sender's offer. On success the returned peer holds the connected
    /// QPs (receives posted) whose immediates gate `ChunkReady`.
    pub fn accept(self: &Arc<Self>, offer: &RdmaOffer, ring: Option<NicMemory<'_>>, peer: &str, session: &str) -> (RdmaOffer, Option<RdmaPeer>) {
        match self.try_accept(offer, ring, peer, session) {
            Ok((answer, p)) => {
                log::info!(session = session; "RDMA offer of {peer} accepted ({}); waiting for its confirmation", p.desc);
                (answer, Some(p))
            }
            Err(e) => {
                // Not serving RDMA at all is a configuration (the sender downgrades or fails and
                // logs it); failing to serve it with devices open is an RDMA error.
                if !self.active() {
                    log::debug!(session = session; "refused the RDMA offer of {peer}: {}", e.chain());
                } else if e.code() == Status::KVSTAGE_E_RDMA {
                    log::error!(session = session; "refused the RDMA offer of {peer}: {}", e.chain());
                } else {
                    log::warn!(session = session; "refused the RDMA offer of {peer}: {}", e.chain());
                }
                (RdmaOffer::refusal(e.code(), e.chain()), None)
            }
        }
    }

    /// Receiver side: the sender confirmed its QPs for `peer_desc`; the session runs on RDMA.
    pub fn confirmed(&self, session: &str, peer_desc: &str) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
        log::info!(session = session; "session connected over rdma ({peer_desc})");
    }

    fn try_accept(self: &Arc<Self>, offer: &RdmaOffer, ring: Option<NicMemory<'_>>, peer: &str, session: &str) -> Result<(RdmaOffer, RdmaPeer)> {
        if !self.active() {
            let why = match self.mode {
                RdmaMode::Off => "its transport is tcp".to_owned(),
                _ => format!("it has no usable RDMA device ({})", self.unavailable_reason()),
            };
            return Err(Error::new(Status::KVSTAGE_E_NO_DEVICE, format!("the receiver does not serve RDMA: {why}")));
        }
        let Some(ring) = ring else {
            return Err(Error::new(Status::KVSTAGE_E_STAGING_TOO_SMALL, "the receiver has no staging ring registered"));
        };
        let (ring_ptr, ring_len) = (ring.ptr, ring.len);
        if offer.endpoints.is_empty() || offer.endpoints.len() > attrs::MAX_ENDPOINTS {
            return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("an offer of {} QPs", offer.endpoints.len())));
        }
        let rkeys = self.ring_keys(&ring)?;
        let notify = Arc::new(Notify::default());
        let arrivals = Arc::new(Arrivals::default());
        let mut slots = Vec::new();
        let mut endpoints = Vec::new();
        for (i, remote) in offer.endpoints.iter().enumerate() {
            let nic = i % self.nics.len();
            let slot = self.new_slot(nic, &notify, Some(arrivals.clone()))?;
            slot.set_peer(peer, session);
            let ids: Vec<u64> = (0..RECV_DEPTH as u64).collect();
            slot.qp.lock().post_recv(&ids).map_err(|e| {
                Error::new(Status::KVSTAGE_E_RDMA, format!("ibv_post_recv on QP {:#x} failed", slot.qpn)).with_source(e)
            })?;
            Rdma::connect_slot(&slot, remote, peer).map_err(|e| e.with_session(session))?;
            endpoints.push(Rdma::endpoint(&slot, rkeys[nic]));
            slots.push(slot);
        }
        let answer = RdmaOffer { version: OFFER_VERSION, status: 0, reason: String::new(), endpoints, ring_addr: ring_ptr as u64, ring_len: ring_len as u64 };
        let desc = format!("{} QP(s) from peer {peer}, session {session}", slots.len());
        Ok((answer, RdmaPeer { slots, arrivals, desc }))
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        self.poller.shutdown();
    }
}
