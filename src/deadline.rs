//! Deadlines: every operation has one (infinite only when asked for explicitly).

use std::time::{Duration, Instant};

use parking_lot::{Condvar, MutexGuard};

use crate::error::{Error, Status};

/// When an operation must have ended; `None` = never (only when asked for explicitly).
#[derive(Clone, Copy, Debug)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    pub fn after(timeout: Option<Duration>) -> Deadline {
        Deadline(timeout.map(|t| Instant::now() + t))
    }

    /// When it passes (`None`: never).
    pub fn instant(&self) -> Option<Instant> {
        self.0
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

    /// Time left (`None` = no deadline); an expired deadline is a `TIMEOUT` error.
    pub fn remaining(&self, what: &str) -> crate::Result<Option<Duration>> {
        match self.0 {
            None => Ok(None),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(Some(left)),
                _ => Err(self.timeout_error(what)),
            },
        }
    }

    pub fn timeout_error(&self, what: &str) -> Error {
        Error::new(Status::KVSTAGE_E_TIMEOUT, format!("deadline passed while {what}"))
    }
}
