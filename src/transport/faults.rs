//! A fault-injecting wrapper around a real transport, for tests only (enabled through
//! `EngineOptions::faults`, never by default): seeded drops, duplicates, reorders and delays of
//! control messages, corrupted or truncated data frames, a connection cut after a chosen number of
//! frames (a peer killed mid-chunk), and, on the receiving side, a reader that stops reading.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{SlicePayload, Transport};
use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::protocol::Message;

/// What to inject. Probabilities are per mille, per control message or per data frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub seed: u64,
    pub drop: u32,
    pub duplicate: u32,
    pub reorder: u32,
    pub delay: u32,
    pub max_delay_ms: u32,
    pub corrupt: u32,
    pub truncate: u32,
    /// Cut the connection (like a crashed peer) instead of writing frame number `n` (0-based).
    pub cut_at_frame: Option<u64>,
    /// Receiver only: stop reading after `n` frames (a stalled peer).
    pub stop_reading_after: Option<u64>,
    /// Sender only: hold the decode pool's mapping this long before each direct copy (a slow
    /// direct writer, still writing when its room is released).
    pub direct_pause_ms: u32,
    /// Receiver only: the shortest run of pool bytes (a decode page's rows, when they are whole
    /// token slots) for which a stream payload is read straight into the pool, in place of the
    /// engine's [`POOL_READ_MIN_RUN`](crate::session::receiver::POOL_READ_MIN_RUN): `Some(0)`
    /// reads every chunk without a checksum there, `Some(u64::MAX)` none (tests reach both paths
    /// on small shapes).
    pub pool_read_min_run: Option<u64>,
    /// Sender only: the shortest run of pool bytes for which a chunk goes out straight from the
    /// pool, in place of [`SEND_FROM_POOL_MIN_RUN`](crate::session::sender::SEND_FROM_POOL_MIN_RUN):
    /// `Some(0)` sends every plan that may from the pool (tests reach that path on small shapes).
    pub send_from_pool_min_run: Option<u64>,
}

/// How many faults of each kind were injected (shared by every wrapper built from one plan).
#[derive(Debug, Default)]
pub struct FaultCounters {
    pub dropped: AtomicU64,
    pub duplicated: AtomicU64,
    pub reordered: AtomicU64,
    pub delayed: AtomicU64,
    pub corrupted: AtomicU64,
    pub truncated: AtomicU64,
    pub cut: AtomicU64,
    pub stalled: AtomicU64,
}

impl FaultCounters {
    pub fn snapshot(&self) -> [(&'static str, u64); 8] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("dropped", g(&self.dropped)),
            ("duplicated", g(&self.duplicated)),
            ("reordered", g(&self.reordered)),
            ("delayed", g(&self.delayed)),
            ("corrupted", g(&self.corrupted)),
            ("truncated", g(&self.truncated)),
            ("cut", g(&self.cut)),
            ("stalled", g(&self.stalled)),
        ]
    }
}

/// The plan plus its counters, as carried by engine options.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub plan: FaultPlan,
    pub counters: Arc<FaultCounters>,
}

impl PartialEq for Faults {
    fn eq(&self, other: &Faults) -> bool {
        self.plan == other.plan
    }
}

struct State {
    rng: u64,
    frames: u64,
    held: Option<Message>,
}

pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    faults: Faults,
    state: Mutex<State>,
}

impl FaultyTransport {
    pub fn new(inner: Arc<dyn Transport>, faults: Faults, salt: u64) -> FaultyTransport {
        let rng = faults.plan.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        FaultyTransport { inner, faults, state: Mutex::new(State { rng, frames: 0, held: None }) }
    }

    /// Decides the fate of the next frame: `Err` when the connection is cut here.
    fn next_frame(&self) -> Result<Dice> {
        let mut st = self.state.lock();
        let frame = st.frames;
        st.frames += 1;
        if self.faults.plan.cut_at_frame == Some(frame) {
            self.faults.counters.cut.fetch_add(1, Ordering::Relaxed);
            self.inner.shutdown();
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("fault injection: connection cut at frame {frame}")));
        }
        let mut roll = || {
            st.rng ^= st.rng << 13;
            st.rng ^= st.rng >> 7;
            st.rng ^= st.rng << 17;
            st.rng
        };
        let p = &self.faults.plan;
        let hit = |per_mille: u32, r: u64| r % 1000 < per_mille as u64;
        let rolls = [roll(), roll(), roll(), roll(), roll(), roll(), roll()];
        Ok(Dice {
            drop: hit(p.drop, rolls[0]),
            duplicate: hit(p.duplicate, rolls[1]),
            reorder: hit(p.reorder, rolls[2]),
            delay: hit(p.delay, rolls[3]).then(|| Duration::from_millis(rolls[4] % (p.max_delay_ms as u64 + 1))),
            corrupt: hit(p.corrupt, rolls[5]),
            truncate: hit(p.truncate, rolls[6]),
            pick: roll(),
        })
    }

    /// A data frame's faults; `grant_offset` is forwarded to transports that need it (RDMA).
    /// One data write through `write` (a whole chunk or a piece), with this frame's faults.
    fn faulty_data(&self, data: &[u8], write: impl Fn(&[u8]) -> Result<()>) -> Result<()> {
        let f = self.next_frame()?;
        self.with_dice(&f, data, write)
    }

    /// `data` written through `write` with the faults `f` rolled for its frame.
    fn with_dice(&self, f: &Dice, data: &[u8], write: impl Fn(&[u8]) -> Result<()>) -> Result<()> {
        let c = &self.faults.counters;
        if f.truncate && !data.is_empty() {
            // The stream ends inside the payload, as when the sender dies mid-write.
            c.truncated.fetch_add(1, Ordering::Relaxed);
            let cut = (f.pick % data.len() as u64) as usize;
            let _ = write(&data[..cut]);
            self.inner.shutdown();
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "fault injection: data frame truncated, connection cut"));
        }
        if f.corrupt && !data.is_empty() {
            c.corrupted.fetch_add(1, Ordering::Relaxed);
            let mut bad = data.to_vec();
            let at = (f.pick % bad.len() as u64) as usize;
            bad[at] ^= 0x5a;
            return write(&bad);
        }
        write(data)
    }
}

/// One frame's dice.
struct Dice {
    drop: bool,
    duplicate: bool,
    reorder: bool,
    delay: Option<Duration>,
    corrupt: bool,
    truncate: bool,
    pick: u64,
}

impl Transport for FaultyTransport {
    fn send(&self, msg: &Message, deadline: &Deadline) -> Result<()> {
        let f = self.next_frame()?;
        let c = &self.faults.counters;
        if let Some(d) = f.delay {
            c.delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(d);
        }
        if f.drop {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let held = self.state.lock().held.take();
        if f.reorder && held.is_none() {
            // Sent after the next message (or never, if none follows: then it was a drop).
            c.reordered.fetch_add(1, Ordering::Relaxed);
            self.state.lock().held = Some(msg.clone());
            return Ok(());
        }
        self.inner.send(msg, deadline)?;
        if let Some(h) = held {
            self.inner.send(&h, deadline)?;
        }
        if f.duplicate {
            c.duplicated.fetch_add(1, Ordering::Relaxed);
            self.inner.send(msg, deadline)?;
        }
        Ok(())
    }

    fn write_chunk(&self, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        self.faulty_data(data, |d| self.inner.write_chunk(header, d, ready, deadline))
    }

    fn write_chunk_at(&self, grant_offset: u64, header: &Message, data: &[u8], ready: &Message, deadline: &Deadline) -> Result<()> {
        self.faulty_data(data, |d| self.inner.write_chunk_at(grant_offset, header, d, ready, deadline))
    }

    fn write_piece(&self, grant_offset: u64, header: &Message, data: &[u8], deadline: &Deadline) -> Result<()> {
        self.faulty_data(data, |d| self.inner.write_piece(grant_offset, header, d, deadline))
    }

    fn streams_from_memory(&self) -> bool {
        self.inner.streams_from_memory()
    }

    /// Straight through the inner transport's writer from memory, unless this frame's payload
    /// is to be corrupted or truncated: then its parts are gathered into one payload, which the
    /// faults treat as any other.
    fn write_piece_from(&self, header: &Message, parts: &mut dyn Iterator<Item = &[u8]>, deadline: &Deadline) -> Result<()> {
        let f = self.next_frame()?;
        if !f.truncate && !f.corrupt {
            return self.inner.write_piece_from(header, parts, deadline);
        }
        let data: Vec<u8> = parts.flatten().copied().collect();
        self.with_dice(&f, &data, |d| self.inner.write_piece(0, header, d, deadline))
    }

    /// Dropped or delayed like any frame, never reordered or duplicated (a broadcast's sender
    /// does not wait to send another).
    fn try_send(&self, msg: &Message) -> Result<bool> {
        let f = self.next_frame()?;
        let c = &self.faults.counters;
        if let Some(d) = f.delay {
            c.delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(d);
        }
        if f.drop {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(true);
        }
        self.inner.try_send(msg)
    }

    fn write_slices(&self, ops: &mut dyn Iterator<Item = (Message, SlicePayload<'_>)>, done: &Message, deadline: &Deadline) -> Result<()> {
        self.next_frame()?;
        self.inner.write_slices(ops, done, deadline)
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }

    fn is_cut(&self) -> bool {
        self.inner.is_cut()
    }

    fn stream_mark(&self) -> Option<u64> {
        self.inner.stream_mark()
    }

    fn acknowledged(&self, mark: u64) -> bool {
        self.inner.acknowledged(mark)
    }

    fn reset(&self) {
        self.inner.reset();
    }

    fn describe(&self) -> String {
        format!("{} (fault injection, seed {})", self.inner.describe(), self.faults.plan.seed)
    }
}
