//! A room released while an honest but slow payload is being read into its pages (over TCP, the
//! decode side reading straight into the pool) or into the ring, with a second room pending on the
//! same session: the release returns at once, nothing lands in the pages after it, the rest of the
//! payload is discarded and the session (and its other room) goes on.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvstage::protocol::{Message, RoomRef};
use kvstage::session::Integrity;
use kvstage::transport::faults::{FaultPlan, Faults};

fn options(into_pool: bool) -> kvstage::engine::EngineOptions {
    let plan = FaultPlan { pool_read_min_run: Some(if into_pool { 0 } else { u64::MAX }), ..FaultPlan::default() };
    kvstage::engine::EngineOptions { integrity: Integrity::Off, faults: Some(Faults { plan, counters: Default::default() }), ..decode_options(&SMALL) }
}

/// Writer 0 holds slots in rooms A and B (chunk 0 each); it streams A's payload slowly (an
/// honest but slow link: 256 B every 40 ms, ~1.3 s in all) while the test releases A.
/// Returns (release_room took, room B's state afterwards, the session alive).
fn release_during_slow_payload(into_pool: bool) -> (Duration, String, bool) {
    let _serial = serial();
    let c = Cluster::new(SMALL, options(into_pool), RingSpec::Owned(1 << 20));
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let pages_a = c.room_pages(11, 1);
    let a = open_room(&c.decode, 11, &pages_a, SMALL.chunk_tokens);
    let b = open_room(&c.decode, 12, &c.room_pages(12, 1), SMALL.chunk_tokens);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "slow-w0", b"");
    let ga = raw.alloc_granted(1, a, 0, 0, &layout);
    let _gb = raw.alloc_granted(2, b, 0, 0, &layout);
    raw.send(&Message::Data { room: a, chunk: 0, writer: 0, offset: ga.region, len: w0.bytes }).unwrap();
    let mut writer = raw.stream_clone();
    let total = w0.bytes as usize;
    let trickle = std::thread::spawn(move || {
        let mut sent = 0;
        while sent < total {
            let n = 256.min(total - sent);
            if writer.send_bytes(&vec![0xAB; n]).is_err() {
                return sent;
            }
            sent += n;
            std::thread::sleep(Duration::from_millis(40));
        }
        sent
    });
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    release_bounded(&c.decode, a, Duration::from_secs(5));
    let took = start.elapsed();
    // From here on the pages are the caller's again: nothing may land in them.
    pool_fill_canary(&c.dpool, &pages_a);
    let sent = trickle.join().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let (stray, first) = pool_scan_canary(&c.dpool, &all_pages(&c.dpool));
    assert_eq!(stray, 0, "into_pool {into_pool}: {stray} pool bytes written after release_room returned; first at {first:?}");
    eprintln!("into_pool {into_pool}: release took {took:?}; the writer got {sent} of {total} bytes out");
    let read = c.decode.stats().receive.regions_read_into_pool;
    assert_eq!(read, 0, "into_pool {into_pool}: a region of a released room counted as read");
    std::thread::sleep(Duration::from_millis(100));
    let b_state = match rx.wait_room(b, Some(Duration::from_millis(300))) {
        Ok(s) => format!("ok {s:?}"),
        Err(e) => format!("{:?}: {}", e.code(), e.chain()),
    };
    let alive = sent == total && {
        raw.send(&Message::AllocReq { req: 9, room: RoomRef { id: u64::MAX - 9, key: 1 }, chunk: 0, writer: 0, tokens: 1, bytes: 1, trace: String::new(), pool_tokens: None, direct: false }).is_ok()
            && matches!(raw.recv_reply(Duration::from_secs(2)), Some(Message::AllocRsp { req: 9, .. }))
    };
    eprintln!("into_pool {into_pool}: room B afterwards: {b_state}; session alive: {alive}");
    (took, b_state, alive)
}

#[test]
fn ring_release_during_a_slow_payload_keeps_the_session() {
    let (took, b, alive) = release_during_slow_payload(false);
    assert!(took < Duration::from_millis(100), "{took:?}");
    assert!(alive && b.contains("TIMEOUT"), "room B: {b}; alive {alive}");
}

/// Without the read's stop when its room is released, the release waited for the payload up to its
/// grace, then cut the session, failing room B (another request on the same session).
#[test]
fn into_pool_release_during_a_slow_payload_keeps_the_session() {
    let (took, b, alive) = release_during_slow_payload(true);
    assert!(took < Duration::from_millis(100), "release_room blocked {took:?}");
    assert!(alive && b.contains("TIMEOUT"), "room B: {b}; alive {alive}");
}
