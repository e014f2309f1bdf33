//! The router: starts every rank process, runs the bootstrap for each request (the decode ranks
//! of the chosen node open rooms and answer their keys; the prefill ranks of the chosen node get
//! (room, key, pages) and send), draws arrivals, sizes and routes, runs the fault schedule, and
//! keeps each request's outcome. It is one thread: every rank's lines come through one channel.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvstage::Result;
use kvstage_testkit::cluster::Setup;

use crate::cli::Cli;
use crate::faults::{Kind, Plan, Record};
use crate::net::Net;
use crate::nodes::{Msg, RankId, RankProc};
use crate::rng::Rng;

mod inject;
mod run;
pub use run::run;

/// One request's bootstrap and outcome.
#[derive(Debug)]
pub struct Req {
    pub id: u64,
    pub prefill_node: u32,
    pub decode_node: u32,
    pub tokens: u64,
    pub arrive: f64,
    pub sent_at: Option<f64>,
    keys: Vec<Option<u64>>,
    /// Per prefill rank: status and why.
    pub sent: Vec<Option<(String, String)>>,
    /// Per decode rank: status, bad bytes, why.
    pub done: Vec<Option<(String, u64, String)>>,
    pub end: Option<f64>,
    pub hung: bool,
    canceled: bool,
}

impl Req {
    fn ended(&self) -> bool {
        self.hung || (self.sent.iter().all(Option::is_some) && self.done.iter().all(Option::is_some))
    }

    fn failed_early(&self) -> bool {
        self.sent.iter().flatten().any(|(s, _)| s != "KVSTAGE_OK") || self.done.iter().flatten().any(|(s, _, _)| s != "KVSTAGE_OK")
    }
}

/// A fault being run: its plan, its record, and what is left to do.
struct Active {
    plan: Plan,
    record: usize,
    /// When to lift it (link up, SIGCONT, restart, restore).
    lift_at: f64,
    lifted: bool,
    /// Restarted decode ranks (or close-all replies) still to report ready.
    waiting: usize,
}

pub struct Outcome {
    pub reqs: Vec<Req>,
    pub rejected: BTreeMap<String, u64>,
    pub faults: Vec<Record>,
    pub leaks: Vec<(String, serde_json::Value)>,
    pub errors: Vec<String>,
    pub elapsed: f64,
}

struct Router<'a> {
    cli: &'a Cli,
    setup: &'a Setup,
    exe: PathBuf,
    setup_flags: Vec<String>,
    logs: PathBuf,
    net: Option<Net>,
    tx: mpsc::Sender<Msg>,
    procs: BTreeMap<RankId, RankProc>,
    /// Ranks alive and ready, and each decode rank's address.
    ready: BTreeMap<RankId, bool>,
    addrs: HashMap<RankId, String>,
    incarnations: HashMap<RankId, u32>,
    reqs: Vec<Req>,
    open: HashMap<u64, usize>,
    /// Pages held on each rank of a node by its requests in flight (prefill, decode): the
    /// router admits a request only where they fit, as an engine's scheduler would.
    busy: HashMap<(bool, u32), u64>,
    rejected: BTreeMap<String, u64>,
    faults: Vec<Record>,
    active: Vec<Active>,
    leaks: Vec<(String, serde_json::Value)>,
    errors: Vec<String>,
    t0: Instant,
}

fn node_of(name: &str) -> (bool, u32) {
    (name.starts_with('d'), name[1..].parse().unwrap_or(0))
}

impl Router<'_> {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn log(&self, what: &str) {
        eprintln!("[{:8.3}] {what}", self.now());
    }

    /// Where a rank's engine listens: in a namespace, its node's address, decode rank `r` on
    /// port 7100 + r (a restarted rank listens where it did, so the prefill side reconnects to
    /// the same address); on loopback, any port (the router hands each request the current one).
    fn listen_addr(&self, id: RankId) -> String {
        match &self.net {
            Some(net) if id.decode => format!("{}:{}", net.addr(true, id.node), 7100 + id.rank),
            Some(net) => format!("{}:0", net.addr(false, id.node)),
            None => "127.0.0.1:0".to_owned(),
        }
    }

    fn spawn(&mut self, id: RankId) -> Result<()> {
        let inc = self.incarnations.entry(id).or_insert(0);
        *inc += 1;
        let inc = *inc;
        let mut args = self.setup_flags.clone();
        args.extend(self.cli.rank_flags(if id.decode { "decode" } else { "prefill" }, id.node, id.rank, &self.listen_addr(id)));
        let ns = self.net.as_ref().map(|n| n.node_ns(&id.node_name()));
        let log = self.logs.join(format!("{id}.log"));
        let p = RankProc::spawn(id, inc, ns.as_deref(), &self.exe, &args, &log, self.tx.clone())?;
        self.ready.insert(id, false);
        self.procs.insert(id, p);
        Ok(())
    }

    fn ranks_of(&self, decode: bool, node: u32) -> Vec<RankId> {
        let tp = if decode { self.setup.decode_tp } else { self.setup.prefill_tp };
        (0..tp).map(|rank| RankId { decode, node, rank }).collect()
    }

    fn node_ready(&self, decode: bool, node: u32) -> bool {
        self.ranks_of(decode, node).iter().all(|r| self.ready.get(r).copied().unwrap_or(false))
    }

    fn send_to(&mut self, id: RankId, line: &str) {
        if let Some(p) = self.procs.get_mut(&id) {
            p.send(line);
        }
    }

    /// A request arrives: route it and ask the decode ranks for rooms.
    fn arrive(&mut self, rng: &mut Rng) {
        let ps = self.setup.page_size as u64;
        let pages = rng.range(self.cli.min_tokens.div_ceil(self.setup.page_size) as u64, self.setup.tokens as u64 / ps);
        let (p, d) = (rng.next_u64(), rng.next_u64());
        let fits = |me: &Self, decode: bool, n: u32| me.busy.get(&(decode, n)).copied().unwrap_or(0) + pages <= me.cli.pool_pages as u64;
        let prefill: Vec<u32> = (0..self.cli.prefill_nodes).filter(|&n| self.node_ready(false, n)).collect();
        let decode: Vec<u32> = (0..self.cli.decode_nodes).filter(|&n| self.node_ready(true, n)).collect();
        let why = if prefill.is_empty() || decode.is_empty() {
            Some("no node of one side is up")
        } else if !prefill.iter().any(|&n| fits(self, false, n)) {
            Some("no prefill node has free pages for it (an engine would queue it)")
        } else if !decode.iter().any(|&n| fits(self, true, n)) {
            Some("no decode node has free pages for it (an engine would queue it)")
        } else {
            None
        };
        if let Some(why) = why {
            *self.rejected.entry(why.into()).or_default() += 1;
            return;
        }
        let prefill: Vec<u32> = prefill.into_iter().filter(|&n| fits(self, false, n)).collect();
        let decode: Vec<u32> = decode.into_iter().filter(|&n| fits(self, true, n)).collect();
        let id = self.reqs.len() as u64 + 1;
        let req = Req {
            id,
            prefill_node: prefill[(p % prefill.len() as u64) as usize],
            decode_node: decode[(d % decode.len() as u64) as usize],
            tokens: pages * ps,
            arrive: self.now(),
            sent_at: None,
            keys: vec![None; self.setup.decode_tp as usize],
            sent: vec![None; self.setup.prefill_tp as usize],
            done: vec![None; self.setup.decode_tp as usize],
            end: None,
            hung: false,
            canceled: false,
        };
        // Every request's tokens are its own (BASE..): bytes of one request in another's pages show.
        *self.busy.entry((false, req.prefill_node)).or_default() += pages;
        *self.busy.entry((true, req.decode_node)).or_default() += pages;
        let line = format!("open {id} {pages} {}", id << 20);
        for r in self.ranks_of(true, req.decode_node) {
            self.send_to(r, &line);
        }
        self.open.insert(id, self.reqs.len());
        self.reqs.push(req);
    }

    fn req_mut(&mut self, id: u64) -> Option<&mut Req> {
        let at = *self.open.get(&id)?;
        self.reqs.get_mut(at)
    }

    /// Asks the decode ranks that still hold the request's room to release it.
    fn cancel(&mut self, id: u64) {
        let Some(req) = self.req_mut(id) else { return };
        if req.canceled {
            return;
        }
        req.canceled = true;
        let node = req.decode_node;
        let owed: Vec<u32> = req.done.iter().enumerate().filter(|(r, d)| d.is_none() && req.keys[*r].is_some()).map(|(r, _)| r as u32).collect();
        for r in owed {
            self.send_to(RankId { decode: true, node, rank: r }, &format!("cancel {id}"));
        }
    }

    fn finish_if_ended(&mut self, id: u64) {
        let now = self.now();
        let Some(req) = self.req_mut(id) else { return };
        if !req.ended() && req.sent_at.is_none() && req.failed_early() {
            // Failed before the prefill ranks were handed the request (a decode rank died or
            // refused while rooms were being opened): they have nothing to report.
            for s in req.sent.iter_mut().filter(|s| s.is_none()) {
                *s = Some(("NOT_SENT".into(), "the request failed before it was handed to the prefill ranks".into()));
            }
        }
        if req.ended() {
            req.end = Some(now);
            let (p, d, pages) = (req.prefill_node, req.decode_node, req.tokens / self.setup.page_size as u64);
            self.open.remove(&id);
            for key in [(false, p), (true, d)] {
                if let Some(b) = self.busy.get_mut(&key) {
                    *b = b.saturating_sub(pages);
                }
            }
        } else if req.failed_early() {
            self.cancel(id);
        }
    }

    fn on_line(&mut self, from: RankId, line: &str) {
        let w: Vec<&str> = line.splitn(5, ' ').collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let rest = |i: usize| w.get(i..).map(|r| r.join(" ")).unwrap_or_default();
        match w.first().copied().unwrap_or("") {
            "ready" => {
                if let Some(addr) = w.get(1) {
                    self.addrs.insert(from, addr.to_string());
                }
                self.ready.insert(from, true);
                self.log(&format!("{from} ready {}", w.get(1).unwrap_or(&"")));
                self.fault_progress(from, "ready");
            }
            "opened" => {
                let (id, key) = (num(1), num(2));
                let Some(req) = self.req_mut(id) else { return };
                req.keys[from.rank as usize] = Some(key);
                if req.canceled {
                    self.send_to(from, &format!("cancel {id}"));
                    return;
                }
                if req.keys.iter().all(Option::is_some) {
                    self.dispatch(id);
                }
            }
            "refused" => {
                let id = num(1);
                let why = rest(2);
                if let Some(req) = self.req_mut(id) {
                    // Not a failure of a transfer: the decode node had no room for the request
                    // (an engine would queue it). Counted apart; rooms opened elsewhere released.
                    req.done[from.rank as usize] = Some(("REFUSED".into(), 0, why.clone()));
                    for (r, d) in req.done.iter_mut().enumerate() {
                        if d.is_none() && req.keys[r].is_none() {
                            *d = Some(("REFUSED".into(), 0, "a sibling rank refused".into()));
                        }
                    }
                    for s in req.sent.iter_mut() {
                        *s = Some(("NOT_SENT".into(), "refused at open".into()));
                    }
                    *self.rejected.entry(format!("decode refused the room: {}", why.split(" (").next().unwrap_or(""))).or_default() += 1;
                    self.cancel(id);
                    self.finish_if_ended(id);
                }
            }
            "sent" => {
                let id = num(1);
                let status = w.get(2).unwrap_or(&"?").to_string();
                let why = rest(4);
                if let Some(req) = self.req_mut(id) {
                    req.sent[from.rank as usize] = Some((status, why));
                    self.finish_if_ended(id);
                }
            }
            "done" => {
                let id = num(1);
                let status = w.get(2).unwrap_or(&"?").to_string();
                let bad = num(3);
                let why = rest(4);
                if let Some(req) = self.req_mut(id) {
                    req.done[from.rank as usize] = Some((status, bad, why));
                    self.finish_if_ended(id);
                }
            }
            "closed-all" => {
                if let Some(addr) = w.get(2) {
                    self.addrs.insert(from, addr.to_string());
                }
                self.log(&format!("{from} closed all sessions in {} ms", num(1)));
                self.fault_progress(from, "closed-all");
            }
            "leaks" => {
                let doc = serde_json::from_str(&rest(1)).unwrap_or_else(|e| serde_json::json!({"error": format!("bad leaks reply: {e}")}));
                self.leaks.push((from.to_string(), doc));
            }
            _ => {
                self.errors.push(format!("{from}: {line}"));
                self.log(&format!("{from}: {line}"));
            }
        }
    }

    /// Every decode rank answered its key: hand (room, key, pages) to the prefill ranks.
    fn dispatch(&mut self, id: u64) {
        let now = self.now();
        let Some(req) = self.req_mut(id) else { return };
        req.sent_at = Some(now);
        let (p, d, tokens) = (req.prefill_node, req.decode_node, req.tokens);
        let keys: Vec<u64> = req.keys.iter().map(|k| k.unwrap_or(0)).collect();
        let targets: Vec<String> = self.ranks_of(true, d).iter().zip(&keys).map(|(r, k)| format!("{}/{k}", self.addrs.get(r).cloned().unwrap_or_default())).collect();
        let line = format!("send {id} {} {} {}", tokens / self.setup.page_size as u64, id << 20, targets.join(" "));
        for r in self.ranks_of(false, p) {
            self.send_to(r, &line);
        }
    }

    /// A rank's stdout closed: it exited (killed, or crashed).
    fn on_exit(&mut self, from: RankId) {
        self.ready.insert(from, false);
        self.procs.remove(&from);
        let expected = self.active.iter().any(|a| a.plan.kind == Kind::DecodeKill && !a.lifted && node_of(&a.plan.node) == (from.decode, from.node));
        if !expected {
            self.errors.push(format!("{from} exited unexpectedly"));
        }
        self.log(&format!("{from} exited{}", if expected { " (killed)" } else { " unexpectedly" }));
        let ids: Vec<u64> = self.open.keys().copied().collect();
        for id in ids {
            let Some(req) = self.req_mut(id) else { continue };
            let slot = from.rank as usize;
            if from.decode && req.decode_node == from.node && req.done[slot].is_none() {
                req.done[slot] = Some(("PROCESS_DIED".into(), 0, "the decode rank process exited".into()));
            } else if !from.decode && req.prefill_node == from.node && req.sent[slot].is_none() && req.sent_at.is_some() {
                req.sent[slot] = Some(("PROCESS_DIED".into(), "the prefill rank process exited".into()));
            } else {
                continue;
            }
            self.finish_if_ended(id);
        }
    }

    fn pump(&mut self, rx: &mpsc::Receiver<Msg>, until: f64) {
        loop {
            let left = until - self.now();
            if left <= 0.0 {
                return;
            }
            match rx.recv_timeout(Duration::from_secs_f64(left.min(0.05))) {
                Ok(msg) => {
                    if self.incarnations.get(&msg.from).copied() != Some(msg.incarnation) {
                        continue; // a line of a process that was replaced
                    }
                    match msg.line {
                        Some(line) => self.on_line(msg.from, &line),
                        None => self.on_exit(msg.from),
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            self.lift_due();
        }
    }

    /// Requests older than `hung_after` that have not ended are hung: counted, their rooms
    /// released.
    fn mark_hung(&mut self, hung_after: f64) {
        let now = self.now();
        let ids: Vec<u64> = self.open.keys().copied().collect();
        for id in ids {
            let Some(req) = self.req_mut(id) else { continue };
            if now - req.arrive > hung_after {
                req.hung = true;
                let what = format!("request {id} hung: {req:?}");
                self.log(&what);
                self.cancel(id);
                self.finish_if_ended(id);
            }
        }
    }
}
