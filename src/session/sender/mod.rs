//! Prefill side: one session per (prefill rank, decode rank) peering.
//!
//! A staged transfer of one chunk: plan → allocate in the receiver's ring → wait for the watermark
//! → gather into the staging buffer (or, same host, into the granted range itself) → one bulk
//! write + ready → wait for the arrival ack. Anything that fails after the grant sends an abort
//! first, so the receiver frees the space.
//!
//! Files: `connect` (handshake, transport negotiation, the reply reader), `staged` (the staged
//! path: plan, grant, gather, write, ack), `pipelined` (a chunk written in pieces while the next
//! is gathered), `from_pool` (TCP writes straight from a host pool's rows), `direct` (same-host
//! direct mode: page to page into the mapped decode pool), `layerwise` (layers sent as the
//! caller marks them ready), `stall` (the stall warning), `describe` (an operation's and a
//! session's describe documents); this file: the session, its waits, the slice path and
//! asynchronous operations.

mod connect;
mod direct;
mod from_pool;
pub use from_pool::SEND_FROM_POOL_MIN_RUN;
pub mod describe;
mod layerwise;
mod pipelined;
mod stall;
mod staged;

pub use stall::StallWarn;
use stall::Stall;

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::op::{Op, Waker};
use super::{checksum, pairing, Deadline, Integrity, Pairing};
use super::layers::LayerGate;
use super::notify::Completions;
use super::staging::StagingPool;
use super::stats::{since, LinkKind, SendCounters, SendMetrics, SessionStats, TransferTimings};
use super::workers::Workers;
use crate::copy::{CopyEngine, ReadyFence};
use crate::error::{Error, Result, Status};
use crate::geometry::{self, Fingerprint, KvLayout, MemoryKind};
use crate::protocol::{self, Hello, Message, RoomRef, PROTOCOL_VERSION};
use crate::ring::Watermark;
use crate::transport::faults::FaultyTransport;
use crate::transport::shm::Negotiated;
use crate::transport::tcp::{self, TcpTransport};
use crate::transport::{SlicePayload, Transport};

/// What sender sessions need from the engine's options.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// Largest send staging buffer (one writer's share of a chunk); larger chunks fall back.
    pub send_staging_bytes: u64,
    /// Pieces of a whole chunk's write from host staging (`0`: one write after the whole gather).
    pub send_piece_bytes: u64,
    /// A whole chunk of a host pool goes over TCP straight from the pool, without staging.
    pub send_from_pool: bool,
    /// Secret presented in the handshake (empty: none).
    pub cluster_token: Vec<u8>,
    /// This side's integrity policy; the stronger of both sides' applies.
    pub integrity: Integrity,
    /// Deadline of an operation without its own (`None`: infinite).
    pub default_deadline: Option<Duration>,
    /// Keepalive and `TCP_USER_TIMEOUT` of the session's connection.
    pub dead_peer_timeout: Option<Duration>,
    /// Test only: faults injected into this side's connections.
    pub faults: Option<crate::transport::faults::Faults>,
    /// When a transfer waiting without progress is reported (one WARN per wait).
    pub stall_warn: StallWarn,
}

/// Engine-wide resources every sender session uses.
pub struct SendResources {
    pub pool: Arc<Mutex<Option<Arc<KvLayout>>>>,
    /// The engine's components (request parts besides the KV), once registered.
    pub components: Arc<Mutex<Option<Arc<crate::copy::Components>>>>,
    pub copy: Arc<dyn CopyEngine>,
    /// Send staging buffers, bounded in count and bytes, reused across chunks.
    pub staging: StagingPool,
    /// Runs asynchronous transfers (a fixed set of threads, fair between sessions).
    pub workers: Workers,
    pub options: SenderConfig,
    /// Where finished asynchronous operations are signalled.
    pub completions: Arc<Completions>,
    /// RDMA devices of the engine (inactive for transport tcp or without a device).
    pub rdma: Arc<crate::transport::rdma::Rdma>,
    /// The same-host path's mode and counters.
    pub shm: Arc<crate::transport::shm::Shm>,
    /// Sender counters of the engine (every session adds to them as well as to its own).
    pub counters: Arc<SendCounters>,
}

/// The target of the sender's log records, whichever of its files logs them (filters name it).
const LOG_TARGET: &str = module_path!();

/// Distinct keys for the sessions' worker queues.
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// How long an abort may take to leave: it is best effort, the receiver also cleans up when the
/// connection closes.
const ABORT_DEADLINE: Duration = Duration::from_secs(1);

pub use crate::session::RoomGrid;

/// One chunk to send: the prefill pages holding its tokens, in chunk order.
#[derive(Clone, Debug, Default)]
pub struct TransferDesc {
    /// The decode room and the key of its opening the decode side handed out.
    pub room: RoomRef,
    pub chunk: u32,
    pub pages: Vec<u32>,
    /// Slots of `pages[0]` before the chunk's first token: where the decode side's cached prefix
    /// (whole decode pages) or the previous chunk ends inside a prefill page.
    pub src_token_offset: u32,
    /// Tokens of the chunk; 0: every slot of `pages` from `src_token_offset` on.
    pub num_tokens: u32,
    /// The request's trace id (the engine's request id); `None`: derived from the room's opening.
    pub trace: Option<String>,
    pub timeout: Option<Duration>,
    /// CUDA pools: the producer's ready point; the gather is ordered after it.
    pub ready: Option<Arc<ReadyFence>>,
    /// Layer-wise sending: the chunk's layers become ready over time, marked on this gate (each
    /// batch with its own ready point, so `ready` must be `None`).
    pub layers: Option<Arc<LayerGate>>,
    /// The request's parts besides the KV (aux row, state slots, extra pools' pages), sent with
    /// the room's last chunk.
    pub parts: Option<Arc<geometry::RequestParts>>,
}

impl TransferDesc {
    /// The trace id in front of this request's log lines on both sides: the caller's, or the one
    /// both sides derive from the room's opening.
    pub fn trace_id(&self) -> String {
        self.trace.clone().unwrap_or_else(|| protocol::trace::derived_trace(self.room))
    }

    /// The chunk's tokens in `pages` (pages of `page_size` slots), checked to be held exactly by
    /// them (`KVSTAGE_E_INVALID_ARG` naming the descriptor's field).
    pub fn span(&self, page_size: u32) -> Result<geometry::PageSpan<'_>> {
        let tokens = match self.num_tokens {
            0 => (self.pages.len() as u64 * page_size as u64).saturating_sub(self.src_token_offset as u64),
            n => n as u64,
        };
        let span = geometry::PageSpan { pages: &self.pages, first_token: self.src_token_offset, tokens };
        span.check(page_size, "desc->src_pages", "desc->src_token_offset")?;
        if tokens > u32::MAX as u64 {
            return Err(Error::invalid_arg("desc->num_pages", format!("the chunk holds {tokens} tokens, more than a chunk may (2^32 - 1)")));
        }
        Ok(span)
    }
}

struct State {
    watermark: Watermark,
    /// Requests a caller still waits for (each a [`Pending`]); a reply to any other id is
    /// dropped and counted, so a receiver cannot grow `replies` at will.
    awaited: HashSet<u64>,
    /// Replies to awaited requests not yet taken: at most one each.
    replies: HashMap<u64, Message>,
    replies_dropped: u64,
    dead: Option<(Status, String)>,
}

/// A request id whose reply is awaited, from before its request goes out until the caller is
/// done with it (on every path: its reply, if any, goes with it).
pub(super) struct Pending<'a> {
    session: &'a SenderSession,
    pub req: u64,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut st = self.session.shared.state.lock();
        st.awaited.remove(&self.req);
        st.replies.remove(&self.req);
    }
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Waker for Shared {
    fn wake(&self) {
        let _guard = self.state.lock();
        self.cv.notify_all();
    }
}

pub struct SenderSession {
    id: String,
    link: Arc<dyn Transport>,
    remote: Hello,
    /// Head group (TP writer) and heads of this pair (fixed at the handshake).
    pair: Pairing,
    resources: Arc<SendResources>,
    pool: Arc<KvLayout>,
    /// The engine's components when the session connected (matched with the peer's then).
    components: Arc<crate::copy::Components>,
    shared: Arc<Shared>,
    next_req: AtomicU64,
    reader: Mutex<Option<JoinHandle<()>>>,
    /// The stronger of both sides' integrity policies.
    integrity: Integrity,
    /// This session's queue on the engine's transfer workers.
    key: u64,
    /// The decode peer's address (for the log).
    peer: SocketAddr,
    /// A fallback to the slice path was logged (warn once per session, then debug).
    fallback_logged: AtomicBool,
    /// (room opening, chunk) of the transfers running on this session: one at a time each,
    /// because the receiver knows a writer's chunk by (connection, room opening, chunk) and an
    /// abort for one would end the other's quarantine while it may still write in place.
    running: Mutex<HashSet<(RoomRef, u32)>>,
    /// This session's counters and the engine's.
    metrics: SendMetrics,
    /// How chunks move; `downgraded`: a faster path was asked for (auto) and counted as a
    /// downgrade, the session runs on a slower one.
    link_kind: LinkKind,
    downgraded: bool,
    /// The CUDA device whose memory this session stages in (its NIC reads GPU memory and the
    /// pool is there); `None`: host staging.
    device_staging: Option<i32>,
    /// Device staging memory could not be registered with the NIC: host staging from then on.
    gpudirect_refused: AtomicBool,
}

impl SenderSession {

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn waker(&self) -> Arc<dyn Waker> {
        self.shared.clone()
    }

    /// The local pool this session sends from.
    pub fn pool(&self) -> &KvLayout {
        &self.pool
    }

    pub fn default_timeout(&self) -> Option<Duration> {
        self.resources.options.default_deadline
    }

    /// Ends the session now: waiting operations fail at once with `why`.
    pub fn close(&self, why: &str) {
        log::debug!(session = self.id.as_str(); "session to {} closed: {why}", self.peer);
        let mut st = self.shared.state.lock();
        st.dead.get_or_insert((Status::KVSTAGE_E_CANCELED, why.to_owned()));
        self.shared.cv.notify_all();
        drop(st);
        self.link.shutdown();
    }

    pub fn remote_ring_bytes(&self) -> u64 {
        self.remote.ring_bytes
    }

    /// This session's counters (bytes, chunks, transfers by result, in flight, summed phase
    /// timings) and its transport.
    pub fn stats(&self) -> SessionStats {
        // A write that failed cut the stream at once; the reader notices its end a moment later.
        let dead = self.shared.state.lock().dead.as_ref().map(|&(code, _)| code).or_else(|| self.link.is_cut().then_some(Status::KVSTAGE_E_PEER_GONE));
        SessionStats { send: self.metrics.session.snapshot(), link: self.link_kind, downgraded: self.downgraded, dead }
    }

    /// The staged path for one chunk. `Ok(FALLBACK)` means nothing was allocated anywhere.
    pub fn transfer(&self, desc: &TransferDesc, op: &Op) -> Result<Status> {
        self.transfer_timed(desc, op).0
    }

    /// [`transfer`](Self::transfer), with the transfer's phase timings (zeros when an argument is
    /// bad: the transfer never started and is not counted).
    pub fn transfer_timed(&self, desc: &TransferDesc, op: &Op) -> (Result<Status>, TransferTimings) {
        self.counted(desc, op, false, |t| self.staged(desc, op, t))
    }

    /// [`transfer_slices`](Self::transfer_slices), with the transfer's phase timings.
    pub fn transfer_slices_timed(&self, desc: &TransferDesc, op: &Op) -> (Result<Status>, TransferTimings) {
        self.counted(desc, op, true, |t| self.slices(desc, op, t))
    }

    /// A gate for a layer-wise transfer on this session ([`TransferDesc::layers`]).
    pub fn layer_gate(&self) -> Arc<LayerGate> {
        LayerGate::new(self.pool.clone(), self.waker())
    }

    /// The argument checks of a transfer, made before it starts (a bad argument is not counted).
    fn check_args(&self, desc: &TransferDesc, slices: bool) -> Result<()> {
        if slices && desc.layers.is_some() {
            return Err(Error::invalid_arg("desc", "the slice path does not send layer by layer").with_session(&self.id));
        }
        if desc.layers.is_some() && desc.ready.is_some() {
            return Err(Error::invalid_arg("desc->cuda_event", "is set on a layer-wise transfer (each layer batch carries its own ready point)").with_session(&self.id));
        }
        if let Some(parts) = &desc.parts {
            let path = if slices { Some("the slice path") } else { desc.layers.as_ref().map(|_| "a layer-wise transfer") };
            if let Some(path) = path {
                return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, format!("request parts (desc->parts) travel with a whole staged chunk, not by {path}")).with_session(&self.id));
            }
            self.components.check_parts(parts, "desc->parts").map_err(|e| e.with_session(&self.id))?;
        }
        if let Some(why) = desc.trace.as_deref().and_then(|t| protocol::trace::check_trace(t).err()) {
            return Err(Error::invalid_arg("desc->trace_id", why).with_session(&self.id));
        }
        let span = desc.span(self.pool.shape.page_size).map_err(|e| e.with_session(&self.id))?;
        let dst_page = self.remote.shape.page_size as u64;
        if slices && !span.tokens.is_multiple_of(dst_page) {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!(
                    "the slice path moves whole decode pages: the chunk's {} tokens are not a multiple of the decode page size {dst_page} (send it staged)",
                    span.tokens
                ),
            )
            .with_session(&self.id));
        }
        self.pool.check_pages(&desc.pages, "desc->src_pages").map_err(|e| e.with_session(&self.id))
    }

    /// Runs a synchronous transfer: in flight meanwhile, timed, its result counted (a panic as
    /// `KVSTAGE_E_PANIC`, then it goes on unwinding).
    fn counted(&self, desc: &TransferDesc, op: &Op, slices: bool, f: impl FnOnce(&mut TransferTimings) -> Result<Status>) -> (Result<Status>, TransferTimings) {
        if let Err(e) = self.check_args(desc, slices) {
            return (Err(e), TransferTimings::ZERO);
        }
        let _running = match RunningChunk::claim(self, desc) {
            Ok(claim) => claim,
            Err(e) => return (Err(e), TransferTimings::ZERO),
        };
        let started = Instant::now();
        op.start(&self.id, desc.trace_id(), desc.room.id, desc.chunk, if slices { "slices" } else { "staged" }, "starting", desc.timeout.map(|t| started + t));
        let _in_flight = self.metrics.start();
        let mut t = TransferTimings::default();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut t)));
        t.finish_total(started);
        match outcome {
            Ok(result) => {
                self.metrics.finished(&result, &t);
                (result, t)
            }
            Err(panic) => {
                self.metrics.finished(&Err(Error::new(Status::KVSTAGE_E_PANIC, "the transfer panicked")), &t);
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// Queues `desc` on the engine's transfer workers and returns its operation at once; the
    /// deadline runs from now (time spent queued counts). `slices` selects the slice path.
    pub fn transfer_async(self: &Arc<Self>, mut desc: TransferDesc, slices: bool, tag: u64) -> Result<Arc<Op>> {
        // A bad argument fails the call at once: no operation, nothing counted.
        self.check_args(&desc, slices)?;
        let op = Op::notifying(self.waker(), self.resources.completions.clone(), tag, desc.layers.clone(), self.default_timeout());
        let (session, worker_op) = (self.clone(), op.clone());
        let queued = Instant::now();
        op.start(&self.id, desc.trace_id(), desc.room.id, desc.chunk, if slices { "slices" } else { "staged" }, "queued", desc.timeout.map(|t| queued + t));
        // In flight from now until the worker finished it (or the submission failed).
        let in_flight = self.metrics.start();
        self.resources.workers.submit(self.key, move || {
            let mut timings = TransferTimings { queued_ns: since(queued), ..TransferTimings::default() };
            desc.timeout = desc.timeout.map(|t| t.saturating_sub(queued.elapsed()));
            // A panic still finishes the operation, or its waiters would hang.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if desc.timeout == Some(Duration::ZERO) {
                    return Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "the deadline passed while the transfer was queued"));
                }
                let _running = RunningChunk::claim(&session, &desc)?;
                if slices {
                    session.slices(&desc, &worker_op, &mut timings)
                } else {
                    session.staged(&desc, &worker_op, &mut timings)
                }
            }))
            .unwrap_or_else(|p| {
                let e = Error::from_panic("the transfer worker panicked", &*p).with_session(session.id());
                log::error!(session = session.id(); "[{}] room {} chunk {}: {}", desc.trace_id(), desc.room, desc.chunk, e.chain());
                Err(e)
            });
            timings.finish_total(queued);
            // Counted before the operation's waiters wake, so they see it in the stats.
            session.metrics.finished(&result, &timings);
            drop(in_flight);
            worker_op.finish_timed(result, timings);
        })?;
        Ok(op)
    }

    /// The slice path for the same chunk: one write per token per layer per K/V, into the decode
    /// pages of the room (the fallback and the benchmark baseline).
    pub fn transfer_slices(&self, desc: &TransferDesc, op: &Op) -> Result<Status> {
        self.transfer_slices_timed(desc, op).0
    }

    fn slices(&self, desc: &TransferDesc, op: &Op, t: &mut TransferTimings) -> Result<Status> {
        let result = self
            .slices_inner(desc, op, t)
            .map_err(|e| e.context(format!("slice transfer of room {} chunk {} failed", desc.room, desc.chunk)).with_session(&self.id));
        self.log_outcome("slice", desc, &result);
        result
    }

    fn slices_inner(&self, desc: &TransferDesc, op: &Op, t: &mut TransferTimings) -> Result<Status> {
        if self.pool.memory != MemoryKind::Host {
            return Err(Error::new(Status::KVSTAGE_E_UNSUPPORTED, "the slice path reads the KV pool from the CPU: host pools only"));
        }
        if self.pair.writer.is_none() {
            return Ok(Status::KVSTAGE_OK); // another prefill rank sends these heads
        }
        let deadline = Deadline::after(desc.timeout);
        let src = &self.pool.shape;
        let dst = &self.remote.shape;
        let hs = self.pair.heads;
        // Destination pages 0..n make every decode offset chunk-relative: the receiver resolves
        // (buffer, token within chunk, byte within the token slot) against its own room pages.
        let span = desc.span(src.page_size)?;
        let chunk_pages: Vec<u32> = (0..span.tokens.div_ceil(dst.page_size as u64) as u32).collect();
        let ops = geometry::slice_plan(&*self.pool, dst, &hs, &span, &geometry::PageSpan { pages: &chunk_pages, first_token: 0, tokens: span.tokens })?;
        let dst_token_bytes = |buffer: u32| dst.token_bytes_of(buffer / dst.layer_count());
        let bytes: u64 = ops.iter().map(|o| o.len).sum();
        let mut frames = ops.iter().map(|o| {
            let base = self.pool.bases[o.src_buffer as usize] as *const u8;
            let piece = (o.len / o.src_pieces as u64) as usize;
            // SAFETY: slice_plan produced offsets inside the registered (checked) pages.
            let at = |p: u32| unsafe { std::slice::from_raw_parts(base.add((o.src_offset + p as u64 * o.src_piece_stride) as usize), piece) };
            let payload = match o.src_pieces {
                1 => SlicePayload::One(at(0)),
                n => SlicePayload::Pieces((0..n).map(at).collect()),
            };
            let header = Message::Slice {
                room: desc.room,
                chunk: desc.chunk,
                buffer: o.dst_buffer,
                token: (o.dst_offset / dst_token_bytes(o.dst_buffer)) as u32,
                byte_offset: (o.dst_offset % dst_token_bytes(o.dst_buffer)) as u32,
                len: o.len as u32,
            };
            (header, payload)
        });
        // The receiver's word that this opening is live before any byte goes out (the staged
        // path has it from the allocation): a stale key costs a round trip, not the chunk.
        op.enter("waiting_for_allocation", || format!("the receiver {} to say the room is open", self.link.describe()));
        self.grid(desc.room, &deadline, op)?;
        let pending = self.expect_reply();
        op.enter("writing", String::new);
        let phase = Instant::now();
        let wrote = self.link.write_slices(&mut frames, &Message::SliceDone { req: pending.req, room: desc.room, chunk: desc.chunk }, &deadline);
        t.wire_ns = since(phase);
        wrote?;
        self.metrics.sent(bytes);
        op.enter("waiting_for_acknowledgement", || format!("the receiver {}", self.link.describe()));
        let phase = Instant::now();
        let ack = self.wait_reply(&pending, &deadline, op, "waiting for the slice acknowledgement", None);
        t.ack_ns = since(phase);
        match ack? {
            Message::Arrived { status: 0, .. } => Ok(Status::KVSTAGE_OK),
            Message::Arrived { status, reason, .. } => {
                let code = Status::from_code(status).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
                Err(Error::new(code, format!("the receiver rejected the slices: {reason}")))
            }
            other => Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unexpected reply {other:?}"))),
        }
    }

    /// The chunk grid of `room` as the receiver opened it: what chunk `k` of a transfer must
    /// cover (pages `[k · chunk_tokens / page_size, …)` of the room, the last chunk possibly
    /// shorter). Fails as the receiver says (`KVSTAGE_E_STALE_ROOM` for an opening it does not have
    /// open) or when `timeout` (`None`: no limit) passes.
    pub fn room_grid(&self, room: RoomRef, timeout: Option<Duration>) -> Result<RoomGrid> {
        self.grid(room, &Deadline::after(timeout), &Op::new(self.waker()))
    }

    fn grid(&self, room: RoomRef, deadline: &Deadline, op: &Op) -> Result<RoomGrid> {
        let pending = self.expect_reply();
        self.link.send(&Message::GridReq { req: pending.req, room }, deadline)?;
        match self.wait_reply(&pending, deadline, op, "waiting for the room's chunk grid", None)? {
            Message::GridRsp { status: 0, chunk_tokens, num_chunks, num_pages, prefix_tokens, .. } => {
                Ok(RoomGrid { chunk_tokens, num_chunks, num_pages, page_size: self.remote.shape.page_size, prefix_tokens })
            }
            Message::GridRsp { status, reason, .. } => {
                let code = Status::from_code(status).unwrap_or(Status::KVSTAGE_E_PROTOCOL);
                Err(Error::new(code, format!("the receiver has no grid for room {room}: {reason}")).with_session(&self.id))
            }
            other => Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("unexpected reply {other:?}"))),
        }
    }

    /// Gives up a chunk (failed with `e`) whose bytes went into the stream up to `mark` (the
    /// [`Transport::stream_mark`] after its last write, `None` when nothing of it was written).
    /// When its deadline passed and the peer has not acknowledged those bytes yet, an abort would
    /// wait behind them, and the receiver's grant (with its ring's watermark) for as long as they
    /// take: the connection is reset instead and the session dies (README, "Failure semantics");
    /// the receiver frees the grant once the reset arrives. A cancel never resets: the chunk's
    /// deadline still bounds what its bytes can hold, and the session's other transfers go on.
    fn abort_written(&self, desc: &TransferDesc, mark: Option<u64>, e: &Error) {
        if self.link.is_cut() {
            return; // a write failed and cut the stream already: no abort can follow it
        }
        let stuck = e.code() == Status::KVSTAGE_E_TIMEOUT && mark.is_some_and(|m| !self.link.acknowledged(m));
        if !stuck {
            return self.abort(desc, e.message());
        }
        let why = format!(
            "reset by this side: room {} chunk {} passed its deadline with its bytes still unacknowledged by the receiver's TCP ({})",
            desc.room,
            desc.chunk,
            e.message()
        );
        {
            let mut st = self.shared.state.lock();
            if st.dead.is_some() {
                return; // dead already (closed, freed, gone): nothing left to cut
            }
            st.dead = Some((Status::KVSTAGE_E_PEER_GONE, why.clone()));
            self.shared.cv.notify_all();
        }
        log::warn!(target: LOG_TARGET, session = self.id.as_str(); "connection to the receiver ({}) reset: {why}", self.link.describe());
        self.link.reset();
    }

    fn abort(&self, desc: &TransferDesc, reason: &str) {
        // Best effort: if the link is gone the receiver frees the space when it notices.
        let msg = Message::Abort { room: desc.room, chunk: desc.chunk, reason: reason.to_owned() };
        let _ = self.link.send(&msg, &Deadline::after(Some(ABORT_DEADLINE)));
    }

    fn check_alive(&self, st: &State, deadline: &Deadline, op: &Op, what: &str) -> Result<()> {
        if let Some((code, why)) = &st.dead {
            return Err(Error::new(*code, format!("peer {} is gone ({why}) while {what}", self.link.describe())));
        }
        if self.link.is_cut() {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("the connection to {} was cut (a write to it failed) while {what}", self.link.describe())));
        }
        if op.is_canceled() {
            return Err(Error::new(Status::KVSTAGE_E_CANCELED, format!("canceled while {what}")));
        }
        if deadline.expired() {
            return Err(deadline.timeout_error(what));
        }
        Ok(())
    }

    /// A new request id, its reply awaited until the returned [`Pending`] drops.
    pub(super) fn expect_reply(&self) -> Pending<'_> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        self.shared.state.lock().awaited.insert(req);
        Pending { session: self, req }
    }

    /// Replies the receiver sent to requests nobody awaited (late, duplicated or made up).
    pub fn replies_dropped(&self) -> u64 {
        self.shared.state.lock().replies_dropped
    }

    /// Waits for the reply to `pending`; a transfer's wait (`stall`) that makes no progress for
    /// long is reported once.
    fn wait_reply(&self, pending: &Pending<'_>, deadline: &Deadline, op: &Op, what: &str, mut stall: Option<&mut Stall>) -> Result<Message> {
        let req = pending.req;
        let mut st = self.shared.state.lock();
        if let Some(s) = stall.as_deref_mut() {
            s.progress();
        }
        loop {
            if let Some(msg) = st.replies.remove(&req) {
                return Ok(msg);
            }
            self.check_alive(&st, deadline, op, what)?;
            match stall.as_deref_mut() {
                Some(s) => s.wait(deadline, &self.shared.cv, &mut st, |_| format!("{what} from the receiver ({})", self.link.describe())),
                None => {
                    deadline.wait(&self.shared.cv, &mut st);
                }
            }
        }
    }

    /// Back-pressure: blocks (without spinning) until the receiver's watermark allows the write.
    fn wait_writable(&self, round: u64, end: u64, deadline: &Deadline, op: &Op, stall: &mut Stall) -> Result<()> {
        let mut st = self.shared.state.lock();
        if !st.watermark.permits(round, end) {
            let w = st.watermark;
            op.enter("waiting_for_watermark", || {
                format!(
                    "this grant ends at offset {end} of the receiver's ring round {round}; its watermark was at round {} offset {} (an older allocation there still holds the space)",
                    w.round, w.offset
                )
            });
        }
        stall.progress();
        loop {
            if st.watermark.permits(round, end) {
                return Ok(());
            }
            self.check_alive(&st, deadline, op, &format!("waiting for the receiver's watermark (round {round})"))?;
            stall.wait(deadline, &self.shared.cv, &mut st, |st| {
                let w = st.watermark;
                format!(
                    "waiting for the receiver's watermark: this grant ends at offset {end} of ring round {round}, the watermark is at round {} offset {} (an older allocation on the receiver still holds that ring space)",
                    w.round, w.offset
                )
            });
        }
    }
}

/// A (room, chunk) running on a session, released on drop.
struct RunningChunk<'a> {
    session: &'a SenderSession,
    key: (RoomRef, u32),
}

impl<'a> RunningChunk<'a> {
    fn claim(session: &'a SenderSession, desc: &TransferDesc) -> Result<RunningChunk<'a>> {
        let key = (desc.room, desc.chunk);
        if !session.running.lock().insert(key) {
            return Err(Error::invalid_arg(
                "desc",
                format!("room {} chunk {} is already being sent on this session; one transfer per chunk at a time", desc.room, desc.chunk),
            )
            .with_session(&session.id));
        }
        Ok(RunningChunk { session, key })
    }
}

impl Drop for RunningChunk<'_> {
    fn drop(&mut self) {
        self.session.running.lock().remove(&self.key);
    }
}

impl Drop for SenderSession {
    fn drop(&mut self) {
        // Marked first, so the reader takes the end of the stream for what it is.
        self.shared.state.lock().dead.get_or_insert((Status::KVSTAGE_E_CANCELED, "the session was freed".to_owned()));
        log::info!(session = self.id.as_str(); "session to {} closed", self.peer);
        self.link.shutdown();
        if let Some(h) = self.reader.lock().take() {
            let _ = h.join();
        }
    }
}

