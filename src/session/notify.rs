//! Completion notifications that fit an engine's event loop: an eventfd that becomes readable
//! whenever an operation finishes or a decode chunk event is queued (for epoll / asyncio), and an
//! optional callback.
//!
//! The callback runs on a library thread (a transfer worker, a receiver connection thread or the
//! scatter thread) with no kvstage lock held, so it may call kvstage functions (poll operations,
//! poll events); it must return quickly, must not free the engine that signals it, and must not
//! wait (room release or wait, operation wait: they may need the very thread running it).
//!
//! Replacing or removing the callback returns only once no call of the old one runs (the caller
//! may then free the old callback's code and data: Python drops its ctypes thunk), unless it is
//! done from inside a completion callback, which never waits (see [`Completions::set_callback`]).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::stats::TransferTimings;
use crate::error::{Error, Result, Status};

/// What completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// An asynchronous operation ended with `status`; `tag` is the caller's, from its descriptor;
    /// `timings` are its phase timings; `trace` the request's trace id.
    Op { tag: u64, status: Status, timings: TransferTimings, trace: Arc<str> },
    /// A decode chunk was scattered or failed.
    Chunk(ChunkEvent),
}

/// What a decode event reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// One chunk landed or failed.
    Chunk,
    /// The whole request: complete, or failed (one per opening).
    Room,
}

/// One completed or failed decode chunk or room, as reported to the decode caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkEvent {
    pub kind: EventKind,
    pub room: u64,
    /// The key of the room's opening the chunk belongs to (a room id reopened for another request
    /// gets another key): tells a late event of an earlier opening apart.
    pub key: u64,
    pub chunk: u32,
    pub status: Status,
    /// The request's trace id (the prefill caller's, once a writer named it; else derived).
    pub trace: Arc<str>,
    /// Staged chunks scattered OK: nanoseconds from the arrival of the chunk's last writer to the
    /// end of its scatter (see [`ReceiveStats`](super::stats::ReceiveStats)); 0 otherwise.
    pub scatter_ns: u64,
}

impl ChunkEvent {
    pub fn chunk(room: u64, key: u64, chunk: u32, status: Status, trace: Arc<str>, scatter_ns: u64) -> ChunkEvent {
        ChunkEvent { kind: EventKind::Chunk, room, key, chunk, status, trace, scatter_ns }
    }

    /// The whole room's event; `chunk` holds its chunk count.
    pub fn room_done(room: u64, key: u64, num_chunks: u32, status: Status, trace: Arc<str>) -> ChunkEvent {
        ChunkEvent { kind: EventKind::Room, room, key, chunk: num_chunks, status, trace, scatter_ns: 0 }
    }
}

pub type Callback = Arc<dyn Fn(&Completion) + Send + Sync>;

/// The callback and the calls of it (and of the ones it replaced) still running.
#[derive(Default)]
struct Slot {
    callback: Option<Callback>,
    /// Bumped by every replacement: a call runs the callback of the generation it started with.
    generation: u64,
    /// Running calls by the generation of the callback they run.
    running: BTreeMap<u64, usize>,
}

thread_local! {
    /// Completion callbacks (of any engine) running on this thread, nested.
    static CALLING: Cell<usize> = const { Cell::new(0) };
}

/// `Err` naming `call` when this thread is inside a completion callback: the call may wait for
/// work of the library thread that runs the callback (a scatter, a connection's read, an
/// operation's completion), which would then never come.
pub fn refuse_in_callback(call: &str) -> crate::Result<()> {
    if CALLING.get() == 0 {
        return Ok(());
    }
    Err(crate::Error::new(
        crate::Status::KVSTAGE_E_UNSUPPORTED,
        format!("{call} was called from inside a completion callback, where it could wait for the thread running the callback: call it from another thread (poll with kvstage_op_poll or kvstage_engine_poll_events there)"),
    ))
}

pub struct Completions {
    fd: OwnedFd,
    slot: Mutex<Slot>,
    /// Signalled whenever a call ends.
    call_ended: Condvar,
}

impl Completions {
    pub fn new() -> Result<Completions> {
        // SAFETY: eventfd with flags only; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::new(Status::KVSTAGE_E_INTERNAL, "cannot create the completion eventfd")
                .with_source(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        Ok(Completions { fd: unsafe { OwnedFd::from_raw_fd(fd) }, slot: Mutex::new(Slot::default()), call_ended: Condvar::new() })
    }

    /// Readable while completions are unread: read 8 bytes to reset it, then poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Replaces the callback and returns once no call of the old one (or of any before it) runs,
    /// so the caller may free what they used. Called from inside a completion callback (of any
    /// engine) it does not wait: two callbacks replacing each other's callbacks, or their own on
    /// two threads, would wait for each other for ever. The old callback may then still be
    /// running on other threads (and the calling one goes on after this returns).
    pub fn set_callback(&self, callback: Option<Callback>) {
        let mut slot = self.slot.lock();
        let old = slot.generation;
        let replaced = std::mem::replace(&mut slot.callback, callback);
        slot.generation += 1;
        let inside_a_callback = CALLING.get() > 0;
        while !inside_a_callback && slot.running.range(..=old).map(|(_, n)| n).sum::<usize>() > 0 {
            self.call_ended.wait(&mut slot);
        }
        drop(slot);
        // The old closure (and the caller's data it holds) is dropped outside the lock.
        drop(replaced);
    }

    /// Counts `n` completions on the descriptor. Called where the completed state becomes
    /// visible (under the lock that publishes it), so that a caller who saw the state and then
    /// drains the descriptor finds them counted.
    pub fn count(&self, n: u64) {
        if n == 0 {
            return;
        }
        // SAFETY: writes 8 bytes from a local to our eventfd; a full counter (EAGAIN) is still
        // readable, which is all a waiter needs.
        unsafe { libc::write(self.fd.as_raw_fd(), &n as *const u64 as *const libc::c_void, 8) };
    }

    /// Runs the callback for `c`, with no lock held. A panicking callback is logged, not
    /// propagated: the completion it reports must still happen.
    pub fn call(&self, c: &Completion) {
        let (callback, generation) = {
            let mut slot = self.slot.lock();
            let Some(cb) = slot.callback.clone() else { return };
            let g = slot.generation;
            *slot.running.entry(g).or_default() += 1;
            (cb, g)
        };
        CALLING.set(CALLING.get() + 1);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(c))).is_err() {
            log::error!("the completion callback panicked on {c:?}");
        }
        CALLING.set(CALLING.get() - 1);
        // The clone goes before the call counts as ended: the replacing thread may free the data.
        drop(callback);
        let mut slot = self.slot.lock();
        if let Some(n) = slot.running.get_mut(&generation) {
            *n -= 1;
            if *n == 0 {
                slot.running.remove(&generation);
            }
        }
        drop(slot);
        self.call_ended.notify_all();
    }

    /// Resets the counter; how many completions were signalled since the last drain.
    pub fn drain(&self) -> u64 {
        let mut n: u64 = 0;
        // SAFETY: reads 8 bytes into a local from our non-blocking eventfd.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), &mut n as *mut u64 as *mut libc::c_void, 8) };
        if r == 8 {
            n
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_fd_becomes_readable_and_the_callback_runs() {
        let c = Completions::new().unwrap();
        let mut pfd = libc::pollfd { fd: c.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "nothing signalled yet");
        let seen = Arc::new(AtomicUsize::new(0));
        let s = seen.clone();
        c.set_callback(Some(Arc::new(move |_c: &Completion| {
            s.fetch_add(1, Ordering::SeqCst);
        })));
        c.count(2);
        c.call(&Completion::Op { tag: 7, status: Status::KVSTAGE_OK, timings: TransferTimings::default(), trace: "7#0000".into() });
        c.call(&Completion::Chunk(ChunkEvent::chunk(1, 1, 0, Status::KVSTAGE_OK, "1#0000".into(), 0)));
        // SAFETY: as above.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert_eq!(c.drain(), 2);
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        assert_eq!(c.drain(), 0);
    }

    fn op() -> Completion {
        Completion::Op { tag: 1, status: Status::KVSTAGE_OK, timings: TransferTimings::default(), trace: "1#0000".into() }
    }

    /// A callback held inside its call: removing it must not return before the call did.
    #[test]
    fn removing_a_callback_waits_for_its_running_calls() {
        use std::sync::atomic::AtomicBool;
        use std::sync::mpsc;
        let c = Arc::new(Completions::new().unwrap());
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(parking_lot::Mutex::new(release_rx));
        let set_returned = Arc::new(AtomicBool::new(false));
        let seen_at_end = Arc::new(AtomicBool::new(true));
        let (r, s, e) = (release_rx.clone(), set_returned.clone(), seen_at_end.clone());
        c.set_callback(Some(Arc::new(move |_c: &Completion| {
            started_tx.send(()).unwrap();
            r.lock().recv_timeout(std::time::Duration::from_secs(10)).unwrap();
            e.store(s.load(Ordering::SeqCst), Ordering::SeqCst);
        })));
        let caller = {
            let c = c.clone();
            std::thread::spawn(move || c.call(&op()))
        };
        started_rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        let remover = {
            let (c, s) = (c.clone(), set_returned.clone());
            std::thread::spawn(move || {
                c.set_callback(None);
                s.store(true, Ordering::SeqCst);
            })
        };
        // Give an early return the chance to show (the assertion below never depends on it).
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!set_returned.load(Ordering::SeqCst), "set_callback(None) returned while the old callback was still running");
        release_tx.send(()).unwrap();
        caller.join().unwrap();
        remover.join().unwrap();
        assert!(!seen_at_end.load(Ordering::SeqCst), "the callback saw set_callback return before it ended");
        assert!(set_returned.load(Ordering::SeqCst));
        c.call(&op()); // removed: nothing runs, nothing blocks
    }

    /// Two threads inside callbacks each remove the callback (the one-shot pattern, with an
    /// operation's and a chunk's completions overlapping): neither waits for the other.
    #[test]
    fn two_callbacks_removing_it_at_once_do_not_wait_for_each_other() {
        use std::sync::Barrier;
        let c = Arc::new(Completions::new().unwrap());
        let both_inside = Arc::new(Barrier::new(2));
        let (weak, b) = (Arc::downgrade(&c), both_inside.clone());
        c.set_callback(Some(Arc::new(move |_c: &Completion| {
            b.wait();
            if let Some(c) = weak.upgrade() {
                c.set_callback(None);
            }
        })));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (c, tx) = (c.clone(), done_tx.clone());
            std::thread::spawn(move || {
                c.call(&op());
                tx.send(()).unwrap();
            });
        }
        for _ in 0..2 {
            done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("two callbacks removing the callback deadlocked");
        }
    }

    /// A callback that removes itself (the documented inside-the-callback case) does not wait for
    /// its own call; a later set from outside finds nothing running.
    #[test]
    fn a_callback_may_remove_itself() {
        let c = Arc::new(Completions::new().unwrap());
        let calls = Arc::new(AtomicUsize::new(0));
        let (weak, n) = (Arc::downgrade(&c), calls.clone());
        c.set_callback(Some(Arc::new(move |_c: &Completion| {
            n.fetch_add(1, Ordering::SeqCst);
            if let Some(c) = weak.upgrade() {
                c.set_callback(None);
            }
        })));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let c2 = c.clone();
        std::thread::spawn(move || {
            c2.call(&op());
            c2.call(&op());
            done_tx.send(()).unwrap();
        });
        done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("a callback that removes itself deadlocked");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        c.set_callback(None);
    }
}
