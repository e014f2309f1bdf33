//! The decode side's bookkeeping as one plain state machine: rooms, chunks, writer slots, grants,
//! leases and events. No I/O, no threads, no clock of its own: the receiver calls it under one
//! lock, does the I/O it allows outside the lock, and reports back.
//!
//! Rules it keeps (ARCHITECTURE.md):
//! - a writer slot belongs to the connection that claimed it; every frame naming it is checked
//!   against that connection;
//! - a ring range is returned to the ring only when no write into it can happen: a payload read in
//!   progress pins its grant, an RDMA grant stays quarantined while its writer may still write;
//! - a released room leaves only when no lease on its pages (slice reads, scatter) is left, and its
//!   id can be opened again only then; stale leases name the room's generation, never a newer room;
//! - events are bounded (overflow is counted).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::coverage::Coverage;
use crate::error::{Error, FieldMismatch, Result, Status};
use crate::geometry::{self, PoolShape, StagingLayout};
use crate::ring::{Grant, Ring, Watermark};
use crate::session::Pairing;

pub type ConnId = u64;

/// What the handshake established about a connection.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub session: String,
    /// The sender's pool shape and ours at the handshake.
    pub src: PoolShape,
    pub dst: PoolShape,
    pub pairing: Pairing,
    /// Chunks arrive by RDMA WRITE: grants stay quarantined until the writer is done with them.
    pub rdma: bool,
    /// Our pool is host memory (the slice path writes it from the CPU: host pools only).
    pub host_pool: bool,
}

/// One completed or failed chunk, as reported to the decode caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkEvent {
    pub room: u64,
    pub chunk: u32,
    pub status: Status,
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

#[derive(Clone, Debug)]
struct Slot {
    conn: ConnId,
    shape: PoolShape,
    /// Staged: bytes landed contiguously from the region's start.
    received: u64,
    /// Slice path: rows landed.
    coverage: Option<Coverage>,
    arrived: bool,
}

#[derive(Clone, Debug)]
struct Chunk {
    phase: Phase,
    mode: Mode,
    grant: Option<u64>,
    layout: Option<StagingLayout>,
    slots: Vec<Option<Slot>>,
}

#[derive(Clone, Debug)]
pub struct Failure {
    pub code: Status,
    pub why: String,
    pub session: String,
}

#[derive(Clone, Debug)]
struct Room {
    gen: u64,
    pages: Vec<u32>,
    grid_pages: usize,
    chunks: Vec<Chunk>,
    failure: Option<Failure>,
    released: bool,
    /// Prefill geometry every writer of the room must share (set by the first writer).
    prefill: Option<PoolShape>,
    /// Leases on the room's pool pages: slice reads by connection, and running scatters.
    page_leases: Vec<Option<ConnId>>,
    expires: Option<Instant>,
}

impl Room {
    fn chunk_pages(&self, chunk: u32) -> &[u32] {
        let start = chunk as usize * self.grid_pages;
        &self.pages[start..(start + self.grid_pages).min(self.pages.len())]
    }

    fn complete(&self) -> bool {
        self.chunks.iter().all(|c| c.phase == Phase::Done)
    }

    fn live(&self) -> bool {
        !self.released && self.failure.is_none()
    }

    fn done_text(&self) -> String {
        format!("{} of {} chunks done", self.chunks.iter().filter(|c| c.phase == Phase::Done).count(), self.chunks.len())
    }
}

/// A ring allocation and who may still write into it.
#[derive(Clone, Debug)]
struct GrantState {
    grant: Grant,
    /// The chunk it was granted for (an RDMA writer's abort or ready names it).
    room: u64,
    chunk: u32,
    /// Payload reads (by connection) and scatters (`None`) using it right now.
    pins: Vec<Option<ConnId>>,
    /// RDMA writers that may still write into it (quarantine).
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
    writer: u32,
    /// Where the payload lands in the ring, and how many bytes.
    pub ring_offset: u64,
    pub len: u64,
}

/// A writer's finished region, checked (checksum) outside the lock before it counts as arrived.
#[derive(Debug)]
pub struct ReadyLease {
    conn: ConnId,
    grant: u64,
    room: u64,
    gen: u64,
    chunk: u32,
    writer: u32,
    pub ring_offset: u64,
    pub len: u64,
}

/// Where one slice payload lands in the pool: buffer, token slot and byte within the slot.
#[derive(Debug)]
pub struct SliceLease {
    conn: ConnId,
    room: u64,
    gen: u64,
    chunk: u32,
    writer: u32,
    token: u32,
    pub buffer: u32,
    pub slot: u64,
    pub byte_offset: u64,
    pub len: u64,
}

/// A chunk whose writers all arrived: scatter it from the ring into the room's pages.
#[derive(Clone, Debug)]
pub struct ScatterJob {
    pub room: u64,
    gen: u64,
    pub chunk: u32,
    grant: u64,
    pub ring_offset: u64,
    pub pages: Vec<u32>,
    pub layout: StagingLayout,
    /// The writers' pool shapes, in slot order.
    pub writers: Vec<PoolShape>,
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
    events: VecDeque<ChunkEvent>,
    max_events: usize,
    next_conn: ConnId,
    next_gen: u64,
    counters: Counters,
    fx: Effects,
}

fn protocol(why: impl Into<String>) -> Error {
    Error::new(Status::KVSTAGE_E_PROTOCOL, why)
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

/// Why slices for this chunk cannot be taken (the stream stays in sync: they are discarded).
fn slices_refused(info: &ConnInfo, c: &Chunk, room: u64, chunk: u32) -> Option<Error> {
    if !info.host_pool {
        return Some(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the slice path writes the KV pool from the CPU: host pools only"));
    }
    (c.mode == Mode::Staged).then(|| {
        Error::new(
            Status::KVSTAGE_E_UNSUPPORTED,
            format!("chunk {chunk} of room {room} is being sent staged; one chunk cannot mix paths"),
        )
    })
}

impl State {
    pub fn new(max_events: usize) -> State {
        State {
            ring: None,
            grants: HashMap::new(),
            rooms: HashMap::new(),
            conns: HashMap::new(),
            events: VecDeque::new(),
            max_events,
            next_conn: 1,
            next_gen: 1,
            counters: Counters::default(),
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
        self.ring = Some(Ring::new(capacity));
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

    pub fn set_rdma(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.rdma = true;
        }
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// A connection ended (and, for RDMA, its queue pairs are destroyed: nothing more can land).
    /// Every room it wrote to and has not delivered fails; its quarantined grants are released.
    pub fn conn_gone(&mut self, conn: ConnId, code: Status, reason: &str) {
        let Some(info) = self.conns.remove(&conn) else { return };
        let owes = |c: &Chunk| {
            c.phase == Phase::Waiting && c.slots.iter().flatten().any(|s| s.conn == conn && !s.arrived)
        };
        let affected: Vec<u64> = self.rooms.iter().filter(|(_, r)| r.chunks.iter().any(owes)).map(|(id, _)| *id).collect();
        for room in affected {
            self.fail_room(room, code, format!("a sender disconnected before delivering every chunk: {reason}"), &info.session);
        }
        // Its leases end with it (also those of a reader that panicked mid-payload).
        let held: Vec<u64> = self
            .grants
            .iter()
            .filter(|(_, g)| g.remote_writers.contains(&conn) || g.pins.contains(&Some(conn)))
            .map(|(id, _)| *id)
            .collect();
        for id in held {
            if let Some(g) = self.grants.get_mut(&id) {
                g.remote_writers.retain(|&c| c != conn);
                g.pins.retain(|&p| p != Some(conn));
            }
            self.maybe_free(id);
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

    /// Opens `room` over `pages`, `grid_pages` pages a chunk. A room id still open, or still being
    /// released, is refused.
    pub fn open_room(&mut self, room: u64, pages: &[u32], grid_pages: usize, expires: Option<Instant>) -> Result<u32> {
        if pages.is_empty() {
            return Err(Error::invalid_arg("num_pages", "0 (a room needs at least one page)"));
        }
        if grid_pages == 0 {
            return Err(Error::invalid_arg("chunk_tokens", "gives chunks of 0 pages"));
        }
        if let Some(r) = self.rooms.get(&room) {
            let why = if r.released { "is still being released" } else { "is already open" };
            return Err(Error::invalid_arg("room", format!("{room} {why}")));
        }
        let num_chunks = pages.len().div_ceil(grid_pages);
        let chunk = Chunk { phase: Phase::Waiting, mode: Mode::Unset, grant: None, layout: None, slots: Vec::new() };
        let gen = self.next_gen;
        self.next_gen += 1;
        self.rooms.insert(
            room,
            Room {
                gen,
                pages: pages.to_vec(),
                grid_pages,
                chunks: vec![chunk; num_chunks],
                failure: None,
                released: false,
                prefill: None,
                page_leases: Vec::new(),
                expires,
            },
        );
        Ok(num_chunks as u32)
    }

    /// `Ok(true)`: every chunk scattered; `Ok(false)`: still in progress; `Err`: failed or unknown.
    pub fn room_outcome(&self, room: u64) -> Result<bool> {
        match self.rooms.get(&room) {
            Some(r) if r.released => Err(Error::invalid_arg("room", format!("{room} was released"))),
            Some(r) => match &r.failure {
                Some(f) => Err(Error::new(f.code, format!("room {room} failed: {}", f.why)).with_session(&f.session)),
                None => Ok(r.complete()),
            },
            None => Err(Error::invalid_arg("room", format!("{room} is not open"))),
        }
    }

    pub fn room_progress(&self, room: u64) -> String {
        self.rooms.get(&room).map_or_else(|| "room gone".to_owned(), Room::done_text)
    }

    /// Releases a room: its ring space goes back (deferred while written into), its pages are
    /// returned to the caller once no lease on them is left. Idempotent.
    pub fn release_room(&mut self, room: u64) -> Release {
        let Some(r) = self.rooms.get_mut(&room) else { return Release::Done };
        r.released = true;
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
        Some(r.page_leases.iter().flatten().copied().collect())
    }

    fn drain_check(&mut self, room: u64) -> Release {
        let Some(r) = self.rooms.get(&room) else { return Release::Done };
        if !r.released {
            return Release::Done;
        }
        if r.page_leases.is_empty() {
            self.rooms.remove(&room);
            self.fx.changed = true;
            return Release::Done;
        }
        Release::Draining { gen: r.gen, holders: r.page_leases.iter().flatten().copied().collect() }
    }

    /// Fails a live room: its ring space goes back, every unfinished chunk is reported failed.
    pub fn fail_room(&mut self, room: u64, code: Status, why: String, session: &str) {
        let Some(r) = self.rooms.get_mut(&room) else { return };
        if !r.live() || r.complete() {
            return;
        }
        r.failure = Some(Failure { code, why, session: session.to_owned() });
        let mut grants = Vec::new();
        let mut events = Vec::new();
        for (i, c) in r.chunks.iter_mut().enumerate() {
            if c.phase != Phase::Scattering {
                grants.extend(c.grant.take());
            }
            if c.phase != Phase::Done {
                events.push(ChunkEvent { room, chunk: i as u32, status: code });
            }
        }
        for id in grants {
            self.retire_grant(id);
        }
        for e in events {
            self.push_event(e);
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

    fn push_event(&mut self, e: ChunkEvent) {
        if self.events.len() >= self.max_events {
            self.counters.events_dropped += 1;
        } else {
            self.events.push_back(e);
        }
    }

    pub fn take_events(&mut self, max: usize) -> Vec<ChunkEvent> {
        let n = max.min(self.events.len());
        self.events.drain(..n).collect()
    }

    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// The room a frame names, when it can still take data; otherwise why not (no error for the
    /// session: a late frame for a released, failed or reopened room is discarded).
    fn live_room(&self, room: u64) -> std::result::Result<&Room, Error> {
        match self.rooms.get(&room) {
            Some(r) if r.live() => Ok(r),
            Some(r) => Err(match &r.failure {
                Some(f) => Error::new(f.code, format!("room {room} failed: {}", f.why)),
                None => Error::new(Status::KVSTAGE_E_CANCELED, format!("room {room} was released by the receiver")),
            }),
            None => Err(Error::new(Status::KVSTAGE_E_CANCELED, format!("room {room} is not open on the receiver"))),
        }
    }

    /// Checks that a writer of this room shares the prefill geometry of the room's first writer.
    fn agree_prefill(&mut self, room: u64, src: &PoolShape) -> Result<()> {
        let r = self.rooms.get_mut(&room).expect("caller checked the room");
        match &r.prefill {
            None => {
                r.prefill = Some(src.clone());
                Ok(())
            }
            Some(first) => {
                let diff = prefill_diff(first, src);
                if diff.is_empty() {
                    return Ok(());
                }
                Err(geometry::mismatch_error(
                    &format!("room {room}: this sender's prefill geometry differs from the room's first sender"),
                    diff,
                ))
            }
        }
    }

    // --- staged path -----------------------------------------------------------------------------

    /// An allocation request from `conn` for its writer slot of (room, chunk). Errors are replied
    /// to the sender; none ends the session.
    pub fn allocate(&mut self, conn: ConnId, room: u64, chunk: u32, claimed: u32, tokens: u32, bytes: u64) -> Result<Grant> {
        let info = self.conn(conn)?.clone();
        let writer = info.pairing.writer;
        if claimed != writer {
            return Err(protocol(format!("writer {claimed} claimed, this session is writer {writer}")));
        }
        self.live_room(room)?;
        self.agree_prefill(room, &info.src)?;
        let r = self.live_room(room)?;
        let num_chunks = r.chunks.len();
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("chunk {chunk} is past room {room}'s {num_chunks} chunks")))?;
        let expected_tokens = r.chunk_pages(chunk).len() as u32 * info.dst.page_size;
        if tokens != expected_tokens {
            return Err(Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("chunk {chunk} of room {room}: sender has {tokens} tokens, receiver expects {expected_tokens}"),
            ));
        }
        match c.mode {
            Mode::Slices => {
                return Err(Error::new(
                    Status::KVSTAGE_E_UNSUPPORTED,
                    format!("chunk {chunk} of room {room} is being sent by the slice path; one chunk cannot mix paths"),
                ))
            }
            _ if c.phase != Phase::Waiting => {
                return Err(protocol(format!("chunk {chunk} of room {room} is already complete")));
            }
            _ => {}
        }
        if let Some(s) = c.slots.get(writer as usize).and_then(|s| s.as_ref()) {
            return Err(if s.conn == conn {
                protocol(format!("writer {writer} requested chunk {chunk} twice"))
            } else {
                protocol(format!("writer slot {writer} of chunk {chunk} is held by another connection"))
            });
        }
        let layout = geometry::staging_layout(&info.src, &info.dst, tokens)?;
        if bytes != layout.total_bytes {
            return Err(Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("allocation size {bytes} != expected {} for chunk {chunk}", layout.total_bytes),
            ));
        }
        if layout.writer_count() != info.pairing.writers || writer >= layout.writer_count() {
            return Err(Error::internal(format!("layout has {} writers, pairing {}", layout.writer_count(), info.pairing.writers)));
        }
        let existing = self.rooms[&room].chunks[chunk as usize].grant;
        let id = match existing {
            Some(id) => id,
            None => {
                let ring = self.ring.as_mut().ok_or_else(|| Error::new(Status::KVSTAGE_E_STAGING_TOO_SMALL, "no staging ring registered"))?;
                let g = ring.assign(bytes).map_err(|e| Error::new(Status::KVSTAGE_E_OVERSIZED, e.to_string()))?;
                self.grants.insert(g.id, GrantState { grant: g, room, chunk, pins: Vec::new(), remote_writers: Vec::new(), freeing: false });
                g.id
            }
        };
        if info.rdma {
            self.grants.get_mut(&id).expect("live grant").remote_writers.push(conn);
        }
        let grant = self.grants[&id].grant;
        let c = &mut self.rooms.get_mut(&room).expect("checked").chunks[chunk as usize];
        if existing.is_none() {
            c.grant = Some(id);
            c.layout = Some(layout);
            c.mode = Mode::Staged;
            c.slots = vec![None; info.pairing.writers as usize];
        }
        c.slots[writer as usize] = Some(Slot { conn, shape: info.src.clone(), received: 0, coverage: None, arrived: false });
        Ok(grant)
    }

    /// Checks a staged write of `len` bytes at `offset` (allocation-relative) by `conn`. An `Err`
    /// ends the session (the frame lies about what this connection owns); a closed room's write
    /// is discarded.
    pub fn begin_data(&mut self, conn: ConnId, room: u64, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<Target<WriteLease>> {
        let (grant, region_offset) = match self.check_write(conn, room, chunk, claimed, offset, len)? {
            Target::Land(v) => v,
            Target::Discard(e) => return Ok(Target::Discard(e)),
        };
        let g = self.grants.get_mut(&grant).expect("a chunk's grant is live");
        g.pins.push(Some(conn));
        let gen = self.rooms[&room].gen;
        Ok(Target::Land(WriteLease {
            conn,
            grant,
            room,
            gen,
            chunk,
            writer: claimed,
            ring_offset: g.grant.offset + region_offset,
            len,
        }))
    }

    /// Validates a write and returns (grant id, allocation-relative offset).
    fn check_write(&self, conn: ConnId, room: u64, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<Target<(u64, u64)>> {
        let writer = self.conn(conn)?.pairing.writer;
        if claimed != writer {
            return Err(protocol(format!("data for writer {claimed} from writer {writer}")));
        }
        let r = match self.live_room(room) {
            Ok(r) => r,
            Err(e) => return Ok(Target::Discard(e)),
        };
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("data for chunk {chunk} past room {room}")))?;
        let slot = c.slots.get(writer as usize).and_then(|s| s.as_ref());
        let (Some(grant), Some(layout), Some(slot)) = (c.grant, c.layout.as_ref(), slot) else {
            return Err(protocol(format!("data for chunk {chunk} of room {room} without an allocation")));
        };
        if slot.conn != conn {
            return Err(protocol(format!("data for writer slot {writer} of chunk {chunk} from a connection that does not hold it")));
        }
        let region = &layout.writers[writer as usize];
        let start = region.offset + slot.received;
        if slot.arrived || offset != start || len > region.bytes - slot.received {
            return Err(protocol(format!(
                "write [{offset}, {}) outside writer {writer}'s remaining region [{start}, {}) of chunk {chunk}",
                offset.saturating_add(len),
                region.offset + region.bytes
            )));
        }
        let g = &self.grants[&grant].grant;
        let wm = self.watermark();
        if !wm.permits(g.round, g.offset + region.offset + region.bytes) {
            return Err(protocol(format!("write to round {} before the watermark {wm:?} allowed it", g.round)));
        }
        Ok(Target::Land((grant, offset)))
    }

    /// The payload read of `lease` ended; `landed` when every byte arrived. Bytes for a room
    /// released or failed meanwhile do not count (the grant was returned once unpinned).
    pub fn end_data(&mut self, lease: WriteLease, landed: bool) {
        if landed {
            if let Some(slot) = self.slot_mut(lease.room, lease.gen, lease.chunk, lease.writer, lease.conn) {
                slot.received += lease.len;
            }
        }
        self.unpin(lease.grant, Some(lease.conn));
    }

    /// An RDMA WRITE report: the bytes are already in the ring; count them if they were the
    /// connection's to write. `Err` ends the session.
    pub fn rdma_written(&mut self, conn: ConnId, room: u64, chunk: u32, claimed: u32, offset: u64, len: u64) -> Result<()> {
        if !self.conn(conn)?.rdma {
            return Err(protocol("an RDMA write report on a session without RDMA"));
        }
        if let Target::Land(_) = self.check_write(conn, room, chunk, claimed, offset, len)? {
            let gen = self.rooms[&room].gen;
            if let Some(slot) = self.slot_mut(room, gen, chunk, claimed, conn) {
                slot.received += len;
            }
        }
        Ok(())
    }

    fn slot_mut(&mut self, room: u64, gen: u64, chunk: u32, writer: u32, conn: ConnId) -> Option<&mut Slot> {
        let r = self.rooms.get_mut(&room).filter(|r| r.gen == gen && r.live())?;
        r.chunks.get_mut(chunk as usize)?.slots.get_mut(writer as usize)?.as_mut().filter(|s| s.conn == conn)
    }

    /// A writer says its region is complete. On success the region is pinned for the checksum
    /// check done outside the lock; [`State::finish_ready`] then counts the arrival. Errors are
    /// replied; a writer that owns the slot and lies about its bytes fails the room.
    pub fn begin_ready(&mut self, conn: ConnId, room: u64, chunk: u32, claimed: u32) -> Result<ReadyLease> {
        let info = self.conn(conn)?;
        let (writer, session) = (info.pairing.writer, info.session.clone());
        // An RDMA writer that reports ready has finished writing (its immediate arrived first).
        self.release_remote_writer(conn, room, Some(chunk));
        if claimed != writer {
            return Err(protocol(format!("ready for writer {claimed} from writer {writer}")));
        }
        let r = self.live_room(room)?;
        let gen = r.gen;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("ready for chunk {chunk} past room {room}")))?;
        let slot = c.slots.get(writer as usize).and_then(|s| s.as_ref()).filter(|s| s.conn == conn);
        let (Some(grant), Some(layout), Some(slot)) = (c.grant, c.layout.as_ref(), slot) else {
            return Err(protocol(format!("ready for chunk {chunk} of room {room} without this connection's allocation")));
        };
        let region = &layout.writers[writer as usize];
        if slot.received != region.bytes || slot.arrived {
            let why = format!("ready for chunk {chunk} after {} of {} bytes", slot.received, region.bytes);
            self.fail_room(room, Status::KVSTAGE_E_PROTOCOL, why.clone(), &session);
            return Err(protocol(why));
        }
        let (ring_offset, len) = (self.grants[&grant].grant.offset + region.offset, region.bytes);
        self.grants.get_mut(&grant).expect("live").pins.push(Some(conn));
        Ok(ReadyLease { conn, grant, room, gen, chunk, writer, ring_offset, len })
    }

    /// Counts the arrival checked by `verified` (the checksum result); when it was the chunk's
    /// last writer the scatter is queued (in the effects).
    pub fn finish_ready(&mut self, lease: ReadyLease, verified: Result<()>, session: &str) -> Result<()> {
        self.unpin(lease.grant, Some(lease.conn));
        let live = self.rooms.get(&lease.room).is_some_and(|r| r.gen == lease.gen && r.live());
        if !live {
            return Err(self.live_room(lease.room).err().unwrap_or_else(|| {
                Error::new(Status::KVSTAGE_E_CANCELED, format!("room {} was reopened", lease.room))
            }));
        }
        if let Err(e) = verified {
            self.fail_room(lease.room, e.code(), e.message().to_owned(), session);
            return Err(e);
        }
        let r = self.rooms.get_mut(&lease.room).expect("live");
        let pages = r.chunk_pages(lease.chunk).to_vec();
        let c = &mut r.chunks[lease.chunk as usize];
        if let Some(s) = c.slots[lease.writer as usize].as_mut() {
            s.arrived = true;
        }
        if !c.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.arrived)) {
            return Ok(());
        }
        c.phase = Phase::Scattering;
        let grant = c.grant.expect("staged chunk has a grant");
        let job = ScatterJob {
            room: lease.room,
            gen: lease.gen,
            chunk: lease.chunk,
            grant,
            ring_offset: self.grants[&grant].grant.offset,
            pages,
            layout: c.layout.clone().expect("staged chunk has a layout"),
            writers: c.slots.iter().flatten().map(|s| s.shape.clone()).collect(),
        };
        r.page_leases.push(None);
        self.grants.get_mut(&grant).expect("live").pins.push(None);
        self.fx.scatter.push(job);
        Ok(())
    }

    /// The scatter of `job` ended: the chunk is done (or the room failed), the grant goes back.
    pub fn scatter_done(&mut self, job: &ScatterJob, result: Result<()>) {
        if let Some(r) = self.rooms.get_mut(&job.room).filter(|r| r.gen == job.gen) {
            if let Some(pos) = r.page_leases.iter().position(|l| l.is_none()) {
                r.page_leases.swap_remove(pos);
            }
            let ok = result.is_ok();
            if let Err(e) = result {
                // While the chunk is still Scattering, the room failure reports it as failed.
                self.fail_room(job.room, e.code(), e.chain(), e.session().unwrap_or(""));
            }
            let r = self.rooms.get_mut(&job.room).expect("present");
            let c = &mut r.chunks[job.chunk as usize];
            c.phase = Phase::Done;
            c.grant = None;
            if ok && r.live() {
                self.push_event(ChunkEvent { room: job.room, chunk: job.chunk, status: Status::KVSTAGE_OK });
            }
            self.drain_check(job.room);
        }
        self.unpin(job.grant, None);
        self.retire_grant(job.grant);
        self.fx.changed = true;
    }

    /// A sender gives up on a chunk (`chunk == u32::MAX`: the whole room). Only a connection that
    /// holds a writer slot of it can fail the room; it also ends that writer's RDMA quarantine.
    pub fn abort(&mut self, conn: ConnId, room: u64, chunk: u32, reason: &str) {
        let Some(info) = self.conns.get(&conn) else { return };
        let session = info.session.clone();
        let which = (chunk != u32::MAX).then_some(chunk);
        self.release_remote_writer(conn, room, which);
        let Some(r) = self.rooms.get(&room) else { return };
        let holds = r
            .chunks
            .iter()
            .enumerate()
            .any(|(i, c)| which.is_none_or(|w| w as usize == i) && c.slots.iter().flatten().any(|s| s.conn == conn));
        if holds {
            let what = which.map_or_else(|| "the room".to_owned(), |c| format!("chunk {c}"));
            self.fail_room(room, Status::KVSTAGE_E_CANCELED, format!("sender aborted {what} (session {session}): {reason}"), &session);
        }
    }

    /// `conn` will not write (room, chunk) — every chunk of the room for `None` — by RDMA any
    /// more: its quarantine of those grants ends.
    fn release_remote_writer(&mut self, conn: ConnId, room: u64, chunk: Option<u32>) {
        let ids: Vec<u64> = self
            .grants
            .iter()
            .filter(|(_, g)| g.room == room && chunk.is_none_or(|c| g.chunk == c) && g.remote_writers.contains(&conn))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(g) = self.grants.get_mut(&id) {
                g.remote_writers.retain(|&c| c != conn);
            }
            self.maybe_free(id);
        }
    }

    // --- slice path ------------------------------------------------------------------------------

    /// Checks one slice write (a token row of this writer's heads in one buffer). `Err` ends the
    /// session; a slice for a closed room, or for a chunk sent staged, is discarded.
    #[allow(clippy::too_many_arguments)]
    pub fn begin_slice(
        &mut self,
        conn: ConnId,
        room: u64,
        chunk: u32,
        buffer: u32,
        token: u32,
        byte_offset: u32,
        len: u32,
    ) -> Result<Target<SliceLease>> {
        let info = self.conn(conn)?.clone();
        let r = match self.live_room(room) {
            Ok(r) => r,
            Err(e) => return Ok(Target::Discard(e)),
        };
        let gen = r.gen;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("slice for chunk {chunk} past room {room}")))?;
        if let Some(why) = slices_refused(&info, c, room, chunk) {
            return Ok(Target::Discard(why));
        }
        if c.phase != Phase::Waiting {
            return Err(protocol(format!("slice for chunk {chunk} of room {room}, which is complete")));
        }
        let pages = r.chunk_pages(chunk);
        let dst = &info.dst;
        let ps = dst.page_size;
        let tokens = pages.len() as u32 * ps;
        let page = *pages.get((token / ps) as usize).ok_or_else(|| protocol(format!("slice token {token} past chunk {chunk}")))?;
        let head_bytes = dst.head_bytes();
        let heads = info.pairing.heads;
        let (row, head_off) = (heads.num_heads as u64 * head_bytes, heads.dst_head_start as u64 * head_bytes);
        if byte_offset as u64 != head_off || len as u64 != row {
            return Err(protocol(format!("slice [{byte_offset}, +{len}) is not this writer's head range [{head_off}, +{row})")));
        }
        let writer = info.pairing.writer;
        let slot = c.slots.get(writer as usize).and_then(|s| s.as_ref());
        if let Some(s) = slot {
            if s.conn != conn {
                return Err(protocol(format!("slice for writer slot {writer} of chunk {chunk} from a connection that does not hold it")));
            }
            let cov = s.coverage.as_ref().expect("slice slots track coverage");
            if !cov.carries(buffer) {
                return Err(protocol(format!("slice buffer {buffer} is not one this writer carries")));
            }
            if cov.has(buffer, token) || s.arrived {
                return Err(protocol(format!("slice of buffer {buffer} token {token} written twice")));
            }
        }
        self.agree_prefill(room, &info.src)?;
        let r = self.rooms.get_mut(&room).expect("checked");
        let c = &mut r.chunks[chunk as usize];
        if c.mode == Mode::Unset {
            c.mode = Mode::Slices;
            c.slots = vec![None; info.pairing.writers as usize];
        }
        if c.slots.len() != info.pairing.writers as usize || writer as usize >= c.slots.len() {
            return Err(protocol(format!("writer {writer} of {} disagrees with the chunk's {} writers", info.pairing.writers, c.slots.len())));
        }
        let slot = c.slots[writer as usize].get_or_insert_with(|| Slot {
            conn,
            shape: info.src.clone(),
            received: 0,
            coverage: Some(Coverage::new(&info.src, dst, tokens)),
            arrived: false,
        });
        if !slot.coverage.as_ref().expect("slice slot").carries(buffer) {
            return Err(protocol(format!("slice buffer {buffer} is not one this writer carries")));
        }
        r.page_leases.push(Some(conn));
        let slot_index = page as u64 * ps as u64 + (token % ps) as u64;
        Ok(Target::Land(SliceLease { conn, room, gen, chunk, writer, token, buffer, slot: slot_index, byte_offset: head_off, len: row }))
    }

    /// The slice payload read ended; `landed` when every byte arrived.
    pub fn end_slice(&mut self, lease: SliceLease, landed: bool) {
        self.finish_slice(lease, landed);
    }

    fn finish_slice(&mut self, lease: SliceLease, landed: bool) {
        let Some(r) = self.rooms.get_mut(&lease.room).filter(|r| r.gen == lease.gen) else { return };
        if let Some(pos) = r.page_leases.iter().position(|l| *l == Some(lease.conn)) {
            r.page_leases.swap_remove(pos);
        }
        if landed && r.live() {
            if let Some(cov) = r
                .chunks
                .get_mut(lease.chunk as usize)
                .and_then(|c| c.slots.get_mut(lease.writer as usize))
                .and_then(|s| s.as_mut())
                .filter(|s| s.conn == lease.conn)
                .and_then(|s| s.coverage.as_mut())
            {
                cov.mark(lease.buffer, lease.token);
            }
        }
        self.drain_check(lease.room);
        self.fx.changed = true;
    }

    /// A slice writer says its rows are complete: accepted only when every row it owes arrived.
    /// Errors are replied; a writer that owns the slot and is short fails the room.
    pub fn slice_done(&mut self, conn: ConnId, room: u64, chunk: u32) -> Result<()> {
        let info = self.conn(conn)?;
        let (writer, session) = (info.pairing.writer, info.session.clone());
        let r = self.live_room(room)?;
        let c = r.chunks.get(chunk as usize).ok_or_else(|| protocol(format!("slices done for chunk {chunk} past room {room}")))?;
        if let Some(why) = slices_refused(info, c, room, chunk) {
            return Err(why);
        }
        let slot = c.slots.get(writer as usize).and_then(|s| s.as_ref()).filter(|s| s.conn == conn);
        let Some(slot) = slot else {
            return Err(protocol(format!("slices done for chunk {chunk} of room {room} by a connection that sent none")));
        };
        if slot.arrived {
            return Err(protocol(format!("slices of chunk {chunk} completed twice")));
        }
        let (covered, expected) = slot.coverage.as_ref().expect("slice slot").progress();
        if covered != expected {
            let why = format!("slices done for chunk {chunk} after {covered} of {expected} rows");
            self.fail_room(room, Status::KVSTAGE_E_PROTOCOL, why.clone(), &session);
            return Err(protocol(why));
        }
        let r = self.rooms.get_mut(&room).expect("live");
        let c = &mut r.chunks[chunk as usize];
        c.slots[writer as usize].as_mut().expect("checked").arrived = true;
        if c.slots.iter().all(|s| s.as_ref().is_some_and(|s| s.arrived)) {
            c.phase = Phase::Done;
            self.push_event(ChunkEvent { room, chunk, status: Status::KVSTAGE_OK });
            self.fx.changed = true;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
