//! TEST BUILDS ONLY: an in-process software RDMA fabric with the semantics the transport relies on
//! (RC state machine, RTR checks of the address vector, memory keys and bounds, WRITE and
//! WRITE_WITH_IMM consuming a receive, signalled completions, errors that move the QP to ERR and
//! flush the rest). Two engines in one process reach each other through it, so CI runs the whole
//! RDMA session path. It cannot show timing, real NIC ordering or the verbs library itself.
//!
//! Memory: host memory by address (`reg_mr`), which must be readable host memory as the kernel's
//! page pinning requires (so a plain device pointer is refused: no peer-memory module here), and
//! device memory by dma-buf (`reg_dmabuf_mr`): the fabric maps the dma-buf and reaches the memory
//! through that mapping, by the IOVA the registration names, as a NIC does.
//!
//! Devices (selected only by naming them in `rdma_devices`): `softib0` (InfiniBand, MTU 4096,
//! LID 1), `softib1` (InfiniBand, MTU 2048, LID 2), `softroce0` (Ethernet, MTU 1024, RoCE v2 GID
//! ::ffff:10.0.0.1 at index 1), `softdown0` (InfiniBand, port DOWN).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::attrs::{LinkLayer, Mtu, PORT_ACTIVE};
use super::verbs::{CompletionQueue, Connect, Device, MemoryRegion, PortInfo, Provider, QpCaps, QueuePair, SendWr, Wc, WcKind};
use crate::error::{Error, Result, Status};

pub const DEVICES: [&str; 4] = ["softib0", "softib1", "softroce0", "softdown0"];

/// True when every name is a soft device (the soft provider serves them).
pub fn serves(names: &[String]) -> bool {
    !names.is_empty() && names.iter().all(|n| DEVICES.contains(&n.as_str()))
}

struct SoftMr {
    /// The addresses work requests use (the IOVA of a dma-buf registration).
    addr: u64,
    len: u64,
    remote_write: bool,
    /// Where this process reaches `addr` (differs from it for a dma-buf's mapping).
    host: u64,
    /// A dma-buf mapping (address, length), unmapped with the region.
    mapping: Option<(usize, usize)>,
}

impl SoftMr {
    /// The host address of `[addr, +len)` when it lies inside the region.
    fn reach(&self, addr: u64, len: u64) -> Option<u64> {
        (addr >= self.addr && addr.checked_add(len)? <= self.addr.checked_add(self.len)?).then(|| self.host + (addr - self.addr))
    }
}

/// Whether every page of `[addr, +len)` is readable host memory of this process (what pinning
/// user pages for a plain registration needs): `process_vm_readv` of one byte per page.
fn pinnable(addr: *mut u8, len: usize) -> bool {
    let page = 4096usize;
    let mut probe = [0u8; 1];
    let first = addr as usize / page * page;
    (first..addr as usize + len.max(1)).step_by(page).all(|p| {
        let at = p.max(addr as usize);
        let local = libc::iovec { iov_base: probe.as_mut_ptr().cast(), iov_len: 1 };
        let remote = libc::iovec { iov_base: at as *mut libc::c_void, iov_len: 1 };
        // SAFETY: reads one byte of this process into `probe`; the kernel checks the address.
        unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) == 1 }
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Err,
}

struct QpInner {
    state: QpState,
    remote_qpn: u32,
    recvs: VecDeque<u64>,
    max_send: u32,
}

struct SoftQpShared {
    inner: Mutex<QpInner>,
    cq: Arc<SoftCq>,
}

#[derive(Default)]
struct Fabric {
    next_id: u32,
    mrs: HashMap<u32, SoftMr>,
    qps: HashMap<u32, Arc<SoftQpShared>>,
}

fn fabric() -> &'static Mutex<Fabric> {
    static FABRIC: OnceLock<Mutex<Fabric>> = OnceLock::new();
    FABRIC.get_or_init(|| Mutex::new(Fabric { next_id: 0x100, ..Fabric::default() }))
}

/// Whether a memory region with key `key` is registered (unit tests of registration lifetimes).
#[cfg(test)]
pub fn registered(key: u32) -> bool {
    fabric().lock().mrs.contains_key(&key)
}

/// Where this process reaches `addr` through region `key` (unit tests of dma-buf registrations).
#[cfg(test)]
pub fn host_address(key: u32, addr: u64) -> Option<u64> {
    fabric().lock().mrs.get(&key)?.reach(addr, 1)
}

impl Fabric {
    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }
}

pub struct SoftProvider;

impl Provider for SoftProvider {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn device_names(&self) -> Result<Vec<String>> {
        Ok(DEVICES.iter().map(|s| s.to_string()).collect())
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Device>> {
        if !DEVICES.contains(&name) {
            return Err(Error::new(Status::KVSTAGE_E_NO_DEVICE, format!("no soft RDMA device {name}")));
        }
        Ok(Arc::new(SoftDevice { name: name.to_owned() }))
    }
}

struct SoftDevice {
    name: String,
}

impl SoftDevice {
    fn info(&self) -> PortInfo {
        let (ll, mtu, lid, state) = match self.name.as_str() {
            "softib0" => (LinkLayer::InfiniBand, Mtu::M4096, 1, PORT_ACTIVE),
            "softib1" => (LinkLayer::InfiniBand, Mtu::M2048, 2, PORT_ACTIVE),
            "softroce0" => (LinkLayer::Ethernet, Mtu::M1024, 0, PORT_ACTIVE),
            _ => (LinkLayer::InfiniBand, Mtu::M4096, 0, 1),
        };
        PortInfo { port: 1, state, active_mtu: mtu, max_mtu: Mtu::M4096, link_layer: ll, lid, gid_table_len: 4 }
    }
}

impl Device for SoftDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn port_count(&self) -> Result<u8> {
        Ok(1)
    }

    fn port(&self, port: u8) -> Result<PortInfo> {
        if port != 1 {
            return Err(Error::new(Status::KVSTAGE_E_RDMA, format!("{} has no port {port}", self.name))
                .with_source(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        Ok(self.info())
    }

    fn gid(&self, _port: u8, index: u32) -> Result<([u8; 16], bool)> {
        let mut g = [0u8; 16];
        match (self.info().link_layer, index) {
            (LinkLayer::Ethernet, 0) => {
                g[0] = 0xfe;
                g[1] = 0x80;
                g[15] = 1;
                Ok((g, false))
            }
            (LinkLayer::Ethernet, 1) => {
                g[10] = 0xff;
                g[11] = 0xff;
                g[12..].copy_from_slice(&[10, 0, 0, 1]);
                Ok((g, true))
            }
            (_, i) if i < 4 => {
                if i == 0 && self.info().link_layer == LinkLayer::InfiniBand {
                    g[0] = 0xfe;
                    g[1] = 0x80;
                    g[15] = self.info().lid as u8;
                }
                Ok((g, false))
            }
            _ => Err(Error::new(Status::KVSTAGE_E_RDMA, format!("GID index {index} out of the table"))
                .with_source(io::Error::from_raw_os_error(libc::EINVAL))),
        }
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, remote_write: bool) -> Result<Box<dyn MemoryRegion>> {
        if !pinnable(addr, len) {
            return Err(Error::new(Status::KVSTAGE_E_RDMA, format!("ibv_reg_mr of {len} bytes at {addr:p} on {} failed", self.name))
                .with_source(io::Error::from_raw_os_error(libc::EFAULT)));
        }
        let mut f = fabric().lock();
        let key = f.id();
        f.mrs.insert(key, SoftMr { addr: addr as u64, len: len as u64, remote_write, host: addr as u64, mapping: None });
        Ok(Box::new(SoftMrHandle { key }))
    }

    unsafe fn reg_dmabuf_mr(&self, fd: i32, offset: u64, len: usize, iova: u64, remote_write: bool) -> Result<Box<dyn MemoryRegion>> {
        let fail = |e: io::Error| Error::new(Status::KVSTAGE_E_RDMA, format!("ibv_reg_dmabuf_mr of {len} bytes (fd {fd}) on {} failed", self.name)).with_source(e);
        let span = (offset as usize).checked_add(len).ok_or_else(|| fail(io::Error::from_raw_os_error(libc::EINVAL)))?;
        // The dma-buf must hold the range (mmap would map past its end, and an access there
        // would fault with SIGBUS).
        // SAFETY: fstat writes the all-zero stat it is given.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        if (st.st_size as u64) < span as u64 {
            return Err(fail(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        // SAFETY: a shared mapping of the caller's dma-buf, checked above to hold the range.
        let map = unsafe { libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if map == libc::MAP_FAILED {
            return Err(fail(io::Error::last_os_error()));
        }
        let host = map as u64 + offset;
        let mut f = fabric().lock();
        let key = f.id();
        f.mrs.insert(key, SoftMr { addr: iova, len: len as u64, remote_write, host, mapping: Some((map as usize, span)) });
        Ok(Box::new(SoftMrHandle { key }))
    }

    fn create_qp(&self, caps: QpCaps) -> Result<(Box<dyn QueuePair>, Arc<dyn CompletionQueue>)> {
        let cq = Arc::new(SoftCq::default());
        let shared = Arc::new(SoftQpShared {
            inner: Mutex::new(QpInner { state: QpState::Reset, remote_qpn: 0, recvs: VecDeque::new(), max_send: caps.max_send_wr }),
            cq: cq.clone(),
        });
        let mut f = fabric().lock();
        let qpn = f.id();
        f.qps.insert(qpn, shared.clone());
        Ok((Box::new(SoftQp { qpn, shared, port: self.info() }), cq))
    }
}

struct SoftMrHandle {
    key: u32,
}

impl MemoryRegion for SoftMrHandle {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for SoftMrHandle {
    fn drop(&mut self) {
        let mr = fabric().lock().mrs.remove(&self.key);
        if let Some((map, span)) = mr.and_then(|m| m.mapping) {
            // SAFETY: the fabric's own mapping, no longer reachable through any key.
            unsafe { libc::munmap(map as *mut libc::c_void, span) };
        }
    }
}

#[derive(Default)]
struct SoftCq {
    q: Mutex<VecDeque<Wc>>,
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut Vec<Wc>) -> io::Result<()> {
        out.extend(self.q.lock().drain(..));
        Ok(())
    }
}

struct SoftQp {
    qpn: u32,
    shared: Arc<SoftQpShared>,
    port: PortInfo,
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl QueuePair for SoftQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn to_init(&mut self, port: u8) -> io::Result<()> {
        let mut s = self.shared.inner.lock();
        if s.state != QpState::Reset || port != 1 {
            return Err(einval());
        }
        s.state = QpState::Init;
        Ok(())
    }

    fn to_rtr(&mut self, c: &Connect<'_>) -> io::Result<()> {
        let mut s = self.shared.inner.lock();
        let remote = &c.remote.port;
        // What a real HCA rejects at RTR: an address vector the port cannot use.
        let bad = s.state != QpState::Init
            || remote.link_layer != self.port.link_layer
            || c.path_mtu > self.port.active_mtu
            || c.path_mtu > remote.active_mtu
            || (remote.link_layer.uses_lid() && (remote.lid == 0 || self.port.lid == 0))
            || (remote.link_layer == LinkLayer::Ethernet && (remote.gid == [0; 16] || c.local.gid == [0; 16]));
        if bad {
            return Err(einval());
        }
        s.remote_qpn = c.remote.qpn;
        s.state = QpState::Rtr;
        Ok(())
    }

    fn to_rts(&mut self, _c: &Connect<'_>) -> io::Result<()> {
        let mut s = self.shared.inner.lock();
        if s.state != QpState::Rtr {
            return Err(einval());
        }
        s.state = QpState::Rts;
        Ok(())
    }

    fn to_error(&mut self) {
        let mut s = self.shared.inner.lock();
        s.state = QpState::Err;
        let flushed: Vec<u64> = s.recvs.drain(..).collect();
        drop(s);
        let mut q = self.shared.cq.q.lock();
        for wr_id in flushed {
            q.push_back(Wc { wr_id, status: 5, kind: WcKind::RecvImm, imm: 0, vendor_err: 0 });
        }
    }

    fn post_send(&mut self, wrs: &[SendWr]) -> io::Result<()> {
        let f = fabric().lock();
        let mut s = self.shared.inner.lock();
        if wrs.len() as u32 > s.max_send {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        let mut out = Vec::new();
        for wr in wrs {
            if s.state == QpState::Err {
                out.push(Wc { wr_id: wr.wr_id, status: 5, kind: WcKind::Send, imm: 0, vendor_err: 0 });
                continue;
            }
            if s.state != QpState::Rts {
                return Err(einval());
            }
            let status = execute(&f, s.remote_qpn, wr);
            if status != 0 {
                s.state = QpState::Err;
            }
            if status != 0 || wr.signaled {
                out.push(Wc { wr_id: wr.wr_id, status, kind: WcKind::Send, imm: 0, vendor_err: if status != 0 { 0x88 } else { 0 } });
            }
        }
        drop(s);
        self.shared.cq.q.lock().extend(out);
        Ok(())
    }

    fn post_recv(&mut self, wr_ids: &[u64]) -> io::Result<()> {
        let mut s = self.shared.inner.lock();
        if s.state == QpState::Reset {
            return Err(einval());
        }
        s.recvs.extend(wr_ids.iter().copied());
        Ok(())
    }
}

/// Performs one WRITE on the fabric: the `ibv_wc_status` it completes with.
fn execute(f: &Fabric, remote_qpn: u32, wr: &SendWr) -> u32 {
    let Some(local) = f.mrs.get(&wr.lkey) else { return 4 }; // IBV_WC_LOC_PROT_ERR
    let Some(source) = local.reach(wr.local_addr, wr.len as u64) else { return 4 };
    let Some(remote_qp) = f.qps.get(&remote_qpn) else { return 12 }; // IBV_WC_RETRY_EXC_ERR
    let mut r = remote_qp.inner.lock();
    if !matches!(r.state, QpState::Rtr | QpState::Rts) {
        return 12;
    }
    let mut target = 0;
    if wr.len > 0 {
        let Some(mr) = f.mrs.get(&wr.rkey) else { return 10 }; // IBV_WC_REM_ACCESS_ERR
        match mr.reach(wr.remote_addr, wr.len as u64) {
            Some(t) if mr.remote_write => target = t,
            _ => return 10,
        }
    }
    if wr.imm.is_some() && r.recvs.is_empty() {
        return 13; // IBV_WC_RNR_RETRY_EXC_ERR
    }
    if wr.len > 0 {
        // SAFETY: both ranges lie inside registered regions of this process (checked above).
        unsafe { std::ptr::copy(source as *const u8, target as *mut u8, wr.len as usize) };
    }
    // The immediate's completion only after the data, as on a real RC QP.
    if let Some(imm) = wr.imm {
        let recv = r.recvs.pop_front().expect("checked above");
        remote_qp.cq.q.lock().push_back(Wc { wr_id: recv, status: 0, kind: WcKind::RecvImm, imm, vendor_err: 0 });
    }
    0
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        fabric().lock().qps.remove(&self.qpn);
    }
}
