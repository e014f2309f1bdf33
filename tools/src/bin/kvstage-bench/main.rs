//! kvstage-bench: the staged path against its limits, every figure next to a baseline measured in
//! the same run on the same bytes between the same two processes.
//!
//! staged   end-to-end rooms (gather + write + arrival + scatter), decode verified afterwards;
//!          over the link each session ended up on (`--transport`: tcp, rdma, shm or auto)
//! slice    the slice path for the same request (time-boxed: ops/s and the extrapolated time; the
//!          decode bytes are verified only when the whole request was sent)
//! raw_tcp  a plain TCP stream of the same byte count to the decode process
//! memcpy   single-thread memcpy of the same byte count
//! gather   the prefill gathers of a request alone; scatter: decode rank 0's scatters alone
//!
//! `--inflight N` keeps N requests in flight through the asynchronous API (`transfer_async` on the
//! engines' own workers; this process submits from one thread) and reports the aggregate rate and
//! the request latencies; a sampler thread records the most library threads seen. `--stuck-peer`
//! measures what a decode peer that stops reading costs the other sessions of its prefill engine.
//!
//! Files: `report` (the sections, the table, the JSON), `stuck` (`--stuck-peer`), `layers`
//! (`--layer-ms`), `sys` (threads and CPU time from /proc).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use indicatif::ProgressBar;
use kvstage::copy::{CopyEngine, HostCopyEngine};
use kvstage::engine::{EngineOptions, TransportKind};
use kvstage::geometry;
use kvstage::session::op::Op;
use kvstage::{Error, Status};
use kvstage_testkit::cluster::{serve_decode_with, DecodeChild, DecodeOptions, Prefill, Setup};
use kvstage_testkit::HostPool;
use kvstage_tools::{parse_with_defaults, usage_error, Links, SetupArgs};

mod layers;
mod report;
mod stuck;
mod sys;

use report::{print_report, ratio, report_json, Check, Fixed, Load, Report, Section, SliceResult};
use sys::{CpuMeter, ThreadSampler};

const DEFAULT_MODEL: &str = "llama3-70b";

/// The staged path against its limits, every figure next to a baseline measured in the same
/// run on the same bytes between the same two processes (this one plays every prefill rank, a
/// child process every decode rank). See benches/README.md.
#[derive(Parser)]
#[command(name = "kvstage-bench", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    setup: SetupArgs,
    /// Timed runs of each section (staged: at least this many requests).
    #[arg(long, value_name = "N", default_value_t = 5)]
    reps: u32,
    /// Untimed staged requests first, per request in flight.
    #[arg(long, value_name = "N", default_value_t = 1)]
    warmup: u32,
    /// Time box of the slice path: beyond it only the first pages of each chunk are sent and the
    /// time of the whole request is extrapolated.
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    slice_seconds: f64,
    /// Threads of the host copy engine of the gather and scatter sections.
    #[arg(long, value_name = "N", default_value_t = 2)]
    threads: u32,
    /// Requests in flight at once (all prefill ranks together; 1 to 4096).
    #[arg(long, value_name = "N", default_value_t = 1)]
    inflight: u32,
    /// Timed staged requests [default: the larger of --reps and twice --inflight].
    #[arg(long, value_name = "N")]
    requests: Option<u32>,
    /// Plain TCP streams of the raw_tcp baseline [default: as many as there are sessions].
    #[arg(long, value_name = "N")]
    raw_streams: Option<u32>,
    /// Transfer threads of each prefill engine [default: the library's].
    #[arg(long, value_name = "N")]
    transfer_threads: Option<u32>,
    /// Send staging buffers of each prefill engine [default: the library's].
    #[arg(long, value_name = "N")]
    staging_buffers: Option<u32>,
    /// Pieces of a chunk's write from a staging buffer, each gathered while the one before is
    /// written; 0: the whole gather, then one write [default: the library's].
    #[arg(long, value_name = "BYTES")]
    piece_bytes: Option<u64>,
    /// Over TCP, gather each chunk into a staging buffer first instead of writing the pool's rows
    /// straight to the socket.
    #[arg(long)]
    no_send_from_pool: bool,
    /// Memory of the pools (only host in this tool).
    #[arg(long, value_parser = ["host"], default_value = "host")]
    memory: String,
    /// Write the report as JSON to FILE (a sweep: an array of reports). With --doctor, without
    /// FILE: the doctor's JSON on stdout.
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<String>>,
    /// Run the whole measurement once per value of this parameter.
    #[arg(long, value_enum)]
    sweep: Option<Sweep>,
    /// What a decode peer that stops reading costs the other sessions of its prefill engine
    /// (three phases on fresh processes).
    #[arg(long, conflicts_with = "sweep")]
    stuck_peer: bool,
    /// Whole-chunk against layer-wise sending behind a simulated prefill that finishes one layer
    /// every MS milliseconds: the exposed time (last layer ready to decode scatter done).
    #[arg(long, value_name = "MS", conflicts_with_all = ["sweep", "stuck_peer"])]
    layer_ms: Option<f64>,
    /// Length of each --stuck-peer phase's window.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    stuck_seconds: f64,
    /// This host's RDMA and CUDA capabilities (kvstage_doctor), then exit.
    #[arg(long)]
    doctor: bool,
    /// Internal: be the decode process.
    #[arg(long, hide = true)]
    role_decode: bool,
    /// Internal (decode process): this rank's engine stops reading (the stuck peer).
    #[arg(long, hide = true)]
    stuck_rank: Option<u32>,
}

/// `--sweep`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Sweep {
    /// 512 to 8192 tokens per request (one chunk each).
    Tokens,
    /// Page sizes 1, 4, 16 and 64.
    PageSize,
    /// P1-D1, P2-D1, P4-D2, P2-D4, P8-D2.
    Tp,
    /// 1, 2, 4, ... up to --inflight (16 when it is not given): staged and raw TCP only.
    Inflight,
    /// The same request without and with request parts (--aux-rows and --state-bytes; 10 aux
    /// rows and 4 MiB of state when neither is given): what they add to its latency.
    Parts,
    /// The byte movers between these two processes: tcp, shm-ring (gather into the mapped decode
    /// ring, then scatter), shm-direct (prefill page to decode page): staged and raw TCP only.
    Transport,
}

impl Sweep {
    fn name(self) -> &'static str {
        match self {
            Sweep::Tokens => "tokens",
            Sweep::PageSize => "page-size",
            Sweep::Tp => "tp",
            Sweep::Inflight => "inflight",
            Sweep::Parts => "parts",
            Sweep::Transport => "transport",
        }
    }
}

/// The run's parameters, with the command line's clamps applied.
#[derive(Clone)]
struct Args {
    setup: Setup,
    reps: u32,
    warmup: u32,
    slice_seconds: f64,
    threads: u32,
    json: Option<String>,
    sweep: Option<Sweep>,
    /// Requests in flight at once (all prefill ranks together).
    inflight: u32,
    /// Timed requests (default: the larger of --reps and twice --inflight).
    requests: Option<u32>,
    /// Raw TCP streams (default: as many as there are sender sessions).
    raw_streams: Option<u32>,
    /// Prefill engine options (default: the library's defaults).
    transfer_threads: Option<u32>,
    staging_buffers: Option<u32>,
    piece_bytes: Option<u64>,
    no_send_from_pool: bool,
    stuck_peer: bool,
    stuck_seconds: f64,
    layer_ms: Option<f64>,
}

impl Args {
    fn new(cli: &Cli, setup: Setup) -> Args {
        let json = match &cli.json {
            Some(None) => usage_error::<Cli>("--json needs a FILE (only --doctor --json prints to stdout)"),
            Some(Some(path)) => Some(path.clone()),
            None => None,
        };
        Args {
            setup,
            reps: cli.reps.max(1),
            warmup: cli.warmup,
            slice_seconds: cli.slice_seconds,
            threads: cli.threads.max(1),
            json,
            sweep: cli.sweep,
            inflight: cli.inflight.clamp(1, 4096),
            requests: cli.requests.map(|r| r.max(1)),
            raw_streams: cli.raw_streams.map(|r| r.clamp(1, 256)),
            transfer_threads: cli.transfer_threads.map(|t| t.clamp(1, 256)),
            staging_buffers: cli.staging_buffers.map(|b| b.max(1)),
            piece_bytes: cli.piece_bytes,
            no_send_from_pool: cli.no_send_from_pool,
            stuck_peer: cli.stuck_peer,
            stuck_seconds: cli.stuck_seconds.max(0.5),
            layer_ms: cli.layer_ms.map(|ms| ms.max(0.0)),
        }
    }
}

fn time<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<(f64, T), Error> {
    let start = Instant::now();
    let v = f()?;
    Ok((start.elapsed().as_secs_f64(), v))
}

/// One step of the run's progress bar.
fn step(bar: &ProgressBar, what: &'static str) {
    bar.set_message(what);
    bar.inc(1);
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
    if let Some(b) = a.piece_bytes {
        o.send_piece_bytes = b;
    }
    o.send_from_pool &= !a.no_send_from_pool;
    o
}

/// How long a transfer may take, from its submission (queued time counts).
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(600);

/// The staged path at load: `inflight` requests at once. Every chunk of a request, on every rank,
/// is submitted at once through `transfer_async`; a new request starts whenever one completes
/// (the decode process reports the room scattered everywhere). `warmup × inflight` requests
/// first, then the timed ones, then `inflight - 1` more so that the timed window always has
/// `inflight` requests in flight. Leaves the last room open (for `verify`) and returns it.
fn staged_load(a: &Args, child: &mut DecodeChild, prefill: &Prefill, room: &mut u64, bar: &ProgressBar) -> Result<(Load, u64), Error> {
    let s = &a.setup;
    let n = a.inflight.max(1) as usize;
    let warmup = a.warmup as usize * n;
    let timed = a.requests.map_or((a.reps as usize).max(2 * n), |r| r as usize);
    let total = warmup + timed + n - 1;
    let bytes = s.room_bytes()?;

    struct InFlight {
        index: usize,
        submitted: Instant,
        ops: Vec<Arc<Op>>,
    }
    let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
    let mut latencies = vec![f64::NAN; total];
    let mut completions: Vec<Instant> = Vec::with_capacity(total);
    let mut submitted = 0usize;
    let mut ops_total = 0u64;
    let first_submission = Instant::now();
    // CPU is measured over the timed requests: not the warmup's first use of buffers and rings.
    let mut meter = CpuMeter::new();
    if warmup == 0 {
        meter.start(child);
    }
    let mut launch = |child: &mut DecodeChild, index: usize, room: &mut u64, in_flight: &mut HashMap<u64, InFlight>| -> Result<(), Error> {
        *room += 1;
        let keys = child.open_room(*room, None)?;
        child.watch(*room)?;
        let submitted = Instant::now();
        let ops = prefill.submit_room(s, &keys, TRANSFER_TIMEOUT, false)?;
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
        if completions.len() == warmup {
            meter.start(child);
        } else if completions.len() == warmup + timed {
            meter.stop(child);
        }
        step(bar, "staged");
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
    let (cpu, busy, idle) = meter.result(timed);
    let section = Section { bytes, samples, inflight: n as u32, rate, cpu: Some(cpu), cores: Some((busy, idle)) };
    Ok((Load { section, warmup_requests: warmup as u32, timed_requests: timed as u32, window, ops: ops_total, check: Check::NotChecked }, last))
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
/// `label` prefixes the progress bar (a sweep's point).
fn measure(a: &Args, full: bool, label: &str) -> Result<Report, Error> {
    let sampler = ThreadSampler::start();
    let s = &a.setup;
    let mut child = spawn_child(a, None)?;
    let prefill = Prefill::connect_with(s, &child.addrs, &prefill_options(a))?;
    let bytes = s.room_bytes()?;
    let n = a.inflight.max(1);
    let staged_steps = a.warmup * n + a.requests.unwrap_or(a.reps.max(2 * n)) + n - 1;
    let bar = kvstage_tools::progress((staged_steps + a.reps + if full { a.reps * 3 + 1 } else { 0 }) as u64);
    bar.set_prefix(label.to_owned());

    // raw_tcp: the same byte count over as many plain streams as there are sessions, at once;
    // half the runs just before the staged requests and half just after, so that both see the
    // same machine (other processes' load drifts). raw_tcp sends from one 8 MiB buffer and
    // receives into 8 MiB per stream (cache-warm); raw_tcp_memory sends every byte from its own
    // address and receives it into its own (memory to memory, as a transfer of KV does).
    let raw_streams = a.raw_streams.unwrap_or(s.sessions() as u32).max(1);
    let warm = vec![0x5au8; kvstage_testkit::cluster::RAW_BUFFER];
    let memory = vec![0x5au8; bytes as usize];
    let (mut raw_tcp, mut raw_memory) = (Section::new(bytes), Section::new(bytes));
    let (mut raw_meter, mut memory_meter) = (CpuMeter::new(), CpuMeter::new());
    let mut raw_runs = |child: &mut DecodeChild, runs: u32| -> Result<(), Error> {
        for _ in 0..runs {
            for (section, meter, buf, whole) in [(&mut raw_tcp, &mut raw_meter, &warm, false), (&mut raw_memory, &mut memory_meter, &memory, true)] {
                meter.start(child);
                section.samples.push(child.raw_tcp_streams(bytes, raw_streams, buf, whole)?.as_secs_f64());
                meter.stop(child);
            }
            step(&bar, "raw_tcp");
        }
        Ok(())
    };
    // Untimed, once each: the child's receive buffers are allocated and touched here.
    for (buf, whole) in [(&warm, false), (&memory, true)] {
        child.raw_tcp_streams(bytes, raw_streams, buf, whole)?;
    }
    let before = a.reps.div_ceil(2);
    raw_runs(&mut child, before)?;

    // staged: requests end to end, until the decode side has scattered everything.
    let mut room = 0u64;
    let (mut staged, last) = staged_load(a, &mut child, &prefill, &mut room, &bar)?;
    // What the sessions ended up on (with --transport auto: what the engines chose), and how
    // many chunks went directly.
    let links = Links::of(&prefill);
    // Every library thread of the run exists now (the engines' workers, the sessions' readers).
    sampler.sample();
    raw_runs(&mut child, a.reps - before)?;
    drop((warm, memory));
    // Verified after the timed runs, not inside them.
    let (bad, first) = child.verify(last)?;
    if bad > 0 {
        eprintln!("kvstage-bench: staged decode bytes differ from the reference: {bad} bytes ({first})");
    }
    staged.check = Check::of(bad);
    child.command(&format!("release {last}"))?;

    let slice = if full {
        // slice: a probe of one page per chunk gives the rate; then as many pages as fit the time box.
        room += 1;
        let keys = child.open_room(room, Some(1))?;
        let (probe_secs, probe_writes) = time(|| prefill.send_room(s, &keys, false, Some(1)))?;
        child.command(&format!("release {room}"))?;
        let full_writes = s.room_slice_writes();
        let per_write = probe_secs / probe_writes.max(1) as f64;
        let pages_fit = ((a.slice_seconds / per_write) / (full_writes as f64 / s.pages() as f64)).floor() as usize;
        let boxed = pages_fit < s.grid_pages();
        room += 1;
        // A time-boxed run sends the first pages of each chunk into a room of just those pages; a
        // room of partial chunks carries the KV alone (request parts travel staged only).
        let keys = child.open_room(room, Some(if boxed { pages_fit.max(1) } else { s.grid_pages() }))?;
        let (slice_secs, slice_writes) = time(|| {
            let w = prefill.send_room(s, &keys, false, boxed.then_some(pages_fit.max(1)))?;
            child.command(&format!("wait {room}"))?;
            Ok(w)
        })?;
        // Only a whole request is compared: the room of a time-boxed run is not the reference's.
        let check = if boxed { Check::NotChecked } else { Check::of(child.verify(room)?.0) };
        if let Check::Differs(bad) = check {
            eprintln!("kvstage-bench: slice path decode bytes differ from the reference: {bad} bytes");
        }
        child.command(&format!("release {room}"))?;
        let writes_per_second = slice_writes as f64 / slice_secs;
        let slice_full_secs = full_writes as f64 / writes_per_second;
        step(&bar, "slice");
        Some(SliceResult { section: Section { samples: vec![slice_full_secs], ..Section::new(bytes) }, writes: full_writes, writes_per_second, boxed, check })
    } else {
        None
    };

    for (section, meter) in [(&mut raw_tcp, &raw_meter), (&mut raw_memory, &memory_meter)] {
        let (cpu, busy, idle) = meter.result(a.reps as usize);
        section.cpu = Some(cpu);
        section.cores = Some((busy, idle));
    }

    let fixed = match slice {
        None => None,
        Some(slice) => {
            let (memcpy, gather, scatter) = copies(a, &prefill, &bar)?;
            Some(Fixed { slice, memcpy, gather, scatter })
        }
    };
    drop(prefill);
    child.quit()?;
    let threads = sampler.finish();
    bar.finish_and_clear();
    Ok(Report { staged, raw_tcp, raw_memory, raw_streams, fixed, threads, links })
}

/// memcpy, gather and scatter of one request's bytes in this process.
fn copies(a: &Args, prefill: &Prefill, bar: &ProgressBar) -> Result<(Section, Section, Section), Error> {
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
        step(bar, "memcpy");
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
                let Some(region) = layout.region_of(&r.pool.layout.shape)? else { continue };
                let plan = geometry::plan_gather(&r.pool.layout, pages, 0, &layout, &region)?;
                staging.resize(staging.len().max(region.bytes as usize), 0);
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
        step(bar, "gather");
    }

    // scatter alone: decode rank 0's scatters of one request into a local pool.
    let dst_shape = s.model.shape(s.page_size, 0, s.decode_tp);
    let decode_pool = HostPool::with_layout(dst_shape.clone(), s.pages() as u64 + 1, s.decode_layout, s.page_pad, false);
    let dst_pages: Vec<u32> = (0..s.pages() as u32).collect();
    let mut scatter_plans = Vec::new();
    let mut scatter_bytes = 0;
    let src_shape = s.model.shape(s.page_size, 0, s.prefill_tp);
    for pages in dst_pages.chunks(grid) {
        let layout = geometry::staging_layout_stages(std::slice::from_ref(&src_shape), &dst_shape, (pages.len() as u32) * s.page_size)?;
        for region in &layout.writers {
            scatter_plans.push(geometry::plan_scatter(&decode_pool.layout, pages, &layout, region)?);
            scatter_bytes += region.bytes;
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
        step(bar, "scatter");
    }
    Ok((memcpy, gather, scatter))
}

/// The sweep's points: (label, arguments).
fn sweep_points(a: &Args, what: Sweep) -> Vec<(String, Args)> {
    let base = a.setup.clone();
    let with = |setup: Setup| Args { setup, ..a.clone() };
    match what {
        Sweep::Tokens => [512u32, 1024, 2048, 4096, 8192]
            .iter()
            .filter(|&&t| t % base.page_size == 0)
            .map(|&t| (t.to_string(), with(Setup { tokens: t, chunk_tokens: t, ..base.clone() })))
            .collect(),
        Sweep::PageSize => [1u32, 4, 16, 64]
            .iter()
            .filter(|&&p| base.tokens.is_multiple_of(p))
            .map(|&p| (p.to_string(), with(Setup { page_size: p, ..base.clone() })))
            .collect(),
        // 1, 2, 4, ... up to --inflight (16 when it is not given).
        Sweep::Inflight => {
            let max = if a.inflight > 1 { a.inflight } else { 16 };
            std::iter::successors(Some(1u32), |&n| (n < max).then(|| (n * 2).min(max)))
                .map(|n| (n.to_string(), Args { inflight: n, ..a.clone() }))
                .collect()
        }
        Sweep::Parts => {
            let (aux_rows, state_bytes) = if base.has_parts() { (base.aux_rows, base.state_bytes) } else { (10, 4 << 20) };
            vec![
                ("none".to_owned(), with(Setup { aux_rows: 0, state_bytes: 0, ..base.clone() })),
                ("with".to_owned(), with(Setup { aux_rows, state_bytes, ..base.clone() })),
            ]
        }
        Sweep::Transport => [("tcp", TransportKind::Tcp, base.direct), ("shm-ring", TransportKind::Shm, false), ("shm-direct", TransportKind::Shm, true)]
            .into_iter()
            .map(|(name, transport, direct)| (name.to_owned(), with(Setup { transport, direct, ..base.clone() })))
            .collect(),
        Sweep::Tp => [(1u32, 1u32), (2, 1), (4, 2), (2, 4), (8, 2)]
            .iter()
            .map(|&(p, d)| (format!("P{p}-D{d}"), with(Setup { prefill_tp: p, decode_tp: d, ..base.clone() })))
            .collect(),
    }
}

fn run(a: &Args) -> Result<bool, Error> {
    if let Some(ms) = a.layer_ms {
        let (text, json) = layers::layer_stream(a, ms)?;
        print!("{text}");
        if let Some(path) = &a.json {
            kvstage_tools::write_json(path, &json)?;
        }
        return Ok(true);
    }
    if a.stuck_peer {
        let (text, json) = stuck::stuck_peer(a)?;
        print!("{text}");
        if let Some(path) = &a.json {
            kvstage_tools::write_json(path, &json)?;
        }
        return Ok(true);
    }
    let Some(what) = a.sweep else {
        let r = measure(a, true, "")?;
        print_report(a, &r);
        if let Some(path) = &a.json {
            kvstage_tools::write_json(path, &report_json(a, &r))?;
        }
        return Ok(r.ok());
    };
    let what_name = what.name();
    let mut json = Vec::new();
    let mut rows = Vec::new();
    let mut medians = Vec::new();
    let mut ok = true;
    // The load does not change the copy-only sections: an inflight sweep measures them not at all.
    let full = !matches!(what, Sweep::Inflight | Sweep::Transport);
    let points = sweep_points(a, what);
    let count = points.len();
    for (i, (label, point)) in points.into_iter().enumerate() {
        let r = measure(&point, full, &format!("{what_name} = {label} ({}/{count})", i + 1))?;
        println!("\n== {what_name} = {label}");
        print_report(&point, &r);
        ok &= r.ok();
        json.push(report_json(&point, &r));
        let st = &r.staged.section;
        medians.push(st.median());
        rows.push(format!(
            "{label:>9} {:>6} {:>11.3} {:>11.3} {:>11.3} {:>8} {:>11.2} {:>11.2} {:>10.4} {:>10.4} {:>8.2} {:>9} {:>9}",
            r.links.common(),
            st.gbps(),
            r.raw_tcp.gbps(),
            r.raw_memory.gbps(),
            r.raw_streams,
            ratio(st.gbps(), r.raw_tcp.gbps()),
            ratio(st.gbps(), r.raw_memory.gbps()),
            st.median(),
            st.p99(),
            ratio(st.p99(), st.median()),
            r.threads.kvstage,
            r.threads.total
        ));
    }
    println!("\n== summary by {what_name}");
    println!(
        "{what_name:>9} {:>6} {:>11} {:>11} {:>11} {:>8} {:>11} {:>11} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "link",
        "staged GB/s", "raw GB/s", "rawmem GB/s", "streams", "staged/raw", "staged/mem", "p50 s", "p99 s", "p99/p50", "kvstage-*", "threads"
    );
    for row in rows {
        println!("{row}");
    }
    if let (Sweep::Parts, &[none, with]) = (what, &medians[..]) {
        println!("request parts add {:+.1} % to the request's median latency (p50 {with:.4} s against {none:.4} s)", (ratio(with, none) - 1.0) * 100.0);
    }
    if let Some(path) = &a.json {
        kvstage_tools::write_json(path, &json)?;
    }
    Ok(ok)
}

fn main() {
    let cli: Cli = parse_with_defaults(&[("model", DEFAULT_MODEL), ("tokens", "2048")]);
    if cli.doctor {
        // This host's RDMA/CUDA capabilities (kvstage_doctor), then exit.
        let report = kvstage::transport::rdma::doctor::probe();
        match &cli.json {
            None => print!("{}", kvstage::transport::rdma::doctor::text(&report)),
            Some(None) => println!("{}", kvstage::transport::rdma::doctor::json(&report)),
            Some(Some(path)) => {
                if let Err(e) = std::fs::write(path, kvstage::transport::rdma::doctor::json(&report) + "\n") {
                    eprintln!("kvstage-bench: cannot write {path}: {e}");
                    std::process::exit(1);
                }
            }
        }
        return;
    }
    let setup = cli.setup.setup(DEFAULT_MODEL).unwrap_or_else(|e| usage_error::<Cli>(e));
    if cli.role_decode {
        let decode = DecodeOptions { stuck: cli.stuck_rank.map(|r| (r, 2)) };
        if let Err(e) = serve_decode_with(&setup, &decode) {
            eprintln!("kvstage-bench (decode): {}", e.chain());
            std::process::exit(1);
        }
        return;
    }
    let args = Args::new(&cli, setup);
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn command_line() {
        super::Cli::command().debug_assert();
    }
}
