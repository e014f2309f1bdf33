//! The decode engine's listener: accepts senders within limits (handshakes in progress: when
//! those are all taken, the oldest handshake of the source holding the most is cut to serve a
//! newcomer; sessions: see [`super::sessions`]), survives accept errors (EMFILE, ENOMEM) with backoff, and tracks every
//! connection thread so the engine can shut them down and join them.

use std::collections::HashMap;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::{conn, Receiver};
use crate::deadline::Deadline;
use crate::error::Status;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;

/// Bounds on what unauthenticated peers can make the listener hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sessions open at once: past it, a newcomer whose handshake passed has the oldest idle
    /// session of the biggest source cut for it, or is refused when none is idle. Connections
    /// alive at once (handshaking or serving) are bounded by this plus `max_handshakes`.
    pub max_connections: u32,
    /// Connections still in their handshake at once; more are refused.
    pub max_handshakes: u32,
    /// The whole handshake (hello in, answer out) must end within this.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_connections: 1024, max_handshakes: 64, handshake_timeout: Duration::from_secs(5) }
    }
}

/// First and longest pause after a failed `accept` (doubling in between).
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(5), Duration::from_secs(1));

/// A connection's thread and a handle to cut its socket (taken by the thread when it ends, so
/// the descriptor goes with it).
struct Tracked {
    closer: Arc<Mutex<Option<TcpStream>>>,
    thread: JoinHandle<()>,
}

/// A connection still in its handshake: where from, and its socket (to cut it).
struct Handshake {
    id: u64,
    source: IpAddr,
    closer: Arc<Mutex<Option<TcpStream>>>,
}

#[derive(Default)]
struct Registry {
    conns: Vec<Tracked>,
    /// Connections in their handshake, oldest first.
    handshaking: Vec<Handshake>,
    /// Handshakes cut to make room whose threads have not ended yet (bounded like the others).
    evicted: u32,
    next_id: u64,
}

impl Registry {
    /// Makes room for one more handshake when `max` are in progress: cuts the oldest handshake of
    /// the source holding the most (one source's idle or half-open connections never lock out
    /// the others, and a peer's fresh handshake outlives a flood's older ones). `None` when
    /// nothing may be cut: `max` cut handshakes are still ending.
    fn evict_for(&mut self, max: u32) -> Option<(IpAddr, usize)> {
        if self.evicted >= max {
            return None;
        }
        let mut by_source: HashMap<IpAddr, usize> = HashMap::new();
        for h in &self.handshaking {
            *by_source.entry(h.source).or_default() += 1;
        }
        // The biggest source; ties go to the one whose oldest handshake is oldest.
        let (source, held) = self
            .handshaking
            .iter()
            .map(|h| (h.source, by_source[&h.source]))
            .fold(None, |best: Option<(IpAddr, usize)>, c| match best {
                Some(b) if b.1 >= c.1 => Some(b),
                _ => Some(c),
            })?;
        let at = self.handshaking.iter().position(|h| h.source == source)?;
        let victim = self.handshaking.remove(at);
        self.evicted += 1;
        if let Some(s) = victim.closer.lock().as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        Some((source, held))
    }

    /// A handshake ended (answered, failed, or cut).
    fn handshake_ended(&mut self, id: u64) {
        match self.handshaking.iter().position(|h| h.id == id) {
            Some(at) => {
                self.handshaking.remove(at);
            }
            None => self.evicted = self.evicted.saturating_sub(1),
        }
    }
}

/// The accept loop and the connections it started.
pub struct Listener {
    registry: Arc<Mutex<Registry>>,
}

impl Listener {
    pub fn new() -> Listener {
        Listener { registry: Arc::new(Mutex::new(Registry::default())) }
    }

    /// Runs the accept loop on the calling thread until `receiver.closing()`; a pass that panics
    /// is counted and the loop goes on (new sessions must not stop being served).
    pub fn run(&self, listener: TcpListener, receiver: Arc<Receiver>) {
        while !receiver.closing() {
            if !crate::panics::contain("the accept thread", Some(&receiver.counters.panics), || self.accept_loop(&listener, &receiver)) {
                std::thread::sleep(ACCEPT_BACKOFF.0);
            }
        }
    }

    fn accept_loop(&self, listener: &TcpListener, receiver: &Arc<Receiver>) {
        let limits = receiver.config().listener;
        let mut backoff = ACCEPT_BACKOFF.0;
        while !receiver.closing() {
            let (stream, peer) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(_) if receiver.closing() => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE, ENFILE, ENOMEM, ECONNABORTED …: counted, and tried again later.
                    let n = receiver.counters.accept_errors.fetch_add(1, Ordering::Relaxed) + 1;
                    if let Some(suppressed) = receiver.log_limits.accept_errors.allow() {
                        log::warn!("accept failed: {e} (retrying in {backoff:?}; {n} accept errors so far){suppressed}");
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
                    continue;
                }
            };
            backoff = ACCEPT_BACKOFF.0;
            crate::panics::point("accept");
            let mut reg = self.registry.lock();
            reg.conns.retain(|t| !t.thread.is_finished());
            let mut refused = None;
            // Sessions are bounded at their handshake's end (where an idle one may be cut for an
            // authenticated newcomer); connections, handshakes included, by both bounds together.
            // Sessions cut for earlier newcomers are ending: they no longer count.
            let cap = limits.max_connections as usize + limits.max_handshakes as usize;
            if reg.conns.len().saturating_sub(receiver.sessions_ending()) >= cap {
                refused = Some(format!("too many connections (limit {} sessions + {} handshakes)", limits.max_connections, limits.max_handshakes));
            }
            if refused.is_none() && reg.handshaking.len() as u32 >= limits.max_handshakes {
                match reg.evict_for(limits.max_handshakes) {
                    Some((source, held)) => {
                        let n = receiver.counters.connections_refused.fetch_add(1, Ordering::Relaxed) + 1;
                        if let Some(suppressed) = receiver.log_limits.refused.allow() {
                            log::warn!(
                                "{} handshakes in progress (the limit): cut the oldest of the {held} from {source} to serve {peer} ({n} refused or cut so far){suppressed}",
                                limits.max_handshakes
                            );
                        }
                    }
                    None => refused = Some(format!("too many handshakes in progress (limit {})", limits.max_handshakes)),
                }
            }
            if let Some(why) = refused {
                drop(reg);
                let n = receiver.counters.connections_refused.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = receiver.log_limits.refused.allow() {
                    log::warn!("refused a connection from {peer}: {why} ({n} refused so far){suppressed}");
                }
                refuse(receiver, stream, &why);
                continue;
            }
            let closer = match stream.try_clone() {
                Ok(closer) => closer,
                Err(e) => {
                    // No descriptor for the closer (EMFILE): refused like a failed accept.
                    drop(reg);
                    receiver.counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(suppressed) = receiver.log_limits.accept_errors.allow() {
                        log::warn!("dropped the connection from {peer}: cannot duplicate its socket: {e}{suppressed}");
                    }
                    continue;
                }
            };
            let closer = Arc::new(Mutex::new(Some(closer)));
            let id = reg.next_id;
            reg.next_id += 1;
            reg.handshaking.push(Handshake { id, source: peer.ip(), closer: closer.clone() });
            let (r, registry, own_closer) = (receiver.clone(), self.registry.clone(), closer.clone());
            let spawned = std::thread::Builder::new().name("kvstage-recv".to_owned()).spawn(move || {
                let hs_registry = registry.clone();
                r.serve(stream, move || hs_registry.lock().handshake_ended(id));
                own_closer.lock().take();
            });
            match spawned {
                Ok(thread) => reg.conns.push(Tracked { closer, thread }),
                Err(e) => {
                    reg.handshake_ended(id);
                    drop(reg);
                    receiver.counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(suppressed) = receiver.log_limits.accept_errors.allow() {
                        log::warn!("dropped the connection from {peer}: cannot start its thread: {e}{suppressed}");
                    }
                }
            }
        }
    }

    /// Shuts every connection's socket down and joins its thread.
    pub fn close_all(&self) {
        let conns = std::mem::take(&mut self.registry.lock().conns);
        for t in &conns {
            if let Some(s) = t.closer.lock().as_ref() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        for t in conns {
            let _ = t.thread.join();
        }
    }

    /// Connection threads not yet finished.
    pub fn live(&self) -> usize {
        self.registry.lock().conns.iter().filter(|t| !t.thread.is_finished()).count()
    }
}

impl Default for Listener {
    fn default() -> Self {
        Listener::new()
    }
}

/// Answers a refused connection with the reason (best effort, never blocking the accept loop
/// for long) and closes it.
fn refuse(receiver: &Receiver, stream: TcpStream, why: &str) {
    if let Ok(link) = TcpTransport::new(stream) {
        let _ = link.send(&conn::refusal(receiver, "", Status::KVSTAGE_E_TRANSPORT, why), &Deadline::after(Some(Duration::from_millis(50))));
        link.shutdown();
    }
}
