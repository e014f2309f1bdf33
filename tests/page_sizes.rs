//! Prefill and decode pools with different page sizes, over real loopback TCP (through the ring,
//! and read straight into the decode pool) and over the same-host path (engines in this process;
//! through the ring, and directly into the decode pool): a whole request moved chunk by chunk as `chunk_span` places it, with and without a
//! decode-side cached prefix, TP changing on top, every byte of every decode page compared with
//! the testkit's reference (request token, global head, layer), the slots after the request's last
//! token untouched. Then what a sender cannot do: a chunk of the wrong size, pages that do not hold
//! the chunk, the slice path for a chunk that ends inside a decode page; and what a lying peer
//! cannot do with the token count of its allocation request.

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::session::Integrity;
use kvstage::transport::faults::{FaultPlan, Faults};
use common::{open_room, Cluster, RawPeer, RingSpec, SMALL};
use kvstage::geometry::{chunk_span, decode_ranks_for_prefill, staging_layout, ModelKind, PoolShape};
use kvstage::protocol::{Message, RoomRef};
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::Status;
use kvstage_testkit::{page_table, HostPool};

const LAYERS: u32 = 3;
const HEADS: u32 = 4;
const CAPACITY: u64 = 48;
const ROOM: u64 = 11;
const CHUNK_TOKENS: u32 = 128;

fn shape(page_size: u32, rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, HEADS, 8, 2, page_size, LAYERS).with_tp(rank, tp)
}

struct Decode {
    engine: Engine,
    pool: HostPool,
    pages: Vec<u32>,
    room: RoomRef,
}

struct Prefill {
    sessions: Vec<(u32, Arc<SenderSession>)>,
    _engine: Engine,
    _pool: HostPool,
}

/// How a request's chunks travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// TCP into the decode ring, scattered from there.
    TcpRing,
    /// TCP, each payload read straight into the decode pool (no checksums, any run length).
    TcpIntoPool,
    /// The same-host path through the decode ring.
    ShmRing,
    /// The same-host path, copied straight into the decode pool (pools in shared memory).
    ShmDirect,
}

impl Path {
    fn transport(self) -> TransportKind {
        if matches!(self, Path::TcpRing | Path::TcpIntoPool) { TransportKind::Tcp } else { TransportKind::Shm }
    }
}

fn engine(path: Path) -> Engine {
    let min_run = if path == Path::TcpIntoPool { 0 } else { u64::MAX };
    let faults = Faults { plan: FaultPlan { pool_read_min_run: Some(min_run), ..FaultPlan::default() }, counters: Default::default() };
    let integrity = if path == Path::TcpIntoPool { Integrity::Off } else { EngineOptions::default().integrity };
    Engine::new(EngineOptions { transport: path.transport(), integrity, faults: Some(faults), ..EngineOptions::default() }).unwrap()
}

/// Decode ranks with pages of `dps`, each with room `ROOM` open over the pages after `prefix`.
/// For `ShmDirect` the pools lie in shared memory (the senders write them directly).
fn decodes_with(path: Path, dps: u32, tp: u32, total: u64, prefix: u64) -> Vec<Decode> {
    (0..tp)
        .map(|r| {
            let engine = engine(path);
            let pool = if path == Path::ShmDirect { HostPool::shared(shape(dps, r, tp), CAPACITY) } else { HostPool::new(shape(dps, r, tp), CAPACITY) };
            engine.register_pool(pool.layout.clone()).unwrap();
            engine.register_staging(None, 1 << 20).unwrap();
            let pages = page_table((total - prefix).div_ceil(dps as u64) as usize, CAPACITY, 7 + r as u64, true);
            let opening = RoomOpening { prefix_tokens: prefix, ..RoomOpening::new(ROOM, &pages, CHUNK_TOKENS) };
            let (key, grid) = engine.receiver().open_room(opening).unwrap();
            let chunks = chunk_span(total, prefix, dps, dps, CHUNK_TOKENS, 0).unwrap().num_chunks;
            assert_eq!((grid.num_chunks, grid.num_pages, grid.page_size, grid.prefix_tokens), (chunks, pages.len() as u32, dps, prefix));
            Decode { engine, pool, pages, room: RoomRef { id: ROOM, key } }
        })
        .collect()
}

fn decodes(path: Path, dps: u32, tp: u32, total: u64, prefix: u64) -> Vec<Decode> {
    decodes_with(path, dps, tp, total, prefix)
}

/// Prefill ranks with pages of `sps` holding the whole request (prefix included) in `pages`.
fn prefills(path: Path, sps: u32, tp: u32, pages: &[u32], decodes: &[Decode]) -> Vec<Prefill> {
    (0..tp)
        .map(|r| {
            let engine = engine(path);
            let mut pool = HostPool::new(shape(sps, r, tp), CAPACITY);
            pool.fill(pages, 0);
            engine.register_pool(pool.layout.clone()).unwrap();
            let sessions = decode_ranks_for_prefill(r, tp, decodes.len() as u32)
                .unwrap()
                .map(|d| (d, engine.connect(&decodes[d as usize].engine.local_addr().to_string(), &format!("p{r}-d{d}"), None).unwrap()))
                .collect();
            Prefill { sessions, _engine: engine, _pool: pool }
        })
        .collect()
}

fn send(session: &SenderSession, desc: &TransferDesc, slices: bool) -> kvstage::Result<Status> {
    let op = Op::new(session.waker());
    if slices {
        session.transfer_slices(desc, &op)
    } else {
        session.transfer(desc, &op)
    }
}

/// Chunk `chunk` of the request as `chunk_span` places it, from the prefill page list `pages`.
fn desc(room: RoomRef, pages: &[u32], total: u64, prefix: u64, sps: u32, dps: u32, chunk: u32) -> TransferDesc {
    let span = chunk_span(total, prefix, sps, dps, CHUNK_TOKENS, chunk).unwrap();
    let first = span.src_first_page as usize;
    TransferDesc {
        room,
        chunk,
        pages: pages[first..first + span.src_num_pages as usize].to_vec(),
        src_token_offset: span.src_token_offset,
        num_tokens: span.num_tokens,
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    }
}

/// Moves a request of `total` tokens from prefill TP `src_tp` (pages of `sps`) to decode TP
/// `dst_tp` (pages of `dps`) whose first `prefix` tokens the decode side holds, over TCP (through
/// the ring and read into the decode pool) and over the same-host path (through the ring and
/// directly into the decode pool).
fn request(sps: u32, dps: u32, src_tp: u32, dst_tp: u32, total: u64, prefix: u64) {
    for path in [Path::TcpRing, Path::TcpIntoPool, Path::ShmRing, Path::ShmDirect] {
        request_over(path, sps, dps, src_tp, dst_tp, total, prefix);
    }
}

fn request_over(path: Path, sps: u32, dps: u32, src_tp: u32, dst_tp: u32, total: u64, prefix: u64) {
    let what = format!("{path:?}: P{src_tp} ps {sps} -> D{dst_tp} ps {dps}, {total} tokens, decode prefix {prefix}");
    let d = decodes_with(path, dps, dst_tp, total, prefix);
    let src_pages = page_table(total.div_ceil(sps as u64) as usize, CAPACITY, 3, false);
    let p = prefills(path, sps, src_tp, &src_pages, &d);
    let chunks = chunk_span(total, prefix, sps, dps, CHUNK_TOKENS, 0).unwrap().num_chunks;
    assert!(chunks > 1, "{what}: the case should take several chunks");
    // Chunks out of order: each lands where the span says, whatever came before.
    for chunk in (0..chunks).rev() {
        for rank in &p {
            for (dr, s) in &rank.sessions {
                let desc = desc(d[*dr as usize].room, &src_pages, total, prefix, sps, dps, chunk);
                let sent = send(s, &desc, false).unwrap_or_else(|e| panic!("{what}: chunk {chunk}: {}", e.chain()));
                assert_eq!(sent, Status::KVSTAGE_OK, "{what}: chunk {chunk}");
            }
        }
    }
    for (r, dec) in d.iter().enumerate() {
        dec.engine.receiver().wait_room(dec.room, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("{what}: decode {r}: {}", e.chain()));
        let (bad, first) = dec.pool.verify_tokens(&dec.pages, prefix, total - prefix);
        assert_eq!(bad, 0, "{what}: decode rank {r}: {first:?}");
        // Every region of every chunk went the way asked: into the pool directly, read into it,
        // or none did.
        let sessions = p.iter().flat_map(|rank| rank.sessions.iter()).filter(|(dr, _)| *dr as usize == r).count() as u64;
        let regions = |on: Path| if path == on { chunks as u64 * sessions } else { 0 };
        assert_eq!(dec.engine.shm().direct_chunks(), regions(Path::ShmDirect), "{what}: decode rank {r}: regions received directly");
        assert_eq!(dec.engine.stats().receive.regions_read_into_pool, regions(Path::TcpIntoPool), "{what}: decode rank {r}: regions read into the pool");
    }
}

#[test]
fn small_prefill_pages_into_large_decode_pages() {
    request(16, 64, 1, 1, 300, 0);
    request(16, 64, 1, 1, 300, 64);
    request(16, 64, 2, 1, 300, 64); // TP 2 -> 1
    request(16, 64, 1, 2, 260, 0); // TP 1 -> 2
}

#[test]
fn large_prefill_pages_into_small_decode_pages() {
    request(64, 16, 1, 1, 300, 0);
    // The decode prefix ends inside the first prefill page: every chunk starts 16 slots into one.
    request(64, 16, 1, 1, 300, 16);
    request(64, 16, 1, 1, 300, 64);
    request(64, 16, 2, 1, 290, 16); // TP 2 -> 1
    request(64, 16, 1, 2, 300, 16); // TP 1 -> 2
}

#[test]
fn a_chunk_of_the_wrong_size_or_pages_that_do_not_hold_it_are_refused() {
    let (sps, dps, total, prefix) = (64, 16, 300, 16);
    let d = decodes(Path::TcpRing, dps, 1, total, prefix);
    let src_pages = page_table(total.div_ceil(sps as u64) as usize, CAPACITY, 3, false);
    let p = prefills(Path::TcpRing, sps, 1, &src_pages, &d);
    let s = &p[0].sessions[0].1;
    let room = d[0].room;
    let good = desc(room, &src_pages, total, prefix, sps, dps, 0);

    // Pages that do not hold the chunk: the sender says which field, nothing is sent.
    let mut more = good.clone();
    more.pages.push(src_pages[4]);
    let e = send(s, &more, false).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
    assert!(e.message().contains("`desc->src_pages`: holds 4 pages, the tokens 16..144 of its pages (page_size 64) need 3"), "{}", e.chain());
    let e = send(s, &TransferDesc { src_token_offset: 64, ..good.clone() }, false).unwrap_err();
    assert!(e.message().contains("`desc->src_token_offset`: 64 is not inside the first page"), "{}", e.chain());

    // A chunk that is not the room's last must fill its decode pages: the receiver refuses 127
    // tokens with both values. The last chunk (tokens 272..300: 28 of its 2 decode pages' 32
    // slots) may end inside its last page, never before it. Each refusal fails its room (a room
    // of its own here), which could not complete without that writer.
    let last = desc(room, &src_pages, total, prefix, sps, dps, 2);
    assert_eq!(last.num_tokens, 28);
    let wrong = [(TransferDesc { num_tokens: 127, ..good.clone() }, "sender has 127 tokens, receiver expects 128"), (TransferDesc { num_tokens: 16, ..last.clone() }, "sender has 16 tokens, receiver expects 17..=32")];
    for (i, (bad, text)) in wrong.into_iter().enumerate() {
        let id = ROOM + 1 + i as u64;
        let (key, _) = d[0].engine.receiver().open_room(RoomOpening { prefix_tokens: prefix, ..RoomOpening::new(id, &d[0].pages, CHUNK_TOKENS) }).unwrap();
        let at = RoomRef { id, key };
        let e = send(s, &TransferDesc { room: at, ..bad }, false).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
        assert!(e.chain().contains(text), "{}", e.chain());
        let failed = d[0].engine.receiver().wait_room(at, Some(Duration::ZERO)).unwrap_err();
        assert!(failed.code() == Status::KVSTAGE_E_GEOMETRY_MISMATCH && failed.chain().contains(text), "room {id}: {}", failed.chain());
        d[0].engine.receiver().release_room(at, None).unwrap();
    }

    // The slice path moves whole decode pages only.
    let e = send(s, &last, true).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED, "{}", e.chain());
    assert!(e.message().contains("28 tokens are not a multiple of the decode page size 16"), "{}", e.chain());

    // Chunks 0 and 1 by the slice path, the last staged: the request lands whole.
    for chunk in 0..2 {
        assert_eq!(send(s, &desc(room, &src_pages, total, prefix, sps, dps, chunk), true).unwrap(), Status::KVSTAGE_OK);
    }
    assert_eq!(send(s, &last, false).unwrap(), Status::KVSTAGE_OK);
    d[0].engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d[0].pool.verify_tokens(&d[0].pages, prefix, total - prefix);
    assert_eq!(bad, 0, "{first:?}");
}

/// A hand-written peer's allocation requests for a room of 6 pages of 4 (chunks of 4 and 2 pages):
/// the token count must fill a chunk's pages, the last chunk's may end inside its last page but
/// no earlier, and both writers of a chunk must agree. Each refusal is answered with both values
/// and fails its room (each lie a room of its own here), claiming nothing in it; a room asked
/// rightly gives both writers one allocation.
#[test]
fn a_lying_token_count_claims_nothing() {
    let c = Cluster::new(SMALL, common::decode_options(&SMALL), RingSpec::Owned(1 << 20));
    let pages = c.room_pages(71, 2)[..6].to_vec();
    let (mut w0, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "liar-0", b"");
    let (mut w1, _) = RawPeer::handshake(c.addr(), &SMALL.shape(1, 2), "liar-1", b"");
    let layout = |rank: u32, tokens: u32| staging_layout(&SMALL.shape(rank, 2), &SMALL.shape(0, 1), tokens).unwrap();
    let refused = |m: Message, what: &str| match m {
        Message::AllocRsp { status, reason, .. } => {
            assert_eq!(status, Status::KVSTAGE_E_GEOMETRY_MISMATCH.code(), "{reason}");
            assert!(reason.contains(what), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    let lies = [(0, 15, "sender has 15 tokens, receiver expects 16"), (1, 4, "sender has 4 tokens, receiver expects 5..=8"), (1, 9, "sender has 9 tokens, receiver expects 5..=8")];
    for (i, (chunk, tokens, text)) in lies.into_iter().enumerate() {
        let id = 72 + i as u64;
        let room = open_room(&c.decode, id, &pages, SMALL.chunk_tokens);
        refused(w0.alloc(1 + i as u64, room, chunk, 0, &layout(0, tokens)), text);
        let failed = c.decode.receiver().wait_room(room, Some(Duration::ZERO)).unwrap_err();
        assert!(failed.code() == Status::KVSTAGE_E_GEOMETRY_MISMATCH && failed.chain().contains(text), "room {id}: {}", failed.chain());
        let doc = serde_json::to_value(c.decode.receiver().describe_room(room).unwrap()).unwrap();
        assert!(doc["chunks"].as_array().unwrap().iter().all(|ch| ch["writers"].as_array().is_none_or(|w| w.is_empty())), "{doc}");
        c.decode.receiver().release_room(room, None).unwrap();
    }
    let room = open_room(&c.decode, 71, &pages, SMALL.chunk_tokens);
    let first = w0.alloc_granted(4, room, 1, 0, &layout(0, 7));
    let second = w1.alloc_granted(6, room, 1, 1, &layout(1, 7));
    assert_eq!((first.round, first.offset, first.len), (second.round, second.offset, second.len), "one allocation for the chunk");
    assert_ne!(first.region, second.region);
    let doc = serde_json::to_value(c.decode.receiver().describe_room(room).unwrap()).unwrap();
    assert_eq!((doc["state"].as_str(), doc["chunks"][1]["tokens"].as_u64()), (Some("open"), Some(7)), "{doc}");
    assert_eq!(doc["chunks"][1]["writers"].as_array().unwrap().len(), 2, "{doc}");
    // A second writer disagreeing with the chunk's first: refused, and the room fails (the
    // chunk's grant, which it could never finish, goes back).
    let rx = c.decode.receiver();
    let live = rx.stats().ring_live;
    let room = open_room(&c.decode, 80, &pages, SMALL.chunk_tokens);
    w0.alloc_granted(7, room, 1, 0, &layout(0, 7));
    assert_eq!(rx.stats().ring_live, live + 1);
    refused(w1.alloc(8, room, 1, 1, &layout(1, 8)), "this writer has 8 tokens, the chunk's first writer 7");
    let failed = rx.wait_room(room, Some(Duration::ZERO)).unwrap_err();
    assert!(failed.chain().contains("writer 1 (session liar-1"), "{}", failed.chain());
    assert_eq!(rx.stats().ring_live, live, "the failed room's grant stayed in the ring");
}
