//! The report: each request's outcome (verified, corrupt, failed with its status, hung), failures
//! matched to the fault windows that explain them, transfer latency without faults and within
//! each fault's window, recovery after each fault, and the leak check of every rank.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::cli::Cli;
use crate::faults::Record;
use crate::latency::latency;
use crate::router::{Outcome, Req};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Verified,
    Corrupt,
    Failed,
    Hung,
    Refused,
}

fn class(r: &Req) -> Class {
    // Hung: no end within the router's bound, or a prefill operation that outlived its deadline.
    if r.hung || r.sent.iter().flatten().any(|(s, _)| s == "HUNG") {
        return Class::Hung;
    }
    if r.done.iter().flatten().any(|(s, _, _)| s == "REFUSED") {
        return Class::Refused;
    }
    if r.done.iter().flatten().any(|(s, bad, _)| s == "KVSTAGE_OK" && *bad > 0) {
        return Class::Corrupt;
    }
    if r.done.iter().all(|d| d.as_ref().is_some_and(|(s, bad, _)| s == "KVSTAGE_OK" && *bad == 0)) {
        return Class::Verified;
    }
    Class::Failed
}

/// The status that says why a request failed: a prefill rank's first error, else a decode rank's.
fn failure(r: &Req) -> (String, String) {
    let prefill = r.sent.iter().flatten().find(|(s, _)| s != "KVSTAGE_OK" && s != "NOT_SENT").map(|(s, w)| (format!("prefill {s}"), w.clone()));
    let decode = r.done.iter().flatten().find(|(s, _, _)| s != "KVSTAGE_OK").map(|(s, _, w)| (format!("decode {s}"), w.clone()));
    prefill.or(decode).unwrap_or_else(|| ("unknown".into(), String::new()))
}

fn touches(r: &Req, node: &str) -> bool {
    let (decode, n) = (node.starts_with('d'), node[1..].parse::<u32>().unwrap_or(u32::MAX));
    if decode {
        r.decode_node == n
    } else {
        r.prefill_node == n
    }
}

/// A fault's window: from its start to its end plus a transfer deadline (a request it hit may
/// fail as late as that) and a second.
fn window(f: &Record, end_of_run: f64, deadline_s: f64) -> (f64, f64) {
    (f.start_s, f.end_s.unwrap_or(end_of_run) + deadline_s + 1.0)
}

fn overlaps(r: &Req, (a, b): (f64, f64)) -> bool {
    r.arrive <= b && r.end.unwrap_or(f64::MAX) >= a
}

fn ms(r: &Req) -> Option<f64> {
    Some((r.end? - r.sent_at?) * 1e3)
}

/// The plot's points: each request at its arrival, by its outcome.
pub fn points(out: &Outcome) -> Vec<crate::plot::Point> {
    use crate::plot::Point;
    out.reqs
        .iter()
        .filter_map(|r| {
            let at = r.arrive;
            Some(match class(r) {
                Class::Verified => Point::Verified { at, ms: ms(r)? },
                Class::Failed => Point::Failed { at },
                Class::Corrupt => Point::Corrupt { at },
                Class::Hung => Point::Hung { at },
                Class::Refused => return None,
            })
        })
        .collect()
}

pub fn build(cli: &Cli, setup: &kvstage_testkit::cluster::Setup, out: &mut Outcome, link: Value) -> Value {
    let deadline_s = cli.timeout_ms as f64 / 1e3;
    let end_of_run = out.elapsed;
    let classes: Vec<Class> = out.reqs.iter().map(class).collect();
    let count = |c: Class| classes.iter().filter(|&&x| x == c).count();
    let windows: Vec<(f64, f64)> = out.faults.iter().map(|f| window(f, end_of_run, deadline_s)).collect();
    // Failures, each with the faults that explain it (its node, inside the window).
    let mut failures = Vec::new();
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut unexplained = 0u64;
    for (r, c) in out.reqs.iter().zip(&classes) {
        if !matches!(c, Class::Failed | Class::Hung | Class::Corrupt) {
            continue;
        }
        let (status, why) = match c {
            Class::Hung => ("hung".into(), String::new()),
            Class::Corrupt => {
                let (bad, first) = r.done.iter().flatten().find(|(s, bad, _)| s == "KVSTAGE_OK" && *bad > 0).map(|(_, b, w)| (*b, w.clone())).unwrap_or_default();
                ("corrupt".into(), format!("{bad} bytes differ from the reference; first: {first}"))
            }
            _ => failure(r),
        };
        *by_status.entry(status.clone()).or_default() += 1;
        let explained: Vec<usize> = out.faults.iter().enumerate().filter(|(i, f)| !f.skipped && (touches(r, &f.node)) && overlaps(r, windows[*i])).map(|(i, _)| i).collect();
        if explained.is_empty() {
            unexplained += 1;
        }
        failures.push(json!({
            "id": r.id, "status": status, "why": why, "prefill_node": format!("p{}", r.prefill_node), "decode_node": format!("d{}", r.decode_node),
            "tokens": r.tokens, "arrive_s": r.arrive, "end_s": r.end, "faults": explained,
        }));
    }
    // Per fault: the requests on its node in flight while it lasted (their latency, their
    // failures), the failures its wider window explains, the first failure (how soon the
    // prefill or decode side noticed), and recovery after it.
    let starts: Vec<f64> = out.faults.iter().filter(|f| !f.skipped).map(|f| f.start_s).collect();
    for (i, f) in out.faults.iter_mut().enumerate() {
        if f.skipped {
            continue;
        }
        let next = starts.iter().copied().filter(|&t| t > f.start_s).fold(f64::MAX, f64::min);
        f.failures_until_ms = out
            .reqs
            .iter()
            .zip(&classes)
            .filter(|(r, c)| matches!(c, Class::Failed | Class::Hung | Class::Corrupt) && touches(r, &f.node) && r.end.unwrap_or(end_of_run) >= f.start_s && r.arrive < next)
            .map(|(r, _)| r.end.unwrap_or(end_of_run))
            .max_by(f64::total_cmp)
            .map(|t| (t - f.end_s.unwrap_or(end_of_run)) * 1e3);
        let during = (f.start_s, f.end_s.unwrap_or(end_of_run));
        let mut lat = Vec::new();
        for (r, c) in out.reqs.iter().zip(&classes) {
            if !touches(r, &f.node) {
                continue;
            }
            match c {
                Class::Verified if overlaps(r, during) => {
                    f.completed_in_window += 1;
                    lat.extend(ms(r));
                }
                Class::Failed | Class::Hung | Class::Corrupt if overlaps(r, windows[i]) => {
                    f.failed_in_window += 1;
                    let status = match c {
                        Class::Hung => "hung".into(),
                        Class::Corrupt => "corrupt".into(),
                        _ => failure(r).0,
                    };
                    *f.failures.entry(status).or_default() += 1;
                    let noticed = (r.end.unwrap_or(end_of_run) - f.start_s) * 1e3;
                    f.first_failure_ms = Some(f.first_failure_ms.map_or(noticed, |x: f64| x.min(noticed)));
                }
                _ => {}
            }
        }
        f.latency_ms = latency(lat);
        let dead_peer_s = cli.dead_peer_ms as f64 / 1e3;
        if f.kind == crate::faults::Kind::LinkDown && during.1 - during.0 > dead_peer_s + 1.5 && f.failed_in_window > 0 {
            f.noticed_within_dead_peer = f.first_failure_ms.map(|ms| ms <= (dead_peer_s + 1.5) * 1e3);
        }
        let end = during.1;
        f.recovery_ms = out
            .reqs
            .iter()
            .zip(&classes)
            .filter(|(r, c)| **c == Class::Verified && touches(r, &f.node) && r.sent_at.is_some_and(|s| s >= end))
            .filter_map(|(r, _)| r.end)
            .min_by(f64::total_cmp)
            .map(|t| (t - end) * 1e3);
    }
    // Latency away from every fault: requests in flight in no fault's window (its start to a
    // deadline after its end, the aftermath included).
    let clean: Vec<f64> = out
        .reqs
        .iter()
        .zip(&classes)
        .filter(|(r, c)| **c == Class::Verified && !out.faults.iter().enumerate().any(|(i, f)| !f.skipped && overlaps(r, windows[i])))
        .filter_map(|(r, _)| ms(r))
        .collect();
    let all: Vec<f64> = out.reqs.iter().zip(&classes).filter(|(_, c)| **c == Class::Verified).filter_map(|(r, _)| ms(r)).collect();
    // Leaks: every counter of every rank, summed; fds and threads only where they grew.
    let mut leak_kinds: BTreeMap<&str, i64> = BTreeMap::new();
    for (_, doc) in &out.leaks {
        for (k, key) in [
            ("ring_allocations", "ring_allocations"),
            ("fds", "fds"),
            ("threads", "threads"),
            ("sessions", "sessions"),
            ("connections", "connections"),
            ("rooms", "rooms"),
            ("pages", "pages_held"),
            ("requests_in_flight", "requests_in_flight"),
        ] {
            let v = doc.get(key).and_then(Value::as_i64).unwrap_or(0).max(0);
            *leak_kinds.entry(k).or_default() += v;
        }
    }
    let ranks_total = (cli.prefill_nodes * setup.prefill_tp + cli.decode_nodes * setup.decode_tp) as usize;
    let unanswered = ranks_total.saturating_sub(out.leaks.len()) as i64;
    let leaks: i64 = leak_kinds.values().sum::<i64>() + unanswered;
    let m = &setup.model;
    json!({
        "requests": out.reqs.len(),
        "completed": count(Class::Verified) + count(Class::Corrupt),
        "verified": count(Class::Verified),
        "failed": count(Class::Failed),
        "hung": count(Class::Hung),
        "corrupt": count(Class::Corrupt),
        "rejected": out.rejected.values().sum::<u64>(),
        "rejected_why": out.rejected,
        "leaks": leaks,
        "leak_detail": { "by_kind": leak_kinds, "ranks_unanswered": unanswered, "per_rank": out.leaks.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<BTreeMap<_, _>>() },
        "faults": out.faults,
        "failed_unexplained": unexplained,
        "failures_by_status": by_status,
        "failures": failures,
        "latency_ms": { "all": latency(all), "without_faults": latency(clean) },
        "errors": out.errors,
        "seconds": cli.seconds,
        "elapsed_s": out.elapsed,
        "config": {
            "prefill_nodes": cli.prefill_nodes, "decode_nodes": cli.decode_nodes,
            "prefill_tp": setup.prefill_tp, "decode_tp": setup.decode_tp,
            "rate_per_s": cli.rate, "tokens": [cli.min_tokens, setup.tokens], "page_size": setup.page_size, "chunk_tokens": setup.chunk_tokens,
            "model": { "name": m.name, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "dtype_bytes": m.dtype_bytes },
            "aux_rows": setup.aux_rows, "state_bytes": setup.state_bytes,
            "timeout_ms": cli.timeout_ms, "room_timeout_ms": cli.room_timeout_ms, "dead_peer_ms": cli.dead_peer_ms, "seed": cli.seed,
            "transport": kvstage_testkit::cluster::transport_name(setup.transport),
        },
        "network": link,
    })
}
