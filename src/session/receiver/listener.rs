//! The decode engine's listener: accepts senders within limits (connections, handshakes in
//! progress), survives accept errors (EMFILE, ENOMEM) with backoff, and tracks every connection
//! thread so the engine can shut them down and join them.

use std::net::{TcpListener, TcpStream};
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
    /// Accepted connections alive at once (handshaking or serving); more are refused.
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

#[derive(Default)]
struct Registry {
    conns: Vec<Tracked>,
    handshaking: u32,
}

/// The accept loop and the connections it started.
pub struct Listener {
    registry: Arc<Mutex<Registry>>,
}

impl Listener {
    pub fn new() -> Listener {
        Listener { registry: Arc::new(Mutex::new(Registry::default())) }
    }

    /// Runs the accept loop on the calling thread until `receiver.closing()`.
    pub fn run(&self, listener: TcpListener, receiver: Arc<Receiver>) {
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
            let mut reg = self.registry.lock();
            reg.conns.retain(|t| !t.thread.is_finished());
            let refused = if reg.conns.len() as u32 >= limits.max_connections {
                Some(format!("too many connections (limit {})", limits.max_connections))
            } else if reg.handshaking >= limits.max_handshakes {
                Some(format!("too many handshakes in progress (limit {})", limits.max_handshakes))
            } else {
                None
            };
            if let Some(why) = refused {
                drop(reg);
                let n = receiver.counters.connections_refused.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = receiver.log_limits.refused.allow() {
                    log::warn!("refused a connection from {peer}: {why} ({n} refused so far){suppressed}");
                }
                refuse(&receiver, stream, &why);
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
            reg.handshaking += 1;
            let (r, registry, own_closer) = (receiver.clone(), self.registry.clone(), closer.clone());
            let spawned = std::thread::Builder::new().name("kvstage-recv".to_owned()).spawn(move || {
                let hs_registry = registry.clone();
                r.serve(stream, move || hs_registry.lock().handshaking -= 1);
                own_closer.lock().take();
            });
            match spawned {
                Ok(thread) => reg.conns.push(Tracked { closer, thread }),
                Err(e) => {
                    reg.handshaking -= 1;
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
