//! End-to-end staged and slice transfers between two real processes: the demo binary plays every
//! prefill rank and spawns a child playing every decode rank, which compares its KV pools
//! byte-for-byte with a reference reshard computed from (layer, token, global head). The demo's
//! default is transport auto, which takes the same-host path here; `--transport tcp` forces
//! loopback TCP.

use std::process::Command;

/// Runs the demo with `args`; returns its standard output.
fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvstage-demo"))
        .args(args)
        .output()
        .expect("the demo binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("result: OK"),
        "kvstage-demo {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert_eq!(stdout.matches("all bytes match the reference reshard").count(), if args.contains(&"--no-slice") { 1 } else { 2 });
    stdout.into_owned()
}

/// A small MHA model: 3 layers, 8 KV heads of 16 bf16 elements (256 B token slots).
const SMALL: [&str; 8] = ["--layers", "3", "--kv-heads", "8", "--head-dim", "16", "--dtype-bytes", "2"];

fn small(extra: &[&str]) -> String {
    let mut args: Vec<&str> = SMALL.to_vec();
    args.extend_from_slice(extra);
    run(&args)
}

/// The line that says which transport the sessions ended up on.
fn sessions_line(stdout: &str) -> &str {
    stdout.lines().find(|l| l.starts_with("sessions    : ")).unwrap_or_else(|| panic!("no sessions line in:\n{stdout}"))
}

#[test]
fn the_default_takes_the_same_host_path_and_says_so() {
    let out = small(&["--prefill-tp", "4", "--decode-tp", "2", "--page-size", "16", "--tokens", "256", "--chunk-tokens", "128"]);
    let line = sessions_line(&out);
    assert!(line.contains("shm (4 sessions)") && line.contains("transport auto chose it"), "{line}");
    let out = small(&["--prefill-tp", "2", "--decode-tp", "1", "--page-size", "16", "--tokens", "64", "--transport", "shm", "--no-slice"]);
    assert!(sessions_line(&out).contains("shm (2 sessions)") && out.contains("--transport shm"), "{out}");
}

#[test]
fn transport_tcp_on_request() {
    let out = small(&["--prefill-tp", "2", "--decode-tp", "2", "--page-size", "16", "--tokens", "256", "--chunk-tokens", "64", "--transport", "tcp"]);
    let line = sessions_line(&out);
    assert!(line.contains("tcp (2 sessions): loopback TCP (--transport tcp)"), "{line}");
}

#[test]
fn prefill_tp4_to_decode_tp2_page16_several_chunks() {
    small(&["--prefill-tp", "4", "--decode-tp", "2", "--page-size", "16", "--tokens", "512", "--chunk-tokens", "128"]);
}

#[test]
fn prefill_tp2_to_decode_tp4_page1() {
    small(&["--prefill-tp", "2", "--decode-tp", "4", "--page-size", "1", "--tokens", "96", "--chunk-tokens", "32"]);
}

#[test]
fn replication_prefill_tp1_to_decode_tp4_with_two_heads() {
    run(&[
        "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype-bytes", "4", "--prefill-tp", "1", "--decode-tp", "4",
        "--page-size", "4", "--tokens", "64", "--chunk-tokens", "16",
    ]);
}

#[test]
fn replication_on_the_prefill_side_tp8_to_tp2_with_two_heads() {
    run(&[
        "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype-bytes", "1", "--prefill-tp", "8", "--decode-tp", "2",
        "--page-size", "4", "--tokens", "64", "--chunk-tokens", "32",
    ]);
}

#[test]
fn equal_tp_with_a_short_last_chunk() {
    small(&["--prefill-tp", "2", "--decode-tp", "2", "--page-size", "16", "--tokens", "160", "--chunk-tokens", "64"]);
}

#[test]
fn mla_latent_replicated_prefill_tp2_to_decode_tp4() {
    run(&[
        "--model", "deepseek-v3", "--layers", "3", "--prefill-tp", "2", "--decode-tp", "4", "--page-size", "16", "--tokens",
        "128", "--chunk-tokens", "64",
    ]);
}
