//! Byte movers. A transport sends control messages and moves a chunk's bytes into a range the
//! receiver granted, delivering the chunk's completion *after* the data (TCP: the same ordered
//! stream; RDMA: WRITE_WITH_IMM on the same QP). Only the byte mover differs between transports:
//! the ring, control plane and deadlines above it are shared.

pub mod tcp;

use crate::error::Result;
use crate::protocol::Message;

pub trait Transport: Send + Sync {
    /// Sends one control message.
    fn send(&self, msg: &Message) -> Result<()>;

    /// Writes `data` to the range named by `header` (a `Message::Data`), then `ready`, in that order.
    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message) -> Result<()>;

    /// Slice path: one write per `(header, payload)` pair (`Message::Slice` headers), then `done`.
    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, &[u8])>, done: &Message) -> Result<()>;

    /// Closes both directions; blocked readers return.
    fn shutdown(&self);

    /// "tcp 127.0.0.1:5000" — for messages.
    fn describe(&self) -> String;
}
