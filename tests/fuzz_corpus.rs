//! Replays the fuzz targets' properties (`fuzz/checks.rs`, the same code the cargo-fuzz targets
//! run) over the committed seed corpus `fuzz/corpus/<target>/seed-*` and over any committed crash
//! reproducers `fuzz/regressions/<target>/*`, so every `cargo test` checks them without cargo-fuzz
//! or a nightly toolchain (see fuzz/README.md).
//!
//! Every seed must still decode: when the wire format changes, regenerate the seeds with
//! `cargo run --manifest-path fuzz/Cargo.toml --bin gen_seeds` and commit them.

use std::path::{Path, PathBuf};

#[path = "../fuzz/checks.rs"]
mod checks;

fn files(dir: &Path, seeds_only: bool) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter(|p| !seeds_only || p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("seed-")))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Seeds of `target` (at least `min` of them), each accepted by `accepted`; then the
/// reproducers, which only must not panic.
fn replay(target: &str, min: usize, accepted: impl Fn(&[u8]) -> bool) {
    let seeds = files(&fuzz_dir().join("corpus").join(target), true);
    assert!(seeds.len() >= min, "fuzz/corpus/{target} holds {} seeds, expected at least {min}", seeds.len());
    for (path, bytes) in &seeds {
        assert!(
            accepted(bytes),
            "{} no longer decodes: the wire format changed; regenerate the seeds \
             (cargo run --manifest-path fuzz/Cargo.toml --bin gen_seeds)",
            path.display()
        );
    }
    for (path, bytes) in files(&fuzz_dir().join("regressions").join(target), false) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| accepted(&bytes)));
        assert!(result.is_ok(), "reproducer {} fails again", path.display());
    }
}

#[test]
fn frame_seeds_decode_and_round_trip() {
    replay("frame", 20, |bytes| checks::frame(bytes) > 0);
}

#[test]
fn handshake_seeds_decode_and_pass_both_sides_checks() {
    replay("handshake", 10, checks::handshake);
}

#[test]
fn fingerprint_seeds_decode_and_round_trip() {
    replay("fingerprint", 10, checks::fingerprint);
}
