//! The main job: a real staged transfer on one machine. This process plays every prefill rank;
//! a child process plays every decode rank. KV moves over loopback TCP through the decode staging
//! rings, is verified byte-for-byte in the child, and the slice path moves the same request for
//! comparison.

use std::time::Instant;

use kvstage::testkit::cluster::{serve_decode, DecodeChild, Prefill, Setup};
use kvstage::testkit::model;
use kvstage::{Error, Status};

const USAGE: &str = "usage: kvstage-demo [--model llama3-8b|qwen3-32b|llama3-70b|deepseek-v3] [--kind mha|mla] [--layers N] \
[--kv-heads N] [--head-dim N] [--dtype-bytes N] [--prefill-tp N] [--decode-tp N] [--page-size N] [--tokens N] \
[--chunk-tokens N] [--ring-chunks N] [--no-slice]";

struct Args {
    setup: Setup,
    slice: bool,
    role_decode: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        setup: Setup {
            model: model("llama3-8b").expect("preset exists"),
            prefill_tp: 4,
            decode_tp: 2,
            page_size: 16,
            tokens: 4096,
            chunk_tokens: 2048,
            ring_chunks: 2,
        },
        slice: true,
        role_decode: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        if a.setup.parse_flag(&flag, &mut value)? {
            continue;
        }
        match flag.as_str() {
            "--no-slice" => a.slice = false,
            "--role-decode" => a.role_decode = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument '{other}'\n{USAGE}")),
        }
    }
    a.setup.check()?;
    Ok(a)
}

const STAGED_ROOM: u64 = 1;
const SLICE_ROOM: u64 = 2;

fn run(a: &Args) -> Result<bool, Error> {
    let s = &a.setup;
    let exe = std::env::current_exe().map_err(|e| Error::internal("cannot find the demo executable").with_source(e))?;
    let mut args = s.flags();
    args.push("--role-decode".into());
    let mut child = DecodeChild::spawn(&exe, &args, s.decode_tp)?;
    let m = &s.model;
    println!(
        "kvstage {} demo: {} ({} layers, {} KV heads, head_dim {}, {}-byte dtype), prefill TP {} -> decode TP {} \
         (separate processes, loopback TCP), page_size {}, {} tokens in chunks of {}",
        env!("CARGO_PKG_VERSION"),
        m.name,
        m.layers,
        m.kv_heads,
        m.head_dim,
        m.dtype_bytes,
        s.prefill_tp,
        s.decode_tp,
        s.page_size,
        s.tokens,
        s.chunk_tokens
    );
    let prefill = Prefill::connect(s, &child.addrs)?;
    let bytes = s.room_bytes()?;
    let gbps = |secs: f64| bytes as f64 / secs / 1e9;
    let mut ok = true;
    let mut staged_secs = 0.0;
    for (room, staged) in [(STAGED_ROOM, true), (SLICE_ROOM, false)] {
        if !staged && !a.slice {
            break;
        }
        child.command(&format!("room {room}"))?;
        let start = Instant::now();
        let writes = prefill.send_room(s, room, staged, None)?;
        child.command(&format!("wait {room}"))?;
        let secs = start.elapsed().as_secs_f64();
        let (bad, first) = child.verify(room)?;
        child.command(&format!("release {room}"))?;
        let label = if staged { "staged path" } else { "slice path " };
        let rate = if staged { String::new() } else { format!(", {:.0} writes/s", writes as f64 / secs) };
        println!("{label} : {bytes} bytes in {writes} writes, {secs:.3} s, {:.2} GB/s{rate}", gbps(secs));
        if bad == 0 {
            println!("              decode pool check: all bytes match the reference reshard");
        } else {
            println!("              decode pool check: MISMATCH, {bad} bytes differ ({first})");
            ok = false;
        }
        if staged {
            staged_secs = secs;
        } else {
            println!("staged / slice throughput: {:.1}x", secs / staged_secs);
        }
    }
    drop(prefill);
    child.quit()?;
    Ok(ok)
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    if args.role_decode {
        if let Err(e) = serve_decode(&args.setup) {
            eprintln!("kvstage-demo (decode): {}", e.chain());
            std::process::exit(1);
        }
        return;
    }
    match run(&args) {
        Ok(true) => println!("\nresult: OK (decode KV pools byte-identical to the reference reshard)"),
        Ok(false) => {
            println!("\nresult: FAILED (decode KV pools differ from the reference)");
            std::process::exit(1);
        }
        Err(e) => {
            let code = if e.code() == Status::KVSTAGE_OK { Status::KVSTAGE_E_INTERNAL } else { e.code() };
            eprintln!("kvstage-demo: {} ({})", e.chain(), code.name());
            std::process::exit(1);
        }
    }
}
