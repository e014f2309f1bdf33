//! Faults on a schedule: `KIND@SECONDS[+DURATION][:NODE]` from the command line, or one of each
//! kind spread over the run. Each fault has a start and an end (when its condition was lifted:
//! the link up again, the process continued, the restarted process ready), logged with times.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Every process of a decode node SIGKILLed, started again after the duration.
    DecodeKill,
    /// The node's link down for the duration.
    LinkDown,
    /// Every process of a prefill node SIGSTOPped, SIGCONTinued after the duration.
    PrefillStop,
    /// A loss burst on the node's link for the duration.
    Loss,
    /// Every decode engine of the node shut down (all its sessions and rooms end) and started
    /// again in its process.
    CloseSessions,
}

impl Kind {
    fn parse(s: &str) -> Result<Kind, String> {
        Ok(match s {
            "decode-kill" => Kind::DecodeKill,
            "link-down" => Kind::LinkDown,
            "prefill-stop" => Kind::PrefillStop,
            "loss" => Kind::Loss,
            "close-sessions" => Kind::CloseSessions,
            other => return Err(format!("unknown fault kind {other:?} (decode-kill, link-down, prefill-stop, loss, close-sessions)")),
        })
    }

    fn default_duration(self) -> f64 {
        match self {
            Kind::DecodeKill => 1.0,
            Kind::LinkDown => 3.0,
            Kind::PrefillStop => 2.0,
            Kind::Loss => 2.0,
            Kind::CloseSessions => 0.0,
        }
    }
}

/// One fault: what, when, for how long, on which node (`p0`, `d1`).
#[derive(Clone, Debug)]
pub struct Plan {
    pub kind: Kind,
    pub at: f64,
    pub duration: f64,
    pub node: String,
}

/// Parses `KIND@SECONDS[+DURATION][:NODE]`.
pub fn parse(spec: &str, prefill_nodes: u32, decode_nodes: u32) -> Result<Plan, String> {
    let (kind, rest) = spec.split_once('@').ok_or_else(|| format!("fault {spec:?}: expected KIND@SECONDS[+DURATION][:NODE]"))?;
    let kind = Kind::parse(kind)?;
    let (time, node) = rest.split_once(':').map_or((rest, None), |(t, n)| (t, Some(n)));
    let (at, duration) = time.split_once('+').map_or((time, None), |(a, d)| (a, Some(d)));
    let num = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| format!("fault {spec:?}: {v:?} is not a number of seconds"));
    let at = num(at)?;
    let duration = duration.map(num).transpose()?.unwrap_or(kind.default_duration());
    let decode_side = match kind {
        Kind::DecodeKill | Kind::CloseSessions => Some(true),
        Kind::PrefillStop => Some(false),
        Kind::LinkDown | Kind::Loss => None,
    };
    let node = node.map(str::to_owned).unwrap_or_else(|| if decode_side == Some(false) { "p0" } else { "d0" }.to_owned());
    let (side, index) = node.split_at(1);
    let index: u32 = index.parse().map_err(|_| format!("fault {spec:?}: node {node:?} is not p<N> or d<N>"))?;
    let decode = match side {
        "d" if index < decode_nodes => true,
        "p" if index < prefill_nodes => false,
        _ => return Err(format!("fault {spec:?}: no node {node:?} (prefill p0..p{}, decode d0..d{})", prefill_nodes.saturating_sub(1), decode_nodes.saturating_sub(1))),
    };
    if decode_side.is_some_and(|d| d != decode) {
        return Err(format!("fault {spec:?}: {kind:?} needs a {} node", if decode_side == Some(true) { "decode" } else { "prefill" }));
    }
    Ok(Plan { kind, at, duration, node })
}

/// One fault of each kind over a run of `seconds`: at 15, 30, 45, 60 and 75 % of it, on
/// alternating nodes.
pub fn default_schedule(seconds: f64, prefill_nodes: u32, decode_nodes: u32) -> Vec<Plan> {
    let d = |i: u32| format!("d{}", i % decode_nodes.max(1));
    let p = |i: u32| format!("p{}", i % prefill_nodes.max(1));
    let plan = |kind: Kind, frac: f64, node: String| Plan { kind, at: seconds * frac, duration: kind.default_duration(), node };
    vec![
        plan(Kind::DecodeKill, 0.15, d(0)),
        plan(Kind::LinkDown, 0.30, d(1)),
        plan(Kind::PrefillStop, 0.45, p(0)),
        plan(Kind::Loss, 0.60, d(0)),
        plan(Kind::CloseSessions, 0.75, d(1)),
    ]
}

/// What happened to one fault (the report's `faults` entries).
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub kind: Kind,
    pub node: String,
    /// Seconds since the run started: when it began, and when its condition was lifted (null
    /// while it lasts).
    pub start_s: f64,
    pub end_s: Option<f64>,
    /// How it was done, or why it was skipped.
    pub how: String,
    pub skipped: bool,
    /// Filled in by the report: requests on the node that failed from the fault's start until a
    /// transfer deadline (and a second) after its end, by status; requests on the node in
    /// flight while it lasted that completed verified, and their transfer latency.
    pub failed_in_window: u64,
    pub failures: std::collections::BTreeMap<String, u64>,
    pub completed_in_window: u64,
    pub latency_ms: Option<crate::latency::Latency>,
    /// From the fault's start until the first request it failed ended (how soon the failure
    /// was noticed).
    pub first_failure_ms: Option<f64>,
    /// A link down for longer than the dead-peer time: whether its first failure came within
    /// the dead-peer time and 1.5 s (the prefill side noticed the vanished peer in time); null
    /// for other faults, and for a link down shorter than that (its sessions may survive it).
    pub noticed_within_dead_peer: Option<bool>,
    /// From the fault's end until the last failed request on the node that ended after the
    /// fault's start (and arrived before the next fault's start) ended: how long the fault kept costing
    /// requests (null: none failed; negative: the last one ended before the fault did).
    pub failures_until_ms: Option<f64>,
    /// From the fault's end until the first request on the node sent after it completed
    /// verified (the node serves again; failures may go on: see `failures_until_ms`).
    pub recovery_ms: Option<f64>,
}
