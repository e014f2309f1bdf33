//! The main job: a real staged transfer on one machine. This process plays every prefill rank;
//! a child process plays every decode rank. KV moves over loopback TCP through the decode staging
//! rings, is verified byte-for-byte in the child, and the slice path moves the same chunks for
//! comparison.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstage::engine::{Engine, EngineOptions};
use kvstage::geometry::{self, ModelKind};
use kvstage::session::op::Op;
use kvstage::session::sender::{SenderSession, TransferDesc};
use kvstage::testkit::{model, page_table, HostPool, Model};
use kvstage::{Error, Status};

#[derive(Clone, Debug)]
struct Args {
    model: Model,
    prefill_tp: u32,
    decode_tp: u32,
    page_size: u32,
    tokens: u32,
    chunk_tokens: u32,
    slice: bool,
    role_decode: bool,
}

const USAGE: &str = "usage: kvstage-demo [--model llama3-8b|qwen3-32b|llama3-70b|deepseek-v3] [--layers N] \
[--kv-heads N] [--head-dim N] [--dtype-bytes N] [--prefill-tp N] [--decode-tp N] [--page-size N] [--tokens N] \
[--chunk-tokens N] [--no-slice]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: model("llama3-8b").expect("preset exists"),
        prefill_tp: 4,
        decode_tp: 2,
        page_size: 16,
        tokens: 4096,
        chunk_tokens: 2048,
        slice: true,
        role_decode: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value\n{USAGE}"));
        let num = |v: String, name: &str| v.parse::<u32>().map_err(|_| format!("{name}: '{v}' is not a number"));
        match flag.as_str() {
            "--model" => {
                let v = value("--model")?;
                a.model = model(&v).ok_or(format!("unknown model '{v}'\n{USAGE}"))?;
            }
            "--layers" => a.model.layers = num(value(&flag)?, &flag)?,
            "--kv-heads" => a.model.kv_heads = num(value(&flag)?, &flag)?,
            "--head-dim" => a.model.head_dim = num(value(&flag)?, &flag)?,
            "--dtype-bytes" => a.model.dtype_bytes = num(value(&flag)?, &flag)?,
            "--prefill-tp" => a.prefill_tp = num(value(&flag)?, &flag)?,
            "--decode-tp" => a.decode_tp = num(value(&flag)?, &flag)?,
            "--page-size" => a.page_size = num(value(&flag)?, &flag)?,
            "--tokens" => a.tokens = num(value(&flag)?, &flag)?,
            "--chunk-tokens" => a.chunk_tokens = num(value(&flag)?, &flag)?,
            "--no-slice" => a.slice = false,
            "--role-decode" => a.role_decode = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument '{other}'\n{USAGE}")),
        }
    }
    if a.tokens == 0 || a.page_size == 0 || a.tokens % a.page_size != 0 {
        return Err(format!("--tokens {} must be a positive multiple of --page-size {}", a.tokens, a.page_size));
    }
    Ok(a)
}

const STAGED_ROOM: u64 = 1;
const SLICE_ROOM: u64 = 2;

impl Args {
    fn pages(&self) -> usize {
        (self.tokens / self.page_size) as usize
    }
    /// Pool capacity: room for both rooms' pages and some slack so page tables are scattered.
    fn capacity(&self) -> u64 {
        self.pages() as u64 * 2 + 16
    }
    fn prefill_pages(&self, rank: u32) -> Vec<u32> {
        page_table(self.pages(), self.capacity(), 100 + rank as u64, false)
    }
    fn decode_pages(&self, rank: u32, room: u64) -> Vec<u32> {
        let all = page_table(self.pages() * 2, self.capacity(), 200 + rank as u64, false);
        let n = self.pages();
        if room == STAGED_ROOM { all[..n].to_vec() } else { all[n..].to_vec() }
    }
    fn grid_pages(&self) -> usize {
        (geometry::grid_tokens(self.chunk_tokens, self.page_size) / self.page_size) as usize
    }
    fn options(&self) -> EngineOptions {
        EngineOptions { chunk_tokens: self.chunk_tokens, ..EngineOptions::default() }
    }
}

fn fail(e: Error) -> ! {
    eprintln!("kvstage-demo: {} ({})", e.chain(), e.code().name());
    std::process::exit(1)
}

/// Decode side: one engine per decode rank; prints their ports, then results as lines.
fn run_decode(a: &Args) -> Result<(), Error> {
    let mut ranks = Vec::new();
    for rd in 0..a.decode_tp {
        let engine = Engine::new(a.options())?;
        let pool = HostPool::new(a.model.shape(a.page_size, rd, a.decode_tp), a.capacity());
        engine.register_pool(pool.layout.clone())?;
        let src = a.model.shape(a.page_size, 0, a.prefill_tp);
        let per_chunk = geometry::staging_layout(&src, &pool.layout.shape, a.grid_pages() as u32 * a.page_size)?.total_bytes;
        engine.register_staging(None, (per_chunk * 2) as usize)?;
        engine.receiver().open_room(STAGED_ROOM, &a.decode_pages(rd, STAGED_ROOM), a.chunk_tokens)?;
        engine.receiver().open_room(SLICE_ROOM, &a.decode_pages(rd, SLICE_ROOM), a.chunk_tokens)?;
        ranks.push((engine, pool));
    }
    let ports: Vec<String> = ranks.iter().map(|(e, _)| e.local_addr().to_string()).collect();
    println!("ADDRS {}", ports.join(" "));
    std::io::stdout().flush().ok();
    for (room, label) in [(STAGED_ROOM, "staged"), (SLICE_ROOM, "slice")] {
        if room == SLICE_ROOM && !a.slice {
            break;
        }
        let mut bad = 0;
        let mut first = None;
        for (rd, (engine, pool)) in ranks.iter().enumerate() {
            engine.receiver().wait_room(room, Some(Duration::from_secs(600)))?;
            let (b, f) = pool.verify(&a.decode_pages(rd as u32, room), 0);
            bad += b;
            first = first.or(f);
            engine.receiver().release_room(room);
        }
        println!("VERIFIED {label} {bad} {}", first.unwrap_or_default());
        std::io::stdout().flush().ok();
    }
    Ok(())
}

/// Which decode ranks prefill rank `rs` writes to.
fn targets(a: &Args, rs: u32) -> Vec<u32> {
    match a.model.kind {
        ModelKind::Mla => (0..a.decode_tp).filter(|rd| rd % a.prefill_tp == rs).collect(),
        ModelKind::Mha => geometry::decode_ranks_for_prefill(rs, a.prefill_tp, a.decode_tp).map(|r| r.collect()).unwrap_or_default(),
    }
}

struct Measured {
    seconds: f64,
    writes: u64,
}

/// Sends every chunk of `room` from every prefill rank (one thread per rank), staged or sliced.
fn send_room(a: &Args, sessions: &[(u32, Vec<Arc<SenderSession>>)], room: u64, staged: bool) -> Result<Measured, Error> {
    let grid = a.grid_pages();
    let start = Instant::now();
    let results: Vec<Result<u64, Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = sessions
            .iter()
            .map(|(rs, list)| {
                s.spawn(move || {
                    let pages = a.prefill_pages(*rs);
                    let mut writes = 0u64;
                    for (chunk, chunk_pages) in pages.chunks(grid).enumerate() {
                        for session in list {
                            let desc = TransferDesc { room, chunk: chunk as u32, pages: chunk_pages.to_vec(), timeout: Some(Duration::from_secs(120)) };
                            let op = Op::new(session.waker());
                            let status = if staged { session.transfer(&desc, &op)? } else { session.transfer_slices(&desc, &op)? };
                            if status != Status::KVSTAGE_OK {
                                return Err(Error::new(status, format!("transfer returned {}", status.name())));
                            }
                            writes += if staged { 1 } else { slice_writes(a, chunk_pages.len()) };
                        }
                    }
                    Ok(writes)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("sender thread panicked")).collect()
    });
    let mut writes = 0;
    for r in results {
        writes += r?;
    }
    Ok(Measured { seconds: start.elapsed().as_secs_f64(), writes })
}

fn slice_writes(a: &Args, pages: usize) -> u64 {
    a.model.layers as u64 * if a.model.kind == ModelKind::Mla { 1 } else { 2 } * (pages as u64 * a.page_size as u64)
}

fn run_prefill(a: &Args) -> Result<(), Error> {
    let exe = std::env::current_exe().map_err(|e| Error::internal("cannot find the demo executable").with_source(e))?;
    let mut child = Command::new(exe)
        .args(std::env::args().skip(1))
        .arg("--role-decode")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::internal("cannot start the decode process").with_source(e))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut next_line = move || lines.next().and_then(|l| l.ok()).unwrap_or_default();
    let first = next_line();
    let addrs: Vec<String> = first.strip_prefix("ADDRS ").map(|s| s.split(' ').map(str::to_owned).collect()).unwrap_or_default();
    if addrs.len() != a.decode_tp as usize {
        let _ = child.kill();
        return Err(Error::internal(format!("decode process did not start (said '{first}')")));
    }

    println!(
        "kvstage {} demo: {} ({} layers, {} KV heads, head_dim {}, {}-byte dtype), prefill TP {} -> decode TP {}, page_size {}, {} tokens in chunks of {}",
        env!("CARGO_PKG_VERSION"),
        a.model.name,
        a.model.layers,
        a.model.kv_heads,
        a.model.head_dim,
        a.model.dtype_bytes,
        a.prefill_tp,
        a.decode_tp,
        a.page_size,
        a.tokens,
        a.chunk_tokens
    );
    let mut engines = Vec::new();
    let mut sessions = Vec::new();
    let mut kv_bytes = 0u64;
    for rs in 0..a.prefill_tp {
        let engine = Engine::new(a.options())?;
        let mut pool = HostPool::new(a.model.shape(a.page_size, rs, a.prefill_tp), a.capacity());
        pool.fill(&a.prefill_pages(rs), 0);
        engine.register_pool(pool.layout.clone())?;
        let mut list = Vec::new();
        for rd in targets(a, rs) {
            list.push(engine.connect(&addrs[rd as usize], &format!("demo-p{rs}-d{rd}"), None)?);
            let dst = a.model.shape(a.page_size, rd, a.decode_tp);
            let w = kvstage::session::writer_of(&pool.layout.shape, &dst)?;
            kv_bytes += geometry::staging_layout(&pool.layout.shape, &dst, a.tokens)?.writers[w as usize].bytes;
        }
        sessions.push((rs, list));
        engines.push((engine, pool));
    }

    let staged = send_room(a, &sessions, STAGED_ROOM, true)?;
    let verdict = next_line();
    let gbps = |bytes: u64, s: f64| bytes as f64 / s / 1e9;
    println!("\nstaged path : {kv_bytes} bytes in {} bulk writes, {:.3} s, {:.2} GB/s", staged.writes, staged.seconds, gbps(kv_bytes, staged.seconds));
    println!("              decode pool check: {}", describe(&verdict, "staged"));
    let mut ok = verdict.starts_with("VERIFIED staged 0");
    if a.slice {
        let sliced = send_room(a, &sessions, SLICE_ROOM, false)?;
        let verdict = next_line();
        println!(
            "slice path  : {kv_bytes} bytes in {} writes, {:.3} s, {:.2} GB/s, {:.0} writes/s",
            sliced.writes,
            sliced.seconds,
            gbps(kv_bytes, sliced.seconds),
            sliced.writes as f64 / sliced.seconds
        );
        println!("              decode pool check: {}", describe(&verdict, "slice"));
        println!("staged / slice throughput: {:.1}x", sliced.seconds / staged.seconds);
        ok &= verdict.starts_with("VERIFIED slice 0");
    }
    drop(sessions);
    let status = child.wait().map_err(|e| Error::internal("waiting for the decode process").with_source(e))?;
    if !ok || !status.success() {
        return Err(Error::new(Status::KVSTAGE_E_INTEGRITY, "decode pools do not match the reference"));
    }
    println!("\nresult: OK (decode KV pools byte-identical to the reference reshard)");
    Ok(())
}

fn describe(line: &str, label: &str) -> String {
    let prefix = format!("VERIFIED {label} ");
    match line.strip_prefix(&prefix) {
        Some(rest) if rest.starts_with("0 ") || rest == "0" => "all bytes match the reference reshard".to_owned(),
        Some(rest) => format!("MISMATCH: {rest} bytes differ"),
        None => format!("decode process failed ({line:?})"),
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let result = if args.role_decode { run_decode(&args) } else { run_prefill(&args) };
    if let Err(e) = result {
        fail(e);
    }
}
