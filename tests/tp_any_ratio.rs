//! TP sizes that do not divide one another (P3→D2, P2→D3, P4→D6, P8→D12 with replication on
//! both sides, MLA P3→D2), over real loopback TCP, engines in this process: every prefill rank
//! opens the sessions the pairing helper names, each sends its heads of every chunk, and every
//! decode pool byte equals the reference (a pattern of layer, K/V, token and the model-global
//! head, computed by the test kit from the TP partition alone). The bytes on the wire are each
//! decode rank's heads once, whatever the head groups' sizes (P3→D2 with 12 heads: decode rank 0
//! takes 4 heads from prefill rank 0 and 2 from prefill rank 1).

use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions};
use kvstage::geometry::{decode_peers, prefill_peers, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::receiver::RoomOpening;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::Status;
use kvstage_testkit::HostPool;

const PAGE: u32 = 4;
const LAYERS: u32 = 3;
/// Two chunks of two pages each.
const CHUNK_TOKENS: u32 = 2 * PAGE;
const SRC_PAGES: [u32; 4] = [6, 1, 3, 8];
const DST_PAGES: [u32; 4] = [2, 9, 0, 5];

struct Decode {
    engine: Engine,
    pool: HostPool,
    room: RoomRef,
}

struct Prefill {
    // Field order: sessions close before their engine.
    sessions: Vec<(std::sync::Arc<SenderSession>, usize)>,
    _engine: Engine,
    _pool: HostPool,
}

fn shape(kind: ModelKind, heads: u32, tp_rank: u32, tp: u32) -> PoolShape {
    let head_dim = if kind == ModelKind::Mla { 24 } else { 8 };
    PoolShape::new(kind, heads, head_dim, 2, PAGE, LAYERS).with_tp(tp_rank, tp)
}

/// Prefill TP `src_tp` into decode TP `dst_tp` for a model of `heads` KV heads: two chunks, every
/// decode byte checked, each decode rank's bytes received equal to its pool's share of the chunk's
/// tokens (its heads once).
fn transfer(kind: ModelKind, heads: u32, src_tp: u32, dst_tp: u32) {
    let what = format!("{kind:?} H={heads} P{src_tp}->D{dst_tp}");
    let decodes: Vec<Decode> = (0..dst_tp)
        .map(|d| {
            let engine = Engine::new(EngineOptions::default()).unwrap();
            let pool = HostPool::new(shape(kind, heads, d, dst_tp), 16);
            engine.register_pool(pool.layout.clone()).unwrap();
            engine.register_staging(None, 1 << 20).unwrap();
            let (key, _) = engine.receiver().open_room(RoomOpening::new(7, &DST_PAGES, CHUNK_TOKENS)).unwrap();
            Decode { engine, pool, room: RoomRef { id: 7, key } }
        })
        .collect();
    let prefills: Vec<Prefill> = (0..src_tp)
        .map(|r| {
            let src = shape(kind, heads, r, src_tp);
            let engine = Engine::new(EngineOptions::default()).unwrap();
            let mut pool = HostPool::new(src.clone(), 16);
            pool.fill(&SRC_PAGES, 0);
            engine.register_pool(pool.layout.clone()).unwrap();
            let peers = decode_peers(&src, &[shape(kind, heads, 0, dst_tp)]).unwrap();
            let sessions = peers
                .iter()
                .map(|p| {
                    let d = p.tp_rank as usize;
                    let id = format!("p{r}-d{d}");
                    (engine.connect(&decodes[d].engine.local_addr().to_string(), &id, None).unwrap(), d)
                })
                .collect();
            Prefill { sessions, _engine: engine, _pool: pool }
        })
        .collect();
    // The decode side's view of the pairing is the inverse of the prefill side's.
    for (d, _) in decodes.iter().enumerate() {
        let from: Vec<u32> = prefill_peers(&shape(kind, heads, d as u32, dst_tp), &[shape(kind, heads, 0, src_tp)]).unwrap().iter().map(|p| p.tp_rank).collect();
        let to: Vec<u32> = prefills.iter().enumerate().filter(|(_, p)| p.sessions.iter().any(|(_, x)| *x == d)).map(|(r, _)| r as u32).collect();
        assert_eq!(from, to, "{what}: the writers of decode rank {d}");
    }
    for chunk in 0..2u32 {
        let pages = SRC_PAGES[(chunk * 2) as usize..(chunk * 2 + 2) as usize].to_vec();
        // Last prefill rank first: arrival order is not rank order.
        for p in prefills.iter().rev() {
            for (s, d) in &p.sessions {
                let desc = TransferDesc { room: decodes[*d].room, chunk, pages: pages.clone(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
                let rc = s.transfer(&desc, &Op::new(s.waker())).unwrap_or_else(|e| panic!("{what}: chunk {chunk} to decode {d}: {}", e.chain()));
                assert_eq!(rc, Status::KVSTAGE_OK);
            }
        }
    }
    for (d, dec) in decodes.iter().enumerate() {
        dec.engine.receiver().wait_room(dec.room, Some(Duration::from_secs(10))).unwrap_or_else(|e| panic!("{what}: decode {d}: {}", e.chain()));
        let (bad, first) = dec.pool.verify(&DST_PAGES, 0);
        assert_eq!(bad, 0, "{what}: decode rank {d}: {first:?}");
        let s = &dec.pool.layout.shape;
        let own: u64 = (0..s.buffers_per_layer()).map(|kv| s.token_bytes_of(kv)).sum::<u64>() * LAYERS as u64 * (DST_PAGES.len() as u64 * PAGE as u64);
        assert_eq!(dec.engine.stats().receive.bytes_received, own, "{what}: decode rank {d} received its heads once");
    }
    let sent: u64 = prefills.iter().flat_map(|p| &p.sessions).map(|(s, _)| s.stats().send.bytes_sent).sum();
    let received: u64 = decodes.iter().map(|d| d.engine.stats().receive.bytes_received).sum();
    assert_eq!(sent, received, "{what}");
}

#[test]
fn three_prefill_ranks_into_two_and_back() {
    transfer(ModelKind::Mha, 12, 3, 2);
    transfer(ModelKind::Mha, 12, 2, 3);
    transfer(ModelKind::Mha, 6, 3, 2);
}

#[test]
fn four_into_six_and_six_into_four() {
    transfer(ModelKind::Mha, 12, 4, 6);
    transfer(ModelKind::Mha, 12, 6, 4);
}

#[test]
fn replicated_heads_on_both_sides() {
    // 4 heads: each held by 2 prefill ranks and by 3 decode ranks (and the reverse).
    transfer(ModelKind::Mha, 4, 8, 12);
    transfer(ModelKind::Mha, 4, 12, 8);
    // 2 heads over P4→D6: two prefill and three decode ranks per head.
    transfer(ModelKind::Mha, 2, 4, 6);
}

#[test]
fn mla_latent_from_one_rank_whatever_the_sizes() {
    transfer(ModelKind::Mla, 1, 3, 2);
    transfer(ModelKind::Mla, 1, 2, 3);
}
