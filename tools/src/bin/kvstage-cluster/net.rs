//! The emulated network, as scripts/cluster.sh built it: node namespaces `PREFIX-p0`,
//! `PREFIX-d1`, ..., each with `eth0` joined by a veth pair to the bridge `br0` in `PREFIX-br`,
//! whose end there is `v-p0`, `v-d1`, .... Faults change it with `ip` and `tc` (bounded: each
//! command is killed after 5 s).

use std::process::Command;

pub struct Net {
    pub prefix: String,
    pub subnet: String,
    pub netem: bool,
}

/// Runs `prog args` with a 5 s bound; Err with its stderr.
pub fn run(prog: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new("timeout").args(["-k", "1", "5", prog]).args(args).output().map_err(|e| format!("{prog}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{prog} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Net {
    pub fn node_ns(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    pub fn bridge_ns(&self) -> String {
        format!("{}-br", self.prefix)
    }

    /// The node's address: prefill nodes .11.., decode nodes .101...
    pub fn addr(&self, decode: bool, node: u32) -> String {
        format!("{}.{}", self.subnet, if decode { 101 } else { 11 } + node)
    }

    /// The node's link up or down (its bridge end: the node keeps its address and routes, as
    /// when a cable or a switch port goes).
    pub fn link(&self, node: &str, up: bool) -> Result<(), String> {
        run("ip", &["-n", &self.bridge_ns(), "link", "set", "dev", &format!("v-{node}"), if up { "up" } else { "down" }])
    }

    /// A loss burst on the node's link, both ways: netem's random loss, or without netem a
    /// squeeze of the link (1 Mbit/s, a 16 KB queue: most packets of a transfer dropped).
    pub fn loss(&self, node: &str, pct: f64) -> Result<String, String> {
        let ends = [(self.node_ns(node), "eth0".to_owned()), (self.bridge_ns(), format!("v-{node}"))];
        if self.netem {
            for (ns, dev) in &ends {
                run("tc", &["-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "99:", "netem", "loss", &format!("{pct}%")])?;
            }
            Ok(format!("netem loss {pct}%"))
        } else {
            for (ns, dev) in &ends {
                run("tc", &["-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "99:", "tbf", "rate", "1mbit", "burst", "4kb", "limit", "16kb"])?;
            }
            Ok("no netem here: a squeeze stands in (tbf 1 Mbit/s, 16 KB queue; drops most of a transfer's packets)".to_owned())
        }
    }

    /// Ends a loss burst: the link's qdisc as the script set it (`restore`: the script's
    /// `tc` arguments, or none).
    pub fn restore(&self, node: &str, restore: Option<&str>) -> Result<(), String> {
        let ends = [(self.node_ns(node), "eth0".to_owned()), (self.bridge_ns(), format!("v-{node}"))];
        for (ns, dev) in &ends {
            let _ = run("tc", &["-n", ns, "qdisc", "del", "dev", dev, "root"]);
            if let Some(args) = restore {
                let mut a = vec!["-n", ns.as_str(), "qdisc", "replace", "dev", dev.as_str(), "root", "handle", "99:"];
                a.extend(args.split_whitespace());
                run("tc", &a)?;
            }
        }
        Ok(())
    }
}
