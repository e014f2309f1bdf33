//! Where kvstage's log records go.
//!
//! The library logs through the `log` facade (`log::warn!` and friends, anywhere in the crate,
//! with the session id as the `session` key-value where there is one). This module is the one
//! logger behind the facade:
//!
//! - **Level.** `KVSTAGE_LOG` = `off`, `error`, `warn` (the default), `info`, `debug` or `trace`
//!   (case-insensitive), read once, when the first engine is created or a callback is set. An
//!   unknown value is reported in one warning and the default applies.
//! - **Sinks.** Without a callback, records at or above that level go to stderr, one line each:
//!   `2026-12-03T10:15:42.123Z  WARN kvstage::transport::rdma: session s-1: message` (UTC), never
//!   waiting for a reader nor raising `SIGPIPE` ([`super::stderr`]). With a
//!   callback ([`set_callback`], the C API's `kvstage_log_set_callback`), records at or above the
//!   callback's own level go to it instead, and nothing goes to stderr.
//! - **Swapping.** A delivery holds the sink for its duration, and [`set_callback`] takes it
//!   exclusively: once it returns, no delivery through the old callback is running or will start,
//!   so its user data may be freed. A callback that sets the callback itself is refused (it would
//!   wait for itself); a record logged by a kvstage call made from inside a callback is dropped.
//!
//! When the library is linked into a Rust program that installed its own `log` logger first, the
//! records go to that logger and this module only keeps its settings.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use log::{Level, LevelFilter, Log, Metadata, Record};
use parking_lot::RwLock;

use crate::error::{Error, Result, Status};

/// The environment variable that sets the level of the stderr sink.
pub const ENV_VAR: &str = "KVSTAGE_LOG";

/// The level without `KVSTAGE_LOG`.
pub const DEFAULT_LEVEL: LevelFilter = LevelFilter::Warn;

/// One record as a sink sees it. `session` is empty when the record is about no session;
/// `message` does not repeat it.
#[derive(Clone, Copy, Debug)]
pub struct Line<'a> {
    pub level: Level,
    pub target: &'a str,
    pub session: &'a str,
    pub message: &'a str,
}

/// A callback sink (the C API wraps the embedder's function pointer in one).
pub type Sink = Box<dyn Fn(&Line<'_>) + Send + Sync>;

struct Callback {
    sink: Sink,
    max: LevelFilter,
}

/// The callback, if any. Read-locked for each delivery, write-locked to change it.
static CALLBACK: RwLock<Option<Callback>> = RwLock::new(None);

/// The level from `KVSTAGE_LOG`, and the value when it was not a level.
static ENV_LEVEL: OnceLock<(LevelFilter, Option<String>)> = OnceLock::new();

static INIT: Once = Once::new();

/// Whether `log`'s global logger is ours (a Rust host may have installed its own first).
static OURS: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while this thread delivers a record (to the callback or stderr).
    static DELIVERING: Cell<bool> = const { Cell::new(false) };
}

/// Parses a level name: `off`, `error`, `warn` (or `warning`), `info`, `debug`, `trace`, in any
/// case, surrounding blanks ignored.
pub fn parse_level(text: &str) -> Option<LevelFilter> {
    match text.trim().to_ascii_lowercase().as_str() {
        "off" => Some(LevelFilter::Off),
        "error" => Some(LevelFilter::Error),
        "warn" | "warning" => Some(LevelFilter::Warn),
        "info" => Some(LevelFilter::Info),
        "debug" => Some(LevelFilter::Debug),
        "trace" => Some(LevelFilter::Trace),
        _ => None,
    }
}

/// The stderr level for a value of `KVSTAGE_LOG` (`None`: unset), and the value when it is not a
/// level (the default applies then). An empty value counts as unset.
pub fn level_from_env(value: Option<&str>) -> (LevelFilter, Option<String>) {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => (DEFAULT_LEVEL, None),
        Some(v) => match parse_level(v) {
            Some(level) => (level, None),
            None => (DEFAULT_LEVEL, Some(v.to_owned())),
        },
    }
}

/// The stderr sink's level (`KVSTAGE_LOG`, read on the first call).
pub fn env_level() -> LevelFilter {
    env_settings().0
}

fn env_settings() -> &'static (LevelFilter, Option<String>) {
    ENV_LEVEL.get_or_init(|| level_from_env(std::env::var(ENV_VAR).ok().as_deref()))
}

/// The level an integer of the C API stands for (`0` off … `5` trace).
pub fn level_from_int(level: i32) -> Option<LevelFilter> {
    Some(match level {
        0 => LevelFilter::Off,
        1 => LevelFilter::Error,
        2 => LevelFilter::Warn,
        3 => LevelFilter::Info,
        4 => LevelFilter::Debug,
        5 => LevelFilter::Trace,
        _ => return None,
    })
}

/// The C API's integer for a record's level (`1` error … `5` trace).
pub fn level_to_int(level: Level) -> i32 {
    level as usize as i32
}

/// Installs the logger (once per process; later calls return at once). Every entry point that
/// can lead to a record calls it: engine creation and [`set_callback`].
pub fn init() {
    INIT.call_once(|| {
        let (_, bad) = env_settings();
        if log::set_logger(&LOGGER).is_ok() {
            OURS.store(true, Ordering::SeqCst);
            set_max_level(&CALLBACK.read());
            if let Some(bad) = bad {
                log::warn!("{ENV_VAR}=\"{bad}\" is not one of off, error, warn, info, debug, trace: using {DEFAULT_LEVEL}");
            }
        }
    });
}

/// The level the facade filters at: the callback's, or the stderr sink's.
fn set_max_level(callback: &Option<Callback>) {
    if OURS.load(Ordering::SeqCst) {
        log::set_max_level(callback.as_ref().map_or_else(env_level, |c| c.max));
    }
}

/// Hands records at or above `max` to `sink` instead of stderr; `None` returns them to stderr
/// (at the `KVSTAGE_LOG` level). Returns once no delivery through the previous callback is
/// running, and drops it then (outside the lock). Refused from inside a delivery.
pub fn set_callback(callback: Option<(Sink, LevelFilter)>) -> Result<()> {
    init();
    if DELIVERING.try_with(Cell::get).unwrap_or(true) {
        return Err(Error::new(
            Status::KVSTAGE_E_UNSUPPORTED,
            "the log callback cannot be changed from inside a log callback (it would wait for itself)",
        ));
    }
    let new = callback.map(|(sink, max)| Callback { sink, max });
    let old = {
        // Waits for every delivery in flight (they hold the read lock).
        let mut slot = CALLBACK.write();
        let old = std::mem::replace(&mut *slot, new);
        set_max_level(&slot);
        old
    };
    drop(old);
    Ok(())
}

/// Whether records of `level` reach a sink now (for costly messages built only when they do).
pub fn enabled(level: Level) -> bool {
    level <= log::max_level()
}

struct Logger;

static LOGGER: Logger = Logger;

/// Marks this thread as delivering until dropped.
struct Delivering;

impl Delivering {
    /// `None` when this thread is already delivering (the record comes from inside a callback).
    fn enter() -> Option<Delivering> {
        DELIVERING
            // Built only when entering: a guard built and dropped here would clear the flag.
            .try_with(|d| if d.replace(true) { None } else { Some(Delivering) })
            .ok()
            .flatten()
    }
}

impl Drop for Delivering {
    fn drop(&mut self) {
        let _ = DELIVERING.try_with(|d| d.set(false));
    }
}

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let Some(_delivering) = Delivering::enter() else { return };
        let value = record.key_values().get(log::kv::Key::from_str("session"));
        let session = value.as_ref().map(|v| v.to_borrowed_str().map_or_else(|| v.to_string(), str::to_owned)).unwrap_or_default();
        let message = record.args().to_string();
        let line = Line { level: record.level(), target: record.target(), session: &session, message: &message };
        let callback = CALLBACK.read();
        match &*callback {
            Some(c) if line.level <= c.max => (c.sink)(&line),
            Some(_) => {}
            None if line.level <= env_level() => write_stderr(&line),
            None => {}
        }
    }

    fn flush(&self) {}
}

/// One line on stderr, written at once (lines of several threads do not interleave), or dropped
/// when stderr would make the thread wait (see [`super::stderr`]).
fn write_stderr(line: &Line<'_>) {
    super::stderr::write_line(&format_line(SystemTime::now(), line));
}

/// `2026-12-03T10:15:42.123Z  WARN kvstage::transport::rdma: session s-1: message\n`; line
/// breaks inside the message become spaces (one record, one line).
pub fn format_line(now: SystemTime, line: &Line<'_>) -> String {
    let mut out = String::with_capacity(64 + line.target.len() + line.session.len() + line.message.len());
    out.push_str(&utc_timestamp(now));
    out.push_str(&format!(" {:>5} {}: ", line.level, line.target));
    if !line.session.is_empty() {
        out.push_str("session ");
        out.push_str(line.session);
        out.push_str(": ");
    }
    out.extend(line.message.chars().map(|c| if c == '\n' || c == '\r' { ' ' } else { c }));
    out.push('\n');
    out
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC) of `t`.
pub fn utc_timestamp(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// The callback is process-wide: tests that set it run one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    const TARGET: &str = "kvstage::engine::logging::tests";

    #[test]
    fn levels_parse_case_insensitively_and_bad_values_keep_the_default() {
        assert_eq!(parse_level("off"), Some(LevelFilter::Off));
        assert_eq!(parse_level(" Error "), Some(LevelFilter::Error));
        assert_eq!(parse_level("WARN"), Some(LevelFilter::Warn));
        assert_eq!(parse_level("warning"), Some(LevelFilter::Warn));
        assert_eq!(parse_level("info"), Some(LevelFilter::Info));
        assert_eq!(parse_level("Debug"), Some(LevelFilter::Debug));
        assert_eq!(parse_level("trace"), Some(LevelFilter::Trace));
        assert_eq!(parse_level("verbose"), None);
        assert_eq!(parse_level("3"), None);
        assert_eq!(level_from_env(None), (LevelFilter::Warn, None));
        assert_eq!(level_from_env(Some("")), (LevelFilter::Warn, None));
        assert_eq!(level_from_env(Some("debug")), (LevelFilter::Debug, None));
        assert_eq!(level_from_env(Some("OFF")), (LevelFilter::Off, None));
        assert_eq!(level_from_env(Some("loud")), (LevelFilter::Warn, Some("loud".to_owned())));
        for (i, level) in [LevelFilter::Off, LevelFilter::Error, LevelFilter::Warn, LevelFilter::Info, LevelFilter::Debug, LevelFilter::Trace]
            .into_iter()
            .enumerate()
        {
            assert_eq!(level_from_int(i as i32), Some(level));
        }
        assert_eq!(level_from_int(-1), None);
        assert_eq!(level_from_int(6), None);
        assert_eq!(level_to_int(Level::Error), 1);
        assert_eq!(level_to_int(Level::Warn), 2);
        assert_eq!(level_to_int(Level::Trace), 5);
    }

    #[test]
    fn stderr_lines_carry_time_level_target_session_and_one_line_message() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_292_942_123); // 2026-12-03T10:15:42.123Z
        let line = Line { level: Level::Warn, target: "kvstage::transport::rdma", session: "s-1", message: "a\nb" };
        assert_eq!(format_line(t, &line), "2026-12-03T10:15:42.123Z  WARN kvstage::transport::rdma: session s-1: a b\n");
        let line = Line { level: Level::Error, target: "kvstage::engine", session: "", message: "m" };
        assert_eq!(format_line(t, &line), "2026-12-03T10:15:42.123Z ERROR kvstage::engine: m\n");
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_timestamp(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000Z");
    }

    type Seen = Arc<Mutex<Vec<(Level, String, String)>>>;

    /// A sink that records this module's test records (other tests log concurrently).
    fn recorder() -> (Sink, Seen) {
        let seen: Seen = Arc::default();
        let s = seen.clone();
        let sink: Sink = Box::new(move |l: &Line<'_>| {
            if l.target == TARGET {
                s.lock().unwrap().push((l.level, l.session.to_owned(), l.message.to_owned()));
            }
        });
        (sink, seen)
    }

    #[test]
    fn the_callback_gets_records_at_or_above_its_level_with_the_session() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (sink, seen) = recorder();
        set_callback(Some((sink, LevelFilter::Info))).unwrap();
        assert_eq!(log::max_level(), LevelFilter::Info);
        assert!(enabled(Level::Info) && !enabled(Level::Debug));
        log::error!(target: TARGET, session = "s-1"; "e {}", 1);
        log::warn!(target: TARGET, "w");
        log::info!(target: TARGET, session = "s-2"; "i");
        log::debug!(target: TARGET, "d");
        log::trace!(target: TARGET, "t");
        set_callback(None).unwrap();
        assert_eq!(log::max_level(), env_level());
        log::error!(target: TARGET, "after the callback was removed");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            vec![
                (Level::Error, "s-1".to_owned(), "e 1".to_owned()),
                (Level::Warn, String::new(), "w".to_owned()),
                (Level::Info, "s-2".to_owned(), "i".to_owned()),
            ]
        );
        // Off: installed, silent.
        let (sink, seen) = recorder();
        set_callback(Some((sink, LevelFilter::Off))).unwrap();
        log::error!(target: TARGET, "dropped");
        set_callback(None).unwrap();
        assert!(seen.lock().unwrap().is_empty());
    }

    #[test]
    fn swapping_the_callback_waits_for_deliveries_in_flight() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        // The old sink is slow and checks on every call that it has not been retired yet.
        let retired = Arc::new(AtomicBool::new(false));
        let late_calls = Arc::new(AtomicUsize::new(0));
        let calls = Arc::new(AtomicUsize::new(0));
        let (r, late, n) = (retired.clone(), late_calls.clone(), calls.clone());
        let old: Sink = Box::new(move |l: &Line<'_>| {
            if l.target != TARGET {
                return;
            }
            n.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(2));
            if r.load(Ordering::SeqCst) {
                late.fetch_add(1, Ordering::SeqCst);
            }
        });
        set_callback(Some((old, LevelFilter::Trace))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let loggers: Vec<_> = (0..4)
            .map(|i| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        log::info!(target: TARGET, "from thread {i}");
                    }
                })
            })
            .collect();
        let t = Instant::now();
        while calls.load(Ordering::SeqCst) < 8 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(calls.load(Ordering::SeqCst) >= 8, "the loggers never reached the callback");
        let (new, seen) = recorder();
        set_callback(Some((new, LevelFilter::Trace))).unwrap();
        // From here on the old sink must never run again: a delivery still inside it would count.
        retired.store(true, Ordering::SeqCst);
        let t = Instant::now();
        while seen.lock().unwrap().len() < 8 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::SeqCst);
        for l in loggers {
            l.join().unwrap();
        }
        set_callback(None).unwrap();
        assert_eq!(late_calls.load(Ordering::SeqCst), 0, "the old callback ran after the swap returned");
        assert!(seen.lock().unwrap().len() >= 8, "the new callback got no records");
    }

    #[test]
    fn a_callback_cannot_replace_itself_and_its_own_records_are_dropped() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let outcome: Arc<Mutex<Vec<String>>> = Arc::default();
        let o = outcome.clone();
        let sink: Sink = Box::new(move |l: &Line<'_>| {
            if l.target != TARGET || l.message != "outer" {
                if l.target == TARGET {
                    o.lock().unwrap().push(format!("nested record delivered: {}", l.message));
                }
                return;
            }
            // A record logged from inside the callback goes nowhere (no recursion, no deadlock).
            log::error!(target: TARGET, "inner");
            let r = set_callback(None);
            o.lock().unwrap().push(match r {
                Ok(()) => "replaced".to_owned(),
                Err(e) => format!("{:?}: {}", e.code(), e.message()),
            });
        });
        set_callback(Some((sink, LevelFilter::Trace))).unwrap();
        log::error!(target: TARGET, "outer");
        set_callback(None).unwrap();
        let outcome = outcome.lock().unwrap().clone();
        assert_eq!(outcome.len(), 1, "{outcome:?}");
        assert!(outcome[0].starts_with("KVSTAGE_E_UNSUPPORTED: the log callback cannot be changed from inside"), "{outcome:?}");
    }
}
