//! The receiver's half of the same-host path: answering a sender's `ShmOffer` (the ring's
//! descriptor goes to the sender's local socket) and watching the mapping's lease.
//!
//! A same-host sender can write the whole ring for as long as it maps it, which may outlast its
//! TCP connection (a sender whose connection was cut still finishes a gather in progress). So the
//! state keeps every range such a connection may write quarantined until the lease socket
//! closes: the sender closes it after unmapping, and the kernel closes it when the process dies
//! (after tearing down its address space). Each watch also holds the ring it passed: a memfd's
//! pages outlive any mapping anyway, but a device ring must not be freed (or reused by the CUDA
//! allocator) while a peer still has it open, so a replaced ring's memory goes only when its
//! last lease ends.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::memory::RingMemory;
use super::state::ConnId;
use super::Receiver;
use crate::error::Status;
use crate::geometry::MemoryKind;
use crate::protocol::Message;
use crate::transport::shm;

/// How long an engine being freed waits for same-host peers of a device ring, or peers that map
/// its KV pool (direct mode), to close their leases (their sessions just ended) before it gives
/// up on them.
const DEVICE_LEASE_DRAIN: Duration = Duration::from_secs(2);

/// First and longest pause before a lease watch that panicked starts over (doubling in between).
const PANIC_BACKOFF: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(500));

/// A watched lease.
struct Watch {
    socket: UnixStream,
    thread: JoinHandle<()>,
    /// The engine's shutdown waits for it: the peer maps a device ring or the KV pool.
    drains: bool,
    /// The peer process, when visible in this PID namespace.
    pid: Option<i32>,
}

/// Same-host peers that still map a memory the engine's shutdown waits for.
#[derive(Debug)]
pub struct StillMapped(pub Vec<(ConnId, Option<i32>)>);

impl std::fmt::Display for StillMapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<String> = self
            .0
            .iter()
            .map(|(id, pid)| match pid {
                Some(pid) => format!("process {pid} (connection {id})"),
                None => format!("connection {id} (process not visible here)"),
            })
            .collect();
        write!(f, "{} same-host peer(s) still map this engine's device ring or KV pool: {}", self.0.len(), peers.join(", "))
    }
}

/// Lease sockets of same-host peers and the threads watching them.
#[derive(Default)]
pub struct Leases {
    watched: Mutex<HashMap<ConnId, Watch>>,
    /// The engine is being freed and cut the leases still open: a device ring they hold is
    /// leaked rather than freed under a peer that may still write it.
    abandoned: AtomicBool,
}

impl Leases {
    /// Waits until no peer maps a memory the engine's teardown waits for (a device ring, the KV
    /// pool), or `until`; returns those that still do.
    pub fn wait_unmapped(&self, until: Option<Instant>) -> Result<(), StillMapped> {
        loop {
            let held: Vec<_> = self.watched.lock().iter().filter(|(_, w)| w.drains).map(|(id, w)| (*id, w.pid)).collect();
            if held.is_empty() {
                return Ok(());
            }
            if until.is_some_and(|u| Instant::now() >= u) {
                return Err(StillMapped(held));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Ends every watch (the engine is freed). Host rings: the quarantines end with the engine,
    /// the ring's pages stay alive as long as any peer still maps them. Device rings, and peers
    /// that map the KV pool: the peers' sessions were closed, so their leases are given a moment
    /// to end (a direct copy in progress finishes, then its sender unmaps); a device ring still
    /// held after that is leaked (logged), never freed under a writer, and a pool still mapped
    /// is logged. `kvstage_engine_shutdown` is the caller's way to wait for them and know.
    pub fn close_all(&self) {
        if let Err(held) = self.wait_unmapped(Some(Instant::now() + DEVICE_LEASE_DRAIN)) {
            log::warn!("engine freed while {held}: they may still write it");
        }
        self.abandoned.store(true, Ordering::SeqCst);
        let watched: Vec<_> = self.watched.lock().drain().collect();
        for (_, w) in watched {
            let _ = w.socket.shutdown(std::net::Shutdown::Both);
            let _ = w.thread.join();
        }
    }
}

/// What woke a lease watcher.
enum LeaseEvent {
    /// Bytes, the end of the stream, or an error: read the socket.
    Readable,
    /// A signal interrupted the wait.
    Interrupted,
    /// The peer process ended.
    ProcessEnded,
}

/// How often a watch that waits for the peer process alone looks whether the engine is freed.
const ABANDON_POLL: Duration = Duration::from_millis(200);

/// How the peer process is watched: a pidfd (Linux 5.3+), else (an older kernel, valgrind) its
/// `/proc` entry checked twice a second, the start time telling a reused pid apart.
enum PeerProcess {
    Pidfd(OwnedFd),
    Proc { pid: i32, started: u64 },
    Unknown,
}

impl PeerProcess {
    fn watch(pid: Option<i32>) -> PeerProcess {
        let Some(pid) = pid else { return PeerProcess::Unknown };
        if let Some(fd) = shm::fdpass::pidfd_open(pid) {
            return PeerProcess::Pidfd(fd);
        }
        match process_start(pid) {
            Some(started) => PeerProcess::Proc { pid, started },
            None => PeerProcess::Unknown,
        }
    }

    /// The process ended (a `Proc` watch: gone, a zombie, or its pid reused).
    fn ended(&self) -> bool {
        match self {
            PeerProcess::Proc { pid, started } => process_start(*pid) != Some(*started),
            _ => false,
        }
    }

    /// Waits until the process ended (true) or `stop` is set (false); at once false for a
    /// process that cannot be watched (outside this PID namespace).
    fn wait_end(&self, stop: &AtomicBool) -> bool {
        while !stop.load(Ordering::SeqCst) {
            let fd = match self {
                PeerProcess::Pidfd(fd) => fd.as_raw_fd(),
                PeerProcess::Proc { .. } => -1,
                PeerProcess::Unknown => return false,
            };
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd entry (a negative fd is ignored by poll).
            let r = unsafe { libc::poll(&mut pfd, 1, ABANDON_POLL.as_millis() as i32) };
            if (r > 0 && pfd.revents != 0) || self.ended() {
                return true;
            }
        }
        false
    }
}

/// The start time (field 22 of `/proc/<pid>/stat`) of a live process; `None` when it is gone or
/// a zombie (its address space torn down).
fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields follow its last ')'.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Waits until `lease` is readable or the peer `process` ended.
fn wait_lease(lease: &UnixStream, process: &PeerProcess) -> LeaseEvent {
    let (pidfd, timeout) = match process {
        PeerProcess::Pidfd(fd) => (fd.as_raw_fd(), -1),
        PeerProcess::Proc { .. } => (-1, 500),
        PeerProcess::Unknown => (-1, -1),
    };
    let mut fds = [
        libc::pollfd { fd: lease.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: pidfd, events: libc::POLLIN, revents: 0 },
    ];
    // SAFETY: two valid pollfd entries (a negative fd is ignored by poll).
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
    if r < 0 {
        return match std::io::Error::last_os_error().kind() {
            std::io::ErrorKind::Interrupted => LeaseEvent::Interrupted,
            _ => LeaseEvent::Readable, // the read reports the error
        };
    }
    if fds[1].revents != 0 || (r == 0 && process.ended()) {
        LeaseEvent::ProcessEnded
    } else if r == 0 {
        LeaseEvent::Interrupted // a timeout with the process alive: wait again
    } else {
        LeaseEvent::Readable
    }
}

impl Receiver {
    /// Answers a same-host offer of connection `id`; `direct`: the sender asks for the KV pool
    /// too (direct mode) if it lies in this memory, passed when this engine allows it and the pool
    /// is shareable.
    pub(super) fn serve_same_host(self: &Arc<Self>, id: ConnId, socket: &str, nonce: &[u8], direct: Option<MemoryKind>, session: &str, peer: &str) -> Message {
        let shm = self.shm.lock().clone();
        let answer = |status: Status, local: bool, ring_len: u64, reason: String| Message::ShmAnswer { status: status.code(), local, ring_len, reason };
        let memory = self.memory.lock().clone();
        let offer = if let Some(why) = shm.as_ref().map_or(Some("it serves no same-host sessions".to_owned()), |s| s.refusal()) {
            Err((Status::KVSTAGE_E_UNSUPPORTED, format!("the receiver does not serve the same-host path: {why}")))
        } else if self.with_state(|st| st.writes_in_place(id)) {
            Err((Status::KVSTAGE_E_PROTOCOL, "a second same-host offer on one session".to_owned()))
        } else if self.leases.watched.lock().len() as u32 >= self.config.listener.max_connections {
            // A lease (a thread and a descriptor here) outlives its connection until the peer
            // unmaps: bounded like the connections themselves.
            self.counters.connections_refused.fetch_add(1, Ordering::Relaxed);
            let held = self.config.listener.max_connections;
            Err((Status::KVSTAGE_E_TRANSPORT, format!("{held} same-host leases are held already (max_connections)")))
        } else {
            match memory.as_ref() {
                None => Err((Status::KVSTAGE_E_STAGING_TOO_SMALL, "the receiver has no staging ring registered".to_owned())),
                Some(m) => m.offer().map(|o| (o, m.size() as u64)).map_err(|e| (e.code(), e.chain())),
            }
        };
        let passed = match offer {
            Err((code, why)) => {
                // Still reached for, so that the sender learns whether it is on this host (a
                // refusal then counts as a downgrade there, another host does not); only a kvstage
                // sender's socket held by the process it names, never any name a peer gives.
                let local = shm::reach_sender(socket).is_ok();
                log::debug!(session = session; "same-host offer of {peer} refused: {why}");
                return answer(code, local, 0, why);
            }
            Ok((ring, ring_len)) => {
                let share = self.pool_share(direct, shm.as_deref(), session);
                shm::pass_ring(socket, nonce, ring, ring_len, share.as_ref()).map(|lease| (lease, ring_len, share.is_some()))
            }
        };
        let (lease, ring_len, direct) = match passed {
            Ok(p) => p,
            Err((local, e)) => {
                log::debug!(session = session; "same-host offer of {peer} not served: {}", e.chain());
                return answer(e.code(), local, 0, e.chain());
            }
        };
        // From here on the peer may write the ring: quarantine applies before its first grant. Under
        // the memory lock, so that a ring registered meanwhile is seen (this lease is then for the
        // old one: refused, the sender never maps it) and a later one closes this session.
        let current = self.memory.lock();
        if !super::memory::still_current(memory.as_ref(), current.as_ref()) {
            return answer(Status::KVSTAGE_E_PEER_GONE, true, 0, "the staging ring was registered again during the exchange; reconnect".to_owned());
        }
        self.with_state(|st| {
            st.set_in_place(id, true);
            if direct {
                st.set_direct(id);
            }
        });
        drop(current);
        let ring = memory.clone().expect("a ring was passed");
        if let Err(e) = self.watch_lease(id, lease, ring, direct) {
            // Without a watch the quarantine would never end: refuse (the lease closes, the sender
            // sees the socket end and unmaps).
            self.with_state(|st| st.unmapped(id));
            return answer(e.code(), true, 0, e.chain());
        }
        if let Some(s) = &shm {
            s.count_session();
            if direct {
                s.count_direct_session();
            }
        }
        let ring = memory.as_ref().map_or_else(String::new, |m| m.describe());
        let pool = if direct { ", and the KV pool directly" } else { "" };
        log::info!(session = session; "session from {peer} writes in place through the same-host path ({ring_len}-byte ring, {ring}){pool}");
        answer(Status::KVSTAGE_OK, true, ring_len, String::new())
    }

    /// The KV pool's share for a sender that asked for direct mode from a pool in `wanted` memory,
    /// when this engine allows it and its pool is in that memory and shareable (host: shared
    /// allocations; CUDA: allocations that hold nothing but the pool); `None` otherwise (the ring
    /// path).
    fn pool_share(&self, wanted: Option<MemoryKind>, shm: Option<&shm::Shm>, session: &str) -> Option<shm::pool::PoolShare> {
        let wanted = wanted.filter(|_| shm.is_some_and(shm::Shm::direct))?;
        let share = self.pool().map_err(|e| e.chain()).and_then(|pool| match (wanted, pool.memory) {
            (MemoryKind::Host, MemoryKind::Host) => shm::pool::PoolShare::of(&pool),
            (MemoryKind::Cuda, MemoryKind::Cuda) => crate::session::device_ring::pool_share(&pool),
            (theirs, ours) => Err(format!("the sender's pool is {theirs:?} memory, this one's {ours:?}")),
        });
        share.inspect_err(|why| log::debug!(session = session; "direct mode not offered: {why}")).ok()
    }

    /// Watches `lease` until the peer closes it (unmapped, or its process ended), holding `ring`
    /// (the ring it was passed) until then; `direct`: the peer maps the KV pool too. A lease of a
    /// device ring or of the pool that closes without [`shm::LEASE_UNMAPPED`] ends with the
    /// peer process only (see [`shm`]).
    fn watch_lease(self: &Arc<Self>, id: ConnId, lease: UnixStream, ring: Arc<RingMemory>, direct: bool) -> crate::Result<()> {
        let watched = lease.try_clone()?;
        let device = ring.device().is_some();
        // The peer process (SO_PEERCRED: 0 when it is outside this PID namespace; then the
        // lease's end is all there is to go by) is watched too.
        let peer_pid = shm::fdpass::peer_pid(&lease).ok().filter(|&pid| pid > 0);
        let process = PeerProcess::watch(peer_pid);
        let peer_died = AtomicBool::new(false);
        let said_unmapped = AtomicBool::new(false);
        let drains = device || direct;
        let me = self.clone();
        // Locked before the thread starts, so its removal comes after this insertion.
        let mut leases = self.leases.watched.lock();
        let handle = std::thread::Builder::new()
            .name(format!("kvstage-lease-{id}"))
            .spawn(move || {
                // The peer sends one byte, LEASE_UNMAPPED, before a clean close (any other is
                // ignored). The end of the stream (or a dead socket) is the signal, or the end of
                // the peer process itself: a sender that forked without exec left the lease (and
                // its session's socket) open in the child, which never writes the ring (kvstage's
                // threads do not survive a fork). A read interrupted by a signal (handlers
                // installed without SA_RESTART, as CPython's are) must not end the quarantine, nor
                // may a panic (the watch starts over: ending it early would free ranges the peer
                // may still write).
                let watch = || {
                    let mut buf = [0u8; 64];
                    loop {
                        crate::panics::point("lease watcher");
                        match wait_lease(&lease, &process) {
                            LeaseEvent::Readable => match (&lease).read(&mut buf) {
                                Ok(n) if n > 0 => {
                                    if buf[..n].contains(&shm::LEASE_UNMAPPED) {
                                        said_unmapped.store(true, Ordering::SeqCst);
                                    }
                                }
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                // The end, or a reset (closed with our greeting unread).
                                _ if drains && !said_unmapped.load(Ordering::SeqCst) => {
                                    // Closed without saying it unmapped, as by a dying process
                                    // whose device context may outlive its files: the end of
                                    // the process ends it (where it can be watched).
                                    if process.wait_end(&me.leases.abandoned) {
                                        peer_died.store(true, Ordering::SeqCst);
                                    }
                                    break;
                                }
                                _ => break,
                            },
                            LeaseEvent::Interrupted => {}
                            LeaseEvent::ProcessEnded => {
                                peer_died.store(true, Ordering::SeqCst);
                                break;
                            }
                        }
                    }
                };
                let mut backoff = PANIC_BACKOFF.0;
                while !crate::panics::contain("a lease watcher thread", Some(&me.counters.panics), watch) {
                    // A watch that panics again at once must not spin a core.
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(PANIC_BACKOFF.1);
                }
                if peer_died.load(Ordering::SeqCst) {
                    // Its session ends too (a forked child may hold the connection open): the
                    // rooms it still owed fail now.
                    log::info!("same-host peer process {} of connection {id} ended: its lease and session end", peer_pid.unwrap_or(0));
                    if let Some(link) = me.peers.lock().get(&id).map(|p| &p.link) {
                        link.shutdown();
                    }
                }
                me.with_state(|st| st.unmapped(id));
                me.leases.watched.lock().remove(&id);
                if device && me.leases.abandoned.load(Ordering::SeqCst) {
                    log::warn!(
                        "engine freed while a same-host peer (connection {id}) may still write its {}: the ring is leaked, not freed under it",
                        ring.describe()
                    );
                    std::mem::forget(ring);
                }
            })
            .map_err(|e| crate::Error::internal("cannot start a lease watcher thread").with_source(e))?;
        // `close_all` may have run between this connection's offer and here (the engine freed).
        if self.leases.abandoned.load(Ordering::SeqCst) {
            let _ = watched.shutdown(std::net::Shutdown::Both);
        }
        leases.insert(id, Watch { socket: watched, thread: handle, drains, pid: peer_pid });
        Ok(())
    }
}
