//! Per-peer state machines: the sender side (prefill: allocate, gather, write) and the receiver
//! side (decode: grant, receive, count writers, scatter, free), plus deadlines and operations.

pub mod op;
pub mod receiver;
pub mod sender;

use std::time::{Duration, Instant};

use parking_lot::{Condvar, MutexGuard};

use crate::error::{Error, Status};
use crate::geometry::{self, PoolShape};

/// When an operation must have ended; `None` = never (only when asked for explicitly).
#[derive(Clone, Copy, Debug)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    pub fn after(timeout: Option<Duration>) -> Deadline {
        Deadline(timeout.map(|t| Instant::now() + t))
    }

    pub fn expired(&self) -> bool {
        self.0.is_some_and(|d| Instant::now() >= d)
    }

    /// Waits on `cv` until notified or the deadline; returns false when the deadline passed.
    pub fn wait<T>(&self, cv: &Condvar, guard: &mut MutexGuard<'_, T>) -> bool {
        match self.0 {
            Some(d) => !cv.wait_until(guard, d).timed_out() || Instant::now() < d,
            None => {
                cv.wait(guard);
                true
            }
        }
    }

    pub fn timeout_error(&self, what: &str) -> Error {
        Error::new(Status::KVSTAGE_E_TIMEOUT, format!("deadline passed while {what}"))
    }
}

/// The writer index of prefill rank `src` in decode rank `dst`'s allocations; an error when that
/// prefill rank does not feed that decode rank at all.
pub fn writer_of(src: &PoolShape, dst: &PoolShape) -> crate::Result<u32> {
    let layout = geometry::staging_layout(src, dst, src.page_size)?;
    layout.writer_for(src)?.ok_or_else(|| {
        Error::new(
            Status::KVSTAGE_E_GEOMETRY_MISMATCH,
            format!(
                "prefill rank (tp {}/{}, pp {}/{}) does not feed decode rank (tp {}/{}, pp {}/{})",
                src.tp_rank, src.tp_size, src.pp_rank, src.pp_size, dst.tp_rank, dst.tp_size, dst.pp_rank, dst.pp_size
            ),
        )
    })
}
