//! A hostile peer against a real decode engine on 127.0.0.1: this process speaks the wire protocol
//! by hand (the crate's own codec) with garbage, lying lengths, trickled and truncated hellos,
//! thousands of idle and half-open connections, descriptor exhaustion, mixed-TP senders, frames
//! for another connection's writer slot or for rooms that are closed, a sender that stops in
//! the middle of a payload, and a same-host peer that maps the ring and lies about what it wrote.
//!
//! After every attack: no panic was caught, a legitimate staged transfer (real prefill engines,
//! TP 2 → decode TP 1) completes and its bytes match the reference (pages outside the room keep
//! their canary), the process's file descriptors and threads return to their baseline within 10 s,
//! and RSS grew by less than 32 MiB.
//!
//! The tests share one mutex (fd, thread and RSS figures are process-wide; one test lowers
//! `RLIMIT_NOFILE`).

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvstage::engine::Engine;
use kvstage::protocol::{Message, RoomRef, PROTOCOL_VERSION};
use kvstage::session::op::Op;
use kvstage::session::receiver::listener::Limits;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::Status;

const RSS_BOUND: u64 = 32 << 20;
const CLOSE_BOUND: Duration = Duration::from_secs(2);

fn cluster(limits: Limits) -> Cluster {
    let mut options = decode_options(&SMALL);
    options.listener = limits;
    let ring = 4 * SMALL.layout(0, 2).total_bytes as usize;
    Cluster::new(SMALL, options, RingSpec::Owned(ring))
}

/// No connection of the decode engine is left (handshaking or serving).
fn quiesce(c: &Cluster) {
    let ok = settle(Duration::from_secs(10), || {
        c.decode.receiver().stats().connections == 0 && threads_named("kvstage-recv") == 0
    });
    assert!(ok, "decode connections did not end: {:?}, {} receiver threads", c.decode.receiver().stats(), threads_named("kvstage-recv"));
}

/// A warm-up transfer (first-use allocations), then the baseline.
fn prepare(c: &Cluster) -> Baseline {
    c.legit_transfer("warm-up", None, 2);
    quiesce(c);
    Baseline::take()
}

/// The checks after each attack.
fn after_attack(c: &Cluster, base: &Baseline, what: &str) -> After {
    let stats = c.decode.receiver().stats();
    assert_eq!(stats.panics, 0, "[{what}] a panic was caught in the engine: {stats:?}");
    let took = c.legit_transfer(what, None, 2);
    eprintln!("[{what}] legitimate transfer after the attack verified in {took:?}");
    quiesce(c);
    base.check(what, RSS_BOUND)
}

fn xorshift_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn garbage_lying_lengths_and_truncated_hellos_are_refused_or_closed() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let valid = hello(&SMALL.shape(0, 2), "garbage", b"").encode();
    let mut random = xorshift_bytes(7, 4096);
    random[4] = 0xAB; // an unknown frame type: refused from the header
    let mut data_with_payload = header(0xFFFF_FFF0, 4);
    data_with_payload.extend(xorshift_bytes(9, 1000));
    let mut bad_magic = header(100, 1);
    bad_magic.extend(xorshift_bytes(11, 100));
    // (what, bytes, then close our write side)
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("http request", b"GET / HTTP/1.1\r\nHost: kvstage\r\n\r\n".to_vec(), false),
        ("4 KiB of random bytes", random, false),
        ("body length 0xFFFF_FFF0, alloc type", header(0xFFFF_FFF0, 2), false),
        ("body length 0xFFFF_FFF0, hello type", header(0xFFFF_FFF0, 1), false),
        ("body length 0xFFFF_FFF0, data type, 1000 bytes", data_with_payload, false),
        ("hello with a bad magic", bad_magic, false),
        ("hello with an empty body", header(0, 1), false),
        ("truncated hello then EOF", valid[..valid.len() / 2].to_vec(), true),
        ("hello header only then EOF", valid[..5].to_vec(), true),
        ("3 bytes of a header then EOF", valid[..3].to_vec(), true),
        ("nothing then EOF", Vec::new(), true),
    ];
    for (what, bytes, eof) in cases {
        let failed_before = c.decode.receiver().stats().handshakes_failed;
        let mut p = RawPeer::connect(c.addr());
        let _ = p.send_bytes(&bytes);
        if eof {
            p.shutdown_write();
        }
        let closed = p.wait_closed(CLOSE_BOUND);
        let refusal = closed.refusal().map(|h| (h.status, h.reason.clone()));
        eprintln!("[{what}] closed after {:?} ({}); refusal: {refusal:?}", closed.after, closed.how);
        assert!(closed.after.is_some(), "[{what}] the engine left the connection open for {CLOSE_BOUND:?}");
        if let Some((status, reason)) = refusal {
            assert_ne!(status, 0, "[{what}] a refusal with status 0");
            assert!(!reason.is_empty(), "[{what}] a refusal without a reason");
        }
        let counted = settle(Duration::from_secs(2), || c.decode.receiver().stats().handshakes_failed > failed_before);
        assert!(counted, "[{what}] not counted as a failed handshake");
        drop(p);
        after_attack(&c, &base, what);
    }
}

#[test]
fn trickled_hello_hits_the_whole_handshake_deadline() {
    let _serial = serial();
    let c = cluster(Limits { handshake_timeout: Duration::from_secs(1), ..Limits::default() });
    let base = prepare(&c);
    let bytes = hello(&SMALL.shape(0, 2), "trickle", b"").encode();
    let start = Instant::now();
    let mut p = RawPeer::connect(c.addr());
    let mut w = p.stream.try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_writer = stop.clone();
    let writer = std::thread::spawn(move || {
        let mut sent = 0;
        for b in bytes {
            if stop_writer.load(Ordering::Relaxed) || w.write_all(&[b]).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(300));
        }
        sent
    });
    let closed = p.wait_closed(Duration::from_secs(5));
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let sent = writer.join().unwrap();
    eprintln!("trickle: closed after {elapsed:?} ({}), {sent} bytes trickled, refusal {:?}", closed.how, closed.refusal().map(|h| &h.reason));
    assert!(closed.after.is_some(), "a hello trickled 1 byte / 300 ms kept the connection open for 5 s (handshake_timeout 1 s)");
    // 1 s deadline + scheduling: nominally ~1.0-1.3 s; a per-read timeout would never fire.
    assert!(elapsed < Duration::from_secs(3), "closed only after {elapsed:?} with handshake_timeout 1 s");
    drop(p);
    after_attack(&c, &base, "trickled hello");
}

#[test]
fn newer_protocol_version_is_told_why_then_closed() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let mut bytes = hello(&SMALL.shape(0, 2), "future", b"").encode();
    // Frame header (5) + MAGIC (8), then the u16 protocol version.
    bytes[13..15].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let mut p = RawPeer::connect(c.addr());
    p.send_bytes(&bytes).unwrap();
    let closed = p.wait_closed(CLOSE_BOUND);
    eprintln!("newer version: closed after {:?} ({}), frames {:?}", closed.after, closed.how, closed.frames);
    let h = closed.refusal().expect("a refusal hello for a newer protocol version");
    assert_ne!(h.status, 0);
    assert!(h.reason.contains("version"), "the refusal does not mention the version: {}", h.reason);
    assert!(h.reason.contains(&(PROTOCOL_VERSION + 1).to_string()), "the refusal does not name the peer's version: {}", h.reason);
    assert_eq!(closed.how, "eof", "expected a clean close after the refusal");
    drop(p);
    after_attack(&c, &base, "newer protocol version");
}

#[test]
fn thousands_of_idle_and_half_open_connections_are_bounded() {
    let _serial = serial();
    const MAX_HANDSHAKES: u32 = 64;
    // A long handshake deadline: no slot frees while the flood is built, so the count is exact.
    let limits = Limits { max_connections: 256, max_handshakes: MAX_HANDSHAKES, handshake_timeout: Duration::from_secs(30) };
    let c = cluster(limits);
    let base = prepare(&c);
    let (soft, _) = nofile();
    // Our sockets + the engine's (4 fds a handshaking connection) + room for everything else.
    let budget = soft as usize - base.fds - 4 * MAX_HANDSHAKES as usize - 400;
    let big = 200usize.min(budget / 4);
    let idle = 2000usize.min(budget - big);
    assert!(idle >= 500, "RLIMIT_NOFILE {soft} leaves room for only {idle} idle connections");
    let refused_before = c.decode.receiver().stats().connections_refused;
    let connect = || {
        let s = TcpStream::connect_timeout(&c.addr(), Duration::from_secs(5)).expect("connect");
        s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        s
    };
    let mut held = Vec::with_capacity(idle + big);
    let start = Instant::now();
    let first_idle = 32.min(idle);
    for _ in 0..first_idle {
        held.push(connect());
    }
    // A 5-byte header announcing a 60 KiB hello, then all of it but the last byte.
    let announced = 60 << 10;
    let body = vec![0x41u8; announced as usize - 1];
    for _ in 0..big {
        let mut s = connect();
        let _ = s.write_all(&header(announced, 1));
        let _ = s.write_all(&body); // refused ones may be reset: fine
        held.push(s);
    }
    let half_open_built = start.elapsed();
    // Connects that waited for a SYN retransmit (the listen backlog overflowed meanwhile).
    let (mut slow, mut slowest) = (0, Duration::ZERO);
    for _ in first_idle..idle {
        let t = Instant::now();
        held.push(connect());
        slowest = slowest.max(t.elapsed());
        slow += (t.elapsed() > Duration::from_millis(500)) as u32;
    }
    let built = start.elapsed();
    eprintln!(
        "flood: first {first_idle} idle + {big} half-open connected after {half_open_built:?}; {slow} idle connects took > 0.5 s \
         (slowest {slowest:?}: SYN retransmits after listen-backlog overflows)"
    );
    let total = (idle + big) as u64;
    let expect_refused = total - MAX_HANDSHAKES as u64;
    let all_seen = settle(Duration::from_secs(10), || c.decode.receiver().stats().connections_refused - refused_before >= expect_refused);
    std::thread::sleep(Duration::from_millis(300)); // the accepted ones read their 60 KiB
    let stats = c.decode.receiver().stats();
    let refused = stats.connections_refused - refused_before;
    let recv_threads = threads_named("kvstage-recv");
    let fds_during = fd_count();
    let rss_growth = (rss_bytes() as f64 - base.rss as f64) / MIB;
    eprintln!(
        "flood: {idle} idle + {big} half-open (60 KiB hello announced, 60 KiB - 1 sent) built in {built:?}; refused {refused} \
         (expected >= {expect_refused}); receiver threads {recv_threads}; fds {} -> {fds_during} (ours {total}); RSS growth {rss_growth:.2} MiB; {stats:?}",
        base.fds
    );
    // Each connection beyond the limit costs one count: an older handshake cut for it, or (while
    // `MAX_HANDSHAKES` cut ones are still ending) itself refused.
    assert!(all_seen, "only {refused} of {total} connections refused or cut with max_handshakes {MAX_HANDSHAKES}");
    assert!(refused <= total, "{refused} refusals for {total} connections");
    // Handshakes in progress, and as many cut ones still ending.
    assert!(recv_threads <= 2 * MAX_HANDSHAKES as usize, "{recv_threads} receiver threads for max_handshakes {MAX_HANDSHAKES}");
    assert!(
        fds_during <= base.fds + total as usize + 8 * MAX_HANDSHAKES as usize + 16,
        "the engine holds too many descriptors during the flood: {fds_during} (baseline {}, ours {total})",
        base.fds
    );
    assert!(rss_growth * MIB < RSS_BOUND as f64, "RSS grew by {rss_growth:.2} MiB during the flood");
    // A legitimate sender meanwhile gets its session: the flood's oldest handshake is cut for it.
    let t = Instant::now();
    let session = c.prefill[0].connect(&c.addr().to_string(), "during-the-flood", Some(Duration::from_secs(5)));
    eprintln!("flood: a legitimate connect during the flood: {:?} after {:?}", session.as_ref().map(|_| ()).map_err(|e| e.chain()), t.elapsed());
    assert!(session.is_ok(), "a legitimate session was locked out by {MAX_HANDSHAKES} stalled handshakes: {}", session.err().unwrap().chain());
    drop(session);
    drop(held);
    after_attack(&c, &base, "idle and half-open flood");
}

/// A flood from one source (idle connections and hellos missing their last byte, renewed in
/// waves) takes every handshake slot: new sessions still open and deliver meanwhile, by having the
/// flood's oldest handshakes cut, and the log says so once per interval, not once per connection.
#[test]
fn a_handshake_flood_from_one_source_locks_out_no_session() {
    use kvstage::engine::logging;
    let _serial = serial();
    const MAX_HANDSHAKES: u32 = 64;
    let limits = Limits { max_connections: 1024, max_handshakes: MAX_HANDSHAKES, handshake_timeout: Duration::from_secs(5) };
    let c = cluster(limits);
    let base = prepare(&c);
    let warnings = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let sink = warnings.clone();
    logging::set_callback(Some((Box::new(move |l: &logging::Line<'_>| sink.lock().push(l.message.to_owned())), log::LevelFilter::Warn)))
        .unwrap();
    let announced = 4u32 << 10;
    let mut held = Vec::new();
    for wave in 0..3 {
        // Each wave alone fills every slot: half idle, half a hello missing its last byte.
        for i in 0..MAX_HANDSHAKES {
            let mut s = TcpStream::connect_timeout(&c.addr(), Duration::from_secs(5)).expect("connect");
            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            if i % 2 == 1 {
                let _ = s.write_all(&header(announced, 1));
                let _ = s.write_all(&vec![0x41u8; announced as usize - 1]);
            }
            held.push(s);
        }
        let took = c.try_transfer(&format!("flood wave {wave}"), None, 2);
        assert!(took.is_ok(), "wave {wave}: a legitimate session was locked out by a handshake flood: {}", took.unwrap_err());
    }
    logging::set_callback(None).unwrap();
    let warnings = warnings.lock().clone();
    let stats = c.decode.receiver().stats();
    eprintln!("flood from one source: {} handshakes cut or refused; {} WARN line(s): {warnings:#?}", stats.connections_refused, warnings.len());
    assert!(stats.connections_refused >= 2 * MAX_HANDSHAKES as u64, "{stats:?}");
    // Once per cause and log interval (10 s), with a count: a handful, not one per connection.
    assert!(warnings.len() <= 6, "{} WARN lines for one flood: {warnings:#?}", warnings.len());
    drop(held);
    after_attack(&c, &base, "handshake flood from one source");
}

/// Handshaked sessions that then say nothing, from 127.0.0.2 (a token holder's flood), fill
/// every connection slot: legitimate senders from 127.0.0.1 still get their sessions (the flood's
/// oldest idle sessions are cut for them) and deliver, and the log says so once per interval, not
/// once per session.
#[test]
fn idle_sessions_from_one_source_lock_out_no_other_sender() {
    use kvstage::engine::logging;
    let _serial = serial();
    const MAX_CONNECTIONS: u32 = 256;
    let limits = Limits { max_connections: MAX_CONNECTIONS, max_handshakes: 64, handshake_timeout: Duration::from_secs(5) };
    let c = cluster(limits);
    let base = prepare(&c);
    let warnings = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let sink = warnings.clone();
    logging::set_callback(Some((Box::new(move |l: &logging::Line<'_>| sink.lock().push(l.message.to_owned())), log::LevelFilter::Warn)))
        .unwrap();
    let flood_from = std::net::SocketAddr::from(([127, 0, 0, 2], 0));
    let mut held = Vec::new();
    for i in 0..MAX_CONNECTIONS {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(&flood_from.into()).unwrap();
        sock.connect_timeout(&c.addr().into(), Duration::from_secs(5)).unwrap();
        let mut raw = RawPeer { stream: sock.into() };
        raw.send(&hello(&SMALL.shape(0, 2), &format!("idle-{i}"), b"")).unwrap();
        match raw.recv(Duration::from_secs(5)) {
            Ok(Some(Message::Hello(h))) if h.status == 0 => held.push(raw),
            other => panic!("idle session {i} refused: {other:?}"),
        }
    }
    assert!(settle(Duration::from_secs(5), || c.decode.receiver().stats().connections == MAX_CONNECTIONS as u64), "{:?}", c.decode.receiver().stats());
    // Connections that never finish a handshake cut no session: only a newcomer whose handshake
    // passed has an idle one cut for it.
    let silent: Vec<RawPeer> = (0..8).map(|_| RawPeer::connect(c.addr())).collect();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(c.decode.receiver().stats().connections, MAX_CONNECTIONS as u64, "a connection without a handshake had a session cut");
    drop(silent);
    let took = c.try_transfer("while idle sessions fill every slot", None, 2);
    let second = c.try_transfer("again", None, 2);
    logging::set_callback(None).unwrap();
    let warnings = warnings.lock().clone();
    let cut = held.iter_mut().map(|r| r.wait_closed(Duration::from_millis(5)).after.is_some()).filter(|&c| c).count();
    eprintln!("{MAX_CONNECTIONS} idle sessions: transfers {took:?} then {second:?}; {cut} idle sessions cut; {} WARN line(s): {warnings:#?}", warnings.len());
    assert!(took.is_ok() && second.is_ok(), "idle sessions from one source locked out another sender: {took:?} {second:?}");
    assert!(cut >= 2, "{cut} idle sessions cut for the newcomers");
    assert!(warnings.len() <= 3, "{} WARN lines for one flood: {warnings:#?}", warnings.len());
    drop(held);
    after_attack(&c, &base, "idle sessions from one source");
}

/// Lowest descriptor number that is not open (a blocked `accept()` may have reserved it).
fn lowest_closed_fd() -> i32 {
    (0..1 << 20)
        // SAFETY: F_GETFD only queries.
        .find(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1)
        .expect("a free descriptor number")
}

struct RestoreNofile(u64);

impl Drop for RestoreNofile {
    fn drop(&mut self) {
        set_nofile_soft(self.0);
    }
}

#[test]
fn descriptor_exhaustion_in_accept_is_survived() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let errors_before = c.decode.receiver().stats().accept_errors;
    const K: usize = 4;
    // Sockets made before the limit drops: connecting them needs no new descriptor.
    let socks: Vec<socket2::Socket> =
        (0..K).map(|_| socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap()).collect();
    let addr: socket2::SockAddr = c.addr().into();
    let (soft, _) = nofile();
    let limit = lowest_closed_fd();
    let (connected, saw_errors, errors_during) = {
        let _restore = RestoreNofile(soft);
        // Every descriptor number below the limit is open: any new one fails with EMFILE.
        set_nofile_soft(limit as u64);
        let connected: Vec<bool> = socks.iter().map(|s| s.connect(&addr).is_ok()).collect();
        let saw = settle(Duration::from_secs(5), || c.decode.receiver().stats().accept_errors > errors_before);
        std::thread::sleep(Duration::from_millis(200));
        (connected, saw, c.decode.receiver().stats().accept_errors - errors_before)
    };
    eprintln!("EMFILE: soft limit {soft} -> {limit} and back; connects {connected:?}; accept errors meanwhile {errors_during}");
    assert!(saw_errors, "accept() never failed with RLIMIT_NOFILE at {limit} ({:?})", c.decode.receiver().stats());
    // The listener recovered: the connections queued meanwhile are served.
    let mut served = 0;
    let mut outcomes = Vec::new();
    for (i, s) in socks.into_iter().enumerate() {
        let mut p = RawPeer { stream: TcpStream::from(s) };
        p.stream.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        let sent = p.send(&hello(&SMALL.shape(0, 2), &format!("emfile-{i}"), b""));
        let answer = p.recv(Duration::from_secs(5));
        match (&sent, &answer) {
            (Ok(()), Ok(Some(Message::Hello(h)))) if h.status == 0 => served += 1,
            _ => {}
        }
        outcomes.push(format!("{sent:?} / {:?}", answer.as_ref().map(|m| m.as_ref().map(|m| format!("{m:?}").chars().take(80).collect::<String>()))));
    }
    eprintln!("EMFILE: after the limit was restored, {served} of {K} queued connections completed a handshake: {outcomes:#?}");
    // The one a blocked accept() took with its reserved descriptor may have been dropped (its
    // try_clone failed); every other one must be served.
    assert!(served >= K - 1, "the listener did not recover: {served} of {K} handshakes: {outcomes:#?}");
    after_attack(&c, &base, "descriptor exhaustion");
}

#[test]
fn mixed_tp_senders_to_one_room_are_refused_without_panic() {
    let _serial = serial();
    let mut pool4 = HostPool::new(SMALL.shape(1, 4), SMALL.pool_pages);
    pool4.fill(&(0..SMALL.pool_pages as u32).collect::<Vec<_>>(), 0);
    let c = cluster(Limits::default());
    let tp4 = Engine::new(prefill_options()).unwrap();
    tp4.register_pool(pool4.layout.clone()).unwrap();
    let base = prepare(&c);
    let addr = c.addr().to_string();
    let rx = c.decode.receiver();
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let desc = |room| TransferDesc { room, chunk: 0, pages: src.clone(), timeout: Some(Duration::from_secs(5)), ..Default::default() };

    // TP 2 first: the TP 4 sender is refused, the room is unharmed and completes.
    let room = 77;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    let s2 = c.prefill[0].connect(&addr, "mixed-tp2-r0", None).expect("TP 2 rank 0 passes the handshake");
    let s4 = tp4.connect(&addr, "mixed-tp4-r1", None).expect("TP 4 rank 1 passes the handshake");
    assert_eq!(s2.transfer(&desc(at), &Op::new(s2.waker())).unwrap(), Status::KVSTAGE_OK);
    let e = s4.transfer(&desc(at), &Op::new(s4.waker())).unwrap_err();
    eprintln!("mixed TP: {:?}: {}", e.code(), e.chain());
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    assert!(e.causes().iter().any(|c| c.contains("tp_size")), "the causes do not name tp_size: {:?}", e.causes());
    let s2b = c.prefill[1].connect(&addr, "mixed-tp2-r1", None).unwrap();
    assert_eq!(s2b.transfer(&desc(at), &Op::new(s2b.waker())).unwrap(), Status::KVSTAGE_OK);
    rx.wait_room(at, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
    c.verify_room("mixed TP", room, &pages);
    rx.release_room(at, None).unwrap();
    pool_fill_canary(&c.dpool, &pages);

    // TP 4 first: now the TP 2 sender is the one refused.
    let room = 78;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    assert_eq!(s4.transfer(&desc(at), &Op::new(s4.waker())).unwrap(), Status::KVSTAGE_OK);
    let e = s2.transfer(&desc(at), &Op::new(s2.waker())).unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH, "{}", e.chain());
    assert!(e.causes().iter().any(|c| c.contains("tp_size")), "{:?}", e.causes());
    assert!(rx.wait_room(at, Some(Duration::from_millis(200))).is_err_and(|e| e.code() == Status::KVSTAGE_E_TIMEOUT));
    rx.release_room(at, None).unwrap();
    assert!(settle(Duration::from_secs(5), || rx.stats().ring_live == 0), "ring space of the released room leaked");
    let (stray, first) = pool_scan_canary(&c.dpool, &all_pages(&c.dpool));
    assert_eq!(stray, 0, "an incomplete room's pages were written: {first:?}");
    assert_eq!(rx.stats().panics, 0);
    drop((s2, s2b, s4));
    drop(tp4);
    after_attack(&c, &base, "mixed TP senders");
}

#[test]
fn another_connections_writer_slot_cannot_be_written() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let addr = c.addr().to_string();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let room = 88;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let desc = TransferDesc { room: at, chunk: 0, pages: src, timeout: Some(Duration::from_secs(5)), ..Default::default() };
    let s0 = c.prefill[0].connect(&addr, "legit-r0", None).unwrap();
    assert_eq!(s0.transfer(&desc, &Op::new(s0.waker())).unwrap(), Status::KVSTAGE_OK);

    // A raw peer with a real handshake, claiming the same prefill rank (writer 0). It knows the
    // room's key: the writer slot alone must keep it out.
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "impostor-r0", b"");
    match raw.alloc(1, at, 0, 0, &layout) {
        Message::AllocRsp { status, reason, .. } => {
            assert_ne!(status, 0, "the impostor was granted another connection's writer slot");
            assert!(reason.contains("carried by prefill rank (tp 0, pp 0) != remote claimed by"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // Writes anyway, into the legitimate writer's region.
    let _ = raw.send(&Message::Data { room: at, chunk: 0, writer: 0, offset: w0.offset, len: w0.bytes });
    let _ = raw.send_bytes(&vec![0xEE; w0.bytes as usize]);
    let _ = raw.send(&Message::ChunkReady { req: 2, room: at, chunk: 0, writer: 0, checksum: None });
    let closed = raw.wait_closed(CLOSE_BOUND);
    eprintln!("impostor data: closed after {:?} ({}), frames {:?}", closed.after, closed.how, closed.frames);
    assert!(closed.after.is_some(), "the engine kept a connection that wrote another connection's slot");
    assert!(
        !closed.frames.iter().any(|m| matches!(m, Message::Arrived { req: 2, status: 0, .. })),
        "the impostor's chunk was acknowledged"
    );
    // A second impostor claims a writer index that is not its own.
    let (mut raw2, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "impostor-w1", b"");
    let _ = raw2.send(&Message::Data { room: at, chunk: 0, writer: 1, offset: layout.writers[1].offset, len: 64 });
    let _ = raw2.send_bytes(&[0xEE; 64]);
    let closed = raw2.wait_closed(CLOSE_BOUND);
    assert!(closed.after.is_some(), "the engine kept a connection that wrote a writer index not its own");

    // The legitimate room completes with the right bytes.
    let s1 = c.prefill[1].connect(&addr, "legit-r1", None).unwrap();
    assert_eq!(s1.transfer(&desc, &Op::new(s1.waker())).unwrap(), Status::KVSTAGE_OK);
    rx.wait_room(at, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
    c.verify_room("impostor data", room, &pages);
    rx.release_room(at, None).unwrap();
    pool_fill_canary(&c.dpool, &pages);
    drop((s0, s1, raw, raw2));
    after_attack(&c, &base, "another connection's writer slot");
}

/// A writer's region gathered by the reference (host) engine from prefill rank `rank`'s pool.
fn region_bytes(c: &Cluster, rank: usize, pages: &[u32]) -> Vec<u8> {
    use kvstage::copy::{CopyEngine, HostCopyEngine};
    let layout = SMALL.layout(rank as u32, 2);
    let region = &layout.writers[rank];
    let plan = kvstage::geometry::plan_gather(&c.ppools[rank].layout, pages, 0, &layout, region).unwrap();
    let mut bytes = vec![0u8; region.bytes as usize];
    // SAFETY: the pool outlives the call and `bytes` holds the region.
    unsafe { HostCopyEngine::new(1).gather(&plan, &c.ppools[rank].layout, bytes.as_mut_ptr()) }.unwrap();
    bytes
}

#[test]
fn slab_writes_land_in_any_order_but_never_twice_or_past_the_region() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let addr = c.addr().to_string();
    let layout = SMALL.layout(1, 2);
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let bytes = region_bytes(&c, 1, &src);
    let half = bytes.len() as u64 / 2;
    let s0 = c.prefill[0].connect(&addr, "legit-r0", None).unwrap();
    let send_rank0 = |room: RoomRef| {
        let desc = TransferDesc { room, chunk: 0, pages: src.clone(), timeout: Some(Duration::from_secs(5)), ..Default::default() };
        assert_eq!(s0.transfer(&desc, &Op::new(s0.waker())).unwrap(), Status::KVSTAGE_OK);
    };
    // Writer 1 by hand: each half of its region in its own write, the second half first.
    let room = 90;
    let pages = c.room_pages(room, 1);
    let opened = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    send_rank0(opened);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(1, 2), "slabs-reversed", b"");
    let g = raw.alloc_granted(1, opened, 0, 1, &layout);
    for (at, part) in [(half, &bytes[half as usize..]), (0, &bytes[..half as usize])] {
        raw.send(&Message::Data { room: opened, chunk: 0, writer: 1, offset: g.region + at, len: part.len() as u64 }).unwrap();
        raw.send_bytes(part).unwrap();
    }
    raw.send(&Message::ChunkReady { req: 2, room: opened, chunk: 0, writer: 1, checksum: Some(kvstage::session::checksum(&bytes)) }).unwrap();
    match raw.reply(Duration::from_secs(5)) {
        Message::Arrived { req: 2, status: 0, .. } => {}
        other => panic!("a region written back to front was not accepted: {other:?}"),
    }
    rx.wait_room(opened, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
    c.verify_room("slabs back to front", room, &pages);
    rx.release_room(opened, None).unwrap();
    pool_fill_canary(&c.dpool, &pages);

    // The same half twice, and a write that runs one byte past the region: each ends the session
    // and nothing of it is acknowledged.
    for (label, second_at) in [("the same half twice", 0), ("one byte past the region", half + 1)] {
        let room = if second_at == 0 { 91 } else { 92 };
        let pages = c.room_pages(room, 1);
        let opened = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
        let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(1, 2), label, b"");
        let g = raw.alloc_granted(1, opened, 0, 1, &layout);
        for at in [0, second_at] {
            let _ = raw.send(&Message::Data { room: opened, chunk: 0, writer: 1, offset: g.region + at, len: half });
            let _ = raw.send_bytes(&bytes[..half as usize]);
        }
        let _ = raw.send(&Message::ChunkReady { req: 2, room: opened, chunk: 0, writer: 1, checksum: None });
        let closed = raw.wait_closed(CLOSE_BOUND);
        assert!(closed.after.is_some(), "[{label}] the engine kept the session");
        assert!(!closed.frames.iter().any(|m| matches!(m, Message::Arrived { req: 2, status: 0, .. })), "[{label}] the chunk was acknowledged");
        if let Ok(done) = rx.wait_room(opened, Some(Duration::from_millis(300))) {
            panic!("[{label}] room {room} ended {done:?} with half of its bytes");
        }
        rx.release_room(opened, None).unwrap();
        pool_fill_canary(&c.dpool, &pages);
    }
    drop((s0, raw));
    after_attack(&c, &base, "slab writes in any order");
}

#[test]
fn abort_from_a_connection_that_never_wrote_does_not_fail_the_room() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let addr = c.addr().to_string();
    let room = 89;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    let src: Vec<u32> = (0..SMALL.pages_per_chunk() as u32).collect();
    let desc = TransferDesc { room: at, chunk: 0, pages: src, timeout: Some(Duration::from_secs(5)), ..Default::default() };
    let s0 = c.prefill[0].connect(&addr, "legit-r0", None).unwrap();
    assert_eq!(s0.transfer(&desc, &Op::new(s0.waker())).unwrap(), Status::KVSTAGE_OK);

    // The aborter knows the room's key: holding no slot alone must make its aborts harmless.
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "aborter", b"");
    raw.send(&Message::Abort { room: at, chunk: u32::MAX, reason: "hostile whole-room abort".into() }).unwrap();
    raw.send(&Message::Abort { room: at, chunk: 0, reason: "hostile chunk abort".into() }).unwrap();
    raw.barrier(1, 0); // both aborts were processed
    match rx.wait_room(at, Some(Duration::from_millis(300))) {
        Err(e) if e.code() == Status::KVSTAGE_E_TIMEOUT => {}
        other => panic!("an abort from a connection holding no slot changed the room: {other:?}"),
    }
    let s1 = c.prefill[1].connect(&addr, "legit-r1", None).unwrap();
    assert_eq!(s1.transfer(&desc, &Op::new(s1.waker())).unwrap(), Status::KVSTAGE_OK);
    rx.wait_room(at, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
    c.verify_room("foreign abort", room, &pages);
    rx.release_room(at, None).unwrap();
    pool_fill_canary(&c.dpool, &pages);
    raw.barrier(2, 0); // and the aborter's session is still served
    drop((s0, s1, raw));
    after_attack(&c, &base, "abort from a non-writer");
}

#[test]
fn late_frames_for_closed_rooms_keep_the_session() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "late", b"");
    // The status of the refusal.
    let late = |raw: &mut RawPeer, room: RoomRef, req: u64, what: &str| {
        raw.send(&Message::Data { room, chunk: 0, writer: 0, offset: w0.offset, len: w0.bytes }).unwrap();
        raw.send_bytes(&vec![0xEE; w0.bytes as usize]).unwrap();
        raw.send(&Message::ChunkReady { req, room, chunk: 0, writer: 0, checksum: None }).unwrap();
        let status = match raw.reply(Duration::from_secs(5)) {
            Message::Arrived { req: r, status, reason } if r == req => {
                eprintln!("late frames, {what}: Arrived status {status}: {reason}");
                assert_ne!(status, 0, "[{what}] late data acknowledged as arrived");
                status
            }
            other => panic!("[{what}] expected Arrived {req}, got {other:?}"),
        };
        raw.barrier(100 + req, 0);
        status
    };
    late(&mut raw, RoomRef { id: 4242, key: 1 }, 1, "never opened");
    let pages = c.room_pages(4243, 1);
    let released = open_room(&c.decode, 4243, &pages, SMALL.chunk_tokens);
    rx.release_room(released, None).unwrap();
    late(&mut raw, released, 2, "released");
    // Granted to this connection, then released before its data came.
    let granted = open_room(&c.decode, 4244, &pages, SMALL.chunk_tokens);
    raw.alloc_granted(3, granted, 0, 0, &layout);
    release_bounded(&c.decode, granted, Duration::from_secs(5));
    late(&mut raw, granted, 4, "released after the grant");
    // Granted to this connection, released, and opened again for another request before its data
    // came: the frames name the old opening (stale), and the new one is unharmed.
    let stale = open_room(&c.decode, 4245, &pages, SMALL.chunk_tokens);
    raw.alloc_granted(5, stale, 0, 0, &layout);
    release_bounded(&c.decode, stale, Duration::from_secs(5));
    let reopened = open_room(&c.decode, 4245, &pages, SMALL.chunk_tokens);
    let status = late(&mut raw, stale, 6, "the room reopened since");
    assert_eq!(status, Status::KVSTAGE_E_STALE_ROOM.code(), "frames of an earlier opening of a reopened room");
    match rx.wait_room(reopened, Some(Duration::from_millis(300))) {
        Err(e) if e.code() == Status::KVSTAGE_E_TIMEOUT => {}
        other => panic!("stale frames changed the reopened room: {other:?}"),
    }
    // The earlier opening is gone: waiting on it says so, releasing it again leaves the new one.
    assert_eq!(rx.wait_room(stale, Some(Duration::ZERO)).map_err(|e| e.code()).err(), Some(Status::KVSTAGE_E_STALE_ROOM));
    rx.release_room(stale, None).unwrap();
    assert!(rx.wait_room(reopened, Some(Duration::ZERO)).is_err_and(|e| e.code() == Status::KVSTAGE_E_TIMEOUT), "releasing an earlier opening released the new one");
    rx.release_room(reopened, None).unwrap();
    assert!(settle(Duration::from_secs(5), || rx.stats().ring_live == 0), "ring space leaked: {:?}", rx.stats());
    let (stray, first) = pool_scan_canary(&c.dpool, &all_pages(&c.dpool));
    assert_eq!(stray, 0, "late data reached the pool: {first:?}");
    drop(raw);
    after_attack(&c, &base, "late frames");
}

#[test]
fn a_sender_stalled_inside_a_payload_cannot_hold_the_ring() {
    let _serial = serial();
    // A peer silent inside a payload for dead_peer_timeout is cut off, and its pinned range freed.
    let mut options = decode_options(&SMALL);
    options.dead_peer_timeout = Some(Duration::from_secs(2));
    let c = Cluster::new(SMALL, options, RingSpec::Owned(4 * SMALL.layout(0, 2).total_bytes as usize));
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    // A sender with a real handshake and a grant sends a data header and half its payload, then
    // goes silent (its socket stays open and its kernel keeps acknowledging).
    let room = 90;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "stalled-mid-payload", b"");
    raw.alloc_granted(1, at, 0, 0, &layout);
    raw.send(&Message::Data { room: at, chunk: 0, writer: 0, offset: w0.offset, len: w0.bytes }).unwrap();
    raw.send_bytes(&vec![0xEE; w0.bytes as usize / 2]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let took = release_bounded(&c.decode, at, Duration::from_secs(5));
    // The ring holds 4 chunks: 4 more single-chunk rooms wrap it, so the last grant needs the
    // watermark to pass the stalled sender's range.
    let mut outcomes = Vec::new();
    for i in 0..4 {
        let t = Instant::now();
        let r = c.try_transfer(&format!("after a stalled sender, room {i}"), None, 1);
        outcomes.push(format!("{:?}: {}", t.elapsed(), r.as_ref().map_or_else(|e| e.clone(), |_| "ok".into())));
        if r.is_err() {
            break;
        }
    }
    let stats = rx.stats();
    // The range went back at the release (the read polls its room); the silent sender itself is
    // cut at its stall bound (2 s after its last byte).
    let closed = raw.wait_closed(Duration::from_secs(3));
    eprintln!(
        "stalled sender: release_room took {took:?}; later transfers: {outcomes:#?}; ring_live {} (watermark {:?}); \
         stalled connection closed by the engine: {}",
        stats.ring_live,
        stats.watermark,
        closed.after.is_some()
    );
    assert!(closed.after.is_some(), "the engine did not cut off a sender stalled inside a payload");
    assert!(
        outcomes.len() == 4 && outcomes.iter().all(|o| o.ends_with("ok")),
        "a sender stalled inside a payload for a released room still holds its ring range (ring_live {}, stalled connection \
         closed: {}), and transfers that wrap the ring wait for it: {outcomes:#?}",
        stats.ring_live,
        closed.after.is_some()
    );
    drop(raw);
    after_attack(&c, &base, "sender stalled inside a payload");
}

/// A writer keeping one payload alive with a byte a second (inside the dead-peer timeout, so no
/// stall bound cuts it), until `stop` or its connection ends.
fn trickle(raw: &RawPeer, header: Message, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    let mut w = raw.stream_clone();
    std::thread::spawn(move || {
        let mut sent = 0;
        if w.send(&header).is_err() {
            return sent;
        }
        let end = Instant::now() + Duration::from_secs(20);
        while !stop.load(Ordering::Relaxed) && Instant::now() < end && w.send_bytes(&[0xAB]).is_ok() {
            sent += 1;
            std::thread::sleep(Duration::from_secs(1));
        }
        sent
    })
}

/// A payload trickled into a room's ring range (a byte a second, under a 3 s dead-peer timeout)
/// holds the range only while the room takes data: released, the room's range is back in the
/// ring within the dead-peer timeout and four chunks of another room, whose grants wrap a ring of
/// two and a half chunks, land meanwhile. Left open, the room's payload is cut at its deadline
/// (the grace plus its length at the minimum rate): the connection ends, the room fails, the
/// range goes back.
#[test]
fn a_trickled_payload_holds_the_ring_no_longer_than_its_room_or_its_rate() {
    let _serial = serial();
    let dead_peer = Duration::from_secs(3);
    let mut options = decode_options(&SMALL);
    options.dead_peer_timeout = Some(dead_peer);
    let layout = SMALL.layout(0, 2);
    let c = Cluster::new(SMALL, options, RingSpec::Owned(5 * layout.total_bytes as usize / 2));
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let w0 = layout.writers[0].clone();
    let data = |at| Message::Data { room: at, chunk: 0, writer: 0, offset: w0.offset, len: w0.bytes };

    // Released while trickled.
    let room = 91;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "trickle-released", b"");
    raw.alloc_granted(1, at, 0, 0, &layout);
    let stop = Arc::new(AtomicBool::new(false));
    let trickler = trickle(&raw, data(at), stop.clone());
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(rx.stats().ring_live, 1, "the trickled grant is in the ring");
    let released = Instant::now();
    release_bounded(&c.decode, at, Duration::from_secs(5));
    let freed = settle(dead_peer, || rx.stats().ring_live == 0);
    let freed_after = released.elapsed();
    let t = Instant::now();
    let outcome = c.try_transfer("after a trickled payload of a released room", None, 4);
    eprintln!("trickle into a released room: its range back after {freed_after:?} (freed: {freed}); 4 chunks of the next room: {outcome:?} in {:?}", t.elapsed());
    stop.store(true, Ordering::Relaxed);
    let sent = trickler.join().unwrap();
    assert!(freed, "a trickled payload of a released room still held its ring range {freed_after:?} after the release ({:?})", rx.stats());
    assert!(outcome.is_ok(), "a room whose grants wrap the ring waited behind a trickled payload: {}", outcome.unwrap_err());
    assert!(sent >= 2, "the trickle sent {sent} bytes");
    drop(raw);

    // Left open while trickled: cut at the payload's deadline, the room fails.
    let room = 92;
    let at = open_room(&c.decode, room, &c.room_pages(room, 1), SMALL.chunk_tokens);
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "trickle-open", b"");
    raw.alloc_granted(1, at, 0, 0, &layout);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let trickler = trickle(&raw, data(at), stop.clone());
    let closed = raw.wait_closed(dead_peer + Duration::from_secs(3));
    let failed = rx.wait_room(at, Some(Duration::from_secs(1)));
    stop.store(true, Ordering::Relaxed);
    trickler.join().unwrap();
    eprintln!("trickle into an open room: connection {} after {:?}; room: {:?}", closed.how, started.elapsed(), failed.as_ref().map_err(|e| e.chain()));
    assert!(closed.after.is_some(), "a payload trickled at a byte a second was not cut at its deadline");
    assert!(failed.is_err_and(|e| e.code() == Status::KVSTAGE_E_PEER_GONE), "the trickled room did not fail with its writer gone");
    assert!(settle(Duration::from_secs(2), || rx.stats().ring_live == 0), "the cut writer's range stayed in the ring: {:?}", rx.stats());
    release_bounded(&c.decode, at, Duration::from_secs(5));
    drop(raw);
    after_attack(&c, &base, "trickled payloads");
}

/// 32 sessions that flood grid requests with wrong keys and never read the replies (their
/// reply streams stay full; each reconnects once cut) stall no one: a room with a 1 s deadline
/// fails within 2 s of opening, and a request whose grant wraps the ring (it needs watermarks)
/// completes within that deadline, while they flood.
#[test]
fn sessions_that_never_read_stall_neither_watermarks_nor_expiry() {
    let _serial = serial();
    let mut options = decode_options(&SMALL);
    options.room_timeout = Some(Duration::from_secs(1));
    let layout = SMALL.layout(0, 2);
    let c = Cluster::new(SMALL, options, RingSpec::Owned(5 * layout.total_bytes as usize / 2));
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let stop = Arc::new(AtomicBool::new(false));
    let addr = c.addr();
    // Started 60 ms apart, so that at any moment some of them are in the middle of the 2 s a
    // reply to a peer that does not read may take.
    let floods: Vec<_> = (0..32u64)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(60 * i));
                let mut sessions = 0u32;
                let frames: Vec<u8> =
                    (0..256u64).flat_map(|req| Message::GridReq { req, room: RoomRef { id: 7, key: 0xDEAD_BEEF } }.encode()).collect();
                while !stop.load(Ordering::Relaxed) {
                    let (mut raw, _) = RawPeer::handshake(addr, &SMALL.shape(0, 2), &format!("never-reads-{i}-{sessions}"), b"");
                    sessions += 1;
                    // Blocks once the engine, its replies unread, stops reading; fails once it is cut.
                    raw.stream.set_write_timeout(None).unwrap();
                    while !stop.load(Ordering::Relaxed) && raw.send_bytes(&frames).is_ok() {}
                }
                sessions
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(3000));
    let idle = 95;
    let opened = Instant::now();
    let idle_room = open_room(&c.decode, idle, &c.room_pages(idle, 1), SMALL.chunk_tokens);
    // Three chunks in a ring of two and a half: the third grant waits for the first's watermark.
    let ((outcome, took), (expired, failed_after)) = std::thread::scope(|s| {
        let transfer = s.spawn(|| {
            let t = Instant::now();
            (c.try_transfer("while 32 sessions never read", None, 3), t.elapsed())
        });
        let expired = settle(Duration::from_secs(3), || {
            rx.wait_room(idle_room, Some(Duration::ZERO)).is_err_and(|e| e.chain().contains("the room's deadline passed"))
        });
        (transfer.join().unwrap(), (expired, opened.elapsed()))
    });
    stop.store(true, Ordering::Relaxed);
    let sessions: u32 = floods.into_iter().map(|h| h.join().unwrap()).sum();
    let idle_outcome = rx.wait_room(idle_room, Some(Duration::ZERO)).map_err(|e| e.chain());
    eprintln!(
        "32 non-reading sessions ({sessions} opened in all): the 1 s room failed after {failed_after:?} ({idle_outcome:?}); \
         a ring-wrapping request: {outcome:?} in {took:?}"
    );
    release_bounded(&c.decode, idle_room, Duration::from_secs(5));
    assert!(expired && failed_after < Duration::from_secs(2), "a room with a 1 s deadline failed only after {failed_after:?} (expired: {expired})");
    assert!(outcome.is_ok(), "a request whose grant wraps the ring did not complete while sessions never read: {}", outcome.unwrap_err());
    after_attack(&c, &base, "sessions that never read");
}

#[test]
fn a_same_host_peer_is_held_to_its_grant_and_its_lease() {
    use kvstage::transport::shm::{fdpass, memory};
    let _serial = serial();
    // The decode engine serves the same-host path (transport auto); its prefill engines stay on TCP.
    let mut options = decode_options(&SMALL);
    options.transport = kvstage::engine::TransportKind::Auto;
    let c = Cluster::new(SMALL, options, RingSpec::Owned(4 * SMALL.layout(0, 2).total_bytes as usize));
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let answer = |raw: &mut RawPeer| match raw.reply(Duration::from_secs(5)) {
        Message::ShmAnswer { status, local, ring_len, reason } => (status, local, ring_len, reason),
        other => panic!("expected a same-host answer, got {other:?}"),
    };

    // Offers the engine cannot reach or that are malformed: answered "not local", session kept.
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "shm-hostile", b"");
    for (socket, nonce) in [("kvstage-shm-nobody-listens-here", vec![1u8; 16]), ("bad name\n", vec![1; 16]), ("kvstage-shm-x", vec![1; 3])] {
        raw.send(&Message::ShmOffer { socket: socket.into(), nonce, direct: None }).unwrap();
        let (status, local, _, reason) = answer(&mut raw);
        assert!(status != 0 && !local, "offer {socket:?}: {status} {local} {reason}");
    }
    raw.barrier(1, 0);

    // A real offer: the ring's descriptor arrives on our socket; a second offer is refused.
    let (name, listener) = fdpass::listen_abstract().unwrap();
    let nonce = fdpass::random_bytes(fdpass::NONCE_BYTES).unwrap();
    raw.send(&Message::ShmOffer { socket: name.clone(), nonce: nonce.clone(), direct: None }).unwrap();
    let (status, local, ring_len, reason) = answer(&mut raw);
    assert!(status == 0 && local, "{status} {local} {reason}");
    let lease = fdpass::accept_by(&listener, Instant::now() + Duration::from_secs(5)).unwrap();
    let mut greeting = [0u8; kvstage::transport::shm::GREETING_BYTES];
    let fd = fdpass::recv_fd(&lease, &mut greeting).unwrap().expect("the ring's descriptor");
    assert_eq!(&greeting[..fdpass::NONCE_BYTES], &nonce[..]);
    let ring = memory::map_peer_ring(&fd, ring_len).unwrap();
    raw.send(&Message::ShmOffer { socket: name, nonce: nonce.clone(), direct: None }).unwrap();
    let (status, _, _, reason) = answer(&mut raw);
    assert!(status != 0 && reason.contains("second"), "{status} {reason}");
    // A refused offer naming any other local listener: the engine never connects to it (no probe
    // of local services), and says "not local".
    use std::os::linux::net::SocketAddrExt;
    let probe_name = format!("kvstage-probe-target-{}", std::process::id());
    let probe = std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(probe_name.as_bytes()).unwrap()).unwrap();
    probe.set_nonblocking(true).unwrap();
    raw.send(&Message::ShmOffer { socket: probe_name.clone(), nonce, direct: None }).unwrap();
    let (status, local, _, reason) = answer(&mut raw);
    assert!(status != 0 && !local, "{status} {local} {reason}");
    // The answer came after any connect: a connection would be waiting in the backlog now.
    assert!(
        matches!(probe.accept(), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the engine connected to @{probe_name}, a local socket a peer named in a refused offer"
    );
    drop(probe);

    // A grant, half written in place and reported; then a report past what it wrote ends the
    // session while the peer still maps the ring: its range stays out of the ring until the lease
    // (the local socket) closes.
    let room = 92;
    let pages = c.room_pages(room, 1);
    let at = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    let g = raw.alloc_granted(2, at, 0, 0, &layout);
    let half = w0.bytes / 2;
    // SAFETY: the granted region lies inside the mapped ring (checked by the engine's grant).
    unsafe { std::ptr::write_bytes(ring.ptr().add((g.offset + g.region) as usize), 0xEE, half as usize) };
    raw.send(&Message::Written { room: at, chunk: 0, writer: 0, offset: g.region, len: half, imm: 0 }).unwrap();
    raw.barrier(3, 0);
    raw.send(&Message::Written { room: at, chunk: 0, writer: 0, offset: g.region + w0.bytes, len: half, imm: 0 }).unwrap();
    let closed = raw.wait_closed(CLOSE_BOUND);
    assert!(closed.after.is_some(), "the engine kept a session that reported bytes outside its region");
    assert!(settle(Duration::from_secs(5), || rx.stats().connections == 0));
    let failed = rx.wait_room(at, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(failed.code(), Status::KVSTAGE_E_PEER_GONE, "{}", failed.chain());
    rx.release_room(at, None).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rx.stats().ring_live, 1, "the range of a peer that still maps the ring went back to the ring");
    drop(lease);
    assert!(settle(Duration::from_secs(5), || rx.stats().ring_live == 0), "the lease ended but the range stayed: {:?}", rx.stats());
    drop((ring, fd, raw, listener));
    after_attack(&c, &base, "same-host peer");
}

/// A hostile receiver answers requests nobody made (10 000 replies with made-up request ids, and
/// duplicates): the sender keeps none of them (dropped and counted), and its session stays alive.
#[test]
fn replies_to_requests_nobody_made_are_dropped_not_kept() {
    use kvstage::engine::{EngineOptions, TransportKind};
    let _serial = serial();
    let shape = SMALL.shape(0, 2);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    const LIES: u64 = 10_000;
    let decode_shape = SMALL.shape(0, 1);
    let liar = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut raw = RawPeer { stream };
        match raw.recv(Duration::from_secs(5)) {
            Ok(Some(Message::Hello(_))) => {}
            other => panic!("expected the sender's hello, got {other:?}"),
        }
        let Message::Hello(mut answer) = hello(&decode_shape, "liar", b"") else { unreachable!() };
        answer.ring_bytes = 1 << 20;
        raw.send(&Message::Hello(answer)).unwrap();
        for i in 0..LIES {
            let req = if i % 2 == 0 { i.wrapping_mul(0x9E37_79B9_7F4A_7C15) } else { 1 };
            raw.send(&Message::AllocRsp { req, status: 0, round: 0, offset: 0, len: 64, region: 0, reason: String::new(), pages: Vec::new() }).unwrap();
        }
        raw
    });
    let prefill = Engine::new(EngineOptions { transport: TransportKind::Tcp, same_host: false, ..EngineOptions::default() }).unwrap();
    let pool = HostPool::new(shape.clone(), 64);
    prefill.register_pool(pool.layout.clone()).unwrap();
    let session = prefill.connect(&addr.to_string(), "lied-to", Some(Duration::from_secs(5))).expect("handshake with the liar");
    let raw = liar.join().unwrap();
    assert!(
        settle(Duration::from_secs(10), || session.replies_dropped() == LIES),
        "{} of {LIES} replies to requests nobody made were dropped",
        session.replies_dropped()
    );
    // Alive: a grid request still gets its (refused) answer path, not a dead session.
    let grid = session.room_grid(RoomRef { id: 7, key: 1 }, Some(Duration::from_millis(200)));
    assert_eq!(grid.err().map(|e| e.code()), Some(Status::KVSTAGE_E_TIMEOUT), "the session died under made-up replies");
    drop(raw);
}

/// A receiver that answers the hello one byte at a time (each byte well within the connect's
/// timeout): the connect ends by its one deadline with `KVSTAGE_E_TIMEOUT`, not one timeout per
/// read (which let a 1 MiB hello take a million of them).
#[test]
fn a_trickled_hello_ends_the_connect_by_its_deadline() {
    use kvstage::engine::{EngineOptions, TransportKind};
    let _serial = serial();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let decode_shape = SMALL.shape(0, 1);
    let trickler = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut raw = RawPeer { stream };
        match raw.recv(Duration::from_secs(5)) {
            Ok(Some(Message::Hello(_))) => {}
            other => panic!("expected the sender's hello, got {other:?}"),
        }
        let Message::Hello(mut answer) = hello(&decode_shape, "trickler", b"") else { unreachable!() };
        answer.ring_bytes = 1 << 20;
        let bytes = Message::Hello(answer).encode();
        let mut sent = 0;
        for b in &bytes {
            if raw.send_bytes(std::slice::from_ref(b)).is_err() {
                break; // the sender gave up and closed
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        (sent, bytes.len())
    });
    let prefill = Engine::new(EngineOptions { transport: TransportKind::Tcp, same_host: false, ..EngineOptions::default() }).unwrap();
    let pool = HostPool::new(SMALL.shape(0, 2), 64);
    prefill.register_pool(pool.layout.clone()).unwrap();
    let e = prefill.connect(&addr.to_string(), "trickled", Some(Duration::from_secs(1))).err().expect("a trickled hello was waited for past the connect's deadline");
    assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT, "{}", e.chain());
    let (sent, len) = trickler.join().unwrap();
    assert!(sent < len, "the whole {len}-byte hello went out before the sender gave up");
}

/// Same-host leases outlive their connections (until the peer unmaps), each a thread and a
/// descriptor of the engine: a peer that opens sessions, takes their leases and drops the
/// connections cannot hold more than `max_connections` of them.
#[test]
fn same_host_leases_are_bounded_like_connections() {
    use kvstage::transport::shm::fdpass;
    let _serial = serial();
    const MAX: u32 = 3;
    let mut options = decode_options(&SMALL);
    options.transport = kvstage::engine::TransportKind::Auto;
    options.listener = Limits { max_connections: MAX, ..Limits::default() };
    let c = Cluster::new(SMALL, options, RingSpec::Owned(4 * SMALL.layout(0, 2).total_bytes as usize));
    let base = prepare(&c);
    let mut leases = Vec::new();
    for i in 0..=MAX {
        let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), &format!("lease-hoarder-{i}"), b"");
        let (name, listener) = fdpass::listen_abstract().unwrap();
        let nonce = fdpass::random_bytes(fdpass::NONCE_BYTES).unwrap();
        raw.send(&Message::ShmOffer { socket: name, nonce, direct: None }).unwrap();
        let (status, reason) = match raw.reply(Duration::from_secs(5)) {
            Message::ShmAnswer { status, reason, .. } => (status, reason),
            other => panic!("expected a same-host answer, got {other:?}"),
        };
        if i < MAX {
            assert_eq!(status, 0, "offer {i}: {reason}");
            leases.push(fdpass::accept_by(&listener, Instant::now() + Duration::from_secs(5)).unwrap());
        } else {
            assert!(status != 0 && reason.contains("leases"), "offer {i} with {MAX} leases held: {status} {reason}");
        }
        drop(raw); // the connection goes, the lease stays
        quiesce(&c); // so the next one is not refused as a connection beyond the limit
    }
    assert!(threads_named("kvstage-lease") <= MAX as usize, "{} lease watchers", threads_named("kvstage-lease"));
    drop(leases);
    assert!(settle(Duration::from_secs(10), || threads_named("kvstage-lease") == 0), "lease watchers outlived their leases");
    after_attack(&c, &base, "lease hoarding");
}

/// Holding the cluster token is not enough to touch another request's room. A peer that knows the
/// id of an open room (and the key of its earlier opening) but not its key sends every frame that
/// names a room with stale and guessed keys: each is refused with `KVSTAGE_E_STALE_ROOM` (or read
/// and discarded), no slot is claimed, no ring space granted, nothing fails, its session stays
/// served; then the room's own senders complete it with exact bytes.
#[test]
fn stale_and_guessed_room_keys_claim_nothing() {
    let _serial = serial();
    let c = cluster(Limits::default());
    let base = prepare(&c);
    let rx = c.decode.receiver();
    let layout = SMALL.layout(0, 2);
    let w0 = layout.writers[0].clone();
    let room = 97;
    let pages = c.room_pages(room, 1);
    // The id was opened before (a canceled request): the guesser knows that opening's key.
    let stale = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    rx.release_room(stale, None).unwrap();
    let open = open_room(&c.decode, room, &pages, SMALL.chunk_tokens);
    assert_ne!(stale.key, open.key);
    let mut keys: Vec<u64> = xorshift_bytes(0x6b65_7973, 8 * 2000).chunks(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
    keys.extend([0, 1, u64::MAX, stale.key, open.key ^ 1, open.key.wrapping_add(1), open.key.rotate_left(1)]);
    keys.retain(|&k| k != open.key);
    let stale_code = Status::KVSTAGE_E_STALE_ROOM.code();
    let (mut raw, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "guesser", b"");
    for (i, &key) in keys.iter().enumerate() {
        let (req, guess) = (10 + i as u64, RoomRef { id: room, key });
        // An allocation or a grid request: refused, one round trip each.
        let reply = match i % 2 {
            0 => raw.alloc(req, guess, 0, 0, &layout),
            _ => {
                raw.send(&Message::GridReq { req, room: guess }).unwrap();
                raw.reply(Duration::from_secs(5))
            }
        };
        match reply {
            Message::AllocRsp { req: r, status, ref reason, .. } | Message::GridRsp { req: r, status, ref reason, .. } if r == req => {
                assert_eq!(status, stale_code, "key {key:#x}: {reason}");
                assert!(!reason.contains(&open.key.to_string()) && !reason.contains(&format!("{:x}", open.key)), "the refusal tells the key: {reason}");
            }
            other => panic!("key {key:#x}: unexpected reply {other:?}"),
        }
        if i % 100 != 0 {
            continue;
        }
        // Data and a slice (payloads read and discarded), a ready, a slice done, aborts.
        raw.send(&Message::Data { room: guess, chunk: 0, writer: 0, offset: w0.offset, len: w0.bytes }).unwrap();
        raw.send_bytes(&vec![0xEE; w0.bytes as usize]).unwrap();
        raw.send(&Message::Slice { room: guess, chunk: 0, buffer: 0, token: 0, byte_offset: 0, len: 64 }).unwrap();
        raw.send_bytes(&[0xEE; 64]).unwrap();
        for ask in [Message::ChunkReady { req, room: guess, chunk: 0, writer: 0, checksum: None }, Message::SliceDone { req, room: guess, chunk: 0 }] {
            raw.send(&ask).unwrap();
            match raw.reply(Duration::from_secs(5)) {
                Message::Arrived { req: r, status, reason } if r == req => assert_eq!(status, stale_code, "key {key:#x}: {reason}"),
                other => panic!("key {key:#x}: unexpected reply {other:?}"),
            }
        }
        raw.send(&Message::Abort { room: guess, chunk: u32::MAX, reason: "guessing".into() }).unwrap();
        raw.send(&Message::Abort { room: guess, chunk: 0, reason: "guessing".into() }).unwrap();
    }
    raw.barrier(1, 0); // every frame was processed, the session is served
    assert_eq!(rx.stats().ring_live, 0, "a guessed key got ring space");
    match rx.wait_room(open, Some(Duration::from_millis(300))) {
        Err(e) if e.code() == Status::KVSTAGE_E_TIMEOUT => {}
        other => panic!("frames with guessed keys changed the room: {other:?}"),
    }
    let (stray, first) = pool_scan_canary(&c.dpool, &all_pages(&c.dpool));
    assert_eq!(stray, 0, "a guessed key's bytes reached the pool: {first:?}");
    // The room's own senders, with its key: every writer slot was still theirs.
    c.send_room(open, &pages, "after guesses").unwrap_or_else(|e| panic!("{}", e.chain()));
    rx.wait_room(open, Some(Duration::from_secs(5))).unwrap_or_else(|e| panic!("room {room}: {}", e.chain()));
    c.verify_room("after guesses", room, &pages);
    rx.release_room(open, None).unwrap();
    pool_fill_canary(&c.dpool, &pages);
    raw.barrier(2, 0);
    drop(raw);
    after_attack(&c, &base, "stale and guessed room keys");
}

/// The trace id of an allocation request is a remote-supplied string that ends up in the decode
/// side's log lines: one that could forge a line (a newline) or grow without bound is refused,
/// claims nothing and leaves the session usable; the room takes the first valid id a writer names
/// and keeps it (a second writer cannot rename the request).
#[test]
fn a_lying_trace_id_is_refused_and_the_first_one_named_stays() {
    let _serial = serial();
    let c = Cluster::new(SMALL, decode_options(&SMALL), RingSpec::Owned(1 << 20));
    let room = open_room(&c.decode, 81, &c.room_pages(81, 1), SMALL.chunk_tokens);
    let (mut w0, _) = RawPeer::handshake(c.addr(), &SMALL.shape(0, 2), "trace-0", b"");
    let (mut w1, _) = RawPeer::handshake(c.addr(), &SMALL.shape(1, 2), "trace-1", b"");
    let layout = SMALL.layout(0, 2);
    let ask = |raw: &mut RawPeer, req: u64, writer: u32, trace: &str| {
        let msg = Message::AllocReq { req, room, chunk: 0, writer, tokens: layout.tokens, bytes: layout.total_bytes, trace: trace.into(), pool_tokens: None, direct: false };
        raw.send(&msg).unwrap();
        raw.reply(Duration::from_secs(5))
    };
    for (req, bad) in [(1, "req-81\n2026-12-05T00:00:00Z ERROR forged"), (2, "x y"), (3, "é")] {
        match ask(&mut w0, req, 0, bad) {
            Message::AllocRsp { status, reason, .. } => {
                assert_eq!(status, Status::KVSTAGE_E_PROTOCOL.code(), "{reason}");
                assert!(reason.contains("trace id") && !reason.contains('\n'), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    let trace = |c: &Cluster| c.decode.receiver().describe_room(room).unwrap().trace;
    assert_eq!(trace(&c), kvstage::protocol::trace::derived_trace(room), "a refused id names nothing");
    assert!(matches!(ask(&mut w0, 4, 0, "req-81"), Message::AllocRsp { status: 0, .. }));
    assert!(matches!(ask(&mut w1, 5, 1, "someone-else"), Message::AllocRsp { status: 0, .. }));
    assert_eq!(trace(&c), "req-81");
    assert!(c.decode.receiver().describe_room(room).unwrap().chunks[0].writers.len() == 2);
}
