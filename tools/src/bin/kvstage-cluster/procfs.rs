//! What a rank process reads about itself from /proc for the leak check: open descriptors and
//! threads (by name).

use std::collections::BTreeMap;

/// Open file descriptors of this process.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Threads of this process by name, with `kvstage-send-p0-d1`-like names cut at their first
/// digit-bearing suffix so that one kind counts together (`kvstage-send-`, `kvstage-recv`).
pub fn threads() -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return out };
    for entry in dir.flatten() {
        let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        let name = name.trim_end();
        let kind = match name.find(|c: char| c.is_ascii_digit()) {
            Some(at) => &name[..at],
            None => name,
        };
        *out.entry(kind.to_owned()).or_insert(0) += 1;
    }
    out
}

/// Threads in `now` beyond `base`, kind by kind (only kinds that grew).
pub fn grown(base: &BTreeMap<String, usize>, now: &BTreeMap<String, usize>) -> BTreeMap<String, usize> {
    let was = |k: &String| base.get(k).copied().unwrap_or(0);
    now.iter().filter(|&(k, &n)| n > was(k)).map(|(k, &n)| (k.clone(), n - was(k))).collect()
}

/// Names this process's thread (threads inherit it; the library's are `kvstage-*`).
pub fn name_thread(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
}

/// Dies with the router: a rank process must not outlive the run (set before exec, kept by it).
pub fn die_with_parent() {
    // SAFETY: plain prctl.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
}
