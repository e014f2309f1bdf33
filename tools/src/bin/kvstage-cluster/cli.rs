//! The command line: the geometry both sides share (the tools' `SetupArgs`), the cluster's shape,
//! the load, the network, the faults, and the hidden role flags of a rank process.

use clap::Parser;
use kvstage_tools::SetupArgs;

/// The defaults this tool gives the shared geometry flags: a small model (so that a 2-core
/// machine runs several nodes), prefill TP 2 into decode TP 1, chunks of 256 tokens, whole
/// requests (two aux rows and 4 KiB of state each).
pub const SETUP_DEFAULTS: &[(&str, &str)] = &[
    ("model", "llama3-8b"),
    ("layers", "8"),
    ("head_dim", "64"),
    ("prefill_tp", "2"),
    ("decode_tp", "1"),
    ("tokens", "1024"),
    ("chunk_tokens", "256"),
    ("ring_chunks", "8"),
    ("aux_rows", "2"),
    ("state_bytes", "4096"),
];
pub const DEFAULT_MODEL: &str = "llama3-8b";

/// A cluster on one machine: P prefill nodes and D decode nodes, one process per rank, each
/// node in a network namespace of its own (scripts/cluster.sh sets them up) or all on loopback;
/// requests arrive as a Poisson process, faults follow a schedule, every decode byte is checked.
#[derive(Parser, Debug)]
#[command(name = "kvstage-cluster")]
pub struct Cli {
    #[command(flatten)]
    pub setup: SetupArgs,
    /// Prefill nodes (each runs one process per prefill rank).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub prefill_nodes: u32,
    /// Decode nodes (each runs one process per decode rank).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub decode_nodes: u32,
    /// Requests per second (Poisson arrivals).
    #[arg(long, value_name = "PER_S", default_value_t = 8.0)]
    pub rate: f64,
    /// Seconds of arrivals (then the run drains and checks for leaks).
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    pub seconds: f64,
    /// Smallest request in tokens (the largest is `--tokens`); sizes are drawn uniformly in whole
    /// pages.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub min_tokens: u32,
    /// Pages of each rank's KV pool (requests in flight on a rank share them).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub pool_pages: u32,
    /// A transfer's deadline (each chunk's `timeout`), milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Decode rooms' `room_timeout`, milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 15_000)]
    pub room_timeout_ms: u64,
    /// Every engine's `dead_peer_timeout`, milliseconds (the library's default: 15000).
    #[arg(long, value_name = "MS", default_value_t = 15_000)]
    pub dead_peer_ms: u64,
    /// Seed of the arrivals, sizes and routes.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A fault, repeatable: `KIND@SECONDS[+DURATION][:NODE]`, KIND one of decode-kill (SIGKILL,
    /// restarted after DURATION), link-down, prefill-stop (SIGSTOP, SIGCONT after DURATION),
    /// loss (a loss burst), close-sessions (a decode engine shut down and started again in its
    /// process); NODE `p0`, `d1`, .... Without any: one of each kind spread over the run.
    #[arg(long = "fault", value_name = "SPEC")]
    pub faults: Vec<String>,
    /// No faults at all.
    #[arg(long)]
    pub no_faults: bool,
    /// Loss of a loss burst, percent (netem; without netem a rate squeeze stands in).
    #[arg(long, value_name = "PCT", default_value_t = 20.0)]
    pub loss_burst_pct: f64,
    /// Network namespaces PREFIX-p0.., PREFIX-d0.. and the bridge's PREFIX-br, made by
    /// scripts/cluster.sh; without it every node runs on loopback (no link faults).
    #[arg(long, value_name = "PREFIX")]
    pub netns: Option<String>,
    /// First three octets of the nodes' addresses (with --netns).
    #[arg(long, value_name = "A.B.C", default_value = "10.43.0")]
    pub subnet: String,
    /// `tc netem` works here (scripts/cluster.sh found out): loss bursts use it.
    #[arg(long)]
    pub netem: bool,
    /// The qdisc scripts/cluster.sh put on every link (`tc` arguments after `root handle 99:`,
    /// e.g. `netem delay 2ms 1ms rate 1gbit`): in the report, and put back after a loss burst.
    #[arg(long, value_name = "TC_ARGS")]
    pub link_qdisc: Option<String>,
    /// Where the rank processes' stderr (the library's log) goes.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<String>,
    /// Writes the JSON report here (`-`: stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Writes a PNG plot here: each request's transfer latency at its arrival time, fault
    /// windows shaded (see docs/CLUSTER.md for the legend).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<String>,
    /// Checks the checker: decode ranks compare every Nth request with another request's
    /// reference, so the run must report exactly those as corrupt (and fail).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub selftest_wrong_reference: u64,
    /// Rank process role (internal).
    #[arg(long, hide = true)]
    pub role: Option<String>,
    /// Rank process: node index and rank (internal).
    #[arg(long, hide = true, default_value_t = 0)]
    pub node: u32,
    #[arg(long, hide = true, default_value_t = 0)]
    pub rank: u32,
    /// Rank process: address to listen on (internal).
    #[arg(long, hide = true, default_value = "127.0.0.1:0")]
    pub listen: String,
}

impl Cli {
    /// The flags a rank process gets besides the setup's.
    pub fn rank_flags(&self, role: &str, node: u32, rank: u32, listen: &str) -> Vec<String> {
        [
            ("--role", role.to_owned()),
            ("--node", node.to_string()),
            ("--rank", rank.to_string()),
            ("--listen", listen.to_owned()),
            ("--pool-pages", self.pool_pages.to_string()),
            ("--timeout-ms", self.timeout_ms.to_string()),
            ("--room-timeout-ms", self.room_timeout_ms.to_string()),
            ("--dead-peer-ms", self.dead_peer_ms.to_string()),
            ("--selftest-wrong-reference", self.selftest_wrong_reference.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }
}
