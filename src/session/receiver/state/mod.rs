//! The decode side's bookkeeping as one plain state machine: rooms, chunks, writer slots, grants,
//! leases and events. No I/O, no threads, no clock of its own: the receiver calls it under one
//! lock, does the I/O it allows outside the lock, and reports back.
//!
//! Rules it keeps (docs/ARCHITECTURE.md, "Receiver rules"):
//! - a writer slot belongs to the connection that claimed it; every frame naming it is checked
//!   against that connection;
//! - a ring range is returned to the ring only when no write into it can happen: a payload read in
//!   progress pins its grant, a grant written in place (RDMA, same-host mapping) stays quarantined
//!   while its writer may still write — for a same-host writer until its mapping is gone, which
//!   may be after its connection;
//! - a writer's staged writes may land in any order inside its region but never outside it or over
//!   bytes already written; its ready counts only when they cover the region, each byte once;
//! - a layer is scattered once its slabs from every writer landed (before the writers' ready,
//!   unless a checksum covers the chunk: then after it was verified, the whole chunk at once; an
//!   RDMA writer's bytes count only from its ready on); the chunk is done when every writer
//!   arrived and every scatter of it ended;
//! - a released room leaves only when no lease on its pages (slice reads, scatter) is left, and its
//!   id can be opened again only then; stale leases name the room's generation, never a newer room;
//! - every frame names the room's opening by its key: one naming another opening (a stale writer
//!   of the request the id was opened for before, a guess) is refused, claims nothing, fails
//!   nothing and does not end its session;
//! - events are bounded (overflow is counted).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, FieldMismatch, Result, Status};
use crate::geometry::{self, ComponentSpec, CopyPlan, PoolShape, StagingLayout, Strides};
use crate::protocol::RoomRef;
use crate::ring::{Grant, Ring, Watermark};
use crate::session::receiver::coverage::Coverage;
use crate::session::receiver::extents::Extents;
pub use crate::session::notify::{ChunkEvent, EventKind};
use crate::session::RoomGrid;

/// What the decode caller opens a room with (checked by the receiver before).
pub struct OpenRoom {
    pub pages: Vec<u32>,
    /// Pages per chunk.
    pub grid_pages: usize,
    pub prefix_tokens: u64,
    pub parts: Option<Arc<RoomParts>>,
    /// The caller's trace id (checked), or `None` for a derived one.
    pub trace: Option<String>,
}

impl OpenRoom {
    /// Pages only: no prefix, parts or trace id.
    pub fn pages(pages: &[u32], grid_pages: usize) -> OpenRoom {
        OpenRoom { pages: pages.to_vec(), grid_pages, prefix_tokens: 0, parts: None, trace: None }
    }
}
pub use describe::{ReceiverDescription, RoomDescription};
pub use parts::{AuxRows, AuxWrite, RoomParts};
use parts::Aux;
use crate::session::stats::ReceiveStats;
use crate::session::{Integrity, Pairing};

mod describe;
mod parts;
mod slices;
mod staged;
mod stalls;
mod streaming;

pub type ConnId = u64;

/// What the handshake established about a connection.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub session: String,
    /// The sender's pool shape and ours at the handshake.
    pub src: PoolShape,
    pub dst: PoolShape,
    /// Our pool's strides (its own: they never cross the wire).
    /// The decode pool's strides: K (or latent), V.
    pub dst_strides: [Strides; 2],
    pub pairing: Pairing,
    /// Chunks are written in place (RDMA WRITE, or a same-host mapping of the ring): grants stay
    /// quarantined until the writer is done with them.
    pub in_place: bool,
    /// Our pool is host memory (the slice path writes it from the CPU: host pools only).
    pub host_pool: bool,
    /// The peer maps our KV pool (direct mode, same host): it may be granted chunks to write
    /// straight into their pages.
    pub direct: bool,
    /// Payloads this connection streams may be read straight into the pool's pages (a host pool;
    /// used while the connection does not write in place, for chunks without a checksum) when
    /// the region's rows there run at least this many bytes at a time; `None`: never.
    pub pool_read_min_run: Option<u64>,
    /// The stronger of both sides' policies: which of its chunks carry a checksum.
    pub integrity: Integrity,
    /// Both sides' components at the handshake (matched then).
    pub src_components: Arc<Vec<ComponentSpec>>,
    pub dst_components: Arc<Vec<ComponentSpec>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Scattering,
    Done,
}

/// How a chunk's writers deliver; fixed by the first frame that names the chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Unset,
    Staged,
    Slices,
}

/// What one connection writes of one chunk: its region (staged) or its rows (slice path).
#[derive(Clone, Debug)]
struct Slot {
    conn: ConnId,
    /// Its region's index in the chunk's layout: the layers it carries (and, staged, where).
    region: u32,
    /// Staged: the ranges of its region that landed (allocation-relative), in any order.
    written: Extents,
    /// Slice path: rows landed.
    coverage: Option<Coverage>,
    arrived: bool,
    /// Where its region's KV lands.
    lands: Lands,
}

/// Where a staged writer's region's KV lands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Lands {
    /// In the ring, scattered into the pool from there.
    Ring,
    /// Straight in the pool's pages, written by the peer that maps the pool (direct mode).
    Mapped,
    /// Straight in the pool's pages, read there from the connection's stream (TCP into a host
    /// pool, no checksum to verify before the bytes may reach the pages): along this scatter plan
    /// of the region, made once at the grant.
    Read(Arc<CopyPlan>),
}

impl Lands {
    fn in_pool(&self) -> bool {
        *self != Lands::Ring
    }
}

#[derive(Clone, Debug)]
struct Chunk {
    phase: Phase,
    mode: Mode,
    grant: Option<u64>,
    /// Which (head group, layer) each slot carries: the chunk needs all of them, once each.
    layout: Option<StagingLayout>,
    /// One per connection that writes the chunk, in the order they claimed it.
    slots: Vec<Slot>,
    /// Decode layers (by index in the pool's layer ids) handed to a scatter so far.
    layers_taken: Vec<bool>,
    /// Scatters of this chunk queued or running.
    scatters: u32,
    /// When its last writer arrived (carried by the scatter queued then, recorded when it ends).
    arrived: Option<Instant>,
}

impl Chunk {
    /// Every (head group, layer) is claimed and every claimant finished.
    fn all_arrived(&self) -> bool {
        self.layout.as_ref().is_some_and(StagingLayout::complete) && self.slots.iter().all(|s| s.arrived)
    }

    /// `conn`'s slot and its index.
    fn slot_of(&self, conn: ConnId) -> Option<(u32, &Slot)> {
        self.slots.iter().enumerate().find(|(_, s)| s.conn == conn).map(|(i, s)| (i as u32, s))
    }
}

#[derive(Clone, Debug)]
pub struct Failure {
    pub code: Status,
    pub why: String,
    pub session: String,
    /// The room's trace id when it failed.
    pub trace: String,
}

#[derive(Clone, Debug)]
struct Room {
    gen: u64,
    /// The opening's key: frames naming another are refused.
    key: u64,
    /// The request's trace id: derived from the opening, or the first writer's (`name_trace`).
    trace: String,
    trace_named: bool,
    pages: Vec<u32>,
    /// Tokens the decode rank held in front of `pages` (reported in the grid).
    prefix_tokens: u64,
    grid_pages: usize,
    chunks: Vec<Chunk>,
    failure: Option<Failure>,
    released: bool,
    /// Prefill geometry every writer of the room must share (set by the first writer).
    prefill: Option<PoolShape>,
    /// Leases on the room's pool pages: slice reads by connection, and running scatters.
    page_leases: Vec<Option<ConnId>>,
    /// Direct writers granted (connection, chunk) that may still write the room's pages: the
    /// room leaves only when they reported ready or aborted, or their mapping ended.
    direct_writers: Vec<(ConnId, u32)>,
    expires: Option<Instant>,
    /// What the room names besides its KV pages (travels with its last chunk).
    parts: Option<Arc<RoomParts>>,
    aux: Aux,
    /// The event of the chunk that completed the room's KV, held until its aux rows are written.
    held_event: Option<ChunkEvent>,
}

impl Room {
    fn chunk_pages(&self, chunk: u32) -> &[u32] {
        let start = chunk as usize * self.grid_pages;
        &self.pages[start..(start + self.grid_pages).min(self.pages.len())]
    }

    /// Every chunk scattered and the aux rows (if any) written.
    fn grid(&self, page_size: u32) -> RoomGrid {
        RoomGrid {
            chunk_tokens: self.grid_pages as u32 * page_size,
            num_chunks: self.chunks.len() as u32,
            num_pages: self.pages.len() as u32,
            page_size,
            prefix_tokens: self.prefix_tokens,
        }
    }

    fn complete(&self) -> bool {
        self.chunks.iter().all(|c| c.phase == Phase::Done) && self.aux.settled()
    }

    fn live(&self) -> bool {
        !self.released && self.failure.is_none()
    }

    /// Connections that hold the room's pages: slice readers and direct writers.
    fn holders(&self) -> Vec<ConnId> {
        self.page_leases.iter().flatten().copied().chain(self.direct_writers.iter().map(|&(w, _)| w)).collect()
    }

    /// "1 of 2 chunks done; chunk 1 waits for prefill tp 1 pp 0 (it has not written layers
    /// 0..=3 (4 layer(s)))": the first unfinished chunk with writers missing names them.
    fn done_text(&self) -> String {
        let mut text = format!("{} of {} chunks done", self.chunks.iter().filter(|c| c.phase == Phase::Done).count(), self.chunks.len());
        let missing = self.chunks.iter().enumerate().find_map(|(i, c)| {
            let m = self.missing_writers(c);
            (!m.is_empty()).then_some((i, m))
        });
        if let Some((i, missing)) = missing {
            let names: Vec<String> = missing.iter().map(ToString::to_string).collect();
            text.push_str(&format!("; chunk {i}: {}", names.join("; ")));
        }
        text
    }

    /// The prefill ranks a chunk still waits for: none once done; before its first writer asked,
    /// every writer another chunk's layout names (none when no chunk of the room has a writer).
    fn missing_writers(&self, c: &Chunk) -> Vec<geometry::MissingWriter> {
        if c.phase == Phase::Done || self.failure.is_some() {
            return Vec::new();
        }
        match &c.layout {
            Some(layout) => layout.missing_writers(),
            None => self.chunks.iter().find_map(|o| o.layout.as_ref()).map_or_else(Vec::new, |l| l.unplaced().missing_writers()),
        }
    }
}

/// A ring allocation and who may still write into it.
#[derive(Clone, Debug)]
struct GrantState {
    grant: Grant,
    /// The chunk it was granted for (an RDMA writer's abort or ready names it).
    room: RoomRef,
    chunk: u32,
    /// Payload reads (by connection) and scatters (`None`) using it right now.
    pins: Vec<Option<ConnId>>,
    /// In-place writers that may still write into it (quarantine).
    remote_writers: Vec<ConnId>,
    /// Its chunk no longer needs it: returned to the ring once unpinned and out of quarantine.
    freeing: bool,
}

/// A payload read into a writer's region (staged path).
#[derive(Debug)]
pub struct WriteLease {
    conn: ConnId,
    grant: u64,
    room: u64,
    gen: u64,
    chunk: u32,
    /// Index of the connection's slot in the chunk.
    slot: u32,
    /// Where the payload lands in the allocation and in the ring, and how many bytes.
    offset: u64,
    pub ring_offset: u64,
    pub len: u64,
    /// Set when the payload is read straight into the pool's pages: the region's scatter plan (its
    /// rows in the pool, in region order), and the payload's offset in the region.
    pub into_pool: Option<(Arc<CopyPlan>, u64)>,
}

/// A writer's finished region, checked (checksum) outside the lock before it counts as arrived.
#[derive(Debug)]
pub struct ReadyLease {
    conn: ConnId,
    grant: u64,
    room: u64,
    gen: u64,
    chunk: u32,
    /// Index of the connection's slot in the chunk.
    slot: u32,
    pub ring_offset: u64,
    pub len: u64,
    /// A region whose bytes are in the pool's pages, not in the ring (direct mode, or read there).
    pub in_pool: Option<DirectRegion>,
    /// The region was written by a peer that maps the pool (direct mode).
    pub mapped: bool,
}

/// Where a region that lands in the pool lies there: the chunk's pages, its layout and the
/// region's index in it (what a checksum of it reads, what a read into the pool fills).
#[derive(Debug)]
pub struct DirectRegion {
    pub pages: Vec<u32>,
    pub layout: StagingLayout,
    pub region: u32,
}

/// An allocation granted: the grant, the writer's region offset in it, and for a direct writer
/// the chunk's decode pages (empty: through the ring).
#[derive(Debug)]
pub struct Granted {
    pub grant: Grant,
    pub region: u64,
    pub pages: Vec<u32>,
}

/// Where one slice payload lands in the pool: buffer, token slot and byte within the slot.
#[derive(Debug)]
pub struct SliceLease {
    conn: ConnId,
    room: u64,
    gen: u64,
    chunk: u32,
    /// Index of the connection's slot in the chunk.
    slot: u32,
    token: u32,
    pub buffer: u32,
    pub pool_slot: u64,
    pub byte_offset: u64,
    pub len: u64,
}

/// Layers of a chunk whose slabs all landed: scatter them from the ring into the room's pages.
#[derive(Clone, Debug)]
pub struct ScatterJob {
    pub room: u64,
    gen: u64,
    pub chunk: u32,
    grant: u64,
    pub ring_offset: u64,
    pub pages: Vec<u32>,
    /// The chunk's layout with every region placed.
    pub layout: StagingLayout,
    /// The model layer ids to scatter (possibly none: the last job of a chunk whose layers all
    /// went before its writers' ready).
    pub layers: Vec<u32>,
    /// The chunk's last scatter, queued when its last writer arrived.
    pub last: bool,
    /// The last scatter's: when the last writer arrived (stamped by the connection that read it).
    pub arrived: Option<Instant>,
    /// When the scatter ended (set by the scatter thread before `scatter_done`).
    pub finished: Option<Instant>,
    /// The room's parts, on the last scatter of a chunk whose regions carry them.
    pub parts: Option<Arc<RoomParts>>,
    /// Regions (indices in the layout) written or read straight into the pool: not scattered.
    pub in_pool: Vec<u32>,
}

/// What a data frame's target turned out to be.
#[derive(Debug)]
pub enum Target<L> {
    /// Read the payload here.
    Land(L),
    /// The room was released or failed (or is unknown): read and discard the payload.
    Discard(Error),
}

/// What the I/O around the state must do once the lock is dropped.
#[derive(Default, Debug)]
pub struct Effects {
    /// Broadcast this watermark to every sender.
    pub watermark: Option<Watermark>,
    /// Run these scatters.
    pub scatter: Vec<ScatterJob>,
    /// Wake waiters (room_wait, room_release).
    pub changed: bool,
    /// Chunk events queued by this call (to signal completion listeners).
    pub events: Vec<ChunkEvent>,
    /// Rooms this call failed, and why (for the log).
    pub failed: Vec<(u64, Failure)>,
    /// Chunk events this call dropped because the queue was full (for the log).
    pub events_dropped: u64,
    /// Aux rows to write (rooms whose everything else is in place).
    pub aux: Vec<AuxWrite>,
}

/// Outcome of releasing a room.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// Gone: no kvstage thread will touch its pages again.
    Done,
    /// Leases remain; the connections holding them (a stuck one may be shut down).
    Draining { gen: u64, holders: Vec<ConnId> },
}

/// Counters of the receiver's bounded structures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub events_dropped: u64,
    pub rooms_expired: u64,
}

pub struct State {
    ring: Option<Ring>,
    grants: HashMap<u64, GrantState>,
    rooms: HashMap<u64, Room>,
    conns: HashMap<ConnId, ConnInfo>,
    /// Connections being cut at the connection limit ([`State::cut_idle`]).
    cutting: std::collections::HashSet<ConnId>,
    /// Connections (live or gone) whose peer maps the ring, with the ring they map (its
    /// registration number): their quarantines outlive them.
    mapped: HashMap<ConnId, u64>,
    /// Registrations of a staging ring so far (the current ring's number).
    ring_registrations: u64,
    events: VecDeque<ChunkEvent>,
    max_events: usize,
    next_conn: ConnId,
    next_gen: u64,
    counters: Counters,
    metrics: ReceiveStats,
    fx: Effects,
}

fn protocol(why: impl Into<String>) -> Error {
    Error::new(Status::KVSTAGE_E_PROTOCOL, why)
}

/// A frame or lease for an opening of `room` that is not open (released, maybe opened again for
/// another request, or a key never issued). Whether the id is open now, and its key, are not
/// said: a guesser learns nothing.
/// A decode caller's room call names an opening that is not open.
pub fn not_open(room: u64) -> Error {
    Error::new(
        Status::KVSTAGE_E_STALE_ROOM,
        format!("room {room} is not open under this key (released, or the id was opened again for another request)"),
    )
}

fn stale(room: u64) -> Error {
    Error::new(
        Status::KVSTAGE_E_STALE_ROOM,
        format!(
            "room {room}: the room key names no open opening of it (the decode side released the room this transfer was for, or the key is wrong; nothing was written)"
        ),
    )
}

fn mismatch(field: &str, ours: u32, theirs: u32) -> Option<FieldMismatch> {
    (ours != theirs).then(|| FieldMismatch { field: field.into(), local: ours.to_string(), remote: theirs.to_string() })
}

/// Fields every prefill writer of one room must share (ranks and layer ids legitimately differ).
fn prefill_diff(first: &PoolShape, other: &PoolShape) -> Vec<FieldMismatch> {
    [
        mismatch("tp_size", first.tp_size, other.tp_size),
        mismatch("pp_size", first.pp_size, other.pp_size),
        mismatch("local_heads", first.local_heads, other.local_heads),
        mismatch("global_heads", first.global_heads, other.global_heads),
        mismatch("head_dim", first.head_dim, other.head_dim),
        mismatch("dtype_bytes", first.dtype_bytes, other.dtype_bytes),
        mismatch("page_size", first.page_size, other.page_size),
        mismatch("model_kind", first.kind as u32, other.kind as u32),
    ]
    .into_iter()
    .flatten()
    .collect()
}

impl State {
    pub fn new(max_events: usize) -> State {
        State {
            ring: None,
            grants: HashMap::new(),
            rooms: HashMap::new(),
            conns: HashMap::new(),
            cutting: Default::default(),
            mapped: HashMap::new(),
            ring_registrations: 0,
            events: VecDeque::new(),
            max_events,
            next_conn: 1,
            next_gen: 1,
            counters: Counters::default(),
            metrics: ReceiveStats::default(),
            fx: Effects::default(),
        }
    }

    /// What the caller must do after this call's lock is dropped.
    pub fn take_effects(&mut self) -> Effects {
        std::mem::take(&mut self.fx)
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Bytes and chunks received, scatter times and the ring's high-water mark.
    pub fn metrics(&self) -> ReceiveStats {
        self.metrics
    }

    /// Current span of the ring held by live allocations (see [`Ring::occupied`]).
    pub fn ring_used(&self) -> u64 {
        self.ring.as_ref().map_or(0, |r| r.occupied())
    }

    // --- ring ------------------------------------------------------------------------------------

    /// Installs a new ring of `capacity` bytes. Refused while any allocation of the old one is live
    /// (pinned or quarantined ones included: a write may still land in the old memory).
    pub fn register_ring(&mut self, capacity: u64) -> Result<()> {
        if let Some(r) = &self.ring {
            if r.live_count() > 0 {
                return Err(Error::invalid_arg(
                    "staging",
                    format!("the staging ring has {} live allocations; release rooms first", r.live_count()),
                ));
            }
        }
        // Rounds go on from the old ring's: senders keep the highest watermark they saw, so a
        // new ring restarting at round 0 would let them write grants that overlap live ones.
        let ring = match &self.ring {
            Some(old) => Ring::starting_at(capacity, old.watermark().round + 1),
            None => Ring::new(capacity),
        };
        self.fx.watermark = Some(ring.watermark());
        self.ring = Some(ring);
        self.ring_registrations += 1;
        // The high-water mark is the current ring's (an old, larger ring's would exceed it).
        self.metrics.ring_high_water = 0;
        Ok(())
    }

    /// (capacity, live allocations, watermark).
    pub fn ring_stats(&self) -> (u64, u64, Watermark) {
        self.ring.as_ref().map_or((0, 0, Watermark::default()), |r| (r.capacity(), r.live_count() as u64, r.watermark()))
    }

    fn watermark(&self) -> Watermark {
        self.ring.as_ref().map(|r| r.watermark()).unwrap_or_default()
    }

    /// Marks a grant no longer needed and returns it to the ring once nothing can write into it.
    fn retire_grant(&mut self, id: u64) {
        if let Some(g) = self.grants.get_mut(&id) {
            g.freeing = true;
        }
        self.maybe_free(id);
    }

    fn maybe_free(&mut self, id: u64) {
        let Some(g) = self.grants.get(&id) else { return };
        if !g.freeing || !g.pins.is_empty() || !g.remote_writers.is_empty() {
            return;
        }
        self.grants.remove(&id);
        if let Some(w) = self.ring.as_mut().and_then(|r| r.free(id)) {
            self.fx.watermark = Some(w);
        }
        self.fx.changed = true;
    }

    fn unpin(&mut self, id: u64, holder: Option<ConnId>) {
        if let Some(g) = self.grants.get_mut(&id) {
            if let Some(pos) = g.pins.iter().position(|p| *p == holder) {
                g.pins.swap_remove(pos);
            }
        }
        self.maybe_free(id);
    }

    // --- connections -----------------------------------------------------------------------------

    pub fn add_conn(&mut self, info: ConnInfo) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(id, info);
        id
    }

    /// `conn`'s chunks are written in place from now on. `mapped`: through a mapping of the ring
    /// that can outlive the connection (same host), ended only by [`State::unmapped`]; otherwise
    /// (RDMA) the writes end with the connection, whose queue pairs go first.
    pub fn set_in_place(&mut self, conn: ConnId, mapped: bool) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.in_place = true;
            if mapped {
                self.mapped.insert(conn, self.ring_registrations);
            }
        }
    }

    /// `conn`'s peer maps our KV pool too (direct mode): it may ask for direct grants.
    pub fn set_direct(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.direct = true;
        }
    }

    /// Whether `conn` was set to write in place (RDMA, or a same-host mapping, now or before).
    pub fn writes_in_place(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| c.in_place)
    }

    /// `Err` when `conn` maps a ring that was replaced since (its session must reconnect).
    pub fn check_mapping(&self, conn: ConnId) -> Result<()> {
        match self.mapped.get(&conn) {
            Some(&ring) if ring != self.ring_registrations => Err(Error::new(
                Status::KVSTAGE_E_PEER_GONE,
                "the staging ring was registered again since this session mapped it; reconnect to map the new one",
            )),
            _ => Ok(()),
        }
    }

    /// Live connections whose peer maps the ring.
    pub fn mapped_conns(&self) -> Vec<ConnId> {
        self.mapped.keys().copied().filter(|c| self.conns.contains_key(c)).collect()
    }

    /// The peer of `conn` no longer maps the ring (its lease socket closed): nothing it writes
    /// can land any more, so every quarantine it holds ends.
    pub fn unmapped(&mut self, conn: ConnId) {
        if self.mapped.remove(&conn).is_none() {
            return;
        }
        self.end_quarantine(conn, |_| true);
        self.end_direct_writes(conn);
    }

    /// `conn`'s peer can no longer write any room's pages directly.
    fn end_direct_writes(&mut self, conn: ConnId) {
        let held: Vec<u64> = self.rooms.iter().filter(|(_, r)| r.direct_writers.iter().any(|&(w, _)| w == conn)).map(|(id, _)| *id).collect();
        for room in held {
            if let Some(r) = self.rooms.get_mut(&room) {
                r.direct_writers.retain(|&(w, _)| w != conn);
            }
            self.drain_check(room);
        }
        self.fx.changed = true;
    }

    /// `conn` can no longer write in place into the grants `of` selects: their quarantine by it
    /// ends (each goes back to the ring once nothing else holds it).
    fn end_quarantine(&mut self, conn: ConnId, of: impl Fn(&GrantState) -> bool) {
        let held: Vec<u64> = self.grants.iter().filter(|(_, g)| g.remote_writers.contains(&conn) && of(g)).map(|(id, _)| *id).collect();
        for id in held {
            if let Some(g) = self.grants.get_mut(&id) {
                g.remote_writers.retain(|&c| c != conn);
            }
            self.maybe_free(id);
        }
    }

    /// Whether cutting `conn` would fail or hold up nothing: it wrote to no live room that is not
    /// complete yet (its connection ending would fail such a room, see [`State::conn_gone`]), has
    /// no grant pin or in-place quarantine, no page lease or direct write, and does not map the
    /// ring.
    pub fn holds_nothing(&self, conn: ConnId) -> bool {
        let writes = |r: &Room| r.live() && !r.complete() && r.chunks.iter().any(|c| c.slot_of(conn).is_some());
        self.conns.contains_key(&conn)
            && !self.mapped.contains_key(&conn)
            && !self.grants.values().any(|g| g.pins.contains(&Some(conn)) || g.remote_writers.contains(&conn))
            && !self.rooms.values().any(|r| writes(r) || r.holders().contains(&conn))
    }

    /// The first of `candidates` (in order) that holds nothing, marked as being cut: from now on
    /// it claims nothing (no grant, no slice write), so it still holds nothing when its socket is
    /// shut down after the state's lock is dropped.
    pub fn cut_idle(&mut self, candidates: &[ConnId]) -> Option<ConnId> {
        let victim = candidates.iter().copied().find(|&c| !self.cutting.contains(&c) && self.holds_nothing(c))?;
        self.cutting.insert(victim);
        Some(victim)
    }

    /// `conn`'s handshake, unless it is being cut (then it claims nothing new).
    fn claimant(&self, conn: ConnId) -> Result<&ConnInfo> {
        if self.cutting.contains(&conn) {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "this session is being cut to serve a newcomer at the connection limit (it held nothing); reconnect"));
        }
        self.conn(conn)
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// A connection ended (and, for RDMA, its queue pairs are destroyed: nothing more can land).
    /// Every room it wrote to fails when it still owes a chunk (a waiting chunk it has not
    /// finished, unless others carry its layers of it): a prefill rank writes every chunk of a
    /// request over one session. Its leases are released, and its quarantines unless its peer
    /// still maps the ring (then [`State::unmapped`] ends them).
    pub fn conn_gone(&mut self, conn: ConnId, code: Status, reason: &str) {
        self.cutting.remove(&conn);
        let Some(info) = self.conns.remove(&conn) else { return };
        // A replica of heads another rank sends owes only the parts it claimed to carry.
        let replica = info.pairing.writer.is_none();
        let wrote = |c: &Chunk| c.slot_of(conn).is_some();
        // A chunk it has no slot in is owed unless other connections carry all of its layers.
        let owes = |c: &Chunk| {
            c.phase == Phase::Waiting
                && match (c.slot_of(conn), &c.layout) {
                    (Some((_, s)), _) => !s.arrived,
                    (None, _) if replica => false,
                    (None, None) => true,
                    (None, Some(l)) => l.region_of(&info.src).ok().flatten().is_none_or(|r| !l.carries(&r)),
                }
        };
        let affected: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.chunks.iter().any(wrote) && r.chunks.iter().any(owes))
            .map(|(id, _)| *id)
            .collect();
        for room in affected {
            self.fail_room(room, code, format!("a sender disconnected before delivering every chunk: {reason}"), &info.session);
        }
        // Its leases end with it (also those of a reader that panicked mid-payload).
        let pinned: Vec<u64> = self.grants.iter().filter(|(_, g)| g.pins.contains(&Some(conn))).map(|(id, _)| *id).collect();
        for id in pinned {
            if let Some(g) = self.grants.get_mut(&id) {
                g.pins.retain(|&p| p != Some(conn));
            }
            self.maybe_free(id);
        }
        if !self.mapped.contains_key(&conn) {
            self.end_quarantine(conn, |_| true);
            self.end_direct_writes(conn);
        }
        let leased: Vec<u64> =
            self.rooms.iter().filter(|(_, r)| r.page_leases.contains(&Some(conn))).map(|(id, _)| *id).collect();
        for room in leased {
            if let Some(r) = self.rooms.get_mut(&room) {
                r.page_leases.retain(|&l| l != Some(conn));
            }
            self.drain_check(room);
        }
        self.fx.changed = true;
    }

    fn conn(&self, conn: ConnId) -> Result<&ConnInfo> {
        self.conns.get(&conn).ok_or_else(|| Error::internal(format!("connection {conn} is not registered")))
    }

    // --- rooms -----------------------------------------------------------------------------------

    /// Opens `room` over `pages`, `grid_pages` pages a chunk, as the opening `key` (nonzero, unique
    /// to this opening: frames must name it). A room id still open, or still being released, is
    /// refused.
    pub fn open_room(&mut self, room: u64, key: u64, open: OpenRoom, expires: Option<Instant>) -> Result<u32> {
        let OpenRoom { pages, grid_pages, prefix_tokens, parts, trace } = open;
        let pages = pages.as_slice();
        if key == 0 {
            return Err(Error::internal("room key 0 (keys are nonzero)"));
        }
        if pages.is_empty() {
            return Err(Error::invalid_arg("desc->num_pages", "0 (a room needs at least one page)"));
        }
        if grid_pages == 0 {
            return Err(Error::invalid_arg("chunk_tokens", "gives chunks of 0 pages"));
        }
        if let Some(r) = self.rooms.get(&room) {
            let why = if r.released { "is still being released" } else { "is already open" };
            return Err(Error::invalid_arg("desc->room", format!("{room} {why}")));
        }
        let num_chunks = pages.len().div_ceil(grid_pages);
        let chunk = Chunk {
            phase: Phase::Waiting,
            mode: Mode::Unset,
            grant: None,
            layout: None,
            slots: Vec::new(),
            layers_taken: Vec::new(),
            scatters: 0,
            arrived: None,
        };
        let gen = self.next_gen;
        self.next_gen += 1;
        self.rooms.insert(
            room,
            Room {
                gen,
                key,
                trace_named: trace.is_some(),
                trace: trace.unwrap_or_else(|| crate::protocol::trace::derived_trace(RoomRef { id: room, key })),
                pages: pages.to_vec(),
                prefix_tokens,
                grid_pages,
                chunks: vec![chunk; num_chunks],
                failure: None,
                released: false,
                prefill: None,
                page_leases: Vec::new(),
                direct_writers: Vec::new(),
                expires,
                aux: Aux::for_room(parts.as_deref()),
                parts,
                held_event: None,
            },
        );
        Ok(num_chunks as u32)
    }

    /// `Ok(true)`: every chunk scattered; `Ok(false)`: still in progress; `Err`: failed, released
    /// or another opening.
    pub fn room_outcome(&self, at: RoomRef) -> Result<bool> {
        let room = at.id;
        match self.rooms.get(&room).filter(|r| r.key == at.key) {
            Some(r) if r.released => Err(Error::new(Status::KVSTAGE_E_CANCELED, format!("room {room} was released"))),
            Some(r) => match &r.failure {
                Some(f) => Err(Error::new(f.code, format!("room {room} failed: {}", f.why)).with_session(&f.session)),
                None => Ok(r.complete()),
            },
            None => Err(not_open(room)),
        }
    }

    /// A copy of a chunk's layout to claim in (committed by the caller), or a fresh one for its
    /// first writer.
    fn chunk_layout(c: &Chunk, info: &ConnInfo, tokens: u32) -> Result<StagingLayout> {
        c.layout.clone().map_or_else(|| geometry::staging_layout(&info.src, &info.dst, tokens), Ok)
    }

    /// Places `info`'s region in `layout` (a copy of a chunk's, committed by the caller). A
    /// second connection claiming the same prefill rank is refused (an impostor or a duplicate:
    /// the room goes on); a *different* prefill rank claiming a layer of the same heads means the
    /// two sides disagree on the pipeline split and either copy may be the wrong layer, so the room
    /// fails as well.
    fn claim(&mut self, room: u64, layout: &mut StagingLayout, info: &ConnInfo, tail: Vec<geometry::TailPart>) -> Result<u32> {
        let clash = layout.region_of(&info.src)?.and_then(|r| {
            layout.overlap(&r).map(|(other, _)| (other.src_tp_rank, other.src_pp_rank) != (info.src.tp_rank, info.src.pp_rank))
        });
        let placed = match info.pairing.writer {
            Some(_) => layout.place_with_tail(&info.src, tail),
            None => layout.place_tail_only(&info.src, tail),
        };
        match placed {
            Err(e) if clash == Some(true) => {
                self.fail_room(room, e.code(), e.chain(), &info.session);
                Err(e)
            }
            placed => placed,
        }
    }

    /// A writer names the request's trace id (its allocation request carries the prefill
    /// caller's): the room takes the first one named, in place of the derived id. A malformed one
    /// is refused (`KVSTAGE_E_PROTOCOL`); an opening that is not open is `KVSTAGE_E_STALE_ROOM`.
    pub fn name_trace(&mut self, at: RoomRef, trace: &str) -> Result<()> {
        self.live_room(at)?;
        crate::protocol::trace::check_trace(trace).map_err(|why| protocol(format!("trace id {trace:?}: {why}")))?;
        let r = self.rooms.get_mut(&at.id).expect("live");
        if !r.trace_named {
            (r.trace, r.trace_named) = (trace.to_owned(), true);
        }
        Ok(())
    }

    /// The chunk grid of open `room` as `conn` sees it.
    pub fn room_grid(&self, conn: ConnId, room: RoomRef) -> Result<RoomGrid> {
        let page_size = self.conn(conn)?.dst.page_size;
        Ok(self.live_room(room)?.grid(page_size))
    }

    pub fn room_progress(&self, room: u64) -> String {
        self.rooms.get(&room).map_or_else(|| "room gone".to_owned(), Room::done_text)
    }

    /// Releases the opening `at`: its ring space goes back (deferred while written into), its
    /// pages are returned to the caller once no lease on them is left. Idempotent; another
    /// opening of the id (the request it was opened for next) is not touched.
    pub fn release_room(&mut self, at: RoomRef) -> Release {
        let room = at.id;
        let Some(r) = self.rooms.get_mut(&room).filter(|r| r.key == at.key) else { return Release::Done };
        r.released = true;
        // Its queued events go too: a reopened room must not report the old request's chunks.
        self.events.retain(|e| e.room != room);
        let grants: Vec<u64> = r.chunks.iter_mut().filter(|c| c.phase != Phase::Scattering).filter_map(|c| c.grant.take()).collect();
        for id in grants {
            self.retire_grant(id);
        }
        self.fx.changed = true;
        self.drain_check(room)
    }

    /// Whether the release of (`room`, `gen`) is still waiting for leases.
    pub fn draining(&self, room: u64, gen: u64) -> Option<Vec<ConnId>> {
        let r = self.rooms.get(&room).filter(|r| r.gen == gen && r.released)?;
        Some(r.holders())
    }

    fn drain_check(&mut self, room: u64) -> Release {
        let Some(r) = self.rooms.get(&room) else { return Release::Done };
        if !r.released {
            return Release::Done;
        }
        if r.page_leases.is_empty() && r.direct_writers.is_empty() {
            self.rooms.remove(&room);
            self.fx.changed = true;
            return Release::Done;
        }
        Release::Draining { gen: r.gen, holders: r.holders() }
    }

    /// Fails a live room: its ring space goes back, every unfinished chunk is reported failed.
    pub fn fail_room(&mut self, room: u64, code: Status, why: String, session: &str) {
        let Some(r) = self.rooms.get_mut(&room) else { return };
        if !r.live() || r.complete() {
            return;
        }
        let failure = Failure { code, why, session: session.to_owned(), trace: r.trace.clone() };
        self.fx.failed.push((room, failure.clone()));
        r.failure = Some(failure);
        let mut grants = Vec::new();
        let mut events = Vec::new();
        for (i, c) in r.chunks.iter_mut().enumerate() {
            if c.phase != Phase::Scattering {
                grants.extend(c.grant.take());
            }
            if c.phase != Phase::Done {
                events.push(ChunkEvent::chunk(room, r.key, i as u32, code, r.trace.as_str().into(), 0));
            }
        }
        // The chunk held for the aux rows is not done either.
        events.extend(r.held_event.take().map(|e| ChunkEvent { status: code, scatter_ns: 0, ..e }));
        // Then the whole request's.
        events.push(ChunkEvent::room_done(room, r.key, r.chunks.len() as u32, code, r.trace.as_str().into()));
        for id in grants {
            self.retire_grant(id);
        }
        for e in events {
            self.queue_event(e);
        }
        self.fx.changed = true;
    }

    /// Fails every live room whose deadline passed (`TIMEOUT`).
    pub fn expire(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.live() && !r.complete() && r.expires.is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for room in due {
            let done = self.room_progress(room);
            self.fail_room(room, Status::KVSTAGE_E_TIMEOUT, format!("the room's deadline passed ({done})"), "");
            self.counters.rooms_expired += 1;
        }
    }

    /// Queues a chunk's event; the chunk that completes its room is followed by the room's.
    fn push_event(&mut self, e: ChunkEvent) {
        let completes = e.kind == EventKind::Chunk
            && e.status == Status::KVSTAGE_OK
            && self.rooms.get(&e.room).is_some_and(|r| r.key == e.key && r.live() && r.complete());
        let room_event = completes.then(|| {
            let r = &self.rooms[&e.room];
            ChunkEvent::room_done(e.room, e.key, r.chunks.len() as u32, Status::KVSTAGE_OK, e.trace.clone())
        });
        self.queue_event(e);
        if let Some(r) = room_event {
            self.queue_event(r);
        }
    }

    fn queue_event(&mut self, e: ChunkEvent) {
        if self.events.len() >= self.max_events {
            self.counters.events_dropped += 1;
            self.fx.events_dropped += 1;
        } else {
            self.fx.events.push(e.clone());
            self.events.push_back(e);
        }
    }

    /// Up to `max` queued events, oldest first: of one opening, or of every room for `None`.
    pub fn take_events(&mut self, room: Option<RoomRef>, max: usize) -> Vec<ChunkEvent> {
        let Some(at) = room else {
            let n = max.min(self.events.len());
            return self.events.drain(..n).collect();
        };
        let mut taken = Vec::new();
        self.events.retain(|e| {
            let take = e.room == at.id && e.key == at.key && taken.len() < max;
            if take {
                taken.push(e.clone());
            }
            !take
        });
        taken
    }

    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// The room a frame names, when it can still take data; otherwise why not (no error for the
    /// session: a late frame for a released, failed or reopened room, or for another opening, is
    /// discarded).
    fn live_room(&self, at: RoomRef) -> std::result::Result<&Room, Error> {
        match self.rooms.get(&at.id) {
            Some(r) if r.key == at.key && r.live() => Ok(r),
            Some(r) if r.key == at.key => Err(self.closed(at.id)),
            _ => Err(stale(at.id)),
        }
    }

    /// Why the open room under id `room` takes no more data: its failure (the other senders of
    /// the request fail fast with the same code), or its release.
    fn closed(&self, room: u64) -> Error {
        match self.rooms.get(&room) {
            Some(Room { failure: Some(f), .. }) => Error::new(f.code, format!("room {room} failed: {}", f.why)),
            _ => stale(room),
        }
    }

    /// Whether the opening `at` is open (not released; failed or not).
    pub fn is_open(&self, at: RoomRef) -> bool {
        self.rooms.get(&at.id).is_some_and(|r| r.key == at.key && !r.released)
    }

    /// Checks that a writer of this room shares the prefill geometry of the room's first writer.
    fn check_prefill(&self, room: u64, src: &PoolShape) -> Result<()> {
        let Some(first) = self.rooms.get(&room).and_then(|r| r.prefill.as_ref()) else { return Ok(()) };
        let diff = prefill_diff(first, src);
        if diff.is_empty() {
            return Ok(());
        }
        Err(geometry::mismatch_error(&format!("room {room}: this sender's prefill geometry differs from the room's first sender"), diff))
    }

    /// The room's prefill geometry, set by its first accepted writer (a refused request sets none).
    fn record_prefill(&mut self, room: u64, src: &PoolShape) {
        if let Some(r) = self.rooms.get_mut(&room) {
            r.prefill.get_or_insert_with(|| src.clone());
        }
    }
}

#[cfg(test)]
mod tests;
