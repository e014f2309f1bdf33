//! Fault soak: many seeded runs of a P2→D1 staged transfer (two chunks, a ring that holds one
//! chunk, so the second waits on the watermark) over real loopback TCP, each with one kind of
//! injected fault on the prefill or the decode side, over TCP or the same-host path. For every seed:
//! - every operation ends (success or error) before its deadline plus a small slack: no hangs;
//! - a room reported complete holds exactly the reference bytes: no corrupt success;
//! - once the room is terminal and the sessions closed, the decode ring is empty before the room is
//!   released (no leak hidden by the release), and after it;
//! - a terminal room reported each chunk once, then itself once, with its outcome.
//!
//! Half the seeds send layer-wise (each chunk's two layers marked in reverse order, each written as
//! it is marked), without a checksum unless the plan corrupts payloads (an unchecked corrupted
//! payload is a success with wrong bytes by design), so the decode side's per-layer scatter runs
//! under every other fault.
//!
//! Whole-chunk seeds over TCP write each chunk in one of three ways, a third of them each: straight
//! from the pool's rows, gathered into a staging buffer then one write, or gathered in pieces of
//! one slab, each written while the next is gathered.
//!
//! A third of all seeds put the decode pool in shared memory: their same-host sessions copy chunks
//! (whole, or batch by batch layer-wise) straight into the decode pages (direct mode, with the
//! checksum computed over the decode pool's rows), while the last chunk with request parts goes
//! through the ring.
//!
//! Half the decode engines read stream payloads without a checksum (layer-wise TCP seeds without
//! corruption) straight into the decode pool, the other half land them in the ring.
//!
//! Half the whole-chunk seeds move the whole request (request parts: an aux row and a state slot
//! per layer, sharded P2 -> D1, with the last chunk): a room reported complete holds exactly the
//! reference parts too, its aux row included.
//!
//! Every pool (the decode rank's and each prefill rank's) is laid out as one of the engines'
//! layouts (sglang, vLLM's six orders, TensorRT-LLM), drawn from the seed for each rank; a room
//! reported complete holds the reference in every row of its pages, computed through the
//! testkit's own index formula of the decode layout, and every other byte of the decode pool is
//! still zero. Every layout completes rooms on each side.
//!
//! After all seeds, no thread and no file descriptor is left behind.
//!
//! `KVSTAGE_SOAK_SEEDS` sets the number of seeds (default 1000).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fd_count, thread_count};
use kvstage::engine::{Engine, EngineOptions, Integrity, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{ComponentKind, ComponentSpec, LayoutPreset, ModelKind, PoolShape, RequestParts, StateItem};
use kvstage::session::notify::EventKind;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::Status;

const OP_DEADLINE: Duration = Duration::from_millis(300);
/// Time an operation may take past its deadline (scheduling on a loaded 2-core machine).
const SLACK: Duration = Duration::from_millis(1500);
const PAGE: u32 = 4;
const CHUNK_TOKENS: u32 = 16;
const PAGES: usize = 8;
const ROOM: u64 = 5;
const LAYERS: u32 = 2;

fn shape(rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 2, 8, 2, PAGE, LAYERS).with_tp(rank, tp)
}

#[derive(Default)]
struct Tally {
    seeds: AtomicU64,
    completed: AtomicU64,
    /// Of them, rooms that moved request parts.
    completed_with_parts: AtomicU64,
    /// Of them, whole-chunk rooms over TCP by how their chunks went out: from the pool, staged
    /// in one write, staged in pieces.
    completed_by_write: [AtomicU64; 3],
    /// Chunk regions the decode engines received directly into their pools (same-host seeds
    /// whose decode pool lies in shared memory), in rooms that completed.
    direct_regions: AtomicU64,
    /// Writer regions read from TCP straight into the decode pools, in rooms that completed.
    read_regions: AtomicU64,
    failed: AtomicU64,
    hangs: AtomicU64,
    corrupt_successes: AtomicU64,
    leaked: AtomicU64,
    /// Terminal rooms whose events were not each chunk's once, then the room's once.
    bad_events: AtomicU64,
    /// Rooms that completed, by the decode pool's layout and by each prefill pool's (index in
    /// `LayoutPreset::ALL`).
    completed_by_decode_layout: [AtomicU64; 8],
    completed_by_prefill_layout: [AtomicU64; 8],
}

/// The layout of a pool of `seed`: prefill rank 0 or 1, or the decode rank (`rank` 2); drawn
/// from the seed apart from the bits that pick the fault, the transport and the write path.
fn layout_for(seed: u64, rank: u64) -> usize {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (rank + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x % LayoutPreset::ALL.len() as u64) as usize
}

fn plan_for(seed: u64) -> (FaultPlan, bool) {
    let mut p = FaultPlan { seed, ..FaultPlan::default() };
    let on_decode = seed % 2 == 1;
    match (seed / 2) % 9 {
        0 => {}
        1 => p.drop = 300,
        2 => p.duplicate = 400,
        3 => p.reorder = 400,
        4 => {
            p.delay = 500;
            p.max_delay_ms = 120;
        }
        5 => p.corrupt = 700,
        6 => p.truncate = 500,
        7 => p.cut_at_frame = Some(seed % 7),
        _ => p.stop_reading_after = Some(seed % 5),
    }
    (p, on_decode)
}

/// Whether `seed` sends layer-wise: every plan, side and transport both ways.
fn layerwise(seed: u64) -> bool {
    !(seed / 36).is_multiple_of(2)
}

/// Every fault kind on either side runs over both byte movers: TCP (whose payloads the faults can
/// corrupt or truncate) and the same-host path (transport auto between engines of one host,
/// where only control frames pass through the faults).
fn options(seed: u64, faults: Option<Faults>) -> EngineOptions {
    EngineOptions {
        chunk_tokens: CHUNK_TOKENS,
        default_deadline: Some(OP_DEADLINE),
        integrity: if layerwise(seed) && plan_for(seed).0.corrupt == 0 { Integrity::Off } else { Integrity::Always },
        faults,
        transport: if (seed / 18).is_multiple_of(2) { TransportKind::Tcp } else { TransportKind::Auto },
        send_from_pool: write_kind(seed) == WriteKind::FromPool,
        send_piece_bytes: if write_kind(seed) == WriteKind::Pieces { 1 } else { 0 },
        ..EngineOptions::default()
    }
}

/// How a whole chunk goes out over TCP.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WriteKind {
    /// Straight from the pool's rows (the default).
    FromPool,
    /// Gathered into a staging buffer, then one write.
    Staged,
    /// Gathered into a staging buffer in pieces of one slab, each written while the next is
    /// gathered.
    Pieces,
}

/// Whether the decode engine of `seed` reads stream payloads without a checksum (layer-wise seeds
/// over TCP without corruption) straight into its pool, or lands them in the ring.
fn reads_into_pool(seed: u64) -> bool {
    (seed / 4).is_multiple_of(2)
}

/// Whether the decode pool of `seed` lies in shared memory: its same-host sessions then go direct
/// (chunks without request parts; the last one with them through the ring).
fn shared_pool(seed: u64) -> bool {
    write_kind(seed) == WriteKind::FromPool
}

fn write_kind(seed: u64) -> WriteKind {
    [WriteKind::FromPool, WriteKind::Staged, WriteKind::Pieces][((seed / 144) % 3) as usize]
}

/// Whether `seed` moves request parts with its last chunk (whole-chunk seeds only).
fn with_parts(seed: u64) -> bool {
    !layerwise(seed) && (seed / 72).is_multiple_of(2)
}

const AUX_ROW: u64 = 32;
const STATE_ELEMS: u32 = 8;

fn part_specs() -> Vec<ComponentSpec> {
    let item = StateItem { outer: 1, groups: vec![STATE_ELEMS], dtype_bytes: 2, replicated: false };
    vec![
        ComponentSpec { name: "aux".into(), kind: ComponentKind::Aux { row_bytes: AUX_ROW }, layer_ids: vec![], page_size: 0 },
        ComponentSpec { name: "state".into(), kind: ComponentKind::State { item }, layer_ids: vec![0, 1], page_size: 0 },
    ]
}

/// The reference of a request's parts as rank `rank` of `tp` holds them: the aux row, then per
/// layer the state slot (global element `e`, byte `k`).
fn parts_reference(rank: u32, tp: u32) -> (Vec<u8>, Vec<Vec<u8>>) {
    let aux = (0..AUX_ROW).map(|b| (b * 7 + 3) as u8 | 1).collect();
    let share = STATE_ELEMS / tp;
    let state = (0..LAYERS)
        .map(|l| (0..share * 2).map(|i| ((rank * share + i / 2) * 31 + (i % 2) * 5 + l * 11) as u8 | 1).collect())
        .collect();
    (aux, state)
}

/// One rank's component memory: two aux rows, two state slots per layer.
struct PartsMemory {
    aux: Vec<u8>,
    state: Vec<Vec<u8>>,
}

impl PartsMemory {
    /// Registers it with `engine`; `fill`: slot and row 1 hold the reference (prefill).
    fn register(engine: &Engine, rank: u32, tp: u32, fill: bool) -> PartsMemory {
        let slot = (STATE_ELEMS / tp * 2) as usize;
        let mut m = PartsMemory { aux: vec![0; 2 * AUX_ROW as usize], state: vec![vec![0; 2 * slot]; LAYERS as usize] };
        if fill {
            let (aux, state) = parts_reference(rank, tp);
            m.aux[AUX_ROW as usize..].copy_from_slice(&aux);
            for (buf, want) in m.state.iter_mut().zip(state) {
                buf[slot..].copy_from_slice(&want);
            }
        }
        let bases = vec![vec![m.aux.as_ptr() as usize], m.state.iter().map(|b| b.as_ptr() as usize).collect()];
        engine.register_components(part_specs().into_iter().zip(bases).map(|(s, b)| (s, 2, b)).collect()).unwrap();
        m
    }

    /// Whether row and slot 0 (the decode side's) hold the reference of a whole decode slot.
    fn holds_reference(&self) -> bool {
        let (aux, _) = parts_reference(0, 1);
        let state = parts_reference(0, 1).1;
        let slot = (STATE_ELEMS * 2) as usize;
        self.aux[..AUX_ROW as usize] == aux[..] && self.state.iter().zip(&state).all(|(b, w)| b[..slot] == w[..])
    }
}

fn parts(slot: u64) -> RequestParts {
    RequestParts { aux_row: slot, state_slots: vec![slot], pools: vec![] }
}

fn run_seed(seed: u64, counters: &Arc<FaultCounters>, tally: &Tally) {
    let (plan, on_decode) = plan_for(seed);
    let parted = with_parts(seed);
    let faults = Faults { plan, counters: counters.clone() };
    // The decode engine always runs under a plan (an empty one when the faults are the prefill's):
    // it says whether payloads without a checksum are read straight into the pool.
    let decode_plan = FaultPlan { pool_read_min_run: Some(if reads_into_pool(seed) { 0 } else { u64::MAX }), ..if on_decode { faults.plan.clone() } else { FaultPlan { seed, ..FaultPlan::default() } } };
    let decode = Engine::new(options(seed, Some(Faults { plan: decode_plan, counters: counters.clone() }))).expect("decode engine");
    let dpool = HostPool::with_layout(shape(0, 1), 16, LayoutPreset::ALL[layout_for(seed, 2)], 0, shared_pool(seed));
    decode.register_pool(dpool.layout.clone()).unwrap();
    let dparts = parted.then(|| PartsMemory::register(&decode, 0, 1, false));
    let src0 = shape(0, 2);
    let alloc = kvstage::geometry::staging_layout(&src0, &dpool.layout.shape, CHUNK_TOKENS).unwrap().total_bytes;
    // A chunk, and the last one's request parts (a few bytes: still not two chunks).
    decode.register_staging(None, alloc as usize + if parted { 4096 } else { 0 }).unwrap();
    let dst_pages = kvstage_testkit::page_table(PAGES, 16, seed, false);
    let room = match parted {
        false => common::open_room(&decode, ROOM, &dst_pages, CHUNK_TOKENS),
        true => {
            let (key, _) = decode.receiver().open_room(RoomOpening { parts: Some(parts(0)), ..RoomOpening::new(ROOM, &dst_pages, CHUNK_TOKENS) }).unwrap();
            kvstage::protocol::RoomRef { id: ROOM, key }
        }
    };
    let addr = decode.local_addr().to_string();

    let prefill: Vec<(Engine, HostPool, Vec<u32>, Option<PartsMemory>)> = (0..2)
        .map(|rank| {
            let engine = Engine::new(options(seed, (!on_decode).then(|| faults.clone()))).expect("prefill engine");
            let mut pool = HostPool::with_layout(shape(rank, 2), 16, LayoutPreset::ALL[layout_for(seed, rank as u64)], 0, false);
            let pages = kvstage_testkit::page_table(PAGES, 16, seed * 7 + rank as u64, seed.is_multiple_of(3));
            pool.fill(&pages, 0);
            engine.register_pool(pool.layout.clone()).unwrap();
            let memory = parted.then(|| PartsMemory::register(&engine, rank, 2, true));
            (engine, pool, pages, memory)
        })
        .collect();

    let hung = std::thread::scope(|s| {
        let handles: Vec<_> = prefill
            .iter()
            .enumerate()
            .map(|(rank, (engine, _, pages, _))| {
                let addr = addr.clone();
                s.spawn(move || {
                    let mut hangs = 0;
                    let start = Instant::now();
                    let session = engine.connect(&addr, &format!("soak-{seed}-p{rank}"), Some(OP_DEADLINE));
                    if start.elapsed() > OP_DEADLINE + SLACK {
                        hangs += 1;
                    }
                    let Ok(session) = session else { return hangs };
                    for (chunk, chunk_pages) in pages.chunks(CHUNK_TOKENS as usize / PAGE as usize).enumerate() {
                        let last = (chunk + 1) * (CHUNK_TOKENS / PAGE) as usize >= PAGES;
                        let parts = (parted && last).then(|| Arc::new(parts(1)));
                        let desc = TransferDesc { room, chunk: chunk as u32, pages: chunk_pages.to_vec(), timeout: Some(OP_DEADLINE), parts, ..Default::default() };
                        let start = Instant::now();
                        let result = match layerwise(seed) {
                            false => session.transfer(&desc, &Op::new(session.waker())),
                            true => session.transfer_async(TransferDesc { layers: Some(session.layer_gate()), ..desc }, false, 0).and_then(|op| {
                                let gate = op.layers().expect("a layer-wise operation has a gate");
                                for layer in (0..LAYERS).rev() {
                                    gate.mark(layer, 1, None).expect("a layer of the pool, marked once");
                                    std::thread::sleep(Duration::from_millis(seed % 3)); // the first layer often leaves alone
                                }
                                op.wait(Some(OP_DEADLINE + SLACK * 2))
                            }),
                        };
                        if start.elapsed() > OP_DEADLINE + SLACK {
                            hangs += 1;
                        }
                        if !matches!(result, Ok(Status::KVSTAGE_OK)) {
                            break;
                        }
                    }
                    hangs
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("sender thread")).sum::<u64>()
    });

    let start = Instant::now();
    let outcome = decode.receiver().wait_room(room, Some(OP_DEADLINE * 3));
    let waited = start.elapsed();
    let mut hangs = hung + (waited > OP_DEADLINE * 3 + SLACK) as u64;
    match outcome {
        Ok(_) => {
            tally.completed.fetch_add(1, Ordering::Relaxed);
            tally.completed_with_parts.fetch_add(parted as u64, Ordering::Relaxed);
            if !layerwise(seed) && (seed / 18).is_multiple_of(2) {
                tally.completed_by_write[write_kind(seed) as usize].fetch_add(1, Ordering::Relaxed);
            }
            tally.direct_regions.fetch_add(decode.shm().direct_chunks(), Ordering::Relaxed);
            tally.read_regions.fetch_add(decode.stats().receive.regions_read_into_pool, Ordering::Relaxed);
            for rank in 0..2 {
                tally.completed_by_prefill_layout[layout_for(seed, rank)].fetch_add(1, Ordering::Relaxed);
            }
            tally.completed_by_decode_layout[layout_for(seed, 2)].fetch_add(1, Ordering::Relaxed);
            // Every byte of the decode pool: the room's rows hold the reference, all else zero.
            let (bad, first) = dpool.verify_exact(&[(&dst_pages, 0, u64::MAX)]);
            if dparts.as_ref().is_some_and(|m| !m.holds_reference()) {
                eprintln!("seed {seed}: room complete with wrong request parts");
                tally.corrupt_successes.fetch_add(1, Ordering::Relaxed);
            }
            if bad != 0 {
                let layouts: Vec<&str> = (0..3).map(|r| LayoutPreset::ALL[layout_for(seed, r)].name()).collect();
                eprintln!("seed {seed}: room complete with {bad} wrong bytes (prefill {} and {} into decode {}): {first:?}", layouts[0], layouts[1], layouts[2]);
                tally.corrupt_successes.fetch_add(1, Ordering::Relaxed);
            }
        }
        Err(_) => {
            tally.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    // A terminal room (complete, or failed) owes the ring nothing once its senders are gone: the
    // leak check runs before the release, which would free whatever was left.
    let terminal = !matches!(&outcome, Err(e) if e.code() == Status::KVSTAGE_E_TIMEOUT);
    drop(prefill); // closes the sessions: the receiver frees whatever they still held
    let settle = |done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(3);
        while !done() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        done()
    };
    settle(&|| decode.receiver().stats().connections == 0);
    let live = || decode.receiver().ring_stats().1;
    if terminal && !settle(&|| live() == 0) {
        eprintln!("seed {seed}: {} ring allocations held by a terminal room before its release", live());
        tally.leaked.fetch_add(1, Ordering::Relaxed);
    }
    if terminal {
        // Its events: each chunk's once, then the whole room's once, with the room's outcome.
        let expected = outcome.as_ref().map_or_else(|e| e.code(), |_| Status::KVSTAGE_OK);
        let events = decode.receiver().take_events(Some(room), 64);
        let chunks = (PAGES / (CHUNK_TOKENS / PAGE) as usize) as u32;
        let mut seen: Vec<u32> = events.iter().filter(|e| e.kind == EventKind::Chunk).map(|e| e.chunk).collect();
        seen.sort_unstable();
        let rooms: Vec<_> = events.iter().filter(|e| e.kind == EventKind::Room).map(|e| (e.chunk, e.status)).collect();
        let last_is_room = events.last().is_some_and(|e| e.kind == EventKind::Room);
        if seen != (0..chunks).collect::<Vec<_>>() || rooms != [(chunks, expected)] || !last_is_room {
            eprintln!("seed {seed}: room events {events:?} after an outcome of {expected:?}");
            tally.bad_events.fetch_add(1, Ordering::Relaxed);
        }
    }
    decode.receiver().release_room(room, None).unwrap();
    if !settle(&|| live() == 0) {
        eprintln!("seed {seed}: {} ring allocations leaked after the release", live());
        tally.leaked.fetch_add(1, Ordering::Relaxed);
    }
    let start = Instant::now();
    drop(decode);
    if start.elapsed() > SLACK {
        hangs += 1;
    }
    if hangs > 0 {
        eprintln!("seed {seed}: {hangs} operation(s) overran their deadline ({:?})", plan_for(seed));
    }
    tally.hangs.fetch_add(hangs, Ordering::Relaxed);
    tally.seeds.fetch_add(1, Ordering::Relaxed);
}

#[test]
fn soak_every_seed_ends_cleanly() {
    let seeds: u64 = std::env::var("KVSTAGE_SOAK_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let (fds_before, threads_before) = (fd_count(), thread_count());
    let counters = Arc::new(FaultCounters::default());
    let tally = Tally::default();
    let next = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= seeds {
                    break;
                }
                run_seed(seed, &counters, &tally);
            });
        }
    });
    // Threads of dropped engines are joined; give the kernel a moment to reap them.
    let deadline = Instant::now() + Duration::from_secs(5);
    while thread_count() > threads_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (fds_after, threads_after) = (fd_count(), thread_count());
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "soak: {} seeds in {:.1} s: {} rooms complete and verified ({} with request parts; whole chunks over tcp: {} from the pool, {} staged, {} staged in pieces; {} regions received directly, {} read into the pool), {} failed cleanly; hangs {}, corrupt successes {}, \
         leaked ring allocations {}; faults injected: {:?}; fds {fds_before}->{fds_after}, threads {threads_before}->{threads_after}",
        g(&tally.seeds),
        started.elapsed().as_secs_f64(),
        g(&tally.completed),
        g(&tally.completed_with_parts),
        g(&tally.completed_by_write[0]),
        g(&tally.completed_by_write[1]),
        g(&tally.completed_by_write[2]),
        g(&tally.direct_regions),
        g(&tally.read_regions),
        g(&tally.failed),
        g(&tally.hangs),
        g(&tally.corrupt_successes),
        g(&tally.leaked),
        counters.snapshot()
    );
    let by_layout = |counts: &[AtomicU64; 8]| LayoutPreset::ALL.iter().zip(counts).map(|(p, n)| format!("{} {}", p.name(), g(n))).collect::<Vec<_>>().join(", ");
    eprintln!(
        "soak: rooms complete by decode layout: {}; by prefill layout (each rank): {}",
        by_layout(&tally.completed_by_decode_layout),
        by_layout(&tally.completed_by_prefill_layout)
    );
    assert_eq!(g(&tally.seeds), seeds);
    assert_eq!(g(&tally.hangs), 0, "operations overran their deadlines");
    assert_eq!(g(&tally.corrupt_successes), 0, "a room completed with wrong bytes");
    assert_eq!(g(&tally.leaked), 0, "ring allocations leaked");
    assert_eq!(g(&tally.bad_events), 0, "terminal rooms without each chunk's event and then one room event with their outcome");
    assert!(fds_after <= fds_before, "file descriptors leaked: {fds_before} -> {fds_after}");
    assert!(threads_after <= threads_before, "threads leaked: {threads_before} -> {threads_after}");
    assert!(g(&tally.completed) > seeds / 10, "too few clean runs: the harness itself may be broken");
    assert!(g(&tally.completed_with_parts) > seeds / 40, "too few clean runs with request parts");
    assert!(g(&tally.direct_regions) > seeds / 40, "too few regions received directly (same-host seeds with a shared decode pool)");
    assert!(g(&tally.read_regions) > seeds / 40, "too few regions read into the pool (layer-wise tcp seeds without checksums)");
    for (kind, n) in ["from the pool", "staged", "staged in pieces"].iter().zip(&tally.completed_by_write) {
        assert!(g(n) > seeds / 80, "too few clean whole-chunk runs over tcp {kind}");
    }
    for (i, preset) in LayoutPreset::ALL.iter().enumerate() {
        let (d, p) = (g(&tally.completed_by_decode_layout[i]), g(&tally.completed_by_prefill_layout[i]));
        assert!(d > seeds / 100 && p > seeds / 100, "too few clean runs with {} pools: {d} as the decode side, {p} as a prefill rank", preset.name());
    }
    for (kind, n) in counters.snapshot() {
        assert!(n > 0, "no fault of kind {kind} was injected");
    }
}
