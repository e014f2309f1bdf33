//! Integrity checksums and the cluster token, over real loopback TCP between two engines.

use std::sync::Arc;
use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions, Integrity, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::notify::EventKind;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::Status;

fn shape(rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 2).with_tp(rank, tp)
}

struct Pair {
    decode: Engine,
    dpool: HostPool,
    prefill: Engine,
    ppool: HostPool,
    /// Room 1 as the sender names it (opened by [`pair`]).
    room: RoomRef,
}

fn pair(decode_opts: EngineOptions, prefill_opts: EngineOptions) -> Pair {
    let decode = Engine::new(decode_opts).unwrap();
    let dpool = HostPool::new(shape(0, 1), 8);
    decode.register_pool(dpool.layout.clone()).unwrap();
    let bytes = staging_layout(&shape(0, 1), &dpool.layout.shape, 16).unwrap().total_bytes;
    decode.register_staging(None, bytes as usize * 2).unwrap();
    let (key, _) = decode.receiver().open_room(RoomOpening::new(1, &[0, 1, 2, 3], 16)).unwrap();
    let prefill = Engine::new(prefill_opts).unwrap();
    let mut ppool = HostPool::new(shape(0, 1), 8);
    ppool.fill(&[4, 5, 6, 7], 0);
    prefill.register_pool(ppool.layout.clone()).unwrap();
    Pair { decode, dpool, prefill, ppool, room: RoomRef { id: 1, key } }
}

fn opts(integrity: Integrity, token: Option<&str>, faults: Option<Faults>) -> EngineOptions {
    EngineOptions {
        integrity,
        cluster_token: token.map(str::to_owned),
        faults,
        default_deadline: Some(Duration::from_secs(5)),
        // The injected faults corrupt TCP payloads: the same-host path has none.
        transport: TransportKind::Tcp,
        ..EngineOptions::default()
    }
}

#[test]
fn corrupted_chunk_is_an_integrity_error_with_both_checksums() {
    let faults = Faults { plan: FaultPlan { seed: 3, corrupt: 1000, ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) };
    let p = pair(opts(Integrity::Off, None, None), opts(Integrity::Always, None, Some(faults.clone())));
    let s = p.prefill.connect(&p.decode.local_addr().to_string(), "integrity-1", None).unwrap();
    let desc = TransferDesc { room: p.room, chunk: 0, pages: vec![4, 5, 6, 7], timeout: Some(Duration::from_secs(5)), ..Default::default() };
    let e = s.transfer(&desc, &Op::new(s.waker())).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_INTEGRITY, "{}", e.chain());
    assert_eq!(e.session(), Some("integrity-1"));
    let chain = e.chain();
    assert!(chain.contains("room 1 chunk 0") && chain.matches("0x").count() >= 2, "{chain}");
    // The decode side never reports the corrupted room as complete, and frees its ring space.
    let room = p.decode.receiver().wait_room(p.room, Some(Duration::from_secs(2))).unwrap_err();
    assert_eq!(room.code(), Status::KVSTAGE_E_INTEGRITY);
    assert_eq!(room.session(), Some("integrity-1"));
    // Its events: the failed chunk's, then the whole room's once, both with the failure.
    let events: Vec<_> = p.decode.receiver().take_events(Some(p.room), 16).iter().map(|e| (e.kind, e.chunk, e.status)).collect();
    assert_eq!(events, [(EventKind::Chunk, 0, Status::KVSTAGE_E_INTEGRITY), (EventKind::Room, 1, Status::KVSTAGE_E_INTEGRITY)]);
    assert!(p.decode.receiver().take_events(None, 16).is_empty());
    assert_eq!(p.decode.receiver().ring_stats().1, 0);
    assert!(faults.counters.corrupted.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn without_checksums_the_same_corruption_goes_unnoticed() {
    // The control case: the checksum, not something else, rejected the corrupted chunk above.
    let faults = Faults { plan: FaultPlan { seed: 3, corrupt: 1000, ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) };
    let p = pair(opts(Integrity::Off, None, None), opts(Integrity::Off, None, Some(faults)));
    let s = p.prefill.connect(&p.decode.local_addr().to_string(), "integrity-2", None).unwrap();
    let desc = TransferDesc { room: p.room, chunk: 0, pages: vec![4, 5, 6, 7], timeout: Some(Duration::from_secs(5)), ..Default::default() };
    assert_eq!(s.transfer(&desc, &Op::new(s.waker())).unwrap(), Status::KVSTAGE_OK);
    p.decode.receiver().wait_room(p.room, Some(Duration::from_secs(2))).unwrap();
    // The decode side saw a whole room: its chunk's event, then the room's, once.
    let events: Vec<_> = p.decode.receiver().take_events(None, 16).iter().map(|e| (e.kind, e.room, e.key, e.chunk, e.status)).collect();
    let (id, key) = (p.room.id, p.room.key);
    assert_eq!(events, [(EventKind::Chunk, id, key, 0, Status::KVSTAGE_OK), (EventKind::Room, id, key, 1, Status::KVSTAGE_OK)]);
    let (bad, _) = p.dpool.verify(&[0, 1, 2, 3], 0);
    assert!(bad > 0, "the fault injector did not corrupt anything");
    let (clean, _) = p.ppool.verify(&[4, 5, 6, 7], 0);
    assert_eq!(clean, 0);
}

#[test]
fn cluster_token_must_match_on_both_sides() {
    for (decode_token, prefill_token) in [(Some("alpha"), Some("beta")), (Some("alpha"), None), (None, Some("alpha"))] {
        let p = pair(opts(Integrity::Off, decode_token, None), opts(Integrity::Off, prefill_token, None));
        let Err(e) = p.prefill.connect(&p.decode.local_addr().to_string(), "auth-1", None) else {
            panic!("{decode_token:?}/{prefill_token:?}: connected without a matching token");
        };
        assert_eq!(e.code(), Status::KVSTAGE_E_AUTH, "{:?}/{:?}: {}", decode_token, prefill_token, e.chain());
        assert_eq!(e.session(), Some("auth-1"));
    }
    let p = pair(opts(Integrity::Always, Some("alpha"), None), opts(Integrity::Always, Some("alpha"), None));
    let s = p.prefill.connect(&p.decode.local_addr().to_string(), "auth-2", None).unwrap();
    let desc = TransferDesc { room: p.room, chunk: 0, pages: vec![4, 5, 6, 7], timeout: Some(Duration::from_secs(5)), ..Default::default() };
    assert_eq!(s.transfer(&desc, &Op::new(s.waker())).unwrap(), Status::KVSTAGE_OK);
}

#[test]
fn sampled_integrity_covers_about_one_chunk_in_sixteen() {
    let covered = (0..64u64).flat_map(|room| (0..64u32).map(move |c| (room, c))).filter(|&(r, c)| Integrity::Sampled.covers(r, c)).count();
    assert!((64 * 64 / 16 / 2..64 * 64 / 16 * 2).contains(&covered), "{covered}");
    assert!((0..10).all(|c| Integrity::Always.covers(3, c) && !Integrity::Off.covers(3, c)));
}
