//! A host that vanishes mid-transfer is noticed on both sides within the dead-peer window.
//!
//! Two network namespaces joined by a veth pair (a private /30 that exists only inside them): the
//! decode engine runs in namespace A, the prefill side in namespace B, each as a child process (this
//! test executable re-run under `ip netns exec` with the role in an environment variable, driven by
//! line commands on stdin; protocol lines on stdout carry a marker, everything else is libtest
//! noise). Both engines use a 3 s `dead_peer_timeout`. The host vanishes without a FIN or an RST,
//! in one of two ways ([`Cut`]): both veth ends go down (routes go with them), or each side's
//! neighbour entry for the other points at a MAC nobody has (links and routes stay up: packets
//! leave and are dropped, as with a crashed remote host).
//!
//! Scenarios (each in its own pair of namespaces, one at a time for clean timings):
//! - `watermark_wait`: the prefill sender holds a grant and waits on the receiver's watermark (the
//!   ring holds one chunk, occupied by a chunk still waiting for its second writer) when the link
//!   is cut: both sockets are idle, keepalive must notice.
//! - `payload_on_the_wire`, `payload_write_blocked[_silent_host]`: the prefill → decode direction is
//!   rate-limited (`tc ... tbf`), so the chunk's payload is on the wire when the host vanishes; the
//!   sender has unacknowledged data (`TCP_USER_TIMEOUT`), in the second case more than any socket
//!   buffer holds (it is blocked inside its write); the receiver is inside the payload read.
//! - `idle_session[_silent_host]`: a connected session with nothing in flight; the decode side must
//!   drop the connection (keepalive), and a transfer tried afterwards must fail, not hang.
//! - `deadline_with_payload_on_the_wire`, `deadline_inside_the_write`: no host vanishes; the link
//!   stays slow, and the transfer's own deadline (1.5 s) passes with its payload still in the
//!   stream (waiting for the acknowledgement; blocked inside the write). The decode ring must let
//!   the grant go within 3 s of the sender's `TIMEOUT` (not at the receiver's payload bound, 7 s
//!   and 35 s after the payload began), the sender's session is dead, and a new session to the same
//!   decode engine delivers the next request.
//!
//! Each asserts: the prefill transfer fails with `PEER_GONE` or `TIMEOUT`, and the decode room wait
//! with `PEER_GONE` (or `TIMEOUT`), within `dead_peer_timeout` + 7 s of the cut (operation
//! deadlines are 60 s, so neither can be an operation's own deadline); once the rooms are released
//! the decode ring holds no allocation and no connection; both engines are then freed promptly.
//!
//! Needs root and `ip netns` (iproute2; `tc` with `tbf` for the payload cases); otherwise it prints
//! `skipped: ...` and passes. Under CI (`CI=true`) a missing capability is a failure unless
//! `KVSTAGE_ALLOW_NETNS_SKIP=1`.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions};
use kvstage::session::receiver::RoomOpening;
use kvstage::geometry::{ModelKind, PoolShape};
use kvstage::protocol::RoomRef;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage_testkit::HostPool;
use kvstage::Status;

/// Dead-peer timeout of both engines.
const DEAD_PEER: Duration = Duration::from_secs(3);
/// Time either side may take past `DEAD_PEER` to notice (keepalive ticks, a loaded 2-core machine).
const SLACK: Duration = Duration::from_secs(7);
/// Operation deadlines far beyond the window: a failure inside the window is the dead-peer
/// detection, never an operation's own deadline.
const OP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the parent keeps waiting past the window, to report how late a side was.
const OVERTIME: Duration = Duration::from_secs(10);
/// Bound for ordinary replies of a child.
const REPLY: Duration = Duration::from_secs(20);
/// A child left alone this long exits by itself.
const CHILD_WATCHDOG: Duration = Duration::from_secs(150);

// Geometry: MHA, 2 KV heads of 128 bf16, 8 layers, 16-token pages; prefill TP2 (this test plays
// rank 0 only: writer 0 of 2) into decode TP1: 8 KiB a token, 4 KiB of it from writer 0. Rooms are
// one chunk each (`KVSTAGE_VANISHED_CHUNK_TOKENS`, default 1024 tokens: 8 MiB, 4 MiB a writer).
const PAGE: u32 = 16;
const SMALL_CHUNK: u32 = 1024;
const DECODE_ROOMS: u32 = 3;

const ROLE_ENV: &str = "KVSTAGE_VANISHED_ROLE";
const LISTEN_ENV: &str = "KVSTAGE_VANISHED_LISTEN";
const CHUNK_ENV: &str = "KVSTAGE_VANISHED_CHUNK_TOKENS";
const CHILD_TEST: &str = "zz_child_role";
const MARK: &str = "@@kv ";

fn shape(rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, 2, 128, 2, PAGE, 8).with_tp(rank, tp)
}

/// Tokens of a chunk (and of a room), in a child.
fn chunk_tokens() -> u32 {
    std::env::var(CHUNK_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(SMALL_CHUNK)
}

fn chunk_pages() -> u32 {
    chunk_tokens() / PAGE
}

fn chunk_alloc_bytes() -> u64 {
    kvstage::geometry::staging_layout(&shape(0, 2), &shape(0, 1), chunk_tokens()).expect("layout").total_bytes
}

fn options(listen: &str) -> EngineOptions {
    EngineOptions {
        listen_address: listen.to_owned(),
        chunk_tokens: chunk_tokens(),
        default_deadline: Some(Duration::from_secs(10)),
        dead_peer_timeout: Some(DEAD_PEER),
        room_timeout: Some(OP_TIMEOUT),
        ..EngineOptions::default()
    }
}

// --- capability check: skip, or fail under CI ------------------------------------------------------

fn truthy(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

/// Prints the skip line and returns, or fails under CI unless skipping is allowed there.
fn skip(why: &str) {
    if truthy("CI") && !truthy("KVSTAGE_ALLOW_NETNS_SKIP") {
        panic!("vanished_host needs root and network namespaces in CI: {why} (set KVSTAGE_ALLOW_NETNS_SKIP=1 to skip)");
    }
    // Straight to the stderr handle: libtest captures print!/eprint!, and a skip must show.
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
}

fn ip_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs a command to completion (bounded); its stderr in the error.
fn run(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{shown}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return if status.success() { Ok(()) } else { Err(format!("{shown}: {status}: {}", err.trim())) };
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown}: did not finish within 20 s"));
            }
        }
    }
}

// --- the namespaces ----------------------------------------------------------------------------------

/// Two namespaces joined by a veth pair; deleted on drop (also on panic).
struct Netns {
    ip: PathBuf,
    a: String,
    b: String,
    /// veth end in `a` (decode) and in `b` (prefill).
    veth_a: &'static str,
    veth_b: &'static str,
    addr_a: String,
    addr_b: String,
}

/// How the host vanishes.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// Both veth ends go down. Their routes go with them: the kernel's retransmissions and probes
    /// then fail locally (the socket's error may be `ENETUNREACH` rather than `ETIMEDOUT`).
    LinkDown,
    /// Each side's neighbour entry for the other is pointed at a MAC address nobody has: packets
    /// still leave and silently vanish, routes and links stay up: a crashed remote host as seen
    /// through a healthy network (no local error, only `TCP_USER_TIMEOUT` and keepalive).
    Silent,
}

impl Netns {
    fn ip(&self, args: &[&str]) -> Result<(), String> {
        run(Command::new(&self.ip).args(args))
    }

    /// Creates the pair; `Err` is a missing capability (the guard cleans up what was made).
    fn create(tag: &str, subnet: u8) -> Result<Netns, String> {
        let ip = ip_tool("ip").ok_or("`ip` (iproute2) not found")?;
        let pid = std::process::id();
        let ns = Netns {
            ip,
            a: format!("kvs-{pid}-{tag}-a"),
            b: format!("kvs-{pid}-{tag}-b"),
            veth_a: "kvsa",
            veth_b: "kvsb",
            addr_a: format!("10.213.{subnet}.1"),
            addr_b: format!("10.213.{subnet}.2"),
        };
        ns.ip(&["netns", "add", &ns.a])?;
        ns.ip(&["netns", "add", &ns.b])?;
        // Made inside A with its peer inside B: the pair never exists in the host's namespace.
        ns.ip(&["-n", &ns.a, "link", "add", ns.veth_a, "type", "veth", "peer", "name", ns.veth_b, "netns", &ns.b])?;
        ns.ip(&["-n", &ns.a, "addr", "add", &format!("{}/30", ns.addr_a), "dev", ns.veth_a])?;
        ns.ip(&["-n", &ns.b, "addr", "add", &format!("{}/30", ns.addr_b), "dev", ns.veth_b])?;
        for (n, veth) in [(&ns.a, ns.veth_a), (&ns.b, ns.veth_b)] {
            ns.ip(&["-n", n, "link", "set", "lo", "up"])?;
            ns.ip(&["-n", n, "link", "set", veth, "up"])?;
        }
        Ok(ns)
    }

    /// Limits what B sends to A (the prefill's payload) to `rate` with a token bucket.
    fn rate_limit_b(&self, rate: &str) -> Result<(), String> {
        let tc = ip_tool("tc").ok_or("`tc` (iproute2) not found")?;
        run(Command::new(&self.ip).args(["netns", "exec", &self.b]).arg(tc).args([
            "qdisc", "add", "dev", self.veth_b, "root", "tbf", "rate", rate, "burst", "32kb", "limit", "512kb",
        ]))
    }

    /// Lifts [`rate_limit_b`](Self::rate_limit_b).
    fn unlimit_b(&self) -> Result<(), String> {
        let tc = ip_tool("tc").ok_or("`tc` (iproute2) not found")?;
        run(Command::new(&self.ip).args(["netns", "exec", &self.b]).arg(tc).args(["qdisc", "del", "dev", self.veth_b, "root"]))
    }

    /// The host vanishes: no FIN, no RST, packets just stop.
    fn cut(&self, how: Cut) {
        match how {
            Cut::LinkDown => {
                self.ip(&["-n", &self.a, "link", "set", self.veth_a, "down"]).expect("link down in A");
                self.ip(&["-n", &self.b, "link", "set", self.veth_b, "down"]).expect("link down in B");
            }
            Cut::Silent => {
                // A locally administered unicast address no interface has: the other end's
                // veth receives the frames and drops them as not addressed to it.
                const NOBODY: &str = "02:00:00:6b:76:00";
                for (n, veth, peer) in [(&self.a, self.veth_a, &self.addr_b), (&self.b, self.veth_b, &self.addr_a)] {
                    self.ip(&["-n", n, "neigh", "replace", peer, "lladdr", NOBODY, "dev", veth, "nud", "permanent"])
                        .expect("neighbour entry");
                }
            }
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth pair with it; one never created just fails.
        for n in [&self.a, &self.b] {
            let _ = self.ip(&["netns", "del", n]);
        }
    }
}

/// Deletes namespaces of earlier runs whose process is gone (killed before its guards ran).
fn reap_stale_namespaces() {
    let Some(ip) = ip_tool("ip") else { return };
    let Ok(dir) = std::fs::read_dir("/run/netns") else { return };
    for name in dir.filter_map(|e| e.ok()?.file_name().into_string().ok()) {
        let pid = name.strip_prefix("kvs-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = run(Command::new(&ip).args(["netns", "del", &name]));
        }
    }
}

/// One scenario at a time: the windows are timings, and this machine has 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// Root and working namespaces, or `None` after the skip line (or a panic under CI).
fn setup(tag: &str, subnet: u8) -> Option<Netns> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)");
        return None;
    }
    reap_stale_namespaces();
    match Netns::create(tag, subnet) {
        Ok(ns) => Some(ns),
        Err(why) => {
            skip(&format!("`ip netns` does not work here: {why}"));
            None
        }
    }
}

// --- child processes, seen from the parent -----------------------------------------------------------

/// A child (decode or prefill) in a namespace. Killed on drop if still running.
struct Peer {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    rx: mpsc::Receiver<(Instant, String)>,
    /// Protocol lines received but not yet asked for.
    pending: VecDeque<(Instant, String)>,
}

impl Peer {
    fn spawn(ns: &Netns, netns: &str, name: &'static str, env: &[(&str, &str)]) -> Peer {
        let exe = std::env::current_exe().expect("test executable");
        let mut cmd = Command::new(&ns.ip);
        cmd.args(["netns", "exec", netns]).arg(exe).args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"]);
        cmd.env(ROLE_ENV, name).envs(env.iter().copied()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start the {name} child: {e}"));
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest's own lines may share a line with ours: the marker finds ours.
                match line.find(MARK) {
                    Some(i) => {
                        let msg = line[i + MARK.len()..].to_owned();
                        if !msg.starts_with("stats") {
                            eprintln!("[{name}] {msg}");
                        }
                        if tx.send((Instant::now(), msg)).is_err() {
                            break;
                        }
                    }
                    None if !line.trim().is_empty() => eprintln!("[{name}: {}]", line.trim()),
                    None => {}
                }
            }
        });
        Peer { name, child, stdin, rx, pending: VecDeque::new() }
    }

    fn send(&mut self, cmd: &str) {
        let sent = writeln!(self.stdin, "{cmd}").and_then(|_| self.stdin.flush());
        sent.unwrap_or_else(|e| panic!("{}: cannot send '{cmd}': {e}", self.name));
    }

    /// The next line starting with `prefix` (others are kept for later), or `None` after `timeout`.
    /// An `error` line or the child's exit fails the test.
    fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Option<(Instant, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.pending.iter().position(|(_, l)| l.starts_with(prefix)) {
                return self.pending.remove(i);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((_, line)) if line.starts_with("error") => panic!("{} child: {line}", self.name),
                Ok(item) => self.pending.push_back(item),
                Err(mpsc::RecvTimeoutError::Timeout) => return None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("the {} child exited while the test waited for '{prefix}' ({:?})", self.name, self.child.try_wait())
                }
            }
        }
    }

    fn expect(&mut self, prefix: &str, timeout: Duration) -> (Instant, String) {
        self.wait_for(prefix, timeout)
            .unwrap_or_else(|| panic!("the {} child did not answer '{prefix}' within {timeout:?}", self.name))
    }

    fn command(&mut self, cmd: &str, reply: &str) -> String {
        self.send(cmd);
        self.expect(reply, REPLY).1
    }

    /// Whether a line starting with `prefix` has arrived (without waiting).
    fn has(&mut self, prefix: &str) -> bool {
        self.wait_for(prefix, Duration::ZERO).inspect(|item| self.pending.push_front(item.clone())).is_some()
    }

    /// `quit`: the child drops its engine (bounded: a hang there fails) and exits successfully.
    fn quit(mut self) -> Duration {
        self.send("quit");
        let (_, bye) = self.expect("bye", REPLY);
        let deadline = Instant::now() + REPLY;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    assert!(status.success(), "the {} child exited with {status}", self.name);
                    break;
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                other => panic!("the {} child did not exit after quit: {other:?}", self.name),
            }
        }
        Duration::from_millis(bye.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `stats` → (live ring allocations, connections).
fn stats(decode: &mut Peer) -> (u64, u64) {
    let line = decode.command("stats", "stats");
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|w| w.parse().expect("stats numbers")).collect();
    (v[0], v[1])
}

/// Polls `stats` until `done` holds (bounded); the last stats.
fn settle(decode: &mut Peer, within: Duration, done: impl Fn((u64, u64)) -> bool) -> (u64, u64) {
    let deadline = Instant::now() + within;
    loop {
        let s = stats(decode);
        if done(s) || Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A result line `<verb> ID STATUS MS message...` → (status name, message).
fn parse_outcome(line: &str) -> (String, String) {
    let mut w = line.splitn(5, ' ');
    let (_verb, _id, status, _ms) = (w.next(), w.next(), w.next().unwrap_or("?").to_owned(), w.next());
    (status, w.next().unwrap_or("").to_owned())
}

/// Waits for a side's failure after the cut and checks its status and timing; returns the time
/// from the cut.
fn noticed(peer: &mut Peer, prefix: &str, cut: Instant, what: &str, allowed: &[Status]) -> Duration {
    let window = DEAD_PEER + SLACK;
    let left = (cut + window + OVERTIME).saturating_duration_since(Instant::now());
    let (at, line) = peer
        .wait_for(prefix, left)
        .unwrap_or_else(|| panic!("{what}: no outcome {:?} after the host vanished (window {window:?})", window + OVERTIME));
    let after = at.saturating_duration_since(cut);
    let (status, msg) = parse_outcome(&line);
    eprintln!("{what}: {status} {after:.2?} after the cut ({msg})");
    assert!(
        allowed.iter().any(|s| s.name() == status),
        "{what}: expected one of {:?}, got {status}: {msg}",
        allowed.iter().map(|s| s.name()).collect::<Vec<_>>()
    );
    assert!(after <= window, "{what}: noticed only {after:.2?} after the cut (window {window:?}): {msg}");
    after
}

const GONE: [Status; 2] = [Status::KVSTAGE_E_PEER_GONE, Status::KVSTAGE_E_TIMEOUT];

/// `room ID` on the decode child; the key of that opening, which the prefill child's `send ID KEY`
/// names.
fn open_room(decode: &mut Peer, id: u64) -> u64 {
    let line = decode.command(&format!("room {id}"), &format!("ok room {id} "));
    line.split_whitespace().nth(3).and_then(|k| k.parse().ok()).unwrap_or_else(|| panic!("no room key in '{line}'"))
}

/// Decode child in A, prefill child in B, connected; rooms of `chunk_tokens` (one chunk).
fn start(ns: &Netns, chunk_tokens: u32) -> (Peer, Peer) {
    let chunk = chunk_tokens.to_string();
    let mut decode = Peer::spawn(ns, &ns.a, "decode", &[(LISTEN_ENV, &ns.addr_a), (CHUNK_ENV, &chunk)]);
    let (_, addr) = decode.expect("addr", REPLY);
    let addr = addr.split_whitespace().nth(1).expect("address").to_owned();
    let mut prefill = Peer::spawn(ns, &ns.b, "prefill", &[(CHUNK_ENV, &chunk)]);
    prefill.expect("started", REPLY);
    prefill.command(&format!("connect {addr}"), "connected");
    let s = settle(&mut decode, REPLY, |(_, conns)| conns == 1);
    assert_eq!(s.1, 1, "the decode side does not see the session");
    (decode, prefill)
}

fn finish(decode: Peer, prefill: Peer) {
    let p = prefill.quit();
    let d = decode.quit();
    eprintln!("engines dropped after the cut: prefill in {p:.2?}, decode in {d:.2?}");
}

/// The sender holds a grant and waits on the watermark when the host vanishes.
#[test]
fn watermark_wait() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(ns) = setup("wm", 1) else { return };
    let (mut decode, mut prefill) = start(&ns, SMALL_CHUNK);
    let key1 = open_room(&mut decode, 1);
    let key2 = open_room(&mut decode, 2);
    // Room 1: writer 0 of 2 delivers; the chunk waits for writer 1, so its grant fills the ring.
    prefill.send(&format!("send 1 {key1}"));
    let (_, sent) = prefill.expect("sent 1", REPLY);
    assert_eq!(parse_outcome(&sent).0, "KVSTAGE_OK", "room 1, writer 0: {sent}");
    assert_eq!(stats(&mut decode), (1, 1), "room 1's grant must hold the ring");
    // Room 2: granted in the next round, the sender waits for the watermark that room 1 holds.
    prefill.send(&format!("send 2 {key2}"));
    let (live, _) = settle(&mut decode, REPLY, |(live, _)| live == 2);
    assert_eq!(live, 2, "room 2 was never granted");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!prefill.has("sent 2"), "room 2's transfer ended before the cut: the ring did not make it wait");
    decode.send("wait 2");
    std::thread::sleep(Duration::from_millis(200));

    let cut = Instant::now();
    ns.cut(Cut::LinkDown);
    let p = noticed(&mut prefill, "sent 2", cut, "prefill transfer (waiting on the watermark)", &GONE);
    let d = noticed(&mut decode, "waited 2", cut, "decode wait_room", &GONE);
    eprintln!("watermark_wait: prefill noticed after {p:.2?}, decode after {d:.2?} (dead_peer_timeout {DEAD_PEER:?})");

    decode.command("release 2", "released 2");
    let s = settle(&mut decode, Duration::from_secs(3), |s| s == (1, 0));
    assert_eq!(s, (1, 0), "after room 2's release: only room 1's grant may stay, and no connection (live, conns)");
    decode.command("release 1", "released 1");
    let s = settle(&mut decode, Duration::from_secs(3), |s| s == (0, 0));
    assert_eq!(s, (0, 0), "ring allocations or connections left after every room was released (live, conns)");
    finish(decode, prefill);
}

/// A 4 MiB payload on a rate-limited wire when the host vanishes. With Linux's usual
/// `net.core.wmem_max` of 4 MiB the whole payload fits in the 8 MiB send buffer the engine asks
/// for: the sender waits for the arrival acknowledgement with data unacknowledged.
#[test]
fn payload_on_the_wire() {
    payload_in_flight("wire", 2, SMALL_CHUNK, Cut::LinkDown);
}

/// A 32 MiB payload, far beyond any socket buffer: the sender is blocked inside its write when the
/// host vanishes.
#[test]
fn payload_write_blocked() {
    payload_in_flight("blk", 4, 8 * SMALL_CHUNK, Cut::LinkDown);
}

/// As [`payload_write_blocked`], the host silent behind a link that stays up.
#[test]
fn payload_write_blocked_silent_host() {
    payload_in_flight("blks", 5, 8 * SMALL_CHUNK, Cut::Silent);
}

/// The pair of namespaces with the prefill → decode direction at 4 Mbit/s (about 0.5 MB/s, so a
/// payload is on the wire for seconds); `None` where that cannot be made (skipped, said so).
fn rate_limited(tag: &str, subnet: u8) -> Option<Netns> {
    let ns = setup(tag, subnet)?;
    if let Err(why) = ns.rate_limit_b("4mbit") {
        skip(&format!("cannot rate-limit the veth (tc tbf): {why}"));
        return None;
    }
    Some(ns)
}

fn payload_in_flight(tag: &str, subnet: u8, chunk_tokens: u32, how: Cut) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(ns) = rate_limited(tag, subnet) else { return };
    let (mut decode, mut prefill) = start(&ns, chunk_tokens);
    let key = open_room(&mut decode, 1);
    prefill.send(&format!("send 1 {key}"));
    let (live, _) = settle(&mut decode, REPLY, |(live, _)| live == 1);
    assert_eq!(live, 1, "room 1 was never granted");
    // Past the allocation and the gather: the payload write is under way.
    std::thread::sleep(Duration::from_millis(700));
    assert!(!prefill.has("sent 1"), "the transfer ended before the cut: the rate limit did not hold it on the wire");
    decode.send("wait 1");
    std::thread::sleep(Duration::from_millis(200));

    let cut = Instant::now();
    ns.cut(how);
    let p = noticed(&mut prefill, "sent 1", cut, "prefill transfer (payload on the wire)", &GONE);
    let d = noticed(&mut decode, "waited 1", cut, "decode wait_room (inside the payload read)", &GONE);
    eprintln!(
        "payload of {chunk_tokens} tokens in flight, {how:?}: prefill noticed after {p:.2?}, decode after {d:.2?} \
         (dead_peer_timeout {DEAD_PEER:?})"
    );

    decode.command("release 1", "released 1");
    let s = settle(&mut decode, Duration::from_secs(3), |s| s == (0, 0));
    assert_eq!(s, (0, 0), "ring allocations or connections left after the release (live, conns)");
    finish(decode, prefill);
}

/// A 4 MiB payload (it fits in the send buffer) on a slow link past the transfer's deadline: the
/// sender gives up waiting for the arrival acknowledgement with its bytes still in the stream.
#[test]
fn deadline_with_payload_on_the_wire() {
    // The 4 MiB must fit in the send buffer for the sender to wait for the acknowledgement; a
    // kernel whose `net.core.wmem_max` is smaller blocks the write instead (the other scenario).
    let wmem_max: u64 = std::fs::read_to_string("/proc/sys/net/core/wmem_max").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    let path = if wmem_max >= 4 << 20 { "waiting for the arrival acknowledgement" } else { "writing to peer" };
    deadline_in_flight("dlw", 7, SMALL_CHUNK, path);
}

/// A 32 MiB payload on a slow link past the transfer's deadline: the sender's write times out.
#[test]
fn deadline_inside_the_write() {
    deadline_in_flight("dlb", 8, 8 * SMALL_CHUNK, "writing to peer");
}

/// The transfer's deadline, far shorter than the payload takes on the rate-limited link.
const SHORT_DEADLINE_MS: u64 = 1500;
/// How soon after the sender's `TIMEOUT` the decode ring must have let the grant go: a reset
/// crosses the link at once (behind at most the token bucket's 512 KB queue, 1 s at 4 Mbit/s).
const GRANT_FREED_WITHIN: Duration = Duration::from_secs(3);

/// `path`: what the sender's `TIMEOUT` must say it was doing (which of the two ways to give up
/// with bytes in the stream this run took).
fn deadline_in_flight(tag: &str, subnet: u8, chunk_tokens: u32, path: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(ns) = rate_limited(tag, subnet) else { return };
    let (mut decode, mut prefill) = start(&ns, chunk_tokens);
    let key = open_room(&mut decode, 1);
    decode.send("wait 1");
    prefill.send(&format!("send 1 {key} {SHORT_DEADLINE_MS}"));
    let (failed_at, line) = prefill.expect("sent 1", REPLY);
    let (status, msg) = parse_outcome(&line);
    assert_eq!(status, "KVSTAGE_E_TIMEOUT", "the transfer must end by its own deadline: {msg}");
    assert!(msg.contains(path), "the transfer gave up elsewhere than '{path}': {msg}");
    let (live, _) = settle(&mut decode, GRANT_FREED_WITHIN, |(live, _)| live == 0);
    let freed = failed_at.elapsed();
    assert_eq!(
        live, 0,
        "{chunk_tokens} tokens: the decode ring still holds the grant {freed:.2?} after the sender's deadline passed with its payload in the stream"
    );
    eprintln!("{chunk_tokens} tokens: the sender timed out; the decode ring was free {freed:.2?} later");
    // The decode side's room fails (its writer's connection went), not at its own timeout.
    let (_, waited) = decode.expect("waited 1", REPLY);
    let (status, msg) = parse_outcome(&waited);
    assert!(["KVSTAGE_E_PEER_GONE", "KVSTAGE_E_CANCELED"].contains(&status.as_str()), "decode room 1: {status}: {msg}");
    // The session that gave up is dead; a new one delivers the next request.
    assert_eq!(prefill.command("alive", "alive"), "alive 0", "the session that reset its connection still claims to be alive");
    ns.unlimit_b().expect("lift the rate limit");
    prefill.command("reconnect", "connected");
    let key = open_room(&mut decode, 2);
    prefill.send(&format!("send 2 {key}"));
    let (_, sent) = prefill.expect("sent 2", REPLY);
    assert_eq!(parse_outcome(&sent).0, "KVSTAGE_OK", "room 2 over a new session: {sent}");
    decode.command("release 1", "released 1");
    decode.command("release 2", "released 2");
    let s = settle(&mut decode, Duration::from_secs(3), |(live, conns)| live == 0 && conns == 1);
    assert_eq!(s, (0, 1), "after both releases: no ring allocation, only the new session's connection (live, conns)");
    finish(decode, prefill);
}

/// Nothing in flight: keepalive alone must notice on the decode side; a later transfer fails.
#[test]
fn idle_session() {
    idle("idle", 3, Cut::LinkDown);
}

/// As [`idle_session`], the host silent behind a link that stays up.
#[test]
fn idle_session_silent_host() {
    idle("idles", 6, Cut::Silent);
}

fn idle(tag: &str, subnet: u8, how: Cut) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(ns) = setup(tag, subnet) else { return };
    let (mut decode, mut prefill) = start(&ns, SMALL_CHUNK);
    let window = DEAD_PEER + SLACK;

    let cut = Instant::now();
    ns.cut(how);
    let (_, conns) = settle(&mut decode, window + OVERTIME, |(_, conns)| conns == 0);
    let d = cut.elapsed();
    eprintln!("idle session, {how:?}: decode dropped the connection {d:.2?} after the cut");
    assert_eq!(conns, 0, "the decode side still holds the connection {d:.2?} after the host vanished");
    assert!(d <= window, "the decode side noticed only {d:.2?} after the cut (window {window:?})");
    // The prefill side: a transfer started now must fail within the window (at once if its
    // keepalive already noticed), not wait for its own deadline. (No room was opened: any key.)
    prefill.send("send 1 1");
    let p = noticed(&mut prefill, "sent 1", cut, "prefill transfer after an idle cut", &GONE);
    eprintln!("idle session, {how:?}: prefill transfer failed {p:.2?} after the cut");
    let s = stats(&mut decode);
    assert_eq!(s, (0, 0), "ring allocations or connections left (live, conns)");
    finish(decode, prefill);
}

// --- the child roles ---------------------------------------------------------------------------------

fn say(msg: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{MARK}{msg}");
    let _ = out.flush();
}

/// `<verb> ID STATUS MS message` (the message `-` on success).
fn report(verb: &str, id: u64, start: Instant, result: kvstage::Result<Status>) {
    let ms = start.elapsed().as_millis();
    match result {
        Ok(s) => say(format!("{verb} {id} {} {ms} -", s.name())),
        Err(e) => say(format!("{verb} {id} {} {ms} {}", e.code().name(), e.chain().replace('\n', " | "))),
    }
}

/// Not a test: the decode or prefill child when `KVSTAGE_VANISHED_ROLE` is set (see `Peer::spawn`);
/// returns at once otherwise.
#[test]
fn zz_child_role() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_WATCHDOG);
        eprintln!("vanished_host child: watchdog expired after {CHILD_WATCHDOG:?}, exiting");
        std::process::exit(3);
    });
    let result = std::panic::catch_unwind(|| match role.as_str() {
        "decode" => decode_child(),
        "prefill" => prefill_child(),
        other => panic!("unknown role {other}"),
    });
    if let Err(p) = result {
        let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        say(format!("error {role} child panicked: {}", why.unwrap_or_default()));
        std::process::exit(2);
    }
}

/// Commands on stdin: (command, argument, second argument, third argument); ends with stdin (the
/// parent gone) or `quit`.
fn commands() -> impl Iterator<Item = (String, String, String, String)> {
    std::io::stdin().lock().lines().map_while(Result::ok).map(|line| {
        let mut w = line.split_whitespace().map(str::to_owned);
        (w.next().unwrap_or_default(), w.next().unwrap_or_default(), w.next().unwrap_or_default(), w.next().unwrap_or_default())
    })
}

fn decode_child() {
    let listen = std::env::var(LISTEN_ENV).expect("listen address");
    let pool = HostPool::new(shape(0, 1), (DECODE_ROOMS * chunk_pages()) as u64);
    let engine = Arc::new(Engine::new(options(&format!("{listen}:0"))).expect("decode engine"));
    engine.register_pool(pool.layout.clone()).expect("pool");
    // One chunk's allocation: a second grant waits for the first to go.
    engine.register_staging(None, chunk_alloc_bytes() as usize).expect("staging ring");
    say(format!("addr {}", engine.local_addr()));
    let mut waits = Vec::new();
    // Each open room's key (its latest opening).
    let mut keys = std::collections::HashMap::new();
    for (cmd, arg, _, _) in commands() {
        let id: u64 = arg.parse().unwrap_or(0);
        match cmd.as_str() {
            "room" => {
                let n = chunk_pages();
                let pages: Vec<u32> = ((id as u32 - 1) * n..id as u32 * n).collect();
                match engine.receiver().open_room(RoomOpening::new(id, &pages, chunk_tokens())) {
                    Ok((key, _)) => {
                        keys.insert(id, key);
                        say(format!("ok room {id} {key}"))
                    }
                    Err(e) => say(format!("error open_room {id}: {}", e.chain())),
                }
            }
            "wait" => {
                let engine = engine.clone();
                let at = RoomRef { id, key: keys.get(&id).copied().unwrap_or(0) };
                waits.push(std::thread::spawn(move || {
                    let start = Instant::now();
                    report("waited", id, start, engine.receiver().wait_room(at, Some(OP_TIMEOUT)));
                }));
            }
            "stats" => {
                let s = engine.receiver().stats();
                say(format!("stats {} {}", s.ring_live, s.connections));
            }
            "release" => {
                engine.receiver().release_room(RoomRef { id, key: keys.get(&id).copied().unwrap_or(0) }, None).unwrap();
                say(format!("released {id}"));
            }
            "quit" => break,
            other => say(format!("error unknown command '{other}'")),
        }
    }
    for w in waits {
        let _ = w.join();
    }
    let start = Instant::now();
    drop(engine);
    say(format!("bye {}", start.elapsed().as_millis()));
    drop(pool);
}

fn prefill_child() {
    let mut pool = HostPool::new(shape(0, 2), chunk_pages() as u64);
    let pages: Vec<u32> = (0..chunk_pages()).collect();
    pool.fill(&pages, 0);
    let engine = Engine::new(options("0.0.0.0:0")).expect("prefill engine");
    engine.register_pool(pool.layout.clone()).expect("pool");
    say("started");
    let mut session = None;
    let mut sends = Vec::new();
    let mut addr = String::new();
    for (cmd, arg, key, ms) in commands() {
        let id: u64 = arg.parse().unwrap_or(0);
        match cmd.as_str() {
            // `connect ADDR`, or `reconnect` to the last address: a new session.
            "connect" | "reconnect" => {
                if cmd == "connect" {
                    addr = arg;
                }
                match engine.connect(&addr, "vanish", Some(Duration::from_secs(10))) {
                    Ok(s) => {
                        session = Some(s);
                        say("connected");
                    }
                    Err(e) => say(format!("error connect: {}", e.chain())),
                }
            }
            "alive" => {
                let alive = session.as_ref().is_some_and(|s| s.describe().dead.is_none());
                say(format!("alive {}", alive as u8));
            }
            // `send ID KEY [MS]`: the room and the key of its opening (the decode child's `ok room
            // ID KEY`), the transfer's deadline (default `OP_TIMEOUT`).
            "send" => {
                let Some(s) = session.clone() else {
                    say("error send before connect");
                    continue;
                };
                let Ok(key) = key.parse::<u64>() else {
                    say(format!("error send {id} without the room's key"));
                    continue;
                };
                let pages = pages.clone();
                let timeout = ms.parse().map_or(OP_TIMEOUT, Duration::from_millis);
                sends.push(std::thread::spawn(move || {
                    let s: Arc<kvstage::session::sender::SenderSession> = s;
                    let desc = TransferDesc { room: RoomRef { id, key }, chunk: 0, pages, timeout: Some(timeout), ..Default::default() };
                    let start = Instant::now();
                    report("sent", id, start, s.transfer(&desc, &Op::new(s.waker())));
                }));
            }
            "quit" => break,
            other => say(format!("error unknown command '{other}'")),
        }
    }
    let start = Instant::now();
    drop(session);
    drop(engine); // ends the session: a transfer still waiting fails at once
    for s in sends {
        let _ = s.join();
    }
    say(format!("bye {}", start.elapsed().as_millis()));
    drop(pool);
}
