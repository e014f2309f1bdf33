//! Stalls reported, not only timed out: a transfer that waits without progress (for its grant,
//! the receiver's watermark, the acknowledgement, the caller's layers) for longer than the stall
//! threshold says so once per wait, in one WARN line naming the request, the chunk and what it
//! waits on. A deadline alone says only that it ended; operators facing a stuck request need the
//! culprit while it is stuck.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, MutexGuard};

use super::TransferDesc;
use crate::session::Deadline;

/// When a wait without progress is reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StallWarn {
    /// After a quarter of the operation's deadline (10 s for an operation without one).
    #[default]
    QuarterOfDeadline,
    After(Duration),
    Never,
}

/// For operations without a deadline.
const NO_DEADLINE_STALL: Duration = Duration::from_secs(10);

impl StallWarn {
    fn threshold(self, timeout: Option<Duration>) -> Option<Duration> {
        match self {
            StallWarn::QuarterOfDeadline => Some(timeout.map_or(NO_DEADLINE_STALL, |t| t / 4)),
            StallWarn::After(d) => Some(d),
            StallWarn::Never => None,
        }
    }
}

/// One transfer's stall watch: each wait starts a new period (a phase reached is progress).
pub(crate) struct Stall {
    session: String,
    request: String,
    after: Option<Duration>,
    since: Instant,
    warned: bool,
}

impl Stall {
    pub(crate) fn new(session: &str, desc: &TransferDesc, warn: StallWarn) -> Stall {
        Stall {
            session: session.to_owned(),
            request: format!("[{}] room {} chunk {}", desc.trace_id(), desc.room, desc.chunk),
            after: warn.threshold(desc.timeout),
            since: Instant::now(),
            warned: false,
        }
    }

    /// A new wait begins (the previous one ended: progress).
    pub(crate) fn progress(&mut self) {
        self.since = Instant::now();
        self.warned = false;
    }

    /// Waits on `cv` until notified, the deadline, or the moment this wait becomes a stall; then
    /// reports the stall once (`what` says what it waits on, computed under the lock; the line is
    /// logged with the lock released).
    pub(crate) fn wait<T>(&mut self, deadline: &Deadline, cv: &Condvar, guard: &mut MutexGuard<'_, T>, what: impl FnOnce(&T) -> String) {
        let stall_at = self.after.filter(|_| !self.warned).map(|a| self.since + a);
        let wake = match (stall_at, deadline.instant()) {
            (Some(s), Some(d)) => Some(s.min(d)),
            (s, d) => s.or(d),
        };
        match wake {
            Some(at) => {
                cv.wait_until(guard, at);
            }
            None => cv.wait(guard),
        }
        if stall_at.is_some_and(|s| Instant::now() >= s) {
            self.warned = true;
            let line = format!(
                "{}: no progress for {:.1} s {} (reported once per wait; it ends by its deadline{})",
                self.request,
                self.since.elapsed().as_secs_f64(),
                what(guard),
                deadline.instant().map_or_else(|| ", none set".to_owned(), |d| format!(" in {:.1} s", d.saturating_duration_since(Instant::now()).as_secs_f64())),
            );
            let session = self.session.as_str();
            MutexGuard::unlocked(guard, || log::warn!(session = session; "{line}"));
        }
    }
}
