//! The panic boundary of the library's own long-lived threads (keeper, accept loop, lease
//! watchers, RDMA completion poller): a panic in one pass of such a loop is caught, logged and
//! counted, and the loop goes on, instead of the thread ending silently and taking its duty
//! (watermarks, room expiry, new sessions, quarantines, completions) with it. Test builds can
//! make a named point panic once ([`arm`]).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

/// Runs `body`; a panic is caught, logged as an error naming `what`, counted in `count`, and
/// `false` returned.
pub fn contain(what: &str, count: Option<&AtomicU64>, body: impl FnOnce()) -> bool {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(()) => true,
        Err(p) => {
            if let Some(c) = count {
                c.fetch_add(1, Ordering::Relaxed);
            }
            log::error!("{} (the thread goes on)", Error::from_panic(format!("{what} panicked"), &*p).chain());
            false
        }
    }
}

#[cfg(feature = "testing")]
static ARMED: parking_lot::Mutex<Vec<&'static str>> = parking_lot::Mutex::new(Vec::new());

/// Test builds: the next pass through [`point`]`(name)` panics (once per call of this).
#[cfg(feature = "testing")]
pub fn arm(name: &'static str) {
    ARMED.lock().push(name);
}

/// A place a test can make panic ([`arm`]); nothing in release builds.
#[inline]
pub fn point(name: &'static str) {
    #[cfg(feature = "testing")]
    {
        let mut armed = ARMED.lock();
        if let Some(i) = armed.iter().position(|&a| a == name) {
            armed.remove(i);
            drop(armed);
            panic!("fault injection: a panic in {name}");
        }
    }
    #[cfg(not(feature = "testing"))]
    let _ = name;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_contained_and_counted() {
        let n = AtomicU64::new(0);
        assert!(contain("a pass", Some(&n), || {}));
        assert!(!contain("a pass", Some(&n), || panic!("boom")));
        assert_eq!(n.load(Ordering::Relaxed), 1);
    }
}
