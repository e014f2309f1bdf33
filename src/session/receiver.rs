//! Decode side: rooms, the staging ring, arrivals, scatter and watermark broadcast.
//!
//! Every remote-supplied room, chunk, writer, offset and length is checked against what this side
//! granted before a single byte is read into memory: a peer can write only inside its allocation
//! (staged path) or inside the token slots of its own room's pages (slice path).

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use super::{pairing, Deadline};
use crate::copy::CopyEngine;
use crate::error::{Error, Result, Status};
use crate::geometry::{self, Fingerprint, HeadSlice, KvLayout, MemoryKind, PoolShape, StagingLayout};
use crate::protocol::{self, Hello, Message, PROTOCOL_VERSION};
use crate::ring::{Grant, Ring, Watermark};
use crate::engine::EngineOptions;
use crate::transport::faults::FaultyTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;

/// Registered staging memory of the receiver (caller-provided or owned).
pub struct RingMemory {
    ptr: *mut u8,
    len: usize,
    _owned: Option<Vec<u8>>,
}

// SAFETY: the memory is only written at offsets the ring granted to one writer at a time and only
// read by the scatter of a chunk whose writers have all arrived.
unsafe impl Send for RingMemory {}
unsafe impl Sync for RingMemory {}

impl RingMemory {
    /// `ptr == None` allocates `len` bytes owned by the engine.
    pub fn new(ptr: Option<*mut u8>, len: usize) -> Result<RingMemory> {
        match ptr {
            Some(p) => Ok(RingMemory { ptr: p, len, _owned: None }),
            None => {
                let mut v = Vec::new();
                v.try_reserve_exact(len).map_err(|_| {
                    Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("cannot allocate a staging ring of {len} bytes"))
                })?;
                v.resize(len, 0);
                let ptr = v.as_mut_ptr();
                Ok(RingMemory { ptr, len, _owned: Some(v) })
            }
        }
    }
}

/// One completed or failed chunk, as reported to the decode caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkEvent {
    pub room: u64,
    pub chunk: u32,
    pub status: Status,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkPhase {
    Waiting,
    Scattering,
    Done,
}

struct Writer {
    peer: u64,
    shape: PoolShape,
    received: u64,
    arrived: bool,
}

struct Chunk {
    phase: ChunkPhase,
    grant: Option<Grant>,
    layout: Option<StagingLayout>,
    writers: Vec<Option<Writer>>,
    /// Slice-path writers (no allocation): the sending connection and whether it finished.
    slicers: Vec<(u64, bool)>,
}

struct Room {
    pages: Vec<u32>,
    grid_pages: usize,
    chunks: Vec<Chunk>,
    /// Why the room failed: code, message, and the session involved (empty when none).
    failure: Option<(Status, String, String)>,
    released: bool,
}

impl Room {
    fn chunk_pages(&self, chunk: u32) -> &[u32] {
        let start = chunk as usize * self.grid_pages;
        &self.pages[start..(start + self.grid_pages).min(self.pages.len())]
    }

    fn complete(&self) -> bool {
        self.chunks.iter().all(|c| c.phase == ChunkPhase::Done)
    }
}

struct State {
    ring: Option<Ring>,
    rooms: HashMap<u64, Room>,
    events: VecDeque<ChunkEvent>,
    peers: HashMap<u64, Arc<dyn Transport>>,
    next_peer: u64,
    /// Recently released rooms: late frames for them are drained, not treated as attacks.
    released: VecDeque<u64>,
}

/// How many released room ids are remembered for draining late frames.
const RELEASED_MEMORY: usize = 4096;

pub struct ScatterJob {
    room: u64,
    chunk: u32,
}

/// The receiver half of an engine.
pub struct Receiver {
    state: Mutex<State>,
    changed: Condvar,
    memory: Mutex<Option<Arc<RingMemory>>>,
    pool: Arc<Mutex<Option<Arc<KvLayout>>>>,
    copy: Arc<dyn CopyEngine>,
    scatter_tx: Mutex<Option<Sender<ScatterJob>>>,
    options: Arc<EngineOptions>,
    /// Set when the engine shuts down (ends stalled test readers).
    closing: std::sync::atomic::AtomicBool,
    /// RDMA devices of the engine: answers senders' offers (none until `set_rdma`).
    rdma: Mutex<Option<Arc<crate::transport::rdma::Rdma>>>,
}

/// How long a `ChunkReady` waits for its write-with-immediate (the sender sends it only after the
/// write completed, so this only bounds a broken or lying sender).
const RDMA_IMM_WAIT: Duration = Duration::from_secs(5);

/// Bound on a reply or broadcast to one sender: the sender's reader drains them at once, so a
/// full socket means a stuck peer, which is then cut off.
const REPLY_DEADLINE: Duration = Duration::from_secs(2);

fn reply_deadline() -> Deadline {
    Deadline::after(Some(REPLY_DEADLINE))
}

fn reject(code: Status, reason: impl Into<String>) -> Error {
    Error::new(code, reason)
}

impl Receiver {
    pub fn new(pool: Arc<Mutex<Option<Arc<KvLayout>>>>, copy: Arc<dyn CopyEngine>, options: Arc<EngineOptions>) -> Receiver {
        Receiver {
            state: Mutex::new(State {
                ring: None,
                rooms: HashMap::new(),
                events: VecDeque::new(),
                peers: HashMap::new(),
                next_peer: 1,
                released: VecDeque::new(),
            }),
            changed: Condvar::new(),
            memory: Mutex::new(None),
            pool,
            copy,
            scatter_tx: Mutex::new(None),
            options,
            closing: std::sync::atomic::AtomicBool::new(false),
            rdma: Mutex::new(None),
        }
    }

    pub fn set_scatter_queue(&self, tx: Sender<ScatterJob>) {
        *self.scatter_tx.lock() = Some(tx);
    }

    pub fn set_rdma(&self, rdma: Arc<crate::transport::rdma::Rdma>) {
        *self.rdma.lock() = Some(rdma);
    }

    pub fn close_scatter_queue(&self) {
        self.scatter_tx.lock().take();
    }

    pub fn register_ring(&self, memory: RingMemory) -> Result<()> {
        let mut st = self.state.lock();
        if st.ring.as_ref().is_some_and(|r| r.live_count() > 0) {
            return Err(Error::invalid_arg("staging", "the staging ring has live allocations; release rooms first"));
        }
        st.ring = Some(Ring::new(memory.len as u64));
        // The old ring's memory region goes before its memory (RDMA peers then fail with a
        // remote access error and reconnect).
        if let Some(r) = self.rdma.lock().as_ref() {
            r.forget_ring();
        }
        *self.memory.lock() = Some(Arc::new(memory));
        Ok(())
    }

    fn pool(&self) -> Result<Arc<KvLayout>> {
        self.pool.lock().clone().ok_or_else(|| {
            Error::invalid_arg("engine", "has no KV pool registered (kvstage_engine_register_pool)")
        })
    }

    /// Opens a room: the decode pages that receive the request's new tokens (after the decode
    /// side's cached prefix), split into chunks of `chunk_tokens` on the page grid.
    pub fn open_room(&self, room: u64, pages: &[u32], chunk_tokens: u32) -> Result<u32> {
        let pool = self.pool()?;
        pool.check_pages(pages, "dst_pages")?;
        if pages.is_empty() {
            return Err(Error::invalid_arg("num_pages", "0 (a room needs at least one page)"));
        }
        let chunk_tokens = if chunk_tokens == 0 { self.options.chunk_tokens } else { chunk_tokens };
        let grid_pages = (geometry::grid_tokens(chunk_tokens, pool.shape.page_size) / pool.shape.page_size) as usize;
        let num_chunks = pages.len().div_ceil(grid_pages);
        let mut st = self.state.lock();
        if st.rooms.get(&room).is_some_and(|r| !r.released) {
            return Err(Error::invalid_arg("room", format!("{room} is already open")));
        }
        let chunks = (0..num_chunks)
            .map(|_| Chunk { phase: ChunkPhase::Waiting, grant: None, layout: None, writers: Vec::new(), slicers: Vec::new() })
            .collect();
        st.rooms.insert(room, Room { pages: pages.to_vec(), grid_pages, chunks, failure: None, released: false });
        Ok(num_chunks as u32)
    }

    /// Waits until every chunk of `room` is scattered (OK), the room failed (its error) or the deadline.
    pub fn wait_room(&self, room: u64, timeout: Option<Duration>) -> Result<Status> {
        let deadline = Deadline::after(timeout);
        let mut st = self.state.lock();
        loop {
            let r = st.rooms.get(&room).ok_or_else(|| Error::invalid_arg("room", format!("{room} is not open")))?;
            if let Some((code, msg, session)) = &r.failure {
                return Err(Error::new(*code, format!("room {room} failed: {msg}")).with_session(session));
            }
            if r.complete() {
                return Ok(Status::KVSTAGE_OK);
            }
            if !deadline.wait(&self.changed, &mut st) {
                let done = r_done(st.rooms.get(&room));
                return Err(deadline.timeout_error(&format!("waiting for room {room} ({done})")));
            }
        }
    }

    /// Frees every allocation the room still holds and forgets it. Idempotent.
    pub fn release_room(&self, room: u64) {
        let mut st = self.state.lock();
        let st = &mut *st;
        let Some(r) = st.rooms.get_mut(&room) else { return };
        r.released = true;
        let (freed, scattering) = take_grants(r);
        if !scattering {
            st.rooms.remove(&room); // otherwise the running scatter removes it when done
        }
        if !st.released.contains(&room) {
            if st.released.len() == RELEASED_MEMORY {
                st.released.pop_front();
            }
            st.released.push_back(room);
        }
        self.free_grants(st, &freed);
        self.changed.notify_all();
    }

    /// Marks a room failed (it stays visible until released), frees its ring space and reports
    /// every unfinished chunk as failed.
    fn fail_room(&self, st: &mut State, room: u64, code: Status, why: String, session: &str) {
        let Some(r) = st.rooms.get_mut(&room) else { return };
        if r.failure.is_some() || r.released || r.complete() {
            return;
        }
        r.failure = Some((code, why, session.to_owned()));
        let (freed, _) = take_grants(r);
        for (i, c) in r.chunks.iter().enumerate() {
            if c.phase != ChunkPhase::Done {
                st.events.push_back(ChunkEvent { room, chunk: i as u32, status: code });
            }
        }
        self.free_grants(st, &freed);
        self.changed.notify_all();
    }

    fn free_grants(&self, st: &mut State, ids: &[u64]) {
        let Some(ring) = st.ring.as_mut() else { return };
        let mut moved = None;
        for &id in ids {
            if let Some(w) = ring.free(id) {
                moved = Some(w);
            }
        }
        if let Some(w) = moved {
            broadcast(st, &Message::Watermark(w));
        }
    }

    pub fn take_events(&self, max: usize) -> Vec<ChunkEvent> {
        let mut st = self.state.lock();
        let n = max.min(st.events.len());
        st.events.drain(..n).collect()
    }

    pub fn ring_stats(&self) -> (u64, u64, Watermark) {
        let st = self.state.lock();
        st.ring.as_ref().map_or((0, 0, Watermark::default()), |r| (r.capacity(), r.live_count() as u64, r.watermark()))
    }

    /// Runs one accepted connection until it closes: handshake, then frames.
    pub fn serve(self: &Arc<Self>, stream: TcpStream) {
        let _ = self.serve_inner(stream);
    }

    fn serve_inner(self: &Arc<Self>, stream: TcpStream) -> Result<()> {
        crate::transport::tcp::tune(&stream)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut reader = stream.try_clone()?;
        let mut link: Arc<dyn Transport> = Arc::new(TcpTransport::new(stream)?);
        if let Some(faults) = &self.options.faults {
            link = Arc::new(FaultyTransport::new(link, faults.clone(), 2));
        }
        let Some(Message::Hello(hello)) = protocol::read_frame(&mut reader)? else {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, "first frame is not a hello"));
        };
        let (peer_id, src) = self.accept(&hello, &link)?;
        reader.set_read_timeout(None)?;
        let result = self.read_loop(peer_id, &src, &mut reader, &link, &hello.session);
        let reason = match &result {
            Ok(()) => "peer closed the connection".to_owned(),
            Err(e) => e.chain(),
        };
        self.peer_gone(peer_id, &reason, &hello.session);
        link.shutdown();
        result
    }

    /// Validates the hello and answers with ours; registers the peer for watermark broadcasts.
    fn accept(&self, hello: &Hello, link: &Arc<dyn Transport>) -> Result<(u64, PoolShape)> {
        let pool = self.pool();
        let token = self.options.cluster_token.clone().unwrap_or_default().into_bytes();
        let mut st = self.state.lock();
        let (ring_bytes, watermark) = st.ring.as_ref().map_or((0, Watermark::default()), |r| (r.capacity(), r.watermark()));
        let (status, reason, shape) = match &pool {
            _ if !super::tokens_match(&token, &hello.token) => {
                (Status::KVSTAGE_E_AUTH, "the sender did not present this cluster's token".to_owned(), None)
            }
            Err(e) => (e.code(), e.message().to_owned(), None),
            Ok(pool) => match verify_peer(&pool.shape, hello) {
                Ok(()) => (Status::KVSTAGE_OK, String::new(), Some(pool.shape.clone())),
                Err(e) => (e.code(), e.chain(), Some(pool.shape.clone())),
            },
        };
        let our_shape = shape.clone().unwrap_or_else(|| hello.shape.clone());
        let answer = Hello {
            protocol_version: PROTOCOL_VERSION,
            library_version: crate::version_number(),
            session: hello.session.clone(),
            fingerprint: Fingerprint::of(&our_shape).encode(),
            shape: our_shape,
            ring_bytes,
            watermark,
            status: status.code(),
            reason: reason.clone(),
            token: if status == Status::KVSTAGE_E_AUTH { Vec::new() } else { token },
        };
        // The peer is registered before the answer so no watermark change can fall in between.
        let peer_id = st.next_peer;
        if status == Status::KVSTAGE_OK {
            st.next_peer += 1;
            st.peers.insert(peer_id, link.clone());
        }
        let sent = link.send(&Message::Hello(answer), &reply_deadline());
        drop(st);
        sent?;
        if status != Status::KVSTAGE_OK {
            return Err(reject(status, reason));
        }
        Ok((peer_id, hello.shape.clone()))
    }

    fn read_loop(
        &self,
        peer: u64,
        src: &PoolShape,
        reader: &mut TcpStream,
        link: &Arc<dyn Transport>,
        session: &str,
    ) -> Result<()> {
        let stop_after = self.options.faults.as_ref().and_then(|f| f.plan.stop_reading_after);
        let mut frames = 0u64;
        let dst = self.pool()?;
        let super::Pairing { writer, writers, heads: slice } = pairing(src, &dst.shape)?;
        // Set when the sender connected its RDMA queue pairs (its chunks then arrive by RDMA).
        let mut rdma_peer: Option<crate::transport::rdma::link::RdmaPeer> = None;
        while let Some(msg) = protocol::read_frame(reader)? {
            frames += 1;
            if stop_after.is_some_and(|n| frames > n) {
                return self.stall(link);
            }
            match msg {
                Message::AllocReq { req, room, chunk, writer: w, tokens, bytes } => {
                    let rsp = match self.allocate(room, chunk, w, writer, writers, tokens, bytes, src, &dst.shape, peer) {
                        Ok(g) => Message::AllocRsp { req, status: 0, round: g.round, offset: g.offset, len: g.len, reason: String::new() },
                        Err(e) => Message::AllocRsp { req, status: e.code().code(), round: 0, offset: 0, len: 0, reason: e.chain() },
                    };
                    link.send(&rsp, &reply_deadline())?;
                }
                Message::Data { room, chunk, writer: w, offset, len } => {
                    match self.data_target(room, chunk, w, writer, offset, len) {
                        Ok(target) => {
                            // SAFETY: `data_target` checked that [target, target+len) lies inside this
                            // writer's region of a live grant that the watermark allows to be written.
                            let buf = unsafe { std::slice::from_raw_parts_mut(target, len as usize) };
                            reader.read_exact(buf).map_err(|e| Error::from(e).context("receiving chunk data failed"))?;
                            self.note_received(room, chunk, w, len);
                        }
                        Err(e) => drain_or_fail(reader, e, len)?,
                    }
                }
                Message::ChunkReady { req, room, chunk, writer: w, checksum } => {
                    // RDMA: the write-with-immediate (imm = req) must have completed first.
                    let landed = rdma_peer.as_ref().map_or(Ok(()), |p| p.wait_imm(req as u32, RDMA_IMM_WAIT));
                    let (status, last) = match landed.and_then(|()| self.arrive(room, chunk, w, writer, checksum, session)) {
                        Ok(last) => (Message::Arrived { req, status: 0, reason: String::new() }, last),
                        Err(e) => (Message::Arrived { req, status: e.code().code(), reason: e.chain() }, false),
                    };
                    // The chunk is complete whether or not the ack gets out: scatter it regardless.
                    let sent = link.send(&status, &reply_deadline());
                    if last {
                        self.dispatch_scatter(room, chunk)?;
                    }
                    sent?;
                }
                Message::Slice { room, chunk, buffer, token, byte_offset, len } => {
                    match self.slice_target(&dst, room, chunk, buffer, token, byte_offset, len, &slice, peer) {
                        Ok(target) => {
                            // SAFETY: `slice_target` checked that the range is inside one token slot
                            // of a page this room owns, within the head range this writer feeds.
                            let buf = unsafe { std::slice::from_raw_parts_mut(target, len as usize) };
                            reader.read_exact(buf).map_err(|e| Error::from(e).context("receiving slice data failed"))?;
                        }
                        Err(e) => drain_or_fail(reader, e, len as u64)?,
                    }
                }
                Message::SliceDone { req, room, chunk } => {
                    let (status, last) = match self.slice_done(room, chunk, peer, writers) {
                        Ok(last) => (Message::Arrived { req, status: 0, reason: String::new() }, last),
                        Err(e) => (Message::Arrived { req, status: e.code().code(), reason: e.chain() }, false),
                    };
                    let sent = link.send(&status, &reply_deadline());
                    if last {
                        self.finish_slices(room, chunk);
                    }
                    sent?;
                }
                Message::RdmaOffer(offer) => {
                    let ring = self.memory.lock().clone();
                    let rdma = self.rdma.lock().clone().unwrap_or_else(crate::transport::rdma::Rdma::off);
                    let (answer, p) = rdma.accept(&offer, ring.as_ref().map(|m| (m.ptr, m.len)), &link.describe(), session);
                    rdma_peer = p;
                    link.send(&Message::RdmaAnswer(answer), &reply_deadline())?;
                }
                Message::RdmaWritten { room, chunk, writer: w, offset, len, imm: _ } => {
                    if rdma_peer.is_none() {
                        return Err(reject(Status::KVSTAGE_E_PROTOCOL, "an RDMA write report on a session without RDMA"));
                    }
                    // The bytes are already in the ring: check that they were this writer's to
                    // write, then count them as received (a closed room's late write is ignored).
                    match self.data_target(room, chunk, w, writer, offset, len) {
                        Ok(_) => self.note_received(room, chunk, w, len),
                        Err(e) if e.code() == Status::KVSTAGE_E_PROTOCOL => return Err(e),
                        Err(_) => {}
                    }
                }
                Message::Abort { room, chunk, reason } => {
                    let mut st = self.state.lock();
                    let why = format!("sender aborted chunk {chunk} (session {session}): {reason}");
                    self.fail_room(&mut st, room, Status::KVSTAGE_E_CANCELED, why, session);
                }
                other => {
                    return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("unexpected frame from sender: {other:?}")));
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn allocate(
        &self,
        room: u64,
        chunk: u32,
        claimed_writer: u32,
        writer: u32,
        writers: u32,
        tokens: u32,
        bytes: u64,
        src: &PoolShape,
        dst: &PoolShape,
        peer: u64,
    ) -> Result<Grant> {
        if claimed_writer != writer {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("writer {claimed_writer} claimed, session is writer {writer}")));
        }
        let mut st = self.state.lock();
        let st = &mut *st;
        let r = live_room(st, room)?;
        let num_chunks = r.chunks.len();
        if chunk as usize >= num_chunks {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("chunk {chunk} is past room {room}'s {num_chunks} chunks")));
        }
        let expected_tokens = r.chunk_pages(chunk).len() as u32 * dst.page_size;
        if tokens != expected_tokens {
            return Err(reject(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("chunk {chunk} of room {room}: sender has {tokens} tokens, receiver expects {expected_tokens}"),
            ));
        }
        let layout = geometry::staging_layout(src, dst, tokens)?;
        if bytes != layout.total_bytes {
            return Err(reject(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("allocation size {bytes} != expected {} for chunk {chunk}", layout.total_bytes),
            ));
        }
        let c = &mut r.chunks[chunk as usize];
        if c.phase != ChunkPhase::Waiting {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("chunk {chunk} of room {room} is already complete")));
        }
        if c.writers.iter().flatten().any(|w| w.peer == peer) || c.writers.get(writer as usize).is_some_and(|w| w.is_some()) {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("writer {writer} requested chunk {chunk} twice")));
        }
        let existing = c.grant;
        let grant = match existing {
            Some(g) => g,
            None => {
                let ring = st.ring.as_mut().ok_or_else(|| reject(Status::KVSTAGE_E_STAGING_TOO_SMALL, "no staging ring registered"))?;
                ring.assign(bytes).map_err(|e| reject(Status::KVSTAGE_E_OVERSIZED, e.to_string()))?
            }
        };
        let c = &mut st.rooms.get_mut(&room).expect("checked above").chunks[chunk as usize];
        if existing.is_none() {
            c.grant = Some(grant);
            c.layout = Some(layout);
        }
        if c.writers.is_empty() {
            c.writers = (0..writers).map(|_| None).collect();
        }
        c.writers[writer as usize] = Some(Writer { peer, shape: src.clone(), received: 0, arrived: false });
        Ok(grant)
    }

    fn data_target(&self, room: u64, chunk: u32, claimed: u32, writer: u32, offset: u64, len: u64) -> Result<*mut u8> {
        if claimed != writer {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("data for writer {claimed} from writer {writer}")));
        }
        let mut st = self.state.lock();
        let st = &mut *st;
        let wm = st.ring.as_ref().map(|r| r.watermark()).unwrap_or_default();
        let r = live_room(st, room)?;
        let c = r
            .chunks
            .get_mut(chunk as usize)
            .ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, format!("data for chunk {chunk} past the room")))?;
        let (Some(g), Some(layout)) = (c.grant, c.layout.as_ref()) else {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("data for chunk {chunk} without an allocation")));
        };
        let region = &layout.writers[writer as usize];
        let w = c.writers[writer as usize]
            .as_mut()
            .ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, "data before the allocation request"))?;
        // Writes must be inside this writer's region, contiguous with what already arrived.
        let start = region.offset + w.received;
        if offset != start || len > region.bytes - w.received || w.arrived {
            return Err(reject(
                Status::KVSTAGE_E_PROTOCOL,
                format!(
                    "write [{offset}, {}) outside writer {writer}'s remaining region [{start}, {}) of chunk {chunk}",
                    offset.saturating_add(len),
                    region.offset + region.bytes
                ),
            ));
        }
        if !wm.permits(g.round, g.offset + region.offset + region.bytes) {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("write to round {} before the watermark {wm:?} allowed it", g.round)));
        }
        let mem = self.memory.lock().clone().ok_or_else(|| Error::internal("grant without ring memory"))?;
        debug_assert!(g.offset + offset + len <= mem.len as u64);
        // SAFETY: inside the ring (grant ⊂ ring, region ⊂ grant).
        Ok(unsafe { mem.ptr.add((g.offset + offset) as usize) })
    }

    fn note_received(&self, room: u64, chunk: u32, writer: u32, len: u64) {
        let mut st = self.state.lock();
        if let Some(w) = st
            .rooms
            .get_mut(&room)
            .and_then(|r| r.chunks.get_mut(chunk as usize))
            .and_then(|c| c.writers.get_mut(writer as usize))
            .and_then(|w| w.as_mut())
        {
            w.received += len;
        }
    }

    /// Marks a writer's data complete; `true` when it was the chunk's last writer.
    fn arrive(&self, room: u64, chunk: u32, claimed: u32, writer: u32, checksum: Option<u64>, session: &str) -> Result<bool> {
        if claimed != writer {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("ready for writer {claimed} from writer {writer}")));
        }
        let region = {
            let mut st = self.state.lock();
            let r = live_room(&mut st, room)?;
            let c = r.chunks.get_mut(chunk as usize).ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, "ready past the room"))?;
            let (grant, layout) = (c.grant, c.layout.as_ref());
            let w = c.writers.get(writer as usize).and_then(|w| w.as_ref());
            let (Some(grant), Some(layout), Some(w)) = (grant, layout, w) else {
                return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("ready for chunk {chunk} without an allocation")));
            };
            let region = &layout.writers[writer as usize];
            if w.received != region.bytes || w.arrived {
                return Err(reject(
                    Status::KVSTAGE_E_PROTOCOL,
                    format!("ready for chunk {chunk} after {} of {} bytes", w.received, region.bytes),
                ));
            }
            (grant.offset + region.offset, region.bytes)
        };
        if let Some(sent) = checksum {
            // Outside the lock: only this connection writes the region, and it is done.
            let mem = self.memory.lock().clone().ok_or_else(|| Error::internal("arrival without ring memory"))?;
            // SAFETY: the region lies inside the ring (checked when the data was accepted).
            let bytes = unsafe { std::slice::from_raw_parts(mem.ptr.add(region.0 as usize), region.1 as usize) };
            let got = super::sender::checksum(bytes);
            if got != sent {
                let why = format!(
                    "integrity check failed for room {room} chunk {chunk} writer {writer}: sender checksum {sent:#018x} != received {got:#018x}"
                );
                let mut st = self.state.lock();
                self.fail_room(&mut st, room, Status::KVSTAGE_E_INTEGRITY, why.clone(), session);
                return Err(Error::new(Status::KVSTAGE_E_INTEGRITY, why).with_session(session));
            }
        }
        let mut st = self.state.lock();
        let r = live_room(&mut st, room)?;
        let c = &mut r.chunks[chunk as usize];
        if let Some(w) = c.writers[writer as usize].as_mut() {
            w.arrived = true;
        }
        if c.writers.iter().all(|w| w.as_ref().is_some_and(|w| w.arrived)) {
            c.phase = ChunkPhase::Scattering;
            return Ok(true);
        }
        Ok(false)
    }

    /// Test fault "a peer that stops reading": the connection stays open, unread, until the
    /// engine shuts it down.
    fn stall(&self, link: &Arc<dyn Transport>) -> Result<()> {
        if let Some(f) = &self.options.faults {
            f.counters.stalled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        while !self.closing.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
        }
        link.shutdown();
        Err(reject(Status::KVSTAGE_E_CANCELED, "fault injection: stopped reading"))
    }

    /// Queues the scatter of a chunk whose writers all arrived (after their acks went out, so a
    /// caller who sees the room complete never races the senders' acknowledgements).
    fn dispatch_scatter(&self, room: u64, chunk: u32) -> Result<()> {
        let tx = self.scatter_tx.lock().clone();
        match tx {
            Some(tx) if tx.send(ScatterJob { room, chunk }).is_ok() => Ok(()),
            _ => Err(Error::internal("scatter queue closed")),
        }
    }

    /// Executes a scatter job (on the engine's scatter thread), then frees the grant.
    pub fn run_scatter(&self, job: ScatterJob) {
        let work = {
            let mut st = self.state.lock();
            let Some(r) = st.rooms.get_mut(&job.room) else { return };
            let pages = r.chunk_pages(job.chunk).to_vec();
            let c = &r.chunks[job.chunk as usize];
            let shapes: Vec<PoolShape> = c.writers.iter().flatten().map(|w| w.shape.clone()).collect();
            (pages, c.grant, c.layout.clone(), shapes)
        };
        let (pages, grant, layout, shapes) = work;
        let result = match (grant, layout) {
            (Some(g), Some(layout)) => self.scatter(&pages, g, &layout, &shapes),
            _ => Err(Error::internal("scatter job without a grant")),
        };
        let mut st = self.state.lock();
        let st = &mut *st;
        let mut freed = Vec::new();
        let status = match &result {
            Ok(()) => Status::KVSTAGE_OK,
            Err(e) => e.code(),
        };
        if let Err(e) = &result {
            // Fails the room while this chunk still counts as unfinished (it reports the event).
            self.fail_room(st, job.room, e.code(), e.chain(), e.session().unwrap_or(""));
        }
        if let Some(r) = st.rooms.get_mut(&job.room) {
            let c = &mut r.chunks[job.chunk as usize];
            c.phase = ChunkPhase::Done;
            freed.extend(c.grant.take().map(|g| g.id));
            if r.released {
                st.rooms.remove(&job.room);
            } else if result.is_ok() {
                st.events.push_back(ChunkEvent { room: job.room, chunk: job.chunk, status });
            }
        }
        self.free_grants(st, &freed);
        self.changed.notify_all();
    }

    fn scatter(&self, pages: &[u32], grant: Grant, layout: &StagingLayout, shapes: &[PoolShape]) -> Result<()> {
        let pool = self.pool()?;
        let mem = self.memory.lock().clone().ok_or_else(|| Error::internal("scatter without ring memory"))?;
        for src in shapes {
            let w = layout.writer_for(src)?.ok_or_else(|| Error::internal("arrived writer is not in the layout"))?;
            let plan = geometry::plan_scatter(&pool.shape, pages, layout, w)?;
            // SAFETY: the writer's region lies inside the grant, which lies inside the ring; all its
            // writers arrived, so nothing writes it while the scatter reads.
            unsafe {
                let region = mem.ptr.add((grant.offset + layout.writers[w as usize].offset) as usize);
                self.copy.scatter(&plan, &pool, region)?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn slice_target(
        &self,
        pool: &KvLayout,
        room: u64,
        chunk: u32,
        buffer: u32,
        token: u32,
        byte_offset: u32,
        len: u32,
        slice: &HeadSlice,
        peer: u64,
    ) -> Result<*mut u8> {
        if pool.memory != MemoryKind::Host {
            return Err(reject(Status::KVSTAGE_E_UNSUPPORTED, "the slice path writes the KV pool from the CPU: host pools only"));
        }
        let mut st = self.state.lock();
        let r = live_room(&mut st, room)?;
        if let Some(c) = r.chunks.get_mut(chunk as usize) {
            if !c.slicers.iter().any(|&(p, _)| p == peer) {
                c.slicers.push((peer, false));
            }
        }
        if chunk as usize >= r.chunks.len() {
            return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("slice for chunk {chunk} past the room")));
        }
        let pages = r.chunk_pages(chunk);
        let ps = pool.shape.page_size;
        let page = pages
            .get((token / ps) as usize)
            .ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, format!("slice token {token} past chunk {chunk}")))?;
        let base = *pool
            .bases
            .get(buffer as usize)
            .ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, format!("slice buffer {buffer} does not exist")))?;
        let token_bytes = pool.shape.token_bytes();
        let row = slice.num_heads as u64 * token_bytes / pool.shape.local_heads as u64;
        let head_off = slice.dst_head_start as u64 * token_bytes / pool.shape.local_heads as u64;
        if byte_offset as u64 != head_off || len as u64 != row {
            return Err(reject(
                Status::KVSTAGE_E_PROTOCOL,
                format!("slice [{byte_offset}, +{len}) is not this writer's head range [{head_off}, +{row})"),
            ));
        }
        let slot = *page as u64 * ps as u64 + (token % ps) as u64;
        Ok((base as u64 + slot * token_bytes + byte_offset as u64) as *mut u8)
    }

    /// Marks a writer's slices complete; `true` when it was the chunk's last writer.
    fn slice_done(&self, room: u64, chunk: u32, peer: u64, writers: u32) -> Result<bool> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let r = live_room(st, room)?;
        let c = r.chunks.get_mut(chunk as usize).ok_or_else(|| reject(Status::KVSTAGE_E_PROTOCOL, "slice done past the room"))?;
        match c.slicers.iter_mut().find(|(p, _)| *p == peer) {
            Some((_, done)) if *done => {
                return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("slices of chunk {chunk} completed twice")))
            }
            Some((_, done)) => *done = true,
            None => c.slicers.push((peer, true)),
        }
        let finished = c.slicers.iter().filter(|(_, done)| *done).count() as u32;
        Ok(finished == writers && c.phase == ChunkPhase::Waiting)
    }

    fn finish_slices(&self, room: u64, chunk: u32) {
        let mut st = self.state.lock();
        if let Some(c) = st.rooms.get_mut(&room).and_then(|r| r.chunks.get_mut(chunk as usize)) {
            c.phase = ChunkPhase::Done;
            st.events.push_back(ChunkEvent { room, chunk, status: Status::KVSTAGE_OK });
        }
        self.changed.notify_all();
    }

    /// A sender vanished: every chunk it was writing can never complete, so its rooms fail and
    /// give back their ring space at once.
    fn peer_gone(&self, peer: u64, reason: &str, session: &str) {
        let mut st = self.state.lock();
        st.peers.remove(&peer);
        // A room it took part in but has not delivered every chunk of can never complete.
        let wrote = |c: &Chunk| c.writers.iter().flatten().any(|w| w.peer == peer) || c.slicers.iter().any(|&(p, _)| p == peer);
        let delivered = |c: &Chunk| {
            c.phase != ChunkPhase::Waiting
                || c.writers.iter().flatten().any(|w| w.peer == peer && w.arrived)
                || c.slicers.contains(&(peer, true))
        };
        let affected: Vec<u64> = st
            .rooms
            .iter()
            .filter(|(_, r)| r.chunks.iter().any(wrote) && !r.chunks.iter().all(delivered))
            .map(|(id, _)| *id)
            .collect();
        for room in affected {
            let why = format!("a sender disconnected before delivering every chunk: {reason}");
            self.fail_room(&mut st, room, Status::KVSTAGE_E_PEER_GONE, why, session);
        }
    }

    pub fn shutdown(&self) {
        self.closing.store(true, std::sync::atomic::Ordering::SeqCst);
        let st = self.state.lock();
        for p in st.peers.values() {
            p.shutdown();
        }
    }
}

/// A frame whose target is invalid closes the session (`PROTOCOL`); one for a room that was
/// released or failed meanwhile is drained so the stream stays in sync.
fn drain_or_fail(reader: &mut TcpStream, e: Error, len: u64) -> Result<()> {
    if e.code() == Status::KVSTAGE_E_PROTOCOL {
        return Err(e);
    }
    let copied = std::io::copy(&mut reader.by_ref().take(len), &mut std::io::sink())?;
    if copied != len {
        return Err(reject(Status::KVSTAGE_E_PEER_GONE, "connection closed inside a payload"));
    }
    Ok(())
}

/// Takes the grants of every chunk not being scattered (a running scatter frees its own).
fn take_grants(r: &mut Room) -> (Vec<u64>, bool) {
    let mut freed = Vec::new();
    let mut scattering = false;
    for c in &mut r.chunks {
        if c.phase == ChunkPhase::Scattering {
            scattering = true;
        } else {
            freed.extend(c.grant.take().map(|g| g.id));
        }
    }
    (freed, scattering)
}

fn r_done(room: Option<&Room>) -> String {
    room.map_or("room gone".to_owned(), |r| {
        format!("{} of {} chunks done", r.chunks.iter().filter(|c| c.phase == ChunkPhase::Done).count(), r.chunks.len())
    })
}

/// The room a frame names, if it can still take data. A released or failed room gives that room's
/// error (not `PROTOCOL`: late frames are drained and the sender learns why from the reply); an
/// unknown room is a protocol error.
fn live_room(st: &mut State, room: u64) -> Result<&mut Room> {
    let live = match st.rooms.get(&room) {
        Some(r) => !r.released && r.failure.is_none(),
        None if st.released.contains(&room) => false,
        None => return Err(reject(Status::KVSTAGE_E_PROTOCOL, format!("unknown room {room}"))),
    };
    if !live {
        return Err(closed_room(st, room));
    }
    Ok(st.rooms.get_mut(&room).expect("checked above"))
}

/// Error for a reply about a room that can no longer take data.
fn closed_room(st: &State, room: u64) -> Error {
    match st.rooms.get(&room).and_then(|r| r.failure.clone()) {
        Some((code, why, _)) => reject(code, format!("room {room} failed: {why}")),
        None => reject(Status::KVSTAGE_E_CANCELED, format!("room {room} was released by the receiver")),
    }
}

fn broadcast(st: &State, msg: &Message) {
    for p in st.peers.values() {
        // A dead or stuck peer is cut off by its failed send; the others still get the message.
        let _ = p.send(msg, &reply_deadline());
    }
}

/// Checks a sender's hello against our shape: versions, fingerprint diff, pairing.
pub fn verify_peer(ours: &PoolShape, hello: &Hello) -> Result<()> {
    let theirs = Fingerprint::decode(&hello.fingerprint)?;
    Fingerprint::of(ours).check(&theirs)?;
    pairing(&hello.shape, ours).map(|_| ())
}
