//! Byte movers. A transport sends control messages and moves a chunk's bytes into a range the
//! receiver granted, delivering the chunk's completion *after* the data (TCP: the same ordered
//! stream; RDMA: WRITE_WITH_IMM on the same QP; same host: the gather writes into the mapped ring,
//! then the report goes over the stream). Only the byte mover differs between transports:
//! the ring, control plane and deadlines above it are shared.
//!
//! Every write is bounded by a deadline: a peer that stops reading fails the write with
//! `KVSTAGE_E_TIMEOUT`, and a transport whose stream was cut mid-frame shuts itself down (the
//! session is then dead; nothing half-written is ever followed by more frames).

pub mod faults;
pub mod rdma;
pub mod shm;
pub mod tcp;

use crate::deadline::Deadline;
use crate::error::Result;
use crate::protocol::Message;

/// The payload of one slice-path write: one range of the prefill pool, or the pieces of a row
/// whose heads the pool puts apart (sent back to back, one head each).
pub enum SlicePayload<'a> {
    One(&'a [u8]),
    Pieces(Vec<&'a [u8]>),
}

pub trait Transport: Send + Sync {
    /// Sends one control message.
    fn send(&self, msg: &Message, deadline: &Deadline) -> Result<()>;

    /// Writes `data` to the range named by `header` (a `Message::Data`), then `ready`, in that order.
    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()>;

    /// As `write_chunk`, for a chunk whose allocation starts at `grant_offset` in the receiver's
    /// ring (RDMA writes there directly; a stream transport does not need it).
    fn write_chunk_at(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        let _ = grant_offset;
        self.write_chunk(header, data, ready, deadline)
    }

    /// Whether [`write_piece_from`](Self::write_piece_from) works: a stream transport that
    /// copies from the caller's memory itself (TCP), so the sender needs no staging copy.
    fn streams_from_memory(&self) -> bool {
        false
    }

    /// As [`write_piece`](Self::write_piece), the payload given as `parts`: slices in order,
    /// together the length `header` (a `Message::Data`) names, written straight from where they
    /// are (the sender's pool rows); the ready follows by [`finish_pieces`](Self::finish_pieces).
    /// Only where [`streams_from_memory`](Self::streams_from_memory).
    fn write_piece_from(&self, header: &Message, parts: &mut dyn Iterator<Item = &[u8]>, deadline: &Deadline) -> Result<()> {
        let _ = (header, parts, deadline);
        Err(crate::error::Error::internal(format!("{} cannot write from the caller's memory", self.describe())))
    }

    /// Layer-wise sending: writes `data` to the range `header` (a `Message::Data`) names in the
    /// grant at `grant_offset`, one piece of a region whose ready follows by
    /// [`finish_pieces`](Self::finish_pieces).
    fn write_piece(&self, grant_offset: u64, header: &Message, data: &[u8], deadline: &Deadline) -> Result<()>;

    /// After the last [`write_piece`](Self::write_piece) of the region `header` (a `Message::Data`
    /// of the whole region, whose bytes are `data`): `ready`, bound to the pieces' data.
    fn finish_pieces(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        let _ = (grant_offset, header, data);
        self.send(ready, deadline)
    }

    /// Whether [`write_device`](Self::write_device) works: the NIC reads device memory (RDMA).
    fn writes_device_memory(&self) -> bool {
        false
    }

    /// GPUDirect RDMA: as [`write_chunk_at`](Self::write_chunk_at) (with `ready`) or
    /// [`write_piece`](Self::write_piece) (without), from the `len` bytes `header` (a
    /// `Message::Data`) names at `src`: device memory registered with the NIC, which the CPU
    /// never reads. Only where [`writes_device_memory`](Self::writes_device_memory).
    fn write_device(&self, grant_offset: u64, header: &Message, src: u64, ready: Option<&Message>, deadline: &Deadline) -> Result<()> {
        let _ = (grant_offset, header, src, ready, deadline);
        Err(crate::error::Error::internal(format!("{} cannot write device memory", self.describe())))
    }

    /// Same-host transports: the range `[ring_offset, +len)` of the receiver's ring, mapped in
    /// this process, for the gather to write in place; then [`finish_in_place`](Self::finish_in_place).
    /// `None`: this transport moves bytes from a staging buffer.
    fn in_place(&self, ring_offset: u64, len: u64) -> Option<Result<shm::InPlace<'_>>> {
        let _ = (ring_offset, len);
        None
    }

    /// Direct mode: whether the receiver's KV pool is mapped here ([`direct_pool`](Self::direct_pool)).
    fn maps_pool(&self) -> bool {
        false
    }

    /// Direct mode: the receiver's KV pool mapped in this process, for a chunk granted directly
    /// to be copied from this side's pages into the decode pages its grant names; then
    /// [`finish_in_place`](Self::finish_in_place). `None`: the pool is not mapped here.
    fn direct_pool(&self) -> Option<Result<shm::DirectPool<'_>>> {
        None
    }

    /// The kind of ring [`in_place`](Self::in_place) hands out (host, or device memory a gather
    /// of a CUDA pool on that device writes directly); `None` when it hands out nothing.
    fn in_place_kind(&self) -> Option<shm::RingKind> {
        None
    }

    /// After an in-place write of the range `header` (a `Message::Data`) names: reports it, then
    /// `ready`, in that order.
    fn finish_in_place(&self, header: &Message, ready: &Message, deadline: &Deadline) -> Result<()> {
        let _ = (header, ready, deadline);
        Err(crate::error::Error::internal(format!("{} cannot write in place", self.describe())))
    }

    /// Slice path: one write per `(header, payload)` pair (`Message::Slice` headers), then `done`.
    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, SlicePayload<'_>)>, done: &Message, deadline: &Deadline) -> Result<()>;

    /// Sends one small control message only if it can go now: `Ok(false)` when another write
    /// holds the stream or the peer's receive window is full (nothing was sent). For broadcasts
    /// that must not wait on one peer; a stream transport overrides it.
    fn try_send(&self, msg: &Message) -> Result<bool> {
        self.send(msg, &Deadline::after(Some(std::time::Duration::from_millis(50)))).map(|()| true)
    }

    /// Closes both directions; blocked readers and writers return.
    fn shutdown(&self);

    /// Whether this side cut the connection ([`shutdown`](Self::shutdown) or
    /// [`reset`](Self::reset), e.g. after a write failed midway): known at once, before the
    /// session's reader sees the stream end.
    fn is_cut(&self) -> bool {
        false
    }

    /// The stream's position: bytes this side has handed to it so far, `None` where the
    /// transport queues no bytes of its own (its data goes by shared memory or RDMA).
    fn stream_mark(&self) -> Option<u64> {
        None
    }

    /// Whether the peer has acknowledged every byte of the stream up to `mark` (a
    /// [`stream_mark`](Self::stream_mark)). While it has not (a slow or lossy link, a peer that
    /// stopped reading), anything written after them, an abort included, reaches the receiver
    /// only once they have.
    fn acknowledged(&self, _mark: u64) -> bool {
        true
    }

    /// Ends the connection at once, dropping what is queued and telling the peer as soon as the
    /// link carries a packet ([`shutdown`](Self::shutdown) where the transport has nothing
    /// faster).
    fn reset(&self) {
        self.shutdown();
    }

    /// "tcp 127.0.0.1:5000" — for messages.
    fn describe(&self) -> String;
}
