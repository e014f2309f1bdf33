//! The sender's same-host transport: the receiver's ring mapped into this process. The gather
//! writes a chunk's bytes straight into the granted range ([`ShmTransport::in_place`]); a
//! `Written` report and the `ChunkReady` then go over the control stream, in that order, so the
//! receiver reads the completion only after the bytes are in its ring.
//!
//! Teardown: [`Transport::shutdown`] waits for a gather in progress (it holds the mapping's read
//! lock), unmaps the ring, then closes the local socket. The receiver keeps every range this
//! session may write quarantined until that socket closes, so nothing writes into a range after
//! it was granted to someone else.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use super::memory::Mapping;
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::Message;
use crate::transport::Transport;

/// A granted range of the receiver's ring, mapped here; the mapping cannot go while it is held.
pub struct InPlace<'a> {
    _mapping: RwLockReadGuard<'a, Option<Mapping>>,
    ptr: *mut u8,
}

impl InPlace<'_> {
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

pub struct ShmTransport {
    tcp: Arc<dyn Transport>,
    ring: RwLock<Option<Mapping>>,
    /// The local socket whose end tells the receiver this process no longer maps its ring.
    lease: Mutex<Option<UnixStream>>,
    ring_len: u64,
}

impl ShmTransport {
    pub fn new(tcp: Arc<dyn Transport>, ring: Mapping, lease: UnixStream) -> ShmTransport {
        let ring_len = ring.len() as u64;
        ShmTransport { tcp, ring: RwLock::new(Some(ring)), lease: Mutex::new(Some(lease)), ring_len }
    }

    /// The range `[ring_offset, +len)` of the receiver's ring, for a gather to write in place.
    pub fn range(&self, ring_offset: u64, len: u64) -> Result<InPlace<'_>> {
        let guard = self.ring.read();
        let Some(m) = guard.as_ref() else {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "the session's mapping of the receiver's ring was torn down"));
        };
        if ring_offset.checked_add(len).is_none_or(|end| end > m.len() as u64) {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("granted range [{ring_offset}, +{len}) lies outside the receiver's {}-byte ring", m.len()),
            ));
        }
        // SAFETY: checked to lie inside the mapping.
        let ptr = unsafe { m.ptr().add(ring_offset as usize) };
        Ok(InPlace { _mapping: guard, ptr })
    }

    /// Copies `data` into the range `header` (a `Message::Data`) names in the grant at `grant_offset`.
    fn copy_in(&self, grant_offset: u64, header: &Message, data: &[u8]) -> Result<()> {
        let Message::Data { offset, .. } = header else {
            return Err(Error::internal(format!("a chunk write described by {header:?}")));
        };
        let start = grant_offset.checked_add(*offset).ok_or_else(|| Error::new(Status::KVSTAGE_E_PROTOCOL, "grant offset overflows"))?;
        let mut range = self.range(start, data.len() as u64)?;
        // SAFETY: `range` is `data.len()` bytes of this writer's region, which nothing else writes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), range.as_mut_ptr(), data.len()) };
        Ok(())
    }

    fn teardown(&self) {
        // Waits for a gather in progress; after this nothing here can write the ring.
        self.ring.write().take();
        if let Some(s) = self.lease.lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
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

    fn finish_in_place(&self, header: &Message, ready: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.write_chunk(&written(header)?, &[], ready, deadline)
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, &[u8])>, done: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.write_slices(ops, done, deadline)
    }

    fn shutdown(&self) {
        self.tcp.shutdown();
        self.teardown();
    }

    fn describe(&self) -> String {
        let size = match self.ring_len {
            n if n >= 1 << 20 => format!("{} MiB", n >> 20),
            n => format!("{n} bytes"),
        };
        format!("shm ({size} ring mapped) via {}", self.tcp.describe())
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.teardown();
    }
}
