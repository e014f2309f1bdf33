//! Decode side: the I/O around the receiver's state machine ([`state`]).
//!
//! [`State`] holds every room, chunk, writer slot, grant and lease and changes only under one
//! lock; this module owns what the state must not: the ring memory, the scatter queue, the
//! watermark broadcast and the caller-facing waits. Connections ([`conn`]) and the listener
//! ([`listener`]) call into it. No blocking I/O happens under the state lock: effects the state
//! asks for (broadcast a watermark, run a scatter, wake waiters) are carried out after unlocking.

mod conn;
mod coverage;
mod describe;
mod extents;
pub mod listener;
mod memory;
mod same_host;
pub use self::same_host::StillMapped;
mod sessions;
pub mod state;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

pub use conn::verify_peer;
pub use memory::{RingMemory, RingSpec};
pub use state::{ChunkEvent, ConnId, ScatterJob};

/// A room the decode caller opens ([`Receiver::open_room`]).
#[derive(Clone, Debug, Default)]
pub struct RoomOpening {
    pub room: u64,
    pub pages: Vec<u32>,
    /// 0: the engine's chunk tokens.
    pub chunk_tokens: u32,
    pub parts: Option<RequestParts>,
    /// Tokens the decode rank holds in front of `pages` (whole pages).
    pub prefix_tokens: u64,
    pub trace: Option<String>,
}

impl RoomOpening {
    /// A room of `pages` in chunks of `chunk_tokens` (0: the engine's), KV only.
    pub fn new(room: u64, pages: &[u32], chunk_tokens: u32) -> RoomOpening {
        RoomOpening { room, pages: pages.to_vec(), chunk_tokens, ..RoomOpening::default() }
    }
}
use state::{AuxRows, AuxWrite, Effects, OpenRoom, Release, RoomParts, State};

use super::notify::{Completion, Completions};
use super::{Deadline, Integrity, LogLimiter, RoomGrid};
use crate::copy::{Components, CopyEngine};
use crate::error::{Error, Result, Status};
use crate::geometry::{self, ComponentSpec, KvLayout, RequestParts};
use crate::protocol::RoomRef;
use crate::ring::Watermark;
use crate::transport::faults::Faults;
use crate::transport::Transport;

/// What the receiver needs from the engine's options.
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// Chunk grid of a room that does not name one.
    pub chunk_tokens: u32,
    /// Secret the sender must present (empty: none).
    pub cluster_token: Vec<u8>,
    /// This side's integrity policy; the stronger of both sides' applies.
    pub integrity: Integrity,
    /// A room not complete this long after it opened fails with `TIMEOUT` (`None`: never).
    pub room_timeout: Option<Duration>,
    /// Chunk events kept for `kvstage_engine_poll_events`; more are dropped and counted.
    pub max_events: usize,
    pub listener: listener::Limits,
    /// Keepalive and `TCP_USER_TIMEOUT`: a silent peer is declared gone after about this long.
    pub dead_peer_timeout: Option<Duration>,
    /// Test only: faults injected into this side's connections.
    pub faults: Option<Faults>,
    /// A chunk holding ring space this long without completing is reported (one WARN naming what
    /// it waits for); `None`: never.
    pub stall_after: Option<Duration>,
}

/// Bound on a reply or broadcast to one sender: its reader drains them at once, so a full socket
/// means a stuck peer, which is then cut off.
const REPLY_DEADLINE: Duration = Duration::from_secs(2);

/// How long `release_room` lets in-flight payload reads finish before it shuts their
/// connections down.
const RELEASE_GRACE: Duration = Duration::from_millis(500);

/// The shortest run of pool bytes (a decode page's rows, when they are whole token slots) into
/// which a stream payload is read straight, skipping the ring and the scatter. Measured on
/// loopback (`kvstage-bench --transport tcp`, 70B-shaped): runs of 16 KiB (TP 2 to 2, pages of 16)
/// took 10–15 % less decode CPU than ring + scatter; runs of 4 KiB (pages of 4) and 512-byte head
/// slices (P4 to D2) took 1.2–3× more (a read into many pieces costs the kernel more than the
/// copy it saves).
pub const POOL_READ_MIN_RUN: u64 = 16 << 10;

/// How often rooms are checked against their deadlines.
const EXPIRY_TICK: Duration = Duration::from_millis(200);

/// How soon the keeper offers a watermark again to a peer that could not take it at once.
const OWED_RETRY: Duration = Duration::from_millis(2);

/// The keeper's broadcast: the latest watermark, the peers that have not taken it yet (since
/// when), and the last expiry pass.
#[derive(Default)]
struct Broadcast {
    latest: Option<Watermark>,
    owed: HashMap<ConnId, Instant>,
    last_expiry: Option<Instant>,
}

fn reply_deadline() -> Deadline {
    Deadline::after(Some(REPLY_DEADLINE))
}

/// A fresh opening key: 64 bits from the kernel's random source (never 0), so a holder of the
/// cluster token cannot name another request's room without having been told its key.
fn new_room_key() -> Result<u64> {
    loop {
        let bytes = crate::transport::shm::fdpass::random_bytes(8)?;
        let key = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        if key != 0 {
            return Ok(key);
        }
    }
}

/// An accepted sender's stream and where it connected from.
struct Peer {
    link: Arc<dyn Transport>,
    source: std::net::IpAddr,
}

/// Counters of the receiver (engine stats).
#[derive(Default)]
pub struct ReceiverCounters {
    pub accept_errors: AtomicU64,
    pub connections_refused: AtomicU64,
    pub handshakes_failed: AtomicU64,
    pub panics: AtomicU64,
}

/// How often records a peer can cause at will may go out (each kind on its own).
const LOG_PERIOD: Duration = Duration::from_secs(10);

/// Rate sense for the receiver's records that peers (or their absence) can repeat at will.
pub struct LogLimits {
    pub accept_errors: LogLimiter,
    pub refused: LogLimiter,
    pub handshakes: LogLimiter,
    pub events_dropped: LogLimiter,
    /// Sessions cut for taking no watermark.
    pub behind: LogLimiter,
    /// Sessions lost (reset, stalled, cut).
    pub lost: LogLimiter,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            accept_errors: LogLimiter::new(LOG_PERIOD),
            refused: LogLimiter::new(LOG_PERIOD),
            handshakes: LogLimiter::new(LOG_PERIOD),
            events_dropped: LogLimiter::new(LOG_PERIOD),
            behind: LogLimiter::new(LOG_PERIOD),
            lost: LogLimiter::new(LOG_PERIOD),
        }
    }
}

/// A snapshot for `kvstage_engine_stats`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReceiverStats {
    pub ring_capacity: u64,
    pub ring_live: u64,
    pub watermark: Watermark,
    pub connections: u64,
    pub accept_errors: u64,
    pub connections_refused: u64,
    pub handshakes_failed: u64,
    pub events_dropped: u64,
    pub rooms_expired: u64,
    pub panics: u64,
    /// Current span of the ring held by live allocations, in bytes.
    pub ring_used: u64,
    /// Bytes and chunks received, scatter times, the ring's high-water mark.
    pub metrics: crate::session::stats::ReceiveStats,
}

/// The receiver half of an engine.
pub struct Receiver {
    state: Mutex<State>,
    changed: Condvar,
    memory: Mutex<Option<Arc<RingMemory>>>,
    pool: Arc<Mutex<Option<Arc<KvLayout>>>>,
    /// The engine's components (request parts besides the KV), once registered.
    components: Arc<Mutex<Option<Arc<Components>>>>,
    copy: Arc<dyn CopyEngine>,
    scatter_tx: Mutex<Option<Sender<ScatterJob>>>,
    config: ReceiverConfig,
    /// Accepted senders: watermark broadcasts, eviction and shutdown (never locked together with
    /// `state`).
    peers: Mutex<HashMap<ConnId, Peer>>,
    /// Sessions cut to serve newcomers at the connection limit whose threads have not ended.
    evicted: Mutex<std::collections::HashSet<ConnId>>,
    /// Latest watermark not yet broadcast, for the keeper thread.
    pending_watermark: Mutex<Option<Watermark>>,
    keeper_wake: Condvar,
    /// The keeper thread's own.
    broadcast: Mutex<Broadcast>,
    closing: AtomicBool,
    rdma: Mutex<Option<Arc<crate::transport::rdma::Rdma>>>,
    shm: Mutex<Option<Arc<crate::transport::shm::Shm>>>,
    /// Same-host peers' mapping leases (see [`same_host`]).
    leases: same_host::Leases,
    pub counters: ReceiverCounters,
    pub log_limits: LogLimits,
    /// Chunk events are signalled here too (eventfd, callback).
    completions: Arc<Completions>,
    /// Waiting grants the keeper has seen: when first, and whether their stall was reported.
    stalls: Mutex<HashMap<u64, (Instant, bool)>>,
}

impl Receiver {
    pub fn new(
        pool: Arc<Mutex<Option<Arc<KvLayout>>>>,
        components: Arc<Mutex<Option<Arc<Components>>>>,
        copy: Arc<dyn CopyEngine>,
        config: ReceiverConfig,
        completions: Arc<Completions>,
    ) -> Receiver {
        Receiver {
            components,
            completions,
            state: Mutex::new(State::new(config.max_events)),
            changed: Condvar::new(),
            memory: Mutex::new(None),
            pool,
            copy,
            scatter_tx: Mutex::new(None),
            config,
            peers: Mutex::new(HashMap::new()),
            evicted: Mutex::new(Default::default()),
            pending_watermark: Mutex::new(None),
            keeper_wake: Condvar::new(),
            broadcast: Mutex::new(Broadcast::default()),
            closing: AtomicBool::new(false),
            rdma: Mutex::new(None),
            shm: Mutex::new(None),
            leases: same_host::Leases::default(),
            counters: ReceiverCounters::default(),
            log_limits: LogLimits::default(),
            stalls: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    pub fn set_scatter_queue(&self, tx: Sender<ScatterJob>) {
        *self.scatter_tx.lock() = Some(tx);
    }

    pub fn set_rdma(&self, rdma: Arc<crate::transport::rdma::Rdma>) {
        *self.rdma.lock() = Some(rdma);
    }

    pub fn set_shm(&self, shm: Arc<crate::transport::shm::Shm>) {
        *self.shm.lock() = Some(shm);
    }

    pub fn close_scatter_queue(&self) {
        self.scatter_tx.lock().take();
    }

    /// Runs `f` on the state under its lock, then carries out the effects it asked for.
    fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let (r, fx) = self.with_state_deferred(f);
        self.apply(fx);
        r
    }

    /// As [`with_state`](Self::with_state), returning the effects for the caller to apply later
    /// (a chunk's scatter is queued only after the sender's acknowledgement left).
    fn with_state_deferred<R>(&self, f: impl FnOnce(&mut State) -> R) -> (R, Effects) {
        let mut st = self.state.lock();
        let r = f(&mut st);
        let fx = st.take_effects();
        // Counted under the state lock that publishes them: a caller whose room wait or event
        // poll saw a chunk's end finds it on the eventfd (the callbacks run later, in `apply`).
        self.completions.count(fx.events.len() as u64);
        (r, fx)
    }

    fn apply(&self, fx: Effects) {
        // Logged before the waiters wake: a caller who sees the room fail finds the record.
        for (room, f) in &fx.failed {
            let code = f.code.name();
            let session = f.session.as_str();
            if matches!(f.code, Status::KVSTAGE_E_PANIC | Status::KVSTAGE_E_INTERNAL | Status::KVSTAGE_E_CUDA | Status::KVSTAGE_E_RDMA) {
                log::error!(session = session; "[{}] room {room} failed ({code}): {}", f.trace, f.why);
            } else {
                log::warn!(session = session; "[{}] room {room} failed ({code}): {}", f.trace, f.why);
            }
        }
        if fx.events_dropped > 0 {
            if let Some(suppressed) = self.log_limits.events_dropped.allow() {
                log::warn!(
                    "room event queue full (max_events {}): {} event(s) dropped; poll events or raise max_events{suppressed}",
                    self.config.max_events,
                    fx.events_dropped
                );
            }
        }
        if let Some(w) = fx.watermark {
            *self.pending_watermark.lock() = Some(w);
            self.keeper_wake.notify_all();
        }
        for job in fx.scatter {
            let tx = self.scatter_tx.lock().clone();
            if tx.ok_or(()).and_then(|tx| tx.send(job.clone()).map_err(|_| ())).is_err() {
                self.with_state(|st| st.scatter_done(&job, Err(Error::internal("the scatter queue is closed"))));
            }
        }
        if fx.changed {
            self.changed.notify_all();
        }
        for write in fx.aux {
            let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.write_aux(&write))).unwrap_or_else(|p| {
                self.counters.panics.fetch_add(1, Ordering::Relaxed);
                Err(Error::from_panic(format!("writing the aux rows of room {} panicked", write.room), &*p))
            });
            self.with_state(|st| st.aux_done(&write, written));
        }
        for e in fx.events {
            self.completions.call(&Completion::Chunk(e));
        }
    }

    /// The components' specs as the handshake shows them (none before registration).
    pub fn component_specs(&self) -> Vec<ComponentSpec> {
        self.components.lock().as_ref().map(|c| c.specs()).unwrap_or_default()
    }

    /// Writes a room's aux rows into the aux buffers (its lease holds the room's release).
    fn write_aux(&self, write: &AuxWrite) -> Result<()> {
        crate::panics::point("aux write");
        // SAFETY: the request's parts were checked at the room's opening; the rows were copied
        // out of the ring with their offsets rebased into `bytes`.
        unsafe { write.parts.components.scatter(&write.parts.request, &write.rows.parts, write.rows.bytes.as_ptr()) }
    }

    pub fn register_ring(&self, memory: RingMemory) -> Result<()> {
        let len = memory.size() as u64;
        // Lock order: pool, then memory (as `check_pool_fits_ring`), so that a pool and a ring
        // registered at once cannot both pass the check against the other's predecessor.
        let pool = self.pool.lock();
        if let Some(p) = pool.as_ref() {
            memory.check_pool(p)?;
        }
        let mut slot = self.memory.lock();
        let mapped = self.with_state(|st| st.register_ring(len).map(|()| st.mapped_conns()))?;
        // The old ring's memory region goes before its memory (RDMA peers then fail with a remote
        // access error and reconnect); nothing writes the old memory: no allocation was live.
        if let Some(r) = self.rdma.lock().as_ref() {
            r.forget_ring();
        }
        // Same-host peers map the old ring: their sessions end (they reconnect to map the new
        // one). Their leases hold the old ring until they end (see `same_host`), so a late write
        // lands in no one's memory.
        if !mapped.is_empty() {
            log::info!("staging ring replaced: closing {} same-host session(s) that map the old one", mapped.len());
            let peers = self.peers.lock();
            for id in mapped {
                if let Some(p) = peers.get(&id) {
                    p.link.shutdown();
                }
            }
        }
        let old = slot.replace(Arc::new(memory));
        drop(slot);
        drop(pool);
        // Freed (munmap, cuMemFree) outside the locks that senders and rooms wait on.
        drop(old);
        Ok(())
    }

    /// Checks a pool about to be registered against the registered ring (see
    /// [`RingMemory::check_pool`]); the caller holds the pool lock it will set the pool under.
    pub fn check_pool_fits_ring(&self, pool: &KvLayout) -> Result<()> {
        match self.memory.lock().as_ref() {
            Some(m) => m.check_pool(pool),
            None => Ok(()),
        }
    }

    /// How the registered ring is held, for logs ("none" before registration).
    pub fn ring_describe(&self) -> String {
        self.memory.lock().as_ref().map_or_else(|| "none".to_owned(), |m| format!("{} bytes of {}", m.size(), m.describe()))
    }

    fn ring_memory(&self) -> Result<Arc<RingMemory>> {
        self.memory.lock().clone().ok_or_else(|| Error::internal("a grant without ring memory"))
    }

    fn pool(&self) -> Result<Arc<KvLayout>> {
        self.pool.lock().clone().ok_or_else(|| {
            Error::invalid_arg("engine", "has no KV pool registered (kvstage_engine_register_pool)")
        })
    }

    /// Opens a room: the decode pages that receive the request's new tokens (after the decode
    /// side's cached prefix), split into chunks of `chunk_tokens` on the page grid, and the parts
    /// it moves besides its KV (checked against the registered components). Returns the opening's
    /// key, which the senders of this request must name, and its grid.
    pub fn open_room(&self, open: RoomOpening) -> Result<(u64, RoomGrid)> {
        if self.closing() {
            return Err(shut_down_error());
        }
        let RoomOpening { room, pages, chunk_tokens, parts, prefix_tokens, trace } = open;
        let pool = self.pool()?;
        pool.check_pages(&pages, "desc->pages")?;
        let page_size = pool.shape.page_size;
        if !prefix_tokens.is_multiple_of(u64::from(page_size)) {
            return Err(Error::invalid_arg(
                "desc->prefix_tokens",
                format!("{prefix_tokens} is not whole decode pages of {page_size} tokens (a room's pages start at a page boundary: round the cached prefix down to {})", prefix_tokens / u64::from(page_size) * u64::from(page_size)),
            ));
        }
        if let Some(t) = &trace {
            crate::protocol::trace::check_trace(t).map_err(|why| Error::invalid_arg("desc->trace_id", format!("{t:?}: {why}")))?;
        }
        let parts = match parts {
            None => None,
            Some(request) => {
                let components = self.components.lock().clone().unwrap_or_default();
                components.check_parts(&request, "desc->parts")?;
                if self.memory.lock().as_ref().is_some_and(|m| m.device().is_some()) {
                    return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "request parts need a host staging ring (this engine's ring is device memory)"));
                }
                Some(Arc::new(RoomParts { request, components }))
            }
        };
        let chunk_tokens = if chunk_tokens == 0 { self.config.chunk_tokens } else { chunk_tokens };
        let grid_pages = (geometry::grid_tokens(chunk_tokens, page_size) / page_size) as usize;
        let expires = self.config.room_timeout.map(|t| Instant::now() + t);
        let key = new_room_key()?;
        let num_pages = pages.len() as u32;
        let open = OpenRoom { pages, grid_pages, prefix_tokens, parts, trace };
        let num_chunks = self.with_state(|st| st.open_room(room, key, open, expires))?;
        let grid = RoomGrid { chunk_tokens: grid_pages as u32 * page_size, num_chunks, num_pages, page_size, prefix_tokens };
        Ok((key, grid))
    }

    /// Waits until the opening `at` is complete (OK), failed (its error) or the deadline.
    pub fn wait_room(&self, at: RoomRef, timeout: Option<Duration>) -> Result<Status> {
        let room = at.id;
        let deadline = Deadline::after(timeout);
        let mut st = self.state.lock();
        st.room_outcome(at)?;
        loop {
            if !st.is_open(at) {
                return Err(Error::new(
                    Status::KVSTAGE_E_CANCELED,
                    format!("room {room} was released while waiting for it (its id may be open again for another request)"),
                ));
            }
            if st.room_outcome(at)? {
                return Ok(Status::KVSTAGE_OK);
            }
            if !deadline.wait(&self.changed, &mut st) {
                let done = st.room_progress(room);
                return Err(deadline.timeout_error(&format!("waiting for room {room} ({done})")));
            }
        }
    }

    /// Releases a room and returns once no kvstage thread nor same-host writer will touch its
    /// pages again: payload reads and direct copies into them get a short grace, then their
    /// connections are shut down (a copy in progress still ends, then its mapping). One that
    /// cannot end, as a stopped prefill process's copy, holds the pages: past `timeout` (`None`:
    /// no limit) this fails with `KVSTAGE_E_TIMEOUT` naming its connections, the room released
    /// but its id and pages not yet free; a second call waits again.
    pub fn release_room(&self, at: RoomRef, timeout: Option<Duration>) -> Result<()> {
        let room = at.id;
        let Release::Draining { gen, .. } = self.with_state(|st| st.release_room(at)) else { return Ok(()) };
        let grace = Deadline::after(Some(RELEASE_GRACE));
        let until = Deadline::after(timeout);
        let mut st = self.state.lock();
        let mut shut = false;
        while let Some(holders) = st.draining(room, gen) {
            // A bound shorter than the grace still cuts the holders (the pages come back once
            // their threads end, a later release sees them gone).
            if shut && until.expired() {
                return Err(until.timeout_error(&format!(
                    "releasing room {room}: connection(s) {holders:?} still hold its pages and may write them (do not reuse them yet)"
                )));
            }
            if !shut && (grace.expired() || until.expired()) {
                // A sender stuck inside a payload into this room's pages: cut it off.
                drop(st);
                let peers = self.peers.lock();
                for h in holders {
                    if let Some(p) = peers.get(&h) {
                        p.link.shutdown();
                    }
                }
                drop(peers);
                shut = true;
                st = self.state.lock();
                continue;
            }
            self.changed.wait_for(&mut st, Duration::from_millis(50));
        }
        Ok(())
    }

    /// Whether the opening `at` is open (not released).
    pub fn is_open(&self, at: RoomRef) -> bool {
        self.state.lock().is_open(at)
    }

    /// Up to `max` queued events, oldest first: of the opening `room`, or of every room.
    pub fn take_events(&self, room: Option<RoomRef>, max: usize) -> Vec<ChunkEvent> {
        self.state.lock().take_events(room, max)
    }

    pub fn ring_stats(&self) -> (u64, u64, Watermark) {
        self.state.lock().ring_stats()
    }

    pub fn stats(&self) -> ReceiverStats {
        let st = self.state.lock();
        let (ring_capacity, ring_live, watermark) = st.ring_stats();
        let c = st.counters();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReceiverStats {
            ring_capacity,
            ring_live,
            watermark,
            connections: st.conn_count() as u64,
            accept_errors: n(&self.counters.accept_errors),
            connections_refused: n(&self.counters.connections_refused),
            handshakes_failed: n(&self.counters.handshakes_failed),
            events_dropped: c.events_dropped,
            rooms_expired: c.rooms_expired,
            panics: n(&self.counters.panics),
            ring_used: st.ring_used(),
            metrics: st.metrics(),
        }
    }

    /// Executes a scatter job (on the engine's scatter thread); a panic fails the room with
    /// `KVSTAGE_E_PANIC` and still returns the ring space. A panic in the bookkeeping after it is
    /// caught too (counted and logged): the scatter thread goes on with the next job.
    pub fn run_scatter(&self, mut job: ScatterJob) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.scatter(&job))).unwrap_or_else(|p| {
            self.counters.panics.fetch_add(1, Ordering::Relaxed);
            Err(Error::from_panic(format!("the scatter of room {} chunk {} panicked", job.room, job.chunk), &*p))
        });
        job.finished = Some(Instant::now());
        crate::panics::contain("the scatter thread's bookkeeping", Some(&self.counters.panics), || {
            crate::panics::point("scatter done");
            self.with_state(|st| st.scatter_done(&job, result));
        });
    }

    fn scatter(&self, job: &ScatterJob) -> Result<Option<AuxRows>> {
        if !job.layers.is_empty() {
            self.scatter_kv(job)?;
        }
        job.parts.as_ref().map(|parts| self.scatter_parts(job, parts)).transpose()
    }

    /// The request's parts in the regions' tails of the room's last chunk: state and pools go
    /// to their components now, the aux rows are copied out (written once the room is in place).
    fn scatter_parts(&self, job: &ScatterJob, parts: &RoomParts) -> Result<AuxRows> {
        let mem = self.ring_memory()?;
        if mem.device().is_some() {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "request parts need a host staging ring (this engine's ring is device memory)"));
        }
        let mut aux = AuxRows::default();
        for region in &job.layout.writers {
            let (now, later): (Vec<_>, Vec<_>) = region.tail.iter().cloned().partition(|p| p.copy != geometry::PartCopy::Row);
            let tail = mem.range(job.ring_offset + region.offset + region.kv_bytes(), region.bytes - region.kv_bytes())?;
            // SAFETY: the grant is pinned for this scatter and every writer arrived (checksum
            // verified where one covers the chunk); `range` checked the tail lies in the ring;
            // the parts were checked against the components at the room's opening.
            unsafe { parts.components.scatter(&parts.request, &now, tail)? };
            for mut p in later {
                let at = p.offset as usize;
                // SAFETY: as above; the part lies in the tail.
                aux.bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(tail.add(at), p.bytes as usize) });
                p.offset = (aux.bytes.len() - p.bytes as usize) as u64;
                aux.parts.push(p);
            }
        }
        Ok(aux)
    }

    fn scatter_kv(&self, job: &ScatterJob) -> Result<()> {
        let pool = self.pool()?;
        let mem = self.ring_memory()?;
        mem.before_device_read()?;
        // A direct writer's region is in the pool already (its ring range was never written).
        let scattered = job.layout.writers.iter().enumerate().filter(|(i, r)| r.layers > 0 && !job.in_pool.contains(&(*i as u32)));
        for (_, region) in scattered {
            let plan = geometry::plan_scatter(&*pool, &job.pages, &job.layout, region)?.for_layers(|l| job.layers.contains(&l));
            if plan.slabs.is_empty() {
                continue;
            }
            let src = mem.range(job.ring_offset + region.offset, region.bytes)?;
            // SAFETY: the grant is pinned for this scatter and the job's slabs all landed (the
            // receiver writes each byte once; an in-place writer is trusted with its own region)
            // while the region's other slabs, which may still be landing, are not read; `range`
            // checked the region lies in the ring.
            unsafe { self.copy.scatter(&plan, &pool, src)? };
        }
        Ok(())
    }

    /// The keeper thread's loop: broadcasts the latest watermark to every sender (outside the
    /// state lock, so a stuck sender delays nobody's bookkeeping) and expires overdue rooms.
    pub fn run_keeper(&self) {
        while !self.closing.load(Ordering::SeqCst) {
            if !crate::panics::contain("the keeper thread", Some(&self.counters.panics), || self.keeper_pass()) {
                // Not hot: a pass that panics again waits a tick first.
                std::thread::sleep(EXPIRY_TICK);
            }
        }
    }

    /// One pass of the keeper: the pending watermark to every peer owed it, then (each
    /// [`EXPIRY_TICK`]) expiry and stall reports. No peer is waited on: one whose stream is busy
    /// or whose receive window is full is tried again a moment later, and cut once it has owed
    /// a watermark for [`REPLY_DEADLINE`]. The watermark stays pending until it is recorded as
    /// owed, so a pass that panics leaves it for the next.
    fn keeper_pass(&self) {
        let mut b = self.broadcast.lock();
        let wait = if b.owed.is_empty() { EXPIRY_TICK } else { OWED_RETRY };
        let fresh = {
            let mut pending = self.pending_watermark.lock();
            if pending.is_none() {
                self.keeper_wake.wait_for(&mut pending, wait);
            }
            *pending
        };
        crate::panics::point("keeper");
        if let Some(w) = fresh {
            let now = Instant::now();
            b.latest = Some(w);
            for id in self.peers.lock().keys() {
                b.owed.entry(*id).or_insert(now);
            }
            let mut pending = self.pending_watermark.lock();
            if *pending == Some(w) {
                *pending = None;
            }
        }
        if let Some(w) = b.latest.filter(|_| !b.owed.is_empty()) {
            self.send_owed(&mut b, w);
        }
        if b.last_expiry.is_some_and(|t| t.elapsed() < EXPIRY_TICK) {
            return;
        }
        b.last_expiry = Some(Instant::now());
        drop(b);
        self.with_state(|st| st.expire(Instant::now()));
        self.report_stalls();
    }

    /// Offers watermark `w` to every peer that owes it, without waiting on any.
    fn send_owed(&self, b: &mut Broadcast, w: Watermark) {
        let peers: Vec<(ConnId, Arc<dyn Transport>)> =
            self.peers.lock().iter().filter(|(id, _)| b.owed.contains_key(id)).map(|(id, p)| (*id, p.link.clone())).collect();
        b.owed.retain(|id, _| peers.iter().any(|(p, _)| p == id));
        let mut cut = Vec::new();
        for (id, p) in peers {
            match p.try_send(&crate::protocol::Message::Watermark(w)) {
                // A failed send cut the stream itself; its connection ends.
                Ok(true) | Err(_) => {
                    b.owed.remove(&id);
                }
                Ok(false) if b.owed[&id].elapsed() >= REPLY_DEADLINE => {
                    p.shutdown();
                    b.owed.remove(&id);
                    cut.push(p.describe());
                }
                Ok(false) => {}
            }
        }
        if let (Some(first), Some(suppressed)) = (cut.first(), (!cut.is_empty()).then(|| self.log_limits.behind.allow()).flatten()) {
            log::warn!(
                "cut {} session(s) that took no watermark for {} ms (their receive window stayed full), {first} among them{suppressed}",
                cut.len(),
                REPLY_DEADLINE.as_millis()
            );
        }
    }

    /// Reports, once each, the chunks that have held ring space for `stall_after` without
    /// completing: what they wait for (writers and their progress), in one WARN line.
    fn report_stalls(&self) {
        let Some(after) = self.config.stall_after else { return };
        let now = Instant::now();
        let waiting = self.state.lock().waiting_grants();
        let due: Vec<u64> = {
            let mut seen = self.stalls.lock();
            let live: std::collections::HashSet<u64> = waiting.iter().copied().collect();
            seen.retain(|id, _| live.contains(id));
            waiting
                .iter()
                .filter(|id| {
                    let (since, reported) = seen.entry(**id).or_insert((now, false));
                    let due = !*reported && now.duration_since(*since) >= after;
                    *reported |= due;
                    due
                })
                .copied()
                .collect()
        };
        for id in due {
            let report = self.state.lock().grant_report(id);
            if let Some(report) = report {
                log::warn!("{report} (no progress in the {:.1} s since the grant)", after.as_secs_f64());
            }
        }
    }

    /// Stops the keeper and shuts every accepted connection down (their threads then end); the
    /// same-host leases stay watched (see [`Receiver::close_leases`]).
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.keeper_wake.notify_all();
        for p in self.peers.lock().values() {
            p.link.shutdown();
        }
        // The ring's memory region goes before its memory (freed with the receiver).
        if let Some(r) = self.rdma.lock().as_ref() {
            r.forget_ring();
        }
    }

    /// Waits until no same-host peer maps this engine's device ring or KV pool (see
    /// [`same_host::Leases::wait_unmapped`]).
    pub fn wait_unmapped(&self, until: Option<Instant>) -> std::result::Result<(), same_host::StillMapped> {
        self.leases.wait_unmapped(until)
    }

    /// Ends every lease watch (the engine is freed; see [`same_host::Leases::close_all`]).
    pub fn close_leases(&self) {
        self.leases.close_all();
    }

    /// Whether the engine stopped ([`shut_down_error`] for the calls it refuses then).
    pub fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }
}

/// What a call that would start work on a stopped engine fails with.
pub fn shut_down_error() -> Error {
    Error::new(Status::KVSTAGE_E_CANCELED, "the engine was shut down (kvstage_engine_shutdown)")
}
