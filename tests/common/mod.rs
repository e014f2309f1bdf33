//! Shared support for the hostile-peer and receiver-race tests: a raw peer that speaks the wire
//! protocol by hand (with the crate's own codec), a decode engine fed by real prefill engines,
//! canary-filled staging rings and KV pools, and process-wide measurements (fds, threads, RSS).
//!
//! Every test of a file that uses this module takes [`serial`] first: fd, thread and RSS figures
//! are process-wide, and one test lowers `RLIMIT_NOFILE`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions, Integrity, TransportKind};
use kvstage::geometry::{staging_layout_stages, Fingerprint, ModelKind, PoolShape, StagingLayout};
use kvstage::protocol::{self, Hello, Message, RoomRef, PROTOCOL_VERSION};
use kvstage::ring::Watermark;
use kvstage::session::op::Op;
use kvstage::session::receiver::RoomOpening;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::Status;

// --- serialization and process-wide measurements ---------------------------------------------------

static SERIAL: Mutex<()> = Mutex::new(());
static RAISE_NOFILE: Once = Once::new();

/// Serializes the tests of one binary (a failed test poisons nothing for the next one) and raises
/// the soft `RLIMIT_NOFILE` to the hard limit once.
pub fn serial() -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    RAISE_NOFILE.call_once(|| {
        let (_, hard) = nofile();
        set_nofile_soft(hard);
    });
    guard
}

/// (soft, hard) `RLIMIT_NOFILE`.
pub fn nofile() -> (u64, u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0, "getrlimit");
    (r.rlim_cur, r.rlim_max)
}

pub fn set_nofile_soft(soft: u64) {
    let (_, hard) = nofile();
    let r = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: hard as libc::rlim_t };
    // SAFETY: a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0, "setrlimit({soft})");
}

pub fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map(|d| d.count()).unwrap_or(0)
}

pub fn fd_count() -> usize {
    count_dir("/proc/self/fd")
}

/// Threads of this process, from the kernel's own count: listing /proc/self/task skips entries
/// while threads exit.
pub fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").and_then(|n| n.trim().parse().ok())))
        .unwrap_or(0)
}

/// Threads of this process whose name is `name` (a lower bound while other threads exit).
pub fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == name))
                .count()
        })
        .unwrap_or(0)
}

/// Resident set size in bytes.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).expect("VmRSS value") * 1024
}

pub const MIB: f64 = (1 << 20) as f64;

/// Polls `done` every 10 ms until it holds or `within` passed; whether it held.
pub fn settle(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Process figures taken before an attack; [`Baseline::check`] compares after it.
#[derive(Clone, Copy, Debug)]
pub struct Baseline {
    pub fds: usize,
    pub threads: usize,
    pub rss: u64,
}

/// Figures after an attack, for the report.
#[derive(Clone, Copy, Debug)]
pub struct After {
    pub fds: usize,
    pub threads: usize,
    pub rss_growth_mib: f64,
    pub fds_settled_in: Duration,
}

impl Baseline {
    pub fn take() -> Baseline {
        Baseline { fds: fd_count(), threads: thread_count(), rss: rss_bytes() }
    }

    /// Waits (up to 10 s) for fds and threads to come back to the baseline, and checks that RSS
    /// grew by less than `rss_bound` bytes.
    pub fn check(&self, what: &str, rss_bound: u64) -> After {
        let start = Instant::now();
        let fds_ok = settle(Duration::from_secs(10), || fd_count() <= self.fds);
        let fds_settled_in = start.elapsed();
        let threads_ok = settle(Duration::from_secs(10), || thread_count() <= self.threads);
        let after = After {
            fds: fd_count(),
            threads: thread_count(),
            rss_growth_mib: (rss_bytes() as f64 - self.rss as f64) / MIB,
            fds_settled_in,
        };
        eprintln!(
            "[{what}] fds {} -> {} (settled in {:?}), threads {} -> {}, RSS growth {:.2} MiB",
            self.fds, after.fds, fds_settled_in, self.threads, after.threads, after.rss_growth_mib
        );
        assert!(fds_ok, "[{what}] file descriptors did not return to the baseline within 10 s: {} -> {}", self.fds, after.fds);
        assert!(threads_ok, "[{what}] threads did not return to the baseline within 10 s: {} -> {}", self.threads, after.threads);
        assert!(
            after.rss_growth_mib * MIB < rss_bound as f64,
            "[{what}] RSS grew by {:.2} MiB (bound {:.0} MiB)",
            after.rss_growth_mib,
            rss_bound as f64 / MIB
        );
        after
    }
}

// --- geometry --------------------------------------------------------------------------------------

/// The model of a test cluster: MHA, `heads` KV heads of `head_dim` bf16 elements.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub heads: u32,
    pub head_dim: u32,
    pub layers: u32,
    pub page: u32,
    pub chunk_tokens: u32,
    /// Pages of the decode pool and of every prefill pool.
    pub pool_pages: u64,
}

/// Small: 8 heads × 16 elements × 2 B = 256 B token slots, 2 layers, pages of 4 tokens, chunks of
/// 16 tokens (4 pages); a chunk's allocation (P TP2 → D TP1) is 16 KiB, 8 KiB a writer.
pub const SMALL: Geometry = Geometry { heads: 8, head_dim: 16, layers: 2, page: 4, chunk_tokens: 16, pool_pages: 32 };

impl Geometry {
    pub fn shape(&self, rank: u32, tp: u32) -> PoolShape {
        PoolShape::new(ModelKind::Mha, self.heads, self.head_dim, 2, self.page, self.layers).with_tp(rank, tp)
    }

    pub fn pages_per_chunk(&self) -> usize {
        (self.chunk_tokens / self.page) as usize
    }

    /// Staging layout of one full chunk from prefill TP `src_tp` into decode TP 1, its regions
    /// placed in prefill rank order (where the receiver puts them when they ask in that order).
    pub fn layout(&self, src_rank: u32, src_tp: u32) -> StagingLayout {
        staging_layout_stages(&[self.shape(src_rank, src_tp)], &self.shape(0, 1), self.chunk_tokens).expect("staging layout")
    }
}

pub fn decode_options(geo: &Geometry) -> EngineOptions {
    EngineOptions {
        transport: TransportKind::Tcp,
        chunk_tokens: geo.chunk_tokens,
        default_deadline: Some(Duration::from_secs(10)),
        integrity: Integrity::Always,
        ..EngineOptions::default()
    }
}

pub fn prefill_options() -> EngineOptions {
    EngineOptions {
        transport: TransportKind::Tcp,
        default_deadline: Some(Duration::from_secs(10)),
        integrity: Integrity::Always,
        ..EngineOptions::default()
    }
}

// --- canaries --------------------------------------------------------------------------------------

/// The canary word at word index `word` of region `salt` (position-dependent: a shifted copy shows).
fn canary_word(salt: u64, word: u64) -> u64 {
    let mut x = word.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ 0x5A5A_C3C3_0F0F_A5A5;
    x ^= x >> 31;
    x
}

/// Fills `len` bytes at `ptr` (8-byte multiple) with the canary of `salt`, word `first_word` on.
///
/// # Safety
/// `ptr..ptr+len` must be writable memory nobody else writes meanwhile.
unsafe fn fill_canary(ptr: *mut u8, len: usize, salt: u64, first_word: u64) {
    assert_eq!(len % 8, 0);
    for i in 0..len / 8 {
        let v = canary_word(salt, first_word + i as u64).to_le_bytes();
        // SAFETY: inside the range (caller).
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), ptr.add(i * 8), 8) };
    }
}

/// Byte offsets (relative to `ptr`) in `[0, len)` that no longer hold the canary (at most 16
/// listed) and their count.
///
/// # Safety
/// `ptr..ptr+len` must be readable.
unsafe fn scan_canary(ptr: *const u8, len: usize, salt: u64, first_word: u64) -> (usize, Vec<usize>) {
    let (mut bad, mut first) = (0, Vec::new());
    for i in 0..len / 8 {
        let expected = canary_word(salt, first_word + i as u64).to_le_bytes();
        // SAFETY: inside the range (caller); volatile: a racing writer would be a library bug.
        let got = unsafe { std::ptr::read_volatile(ptr.add(i * 8) as *const [u8; 8]) };
        for b in 0..8 {
            if got[b] != expected[b] {
                bad += 1;
                if first.len() < 16 {
                    first.push(i * 8 + b);
                }
            }
        }
    }
    (bad, first)
}

/// A caller-provided staging ring: `len` bytes registered in the middle of an allocation with
/// `margin` canary bytes on both sides; the ring itself starts out canary-filled too.
pub struct CanaryRing {
    buf: Box<[u64]>,
    pub margin: usize,
    pub len: usize,
    salt: u64,
}

impl CanaryRing {
    pub fn new(len: usize, margin: usize, salt: u64) -> CanaryRing {
        assert!(len.is_multiple_of(8) && margin.is_multiple_of(8));
        let mut buf = vec![0u64; (len + 2 * margin) / 8].into_boxed_slice();
        // SAFETY: our own allocation.
        unsafe { fill_canary(buf.as_mut_ptr() as *mut u8, buf.len() * 8, salt, 0) };
        CanaryRing { buf, margin, len, salt }
    }

    /// The ring's first byte (what the engine gets).
    pub fn ptr(&self) -> *mut u8 {
        // SAFETY: margin is inside the allocation.
        unsafe { (self.buf.as_ptr() as *mut u8).add(self.margin) }
    }

    /// Copies `len` ring bytes at `offset` (call only when no write can be in flight).
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        let mut out = vec![0u8; len];
        // SAFETY: inside the ring.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr().add(offset), out.as_mut_ptr(), len) };
        out
    }

    /// Checks the margins and every ring byte outside `allowed` (ring-relative ranges) still hold
    /// the canary; panics naming the first bytes that changed.
    pub fn check(&self, what: &str, allowed: &[std::ops::Range<usize>]) {
        let base = self.buf.as_ptr() as *const u8;
        let allowed_at = |p: usize| {
            let rel = p as isize - self.margin as isize;
            rel >= 0 && (rel as usize) < self.len && allowed.iter().any(|r| r.contains(&(rel as usize)))
        };
        let (mut count, mut first) = (0usize, Vec::new());
        for w in 0..self.buf.len() {
            let expected = canary_word(self.salt, w as u64).to_le_bytes();
            // SAFETY: inside our allocation; volatile: a racing writer would be a library bug.
            let got = unsafe { std::ptr::read_volatile(base.add(w * 8) as *const [u8; 8]) };
            if got == expected {
                continue;
            }
            for b in (0..8).filter(|&b| got[b] != expected[b]) {
                let p = w * 8 + b;
                if allowed_at(p) {
                    continue;
                }
                count += 1;
                if first.len() < 8 {
                    let rel = p as isize - self.margin as isize;
                    first.push(if rel < 0 || rel as usize >= self.len {
                        format!("margin byte (ring-relative {rel})")
                    } else {
                        format!("ring byte {rel}")
                    });
                }
            }
        }
        assert!(count == 0, "[{what}] {count} canary bytes changed outside the granted regions {allowed:?}; first: {first:?}");
    }
}

// SAFETY: the ring is plain memory; the engine writes it only inside grants.
unsafe impl Send for CanaryRing {}
unsafe impl Sync for CanaryRing {}

/// Fills `pages` of `pool` (every buffer) with the pool canary.
pub fn pool_fill_canary(pool: &HostPool, pages: &[u32]) {
    let l = &pool.layout;
    let page_bytes = l.shape.page_bytes() as usize;
    for (b, &base) in l.bases.iter().enumerate() {
        for &p in pages {
            let off = p as usize * page_bytes;
            // SAFETY: the page is inside the buffer (page < capacity_pages); no transfer runs into
            // these pages now (callers quiesce first).
            unsafe { fill_canary((base + off) as *mut u8, page_bytes, 0x900 + b as u64, (off / 8) as u64) };
        }
    }
}

/// Bytes of `pages` of `pool` that no longer hold the canary; a description of the first.
pub fn pool_scan_canary(pool: &HostPool, pages: &[u32]) -> (usize, Option<String>) {
    let l = &pool.layout;
    let page_bytes = l.shape.page_bytes() as usize;
    let (mut bad, mut first) = (0, None);
    for (b, &base) in l.bases.iter().enumerate() {
        for &p in pages {
            let off = p as usize * page_bytes;
            // SAFETY: inside the buffer.
            let (n, pos) = unsafe { scan_canary((base + off) as *const u8, page_bytes, 0x900 + b as u64, (off / 8) as u64) };
            if n > 0 && first.is_none() {
                first = Some(format!("buffer {b} page {p} byte {}", pos[0]));
            }
            bad += n;
        }
    }
    (bad, first)
}

pub fn all_pages(pool: &HostPool) -> Vec<u32> {
    (0..pool.layout.capacity_pages as u32).collect()
}

// --- a decode engine fed by real prefill engines ---------------------------------------------------

/// A decode engine (TP 1) with a canary-filled host pool, and prefill engines (TP 2, ranks 0 and 1
/// by default) whose pools hold the reference pattern for tokens `0..pool_pages·page`.
/// Fields drop in order: the engines before the pools they write.
pub struct Cluster {
    pub decode: Engine,
    pub prefill: Vec<Engine>,
    pub dpool: HostPool,
    pub ppools: Vec<HostPool>,
    pub geo: Geometry,
    pub prefill_ranks: Vec<(u32, u32)>,
    next_room: AtomicU64,
}

/// Where the decode ring lives.
pub enum RingSpec<'a> {
    /// Engine-owned, of this many bytes.
    Owned(usize),
    /// Caller memory.
    Caller(&'a CanaryRing),
}

impl Cluster {
    pub fn new(geo: Geometry, options: EngineOptions, ring: RingSpec<'_>) -> Cluster {
        Self::with_prefill(geo, options, ring, &[(0, 2), (1, 2)])
    }

    pub fn with_prefill(geo: Geometry, options: EngineOptions, ring: RingSpec<'_>, ranks: &[(u32, u32)]) -> Cluster {
        let decode = Engine::new(options).expect("decode engine");
        let dpool = HostPool::new(geo.shape(0, 1), geo.pool_pages);
        pool_fill_canary(&dpool, &all_pages(&dpool));
        decode.register_pool(dpool.layout.clone()).expect("decode pool");
        match ring {
            RingSpec::Owned(n) => decode.register_staging(None, n).expect("staging"),
            RingSpec::Caller(r) => decode.register_staging(Some(r.ptr()), r.len).expect("staging"),
        }
        let mut prefill = Vec::new();
        let mut ppools = Vec::new();
        for &(rank, tp) in ranks {
            let engine = Engine::new(prefill_options()).expect("prefill engine");
            let mut pool = HostPool::new(geo.shape(rank, tp), geo.pool_pages);
            pool.fill(&(0..geo.pool_pages as u32).collect::<Vec<_>>(), 0);
            engine.register_pool(pool.layout.clone()).expect("prefill pool");
            prefill.push(engine);
            ppools.push(pool);
        }
        Cluster { decode, prefill, dpool, ppools, geo, prefill_ranks: ranks.to_vec(), next_room: AtomicU64::new(1000) }
    }

    pub fn addr(&self) -> SocketAddr {
        self.decode.local_addr()
    }

    /// Decode pages of a room of `chunks` chunks (shuffled, distinct, seeded by the room id).
    pub fn room_pages(&self, room: u64, chunks: usize) -> Vec<u32> {
        kvstage_testkit::page_table(chunks * self.geo.pages_per_chunk(), self.geo.pool_pages, room, false)
    }

    /// Sends `chunks` chunks from every prefill engine into `room` over `pages` (already opened).
    pub fn send_room(&self, room: RoomRef, pages: &[u32], label: &str) -> kvstage::Result<()> {
        let ppc = self.geo.pages_per_chunk();
        let sessions: Vec<_> = self
            .prefill
            .iter()
            .enumerate()
            .map(|(i, e)| e.connect(&self.addr().to_string(), &format!("{label}-p{i}"), Some(Duration::from_secs(10))))
            .collect::<kvstage::Result<_>>()?;
        for chunk in 0..pages.len() / ppc {
            let src: Vec<u32> = (chunk * ppc..(chunk + 1) * ppc).map(|p| p as u32).collect();
            for s in &sessions {
                let desc = TransferDesc { room, chunk: chunk as u32, pages: src.clone(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
                let status = s.transfer(&desc, &Op::new(s.waker()))?;
                assert_eq!(status, Status::KVSTAGE_OK, "[{label}] chunk {chunk} fell back");
            }
        }
        Ok(())
    }

    /// A legitimate staged transfer of `chunks` chunks into a fresh room (or `room`): opened, sent
    /// by every prefill engine, waited for, verified against the reference, pages outside the
    /// room checked for canaries, released, and its pages canary-filled again. Panics on failure.
    pub fn legit_transfer(&self, label: &str, room: Option<u64>, chunks: usize) -> Duration {
        let start = Instant::now();
        if let Err(e) = self.try_transfer(label, room, chunks) {
            panic!("{e}");
        }
        start.elapsed()
    }

    /// As [`legit_transfer`](Self::legit_transfer), returning why the transfer failed (a failed
    /// room is released; wrong bytes still panic).
    pub fn try_transfer(&self, label: &str, room: Option<u64>, chunks: usize) -> Result<(), String> {
        let room = room.unwrap_or_else(|| self.next_room.fetch_add(1, Ordering::Relaxed));
        let pages = self.room_pages(room, chunks);
        let all = all_pages(&self.dpool);
        let (stray, first) = pool_scan_canary(&self.dpool, &all);
        assert_eq!(stray, 0, "[{label}] {stray} decode pool bytes changed before the transfer (stray writes): first at {first:?}");
        let (key, grid) = self
            .decode
            .receiver()
            .open_room(RoomOpening::new(room, &pages, self.geo.chunk_tokens))
            .map_err(|e| format!("[{label}] open_room {room}: {}", e.chain()))?;
        assert_eq!(grid.num_chunks as usize, chunks);
        let at = RoomRef { id: room, key };
        let outcome = self
            .send_room(at, &pages, label)
            .map_err(|e| format!("[{label}] legitimate transfer into room {room} failed: {:?}: {}", e.code(), e.chain()))
            .and_then(|()| {
                self.decode.receiver().wait_room(at, Some(Duration::from_secs(10))).map_err(|e| format!("[{label}] room {room} did not complete: {}", e.chain()))
            });
        if outcome.is_ok() {
            self.verify_room(label, room, &pages);
        }
        self.decode.receiver().release_room(at, None).unwrap();
        pool_fill_canary(&self.dpool, &pages);
        outcome.map(|_| ())
    }

    /// The room's pages hold the reference, every other page its canary.
    pub fn verify_room(&self, label: &str, room: u64, pages: &[u32]) {
        let (bad, first) = self.dpool.verify(pages, 0);
        assert_eq!(bad, 0, "[{label}] room {room}: {bad} bytes differ from the reference; first: {first:?}");
        let others: Vec<u32> = all_pages(&self.dpool).into_iter().filter(|p| !pages.contains(p)).collect();
        let (stray, first) = pool_scan_canary(&self.dpool, &others);
        assert_eq!(stray, 0, "[{label}] room {room}: {stray} bytes changed outside the room's pages; first: {first:?}");
    }
}

// --- the raw peer ----------------------------------------------------------------------------------

/// A hello as a prefill rank of `shape` would send it.
pub fn hello(shape: &PoolShape, session: &str, token: &[u8]) -> Message {
    hello_with(shape, session, token, Vec::new())
}

/// [`hello`] from a rank that registered `components`.
pub fn hello_with(shape: &PoolShape, session: &str, token: &[u8], components: Vec<kvstage::geometry::ComponentSpec>) -> Message {
    Message::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        library_version: kvstage::version_number(),
        session: session.to_owned(),
        fingerprint: Fingerprint::of(shape).encode(),
        shape: shape.clone(),
        ring_bytes: 0,
        watermark: Watermark::default(),
        status: 0,
        reason: String::new(),
        token: token.to_vec(),
        integrity: Integrity::Off.wire(),
        components,
    })
}

/// How a connection ended (or did not) from the raw peer's side.
#[derive(Debug)]
pub struct Closed {
    /// Time from the call until EOF or a reset; `None`: still open at the bound.
    pub after: Option<Duration>,
    /// "eof", "reset: …" or "open".
    pub how: String,
    /// Frames read meanwhile (a refusal hello, watermarks, replies).
    pub frames: Vec<Message>,
}

impl Closed {
    /// The refusal hello among the frames, if one came.
    pub fn refusal(&self) -> Option<&Hello> {
        self.frames.iter().find_map(|m| match m {
            Message::Hello(h) => Some(h),
            _ => None,
        })
    }
}

pub struct RawPeer {
    pub stream: TcpStream,
}

impl RawPeer {
    pub fn connect(addr: SocketAddr) -> RawPeer {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("raw connect");
        stream.set_nodelay(true).expect("nodelay");
        stream.set_write_timeout(Some(Duration::from_secs(5))).expect("write timeout");
        RawPeer { stream }
    }

    /// Connects and completes a real handshake as a prefill rank of `shape`; panics if refused.
    pub fn handshake(addr: SocketAddr, shape: &PoolShape, session: &str, token: &[u8]) -> (RawPeer, Hello) {
        let mut peer = RawPeer::connect(addr);
        peer.send(&hello(shape, session, token)).expect("send hello");
        let answer = match peer.recv(Duration::from_secs(5)) {
            Ok(Some(Message::Hello(h))) => h,
            other => panic!("raw handshake: expected the receiver's hello, got {other:?}"),
        };
        assert_eq!(answer.status, 0, "raw handshake refused: {}", answer.reason);
        (peer, answer)
    }

    pub fn send(&mut self, msg: &Message) -> std::io::Result<()> {
        self.stream.write_all(&msg.encode())
    }

    pub fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// One frame (watermarks included); `Ok(None)` on EOF.
    pub fn recv(&mut self, timeout: Duration) -> kvstage::Result<Option<Message>> {
        self.stream.set_read_timeout(Some(timeout)).expect("read timeout");
        protocol::read_frame(&mut self.stream)
    }

    /// The next frame that is not a watermark; panics on EOF, error or timeout.
    pub fn reply(&mut self, timeout: Duration) -> Message {
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match self.recv(left) {
                Ok(Some(Message::Watermark(_))) => continue,
                Ok(Some(m)) => return m,
                other => panic!("raw peer: expected a reply, got {other:?}"),
            }
        }
    }

    /// Proves the session is alive and every earlier frame was processed: an allocation request for
    /// a room that is not open must be answered (refused) in order.
    pub fn barrier(&mut self, req: u64, writer: u32) -> Message {
        self.send(&Message::AllocReq { req, room: RoomRef { id: u64::MAX - req, key: 1 }, chunk: 0, writer, tokens: 1, bytes: 1, trace: String::new(), pool_tokens: None, direct: false }).expect("send barrier");
        match self.reply(Duration::from_secs(5)) {
            m @ Message::AllocRsp { req: r, status, .. } if r == req && status != 0 => m,
            other => panic!("raw peer barrier {req}: unexpected reply {other:?}"),
        }
    }

    /// Reads until EOF or a reset, at most `within`; collects the frames that came.
    pub fn wait_closed(&mut self, within: Duration) -> Closed {
        let start = Instant::now();
        let mut bytes = Vec::new();
        let mut buf = [0u8; 65536];
        let (after, how) = loop {
            let left = within.saturating_sub(start.elapsed());
            if left.is_zero() {
                break (None, "open".to_owned());
            }
            self.stream.set_read_timeout(Some(left)).expect("read timeout");
            match self.stream.read(&mut buf) {
                Ok(0) => break (Some(start.elapsed()), "eof".to_owned()),
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break (Some(start.elapsed()), format!("reset: {e}")),
            }
        };
        let mut frames = Vec::new();
        let mut rest = &bytes[..];
        while let Ok(Some(m)) = protocol::read_frame(&mut rest) {
            frames.push(m);
        }
        Closed { after, how, frames }
    }

    /// Another handle on the same socket (review probes).
    pub fn stream_clone(&self) -> RawPeer {
        RawPeer { stream: self.stream.try_clone().expect("clone") }
    }

    /// The next frame that is not a watermark; `None` on EOF, error or timeout (review probes).
    pub fn recv_reply(&mut self, timeout: Duration) -> Option<Message> {
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match self.recv(left) {
                Ok(Some(Message::Watermark(_))) => continue,
                Ok(Some(m)) => return Some(m),
                _ => return None,
            }
        }
    }

    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

/// A frame header: body length and type, nothing else.
pub fn header(len: u32, kind: u8) -> Vec<u8> {
    let mut h = len.to_le_bytes().to_vec();
    h.push(kind);
    h
}

/// A granted allocation, as the raw peer learned it.
#[derive(Clone, Copy, Debug)]
pub struct RawGrant {
    pub round: u64,
    pub offset: u64,
    pub len: u64,
    /// Where the writer's region lies in the allocation.
    pub region: u64,
}

impl RawPeer {
    /// Asks for (room, chunk) as `writer` with the full chunk's allocation size; the reply.
    pub fn alloc(&mut self, req: u64, room: RoomRef, chunk: u32, writer: u32, layout: &StagingLayout) -> Message {
        let msg = Message::AllocReq { req, room, chunk, writer, tokens: layout.tokens, bytes: layout.total_bytes, trace: String::new(), pool_tokens: None, direct: false };
        self.send(&msg).expect("send alloc");
        match self.reply(Duration::from_secs(5)) {
            m @ Message::AllocRsp { req: r, .. } if r == req => m,
            other => panic!("raw peer: expected the allocation reply {req}, got {other:?}"),
        }
    }

    /// As [`alloc`](Self::alloc), panicking unless granted.
    pub fn alloc_granted(&mut self, req: u64, room: RoomRef, chunk: u32, writer: u32, layout: &StagingLayout) -> RawGrant {
        match self.alloc(req, room, chunk, writer, layout) {
            Message::AllocRsp { status: 0, round, offset, len, region, .. } => RawGrant { round, offset, len, region },
            other => panic!("raw peer: allocation of room {room} chunk {chunk} refused: {other:?}"),
        }
    }
}

/// Runs `f` (a call that must return by itself) on a helper thread; aborts the whole test process
/// when it has not returned within `bound` (a hang must not keep the suite waiting forever).
pub fn bounded<T: Send>(what: &str, bound: Duration, f: impl FnOnce() -> T + Send) -> (T, Duration) {
    std::thread::scope(|s| {
        let start = Instant::now();
        let h = s.spawn(f);
        while !h.is_finished() {
            if start.elapsed() > bound {
                eprintln!("FATAL: {what} did not return within {bound:?}; aborting the test process");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let took = start.elapsed();
        (h.join().expect("bounded call panicked"), took)
    })
}

/// `release_room`, which must return within `bound`; how long it took.
pub fn release_bounded(engine: &Engine, room: RoomRef, bound: Duration) -> Duration {
    bounded(&format!("release_room({room}, None).unwrap()"), bound, || engine.receiver().release_room(room, None).unwrap()).1
}

/// Opens `room` on the decode engine `engine` and returns it as its senders name it (id and the
/// opening's key). Panics on failure.
pub fn open_room(engine: &Engine, room: u64, pages: &[u32], chunk_tokens: u32) -> RoomRef {
    let (key, _) = engine.receiver().open_room(RoomOpening::new(room, pages, chunk_tokens)).unwrap_or_else(|e| panic!("open_room {room}: {}", e.chain()));
    RoomRef { id: room, key }
}
