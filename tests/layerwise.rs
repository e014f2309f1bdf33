//! Layer-wise sending over real loopback sockets, engines in this process: a chunk's transfer
//! starts before its layers are computed and the caller marks layers ready over time.
//!
//! - Layers marked in random order and in bursts with random delays, for MHA, MLA and pipeline
//!   stage senders, over TCP, the same-host path and (test builds: the soft fabric) RDMA: every
//!   decode pool holds the reference bytes.
//! - Over TCP the marked layers' bytes are in the decode ring before the last layer is marked
//!   (the transfer streams; it does not wait for the whole chunk).
//! - A layer never marked: the transfer ends by its deadline with `TIMEOUT`, the decode room fails
//!   and the ring is empty once the room is released.
//!
//! Slab writes outside a region, twice or past its end are refused by the receiver whatever the
//! sender: `hostile_peer.rs` plays that peer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::session::stats::LinkKind;
use kvstage::session::Integrity;
use kvstage::transport::faults::{FaultPlan, Faults};
use kvstage::Status;
use kvstage_testkit::HostPool;

const PAGE: u32 = 4;
const LAYERS: u32 = 6;

/// A small deterministic generator (the orders must be reproducible from the seed in a failure).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// `ids` cut into runs of 1–3 adjacent layers, the runs shuffled: the marks of one sender.
fn bursts(ids: &[u32], rng: &mut Rng) -> Vec<(u32, u32)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut n = 1 + rng.below(3) as usize;
        n = n.min(ids.len() - i);
        while ids[i + n - 1] != ids[i] + n as u32 - 1 {
            n -= 1; // a run is contiguous layer ids
        }
        runs.push((ids[i], n as u32));
        i += n;
    }
    for k in (1..runs.len()).rev() {
        runs.swap(k, rng.below(k as u64 + 1) as usize);
    }
    runs
}

fn options(transport: TransportKind) -> EngineOptions {
    options_into(transport, false)
}

/// As [`options`]; `into_pool` over TCP: no checksums, and the decode side reads every payload
/// straight into its pool (whatever the run length).
fn options_into(transport: TransportKind, into_pool: bool) -> EngineOptions {
    let o = EngineOptions { transport, ..EngineOptions::default() };
    if into_pool && transport == TransportKind::Tcp {
        let plan = FaultPlan { pool_read_min_run: Some(0), ..FaultPlan::default() };
        return EngineOptions { integrity: Integrity::Off, faults: Some(Faults { plan, counters: Default::default() }), ..o };
    }
    // RDMA: the soft fabric of test builds (both engines on it; no same-host path before it).
    #[cfg(feature = "testing")]
    if transport == TransportKind::Rdma {
        let devices = kvstage::transport::rdma::parse_devices("softib0").unwrap();
        return EngineOptions { rdma: kvstage::transport::rdma::RdmaOptions { devices, ..o.rdma }, same_host: false, ..o };
    }
    o
}

struct Decode {
    engine: Engine,
    pool: HostPool,
}

fn decode(shape: PoolShape, transport: TransportKind, ring: Option<&mut [u8]>) -> Decode {
    decode_in(shape, transport, ring, false)
}

/// As [`decode`]; `into_pool`: same host, the pool in shared memory, so senders write it
/// directly; over TCP, payloads read straight into it.
fn decode_in(shape: PoolShape, transport: TransportKind, ring: Option<&mut [u8]>, into_pool: bool) -> Decode {
    let engine = Engine::new(options_into(transport, into_pool)).unwrap();
    let shared = into_pool && transport == TransportKind::Shm;
    let pool = if shared { HostPool::shared(shape, 16) } else { HostPool::new(shape, 16) };
    engine.register_pool(pool.layout.clone()).unwrap();
    match ring {
        Some(r) => engine.register_staging(Some(r.as_mut_ptr()), r.len()).unwrap(),
        None => engine.register_staging(None, 1 << 20).unwrap(),
    }
    Decode { engine, pool }
}

struct Prefill {
    // Field order: the session closes before its engine.
    session: Arc<SenderSession>,
    _engine: Engine,
    _pool: HostPool,
}

fn prefill(shape: PoolShape, pages: &[u32], to: &Decode, transport: TransportKind, id: &str) -> Prefill {
    prefill_with(shape, pages, to, options(transport), id)
}

fn prefill_with(shape: PoolShape, pages: &[u32], to: &Decode, options: EngineOptions, id: &str) -> Prefill {
    let engine = Engine::new(options).unwrap();
    let mut pool = HostPool::new(shape, 16);
    pool.fill(pages, 0);
    engine.register_pool(pool.layout.clone()).unwrap();
    let session = engine.connect(&to.engine.local_addr().to_string(), id, None).unwrap();
    Prefill { session, _engine: engine, _pool: pool }
}

/// Starts a layer-wise transfer of one chunk on `session`.
fn start(session: &Arc<SenderSession>, room: RoomRef, pages: &[u32], timeout: Duration) -> Arc<Op> {
    let desc = TransferDesc { room, pages: pages.to_vec(), timeout: Some(timeout), layers: Some(session.layer_gate()), ..Default::default() };
    session.transfer_async(desc, false, room.id).unwrap()
}

/// Every sender's layers marked in shuffled bursts with delays of 0–2 ms, the senders
/// interleaved; then every operation succeeds and the decode pool holds the reference bytes.
fn stream(name: &str, srcs: &[PoolShape], dst: PoolShape, transport: TransportKind, seed: u64) {
    stream_into(name, srcs, dst, transport, seed, false);
}

/// As [`stream`]; `into_pool`: same host, the decode pool in shared memory, each batch copied
/// straight into it; over TCP, each batch read straight into it.
fn stream_into(name: &str, srcs: &[PoolShape], dst: PoolShape, transport: TransportKind, seed: u64, into_pool: bool) {
    let pages = [5u32, 2, 7];
    let dst_pages = [1u32, 9, 4];
    let d = decode_in(dst, transport, None, into_pool);
    let (key, _) = d.engine.receiver().open_room(RoomOpening::new(1, &dst_pages, PAGE * 3)).unwrap();
    let room = RoomRef { id: 1, key };
    let prefills: Vec<Prefill> =
        srcs.iter().enumerate().map(|(i, s)| prefill_with(s.clone(), &pages, &d, options_into(transport, into_pool), &format!("{name}-{i}"))).collect();
    for p in &prefills {
        let want = match transport {
            TransportKind::Shm => LinkKind::Shm,
            TransportKind::Rdma => LinkKind::Rdma,
            _ => LinkKind::Tcp,
        };
        assert_eq!(p.session.stats().link, want, "{name}: the transport in use");
    }
    let ops: Vec<Arc<Op>> = prefills.iter().map(|p| start(&p.session, room, &pages, Duration::from_secs(20))).collect();
    let mut rng = Rng(seed);
    let mut marks: Vec<(usize, (u32, u32))> =
        prefills.iter().enumerate().flat_map(|(i, p)| bursts(&p.session.pool().shape.layer_ids, &mut rng).into_iter().map(move |b| (i, b))).collect();
    // Interleave the senders too (each sender's own bursts keep their shuffled order).
    for k in (1..marks.len()).rev() {
        let j = rng.below(k as u64 + 1) as usize;
        if marks[k].0 != marks[j].0 {
            marks.swap(k, j);
        }
    }
    for (i, (first, count)) in marks {
        std::thread::sleep(Duration::from_micros(rng.below(2000)));
        ops[i].layers().expect("a layer-wise operation has a gate").mark(first, count, None).unwrap();
    }
    for (i, op) in ops.iter().enumerate() {
        match op.wait(Some(Duration::from_secs(20))) {
            Ok(s) => assert_eq!(s, Status::KVSTAGE_OK, "{name} sender {i}"),
            Err(e) => panic!("{name} sender {i} (seed {seed}): {}", e.chain()),
        }
    }
    d.engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("{name} (seed {seed}): {}", e.chain()));
    let (bad, first) = d.pool.verify(&dst_pages, 0);
    assert_eq!(bad, 0, "{name} (seed {seed}): {first:?}");
    let regions = |on: TransportKind| if into_pool && transport == on { prefills.len() as u64 } else { 0 };
    assert_eq!(d.engine.shm().direct_chunks(), regions(TransportKind::Shm), "{name} (seed {seed}): regions received directly");
    assert_eq!(d.engine.stats().receive.regions_read_into_pool, regions(TransportKind::Tcp), "{name} (seed {seed}): regions read into the pool");
    d.engine.receiver().release_room(room, None).unwrap();
}

fn mha() -> PoolShape {
    PoolShape::new(ModelKind::Mha, 4, 8, 2, PAGE, LAYERS)
}

fn mha6() -> PoolShape {
    PoolShape::new(ModelKind::Mha, 6, 8, 2, PAGE, LAYERS)
}

fn cases() -> Vec<(&'static str, Vec<PoolShape>, PoolShape)> {
    let mla = PoolShape::new(ModelKind::Mla, 1, 16, 2, PAGE, LAYERS);
    vec![
        ("mha-tp2-tp1", vec![mha().with_tp(0, 2), mha().with_tp(1, 2)], mha()),
        ("mha-tp1-tp2", vec![mha()], mha().with_tp(1, 2)),
        // MLA: one prefill rank feeds each decode rank (the others do not connect).
        ("mla-tp2-tp1", vec![mla.clone().with_tp(0, 2)], mla.clone()),
        ("mla-tp1-tp2", vec![mla.clone()], mla.with_tp(1, 2)),
        ("pp-2-stages", vec![mha().with_pp(0, 2, vec![0, 1]), mha().with_pp(1, 2, vec![2, 3, 4, 5])], mha()),
        // TP sizes that do not divide one another, 6 heads: decode rank 0 of 2 takes 2 heads from
        // prefill rank 0 of 3 and 1 from rank 1; decode rank 1 of 3 takes 1 from each of 2.
        ("mha6-tp3-tp2", vec![mha6().with_tp(0, 3), mha6().with_tp(1, 3)], mha6().with_tp(0, 2)),
        ("mha6-tp2-tp3", vec![mha6().with_tp(0, 2), mha6().with_tp(1, 2)], mha6().with_tp(1, 3)),
    ]
}

#[test]
fn layers_marked_in_any_order_land_bit_exact_over_tcp() {
    for seed in [1u64, 7, 42] {
        for (name, srcs, dst) in cases() {
            stream(name, &srcs, dst, TransportKind::Tcp, seed);
        }
    }
}

#[test]
fn layers_marked_in_any_order_land_bit_exact_in_place_on_one_host() {
    for seed in [3u64, 11] {
        for (name, srcs, dst) in cases() {
            stream(name, &srcs, dst, TransportKind::Shm, seed);
        }
    }
}

/// The same with the decode pool in shared memory: each batch of layers is copied from the prefill
/// pages straight into the decode pages (direct mode), reported written per batch.
#[test]
fn layers_marked_in_any_order_land_bit_exact_directly_into_the_decode_pool() {
    for seed in [3u64, 11] {
        for (name, srcs, dst) in cases() {
            stream_into(name, &srcs, dst, TransportKind::Shm, seed, true);
        }
    }
}

/// Over TCP with every batch's payload read straight into the decode pool (no ring, no scatter):
/// a region arrives in several payloads, each at its own offset of the region.
#[test]
fn layers_marked_in_any_order_are_read_bit_exact_into_the_decode_pool_over_tcp() {
    for seed in [2u64, 9] {
        for (name, srcs, dst) in cases() {
            stream_into(name, &srcs, dst, TransportKind::Tcp, seed, true);
        }
    }
}

/// By RDMA WRITE on the soft fabric of test builds (each batch in pieces, the immediate after the
/// last; the decode side scatters once it arrived).
#[cfg(feature = "testing")]
#[test]
fn layers_marked_in_any_order_land_bit_exact_by_rdma_write() {
    for seed in [5u64, 13] {
        for (name, srcs, dst) in cases() {
            stream(name, &srcs, dst, TransportKind::Rdma, seed);
        }
    }
}

/// Over TCP the bytes of the layers marked so far reach the decode ring while the last layer is
/// still missing: the canary-filled ring changes by (almost) all of those layers' bytes, and the
/// decode pool already holds them.
#[test]
fn marked_layers_leave_before_the_last_is_ready() {
    let pages = [3u32, 0];
    let tokens = PAGE * 2;
    let region = staging_layout(&mha(), &mha(), tokens).unwrap().total_bytes as usize;
    const CANARY: u8 = 0xA5;
    let mut ring = vec![CANARY; region * 2];
    let ring_ptr = ring.as_ptr() as usize;
    let d = decode(mha(), TransportKind::Tcp, Some(&mut ring));
    let (key, _) = d.engine.receiver().open_room(RoomOpening::new(1, &pages, tokens)).unwrap();
    let p = prefill(mha(), &pages, &d, TransportKind::Tcp, "streams");
    let room = RoomRef { id: 1, key };
    let op = start(&p.session, room, &pages, Duration::from_secs(20));
    let gate = op.layers().unwrap().clone();
    gate.mark(0, LAYERS - 1, None).unwrap();
    // (LAYERS-1)/LAYERS of the region; pattern bytes equal to the canary by chance are few.
    let expected = region / LAYERS as usize * (LAYERS as usize - 1);
    let changed = || (0..ring.len()).filter(|&i| unsafe { std::ptr::read_volatile((ring_ptr + i) as *const u8) } != CANARY).count();
    let started = Instant::now();
    let mut seen = changed();
    while seen < expected * 9 / 10 && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
        seen = changed();
    }
    assert!(seen >= expected * 9 / 10, "only {seen} of the {expected} bytes of the marked layers reached the ring before the last layer");
    assert!(seen <= expected, "{seen} bytes changed: more than the marked layers hold ({expected})");
    // The decode side scatters each of those layers without waiting for the last one.
    let marked = |l: u32| l < LAYERS - 1;
    let mut scattered = d.pool.verify_layers(&pages, 0, marked);
    while scattered.0 > 0 && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
        scattered = d.pool.verify_layers(&pages, 0, marked);
    }
    assert_eq!(scattered.0, 0, "the marked layers were not scattered before the last layer: {:?}", scattered.1);
    assert!(d.pool.verify_layers(&pages, 0, |l| !marked(l)).0 > 0, "the last layer is in the pool before it was marked");
    assert_eq!(op.poll().unwrap(), Status::KVSTAGE_PENDING, "the chunk cannot be done without its last layer");
    gate.mark(LAYERS - 1, 1, None).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(20))).unwrap(), Status::KVSTAGE_OK);
    d.engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d.pool.verify(&pages, 0);
    assert_eq!(bad, 0, "{first:?}");
    d.engine.receiver().release_room(room, None).unwrap();
    drop(p);
    drop(d);
    drop(ring);
}

/// The last layer never becomes ready: `TIMEOUT` by the deadline, the room fails, and once it is
/// released nothing of the chunk is left in the ring.
#[test]
fn a_layer_never_marked_ends_by_the_deadline_and_fails_the_room() {
    for (transport, direct) in [(TransportKind::Tcp, false), (TransportKind::Shm, false), (TransportKind::Shm, true)] {
        let pages = [1u32, 2];
        let d = decode_in(mha(), transport, None, direct);
        let (key, _) = d.engine.receiver().open_room(RoomOpening::new(1, &pages, PAGE * 2)).unwrap();
        let p = prefill(mha(), &pages, &d, transport, "never");
        let deadline = Duration::from_millis(400);
        let started = Instant::now();
        let at = RoomRef { id: 1, key };
        let op = start(&p.session, at, &pages, deadline);
        op.layers().unwrap().mark(0, LAYERS - 1, None).unwrap();
        let err = op.wait(Some(Duration::from_secs(20))).unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.code(), Status::KVSTAGE_E_TIMEOUT, "{transport:?}: {}", err.chain());
        assert!(err.chain().contains("mark the chunk's layers ready"), "{}", err.chain());
        assert!(took < deadline + Duration::from_secs(2), "{transport:?}: ended after {took:?}");
        let room = d.engine.receiver().wait_room(at, Some(Duration::from_secs(10)));
        assert!(room.is_err(), "{transport:?}: the room cannot complete without the layer");
        d.engine.receiver().release_room(at, None).unwrap();
        let live = || d.engine.receiver().ring_stats().1;
        let t = Instant::now();
        while live() != 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(live(), 0, "{transport:?}: ring space left after the release");
        // Marking after the end is harmless; the gate refuses layers the pool lacks.
        op.layers().unwrap().mark(LAYERS - 1, 1, None).unwrap();
        assert_eq!(op.layers().unwrap().mark(LAYERS, 1, None).unwrap_err().code(), Status::KVSTAGE_E_INVALID_ARG);
    }
}

/// The slice path does not send layer by layer: refused at once, before an operation exists.
#[test]
fn the_slice_path_refuses_a_layer_gate() {
    let pages = [1u32];
    let d = decode(mha(), TransportKind::Tcp, None);
    let p = prefill(mha(), &pages, &d, TransportKind::Tcp, "args");
    let desc = TransferDesc { room: RoomRef { id: 9, key: 1 }, pages: pages.to_vec(), timeout: Some(Duration::from_secs(1)), layers: Some(p.session.layer_gate()), ..Default::default() };
    let Err(e) = p.session.transfer_async(desc.clone(), true, 0) else { panic!("a layer-wise slice transfer was queued") };
    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
    let e = p.session.transfer_slices(&desc, &Op::new(p.session.waker())).unwrap_err();
    assert!(e.message().contains("does not send layer by layer"), "{}", e.chain());
    assert_eq!(p.session.stats().send.transfers_failed(), 0, "a refused argument is not a transfer");
}
