//! kvstage-bench: the staged path against its limits, every figure next to a baseline measured in
//! the same run on the same bytes between the same two processes.
//!
//! staged   end-to-end rooms (gather + write + arrival + scatter), decode verified afterwards
//! slice    the slice path for the same request (time-boxed: ops/s and the extrapolated time)
//! raw_tcp  a plain TCP stream of the same byte count to the decode process
//! memcpy   single-thread memcpy of the same byte count
//! gather   the prefill gathers of a request alone; scatter: decode rank 0's scatters alone
//!
//! `--inflight N` keeps N requests in flight through the asynchronous API (`transfer_async` on the
//! engines' own workers; this process submits from one thread) and reports the aggregate rate and
//! the request latencies; a sampler thread records the most library threads seen. `--stuck-peer`
//! measures what a decode peer that stops reading costs the other sessions of its prefill engine.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvstage::copy::{CopyEngine, HostCopyEngine};
use kvstage::engine::EngineOptions;
use kvstage::geometry;
use kvstage::session::notify::Completion;
use kvstage::session::sender::TransferDesc;
use kvstage::testkit::cluster::{serve_decode_with, DecodeChild, DecodeOptions, Prefill, Setup};
use kvstage::testkit::{model, HostPool};
use kvstage::{Error, Status};

const USAGE: &str = "usage: kvstage-bench [--model llama3-8b|qwen3-32b|llama3-70b|deepseek-v3] [--kind mha|mla] [--layers N] [--kv-heads N] \
[--head-dim N] [--dtype-bytes N] [--prefill-tp N] [--decode-tp N] [--page-size N] [--tokens N (per request)] \
[--chunk-tokens N] [--ring-chunks N] [--reps N] [--warmup N] [--slice-seconds S] [--threads N] \
[--inflight N] [--requests N] [--raw-streams N] [--transfer-threads N] [--staging-buffers N] \
[--transport tcp] [--memory host] [--json FILE] [--sweep tokens|page-size|tp|inflight [--plot FILE.svg]] \
| --stuck-peer [--inflight N] [--stuck-seconds S] [--json FILE] | --doctor [--json]";

#[derive(Clone)]
struct Args {
    setup: Setup,
    reps: u32,
    warmup: u32,
    slice_seconds: f64,
    threads: u32,
    json: Option<String>,
    sweep: Option<String>,
    plot: Option<String>,
    role_decode: bool,
    /// Requests in flight at once (all prefill ranks together).
    inflight: u32,
    /// Timed requests (default: the larger of --reps and twice --inflight).
    requests: Option<u32>,
    /// Raw TCP streams (default: as many as there are sender sessions).
    raw_streams: Option<u32>,
    /// Prefill engine options (default: the library's defaults).
    transfer_threads: Option<u32>,
    staging_buffers: Option<u32>,
    stuck_peer: bool,
    stuck_seconds: f64,
    /// Decode side only: this rank's engine stops reading (the stuck peer).
    stuck_rank: Option<u32>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        setup: Setup {
            model: model("llama3-70b").expect("preset exists"),
            prefill_tp: 4,
            decode_tp: 2,
            page_size: 16,
            tokens: 2048,
            chunk_tokens: 2048,
            ring_chunks: 2,
        },
        reps: 5,
        warmup: 1,
        slice_seconds: 5.0,
        threads: 2,
        json: None,
        sweep: None,
        plot: None,
        role_decode: false,
        inflight: 1,
        requests: None,
        raw_streams: None,
        transfer_threads: None,
        staging_buffers: None,
        stuck_peer: false,
        stuck_seconds: 10.0,
        stuck_rank: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        if a.setup.parse_flag(&flag, &mut value)? {
            continue;
        }
        let num = |v: String| v.parse::<f64>().map_err(|_| format!("{flag}: '{v}' is not a number"));
        match flag.as_str() {
            "--reps" => a.reps = num(value()?)?.max(1.0) as u32,
            "--warmup" => a.warmup = num(value()?)? as u32,
            "--slice-seconds" => a.slice_seconds = num(value()?)?,
            "--threads" => a.threads = num(value()?)?.max(1.0) as u32,
            "--json" => a.json = Some(value()?),
            "--plot" => a.plot = Some(value()?),
            "--sweep" => {
                let v = value()?;
                if !["tokens", "page-size", "tp", "inflight"].contains(&v.as_str()) {
                    return Err(format!("--sweep {v}: expected tokens, page-size, tp or inflight"));
                }
                a.sweep = Some(v);
            }
            "--inflight" => a.inflight = num(value()?)?.clamp(1.0, 4096.0) as u32,
            "--requests" => a.requests = Some(num(value()?)?.max(1.0) as u32),
            "--raw-streams" => a.raw_streams = Some(num(value()?)?.clamp(1.0, 256.0) as u32),
            "--transfer-threads" => a.transfer_threads = Some(num(value()?)?.clamp(1.0, 256.0) as u32),
            "--staging-buffers" => a.staging_buffers = Some(num(value()?)?.max(1.0) as u32),
            "--stuck-peer" => a.stuck_peer = true,
            "--stuck-seconds" => a.stuck_seconds = num(value()?)?.max(0.5),
            "--stuck-rank" => a.stuck_rank = Some(num(value()?)? as u32),
            "--transport" => {
                let v = value()?;
                if v != "tcp" {
                    return Err(format!("--transport {v}: only tcp is available in this build"));
                }
            }
            "--memory" => {
                let v = value()?;
                if v != "host" {
                    return Err(format!("--memory {v}: only host memory is available in this build"));
                }
            }
            "--role-decode" => a.role_decode = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument '{other}'\n{USAGE}")),
        }
    }
    a.setup.check()?;
    if a.plot.is_some() && a.sweep.is_none() {
        return Err("--plot needs --sweep".into());
    }
    if a.stuck_peer && a.sweep.is_some() {
        return Err("--stuck-peer runs on its own, not in a --sweep".into());
    }
    Ok(a)
}

/// Progress on stderr, only when it is a terminal.
struct Progress {
    on: bool,
    total: u32,
    done: u32,
}

impl Progress {
    fn new(total: u32) -> Progress {
        Progress { on: std::io::stderr().is_terminal(), total, done: 0 }
    }
    fn step(&mut self, what: &str) {
        self.done += 1;
        if self.on {
            let width = 30;
            let filled = (self.done * width / self.total.max(1)).min(width) as usize;
            eprint!("\r[{}{}] {}/{} {what:<24}", "#".repeat(filled), ".".repeat(width as usize - filled), self.done, self.total);
            if self.done >= self.total {
                eprintln!();
            }
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Section {
    bytes: u64,
    samples: Vec<f64>,
    /// Requests in flight at once while the samples were taken.
    inflight: u32,
    /// Measured aggregate rate (GB/s) where it is not `bytes / median` (requests overlapping).
    rate: Option<f64>,
    /// CPU time (user + system, this process and the decode process) per request, in seconds.
    cpu: Option<f64>,
    /// While the samples were taken: cores these two processes kept busy on average, and the
    /// share of the machine's CPU time that was idle.
    cores: Option<(f64, f64)>,
}

impl Section {
    fn new(bytes: u64) -> Section {
        Section { bytes, samples: Vec::new(), inflight: 1, rate: None, cpu: None, cores: None }
    }
    fn quantile(&self, q: f64) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        if s.is_empty() {
            return 0.0;
        }
        s[((s.len() - 1) as f64 * q).round() as usize]
    }
    fn median(&self) -> f64 {
        self.quantile(0.5)
    }
    fn p99(&self) -> f64 {
        self.quantile(0.99)
    }
    /// One request's bytes over its median time.
    fn request_gbps(&self) -> f64 {
        let m = self.median();
        if m > 0.0 { self.bytes as f64 / m / 1e9 } else { 0.0 }
    }
    /// The aggregate rate: measured over a window when requests overlap, else one request's.
    fn gbps(&self) -> f64 {
        self.rate.unwrap_or_else(|| self.request_gbps())
    }
    fn json(&self, extra: &str) -> String {
        format!(
            "{{\"bytes\": {}, \"seconds_median\": {:.9}, \"seconds_p99\": {:.9}, \"gbps\": {:.6}, \"inflight\": {}, \
             \"latency_p50_s\": {:.9}, \"latency_p99_s\": {:.9}{extra}",
            self.bytes,
            self.median(),
            self.p99(),
            self.gbps(),
            self.inflight,
            self.median(),
            self.p99()
        ) + &self.cpu.map_or(String::new(), |c| format!(", \"cpu_s_per_request\": {c:.6}"))
            + &self.cores.map_or(String::new(), |(busy, idle)| format!(", \"cores_busy\": {busy:.3}, \"machine_idle\": {idle:.3}"))
            + "}"
    }
}

struct SliceResult {
    section: Section,
    writes: u64,
    writes_per_second: f64,
    boxed: bool,
}

/// The staged path at load: requests (rooms) kept in flight through `transfer_async`.
struct Load {
    /// Samples: request latencies (submission to decode room complete); `rate`: the aggregate.
    section: Section,
    warmup_requests: u32,
    timed_requests: u32,
    /// The window the aggregate rate was measured over (seconds).
    window: f64,
    /// Operations (chunk transfers, all sessions) submitted.
    ops: u64,
}

/// The sections that do not depend on the load (skipped in an inflight sweep).
struct Fixed {
    slice: SliceResult,
    memcpy: Section,
    gather: Section,
    scatter: Section,
}

struct Report {
    staged: Load,
    raw_tcp: Section,
    raw_streams: u32,
    fixed: Option<Fixed>,
    threads: ThreadPeak,
    verified: bool,
}

fn time<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<(f64, T), Error> {
    let start = Instant::now();
    let v = f()?;
    Ok((start.elapsed().as_secs_f64(), v))
}

/// The most threads this process had at once, all and `kvstage-*` named (the library's).
#[derive(Clone, Copy, Debug, Default)]
struct ThreadPeak {
    total: usize,
    kvstage: usize,
    samples: u64,
}

/// Samples /proc/self/task every few milliseconds on its own thread until dropped.
struct ThreadSampler {
    stop: Arc<AtomicBool>,
    total: Arc<AtomicUsize>,
    kvstage: Arc<AtomicUsize>,
    samples: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// (threads, threads whose name starts with `kvstage-`) of this process now.
fn count_threads() -> (usize, usize) {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return (0, 0) };
    let (mut total, mut kvstage) = (0, 0);
    for entry in dir.flatten() {
        total += 1;
        if std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|name| name.starts_with("kvstage-")) {
            kvstage += 1;
        }
    }
    (total, kvstage)
}

impl ThreadSampler {
    fn start() -> ThreadSampler {
        let mut me = ThreadSampler {
            stop: Arc::new(AtomicBool::new(false)),
            total: Arc::new(AtomicUsize::new(0)),
            kvstage: Arc::new(AtomicUsize::new(0)),
            samples: Arc::new(AtomicU64::new(0)),
            handle: None,
        };
        let (stop, total, kvstage, samples) = (me.stop.clone(), me.total.clone(), me.kvstage.clone(), me.samples.clone());
        me.handle = std::thread::Builder::new()
            .name("bench-threads".into())
            .spawn(move || loop {
                let (t, k) = count_threads();
                total.fetch_max(t, Ordering::Relaxed);
                kvstage.fetch_max(k, Ordering::Relaxed);
                samples.fetch_add(1, Ordering::Relaxed);
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(SAMPLE_EVERY);
            })
            .ok();
        me
    }

    fn peak(&self) -> ThreadPeak {
        ThreadPeak {
            total: self.total.load(Ordering::Relaxed),
            kvstage: self.kvstage.load(Ordering::Relaxed),
            samples: self.samples.load(Ordering::Relaxed),
        }
    }

    /// Stops the sampler (after one last sample) and returns the peak.
    fn finish(mut self) -> ThreadPeak {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak()
    }
}

impl Drop for ThreadSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// CPU time (user + system, seconds) process `pid` has used so far, all its threads.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the parenthesised name: state is field 3, utime 14 and stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(14) + ticks(15)) / hz
}

/// CPU time of this process and the decode process together.
fn cpu_both(child: &DecodeChild) -> f64 {
    cpu_seconds(std::process::id()) + cpu_seconds(child.pid())
}

/// The machine's CPU time so far (all cores, clock ticks): (idle including I/O wait, total).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next().and_then(|l| l.strip_prefix("cpu ")) else { return (0, 0) };
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let total = v.iter().take(8).sum();
    (v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0), total)
}

/// CPU use over a stretch of time: these two processes' CPU seconds, and the machine's ticks.
struct CpuMeter {
    ours: f64,
    machine: (u64, u64),
    wall: Instant,
    /// Accumulated: our CPU seconds, wall seconds, machine idle ticks, machine ticks.
    sum: (f64, f64, u64, u64),
}

impl CpuMeter {
    fn new() -> CpuMeter {
        CpuMeter { ours: 0.0, machine: (0, 0), wall: Instant::now(), sum: (0.0, 0.0, 0, 0) }
    }
    fn start(&mut self, child: &DecodeChild) {
        (self.ours, self.machine, self.wall) = (cpu_both(child), machine_ticks(), Instant::now());
    }
    fn stop(&mut self, child: &DecodeChild) {
        let (idle, total) = machine_ticks();
        self.sum.0 += cpu_both(child) - self.ours;
        self.sum.1 += self.wall.elapsed().as_secs_f64();
        self.sum.2 += idle.saturating_sub(self.machine.0);
        self.sum.3 += total.saturating_sub(self.machine.1);
    }
    /// (CPU seconds, cores busy on average, machine idle share).
    fn result(&self) -> (f64, f64, f64) {
        let busy = if self.sum.1 > 0.0 { self.sum.0 / self.sum.1 } else { 0.0 };
        let idle = if self.sum.3 > 0 { self.sum.2 as f64 / self.sum.3 as f64 } else { 0.0 };
        (self.sum.0, busy, idle)
    }
}

/// The prefill engines' options: the setup's, with the bench's overrides.
fn prefill_options(a: &Args) -> EngineOptions {
    let mut o = a.setup.options();
    if let Some(t) = a.transfer_threads {
        o.transfer_threads = t;
    }
    if let Some(b) = a.staging_buffers {
        o.send_staging_buffers = b;
    }
    o
}

/// How long a transfer may take, from its submission (queued time counts).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(600);

/// The staged path at load: `inflight` requests at once. Every chunk of a request, on every rank,
/// is submitted at once through `transfer_async`; a new request starts whenever one completes
/// (the decode process reports the room scattered everywhere). `warmup × inflight` requests
/// first, then the timed ones, then `inflight - 1` more so that the timed window always has
/// `inflight` requests in flight. Leaves the last room open (for `verify`) and returns it.
fn staged_load(a: &Args, child: &mut DecodeChild, prefill: &Prefill, room: &mut u64, progress: &mut Progress) -> Result<(Load, u64), Error> {
    let s = &a.setup;
    let n = a.inflight.max(1) as usize;
    let warmup = a.warmup as usize * n;
    let timed = a.requests.map_or((a.reps as usize).max(2 * n), |r| r as usize);
    let total = warmup + timed + n - 1;
    let bytes = s.room_bytes()?;

    struct InFlight {
        index: usize,
        submitted: Instant,
        ops: Vec<Arc<kvstage::session::op::Op>>,
    }
    let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
    let mut latencies = vec![f64::NAN; total];
    let mut completions: Vec<Instant> = Vec::with_capacity(total);
    let mut submitted = 0usize;
    let mut ops_total = 0u64;
    let first_submission = Instant::now();
    let mut meter = CpuMeter::new();
    meter.start(child);
    let mut launch = |child: &mut DecodeChild, index: usize, room: &mut u64, in_flight: &mut HashMap<u64, InFlight>| -> Result<(), Error> {
        *room += 1;
        child.command(&format!("room {room}"))?;
        child.watch(*room)?;
        let submitted = Instant::now();
        let ops = prefill.submit_room(s, *room, TRANSFER_TIMEOUT)?;
        ops_total += ops.len() as u64;
        in_flight.insert(*room, InFlight { index, submitted, ops });
        Ok(())
    };
    while submitted < n.min(total) {
        launch(child, submitted, room, &mut in_flight)?;
        submitted += 1;
    }
    let mut last = 0;
    while completions.len() < total {
        let (done, at) = child.next_done()?;
        let f = in_flight.remove(&done).ok_or_else(|| Error::internal(format!("the decode process reported room {done}, not in flight")))?;
        for op in &f.ops {
            // The room is complete, so every chunk arrived: its operation ends at once.
            match op.wait(Some(Duration::from_secs(60))) {
                Ok(Status::KVSTAGE_OK) => {}
                Ok(other) => return Err(Error::new(other, format!("a transfer of room {done} ended with {}", other.name()))),
                Err(e) => return Err(e),
            }
        }
        latencies[f.index] = at.saturating_duration_since(f.submitted).as_secs_f64();
        completions.push(at);
        progress.step("staged");
        if submitted < total {
            launch(child, submitted, room, &mut in_flight)?;
            submitted += 1;
        }
        if completions.len() < total {
            child.command(&format!("release {done}"))?;
        } else {
            last = done;
        }
    }
    // The window: from the warmup's last completion (or the first submission) to the last timed
    // completion; `inflight` requests were in flight throughout.
    let from = if warmup == 0 { first_submission } else { completions[warmup - 1] };
    let window = completions[warmup + timed - 1].saturating_duration_since(from).as_secs_f64();
    let samples: Vec<f64> = latencies[warmup..warmup + timed].to_vec();
    let rate = (n > 1 && window > 0.0).then(|| bytes as f64 * timed as f64 / window / 1e9);
    meter.stop(child);
    let (cpu, busy, idle) = meter.result();
    let section = Section { bytes, samples, inflight: n as u32, rate, cpu: Some(cpu / total as f64), cores: Some((busy, idle)) };
    Ok((Load { section, warmup_requests: warmup as u32, timed_requests: timed as u32, window, ops: ops_total }, last))
}

fn spawn_child(a: &Args, stuck_rank: Option<u32>) -> Result<DecodeChild, Error> {
    let s = &a.setup;
    let exe = std::env::current_exe().map_err(|e| Error::internal("cannot find the bench executable").with_source(e))?;
    let mut args = s.flags();
    args.push("--role-decode".into());
    if let Some(r) = stuck_rank {
        args.extend(["--stuck-rank".to_owned(), r.to_string()]);
    }
    DecodeChild::spawn(&exe, &args, s.decode_tp)
}

/// Runs every section; with `full` unset only those that depend on the load (staged, raw_tcp).
fn measure(a: &Args, full: bool) -> Result<Report, Error> {
    let sampler = ThreadSampler::start();
    let s = &a.setup;
    let mut child = spawn_child(a, None)?;
    let prefill = Prefill::connect_with(s, &child.addrs, &prefill_options(a))?;
    let bytes = s.room_bytes()?;
    let n = a.inflight.max(1);
    let staged_steps = a.warmup * n + a.requests.unwrap_or(a.reps.max(2 * n)) + n - 1;
    let mut progress = Progress::new(staged_steps + a.reps + if full { a.reps * 3 + 1 } else { 0 });

    // raw_tcp: the same byte count over as many plain streams as there are sessions, at once;
    // half the runs just before the staged requests and half just after, so that both see the
    // same machine (other processes' load drifts).
    let raw_streams = a.raw_streams.unwrap_or(s.sessions() as u32).max(1);
    let buf = vec![0x5au8; 8 << 20];
    let mut raw_tcp = Section::new(bytes);
    let mut raw_meter = CpuMeter::new();
    let mut raw_runs = |child: &mut DecodeChild, runs: u32, progress: &mut Progress| -> Result<(), Error> {
        raw_meter.start(child);
        for _ in 0..runs {
            raw_tcp.samples.push(child.raw_tcp_streams(bytes, raw_streams, &buf)?.as_secs_f64());
            progress.step("raw_tcp");
        }
        raw_meter.stop(child);
        Ok(())
    };
    let before = a.reps.div_ceil(2);
    raw_runs(&mut child, before, &mut progress)?;

    // staged: requests end to end, until the decode side has scattered everything.
    let mut room = 0u64;
    let (staged, last) = staged_load(a, &mut child, &prefill, &mut room, &mut progress)?;
    raw_runs(&mut child, a.reps - before, &mut progress)?;
    drop(buf);
    // Verified after the timed runs, not inside them.
    let (bad, first) = child.verify(last)?;
    if bad > 0 {
        eprintln!("kvstage-bench: staged decode bytes differ from the reference: {bad} bytes ({first})");
    }
    child.command(&format!("release {last}"))?;

    let mut slice_verified = true;
    let slice = if full {
        // slice: a probe of one page per chunk gives the rate; then as many pages as fit the time box.
        room += 1;
        child.command(&format!("room {room} 1"))?;
        let (probe_secs, probe_writes) = time(|| prefill.send_room(s, room, false, Some(1)))?;
        child.command(&format!("release {room}"))?;
        let full_writes = s.room_slice_writes();
        let per_write = probe_secs / probe_writes.max(1) as f64;
        let pages_fit = ((a.slice_seconds / per_write) / (full_writes as f64 / s.pages() as f64)).floor() as usize;
        let boxed = pages_fit < s.grid_pages();
        room += 1;
        // A time-boxed run sends the first pages of each chunk into a room of just those pages.
        child.command(&if boxed { format!("room {room} {}", pages_fit.max(1)) } else { format!("room {room}") })?;
        let (slice_secs, slice_writes) = time(|| {
            let w = prefill.send_room(s, room, false, boxed.then_some(pages_fit.max(1)))?;
            child.command(&format!("wait {room}"))?;
            Ok(w)
        })?;
        slice_verified = if boxed { true } else { child.verify(room)?.0 == 0 };
        child.command(&format!("release {room}"))?;
        let writes_per_second = slice_writes as f64 / slice_secs;
        let slice_full_secs = full_writes as f64 / writes_per_second;
        progress.step("slice");
        Some(SliceResult { section: Section { samples: vec![slice_full_secs], ..Section::new(bytes) }, writes: full_writes, writes_per_second, boxed })
    } else {
        None
    };

    let (raw_cpu, busy, idle) = raw_meter.result();
    raw_tcp.cpu = Some(raw_cpu / a.reps.max(1) as f64);
    raw_tcp.cores = Some((busy, idle));

    let fixed = match slice {
        None => None,
        Some(slice) => {
            let (memcpy, gather, scatter) = copies(a, &prefill, &mut progress)?;
            Some(Fixed { slice, memcpy, gather, scatter })
        }
    };
    drop(prefill);
    child.quit()?;
    let threads = sampler.finish();
    Ok(Report { staged, raw_tcp, raw_streams, fixed, threads, verified: bad == 0 && slice_verified })
}

/// memcpy, gather and scatter of one request's bytes in this process.
fn copies(a: &Args, prefill: &Prefill, progress: &mut Progress) -> Result<(Section, Section, Section), Error> {
    let s = &a.setup;
    let bytes = s.room_bytes()?;
    // memcpy: single thread, same byte count, through buffers larger than the caches.
    let block = (bytes as usize).clamp(1, 256 << 20);
    let src = vec![1u8; block];
    let mut dst = vec![0u8; block];
    let mut memcpy = Section::new(bytes);
    for _ in 0..a.reps {
        let start = Instant::now();
        let mut left = bytes as usize;
        while left > 0 {
            let n = left.min(block);
            dst[..n].copy_from_slice(&src[..n]);
            left -= n;
        }
        std::hint::black_box(&dst);
        memcpy.samples.push(start.elapsed().as_secs_f64());
        progress.step("memcpy");
    }
    drop((src, dst));

    // gather alone: every prefill rank's gathers of one request, one rank pair after another.
    let engine = HostCopyEngine::new(a.threads);
    let grid = s.grid_pages();
    let mut gather = Section::new(bytes);
    let mut staging: Vec<u8> = Vec::new();
    let mut plans = Vec::new();
    for r in &prefill.ranks {
        for rd in s.targets(r.rank) {
            let dst_shape = s.model.shape(s.page_size, rd, s.decode_tp);
            for pages in s.prefill_pages(r.rank).chunks(grid) {
                let layout = geometry::staging_layout(&r.pool.layout.shape, &dst_shape, (pages.len() as u32) * s.page_size)?;
                let w = kvstage::session::pairing(&r.pool.layout.shape, &dst_shape)?.writer;
                let plan = geometry::plan_gather(&r.pool.layout.shape, pages, &layout, w)?;
                staging.resize(staging.len().max(layout.writers[w as usize].bytes as usize), 0);
                plans.push((r.rank as usize, plan));
            }
        }
    }
    for _ in 0..a.reps {
        let start = Instant::now();
        for (rank, plan) in &plans {
            // SAFETY: the pool is live and the staging buffer holds the largest region.
            unsafe { engine.gather(plan, &prefill.ranks[*rank].pool.layout, staging.as_mut_ptr()) }?;
        }
        gather.samples.push(start.elapsed().as_secs_f64());
        progress.step("gather");
    }

    // scatter alone: decode rank 0's scatters of one request into a local pool.
    let dst_shape = s.model.shape(s.page_size, 0, s.decode_tp);
    let decode_pool = HostPool::new(dst_shape.clone(), s.pages() as u64 + 1);
    let dst_pages: Vec<u32> = (0..s.pages() as u32).collect();
    let mut scatter_plans = Vec::new();
    let mut scatter_bytes = 0;
    let src_shape = s.model.shape(s.page_size, 0, s.prefill_tp);
    for pages in dst_pages.chunks(grid) {
        let layout = geometry::staging_layout(&src_shape, &dst_shape, (pages.len() as u32) * s.page_size)?;
        for w in 0..layout.writer_count() {
            scatter_plans.push(geometry::plan_scatter(&dst_shape, pages, &layout, w)?);
            scatter_bytes += layout.writers[w as usize].bytes;
        }
    }
    let mut scatter = Section::new(scatter_bytes);
    for _ in 0..a.reps {
        let start = Instant::now();
        for plan in &scatter_plans {
            // SAFETY: as for the gathers; every region fits the staging buffer.
            unsafe { engine.scatter(plan, &decode_pool.layout, staging.as_ptr()) }?;
        }
        scatter.samples.push(start.elapsed().as_secs_f64());
        progress.step("scatter");
    }
    Ok((memcpy, gather, scatter))
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

fn print_report(a: &Args, r: &Report) {
    let s = &a.setup;
    let m = &s.model;
    println!(
        "kvstage-bench: {} ({} layers, {} KV heads, head_dim {}, {} B dtype), P{} -> D{}, page_size {}, {} tokens per request in chunks of {}, ring {} chunks, tcp, host memory",
        m.name, m.layers, m.kv_heads, m.head_dim, m.dtype_bytes, s.prefill_tp, s.decode_tp, s.page_size, s.tokens, s.chunk_tokens, s.ring_chunks
    );
    println!("{:<9} {:>14} {:>12} {:>12} {:>9}", "", "bytes", "median s", "p99 s", "GB/s");
    let row = |name: &str, sec: &Section| {
        println!("{name:<9} {:>14} {:>12.6} {:>12.6} {:>9.3}", sec.bytes, sec.median(), sec.p99(), sec.gbps());
    };
    row("staged", &r.staged.section);
    if let Some(f) = &r.fixed {
        row("slice", &f.slice.section);
    }
    row("raw_tcp", &r.raw_tcp);
    if let Some(f) = &r.fixed {
        row("memcpy", &f.memcpy);
        row("gather", &f.gather);
        row("scatter", &f.scatter);
    }
    let st = &r.staged;
    let o = prefill_options(a);
    println!(
        "staged: {} in flight ({} sessions, {} transfer threads and {} send staging buffers per prefill engine), {} timed requests after {} warmup: \
         {:.3} GB/s {} over {:.2} s; request latency p50 {:.4} s p99 {:.4} s (p99/p50 {:.2})",
        st.section.inflight,
        s.sessions(),
        o.transfer_threads,
        o.send_staging_buffers,
        st.timed_requests,
        st.warmup_requests,
        st.section.gbps(),
        if st.section.rate.is_some() { "aggregate" } else { "(one request / median)" },
        st.window,
        st.section.median(),
        st.section.p99(),
        ratio(st.section.p99(), st.section.median())
    );
    println!("raw_tcp: {} streams at once, the same bytes between them", r.raw_streams);
    let (sc, rc) = (st.section.cpu.unwrap_or(0.0), r.raw_tcp.cpu.unwrap_or(0.0));
    let ((sb, si), (rb, ri)) = (st.section.cores.unwrap_or_default(), r.raw_tcp.cores.unwrap_or_default());
    println!(
        "cpu per request (both processes, user + system): staged {sc:.3} s, raw_tcp {rc:.3} s ({:.2}x); cores busy: staged {sb:.2}, raw_tcp {rb:.2}; machine idle: staged {:.0}%, raw_tcp {:.0}%",
        ratio(sc, rc),
        si * 100.0,
        ri * 100.0
    );
    if let Some(f) = &r.fixed {
        println!(
            "slice path: {} writes per request at {:.0} writes/s{}",
            f.slice.writes,
            f.slice.writes_per_second,
            if f.slice.boxed { " (time-boxed: only part of each chunk was sent; the time shown is extrapolated)" } else { "" }
        );
        println!(
            "ratios: staged/raw_tcp {:.2}x  staged/slice {:.1}x  gather/memcpy {:.2}x",
            ratio(r.staged.section.gbps(), r.raw_tcp.gbps()),
            ratio(r.staged.section.gbps(), f.slice.section.gbps()),
            ratio(f.gather.gbps(), f.memcpy.gbps())
        );
    } else {
        println!("ratios: staged/raw_tcp {:.2}x", ratio(r.staged.section.gbps(), r.raw_tcp.gbps()));
    }
    println!("threads: at most {} kvstage-* threads, {} threads in all ({} samples)", r.threads.kvstage, r.threads.total, r.threads.samples);
    println!("verified: {}", r.verified);
}

fn report_json(a: &Args, r: &Report) -> String {
    let s = &a.setup;
    let m = &s.model;
    let o = prefill_options(a);
    let mut j = String::new();
    let _ = write!(
        j,
        "{{\n  \"params\": {{\"model\": \"{}\", \"layers\": {}, \"kv_heads\": {}, \"head_dim\": {}, \"dtype_bytes\": {}, \
         \"prefill_tp\": {}, \"decode_tp\": {}, \"page_size\": {}, \"tokens\": {}, \"chunk_tokens\": {}, \"ring_chunks\": {}, \
         \"reps\": {}, \"warmup\": {}, \"inflight\": {}, \"sessions\": {}, \"raw_streams\": {}, \"transfer_threads\": {}, \
         \"send_staging_buffers\": {}, \"transport\": \"tcp\", \"memory\": \"host\"}},\n",
        m.name, m.layers, m.kv_heads, m.head_dim, m.dtype_bytes, s.prefill_tp, s.decode_tp, s.page_size, s.tokens,
        s.chunk_tokens, s.ring_chunks, a.reps, a.warmup, a.inflight, s.sessions(), r.raw_streams, o.transfer_threads,
        o.send_staging_buffers
    );
    let st = &r.staged;
    let _ = writeln!(
        j,
        "  \"staged\": {},",
        st.section.json(&format!(
            ", \"requests\": {}, \"warmup_requests\": {}, \"window_s\": {:.9}, \"request_gbps\": {:.6}, \"operations\": {}",
            st.timed_requests,
            st.warmup_requests,
            st.window,
            st.section.request_gbps(),
            st.ops
        ))
    );
    if let Some(f) = &r.fixed {
        let _ = writeln!(
            j,
            "  \"slice\": {},",
            f.slice.section.json(&format!(
                ", \"writes\": {}, \"writes_per_second\": {:.3}, \"time_boxed\": {}",
                f.slice.writes, f.slice.writes_per_second, f.slice.boxed
            ))
        );
    }
    let _ = writeln!(j, "  \"raw_tcp\": {},", r.raw_tcp.json(&format!(", \"streams\": {}", r.raw_streams)));
    if let Some(f) = &r.fixed {
        let _ = writeln!(j, "  \"memcpy\": {},", f.memcpy.json(""));
        let _ = writeln!(j, "  \"gather\": {},", f.gather.json(""));
        let _ = writeln!(j, "  \"scatter\": {},", f.scatter.json(""));
    }
    let staged = r.staged.section.gbps();
    let mut ratios = format!(
        "\"staged_over_raw_tcp\": {:.6}, \"staged_p99_over_p50\": {:.6}, \"staged_cpu_over_raw_tcp_cpu\": {:.6}",
        ratio(staged, r.raw_tcp.gbps()),
        ratio(r.staged.section.p99(), r.staged.section.median()),
        ratio(r.staged.section.cpu.unwrap_or(0.0), r.raw_tcp.cpu.unwrap_or(0.0))
    );
    if let Some(f) = &r.fixed {
        let _ = write!(
            ratios,
            ", \"staged_over_slice\": {:.6}, \"gather_over_memcpy\": {:.6}",
            ratio(staged, f.slice.section.gbps()),
            ratio(f.gather.gbps(), f.memcpy.gbps())
        );
    }
    let _ = writeln!(j, "  \"ratios\": {{{ratios}}},");
    let _ = writeln!(
        j,
        "  \"threads\": {{\"max_total\": {}, \"max_kvstage\": {}, \"samples\": {}, \"sample_interval_ms\": {}}},",
        r.threads.total,
        r.threads.kvstage,
        r.threads.samples,
        SAMPLE_EVERY.as_millis()
    );
    let _ = writeln!(j, "  \"verified\": {}\n}}", r.verified);
    j
}

/// The sweep's points: (label, arguments).
fn sweep_points(a: &Args, what: &str) -> Vec<(String, Args)> {
    let base = a.setup.clone();
    let with = |setup: Setup| Args { setup, ..a.clone() };
    match what {
        "tokens" => [512u32, 1024, 2048, 4096, 8192]
            .iter()
            .filter(|&&t| t % base.page_size == 0)
            .map(|&t| (t.to_string(), with(Setup { tokens: t, chunk_tokens: t, ..base.clone() })))
            .collect(),
        "page-size" => [1u32, 4, 16, 64]
            .iter()
            .filter(|&&p| base.tokens % p == 0)
            .map(|&p| (p.to_string(), with(Setup { page_size: p, ..base.clone() })))
            .collect(),
        // 1, 2, 4, ... up to --inflight (16 when it is not given).
        "inflight" => {
            let max = if a.inflight > 1 { a.inflight } else { 16 };
            std::iter::successors(Some(1u32), |&n| (n < max).then(|| (n * 2).min(max)))
                .map(|n| (n.to_string(), Args { inflight: n, ..a.clone() }))
                .collect()
        }
        _ => [(1u32, 1u32), (2, 1), (4, 2), (2, 4), (8, 2)]
            .iter()
            .map(|&(p, d)| (format!("P{p}-D{d}"), with(Setup { prefill_tp: p, decode_tp: d, ..base.clone() })))
            .collect(),
    }
}

/// One sweep point: its label and the staged, slice and raw TCP throughput (GB/s).
type SweepPoint = (String, f64, f64, f64);
/// A plotted series: name, colour, and its value at a point.
type Series = (&'static str, &'static str, fn(&SweepPoint) -> f64);

/// A line chart of staged, slice and raw TCP throughput over the sweep.
fn svg(what: &str, points: &[SweepPoint]) -> String {
    let (w, h, left, bottom, top, right) = (720.0, 420.0, 70.0, 60.0, 40.0, 150.0);
    let max = points.iter().flat_map(|p| [p.1, p.2, p.3]).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let n = points.len().max(2) as f64 - 1.0;
    let x = |i: usize| left + (w - left - right) * i as f64 / n;
    let y = |v: f64| top + (h - top - bottom) * (1.0 - v / max);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"24\" font-size=\"15\">kvstage throughput by {what} (GB/s)</text>\n\
         <line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - bottom, w - right, h - bottom, h - bottom
    );
    for k in 0..=4 {
        let v = max * k as f64 / 4.0;
        let _ = writeln!(out, "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text>", left - 6.0, y(v) + 4.0);
        let _ = writeln!(out, "<line x1=\"{left}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>", y(v), w - right, y(v));
    }
    for (i, p) in points.iter().enumerate() {
        let _ = writeln!(out, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>", x(i), h - bottom + 18.0, p.0);
    }
    let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{what}</text>", (left + w - right) / 2.0, h - 16.0);
    let series: [Series; 3] =
        [("staged", "#1f77b4", |p| p.1), ("slice", "#d62728", |p| p.2), ("raw TCP", "#2ca02c", |p| p.3)];
    // A series measured nowhere (slice in an inflight sweep) is left out.
    for (k, (name, color, get)) in series.iter().filter(|(_, _, get)| points.iter().any(|p| get(p) > 0.0)).enumerate() {
        let path: Vec<String> = points.iter().enumerate().map(|(i, p)| format!("{:.1},{:.1}", x(i), y(get(p)))).collect();
        let _ = writeln!(out, "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>", path.join(" "));
        for (i, p) in points.iter().enumerate() {
            let _ = writeln!(out, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{color}\"/>", x(i), y(get(p)));
        }
        let ly = top + 20.0 * k as f64;
        let _ = writeln!(out, "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"/>", w - right + 15.0, w - right + 35.0);
        let _ = writeln!(out, "<text x=\"{}\" y=\"{}\">{name}</text>", w - right + 40.0, ly + 4.0);
    }
    out.push_str("</svg>\n");
    out
}

fn run(a: &Args) -> Result<bool, Error> {
    let write = |path: &str, text: &str| {
        std::fs::write(path, text).map_err(|e| Error::internal(format!("cannot write {path}")).with_source(e))
    };
    if a.stuck_peer {
        let (text, json, ok) = stuck_peer(a)?;
        print!("{text}");
        if let Some(path) = &a.json {
            write(path, &json)?;
        }
        return Ok(ok);
    }
    match &a.sweep {
        None => {
            let r = measure(a, true)?;
            print_report(a, &r);
            if let Some(path) = &a.json {
                write(path, &report_json(a, &r))?;
            }
            Ok(r.verified)
        }
        Some(what) => {
            let mut points = Vec::new();
            let mut json = Vec::new();
            let mut rows = Vec::new();
            let mut verified = true;
            // The load does not change the copy-only sections: an inflight sweep measures them not at all.
            let full = what != "inflight";
            for (label, point) in sweep_points(a, what) {
                let r = measure(&point, full)?;
                println!("\n== {what} = {label}");
                print_report(&point, &r);
                verified &= r.verified;
                json.push(report_json(&point, &r));
                let slice = r.fixed.as_ref().map_or(0.0, |f| f.slice.section.gbps());
                points.push((label.clone(), r.staged.section.gbps(), slice, r.raw_tcp.gbps()));
                let st = &r.staged.section;
                rows.push(format!(
                    "{label:>9} {:>11.3} {:>11.3} {:>8} {:>11.2} {:>10.4} {:>10.4} {:>8.2} {:>9} {:>9}",
                    st.gbps(),
                    r.raw_tcp.gbps(),
                    r.raw_streams,
                    ratio(st.gbps(), r.raw_tcp.gbps()),
                    st.median(),
                    st.p99(),
                    ratio(st.p99(), st.median()),
                    r.threads.kvstage,
                    r.threads.total
                ));
            }
            println!("\n== summary by {what}");
            println!(
                "{what:>9} {:>11} {:>11} {:>8} {:>11} {:>10} {:>10} {:>8} {:>9} {:>9}",
                "staged GB/s", "raw GB/s", "streams", "staged/raw", "p50 s", "p99 s", "p99/p50", "kvstage-*", "threads"
            );
            for row in rows {
                println!("{row}");
            }
            if let Some(path) = &a.json {
                write(path, &format!("[\n{}]\n", json.join(",\n")))?;
            }
            if let Some(path) = &a.plot {
                write(path, &svg(what, &points))?;
            }
            Ok(verified)
        }
    }
}

/// One session's figures in a stuck-peer phase.
#[derive(Clone, Debug, Default)]
struct SessionRate {
    name: String,
    rank: u32,
    decode: u32,
    /// Bytes of transfers that ended OK inside the window.
    bytes: u64,
    ok: u64,
    failed: u64,
}

/// `--stuck-peer`: three phases on fresh processes, each `--stuck-seconds` long after a warmup.
/// Every session keeps `--inflight` chunk transfers of its own in flight (a fresh room each; a
/// new one whenever one ends, signalled through the engines' completion callbacks); the second
/// phase sends nothing to one decode rank that a prefill engine with more than one session feeds,
/// the third makes that rank stop reading (fault injection in the decode process). Compared: each
/// other session's rate with the stuck peer against the healthy run (the target) and against the
/// silent one (what the stuck peer costs beyond its own traffic).
fn stuck_peer(a: &Args) -> Result<(String, String, bool), Error> {
    let s = &a.setup;
    let Some(victim) = (0..s.prefill_tp).find(|&r| s.targets(r).len() > 1) else {
        return Err(Error::invalid_arg(
            "--stuck-peer",
            "needs a prefill rank that feeds more than one decode rank (e.g. --prefill-tp 2 --decode-tp 4, or an MLA model)",
        ));
    };
    let stuck_rank = *s.targets(victim).last().expect("more than one target");
    let healthy = stuck_phase(a, None, None)?;
    let idle = stuck_phase(a, None, Some(stuck_rank))?;
    let stuck = stuck_phase(a, Some(stuck_rank), None)?;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "stuck peer: decode rank {stuck_rank} stops reading (fed by prefill rank {victim}); {} transfers in flight per session, {:.1} s windows, chunk share {} bytes",
        a.inflight,
        a.stuck_seconds,
        chunk_share(s, 0, s.targets(0)[0])?
    );
    let _ = writeln!(
        text,
        "{:<10} {:>12} {:>12} {:>12} {:>8} {:>10} {:>10} {:>11}",
        "session", "healthy GB/s", "silent GB/s", "stuck GB/s", "ratio", "vs silent", "ok/failed", "same engine"
    );
    let mut worst_sibling = f64::INFINITY;
    let mut rows = Vec::new();
    for ((h, i), t) in healthy.iter().zip(&idle).zip(&stuck) {
        let rate = |r: &SessionRate| r.bytes as f64 / a.stuck_seconds / 1e9;
        let (hr, ir, tr) = (rate(h), rate(i), rate(t));
        let is_stuck = t.decode == stuck_rank;
        let sibling = t.rank == victim && !is_stuck;
        if sibling {
            worst_sibling = worst_sibling.min(ratio(tr, hr));
        }
        let _ = writeln!(
            text,
            "{:<10} {:>12.3} {:>12.3} {:>12.3} {:>7.2}x {:>9.2}x {:>10} {:>11}",
            t.name,
            hr,
            ir,
            tr,
            ratio(tr, hr),
            ratio(tr, ir),
            format!("{}/{}", t.ok, t.failed),
            if is_stuck { "stuck" } else if sibling { "yes" } else { "no" }
        );
        rows.push(format!(
            "{{\"session\": \"{}\", \"prefill_rank\": {}, \"decode_rank\": {}, \"stuck\": {is_stuck}, \"same_engine_as_stuck\": {sibling}, \
             \"healthy_gbps\": {hr:.6}, \"silent_peer_gbps\": {ir:.6}, \"stuck_phase_gbps\": {tr:.6}, \"ratio\": {:.6}, \"ratio_vs_silent\": {:.6}, \
             \"ok\": {}, \"failed\": {}}}",
            t.name,
            t.rank,
            t.decode,
            ratio(tr, hr),
            ratio(tr, ir),
            t.ok,
            t.failed
        ));
    }
    let ok = worst_sibling >= 0.8;
    let _ = writeln!(
        text,
        "the other sessions of prefill engine {victim} keep {:.0}% of their rate at worst (target >= 80%): {}",
        worst_sibling * 100.0,
        if ok { "met" } else { "missed" }
    );
    let json = format!(
        "{{\n  \"stuck_peer\": {{\"stuck_decode_rank\": {stuck_rank}, \"prefill_rank\": {victim}, \"inflight_per_session\": {}, \"window_s\": {}, \
         \"worst_sibling_ratio\": {worst_sibling:.6}, \"met\": {ok},\n    \"sessions\": [\n      {}\n    ]}}\n}}\n",
        a.inflight,
        a.stuck_seconds,
        rows.join(",\n      ")
    );
    Ok((text, json, true))
}

/// Bytes prefill rank `rs` sends decode rank `rd` for one chunk (its writer's share).
fn chunk_share(s: &Setup, rs: u32, rd: u32) -> Result<u64, Error> {
    let src = s.model.shape(s.page_size, rs, s.prefill_tp);
    let dst = s.model.shape(s.page_size, rd, s.decode_tp);
    let w = kvstage::session::pairing(&src, &dst)?.writer;
    let tokens = (s.grid_pages().min(s.pages()) as u32) * s.page_size;
    Ok(geometry::staging_layout(&src, &dst, tokens)?.writers[w as usize].bytes)
}

/// One phase of `--stuck-peer`: every session's transfers that ended inside the window. With
/// `silent`, the sessions to that decode rank send nothing (the baseline without the peer's load).
fn stuck_phase(a: &Args, stuck_rank: Option<u32>, silent: Option<u32>) -> Result<Vec<SessionRate>, Error> {
    let s = &a.setup;
    let mut child = spawn_child(a, stuck_rank)?;
    let prefill = Prefill::connect_with(s, &child.addrs, &prefill_options(a))?;
    // Every session: (prefill rank, decode rank, session).
    let mut sessions = Vec::new();
    for r in &prefill.ranks {
        for (session, rd) in r.sessions.iter().zip(s.targets(r.rank)) {
            sessions.push((r.rank, rd, session.clone()));
        }
    }
    let (tx, rx) = mpsc::channel::<(u64, Status, Instant)>();
    for r in &prefill.ranks {
        let tx = tx.clone();
        r.engine.completions().set_callback(Some(Arc::new(move |c: &Completion| {
            if let Completion::Op { tag, status } = c {
                let _ = tx.send((*tag, *status, Instant::now()));
            }
        })));
    }
    drop(tx);
    let shares: Vec<u64> = sessions.iter().map(|(rs, rd, _)| chunk_share(s, *rs, *rd)).collect::<Result<_, _>>()?;
    let pages: Vec<Vec<u32>> = prefill.ranks.iter().map(|r| s.prefill_pages(r.rank)[..s.grid_pages().min(s.pages())].to_vec()).collect();
    let mut rates: Vec<SessionRate> = sessions
        .iter()
        .map(|(rs, rd, _)| SessionRate { name: format!("p{rs}-d{rd}"), rank: *rs, decode: *rd, ..Default::default() })
        .collect();
    // A stuck transfer holds its workers past the window; the teardown ends it.
    let timeout = Duration::from_secs_f64(a.stuck_seconds * 3.0 + 30.0);
    let mut room = 0u64;
    let mut ops = HashMap::new();
    let submit = |i: usize, child: &mut DecodeChild, room: &mut u64, ops: &mut HashMap<u64, Arc<kvstage::session::op::Op>>| -> Result<(), Error> {
        *room += 1;
        child.command(&format!("room {room}"))?;
        let (rs, _, session) = &sessions[i];
        let desc = TransferDesc { room: *room, chunk: 0, pages: pages[*rs as usize].clone(), timeout: Some(timeout), ready: None };
        let op = session.transfer_async(desc, false, ((i as u64) << 40) | *room)?;
        ops.insert(*room, op);
        Ok(())
    };
    for i in (0..sessions.len()).filter(|&i| Some(sessions[i].1) != silent) {
        for _ in 0..a.inflight.max(1) {
            submit(i, &mut child, &mut room, &mut ops)?;
        }
    }
    let warm = Duration::from_secs_f64((a.stuck_seconds / 5.0).clamp(0.5, 3.0));
    let start = Instant::now();
    let (from, to) = (start + warm, start + warm + Duration::from_secs_f64(a.stuck_seconds));
    while Instant::now() < to {
        let Ok((tag, status, at)) = rx.recv_timeout(to.saturating_duration_since(Instant::now())) else { continue };
        let (i, done_room) = ((tag >> 40) as usize, tag & ((1 << 40) - 1));
        ops.remove(&done_room);
        if at >= from && at < to {
            if status == Status::KVSTAGE_OK {
                rates[i].bytes += shares[i];
                rates[i].ok += 1;
            } else {
                rates[i].failed += 1;
            }
        }
        submit(i, &mut child, &mut room, &mut ops)?;
    }
    // Teardown: the prefill engines end their sessions (the stuck transfers fail at once).
    drop(prefill);
    drop(ops);
    child.quit()?;
    Ok(rates)
}

fn main() {
    // `--doctor [--json]`: this host's RDMA/CUDA capabilities (kvstage_doctor), then exit.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.iter().any(|a| a == "--doctor") {
        let report = kvstage::transport::rdma::doctor::probe();
        let json = raw.iter().any(|a| a == "--json");
        print!("{}", if json { kvstage::transport::rdma::doctor::json(&report) + "\n" } else { kvstage::transport::rdma::doctor::text(&report) });
        return;
    }
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    if args.role_decode {
        let decode = DecodeOptions { stuck: args.stuck_rank.map(|r| (r, 2)) };
        if let Err(e) = serve_decode_with(&args.setup, &decode) {
            eprintln!("kvstage-bench (decode): {}", e.chain());
            std::process::exit(1);
        }
        return;
    }
    // Threads inherit their creator's name: this thread's (the program name, "kvstage-bench")
    // would make the bench's own unnamed threads look like the library's to the sampler.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"bench-main".as_ptr()) };
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("kvstage-bench: {} ({})", e.chain(), e.code().name());
            std::process::exit(1);
        }
    }
}
