//! Transfer latency of a set of requests: count, p50, p99, max (milliseconds), for the report and
//! each fault's record.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

pub fn latency(mut ms: Vec<f64>) -> Option<Latency> {
    if ms.is_empty() {
        return None;
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| kvstage_tools::quantile(&ms, q);
    Some(Latency { count: ms.len(), p50: at(0.5), p99: at(0.99), max: ms[ms.len() - 1] })
}
