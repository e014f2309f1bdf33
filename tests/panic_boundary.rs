//! The library's own threads survive a panic in one pass of their loop: the keeper still expires
//! rooms (and broadcasts watermarks), the accept loop still serves new sessions. Test builds only
//! (the panics are injected at named points: `kvstage::panics::arm`).

use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage_testkit::HostPool;

fn shape() -> PoolShape {
    PoolShape::new(ModelKind::Mha, 2, 64, 2, 16, 2)
}

fn decode_engine(room_timeout: Option<Duration>) -> (Engine, HostPool) {
    let decode = Engine::new(EngineOptions { room_timeout, ..EngineOptions::default() }).unwrap();
    let pool = HostPool::new(shape(), 16);
    decode.register_pool(pool.layout.clone()).unwrap();
    let chunk = staging_layout(&shape(), &shape(), 64).unwrap().total_bytes;
    decode.register_staging(None, 4 * chunk as usize).unwrap();
    (decode, pool)
}

/// The fault points are process-wide: one test at a time arms them.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Polls `f` up to `limit`.
fn settle(limit: Duration, f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + limit;
    while !f() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
fn the_keeper_still_expires_rooms_after_a_panic() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (decode, _pool) = decode_engine(Some(Duration::from_millis(300)));
    let rx = decode.receiver();
    kvstage::panics::arm("keeper");
    assert!(settle(Duration::from_secs(5), || rx.stats().panics >= 1), "the keeper never reached its fault point: {:?}", rx.stats());
    let (key, _) = rx.open_room(RoomOpening::new(1, &[0, 1, 2, 3], 64)).unwrap();
    let room = kvstage::protocol::RoomRef { id: 1, key };
    // Nobody sends: the room must expire by its 300 ms timeout, which only the keeper enforces.
    assert!(
        settle(Duration::from_secs(5), || rx.stats().rooms_expired >= 1),
        "the room did not expire after the keeper panicked once (the keeper thread is gone): {:?}",
        rx.stats()
    );
    let outcome = rx.wait_room(room, Some(Duration::from_secs(1)));
    assert_eq!(outcome.as_ref().map_err(|e| e.code()).err(), Some(kvstage::Status::KVSTAGE_E_TIMEOUT), "{outcome:?}");
    rx.release_room(room, None).unwrap();
}

#[test]
fn the_accept_loop_still_serves_sessions_after_a_panic() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (decode, _dpool) = decode_engine(None);
    let prefill = Engine::new(EngineOptions::default()).unwrap();
    let ppool = HostPool::new(shape(), 16);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let addr = decode.local_addr().to_string();
    kvstage::panics::arm("accept");
    // The connection accepted when the loop panicked goes with the panic.
    let first = prefill.connect(&addr, "accepted-in-the-panic", Some(Duration::from_secs(5)));
    assert!(first.is_err(), "the connection accepted by the panicking pass was served");
    assert!(settle(Duration::from_secs(5), || decode.receiver().stats().panics == 1), "{:?}", decode.receiver().stats());
    let second = prefill.connect(&addr, "after-the-panic", Some(Duration::from_secs(5)));
    assert!(second.is_ok(), "no session after the accept loop panicked once: {}", second.err().unwrap().chain());
}

/// A panic in the scatter thread's bookkeeping after a scatter (its room's chunk is lost with
/// it) leaves the thread serving the next room, whose bytes land.
#[test]
fn the_scatter_thread_goes_on_after_a_panic_in_its_bookkeeping() {
    use kvstage::protocol::RoomRef;
    use kvstage::session::op::Op;
    use kvstage::session::sender::TransferDesc;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (decode, dpool) = decode_engine(None);
    let rx = decode.receiver();
    let prefill = Engine::new(EngineOptions::default()).unwrap();
    let mut ppool = HostPool::new(shape(), 16);
    let src: Vec<u32> = (0..4).collect();
    ppool.fill(&src, 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    let s = prefill.connect(&decode.local_addr().to_string(), "scatter-panic", Some(Duration::from_secs(5))).unwrap();
    kvstage::panics::arm("scatter done");
    let mut last = RoomRef::default();
    for room in [1u64, 2] {
        let pages: Vec<u32> = (room as u32 * 4..room as u32 * 4 + 4).collect();
        let (key, _) = rx.open_room(RoomOpening::new(room, &pages, 64)).unwrap();
        last = RoomRef { id: room, key };
        let desc = TransferDesc { room: last, chunk: 0, pages: src.clone(), timeout: Some(Duration::from_secs(5)), ..Default::default() };
        assert_eq!(s.transfer(&desc, &Op::new(s.waker())).unwrap(), kvstage::Status::KVSTAGE_OK);
        if room == 1 {
            assert!(settle(Duration::from_secs(5), || rx.stats().panics == 1), "the bookkeeping never reached its fault point: {:?}", rx.stats());
        }
    }
    rx.wait_room(last, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("the room after the panic: {}", e.chain()));
    let (bad, first) = dpool.verify(&[8, 9, 10, 11], 0);
    assert_eq!(bad, 0, "{first:?}");
}
