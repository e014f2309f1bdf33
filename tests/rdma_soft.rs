//! The RDMA session path end to end on the in-process soft fabric (two engines, one process):
//! attribute exchange, QP transitions, WR splitting and striping, the CQ thread, the immediate
//! gating `ChunkReady`, downgrade and error reporting. Plus what this host says without a device.
//! The soft fabric is in test builds of the library only: this test needs the feature `testing`
//! (`cargo test --features testing`; the dev preset's `cargo_test` ctest has it).

use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions, Integrity, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage::transport::rdma::{parse_devices, RdmaOptions};
use kvstage::Status;
use kvstage_testkit::HostPool;

fn shape(rank: u32, tp: u32) -> PoolShape {
    // 8 heads of 64, bf16, pages of 16, 4 layers: 16 KiB per token slot row set, ~64 KiB per chunk share.
    PoolShape::new(ModelKind::Mha, 8, 64, 2, 16, 4).with_tp(rank, tp)
}

fn opts(transport: TransportKind, devices: &str, qps: u32) -> EngineOptions {
    EngineOptions {
        transport,
        integrity: Integrity::Always,
        default_deadline: Some(Duration::from_secs(10)),
        rdma: RdmaOptions {
            devices: parse_devices(devices).unwrap(),
            qps_per_device: qps,
            wr_bytes: 4096,
            signal_every: 3,
            ..RdmaOptions::default()
        },
        // Both engines share this host: auto would take the same-host path before RDMA.
        same_host: false,
        ..EngineOptions::default()
    }
}

/// The injected faults are process-wide: one test of this file at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Pair {
    decode: Engine,
    dpool: HostPool,
    prefill: Vec<(Engine, HostPool)>,
}

const PAGES: u32 = 8;

/// Decode TP 1 (one rank) fed by `prefill_tp` prefill ranks.
fn pair(decode: EngineOptions, prefill: EngineOptions, prefill_tp: u32) -> Pair {
    let d = Engine::new(decode).unwrap();
    let dpool = HostPool::new(shape(0, 1), 16);
    d.register_pool(dpool.layout.clone()).unwrap();
    let bytes = staging_layout(&shape(0, prefill_tp), &dpool.layout.shape, PAGES * 16).unwrap().total_bytes;
    d.register_staging(None, bytes as usize * 2).unwrap();
    let prefill = (0..prefill_tp)
        .map(|r| {
            let e = Engine::new(prefill.clone()).unwrap();
            let mut p = HostPool::new(shape(r, prefill_tp), 16);
            p.fill(&(8..8 + PAGES).collect::<Vec<_>>(), 0);
            e.register_pool(p.layout.clone()).unwrap();
            (e, p)
        })
        .collect();
    Pair { decode: d, dpool, prefill }
}

/// Opens `room` on the decode engine over `pages` (one chunk); the room as its senders name it.
fn open(p: &Pair, room: u64, pages: &[u32]) -> RoomRef {
    let (key, _) = p.decode.receiver().open_room(RoomOpening::new(room, pages, PAGES * 16)).unwrap();
    RoomRef { id: room, key }
}

fn desc(room: RoomRef) -> TransferDesc {
    TransferDesc { room, chunk: 0, pages: (8..8 + PAGES).collect(), timeout: Some(Duration::from_secs(10)), ..Default::default() }
}

fn transfer_all(p: &Pair, room: u64, tag: &str) {
    let at = open(p, room, &(0..PAGES).collect::<Vec<_>>());
    for (i, (e, _)) in p.prefill.iter().enumerate() {
        let s = e.connect(&p.decode.local_addr().to_string(), &format!("{tag}-{i}"), None).unwrap();
        assert_eq!(s.transfer(&desc(at), &Op::new(s.waker())).unwrap(), Status::KVSTAGE_OK);
    }
    p.decode.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = p.dpool.verify(&(0..PAGES).collect::<Vec<_>>(), 0);
    assert_eq!(bad, 0, "{first:?}");
    p.decode.receiver().release_room(at, None).unwrap();
    assert_eq!(p.decode.receiver().ring_stats().1, 0);
}

#[test]
fn staged_chunks_land_by_rdma_write_between_two_engines() {
    let _serial = serial();
    // softib1 (MTU 2048) to softib0 (MTU 4096): path MTU 2048. Two prefill ranks write one ring.
    let p = pair(opts(TransportKind::Rdma, "softib0", 1), opts(TransportKind::Rdma, "softib1", 1), 2);
    transfer_all(&p, 1, "rdma");
    assert_eq!(p.decode.rdma().sessions(), 2);
    for (e, _) in &p.prefill {
        assert_eq!(e.rdma().sessions(), 1);
        assert_eq!(e.rdma().downgrades(), 0);
    }
    // A second room over new sessions reuses the ring registration.
    transfer_all(&p, 2, "rdma-again");
}

/// Layer-wise over RDMA: each batch goes by plain RDMA WRITEs as it is marked (the bytes of the
/// first three layers are in the decode ring while the last is missing), but the decode side
/// trusts none of them before the zero-length write-with-immediate that follows the last batch:
/// none of those layers is scattered until then (no checksum here, which would hold them back
/// anyway); then every byte verified.
#[test]
fn a_layer_wise_chunk_streams_by_rdma_write_and_its_immediate_follows_the_last_layer() {
    let _serial = serial();
    const CANARY: u8 = 0xA5;
    let region = staging_layout(&shape(0, 1), &shape(0, 1), PAGES * 16).unwrap().total_bytes as usize;
    let mut ring = vec![CANARY; region * 2];
    let ring_ptr = ring.as_ptr() as usize;
    let unchecked = |o: EngineOptions| EngineOptions { integrity: Integrity::Off, ..o };
    let p = pair(unchecked(opts(TransportKind::Rdma, "softib0", 1)), unchecked(opts(TransportKind::Rdma, "softib0", 2)), 1);
    p.decode.register_staging(Some(ring.as_mut_ptr()), ring.len()).unwrap();
    let room = 11;
    let pages: Vec<u32> = (0..PAGES).collect();
    let at = open(&p, room, &pages);
    let s = p.prefill[0].0.connect(&p.decode.local_addr().to_string(), "layers", None).unwrap();
    assert_eq!(s.stats().link, kvstage::session::stats::LinkKind::Rdma);
    let op = s.transfer_async(TransferDesc { layers: Some(s.layer_gate()), ..desc(at) }, false, 0).unwrap();
    let gate = op.layers().unwrap().clone();
    for layer in (0..3).rev() {
        gate.mark(layer, 1, None).unwrap();
    }
    let expected = region / 4 * 3;
    // SAFETY: the ring outlives the engines (declared first); only the soft fabric writes it.
    let changed = || (0..ring.len()).filter(|&i| unsafe { std::ptr::read_volatile((ring_ptr + i) as *const u8) } != CANARY).count();
    let started = std::time::Instant::now();
    let mut seen = changed();
    while seen < expected * 9 / 10 && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
        seen = changed();
    }
    assert!(seen >= expected * 9 / 10, "only {seen} of the {expected} bytes of the marked layers reached the ring before the last layer");
    assert!(seen <= expected, "{seen} bytes changed: more than the marked layers hold ({expected})");
    // Time for a scatter that should not happen (over TCP it would, at once).
    std::thread::sleep(Duration::from_millis(100));
    for layer in 0..3 {
        assert!(p.dpool.verify_layers(&pages, 0, |l| l == layer).0 > 0, "layer {layer} scattered before the write-with-immediate");
    }
    gate.mark(3, 1, None).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap(), Status::KVSTAGE_OK);
    p.decode.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = p.dpool.verify(&pages, 0);
    assert_eq!(bad, 0, "{first:?}");
    p.decode.receiver().release_room(at, None).unwrap();
    drop(s);
    drop(p);
    drop(ring);
}

/// Two sessions of one prefill engine write at once, each from its own send staging buffer: every
/// chunk lands (a write never loses its buffer's registration to the other session's write) and
/// every byte is verified.
#[test]
fn two_sessions_of_one_engine_write_at_once_from_their_own_staging_buffers() {
    let _serial = serial();
    let p = pair(opts(TransportKind::Rdma, "softib0", 1), opts(TransportKind::Rdma, "softib0", 2), 1);
    let addr = p.decode.local_addr().to_string();
    std::thread::scope(|scope| {
        for t in 0..2u32 {
            let (p, addr) = (&p, &addr);
            scope.spawn(move || {
                let s = p.prefill[0].0.connect(addr, &format!("concurrent-{t}"), None).unwrap();
                let dst: Vec<u32> = (t * PAGES..(t + 1) * PAGES).collect();
                for i in 0..25u64 {
                    let room = 100 + u64::from(t) * 1000 + i;
                    let at = open(p, room, &dst);
                    let status = s.transfer(&desc(at), &Op::new(s.waker())).unwrap_or_else(|e| panic!("session {t} chunk {i}: {}", e.chain()));
                    assert_eq!(status, Status::KVSTAGE_OK);
                    p.decode.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
                    let (bad, first) = p.dpool.verify(&dst, 0);
                    assert_eq!(bad, 0, "session {t} chunk {i}: {first:?}");
                    p.decode.receiver().release_room(at, None).unwrap();
                }
            });
        }
    });
    // The buffers the two sessions wrote from are registered, each once, and stay so for reuse.
    let registered = p.prefill[0].0.rdma().staging_registrations();
    assert!((1..=2).contains(&registered), "{registered} staging registrations for two sessions' buffers");
}

#[test]
fn a_chunk_is_striped_over_several_qps() {
    let _serial = serial();
    let p = pair(opts(TransportKind::Rdma, "softib0", 2), opts(TransportKind::Rdma, "softib0", 3), 1);
    transfer_all(&p, 7, "striped");
    let p = pair(opts(TransportKind::Auto, "softib0", 1), opts(TransportKind::Auto, "softib0,softib1", 2), 1);
    transfer_all(&p, 8, "two-nics");
    assert_eq!(p.prefill[0].0.rdma().sessions(), 1);
}

#[test]
fn auto_downgrades_to_tcp_when_the_receiver_has_no_rdma_and_rdma_refuses() {
    let _serial = serial();
    let p = pair(opts(TransportKind::Tcp, "", 1), opts(TransportKind::Auto, "softib0", 1), 1);
    transfer_all(&p, 3, "auto");
    let e = &p.prefill[0].0;
    assert_eq!(e.rdma().downgrades(), 1);
    assert!(e.rdma().last_downgrade().contains("the receiver does not serve RDMA: its transport is tcp"), "{}", e.rdma().last_downgrade());
    assert_eq!(e.rdma().staging_registrations(), 0, "a TCP session's staging buffer was registered with the NIC");
    let p = pair(opts(TransportKind::Tcp, "", 1), opts(TransportKind::Rdma, "softib0", 1), 1);
    let Err(err) = p.prefill[0].0.connect(&p.decode.local_addr().to_string(), "required", None) else {
        panic!("transport rdma connected to a receiver without RDMA");
    };
    assert_eq!(err.code(), Status::KVSTAGE_E_NO_DEVICE, "{}", err.chain());
    assert_eq!(err.session(), Some("required"));
    assert!(err.chain().contains("cannot serve RDMA"), "{}", err.chain());
}

#[test]
fn rtr_failure_names_the_disagreeing_attribute() {
    let _serial = serial();
    // InfiniBand sender, RoCE receiver: the receiver's RTR fails and says why.
    let p = pair(opts(TransportKind::Rdma, "softroce0", 1), opts(TransportKind::Rdma, "softib0", 1), 1);
    let Err(err) = p.prefill[0].0.connect(&p.decode.local_addr().to_string(), "mixed", None) else {
        panic!("an InfiniBand QP connected to a RoCE QP");
    };
    let chain = err.chain();
    assert_eq!(err.code(), Status::KVSTAGE_E_RDMA, "{chain}");
    assert!(chain.contains("to RTR") && chain.contains("QP 0x"), "{chain}");
    assert!(chain.contains("suspect: link_layer"), "{chain}");
    assert!(chain.contains("link_layer: local Ethernet (RoCE) | remote InfiniBand  <-- DIFFERS"), "{chain}");
    // auto: the same failure downgrades the session to TCP and the transfer still works.
    let p = pair(opts(TransportKind::Auto, "softroce0", 1), opts(TransportKind::Auto, "softib0", 1), 1);
    transfer_all(&p, 4, "mixed-auto");
    assert_eq!(p.prefill[0].0.rdma().downgrades(), 1);
    assert!(p.prefill[0].0.rdma().last_downgrade().contains("link_layer"));
}

#[test]
fn a_failed_work_completion_names_status_qp_peer_and_session() {
    let _serial = serial();
    let p = pair(opts(TransportKind::Rdma, "softib0", 1), opts(TransportKind::Rdma, "softib0", 1), 1);
    let (e, _) = &p.prefill[0];
    let s = e.connect(&p.decode.local_addr().to_string(), "stale-rkey", None).unwrap();
    // Registering the ring again deregisters the region the session learned: its next write
    // completes with a remote access error.
    let bytes = p.decode.receiver().ring_stats().0;
    p.decode.register_staging(None, bytes as usize).unwrap();
    let at = open(&p, 5, &(0..PAGES).collect::<Vec<_>>());
    let err = s.transfer(&desc(at), &Op::new(s.waker())).unwrap_err();
    let chain = err.chain();
    assert_eq!(err.code(), Status::KVSTAGE_E_RDMA, "{chain}");
    assert_eq!(err.session(), Some("stale-rkey"));
    assert!(chain.contains("IBV_WC_REM_ACCESS_ERR (status 10"), "{chain}");
    assert!(chain.contains("QP 0x") && chain.contains("peer ") && chain.contains("session stale-rkey"), "{chain}");
    // The session is dead; the decode side fails the room and frees its ring space.
    let room = p.decode.receiver().wait_room(at, Some(Duration::from_secs(5))).unwrap_err();
    assert!(matches!(room.code(), Status::KVSTAGE_E_PEER_GONE | Status::KVSTAGE_E_CANCELED), "{}", room.chain());
    assert_eq!(p.decode.receiver().ring_stats().1, 0);
}

#[test]
fn this_host_without_a_device_reports_no_device_or_downgrades() {
    let _serial = serial();
    // Only meaningful on a host without RDMA (CI); on a host with a device it checks nothing.
    if kvstage::dynlib::rdma_device_count() > 0 {
        return;
    }
    let err = Engine::new(EngineOptions { transport: TransportKind::Rdma, ..EngineOptions::default() }).err().expect("rdma without a device");
    assert_eq!(err.code(), Status::KVSTAGE_E_NO_DEVICE);
    assert_eq!(err.class(), kvstage::ErrorClass::KVSTAGE_CLASS_RDMA);
    assert!(err.message().contains("transport rdma: no usable RDMA device"), "{}", err.chain());
    let causes = err.causes();
    let last = causes.last().expect("a cause chain");
    assert!(last.contains("os error") || last.contains("returned no devices") || last.contains("no device"), "{causes:?}");
    // auto (same host ruled out): the engine is created, its sessions use TCP and are counted.
    let auto = || EngineOptions { same_host: false, ..EngineOptions::default() };
    let p = pair(auto(), auto(), 1);
    transfer_all(&p, 9, "auto-here");
    assert_eq!(p.prefill[0].0.rdma().downgrades(), 1);
    assert!(!p.prefill[0].0.rdma().active());
}


/// A transfer waits for another transfer's RDMA write on the same session only until its own
/// deadline: the first write stalls mid-chunk (test fault, 10 s) holding the session's write lock;
/// a second transfer with a 500 ms deadline ends with KVSTAGE_E_TIMEOUT naming that wait, instead
/// of blocking behind the stall and failing later for another reason.
#[test]
fn a_write_stuck_on_the_session_delays_another_only_until_its_deadline() {
    let _serial = serial();
    use kvstage::transport::rdma::fault::{self, WriteFault};
    let unchecked = |o: EngineOptions| EngineOptions { integrity: Integrity::Off, ..o };
    let p = pair(unchecked(opts(TransportKind::Rdma, "softib0", 1)), unchecked(opts(TransportKind::Rdma, "softib0", 1)), 1);
    let pages: Vec<u32> = (0..PAGES).collect();
    let (room_a, room_b) = (open(&p, 21, &pages), open(&p, 22, &pages));
    let s = p.prefill[0].0.connect(&p.decode.local_addr().to_string(), "write-lock", None).unwrap();
    fault::arm(WriteFault::PauseMidChunk);
    let stuck = s.transfer_async(TransferDesc { timeout: Some(Duration::from_secs(30)), ..desc(room_a) }, false, 0).unwrap();
    // The stuck write took the fault (under the session's write lock, which it keeps for the pause).
    let started = std::time::Instant::now();
    while fault::armed() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!fault::armed(), "the first transfer never reached its write");
    let second = s.transfer(&TransferDesc { timeout: Some(Duration::from_millis(500)), ..desc(room_b) }, &Op::new(s.waker()));
    let e = second.expect_err("a transfer behind a stuck write succeeded");
    assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT, "{}", e.chain());
    assert!(e.chain().contains("waiting for another write"), "{}", e.chain());
    let _ = stuck.wait(Some(Duration::from_secs(30)));
    p.decode.receiver().release_room(room_a, None).unwrap();
    p.decode.receiver().release_room(room_b, None).unwrap();
}

/// RDMA setup that fails on the sender only, after the receiver accepted its offer (its QPs'
/// transition to RTR, a test fault): both sides settle on TCP before the first grant, the
/// transfer lands over TCP, and the sender counts the downgrade with its reason. Before, the
/// receiver already treated the connection as RDMA and every chunk ready waited for an immediate
/// that never came.
#[test]
fn a_sender_side_rdma_setup_failure_settles_both_sides_on_tcp() {
    let _serial = serial();
    use kvstage::session::stats::LinkKind;
    use kvstage::transport::rdma::fault;
    let p = pair(opts(TransportKind::Auto, "softib0", 1), opts(TransportKind::Auto, "softib1", 1), 1);
    let pages: Vec<u32> = (0..PAGES).collect();
    let at = open(&p, 31, &pages);
    fault::arm_sender_rtr_failure();
    let (e, _) = &p.prefill[0];
    let s = e.connect(&p.decode.local_addr().to_string(), "rtr-fails-here", None).unwrap();
    assert_eq!(s.stats().link, LinkKind::Tcp);
    assert!(s.stats().downgraded);
    assert_eq!((e.rdma().sessions(), e.rdma().downgrades()), (0, 1));
    assert_eq!(p.decode.rdma().sessions(), 0, "the receiver counted an RDMA session the sender could not set up");
    let started = std::time::Instant::now();
    assert_eq!(s.transfer(&desc(at), &Op::new(s.waker())).unwrap(), Status::KVSTAGE_OK);
    p.decode.receiver().wait_room(at, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = p.dpool.verify(&pages, 0);
    assert_eq!(bad, 0, "{first:?}");
    eprintln!("transfer over tcp after the sender's RDMA setup failed: {:?}", started.elapsed());
    p.decode.receiver().release_room(at, None).unwrap();
}
