//! The sender's same-host transport: the receiver's ring mapped into this process (a host ring's
//! memfd) or opened on this process's GPU (a device ring, through CUDA IPC). The gather writes a
//! chunk's bytes straight into the granted range ([`ShmTransport::in_place`]; a device gather
//! returns after its stream completed); a `Written` report and the `ChunkReady` then go over the
//! control stream, in that order, so the receiver reads the completion only after the bytes are
//! in its ring.
//!
//! In direct mode the receiver's KV pool is mapped (host) or opened through CUDA IPC (device) too
//! ([`ShmTransport::direct_pool`]): a chunk granted directly is copied from this pool's pages into
//! the decode pages the grant names.
//!
//! Teardown: [`Transport::shutdown`] waits for a gather or direct copy in progress (it holds the
//! mappings' read lock), unmaps the ring and the pool, then closes the local socket. The receiver keeps every range this
//! session may write quarantined until that socket closes, so nothing writes into a range after
//! it was granted to someone else.

use std::borrow::Cow;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use super::memory::Mapping;
use super::pool::PeerPool;
use super::{PeerDevice, RingKind};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::Message;
use crate::transport::{SlicePayload, Transport};

/// The receiver's ring as this process reaches it.
pub enum PeerRing {
    /// A host ring: its memfd mapped here.
    Host(Mapping),
    /// A device ring: opened through CUDA IPC on the device of this process's KV pool (closed on
    /// drop), or the very address when the receiver is this process.
    Device(Box<dyn PeerDevice>),
}

impl PeerRing {
    fn len(&self) -> usize {
        match self {
            PeerRing::Host(m) => m.len(),
            PeerRing::Device(d) => d.bytes(),
        }
    }

    fn kind(&self) -> RingKind {
        match self {
            PeerRing::Host(_) => RingKind::Host,
            PeerRing::Device(_) => RingKind::Device,
        }
    }
}

/// What this process maps of the receiver: its ring, and its KV pool in direct mode.
struct Mapped {
    ring: PeerRing,
    pool: Option<PeerPool>,
}

/// A granted range of the receiver's ring, reachable here (host addresses, or device addresses
/// for a device ring); the mapping cannot go while it is held.
pub struct InPlace<'a> {
    ring: RwLockReadGuard<'a, Option<Mapped>>,
    offset: u64,
    len: u64,
}

/// The receiver's KV pool as mapped here (direct mode); the mapping cannot go while it is held.
pub struct DirectPool<'a> {
    mapped: RwLockReadGuard<'a, Option<Mapped>>,
}

impl DirectPool<'_> {
    /// The receiver's pool at this process's addresses (its shape, capacity, buffers).
    pub fn layout(&self) -> &crate::geometry::KvLayout {
        &self.mapped.as_ref().and_then(|m| m.pool.as_ref()).expect("checked when the pool was taken").layout
    }
}

impl InPlace<'_> {
    fn ring(&self) -> &PeerRing {
        &self.ring.as_ref().expect("checked when the range was taken").ring
    }

    /// The range's first byte: a host address, or a device address for a device ring.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self.ring() {
            // SAFETY: checked to lie inside the mapping when the range was taken.
            PeerRing::Host(m) => unsafe { m.ptr().add(self.offset as usize) },
            PeerRing::Device(d) => (d.ptr() + self.offset) as *mut u8,
        }
    }

    /// The range's bytes as the CPU sees them: borrowed from a host ring, copied back from a
    /// device ring (one device→host crossing).
    pub fn to_host(&mut self) -> Result<Cow<'_, [u8]>> {
        let (offset, len) = (self.offset, self.len as usize);
        match self.ring() {
            // SAFETY: inside the mapping (checked), this writer's range, which nothing else writes.
            PeerRing::Host(m) => Ok(Cow::Borrowed(unsafe { std::slice::from_raw_parts(m.ptr().add(offset as usize), len) })),
            PeerRing::Device(d) => Ok(Cow::Owned(d.to_vec(offset as usize, len)?)),
        }
    }

    /// Copies `data` to the start of a host range. A device ring is only ever written in place,
    /// by the gather kernels of a pool on its device (a host pool is refused it at the exchange).
    fn copy_from(&mut self, data: &[u8]) -> Result<()> {
        debug_assert_eq!(data.len() as u64, self.len);
        match self.ring() {
            PeerRing::Host(_) => {
                // SAFETY: `data.len()` bytes of this writer's range, which nothing else writes.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_mut_ptr(), data.len()) };
                Ok(())
            }
            PeerRing::Device(_) => Err(Error::internal("host bytes copied into a device ring (it is written in place)")),
        }
    }
}

/// The sender's end of a mapping's lease (the local socket of the exchange). Dropped once nothing
/// of this process maps the receiver's memory (drop the mappings first): it says so with
/// [`super::LEASE_UNMAPPED`], so that the receiver need not wait for this process to end, then
/// closes. Every way out of an exchange drops it so, a failed one included.
pub struct Lease(UnixStream);

impl Lease {
    pub fn new(stream: UnixStream) -> Lease {
        Lease(stream)
    }
}

impl std::ops::Deref for Lease {
    type Target = UnixStream;
    fn deref(&self) -> &UnixStream {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Never blocks (a full socket only costs the receiver the wait) nor raises SIGPIPE (the
        // receiver may be gone).
        // SAFETY: an open socket and a one-byte buffer.
        unsafe { libc::send(self.0.as_raw_fd(), [super::LEASE_UNMAPPED].as_ptr().cast(), 1, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

pub struct ShmTransport {
    tcp: Arc<dyn Transport>,
    ring: RwLock<Option<Mapped>>,
    /// The local socket whose end tells the receiver this process no longer maps its ring.
    lease: Mutex<Option<Lease>>,
    ring_len: u64,
    kind: RingKind,
    maps_pool: bool,
}

impl ShmTransport {
    pub fn new(tcp: Arc<dyn Transport>, ring: PeerRing, pool: Option<PeerPool>, lease: Lease) -> ShmTransport {
        let (ring_len, kind, maps_pool) = (ring.len() as u64, ring.kind(), pool.is_some());
        ShmTransport { tcp, ring: RwLock::new(Some(Mapped { ring, pool })), lease: Mutex::new(Some(lease)), ring_len, kind, maps_pool }
    }

    /// The receiver's KV pool (direct mode), held mapped while the guard lives.
    pub fn pool(&self) -> Result<DirectPool<'_>> {
        let mapped = self.ring.read();
        match mapped.as_ref() {
            None => Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "the session's mapping of the receiver's pool was torn down")),
            Some(m) if m.pool.is_none() => Err(Error::internal("a direct write on a session that does not map the receiver's pool")),
            Some(_) => Ok(DirectPool { mapped }),
        }
    }

    /// The range `[ring_offset, +len)` of the receiver's ring, for a gather to write in place.
    pub fn range(&self, ring_offset: u64, len: u64) -> Result<InPlace<'_>> {
        let guard = self.ring.read();
        let Some(m) = guard.as_ref().map(|m| &m.ring) else {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "the session's mapping of the receiver's ring was torn down"));
        };
        if ring_offset.checked_add(len).is_none_or(|end| end > m.len() as u64) {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("granted range [{ring_offset}, +{len}) lies outside the receiver's {}-byte ring", m.len()),
            ));
        }
        Ok(InPlace { ring: guard, offset: ring_offset, len })
    }

    /// Copies `data` into the range `header` (a `Message::Data`) names in the grant at `grant_offset`.
    fn copy_in(&self, grant_offset: u64, header: &Message, data: &[u8]) -> Result<()> {
        let Message::Data { offset, .. } = header else {
            return Err(Error::internal(format!("a chunk write described by {header:?}")));
        };
        let start = grant_offset.checked_add(*offset).ok_or_else(|| Error::new(Status::KVSTAGE_E_PROTOCOL, "grant offset overflows"))?;
        self.range(start, data.len() as u64)?.copy_from(data)
    }

    fn teardown(&self) {
        // Waits for a gather in progress; after this nothing here can write the ring.
        self.ring.write().take();
        // The mappings are gone (device ones closed): the lease ends saying so.
        self.lease.lock().take();
    }
}

/// The report of an in-place write described by `header` (a `Message::Data`).
fn written(header: &Message) -> Result<Message> {
    match header {
        Message::Data { room, chunk, writer, offset, len } => {
            Ok(Message::Written { room: *room, chunk: *chunk, writer: *writer, offset: *offset, len: *len, imm: 0 })
        }
        other => Err(Error::internal(format!("an in-place write described by {other:?}"))),
    }
}

impl Transport for ShmTransport {
    fn send(&self, msg: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.send(msg, deadline)
    }

    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.write_chunk(header, data, ready, deadline)
    }

    fn write_chunk_at(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        self.copy_in(grant_offset, header, data)?;
        self.finish_in_place(header, ready, deadline)
    }

    fn write_piece(&self, grant_offset: u64, header: &Message, data: &[u8], deadline: &Deadline) -> Result<()> {
        self.copy_in(grant_offset, header, data)?;
        self.tcp.send(&written(header)?, deadline)
    }

    fn in_place(&self, ring_offset: u64, len: u64) -> Option<Result<InPlace<'_>>> {
        Some(self.range(ring_offset, len))
    }

    fn in_place_kind(&self) -> Option<RingKind> {
        Some(self.kind)
    }

    fn maps_pool(&self) -> bool {
        self.maps_pool
    }

    fn direct_pool(&self) -> Option<Result<DirectPool<'_>>> {
        self.maps_pool.then(|| self.pool())
    }

    fn finish_in_place(&self, header: &Message, ready: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.write_chunk(&written(header)?, &[], ready, deadline)
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, SlicePayload<'_>)>, done: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.write_slices(ops, done, deadline)
    }

    fn shutdown(&self) {
        self.tcp.shutdown();
        self.teardown();
    }

    fn is_cut(&self) -> bool {
        self.tcp.is_cut()
    }

    fn describe(&self) -> String {
        let size = match self.ring_len {
            n if n >= 1 << 20 => format!("{} MiB", n >> 20),
            n => format!("{n} bytes"),
        };
        match self.kind {
            RingKind::Host if self.maps_pool => format!("shm direct ({size} ring and the decode pool mapped) via {}", self.tcp.describe()),
            RingKind::Host => format!("shm ({size} ring mapped) via {}", self.tcp.describe()),
            RingKind::Device if self.maps_pool => format!("cuda-ipc direct ({size} device ring and the decode pool opened) via {}", self.tcp.describe()),
            RingKind::Device => format!("cuda-ipc ({size} device ring opened) via {}", self.tcp.describe()),
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.teardown();
    }
}
