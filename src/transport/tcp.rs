//! TCP transport: control frames and bulk data share one ordered stream per session.

use std::io::{IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use parking_lot::Mutex;

use super::Transport;
use crate::error::{Error, Result};
use crate::protocol::Message;

/// Socket buffer size asked for bulk streams (the kernel may clamp it).
const SOCKET_BUFFER_BYTES: usize = 8 << 20;

/// Tunes a connected socket: no Nagle delay for control frames, large buffers for bulk data.
pub fn tune(stream: &TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    // Best effort: a kernel limit below the request is not an error.
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    sock.set_keepalive(true)?;
    Ok(())
}

pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| Error::from(e).context(format!("connect to {addr} failed")))?;
    tune(&stream)?;
    Ok(stream)
}

pub struct TcpTransport {
    writer: Mutex<TcpStream>,
    /// A second handle on the socket so shutdown never waits behind a blocked writer.
    closer: TcpStream,
    peer: SocketAddr,
}

impl TcpTransport {
    pub fn new(stream: TcpStream) -> Result<TcpTransport> {
        let peer = stream.peer_addr()?;
        let closer = stream.try_clone()?;
        Ok(TcpTransport { writer: Mutex::new(stream), closer, peer })
    }

    fn fail(&self, e: std::io::Error) -> Error {
        Error::from(e).context(format!("write to peer {} failed", self.peer))
    }
}

fn write_all_vectored(w: &mut TcpStream, mut parts: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        match w.write_vectored(parts) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Transport for TcpTransport {
    fn send(&self, msg: &Message) -> Result<()> {
        self.writer.lock().write_all(&msg.encode()).map_err(|e| self.fail(e))
    }

    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message) -> Result<()> {
        let (head, tail) = (header.encode(), ready.encode());
        // Written straight from the caller's staging buffer: no copy between gather and socket.
        let mut parts = [IoSlice::new(&head), IoSlice::new(data), IoSlice::new(&tail)];
        write_all_vectored(&mut self.writer.lock(), &mut parts).map_err(|e| self.fail(e))
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, &[u8])>, done: &Message) -> Result<()> {
        let mut w = self.writer.lock();
        for (header, payload) in ops {
            let head = header.encode();
            let mut parts = [IoSlice::new(&head), IoSlice::new(payload)];
            write_all_vectored(&mut w, &mut parts).map_err(|e| self.fail(e))?;
        }
        w.write_all(&done.encode()).map_err(|e| self.fail(e))
    }

    fn shutdown(&self) {
        let _ = self.closer.shutdown(Shutdown::Both);
    }

    fn describe(&self) -> String {
        format!("tcp {}", self.peer)
    }
}
