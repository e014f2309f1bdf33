//! kvstage-bench: the staged path against its limits, every figure next to a baseline measured in
//! the same run on the same bytes between the same two processes.
//!
//! staged   end-to-end rooms (gather + write + arrival + scatter), decode verified afterwards
//! slice    the slice path for the same request (time-boxed: ops/s and the extrapolated time)
//! raw_tcp  a plain TCP stream of the same byte count to the decode process
//! memcpy   single-thread memcpy of the same byte count
//! gather   the prefill gathers of a request alone; scatter: decode rank 0's scatters alone

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::Instant;

use kvstage::copy::{CopyEngine, HostCopyEngine};
use kvstage::geometry;
use kvstage::testkit::cluster::{serve_decode, DecodeChild, Prefill, Setup};
use kvstage::testkit::{model, HostPool};
use kvstage::Error;

const USAGE: &str = "usage: kvstage-bench [--model llama3-8b|qwen3-32b|llama3-70b|deepseek-v3] [--kind mha|mla] [--layers N] [--kv-heads N] \
[--head-dim N] [--dtype-bytes N] [--prefill-tp N] [--decode-tp N] [--page-size N] [--tokens N (per request)] \
[--chunk-tokens N] [--ring-chunks N] [--reps N] [--warmup N] [--slice-seconds S] [--threads N] \
[--transport tcp] [--memory host] [--json FILE] [--sweep tokens|page-size|tp --plot FILE.svg] | --doctor [--json]";

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
                if !["tokens", "page-size", "tp"].contains(&v.as_str()) {
                    return Err(format!("--sweep {v}: expected tokens, page-size or tp"));
                }
                a.sweep = Some(v);
            }
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
}

impl Section {
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
    fn gbps(&self) -> f64 {
        let m = self.median();
        if m > 0.0 { self.bytes as f64 / m / 1e9 } else { 0.0 }
    }
    fn json(&self, extra: &str) -> String {
        format!(
            "{{\"bytes\": {}, \"seconds_median\": {:.9}, \"seconds_p99\": {:.9}, \"gbps\": {:.6}{extra}}}",
            self.bytes,
            self.median(),
            self.p99(),
            self.gbps()
        )
    }
}

struct SliceResult {
    section: Section,
    writes: u64,
    writes_per_second: f64,
    boxed: bool,
}

struct Report {
    staged: Section,
    slice: SliceResult,
    raw_tcp: Section,
    memcpy: Section,
    gather: Section,
    scatter: Section,
    verified: bool,
}

fn time<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<(f64, T), Error> {
    let start = Instant::now();
    let v = f()?;
    Ok((start.elapsed().as_secs_f64(), v))
}

fn measure(a: &Args) -> Result<Report, Error> {
    let s = &a.setup;
    let exe = std::env::current_exe().map_err(|e| Error::internal("cannot find the bench executable").with_source(e))?;
    let mut args = s.flags();
    args.push("--role-decode".into());
    let mut child = DecodeChild::spawn(&exe, &args, s.decode_tp)?;
    let prefill = Prefill::connect(s, &child.addrs)?;
    let bytes = s.room_bytes()?;
    let mut progress = Progress::new(a.warmup + a.reps * 3 + 4);

    // staged: whole requests end to end, until the decode side has scattered everything.
    let mut staged = Section { bytes, samples: Vec::new() };
    let mut room = 0u64;
    for rep in 0..a.warmup + a.reps {
        room += 1;
        child.command(&format!("room {room}"))?;
        let (secs, _) = time(|| {
            prefill.send_room(s, room, true, None)?;
            child.command(&format!("wait {room}"))
        })?;
        if rep >= a.warmup {
            staged.samples.push(secs);
        }
        if rep + 1 < a.warmup + a.reps {
            child.command(&format!("release {room}"))?;
        }
        progress.step("staged");
    }
    // Verified after the timed runs, not inside them.
    let (bad, first) = child.verify(room)?;
    if bad > 0 {
        eprintln!("kvstage-bench: staged decode bytes differ from the reference: {bad} bytes ({first})");
    }
    child.command(&format!("release {room}"))?;

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
    let slice_verified = if boxed { true } else { child.verify(room)?.0 == 0 };
    child.command(&format!("release {room}"))?;
    let writes_per_second = slice_writes as f64 / slice_secs;
    let slice_full_secs = full_writes as f64 / writes_per_second;
    progress.step("slice");

    // raw_tcp: the same byte count as one plain stream to the same decode process.
    let buf = vec![0x5au8; 8 << 20];
    let mut raw_tcp = Section { bytes, samples: Vec::new() };
    for _ in 0..a.reps {
        raw_tcp.samples.push(child.raw_tcp(bytes, &buf)?.as_secs_f64());
        progress.step("raw_tcp");
    }

    // memcpy: single thread, same byte count, through buffers larger than the caches.
    let block = (bytes as usize).clamp(1, 256 << 20);
    let src = vec![1u8; block];
    let mut dst = vec![0u8; block];
    let mut memcpy = Section { bytes, samples: Vec::new() };
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
    let mut gather = Section { bytes, samples: Vec::new() };
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
    let mut scatter = Section { bytes: scatter_bytes, samples: Vec::new() };
    for _ in 0..a.reps {
        let start = Instant::now();
        for plan in &scatter_plans {
            // SAFETY: as for the gathers; every region fits the staging buffer.
            unsafe { engine.scatter(plan, &decode_pool.layout, staging.as_ptr()) }?;
        }
        scatter.samples.push(start.elapsed().as_secs_f64());
        progress.step("scatter");
    }
    drop(prefill);
    child.quit()?;
    let slice = SliceResult {
        section: Section { bytes, samples: vec![slice_full_secs] },
        writes: full_writes,
        writes_per_second,
        boxed,
    };
    Ok(Report { staged, slice, raw_tcp, memcpy, gather, scatter, verified: bad == 0 && slice_verified })
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
    row("staged", &r.staged);
    row("slice", &r.slice.section);
    row("raw_tcp", &r.raw_tcp);
    row("memcpy", &r.memcpy);
    row("gather", &r.gather);
    row("scatter", &r.scatter);
    println!(
        "slice path: {} writes per request at {:.0} writes/s{}",
        r.slice.writes,
        r.slice.writes_per_second,
        if r.slice.boxed { " (time-boxed: only part of each chunk was sent; the time shown is extrapolated)" } else { "" }
    );
    println!(
        "ratios: staged/raw_tcp {:.2}x  staged/slice {:.1}x  gather/memcpy {:.2}x",
        ratio(r.staged.gbps(), r.raw_tcp.gbps()),
        ratio(r.staged.gbps(), r.slice.section.gbps()),
        ratio(r.gather.gbps(), r.memcpy.gbps())
    );
    println!("verified: {}", r.verified);
}

fn report_json(a: &Args, r: &Report) -> String {
    let s = &a.setup;
    let m = &s.model;
    let mut j = String::new();
    let _ = write!(
        j,
        "{{\n  \"params\": {{\"model\": \"{}\", \"layers\": {}, \"kv_heads\": {}, \"head_dim\": {}, \"dtype_bytes\": {}, \
         \"prefill_tp\": {}, \"decode_tp\": {}, \"page_size\": {}, \"tokens\": {}, \"chunk_tokens\": {}, \"ring_chunks\": {}, \
         \"reps\": {}, \"warmup\": {}, \"transport\": \"tcp\", \"memory\": \"host\"}},\n",
        m.name, m.layers, m.kv_heads, m.head_dim, m.dtype_bytes, s.prefill_tp, s.decode_tp, s.page_size, s.tokens,
        s.chunk_tokens, s.ring_chunks, a.reps, a.warmup
    );
    let _ = writeln!(j, "  \"staged\": {},", r.staged.json(""));
    let _ = writeln!(
        j,
        "  \"slice\": {},",
        r.slice.section.json(&format!(
            ", \"writes\": {}, \"writes_per_second\": {:.3}, \"time_boxed\": {}",
            r.slice.writes, r.slice.writes_per_second, r.slice.boxed
        ))
    );
    let _ = writeln!(j, "  \"raw_tcp\": {},", r.raw_tcp.json(""));
    let _ = writeln!(j, "  \"memcpy\": {},", r.memcpy.json(""));
    let _ = writeln!(j, "  \"gather\": {},", r.gather.json(""));
    let _ = writeln!(j, "  \"scatter\": {},", r.scatter.json(""));
    let _ = writeln!(
        j,
        "  \"ratios\": {{\"staged_over_raw_tcp\": {:.6}, \"staged_over_slice\": {:.6}, \"gather_over_memcpy\": {:.6}}},",
        ratio(r.staged.gbps(), r.raw_tcp.gbps()),
        ratio(r.staged.gbps(), r.slice.section.gbps()),
        ratio(r.gather.gbps(), r.memcpy.gbps())
    );
    let _ = writeln!(j, "  \"verified\": {}\n}}", r.verified);
    j
}

/// The sweep's points: (label, setup).
fn sweep_points(a: &Args, what: &str) -> Vec<(String, Setup)> {
    let base = a.setup.clone();
    match what {
        "tokens" => [512u32, 1024, 2048, 4096, 8192]
            .iter()
            .filter(|&&t| t % base.page_size == 0)
            .map(|&t| (t.to_string(), Setup { tokens: t, chunk_tokens: t, ..base.clone() }))
            .collect(),
        "page-size" => [1u32, 4, 16, 64]
            .iter()
            .filter(|&&p| base.tokens % p == 0)
            .map(|&p| (p.to_string(), Setup { page_size: p, ..base.clone() }))
            .collect(),
        _ => [(1u32, 1u32), (2, 1), (4, 2), (2, 4), (8, 2)]
            .iter()
            .map(|&(p, d)| (format!("P{p}-D{d}"), Setup { prefill_tp: p, decode_tp: d, ..base.clone() }))
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
    for (k, (name, color, get)) in series.iter().enumerate() {
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
    match &a.sweep {
        None => {
            let r = measure(a)?;
            print_report(a, &r);
            if let Some(path) = &a.json {
                write(path, &report_json(a, &r))?;
            }
            Ok(r.verified)
        }
        Some(what) => {
            let mut points = Vec::new();
            let mut json = Vec::new();
            let mut verified = true;
            for (label, setup) in sweep_points(a, what) {
                let point = Args { setup, ..a.clone() };
                let r = measure(&point)?;
                println!("\n== {what} = {label}");
                print_report(&point, &r);
                verified &= r.verified;
                json.push(report_json(&point, &r));
                points.push((label, r.staged.gbps(), r.slice.section.gbps(), r.raw_tcp.gbps()));
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
        if let Err(e) = serve_decode(&args.setup) {
            eprintln!("kvstage-bench (decode): {}", e.chain());
            std::process::exit(1);
        }
        return;
    }
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("kvstage-bench: {} ({})", e.chain(), e.code().name());
            std::process::exit(1);
        }
    }
}
