//! The verbs on real hardware: libibverbs through sideway (rdma-mummy-sys), which `dlopen`s
//! `libibverbs.so.1` when the library is loaded, so kvstage has no NEEDED entry for it. Without
//! rdma-core every call fails with EOPNOTSUPP; without kernel support the device list is empty or
//! fails with the OS error of `ibv_get_device_list`.
//!
//! NOT EXERCISED IN CI (no RDMA device, no kernel InfiniBand support on these machines): every
//! function here runs only on a host with an RDMA NIC (ctest label `rdma`).

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu as SwMtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, ModifyQueuePairError, ModifyQueuePairErrorKind, PostSendError, PostSendGuard, QueuePair as _,
    QueuePairAttribute, QueuePairState, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::attrs::{LinkLayer, Mtu};
use super::verbs::{CompletionQueue, Connect, Device, MemoryRegion, PortInfo, Provider, QpCaps, QueuePair, SendWr, Wc, WcKind};
use crate::error::{Error, Result, Status};

pub struct HwProvider;

fn rdma_err(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::new(Status::KVSTAGE_E_RDMA, what).with_source(source)
}

fn device_list() -> Result<DeviceList> {
    DeviceList::new().map_err(|e| {
        let os = match e.0 {
            GetDeviceListErrorKind::Ibverbs(io) => io,
            #[allow(unreachable_patterns)]
            other => io::Error::other(other.to_string()),
        };
        Error::new(Status::KVSTAGE_E_NO_DEVICE, "ibv_get_device_list failed").with_source(os)
    })
}

impl Provider for HwProvider {
    fn name(&self) -> &'static str {
        "libibverbs"
    }

    fn device_names(&self) -> Result<Vec<String>> {
        let list = device_list()?;
        Ok(list.iter().map(|d| d.name()).collect())
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Device>> {
        let list = device_list()?;
        let dev = list
            .iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::new(Status::KVSTAGE_E_NO_DEVICE, format!("no RDMA device named {name}")))?;
        let ctx = dev.open().map_err(|e| rdma_err(format!("ibv_open_device({name}) failed"), e))?;
        let pd = ctx.alloc_pd().map_err(|e| rdma_err(format!("ibv_alloc_pd on {name} failed"), e))?;
        Ok(Arc::new(HwDevice { name: name.to_owned(), ctx, pd }))
    }
}

struct HwDevice {
    name: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
}

fn access(remote_write: bool) -> AccessFlags {
    if remote_write {
        AccessFlags::LocalWrite | AccessFlags::RemoteWrite
    } else {
        AccessFlags::LocalWrite
    }
}

impl Device for HwDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn port_count(&self) -> Result<u8> {
        let attr = self.ctx.query_device().map_err(|e| rdma_err(format!("ibv_query_device({}) failed", self.name), e))?;
        Ok(attr.phys_port_cnt())
    }

    fn port(&self, port: u8) -> Result<PortInfo> {
        let p = self
            .ctx
            .query_port(port)
            .map_err(|e| rdma_err(format!("ibv_query_port({}, {port}) failed", self.name), e))?;
        let a = &p.attr;
        let mtu = |code: u32, what: &str| {
            Mtu::from_code(code).ok_or_else(|| Error::new(Status::KVSTAGE_E_RDMA, format!("{}:{port}: unknown {what} code {code}", self.name)))
        };
        Ok(PortInfo {
            port,
            state: a.state,
            active_mtu: mtu(a.active_mtu, "active MTU")?,
            max_mtu: mtu(a.max_mtu, "max MTU")?,
            link_layer: LinkLayer::from_code(a.link_layer).unwrap_or(LinkLayer::Unspecified),
            lid: a.lid,
            gid_table_len: a.gid_tbl_len.max(0) as u32,
        })
    }

    fn gid(&self, port: u8, index: u32) -> Result<([u8; 16], bool)> {
        let gid = self
            .ctx
            .query_gid(port, index)
            .map_err(|e| rdma_err(format!("ibv_query_gid({}, {port}, {index}) failed", self.name), e))?;
        // IBV_GID_TYPE_SYSFS_ROCE_V2 = 1; unknown (IB, or an old kernel) counts as not v2.
        let v2 = self.ctx.query_gid_type(port, index).map(|t| t == 1).unwrap_or(false);
        Ok((gid.raw, v2))
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, remote_write: bool) -> Result<Box<dyn MemoryRegion>> {
        // SAFETY: the caller keeps the range allocated for the region's life.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access(remote_write)) }
            .map_err(|e| rdma_err(format!("ibv_reg_mr of {len} bytes at {addr:p} on {} failed", self.name), e))?;
        Ok(Box::new(HwMr(Some(mr))))
    }

    unsafe fn reg_dmabuf_mr(&self, fd: i32, offset: u64, len: usize, iova: u64, remote_write: bool) -> Result<Box<dyn MemoryRegion>> {
        // SAFETY: the caller keeps the dma-buf alive for the region's life.
        let mr = unsafe { self.pd.reg_dmabuf_mr(offset, len, iova, fd, access(remote_write)) }
            .map_err(|e| rdma_err(format!("ibv_reg_dmabuf_mr of {len} bytes (fd {fd}) on {} failed", self.name), e))?;
        Ok(Box::new(HwMr(Some(mr))))
    }

    fn create_qp(&self, caps: QpCaps) -> Result<(Box<dyn QueuePair>, Arc<dyn CompletionQueue>)> {
        let cqe = caps.max_send_wr + caps.max_recv_wr + 16;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .build()
            .map_err(|e| rdma_err(format!("ibv_create_cq({cqe}) on {} failed", self.name), e))?;
        let generic = GenericCompletionQueue::from(cq.clone());
        let qp = self
            .pd
            .create_qp_builder()
            .setup_max_send_wr(caps.max_send_wr)
            .setup_max_recv_wr(caps.max_recv_wr)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(generic.clone())
            .setup_recv_cq(generic)
            .build()
            .map_err(|e| rdma_err(format!("ibv_create_qp (RC, {} send / {} recv WRs) on {} failed", caps.max_send_wr, caps.max_recv_wr, self.name), e))?;
        Ok((Box::new(HwQp(Some(qp))), Arc::new(HwCq(Some(cq)))))
    }
}

struct HwMr(Option<Arc<sideway::ibverbs::memory_region::MemoryRegion>>);

impl MemoryRegion for HwMr {
    fn lkey(&self) -> u32 {
        self.0.as_ref().map_or(0, |m| m.lkey())
    }
    fn rkey(&self) -> u32 {
        self.0.as_ref().map_or(0, |m| m.rkey())
    }
}

impl Drop for HwMr {
    fn drop(&mut self) {
        let mr = self.0.take();
        let _ = catch_unwind(AssertUnwindSafe(|| drop(mr)));
    }
}

struct HwCq(Option<Arc<BasicCompletionQueue>>);

impl CompletionQueue for HwCq {
    fn poll(&self, out: &mut Vec<Wc>) -> io::Result<()> {
        let Some(cq) = &self.0 else { return Ok(()) };
        let poller = match cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
            Err(PollCompletionQueueError::Ibverbs(e)) => return Err(e),
            #[allow(unreachable_patterns)]
            Err(e) => return Err(io::Error::other(e.to_string())),
        };
        for wc in poller {
            let kind = match wc.opcode() {
                0..=5 => WcKind::Send,    // IBV_WC_SEND, RDMA_WRITE, RDMA_READ, ...
                129 => WcKind::RecvImm, // IBV_WC_RECV_RDMA_WITH_IMM
                other => WcKind::Other(other),
            };
            // On an error completion the opcode is undefined: wr_id says what it was.
            out.push(Wc { wr_id: wc.wr_id(), status: wc.status(), kind, imm: wc.imm_data(), vendor_err: wc.vendor_err() });
        }
        Ok(())
    }
}

impl Drop for HwCq {
    fn drop(&mut self) {
        // sideway asserts that ibv_destroy_cq succeeded: never let that unwind out of a drop.
        let cq = self.0.take();
        let _ = catch_unwind(AssertUnwindSafe(|| drop(cq)));
    }
}

struct HwQp(Option<BasicQueuePair>);

fn modify_err(e: ModifyQueuePairError) -> io::Error {
    match e.0 {
        ModifyQueuePairErrorKind::Ibverbs(io) => io,
        ModifyQueuePairErrorKind::InvalidTransition { source, .. }
        | ModifyQueuePairErrorKind::InvalidAttributeMask { source, .. }
        | ModifyQueuePairErrorKind::ResolveRouteTimedout { source, .. }
        | ModifyQueuePairErrorKind::NetworkUnreachable { source, .. } => source,
        #[allow(unreachable_patterns)]
        other => io::Error::other(other.to_string()),
    }
}

fn sw_mtu(m: Mtu) -> SwMtu {
    match m {
        Mtu::M256 => SwMtu::Mtu256,
        Mtu::M512 => SwMtu::Mtu512,
        Mtu::M1024 => SwMtu::Mtu1024,
        Mtu::M2048 => SwMtu::Mtu2048,
        Mtu::M4096 => SwMtu::Mtu4096,
    }
}

impl HwQp {
    fn qp(&mut self) -> &mut BasicQueuePair {
        self.0.as_mut().expect("QP present until drop")
    }
}

impl QueuePair for HwQp {
    fn qpn(&self) -> u32 {
        self.0.as_ref().map_or(0, |q| q.qp_number())
    }

    fn to_init(&mut self, port: u8) -> io::Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        self.qp().modify(&attr).map_err(modify_err)
    }

    fn to_rtr(&mut self, c: &Connect<'_>) -> io::Result<()> {
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(c.remote.port.lid).setup_port(c.local.port).setup_service_level(0);
        // RoCE addresses by GID (a GRH on every packet); InfiniBand within a subnet by LID only
        // (routing between IB subnets, which needs a GRH too, is not supported).
        if c.local.link_layer == LinkLayer::Ethernet {
            let gid = sideway::ibverbs::address::Gid { raw: c.remote.port.gid };
            ah.setup_grh(&gid, 0, c.local.gid_index as u8, 64, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(sw_mtu(c.path_mtu))
            .setup_dest_qp_num(c.remote.qpn)
            .setup_rq_psn(c.remote.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp().modify(&attr).map_err(modify_err)
    }

    fn to_rts(&mut self, c: &Connect<'_>) -> io::Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(c.local_psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(1);
        self.qp().modify(&attr).map_err(modify_err)
    }

    fn to_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        let _ = self.qp().modify(&attr);
    }

    fn post_send(&mut self, wrs: &[SendWr]) -> io::Result<()> {
        let mut guard = self.qp().start_post_send();
        for wr in wrs {
            let flags = if wr.signaled { WorkRequestFlags::Signaled } else { WorkRequestFlags::none() };
            let handle = guard.construct_wr(wr.wr_id, flags);
            let local = match wr.imm {
                Some(imm) => handle.setup_write_imm(wr.rkey, wr.remote_addr, imm),
                None => handle.setup_write(wr.rkey, wr.remote_addr),
            };
            if wr.len > 0 {
                // SAFETY: the caller keeps the registered buffer alive until the WR completes.
                unsafe { local.setup_sge(wr.lkey, wr.local_addr, wr.len) };
            }
        }
        guard.post().map_err(|e| match e {
            PostSendError::Ibverbs(io)
            | PostSendError::InvalidWorkRequest(io)
            | PostSendError::InvalidQueuePair(io)
            | PostSendError::NotEnoughResources(io) => io,
            #[allow(unreachable_patterns)]
            other => io::Error::other(other.to_string()),
        })
    }

    fn post_recv(&mut self, wr_ids: &[u64]) -> io::Result<()> {
        let mut guard = self.qp().start_post_recv();
        for &id in wr_ids {
            let _ = guard.construct_wr(id);
        }
        guard.post().map_err(|e| io::Error::other(e.to_string()))
    }
}

impl Drop for HwQp {
    fn drop(&mut self) {
        // sideway asserts that ibv_destroy_qp succeeded: never let that unwind out of a drop.
        let qp = self.0.take();
        let _ = catch_unwind(AssertUnwindSafe(|| drop(qp)));
    }
}
