//! The geometry fingerprint of a peer's hello (`Fingerprint::decode`).
//! The properties are in `fuzz/checks.rs`, shared with `tests/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| {
    checks::fingerprint(data);
});
