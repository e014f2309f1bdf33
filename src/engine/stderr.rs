//! The stderr sink of the log ([`super::logging`]): a library thread writing its line must never
//! wait for whoever reads the process's stderr, nor be killed by it.
//!
//! - A line is written only when stderr takes it now (`poll` says writable, one `write` of at most
//!   `PIPE_BUF` bytes, which a writable pipe takes whole): a full pipe nobody reads drops the line
//!   instead of parking the thread (a connection thread blocked here would hold its peers). The
//!   next line written says how many were dropped. Best effort where `poll` cannot promise room
//!   (a terminal, a writer outside the library filling the pipe in between): one thread may then
//!   block in its write, and the others drop their lines rather than wait behind it.
//! - `SIGPIPE` is blocked on the writing thread around the write, and one it raised is taken back,
//!   so a closed stderr (the reader went away) is `EPIPE` here, not the default action, which ends
//!   a C program; a `SIGPIPE` already pending before the write is left alone.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Lines the sink could not write since the last one it wrote.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Serialises the library's writers: two threads that both saw room for one line must not both
/// write into it.
static WRITING: Mutex<()> = Mutex::new(());

/// The longest line written (longer ones are cut, ending with "…\n").
const MAX_LINE: usize = libc::PIPE_BUF;

/// Writes `line` (one log line, ending with a newline) to fd 2 if it takes it without waiting;
/// drops it otherwise.
pub fn write_line(line: &str) {
    // Another library thread writing (a terminal that blocks it): this line is not waited for.
    let Some(_writing) = WRITING.try_lock() else {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    };
    if !writable_now(libc::STDERR_FILENO) {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    let text = match dropped {
        0 => std::borrow::Cow::Borrowed(line),
        n => format!("{}({n} earlier log line(s) dropped: stderr was full)\n", line).into(),
    };
    let bytes = cut(&text);
    let wrote = without_sigpipe(|| {
        // SAFETY: fd 2 and a buffer of `bytes.len()` readable bytes.
        unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) }
    });
    if wrote < 0 {
        DROPPED.fetch_add(1 + dropped, Ordering::Relaxed);
    }
}

/// `text` as at most [`MAX_LINE`] bytes, cut on a character boundary.
fn cut(text: &str) -> std::borrow::Cow<'_, [u8]> {
    if text.len() <= MAX_LINE {
        return std::borrow::Cow::Borrowed(text.as_bytes());
    }
    const TAIL: &str = "…\n";
    let mut end = MAX_LINE - TAIL.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = text.as_bytes()[..end].to_vec();
    out.extend_from_slice(TAIL.as_bytes());
    out.into()
}

/// `fd` takes a write now (a regular file always does; a pipe or socket with room).
fn writable_now(fd: i32) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd; timeout 0 never waits.
    let r = unsafe { libc::poll(&mut pfd, 1, 0) };
    r == 1 && pfd.revents & libc::POLLOUT != 0 && pfd.revents & (libc::POLLERR | libc::POLLNVAL) == 0
}

/// Runs `write` with `SIGPIPE` blocked on this thread, taking back one that it raised.
fn without_sigpipe(write: impl FnOnce() -> isize) -> isize {
    // SAFETY: signal sets are plain data initialised by sigemptyset/sigaddset; pthread_sigmask,
    // sigpending and sigtimedwait only read and write them and this thread's mask.
    unsafe {
        let mut pipe: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut pipe);
        libc::sigaddset(&mut pipe, libc::SIGPIPE);
        let mut old: libc::sigset_t = std::mem::zeroed();
        if libc::pthread_sigmask(libc::SIG_BLOCK, &pipe, &mut old) != 0 {
            return write();
        }
        let mut pending: libc::sigset_t = std::mem::zeroed();
        let was_pending = libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, libc::SIGPIPE) == 1;
        let wrote = write();
        if wrote < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPIPE) && !was_pending {
            let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // Ours, raised on this thread by the write: taken back before the mask is restored.
            while libc::sigtimedwait(&pipe, std::ptr::null_mut(), &zero) < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {}
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        wrote
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_line_is_cut_on_a_character_boundary_and_keeps_its_newline() {
        let long = format!("{}\n", "é".repeat(MAX_LINE));
        let short = cut(&long);
        assert!(short.len() <= MAX_LINE);
        let text = std::str::from_utf8(&short).expect("cut inside a character");
        assert!(text.ends_with("…\n"));
        assert_eq!(cut("short\n").as_ref(), b"short\n");
    }
}
