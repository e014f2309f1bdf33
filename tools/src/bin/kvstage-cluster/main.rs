//! kvstage-cluster: a cluster on one machine where nodes die and nothing is lost (issue 43).
//! See docs/CLUSTER.md. Files: `cli` (flags), `router` (the run: processes, bootstrap, arrivals,
//! faults), `prefill` and `decode` (the rank processes), `proto` (their line protocol), `nodes`
//! (starting and signalling them), `net` (ip/tc on the namespaces), `faults` (the schedule),
//! `report` (the JSON), `latency` (its percentiles), `plot` (the PNG), `pages`, `procfs`, `rng`.

mod cli;
mod decode;
mod faults;
mod latency;
mod net;
mod nodes;
mod pages;
mod plot;
mod prefill;
mod procfs;
mod proto;
mod report;
mod rng;
mod router;

use cli::{Cli, DEFAULT_MODEL, SETUP_DEFAULTS};
use kvstage_tools::{parse_with_defaults, usage_error, write_json};

fn main() {
    let cli: Cli = parse_with_defaults(SETUP_DEFAULTS);
    let setup = cli.setup.setup(DEFAULT_MODEL).unwrap_or_else(|e| usage_error::<Cli>(e));
    if let Some(role) = cli.role.as_deref() {
        procfs::die_with_parent();
        let r = match role {
            "decode" => decode::run(&cli, setup),
            "prefill" => prefill::run(&cli, setup),
            other => usage_error::<Cli>(format!("--role {other:?}")),
        };
        if let Err(e) = r {
            eprintln!("kvstage-cluster ({role} {}r{}): {}", cli.node, cli.rank, e.chain());
            std::process::exit(1);
        }
        std::process::exit(0);
    }
    if cli.prefill_nodes == 0 || cli.decode_nodes == 0 || cli.rate <= 0.0 || cli.min_tokens > setup.tokens {
        usage_error::<Cli>("--prefill-nodes and --decode-nodes must be positive, --rate above 0, --min-tokens at most --tokens");
    }
    procfs::name_thread(c"cluster-router");
    let link = serde_json::json!({
        "namespaces": cli.netns.is_some(),
        "netem": cli.netem,
        "link_qdisc": cli.link_qdisc,
        "loss_burst": if cli.netem { format!("netem loss {}%", cli.loss_burst_pct) } else { "no netem: a tbf squeeze (1 Mbit/s, 16 KB queue) stands in".to_owned() },
    });
    let mut out = match router::run(&cli, &setup) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("kvstage-cluster: {}", e.chain());
            std::process::exit(1);
        }
    };
    let doc = report::build(&cli, &setup, &mut out, link);
    if let Some(path) = cli.plot.as_deref() {
        let png = plot::draw(&report::points(&out), &out.faults, out.elapsed.max(cli.seconds));
        if let Err(e) = std::fs::write(path, png) {
            eprintln!("kvstage-cluster: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
    let text = kvstage_tools::json(&doc);
    match cli.json.as_deref() {
        Some("-") | None => print!("{text}"),
        Some(path) => {
            if let Err(e) = write_json(path, &doc) {
                eprintln!("kvstage-cluster: {}", e.chain());
                std::process::exit(1);
            }
        }
    }
    let n = |k: &str| doc.get(k).and_then(serde_json::Value::as_i64).unwrap_or(-1);
    eprintln!(
        "kvstage-cluster: {} requests: {} verified, {} failed, {} hung, {} corrupt, {} rejected; leaks {}",
        n("requests"),
        n("verified"),
        n("failed"),
        n("hung"),
        n("corrupt"),
        n("rejected"),
        n("leaks")
    );
    if n("hung") != 0 || n("corrupt") != 0 || n("leaks") != 0 {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::faults::{self, Kind};

    #[test]
    fn command_line() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn fault_specs() {
        let f = faults::parse("link-down@12.5+3:p1", 2, 2).unwrap();
        assert_eq!((f.kind, f.at, f.duration, f.node.as_str()), (Kind::LinkDown, 12.5, 3.0, "p1"));
        let f = faults::parse("decode-kill@4", 2, 2).unwrap();
        assert_eq!((f.kind, f.duration, f.node.as_str()), (Kind::DecodeKill, 1.0, "d0"));
        assert!(faults::parse("prefill-stop@3:d0", 2, 2).unwrap_err().contains("prefill node"));
        assert!(faults::parse("loss@3:d2", 2, 2).unwrap_err().contains("no node"));
        assert!(faults::parse("flood@3", 2, 2).is_err());
        let kinds: Vec<Kind> = faults::default_schedule(60.0, 2, 2).iter().map(|p| p.kind).collect();
        assert_eq!(kinds, [Kind::DecodeKill, Kind::LinkDown, Kind::PrefillStop, Kind::Loss, Kind::CloseSessions]);
    }
}
