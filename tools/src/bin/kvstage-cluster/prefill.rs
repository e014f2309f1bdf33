//! A prefill rank process: one engine and a filled KV pool, sessions to decode ranks opened on
//! first use and kept (one per decode rank address), opened again after the peer died. For each
//! request (`send REQ PAGES BASE ADDR/KEY...`) it takes pages of its own, fills them with the
//! reference for the request's tokens (tokens `BASE..`: every request's bytes differ), queues
//! every chunk to every decode rank it feeds (`transfer_async`, the request's parts with the last
//! chunk), waits for them and answers `sent REQ STATUS MS`.

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvstage::engine::Engine;
use kvstage::protocol::RoomRef;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::{Error, Result, Status};
use kvstage_testkit::cluster::Setup;
use kvstage_testkit::parts::PartsMemory;
use kvstage_testkit::HostPool;

use crate::cli::Cli;
use crate::pages::Pages;
use crate::procfs;
use crate::proto::{self, Out};

struct Prefill {
    setup: Setup,
    node: u32,
    rank: u32,
    timeout: Duration,
    engine: Engine,
    pool: Mutex<HostPool>,
    _parts: Option<PartsMemory>,
    pages: Pages,
    sessions: Mutex<HashMap<String, Arc<SenderSession>>>,
    in_flight: AtomicUsize,
    /// The sequence number of the next request whose chunks may be queued.
    order: (Mutex<u64>, Condvar),
    out: Out,
}

/// A request's turn to queue its chunks, in the order the requests came: [`Ticket::wait`] until
/// it comes; dropping the ticket (after waiting, or instead of it) hands the turn on once it came.
struct Ticket<'a> {
    order: &'a (Mutex<u64>, Condvar),
    seq: u64,
}

impl Ticket<'_> {
    fn wait(&self) {
        let (lock, cv) = self.order;
        let mut next = lock.lock().unwrap();
        while *next < self.seq {
            next = cv.wait(next).unwrap();
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.wait();
        let (lock, cv) = self.order;
        let mut next = lock.lock().unwrap();
        *next = (*next).max(self.seq + 1);
        cv.notify_all();
    }
}

impl Prefill {
    /// The live session to `addr`, connecting when there is none (or the one kept died) within
    /// `timeout`. The map is not held while connecting: a peer that does not answer holds only
    /// the requests that go to it.
    fn session(&self, addr: &str, timeout: Duration) -> Result<Arc<SenderSession>> {
        {
            let mut sessions = self.sessions.lock().unwrap();
            if let Some(s) = sessions.get(addr) {
                if s.describe().dead.is_none() {
                    return Ok(s.clone());
                }
                sessions.remove(addr);
            }
            // Sessions to other addresses that died (a restarted decode process on loopback
            // listens elsewhere).
            sessions.retain(|_, s| s.describe().dead.is_none());
        }
        let id = format!("p{}r{}-{addr}", self.node, self.rank);
        let s = self.engine.connect(addr, &id, Some(timeout.min(Duration::from_secs(3))))?;
        // Another request may have connected meanwhile: keep one (the other closes when dropped).
        Ok(self.sessions.lock().unwrap().entry(addr.to_owned()).or_insert(s).clone())
    }

    /// After a failure: a session that says it is dead (README, "Failure semantics": its
    /// connection went, or a chunk gave up with bytes in the stream and reset it) is let go; the
    /// next request to `addr` connects again.
    fn forget_if_dead(&self, addr: &str, session: &Arc<SenderSession>) {
        if session.stats().dead.is_none() {
            return;
        }
        let mut sessions = self.sessions.lock().unwrap();
        if sessions.get(addr).is_some_and(|s| Arc::ptr_eq(s, session)) {
            sessions.remove(addr);
        }
    }

    /// Sends one request to the decode ranks this rank feeds; the first failure's status.
    fn send(&self, req: u64, npages: usize, base: u64, targets: &[(String, u64)], start: Instant, ticket: Ticket<'_>) -> Result<()> {
        let pages = self.pages.take(npages).ok_or_else(|| Error::new(Status::KVSTAGE_E_OUT_OF_MEMORY, format!("no free prefill pages ({npages} asked, {} held)", self.pages.held())))?;
        self.pool.lock().unwrap().fill(&pages, base);
        let result = self.send_pages(req, &pages, targets, start, ticket);
        self.pages.give(pages);
        result
    }

    /// The request's deadline is `self.timeout` from `start` (when its `send` arrived): connecting
    /// and every chunk's deadline count against it.
    fn send_pages(&self, req: u64, pages: &[u32], targets: &[(String, u64)], start: Instant, ticket: Ticket<'_>) -> Result<()> {
        let deadline = start + self.timeout;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let grid = self.setup.grid_pages();
        let chunks = pages.len().div_ceil(grid);
        let mut ops = Vec::new();
        let mut first_err: Option<Error> = None;
        let mut sessions = Vec::new();
        for rd in self.setup.targets(self.rank) {
            let Some((addr, key)) = targets.get(rd as usize) else {
                return Err(Error::invalid_arg("send", format!("no address for decode rank {rd}")));
            };
            match self.session(addr, left()) {
                Ok(s) => sessions.push((addr, *key, s)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Chunks are queued in the order the requests came (every prefill rank gets them in the
        // router's order): two ranks that queued two requests' chunks in different orders could
        // each hold a decode ring's oldest grant for a chunk the other rank has not asked for
        // yet, and each wait behind the other until a deadline ends it.
        ticket.wait();
        for (addr, key, session) in sessions {
            let key = &key;
            for (chunk, chunk_pages) in pages.chunks(grid).enumerate() {
                let parts = (chunk + 1 == chunks).then(|| self.setup.request_parts(req)).flatten().map(Arc::new);
                let desc = TransferDesc {
                    room: RoomRef { id: req, key: *key },
                    chunk: chunk as u32,
                    pages: chunk_pages.to_vec(),
                    timeout: Some(left()),
                    trace: Some(format!("req-{req}")),
                    parts,
                    ..Default::default()
                };
                match session.transfer_async(desc, false, req) {
                    Ok(op) => ops.push((addr.to_owned(), session.clone(), op)),
                    Err(e) => {
                        self.forget_if_dead(addr, &session);
                        first_err.get_or_insert(e);
                        break;
                    }
                }
            }
        }
        drop(ticket);
        let mut hung = false;
        for (addr, session, op) in ops {
            // Each operation ends by its deadline; the margin only guards against a bug.
            let r = match op.wait(Some(left() + Duration::from_secs(5))) {
                Ok(Status::KVSTAGE_PENDING) => {
                    // A library operation that outlives its deadline: the run reports it hung.
                    op.cancel();
                    hung = true;
                    Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "the operation outlived its deadline by 5 s"))
                }
                Ok(Status::KVSTAGE_OK) => Ok(()),
                Ok(s) => Err(Error::new(s, format!("transfer returned {}", s.name()))),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                self.forget_if_dead(&addr, &session);
                first_err.get_or_insert(e);
            }
        }
        if hung {
            return Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "HUNG: an operation outlived its deadline by 5 s"));
        }
        first_err.map_or(Ok(()), Err)
    }

    fn leaks(&self, base_fds: usize, base_threads: &std::collections::BTreeMap<String, usize>) -> String {
        let until = Instant::now() + Duration::from_secs(10);
        while self.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        let dropped: Vec<_> = self.sessions.lock().unwrap().drain().map(|(_, s)| s).collect();
        let kept = dropped.len();
        drop(dropped);
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let t = procfs::threads();
            let senders = t.get("kvstage-send-p").copied().unwrap_or(0);
            if (self.engine.describe().sessions.is_empty() && senders == 0) || Instant::now() > until {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let threads = procfs::grown(base_threads, &procfs::threads());
        let s = self.engine.stats();
        let doc = serde_json::json!({
            "sessions_closed": kept,
            "sessions": self.engine.describe().sessions.len(),
            "requests_in_flight": self.in_flight.load(Ordering::SeqCst),
            "pages_held": self.pages.held(),
            "fds": procfs::fds() as i64 - base_fds as i64,
            "threads": threads.values().sum::<usize>(),
            "thread_kinds": threads,
            "thread_panics": s.thread_panics,
        });
        format!("leaks {doc}")
    }
}

pub fn run(cli: &Cli, setup: Setup) -> Result<()> {
    let engine = Engine::new(crate::decode::options(&setup, cli))?;
    let shape = setup.model.shape(setup.page_size, cli.rank, setup.prefill_tp);
    let pool = HostPool::with_layout(shape, cli.pool_pages as u64, setup.prefill_layout, setup.page_pad, false);
    engine.register_pool(pool.layout.clone())?;
    let parts = setup.has_parts().then(|| PartsMemory::register(&setup, &engine, cli.rank, setup.prefill_tp, true)).transpose()?;
    let me = Arc::new(Prefill {
        node: cli.node,
        rank: cli.rank,
        timeout: Duration::from_millis(cli.timeout_ms),
        engine,
        pool: Mutex::new(pool),
        _parts: parts,
        pages: Pages::new(cli.pool_pages, 100 + cli.rank as u64),
        sessions: Mutex::new(HashMap::new()),
        in_flight: AtomicUsize::new(0),
        order: (Mutex::new(0), Condvar::new()),
        out: Out::default(),
        setup,
    });
    std::thread::sleep(Duration::from_millis(50));
    let (base_fds, base_threads) = (procfs::fds(), procfs::threads());
    me.out.line("ready");
    let mut next_seq = 0u64;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| Error::from(e).context("stdin".to_owned()))?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match w.first().copied().unwrap_or("") {
            "send" => {
                let (req, npages, base) = (num(1), num(2) as usize, num(3));
                let targets: Vec<(String, u64)> = w[4.min(w.len())..]
                    .iter()
                    .map(|t| {
                        let (a, k) = t.rsplit_once('/').unwrap_or((t, "0"));
                        (a.to_owned(), k.parse().unwrap_or(0))
                    })
                    .collect();
                me.in_flight.fetch_add(1, Ordering::SeqCst);
                let seq = next_seq;
                next_seq += 1;
                let worker = me.clone();
                let spawned = std::thread::Builder::new().name(format!("cluster-req-{req}")).spawn(move || {
                    let t = Instant::now();
                    let ticket = Ticket { order: &worker.order, seq };
                    let r = worker.send(req, npages, base, &targets, t, ticket);
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    let line = match r {
                        Ok(()) => format!("sent {req} KVSTAGE_OK {ms:.3}"),
                        Err(e) if e.message().starts_with("HUNG") => format!("sent {req} HUNG {ms:.3} {}", proto::one_line(&e.chain())),
                        Err(e) => format!("sent {req} {} {ms:.3} {}", e.code().name(), proto::one_line(&e.chain())),
                    };
                    worker.in_flight.fetch_sub(1, Ordering::SeqCst);
                    worker.out.line(&line);
                });
                if let Err(e) = spawned {
                    drop(Ticket { order: &me.order, seq });
                    me.in_flight.fetch_sub(1, Ordering::SeqCst);
                    me.out.line(&format!("sent {req} KVSTAGE_E_INTERNAL 0 cannot start a thread: {e}"));
                }
            }
            "leaks" => {
                let reply = me.leaks(base_fds, &base_threads);
                me.out.line(&reply);
            }
            "quit" => break,
            other => me.out.line(&format!("error unknown command '{other}'")),
        }
    }
    me.sessions.lock().unwrap().clear();
    let _ = me.engine.shutdown(Some(Duration::from_secs(5)));
    Ok(())
}
