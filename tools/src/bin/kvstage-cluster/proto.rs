//! The line protocol between the router and the rank processes (their stdin and stdout: the
//! control plane never crosses the emulated network, the data plane always does).
//!
//! Router to decode rank: `open REQ PAGES BASE`, `cancel REQ`, `close-all`, `leaks`, `quit`.
//! Decode rank to router: `ready ADDR`, `opened REQ KEY`, `refused REQ WHY`,
//! `done REQ STATUS BAD_BYTES [WHY]` (STATUS a status name, `RELEASED` after `cancel`,
//! `SHUTDOWN` after `close-all`), `closed-all MS ADDR`, `leaks JSON`.
//! Router to prefill rank: `send REQ PAGES BASE ADDR/KEY...` (one per decode rank of the chosen
//! node, in rank order), `leaks`, `quit`. Prefill rank to router: `ready`,
//! `sent REQ STATUS MS [WHY]` (STATUS `HUNG` when an operation outlived its deadline), `leaks JSON`.

use std::io::Write;
use std::sync::Mutex;

/// A rank's stdout, one whole line at a time from any thread.
#[derive(Default)]
pub struct Out(Mutex<()>);

impl Out {
    pub fn line(&self, line: &str) {
        let _held = self.0.lock().unwrap();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// `text` on one line (error chains may hold newlines).
pub fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}
