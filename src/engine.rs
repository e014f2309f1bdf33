//! The top-level object: options, registrations, worker threads, stats.

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    Auto,
    Tcp,
    Rdma,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub transport: TransportKind,
    pub listen_address: String,
    pub worker_threads: u32,
    /// `None` = infinite (only when asked for explicitly).
    pub default_deadline: Option<Duration>,
}

pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            transport: TransportKind::Auto,
            listen_address: "127.0.0.1:0".to_owned(),
            worker_threads: 2,
            default_deadline: Some(DEFAULT_DEADLINE),
        }
    }
}

impl EngineOptions {
    pub fn default_deadline_ms(&self) -> u64 {
        self.default_deadline.map_or(u64::MAX, |d| d.as_millis() as u64)
    }

    pub fn set_default_deadline_ms(&mut self, ms: u64) {
        self.default_deadline = if ms == u64::MAX { None } else { Some(Duration::from_millis(ms)) };
    }

    /// Checks every field; the error names the field and the bad value.
    pub fn validate(&self) -> Result<SocketAddr> {
        if self.worker_threads == 0 || self.worker_threads > 256 {
            return Err(Error::invalid_arg(
                "options->worker_threads",
                format!("{} is outside 1..=256", self.worker_threads),
            ));
        }
        if self.default_deadline == Some(Duration::ZERO) {
            return Err(Error::invalid_arg(
                "options->default_deadline_ms",
                "0 would fail every operation at once (use KVSTAGE_DEADLINE_INFINITE for no deadline)",
            ));
        }
        self.listen_address.parse::<SocketAddr>().map_err(|e| {
            Error::invalid_arg(
                "options->listen_address",
                format!("\"{}\" is not HOST:PORT with a numeric IP ({e})", self.listen_address),
            )
        })
    }
}

/// What this host can use, detected at run time (never by linking).
#[derive(Clone, Copy, Debug, Default)]
pub struct Capabilities {
    pub rdma: bool,
    pub cuda: bool,
}

impl Capabilities {
    pub fn detect() -> Capabilities {
        Capabilities { rdma: crate::dynlib::rdma_device_count() > 0, cuda: crate::dynlib::cuda_device_count() > 0 }
    }
}

pub struct Engine {
    options: EngineOptions,
    listen: SocketAddr,
}

impl Engine {
    pub fn new(options: EngineOptions) -> Result<Engine> {
        let listen = options.validate()?;
        Ok(Engine { options, listen })
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    pub fn configured_listen_address(&self) -> SocketAddr {
        self.listen
    }
}
