//! What the bench reads from /proc: this process's threads (sampled on a thread of its own) and
//! CPU time, of this process, the decode process and the whole machine.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvstage_testkit::cluster::DecodeChild;

/// The most threads this process had at once, all and `kvstage-*` named (the library's).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadPeak {
    pub total: usize,
    pub kvstage: usize,
    pub samples: u64,
}

/// Samples /proc/self/task every few milliseconds on its own thread until dropped, and whenever
/// the bench calls [`ThreadSampler::sample`] at a point where the library's threads exist (a
/// sampler thread alone can miss a short run on a busy machine).
pub struct ThreadSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Peak>,
    handle: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Peak {
    total: AtomicUsize,
    kvstage: AtomicUsize,
    samples: AtomicU64,
}

impl Peak {
    fn record(&self) {
        let (t, k) = count_threads();
        self.total.fetch_max(t, Ordering::Relaxed);
        self.kvstage.fetch_max(k, Ordering::Relaxed);
        self.samples.fetch_add(1, Ordering::Relaxed);
    }
}

pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// (threads, threads whose name starts with `kvstage-`) of this process now.
fn count_threads() -> (usize, usize) {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return (0, 0) };
    let (mut total, mut kvstage) = (0, 0);
    for entry in dir.flatten() {
        total += 1;
        if std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|name| name.starts_with("kvstage-")) {
            kvstage += 1;
        }
    }
    (total, kvstage)
}

impl ThreadSampler {
    pub fn start() -> ThreadSampler {
        let mut me = ThreadSampler { stop: Arc::new(AtomicBool::new(false)), peak: Arc::default(), handle: None };
        let (stop, peak) = (me.stop.clone(), me.peak.clone());
        me.handle = std::thread::Builder::new()
            .name("bench-threads".into())
            .spawn(move || loop {
                peak.record();
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(SAMPLE_EVERY);
            })
            .ok();
        me
    }

    /// Takes a sample now, on the calling thread.
    pub fn sample(&self) {
        self.peak.record();
    }

    fn peak(&self) -> ThreadPeak {
        ThreadPeak {
            total: self.peak.total.load(Ordering::Relaxed),
            kvstage: self.peak.kvstage.load(Ordering::Relaxed),
            samples: self.peak.samples.load(Ordering::Relaxed),
        }
    }

    /// Stops the sampler (after one last sample) and returns the peak.
    pub fn finish(mut self) -> ThreadPeak {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak()
    }
}

impl Drop for ThreadSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Seconds of user + system time in a `/proc/.../stat` line (fields after the parenthesised
/// name: state is field 3, utime 14 and stime 15), with the name.
fn stat_cpu(stat: &str) -> Option<(&str, f64)> {
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((name, (ticks(14) + ticks(15)) / hz))
}

/// CPU time of one process so far: all its threads (also those that ended), and each live thread
/// by id with its name.
#[derive(Clone, Debug, Default)]
struct ProcessCpu {
    total: f64,
    threads: HashMap<u32, (String, f64)>,
}

impl ProcessCpu {
    fn read(pid: u32) -> ProcessCpu {
        let total = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| stat_cpu(&s).map(|(_, t)| t)).unwrap_or(0.0);
        let mut threads = HashMap::new();
        for entry in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            if let Some((name, secs)) = stat_cpu(&stat) {
                // The main thread goes by the process's name: called `main` whatever that is.
                let group = if tid == pid { "main".to_owned() } else { thread_group(name) };
                threads.insert(tid, (group, secs));
            }
        }
        ProcessCpu { total, threads }
    }

    /// CPU time spent since `before`, by thread group (those that used any); what threads that
    /// ended meanwhile used is `exited`.
    fn since(&self, before: &ProcessCpu) -> ProcessParts {
        let mut by_group: BTreeMap<String, f64> = BTreeMap::new();
        for (tid, (group, secs)) in &self.threads {
            let earlier = before.threads.get(tid).map_or(0.0, |(_, s)| *s);
            *by_group.entry(group.clone()).or_default() += (secs - earlier).max(0.0);
        }
        // The process's figure and its threads' are read one after the other: the larger wins.
        let counted: f64 = by_group.values().sum();
        let exited = (self.total - before.total) - counted;
        if exited > 0.0 {
            by_group.insert("exited".to_owned(), exited);
        }
        by_group.retain(|_, secs| *secs > 0.0);
        ProcessParts { total: by_group.values().sum(), threads: by_group }
    }
}

/// A thread name without its instance suffix: `kvstage-xfer-1` and `kvstage-send-p0` count as
/// `kvstage-xfer` and `kvstage-send`, `bench-raw-3` as `bench-raw`.
fn thread_group(name: &str) -> String {
    match name.rsplit_once('-') {
        Some((group, _)) if group.contains('-') => group.to_owned(),
        _ => name.to_owned(),
    }
}

/// CPU seconds of one process over a measurement, and by thread group (`kvstage-*`: the
/// library's; `main` and `bench-*`: the bench's own; `exited`: threads gone before the end).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ProcessParts {
    pub total: f64,
    pub threads: BTreeMap<String, f64>,
}

impl ProcessParts {
    fn add(&mut self, other: &ProcessParts) {
        self.total += other.total;
        for (g, s) in &other.threads {
            *self.threads.entry(g.clone()).or_default() += s;
        }
    }

    /// Every figure divided by `n`.
    fn per(&self, n: f64) -> ProcessParts {
        ProcessParts { total: self.total / n, threads: self.threads.iter().map(|(g, s)| (g.clone(), s / n)).collect() }
    }
}

/// CPU use of the two processes over a measurement: the prefill (this one) and the decode process.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CpuParts {
    pub prefill: ProcessParts,
    pub decode: ProcessParts,
}

impl CpuParts {
    pub fn total(&self) -> f64 {
        self.prefill.total + self.decode.total
    }
}

/// The machine's CPU time so far (all cores, clock ticks): (idle including I/O wait, total).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next().and_then(|l| l.strip_prefix("cpu ")) else { return (0, 0) };
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let total = v.iter().take(8).sum();
    (v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0), total)
}

/// CPU use over stretches of time: these two processes' CPU seconds (by thread group), and the
/// machine's ticks.
pub struct CpuMeter {
    ours: (ProcessCpu, ProcessCpu),
    machine: (u64, u64),
    wall: Instant,
    /// Accumulated: our CPU seconds, wall seconds, machine idle ticks, machine ticks.
    sum: (CpuParts, f64, u64, u64),
}

/// A snapshot of (this process, the decode process).
fn cpu_both(child: &DecodeChild) -> (ProcessCpu, ProcessCpu) {
    (ProcessCpu::read(std::process::id()), ProcessCpu::read(child.pid()))
}

impl CpuMeter {
    pub fn new() -> CpuMeter {
        CpuMeter { ours: Default::default(), machine: (0, 0), wall: Instant::now(), sum: (CpuParts::default(), 0.0, 0, 0) }
    }
    pub fn start(&mut self, child: &DecodeChild) {
        (self.ours, self.machine, self.wall) = (cpu_both(child), machine_ticks(), Instant::now());
    }
    pub fn stop(&mut self, child: &DecodeChild) {
        let (idle, total) = machine_ticks();
        let (prefill, decode) = cpu_both(child);
        self.sum.0.prefill.add(&prefill.since(&self.ours.0));
        self.sum.0.decode.add(&decode.since(&self.ours.1));
        self.sum.1 += self.wall.elapsed().as_secs_f64();
        self.sum.2 += idle.saturating_sub(self.machine.0);
        self.sum.3 += total.saturating_sub(self.machine.1);
    }
    /// (CPU seconds per request of the `requests` measured, by process and thread group; cores
    /// busy on average; machine idle share).
    pub fn result(&self, requests: usize) -> (CpuParts, f64, f64) {
        let busy = if self.sum.1 > 0.0 { self.sum.0.total() / self.sum.1 } else { 0.0 };
        let idle = if self.sum.3 > 0 { self.sum.2 as f64 / self.sum.3 as f64 } else { 0.0 };
        let n = requests.max(1) as f64;
        (CpuParts { prefill: self.sum.0.prefill.per(n), decode: self.sum.0.decode.per(n) }, busy, idle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_groups_drop_the_instance_suffix() {
        for (name, group) in [
            ("kvstage-xfer-12", "kvstage-xfer"),
            ("kvstage-send-p0", "kvstage-send"),
            ("kvstage-recv", "kvstage-recv"),
            ("kvstage-scatter", "kvstage-scatter"),
            ("bench-raw-3", "bench-raw"),
            ("bench-main", "bench-main"),
        ] {
            assert_eq!(thread_group(name), group, "{name}");
        }
    }

    #[test]
    fn a_stat_line_with_spaces_and_parentheses_in_the_name() {
        // comm may hold anything, ')' included: the fields follow the last ')'.
        let line = "42 (a) b) c) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let (name, secs) = stat_cpu(line).unwrap();
        assert_eq!(name, "a) b) c");
        assert!((secs - 300.0 / hz).abs() < 1e-9, "{secs}");
    }

    #[test]
    fn threads_that_ended_are_counted_as_exited() {
        let before = ProcessCpu { total: 1.0, threads: HashMap::from([(1, ("main".into(), 0.5)), (2, ("kvstage-xfer".into(), 0.5))]) };
        let after = ProcessCpu { total: 4.0, threads: HashMap::from([(1, ("main".into(), 1.0)), (3, ("kvstage-xfer".into(), 1.5))]) };
        let parts = after.since(&before);
        assert_eq!(parts.total, 3.0);
        assert_eq!(parts.threads["main"], 0.5);
        assert_eq!(parts.threads["kvstage-xfer"], 1.5);
        assert_eq!(parts.threads["exited"], 1.0);
    }
}
