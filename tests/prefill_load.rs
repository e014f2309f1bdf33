//! The prefill side at load, over real loopback TCP: a stuck decode peer costs only its own
//! sessions, hundreds of asynchronous operations run on a fixed set of threads, and every
//! operation reaches a terminal state by its deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions};
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::Status;

mod common;

use common::thread_count as threads;

struct Decode {
    engine: Engine,
    pool: HostPool,
}

fn decode(shape: &PoolShape, pages: u64, ring_chunks: u64, chunk_tokens: u32, faults: Option<Faults>) -> Decode {
    let engine = Engine::new(EngineOptions { faults, ..EngineOptions::default() }).unwrap();
    let pool = HostPool::new(shape.clone(), pages);
    engine.register_pool(pool.layout.clone()).unwrap();
    let chunk = staging_layout(shape, shape, chunk_tokens).unwrap().total_bytes;
    engine.register_staging(None, (chunk * ring_chunks) as usize).unwrap();
    Decode { engine, pool }
}

/// A decode engine that stops reading after its first frames: transfers to it fail by their
/// deadline (plus the documented slack), and transfers of the same prefill engine to a healthy
/// decode engine in the same period all succeed with verified bytes.
/// The thread-count test counts the whole process: the other test's engines must not start or
/// stop threads meanwhile, so the tests of this file run one at a time.
static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

#[test]
fn a_stuck_decode_peer_costs_only_its_own_sessions() {
    let _alone = ONE_AT_A_TIME.lock();
    // 32 KiB per token: a 64-page chunk is 32 MiB, more than the socket buffers can swallow.
    let shape = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 8);
    let chunk_tokens = 64 * 16;
    let pages: Vec<u32> = (0..64).collect();
    let stuck_faults = Faults { plan: FaultPlan { stop_reading_after: Some(2), ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) };
    let healthy = decode(&shape, 64, 2, chunk_tokens, None);
    let stuck = decode(&shape, 64, 2, chunk_tokens, Some(stuck_faults.clone()));
    let prefill = Engine::new(EngineOptions::default()).unwrap();
    let mut ppool = HostPool::new(shape.clone(), 64);
    ppool.fill(&pages, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let to_healthy = prefill.connect(&healthy.engine.local_addr().to_string(), "healthy", None).unwrap();
    let to_stuck = prefill.connect(&stuck.engine.local_addr().to_string(), "stuck", None).unwrap();

    let room = common::open_room(&stuck.engine, 1, &pages, chunk_tokens);
    let deadline = Duration::from_secs(2);
    let started = Instant::now();
    let stuck_op = to_stuck
        .transfer_async(TransferDesc { room, chunk: 0, pages: pages.clone(), timeout: Some(deadline), ..Default::default() }, false, 1)
        .unwrap();
    let watcher = {
        let op = stuck_op.clone();
        std::thread::spawn(move || {
            let r = op.wait(Some(Duration::from_secs(30)));
            (r.map_err(|e| e.chain()).err(), op.poll().err().map(|e| e.code()), started.elapsed())
        })
    };
    // Meanwhile: room after room to the healthy peer, each verified.
    let mut healthy_rooms = 0;
    while started.elapsed() < deadline + Duration::from_millis(500) || healthy_rooms < 3 {
        let room = 100 + healthy_rooms;
        let at = common::open_room(&healthy.engine, room, &pages, chunk_tokens);
        let desc = TransferDesc { room: at, chunk: 0, pages: pages.clone(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
        let status = to_healthy.transfer(&desc, &Op::new(to_healthy.waker())).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
        assert_eq!(status, Status::KVSTAGE_OK);
        healthy.engine.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
        let (bad, first) = healthy.pool.verify(&pages, 0);
        assert_eq!(bad, 0, "room {room}: {first:?}");
        healthy.engine.receiver().release_room(at, None).unwrap();
        healthy_rooms += 1;
        assert!(healthy_rooms < 1000, "bounded");
    }
    let (chain, code, took) = watcher.join().unwrap();
    let chain = chain.expect("a transfer to a peer that stopped reading cannot succeed");
    assert_eq!(code, Some(Status::KVSTAGE_E_TIMEOUT), "{chain}");
    // The deadline holds: a write re-arms its timeout every 10 ms, the abort takes at most 1 s.
    assert!(took < deadline + Duration::from_millis(1500), "the stuck transfer ended after {took:?}");
    assert!(stuck_faults.counters.stalled.load(std::sync::atomic::Ordering::Relaxed) > 0);
    eprintln!("stuck peer: failed after {took:?}; {healthy_rooms} verified rooms to the healthy peer meanwhile");
}

/// Hundreds of asynchronous operations over several sessions: the library's thread count stays
/// flat, every operation ends, every room verifies, and each end is signalled once.
#[test]
fn hundreds_of_async_operations_run_on_a_fixed_set_of_threads() {
    let _alone = ONE_AT_A_TIME.lock();
    let shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 2);
    let pages: Vec<u32> = (0..4).collect();
    let decodes: Vec<Decode> = (0..2).map(|_| decode(&shape, 8, 8, 16, None)).collect();
    let prefill = Engine::new(EngineOptions::default()).unwrap();
    let mut ppool = HostPool::new(shape.clone(), 8);
    ppool.fill(&pages, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let sessions: Vec<_> = decodes
        .iter()
        .enumerate()
        .flat_map(|(d, dec)| (0..2).map(move |i| (d, i)).map(|(d, i)| (d, dec.engine.local_addr().to_string(), format!("s{d}-{i}"))))
        .map(|(d, addr, id)| (d, prefill.connect(&addr, &id, None).unwrap()))
        .collect();
    const OPS: u64 = 400;
    let opened: Vec<_> = (0..OPS).map(|room| common::open_room(&decodes[(room % 2) as usize].engine, room, &pages, 16)).collect();
    let before = threads();
    let mut ops = Vec::new();
    let mut most = before;
    for room in 0..OPS {
        // Sessions 0,1 go to decode 0 and 2,3 to decode 1: room parity picks the decode engine.
        let (d, s) = &sessions[((room % 2) * 2 + (room / 2) % 2) as usize];
        assert_eq!(*d as u64, room % 2);
        let desc = TransferDesc { room: opened[room as usize], chunk: 0, pages: pages.clone(), timeout: Some(Duration::from_secs(60)), ..Default::default() };
        ops.push(s.transfer_async(desc, false, room).unwrap());
        most = most.max(threads());
    }
    for (room, op) in ops.iter().enumerate() {
        most = most.max(threads());
        match op.wait(Some(Duration::from_secs(60))) {
            Ok(status) => assert_eq!(status, Status::KVSTAGE_OK, "room {room}"),
            Err(e) => panic!("room {room}: {}", e.chain()),
        }
    }
    for room in 0..OPS {
        let d = &decodes[(room % 2) as usize];
        d.engine.receiver().wait_room(opened[room as usize], Some(Duration::from_secs(10))).unwrap();
        let (bad, first) = d.pool.verify(&pages, 0);
        assert_eq!(bad, 0, "room {room}: {first:?}");
        d.engine.receiver().release_room(opened[room as usize], None).unwrap();
    }
    let after = threads();
    eprintln!("threads: {before} before, at most {most} with {OPS} operations in flight, {after} after");
    assert!(most <= before + 2, "library threads grew with the operations in flight: {before} -> {most}");
    assert!(after <= before, "threads left behind: {before} -> {after}");
    assert_eq!(prefill.completions().drain(), OPS, "each operation's end is signalled once");
    assert!(ops.iter().all(|o| o.poll().is_ok()));
}

/// One transfer per (room, chunk) at a time on a session: the receiver knows a writer's chunk by
/// (connection, room, chunk), so a second one's abort would end the first one's quarantine while
/// it may still write in place. The second is refused at once; once the first ended, it may run.
#[test]
fn a_chunk_runs_once_at_a_time_per_session() {
    let _alone = ONE_AT_A_TIME.lock();
    let shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 2);
    let pages: Vec<u32> = (0..4).collect();
    let stuck_faults = Faults { plan: FaultPlan { stop_reading_after: Some(2), ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) };
    let stuck = decode(&shape, 8, 2, 16, Some(stuck_faults.clone()));
    let room = common::open_room(&stuck.engine, 1, &pages, 16);
    let prefill = Engine::new(EngineOptions::default()).unwrap();
    let mut ppool = HostPool::new(shape.clone(), 8);
    ppool.fill(&pages, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let s = prefill.connect(&stuck.engine.local_addr().to_string(), "twice", None).unwrap();
    let desc = |timeout| TransferDesc { room, chunk: 0, pages: pages.clone(), timeout: Some(timeout), ..Default::default() };
    let first = s.transfer_async(desc(Duration::from_secs(2)), false, 1).unwrap();
    // The decode peer stops reading at the first's allocation request: from then on the first
    // runs (it claimed the chunk before asking).
    let ran = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(5));
        stuck_faults.counters.stalled.load(std::sync::atomic::Ordering::Relaxed) > 0
    });
    assert!(ran, "the first transfer never reached the decode peer");
    let refused = s.transfer(&desc(Duration::from_millis(50)), &Op::new(s.waker())).unwrap_err();
    assert_eq!(refused.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", refused.chain());
    assert!(refused.message().contains("room 1 chunk 0 is already being sent on this session"), "{}", refused.chain());
    assert_eq!(first.wait(Some(Duration::from_secs(30))).unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT);
    // The first ended: the chunk may be sent again (the stuck peer times it out, but not refused).
    let again = s.transfer(&desc(Duration::from_millis(200)), &Op::new(s.waker())).unwrap_err();
    assert_ne!(again.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", again.chain());
}
