//! Prefill-side GQA replication over real loopback TCP: with TP 4 and 2 KV heads every head lives
//! on two prefill ranks, and exactly one copy of each crosses the wire. Every prefill rank may
//! still open its session (an engine that pairs by TP ratio does); the replicas' transfers
//! succeed with nothing sent, and the decode pool holds the reference bytes.

use std::time::Duration;

use kvstage::engine::{Engine, EngineOptions};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{decode_peers, staging_layout, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage::Status;
use kvstage_testkit::HostPool;

#[test]
fn each_replicated_head_crosses_the_wire_once() {
    let (heads, prefill_tp, page_size, layers) = (2, 4, 4, 3);
    let base = PoolShape::new(ModelKind::Mha, heads, 16, 2, page_size, layers);
    let dst_shape = base.clone().with_tp(0, 1);
    let pages: Vec<u32> = (0..8).collect();
    let tokens = pages.len() as u32 * page_size;

    let decode = Engine::new(EngineOptions::default()).unwrap();
    let dpool = HostPool::new(dst_shape.clone(), 8);
    decode.register_pool(dpool.layout.clone()).unwrap();
    let chunk_bytes = staging_layout(&base.clone().with_tp(0, prefill_tp), &dst_shape, tokens).unwrap().total_bytes;
    decode.register_staging(None, 2 * chunk_bytes as usize).unwrap();
    let (key, _) = decode.receiver().open_room(RoomOpening::new(7, &pages, tokens)).unwrap();
    let room = RoomRef { id: 7, key };
    let addr = decode.local_addr().to_string();

    let mut prefill = Vec::new();
    for rs in 0..prefill_tp {
        let shape = base.clone().with_tp(rs, prefill_tp);
        // The pairing helper lists only the rank of each head group that sends.
        let peers = decode_peers(&shape, std::slice::from_ref(&dst_shape)).unwrap();
        assert_eq!(peers.len(), usize::from(rs % 2 == 0), "prefill rank {rs}: {peers:?}");
        let engine = Engine::new(EngineOptions::default()).unwrap();
        let mut pool = HostPool::new(shape, 8);
        pool.fill(&pages, 0);
        engine.register_pool(pool.layout.clone()).unwrap();
        let session = engine.connect(&addr, &format!("p{rs}"), None).unwrap();
        prefill.push((engine, pool, session));
    }
    for (rs, (_, _, session)) in prefill.iter().enumerate() {
        let desc = TransferDesc { room, chunk: 0, pages: pages.clone(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
        let status = session.transfer(&desc, &Op::new(session.waker())).unwrap_or_else(|e| panic!("rank {rs}: {}", e.chain()));
        assert_eq!(status, Status::KVSTAGE_OK, "prefill rank {rs}");
    }
    decode.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = dpool.verify(&pages, 0);
    assert_eq!(bad, 0, "{first:?}");

    // Bytes: the decode rank's two heads once, not four copies.
    let distinct = tokens as u64 * dst_shape.local_heads as u64 * 16 * 2 * layers as u64 * 2;
    assert_eq!(chunk_bytes, distinct);
    assert_eq!(decode.stats().receive.bytes_received, distinct);
    let sent: Vec<u64> = prefill.iter().map(|(_, _, s)| s.stats().send.bytes_sent).collect();
    assert_eq!(sent, [distinct / 2, 0, distinct / 2, 0]);
    decode.receiver().release_room(room, None).unwrap();
}
