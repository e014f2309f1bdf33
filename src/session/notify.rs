//! Completion notifications that fit an engine's event loop: an eventfd that becomes readable
//! whenever an operation finishes or a decode chunk event is queued (for epoll / asyncio), and an
//! optional callback.
//!
//! The callback runs on a library thread (a transfer worker, a receiver connection thread or the
//! scatter thread) with no kvstage lock held, so it may call kvstage functions (poll operations,
//! poll events); it must return quickly, must not free the engine that signals it, and must not
//! wait (room release or wait, operation wait: they may need the very thread running it).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use parking_lot::RwLock;

use super::receiver::ChunkEvent;
use super::stats::TransferTimings;
use crate::error::{Error, Result, Status};

/// What completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// An asynchronous operation ended with `status`; `tag` is the caller's, from its descriptor;
    /// `timings` are its phase timings.
    Op { tag: u64, status: Status, timings: TransferTimings },
    /// A decode chunk was scattered or failed.
    Chunk(ChunkEvent),
}

pub type Callback = Arc<dyn Fn(&Completion) + Send + Sync>;

pub struct Completions {
    fd: OwnedFd,
    callback: RwLock<Option<Callback>>,
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
        Ok(Completions { fd: unsafe { OwnedFd::from_raw_fd(fd) }, callback: RwLock::new(None) })
    }

    /// Readable while completions are unread: read 8 bytes to reset it, then poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn set_callback(&self, callback: Option<Callback>) {
        *self.callback.write() = callback;
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
        let callback = self.callback.read().clone();
        if let Some(cb) = callback {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(c))).is_err() {
                log::error!("the completion callback panicked on {c:?}");
            }
        }
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
        c.call(&Completion::Op { tag: 7, status: Status::KVSTAGE_OK, timings: TransferTimings::default() });
        c.call(&Completion::Chunk(ChunkEvent { room: 1, chunk: 0, status: Status::KVSTAGE_OK, scatter_ns: 0 }));
        // SAFETY: as above.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert_eq!(c.drain(), 2);
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        assert_eq!(c.drain(), 0);
    }
}
