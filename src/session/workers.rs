//! The engine's transfer workers: a fixed set of threads that run asynchronous transfers, so the
//! number of library threads does not grow with the operations in flight.
//!
//! Jobs are queued per session and taken round-robin, and one session may run at most
//! `per_session` jobs at once: a decode peer that stops reading ties up at most that many workers
//! (until its transfers' deadlines), never all of them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result, Status};

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    /// Pending jobs by session key.
    pending: HashMap<u64, VecDeque<Job>>,
    /// Sessions with pending jobs, in the order they are served.
    order: VecDeque<u64>,
    running: HashMap<u64, usize>,
    closed: bool,
}

impl Queue {
    /// The next job a worker may run: the first session in turn that is below its limit.
    fn next(&mut self, per_session: usize) -> Option<(u64, Job)> {
        let pos = self.order.iter().position(|k| self.running.get(k).copied().unwrap_or(0) < per_session)?;
        let key = self.order.remove(pos).expect("position is in range");
        let jobs = self.pending.get_mut(&key).expect("ordered sessions have jobs");
        let job = jobs.pop_front().expect("ordered sessions have jobs");
        if jobs.is_empty() {
            self.pending.remove(&key);
        } else {
            self.order.push_back(key);
        }
        *self.running.entry(key).or_default() += 1;
        Some((key, job))
    }
}

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    per_session: usize,
}

pub struct Workers {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Workers {
    /// Starts `threads` workers; a session runs at most `per_session` jobs at once.
    pub fn new(threads: usize, per_session: usize) -> Result<Workers> {
        let shared = Arc::new(Shared { queue: Mutex::new(Queue::default()), cv: Condvar::new(), per_session: per_session.max(1) });
        let workers = Workers { shared, threads: Mutex::new(Vec::new()) };
        for i in 0..threads.max(1) {
            let shared = workers.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("kvstage-xfer-{i}"))
                .spawn(move || run(&shared))
                .map_err(|e| Error::internal("cannot start a transfer worker").with_source(e));
            match h {
                Ok(h) => workers.threads.lock().push(h),
                Err(e) => {
                    workers.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(workers)
    }

    /// Queues `job` for session `key`. Fails once the workers were shut down.
    pub fn submit(&self, key: u64, job: impl FnOnce() + Send + 'static) -> Result<()> {
        let mut q = self.shared.queue.lock();
        if q.closed {
            return Err(Error::new(Status::KVSTAGE_E_CANCELED, "the engine was freed"));
        }
        if !q.pending.contains_key(&key) {
            q.order.push_back(key);
        }
        q.pending.entry(key).or_default().push_back(Box::new(job));
        drop(q);
        self.shared.cv.notify_one();
        Ok(())
    }

    /// Jobs queued but not started.
    pub fn queued(&self) -> usize {
        self.shared.queue.lock().pending.values().map(VecDeque::len).sum()
    }

    /// Runs the jobs still queued (they fail fast: their sessions are closed first), then joins
    /// every worker. Idempotent.
    pub fn shutdown(&self) {
        self.shared.queue.lock().closed = true;
        self.shared.cv.notify_all();
        for h in std::mem::take(&mut *self.threads.lock()) {
            let _ = h.join();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run(shared: &Shared) {
    let mut q = shared.queue.lock();
    loop {
        if let Some((key, job)) = q.next(shared.per_session) {
            drop(q);
            // A job completes its operation itself, also when it panics (see its closure); the
            // worker survives either way.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            q = shared.queue.lock();
            if let Some(n) = q.running.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    q.running.remove(&key);
                }
            }
            // A slot of this session opened: a worker may now take its next job.
            shared.cv.notify_one();
            continue;
        }
        if q.closed && q.pending.is_empty() {
            return;
        }
        shared.cv.wait(&mut q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn a_blocked_session_holds_at_most_its_share_of_workers() {
        let w = Workers::new(4, 2).unwrap();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let blocked_running = Arc::new(AtomicUsize::new(0));
        // Session 1's jobs block until the gate opens.
        for _ in 0..10 {
            let (gate, running) = (gate.clone(), blocked_running.clone());
            w.submit(1, move || {
                running.fetch_add(1, Ordering::SeqCst);
                let mut open = gate.0.lock();
                while !*open {
                    gate.1.wait(&mut open);
                }
            })
            .unwrap();
        }
        // Session 2's jobs still run, on the workers session 1 may not take.
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..50 {
            let done = done.clone();
            w.submit(2, move || {
                done.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        let t = Instant::now();
        while done.load(Ordering::SeqCst) < 50 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(done.load(Ordering::SeqCst), 50);
        assert_eq!(blocked_running.load(Ordering::SeqCst), 2, "a session ran more jobs than its share");
        *gate.0.lock() = true;
        gate.1.notify_all();
        w.shutdown();
        assert_eq!(blocked_running.load(Ordering::SeqCst), 10, "queued jobs run before shutdown returns");
        assert!(w.submit(3, || {}).is_err());
    }

    #[test]
    fn a_panicking_job_does_not_kill_its_worker() {
        let w = Workers::new(1, 1).unwrap();
        w.submit(1, || panic!("job panics")).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        w.submit(1, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        w.shutdown();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
