//! Asynchronous operations: a result slot, a cancel flag and a way to wake whoever waits for them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::layers::LayerGate;
pub use super::wake::Waker;
use super::notify::{Completion, Completions};
use super::stats::TransferTimings;
use super::Deadline;
use crate::error::{Error, Result, Status};

/// Where a running transfer is (`kvstage_op_describe`): set by the transfer as it goes.
#[derive(Clone, Debug)]
pub struct Progress {
    /// The session, room and chunk (once the transfer started), and the request's trace id.
    pub session: String,
    pub trace: String,
    pub room: u64,
    pub chunk: u32,
    pub path: &'static str,
    /// `queued` (asynchronous) or `starting` (synchronous), `waiting_for_ready_point`,
    /// `waiting_for_allocation`, `waiting_for_watermark`,
    /// `waiting_for_staging_buffer`, `gathering`, `writing`, `waiting_for_layers`,
    /// `waiting_for_acknowledgement`, then `done` or `failed`.
    pub phase: &'static str,
    /// What the phase waits on, in words (the grant and the receiver's watermark, the receiver's
    /// address, the unmarked layers).
    pub waits_on: String,
    pub since: Instant,
    pub deadline: Option<Instant>,
}

pub struct Op {
    /// The terminal result (once finished) and the transfer's phase timings.
    result: Mutex<(Option<Result<Status>>, TransferTimings)>,
    progress: Mutex<Option<Progress>>,
    done: Condvar,
    canceled: AtomicBool,
    waker: Arc<dyn Waker>,
    /// Signalled with `tag` when the operation finishes (asynchronous operations).
    notify: Option<(Arc<Completions>, u64)>,
    /// Layer-wise transfers: where the caller marks layers ready.
    layers: Option<Arc<LayerGate>>,
    /// What a wait of "the engine default" means for it (its engine's default timeout).
    default_wait: Option<Duration>,
}

impl Op {
    pub fn new(waker: Arc<dyn Waker>) -> Arc<Op> {
        Op::with(waker, None, None, None)
    }

    /// An operation whose end is signalled on `completions` with the caller's `tag`; `layers`:
    /// a layer-wise transfer's gate; `default_wait`: the engine's default timeout.
    pub fn notifying(waker: Arc<dyn Waker>, completions: Arc<Completions>, tag: u64, layers: Option<Arc<LayerGate>>, default_wait: Option<Duration>) -> Arc<Op> {
        Op::with(waker, Some((completions, tag)), layers, default_wait)
    }

    fn with(waker: Arc<dyn Waker>, notify: Option<(Arc<Completions>, u64)>, layers: Option<Arc<LayerGate>>, default_wait: Option<Duration>) -> Arc<Op> {
        Arc::new(Op {
            result: Mutex::new((None, TransferTimings::default())),
            progress: Mutex::new(None),
            done: Condvar::new(),
            canceled: AtomicBool::new(false),
            waker,
            notify,
            layers,
            default_wait,
        })
    }

    /// The engine's default timeout, for a wait that asks for it.
    pub fn default_timeout(&self) -> Option<Duration> {
        self.default_wait
    }

    /// The gate of a layer-wise transfer (`None` for any other operation).
    pub fn layers(&self) -> Option<&Arc<LayerGate>> {
        self.layers.as_ref()
    }

    /// The transfer of (`session`, `room`, `chunk`; request `trace`) by `path` starts (or is
    /// queued) in `phase`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(&self, session: &str, trace: String, room: u64, chunk: u32, path: &'static str, phase: &'static str, deadline: Option<Instant>) {
        let since = Instant::now();
        *self.progress.lock() = Some(Progress { session: session.to_owned(), trace, room, chunk, path, phase, waits_on: String::new(), since, deadline });
    }

    /// The transfer enters `phase`, waiting on what `waits_on` says (empty: its own work).
    pub fn enter(&self, phase: &'static str, waits_on: impl FnOnce() -> String) {
        if let Some(p) = self.progress.lock().as_mut().filter(|p| p.phase != phase) {
            (p.phase, p.waits_on, p.since) = (phase, waits_on(), Instant::now());
        }
    }

    /// Where the transfer is, once it started, with its result read at the same moment (`None`
    /// while it runs); its phase is `done` or `failed` once it ended.
    pub fn progress(&self) -> Option<(Progress, Option<Result<Status>>)> {
        let mut p = self.progress.lock().clone()?;
        let result = self.result.lock().0.as_ref().map(clone_result);
        if let Some(r) = &result {
            p.phase = if r.is_ok() { "done" } else { "failed" };
            p.waits_on.clear();
        }
        Some((p, result))
    }

    pub fn is_canceled(&self) -> bool {
        self.canceled.load(Ordering::SeqCst)
    }

    pub fn cancel(&self) {
        self.canceled.store(true, Ordering::SeqCst);
        self.waker.wake();
    }

    pub fn finish(&self, result: Result<Status>) {
        self.finish_timed(result, TransferTimings::default());
    }

    /// Finishes with the transfer's phase timings (kept for [`timings`](Self::timings) and
    /// carried by the completion).
    pub fn finish_timed(&self, result: Result<Status>, timings: TransferTimings) {
        let status = match &result {
            Ok(s) => *s,
            Err(e) => e.code(),
        };
        // The callback first, then the result with its count on the eventfd (under the lock that
        // publishes it): whoever sees the end (poll, wait, the eventfd) finds the callback done
        // and the end counted. During its own callback the operation still polls PENDING.
        if let Some((completions, tag)) = &self.notify {
            let trace = self.progress.lock().as_ref().map(|p| p.trace.clone()).unwrap_or_default();
            completions.call(&Completion::Op { tag: *tag, status, timings, trace: trace.into() });
        }
        let mut slot = self.result.lock();
        *slot = (Some(result), timings);
        if let Some((completions, _)) = &self.notify {
            completions.count(1);
        }
        drop(slot);
        self.done.notify_all();
    }

    /// The phase timings once the operation finished; `None` while it runs.
    pub fn timings(&self) -> Option<TransferTimings> {
        let slot = self.result.lock();
        slot.0.is_some().then_some(slot.1)
    }

    /// `PENDING` while running, otherwise the terminal result (repeatable).
    pub fn poll(&self) -> Result<Status> {
        match &self.result.lock().0 {
            None => Ok(Status::KVSTAGE_PENDING),
            Some(r) => clone_result(r),
        }
    }

    /// Waits up to `timeout` (`None` = forever); `PENDING` when it is still running then.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Status> {
        let deadline = Deadline::after(timeout);
        let mut slot = self.result.lock();
        while slot.0.is_none() {
            if !deadline.wait(&self.done, &mut slot) {
                return Ok(Status::KVSTAGE_PENDING);
            }
        }
        clone_result(slot.0.as_ref().expect("checked above"))
    }
}

/// Results are read repeatably by poll/wait; errors are re-created with the same code and chain.
fn clone_result(r: &Result<Status>) -> Result<Status> {
    match r {
        Ok(s) => Ok(*s),
        Err(e) => {
            let mut copy = Error::new(e.code(), e.message()).with_class(e.class());
            if let Some(s) = e.session() {
                copy = copy.with_session(s);
            }
            let causes = e.causes();
            if let Some(chain) = crate::error::CauseChain::from_list(causes) {
                copy = copy.with_source(chain);
            }
            Err(copy)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoWaker;
    impl Waker for NoWaker {
        fn wake(&self) {}
    }

    /// The end is on the eventfd by the time a waiter wakes: a caller that waits, then drains,
    /// never misses it (finished on another thread, many times, to give a wrong order its chance).
    #[test]
    fn a_returned_wait_finds_the_end_already_signalled_and_its_callback_done() {
        let completions = Arc::new(Completions::new().unwrap());
        let called = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = called.clone();
        completions.set_callback(Some(Arc::new(move |_c: &Completion| {
            seen.fetch_add(1, Ordering::SeqCst);
        })));
        for tag in 0..2000 {
            let op = Op::notifying(Arc::new(NoWaker), completions.clone(), tag, None, None);
            let finisher = {
                let op = op.clone();
                std::thread::spawn(move || op.finish(Ok(Status::KVSTAGE_OK)))
            };
            assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap(), Status::KVSTAGE_OK);
            assert_eq!(completions.drain(), 1, "operation {tag}: its wait returned before its end was signalled");
            assert_eq!(called.load(Ordering::SeqCst), tag + 1, "operation {tag}: its wait returned before its callback ran");
            finisher.join().unwrap();
        }
    }
}
