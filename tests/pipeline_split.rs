//! Pipeline splits and the chunk grid over real loopback TCP, engines in this process.
//!
//! - Uneven and interleaved prefill stages into one decode rank, three stages into two, the
//!   writers arriving in an order other than stage order: every decode pool holds the reference
//!   bytes, and the bytes on the wire are the decode layers' once.
//! - Two prefill ranks claiming the same layer of the same heads: the second is refused before
//!   its bytes move and the room fails, naming the layer and both ranks.
//! - The chunk grid: the prefill side asks the decode side for it (the decode prefix too, which
//!   must be whole decode pages); a chunk of the wrong size or past the room is refused before any
//!   byte moves, with both sides' values in the message.

use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{decode_peers, staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::{RoomGrid, SenderSession, TransferDesc};
use kvstage::Status;
use kvstage_testkit::HostPool;

const PAGE: u32 = 4;
const LAYERS: u32 = 7;

fn base() -> PoolShape {
    PoolShape::new(ModelKind::Mha, 4, 8, 2, PAGE, LAYERS)
}

fn stages(tp: u32, split: &[Vec<u32>]) -> Vec<PoolShape> {
    split.iter().enumerate().map(|(j, ids)| base().with_tp(0, tp).with_pp(j as u32, split.len() as u32, ids.clone())).collect()
}

struct Decode {
    engine: Engine,
    pool: HostPool,
    /// The room [`decode`] opened, as its senders name it.
    room: RoomRef,
}

fn decode(shape: PoolShape, room: u64, pages: &[u32], chunk_tokens: u32) -> Decode {
    let engine = Engine::new(EngineOptions::default()).unwrap();
    let pool = HostPool::new(shape, 16);
    engine.register_pool(pool.layout.clone()).unwrap();
    engine.register_staging(None, 1 << 20).unwrap();
    let (key, _) = engine.receiver().open_room(RoomOpening::new(room, pages, chunk_tokens)).unwrap();
    Decode { engine, pool, room: RoomRef { id: room, key } }
}

struct Prefill {
    // Field order: sessions close before their engine.
    sessions: Vec<std::sync::Arc<SenderSession>>,
    /// For each session, the room of the decode rank it goes to.
    rooms: Vec<RoomRef>,
    _engine: Engine,
    _pool: HostPool,
}

/// A prefill rank with `shape`, its pool filled for `pages`, connected to the decode ranks the
/// pairing helper names among `decodes` (indexed by decode PP stage, TP 1).
fn prefill(shape: PoolShape, pages: &[u32], decodes: &[Decode]) -> Prefill {
    let engine = Engine::new(EngineOptions::default()).unwrap();
    let mut pool = HostPool::new(shape.clone(), 16);
    pool.fill(pages, 0);
    engine.register_pool(pool.layout.clone()).unwrap();
    let dst_stages: Vec<PoolShape> = decodes.iter().map(|d| d.pool.layout.shape.clone()).collect();
    let (sessions, rooms) = decode_peers(&shape, &dst_stages)
        .unwrap()
        .iter()
        .map(|p| {
            let id = format!("p{}-{}-d{}", shape.pp_rank, shape.tp_rank, p.pp_rank);
            let d = &decodes[p.pp_rank as usize];
            (engine.connect(&d.engine.local_addr().to_string(), &id, None).unwrap(), d.room)
        })
        .unzip();
    Prefill { sessions, rooms, _engine: engine, _pool: pool }
}

fn send(session: &SenderSession, room: RoomRef, chunk: u32, pages: &[u32]) -> kvstage::Result<Status> {
    let desc = TransferDesc { room, chunk, pages: pages.to_vec(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
    session.transfer(&desc, &Op::new(session.waker()))
}

/// Prefill stages `src_split` (TP `src_tp`) into decode stages `dst_split` (TP 1), one chunk;
/// the prefill ranks send in the order `order` (indices into stage-major rank order).
fn reshard(src_tp: u32, src_split: &[Vec<u32>], dst_split: &[Vec<u32>], order: &[usize]) {
    let pages: Vec<u32> = vec![5, 2, 7];
    let dst_pages: Vec<u32> = vec![1, 9, 4];
    let tokens = pages.len() as u32 * PAGE;
    let decodes: Vec<Decode> = stages(1, dst_split).into_iter().map(|s| decode(s, 3, &dst_pages, tokens)).collect();
    let ranks: Vec<Prefill> = stages(src_tp, src_split)
        .iter()
        .flat_map(|stage| (0..src_tp).map(move |r| stage.clone().with_tp(r, src_tp)))
        .map(|shape| prefill(shape, &pages, &decodes))
        .collect();
    assert_eq!(order.len(), ranks.len());
    for &i in order {
        for (s, &room) in ranks[i].sessions.iter().zip(&ranks[i].rooms) {
            assert_eq!(send(s, room, 0, &pages).unwrap_or_else(|e| panic!("rank {i}: {}", e.chain())), Status::KVSTAGE_OK);
        }
    }
    for (q, d) in decodes.iter().enumerate() {
        d.engine.receiver().wait_room(d.room, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("decode stage {q}: {}", e.chain()));
        let (bad, first) = d.pool.verify(&dst_pages, 0);
        assert_eq!(bad, 0, "{src_split:?} -> {dst_split:?}: decode stage {q}: {first:?}");
        // The decode rank's layers crossed once each, whatever the split.
        let want = staging_layout(&base().with_tp(0, src_tp), &d.pool.layout.shape, tokens).unwrap().total_bytes;
        assert_eq!(d.engine.stats().receive.bytes_received, want, "decode stage {q}");
    }
    let sent: u64 = ranks.iter().flat_map(|r| &r.sessions).map(|s| s.stats().send.bytes_sent).sum();
    let received: u64 = decodes.iter().map(|d| d.engine.stats().receive.bytes_received).sum();
    assert_eq!(sent, received);
}

#[test]
fn uneven_stages_into_one_decode_rank_in_any_arrival_order() {
    let split = [vec![0, 1, 2, 3], vec![4, 5, 6]];
    reshard(1, &split, &[(0..LAYERS).collect()], &[1, 0]);
    // TP 2 × PP 2 (4 + 3 layers): the second stage's ranks arrive first, interleaved.
    reshard(2, &split, &[(0..LAYERS).collect()], &[3, 0, 2, 1]);
}

#[test]
fn three_stages_into_two_and_interleaved_layer_ids() {
    let dst = [vec![0, 1, 2, 3], vec![4, 5, 6]];
    reshard(1, &[vec![0, 1, 2], vec![3, 4], vec![5, 6]], &dst, &[2, 1, 0]);
    reshard(1, &[vec![0, 2, 4, 6], vec![1, 3, 5]], &dst, &[1, 0]);
}

#[test]
fn two_ranks_claiming_one_layer_are_refused_before_bytes_move() {
    let pages: Vec<u32> = vec![0, 1];
    let tokens = pages.len() as u32 * PAGE;
    let d = decode(base(), 4, &pages, tokens);
    let first = prefill(base().with_pp(0, 2, vec![0, 1, 2, 3]), &pages, std::slice::from_ref(&d));
    let overlapping = prefill(base().with_pp(1, 2, vec![3, 4, 5, 6]), &pages, std::slice::from_ref(&d));
    assert_eq!(send(&first.sessions[0], d.room, 0, &pages).unwrap(), Status::KVSTAGE_OK);
    let before = d.engine.stats().receive.bytes_received;
    let e = send(&overlapping.sessions[0], d.room, 0, &pages).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    assert!(e.chain().contains("layer 3 of head group 0"), "{}", e.chain());
    assert!(e.chain().contains("carried by prefill rank (tp 0, pp 0) != remote claimed by prefill rank (tp 0, pp 1)"), "{}", e.chain());
    assert_eq!(d.engine.stats().receive.bytes_received, before, "the refused writer's bytes never moved");
    assert_eq!(overlapping.sessions[0].stats().send.bytes_sent, 0);
    // Either copy of layer 3 may be the wrong layer: the room fails at once, naming both ranks.
    let e = d.engine.receiver().wait_room(d.room, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    assert!(e.chain().contains("claimed by prefill rank (tp 0, pp 1)"), "{}", e.chain());
}

#[test]
fn the_prefill_side_learns_the_grid_and_a_wrong_chunk_is_refused_with_both_values() {
    // 10 pages on a grid of 4 pages (16 tokens): chunks of 4, 4 and 2 pages.
    let pages: Vec<u32> = (0..10).collect();
    let d = decode(base(), 6, &pages, 16);
    let p = prefill(base(), &pages, std::slice::from_ref(&d));
    let s = &p.sessions[0];
    let grid = s.room_grid(d.room, Some(Duration::from_secs(5))).unwrap();
    assert_eq!(grid, RoomGrid { chunk_tokens: 16, num_chunks: 3, num_pages: 10, page_size: PAGE, prefix_tokens: 0 });
    let e = s.room_grid(RoomRef { id: 99, key: 1 }, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM, "{}", e.chain());
    assert!(e.chain().contains("room 99: the room key names no open opening"), "{}", e.chain());
    d.engine.receiver().release_room(d.room, None).unwrap();
    let e = s.room_grid(d.room, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_STALE_ROOM, "a released room is gone: {}", e.chain());
    // A decode prefix must be whole decode pages; the one the room opens with reaches the sender.
    let e = d.engine.receiver().open_room(RoomOpening { prefix_tokens: u64::from(PAGE) * 3 + 1, ..RoomOpening::new(6, &pages, 16) }).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
    assert!(e.chain().contains("prefix_tokens") && e.chain().contains("round the cached prefix down to 12"), "{}", e.chain());
    let (key, opened) = d.engine.receiver().open_room(RoomOpening { prefix_tokens: u64::from(PAGE) * 3, ..RoomOpening::new(6, &pages, 16) }).unwrap();
    let prefixed = RoomGrid { prefix_tokens: u64::from(PAGE) * 3, ..grid };
    assert_eq!(opened, prefixed);
    assert_eq!(s.room_grid(RoomRef { id: 6, key }, Some(Duration::from_secs(5))).unwrap(), prefixed, "the sender learns the decode prefix");
    d.engine.receiver().release_room(RoomRef { id: 6, key }, None).unwrap();
    let (key, opened) = d.engine.receiver().open_room(RoomOpening::new(6, &pages, 16)).unwrap();
    assert_eq!(opened, grid);
    let room = RoomRef { id: 6, key };

    // A chunk past the grid: refused, the room goes on.
    let e = send(s, room, 3, &pages[..2]).unwrap_err();
    assert!(e.chain().contains("chunk 3 is past room 6's 3 chunks (0 .. 2)"), "{}", e.chain());
    assert_eq!(d.engine.receiver().wait_room(room, Some(Duration::ZERO)).unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT, "the room goes on");
    // A sender guessing a grid of 3 pages: refused at allocation with both values, nothing sent;
    // the room, which that writer cannot deliver, fails at once with the same words.
    let e = send(s, room, 0, &pages[..3]).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    let both = "sender has 12 tokens, receiver expects 16 (its grid: 3 chunks of 16 tokens over 10 pages of 4)";
    assert!(e.chain().contains(both), "{}", e.chain());
    assert_eq!(s.stats().send.bytes_sent, 0);
    assert_eq!(d.engine.stats().receive.bytes_received, 0);
    let failed = d.engine.receiver().wait_room(room, Some(Duration::ZERO)).unwrap_err();
    assert!(failed.code() == Status::KVSTAGE_E_GEOMETRY_MISMATCH && failed.chain().contains(both), "{}", failed.chain());
    d.engine.receiver().release_room(room, None).unwrap();
    let (key, _) = d.engine.receiver().open_room(RoomOpening::new(6, &pages, 16)).unwrap();
    let room = RoomRef { id: 6, key };

    // Cut on the grid it learnt, the same sender delivers the room opened again.
    let per_chunk = (grid.chunk_tokens / PAGE) as usize;
    for (k, chunk) in pages.chunks(per_chunk).enumerate() {
        assert_eq!(send(s, room, k as u32, chunk).unwrap_or_else(|e| panic!("chunk {k}: {}", e.chain())), Status::KVSTAGE_OK);
    }
    d.engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d.pool.verify(&pages, 0);
    assert_eq!(bad, 0, "{first:?}");
}
