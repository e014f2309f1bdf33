//! The main job: a real staged transfer on one machine. This process plays every prefill rank;
//! a child process plays every decode rank. KV moves by transport auto by default: the same-host
//! path in direct mode, where each chunk is copied from the prefill pages straight into the decode
//! pages (the decode pools in shared memory; `--no-direct`: the gathers write into the decode
//! staging rings through shared mappings, then the decode side scatters), else loopback TCP. It is
//! verified byte-for-byte in the child, and
//! the slice path moves the same request for comparison. It prints which transport the sessions
//! ended up on and, when auto fell back, why.

use std::time::Instant;

use clap::Parser;
use kvstage::engine::TransportKind;
use kvstage::session::stats::LinkKind;
use kvstage::{Error, Status};
use kvstage_testkit::cluster::{serve_decode, transport_name, DecodeChild, Prefill, Setup};
use kvstage_tools::{parse_with_defaults, spinner, Links, SetupArgs};

const DEFAULT_MODEL: &str = "llama3-8b";

/// A staged KV transfer between two processes on this machine (prefill TP -> decode TP; transport
/// auto by default: the same-host path when available, else loopback TCP), the decode pools
/// checked byte for byte against a reference reshard, and the slice path for comparison.
#[derive(Parser)]
#[command(name = "kvstage-demo", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    setup: SetupArgs,
    /// Skip the slice path.
    #[arg(long)]
    no_slice: bool,
    /// Internal: be the decode process.
    #[arg(long, hide = true)]
    role_decode: bool,
}

const STAGED_ROOM: u64 = 1;
const SLICE_ROOM: u64 = 2;

/// Which transport the sessions ended up on, and why (the engines' last downgrade when auto fell
/// back).
fn transport_line(s: &Setup, links: &Links) -> String {
    let asked = match s.transport {
        TransportKind::Auto => "transport auto chose it".to_owned(),
        other => format!("--transport {}", transport_name(other)),
    };
    if links.all(LinkKind::Shm) && links.path() == "shm-direct" {
        return format!(
            "{}: same host, direct mode: each chunk copied from the prefill pages straight into the decode pages \
             (the decode pools in shared memory, mapped here), control frames on loopback TCP ({asked})",
            links.summary()
        );
    }
    if links.all(LinkKind::Shm) {
        return format!(
            "{}: same host, the gathers write straight into the decode staging rings through shared mappings, \
             control frames on loopback TCP ({asked})",
            links.summary()
        );
    }
    let mut line = format!("{}: ", links.summary());
    if links.all(LinkKind::Rdma) {
        line += &format!("RDMA writes into the decode staging rings ({asked})");
    } else if s.transport == TransportKind::Auto {
        let why = links.shm_downgrade.clone().unwrap_or_else(|| "the decode engines did not appear to be on this host".to_owned());
        let which = if links.sessions.iter().any(|(_, l)| *l == LinkKind::Shm) { " for every session" } else { "" };
        line += &format!("transport auto did not take the same-host path{which}: {why}");
    } else {
        line += &format!("loopback TCP ({asked})");
    }
    line
}

fn run(s: &Setup, slice: bool) -> Result<bool, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::internal("cannot find the demo executable").with_source(e))?;
    let mut args = s.flags();
    args.push("--role-decode".into());
    let mut child = DecodeChild::spawn(&exe, &args, s.decode_tp)?;
    let m = &s.model;
    println!(
        "kvstage {} demo: {} ({} layers, {} KV heads, head_dim {}, {}-byte dtype), prefill TP {} -> decode TP {} \
         (separate processes, transport {}), page_size {}, {} tokens in chunks of {}",
        kvstage_tools::library_version(),
        m.name,
        m.layers,
        m.kv_heads,
        m.head_dim,
        m.dtype_bytes,
        s.prefill_tp,
        s.decode_tp,
        transport_name(s.transport),
        s.page_size,
        s.tokens,
        s.chunk_tokens
    );
    let prefill = Prefill::connect(s, &child.addrs)?;
    println!("sessions    : {}", transport_line(s, &Links::of(&prefill)));
    let bytes = s.room_bytes()?;
    let gbps = |secs: f64| bytes as f64 / secs / 1e9;
    let mut ok = true;
    let mut staged_secs = 0.0;
    for (room, staged) in [(STAGED_ROOM, true), (SLICE_ROOM, false)] {
        if !staged && !slice {
            break;
        }
        let label = if staged { "staged path" } else { "slice path " };
        let bar = spinner(format!("{}: {bytes} bytes, then the decode pool check", label.trim_end()));
        let keys = child.open_room(room, None)?;
        let start = Instant::now();
        let writes = prefill.send_room(s, &keys, staged, None)?;
        child.command(&format!("wait {room}"))?;
        let secs = start.elapsed().as_secs_f64();
        let (bad, first) = child.verify(room)?;
        child.command(&format!("release {room}"))?;
        bar.finish_and_clear();
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
    // Transport auto: the same-host path when both processes can use it, and the demo says which.
    let cli: Cli = parse_with_defaults(&[("model", DEFAULT_MODEL), ("tokens", "4096"), ("transport", "auto")]);
    let setup = cli.setup.setup(DEFAULT_MODEL).unwrap_or_else(|e| kvstage_tools::usage_error::<Cli>(e));
    if cli.role_decode {
        if let Err(e) = serve_decode(&setup) {
            eprintln!("kvstage-demo (decode): {}", e.chain());
            std::process::exit(1);
        }
        return;
    }
    match run(&setup, !cli.no_slice) {
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn command_line() {
        super::Cli::command().debug_assert();
    }
}
