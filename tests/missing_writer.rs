//! A decode room one prefill rank never writes: its describe document and its timeout name that
//! rank (TP and PP rank) and the layers it owes, for the chunk it started and for the chunk no
//! writer asked for yet (issue 39, item 5).

mod common;

use std::time::Duration;

use common::*;
use kvstage::geometry::MissingWriter;
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::receiver::RoomOpening;
use kvstage::session::sender::TransferDesc;
use kvstage::Status;

#[test]
fn a_room_names_the_prefill_rank_that_never_wrote() {
    let _serial = serial();
    // Prefill TP 2 -> decode TP 1: each chunk needs prefill ranks 0 and 1; only rank 0 writes,
    // and only chunk 0.
    let cluster = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Owned(1 << 20));
    let room = 7;
    let pages = cluster.room_pages(room, 2);
    let (key, grid) = cluster.decode.receiver().open_room(RoomOpening::new(room, &pages, SMALL.chunk_tokens)).unwrap();
    assert_eq!(grid.num_chunks, 2);
    let at = RoomRef { id: room, key };
    let session = cluster.prefill[0].connect(&cluster.addr().to_string(), "only-p0", Some(Duration::from_secs(10))).unwrap();
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let desc = TransferDesc { room: at, chunk: 0, pages: src, timeout: Some(Duration::from_secs(10)), ..Default::default() };
    assert_eq!(session.transfer(&desc, &Op::new(session.waker())).unwrap(), Status::KVSTAGE_OK);

    let layers = vec![0, 1];
    let rank = |tp| MissingWriter { src_tp_rank: tp, src_pp_rank: Some(0), layers: layers.clone() };
    let described = cluster.decode.receiver().describe_room(at).unwrap();
    assert_eq!(described.chunks[0].missing_writers, vec![rank(1)], "chunk 0 waits for prefill rank 1 alone");
    assert_eq!(described.chunks[1].phase, "not_started");
    assert_eq!(described.chunks[1].missing_writers, vec![rank(0), rank(1)], "nobody asked for chunk 1");

    let e = cluster.decode.receiver().wait_room(at, Some(Duration::from_millis(300))).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT);
    assert!(
        e.message().contains("0 of 2 chunks done; chunk 0: prefill tp 1 pp 0 has not written layers 0..=1 (2 layer(s))"),
        "{}",
        e.message()
    );
    cluster.decode.receiver().release_room(at, None).unwrap();
}
