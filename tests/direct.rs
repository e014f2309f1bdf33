//! Direct mode on one host (engines in this process, the same-host path): the decode pool lies in
//! shared memory and the prefill copies each chunk from its pages straight into the decode pages.
//! What the mapped pool must never allow: a writer still copying when its room is released writes
//! into pages the caller got back (the release waits for it), and a receiver that names pages
//! outside its pool gets nothing written there (the sender refuses the grant).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{pool_fill_canary, pool_scan_canary};
use kvstage::engine::{Engine, EngineOptions, TransportKind};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{MemoryKind, ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::transport::faults::{FaultCounters, FaultPlan, Faults};
use kvstage::Status;
use kvstage_testkit::{page_table, HostPool};

const CAPACITY: u64 = 32;
const ROOM: u64 = 5;
const PAGES: usize = 8;

fn shape(rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 4, 16, 2, 16, 3).with_tp(rank, tp)
}

struct Decode {
    engine: Engine,
    pool: HostPool,
    pages: Vec<u32>,
}

/// A decode rank (TP 1) whose pool lies in shared memory, with room `ROOM` open over `PAGES` pages.
fn decode() -> (Decode, RoomRef) {
    let engine = Engine::new(EngineOptions { transport: TransportKind::Shm, ..EngineOptions::default() }).unwrap();
    let pool = HostPool::shared(shape(0, 1), CAPACITY);
    engine.register_pool(pool.layout.clone()).unwrap();
    engine.register_staging(None, 1 << 20).unwrap();
    let pages = page_table(PAGES, CAPACITY, 9, true);
    let (key, _) = engine.receiver().open_room(RoomOpening::new(ROOM, &pages, (PAGES * 16) as u32)).unwrap();
    (Decode { engine, pool, pages }, RoomRef { id: ROOM, key })
}

/// A prefill rank (TP 1) whose pool holds the reference pattern, connected to `to`.
fn prefill(to: &Engine, plan: FaultPlan) -> (Engine, HostPool, Arc<SenderSession>, Vec<u32>) {
    let faults = Faults { plan, counters: Arc::new(FaultCounters::default()) };
    let engine = Engine::new(EngineOptions { transport: TransportKind::Shm, faults: Some(faults), ..EngineOptions::default() }).unwrap();
    let mut pool = HostPool::new(shape(0, 1), CAPACITY);
    let pages = page_table(PAGES, CAPACITY, 4, false);
    pool.fill(&pages, 0);
    engine.register_pool(pool.layout.clone()).unwrap();
    let session = engine.connect(&to.local_addr().to_string(), "direct", None).unwrap();
    (engine, pool, session, pages)
}

/// Sends `desc` on its own thread; returns once the transfer holds its direct grant and copies (its
/// phase is `gathering`, which the test fault's pause holds), and the thread.
fn send_until_copying(session: &Arc<SenderSession>, desc: TransferDesc) -> std::thread::JoinHandle<kvstage::Result<Status>> {
    let op = Op::new(session.waker());
    let writer = {
        let (session, op) = (session.clone(), op.clone());
        std::thread::spawn(move || session.transfer(&desc, &op))
    };
    let copying = common::settle(Duration::from_secs(10), || op.progress().is_some_and(|(p, _)| p.phase == "gathering"));
    assert!(copying, "the transfer never reached its direct copy: {:?}", op.progress().map(|(p, r)| (p.phase, r.map(|r| r.map_err(|e| e.chain())))));
    writer
}

fn chunk(room: RoomRef, pages: &[u32]) -> TransferDesc {
    TransferDesc { room, chunk: 0, pages: pages.to_vec(), timeout: Some(Duration::from_secs(20)), ..Default::default() }
}

/// A writer pauses 3 s holding the decode pool's mapping before it copies; the room is released
/// while it pauses (a first release bounded at 1 s fails with TIMEOUT). The release returns only once that writer can no longer write (here: its
/// session cut after the release's grace, its copy finished, its mapping gone), so pages the caller
/// refills right after the release keep what it wrote. The room id then opens again for another
/// request, which lands whole. Without the release's hold on direct writers, the copy lands over a
/// second after the release returned, over the caller's bytes.
#[test]
fn a_release_waits_for_a_direct_writer_still_copying() {
    let (d, room) = decode();
    let (_pe, _pp, session, src_pages) = prefill(&d.engine, FaultPlan { direct_pause_ms: 3000, ..FaultPlan::default() });
    let writer = send_until_copying(&session, chunk(room, &src_pages));
    // A release bounded below the pause ends by its bound, naming the writer; the pages and the id
    // are not free yet.
    let held = d.engine.receiver().release_room(room, Some(Duration::from_secs(1))).unwrap_err();
    assert_eq!(held.code(), Status::KVSTAGE_E_TIMEOUT, "{}", held.chain());
    assert!(held.chain().contains("still hold its pages"), "{}", held.chain());
    assert!(d.engine.receiver().open_room(RoomOpening::new(ROOM, &d.pages, (PAGES * 16) as u32)).is_err(), "a room id reopened while a writer held its pages");
    d.engine.receiver().release_room(room, None).unwrap();
    pool_fill_canary(&d.pool, &d.pages);
    let sent = writer.join().unwrap();
    assert!(sent.is_err(), "a transfer into a released room succeeded: {sent:?}");
    std::thread::sleep(Duration::from_millis(300));
    let (bad, first) = pool_scan_canary(&d.pool, &d.pages);
    assert_eq!(bad, 0, "{bad} bytes of the released room's pages changed after the release returned (first: {first:?})");

    let (key, _) = d.engine.receiver().open_room(RoomOpening::new(ROOM, &d.pages, (PAGES * 16) as u32)).unwrap();
    let (_pe2, _pp2, fresh, src_pages) = prefill(&d.engine, FaultPlan::default());
    let reopened = RoomRef { id: ROOM, key };
    let status = fresh.transfer(&chunk(reopened, &src_pages), &Op::new(fresh.waker())).unwrap();
    assert_eq!(status, Status::KVSTAGE_OK);
    d.engine.receiver().wait_room(reopened, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d.pool.verify(&d.pages, 0);
    assert_eq!(bad, 0, "{first:?}");
    assert!(d.engine.shm().direct_chunks() >= 1, "the second request went directly");
}

/// A writer that finishes its copy within the release's grace (a 0.1 s pause, released during it):
/// the release waits for its report, nothing after it changes the pages, and the session is not
/// cut (its other rooms go on): the same session delivers the next request.
#[test]
fn a_release_within_the_grace_waits_for_the_report_and_keeps_the_session() {
    let (d, room) = decode();
    let (_pe, _pp, session, src_pages) = prefill(&d.engine, FaultPlan { direct_pause_ms: 100, ..FaultPlan::default() });
    let writer = send_until_copying(&session, chunk(room, &src_pages));
    d.engine.receiver().release_room(room, None).unwrap();
    pool_fill_canary(&d.pool, &d.pages);
    let sent = writer.join().unwrap();
    assert!(sent.is_err(), "a transfer into a released room succeeded: {sent:?}");
    let (bad, first) = pool_scan_canary(&d.pool, &d.pages);
    assert_eq!(bad, 0, "{bad} bytes changed after the release returned (first: {first:?})");
    let (key, _) = d.engine.receiver().open_room(RoomOpening::new(ROOM + 1, &d.pages, (PAGES * 16) as u32)).unwrap();
    let next = RoomRef { id: ROOM + 1, key };
    let status = session.transfer(&chunk(next, &src_pages), &Op::new(session.waker())).unwrap();
    assert_eq!(status, Status::KVSTAGE_OK, "the session was cut");
    d.engine.receiver().wait_room(next, Some(Duration::from_secs(10))).unwrap();
    let (bad, first) = d.pool.verify(&d.pages, 0);
    assert_eq!(bad, 0, "{first:?}");
}

/// A receiver that plays direct mode and lies: it passes its ring and a pool of `CAPACITY` pages,
/// then grants decode pages past that pool (a chunk would run over the end of its mapping), or
/// fewer pages than the chunk fills. The sender refuses the grant without writing anything (the
/// receiver's pool and ring stay zero), aborts the chunk, and says why.
#[test]
fn a_receiver_granting_pages_outside_its_pool_gets_nothing_written() {
    use common::{hello, RawPeer};
    use kvstage::protocol::Message;
    use kvstage::transport::shm::{self, memory::SharedRing, OfferedRing};
    for (lie, pages) in [("past the pool", vec![CAPACITY as u32 + 3; PAGES]), ("too few", vec![1u32; PAGES - 1])] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let liar = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut raw = RawPeer { stream };
            assert!(matches!(raw.recv(Duration::from_secs(5)), Ok(Some(Message::Hello(_)))));
            let Message::Hello(mut answer) = hello(&shape(0, 1), "liar", b"") else { unreachable!() };
            answer.ring_bytes = 1 << 20;
            raw.send(&Message::Hello(answer)).unwrap();
            let (socket, nonce) = match raw.reply(Duration::from_secs(5)) {
                Message::ShmOffer { socket, nonce, direct: Some(MemoryKind::Host) } => (socket, nonce),
                other => panic!("expected a same-host offer asking for the pool, got {other:?}"),
            };
            let ring = SharedRing::create(1 << 20).unwrap();
            let pool = HostPool::shared(shape(0, 1), CAPACITY);
            let share = shm::pool::PoolShare::of(&pool.layout).unwrap();
            let lease = shm::pass_ring(&socket, &nonce, OfferedRing::Memfd(ring.fd()), 1 << 20, Some(&share)).unwrap();
            raw.send(&Message::ShmAnswer { status: 0, local: true, ring_len: 1 << 20, reason: String::new() }).unwrap();
            let (req, bytes) = match raw.reply(Duration::from_secs(5)) {
                Message::AllocReq { req, bytes, direct: true, .. } => (req, bytes),
                other => panic!("expected a direct allocation request, got {other:?}"),
            };
            raw.send(&Message::AllocRsp { req, status: 0, round: 0, offset: 0, len: bytes, region: 0, reason: String::new(), pages }).unwrap();
            let abort = raw.reply(Duration::from_secs(5));
            assert!(matches!(abort, Message::Abort { .. }), "expected the sender to abort the chunk, got {abort:?}");
            // SAFETY: both mappings live here; the sender's session is over (it aborted).
            let written = pool.bytes_nonzero() + unsafe { std::slice::from_raw_parts(ring.ptr(), ring.len()) }.iter().filter(|&&b| b != 0).count();
            drop(lease);
            written
        });
        let engine = Engine::new(EngineOptions { transport: TransportKind::Shm, ..EngineOptions::default() }).unwrap();
        let mut pool = HostPool::new(shape(0, 1), CAPACITY);
        let src_pages = page_table(PAGES, CAPACITY, 4, false);
        pool.fill(&src_pages, 0);
        engine.register_pool(pool.layout.clone()).unwrap();
        let session = engine.connect(&addr.to_string(), "lied-to", Some(Duration::from_secs(5))).expect("handshake with the liar");
        let e = session.transfer(&chunk(RoomRef { id: 3, key: 1 }, &src_pages), &Op::new(session.waker())).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL, "{lie}: {}", e.chain());
        assert!(e.chain().contains("granted decode pages that do not hold this chunk"), "{lie}: {}", e.chain());
        assert_eq!(liar.join().unwrap(), 0, "{lie}: bytes were written into the liar's pool or ring");
        assert_eq!(engine.shm().direct_chunks(), 0, "{lie}");
    }
}

/// A sender is shared the decode pool only in the memory it names, its own pool's (the copy runs
/// between two pools of one kind): asking a host pool for device memory, it gets the ring alone
/// (no pool allocations after the greeting, no direct session counted), and the session stays
/// usable. Asking for host memory, the same receiver shares it (the control that this can fail).
#[test]
fn a_sender_gets_the_pool_only_in_the_memory_it_names() {
    use common::RawPeer;
    use kvstage::protocol::Message;
    use kvstage::transport::shm::{fdpass, GREETING_BYTES};
    let (d, _room) = decode();
    for (asked, shared) in [(MemoryKind::Cuda, false), (MemoryKind::Host, true)] {
        let (mut raw, _) = RawPeer::handshake(d.engine.local_addr(), &shape(0, 1), "asks", b"");
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(fdpass::NONCE_BYTES).unwrap();
        raw.send(&Message::ShmOffer { socket: name, nonce, direct: Some(asked) }).unwrap();
        let lease = fdpass::accept_by(&listener, std::time::Instant::now() + Duration::from_secs(5)).unwrap();
        let mut greeting = [0u8; GREETING_BYTES];
        fdpass::recv_fd(&lease, &mut greeting).unwrap().expect("the ring's descriptor");
        // The greeting ends with the pool's allocation count (u32) and their memory (u8).
        let files = u32::from_le_bytes(greeting[GREETING_BYTES - 5..GREETING_BYTES - 1].try_into().unwrap());
        match raw.reply(Duration::from_secs(5)) {
            Message::ShmAnswer { status: 0, local: true, .. } => {}
            other => panic!("expected the ring, got {other:?}"),
        }
        assert_eq!(files > 0, shared, "asked for {asked:?}: {files} pool allocation(s) passed");
        assert_eq!(d.engine.shm().direct_sessions(), shared as u64, "asked for {asked:?}");
        drop(lease);
    }
}

/// A raw same-host peer that asks for direct mode and takes the lease of the ring and pool.
fn raw_direct_peer(decode: &Engine, name: &str) -> (common::RawPeer, std::os::unix::net::UnixStream) {
    use kvstage::protocol::Message;
    use kvstage::transport::shm::fdpass;
    let (mut raw, _) = common::RawPeer::handshake(decode.local_addr(), &shape(0, 1), name, b"");
    let (socket, listener) = fdpass::listen_abstract().unwrap();
    let nonce = fdpass::random_bytes(fdpass::NONCE_BYTES).unwrap();
    raw.send(&Message::ShmOffer { socket, nonce, direct: Some(MemoryKind::Host) }).unwrap();
    match raw.reply(Duration::from_secs(5)) {
        Message::ShmAnswer { status: 0, local: true, .. } => {}
        other => panic!("{name}: expected the ring and the pool, got {other:?}"),
    }
    let lease = fdpass::accept_by(&listener, std::time::Instant::now() + Duration::from_secs(5)).unwrap();
    (raw, lease)
}

/// `Engine::shutdown` (kvstage_engine_shutdown) stops the engine, then says whether any same-host
/// peer still maps its KV pool: a real sender's session ends and it unmaps (its lease ends with
/// the unmapped byte); a peer holding its lease is named until it says it unmapped; one whose lease
/// closes without saying so (as a dying process's may, before its device context is torn down)
/// holds until its process ends, which this one (the test process) never does.
#[test]
fn shutdown_says_when_no_same_host_peer_maps_the_pool() {
    use std::io::Write;
    let (d, room) = decode();
    let (_prefill, _ppool, session, src) = prefill(&d.engine, FaultPlan::default());
    let op = Op::new(session.waker());
    assert_eq!(session.transfer(&chunk(room, &src), &op).map_err(|e| e.chain()), Ok(Status::KVSTAGE_OK));
    d.engine.receiver().wait_room(room, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(d.engine.shm().direct_sessions(), 1, "the real sender did not map the pool");
    let (_says, says_unmapped) = raw_direct_peer(&d.engine, "says-unmapped");
    let (_silent, closes_silently) = raw_direct_peer(&d.engine, "closes-silently");
    let me = Some(std::process::id() as i32);

    // The real sender's session ends at the shutdown and it unmaps; the two raw peers hold.
    let mut held = d.engine.shutdown(Some(Duration::from_millis(100))).unwrap_err();
    for _ in 0..100 {
        if held.0.len() <= 2 {
            break;
        }
        held = d.engine.shutdown(Some(Duration::from_millis(100))).unwrap_err();
    }
    assert_eq!(held.0.len(), 2, "the real sender did not unmap, or a raw peer's lease ended: {held}");
    assert!(held.0.iter().all(|(_, pid)| *pid == me), "{held}");
    let after = session.transfer(&chunk(room, &src), &Op::new(session.waker()));
    assert!(after.is_err() || after.as_ref().is_ok_and(|s| *s != Status::KVSTAGE_OK), "a session of a shut-down engine still transferred");
    assert_eq!(d.engine.connect("127.0.0.1:1", "late", None).err().map(|e| e.code()), Some(Status::KVSTAGE_E_CANCELED));
    assert_eq!(d.engine.receiver().open_room(RoomOpening::new(ROOM + 1, &d.pages, 16)).err().map(|e| e.code()), Some(Status::KVSTAGE_E_CANCELED));

    (&says_unmapped).write_all(&[kvstage::transport::shm::LEASE_UNMAPPED]).unwrap();
    drop(says_unmapped);
    drop(closes_silently);
    let held = d.engine.shutdown(Some(Duration::from_secs(1))).unwrap_err();
    assert_eq!(held.0.len(), 1, "the peer that said it unmapped still counts, or the silent one ended with its socket: {held}");
    assert!(held.to_string().contains(&format!("process {}", std::process::id())), "{held}");
}
