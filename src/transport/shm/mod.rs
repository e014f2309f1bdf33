//! Same-host transport: the sender maps the receiver's staging ring (a sealed memfd) and its
//! gather writes each chunk straight into the granted range; control frames (allocation, the
//! `Written` report, `ChunkReady`, acks, watermarks) stay on the session's TCP stream, so the ring,
//! watermark, deadlines and integrity checks are the TCP path's.
//!
//! Negotiation, after the handshake (cluster token checked) and before RDMA's:
//! 1. the sender listens on a fresh abstract Unix socket and offers its name and a nonce
//!    (`ShmOffer`);
//! 2. the receiver connects to it — possible only from the same host and network namespace — and
//!    sends the nonce, the ring's size and the ring itself: a host ring's descriptor
//!    (`SCM_RIGHTS`), or a device ring's CUDA IPC export (handle, offset in its allocation,
//!    address). Then it answers on TCP (`ShmAnswer`: `local` says whether it reached the socket,
//!    `status` whether it serves);
//! 3. the sender checks the nonce and the ring: a memfd of that size, sealed against shrinking,
//!    which it maps; or device memory of that size on its KV pool's device, which it opens (or,
//!    when the receiver is this very process, uses at its address). The local socket stays open
//!    as the mapping's lease: its end tells the receiver that this process can no longer write
//!    its ring. A sender that unmapped writes [`LEASE_UNMAPPED`] before it closes the lease; a
//!    lease that the receiver's memory waits for (a device ring, a mapped KV pool) and that ends
//!    without that byte holds until the peer process has ended, since a dying process closes its
//!    files in descriptor order and the lease may close before its GPU context is torn down.
//!
//! Direct mode: when the sender asks for it (naming its own pool's memory) and the receiver's KV
//! pool is in that memory and shareable — host memory of `kvstage_shared_alloc`, or CUDA device
//! allocations that hold nothing but the pool — the receiver also passes the pool's memfds or IPC
//! handles and where each buffer lies in them; the sender maps or opens them under the same lease,
//! and chunks the receiver grants directly are copied from prefill page to decode page in one pass
//! (no ring, no scatter).
//!
//! Files: `fdpass` (abstract sockets, descriptor passing), `memory` (sealed memfd, mappings),
//! `pool` (shared allocations, the pool's share), `link` (the sender's transport).

pub mod fdpass;
mod greeting;
mod link;
pub mod memory;
pub mod pool;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use self::greeting::{DeviceExport, OfferedRing, PoolFiles, GREETING_BYTES, IPC_HANDLE_BYTES};
pub use self::link::{DirectPool, InPlace, Lease, PeerRing, ShmTransport};
use self::pool::{PeerPool, PoolShare};
use self::fdpass::NONCE_BYTES;
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::geometry::{MemoryKind, PoolShape};
use crate::protocol::{self, Message};
use crate::transport::Transport;

/// The byte a sender writes on its lease once nothing in its process maps the receiver's ring
/// or pool any more (then it closes the lease).
pub const LEASE_UNMAPPED: u8 = b'U';

/// A receiver's device memory as a sender reaches it: its device ring, or an allocation of its KV
/// pool (direct mode). The session layer, which owns CUDA, opens it (see [`OpenDevice`]) and
/// closes it on drop.
pub trait PeerDevice: Send + Sync {
    /// The memory's first byte: a device address of this process.
    fn ptr(&self) -> u64;
    fn bytes(&self) -> usize;
    /// The `len` bytes at offset `at`, copied to the host (synchronous).
    fn to_vec(&self, at: usize, len: usize) -> Result<Vec<u8>>;
}

/// The kind of memory a same-host ring is (what a gather must be able to write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingKind {
    Host,
    /// GPU memory, reached through CUDA IPC.
    Device,
}

/// Opens `len` bytes of a receiver's exported device memory (its ring, or a pool allocation) on the
/// device of this engine's KV pool; `same_process`: the receiver is this very process (its
/// address is used as is).
pub type OpenDevice<'a> = &'a dyn Fn(&DeviceExport, usize, bool) -> Result<Box<dyn PeerDevice>>;

/// Local connections the sender accepts while looking for the receiver's (another local process
/// that saw the socket's name may connect first; it cannot know the nonce).
const MAX_LOCAL_ACCEPTS: usize = 8;
/// How long an accepted local connection has to present its whole greeting (the receiver sends
/// it in one write as soon as it connects; others wait beside it meanwhile).
const GREETING_BOUND: Duration = Duration::from_secs(2);

/// I/O bound on the local socket during the exchange.
pub const LOCAL_IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What the engine's options ask of the same-host path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShmMode {
    /// Never (transport tcp or rdma, or `same_host` off).
    Off,
    /// When the peer is on this host and its ring is shareable; else RDMA or TCP.
    Auto,
    /// Transport shm: the same-host path or an error at connect.
    Required,
}

/// The same-host side of an engine: its mode and counters.
pub struct Shm {
    mode: ShmMode,
    /// Direct mode allowed (option `same_host_direct`).
    direct: bool,
    sessions: AtomicU64,
    direct_sessions: AtomicU64,
    direct_chunks: AtomicU64,
    downgrades: AtomicU64,
    last_downgrade: Mutex<String>,
}

/// How a sender's offer ended.
pub enum Negotiated {
    /// The ring is mapped: chunks go through it.
    Mapped(Arc<dyn Transport>),
    /// Not used; the session goes on to RDMA or TCP. `downgraded`: the peer is on this host but
    /// the path failed (counted); otherwise it was off or the peer is on another host.
    NotUsed { downgraded: bool },
}

impl Shm {
    pub fn new(mode: ShmMode, direct: bool) -> Arc<Shm> {
        Arc::new(Shm {
            mode,
            direct,
            sessions: AtomicU64::new(0),
            direct_sessions: AtomicU64::new(0),
            direct_chunks: AtomicU64::new(0),
            downgrades: AtomicU64::new(0),
            last_downgrade: Mutex::new(String::new()),
        })
    }

    /// Whether this engine uses direct mode where its peer allows it.
    pub fn direct(&self) -> bool {
        self.direct && self.mode != ShmMode::Off
    }

    /// Same-host sessions in direct mode (the sender maps the decode pool), opened or accepted.
    pub fn direct_sessions(&self) -> u64 {
        self.direct_sessions.load(Ordering::Relaxed)
    }

    /// Chunk regions written straight into a decode pool: by this engine (sender) or into its
    /// pool (receiver).
    pub fn direct_chunks(&self) -> u64 {
        self.direct_chunks.load(Ordering::Relaxed)
    }

    pub fn count_direct_session(&self) {
        self.direct_sessions.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_direct_chunk(&self) {
        self.direct_chunks.fetch_add(1, Ordering::Relaxed);
    }

    pub fn mode(&self) -> ShmMode {
        self.mode
    }

    /// Sessions that used the same-host path (opened or accepted by this engine).
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Sessions to a peer on this host that could not use the same-host path although it was
    /// allowed (transport auto); `last_downgrade` says why.
    pub fn downgrades(&self) -> u64 {
        self.downgrades.load(Ordering::Relaxed)
    }

    pub fn last_downgrade(&self) -> String {
        self.last_downgrade.lock().clone()
    }

    pub fn count_session(&self) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
    }

    fn downgrade(&self, session: &str, peer: &str, why: &str) {
        log::warn!(session = session; "same-host path not used for the session to {peer} (transport auto): {why}");
        self.downgrades.fetch_add(1, Ordering::Relaxed);
        *self.last_downgrade.lock() = format!("session {session} to {peer}: {why}");
    }

    /// Sender side, right after the handshake: offers the same-host path on `tcp` and reads the
    /// answer from `reader` (watermarks that arrive meanwhile go to `early`).
    /// `ring_bytes`: the ring size the receiver's hello announced (the ring it passes must be it).
    /// `open_device`: opens a receiver's device ring on the device of this engine's KV pool
    /// (`None`: the pool is host memory, and a device ring is not written from it).
    /// `direct`: the receiver's pool shape and this engine's pool memory, when this sender would
    /// map the receiver's pool (direct mode: this engine allows it; the receiver shares a pool in
    /// that memory only, opened with `open_device` when it is device memory).
    #[allow(clippy::too_many_arguments)]
    pub fn negotiate(
        &self,
        tcp: &Arc<dyn Transport>,
        reader: &mut impl Read,
        peer: &str,
        session: &str,
        ring_bytes: u64,
        open_device: Option<OpenDevice<'_>>,
        direct: Option<(&PoolShape, MemoryKind)>,
        deadline: &Deadline,
        early: &mut Vec<Message>,
    ) -> Result<Negotiated> {
        if self.mode == ShmMode::Off {
            return Ok(Negotiated::NotUsed { downgraded: false });
        }
        let local = fdpass::listen_abstract().and_then(|l| Ok((l, fdpass::random_bytes(NONCE_BYTES)?)));
        let ((name, listener), nonce) = match local {
            Ok(l) => l,
            Err(e) => return self.refused(e.context("cannot offer the same-host path"), session, peer),
        };
        let listener = OfferSocket(listener);
        let direct = direct.filter(|_| self.direct());
        tcp.send(&Message::ShmOffer { socket: name, nonce: nonce.clone(), direct: direct.map(|d| d.1) }, deadline)?;
        let (status, local, ring_len, reason) = loop {
            match protocol::read_frame(reader) {
                Ok(Some(Message::ShmAnswer { status, local, ring_len, reason })) => break (status, local, ring_len, reason),
                Ok(Some(m @ Message::Watermark(_))) => early.push(m),
                Ok(Some(other)) => {
                    return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("expected a same-host answer from {peer}, got {other:?}")))
                }
                Ok(None) => return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("{peer} closed the connection during the same-host exchange"))),
                Err(e) => return Err(e.context(format!("same-host exchange with {peer} failed"))),
            }
        };
        let refused = if !local {
            // Not a downgrade: the peer is on another host (or network namespace).
            if self.mode == ShmMode::Required {
                return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, format!("transport shm: {peer} is not on this host ({reason})")));
            }
            log::debug!(session = session; "{peer} is not on this host ({reason}): same-host path not used");
            return Ok(Negotiated::NotUsed { downgraded: false });
        } else if status != 0 {
            let code = Status::from_code(status).filter(|c| *c != Status::KVSTAGE_OK).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
            Error::new(code, format!("{peer} cannot serve the same-host path: {reason}"))
        } else if ring_len != ring_bytes {
            // Nothing is mapped that the handshake did not announce (a lying peer could offer a
            // huge sparse file, populated at our expense).
            Error::new(Status::KVSTAGE_E_PROTOCOL, format!("{peer} offers a ring of {ring_len} bytes, its hello said {ring_bytes}"))
        } else {
            match map_offered_ring(&listener.0, &nonce, ring_len, open_device, direct, deadline) {
                Ok((ring, pool, lease)) => {
                    self.count_session();
                    if pool.is_some() {
                        self.count_direct_session();
                    }
                    return Ok(Negotiated::Mapped(Arc::new(ShmTransport::new(tcp.clone(), ring, pool, lease))));
                }
                Err(e) => e.context(format!("mapping the staging ring of {peer} failed")),
            }
        };
        self.refused(refused, session, peer)
    }

    /// The same-host path failed for this session (the control stream is fine): an error for
    /// transport shm, a counted downgrade for auto.
    fn refused(&self, why: Error, session: &str, peer: &str) -> Result<Negotiated> {
        if self.mode == ShmMode::Required {
            return Err(why.context("transport shm: no fallback"));
        }
        self.downgrade(session, peer, &why.chain());
        Ok(Negotiated::NotUsed { downgraded: true })
    }

    /// Receiver side: why this engine does not serve the same-host path (`None`: it does).
    pub fn refusal(&self) -> Option<String> {
        match self.mode {
            ShmMode::Off => Some("its transport or same_host option rules the same-host path out".to_owned()),
            _ => None,
        }
    }
}

/// The sender's exchange socket. When it goes, every connection it did not take (the receiver's,
/// when the exchange failed before its accept: a lost answer, a refusal) is told that nothing of
/// this process maps what it passed, so that the receiver does not wait for this process to end.
struct OfferSocket(std::os::unix::net::UnixListener);

impl Drop for OfferSocket {
    fn drop(&mut self) {
        // Non-blocking: ends at the first empty accept.
        while let Ok((stream, _)) = self.0.accept() {
            drop(Lease::new(stream));
        }
    }
}

/// Accepts the receiver's local connection (the one that knows `nonce`), receives the ring and
/// maps it (a host ring) or opens it with `open_device` (a device ring), and the decode pool of
/// shape `direct` when the receiver passes it. Returns the ring, the pool and the lease socket.
fn map_offered_ring(
    listener: &std::os::unix::net::UnixListener,
    nonce: &[u8],
    ring_len: u64,
    open_device: Option<OpenDevice<'_>>,
    direct: Option<(&PoolShape, MemoryKind)>,
    deadline: &Deadline,
) -> Result<(PeerRing, Option<PeerPool>, Lease)> {
    let local = std::time::Instant::now() + LOCAL_IO_TIMEOUT;
    let until = deadline.instant().map_or(local, |d| d.min(local));
    let (stream, bytes, fd) = greeted(listener, nonce, until)?;
    // Declared before the mappings, so dropped after them on every way out.
    let stream = Lease::new(stream);
    // The rest (a direct pool's table) by the exchange's end.
    let left = until.saturating_duration_since(std::time::Instant::now()).max(std::time::Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    let said = greeting::parse(&bytes)?;
    if said.ring_len != ring_len {
        return Err(Error::new(
            Status::KVSTAGE_E_PROTOCOL,
            format!("ring of {} bytes on the local socket, {ring_len} on the control stream", said.ring_len),
        ));
    }
    // The kernel's word on who connected, not the peer's: only this very process may hand
    // over bare device addresses.
    let same_process = fdpass::peer_pid(&stream)? == std::process::id() as i32;
    let ring = match (said.device, fd) {
        (None, Some(fd)) => PeerRing::Host(memory::map_peer_ring(&fd, ring_len)?),
        (None, None) => return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, "the peer sent no descriptor with its host ring")),
        (Some(export), _) => {
            let Some(open_device) = open_device else {
                return Err(Error::new(
                    Status::KVSTAGE_E_UNSUPPORTED,
                    "the receiver's staging ring is CUDA device memory and this engine's KV pool is host memory",
                ));
            };
            let ring = open_device(&export, ring_len as usize, same_process)?;
            if ring.bytes() as u64 != ring_len {
                return Err(Error::internal(format!("a device ring of {} bytes was opened for {ring_len}", ring.bytes())));
            }
            PeerRing::Device(ring)
        }
    };
    let pool = match (said.pool, direct) {
        (PoolFiles { count: 0, .. }, _) => None,
        // A pool this process cannot reach (on another GPU, IPC refused, a share that does not
        // check out) leaves the ring: its chunks go through that instead.
        (files, Some((shape, kind))) if files.device == (kind == MemoryKind::Cuda) => match pool::map_peer_pool(&stream, files, shape, open_device, same_process) {
            Ok(pool) => Some(pool),
            Err(e) => {
                log::warn!("the receiver's KV pool cannot be written directly, its chunks go through the ring: {}", e.chain());
                None
            }
        },
        (files, _) => {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("the peer passes {} pool allocation(s) in {} memory, which this sender did not ask for", files.count, if files.device { "device" } else { "host" }),
            ))
        }
    };
    stream.set_read_timeout(None)?;
    Ok((ring, pool, stream))
}

/// The first local connection that greets with `nonce` (by `until`): its stream, greeting and
/// descriptor. Connections are watched together and a greeting is read only once it arrived
/// whole (the receiver sends it in one write as it connects), so a local process that connects
/// first and says nothing, or sends part of a greeting, delays no one; each is dropped
/// [`GREETING_BOUND`] after it was accepted. At most [`MAX_LOCAL_ACCEPTS`] connections are taken.
fn greeted(listener: &std::os::unix::net::UnixListener, nonce: &[u8], until: std::time::Instant) -> Result<(UnixStream, [u8; GREETING_BYTES], Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::AsRawFd;
    use std::time::Instant;
    let mut waiting: Vec<(UnixStream, Instant)> = Vec::new();
    let mut accepted = 0;
    loop {
        let now = Instant::now();
        if now >= until {
            return Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "no local connection presented the session's nonce in time"));
        }
        waiting.retain(|(_, since)| now < *since + GREETING_BOUND);
        // Whole greetings first; a closed connection goes.
        let mut i = 0;
        while i < waiting.len() {
            match queued_bytes(&waiting[i].0) {
                Some(n) if n >= GREETING_BYTES => {
                    let (stream, _) = waiting.swap_remove(i);
                    let mut bytes = [0u8; GREETING_BYTES];
                    if let Ok(fd) = fdpass::recv_fd(&stream, &mut bytes) {
                        if greeting::knows(&bytes, nonce) {
                            return Ok((stream, bytes, fd));
                        }
                    } // else another local process: not the receiver that answered
                }
                None => {
                    waiting.swap_remove(i);
                }
                Some(_) => i += 1,
            }
        }
        // Sleep until a connection comes, one of those that sent nothing yet says something (or
        // closes), or the next bound.
        let silent: Vec<&UnixStream> = waiting.iter().filter(|(s, _)| queued_bytes(s) == Some(0)).map(|(s, _)| s).collect();
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
            .chain(silent.iter().map(|s| s.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let wake = waiting.iter().map(|(_, since)| *since + GREETING_BOUND).fold(until, Instant::min);
        let ms = wake.saturating_duration_since(now).as_millis().clamp(1, 100) as i32;
        // SAFETY: `fds` holds valid pollfd entries for open descriptors.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if fds[0].revents == 0 {
            continue;
        }
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    accepted += 1;
                    if accepted > MAX_LOCAL_ACCEPTS {
                        return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("no local connection in {MAX_LOCAL_ACCEPTS} presented the session's nonce")));
                    }
                    stream.set_nonblocking(false)?;
                    waiting.push((stream, Instant::now()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Error::new(Status::KVSTAGE_E_TRANSPORT, "accept on the local socket failed").with_source(e)),
            }
        }
    }
}

/// Bytes queued to read on `stream` (`FIONREAD`); `None` once the peer closed it (readable with
/// nothing queued) or on an error.
fn queued_bytes(stream: &UnixStream) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    if unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut n) } != 0 {
        return None;
    }
    if n > 0 {
        return Some(n as usize);
    }
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; timeout 0 never waits.
    let readable = unsafe { libc::poll(&mut pfd, 1, 0) } == 1;
    (!readable).then_some(0)
}

/// Whether the same-host path works on this host (the doctor): a small sealed ring passed over an
/// abstract socket, mapped again and written through the second mapping.
pub fn probe() -> Result<()> {
    let ring = memory::SharedRing::create(4096)?;
    let (name, listener) = fdpass::listen_abstract()?;
    let nonce = fdpass::random_bytes(NONCE_BYTES)?;
    let _lease = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 4096, None).map_err(|(_, e)| e)?;
    let (mapped, _, _stream) = map_offered_ring(&listener, &nonce, 4096, None, None, &Deadline::after(Some(LOCAL_IO_TIMEOUT)))?;
    let PeerRing::Host(mapped) = mapped else { return Err(Error::internal("a host ring was opened as device memory")) };
    // SAFETY: both mappings are 4096 bytes and this function their only user.
    let seen = unsafe {
        mapped.ptr().add(100).write(0xa5);
        ring.ptr().add(100).read()
    };
    if seen != 0xa5 {
        return Err(Error::internal("a write through the second mapping did not reach the first"));
    }
    Ok(())
}

/// The pid a sender's socket name carries ("kvstage-shm-<pid>-<random>"), if it is one.
fn socket_pid(socket: &str) -> Option<i32> {
    let rest = socket.strip_prefix("kvstage-shm-")?;
    let (pid, random) = rest.split_once('-')?;
    (!random.is_empty() && random.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

/// Receiver side: connects to the sender's socket named in an offer, only if it is a kvstage
/// sender's socket: the name must be one `listen_abstract` makes, and the process that listens on
/// it must be the one the name says (so a peer can neither have the ring sent to, nor make the
/// receiver probe, any other local listener). `Err` says whether the socket was reached.
pub fn reach_sender(socket: &str) -> std::result::Result<UnixStream, (bool, Error)> {
    let Some(pid) = socket_pid(socket) else {
        return Err((false, Error::new(Status::KVSTAGE_E_PROTOCOL, format!("\"{}\" is not a kvstage sender's socket name", socket.escape_debug()))));
    };
    let stream = fdpass::connect_abstract(socket, LOCAL_IO_TIMEOUT).map_err(|e| (false, e))?;
    let listener_pid = fdpass::peer_pid(&stream).map_err(|e| (true, e))?;
    if listener_pid != pid {
        return Err((true, Error::new(Status::KVSTAGE_E_PROTOCOL, format!("the socket @{socket} is held by process {listener_pid}, not {pid}"))));
    }
    Ok(stream)
}

/// Receiver side: passes `ring` (its descriptor or IPC export, and its size) to the sender's
/// socket named in its offer ([`reach_sender`]), then the decode pool's `share` for direct mode.
/// `Err` says whether the socket was reached.
pub fn pass_ring(socket: &str, nonce: &[u8], ring: OfferedRing<'_>, ring_len: u64, share: Option<&PoolShare>) -> std::result::Result<UnixStream, (bool, Error)> {
    if nonce.len() != NONCE_BYTES {
        return Err((false, Error::new(Status::KVSTAGE_E_PROTOCOL, format!("a same-host offer with a {}-byte nonce", nonce.len()))));
    }
    let stream = reach_sender(socket)?;
    let greeting = ring.greeting(nonce, ring_len, share.map_or_else(PoolFiles::default, PoolShare::files));
    let sent = match ring {
        OfferedRing::Memfd(fd) => fdpass::send_fd(&stream, fd, &greeting),
        OfferedRing::Device(_) => fdpass::send_all(&stream, &greeting).map_err(|e| Error::new(Status::KVSTAGE_E_PEER_GONE, "sending the ring's IPC handle failed").with_source(e)),
    };
    sent.and_then(|()| share.map_or(Ok(()), |s| s.send(&stream))).map_err(|e| (true, e))?;
    stream.set_read_timeout(None).map_err(|e| (true, e.into()))?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_serves_the_path() {
        probe().unwrap();
    }

    /// Local processes that saw the socket's name connect first: one says nothing, one sends part
    /// of a greeting and stops. The receiver's greeting behind them is taken well within the
    /// exchange's bound (before, the silent one held it for the whole bound).
    #[test]
    fn local_processes_that_connect_first_and_stall_delay_the_exchange_not() {
        use std::io::Write;
        let ring = memory::SharedRing::create(8192).unwrap();
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(NONCE_BYTES).unwrap();
        let silent = fdpass::connect_abstract(&name, LOCAL_IO_TIMEOUT).unwrap();
        let mut partial = fdpass::connect_abstract(&name, LOCAL_IO_TIMEOUT).unwrap();
        partial.write_all(&[0u8; 3]).unwrap();
        let _r = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 8192, None).unwrap();
        let started = std::time::Instant::now();
        let (mapped, _, _lease) = map_offered_ring(&listener, &nonce, 8192, None, None, &Deadline::after(Some(LOCAL_IO_TIMEOUT))).unwrap();
        let took = started.elapsed();
        assert!(took < LOCAL_IO_TIMEOUT / 2, "the exchange waited {took:?} behind local connections that stalled");
        assert!(matches!(mapped, PeerRing::Host(_)));
        drop((silent, partial));
    }

    #[test]
    fn a_local_process_that_connects_first_without_the_nonce_is_skipped() {
        let ring = memory::SharedRing::create(8192).unwrap();
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(NONCE_BYTES).unwrap();
        // An intruder that read the name from /proc/net/unix: a descriptor, but not the nonce.
        let intruder = memory::SharedRing::create(8192).unwrap();
        let _i = pass_ring(&name, &[0u8; NONCE_BYTES], OfferedRing::Memfd(intruder.fd()), 8192, None).unwrap();
        let _r = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 8192, None).unwrap();
        let (mapped, _, _lease) = map_offered_ring(&listener, &nonce, 8192, None, None, &Deadline::after(Some(LOCAL_IO_TIMEOUT))).unwrap();
        let PeerRing::Host(mapped) = mapped else { panic!("a host ring opened as device memory") };
        // SAFETY: 8 KiB mappings, used by this test only.
        unsafe {
            mapped.ptr().write(7);
            assert_eq!(ring.ptr().read(), 7, "the receiver's ring was mapped, not the intruder's");
            assert_eq!(intruder.ptr().read(), 0);
        }
    }

    #[test]
    fn the_ring_goes_only_to_a_kvstage_socket_held_by_the_process_it_names() {
        use std::os::linux::net::SocketAddrExt;
        let ring = memory::SharedRing::create(4096).unwrap();
        let nonce = [3u8; NONCE_BYTES];
        // Not a sender's name: refused before connecting.
        let (local, e) = pass_ring("some-other-service", &nonce, OfferedRing::Memfd(ring.fd()), 4096, None).unwrap_err();
        assert!(!local && e.message().contains("not a kvstage sender's socket name"), "{}", e.chain());
        // A sender's name, but this process (not pid 1) listens on it.
        let name = format!("kvstage-shm-1-{}", fdpass::hex(&fdpass::random_bytes(8).unwrap()));
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let (local, e) = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 4096, None).unwrap_err();
        assert!(local && e.message().contains(&format!("held by process {}, not 1", std::process::id())), "{}", e.chain());
    }

    /// A device pool share this process cannot open (here: the decode pool on another GPU) leaves
    /// the ring usable: the session is same-host, without direct mode.
    #[test]
    fn a_pool_that_cannot_be_opened_leaves_the_ring() {
        use crate::geometry::{KvLayout, ModelKind};
        let shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 3);
        let buffer = 4 * shape.page_bytes() as usize;
        let a = 0x7000_0000usize;
        let pool = KvLayout::new(shape.clone(), 4, MemoryKind::Cuda, (0..6).map(|i| a + i * buffer).collect());
        let export = |s: usize| Ok(DeviceExport { handle: [1; IPC_HANDLE_BYTES], offset: 0, ptr: s as u64 });
        let share = pool::PoolShare::device(&pool, |_| Ok((a, 6 * buffer as u64)), export).unwrap();
        let ring = memory::SharedRing::create(8192).unwrap();
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(NONCE_BYTES).unwrap();
        let _r = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 8192, Some(&share)).unwrap();
        let open = |_: &DeviceExport, _: usize, _: bool| -> Result<Box<dyn PeerDevice>> {
            Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the peer's memory is on device 1, the KV pool on device 0"))
        };
        let direct = Some((&shape, MemoryKind::Cuda));
        let (ring, pool, _lease) = map_offered_ring(&listener, &nonce, 8192, Some(&open), direct, &Deadline::after(Some(LOCAL_IO_TIMEOUT))).unwrap();
        assert!(matches!(ring, PeerRing::Host(_)) && pool.is_none());
    }

    #[test]
    fn a_size_that_differs_from_the_answer_is_refused() {
        let ring = memory::SharedRing::create(8192).unwrap();
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(NONCE_BYTES).unwrap();
        let _r = pass_ring(&name, &nonce, OfferedRing::Memfd(ring.fd()), 8192, None).unwrap();
        let Err(e) = map_offered_ring(&listener, &nonce, 4096, None, None, &Deadline::after(Some(LOCAL_IO_TIMEOUT))) else {
            panic!("a ring of another size was mapped")
        };
        assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
        assert!(e.message().contains("8192"), "{}", e.chain());
    }
}
