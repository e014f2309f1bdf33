//! TCP transport: control frames and bulk data share one ordered stream per session.

use std::io::{IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{SlicePayload, Transport};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::Message;

/// Socket buffer size asked for bulk streams (the kernel may clamp it).
const SOCKET_BUFFER_BYTES: usize = 8 << 20;

/// Keepalive probes sent before a silent peer is declared gone.
const KEEPALIVE_PROBES: u32 = 5;

/// The slowest average rate a payload may arrive at, after its grace (the stall bound): a
/// payload pins the ring range or pool pages it lands in, so one peer trickling it must not hold
/// them (and the ring's watermark behind them) for long.
pub const MIN_PAYLOAD_RATE: u64 = 1 << 20;

/// A payload's grace where no stall bound is set.
pub const PAYLOAD_GRACE: Duration = Duration::from_secs(10);

/// How often a payload read that receives nothing asks whether its room still takes data.
const LIVENESS_POLL: Duration = Duration::from_millis(200);

/// Tunes a connected socket: no Nagle delay for control frames, large buffers for bulk data, and
/// dead-peer detection: with `dead_peer` set, a peer that stops answering (a host that vanished)
/// fails the socket after about that long, idle (keepalive: a third of it idle, then
/// [`KEEPALIVE_PROBES`] probes) or with unacknowledged data (`TCP_USER_TIMEOUT`).
pub fn tune(stream: &TcpStream, dead_peer: Option<Duration>) -> Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    // Best effort: a kernel limit below the request is not an error.
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    match dead_peer {
        None => sock.set_keepalive(true)?,
        Some(t) => {
            let idle = (t / 3).max(Duration::from_secs(1));
            let interval = ((t - t / 3) / KEEPALIVE_PROBES).max(Duration::from_secs(1));
            let keepalive = socket2::TcpKeepalive::new().with_time(idle).with_interval(interval).with_retries(KEEPALIVE_PROBES);
            sock.set_tcp_keepalive(&keepalive)?;
            sock.set_tcp_user_timeout(Some(t))?;
        }
    }
    Ok(())
}

/// A listening socket with room for `backlog` connections not yet accepted (std's fixed 128
/// overflows under a burst of senders: their SYNs are dropped and retried a second later).
pub fn listen(addr: SocketAddr, backlog: i32) -> Result<std::net::TcpListener> {
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        sock.bind(&addr.into())?;
        sock.listen(backlog)?;
        Ok(sock.into())
    };
    bind().map_err(|e| Error::from(e).context(format!("cannot listen on {addr}")))
}

pub fn connect(addr: SocketAddr, timeout: Duration, dead_peer: Option<Duration>) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| Error::from(e).context(format!("connect to {addr} failed")))?;
    tune(&stream, dead_peer)?;
    Ok(stream)
}

/// The receiving half of a TCP session: frames, and each payload read straight into the target
/// its header was checked against (no intermediate copy).
///
/// With a `stall` bound, a peer may idle between frames as long as it likes (keepalive notices a
/// vanished host), but one that stops sending inside a frame or payload for that long is cut off:
/// otherwise a payload read that never ends would pin its ring range forever.
pub struct Inbound {
    stream: TcpStream,
    stall: Option<Duration>,
}

impl Inbound {
    pub fn new(stream: TcpStream, stall: Option<Duration>) -> Inbound {
        Inbound { stream, stall }
    }

    /// The first frame: a hello within `deadline` for the whole of it (a trickling peer cannot
    /// stretch it), bounded in size before its body is read.
    pub fn read_hello(&mut self, deadline: &Deadline) -> Result<crate::protocol::Hello> {
        let hello = crate::protocol::read_hello(&mut DeadlineReader::new(&self.stream, deadline, "reading the hello"));
        self.stream.set_read_timeout(self.stall)?;
        hello
    }

    /// The next frame header and body; `None` on a clean EOF between frames.
    pub fn next_frame(&mut self) -> Result<Option<Message>> {
        crate::protocol::read_frame_between_idle(&mut self.stream).map_err(|e| self.stalled(e))
    }

    /// Reads a payload of exactly `buf.len()` bytes into `buf`.
    pub fn payload_into(&mut self, buf: &mut [u8]) -> Result<()> {
        std::io::Read::read_exact(&mut self.stream, buf).map_err(|e| self.stalled(peer_error(e).context("receiving a payload failed")))
    }

    /// When a payload of `len` bytes announced now must have arrived: the stall bound (or
    /// [`PAYLOAD_GRACE`]) plus its length at [`MIN_PAYLOAD_RATE`]. A peer that keeps a payload
    /// alive with a byte now and then holds its grant no longer than that.
    pub fn payload_until(&self, len: u64) -> Instant {
        let grace = self.stall.unwrap_or(PAYLOAD_GRACE);
        Instant::now() + grace + Duration::from_secs_f64(len as f64 / MIN_PAYLOAD_RATE as f64)
    }

    /// Reads a payload into `ranges` (`(address, length)`, filled in order, their lengths summing
    /// to the payload's), with vectored reads straight from the socket, by `until` (else the
    /// peer counts as gone: `KVSTAGE_E_PEER_GONE`). After every read that leaves bytes to come,
    /// and every [`LIVENESS_POLL`] the peer sends nothing, `go_on()` says whether to continue:
    /// when it says no, returns the bytes not read (the caller discards them to keep the stream
    /// in sync); `Ok(0)`: all read.
    ///
    /// # Safety
    /// Every range is memory valid for writes that nothing else reads or writes meanwhile.
    pub unsafe fn payload_into_ranges(&mut self, ranges: &[(usize, usize)], until: Instant, mut go_on: impl FnMut() -> bool) -> Result<u64> {
        /// Ranges handed to one `readv` at most (the kernel's `IOV_MAX` is 1024).
        const BATCH: usize = 1024;
        let total: u64 = ranges.iter().map(|&(_, n)| n as u64).sum();
        let mut left = total;
        let mut progress = Instant::now();
        let mut slices: Vec<std::io::IoSliceMut<'_>> = Vec::with_capacity(BATCH);
        for batch in ranges.chunks(BATCH) {
            slices.clear();
            // SAFETY: the caller's contract: each range is writable memory nobody else touches.
            slices.extend(batch.iter().filter(|&&(_, n)| n > 0).map(|&(at, n)| std::io::IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(at as *mut u8, n) })));
            let mut pending = &mut slices[..];
            while !pending.is_empty() {
                self.arm_read(until, progress, total, left)?;
                let n = match std::io::Read::read_vectored(&mut self.stream, pending) {
                    Ok(0) => return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "connection closed inside a payload")),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) if self.quiet(&e, until, progress) => {
                        // Nothing came for a poll: a room that stopped taking data ends the read.
                        if !go_on() {
                            self.stream.set_read_timeout(self.stall)?;
                            return Ok(left);
                        }
                        continue;
                    }
                    Err(e) => return Err(self.payload_error(e, until, total, left, "receiving a payload failed")),
                };
                progress = Instant::now();
                std::io::IoSliceMut::advance_slices(&mut pending, n);
                left -= n as u64;
                if left > 0 && !go_on() {
                    self.stream.set_read_timeout(self.stall)?;
                    return Ok(left);
                }
            }
        }
        self.stream.set_read_timeout(self.stall)?;
        Ok(0)
    }

    /// Reads and drops a payload of `len` bytes by `until` (the stream stays in sync).
    pub fn discard(&mut self, len: u64, until: Instant) -> Result<()> {
        let mut buf = [0u8; 64 << 10];
        let mut left = len;
        let mut progress = Instant::now();
        while left > 0 {
            self.arm_read(until, progress, len, left)?;
            let want = left.min(buf.len() as u64) as usize;
            match std::io::Read::read(&mut self.stream, &mut buf[..want]) {
                Ok(0) => return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "connection closed inside a payload")),
                Ok(n) => {
                    left -= n as u64;
                    progress = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if self.quiet(&e, until, progress) => {}
                Err(e) => return Err(self.payload_error(e, until, len, left, "discarding a payload failed")),
            }
        }
        self.stream.set_read_timeout(self.stall)?;
        Ok(())
    }

    /// The next read of a payload waits at most [`LIVENESS_POLL`], and neither past `until` nor
    /// past the stall bound counted from the last byte (`progress`).
    fn arm_read(&self, until: Instant, progress: Instant, total: u64, left: u64) -> Result<()> {
        let Some(rest) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Err(self.too_slow(total, left));
        };
        let stall_left = self.stall.map_or(rest, |s| s.saturating_sub(progress.elapsed()));
        if stall_left.is_zero() {
            return Err(self.stalled(Error::new(Status::KVSTAGE_E_TIMEOUT, "no byte of the payload came")));
        }
        self.stream.set_read_timeout(Some(rest.min(stall_left).min(LIVENESS_POLL)))?;
        Ok(())
    }

    /// A read that timed out on a poll, with neither the payload's deadline nor the stall bound
    /// reached: the payload may go on.
    fn quiet(&self, e: &std::io::Error, until: Instant, progress: Instant) -> bool {
        matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
            && Instant::now() < until
            && self.stall.is_none_or(|s| progress.elapsed() < s)
    }

    fn payload_error(&self, e: std::io::Error, until: Instant, total: u64, left: u64, what: &str) -> Error {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) && Instant::now() >= until {
            return self.too_slow(total, left);
        }
        self.stalled(peer_error(e).context(what.to_owned()))
    }

    fn too_slow(&self, total: u64, left: u64) -> Error {
        Error::new(
            Status::KVSTAGE_E_PEER_GONE,
            format!(
                "a payload of {total} bytes still missed {left} of them at its deadline (it must arrive at {} MiB/s at least after a grace of {} ms); the peer is cut off",
                MIN_PAYLOAD_RATE >> 20,
                self.stall.unwrap_or(PAYLOAD_GRACE).as_millis()
            ),
        )
    }

    /// A read timeout here means the peer stalled mid-frame: it is treated as gone.
    fn stalled(&self, e: Error) -> Error {
        match self.stall {
            Some(t) if e.code() == Status::KVSTAGE_E_TIMEOUT => {
                e.wrap(Status::KVSTAGE_E_PEER_GONE, format!("the peer sent nothing for {} ms inside a frame or payload", t.as_millis()))
            }
            _ => e,
        }
    }
}

/// An I/O error on an established connection. The peer's host being unreachable or gone (reset,
/// closed, no acknowledgement within `TCP_USER_TIMEOUT`, network or host unreachable) is
/// `KVSTAGE_E_PEER_GONE`; a read or write timeout that a deadline set is `KVSTAGE_E_TIMEOUT`;
/// anything else `KVSTAGE_E_TRANSPORT`.
pub fn peer_error(e: std::io::Error) -> Error {
    let gone = matches!(
        e.raw_os_error(),
        Some(libc::ETIMEDOUT | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ENETDOWN | libc::EHOSTDOWN | libc::ECONNRESET | libc::EPIPE | libc::ECONNABORTED)
    ) || e.kind() == std::io::ErrorKind::UnexpectedEof;
    if gone {
        let why = if e.raw_os_error() == Some(libc::ETIMEDOUT) {
            "the peer stopped acknowledging (host gone or partitioned)"
        } else {
            "the peer is gone"
        };
        return Error::from(e).wrap(Status::KVSTAGE_E_PEER_GONE, why);
    }
    Error::from(e)
}

/// Reads from a stream with one deadline for the whole exchange (not per read): a peer that
/// trickles bytes cannot stretch it.
pub struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: &'a Deadline,
    what: &'static str,
}

impl<'a> DeadlineReader<'a> {
    pub fn new(stream: &'a TcpStream, deadline: &'a Deadline, what: &'static str) -> DeadlineReader<'a> {
        DeadlineReader { stream, deadline, what }
    }
}

impl std::io::Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.remaining(self.what).map_err(|e| std::io::Error::new(std::io::ErrorKind::TimedOut, e.message().to_owned()))?;
        self.stream.set_read_timeout(left)?;
        let mut s = self.stream;
        match std::io::Read::read(&mut s, buf) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("deadline passed while {}", self.what)))
            }
            other => other,
        }
    }
}

pub struct TcpTransport {
    writer: Mutex<TcpStream>,
    /// A second handle on the socket so shutdown never waits behind a blocked writer.
    closer: TcpStream,
    peer: SocketAddr,
    /// Bytes the kernel took from this side so far (the stream's position).
    written: AtomicU64,
    /// Set once this side shut the stream down or reset it.
    cut: AtomicBool,
}

impl TcpTransport {
    pub fn new(stream: TcpStream) -> Result<TcpTransport> {
        let peer = stream.peer_addr()?;
        let closer = stream.try_clone()?;
        Ok(TcpTransport { writer: Mutex::new(stream), closer, peer, written: AtomicU64::new(0), cut: AtomicBool::new(false) })
    }

    /// Bytes written to the socket that the peer's TCP has not acknowledged (unsent ones too).
    fn unacknowledged(&self) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int; the descriptor is open while `self` lives.
        let rc = unsafe { libc::ioctl(self.closer.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
        if rc == 0 { n.max(0) as usize } else { 0 }
    }

    /// Ends the connection with a reset: queued bytes are dropped and the peer is told at once
    /// (Linux's `connect` with `AF_UNSPEC` disconnects a TCP socket for every handle on it and
    /// wakes a blocked reader or writer with an error; a `close` would wait for the last handle, a
    /// `shutdown` queue a FIN behind the data).
    fn reset(&self) {
        let unspec = libc::sockaddr { sa_family: libc::AF_UNSPEC as libc::sa_family_t, sa_data: [0; 14] };
        // SAFETY: a valid sockaddr of the size given; the descriptor is open while `self` lives.
        let rc = unsafe { libc::connect(self.closer.as_raw_fd(), &unspec, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t) };
        if rc != 0 {
            // Linux 6.4 to 6.6 (and stable kernels that took that change) refuse to disconnect a
            // socket a thread is blocked on (EBUSY): the FIN of the shutdown below is all we have.
            log::warn!(
                target: module_path!(),
                "cannot reset the connection to {} ({}): shut down instead, the peer sees it behind the bytes still queued",
                self.peer,
                std::io::Error::last_os_error()
            );
        }
        // Whatever that did, nothing more goes out or comes in.
        self.shutdown();
    }

    /// Runs `write` on the stream with the deadline as its write timeout. Any failure may have cut
    /// a frame in half, so the stream is shut down: the session is dead from here on.
    fn write(&self, deadline: &Deadline, write: impl FnOnce(&mut DeadlineWriter<'_>) -> std::io::Result<()>) -> Result<()> {
        // Another transfer of this session may be writing: wait for it only until our deadline.
        let w = match deadline.instant() {
            Some(t) => self.writer.try_lock_until(t).ok_or_else(|| deadline.timeout_error(&format!("waiting to write to peer {}", self.peer)))?,
            None => self.writer.lock(),
        };
        self.write_locked(&w, deadline, write)
    }

    /// [`write`](Self::write) on the stream `w`, whose writer lock the caller holds.
    fn write_locked(&self, w: &TcpStream, deadline: &Deadline, write: impl FnOnce(&mut DeadlineWriter<'_>) -> std::io::Result<()>) -> Result<()> {
        let what = format!("writing to peer {}", self.peer);
        let mut out = DeadlineWriter::new(w, deadline, &self.written);
        let Err(e) = write(&mut out) else { return Ok(()) };
        // SO_SNDTIMEO (the deadline) expires as EAGAIN; ETIMEDOUT is TCP_USER_TIMEOUT: gone.
        let deadline_passed = e.kind() == std::io::ErrorKind::WouldBlock;
        if deadline_passed && out.wrote == 0 {
            // Not a byte of it went out: the stream is whole, only this write's deadline passed.
            return Err(Error::new(Status::KVSTAGE_E_TIMEOUT, format!("deadline passed before {what} (the send buffer stayed full)")));
        }
        // A reset, not a FIN: a FIN would reach the peer only behind the bytes queued (and the
        // half frame), so its reader would hold the payload's grant until they trickle in.
        self.reset();
        let err = peer_error(e).context(format!("write to peer {} failed", self.peer));
        Err(if deadline_passed { err.wrap(Status::KVSTAGE_E_TIMEOUT, format!("deadline passed while {what} (the peer stopped reading)")) } else { err })
    }
}

/// Writes with one deadline for the whole exchange: the socket's send timeout is re-armed with
/// the time left (at most every [`REARM`]), so a peer that drains slowly cannot stretch a write
/// past its deadline by more than that slack.
pub struct DeadlineWriter<'a> {
    stream: &'a TcpStream,
    deadline: &'a Deadline,
    armed: Option<Instant>,
    /// The transport's stream position, advanced by every byte written.
    written: &'a AtomicU64,
    /// Bytes this writer wrote.
    wrote: u64,
}

/// How long the rest of a frame that [`TcpTransport::try_send`] got only partly into the send
/// buffer may take (the buffer was nearly full: a peer that does not drain it is cut).
const PARTIAL_FRAME_BOUND: Duration = Duration::from_millis(100);

/// How often the send timeout is re-armed while writing (the slack a deadline may overrun by).
pub const REARM: Duration = Duration::from_millis(10);

impl<'a> DeadlineWriter<'a> {
    fn new(stream: &'a TcpStream, deadline: &'a Deadline, written: &'a AtomicU64) -> DeadlineWriter<'a> {
        DeadlineWriter { stream, deadline, armed: None, written, wrote: 0 }
    }

    fn advance(&mut self, n: usize) {
        self.wrote += n as u64;
        self.written.fetch_add(n as u64, Ordering::Release);
    }

    fn arm(&mut self) -> std::io::Result<()> {
        if self.armed.is_some_and(|t| t.elapsed() < REARM) {
            return Ok(());
        }
        let left = self.deadline.remaining("writing").map_err(|_| std::io::Error::from(std::io::ErrorKind::WouldBlock))?;
        self.stream.set_write_timeout(left)?;
        self.armed = Some(Instant::now());
        Ok(())
    }
}

impl Write for DeadlineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm()?;
        let mut s = self.stream;
        let n = s.write(buf)?;
        self.advance(n);
        Ok(n)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.arm()?;
        // Not TcpStream::write_vectored: std sends vectors with writev, which raises SIGPIPE in the
        // host process when the peer has gone (a library must never kill its host). sendmsg with
        // MSG_NOSIGNAL reports EPIPE instead, as std's own `write` does.
        let n = socket2::SockRef::from(self.stream).send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)?;
        self.advance(n);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Slices one `sendmsg` takes at most (Linux `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

fn write_all_vectored(w: &mut impl Write, mut parts: &mut [IoSlice<'_>]) -> std::io::Result<()> {
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
    fn send(&self, msg: &Message, deadline: &Deadline) -> Result<()> {
        let frame = msg.encode();
        self.write(deadline, |w| w.write_all(&frame))
    }

    /// Never waits for the writer lock or for room in the send buffer; the rest of a frame the
    /// kernel took only part of follows within [`PARTIAL_FRAME_BOUND`], else the stream is cut.
    fn try_send(&self, msg: &Message) -> Result<bool> {
        let Some(w) = self.writer.try_lock() else { return Ok(false) };
        let frame = msg.encode();
        let sent = loop {
            match socket2::SockRef::from(&*w).send_with_flags(&frame, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(n) => {
                    self.written.fetch_add(n as u64, Ordering::Release);
                    break n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => {
                    self.reset();
                    return Err(peer_error(e).context(format!("write to peer {} failed", self.peer)));
                }
            }
        };
        if sent < frame.len() {
            self.write_locked(&w, &Deadline::after(Some(PARTIAL_FRAME_BOUND)), |out| out.write_all(&frame[sent..]))?;
        }
        Ok(true)
    }

    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        let (head, tail) = (header.encode(), ready.encode());
        // Written straight from the caller's staging buffer: no copy between gather and socket.
        self.write(deadline, |w| write_all_vectored(w, &mut [IoSlice::new(&head), IoSlice::new(data), IoSlice::new(&tail)]))
    }

    fn streams_from_memory(&self) -> bool {
        true
    }

    fn write_piece_from(&self, header: &Message, parts: &mut dyn Iterator<Item = &[u8]>, deadline: &Deadline) -> Result<()> {
        let head = header.encode();
        let &Message::Data { len, .. } = header else {
            return Err(Error::internal("write_piece_from needs a Data header"));
        };
        let mut written = 0u64;
        self.write(deadline, |w| {
            // Batches of at most IOV_MAX slices per sendmsg (the kernel refuses longer vectors).
            let mut batch: Vec<IoSlice<'_>> = Vec::with_capacity(IOV_MAX);
            batch.push(IoSlice::new(&head));
            loop {
                let mut last = false;
                while batch.len() < IOV_MAX && !last {
                    match parts.next() {
                        Some(part) => {
                            written += part.len() as u64;
                            batch.push(IoSlice::new(part));
                        }
                        None => last = true,
                    }
                }
                if last && written != len {
                    // The frame would not match its header: the stream is cut (by `write`).
                    return Err(std::io::Error::other(format!("a piece of {written} bytes under a header of {len}")));
                }
                write_all_vectored(w, &mut batch)?;
                if last {
                    return Ok(());
                }
                batch.clear();
            }
        })
    }

    fn write_piece(&self, _grant_offset: u64, header: &Message, data: &[u8], deadline: &Deadline) -> Result<()> {
        let head = header.encode();
        self.write(deadline, |w| write_all_vectored(w, &mut [IoSlice::new(&head), IoSlice::new(data)]))
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, SlicePayload<'_>)>, done: &Message, deadline: &Deadline) -> Result<()> {
        self.write(deadline, |w| {
            for (header, payload) in ops {
                let head = header.encode();
                match payload {
                    SlicePayload::One(bytes) => write_all_vectored(w, &mut [IoSlice::new(&head), IoSlice::new(bytes)])?,
                    SlicePayload::Pieces(pieces) => {
                        let mut io: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&head)).chain(pieces.iter().map(|p| IoSlice::new(p))).collect();
                        write_all_vectored(w, &mut io)?
                    }
                }
            }
            w.write_all(&done.encode())
        })
    }

    fn shutdown(&self) {
        self.cut.store(true, Ordering::Release);
        let _ = self.closer.shutdown(Shutdown::Both);
    }

    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }

    fn stream_mark(&self) -> Option<u64> {
        Some(self.written.load(Ordering::Acquire))
    }

    fn acknowledged(&self, mark: u64) -> bool {
        // `written` first: bytes written after this load can only make the queue longer, so the
        // estimate of what was acknowledged errs low (towards a reset, never towards an abort
        // that would wait behind unacknowledged bytes of the chunk).
        let written = self.written.load(Ordering::Acquire);
        written.saturating_sub(self.unacknowledged() as u64) >= mark
    }

    fn reset(&self) {
        TcpTransport::reset(self);
    }

    fn describe(&self) -> String {
        format!("tcp {}", self.peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RoomRef;

    /// Pieces from memory of any slice count (across the 1024-slice batches, empty slices among
    /// them) arrive byte for byte behind their header through a small send buffer and a slow
    /// reader; a piece shorter than its header cuts the stream instead of desynchronizing it.
    #[test]
    fn pieces_from_memory_arrive_whole_in_order() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sender = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _ = socket2::SockRef::from(&sender).set_send_buffer_size(4096);
        let link = TcpTransport::new(sender).unwrap();
        let (receiver, _) = listener.accept().unwrap();
        let counts = [0usize, 1, 1022, 1023, 1024, 1025, 2046, 2047, 2048, 3001];
        let piece = |n: usize| -> Vec<Vec<u8>> { (0..n).map(|i| vec![(i % 251) as u8; i % 7]).collect() };
        let reader = std::thread::spawn(move || {
            let mut inbound = Inbound::new(receiver, None);
            for n in counts {
                let Some(Message::Data { len, .. }) = inbound.next_frame().unwrap() else { panic!("a Data frame") };
                let mut got = vec![0u8; len as usize];
                std::thread::sleep(Duration::from_millis(2));
                inbound.payload_into(&mut got).unwrap();
                assert_eq!(got, piece(n).concat(), "{n} slices");
            }
            // The short piece: the stream ends, at the latest inside its payload.
            match inbound.next_frame() {
                Ok(None) | Err(_) => {}
                Ok(Some(Message::Data { len, .. })) => assert!(inbound.payload_into(&mut vec![0u8; len as usize]).is_err(), "a short piece ends the stream"),
                Ok(Some(other)) => panic!("after the pieces: {other:?}"),
            }
        });
        let deadline = Deadline::after(Some(Duration::from_secs(10)));
        let header = |len: usize| Message::Data { room: RoomRef { id: 1, key: 1 }, chunk: 0, writer: 0, offset: 0, len: len as u64 };
        for n in counts {
            let slices = piece(n);
            let len = slices.iter().map(Vec::len).sum();
            link.write_piece_from(&header(len), &mut slices.iter().map(Vec::as_slice), &deadline).unwrap();
        }
        let short = piece(10);
        let err = link.write_piece_from(&header(1000), &mut short.iter().map(Vec::as_slice), &deadline).unwrap_err();
        assert!(err.chain().contains("under a header of 1000"), "{}", err.chain());
        reader.join().unwrap();
    }
}
