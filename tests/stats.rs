//! Metrics over real loopback TCP engines: after a known sequence of transfers and failures the
//! engine and session counters are exact, and the phase timings are positive where the phase
//! happened, zero where it did not, and ordered (the total spans the phases).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::notify::{Completion, EventKind};
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage::session::stats::{SendStats, TransferTimings};
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::Status;
use kvstage_testkit::HostPool;

const PAGES: u64 = 16;
const CHUNK_PAGES: u32 = 4;

fn shape() -> PoolShape {
    // 4 heads × 64 × 2 bytes, K and V, 4 layers: 4 KiB per token, 256 KiB per 4-page chunk.
    PoolShape::new(ModelKind::Mha, 4, 64, 2, 16, 4)
}

fn tcp(faults: Option<Faults>) -> Engine {
    Engine::new(EngineOptions { transport: TransportKind::Tcp, faults, ..EngineOptions::default() }).unwrap()
}

/// A decode engine with a ring of `ring_chunks` chunks of `CHUNK_PAGES` pages.
fn decode(ring_chunks: u64, faults: Option<Faults>) -> (Engine, HostPool, u64) {
    let engine = tcp(faults);
    let pool = HostPool::new(shape(), PAGES);
    engine.register_pool(pool.layout.clone()).unwrap();
    let chunk = staging_layout(&shape(), &shape(), CHUNK_PAGES * 16).unwrap().total_bytes;
    engine.register_staging(None, (chunk * ring_chunks) as usize).unwrap();
    (engine, pool, chunk)
}

/// Opens `room` on `engine` over `pages` (one chunk); the room as its senders name it.
fn open(engine: &Engine, room: u64, pages: &[u32]) -> RoomRef {
    let (key, _) = engine.receiver().open_room(RoomOpening::new(room, pages, CHUNK_PAGES * 16)).unwrap();
    RoomRef { id: room, key }
}

/// A room that is not open (any key).
fn closed(room: u64) -> RoomRef {
    RoomRef { id: room, key: 1 }
}

fn desc(room: RoomRef, pages: &[u32], timeout_ms: u64) -> TransferDesc {
    TransferDesc { room, chunk: 0, pages: pages.to_vec(), timeout: Some(Duration::from_millis(timeout_ms)), ..Default::default() }
}

/// The phases of a staged transfer that reached its acknowledgement all happened.
fn assert_full(t: &TransferTimings, what: &str) {
    for (name, v) in [
        ("watermark_wait", t.watermark_wait_ns),
        ("alloc_wait", t.alloc_wait_ns),
        ("gather", t.gather_ns),
        ("wire", t.wire_ns),
        ("ack", t.ack_ns),
        ("total", t.total_ns),
    ] {
        assert!(v > 0, "{what}: {name} is 0 in {t:?}");
    }
    assert_ordered(t, what);
}

/// The phases run one after the other inside the total.
fn assert_ordered(t: &TransferTimings, what: &str) {
    let phases = t.queued_ns + t.watermark_wait_ns + t.alloc_wait_ns + t.gather_ns + t.wire_ns + t.ack_ns;
    assert!(t.total_ns >= phases, "{what}: total {} < sum of phases {phases} in {t:?}", t.total_ns);
}

/// `f()` once it is `Some`, polling for up to 10 s.
fn eventually<T>(f: impl Fn() -> Option<T>) -> Option<T> {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match f() {
            Some(v) => return Some(v),
            None if std::time::Instant::now() > end => return None,
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn counts(s: &SendStats) -> [u64; 10] {
    [
        s.bytes_sent,
        s.chunks_sent,
        s.transfers_ok,
        s.transfers_fallback,
        s.transfers_timeout,
        s.transfers_canceled,
        s.transfers_peer_gone,
        s.transfers_failed_other,
        s.in_flight,
        s.timed_transfers,
    ]
}

#[test]
fn counters_and_timings_match_a_known_sequence() {
    let (healthy, hpool, chunk) = decode(2, None);
    let ring = chunk * 2;
    // Stops reading at the chunk's ready frame (frames: alloc 1, data 2, ready 3): the data is
    // written, the acknowledgement never comes, the transfer times out.
    let stuck_faults = Faults { plan: FaultPlan { stop_reading_after: Some(2), ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) };
    let (stuck, _spool, _) = decode(2, Some(stuck_faults));
    let (doomed, _dpool, _) = decode(2, None);

    // Gathering into staging buffers, so that every phase happens (`a_chunk_from_the_pool_has_no_staging_phases`).
    let prefill = Engine::new(EngineOptions { transport: TransportKind::Tcp, send_from_pool: false, ..EngineOptions::default() }).unwrap();
    let mut ppool = HostPool::new(shape(), PAGES);
    let all: Vec<u32> = (0..PAGES as u32).collect();
    ppool.fill(&all, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let completions: Arc<Mutex<Vec<Completion>>> = Arc::default();
    let seen = completions.clone();
    prefill.completions().set_callback(Some(Arc::new(move |c: &Completion| seen.lock().push(c.clone()))));
    let chunk_events: Arc<Mutex<Vec<Completion>>> = Arc::default();
    let seen = chunk_events.clone();
    healthy.completions().set_callback(Some(Arc::new(move |c: &Completion| seen.lock().push(c.clone()))));

    let to_healthy = prefill.connect(&healthy.local_addr().to_string(), "healthy", None).unwrap();
    let to_stuck = prefill.connect(&stuck.local_addr().to_string(), "stuck", None).unwrap();
    let to_doomed = prefill.connect(&doomed.local_addr().to_string(), "doomed", None).unwrap();
    let pages: Vec<u32> = (0..CHUNK_PAGES).collect();

    let fresh = prefill.stats();
    assert_eq!(counts(&fresh.send), [0; 10]);
    assert_eq!(fresh.send.sum, TransferTimings::default());
    for s in [&to_healthy, &to_stuck, &to_doomed] {
        let st = s.stats();
        assert!(st.link == kvstage::session::stats::LinkKind::Tcp && !st.downgraded, "transport tcp: neither another link nor downgraded");
    }

    // 1. Three synchronous transfers, each verified on the decode side.
    for room in 1..=3u64 {
        let at = open(&healthy, room, &pages);
        let (r, t) = to_healthy.transfer_timed(&desc(at, &pages, 10_000), &Op::new(to_healthy.waker()));
        assert_eq!(r.unwrap(), Status::KVSTAGE_OK);
        assert_full(&t, &format!("room {room}"));
        assert_eq!(t.queued_ns, 0, "a synchronous transfer is never queued");
        healthy.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(hpool.verify(&pages, 0).0, 0);
        healthy.receiver().release_room(at, None).unwrap();
    }

    // 2. One asynchronous transfer: queued first, the same timings in its completion.
    let at = open(&healthy, 4, &pages);
    let op = to_healthy.transfer_async(desc(at, &pages, 10_000), false, 44).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap(), Status::KVSTAGE_OK);
    let t = op.timings().expect("finished");
    assert_full(&t, "async");
    assert!(t.queued_ns > 0, "{t:?}");
    // The callback runs right after the waiters wake.
    let signalled = eventually(|| {
        completions.lock().iter().find_map(|c| match c {
            Completion::Op { tag: 44, status, timings, .. } => Some((*status, *timings)),
            _ => None,
        })
    });
    assert_eq!(signalled, Some((Status::KVSTAGE_OK, t)), "the completion carries the operation's timings");
    healthy.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    healthy.receiver().release_room(at, None).unwrap();

    // 3. A fallback: a 12-page chunk does not fit the 2-chunk ring. Nothing but the total.
    let big: Vec<u32> = (0..12).collect();
    let (r, t) = to_healthy.transfer_timed(&desc(closed(5), &big, 10_000), &Op::new(to_healthy.waker()));
    assert_eq!(r.unwrap(), Status::KVSTAGE_FALLBACK);
    assert!(t.total_ns > 0);
    assert_eq!(TransferTimings { total_ns: 0, ..t }, TransferTimings::default(), "a fallback has no phases: {t:?}");

    // 4. Stale: the room is not open on the receiver; refused at the allocation.
    let (r, t) = to_healthy.transfer_timed(&desc(closed(6), &pages, 10_000), &Op::new(to_healthy.waker()));
    assert_eq!(r.unwrap_err().code(), Status::KVSTAGE_E_STALE_ROOM);
    assert!(t.watermark_wait_ns > 0 && t.total_ns > 0, "{t:?}");
    assert_eq!((t.alloc_wait_ns, t.gather_ns, t.wire_ns, t.ack_ns), (0, 0, 0, 0), "{t:?}");
    assert_ordered(&t, "canceled");

    // A bad argument (a page outside the pool) fails before the transfer starts: zero timings,
    // nothing counted (the counters below stay exact), no operation.
    let outside = [PAGES as u32];
    let (r, t) = to_healthy.transfer_timed(&desc(closed(6), &outside, 10_000), &Op::new(to_healthy.waker()));
    assert_eq!(r.unwrap_err().code(), Status::KVSTAGE_E_INVALID_ARG);
    assert_eq!(t, TransferTimings::ZERO);
    let (r, t) = to_healthy.transfer_slices_timed(&desc(closed(6), &outside, 10_000), &Op::new(to_healthy.waker()));
    assert_eq!(r.unwrap_err().code(), Status::KVSTAGE_E_INVALID_ARG);
    assert_eq!(t, TransferTimings::ZERO);
    let submitted = to_healthy.transfer_async(desc(closed(6), &outside, 10_000), false, 66);
    assert_eq!(submitted.err().map(|e| e.code()), Some(Status::KVSTAGE_E_INVALID_ARG));
    assert_eq!(to_healthy.stats().send.in_flight, 0);

    // 5. Timeout: the stuck peer takes the data but never acknowledges it. In flight meanwhile.
    let at = open(&stuck, 7, &pages);
    // The deadline leaves the in-flight checks seconds to run before the operation can end.
    let op = to_stuck.transfer_async(desc(at, &pages, 3_000), false, 77).unwrap();
    assert_eq!(to_stuck.stats().send.in_flight, 1);
    assert_eq!(prefill.stats().send.in_flight, 1);
    let e = op.wait(Some(Duration::from_secs(20))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT);
    assert!(e.chain().contains("waiting for the arrival acknowledgement"), "it timed out in the ack wait: {}", e.chain());
    let t = op.timings().expect("finished");
    assert!(t.wire_ns > 0 && t.ack_ns > 0 && t.gather_ns > 0, "the write went out, the ack never came: {t:?}");
    assert_ordered(&t, "timeout");

    // 6. Peer gone: the decode engine of the third session is freed.
    drop(doomed);
    let (r, t) = to_doomed.transfer_timed(&desc(closed(8), &pages, 10_000), &Op::new(to_doomed.waker()));
    assert_eq!(r.unwrap_err().code(), Status::KVSTAGE_E_PEER_GONE);
    assert!(t.total_ns > 0);
    assert_ordered(&t, "peer gone");

    // Session counters: exact.
    //            bytes     chunks ok fb to ca pg other in_flight timed
    assert_eq!(counts(&to_healthy.stats().send), [4 * chunk, 4, 4, 1, 0, 1, 0, 0, 0, 6]);
    assert_eq!(counts(&to_stuck.stats().send), [chunk, 1, 0, 0, 1, 0, 0, 0, 0, 1]);
    assert_eq!(counts(&to_doomed.stats().send), [0, 0, 0, 0, 0, 0, 1, 0, 0, 1]);
    assert_eq!(to_healthy.stats().send.transfers_failed(), 1);

    // Engine counters: every session together, the freed one included.
    drop(to_doomed);
    let e = prefill.stats();
    assert_eq!(counts(&e.send), [5 * chunk, 5, 4, 1, 1, 1, 1, 0, 0, 8]);
    assert_eq!(e.send.transfers_failed(), 3);
    let sum = e.send.sum;
    assert!(sum.watermark_wait_ns > 0 && sum.alloc_wait_ns > 0 && sum.gather_ns > 0 && sum.wire_ns > 0 && sum.ack_ns > 0 && sum.queued_ns > 0);
    assert_ordered(&sum, "engine sums");
    assert_eq!(e.receive, Default::default(), "the prefill engine received nothing");

    // The decode side: four chunks arrived and were scattered, each timed.
    let d = healthy.stats();
    assert_eq!((d.receive.bytes_received, d.receive.chunks_received, d.receive.scatter_count), (4 * chunk, 4, 4));
    assert!(d.receive.scatter_ns_max > 0 && d.receive.scatter_ns_sum >= d.receive.scatter_ns_max, "{:?}", d.receive);
    assert!(d.receive.ring_high_water >= chunk && d.receive.ring_high_water <= ring, "{:?}", d.receive);
    assert_eq!((d.ring_capacity, d.ring_used_bytes, d.ring_live_allocations), (ring, 0, 0));
    assert_eq!(counts(&d.send), [0; 10], "the decode engine sent nothing");
    let scattered: Vec<u64> = eventually(|| {
        let ns: Vec<u64> = chunk_events
            .lock()
            .iter()
            .filter_map(|c| match c {
                Completion::Chunk(e) if e.kind == EventKind::Chunk && e.status == Status::KVSTAGE_OK => Some(e.scatter_ns),
                _ => None,
            })
            .collect();
        (ns.len() == 4).then_some(ns)
    })
    .expect("four chunk completions");
    assert!(scattered.iter().all(|&ns| ns > 0 && ns <= d.receive.scatter_ns_max), "{scattered:?}");
    assert_eq!(scattered.iter().sum::<u64>(), d.receive.scatter_ns_sum);
    // After each room's chunk, the whole room's event: one per room, untimed.
    // (The last one's callback may still be on its way.)
    let room_events = || -> Vec<(u64, u32, Status, u64)> {
        chunk_events
            .lock()
            .iter()
            .filter_map(|c| match c {
                Completion::Chunk(e) if e.kind == EventKind::Room => Some((e.room, e.chunk, e.status, e.scatter_ns)),
                _ => None,
            })
            .collect()
    };
    let rooms = eventually(|| Some(room_events()).filter(|r| r.len() >= 4)).unwrap_or_else(room_events);
    assert_eq!(rooms, (1..=4).map(|r| (r, 1, Status::KVSTAGE_OK, 0)).collect::<Vec<_>>());
}

/// Over TCP from a host pool (the default) a chunk takes no staging buffer: no wait for one, and
/// the gather phase is the checksum's (every chunk checksummed here); the bytes land exact.
#[test]
fn a_chunk_from_the_pool_has_no_staging_phases() {
    let (dec, dpool, _) = decode(2, None);
    let prefill = Engine::new(EngineOptions { transport: TransportKind::Tcp, integrity: kvstage::engine::Integrity::Always, ..EngineOptions::default() }).unwrap();
    let mut ppool = HostPool::new(shape(), PAGES);
    let pages: Vec<u32> = (0..CHUNK_PAGES).collect();
    ppool.fill(&pages, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let s = prefill.connect(&dec.local_addr().to_string(), "from-pool", None).unwrap();
    let at = open(&dec, 1, &pages);
    let (r, t) = s.transfer_timed(&desc(at, &pages, 10_000), &Op::new(s.waker()));
    assert_eq!(r.unwrap(), Status::KVSTAGE_OK);
    dec.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(dpool.verify(&pages, 0).0, 0);
    assert_eq!(t.alloc_wait_ns, 0, "no staging buffer: {t:?}");
    assert!(t.watermark_wait_ns > 0 && t.gather_ns > 0 && t.wire_ns > 0 && t.ack_ns > 0, "{t:?}");
    assert_ordered(&t, "from the pool");
}

/// The slice path is counted too: its payload bytes, one chunk, wire and acknowledgement only.
#[test]
fn the_slice_path_is_counted() {
    let (dec, dpool, chunk) = decode(2, None);
    let prefill = tcp(None);
    let mut ppool = HostPool::new(shape(), PAGES);
    let pages: Vec<u32> = (0..CHUNK_PAGES).collect();
    ppool.fill(&pages, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let s = prefill.connect(&dec.local_addr().to_string(), "slices", None).unwrap();
    let at = open(&dec, 1, &pages);
    let (r, t) = s.transfer_slices_timed(&desc(at, &pages, 10_000), &Op::new(s.waker()));
    assert_eq!(r.unwrap(), Status::KVSTAGE_OK);
    dec.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(dpool.verify(&pages, 0).0, 0);
    assert!(t.wire_ns > 0 && t.ack_ns > 0, "{t:?}");
    assert_eq!((t.watermark_wait_ns, t.alloc_wait_ns, t.gather_ns, t.queued_ns), (0, 0, 0, 0));
    assert_ordered(&t, "slices");
    // Every token's K and V rows of every layer: as many bytes as the staged chunk.
    let payload = u64::from(CHUNK_PAGES) * 16 * shape().token_bytes() * 4 * 2;
    assert_eq!(payload, chunk);
    assert_eq!(counts(&s.stats().send), [payload, 1, 1, 0, 0, 0, 0, 0, 0, 1]);
    let d = dec.stats().receive;
    assert_eq!((d.bytes_received, d.chunks_received, d.scatter_count, d.ring_high_water), (payload, 1, 0, 0));
    // The room released, its opening is stale: refused before a byte is sent, as on the staged path.
    dec.receiver().release_room(at, None).unwrap();
    let (r, t) = s.transfer_slices_timed(&desc(at, &pages, 10_000), &Op::new(s.waker()));
    assert_eq!(r.unwrap_err().code(), Status::KVSTAGE_E_STALE_ROOM);
    assert_eq!(t.wire_ns, 0, "the slices went out to a stale room: {t:?}");
    assert_eq!(s.stats().send.bytes_sent, payload);
    assert_eq!(dec.stats().receive.bytes_received, payload);
}
