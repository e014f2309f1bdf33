//! The verbs the transport needs, as object-safe traits, so that the transport above them runs on
//! real hardware (libibverbs through sideway, `hw.rs`) and, in test builds, on an in-process
//! software fabric (`soft.rs`) that CI can run: every line of the transport except the verbs calls
//! themselves.

use std::sync::Arc;

use super::attrs::{Mtu, PortAttrs, QpEndpoint};
use crate::error::Result;

/// One port of a device as listed (for selection and the doctor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    /// `enum ibv_port_state`.
    pub state: u32,
    pub active_mtu: Mtu,
    pub max_mtu: Mtu,
    pub link_layer: super::attrs::LinkLayer,
    pub lid: u16,
    pub gid_table_len: u32,
}

/// A source of RDMA devices.
pub trait Provider: Send + Sync {
    /// "libibverbs" or "soft" (for messages).
    fn name(&self) -> &'static str;
    /// Names of the devices (`ibv_get_device_list`); the error carries the OS error of that call.
    fn device_names(&self) -> Result<Vec<String>>;
    fn open(&self, name: &str) -> Result<Arc<dyn Device>>;
}

/// An opened device with its protection domain.
pub trait Device: Send + Sync {
    fn name(&self) -> &str;
    fn port_count(&self) -> Result<u8>;
    fn port(&self, port: u8) -> Result<PortInfo>;
    /// GID at `index` of `port` and whether it is a RoCE v2 GID (false when unknown).
    fn gid(&self, port: u8, index: u32) -> Result<([u8; 16], bool)>;
    /// Registers host memory (`ibv_reg_mr`): local write always, remote write when asked.
    ///
    /// # Safety
    /// `[addr, addr + len)` stays allocated until the region is dropped.
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, remote_write: bool) -> Result<Box<dyn MemoryRegion>>;
    /// Registers device memory exported as a dma-buf (`ibv_reg_dmabuf_mr`): the hook for CUDA
    /// staging buffers (`cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`
    /// gives the fd; `iova` is the device pointer). With the nvidia-peermem module loaded, plain
    /// `reg_mr` on a device pointer works too (peer memory).
    ///
    /// # Safety
    /// `fd` is a dma-buf covering `[offset, offset + len)` that outlives the region.
    unsafe fn reg_dmabuf_mr(&self, fd: i32, offset: u64, len: usize, iova: u64, remote_write: bool) -> Result<Box<dyn MemoryRegion>>;
    /// A reliable-connected QP in RESET with its own completion queue (send and receive).
    fn create_qp(&self, caps: QpCaps) -> Result<(Box<dyn QueuePair>, Arc<dyn CompletionQueue>)>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
}

pub trait MemoryRegion: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

/// One RDMA WRITE (or WRITE_WITH_IMM when `imm` is set) from a registered local buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    pub imm: Option<u32>,
}

/// The attributes the RTR/RTS transitions need.
#[derive(Clone, Debug)]
pub struct Connect<'a> {
    pub local: &'a PortAttrs,
    pub local_psn: u32,
    pub remote: &'a QpEndpoint,
    pub path_mtu: Mtu,
}

pub trait QueuePair: Send {
    fn qpn(&self) -> u32;
    /// RESET → INIT (port, remote write allowed).
    fn to_init(&mut self, port: u8) -> std::io::Result<()>;
    /// INIT → RTR (remote QPN/PSN, path MTU, address vector: LID, or GRH with GID for RoCE).
    fn to_rtr(&mut self, c: &Connect<'_>) -> std::io::Result<()>;
    /// RTR → RTS (local PSN, timeouts and retries).
    fn to_rts(&mut self, c: &Connect<'_>) -> std::io::Result<()>;
    /// Any → ERR: outstanding work requests are flushed.
    fn to_error(&mut self);
    fn post_send(&mut self, wrs: &[SendWr]) -> std::io::Result<()>;
    /// Receive work requests without buffers (for WRITE_WITH_IMM completions).
    fn post_recv(&mut self, wr_ids: &[u64]) -> std::io::Result<()>;
}

/// What a completion completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcKind {
    Send,
    RecvImm,
    Other(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: u32,
    pub kind: WcKind,
    pub imm: u32,
    pub vendor_err: u32,
}

pub trait CompletionQueue: Send + Sync {
    /// Appends the available completions to `out` (never blocks).
    fn poll(&self, out: &mut Vec<Wc>) -> std::io::Result<()>;
}
