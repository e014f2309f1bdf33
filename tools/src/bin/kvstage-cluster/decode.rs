//! A decode rank process: one engine (its KV pool, ring and request parts) listening on its
//! node's address. The router asks it to open a room per request (`open REQ PAGES BASE`: pages
//! of its own from its free list, the request's aux row and state slot), and it answers the key
//! (`opened REQ KEY`), which the router hands to the prefill ranks: the bootstrap an engine's
//! router runs. When the room ends (its ROOM event, or `cancel REQ`) it checks every byte of the
//! room's pages against the reference for the request's tokens (and its parts), releases the
//! room, frees its pages and reports `done REQ STATUS BAD_BYTES [first difference]`.
//! `close-all` shuts the engine down (every session and room ends) and starts a new one on the
//! same address in the same process; `leaks` reports what is left once the prefill side closed
//! its sessions.

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvstage::engine::Engine;
use kvstage::protocol::RoomRef;
use kvstage::session::notify::{Completion, EventKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::{Error, Result, Status};
use kvstage_testkit::cluster::Setup;
use kvstage_testkit::parts::PartsMemory;
use kvstage_testkit::HostPool;

use crate::cli::Cli;
use crate::pages::Pages;
use crate::procfs;
use crate::proto::{self, Out};

struct Room {
    key: u64,
    pages: Vec<u32>,
    base: u64,
}

struct Decode {
    setup: Setup,
    rank: u32,
    listen: String,
    cli_options: kvstage::engine::EngineOptions,
    engine: RwLock<Option<Arc<Engine>>>,
    pool: HostPool,
    parts: Mutex<Option<PartsMemory>>,
    rooms: Mutex<HashMap<u64, Room>>,
    pages: Pages,
    out: Out,
    /// `--selftest-wrong-reference`.
    wrong_every: u64,
}

/// Why a room ended, as the worker learns it.
enum End {
    Event { room: u64, key: u64, status: Status },
    Cancel { room: u64 },
}

pub fn options(setup: &Setup, cli: &Cli) -> kvstage::engine::EngineOptions {
    let mut o = setup.options();
    o.listen_address = cli.listen.clone();
    o.default_deadline = Some(Duration::from_millis(cli.timeout_ms));
    o.room_timeout = Some(Duration::from_millis(cli.room_timeout_ms));
    o.dead_peer_timeout = Some(Duration::from_millis(cli.dead_peer_ms));
    o
}

impl Decode {
    /// A new engine with the pool, the ring and the parts registered, its room events sent to
    /// `ends`.
    fn start_engine(&self, listen: &str, ends: &mpsc::Sender<End>) -> Result<Arc<Engine>> {
        let mut o = self.cli_options.clone();
        o.listen_address = listen.to_owned();
        let engine = Arc::new(Engine::new(o)?);
        engine.register_pool(self.pool.layout.clone())?;
        let src = self.setup.model.shape(self.setup.page_size, 0, self.setup.prefill_tp);
        let chunk = self.setup.grid_pages() as u32 * self.setup.page_size;
        let per_chunk = kvstage::geometry::staging_layout(&src, &self.pool.layout.shape, chunk)?.total_bytes;
        engine.register_staging(None, (per_chunk * self.setup.ring_chunks as u64) as usize)?;
        let parts = self.setup.has_parts().then(|| PartsMemory::register(&self.setup, &engine, self.rank, self.setup.decode_tp, false)).transpose()?;
        *self.parts.lock().unwrap() = parts;
        let tx = Mutex::new(ends.clone());
        engine.completions().set_callback(Some(Arc::new(move |c: &Completion| {
            if let Completion::Chunk(e) = c {
                if e.kind == EventKind::Room {
                    let _ = tx.lock().unwrap().send(End::Event { room: e.room, key: e.key, status: e.status });
                }
            }
        })));
        Ok(engine)
    }

    fn engine(&self) -> Option<Arc<Engine>> {
        self.engine.read().unwrap().clone()
    }

    fn open(&self, req: u64, npages: usize, base: u64) -> String {
        let Some(engine) = self.engine() else { return format!("refused {req} no engine (restarting)") };
        let Some(pages) = self.pages.take(npages) else {
            return format!("refused {req} no free pages ({npages} asked, {} held)", self.pages.held());
        };
        let mut open = RoomOpening::new(req, &pages, self.setup.chunk_tokens);
        open.parts = self.setup.request_parts(req);
        open.trace = Some(format!("req-{req}"));
        let mut rooms = self.rooms.lock().unwrap();
        match engine.receiver().open_room(open) {
            Ok((key, _grid)) => {
                rooms.insert(req, Room { key, pages, base });
                format!("opened {req} {key}")
            }
            Err(e) => {
                self.pages.give(pages);
                format!("refused {req} {}: {}", e.code().name(), proto::one_line(&e.chain()))
            }
        }
    }

    /// Checks, releases and reports an ended room (once: whoever takes it out of `rooms`).
    fn end(&self, end: End) {
        let (req, status) = match end {
            End::Event { room, key, status } => {
                let rooms = self.rooms.lock().unwrap();
                if rooms.get(&room).is_none_or(|r| r.key != key) {
                    return; // a late event of an opening already ended
                }
                (room, Some(status))
            }
            End::Cancel { room } => (room, None),
        };
        let Some(room) = self.rooms.lock().unwrap().remove(&req) else { return };
        let at = RoomRef { id: req, key: room.key };
        // Release first: then no kvstage thread touches the pages, and the check reads them still.
        let released = match self.engine() {
            Some(engine) => engine.receiver().release_room(at, Some(Duration::from_secs(5))),
            None => Ok(()),
        };
        let (mut bad, mut first) = (0u64, None);
        if status == Some(Status::KVSTAGE_OK) {
            // The self-test: this request against the next request's tokens, which must differ.
            let wrong = self.wrong_every > 0 && req % self.wrong_every == 0;
            let (b, f) = self.pool.verify(&room.pages, room.base + u64::from(wrong));
            bad += b;
            first = f;
            if let Some(parts) = self.parts.lock().unwrap().as_mut() {
                let (b, f) = parts.verify(req % 2);
                bad += b;
                first = first.or(f);
            }
        }
        self.pages.give(room.pages);
        let what = match status {
            Some(s) => s.name().to_owned(),
            None => "RELEASED".to_owned(),
        };
        let mut line = format!("done {req} {what} {bad}");
        if let Some(f) = first {
            line.push_str(&format!(" {}", proto::one_line(&f)));
        }
        if let Err(e) = released {
            line.push_str(&format!(" (release: {})", proto::one_line(&e.chain())));
        }
        self.out.line(&line);
    }

    /// Shuts the engine down and starts another on the same address: every session and room
    /// ends (the rooms are reported `SHUTDOWN`).
    fn close_all(&self, ends: &mpsc::Sender<End>) -> Result<String> {
        let t = Instant::now();
        let mut slot = self.engine.write().unwrap();
        let Some(old) = slot.take() else { return Err(Error::internal("no engine")) };
        let addr = old.local_addr().to_string();
        let ended: Vec<(u64, Room)> = {
            let mut rooms = self.rooms.lock().unwrap();
            let _ = old.shutdown(Some(Duration::from_secs(5)));
            rooms.drain().collect()
        };
        drop(old);
        for (req, room) in ended {
            self.pages.give(room.pages);
            self.out.line(&format!("done {req} SHUTDOWN 0"));
        }
        // The old engine's listener closes when its last handle goes (the ends worker may hold
        // one for a moment): bind again until then.
        let until = Instant::now() + Duration::from_secs(5);
        let engine = loop {
            match self.start_engine(&addr, ends) {
                Ok(e) => break e,
                Err(e) if Instant::now() > until => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let reply = format!("closed-all {} {}", t.elapsed().as_millis(), engine.local_addr());
        *slot = Some(engine);
        Ok(reply)
    }

    /// What is left: waits up to 10 s for the prefill side's connections to go, then reports.
    fn leaks(&self, base_fds: usize, base_threads: &std::collections::BTreeMap<String, usize>) -> String {
        let Some(engine) = self.engine() else { return "leaks {\"error\": \"no engine\"}".to_owned() };
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let s = engine.stats();
            let quiet = s.connections == 0 && s.ring_live_allocations == 0 && self.rooms.lock().unwrap().is_empty();
            if quiet && procfs::threads().get("kvstage-recv").copied().unwrap_or(0) == 0 || Instant::now() > until {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let s = engine.stats();
        let d = engine.describe();
        let threads = procfs::grown(base_threads, &procfs::threads());
        let doc = serde_json::json!({
            "ring_allocations": s.ring_live_allocations,
            "ring_used_bytes": s.ring_used_bytes,
            "connections": s.connections,
            "rooms": d.receiver.rooms.len(),
            "rooms_open_here": self.rooms.lock().unwrap().len(),
            "pages_held": self.pages.held(),
            "fds": procfs::fds() as i64 - base_fds as i64,
            "threads": threads.values().sum::<usize>(),
            "thread_kinds": threads,
            "rooms_expired": s.rooms_expired,
            "thread_panics": s.thread_panics,
        });
        format!("leaks {doc}")
    }
}

pub fn run(cli: &Cli, setup: Setup) -> Result<()> {
    let shape = setup.model.shape(setup.page_size, cli.rank, setup.decode_tp);
    let pool = HostPool::with_layout(shape, cli.pool_pages as u64, setup.decode_layout, setup.page_pad, false);
    let (tx, rx) = mpsc::channel::<End>();
    let me = Arc::new(Decode {
        rank: cli.rank,
        listen: cli.listen.clone(),
        cli_options: options(&setup, cli),
        engine: RwLock::new(None),
        pool,
        parts: Mutex::new(None),
        rooms: Mutex::new(HashMap::new()),
        pages: Pages::new(cli.pool_pages, 300 + cli.rank as u64),
        out: Out::default(),
        wrong_every: cli.selftest_wrong_reference,
        setup,
    });
    let engine = me.start_engine(&me.listen, &tx)?;
    *me.engine.write().unwrap() = Some(engine.clone());
    {
        let me = me.clone();
        std::thread::Builder::new().name("cluster-ends".into()).spawn(move || {
            for end in rx {
                me.end(end);
            }
        })?;
    }
    std::thread::sleep(Duration::from_millis(50));
    let (base_fds, base_threads) = (procfs::fds(), procfs::threads());
    me.out.line(&format!("ready {}", engine.local_addr()));
    drop(engine);
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| Error::from(e).context("stdin".to_owned()))?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match w.first().copied().unwrap_or("") {
            "open" => {
                let reply = me.open(num(1), num(2) as usize, num(3));
                me.out.line(&reply);
            }
            "cancel" => {
                let _ = tx.send(End::Cancel { room: num(1) });
            }
            "close-all" => {
                let reply = me.close_all(&tx).unwrap_or_else(|e| format!("error close-all: {}", proto::one_line(&e.chain())));
                me.out.line(&reply);
            }
            "leaks" => {
                let reply = me.leaks(base_fds, &base_threads);
                me.out.line(&reply);
            }
            "quit" => break,
            other => me.out.line(&format!("error unknown command '{other}'")),
        }
    }
    // The ends worker holds no lock here; the process exits after this (the engine's
    // callback keeps the channel open, so the worker is not joined).
    if let Some(engine) = me.engine.write().unwrap().take() {
        let _ = engine.shutdown(Some(Duration::from_secs(5)));
    }
    Ok(())
}
