//! The CUDA copy engine on a real GPU: doctor report, bit-exactness check, benchmark.
//!
//! Usage:
//!   kvstage-cuda doctor               driver version, devices, whether the embedded PTX loads
//!   kvstage-cuda check [--device N]   the selftest cases (device engine and host engine vs a
//!                                     reference walk of the rows: token-major pools, then every
//!                                     named layout — sglang, vLLM's six orders, TensorRT-LLM —
//!                                     padded pages, direct copies between different layouts) with
//!                                     default, tiny-scratch and tiny-grid engines, and the
//!                                     ready-fence ordering (stream and event)
//!   kvstage-cuda bench [--device N] [--iters N] [--tokens N] [--json FILE]
//!                                     gather/scatter of 70B- and MLA-shaped chunks, pages of 16 and
//!                                     64 tokens (and 1 for 70B; default 8192
//!                                     tokens, a multiple of 64) vs a
//!                                     device memcpy of the same bytes (and vs device<->host copies
//!                                     for host staging), median of N runs, ratios
//!
//! `check` and `bench` exit 77 when there is no usable GPU (KVSTAGE_REQUIRE_GPU=1 makes that a
//! failure), 1 on a failed check.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use kvstage::copy::cuda::{self, selftest, CudaCopyEngine, CudaTestMemory, DeviceMemory, ReadyFence, ToolStream};
use kvstage::copy::CopyEngine;
use kvstage::geometry::{plan_gather, plan_scatter, staging_layout, CopyPlan, KvLayout, MemoryKind, ModelKind, PoolShape};
use kvstage::{Error, Result};
use serde::Serialize;

/// The CUDA copy engine on a real GPU: doctor report, bit-exactness check, benchmark.
#[derive(Parser)]
#[command(name = "kvstage-cuda", args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Driver version, devices, whether the embedded PTX loads.
    Doctor,
    /// The selftest cases (device engine and host engine vs a reference walk of the rows:
    /// token-major pools, every named layout, padded pages, direct copies between different
    /// layouts) with default, tiny-scratch and tiny-grid engines, and the ready-fence ordering
    /// (stream and event).
    #[command(args_override_self = true)]
    Check {
        /// CUDA device ordinal.
        #[arg(long, value_name = "N", default_value_t = 0)]
        device: i32,
    },
    /// Gather/scatter of 70B- and MLA-shaped chunks vs a device memcpy of the same bytes (and vs
    /// device<->host copies for host staging), median of N runs, ratios.
    #[command(args_override_self = true)]
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// CUDA device ordinal.
    #[arg(long, value_name = "N", default_value_t = 0)]
    device: i32,
    /// Timed runs per figure (after 3 untimed ones); the median is reported.
    #[arg(long, value_name = "N", default_value_t = 20)]
    iters: usize,
    /// Tokens per chunk (a positive multiple of 64).
    #[arg(long, value_name = "N", default_value_t = 8192, value_parser = tokens)]
    tokens: u32,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
}

fn tokens(v: &str) -> std::result::Result<u32, String> {
    match v.parse::<u32>() {
        Ok(t) if t > 0 && t % 64 == 0 => Ok(t),
        _ => Err("must be a positive multiple of 64".into()),
    }
}

/// 77 (skipped) without a GPU, unless KVSTAGE_REQUIRE_GPU=1.
fn no_gpu(e: &Error) -> ExitCode {
    println!("kvstage-cuda: no usable GPU: {}", e.chain());
    if std::env::var("KVSTAGE_REQUIRE_GPU").as_deref() == Ok("1") {
        eprintln!("kvstage-cuda: KVSTAGE_REQUIRE_GPU=1 but no GPU");
        return ExitCode::from(1);
    }
    ExitCode::from(77)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (device, name) = match &cli.cmd {
        Cmd::Doctor => {
            print!("{}", cuda::report());
            return ExitCode::SUCCESS;
        }
        Cmd::Check { device } => (*device, "check"),
        Cmd::Bench(b) => (b.device, "bench"),
    };
    let engine = match CudaCopyEngine::open(device) {
        Ok(e) => e,
        Err(e) => return no_gpu(&e),
    };
    let result = match &cli.cmd {
        Cmd::Bench(b) => bench(&engine, b),
        _ => check(&engine, device),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvstage-cuda {name}: FAILED: {}", e.chain());
            ExitCode::from(1)
        }
    }
}

fn check(engine: &CudaCopyEngine, device: i32) -> Result<()> {
    print!("{}", cuda::report());
    let mem = CudaTestMemory::new(device);
    let mut log = |line: &str| println!("  {line}");
    let (standard, layouts) = (selftest::standard_cases().len(), selftest::layout_cases().len());
    println!("check: {standard} token-major cases, {layouts} strided-layout cases");
    println!("check: default engine");
    let (n, _) = selftest::run_all(engine, &mem, &mut log)?;
    println!("check: 1-byte scratch limit (one piece per slab), 1x1 grid");
    let tiny = CudaCopyEngine::open(device)?
        .with_scratch_limit(1)
        .with_grid_limits(cuda::job::GridLimits { x: 1, y: 1 });
    selftest::run_all(&tiny, &mem, &mut log)?;
    println!("check: 3 KiB scratch, 2x3 grid");
    let small = CudaCopyEngine::open(device)?
        .with_scratch_limit(3 << 10)
        .with_grid_limits(cuda::job::GridLimits { x: 2, y: 3 });
    selftest::run_all(&small, &mem, &mut log)?;
    fences(engine, device)?;
    println!("check: {n} cases x 3 engines bit-exact, fences ordered: all passed");
    Ok(())
}

/// A pool of `shape` in one device allocation; buffers back to back.
struct DevicePool {
    _mem: DeviceMemory,
    layout: KvLayout,
}

fn device_pool(device: i32, shape: &PoolShape, capacity_pages: u64) -> Result<DevicePool> {
    let nb = (shape.buffers_per_layer() * shape.layer_count()) as usize;
    let bb = (capacity_pages * shape.page_bytes()) as usize;
    let mem = DeviceMemory::alloc(device, nb * bb)?;
    let bases = (0..nb).map(|i| mem.ptr as usize + i * bb).collect();
    let layout = KvLayout::new(shape.clone(), capacity_pages, MemoryKind::Cuda, bases);
    Ok(DevicePool { _mem: mem, layout })
}

/// The gather waits for work queued on the producer's stream before the fence was captured: a
/// large memset on another stream, then gather_after(fence) must see only the memset's bytes.
fn fences(engine: &CudaCopyEngine, device: i32) -> Result<()> {
    let shape = PoolShape::new(ModelKind::Mha, 8, 128, 2, 64, 8);
    let capacity = 512u64; // 32768 tokens x 2 KiB x 16 buffers = 1 GiB of memset
    let pool = device_pool(device, &shape, capacity)?;
    let st = staging_layout(&shape, &shape, 128 * 64)?;
    let pages: Vec<u32> = (0..128).map(|p| p * 4 % capacity as u32).collect();
    let region = st.region_of(&shape)?.ok_or_else(|| Error::internal("a TP 1 rank writes every layer"))?;
    let plan = plan_gather(&shape, &pages, 0, &st, &region)?;
    let bytes = pool.layout.max_buffer_bytes() as usize * pool.layout.bases.len();
    let producer = ToolStream::new(device)?;
    let mut staging = vec![0u8; plan.staging_bytes as usize];
    for (round, byte) in [(0, 0x5Au8), (1, 0x3C)] {
        staging.fill(0);
        producer.memset(pool.layout.bases[0] as u64, byte, bytes)?;
        let event;
        let fence = if round == 0 {
            ReadyFence::capture(&pool.layout, producer.raw(), 0)?
        } else {
            event = producer.record()?;
            ReadyFence::capture(&pool.layout, 0, event.raw())?
        };
        // SAFETY: device pool, host staging of the region's size.
        unsafe { engine.gather_after(&plan, &pool.layout, staging.as_mut_ptr(), fence.as_ref(), &kvstage::deadline::Deadline::after(None)) }?;
        if let Some(i) = staging.iter().position(|&b| b != byte) {
            return Err(Error::internal(format!(
                "gather after a {} fence read byte {i} = {:#x}, expected {byte:#x}: it did not wait for the producer",
                if round == 0 { "stream" } else { "event" },
                staging[i]
            )));
        }
        producer.sync()?;
        println!("  ok   gather ordered after the producer's {}", if round == 0 { "stream" } else { "event" });
    }
    Ok(())
}

#[derive(Serialize)]
struct Row {
    #[serde(rename = "case")]
    name: String,
    bytes: u64,
    ms: f64,
    #[serde(rename = "baseline_ms")]
    base_ms: f64,
    baseline: &'static str,
    /// GB/s of the case; its baseline's time over its own (filled by [`Row::new`]).
    gbps: f64,
    ratio: f64,
}

impl Row {
    fn new(name: String, bytes: u64, ms: f64, base_ms: f64, baseline: &'static str) -> Row {
        Row { name, bytes, ms, base_ms, baseline, gbps: bytes as f64 / ms / 1e6, ratio: base_ms / ms }
    }
}

/// The `--json` report.
#[derive(Serialize)]
struct Report<'a> {
    iters: usize,
    results: &'a [Row],
}

fn median_ms(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn bench(engine: &CudaCopyEngine, args: &BenchArgs) -> Result<()> {
    print!("{}", cuda::report());
    let dev = args.device;
    let tokens = args.tokens;
    let mut rows = Vec::new();
    // 70B: 80 layers, 8 KV heads, D128, bf16. P4 -> D2: gather whole 512-byte slots, scatter into
    // half of 1024-byte slots. P2 -> D4: gather half slots.
    let m70 = |ps: u32, rank: u32, tp: u32| PoolShape::new(ModelKind::Mha, 8, 128, 2, ps, 80).with_tp(rank, tp);
    // DeepSeek V3: 61 layers of one 576-element latent, replicated on every TP rank.
    let mla = |ps: u32| PoolShape::new(ModelKind::Mla, 1, 576, 2, ps, 61);
    let cases: Vec<(&str, PoolShape, PoolShape, bool)> = vec![
        ("70B P4->D2 ps16 consecutive pages", m70(16, 0, 4), m70(16, 0, 2), false),
        ("70B P4->D2 ps16 random pages", m70(16, 0, 4), m70(16, 0, 2), true),
        ("70B P4->D2 ps64 random pages", m70(64, 0, 4), m70(64, 0, 2), true),
        ("70B P4->D2 ps1 random pages", m70(1, 0, 4), m70(1, 0, 2), true),
        ("70B P2->D4 ps16 random pages", m70(16, 1, 2), m70(16, 3, 4), true),
        ("DeepSeek MLA ps16 random pages", mla(16), mla(16), true),
        ("DeepSeek MLA ps64 random pages", mla(64), mla(64), true),
    ];
    for (name, src, dst, random) in cases {
        let st = staging_layout(&src, &dst, tokens)?;
        let w = &st.region_of(&src)?.ok_or_else(|| Error::internal("not a writer"))?;
        let npages = tokens / src.page_size;
        let capacity = 2 * npages as u64;
        let pages: Vec<u32> = if random {
            let mut v: Vec<u32> = (0..capacity as u32).collect();
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            for i in (1..v.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                v.swap(i, (x % (i as u64 + 1)) as usize);
            }
            v.truncate(npages as usize);
            v
        } else {
            (0..npages).collect()
        };
        let sp = device_pool(dev, &src, capacity)?;
        let dp = device_pool(dev, &dst, capacity)?;
        let g = plan_gather(&src, &pages, 0, &st, w)?;
        let s = plan_scatter(&dst, &pages, &st, w)?;
        let region = w.bytes as usize;
        let staging = DeviceMemory::alloc(dev, region)?;
        let other = DeviceMemory::alloc(dev, region)?;
        let memcpy = median_ms(args.iters, || other.copy_from(&staging, region))?;
        let run = |plan: &CopyPlan, pool: &KvLayout, gather: bool| {
            median_ms(args.iters, || unsafe {
                if gather {
                    engine.gather(plan, pool, staging.ptr as *mut u8)
                } else {
                    engine.scatter(plan, pool, staging.ptr as *const u8)
                }
            })
        };
        let gms = run(&g, &sp.layout, true)?;
        let sms = run(&s, &dp.layout, false)?;
        rows.push(Row::new(format!("{name}: gather"), g.bytes(), gms, memcpy, "device memcpy"));
        rows.push(Row::new(format!("{name}: scatter"), s.bytes(), sms, memcpy, "device memcpy"));
        if name.starts_with("70B P4->D2 ps16 random") {
            // Host staging (the TCP path): pinned and pageable, vs a plain copy of the same bytes.
            let mut host = vec![0u8; region];
            let d2h = median_ms(args.iters, || staging.read(0, &mut host))?;
            let pageable = median_ms(args.iters, || unsafe { engine.gather(&g, &sp.layout, host.as_mut_ptr()) })?;
            rows.push(Row::new(format!("{name}: gather to pageable host"), g.bytes(), pageable, d2h, "device->host copy, same buffer"));
            let pin = engine.pin_host(host.as_mut_ptr(), host.len())?;
            let d2h_pinned = median_ms(args.iters, || staging.read(0, &mut host))?;
            let pinned = median_ms(args.iters, || unsafe { engine.gather(&g, &sp.layout, host.as_mut_ptr()) })?;
            let h2d_pinned = median_ms(args.iters, || staging.write(0, &host))?;
            let spinned = median_ms(args.iters, || unsafe { engine.scatter(&s, &dp.layout, host.as_ptr()) })?;
            rows.push(Row::new(format!("{name}: gather to pinned host"), g.bytes(), pinned, d2h_pinned, "device->host copy, pinned"));
            rows.push(Row::new(format!("{name}: scatter from pinned host"), s.bytes(), spinned, h2d_pinned, "host->device copy, pinned"));
            drop(pin);
        }
    }
    println!("{:<56} {:>9} {:>9} {:>9} {:>7}  baseline", "case", "MiB", "ms", "GB/s", "ratio");
    for r in &rows {
        println!(
            "{:<56} {:>9.1} {:>9.3} {:>9.1} {:>7.2}  {} ({:.1} GB/s)",
            r.name,
            r.bytes as f64 / (1 << 20) as f64,
            r.ms,
            r.gbps,
            r.ratio,
            r.baseline,
            r.bytes as f64 / r.base_ms / 1e6
        );
    }
    if let Some(path) = &args.json {
        kvstage_tools::write_json(path, &Report { iters: args.iters, results: &rows })?;
        println!("bench: JSON in {path}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn command_line() {
        super::Cli::command().debug_assert();
    }
}
