//! A rank's free pages: each request in flight on a rank holds pages of its own, so a stray
//! write from one request into another's pages shows in the byte check.

use std::sync::Mutex;

pub struct Pages {
    free: Mutex<Vec<u32>>,
    total: usize,
}

impl Pages {
    /// Every page of a pool of `capacity`, handed out in a shuffled order (`seed`), as an
    /// engine's allocator scatters a request's pages.
    pub fn new(capacity: u32, seed: u64) -> Pages {
        let mut free = kvstage_testkit::page_table(capacity as usize, capacity as u64, seed, false);
        free.reverse();
        Pages { total: free.len(), free: Mutex::new(free) }
    }

    pub fn take(&self, n: usize) -> Option<Vec<u32>> {
        let mut free = self.free.lock().unwrap();
        let at = free.len().checked_sub(n)?;
        Some(free.split_off(at))
    }

    pub fn give(&self, pages: Vec<u32>) {
        self.free.lock().unwrap().extend(pages);
    }

    /// Pages not handed back.
    pub fn held(&self) -> usize {
        self.total - self.free.lock().unwrap().len()
    }
}
