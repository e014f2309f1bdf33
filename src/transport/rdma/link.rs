//! Queue-pair slots, the completion-queue polling thread, the sender's transport (RDMA WRITE of
//! the chunk, WRITE_WITH_IMM as its completion, control frames over the session's TCP stream) and
//! the receiver's peer (immediates that must precede `ChunkReady`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::attrs::{self, PortAttrs};
use super::fault::{self, WriteFault};
use super::split::{plan_writes, PlannedWr};
use super::verbs::{CompletionQueue, QueuePair, SendWr, Wc, WcKind};
use super::{Rdma, StagingKeys};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::Message;
use crate::transport::{SlicePayload, Transport};

/// Receive work requests kept posted on a receiver QP (one per WRITE_WITH_IMM in flight).
pub const RECV_DEPTH: u32 = 64;
/// How long a shut-down transport waits for its flushed work requests.
const FLUSH_WAIT: Duration = Duration::from_secs(1);

/// Wakes the waiters of one transport or peer when any of its QPs completes something.
#[derive(Default)]
pub struct Notify {
    lock: Mutex<()>,
    cv: Condvar,
}

impl Notify {
    fn notify(&self) {
        let _g = self.lock.lock();
        self.cv.notify_all();
    }

    /// Waits until `ready()` or the deadline; `Ok(false)` on the deadline.
    fn wait_until(&self, deadline: &Deadline, mut ready: impl FnMut() -> bool) -> bool {
        let mut g = self.lock.lock();
        loop {
            if ready() {
                return true;
            }
            if !deadline.wait(&self.cv, &mut g) && !ready() {
                return false;
            }
        }
    }
}

/// A failed work completion, as recorded by the poller.
#[derive(Clone, Debug)]
pub struct WcFailure {
    pub status: u32,
    pub vendor_err: u32,
    pub wr_id: u64,
}

/// One connected (or connecting) QP with its completion queue.
pub struct QpSlot {
    pub qp: Mutex<Box<dyn QueuePair>>,
    cq: Arc<dyn CompletionQueue>,
    pub qpn: u32,
    pub nic: usize,
    pub local: PortAttrs,
    pub psn: u32,
    /// "QP 0x1a4 on mlx5_0:1, peer 10.0.0.2:7000, session s-1"
    pub desc: Mutex<String>,
    pub session: Mutex<String>,
    signals: AtomicU64,
    /// The newest work request posted on this QP, and the newest one completed (any status: a QP
    /// in the error state completes every outstanding request, flushed): equal once drained.
    last_posted_wr: AtomicU64,
    last_done_wr: AtomicU64,
    failure: Mutex<Option<WcFailure>>,
    notify: Arc<Notify>,
    arrivals: Option<Arc<Arrivals>>,
}

impl QpSlot {
    pub fn new(
        qp: Box<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        nic: usize,
        local: PortAttrs,
        psn: u32,
        notify: Arc<Notify>,
        arrivals: Option<Arc<Arrivals>>,
    ) -> QpSlot {
        let qpn = qp.qpn();
        QpSlot {
            desc: Mutex::new(format!("QP {qpn:#x} on {}", local.describe())),
            session: Mutex::new(String::new()),
            qp: Mutex::new(qp),
            cq,
            qpn,
            nic,
            local,
            psn,
            signals: AtomicU64::new(0),
            last_posted_wr: AtomicU64::new(0),
            last_done_wr: AtomicU64::new(0),
            failure: Mutex::new(None),
            notify,
            arrivals,
        }
    }

    pub fn set_peer(&self, peer: &str, session: &str) {
        *self.desc.lock() = format!("QP {:#x} on {}, peer {peer}, session {session}", self.qpn, self.local.describe());
        *self.session.lock() = session.to_owned();
    }

    /// The error a failed completion of this QP stands for (the `ibv_wc_status` name, QP number,
    /// device, peer and session).
    pub fn failure_error(&self) -> Option<Error> {
        let f = self.failure.lock().clone()?;
        let desc = self.desc.lock().clone();
        Some(wc_error(&f, &desc).with_session(&self.session.lock()))
    }

    /// Every send work request posted on this QP completed (or was flushed).
    fn drained(&self) -> bool {
        self.last_done_wr.load(Ordering::SeqCst) >= self.last_posted_wr.load(Ordering::SeqCst)
    }

    fn handle(&self, wc: &Wc) {
        if wc.status != 0 || wc.kind == WcKind::Send {
            // Send queues complete in order: this one and every request posted before it are done.
            self.last_done_wr.fetch_max(wc.wr_id, Ordering::SeqCst);
        }
        if wc.status != 0 {
            let mut f = self.failure.lock();
            // Keep the first real error; a flush (5) only when nothing better is known.
            let first = f.as_ref().is_none_or(|old| old.status == 5 && wc.status != 5);
            if first {
                *f = Some(WcFailure { status: wc.status, vendor_err: wc.vendor_err, wr_id: wc.wr_id });
            }
            drop(f);
            if first {
                // Once per QP (a flush only until a real error shows): the QP is in the error
                // state; every write on it fails from here on.
                let e = self.failure_error().expect("just recorded");
                let session = self.session.lock().clone();
                if wc.status == 5 {
                    log::debug!(session = session.as_str(); "{}", e.chain());
                } else {
                    log::error!(session = session.as_str(); "{}", e.chain());
                }
            }
            if let Some(a) = &self.arrivals {
                a.fail(self.failure_error().expect("just recorded"));
            }
            return;
        }
        match wc.kind {
            WcKind::Send => {
                self.signals.fetch_add(1, Ordering::SeqCst);
            }
            WcKind::RecvImm => {
                if let Some(a) = &self.arrivals {
                    a.arrive(wc.imm);
                }
                // Keep the receive queue full: one posted receive per immediate in flight.
                if let Err(e) = self.qp.lock().post_recv(&[wc.wr_id]) {
                    if let Some(a) = &self.arrivals {
                        let desc = self.desc.lock().clone();
                        a.fail(Error::new(Status::KVSTAGE_E_RDMA, format!("ibv_post_recv on {desc} failed")).with_source(e));
                    }
                }
            }
            WcKind::Other(_) => {}
        }
    }

    pub fn to_error(&self) {
        self.qp.lock().to_error();
    }
}

pub fn wc_error(f: &WcFailure, desc: &str) -> Error {
    Error::new(
        Status::KVSTAGE_E_RDMA,
        format!(
            "work completion failed: {} (status {}, vendor error {:#x}, wr_id {}) on {desc}",
            attrs::wc_status_name(f.status),
            f.status,
            f.vendor_err,
            f.wr_id
        ),
    )
    .with_source(crate::error::CauseChain::from_list(vec![attrs::wc_status_hint(f.status)]).expect("one item"))
}

/// Immediates received on a peer's QPs (chunk completions), and the first failure.
pub struct Arrivals {
    state: Mutex<(HashSet<u32>, Option<String>, Status)>,
    notify: Notify,
}

impl Default for Arrivals {
    fn default() -> Self {
        Arrivals { state: Mutex::new((HashSet::new(), None, Status::KVSTAGE_E_RDMA)), notify: Notify::default() }
    }
}

/// Writes-with-immediate a peer may have completed ahead of their chunk readies. A sender has one
/// per transfer in flight; beyond this the peer is broken or hostile (each costs memory here), and
/// its session fails rather than the set growing.
const MAX_EARLY_IMMEDIATES: usize = 4096;

impl Arrivals {
    fn arrive(&self, imm: u32) {
        let mut s = self.state.lock();
        if s.0.len() >= MAX_EARLY_IMMEDIATES && !s.0.contains(&imm) {
            drop(s);
            self.fail(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("more than {MAX_EARLY_IMMEDIATES} writes-with-immediate arrived without their chunk readies"),
            ));
            return;
        }
        s.0.insert(imm);
        drop(s);
        self.notify.notify();
    }

    fn fail(&self, e: Error) {
        let mut s = self.state.lock();
        if s.1.is_none() {
            s.1 = Some(e.chain());
            s.2 = e.code();
        }
        drop(s);
        self.notify.notify();
    }
}

/// The engine's completion-queue poller: one thread for every QP of the engine, started with the
/// first QP. It spins briefly after activity and then backs off to 1 ms sleeps.
#[derive(Default)]
pub struct Poller {
    slots: Mutex<Vec<Weak<QpSlot>>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    idle: Notify,
}

impl Poller {
    pub fn add(self: &Arc<Self>, slot: &Arc<QpSlot>) -> Result<()> {
        self.slots.lock().push(Arc::downgrade(slot));
        let mut t = self.thread.lock();
        if t.is_none() {
            let me = self.clone();
            *t = Some(
                std::thread::Builder::new()
                    .name("kvstage-rdma-cq".into())
                    .spawn(move || me.run())
                    .map_err(|e| Error::internal("cannot start the RDMA completion thread").with_source(e))?,
            );
        }
        drop(t);
        self.idle.notify();
        Ok(())
    }

    fn run(&self) {
        let mut wcs = Vec::with_capacity(64);
        let mut idle_passes = 0u32;
        while !self.stop.load(Ordering::SeqCst) {
            let live: Vec<Arc<QpSlot>> = {
                let mut slots = self.slots.lock();
                slots.retain(|w| w.strong_count() > 0);
                slots.iter().filter_map(Weak::upgrade).collect()
            };
            if live.is_empty() {
                let dl = Deadline::after(Some(Duration::from_millis(50)));
                self.idle.wait_until(&dl, || self.stop.load(Ordering::SeqCst));
                continue;
            }
            let mut any = false;
            // The slot being polled: a panic fails that one's waiters only.
            let mut at = 0usize;
            let polled = crate::panics::contain("the RDMA completion thread", None, || {
                crate::panics::point("rdma completions");
                for (i, slot) in live.iter().enumerate() {
                    at = i;
                    wcs.clear();
                    if let Err(e) = slot.cq.poll(&mut wcs) {
                        // A CQ that cannot be polled: every waiter of this QP fails.
                        slot.handle(&Wc { wr_id: 0, status: 21, kind: WcKind::Other(0), imm: 0, vendor_err: e.raw_os_error().unwrap_or(0) as u32 });
                    }
                    for wc in &wcs {
                        slot.handle(wc);
                    }
                    if !wcs.is_empty() {
                        any = true;
                        slot.notify.notify();
                    }
                }
            });
            if !polled {
                // Completions taken off that queue may have been lost with the panic: its waiters
                // fail now instead of at their deadlines, and the thread polls on for the others.
                if let Some(slot) = live.get(at) {
                    slot.handle(&Wc { wr_id: 0, status: 21, kind: WcKind::Other(0), imm: 0, vendor_err: 0 });
                    slot.notify.notify();
                }
            }
            drop(live);
            if any {
                idle_passes = 0;
            } else {
                idle_passes = idle_passes.saturating_add(1);
                if idle_passes < 64 {
                    std::thread::yield_now();
                } else {
                    let us = 20u64 << (idle_passes - 64).min(6);
                    std::thread::sleep(Duration::from_micros(us.min(1000)));
                }
            }
        }
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.idle.notify();
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
    }
}

/// Where the receiver's ring is, as learned from its answer.
#[derive(Clone, Debug)]
pub struct RemoteRing {
    pub addr: u64,
    pub len: u64,
    /// rkey per QP (the ring's key on that QP's remote device).
    pub rkeys: Vec<u32>,
}

/// The sender side: control frames over `tcp`, chunk bytes by RDMA.
pub struct RdmaTransport {
    tcp: Arc<dyn Transport>,
    rdma: Arc<Rdma>,
    slots: Vec<Arc<QpSlot>>,
    remote: RemoteRing,
    notify: Arc<Notify>,
    write_lock: Mutex<()>,
    dead: AtomicBool,
    desc: String,
    session: String,
    next_wr: AtomicU64,
}

impl RdmaTransport {
    pub fn new(tcp: Arc<dyn Transport>, rdma: Arc<Rdma>, slots: Vec<Arc<QpSlot>>, remote: RemoteRing, notify: Arc<Notify>, session: &str) -> RdmaTransport {
        let devices: Vec<String> = slots.iter().map(|s| s.local.describe()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let desc = format!("rdma {} ({} QP{}) via {}", devices.join("+"), slots.len(), if slots.len() == 1 { "" } else { "s" }, tcp.describe());
        RdmaTransport {
            tcp,
            rdma,
            slots,
            remote,
            notify,
            write_lock: Mutex::new(()),
            dead: AtomicBool::new(false),
            desc,
            session: session.to_owned(),
            next_wr: AtomicU64::new(1),
        }
    }

    pub fn qp_numbers(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.qpn).collect()
    }

    fn first_failure(&self) -> Option<Error> {
        self.slots.iter().find_map(|s| s.failure_error())
    }

    /// Any failure mid-write: the QPs go to ERR (flushing what is outstanding, so nothing of this
    /// chunk lands later in a ring range that may be granted again), the session's stream closes.
    fn kill(&self) {
        if self.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        for s in &self.slots {
            s.to_error();
        }
        self.tcp.shutdown();
    }

    /// Writes `len` bytes at `src` (registered host or device memory: the NIC reads it, never
    /// the CPU) to `remote_offset` of the receiver's ring; with `imm`, the last work request of
    /// QP 0 is a WRITE_WITH_IMM carrying it, after every other byte. Returns once every work
    /// request completed.
    pub fn rdma_write(&self, remote_offset: u64, src: u64, len: usize, imm: Option<u32>, deadline: &Deadline) -> Result<()> {
        // Another transfer's write on this session goes first, bounded by this one's deadline.
        let _g = match deadline.instant() {
            Some(until) => self.write_lock.try_lock_until(until).ok_or_else(|| {
                deadline.timeout_error(&format!("waiting for another write on {} to finish", self.desc)).with_session(&self.session)
            })?,
            None => self.write_lock.lock(),
        };
        if self.dead.load(Ordering::SeqCst) {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("{} was shut down", self.desc)));
        }
        let end = remote_offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.remote.len) {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!("write [{remote_offset}, +{len}) outside the receiver's ring of {} bytes", self.remote.len),
            ));
        }
        let lkeys = self.rdma.staging_keys(src as *mut u8, len)?;
        let result = self.post_and_wait(remote_offset, src, len, imm, &lkeys, deadline);
        if result.is_err() {
            self.kill();
            // The QPs are in the error state: every outstanding request completes, flushed. Only
            // then may the staging buffer the NIC reads be reused (bounded: a device that never
            // reports them is logged).
            let dl = Deadline::after(Some(FLUSH_WAIT));
            if !self.notify.wait_until(&dl, || self.slots.iter().all(|s| s.drained())) {
                log::error!(session = self.session.as_str(); "work requests of a failed write on {} still outstanding after {FLUSH_WAIT:?}", self.desc);
            }
        }
        result
    }

    fn post_and_wait(&self, remote_offset: u64, src: u64, len: usize, imm: Option<u32>, lkeys: &StagingKeys, deadline: &Deadline) -> Result<()> {
        let opts = self.rdma.options();
        let plan = plan_writes(len as u64, opts.wr_bytes, opts.signal_every, self.slots.len() as u32);
        // Without an immediate the planned imm request is a plain write, posted with the others.
        let defer_imm = imm.is_some() && plan.imm_waits_for_others();
        let window = (self.rdma.send_depth() / opts.signal_every.max(1)).max(1) as u64;
        let base: Vec<u64> = self.slots.iter().map(|s| s.signals.load(Ordering::SeqCst)).collect();
        let mut posted = vec![0u64; self.slots.len()];
        // Batches per QP: runs of WRs ending with a signalled one.
        let batches: Vec<Vec<Vec<PlannedWr>>> = plan
            .per_qp
            .iter()
            .map(|wrs| {
                let mut out: Vec<Vec<PlannedWr>> = Vec::new();
                let mut cur = Vec::new();
                for w in wrs {
                    if w.imm && defer_imm {
                        continue;
                    }
                    cur.push(*w);
                    if w.signaled {
                        out.push(std::mem::take(&mut cur));
                    }
                }
                if !cur.is_empty() {
                    // Ends at the deferred imm: signal the last one so the run is retired.
                    cur.last_mut().expect("non-empty").signaled = true;
                    out.push(cur);
                }
                out
            })
            .collect();
        let mut cursor = vec![0usize; self.slots.len()];
        let fault = fault::take();
        let past_the_ring = if fault == WriteFault::PastTheRing { self.remote.len } else { 0 };
        let to_wr = |q: usize, w: &PlannedWr| SendWr {
            wr_id: self.next_wr.fetch_add(1, Ordering::Relaxed),
            local_addr: src + w.offset,
            lkey: lkeys.lkey(self.slots[q].nic),
            len: w.len,
            remote_addr: self.remote.addr + remote_offset + w.offset + past_the_ring,
            rkey: if fault == WriteFault::BadRkey { !self.remote.rkeys[q] } else { self.remote.rkeys[q] },
            signaled: w.signaled,
            imm: imm.filter(|_| w.imm && fault != WriteFault::NoImmediate),
        };
        loop {
            let mut progressed = false;
            let mut pending = false;
            for q in 0..self.slots.len() {
                while cursor[q] < batches[q].len() {
                    let done = self.slots[q].signals.load(Ordering::SeqCst) - base[q];
                    if posted[q] - done >= window {
                        pending = true;
                        break;
                    }
                    let wrs: Vec<SendWr> = batches[q][cursor[q]].iter().map(|w| to_wr(q, w)).collect();
                    self.post(q, &wrs)?;
                    if q == 0 && cursor[0] == 0 {
                        match fault {
                            WriteFault::QpErrorMidChunk => self.slots[0].to_error(),
                            WriteFault::PauseMidChunk => std::thread::sleep(fault::PAUSE),
                            _ => {}
                        }
                    }
                    posted[q] += wrs.iter().filter(|w| w.signaled).count() as u64;
                    cursor[q] += 1;
                    progressed = true;
                }
            }
            if !pending {
                break;
            }
            if !progressed {
                self.wait(deadline, "waiting for send-queue space", |s, q| s.signals.load(Ordering::SeqCst) - base[q] + window > posted[q])?;
            }
        }
        self.wait(deadline, "waiting for the RDMA write completions", |s, q| s.signals.load(Ordering::SeqCst) - base[q] >= posted[q])?;
        if defer_imm {
            let w = *plan.per_qp[0].last().expect("QP 0 carries the imm");
            let wr = to_wr(0, &w);
            self.post(0, &[wr])?;
            posted[0] += 1;
            self.wait(deadline, "waiting for the write-with-immediate completion", |s, q| s.signals.load(Ordering::SeqCst) - base[q] >= posted[q])?;
        }
        Ok(())
    }

    fn post(&self, q: usize, wrs: &[SendWr]) -> Result<()> {
        let slot = &self.slots[q];
        slot.qp.lock().post_send(wrs).map_err(|e| {
            let desc = slot.desc.lock().clone();
            Error::new(Status::KVSTAGE_E_RDMA, format!("ibv_post_send of {} work requests on {desc} failed", wrs.len()))
                .with_source(e)
                .with_session(&self.session)
        })?;
        if let Some(newest) = wrs.iter().map(|w| w.wr_id).max() {
            slot.last_posted_wr.fetch_max(newest, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Waits until `done(slot, index)` holds for every slot, a completion failed, or the deadline.
    fn wait(&self, deadline: &Deadline, what: &str, done: impl Fn(&QpSlot, usize) -> bool) -> Result<()> {
        let mut failed = None;
        let ok = self.notify.wait_until(deadline, || {
            if let Some(e) = self.first_failure() {
                failed = Some(e);
                return true;
            }
            self.slots.iter().enumerate().all(|(q, s)| done(s, q))
        });
        if let Some(e) = failed {
            return Err(e);
        }
        if !ok {
            return Err(deadline.timeout_error(&format!("{what} on {}", self.desc)).with_session(&self.session));
        }
        Ok(())
    }
}

impl RdmaTransport {
    /// Writes the bytes at `src` to the range `header` (a `Message::Data`) names in the grant at
    /// `grant_offset` (with `imm`: its write-with-immediate last), then reports it by `Written`.
    fn write_reported(&self, grant_offset: u64, header: &Message, src: u64, imm: Option<u32>, deadline: &Deadline) -> Result<()> {
        let &Message::Data { room, chunk, writer, offset, len } = header else {
            return Err(Error::internal("an RDMA write needs a Data header"));
        };
        self.rdma_write(granted_at(grant_offset, offset)?, src, len as usize, imm, deadline)?;
        self.tcp.send(&Message::Written { room, chunk, writer, offset, len, imm: imm.unwrap_or(0) }, deadline)
    }

    /// `data`, checked to be the bytes `header` (a `Message::Data`) describes, as a NIC source.
    fn host_source(header: &Message, data: &[u8]) -> Result<u64> {
        match header {
            Message::Data { len, .. } if *len == data.len() as u64 => Ok(data.as_ptr() as u64),
            Message::Data { len, .. } => Err(Error::internal(format!("data header says {len} bytes, {} given", data.len()))),
            _ => Err(Error::internal("an RDMA write needs a Data header")),
        }
    }

    /// The immediate of a chunk's ready: its request id (the receiver waits for it before the ready).
    fn ready_imm(ready: &Message) -> Result<u32> {
        match ready {
            Message::ChunkReady { req, .. } => Ok(*req as u32),
            other => Err(Error::internal(format!("an RDMA chunk write ends with a ChunkReady, not {other:?}"))),
        }
    }
}

impl Transport for RdmaTransport {
    fn send(&self, msg: &Message, deadline: &Deadline) -> Result<()> {
        self.tcp.send(msg, deadline)
    }

    fn write_chunk(&self, _header: &Message, _data: &[u8], _ready: &Message, _deadline: &Deadline) -> Result<()> {
        Err(Error::internal("an RDMA write needs the grant's ring offset (write_chunk_at)"))
    }

    fn write_chunk_at(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        self.write_device(grant_offset, header, Self::host_source(header, data)?, Some(ready), deadline)
    }

    /// A plain RDMA WRITE of the piece, completed before its report: the receiver counts the
    /// piece's bytes only once the region's immediate arrived ([`finish_pieces`](Transport::finish_pieces)).
    fn write_piece(&self, grant_offset: u64, header: &Message, data: &[u8], deadline: &Deadline) -> Result<()> {
        self.write_device(grant_offset, header, Self::host_source(header, data)?, None, deadline)
    }

    /// Every piece's write completed (on every QP) before this returns from `write_piece`, so a
    /// zero-length WRITE_WITH_IMM posted now follows all of them: the ready stays bound to data.
    fn finish_pieces(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        let &Message::Data { offset, .. } = header else {
            return Err(Error::internal("finish_pieces needs a Data header"));
        };
        self.rdma_write(granted_at(grant_offset, offset)?, data.as_ptr() as u64, 0, Some(Self::ready_imm(ready)?), deadline)?;
        self.tcp.send(ready, deadline)
    }

    fn writes_device_memory(&self) -> bool {
        true
    }

    /// The NIC reads `src` (host memory here too: the host entry points above come through this).
    /// With `ready`, the imm is its request id, the receiver waits for it before the ready.
    fn write_device(&self, grant_offset: u64, header: &Message, src: u64, ready: Option<&Message>, deadline: &Deadline) -> Result<()> {
        let imm = ready.map(Self::ready_imm).transpose()?;
        self.write_reported(grant_offset, header, src, imm, deadline)?;
        match ready {
            Some(r) => self.tcp.send(r, deadline),
            None => Ok(()),
        }
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, SlicePayload<'_>)>, done: &Message, deadline: &Deadline) -> Result<()> {
        // The slice path stays on the control stream: thousands of tiny writes are what staging avoids.
        self.tcp.write_slices(ops, done, deadline)
    }

    fn shutdown(&self) {
        self.kill();
    }

    fn is_cut(&self) -> bool {
        self.dead.load(Ordering::SeqCst) || self.tcp.is_cut()
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        for s in &self.slots {
            s.to_error();
        }
    }
}

/// Where `offset` of a grant at `grant_offset` lies in the receiver's ring.
fn granted_at(grant_offset: u64, offset: u64) -> Result<u64> {
    grant_offset.checked_add(offset).ok_or_else(|| Error::new(Status::KVSTAGE_E_PROTOCOL, "granted offset overflows"))
}

/// The receiver side of one RDMA session: its QPs and the immediates that arrived.
pub struct RdmaPeer {
    pub slots: Vec<Arc<QpSlot>>,
    pub arrivals: Arc<Arrivals>,
    pub desc: String,
}

impl RdmaPeer {
    /// Waits until the WRITE_WITH_IMM carrying `imm` completed on one of the peer's QPs (so the
    /// chunk's bytes are in the ring), then forgets it.
    pub fn wait_imm(&self, imm: u32, timeout: Duration) -> Result<()> {
        let deadline = Deadline::after(Some(timeout));
        let start = Instant::now();
        let mut failure = None;
        let arrived = self.arrivals.notify.wait_until(&deadline, || {
            let mut s = self.arrivals.state.lock();
            if s.0.remove(&imm) {
                return true;
            }
            if let Some(why) = &s.1 {
                failure = Some((s.2, why.clone()));
                return true;
            }
            false
        });
        if let Some((code, why)) = failure {
            return Err(Error::new(code, format!("the RDMA write for request {imm} did not complete on {}: {why}", self.desc)));
        }
        if !arrived {
            return Err(Error::new(
                Status::KVSTAGE_E_PROTOCOL,
                format!(
                    "chunk ready for request {imm} but its write-with-immediate did not arrive on {} within {} ms",
                    self.desc,
                    start.elapsed().as_millis()
                ),
            ));
        }
        Ok(())
    }
}

impl Drop for RdmaPeer {
    fn drop(&mut self) {
        for s in &self.slots {
            s.to_error();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that completes writes-with-immediate without ever sending their readies cannot grow
    /// the set without bound: past the limit its session fails, and every wait says why.
    #[test]
    fn early_immediates_are_bounded() {
        let arrivals = Arc::new(Arrivals::default());
        for imm in 0..MAX_EARLY_IMMEDIATES as u32 {
            arrivals.arrive(imm);
        }
        arrivals.arrive(7); // a duplicate of one already held: no growth, still fine
        let peer = RdmaPeer { slots: Vec::new(), arrivals: arrivals.clone(), desc: "test".into() };
        peer.wait_imm(5, Duration::from_millis(10)).unwrap();
        arrivals.arrive(1 << 30);
        arrivals.arrive((1 << 30) + 1);
        let e = peer.wait_imm((1 << 30) + 5, Duration::from_millis(10)).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{}", e.chain());
        assert!(e.chain().contains("without their chunk readies"), "{}", e.chain());
        assert!(arrivals.state.lock().0.len() <= MAX_EARLY_IMMEDIATES);
    }
}
