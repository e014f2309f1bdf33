//! Races on the decode side, observed through canaries: the staging ring is caller memory (a
//! larger canary-filled allocation whose middle part is registered) and every decode pool page
//! not being received holds a canary. A raw peer (the wire protocol by hand) controls the timing:
//! it sends a data header and part of its payload, pauses, and the test thread then releases the
//! room, aborts from a co-writer, replaces the ring, or reopens the room id.
//!
//! After each race: canary margins and ring bytes outside the grants are intact, pool pages
//! outside the rooms are intact, the ring drains, and a full legitimate transfer into the same
//! room id verifies against the reference.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kvstage::protocol::{Message, RoomRef};
use kvstage::session::receiver::RoomOpening;
use kvstage::Status;

const MARGIN: usize = 4096;
const PAUSE: Duration = Duration::from_millis(300);
const BOUND: Duration = Duration::from_secs(5);

/// A raw writer 0 (prefill TP 2 rank 0) that holds a grant for (room, chunk 0) and is stalled
/// inside its data payload: the header and the first half of the payload went out.
struct Stalled {
    raw: RawPeer,
    grant: RawGrant,
    /// Ring range of writer 0's region.
    region: std::ops::Range<usize>,
    half: usize,
}

const FIRST: u8 = 0xD1;
const SECOND: u8 = 0xD2;

fn stall_writer0(c: &Cluster, room: RoomRef, session: &str) -> Stalled {
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), session, b"");
    let grant = raw.alloc_granted(1, room, 0, 0, &layout);
    assert_eq!(grant.len, layout.total_bytes);
    let half = w0.bytes as usize / 2;
    // The receiver places regions in allocation order: writer 0's lies where the grant says.
    raw.send(&Message::Data { room, chunk: 0, writer: 0, offset: grant.region, len: w0.bytes }).unwrap();
    raw.send_bytes(&vec![FIRST; half]).unwrap();
    std::thread::sleep(PAUSE); // the engine is now inside the payload read
    let start = (grant.offset + grant.region) as usize;
    Stalled { raw, grant, region: start..start + w0.bytes as usize, half }
}

impl Stalled {
    /// The rest of the payload, then the writer's ready; the engine's answer (an `Arrived`).
    fn finish(&mut self, req: u64, room: RoomRef) -> Message {
        let rest = self.region.len() - self.half;
        self.raw.send_bytes(&vec![SECOND; rest]).expect("the rest of the payload");
        self.raw.send(&Message::ChunkReady { req, room, chunk: 0, writer: 0, checksum: None }).unwrap();
        self.raw.reply(BOUND)
    }

    /// The region holds the first half and, if `second`, the second half of what was sent.
    fn check_landed(&self, ring: &CanaryRing, second: bool) {
        let got = ring.read(self.region.start, self.region.len());
        assert!(got[..self.half].iter().all(|&b| b == FIRST), "the first half of the payload is not where it was granted");
        if second {
            assert!(got[self.half..].iter().all(|&b| b == SECOND), "the second half of the payload is not where it was granted");
        }
    }
}

fn canary_ring(salt: u64) -> CanaryRing {
    CanaryRing::new(4 * SMALL.layout(0, 2).total_bytes as usize, MARGIN, salt)
}

fn assert_pool_untouched(c: &Cluster, what: &str) {
    let (stray, first) = pool_scan_canary(&c.dpool, &all_pages(&c.dpool));
    assert_eq!(stray, 0, "[{what}] {stray} decode pool bytes changed; first at {first:?}");
}

/// A release while a writer is stalled inside its payload into the ring: the read stops at its
/// next look at its room (every 200 ms while nothing comes) and the range goes back with only the
/// first half landed; the rest of the payload, when it comes, is read and discarded (it lands
/// nowhere, the session is kept) and the late ready is refused; the room id opens again at once.
#[test]
fn release_during_a_payload_read_frees_the_range_once_the_read_stops() {
    let _serial = serial();
    let ring = canary_ring(1);
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Caller(&ring));
    let rx = c.decode.receiver();
    let room = 1;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    let mut w = stall_writer0(&c, at, "stalled-w0");
    assert_eq!(rx.stats().ring_live, 1);

    let took = release_bounded(&c.decode, at, BOUND);
    assert!(settle(BOUND, || rx.stats().ring_live == 0), "the stalled read kept its range after the release: {:?}", rx.stats());
    eprintln!("release during a payload read: release_room returned after {took:?}, the range went back");
    w.check_landed(&ring, false);
    let first_half = w.region.start..w.region.start + w.half;
    ring.check("released during a read", std::slice::from_ref(&first_half));
    // The rest of the payload and the ready: discarded and refused, the session served on.
    match w.finish(2, at) {
        Message::Arrived { req: 2, status, reason } => {
            eprintln!("release during a payload read: late ready answered {status}: {reason}");
            assert_ne!(status, 0, "a chunk of a released room was acknowledged");
        }
        other => panic!("expected Arrived 2, got {other:?}"),
    }
    ring.check("the rest of a released room's payload", &[first_half]);
    w.raw.barrier(3, 0);
    assert_pool_untouched(&c, "release during a payload read");
    c.legit_transfer("after the release race", Some(room), 1);
    assert!(settle(BOUND, || rx.stats().ring_live == 0), "the ring did not drain: {:?}", rx.stats());
    assert_eq!(rx.stats().panics, 0);
}

#[test]
fn co_writer_abort_during_a_payload_read() {
    let _serial = serial();
    let ring = canary_ring(2);
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Caller(&ring));
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let room = 2;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    // Writer 1 (prefill TP 2 rank 1) takes its slot of the same chunk first.
    let (mut w1, _) = RawPeer::handshake(c.addr(), &SMALL.shape(1, 2), "co-writer-w1", b"");
    let g1 = w1.alloc_granted(1, at, 0, 1, &layout);
    let mut w0 = stall_writer0(&c, at, "stalled-w0");
    assert_eq!(g1.offset, w0.grant.offset, "both writers of a chunk share one allocation");

    w1.send(&Message::Abort { room: at, chunk: 0, reason: "co-writer gives up".into() }).unwrap();
    w1.barrier(2, 1);
    let e = rx.wait_room(at, Some(BOUND)).unwrap_err();
    eprintln!("co-writer abort: room {room}: {:?}: {}", e.code(), e.chain());
    assert_eq!(e.code(), Status::KVSTAGE_E_CANCELED, "{}", e.chain());
    std::thread::sleep(Duration::from_millis(100));
    let live = rx.stats().ring_live;
    if live == 0 {
        let closed = w0.raw.wait_closed(Duration::from_secs(2));
        assert!(closed.after.is_some(), "the failed room's range was freed while writer 0's read was still open");
        w0.check_landed(&ring, false);
    } else {
        assert_eq!(live, 1, "the failed room's range must stay pinned by writer 0's read");
        match w0.finish(3, at) {
            Message::Arrived { req: 3, status, reason } => {
                eprintln!("co-writer abort: writer 0's ready answered {status}: {reason}");
                assert_ne!(status, 0, "a chunk of an aborted room was acknowledged");
            }
            other => panic!("expected Arrived 3, got {other:?}"),
        }
        assert!(settle(BOUND, || rx.stats().ring_live == 0), "the ring did not drain: {:?}", rx.stats());
        w0.check_landed(&ring, true);
        w0.raw.barrier(4, 0);
    }
    ring.check("co-writer abort", &[w0.region.clone()]);
    assert_pool_untouched(&c, "co-writer abort");
    let took = release_bounded(&c.decode, at, BOUND);
    eprintln!("co-writer abort: release of the failed room took {took:?}");
    // The ring is empty: the next grant starts a new round at offset 0.
    c.legit_transfer("after the co-writer abort", Some(room), 1);
    let total = layout.total_bytes as usize;
    ring.check("co-writer abort, then a full transfer", &[w0.region.clone(), 0..total]);
    assert_eq!(rx.stats().panics, 0);
}

#[test]
fn register_staging_during_a_read_fails_until_the_room_is_drained() {
    let _serial = serial();
    let ring1 = canary_ring(3);
    let ring2 = canary_ring(4);
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Caller(&ring1));
    let rx = c.decode.receiver();
    let room = 3;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    let mut w = stall_writer0(&c, at, "stalled-w0");

    let e = c.decode.register_staging(Some(ring2.ptr()), ring2.len).unwrap_err();
    eprintln!("register_staging during a read: {:?}: {}", e.code(), e.chain());
    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
    assert!(e.chain().contains("live allocation"), "{}", e.chain());
    release_bounded(&c.decode, at, BOUND);
    std::thread::sleep(Duration::from_millis(100));
    if rx.stats().ring_live > 0 {
        // Released, but the read still pins its range: still refused.
        let e = c.decode.register_staging(Some(ring2.ptr()), ring2.len).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
        match w.finish(2, at) {
            Message::Arrived { req: 2, status, .. } => assert_ne!(status, 0),
            other => panic!("expected Arrived 2, got {other:?}"),
        }
        assert!(settle(BOUND, || rx.stats().ring_live == 0), "the ring did not drain: {:?}", rx.stats());
        w.check_landed(&ring1, true);
    } else {
        assert!(w.raw.wait_closed(Duration::from_secs(2)).after.is_some(), "range freed under an open read");
        w.check_landed(&ring1, false);
    }
    c.decode.register_staging(Some(ring2.ptr()), ring2.len).expect("a drained ring can be replaced");
    c.legit_transfer("on the replacement ring", Some(room), 1);
    let total = SMALL.layout(0, 2).total_bytes as usize;
    ring1.check("the old ring", &[w.region.clone()]);
    ring2.check("the replacement ring", std::slice::from_ref(&(0..total)));
    assert_pool_untouched(&c, "ring replacement");
    assert_eq!(rx.stats().panics, 0);
}

#[test]
fn reopen_during_the_release_of_a_slice_read() {
    let _serial = serial();
    let ring = canary_ring(5);
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Caller(&ring));
    let rx = c.decode.receiver();
    let room = 4;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    let layout = SMALL.layout(0, 2);
    let heads = layout.writers[0].heads;
    let head_bytes = SMALL.head_dim * 2;
    let row = heads.num_heads * head_bytes;
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "slice-w0", b"");
    // One token row of writer 0's heads, straight into the room's first page: half of it.
    raw.send(&Message::Slice { room: at, chunk: 0, buffer: 0, token: 0, byte_offset: heads.dst_head_start * head_bytes, len: row }).unwrap();
    raw.send_bytes(&vec![FIRST; row as usize / 2]).unwrap();
    std::thread::sleep(PAUSE);

    let released = AtomicBool::new(false);
    let (mut still_releasing, mut already_open) = (0, 0);
    let (release_took, reopened_after, reopened) = std::thread::scope(|s| {
        let start = Instant::now();
        let releaser = s.spawn(|| {
            let took = release_bounded(&c.decode, at, BOUND);
            released.store(true, Ordering::SeqCst);
            took
        });
        let (reopened, at) = loop {
            assert!(start.elapsed() < BOUND * 2, "open_room never succeeded after the release");
            match rx.open_room(RoomOpening::new(room, &pages, SMALL.chunk_tokens)) {
                Ok((key, _)) => break (start.elapsed(), RoomRef { id: room, key }),
                Err(e) => {
                    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
                    if e.message().contains("still being released") {
                        still_releasing += 1;
                    } else {
                        assert!(e.message().contains("already open") && still_releasing == 0, "{}", e.chain());
                        already_open += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let released_first = released.load(Ordering::SeqCst);
        // From the reopen on, nothing may land in the pages: the partial row is wiped, the
        // sender pushes the rest of its payload (if its connection still lets it).
        pool_fill_canary(&c.dpool, &pages);
        let rest = raw.send_bytes(&vec![SECOND; row as usize - row as usize / 2]);
        std::thread::sleep(Duration::from_millis(200));
        assert_pool_untouched(&c, "after the reopen");
        let took = releaser.join().unwrap();
        eprintln!(
            "slice read: release_room took {took:?}; reopen succeeded after {reopened:?} (release returned first: {released_first}); \
             refusals: {still_releasing} \"still being released\", {already_open} \"already open\"; late payload write: {rest:?}"
        );
        (took, reopened, at)
    });
    assert!(still_releasing > 0, "open_room never saw the room being released (release took {release_took:?})");
    assert!(release_took < BOUND && reopened_after < BOUND);
    let closed = raw.wait_closed(Duration::from_secs(2));
    assert!(closed.after.is_some(), "the stalled slice reader's connection was not shut down by the release");
    // The reopened room takes a full staged transfer.
    rx.release_room(reopened, None).unwrap();
    c.legit_transfer("after the slice-read release", Some(room), 1);
    assert_eq!(rx.stats().panics, 0);
}

/// Larger chunks (8 MiB a chunk) so the scatter takes a while.
const BIG: Geometry = Geometry { heads: 8, head_dim: 128, layers: 8, page: 4, chunk_tokens: 256, pool_pages: 128 };

#[test]
fn reopen_during_a_scatter_waits_for_it() {
    let _serial = serial();
    let total = BIG.layout(0, 2).total_bytes as usize;
    let ring = CanaryRing::new(2 * total, MARGIN, 6);
    let c = Cluster::new(BIG, decode_options(&BIG), RingSpec::Caller(&ring));
    let rx = c.decode.receiver();
    let room = 5;
    let pages = c.room_pages(room, 1);
    let mut at = open_room(&c.decode, room, &pages, BIG.chunk_tokens);
    const ROUNDS: usize = 12;
    let (mut hits, mut refusals) = (0, 0);
    let mut release_max = Duration::ZERO;
    for round in 0..ROUNDS {
        // Every writer's ready is acknowledged before the scatter is queued: when the last
        // transfer returns, the scatter is queued or running.
        c.send_room(at, &pages, &format!("scatter-{round}")).unwrap_or_else(|e| panic!("round {round}: {}", e.chain()));
        let mut seen = 0;
        std::thread::scope(|s| {
            let (old, decode) = (at, &c.decode);
            let releaser = s.spawn(move || release_bounded(decode, old, BOUND));
            let start = Instant::now();
            loop {
                assert!(start.elapsed() < BOUND * 2, "open_room never succeeded");
                match rx.open_room(RoomOpening::new(room, &pages, BIG.chunk_tokens)) {
                    Ok((key, _)) => {
                        at = RoomRef { id: room, key };
                        break;
                    }
                    Err(e) => {
                        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG, "{}", e.chain());
                        assert!(e.message().contains("still being released") || e.message().contains("already open"), "{}", e.chain());
                        seen += e.message().contains("still being released") as u32;
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            // Reopened: the old scatter must be over. Wipe the pages; nothing may write them now.
            pool_fill_canary(&c.dpool, &pages);
            let took = releaser.join().unwrap();
            release_max = release_max.max(took);
            std::thread::sleep(Duration::from_millis(20));
            let (bad, first) = pool_scan_canary(&c.dpool, &pages);
            assert_eq!(bad, 0, "round {round}: {bad} bytes of the reopened room's pages written after open_room succeeded: {first:?}");
        });
        hits += (seen > 0) as u32;
        refusals += seen;
    }
    eprintln!(
        "scatter race: {ROUNDS} rounds; reopen refused as \"still being released\" in {hits} rounds ({refusals} refusals); \
         longest release {release_max:?}"
    );
    // The reopened room takes a full transfer and verifies.
    c.send_room(at, &pages, "final").unwrap();
    rx.wait_room(at, Some(BOUND)).unwrap_or_else(|e| panic!("{}", e.chain()));
    c.verify_room("after the scatter races", room, &pages);
    rx.release_room(at, None).unwrap();
    assert!(settle(BOUND, || rx.stats().ring_live == 0));
    ring.check("scatter races", std::slice::from_ref(&(0..total)));
    assert_eq!(rx.stats().panics, 0);
}
