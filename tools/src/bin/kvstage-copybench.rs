//! Gather/scatter throughput of the host copy engine on a 70B-shaped chunk, next to a
//! single-thread memcpy of the same bytes measured in the same run.
//!
//! Shape: 80 layers, 8 KV heads, head_dim 128, bf16, prefill TP 4 → decode TP 2 (512-byte rows:
//! the prefill side's slot is the whole row, the decode side's slot is two rows), one writer's
//! region of a chunk of `--tokens` tokens (default 8192: 640 MiB). Page sizes 1 and 16, pages as
//! one consecutive run or fully random (in a pool twice the chunk). `--layout P[:D]` lays the
//! prefill and decode pools out as engines do (`sglang`, `vllm-lbhnc`, ..., `trtllm`; D defaults to
//! P), and adds direct mode's one pass, pool to pool on one thread, next to the same memcpy.
//!
//! Usage: kvstage-copybench [--tokens N] [--threads N] [--iters N] [--layout P[:D]] [--json]

use std::time::{Duration, Instant};

use clap::Parser;
use kvstage::copy::{CopyEngine, HostCopyEngine};
use kvstage::deadline::Deadline;
use kvstage::geometry::{plan_gather, plan_scatter, slice_plan, staging_layout, KvLayout, LayoutPreset, MemoryKind, ModelKind, PageSpan, PoolShape};
use serde::Serialize;

/// Gather/scatter throughput of the host copy engine on a 70B-shaped chunk, next to a
/// single-thread memcpy of the same bytes.
#[derive(Parser)]
#[command(name = "kvstage-copybench", args_override_self = true)]
struct Cli {
    /// Tokens of the chunk (a positive multiple of 16).
    #[arg(long, value_name = "N", default_value_t = 8192, value_parser = tokens)]
    tokens: u32,
    /// Copy engine threads (default: the available cores).
    #[arg(long, value_name = "N", default_value_t = std::thread::available_parallelism().map_or(2, |n| n.get() as u32))]
    threads: u32,
    /// Timed runs per figure (the median is reported; one more runs first, untimed).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Pool layouts, prefill[:decode] (sglang, vllm-lbhnc, vllm-lbnhc, vllm-lhbnc, vllm-blhnc,
    /// vllm-blnhc, vllm-bhlnc, trtllm); the decode side defaults to the prefill's.
    #[arg(long, value_name = "P[:D]", default_value = "sglang", value_parser = kvstage_tools::layout_pair)]
    layout: (LayoutPreset, LayoutPreset),
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

fn tokens(v: &str) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(t) if t > 0 && t % 16 == 0 => Ok(t),
        _ => Err("must be a positive multiple of 16".into()),
    }
}

/// Page-aligned, pre-faulted host memory.
struct Mem {
    ptr: *mut u8,
    len: usize,
}

impl Mem {
    fn new(len: usize, fill: u8) -> Mem {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).expect("layout");
        // SAFETY: non-zero size; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "out of memory allocating {len} bytes");
        // SAFETY: `len` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        Mem { ptr, len }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.len.max(1), 4096).expect("layout")) };
    }
}

/// A pool of `shape` laid out as `preset`, in one allocation.
fn pool(shape: PoolShape, capacity_pages: u64, preset: LayoutPreset) -> (Mem, KvLayout) {
    let mem = Mem::new(preset.tensor_bytes(&shape, capacity_pages) as usize, 0x5A);
    let bases = preset.bases(&shape, capacity_pages, mem.ptr as usize);
    let strides = preset.placement(&shape, capacity_pages).strides;
    let layout = KvLayout::new(shape, capacity_pages, MemoryKind::Host, bases).with_strides(strides);
    layout.validate().expect("a preset's layout");
    (mem, layout)
}

/// xorshift64*: deterministic random page lists without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn random_pages(n: usize, capacity: u32, rng: &mut Rng) -> Vec<u32> {
    let mut all: Vec<u32> = (0..capacity).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    all.truncate(n);
    all
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn memcpy_once(src: &Mem, dst: &Mem, bytes: usize) -> Duration {
    let t = Instant::now();
    // SAFETY: both buffers hold at least `bytes` bytes and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.ptr, dst.ptr, bytes) };
    std::hint::black_box(dst.ptr);
    t.elapsed()
}

#[derive(Serialize)]
struct Row {
    page_size: u32,
    indices: &'static str,
    op: &'static str,
    runs: usize,
    bytes: u64,
    #[serde(rename = "seconds", serialize_with = "secs")]
    time: Duration,
    /// GB/s of the op and of the memcpy of the same bytes; memcpy time / op time.
    gbps: f64,
    memcpy_gbps: f64,
    ratio: f64,
}

impl Row {
    fn new(page_size: u32, indices: &'static str, op: &'static str, runs: usize, bytes: u64, time: Duration, memcpy: Duration) -> Row {
        let (gbps, memcpy_gbps) = (gbps(bytes, time), gbps(bytes, memcpy));
        Row { page_size, indices, op, runs, bytes, time, gbps, memcpy_gbps, ratio: memcpy.as_secs_f64() / time.as_secs_f64() }
    }
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The `--json` report.
#[derive(Serialize)]
struct Report<'a> {
    tokens: u32,
    threads: u32,
    iters: u32,
    layout: String,
    region_bytes: usize,
    results: &'a [Row],
}

fn main() {
    let args = Cli::parse();
    let engine = HostCopyEngine::new(args.threads);
    let base = PoolShape::new(ModelKind::Mha, 8, 128, 2, 1, 80);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut rows: Vec<Row> = Vec::new();

    // Memcpy baseline buffers, sized like one writer region.
    let src0 = base.clone().with_tp(0, 4);
    let region = staging_layout(&src0, &base.clone().with_tp(0, 2), args.tokens)
        .and_then(|st| st.region_of(&src0))
        .expect("70B staging layout")
        .expect("prefill rank 0 writes to decode rank 0")
        .bytes as usize;
    let copy_src = Mem::new(region, 1);
    let copy_dst = Mem::new(region, 2);
    let staging = Mem::new(region, 3);

    if !args.json {
        println!(
            "kvstage-copybench: 70B chunk (80 layers, 8 KV heads, head_dim 128, bf16), P4->D2, 512 B rows, {} -> {} pools, {} tokens, {:.0} MiB per writer region, {} thread(s), median of {}",
            args.layout.0.name(),
            args.layout.1.name(),
            args.tokens,
            region as f64 / (1 << 20) as f64,
            args.threads,
            args.iters
        );
        println!("{:>4} {:>7} {:>8} {:>9} {:>10} {:>12} {:>8}", "ps", "indices", "op", "runs", "GB/s", "memcpy GB/s", "ratio");
    }
    for page_size in [1u32, 16] {
        let pages_n = (args.tokens / page_size) as usize;
        // Twice the chunk, and room for the run-shaped lists (pages 7.. and 3..) at any --tokens.
        let capacity = 2 * pages_n as u32 + 8;
        let src_shape = PoolShape { page_size, ..base.clone() }.with_tp(1, 4);
        let dst_shape = PoolShape { page_size, ..base.clone() }.with_tp(0, 2);
        let (_src_mem, src_pool) = pool(src_shape.clone(), capacity as u64, args.layout.0);
        let (_dst_mem, dst_pool) = pool(dst_shape.clone(), capacity as u64, args.layout.1);
        let st = staging_layout(&src_shape, &dst_shape, args.tokens).expect("staging layout");
        let w = &st.region_of(&src_shape).expect("writer").expect("rank 1 writes to decode rank 0");
        for indices in ["runs", "random"] {
            let (src_pages, dst_pages) = match indices {
                "runs" => ((7..7 + pages_n as u32).collect::<Vec<_>>(), (3..3 + pages_n as u32).collect::<Vec<_>>()),
                _ => (random_pages(pages_n, capacity, &mut rng), random_pages(pages_n, capacity, &mut rng)),
            };
            let t = Instant::now();
            let g = plan_gather(&src_pool, &src_pages, 0, &st, w).expect("gather plan");
            let s = plan_scatter(&dst_pool, &dst_pages, &st, w).expect("scatter plan");
            let plan_time = t.elapsed();
            let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
            for i in 0..=args.iters {
                let m = memcpy_once(&copy_src, &copy_dst, region);
                let t = Instant::now();
                // SAFETY: the pools and the staging buffer are live and sized for the plans.
                unsafe { engine.gather(&g, &src_pool, staging.ptr) }.expect("gather");
                let tg = t.elapsed();
                let t = Instant::now();
                unsafe { engine.scatter(&s, &dst_pool, staging.ptr) }.expect("scatter");
                let ts = t.elapsed();
                let t = Instant::now();
                // SAFETY: as above; the two pools do not overlap.
                unsafe { engine.copy_across(&g, &src_pool, &s, &dst_pool, &Deadline::after(None)) }.expect("direct copy");
                let td = t.elapsed();
                if i > 0 {
                    times[0].push(m);
                    times[1].push(tg);
                    times[2].push(ts);
                    times[3].push(td);
                }
            }
            let [m, tg, ts, td] = times.map(median);
            rows.push(Row::new(page_size, indices, "gather", g.run_count(), g.bytes(), tg, m));
            rows.push(Row::new(page_size, indices, "scatter", s.run_count(), s.bytes(), ts, m));
            rows.push(Row::new(page_size, indices, "direct", s.run_count(), s.bytes(), td, m));
            if !args.json {
                for r in &rows[rows.len() - 3..] {
                    println!(
                        "{:>4} {:>7} {:>8} {:>9} {:>10.2} {:>12.2} {:>7.2}x",
                        r.page_size,
                        r.indices,
                        r.op,
                        r.runs,
                        r.gbps,
                        r.memcpy_gbps,
                        r.ratio
                    );
                }
                println!("     (planning both: {:.2} ms)", plan_time.as_secs_f64() * 1e3);
            }
        }
        // The slice path for the same pair, pool to pool, one memcpy per op on one thread (its
        // destination offsets count a token-major pool: sglang's layouts only).
        if page_size == 16 && args.layout == (LayoutPreset::Sglang, LayoutPreset::Sglang) {
            let src_pages: Vec<u32> = (7..7 + pages_n as u32).collect();
            let dst_pages: Vec<u32> = (3..3 + pages_n as u32).collect();
            let hs = w.heads;
            let t = Instant::now();
            let ops = slice_plan(&src_shape, &dst_shape, &hs, &PageSpan::whole(&src_pages, src_shape.page_size), &PageSpan::whole(&dst_pages, dst_shape.page_size)).expect("slice plan");
            let plan_time = t.elapsed();
            let mut times = Vec::new();
            let mut mtimes = Vec::new();
            for i in 0..=args.iters.min(3) {
                let m = memcpy_once(&copy_src, &copy_dst, region);
                let t = Instant::now();
                for op in &ops {
                    let from = src_pool.bases[op.src_buffer as usize] + op.src_offset as usize;
                    let to = dst_pool.bases[op.dst_buffer as usize] + op.dst_offset as usize;
                    // SAFETY: slice_plan offsets lie within the pools' first 2·pages_n pages.
                    unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, op.len as usize) };
                }
                if i > 0 {
                    times.push(t.elapsed());
                    mtimes.push(m);
                }
            }
            let bytes: u64 = ops.iter().map(|o| o.len).sum();
            let (t, m) = (median(times), median(mtimes));
            rows.push(Row::new(page_size, "runs", "slice", ops.len(), bytes, t, m));
            if !args.json {
                println!(
                    "{:>4} {:>7} {:>8} {:>9} {:>10.2} {:>12.2} {:>7.2}x   (slice path: one 512 B memcpy per op, 1 thread; plan {:.1} ms)",
                    page_size,
                    "runs",
                    "slice",
                    ops.len(),
                    gbps(bytes, t),
                    gbps(bytes, m),
                    m.as_secs_f64() / t.as_secs_f64(),
                    plan_time.as_secs_f64() * 1e3
                );
            }
        }
    }
    if args.json {
        let layout = format!("{}:{}", args.layout.0.name(), args.layout.1.name());
        let report = Report { tokens: args.tokens, threads: args.threads, iters: args.iters, layout, region_bytes: region, results: &rows };
        print!("{}", kvstage_tools::json(&report));
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
