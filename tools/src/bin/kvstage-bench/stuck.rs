//! `--stuck-peer`: what a decode peer that stops reading costs the other sessions of its
//! prefill engine, and how the stuck request looks from both sides (its operation's and its
//! decode room's describe documents; the prefill side's stall WARN goes to stderr).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvstage::engine::{EngineOptions, StallWarn};
use kvstage::geometry;
use kvstage::session::notify::Completion;
use kvstage::session::sender::describe::describe_op;
use kvstage::session::op::Op;
use kvstage::session::sender::TransferDesc;
use kvstage::{Error, Status};
use kvstage_testkit::cluster::{DecodeChild, Prefill, Setup};
use serde::Serialize;

use crate::report::ratio;
use crate::{prefill_options, spawn_child, Args};

/// One session's figures in a stuck-peer phase.
#[derive(Clone, Debug, Default)]
struct SessionRate {
    name: String,
    rank: u32,
    decode: u32,
    /// Bytes of transfers that ended OK inside the window.
    bytes: u64,
    ok: u64,
    failed: u64,
}

/// `--stuck-peer`: three phases on fresh processes, each `--stuck-seconds` long after a warmup.
/// Every session keeps `--inflight` chunk transfers of its own in flight (a fresh room each; a
/// new one whenever one ends, signalled through the engines' completion callbacks); the second
/// phase sends nothing to one decode rank that a prefill engine with more than one session feeds,
/// the third makes that rank stop reading (fault injection in the decode process). Compared: each
/// other session's rate with the stuck peer against the healthy run (the target) and against the
/// silent one (what the stuck peer costs beyond its own traffic).
pub fn stuck_peer(a: &Args) -> Result<(String, StuckJson), Error> {
    let s = &a.setup;
    let Some(victim) = (0..s.prefill_tp).find(|&r| s.targets(r).len() > 1) else {
        return Err(Error::invalid_arg(
            "--stuck-peer",
            "needs a prefill rank that feeds more than one decode rank (e.g. --prefill-tp 2 --decode-tp 4, or an MLA model)",
        ));
    };
    let stuck_rank = *s.targets(victim).last().expect("more than one target");
    let bar = kvstage_tools::progress(3);
    bar.set_message("healthy");
    let (healthy, _) = stuck_phase(a, None, None)?;
    bar.inc(1);
    bar.set_message("silent peer");
    let (idle, _) = stuck_phase(a, None, Some(stuck_rank))?;
    bar.inc(1);
    bar.set_message("stuck peer");
    let (stuck, described) = stuck_phase(a, Some(stuck_rank), None)?;
    bar.finish_and_clear();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "stuck peer: decode rank {stuck_rank} stops reading (fed by prefill rank {victim}); {} transfers in flight per session, {:.1} s windows, chunk share {} bytes",
        a.inflight,
        a.stuck_seconds,
        chunk_share(s, 0, s.targets(0)[0])?
    );
    let _ = writeln!(
        text,
        "{:<10} {:>12} {:>12} {:>12} {:>8} {:>10} {:>10} {:>11}",
        "session", "healthy GB/s", "silent GB/s", "stuck GB/s", "ratio", "vs silent", "ok/failed", "same engine"
    );
    let mut worst_sibling = f64::INFINITY;
    let mut rows = Vec::new();
    for ((h, i), t) in healthy.iter().zip(&idle).zip(&stuck) {
        let rate = |r: &SessionRate| r.bytes as f64 / a.stuck_seconds / 1e9;
        let (hr, ir, tr) = (rate(h), rate(i), rate(t));
        let is_stuck = t.decode == stuck_rank;
        let sibling = t.rank == victim && !is_stuck;
        if sibling {
            worst_sibling = worst_sibling.min(ratio(tr, hr));
        }
        let _ = writeln!(
            text,
            "{:<10} {:>12.3} {:>12.3} {:>12.3} {:>7.2}x {:>9.2}x {:>10} {:>11}",
            t.name,
            hr,
            ir,
            tr,
            ratio(tr, hr),
            ratio(tr, ir),
            format!("{}/{}", t.ok, t.failed),
            if is_stuck { "stuck" } else if sibling { "yes" } else { "no" }
        );
        rows.push(SessionJson {
            session: t.name.clone(),
            prefill_rank: t.rank,
            decode_rank: t.decode,
            stuck: is_stuck,
            same_engine_as_stuck: sibling,
            healthy_gbps: hr,
            silent_peer_gbps: ir,
            stuck_phase_gbps: tr,
            ratio: ratio(tr, hr),
            ratio_vs_silent: ratio(tr, ir),
            ok: t.ok,
            failed: t.failed,
        });
    }
    let met = worst_sibling >= 0.8;
    let _ = writeln!(
        text,
        "the other sessions of prefill engine {victim} keep {:.0}% of their rate at worst (target >= 80%): {}",
        worst_sibling * 100.0,
        if met { "met" } else { "missed" }
    );
    if let Some(d) = &described {
        let _ = writeln!(
            text,
            "the oldest stuck request (room {}), as its prefill operation describes itself (kvstage_op_describe):\n{}\nand as the stuck decode rank describes its room (kvstage_room_describe):\n{}",
            d.room, d.op, d.decode_room
        );
    }
    let json = StuckJson {
        stuck_request: described,
        stuck_peer: StuckPeer {
            stuck_decode_rank: stuck_rank,
            prefill_rank: victim,
            inflight_per_session: a.inflight,
            window_s: a.stuck_seconds,
            worst_sibling_ratio: worst_sibling,
            met,
            sessions: rows,
        },
    };
    Ok((text, json))
}

/// The `--json` report of `--stuck-peer`.
#[derive(Serialize)]
pub struct StuckJson {
    stuck_peer: StuckPeer,
    /// The oldest request still in flight to the stuck rank at the end of the stuck window.
    stuck_request: Option<StuckRequest>,
}

/// A stuck request as both sides describe it.
#[derive(Serialize)]
struct StuckRequest {
    room: u64,
    op: serde_json::Value,
    decode_room: serde_json::Value,
}

#[derive(Serialize)]
struct StuckPeer {
    stuck_decode_rank: u32,
    prefill_rank: u32,
    inflight_per_session: u32,
    window_s: f64,
    worst_sibling_ratio: f64,
    met: bool,
    sessions: Vec<SessionJson>,
}

#[derive(Serialize)]
struct SessionJson {
    session: String,
    prefill_rank: u32,
    decode_rank: u32,
    stuck: bool,
    same_engine_as_stuck: bool,
    healthy_gbps: f64,
    silent_peer_gbps: f64,
    stuck_phase_gbps: f64,
    ratio: f64,
    ratio_vs_silent: f64,
    ok: u64,
    failed: u64,
}

/// Bytes prefill rank `rs` sends decode rank `rd` for one chunk (its writer's share).
fn chunk_share(s: &Setup, rs: u32, rd: u32) -> Result<u64, Error> {
    let src = s.model.shape(s.page_size, rs, s.prefill_tp);
    let dst = s.model.shape(s.page_size, rd, s.decode_tp);
    let tokens = (s.grid_pages().min(s.pages()) as u32) * s.page_size;
    let region = geometry::staging_layout(&src, &dst, tokens)?.region_of(&src)?;
    Ok(region.ok_or_else(|| Error::internal(format!("prefill rank {rs} writes nothing to decode rank {rd}")))?.bytes)
}

/// One phase of `--stuck-peer`: every session's transfers that ended inside the window. With
/// `silent`, the sessions to that decode rank send nothing (the baseline without the peer's load).
fn stuck_phase(a: &Args, stuck_rank: Option<u32>, silent: Option<u32>) -> Result<(Vec<SessionRate>, Option<StuckRequest>), Error> {
    let s = &a.setup;
    let mut child = spawn_child(a, stuck_rank)?;
    // Stalls are reported inside the window.
    let options = EngineOptions { stall_warn: StallWarn::After(Duration::from_secs_f64(a.stuck_seconds / 2.0)), ..prefill_options(a) };
    let prefill = Prefill::connect_with(s, &child.addrs, &options)?;
    // Every session: (prefill rank, decode rank, session).
    let mut sessions = Vec::new();
    for r in &prefill.ranks {
        for (session, rd) in r.sessions.iter().zip(s.targets(r.rank)) {
            sessions.push((r.rank, rd, session.clone()));
        }
    }
    let (tx, rx) = mpsc::channel::<(u64, Status, Instant)>();
    for r in &prefill.ranks {
        let tx = tx.clone();
        r.engine.completions().set_callback(Some(Arc::new(move |c: &Completion| {
            if let Completion::Op { tag, status, .. } = c {
                let _ = tx.send((*tag, *status, Instant::now()));
            }
        })));
    }
    drop(tx);
    let shares: Vec<u64> = sessions.iter().map(|(rs, rd, _)| chunk_share(s, *rs, *rd)).collect::<Result<_, _>>()?;
    let pages: Vec<Vec<u32>> = prefill.ranks.iter().map(|r| s.prefill_pages(r.rank)[..s.grid_pages().min(s.pages())].to_vec()).collect();
    let mut rates: Vec<SessionRate> = sessions
        .iter()
        .map(|(rs, rd, _)| SessionRate { name: format!("p{rs}-d{rd}"), rank: *rs, decode: *rd, ..Default::default() })
        .collect();
    // A stuck transfer holds its workers past the window; the teardown ends it.
    let timeout = Duration::from_secs_f64(a.stuck_seconds * 3.0 + 30.0);
    let mut room = 0u64;
    let mut ops = HashMap::new();
    let submit = |i: usize, child: &mut DecodeChild, room: &mut u64, ops: &mut HashMap<u64, (usize, Arc<Op>)>| -> Result<(), Error> {
        *room += 1;
        let keys = child.open_room(*room, None)?;
        let (rs, rd, session) = &sessions[i];
        let desc = TransferDesc { room: keys.at(*rd), chunk: 0, pages: pages[*rs as usize].clone(), timeout: Some(timeout), ..Default::default() };
        let op = session.transfer_async(desc, false, ((i as u64) << 40) | *room)?;
        ops.insert(*room, (i, op));
        Ok(())
    };
    for i in (0..sessions.len()).filter(|&i| Some(sessions[i].1) != silent) {
        for _ in 0..a.inflight.max(1) {
            submit(i, &mut child, &mut room, &mut ops)?;
        }
    }
    let warm = Duration::from_secs_f64((a.stuck_seconds / 5.0).clamp(0.5, 3.0));
    let start = Instant::now();
    let (from, to) = (start + warm, start + warm + Duration::from_secs_f64(a.stuck_seconds));
    while Instant::now() < to {
        let Ok((tag, status, at)) = rx.recv_timeout(to.saturating_duration_since(Instant::now())) else { continue };
        let (i, done_room) = ((tag >> 40) as usize, tag & ((1 << 40) - 1));
        ops.remove(&done_room);
        if at >= from && at < to {
            if status == Status::KVSTAGE_OK {
                rates[i].bytes += shares[i];
                rates[i].ok += 1;
            } else {
                rates[i].failed += 1;
            }
        }
        submit(i, &mut child, &mut room, &mut ops)?;
    }
    let described = match stuck_rank {
        Some(sr) => describe_stuck(&mut child, &sessions, &ops, sr)?,
        None => None,
    };
    // Teardown: the prefill engines end their sessions (the stuck transfers fail at once).
    drop(prefill);
    drop(ops);
    child.quit()?;
    Ok((rates, described))
}

/// The oldest request in flight to decode rank `stuck`, described by its operation and by that
/// decode rank.
fn describe_stuck(
    child: &mut DecodeChild,
    sessions: &[(u32, u32, Arc<kvstage::session::sender::SenderSession>)],
    ops: &HashMap<u64, (usize, Arc<Op>)>,
    stuck: u32,
) -> Result<Option<StuckRequest>, Error> {
    let Some((&room, (_, op))) = ops.iter().filter(|(_, (i, _))| sessions[*i].1 == stuck).min_by_key(|(room, _)| **room) else {
        return Ok(None);
    };
    let json = |text: &str| serde_json::from_str(text).map_err(|e| Error::internal("a describe document does not parse").with_source(e));
    let op = describe_op(op).map(|d| serde_json::to_value(d).expect("serializable")).unwrap_or_default();
    let decode_room = json(&child.describe_room(room, stuck)?)?;
    Ok(Some(StuckRequest { room, op, decode_room }))
}

