//! A prefill side (this process, one engine per rank) and a decode side (a child process, one
//! engine per rank) on one machine, driven by line commands over the child's stdin/stdout. Used by
//! the demo, the benchmark and the multi-process tests.
//!
//! Child commands (one line each, one reply line each):
//! `room ID [K]` opens room ID on every decode rank (with K: only the first K pages of each chunk,
//! in chunks of K pages, for runs that send partial chunks) and answers `keys KEY0 KEY1 ...`, each
//! decode rank's key of this opening (what an engine's bootstrap carries) · `wait ID` waits until it is scattered everywhere ·
//! `verify ID` compares the decode pools with the reference · `verify-exact ID` compares every
//! byte of every decode pool: the pages of room ID's set, and of the other set if a room of it was
//! opened since the last `clear`, hold the reference, every other byte (padding included) is still
//! zero (refused after a room of partial chunks) · `clear` zeroes every decode pool (refused while
//! a room is open) · `release ID` · `raw BYTES [STREAMS]`
//! accepts STREAMS (default 1) connections on the raw TCP listener, reads each until its sender
//! shuts it down, acknowledges each, and answers `raw TOTAL` · `watch ID` reports room ID's end
//! through `next` · `next` waits until a watched room is scattered everywhere (or failed) and
//! answers `done ID AGO_NS` (how long ago it completed) · `quit`.
//!
//! Rooms open on decode pages that alternate between two sets (odd and even room ids): many rooms
//! in flight at once share pages. Every room carries the same request, so shared pages receive
//! the same bytes and `verify` still checks what the last room scattered.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::geometry::{self, LayoutPreset, ModelKind};
use kvstage::protocol::RoomRef;
use kvstage::session::notify::{ChunkEvent, Completion, EventKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::{Error, Result, Status};

use crate::parts::PartsMemory;

/// Bytes of one raw TCP write, and of a raw stream's receive buffer unless it receives into
/// memory as large as the stream.
pub const RAW_BUFFER: usize = 8 << 20;
use crate::{page_table, HostPool, Model};

/// Everything both processes must agree on; passed to the child as command-line flags.
#[derive(Clone, Debug)]
pub struct Setup {
    pub model: Model,
    pub prefill_tp: u32,
    pub decode_tp: u32,
    pub page_size: u32,
    /// Tokens of one room (request).
    pub tokens: u32,
    /// Decode chunk grid.
    pub chunk_tokens: u32,
    /// Decode staging ring size in chunk allocations.
    pub ring_chunks: u32,
    /// Transport of every engine, on both sides.
    pub transport: TransportKind,
    /// Request parts besides the KV ([`crate::parts`]): aux buffers (one row each per request)
    /// and bytes of state per request (0: none).
    pub aux_rows: u32,
    pub state_bytes: u64,
    /// Direct mode for same-host sessions: the decode pools lie in shared memory and both sides
    /// allow it (`false`: every chunk through the decode ring).
    pub direct: bool,
    /// How each side's pools lay out their bytes (each side's own: only the shape crosses the
    /// wire). `--prefill-layout`, `--decode-layout`; sglang by default.
    pub prefill_layout: LayoutPreset,
    pub decode_layout: LayoutPreset,
    /// Bytes after every page (block) of every pool, both sides (`--page-pad`; 0 by default):
    /// see [`crate::Reference`] for which strides grow with it.
    pub page_pad: u64,
}

impl Setup {
    pub fn pages(&self) -> usize {
        (self.tokens / self.page_size) as usize
    }

    /// Pool capacity: two rooms' pages (rooms alternate between them) plus slack.
    pub fn capacity(&self) -> u64 {
        self.pages() as u64 * 2 + 16
    }

    pub fn grid_pages(&self) -> usize {
        let grid = geometry::grid_tokens(self.chunk_tokens, self.page_size);
        (grid / self.page_size) as usize
    }

    pub fn chunks(&self) -> usize {
        self.pages().div_ceil(self.grid_pages())
    }

    pub fn prefill_pages(&self, rank: u32) -> Vec<u32> {
        page_table(self.pages(), self.capacity(), 100 + rank as u64, false)
    }

    pub fn decode_pages(&self, rank: u32, room: u64) -> Vec<u32> {
        let all = page_table(self.pages() * 2, self.capacity(), 200 + rank as u64, false);
        let n = self.pages();
        if room % 2 == 1 { all[..n].to_vec() } else { all[n..].to_vec() }
    }

    /// The decode pages of a room that receives only the first `per_chunk` pages of each chunk
    /// (time-boxed slice runs): its chunks are `per_chunk` pages, so each one is sent whole.
    pub fn decode_pages_limited(&self, rank: u32, room: u64, per_chunk: usize) -> Vec<u32> {
        self.decode_pages(rank, room).chunks(self.grid_pages()).flat_map(|c| c[..per_chunk.min(c.len())].to_vec()).collect()
    }

    pub fn options(&self) -> EngineOptions {
        EngineOptions { chunk_tokens: self.chunk_tokens, transport: self.transport, same_host_direct: self.direct, ..EngineOptions::default() }
    }

    /// Which decode ranks prefill rank `rs` writes to (the library's pairing helper: a replica of
    /// heads another rank sends has no session to open).
    pub fn targets(&self, rs: u32) -> Vec<u32> {
        let src = self.model.shape(self.page_size, rs, self.prefill_tp);
        let decode_stage = self.model.shape(self.page_size, 0, self.decode_tp);
        geometry::decode_peers(&src, &[decode_stage]).map(|peers| peers.iter().map(|p| p.tp_rank).collect()).unwrap_or_default()
    }

    /// Sender sessions (prefill rank, decode rank pairs) one room uses.
    pub fn sessions(&self) -> usize {
        (0..self.prefill_tp).map(|rs| self.targets(rs).len()).sum()
    }

    /// Bytes of KV one room moves (all writers, all decode ranks).
    pub fn room_bytes(&self) -> Result<u64> {
        let mut total = 0;
        for rs in 0..self.prefill_tp {
            let src = self.model.shape(self.page_size, rs, self.prefill_tp);
            for rd in self.targets(rs) {
                let dst = self.model.shape(self.page_size, rd, self.decode_tp);
                if let Some(region) = geometry::staging_layout(&src, &dst, self.tokens)?.region_of(&src)? {
                    total += region.bytes;
                }
            }
        }
        Ok(total)
    }

    /// Writes (slice path) one room needs: one per token, layer and K/V per rank pair.
    pub fn room_slice_writes(&self) -> u64 {
        let pairs: u64 = (0..self.prefill_tp).map(|rs| self.targets(rs).len() as u64).sum();
        pairs * self.slice_writes_for(self.pages())
    }

    /// Slice writes for `pages` pages of one rank pair.
    pub fn slice_writes_for(&self, pages: usize) -> u64 {
        let buffers = if self.model.kind == ModelKind::Mla { 1 } else { 2 };
        self.model.layers as u64 * buffers * pages as u64 * self.page_size as u64
    }

    /// The flags that make a child process build the same setup.
    pub fn flags(&self) -> Vec<String> {
        let m = &self.model;
        [
            ("--model", m.name.to_string()),
            ("--kind", if m.kind == ModelKind::Mla { "mla" } else { "mha" }.to_string()),
            ("--layers", m.layers.to_string()),
            ("--kv-heads", m.kv_heads.to_string()),
            ("--head-dim", m.head_dim.to_string()),
            ("--head-dim-v", m.head_dim_v.to_string()),
            ("--dtype-bytes", m.dtype_bytes.to_string()),
            ("--prefill-tp", self.prefill_tp.to_string()),
            ("--decode-tp", self.decode_tp.to_string()),
            ("--page-size", self.page_size.to_string()),
            ("--tokens", self.tokens.to_string()),
            ("--chunk-tokens", self.chunk_tokens.to_string()),
            ("--ring-chunks", self.ring_chunks.to_string()),
            ("--transport", transport_name(self.transport).to_string()),
            ("--aux-rows", self.aux_rows.to_string()),
            ("--state-bytes", self.state_bytes.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .chain((!self.direct).then(|| "--no-direct".to_owned()))
        // Only where not the default: a child that predates them still parses the rest.
        .chain(self.layout_flags())
        .collect()
    }

    /// `--prefill-layout`, `--decode-layout` and `--page-pad`, each where not the default.
    pub fn layout_flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.prefill_layout != LayoutPreset::Sglang {
            out.extend(["--prefill-layout".to_owned(), self.prefill_layout.name().to_owned()]);
        }
        if self.decode_layout != LayoutPreset::Sglang {
            out.extend(["--decode-layout".to_owned(), self.decode_layout.name().to_owned()]);
        }
        if self.page_pad != 0 {
            out.extend(["--page-pad".to_owned(), self.page_pad.to_string()]);
        }
        out
    }

    /// The setup [`flags`](Self::flags) describe (for a child process without the tools' parser):
    /// every flag `flags` writes, each once at most; a model name of [`crate::MODELS`] is that
    /// preset, changed by the shape flags after it, any other name a custom shape.
    pub fn from_flags(args: &[String]) -> std::result::Result<Setup, String> {
        let mut s = Setup {
            model: crate::MODELS[0],
            prefill_tp: 1,
            decode_tp: 1,
            page_size: 16,
            tokens: 2048,
            chunk_tokens: 2048,
            ring_chunks: 2,
            transport: TransportKind::Tcp,
            aux_rows: 0,
            state_bytes: 0,
            direct: true,
            prefill_layout: LayoutPreset::Sglang,
            decode_layout: LayoutPreset::Sglang,
            page_pad: 0,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            if flag == "--no-direct" {
                s.direct = false;
                continue;
            }
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let num = |what: &str| value.parse::<u64>().map_err(|_| format!("{what} {value:?} is not a number"));
            let small = |what: &str| num(what).and_then(|v| u32::try_from(v).map_err(|_| format!("{what} {v} is too large")));
            match flag.as_str() {
                "--model" => {
                    s.model = crate::model(value).unwrap_or(Model { name: "custom", ..s.model });
                }
                "--kind" => {
                    s.model.kind = match value.as_str() {
                        "mha" => ModelKind::Mha,
                        "mla" => ModelKind::Mla,
                        other => return Err(format!("--kind {other:?} is not mha or mla")),
                    }
                }
                "--layers" => s.model.layers = small(flag)?,
                "--kv-heads" => s.model.kv_heads = small(flag)?,
                "--head-dim" => s.model.head_dim = small(flag)?,
                "--head-dim-v" => s.model.head_dim_v = small(flag)?,
                "--dtype-bytes" => s.model.dtype_bytes = small(flag)?,
                "--prefill-tp" => s.prefill_tp = small(flag)?,
                "--decode-tp" => s.decode_tp = small(flag)?,
                "--page-size" => s.page_size = small(flag)?,
                "--tokens" => s.tokens = small(flag)?,
                "--chunk-tokens" => s.chunk_tokens = small(flag)?,
                "--ring-chunks" => s.ring_chunks = small(flag)?,
                "--transport" => {
                    s.transport = match value.as_str() {
                        "tcp" => TransportKind::Tcp,
                        "rdma" => TransportKind::Rdma,
                        "shm" => TransportKind::Shm,
                        "auto" => TransportKind::Auto,
                        other => return Err(format!("--transport {other:?} is not tcp, rdma, shm or auto")),
                    }
                }
                "--aux-rows" => s.aux_rows = small(flag)?,
                "--state-bytes" => s.state_bytes = num(flag)?,
                "--prefill-layout" => s.prefill_layout = LayoutPreset::from_name(value).map_err(|e| e.message().to_owned())?,
                "--decode-layout" => s.decode_layout = LayoutPreset::from_name(value).map_err(|e| e.message().to_owned())?,
                "--page-pad" => s.page_pad = num(flag)?,
                other => return Err(format!("unknown flag {other:?}")),
            }
        }
        s.check()?;
        Ok(s)
    }

    /// The request's parts when `chunk` is the room's last (they travel with it).
    pub fn last_chunk_parts(&self, room: u64, chunk: usize) -> Option<Arc<kvstage::geometry::RequestParts>> {
        (chunk + 1 == self.chunks()).then(|| self.request_parts(room)).flatten().map(Arc::new)
    }

    pub fn check(&self) -> std::result::Result<(), String> {
        if self.tokens == 0 || self.page_size == 0 || !self.tokens.is_multiple_of(self.page_size) {
            return Err(format!("--tokens {} must be a positive multiple of --page-size {}", self.tokens, self.page_size));
        }
        if self.prefill_tp == 0 || self.decode_tp == 0 || self.ring_chunks == 0 {
            return Err("--prefill-tp, --decode-tp and --ring-chunks must be positive".into());
        }
        if !self.page_pad.is_multiple_of(self.model.dtype_bytes.max(1) as u64) {
            return Err(format!("--page-pad {} must be a multiple of the dtype's {} bytes", self.page_pad, self.model.dtype_bytes));
        }
        Ok(())
    }
}

/// `tcp`, `rdma`, `shm` or `auto`: the `--transport` value of `kind`.
pub fn transport_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Tcp => "tcp",
        TransportKind::Rdma => "rdma",
        TransportKind::Shm => "shm",
        TransportKind::Auto => "auto",
    }
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::from(e).context(what.to_owned())
}

/// Rooms the child reports through `next`: the chunk events and room events (one per decode rank)
/// still owed by each, and the rooms that ended (scattered everywhere, or failed) in the order
/// they ended.
#[derive(Default)]
struct Watched {
    owed: HashMap<u64, Owed>,
    ended: VecDeque<(u64, Instant, Option<String>)>,
}

/// What a watched room still owes: chunk events (over every decode rank) and room events (one
/// per decode rank, after its last chunk event).
#[derive(Clone, Copy, Debug)]
struct Owed {
    chunks: u64,
    rooms: u64,
}

#[derive(Default)]
struct Watch {
    state: Mutex<Watched>,
    cv: Condvar,
}

impl Watch {
    /// A decode engine's chunk or room event (called on a library thread, with no kvstage lock
    /// held). The room ends with the last rank's room event, which must come after every chunk
    /// event; a failed event of either kind ends it at once.
    fn event(&self, e: &ChunkEvent) {
        let mut st = self.state.lock();
        let Some(owed) = st.owed.get_mut(&e.room) else { return };
        let failure = match e.kind {
            _ if e.status != Status::KVSTAGE_OK => {
                let what = if e.kind == EventKind::Room { "the room" } else { "a chunk" };
                Some(format!("{what} ended with {}", e.status.name()))
            }
            EventKind::Chunk if owed.chunks == 0 => Some(format!("chunk {} reported more chunk events than the room has", e.chunk)),
            EventKind::Chunk => {
                owed.chunks -= 1;
                return;
            }
            EventKind::Room if owed.rooms == 0 => Some("more room events than decode ranks".to_owned()),
            EventKind::Room => {
                owed.rooms -= 1;
                if owed.rooms > 0 {
                    return;
                }
                (owed.chunks != 0).then(|| format!("every rank's room event came with {} chunk event(s) still owed", owed.chunks))
            }
        };
        st.owed.remove(&e.room);
        st.ended.push_back((e.room, Instant::now(), failure));
        self.cv.notify_all();
    }

    /// The next room that ended: its id, when, and why it failed.
    fn next(&self, timeout: Duration) -> Option<(u64, Instant, Option<String>)> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        loop {
            if let Some(e) = st.ended.pop_front() {
                return Some(e);
            }
            if st.owed.is_empty() || self.cv.wait_until(&mut st, deadline).timed_out() {
                return st.ended.pop_front();
            }
        }
    }
}

/// Receives one raw stream until its sender shuts it down, then acknowledges it: into `buf` from
/// its start on, again from its start whenever it is full.
fn raw_receive(mut stream: TcpStream, buf: &mut [u8]) -> Result<u64> {
    kvstage::transport::tcp::tune(&stream, None)?;
    let (mut got, mut at) = (0u64, 0usize);
    loop {
        if at == buf.len() {
            at = 0;
        }
        let n = stream.read(&mut buf[at..]).map_err(io_err("raw receive"))?;
        if n == 0 {
            break;
        }
        (got, at) = (got + n as u64, at + n);
    }
    stream.write_all(b"k").map_err(io_err("raw ack"))?;
    Ok(got)
}

/// Child side: builds the decode ranks, prints `ADDRS a b ... RAW r`, then serves commands.
pub fn serve_decode(setup: &Setup) -> Result<()> {
    serve_decode_with(setup, &DecodeOptions::default())
}

/// Options of the decode side beyond the [`Setup`] both sides share.
#[derive(Clone, Debug, Default)]
pub struct DecodeOptions {
    /// Decode rank whose engine stops reading after this many frames per connection (a stuck
    /// peer): `(rank, frames)`.
    pub stuck: Option<(u32, u64)>,
}

/// [`serve_decode`] with [`DecodeOptions`].
pub fn serve_decode_with(setup: &Setup, decode: &DecodeOptions) -> Result<()> {
    let watch = Arc::new(Watch::default());
    let mut ranks = Vec::new();
    for rd in 0..setup.decode_tp {
        let mut options = setup.options();
        if let Some((_, frames)) = decode.stuck.filter(|(r, _)| *r == rd) {
            let plan = kvstage::transport::faults::FaultPlan { stop_reading_after: Some(frames), ..Default::default() };
            options.faults = Some(kvstage::transport::faults::Faults { plan, counters: Default::default() });
        }
        let engine = Engine::new(options)?;
        let shape = setup.model.shape(setup.page_size, rd, setup.decode_tp);
        let pool = HostPool::with_layout(shape, setup.capacity(), setup.decode_layout, setup.page_pad, setup.direct);
        engine.register_pool(pool.layout.clone())?;
        let src = setup.model.shape(setup.page_size, 0, setup.prefill_tp);
        let chunk = setup.grid_pages() as u32 * setup.page_size;
        let per_chunk = geometry::staging_layout(&src, &pool.layout.shape, chunk)?.total_bytes;
        engine.register_staging(None, (per_chunk * setup.ring_chunks as u64) as usize)?;
        let parts = setup.has_parts().then(|| PartsMemory::register(setup, &engine, rd, setup.decode_tp, false)).transpose()?;
        let w = watch.clone();
        engine.completions().set_callback(Some(Arc::new(move |c: &Completion| {
            if let Completion::Chunk(e) = c {
                w.event(e);
            }
        })));
        ranks.push((engine, pool, parts));
    }
    let raw = TcpListener::bind("127.0.0.1:0")?;
    let addrs: Vec<String> = ranks.iter().map(|(e, _, _)| e.local_addr().to_string()).collect();
    let mut out = std::io::stdout();
    writeln!(out, "ADDRS {} RAW {}", addrs.join(" "), raw.local_addr()?).map_err(io_err("stdout"))?;
    out.flush().map_err(io_err("stdout"))?;
    // Raw TCP receive buffers: cache-warm, and as large as each stream.
    let (mut raw_bufs, mut raw_memory): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
    // Rooms opened with request parts (their items are verified too).
    let mut parted = std::collections::HashSet::new();
    // Page sets (room parities) of the full rooms opened since the last `clear`, and whether a
    // room of partial chunks was (`verify-exact` then has no reference).
    let mut written_sets = std::collections::BTreeSet::new();
    let mut partial_rooms = false;
    // Each open room's keys, one per decode rank (its latest opening).
    let mut opened: HashMap<u64, Vec<u64>> = HashMap::new();
    let opening = |opened: &HashMap<u64, Vec<u64>>, room: u64, rank: usize| RoomRef { id: room, key: opened.get(&room).and_then(|k| k.get(rank)).copied().unwrap_or(0) };
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(io_err("stdin"))?;
        let mut words = line.split_whitespace();
        let cmd = words.next().unwrap_or("");
        let arg: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let per_chunk: Option<usize> = words.next().and_then(|w| w.parse().ok());
        let reply = match cmd {
            "room" => {
                let mut keys = "keys".to_owned();
                let mut rank_keys = Vec::new();
                for (rd, (engine, _, _)) in ranks.iter().enumerate() {
                    // A room of partial chunks (slice runs) carries the KV alone.
                    let (pages, tokens, parts) = match per_chunk {
                        Some(k) => (setup.decode_pages_limited(rd as u32, arg, k), k as u32 * setup.page_size, None),
                        None => (setup.decode_pages(rd as u32, arg), setup.chunk_tokens, setup.request_parts(arg)),
                    };
                    if parts.is_some() {
                        parted.insert(arg);
                    }
                    match per_chunk {
                        Some(_) => partial_rooms = true,
                        None => {
                            written_sets.insert(arg % 2);
                        }
                    }
                    let mut open = RoomOpening::new(arg, &pages, tokens);
                    open.parts = parts;
                    let (key, _) = engine.receiver().open_room(open)?;
                    keys.push_str(&format!(" {key}"));
                    rank_keys.push(key);
                }
                opened.insert(arg, rank_keys);
                keys
            }
            "wait" => {
                let mut status = "ok".to_owned();
                for (rd, (engine, _, _)) in ranks.iter().enumerate() {
                    if let Err(e) = engine.receiver().wait_room(opening(&opened, arg, rd), Some(Duration::from_secs(600))) {
                        status = format!("error {}", e.chain());
                    }
                }
                status
            }
            "watch" => {
                // Every decode rank receives every chunk of a (full) room.
                let owed = Owed { chunks: setup.chunks() as u64 * ranks.len() as u64, rooms: ranks.len() as u64 };
                watch.state.lock().owed.insert(arg, owed);
                "ok".to_owned()
            }
            "next" => match watch.next(Duration::from_secs(600)) {
                Some((room, at, None)) => format!("done {room} {}", at.elapsed().as_nanos()),
                Some((room, _, Some(why))) => {
                    let progress: Vec<String> = ranks.iter().enumerate().map(|(rd, (e, _, _))| e.receiver().wait_room(opening(&opened, room, rd), Some(Duration::ZERO)).err().map(|e| e.chain()).unwrap_or_default()).collect();
                    format!("error room {room} failed: {why} ({})", progress.join("; "))
                }
                None => "error no watched room ended (none in flight, or none within 600 s)".to_owned(),
            },
            "verify" => {
                let (mut bad, mut first) = (0, None);
                for (rd, (_, pool, parts)) in ranks.iter_mut().enumerate() {
                    let (b, f) = pool.verify(&setup.decode_pages(rd as u32, arg), 0);
                    bad += b;
                    first = first.or(f);
                    if let Some(parts) = parts.as_mut().filter(|_| parted.contains(&arg)) {
                        let (b, f) = parts.verify(arg % 2);
                        bad += b;
                        first = first.or(f);
                    }
                }
                format!("verified {bad} {}", first.unwrap_or_default())
            }
            "verify-exact" if partial_rooms => "error verify-exact: a room of partial chunks was opened since the last clear".to_owned(),
            "verify-exact" => {
                let (mut bad, mut first) = (0, None);
                let sets: Vec<u64> = written_sets.iter().copied().chain([arg % 2]).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
                for (rd, (_, pool, _)) in ranks.iter().enumerate() {
                    let pages: Vec<Vec<u32>> = sets.iter().map(|&set| setup.decode_pages(rd as u32, set)).collect();
                    let requests: Vec<(&[u32], u64, u64)> = pages.iter().map(|p| (p.as_slice(), 0, u64::MAX)).collect();
                    let (b, f) = pool.verify_exact(&requests);
                    bad += b;
                    first = first.or(f.map(|f| format!("decode rank {rd}: {f}")));
                }
                format!("verified {bad} {}", first.unwrap_or_default())
            }
            "clear" if !opened.is_empty() => {
                let open: Vec<String> = opened.keys().map(|k| k.to_string()).collect();
                format!("error clear: rooms {} are still open (release them first)", open.join(", "))
            }
            "clear" => {
                for (_, pool, _) in ranks.iter_mut() {
                    pool.clear();
                }
                written_sets.clear();
                partial_rooms = false;
                "ok".to_owned()
            }
            "describe" => {
                // `describe ROOM RANK`: that decode rank's document of the room, on one line.
                let rank = per_chunk.unwrap_or(0);
                let engine = &ranks.get(rank).ok_or_else(|| Error::invalid_arg("rank", format!("{rank} is not a decode rank here")))?.0;
                match engine.receiver().describe_room(opening(&opened, arg, rank)) {
                    Ok(doc) => format!("describe {}", serde_json::to_string(&doc).map_err(|e| Error::internal("describe").with_source(e))?),
                    Err(e) => format!("error {}", e.chain()),
                }
            }
            "release" => {
                parted.remove(&arg);
                for (rd, (engine, _, _)) in ranks.iter().enumerate() {
                    engine.receiver().release_room(opening(&opened, arg, rd), None).unwrap();
                }
                opened.remove(&arg);
                "ok".to_owned()
            }
            "raw" => {
                let streams = per_chunk.unwrap_or(1).max(1);
                // Each stream's receive buffer: RAW_BUFFER (cache-warm), or as large as the stream
                // (`raw BYTES STREAMS memory`: every byte lands at its own address).
                let (bufs, len) = match words.next() {
                    Some("memory") => (&mut raw_memory, (arg as usize).div_ceil(streams).max(1)),
                    _ => (&mut raw_bufs, RAW_BUFFER),
                };
                bufs.resize_with(streams.max(bufs.len()), Vec::new);
                for b in &mut bufs[..streams] {
                    // Allocated and touched once, before the first timed run: its page faults
                    // and fill are not the wire's.
                    if b.len() != len {
                        *b = vec![0x11; len];
                    }
                }
                let mut conns = Vec::new();
                for _ in 0..streams {
                    conns.push(raw.accept()?.0);
                }
                let results: Vec<Result<u64>> = std::thread::scope(|s| {
                    let handles: Vec<_> = conns
                        .into_iter()
                        .zip(bufs.iter_mut())
                        .map(|(c, buf)| s.spawn(move || raw_receive(c, buf)))
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("raw receiver panicked")))).collect()
                });
                let mut total = 0;
                for r in results {
                    total += r?;
                }
                format!("raw {total}")
            }
            "quit" => break,
            other => format!("error unknown command '{other}'"),
        };
        writeln!(out, "{reply}").map_err(io_err("stdout"))?;
        out.flush().map_err(io_err("stdout"))?;
    }
    Ok(())
}

/// The decode child process, seen from the parent.
pub struct DecodeChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub addrs: Vec<String>,
    pub raw_addr: String,
}

impl DecodeChild {
    /// Starts `exe` with `args` (which must make it call [`serve_decode`]).
    pub fn spawn(exe: &std::path::Path, args: &[String], decode_tp: u32) -> Result<DecodeChild> {
        let mut cmd = Command::new(exe);
        cmd.args(args);
        Self::spawn_command(cmd, decode_tp)
    }

    /// [`spawn`](Self::spawn) with a command of the caller's (arguments, environment): e.g. a
    /// test executable that runs one test calling [`serve_decode`]. Lines before the `ADDRS` line
    /// (a test harness's own) are skipped, and text before `ADDRS` on its line.
    pub fn spawn_command(mut cmd: Command, decode_tp: u32) -> Result<DecodeChild> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| Error::internal("cannot start the decode process").with_source(e))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut me = DecodeChild { child, stdin, stdout, addrs: Vec::new(), raw_addr: String::new() };
        let mut skipped = Vec::new();
        let first = loop {
            let line = me.read_line()?;
            if let Some(at) = line.find("ADDRS ") {
                break line[at..].to_owned();
            }
            if skipped.len() == 16 {
                return Err(Error::internal(format!("decode process did not start (said '{}')", skipped.join("' '"))));
            }
            skipped.push(line);
        };
        let mut words = first.split_whitespace();
        words.next();
        for w in words.by_ref() {
            if w == "RAW" {
                break;
            }
            me.addrs.push(w.to_owned());
        }
        me.raw_addr = words.next().unwrap_or_default().to_owned();
        if me.addrs.len() != decode_tp as usize {
            return Err(Error::internal(format!("decode process reported {} ranks, expected {decode_tp}", me.addrs.len())));
        }
        Ok(me)
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line).map_err(io_err("reading from the decode process"))?;
        if line.is_empty() {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "the decode process exited"));
        }
        Ok(line.trim_end().to_owned())
    }

    /// Sends one command and returns the reply; an `error ...` reply is an error.
    pub fn command(&mut self, cmd: &str) -> Result<String> {
        writeln!(self.stdin, "{cmd}").map_err(io_err("writing to the decode process"))?;
        self.stdin.flush().map_err(io_err("writing to the decode process"))?;
        let reply = self.read_line()?;
        match reply.strip_prefix("error ") {
            Some(why) => Err(Error::internal(format!("decode process: '{cmd}' failed: {why}"))),
            None => Ok(reply),
        }
    }

    /// Bad bytes after `verify`, with the first difference.
    pub fn verify(&mut self, room: u64) -> Result<(u64, String)> {
        let reply = self.command(&format!("verify {room}"))?;
        let rest = reply.strip_prefix("verified ").unwrap_or("");
        let (bad, first) = rest.split_once(' ').unwrap_or((rest, ""));
        let bad = bad.parse().map_err(|_| Error::internal(format!("bad verify reply '{reply}'")))?;
        Ok((bad, first.to_owned()))
    }

    /// Bad bytes after `verify-exact` (every byte of every decode pool), with the first difference.
    pub fn verify_exact(&mut self, room: u64) -> Result<(u64, String)> {
        let reply = self.command(&format!("verify-exact {room}"))?;
        let rest = reply.strip_prefix("verified ").unwrap_or("");
        let (bad, first) = rest.split_once(' ').unwrap_or((rest, ""));
        let bad = bad.parse().map_err(|_| Error::internal(format!("bad verify-exact reply '{reply}'")))?;
        Ok((bad, first.to_owned()))
    }

    /// Times a plain TCP stream of `bytes` from this process to the child (the wire baseline).
    pub fn raw_tcp(&mut self, bytes: u64, buf: &[u8]) -> Result<Duration> {
        self.raw_tcp_streams(bytes, 1, buf, false)
    }

    /// Times `streams` plain TCP streams from this process to the child, all at once, carrying
    /// `bytes` between them (split evenly), until the child has read every byte of every stream.
    /// Stream `i` sends from `buf` at `i × share` on (wrapping round): a buffer as large as `bytes`
    /// sends every byte from its own address; `memory` has the child receive each stream into a
    /// buffer as large as it too (else into [`RAW_BUFFER`] bytes, again and again).
    pub fn raw_tcp_streams(&mut self, bytes: u64, streams: u32, buf: &[u8], memory: bool) -> Result<Duration> {
        let streams = streams.max(1);
        writeln!(self.stdin, "raw {bytes} {streams}{}", if memory { " memory" } else { "" }).map_err(io_err("writing to the decode process"))?;
        self.stdin.flush().map_err(io_err("writing to the decode process"))?;
        let addr = self.raw_addr.parse().map_err(|_| Error::internal("raw address"))?;
        let mut conns = Vec::new();
        for _ in 0..streams {
            conns.push(kvstage::transport::tcp::connect(addr, Duration::from_secs(10), None)?);
        }
        let share = |i: u64| bytes / streams as u64 + u64::from(i < bytes % streams as u64);
        // The senders start together: each waits for the gate this thread holds until all exist.
        let gate = RwLock::new(());
        let (elapsed, results) = std::thread::scope(|s| {
            let held = gate.write();
            let mut handles = Vec::new();
            for (i, mut stream) in conns.into_iter().enumerate() {
                let gate = &gate;
                let left = share(i as u64) as usize;
                let from = (i as u64 * (bytes / streams as u64)) as usize % buf.len();
                let h = std::thread::Builder::new().name(format!("bench-raw-{i}")).spawn_scoped(s, move || -> Result<()> {
                    drop(gate.read());
                    let (mut left, mut at) = (left, from);
                    while left > 0 {
                        let n = left.min(buf.len() - at).min(RAW_BUFFER);
                        stream.write_all(&buf[at..at + n]).map_err(io_err("raw send"))?;
                        left -= n;
                        at = (at + n) % buf.len();
                    }
                    stream.shutdown(Shutdown::Write).map_err(io_err("raw shutdown"))?;
                    let mut ack = [0u8; 1];
                    stream.read_exact(&mut ack).map_err(io_err("raw ack"))?;
                    Ok(())
                });
                handles.push(h);
            }
            let start = Instant::now();
            drop(held);
            let results: Vec<Result<()>> = handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err(Error::internal("raw sender panicked"))),
                    Err(e) => Err(Error::internal("cannot start a raw sender thread").with_source(e)),
                })
                .collect();
            (start.elapsed(), results)
        });
        let reply = self.read_line()?;
        for r in results {
            r?;
        }
        if reply != format!("raw {bytes}") {
            return Err(Error::internal(format!("raw TCP: sent {bytes} bytes, the decode process said '{reply}'")));
        }
        Ok(elapsed)
    }

    /// The child's process id (for its CPU time in /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Opens room `room` on every decode rank (`per_chunk`: only the first pages of each chunk, see
    /// the module doc) and returns each rank's key of the opening.
    pub fn open_room(&mut self, room: u64, per_chunk: Option<usize>) -> Result<RoomKeys> {
        let reply = self.command(&match per_chunk {
            Some(k) => format!("room {room} {k}"),
            None => format!("room {room}"),
        })?;
        let keys: Option<Vec<u64>> = reply.strip_prefix("keys ").and_then(|k| k.split_whitespace().map(str::parse).collect::<std::result::Result<_, _>>().ok());
        keys.map(|keys| RoomKeys { id: room, keys }).ok_or_else(|| Error::internal(format!("bad reply to room: '{reply}'")))
    }

    /// Decode rank `rank`'s describe document of room `room` (JSON, `kvstage_room_describe`).
    pub fn describe_room(&mut self, room: u64, rank: u32) -> Result<String> {
        let reply = self.command(&format!("describe {room} {rank}"))?;
        reply.strip_prefix("describe ").map(str::to_owned).ok_or_else(|| Error::internal(format!("bad reply to describe: '{reply}'")))
    }

    /// Asks the child to report room `room`'s end through [`next_done`](Self::next_done).
    pub fn watch(&mut self, room: u64) -> Result<()> {
        self.command(&format!("watch {room}")).map(|_| ())
    }

    /// Waits until a watched room is scattered on every decode rank; returns it and when that
    /// happened (on this process's clock). A failed room is an error.
    pub fn next_done(&mut self) -> Result<(u64, Instant)> {
        let reply = self.command("next")?;
        let now = Instant::now();
        let mut words = reply.split_whitespace();
        let parsed = match (words.next(), words.next().map(str::parse::<u64>), words.next().map(str::parse::<u64>)) {
            (Some("done"), Some(Ok(room)), Some(Ok(ago))) => Some((room, now.checked_sub(Duration::from_nanos(ago)).unwrap_or(now))),
            _ => None,
        };
        parsed.ok_or_else(|| Error::internal(format!("bad reply to next: '{reply}'")))
    }

    pub fn quit(mut self) -> Result<()> {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let status = self.child.wait().map_err(io_err("waiting for the decode process"))?;
        if !status.success() {
            return Err(Error::internal(format!("the decode process exited with {status}")));
        }
        Ok(())
    }
}

impl Drop for DecodeChild {
    fn drop(&mut self) {
        // A parent that fails early must not leave the child behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A room opened on every decode rank: its id and each rank's key of the opening.
#[derive(Clone, Debug)]
pub struct RoomKeys {
    pub id: u64,
    pub keys: Vec<u64>,
}

impl RoomKeys {
    /// The room as a sender to decode rank `rank` names it.
    pub fn at(&self, rank: u32) -> RoomRef {
        RoomRef { id: self.id, key: self.keys.get(rank as usize).copied().unwrap_or(0) }
    }
}

/// The prefill side: one engine, filled pool and sessions per prefill rank.
pub struct Prefill {
    pub ranks: Vec<PrefillRank>,
}

pub struct PrefillRank {
    pub rank: u32,
    pub engine: Engine,
    pub pool: HostPool,
    pub sessions: Vec<Arc<SenderSession>>,
    /// The decode rank each session writes to.
    pub targets: Vec<u32>,
    /// Its request parts' memory (registered with the engine), when the setup has parts.
    pub parts: Option<PartsMemory>,
}

impl Prefill {
    pub fn connect(setup: &Setup, addrs: &[String]) -> Result<Prefill> {
        Self::connect_with(setup, addrs, &setup.options())
    }

    /// [`connect`](Self::connect) with these engine options for every prefill rank.
    pub fn connect_with(setup: &Setup, addrs: &[String], options: &EngineOptions) -> Result<Prefill> {
        let mut ranks = Vec::new();
        for rank in 0..setup.prefill_tp {
            let engine = Engine::new(options.clone())?;
            let shape = setup.model.shape(setup.page_size, rank, setup.prefill_tp);
            let mut pool = HostPool::with_layout(shape, setup.capacity(), setup.prefill_layout, setup.page_pad, false);
            pool.fill(&setup.prefill_pages(rank), 0);
            engine.register_pool(pool.layout.clone())?;
            let parts = setup.has_parts().then(|| PartsMemory::register(setup, &engine, rank, setup.prefill_tp, true)).transpose()?;
            let mut sessions = Vec::new();
            let targets = setup.targets(rank);
            for &rd in &targets {
                sessions.push(engine.connect(&addrs[rd as usize], &format!("p{rank}-d{rd}"), None)?);
            }
            ranks.push(PrefillRank { rank, engine, pool, sessions, targets, parts });
        }
        Ok(Prefill { ranks })
    }

    /// Sends every chunk of `room` from every prefill rank (one thread per rank). `pages_limit`
    /// sends only the first pages of each chunk (time-boxed slice runs). Returns the writes issued.
    pub fn send_room(&self, setup: &Setup, room: &RoomKeys, staged: bool, pages_limit: Option<usize>) -> Result<u64> {
        let grid = setup.grid_pages();
        let results: Vec<Result<u64>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .map(|r| {
                    s.spawn(move || -> Result<u64> {
                        let pages = setup.prefill_pages(r.rank);
                        let mut writes = 0u64;
                        for (chunk, chunk_pages) in pages.chunks(grid).enumerate() {
                            let chunk_pages = &chunk_pages[..pages_limit.unwrap_or(usize::MAX).min(chunk_pages.len())];
                            for (session, &rd) in r.sessions.iter().zip(&r.targets) {
                                let desc = TransferDesc {
                                    room: room.at(rd),
                                    chunk: chunk as u32,
                                    pages: chunk_pages.to_vec(),
                                    timeout: Some(Duration::from_secs(600)),
                                    parts: setup.last_chunk_parts(room.id, chunk).filter(|_| staged && pages_limit.is_none()),
                                    ..Default::default()
                                };
                                let op = Op::new(session.waker());
                                let status = if staged { session.transfer(&desc, &op)? } else { session.transfer_slices(&desc, &op)? };
                                if status != Status::KVSTAGE_OK {
                                    return Err(Error::new(status, format!("transfer returned {}", status.name())));
                                }
                                writes += if staged { 1 } else { setup.slice_writes_for(chunk_pages.len()) };
                            }
                        }
                        Ok(writes)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("sender thread panicked")))).collect()
        });
        results.into_iter().sum()
    }

    /// Queues every chunk of `room` from every prefill rank to every decode rank it feeds on the
    /// engines' transfer workers (`transfer_async`, staged path) and returns the operations at
    /// once, chunk by chunk in request order. `timeout` runs from now (queued time counts).
    /// `layer_wise`: each operation waits for its layers to be marked ready on its gate.
    pub fn submit_room(&self, setup: &Setup, room: &RoomKeys, timeout: Duration, layer_wise: bool) -> Result<Vec<Arc<Op>>> {
        let grid = setup.grid_pages();
        let pages: Vec<Vec<u32>> = self.ranks.iter().map(|r| setup.prefill_pages(r.rank)).collect();
        let mut ops = Vec::new();
        for chunk in 0..setup.chunks() {
            for (r, rank_pages) in self.ranks.iter().zip(&pages) {
                let Some(chunk_pages) = rank_pages.chunks(grid).nth(chunk) else { continue };
                for (session, &rd) in r.sessions.iter().zip(&r.targets) {
                    let layers = layer_wise.then(|| session.layer_gate());
                    let parts = setup.last_chunk_parts(room.id, chunk);
                    let desc = TransferDesc { room: room.at(rd), chunk: chunk as u32, pages: chunk_pages.to_vec(), timeout: Some(timeout), layers, parts, ..Default::default() };
                    let tag = (room.id << 24) | ops.len() as u64;
                    ops.push(session.transfer_async(desc, false, tag)?);
                }
            }
        }
        Ok(ops)
    }
}
