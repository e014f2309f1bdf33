//! Whole requests: KV plus aux rows (three buffers of different row sizes), a conv-like state of
//! three groups and an SSM-like state (sharded by TP), a replicated state and a sliding-window pool
//! with its own page size, moved in one room over real loopback TCP and the same-host path
//! (engines in this process), prefill TP 4 → decode TP 2 and 2 → 4. Every byte of every decode
//! component is compared with a reference computed element by element from each element's global
//! identity (written here, independently of the planner), and the bytes around the request's
//! items stay untouched. Then what a sender or a lying peer cannot do with the new fields.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::RawPeer;
use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{decode_ranks_for_prefill, ComponentKind, ComponentSpec, ModelKind, PoolShape, PoolSpan, RequestParts, StateItem};
use kvstage::protocol::{Message, RoomRef};
use kvstage::session::notify::EventKind;
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::Status;
use kvstage_testkit::{page_table, HostPool};

const HEADS: u32 = 4;
const KV_PAGE: u32 = 16;
const CAPACITY: u64 = 16;
const TOTAL: u64 = 100;
const CHUNK_TOKENS: u32 = 32;
const ROOM: u64 = 5;
/// The window pool: its own page size, the request's last `WINDOW` tokens.
const WINDOW_PAGE: u32 = 8;
const WINDOW: u32 = 40;
const ITEMS: u64 = 6;

fn shape(rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, HEADS, 8, 2, KV_PAGE, 4).with_tp(rank, tp)
}

/// The components both sides register (sglang-shaped: three metadata buffers, a Mamba conv state
/// of key/key/value groups and an SSM state on layers 0 and 2, a replicated state on layer 1, a
/// sliding-window pool on layers 1 and 3).
fn specs() -> Vec<ComponentSpec> {
    let state = |outer, groups: Vec<u32>, dtype_bytes, replicated| ComponentKind::State { item: StateItem { outer, groups, dtype_bytes, replicated } };
    let spec = |name: &str, kind, layer_ids: Vec<u32>, page_size| ComponentSpec { name: name.into(), kind, layer_ids, page_size };
    vec![
        spec("output_ids", ComponentKind::Aux { row_bytes: 64 }, vec![], 0),
        spec("conv", state(3, vec![8, 8, 16], 2, false), vec![0, 2], 0),
        spec("top_logprobs", ComponentKind::Aux { row_bytes: 512 }, vec![], 0),
        spec("ssm", state(2, vec![32], 4, false), vec![0, 2], 0),
        spec("rep", state(2, vec![6], 2, true), vec![1], 0),
        spec("swa", ComponentKind::Pool { unit_bytes: 16, head_sliced: true }, vec![1, 3], WINDOW_PAGE),
        spec("hidden", ComponentKind::Aux { row_bytes: 200 }, vec![], 0),
    ]
}

/// The reference byte of an element, from its global identity only.
fn value(parts: &[u64]) -> u8 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        h = (h ^ p).wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 29) as u8 | 1
}

/// One rank's component memory: per component, per layer, a buffer.
struct Memory {
    /// The components as this rank registers them (a pipeline stage: only its layers).
    specs: Vec<ComponentSpec>,
    buffers: Vec<Vec<Vec<u8>>>,
    /// Bytes of one item per component on this rank.
    item_bytes: Vec<u64>,
    rank: u32,
    tp: u32,
}

/// Global element of local element `i` of a state row on rank `rank` of `tp`.
fn global_element(item: &StateItem, rank: u32, tp: u32, i: u64) -> u64 {
    if item.replicated {
        return i;
    }
    let (mut local, mut global) = (0u64, 0u64);
    for &g in &item.groups {
        let share = (g / tp) as u64;
        if i < local + share {
            return global + rank as u64 * share + (i - local);
        }
        local += share;
        global += g as u64;
    }
    unreachable!("element {i} past the row")
}

impl Memory {
    fn new(rank: u32, tp: u32) -> Memory {
        Self::of_stage(rank, tp, &[0, 1, 2, 3])
    }

    /// The memory of rank `rank` of `tp` of the pipeline stage holding `layers`.
    fn of_stage(rank: u32, tp: u32, layers: &[u32]) -> Memory {
        let local_heads = (HEADS / tp).max(1);
        let mut buffers = Vec::new();
        let mut item_bytes = Vec::new();
        let mut specs = specs();
        for s in &mut specs {
            s.layer_ids.retain(|l| layers.contains(l));
        }
        for s in &specs {
            let ib = s.item_bytes(tp, local_heads);
            let per_layer = match s.kind {
                ComponentKind::Pool { .. } => ITEMS * WINDOW_PAGE as u64 * ib,
                _ => ITEMS * ib,
            };
            let buffers_of = if matches!(s.kind, ComponentKind::Aux { .. }) { 1 } else { s.layer_ids.len() };
            buffers.push((0..buffers_of).map(|_| vec![0u8; per_layer as usize]).collect());
            item_bytes.push(ib);
        }
        Memory { specs, buffers, item_bytes, rank, tp }
    }

    fn register(&self, engine: &Engine) -> kvstage::Result<()> {
        let list = self
            .specs
            .iter()
            .cloned()
            .zip(&self.buffers)
            .map(|(s, bufs)| (s, ITEMS, bufs.iter().map(|b| b.as_ptr() as usize).collect()))
            .collect();
        engine.register_components(list)
    }

    /// What each byte of the request's items holds: `(component, layer index, byte offset in the
    /// layer's buffer, value)` for aux row `row`, state slots `slots`, window span `window`
    /// (request tokens `TOTAL - WINDOW ..`).
    fn expected(&self, row: u64, slots: &[u64], window: &PoolSpan) -> Vec<(usize, usize, usize, u8)> {
        let mut out = Vec::new();
        let mut state = 0;
        for (c, s) in self.specs.iter().enumerate() {
            let ib = self.item_bytes[c];
            match &s.kind {
                ComponentKind::Aux { row_bytes } => {
                    for b in 0..*row_bytes {
                        out.push((c, 0, (row * ib + b) as usize, value(&[c as u64, b])));
                    }
                }
                ComponentKind::State { item } => {
                    let slot = slots[state];
                    state += 1;
                    let row_elems = item.local_dim(self.tp);
                    for (li, &layer) in s.layer_ids.iter().enumerate() {
                        for r in 0..item.outer as u64 {
                            for i in 0..row_elems {
                                let e = global_element(item, self.rank, self.tp, i);
                                for b in 0..item.dtype_bytes as u64 {
                                    let at = slot * ib + ((r * row_elems + i) * item.dtype_bytes as u64 + b);
                                    out.push((c, li, at as usize, value(&[c as u64, layer as u64, r, e, b])));
                                }
                            }
                        }
                    }
                }
                ComponentKind::Pool { unit_bytes, .. } => {
                    // A rank holds max(1, H / tp) heads from head rank·H/tp (replicas share one).
                    let local_heads = (HEADS / self.tp).max(1) as u64;
                    let first_head = (self.rank * HEADS / self.tp) as u64;
                    for (li, &layer) in s.layer_ids.iter().enumerate() {
                        for j in 0..window.tokens as u64 {
                            let t = window.first_token as u64 + j;
                            let slot = window.pages[(t / WINDOW_PAGE as u64) as usize] as u64 * WINDOW_PAGE as u64 + t % WINDOW_PAGE as u64;
                            for h in 0..local_heads {
                                let head = first_head + h;
                                for b in 0..*unit_bytes {
                                    let token = TOTAL - WINDOW as u64 + j;
                                    out.push((c, li, (slot * ib + h * unit_bytes + b) as usize, value(&[c as u64, layer as u64, token, head, b])));
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    fn fill(&mut self, row: u64, slots: &[u64], window: &PoolSpan) {
        for (c, li, at, v) in self.expected(row, slots, window) {
            self.buffers[c][li][at] = v;
        }
    }

    /// Bytes that differ from the reference, the first of them described; every byte outside the
    /// request's items must still be 0.
    fn verify(&self, row: u64, slots: &[u64], window: &PoolSpan) -> (usize, Option<String>) {
        let mut want: Vec<Vec<Vec<u8>>> = self.buffers.iter().map(|c| c.iter().map(|b| vec![0u8; b.len()]).collect()).collect();
        for (c, li, at, v) in self.expected(row, slots, window) {
            want[c][li][at] = v;
        }
        let names = &self.specs;
        let mut bad = 0;
        let mut first = None;
        for (c, layers) in self.buffers.iter().enumerate() {
            for (li, got) in layers.iter().enumerate() {
                for (at, (g, w)) in got.iter().zip(&want[c][li]).enumerate() {
                    if g != w {
                        bad += 1;
                        first.get_or_insert_with(|| format!("{} layer index {li} byte {at}: {g} != {w}", names[c].name));
                    }
                }
            }
        }
        (bad, first)
    }
}

fn engine(transport: TransportKind) -> Engine {
    Engine::new(EngineOptions { transport, ..EngineOptions::default() }).unwrap()
}

struct Decode {
    engine: Engine,
    pool: HostPool,
    memory: Memory,
    pages: Vec<u32>,
    parts: RequestParts,
    room: RoomRef,
}

fn decode_parts(rank: u32) -> RequestParts {
    // Each side names its own row, slots and window pages (the decode window starts on a page).
    let pages = page_table(WINDOW.div_ceil(WINDOW_PAGE) as usize, ITEMS, 11 + rank as u64, true);
    RequestParts { aux_row: 4, state_slots: vec![1, 5, 2], pools: vec![PoolSpan { pages, first_token: 0, tokens: WINDOW }] }
}

fn prefill_parts() -> RequestParts {
    // The window is the request's last 40 tokens: 4 slots into its first prefill page.
    let first_token = ((TOTAL - WINDOW as u64) % WINDOW_PAGE as u64) as u32;
    let pages = vec![5, 0, 3, 2, 4, 1];
    RequestParts { aux_row: 2, state_slots: vec![3, 0, 4], pools: vec![PoolSpan { pages, first_token, tokens: WINDOW }] }
}

fn decodes(transport: TransportKind, tp: u32) -> Vec<Decode> {
    (0..tp)
        .map(|r| {
            let engine = engine(transport);
            let pool = HostPool::new(shape(r, tp), CAPACITY);
            engine.register_pool(pool.layout.clone()).unwrap();
            let memory = Memory::new(r, tp);
            memory.register(&engine).unwrap();
            engine.register_staging(None, 1 << 20).unwrap();
            let pages = page_table(TOTAL.div_ceil(KV_PAGE as u64) as usize, CAPACITY, 7 + r as u64, true);
            let parts = decode_parts(r);
            let (key, _) = engine.receiver().open_room(RoomOpening { parts: Some(parts.clone()), ..RoomOpening::new(ROOM, &pages, CHUNK_TOKENS) }).unwrap();
            Decode { engine, pool, memory, pages, parts, room: RoomRef { id: ROOM, key } }
        })
        .collect()
}

struct Prefill {
    sessions: Vec<(u32, Arc<SenderSession>)>,
    _engine: Engine,
    _pool: HostPool,
    _memory: Memory,
}

fn prefills(transport: TransportKind, tp: u32, pages: &[u32], decodes: &[Decode]) -> Vec<Prefill> {
    (0..tp)
        .map(|r| {
            let engine = engine(transport);
            let mut pool = HostPool::new(shape(r, tp), CAPACITY);
            pool.fill(pages, 0);
            engine.register_pool(pool.layout.clone()).unwrap();
            let mut memory = Memory::new(r, tp);
            let parts = prefill_parts();
            memory.fill(parts.aux_row, &parts.state_slots, &parts.pools[0]);
            memory.register(&engine).unwrap();
            let sessions = decode_ranks_for_prefill(r, tp, decodes.len() as u32)
                .unwrap()
                .map(|d| (d, engine.connect(&decodes[d as usize].engine.local_addr().to_string(), &format!("p{r}-d{d}"), None).unwrap()))
                .collect();
            Prefill { sessions, _engine: engine, _pool: pool, _memory: memory }
        })
        .collect()
}

fn send(session: &SenderSession, desc: &TransferDesc) -> kvstage::Result<Status> {
    session.transfer(desc, &Op::new(session.waker()))
}

/// Chunk `chunk` (of 32 tokens on 16-token pages, the last of 4 tokens) with the request's parts
/// when it is the last.
fn desc(room: RoomRef, pages: &[u32], chunk: u32) -> TransferDesc {
    let (first, tokens) = (chunk as u64 * CHUNK_TOKENS as u64, (TOTAL - chunk as u64 * CHUNK_TOKENS as u64).min(CHUNK_TOKENS as u64));
    let page = (first / KV_PAGE as u64) as usize;
    TransferDesc {
        room,
        chunk,
        pages: pages[page..page + tokens.div_ceil(KV_PAGE as u64) as usize].to_vec(),
        num_tokens: tokens as u32,
        timeout: Some(Duration::from_secs(10)),
        parts: (chunk == last_chunk()).then(|| Arc::new(prefill_parts())),
        ..Default::default()
    }
}

fn last_chunk() -> u32 {
    (TOTAL.div_ceil(CHUNK_TOKENS as u64) - 1) as u32
}

/// The complete room's queued events: each chunk's once (OK), then the whole room's once (OK,
/// carrying its chunk count), last.
fn assert_every_chunk_then_the_room(dec: &Decode, what: &str) {
    let events = dec.engine.receiver().take_events(Some(dec.room), 64);
    let n = last_chunk() + 1;
    let (room, chunks) = events.split_last().unwrap_or_else(|| panic!("{what}: no events"));
    assert_eq!((room.kind, room.chunk, room.status), (EventKind::Room, n, Status::KVSTAGE_OK), "{what}: the last event {events:?}");
    let mut seen: Vec<u32> = chunks.iter().filter(|e| e.kind == EventKind::Chunk && e.status == Status::KVSTAGE_OK).map(|e| e.chunk).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{what}: chunk events {events:?}");
    assert_eq!(chunks.len() as u32, n, "{what}: events {events:?}");
}

fn request(transport: TransportKind, src_tp: u32, dst_tp: u32) {
    let what = format!("{transport:?}: P{src_tp} -> D{dst_tp}");
    let d = decodes(transport, dst_tp);
    let src_pages = page_table(TOTAL.div_ceil(KV_PAGE as u64) as usize, CAPACITY, 3, false);
    let p = prefills(transport, src_tp, &src_pages, &d);
    // The last chunk (with the parts) first: the room completes only with every chunk, and its
    // aux rows are written after the rest.
    for chunk in (0..=last_chunk()).rev() {
        for rank in &p {
            for (dr, s) in &rank.sessions {
                let sent = send(s, &desc(d[*dr as usize].room, &src_pages, chunk)).unwrap_or_else(|e| panic!("{what}: chunk {chunk}: {}", e.chain()));
                assert_eq!(sent, Status::KVSTAGE_OK, "{what}: chunk {chunk}");
            }
        }
        if chunk == last_chunk() {
            for dec in &d {
                // The last chunk's scatter copies the aux rows out and holds them (bounded wait:
                // the scatter runs after the arrival was acknowledged).
                let held = (0..500).any(|_| {
                    let doc = dec.engine.receiver().describe_room(dec.room).unwrap();
                    std::thread::sleep(Duration::from_millis(10));
                    doc.aux_rows == Some("held")
                });
                assert!(held, "{what}: the aux rows never went to 'held'");
                let aux = dec.memory.buffers[0][0][(dec.parts.aux_row * 64) as usize];
                assert_eq!(aux, 0, "{what}: an aux row was written before the room's other chunks");
            }
        }
    }
    for (r, dec) in d.iter().enumerate() {
        dec.engine.receiver().wait_room(dec.room, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("{what}: decode {r}: {}", e.chain()));
        let (bad, first) = dec.pool.verify_tokens(&dec.pages, 0, TOTAL);
        assert_eq!(bad, 0, "{what}: decode rank {r} KV: {first:?}");
        let (bad, first) = dec.memory.verify(dec.parts.aux_row, &dec.parts.state_slots, &dec.parts.pools[0]);
        assert_eq!(bad, 0, "{what}: decode rank {r} parts: {first:?}");
        assert_eq!(dec.engine.receiver().describe_room(dec.room).unwrap().aux_rows, Some("written"));
        // One OK event per chunk, the last of them once the aux rows are written, then the room's.
        assert_every_chunk_then_the_room(dec, &format!("{what}: decode rank {r}"));
    }
}

#[test]
fn a_whole_request_lands_over_tcp_and_the_same_host_path() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        // Prefill TP 8 over 4 KV heads: ranks that replicate a head send their state shares alone.
        request(transport, 8, 2);
        request(transport, 8, 4);
        request(transport, 4, 2);
        request(transport, 2, 4);
        request(transport, 2, 2);
    }
}

/// One prefill rank, one decode rank over TCP, the room open with parts.
fn pair() -> (Vec<Decode>, Vec<Prefill>, Vec<u32>) {
    let d = decodes(TransportKind::Tcp, 1);
    let src_pages = page_table(TOTAL.div_ceil(KV_PAGE as u64) as usize, CAPACITY, 3, false);
    let p = prefills(TransportKind::Tcp, 1, &src_pages, &d);
    (d, p, src_pages)
}

fn refused(s: &SenderSession, desc: &TransferDesc, code: Status, text: &str) {
    let e = send(s, desc).unwrap_err();
    assert_eq!(e.code(), code, "{}", e.chain());
    assert!(e.chain().contains(text), "expected {text:?} in: {}", e.chain());
}

#[test]
fn parts_go_with_the_last_chunk_only_and_every_field_is_checked() {
    let (d, p, src_pages) = pair();
    let s = &p[0].sessions[0].1;
    let room = d[0].room;
    let last = desc(room, &src_pages, last_chunk());
    // Parts on another chunk, a last chunk without the parts the room names, a window of another
    // length than the room's (both values and the pool named): refused by the receiver with the
    // reason, and the room (each its own) fails at once with it.
    let mut shorter = prefill_parts();
    shorter.pools[0] = PoolSpan { pages: shorter.pools[0].pages[1..].to_vec(), first_token: 0, tokens: WINDOW - 4 };
    let wrong: [(u32, Option<Arc<RequestParts>>, &str); 3] = [
        (0, last.parts.clone(), "request parts travel with the room's last chunk (3), not with chunk 0"),
        (last_chunk(), None, "this writer does not send with the last chunk"),
        (last_chunk(), Some(Arc::new(shorter)), "pool \"swa\": the sender sends 36 tokens, the room's span holds 40"),
    ];
    for (i, (chunk, parts, text)) in wrong.into_iter().enumerate() {
        let id = ROOM + 10 + i as u64;
        let (key, _) = d[0].engine.receiver().open_room(RoomOpening { parts: Some(d[0].parts.clone()), ..RoomOpening::new(id, &d[0].pages, CHUNK_TOKENS) }).unwrap();
        refused(s, &TransferDesc { parts, ..desc(RoomRef { id, key }, &src_pages, chunk) }, Status::KVSTAGE_E_GEOMETRY_MISMATCH, text);
        let failed = d[0].engine.receiver().wait_room(RoomRef { id, key }, Some(Duration::ZERO)).unwrap_err();
        assert!(failed.code() == Status::KVSTAGE_E_GEOMETRY_MISMATCH && failed.chain().contains(text), "room {id}: {}", failed.chain());
        d[0].engine.receiver().release_room(RoomRef { id, key }, None).unwrap();
    }
    // Caller mistakes are named field by field before anything is sent.
    let mut bad = prefill_parts();
    bad.state_slots[1] = ITEMS;
    refused(s, &TransferDesc { parts: Some(Arc::new(bad)), ..last.clone() }, Status::KVSTAGE_E_INVALID_ARG, "`desc->parts.state_slots[1]`: 6 is outside state component \"ssm\"'s 6 slots");
    let mut bad = prefill_parts();
    bad.pools[0].tokens = 48;
    refused(s, &TransferDesc { parts: Some(Arc::new(bad)), ..last.clone() }, Status::KVSTAGE_E_INVALID_ARG, "`desc->parts.pool_spans[0].pages`: holds 6 pages, the tokens 4..52 of its pages (page_size 8) need 7");
    let mut bad = prefill_parts();
    bad.state_slots.pop();
    refused(s, &TransferDesc { parts: Some(Arc::new(bad)), ..last.clone() }, Status::KVSTAGE_E_INVALID_ARG, "`desc->parts.num_state_slots`: 2 != 3");
    // The room, which the receiver refused nothing of, completes with the right transfers.
    for chunk in 0..=last_chunk() {
        assert_eq!(send(s, &desc(room, &src_pages, chunk)).unwrap(), Status::KVSTAGE_OK);
    }
    d[0].engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d[0].memory.verify(d[0].parts.aux_row, &d[0].parts.state_slots, &d[0].parts.pools[0]);
    assert_eq!(bad, 0, "{first:?}");
    // A room opened for the KV alone takes no parts.
    let (key, _) = d[0].engine.receiver().open_room(RoomOpening::new(ROOM + 1, &d[0].pages, CHUNK_TOKENS)).unwrap();
    let plain = RoomRef { id: ROOM + 1, key };
    refused(s, &desc(plain, &src_pages, last_chunk()), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "the room does not name (name them in kvstage_room_desc.parts");
    // A decode room naming a slot outside its component is refused at the opening.
    let mut outside = decode_parts(0);
    outside.aux_row = ITEMS + 3;
    let e = d[0].engine.receiver().open_room(RoomOpening { parts: Some(outside), ..RoomOpening::new(ROOM + 2, &d[0].pages, CHUNK_TOKENS) }).unwrap_err();
    assert!(e.message().contains("`desc->parts.aux_row`: 9 is outside aux buffer \"output_ids\"'s 6 rows"), "{}", e.chain());
}

/// Prefill TP 2 into decode TP 1: rank 1 names the request's parts wrongly (a window 4 tokens
/// short in room B, no parts with the last chunk in room C) after rank 0 was granted the chunk.
/// The decode side fails B and C at once, naming the part and the writer; rank 0's grants go back
/// to the ring; B's and C's aux row stays unwritten; rooms F and G, sent next by both ranks to
/// the same decode rank, complete byte for byte.
#[test]
fn a_writer_refused_for_its_parts_fails_the_room_at_once() {
    let d = decodes(TransportKind::Tcp, 1);
    let src_pages = page_table(TOTAL.div_ceil(KV_PAGE as u64) as usize, CAPACITY, 3, false);
    let p = prefills(TransportKind::Tcp, 2, &src_pages, &d);
    let rx = d[0].engine.receiver();
    let (good, bad) = (&p[0].sessions[0].1, &p[1].sessions[0].1);
    let mut shorter = prefill_parts();
    shorter.pools[0] = PoolSpan { pages: shorter.pools[0].pages[1..].to_vec(), first_token: 0, tokens: WINDOW - 4 };
    let wrong: [(u64, Option<Arc<RequestParts>>, &str); 2] = [
        (20, Some(Arc::new(shorter)), "pool \"swa\": the sender sends 36 tokens, the room's span holds 40"),
        (21, None, "this writer does not send with the last chunk"),
    ];
    let mut failed_rooms = Vec::new();
    for (id, parts, text) in wrong {
        let (key, _) = rx.open_room(RoomOpening { parts: Some(d[0].parts.clone()), ..RoomOpening::new(id, &d[0].pages, CHUNK_TOKENS) }).unwrap();
        failed_rooms.push(RoomRef { id, key });
        let last = desc(RoomRef { id, key }, &src_pages, last_chunk());
        assert_eq!(send(good, &last).unwrap(), Status::KVSTAGE_OK);
        refused(bad, &TransferDesc { parts, ..last }, Status::KVSTAGE_E_GEOMETRY_MISMATCH, text);
        let failed = rx.wait_room(RoomRef { id, key }, Some(Duration::ZERO)).unwrap_err();
        eprintln!("room {id}: {}", failed.chain());
        assert_eq!(failed.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "room {id} did not fail at once: {}", failed.chain());
        assert!(failed.chain().contains(text) && failed.chain().contains("writer 1 (session p1-d0"), "room {id}: {}", failed.chain());
        // Every chunk reported failed (none landed whole), then the room once, with the failure.
        let events: Vec<_> = rx.take_events(Some(RoomRef { id, key }), 64).iter().map(|e| (e.kind, e.chunk, e.status)).collect();
        let mut expected: Vec<_> = (0..=last_chunk()).map(|c| (EventKind::Chunk, c, Status::KVSTAGE_E_GEOMETRY_MISMATCH)).collect();
        expected.push((EventKind::Room, last_chunk() + 1, Status::KVSTAGE_E_GEOMETRY_MISMATCH));
        assert_eq!(events, expected, "room {id}");
    }
    let freed = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        rx.stats().ring_live == 0
    });
    assert!(freed, "the refused rooms' grants stayed in the ring: {:?}", rx.stats());
    assert_eq!(d[0].memory.buffers[0][0][(d[0].parts.aux_row * 64) as usize], 0, "a failed room's aux row was written");
    for at in failed_rooms {
        rx.release_room(at, None).unwrap();
    }
    for id in [22, 23] {
        let (key, _) = rx.open_room(RoomOpening { parts: Some(d[0].parts.clone()), ..RoomOpening::new(id, &d[0].pages, CHUNK_TOKENS) }).unwrap();
        for chunk in 0..=last_chunk() {
            for rank in &p {
                assert_eq!(send(&rank.sessions[0].1, &desc(RoomRef { id, key }, &src_pages, chunk)).unwrap(), Status::KVSTAGE_OK);
            }
        }
        rx.wait_room(RoomRef { id, key }, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("room {id}: {}", e.chain()));
        let (bad, first) = d[0].pool.verify_tokens(&d[0].pages, 0, TOTAL);
        assert_eq!(bad, 0, "room {id} KV: {first:?}");
        let (bad, first) = d[0].memory.verify(d[0].parts.aux_row, &d[0].parts.state_slots, &d[0].parts.pools[0]);
        assert_eq!(bad, 0, "room {id} parts: {first:?}");
        rx.release_room(RoomRef { id, key }, None).unwrap();
    }
}

#[test]
fn ranks_with_different_components_are_refused_at_the_handshake() {
    let d = decodes(TransportKind::Tcp, 1);
    let engine = engine(TransportKind::Tcp);
    let pool = HostPool::new(shape(0, 1), CAPACITY);
    engine.register_pool(pool.layout.clone()).unwrap();
    let memory = Memory::new(0, 1);
    let mut list: Vec<_> = specs().into_iter().zip(&memory.buffers).map(|(s, b)| (s, ITEMS, b.iter().map(|b| b.as_ptr() as usize).collect())).collect();
    list[5].0.kind = ComponentKind::Pool { unit_bytes: 16, head_sliced: false };
    list[1].0.name = "conv_state".into();
    engine.register_components(list).unwrap();
    let Err(e) = engine.connect(&d[0].engine.local_addr().to_string(), "p0-d0", None) else { panic!("connected with different components") };
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    for field in ["components[1].name: local \"conv_state\"", "components[5] (swa).head_sliced"] {
        assert!(e.chain().contains(field.split(':').next().unwrap()), "{field} missing in {}", e.chain());
    }
}

/// A lying peer (a raw connection that passed the handshake with the right components, told
/// the room's key) cannot make a room take parts it does not name, a window of another length, a
/// pool list of another size, or an allocation that leaves the parts out: each lie is refused
/// with the reason, and fails the room it was told (it can fail a room it was told, no more).
#[test]
fn a_lying_peer_cannot_bend_the_parts() {
    let d = decodes(TransportKind::Tcp, 1);
    let addr = d[0].engine.local_addr();
    let mut peer = RawPeer::connect(addr);
    peer.send(&common::hello_with(&shape(0, 1), "liar", &[], specs())).unwrap();
    assert!(matches!(peer.reply(Duration::from_secs(5)), Message::Hello(h) if h.status == 0));
    let layout = kvstage::geometry::staging_layout(&shape(0, 1), &shape(0, 1), (TOTAL % CHUNK_TOKENS as u64) as u32).unwrap();
    let rx = d[0].engine.receiver();
    let lies: [(u32, Option<Vec<u32>>, String); 4] = [
        (last_chunk(), Some(vec![WINDOW + 1]), "pool \"swa\": the sender sends 41 tokens, the room's span holds 40".into()),
        (last_chunk(), Some(vec![WINDOW, WINDOW]), "the sender names 2 pool spans, the room 1".into()),
        // The KV alone in the last chunk's allocation: the size must include the parts.
        (last_chunk(), Some(vec![WINDOW]), format!("allocation size {} != expected", layout.total_bytes)),
        (1, Some(vec![WINDOW]), "request parts travel with the room's last chunk".into()),
    ];
    for (i, (chunk, pool_tokens, text)) in lies.into_iter().enumerate() {
        let id = ROOM + 1 + i as u64;
        let (key, _) = rx.open_room(RoomOpening { parts: Some(d[0].parts.clone()), ..RoomOpening::new(id, &d[0].pages, CHUNK_TOKENS) }).unwrap();
        let tokens = if chunk == last_chunk() { layout.tokens } else { CHUNK_TOKENS };
        let req = i as u64 + 1;
        let ask = Message::AllocReq { req, room: RoomRef { id, key }, chunk, writer: 0, tokens, bytes: layout.total_bytes, trace: String::new(), pool_tokens, direct: false };
        peer.send(&ask).unwrap();
        let (status, reason) = match peer.reply(Duration::from_secs(5)) {
            Message::AllocRsp { req: r, status, reason, .. } if r == req => (status, reason),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(status, Status::KVSTAGE_E_GEOMETRY_MISMATCH.code(), "{reason}");
        assert!(reason.contains(&text), "{reason}");
        let failed = rx.wait_room(RoomRef { id, key }, Some(Duration::ZERO)).unwrap_err();
        assert!(failed.code() == Status::KVSTAGE_E_GEOMETRY_MISMATCH && failed.chain().contains(&text), "room {id}: {}", failed.chain());
    }
    // The room it was not told is untouched: the decode side still waits for its chunks.
    let e = rx.wait_room(d[0].room, Some(Duration::from_millis(100))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT, "{}", e.chain());
}

/// The room's last chunk (with the parts) staged first, the others by the slice path afterwards:
/// the chunk that completes the room's KV is a slice-path one, and the room still writes its aux
/// rows, completes, and reports every chunk.
#[test]
fn a_room_completed_by_the_slice_path_writes_its_aux_rows() {
    let (d, p, src_pages) = pair();
    let s = &p[0].sessions[0].1;
    let room = d[0].room;
    assert_eq!(send(s, &desc(room, &src_pages, last_chunk())).unwrap(), Status::KVSTAGE_OK);
    // Parts never take the slice path.
    let e = s.transfer_slices(&desc(room, &src_pages, last_chunk()), &Op::new(s.waker())).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED, "{}", e.chain());
    for chunk in 0..last_chunk() {
        let status = s.transfer_slices(&TransferDesc { parts: None, ..desc(room, &src_pages, chunk) }, &Op::new(s.waker())).unwrap();
        assert_eq!(status, Status::KVSTAGE_OK);
    }
    d[0].engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d[0].memory.verify(d[0].parts.aux_row, &d[0].parts.state_slots, &d[0].parts.pools[0]);
    assert_eq!(bad, 0, "{first:?}");
    assert_every_chunk_then_the_room(&d[0], "slice path");
}

/// Prefill TP 2 × PP 2 (layers 0-1 and 2-3) into decode TP 1: each stage sends the component
/// layers it holds (state on layers 0 and 2, the window on 1 and 3: one of each per stage), the
/// aux rows come once (from the stage holding the decode rank's first layer), every byte lands.
#[test]
fn pipeline_stages_each_send_the_component_layers_they_hold() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let d = decodes(transport, 1);
        let src_pages = page_table(TOTAL.div_ceil(KV_PAGE as u64) as usize, CAPACITY, 3, false);
        let mut ranks = Vec::new();
        for (stage, layers) in [vec![0u32, 1], vec![2, 3]].into_iter().enumerate() {
            for r in 0..2 {
                let engine = engine(transport);
                let mut pool = HostPool::new(shape(r, 2).with_pp(stage as u32, 2, layers.clone()), CAPACITY);
                pool.fill(&src_pages, 0);
                engine.register_pool(pool.layout.clone()).unwrap();
                let mut memory = Memory::of_stage(r, 2, &layers);
                let parts = prefill_parts();
                memory.fill(parts.aux_row, &parts.state_slots, &parts.pools[0]);
                memory.register(&engine).unwrap();
                let session = engine.connect(&d[0].engine.local_addr().to_string(), &format!("p{stage}.{r}"), None).unwrap();
                ranks.push((engine, pool, memory, session));
            }
        }
        for chunk in (0..=last_chunk()).rev() {
            for (_, _, _, s) in &ranks {
                let sent = send(s, &desc(d[0].room, &src_pages, chunk)).unwrap_or_else(|e| panic!("{transport:?} chunk {chunk}: {}", e.chain()));
                assert_eq!(sent, Status::KVSTAGE_OK);
            }
        }
        let dec = &d[0];
        dec.engine.receiver().wait_room(dec.room, Some(Duration::from_secs(10))).unwrap();
        let (bad, first) = dec.pool.verify_tokens(&dec.pages, 0, TOTAL);
        assert_eq!(bad, 0, "{transport:?} KV: {first:?}");
        let (bad, first) = dec.memory.verify(dec.parts.aux_row, &dec.parts.state_slots, &dec.parts.pools[0]);
        assert_eq!(bad, 0, "{transport:?} parts: {first:?}");
    }
}
