//! A run's phases: every rank started and ready, arrivals and faults on their schedule, the drain
//! (every request ends or is hung), then the leak check of every rank.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvstage::{Error, Result};
use kvstage_testkit::cluster::Setup;

use super::{Outcome, Router};
use crate::cli::Cli;
use crate::faults::{self, Plan};
use crate::net::Net;
use crate::nodes::RankId;
use crate::rng::Rng;

pub fn run(cli: &Cli, setup: &Setup) -> Result<Outcome> {
    let exe = std::env::current_exe().map_err(|e| Error::internal("current_exe").with_source(e))?;
    let logs = PathBuf::from(cli.log_dir.clone().unwrap_or_else(|| format!("/tmp/kvstage-cluster-{}", std::process::id())));
    std::fs::create_dir_all(&logs).map_err(|e| Error::internal(format!("cannot create {}", logs.display())).with_source(e))?;
    let mut plans: Vec<Plan> = if cli.no_faults {
        Vec::new()
    } else if cli.faults.is_empty() {
        faults::default_schedule(cli.seconds, cli.prefill_nodes, cli.decode_nodes)
    } else {
        cli.faults.iter().map(|s| faults::parse(s, cli.prefill_nodes, cli.decode_nodes)).collect::<std::result::Result<_, _>>().map_err(|e| Error::invalid_arg("--fault", e))?
    };
    plans.sort_by(|a, b| a.at.total_cmp(&b.at));
    let (tx, rx) = mpsc::channel();
    let mut r = Router {
        cli,
        setup,
        exe,
        setup_flags: setup.flags(),
        logs: logs.clone(),
        net: cli.netns.as_ref().map(|p| Net { prefix: p.clone(), subnet: cli.subnet.clone(), netem: cli.netem }),
        tx,
        procs: BTreeMap::new(),
        ready: BTreeMap::new(),
        addrs: HashMap::new(),
        incarnations: HashMap::new(),
        reqs: Vec::new(),
        open: HashMap::new(),
        busy: HashMap::new(),
        rejected: BTreeMap::new(),
        faults: Vec::new(),
        active: Vec::new(),
        leaks: Vec::new(),
        errors: Vec::new(),
        t0: Instant::now(),
    };
    r.log(&format!("logs of the rank processes in {}", logs.display()));
    for decode in [true, false] {
        let nodes = if decode { cli.decode_nodes } else { cli.prefill_nodes };
        for node in 0..nodes {
            for id in r.ranks_of(decode, node) {
                r.spawn(id)?;
            }
        }
    }
    // Every rank ready within 30 s.
    let start_by = r.now() + 30.0;
    while r.ready.values().any(|&x| !x) {
        if r.now() > start_by {
            let late: Vec<String> = r.ready.iter().filter(|(_, &x)| !x).map(|(id, _)| id.to_string()).collect();
            return Err(Error::internal(format!("ranks {} did not start within 30 s (logs in {})", late.join(", "), logs.display())));
        }
        let until = r.now() + 0.1;
        r.pump(&rx, until);
    }
    r.t0 = Instant::now();
    r.log(&format!("all {} rank processes ready; {} s of arrivals at {} per s", r.procs.len(), cli.seconds, cli.rate));
    let mut rng = Rng::new(cli.seed);
    let hung_after = (cli.timeout_ms + cli.room_timeout_ms) as f64 / 1e3 + 15.0;
    let mut next_arrival = rng.exp_gap(cli.rate);
    let mut plan_at = 0;
    while r.now() < cli.seconds {
        let next_fault = plans.get(plan_at).map_or(f64::MAX, |p| p.at);
        let until = next_arrival.min(next_fault).min(cli.seconds);
        r.pump(&rx, until);
        let now = r.now();
        if now >= next_fault {
            r.start_fault(plans[plan_at].clone());
            plan_at += 1;
        }
        if now >= next_arrival && now < cli.seconds {
            r.arrive(&mut rng);
            next_arrival += rng.exp_gap(cli.rate);
        }
        r.mark_hung(hung_after);
    }
    r.log(&format!("arrivals over: {} requests, {} still in flight; draining", r.reqs.len(), r.open.len()));
    // Drain: faults still scheduled to lift do so on time; every request ends or is hung.
    let drain_by = r.now() + hung_after + 1.0;
    while !r.open.is_empty() && r.now() < drain_by {
        let until = r.now() + 0.2;
        r.pump(&rx, until);
        r.mark_hung(hung_after);
    }
    r.lift_all();
    // A restarted rank must be up before the leak check.
    let up_by = r.now() + 30.0;
    while r.ready.values().any(|&x| !x) && r.now() < up_by {
        let until = r.now() + 0.1;
        r.pump(&rx, until);
    }
    r.mark_hung(0.0);
    let elapsed = r.now();
    // Leaks: the prefill ranks close their sessions first, then the decode ranks report.
    for decode in [false, true] {
        let ids: Vec<RankId> = r.procs.keys().copied().filter(|id| id.decode == decode).collect();
        let want = r.leaks.len() + ids.len();
        for id in &ids {
            r.send_to(*id, "leaks");
        }
        let by = r.now() + 25.0;
        while r.leaks.len() < want && r.now() < by {
            let until = r.now() + 0.1;
            r.pump(&rx, until);
        }
        if r.leaks.len() < want {
            r.errors.push(format!("{} {} ranks did not answer the leak check", want - r.leaks.len(), if decode { "decode" } else { "prefill" }));
        }
    }
    let procs = std::mem::take(&mut r.procs);
    for (_, p) in procs {
        p.stop(Duration::from_secs(5));
    }
    Ok(Outcome { reqs: r.reqs, rejected: r.rejected, faults: r.faults, leaks: r.leaks, errors: r.errors, elapsed })
}
