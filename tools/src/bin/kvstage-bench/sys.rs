//! What the bench reads from /proc: this process's threads (sampled on a thread of its own) and
//! CPU time, of this process, the decode process and the whole machine.

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

/// CPU time (user + system, seconds) process `pid` has used so far, all its threads.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the parenthesised name: state is field 3, utime 14 and stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(14) + ticks(15)) / hz
}

/// CPU time of this process and the decode process together.
fn cpu_both(child: &DecodeChild) -> f64 {
    cpu_seconds(std::process::id()) + cpu_seconds(child.pid())
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

/// CPU use over a stretch of time: these two processes' CPU seconds, and the machine's ticks.
pub struct CpuMeter {
    ours: f64,
    machine: (u64, u64),
    wall: Instant,
    /// Accumulated: our CPU seconds, wall seconds, machine idle ticks, machine ticks.
    sum: (f64, f64, u64, u64),
}

impl CpuMeter {
    pub fn new() -> CpuMeter {
        CpuMeter { ours: 0.0, machine: (0, 0), wall: Instant::now(), sum: (0.0, 0.0, 0, 0) }
    }
    pub fn start(&mut self, child: &DecodeChild) {
        (self.ours, self.machine, self.wall) = (cpu_both(child), machine_ticks(), Instant::now());
    }
    pub fn stop(&mut self, child: &DecodeChild) {
        let (idle, total) = machine_ticks();
        self.sum.0 += cpu_both(child) - self.ours;
        self.sum.1 += self.wall.elapsed().as_secs_f64();
        self.sum.2 += idle.saturating_sub(self.machine.0);
        self.sum.3 += total.saturating_sub(self.machine.1);
    }
    /// (CPU seconds, cores busy on average, machine idle share).
    pub fn result(&self) -> (f64, f64, f64) {
        let busy = if self.sum.1 > 0.0 { self.sum.0 / self.sum.1 } else { 0.0 };
        let idle = if self.sum.3 > 0 { self.sum.2 as f64 / self.sum.3 as f64 } else { 0.0 };
        (self.sum.0, busy, idle)
    }
}

