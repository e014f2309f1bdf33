//! The measurements of one run, printed as a table and written as JSON (`--json`).

use kvstage_tools::Links;
use serde::Serialize;

use crate::sys::{CpuParts, ThreadPeak, SAMPLE_EVERY};
use crate::{prefill_options, Args};

#[derive(Clone, Debug, Default)]
pub struct Section {
    pub bytes: u64,
    pub samples: Vec<f64>,
    /// Requests in flight at once while the samples were taken.
    pub inflight: u32,
    /// Measured aggregate rate (GB/s) where it is not `bytes / median` (requests overlapping).
    pub rate: Option<f64>,
    /// CPU time (user + system, this process and the decode process) per request, in seconds.
    pub cpu: Option<CpuParts>,
    /// While the samples were taken: cores these two processes kept busy on average, and the
    /// share of the machine's CPU time that was idle.
    pub cores: Option<(f64, f64)>,
}

impl Section {
    pub fn new(bytes: u64) -> Section {
        Section { bytes, samples: Vec::new(), inflight: 1, rate: None, cpu: None, cores: None }
    }
    /// CPU seconds per request, both processes (0 when not measured).
    pub fn cpu_total(&self) -> f64 {
        self.cpu.as_ref().map_or(0.0, CpuParts::total)
    }
    fn quantile(&self, q: f64) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        if s.is_empty() {
            return 0.0;
        }
        kvstage_tools::quantile(&s, q)
    }
    pub fn median(&self) -> f64 {
        self.quantile(0.5)
    }
    pub fn p99(&self) -> f64 {
        self.quantile(0.99)
    }
    /// One request's bytes over its median time.
    pub fn request_gbps(&self) -> f64 {
        let m = self.median();
        if m > 0.0 {
            self.bytes as f64 / m / 1e9
        } else {
            0.0
        }
    }
    /// The aggregate rate: measured over a window when requests overlap, else one request's.
    pub fn gbps(&self) -> f64 {
        self.rate.unwrap_or_else(|| self.request_gbps())
    }
    /// The section's JSON object, with `extra`'s fields after the common ones.
    fn json<E: Serialize>(&self, extra: E) -> SectionJson<E> {
        SectionJson {
            bytes: self.bytes,
            seconds_median: self.median(),
            seconds_p99: self.p99(),
            gbps: self.gbps(),
            inflight: self.inflight,
            latency_p50_s: self.median(),
            latency_p99_s: self.p99(),
            cpu_s_per_request: self.cpu.as_ref().map(CpuParts::total),
            cpu_s_per_request_parts: self.cpu.clone(),
            cores_busy: self.cores.map(|c| c.0),
            machine_idle: self.cores.map(|c| c.1),
            extra,
        }
    }
}

/// Whether a section's decode bytes were compared with the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    Matched,
    /// Bytes that differ.
    Differs(u64),
    /// Not compared (a time-boxed slice run sends part of each chunk into a room of just those
    /// pages: nothing checks them).
    NotChecked,
}

impl Check {
    pub fn of(bad: u64) -> Check {
        if bad == 0 {
            Check::Matched
        } else {
            Check::Differs(bad)
        }
    }
    /// The JSON's `verified`: compared, and equal.
    pub fn verified(self) -> bool {
        self == Check::Matched
    }
    pub fn text(self) -> String {
        match self {
            Check::Matched => "yes".into(),
            Check::Differs(bad) => format!("NO, {bad} bytes differ"),
            Check::NotChecked => "no (time-boxed: its bytes were not checked)".into(),
        }
    }
}

pub struct SliceResult {
    pub section: Section,
    pub writes: u64,
    pub writes_per_second: f64,
    pub boxed: bool,
    pub check: Check,
}

/// The staged path at load: requests (rooms) kept in flight through `transfer_async`.
pub struct Load {
    /// Samples: request latencies (submission to decode room complete); `rate`: the aggregate.
    pub section: Section,
    pub warmup_requests: u32,
    pub timed_requests: u32,
    /// The window the aggregate rate was measured over (seconds).
    pub window: f64,
    /// Operations (chunk transfers, all sessions) submitted.
    pub ops: u64,
    pub check: Check,
}

/// The sections that do not depend on the load (skipped in an inflight sweep).
pub struct Fixed {
    pub slice: SliceResult,
    pub memcpy: Section,
    pub gather: Section,
    pub scatter: Section,
}

pub struct Report {
    pub staged: Load,
    pub raw_tcp: Section,
    /// The same streams memory to memory: every byte sent from and received at its own address.
    pub raw_memory: Section,
    pub raw_streams: u32,
    pub fixed: Option<Fixed>,
    pub threads: ThreadPeak,
    /// The links the sender sessions ended up on (the staged section's; the slice path's writes
    /// always go on the sessions' TCP control streams).
    pub links: Links,
}

impl Report {
    /// No section whose bytes were compared differs from the reference.
    pub fn ok(&self) -> bool {
        let slice = self.fixed.as_ref().map(|f| f.slice.check);
        [Some(self.staged.check), slice].into_iter().flatten().all(|c| !matches!(c, Check::Differs(_)))
    }
}

pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub fn print_report(a: &Args, r: &Report) {
    let s = &a.setup;
    let m = &s.model;
    println!(
        "kvstage-bench: {} ({} layers, {} KV heads, head_dim {}, {} B dtype), P{} -> D{}, page_size {}, {} tokens per request in chunks of {}, ring {} chunks, {}, host memory",
        m.name,
        m.layers,
        m.kv_heads,
        m.head_dim,
        m.dtype_bytes,
        s.prefill_tp,
        s.decode_tp,
        s.page_size,
        s.tokens,
        s.chunk_tokens,
        s.ring_chunks,
        kvstage_testkit::cluster::transport_name(s.transport)
    );
    let downgraded = match (&r.links.downgraded, &r.links.shm_downgrade) {
        (0, _) => String::new(),
        (n, Some(why)) => format!(" ({n} downgraded; last same-host downgrade: {why})"),
        (n, None) => format!(" ({n} downgraded to tcp: transport auto found no usable RDMA path)"),
    };
    println!(
        "links: staged over {}{downgraded}; slice writes on the sessions' TCP control streams; raw_tcp over {} plain loopback TCP stream{}",
        r.links.summary(),
        r.raw_streams,
        if r.raw_streams == 1 { "" } else { "s" }
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
    row("raw_mem", &r.raw_memory);
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
    println!(
        "raw_tcp: {} streams at once, the same bytes between them, from one 8 MiB buffer (cache-warm); raw_mem: the same streams memory to memory (each byte from and into its own address)",
        r.raw_streams
    );
    let (sc, rc) = (st.section.cpu_total(), r.raw_tcp.cpu_total());
    let ((sb, si), (rb, ri)) = (st.section.cores.unwrap_or_default(), r.raw_tcp.cores.unwrap_or_default());
    println!(
        "cpu per request (both processes, user + system): staged {sc:.3} s, raw_tcp {rc:.3} s ({:.2}x); cores busy: staged {sb:.2}, raw_tcp {rb:.2}; machine idle: staged {:.0}%, raw_tcp {:.0}%",
        ratio(sc, rc),
        si * 100.0,
        ri * 100.0
    );
    let mc = r.raw_memory.cpu_total();
    println!("raw_mem: {:.3} GB/s, cpu per request {mc:.3} s; staged/raw_mem {:.2}x, cpu {:.2}x", r.raw_memory.gbps(), ratio(st.section.gbps(), r.raw_memory.gbps()), ratio(sc, mc));
    if let Some(parts) = &st.section.cpu {
        println!("staged cpu per request by thread: prefill {}; decode {}", by_thread(&parts.prefill), by_thread(&parts.decode));
    }
    if let Some(f) = &r.fixed {
        println!(
            "slice path: {} writes per request at {:.0} writes/s{}",
            f.slice.writes,
            f.slice.writes_per_second,
            if f.slice.boxed { " (time-boxed: only part of each chunk was sent; the time shown is extrapolated)" } else { "" }
        );
        println!(
            "ratios: staged/raw_tcp {:.2}x  staged/memcpy {:.2}x  staged/slice {:.1}x  gather/memcpy {:.2}x",
            ratio(r.staged.section.gbps(), r.raw_tcp.gbps()),
            ratio(r.staged.section.gbps(), f.memcpy.gbps()),
            ratio(r.staged.section.gbps(), f.slice.section.gbps()),
            ratio(f.gather.gbps(), f.memcpy.gbps())
        );
    } else {
        println!("ratios: staged/raw_tcp {:.2}x", ratio(r.staged.section.gbps(), r.raw_tcp.gbps()));
    }
    println!("threads: at most {} kvstage-* threads, {} threads in all ({} samples)", r.threads.kvstage, r.threads.total, r.threads.samples);
    let slice = r.fixed.as_ref().map_or(String::new(), |f| format!("; slice {}", f.slice.check.text()));
    println!("verified (decode bytes compared with the reference): staged {}{slice}", r.staged.check.text());
}

/// "0.412 s (kvstage-xfer 0.300, kvstage-copy 0.080, ...)", the largest first.
fn by_thread(p: &crate::sys::ProcessParts) -> String {
    let mut groups: Vec<(&String, &f64)> = p.threads.iter().filter(|(_, s)| **s >= 0.0005).collect();
    groups.sort_by(|a, b| b.1.total_cmp(a.1));
    let list: Vec<String> = groups.iter().map(|(g, s)| format!("{g} {s:.3}")).collect();
    format!("{:.3} s ({})", p.total, list.join(", "))
}

/// One section in the JSON report.
#[derive(Serialize)]
struct SectionJson<E> {
    bytes: u64,
    seconds_median: f64,
    seconds_p99: f64,
    gbps: f64,
    inflight: u32,
    latency_p50_s: f64,
    latency_p99_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu_s_per_request: Option<f64>,
    /// The same by process (prefill, decode) and in each by thread group.
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu_s_per_request_parts: Option<CpuParts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cores_busy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    machine_idle: Option<f64>,
    #[serde(flatten)]
    extra: E,
}

/// No fields beyond the common ones.
#[derive(Serialize)]
struct Plain {}

#[derive(Serialize)]
struct StagedJson {
    requests: u32,
    warmup_requests: u32,
    window_s: f64,
    request_gbps: f64,
    operations: u64,
    /// The decode pools compared with the reference after the timed requests, and equal.
    verified: bool,
    /// The link every sender session ended up on (`tcp`, `rdma`, `shm`), or `mixed`.
    link: &'static str,
    /// How the chunks went: `shm-direct` (prefill page to decode page, one copy), `shm-ring`
    /// (gather into the mapped decode ring, then scatter), else the link.
    path: &'static str,
    /// Chunk regions copied page to page (direct mode), warmup included.
    direct_chunks: u64,
    /// Sessions allowed a faster path (transport auto) that run on a slower one.
    downgraded_sessions: usize,
    /// The prefill engines' last same-host downgrade: why auto did not take shm.
    #[serde(skip_serializing_if = "Option::is_none")]
    shm_downgrade: Option<String>,
}

#[derive(Serialize)]
struct SliceJson {
    writes: u64,
    writes_per_second: f64,
    time_boxed: bool,
    /// False when time-boxed (not compared) or when the bytes differ.
    verified: bool,
    /// Always `tcp`: slice writes go on the sessions' TCP control streams, whatever their link.
    link: &'static str,
}

#[derive(Serialize)]
struct RawJson {
    streams: u32,
}

#[derive(Serialize)]
struct Params {
    model: &'static str,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype_bytes: u32,
    prefill_tp: u32,
    decode_tp: u32,
    page_size: u32,
    tokens: u32,
    chunk_tokens: u32,
    ring_chunks: u32,
    reps: u32,
    warmup: u32,
    inflight: u32,
    sessions: usize,
    raw_streams: u32,
    transfer_threads: u32,
    send_staging_buffers: u32,
    /// Pieces of a chunk's write from a staging buffer (0: one write after the whole gather).
    send_piece_bytes: u64,
    /// Over TCP, chunks written straight from the pool's rows (no staging copy).
    send_from_pool: bool,
    /// What `--transport` asked.
    transport: &'static str,
    /// Same-host sessions may go direct (`--no-direct`: false; the decode pools in shared memory).
    direct: bool,
    /// What each sender session ended up on, in session order (prefill rank, then decode rank).
    links: Vec<&'static str>,
    memory: &'static str,
    /// Aux buffers and state bytes each request also moves, and the bytes of those parts per request (all decode ranks).
    aux_rows: u32,
    state_bytes: u64,
    part_bytes: u64,
}

#[derive(Serialize)]
struct Ratios {
    staged_over_raw_tcp: f64,
    staged_p99_over_p50: f64,
    staged_cpu_over_raw_tcp_cpu: f64,
    staged_over_raw_tcp_memory: f64,
    staged_cpu_over_raw_tcp_memory_cpu: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    staged_over_slice: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    staged_over_memcpy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gather_over_memcpy: Option<f64>,
}

#[derive(Serialize)]
struct Threads {
    max_total: usize,
    max_kvstage: usize,
    samples: u64,
    sample_interval_ms: u128,
}

/// The `--json` report of one run (a sweep writes an array of them).
#[derive(Serialize)]
pub struct ReportJson {
    params: Params,
    staged: SectionJson<StagedJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    slice: Option<SectionJson<SliceJson>>,
    raw_tcp: SectionJson<RawJson>,
    raw_tcp_memory: SectionJson<RawJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memcpy: Option<SectionJson<Plain>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gather: Option<SectionJson<Plain>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scatter: Option<SectionJson<Plain>>,
    ratios: Ratios,
    threads: Threads,
}

pub fn report_json(a: &Args, r: &Report) -> ReportJson {
    let s = &a.setup;
    let m = &s.model;
    let o = prefill_options(a);
    let st = &r.staged;
    let staged = st.section.gbps();
    let f = r.fixed.as_ref();
    ReportJson {
        params: Params {
            model: m.name,
            layers: m.layers,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            dtype_bytes: m.dtype_bytes,
            prefill_tp: s.prefill_tp,
            decode_tp: s.decode_tp,
            page_size: s.page_size,
            tokens: s.tokens,
            chunk_tokens: s.chunk_tokens,
            ring_chunks: s.ring_chunks,
            reps: a.reps,
            warmup: a.warmup,
            inflight: a.inflight,
            sessions: s.sessions(),
            raw_streams: r.raw_streams,
            transfer_threads: o.transfer_threads,
            send_staging_buffers: o.send_staging_buffers,
            send_piece_bytes: o.send_piece_bytes,
            send_from_pool: o.send_from_pool,
            transport: kvstage_testkit::cluster::transport_name(s.transport),
            direct: s.direct,
            links: r.links.names(),
            memory: "host",
            aux_rows: s.aux_rows,
            state_bytes: s.state_bytes,
            part_bytes: if s.has_parts() { s.room_part_bytes() } else { 0 },
        },
        staged: st.section.json(StagedJson {
            requests: st.timed_requests,
            warmup_requests: st.warmup_requests,
            window_s: st.window,
            request_gbps: st.section.request_gbps(),
            operations: st.ops,
            verified: st.check.verified(),
            link: r.links.common(),
            path: r.links.path(),
            direct_chunks: r.links.direct_chunks,
            downgraded_sessions: r.links.downgraded,
            shm_downgrade: r.links.shm_downgrade.clone(),
        }),
        slice: f.map(|f| {
            f.slice.section.json(SliceJson {
                writes: f.slice.writes,
                writes_per_second: f.slice.writes_per_second,
                time_boxed: f.slice.boxed,
                verified: f.slice.check.verified(),
                link: "tcp",
            })
        }),
        raw_tcp: r.raw_tcp.json(RawJson { streams: r.raw_streams }),
        raw_tcp_memory: r.raw_memory.json(RawJson { streams: r.raw_streams }),
        memcpy: f.map(|f| f.memcpy.json(Plain {})),
        gather: f.map(|f| f.gather.json(Plain {})),
        scatter: f.map(|f| f.scatter.json(Plain {})),
        ratios: Ratios {
            staged_over_raw_tcp: ratio(staged, r.raw_tcp.gbps()),
            staged_p99_over_p50: ratio(st.section.p99(), st.section.median()),
            staged_cpu_over_raw_tcp_cpu: ratio(st.section.cpu_total(), r.raw_tcp.cpu_total()),
            staged_over_raw_tcp_memory: ratio(staged, r.raw_memory.gbps()),
            staged_cpu_over_raw_tcp_memory_cpu: ratio(st.section.cpu_total(), r.raw_memory.cpu_total()),
            staged_over_slice: f.map(|f| ratio(staged, f.slice.section.gbps())),
            staged_over_memcpy: f.map(|f| ratio(staged, f.memcpy.gbps())),
            gather_over_memcpy: f.map(|f| ratio(f.gather.gbps(), f.memcpy.gbps())),
        },
        threads: Threads {
            max_total: r.threads.total,
            max_kvstage: r.threads.kvstage,
            samples: r.threads.samples,
            sample_interval_ms: SAMPLE_EVERY.as_millis(),
        },
    }
}
