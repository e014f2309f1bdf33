//! Stuck is reported, not only timed out: a transfer that waits without progress logs one WARN
//! line, once per wait, naming its session, room and chunk and what it waits on — in the stuck
//! situations a sender can meet: the receiver's watermark held by an older allocation nobody
//! finishes, a receiver that never answers the allocation (a peer that stopped reading), and a
//! layer-wise transfer whose last layer is never marked ready. While each one is stuck, the
//! describe documents say the same from both sides: the operation's phase and what it waits on,
//! the decode room's chunk phase and its culprit. No timing is asserted beyond the transfers' own
//! deadlines (the documents are polled until the stuck phase shows, within the deadline).

mod common;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use common::*;
use kvstage::engine::logging;
use kvstage::engine::{Engine, EngineOptions, StallWarn};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::describe::{describe_op, OpDescription};
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::session::sender::TransferDesc;
use kvstage::Status;
use kvstage_testkit::HostPool;

/// Every WARN line of `session` logged while `f` runs: (session, message).
fn warnings_during<T>(f: impl FnOnce() -> T) -> (T, Vec<(String, String)>) {
    let lines: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let sink = lines.clone();
    logging::set_callback(Some((
        Box::new(move |l: &logging::Line<'_>| sink.lock().push((l.session.to_owned(), l.message.to_owned()))),
        log::LevelFilter::Warn,
    )))
    .unwrap();
    let out = f();
    logging::set_callback(None).unwrap();
    let lines = lines.lock().clone();
    (out, lines)
}

/// A prefill engine (rank `rank` of TP 2 of `geo`) whose stalls are reported after 300 ms.
fn prefill(geo: &Geometry, rank: u32) -> (Engine, HostPool) {
    let engine = Engine::new(EngineOptions { stall_warn: StallWarn::After(Duration::from_millis(300)), ..prefill_options() }).unwrap();
    let mut pool = HostPool::new(geo.shape(rank, 2), geo.pool_pages);
    pool.fill(&(0..geo.pool_pages as u32).collect::<Vec<_>>(), 0);
    engine.register_pool(pool.layout.clone()).unwrap();
    (engine, pool)
}

/// The operation's document once it reached `phase` (polled; `None` if it never does while it runs).
fn op_in_phase(op: &Op, phase: &str) -> Option<OpDescription> {
    let mut seen = None;
    settle(Duration::from_secs(2), || {
        seen = describe_op(op).filter(|d| d.phase == phase);
        seen.is_some()
    });
    seen
}

/// Room `room`'s document on `engine`, parsed.
fn room_doc(engine: &Engine, room: RoomRef) -> serde_json::Value {
    serde_json::to_value(engine.receiver().describe_room(room).unwrap()).unwrap()
}

fn stalls<'a>(lines: &'a [(String, String)], session: &str) -> Vec<&'a str> {
    lines.iter().filter(|(s, m)| s == session && m.contains("no progress for")).map(|(_, m)| m.as_str()).collect()
}

#[test]
fn a_watermark_held_by_an_unfinished_allocation_is_reported_once() {
    let _serial = serial();
    // A ring of one chunk: a granted chunk nobody finishes holds the watermark for every later one.
    let ring = SMALL.layout(0, 2).total_bytes as usize;
    let decode = EngineOptions { stall_warn: StallWarn::After(Duration::from_millis(300)), ..decode_options(&SMALL) };
    let c = Cluster::new(SMALL, decode, RingSpec::Owned(ring));
    let held = open_room(&c.decode, 61, &c.room_pages(61, 1), SMALL.chunk_tokens);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "holder", b"");
    raw.alloc_granted(1, held, 0, 0, &SMALL.layout(0, 2));
    let room = open_room(&c.decode, 62, &c.room_pages(62, 1), SMALL.chunk_tokens);
    let (engine, _pool) = prefill(&SMALL, 0);
    let s = engine.connect(&c.addr().to_string(), "stalled-watermark", None).unwrap();
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    // The engine's own request id, as the trace id both sides put in front of the request's lines.
    let desc = TransferDesc { room, chunk: 0, pages: src, timeout: Some(Duration::from_secs(2)), trace: Some("req-62".into()), ..Default::default() };
    let (result, lines) = warnings_during(|| {
        let op = s.transfer_async(desc, false, 0).unwrap();
        // While stuck: the operation waits for the watermark, the decode room's chunk waits
        // behind room 61's allocation, which waits for writers (one never asked).
        let d = op_in_phase(&op, "waiting_for_watermark").expect("the operation reaches the watermark wait");
        assert!((d.session.as_str(), d.trace.as_str(), d.room, d.chunk, d.status) == ("stalled-watermark", "req-62", 62, 0, "KVSTAGE_PENDING"), "{d:?}");
        assert!(d.waits_on.contains("an older allocation there still holds the space") && d.deadline_left_ms.is_some(), "{d:?}");
        let blocked = room_doc(&c.decode, room);
        let chunk = &blocked["chunks"][0];
        assert_eq!(chunk["phase"], "waiting_for_watermark", "{blocked}");
        assert_eq!(blocked["trace"], "req-62", "the decode room took the writer's trace id: {blocked}");
        assert_eq!(chunk["grant"]["waits_behind"], serde_json::json!({"room": 61, "chunk": 0}), "{blocked}");
        let holder = room_doc(&c.decode, held);
        let chunk = &holder["chunks"][0];
        assert_eq!((chunk["phase"].as_str(), chunk["grant"]["ring_position"].as_u64()), (Some("granted"), Some(0)), "{holder}");
        assert_eq!(chunk["writers"][0]["session"], "holder", "{holder}");
        assert_eq!((chunk["writers"][0]["landed"].as_u64(), chunk["writers"][0]["ready"].as_bool()), (Some(0), Some(false)), "{holder}");
        assert!(chunk["unclaimed_slabs"].as_u64().unwrap() > 0, "the other prefill rank never asked: {holder}");
        let engine_doc = serde_json::to_value(c.decode.describe()).unwrap();
        assert_eq!(engine_doc["receiver"]["ring"]["allocations"][0]["room"], 61, "{engine_doc}");
        let prefill_doc = serde_json::to_value(engine.describe()).unwrap();
        assert_eq!(prefill_doc["sessions"][0]["running"], serde_json::json!([{"room": 62, "chunk": 0}]), "{prefill_doc}");
        op.wait(None)
    });
    assert_eq!(result.unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT);
    let reported = stalls(&lines, "stalled-watermark");
    assert_eq!(reported.len(), 1, "one report per stalled wait: {lines:?}");
    let line = reported[0];
    assert!(line.starts_with("[req-62] room 62 chunk 0: no progress for"), "{line}");
    assert!(line.contains("waiting for the receiver's watermark") && line.contains("an older allocation on the receiver still holds"), "{line}");
    assert!(!line.contains(&held.key.to_string()) && !line.contains(&room.key.to_string()), "a key in the log: {line}");
    // The decode side names the culprit: the allocation that holds the ring and who owes it.
    // The raw holder named no trace id: its room's is derived from the opening.
    let derived = format!("[{}] room 61 chunk 0:", kvstage::protocol::trace::derived_trace(held));
    let culprit: Vec<&str> = lines.iter().filter(|(s, m)| s.is_empty() && m.starts_with(&derived)).map(|(_, m)| m.as_str()).collect();
    assert_eq!(culprit.len(), 1, "one decode-side report of the allocation holding the ring: {lines:?}");
    let c0 = culprit[0];
    assert!(c0.contains("its allocation of ring round 0") && c0.contains("holds it until the chunk completes") && c0.contains("session holder (prefill tp 0 pp 0): 0 of 8192 bytes landed, not ready"), "{c0}");
    assert!(c0.contains("claimed by no writer yet"), "the other prefill rank never asked: {c0}");
    // The blocked chunk's own report says what it waits behind, not that it holds the ring.
    // One grep for the request's id finds both sides' lines about it.
    let blocked: Vec<&str> = lines.iter().filter(|(s, m)| s.is_empty() && m.starts_with("[req-62] room 62 chunk 0:")).map(|(_, m)| m.as_str()).collect();
    assert!(blocked.len() == 1 && blocked[0].contains("waits behind room 61 chunk 0 (the ring's oldest allocation) for the watermark"), "{lines:?}");
    drop(raw);
}

#[test]
fn an_allocation_never_answered_is_reported_once() {
    let _serial = serial();
    // The receiver stops reading this session's frames (test fault): the allocation is never answered.
    let mut options = decode_options(&SMALL);
    options.faults = Some(Faults { plan: FaultPlan { stop_reading_after: Some(0), ..FaultPlan::default() }, counters: Arc::new(FaultCounters::default()) });
    let c = Cluster::new(SMALL, options, RingSpec::Owned(4 * SMALL.layout(0, 2).total_bytes as usize));
    let room = open_room(&c.decode, 63, &c.room_pages(63, 1), SMALL.chunk_tokens);
    let (engine, _pool) = prefill(&SMALL, 0);
    let s = engine.connect(&c.addr().to_string(), "stalled-reader", None).unwrap();
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let desc = TransferDesc { room, chunk: 0, pages: src, timeout: Some(Duration::from_secs(2)), ..Default::default() };
    let (result, lines) = warnings_during(|| {
        let op = s.transfer_async(desc, false, 0).unwrap();
        let d = op_in_phase(&op, "waiting_for_allocation").expect("the operation waits for its allocation");
        assert!(d.waits_on.contains(&c.addr().to_string()), "names the receiver: {d:?}");
        // The receiver never read the request: nobody asked for the chunk there.
        assert_eq!(room_doc(&c.decode, room)["chunks"][0]["phase"], "not_started");
        let r = op.wait(None);
        let ended = describe_op(&op).unwrap();
        assert_eq!((ended.phase, ended.status, ended.deadline_left_ms), ("failed", "KVSTAGE_E_TIMEOUT", None), "{ended:?}");
        r
    });
    assert_eq!(result.unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT);
    let reported = stalls(&lines, "stalled-reader");
    assert_eq!(reported.len(), 1, "{lines:?}");
    let derived = kvstage::protocol::trace::derived_trace(room);
    assert!(reported[0].starts_with(&format!("[{derived}] room 63 chunk 0: no progress for")) && reported[0].contains("waiting for the allocation from the receiver"), "{}", reported[0]);
}

#[test]
fn a_layer_never_marked_ready_is_reported_once_naming_it() {
    let _serial = serial();
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Owned(4 * SMALL.layout(0, 2).total_bytes as usize));
    let room = open_room(&c.decode, 64, &c.room_pages(64, 1), SMALL.chunk_tokens);
    let (engine, _pool) = prefill(&SMALL, 0);
    let s = engine.connect(&c.addr().to_string(), "stalled-layers", None).unwrap();
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let gate = s.layer_gate();
    let desc = TransferDesc { room, chunk: 0, pages: src, timeout: Some(Duration::from_secs(2)), layers: Some(gate.clone()), ..Default::default() };
    let ((), lines) = warnings_during(|| {
        let op = s.transfer_async(desc, false, 0).unwrap();
        // Every layer but the last (the pool's layer ids are 0..layers).
        let layers = SMALL.shape(0, 2).layer_ids.len() as u32;
        gate.mark(0, layers - 1, None).unwrap();
        let d = op_in_phase(&op, "waiting_for_layers").expect("the operation waits for the last layer");
        assert!(d.waits_on.contains(&format!("layers {} of the chunk are not marked", layers - 1)), "{d:?}");
        // The decode side has the marked layers' bytes, not the writer's ready.
        let doc = room_doc(&c.decode, room);
        let chunk = &doc["chunks"][0];
        assert_eq!(chunk["phase"], "writing", "{doc}");
        let w = &chunk["writers"][0];
        assert!(w["landed"].as_u64().unwrap() < w["expected"].as_u64().unwrap() && !w["ready"].as_bool().unwrap(), "{doc}");
        assert_eq!(op.wait(None).unwrap_err().code(), Status::KVSTAGE_E_TIMEOUT);
    });
    let reported = stalls(&lines, "stalled-layers");
    let last = SMALL.shape(0, 2).layer_ids.len() - 1;
    assert_eq!(reported.len(), 1, "{lines:?}");
    assert!(reported[0].contains(&format!("layers {last} of this chunk are not marked")), "{}", reported[0]);
}
