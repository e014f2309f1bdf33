//! The top-level object: options, registrations, worker threads, stats, logging ([`logging`]).

pub mod describe;
pub mod logging;
pub mod stats;
mod stderr;

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::copy::{AnyCopyEngine, Component, Components, CopyEngine};
use crate::error::{Error, Result};
use crate::geometry::{ComponentKind, ComponentSpec, KvLayout, MemoryKind};
use crate::transport::faults::Faults;
use crate::transport::rdma::{Rdma, RdmaMode, RdmaOptions};
use crate::transport::shm::{Shm, ShmMode};
use crate::session::receiver::listener::{Limits, Listener};
use crate::session::receiver::{Receiver, ReceiverConfig, RingMemory, RingSpec, ScatterJob, StillMapped};
use crate::session::notify::Completions;
use crate::session::sender::{SendResources, SenderConfig, SenderSession};
pub use crate::session::sender::StallWarn;
use crate::session::staging::StagingPool;
use crate::session::workers::Workers;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    Auto,
    Tcp,
    Rdma,
    /// The same-host path or an error at connect.
    Shm,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub transport: TransportKind,
    pub listen_address: String,
    pub worker_threads: u32,
    /// `None` = infinite (only when asked for explicitly).
    pub default_deadline: Option<Duration>,
    /// Receiver chunk grid when a room does not name one.
    pub chunk_tokens: u32,
    /// Largest send staging buffer (one writer's share of a chunk); larger chunks fall back.
    pub send_staging_bytes: u64,
    /// Send staging buffers at most (chunks gathering or writing at once, all sessions).
    pub send_staging_buffers: u32,
    /// Bytes all send staging buffers may hold together.
    pub send_staging_total_bytes: u64,
    /// A whole chunk goes out in pieces of about this many bytes (whole slabs): from host
    /// staging each written while the next is gathered, when it makes two pieces or more; from
    /// the pool over TCP with the session's stream free between them. `0`: one write (after the
    /// whole gather).
    pub send_piece_bytes: u64,
    /// Over TCP, a whole chunk of a host pool is written straight from the pool's rows (vectored
    /// writes: the kernel's copy into the socket is the only one); `false`: gathered into a
    /// staging buffer first.
    pub send_from_pool: bool,
    /// Threads running asynchronous transfers (a session uses at most half of them at once).
    pub transfer_threads: u32,
    /// Shared secret both sides must present in the handshake (`None`: no authentication).
    pub cluster_token: Option<String>,
    /// Per-chunk checksums (computed after gather, verified on arrival before the scatter).
    pub integrity: Integrity,
    /// Test only: inject faults into this engine's connections.
    pub faults: Option<Faults>,
    /// RDMA devices, QPs and work-request sizes (transport auto or rdma).
    pub rdma: RdmaOptions,
    /// Transport auto: use the same-host path when the peer is on this host (`false`: never).
    pub same_host: bool,
    /// Same-host sessions: direct mode where both sides allow it (the decode pool in memory of
    /// `kvstage_shared_alloc`, both pools host memory): chunks are copied from prefill page to
    /// decode page in one pass, without the ring and the scatter. `false`: never (the ring path).
    pub same_host_direct: bool,
    /// Listener bounds: connections, handshakes in progress, handshake deadline.
    pub listener: Limits,
    /// A peer that stops answering is declared gone after about this long (keepalive and
    /// `TCP_USER_TIMEOUT`); `None`: the OS defaults (hours).
    pub dead_peer_timeout: Option<Duration>,
    /// Decode rooms not complete this long after they opened fail with `TIMEOUT`; `None`: never.
    pub room_timeout: Option<Duration>,
    /// Chunk events kept for polling; more are dropped and counted.
    pub max_events: u32,
    /// When a transfer waiting without progress (grant, watermark, acknowledgement, layers) is
    /// reported: one WARN line per wait naming the request and what it waits on.
    pub stall_warn: StallWarn,
}

pub use crate::session::{Integrity, INTEGRITY_SAMPLE_PERIOD};

pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
pub const DEFAULT_CHUNK_TOKENS: u32 = 8192;
pub const DEFAULT_SEND_STAGING_BYTES: u64 = 1 << 30;
pub const DEFAULT_SEND_STAGING_BUFFERS: u32 = 4;
pub const DEFAULT_SEND_STAGING_TOTAL_BYTES: u64 = 4 << 30;
/// Large enough that a piece's frame and wakeup cost nothing next to its copy, small enough that
/// the first piece's gather (the part not hidden behind the wire) is short.
pub const DEFAULT_SEND_PIECE_BYTES: u64 = 4 << 20;
pub const DEFAULT_TRANSFER_THREADS: u32 = 4;
pub const DEFAULT_DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_ROOM_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_MAX_EVENTS: u32 = 65536;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            transport: TransportKind::Auto,
            listen_address: "127.0.0.1:0".to_owned(),
            worker_threads: 2,
            default_deadline: Some(DEFAULT_DEADLINE),
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
            send_staging_bytes: DEFAULT_SEND_STAGING_BYTES,
            send_staging_buffers: DEFAULT_SEND_STAGING_BUFFERS,
            send_staging_total_bytes: DEFAULT_SEND_STAGING_TOTAL_BYTES,
            send_piece_bytes: DEFAULT_SEND_PIECE_BYTES,
            send_from_pool: true,
            transfer_threads: DEFAULT_TRANSFER_THREADS,
            cluster_token: None,
            integrity: Integrity::Sampled,
            faults: None,
            rdma: RdmaOptions::default(),
            same_host: true,
            same_host_direct: true,
            listener: Limits::default(),
            dead_peer_timeout: Some(DEFAULT_DEAD_PEER_TIMEOUT),
            room_timeout: Some(DEFAULT_ROOM_TIMEOUT),
            max_events: DEFAULT_MAX_EVENTS,
            stall_warn: StallWarn::default(),
        }
    }
}

impl EngineOptions {
    pub fn default_deadline_ms(&self) -> u64 {
        self.default_deadline.map_or(u64::MAX, |d| d.as_millis() as u64)
    }

    pub fn set_default_deadline_ms(&mut self, ms: u64) {
        self.default_deadline = if ms == u64::MAX { None } else { Some(Duration::from_millis(ms)) };
    }

    /// Checks every field; the error names the field and the bad value.
    pub fn validate(&self) -> Result<SocketAddr> {
        if self.worker_threads == 0 || self.worker_threads > 256 {
            return Err(Error::invalid_arg(
                "options->worker_threads",
                format!("{} is outside 1..=256", self.worker_threads),
            ));
        }
        if self.default_deadline == Some(Duration::ZERO) {
            return Err(Error::invalid_arg(
                "options->default_timeout_ms",
                "0 would fail every operation at once (use KVSTAGE_TIMEOUT_INFINITE for no limit)",
            ));
        }
        if self.chunk_tokens == 0 {
            return Err(Error::invalid_arg("options->chunk_tokens", "0 (a chunk needs at least one page of tokens)"));
        }
        if self.send_staging_bytes == 0 {
            return Err(Error::invalid_arg("options->send_staging_bytes", "0 (every staged transfer would fall back)"));
        }
        let positive = |name: &str, v: u32| {
            if v == 0 {
                Err(Error::invalid_arg(name, "0 (must be at least 1)"))
            } else {
                Ok(())
            }
        };
        positive("options->max_connections", self.listener.max_connections)?;
        positive("options->send_staging_buffers", self.send_staging_buffers)?;
        if self.transfer_threads == 0 || self.transfer_threads > 256 {
            return Err(Error::invalid_arg("options->transfer_threads", format!("{} is outside 1..=256", self.transfer_threads)));
        }
        if self.send_staging_total_bytes < self.send_staging_bytes {
            return Err(Error::invalid_arg(
                "options->send_staging_total_bytes",
                format!("{} is below send_staging_bytes {} (one chunk share must fit)", self.send_staging_total_bytes, self.send_staging_bytes),
            ));
        }
        positive("options->max_handshakes", self.listener.max_handshakes)?;
        positive("options->max_events", self.max_events)?;
        if self.listener.handshake_timeout.is_zero() {
            return Err(Error::invalid_arg("options->handshake_timeout_ms", "0 would refuse every sender"));
        }
        if self.dead_peer_timeout.is_some_and(|t| t < Duration::from_secs(1)) {
            return Err(Error::invalid_arg(
                "options->dead_peer_timeout_ms",
                "below 1000 (keepalive works in whole seconds; KVSTAGE_DEADLINE_INFINITE for the OS defaults)",
            ));
        }
        if self.room_timeout == Some(Duration::ZERO) {
            return Err(Error::invalid_arg("options->room_timeout_ms", "0 would fail every room at once"));
        }
        self.rdma.validate()?;
        if self.transport == TransportKind::Shm && !self.same_host {
            return Err(Error::invalid_arg("options->same_host", "is OFF while the transport is SHM (which requires it)"));
        }
        self.listen_address.parse::<SocketAddr>().map_err(|e| {
            Error::invalid_arg(
                "options->listen_address",
                format!("\"{}\" is not HOST:PORT with a numeric IP ({e})", self.listen_address),
            )
        })
    }
}

/// What this host can use, detected at run time (never by linking).
#[derive(Clone, Copy, Debug, Default)]
pub struct Capabilities {
    pub rdma: bool,
    pub cuda: bool,
}

impl Capabilities {
    pub fn detect() -> Capabilities {
        Capabilities { rdma: crate::dynlib::rdma_device_count() > 0, cuda: crate::dynlib::cuda_device_count() > 0 }
    }
}

pub struct Engine {
    options: EngineOptions,
    local_addr: SocketAddr,
    pool: Arc<Mutex<Option<Arc<KvLayout>>>>,
    /// The pool's shared allocations, which `kvstage_shared_free` refuses while the engine lives.
    pool_pin: Mutex<Option<crate::transport::shm::pool::PoolPin>>,
    components: Arc<Mutex<Option<Arc<Components>>>>,
    send: Arc<SendResources>,
    receiver: Arc<Receiver>,
    listener: TcpListener,
    /// Accept, scatter and keeper threads, joined by the first of shutdown and free.
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// `stop` began (shutdown or free): the engine serves and sends nothing more.
    stopped: AtomicBool,
    /// Held for the whole of `stop`: a second caller returns only once the first one is done.
    stopping: Mutex<()>,
    conns: Arc<Listener>,
    /// Sessions this engine opened, ended when it is freed (their operations fail at once).
    sessions: Mutex<Vec<std::sync::Weak<SenderSession>>>,
    rdma: Arc<Rdma>,
    shm: Arc<Shm>,
}

impl Engine {
    pub fn new(options: EngineOptions) -> Result<Engine> {
        logging::init();
        let listen = options.validate()?;
        // RDMA devices: transport rdma without a usable one fails here (KVSTAGE_E_NO_DEVICE, the
        // causes down to the OS error of the device list); auto without one runs on TCP.
        let rdma_mode = match options.transport {
            TransportKind::Tcp | TransportKind::Shm => RdmaMode::Off,
            TransportKind::Auto => RdmaMode::Auto,
            TransportKind::Rdma => RdmaMode::Required,
        };
        let shm_mode = match options.transport {
            TransportKind::Auto if options.same_host => ShmMode::Auto,
            TransportKind::Shm => ShmMode::Required,
            _ => ShmMode::Off,
        };
        let shm = Shm::new(shm_mode, options.same_host_direct);
        let rdma = Rdma::open(rdma_mode, options.rdma.clone())?;
        if rdma_mode == RdmaMode::Auto && !rdma.active() {
            log::info!("transport auto: no usable RDMA device, sessions will use tcp ({})", rdma.unavailable_reason());
        }
        let backlog = options.listener.max_connections.clamp(128, 4096) as i32;
        let listener = crate::transport::tcp::listen(listen, backlog)?;
        let local_addr = listener.local_addr()?;
        // Host pools: memcpy threads; CUDA pools: the CUDA engine of the pool's device (see copy::any).
        let copy: Arc<dyn CopyEngine> = Arc::new(AnyCopyEngine::new(options.worker_threads));
        let pool = Arc::new(Mutex::new(None));
        let components = Arc::new(Mutex::new(None));
        let completions = Arc::new(Completions::new()?);
        let send = Arc::new(SendResources {
            pool: pool.clone(),
            components: components.clone(),
            copy: copy.clone(),
            staging: StagingPool::new(options.send_staging_buffers as usize, options.send_staging_total_bytes),
            workers: Workers::new(options.transfer_threads as usize, (options.transfer_threads as usize).div_ceil(2))?,
            completions: completions.clone(),
            options: SenderConfig {
                send_staging_bytes: options.send_staging_bytes,
                send_piece_bytes: options.send_piece_bytes,
                send_from_pool: options.send_from_pool,
                cluster_token: options.cluster_token.clone().unwrap_or_default().into_bytes(),
                integrity: options.integrity,
                default_deadline: options.default_deadline,
                dead_peer_timeout: options.dead_peer_timeout,
                faults: options.faults.clone(),
                stall_warn: options.stall_warn,
            },
            rdma: rdma.clone(),
            shm: shm.clone(),
            counters: Default::default(),
        });
        let config = ReceiverConfig {
            chunk_tokens: options.chunk_tokens,
            cluster_token: options.cluster_token.clone().unwrap_or_default().into_bytes(),
            integrity: options.integrity,
            room_timeout: options.room_timeout,
            max_events: options.max_events as usize,
            listener: options.listener,
            dead_peer_timeout: options.dead_peer_timeout,
            faults: options.faults.clone(),
            stall_after: match options.stall_warn {
                StallWarn::QuarterOfDeadline => Some(options.room_timeout.map_or(Duration::from_secs(10), |t| t / 4)),
                StallWarn::After(d) => Some(d),
                StallWarn::Never => None,
            },
        };
        let receiver = Arc::new(Receiver::new(pool.clone(), components.clone(), copy, config, completions.clone()));
        receiver.set_rdma(rdma.clone());
        receiver.set_shm(shm.clone());
        let (tx, rx) = crossbeam_channel::unbounded::<ScatterJob>();
        receiver.set_scatter_queue(tx);
        let scatter_receiver = receiver.clone();
        let scatter_thread = spawn("kvstage-scatter", move || {
            for job in rx {
                scatter_receiver.run_scatter(job);
            }
        })?;
        let keeper_receiver = receiver.clone();
        let keeper_thread = spawn("kvstage-keeper", move || keeper_receiver.run_keeper())?;
        let conns = Arc::new(Listener::new());
        let accept_listener = listener.try_clone()?;
        let (accept_receiver, accept_conns) = (receiver.clone(), conns.clone());
        let accept_thread = spawn("kvstage-accept", move || accept_conns.run(accept_listener, accept_receiver))?;
        log::info!("engine listening on {local_addr}, transport {}", describe_transport(&options, &rdma));
        Ok(Engine {
            pool_pin: Mutex::new(None),
            options,
            local_addr,
            pool,
            components,
            send,
            receiver,
            listener,
            // In the order they are joined: accepts end before the connections are joined, the
            // scatter queue closes after them.
            threads: Mutex::new(vec![accept_thread, keeper_thread, scatter_thread]),
            stopped: AtomicBool::new(false),
            stopping: Mutex::new(()),
            conns,
            sessions: Mutex::new(Vec::new()),
            rdma,
            shm,
        })
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// The engine's RDMA side (devices, counters; inactive for transport tcp or without a device).
    pub fn rdma(&self) -> &Arc<Rdma> {
        &self.rdma
    }

    /// The engine's same-host side (mode, counters).
    pub fn shm(&self) -> &Arc<Shm> {
        &self.shm
    }

    /// The address the engine listens on (the chosen port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn register_pool(&self, layout: KvLayout) -> Result<()> {
        layout.validate()?;
        let mut pool = self.pool.lock();
        // Under the pool's lock, which a successful shutdown takes to lift the pin.
        self.check_running()?;
        if pool.is_some() {
            return Err(Error::invalid_arg("layout", "a KV pool is already registered on this engine"));
        }
        self.receiver.check_pool_fits_ring(&layout)?;
        *self.pool_pin.lock() = Some(crate::transport::shm::pool::PoolPin::new(&layout));
        *pool = Some(Arc::new(layout));
        Ok(())
    }

    /// Registers the rank's components (aux buffers, state, extra paged pools: the parts of a
    /// request besides its KV), once, after the KV pool: each item's size on this rank follows
    /// from the pool's TP size and heads. Sessions carry the components registered when they
    /// connected (register before connecting or accepting sessions).
    pub fn register_components(&self, list: Vec<(ComponentSpec, u64, Vec<usize>)>) -> Result<()> {
        let pool = self.pool.lock().clone().ok_or_else(|| Error::invalid_arg("engine", "register the KV pool (kvstage_engine_register_pool) before the components"))?;
        let mut registered = self.components.lock();
        if registered.is_some() {
            return Err(Error::invalid_arg("components", "components are already registered on this engine"));
        }
        let shape = &pool.shape;
        let mut out = Vec::with_capacity(list.len());
        for (i, (spec, items, bases)) in list.into_iter().enumerate() {
            if let ComponentKind::State { item } = &spec.kind {
                item.validate(shape.tp_size, 1).map_err(|e| e.context(format!("components[{i}] ({}) on this rank of TP {}", spec.name, shape.tp_size)))?;
            }
            let item_bytes = spec.item_bytes(shape.tp_size, shape.local_heads);
            out.push(Component::new(spec, items, item_bytes, bases));
        }
        *registered = Some(Arc::new(Components::new(out)?));
        Ok(())
    }

    /// Registers a host ring: `bytes` at `ptr`, or engine-owned (shareable) memory for `None`.
    pub fn register_staging(&self, ptr: Option<*mut u8>, bytes: usize) -> Result<()> {
        self.register_staging_memory(RingSpec { memory: MemoryKind::Host, cuda_device: None, ptr, bytes })
    }

    /// Registers a ring of any memory kind (a device ring needs a CUDA pool on its device).
    pub fn register_staging_memory(&self, spec: RingSpec) -> Result<()> {
        self.check_running()?;
        if spec.bytes == 0 {
            return Err(Error::invalid_arg("staging->bytes", "0 (a staging ring needs space)"));
        }
        self.receiver.register_ring(RingMemory::new(spec)?)?;
        log::info!("staging ring registered: {}", self.receiver.ring_describe());
        Ok(())
    }

    /// Finished operations and decode room events are signalled here (eventfd, callback).
    pub fn completions(&self) -> &Arc<Completions> {
        &self.send.completions
    }

    pub fn receiver(&self) -> &Receiver {
        &self.receiver
    }

    pub fn connect(&self, addr: &str, session: &str, timeout: Option<Duration>) -> Result<Arc<SenderSession>> {
        self.check_running()?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| Error::invalid_arg("peer_address", format!("\"{addr}\" is not HOST:PORT ({e})")))?;
        if session.is_empty() {
            return Err(Error::invalid_arg("session_id", "is empty"));
        }
        let timeout = timeout.or(self.options.default_deadline).unwrap_or(DEFAULT_DEADLINE);
        let s = SenderSession::connect(self.send.clone(), addr, session, timeout)?;
        let mut sessions = self.sessions.lock();
        sessions.retain(|w| w.strong_count() > 0);
        if self.stopped.load(Ordering::SeqCst) {
            // Shut down during the connect: `stop` has drained the list already.
            s.close("the engine was shut down");
            return Err(crate::session::receiver::shut_down_error());
        }
        sessions.push(Arc::downgrade(&s));
        Ok(s)
    }

    fn check_running(&self) -> Result<()> {
        if self.stopped.load(Ordering::SeqCst) {
            return Err(crate::session::receiver::shut_down_error());
        }
        Ok(())
    }

    /// Stops the engine (as freeing it does: sessions closed, accepts and connections ended,
    /// threads joined), then waits up to `timeout` (`None`: no limit) until no same-host peer
    /// maps its device ring or KV pool: only then is that memory the caller's to free. Again
    /// after a timeout, it waits again.
    pub fn shutdown(&self, timeout: Option<Duration>) -> std::result::Result<(), StillMapped> {
        self.stop("the engine was shut down");
        self.receiver.wait_unmapped(timeout.map(|t| Instant::now() + t))?;
        // Nothing of this engine touches the pool any more: `kvstage_shared_free` may free it.
        let _registering = self.pool.lock();
        self.pool_pin.lock().take();
        Ok(())
    }

    /// Ends everything but the same-host leases, once (the first of shutdown and free).
    fn stop(&self, why: &str) {
        let _stopping = self.stopping.lock();
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        log::info!("engine on {} stopping: {why}", self.local_addr);
        let sessions: Vec<_> = self.sessions.lock().drain(..).filter_map(|w| w.upgrade()).collect();
        for s in sessions {
            s.close(why);
        }
        // Queued transfers now fail fast (their sessions are closed); then every worker is joined.
        self.send.workers.shutdown();
        // The copy workers too, even while a session handle outlives the engine.
        self.send.copy.shutdown();
        // Closing first: the accept loop retries failed accepts unless the receiver is closing.
        self.receiver.shutdown();
        // SHUT_RD on a listening socket wakes a blocked accept() on Linux.
        // SAFETY: the fd is ours and open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RD) };
        let mut threads = std::mem::take(&mut *self.threads.lock()).into_iter();
        let (accept, keeper, scatter) = (threads.next(), threads.next(), threads.next());
        if let Some(h) = accept {
            let _ = h.join();
        }
        // Join every connection so no thread writes into caller memory after the engine stops.
        self.conns.close_all();
        if let Some(h) = keeper {
            let _ = h.join();
        }
        self.receiver.close_scatter_queue();
        if let Some(h) = scatter {
            let _ = h.join();
        }
    }

    /// The engine's default timeout (`None`: no limit): what a timeout of 0 means in every call.
    pub fn default_timeout(&self) -> Option<Duration> {
        self.options.default_deadline
    }
}

/// "auto (same host, else rdma: mlx5_0:1)", "rdma (mlx5_0:1, mlx5_1:1)", "tcp", "shm",
/// "auto (same host, else tcp)" for the log.
fn describe_transport(options: &EngineOptions, rdma: &Rdma) -> String {
    let nics = || rdma.nics().iter().map(|n| n.attrs.describe()).collect::<Vec<_>>().join(", ");
    let same_host = if options.same_host { "same host, else " } else { "" };
    match options.transport {
        TransportKind::Tcp => "tcp".to_owned(),
        TransportKind::Shm => "shm (same host only)".to_owned(),
        TransportKind::Auto if rdma.active() => format!("auto ({same_host}rdma: {})", nics()),
        TransportKind::Auto => format!("auto ({same_host}tcp)"),
        TransportKind::Rdma => format!("rdma ({})", nics()),
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| Error::internal(format!("cannot start thread {name}")).with_source(e))
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop("the engine was freed");
        self.receiver.close_leases();
        log::info!("engine on {} freed", self.local_addr);
    }
}
