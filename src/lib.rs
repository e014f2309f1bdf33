//! kvstage: staged KV-cache transfer for prefill/decode disaggregated LLM serving.
//!
//! Layers (docs/ARCHITECTURE.md, "Layers of the code"): `error` (and `deadline`, `dynlib`, and
//! `panics`, the library threads' panic boundary) → `geometry` → `copy` →
//! `ring`/`protocol`/`transport` → `session` → `engine`, and `ffi`, the only `extern "C"` code.
//! Every module but `error` and `ffi` is hidden from cbindgen (`cbindgen:ignore`): their C view
//! lives in `ffi`.

/// cbindgen:ignore
pub mod copy;
/// cbindgen:ignore
pub mod deadline;
/// cbindgen:ignore
pub mod dynlib;
/// cbindgen:ignore
pub mod engine;
pub mod error;
pub mod ffi;
/// cbindgen:ignore
pub mod panics;
/// cbindgen:ignore
pub mod geometry;
/// cbindgen:ignore
pub mod protocol;
/// cbindgen:ignore
pub mod ring;
/// cbindgen:ignore
pub mod session;
/// cbindgen:ignore
pub mod transport;

pub use error::{Error, ErrorClass, Result, Status};

/// `MAJOR << 16 | MINOR << 8 | PATCH`, from Cargo.toml.
pub fn version_number() -> u32 {
    let part = |s: &str| s.parse::<u32>().unwrap_or(0);
    (part(env!("CARGO_PKG_VERSION_MAJOR")) << 16)
        | (part(env!("CARGO_PKG_VERSION_MINOR")) << 8)
        | part(env!("CARGO_PKG_VERSION_PATCH"))
}
