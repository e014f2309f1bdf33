//! The rank processes, seen from the router: started in their node's network namespace
//! (`ip netns exec`, which execs, so the process id is the rank's own), their stdout read line by
//! line into one channel, their stderr (the library's log) into a file per rank; killed when
//! dropped, and dying with the router (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Sender;

use kvstage::{Error, Result};

/// Which process: prefill or decode, node, rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId {
    pub decode: bool,
    pub node: u32,
    pub rank: u32,
}

impl RankId {
    pub fn node_name(&self) -> String {
        format!("{}{}", if self.decode { "d" } else { "p" }, self.node)
    }
}

impl std::fmt::Display for RankId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}r{}", self.node_name(), self.rank)
    }
}

/// A line from a rank (`None`: its stdout closed: it exited), tagged with the incarnation it came
/// from (a restarted rank's old lines are told apart).
pub struct Msg {
    pub from: RankId,
    pub incarnation: u32,
    pub line: Option<String>,
}

pub struct RankProc {
    child: Child,
    stdin: ChildStdin,
}

impl RankProc {
    /// Starts `exe args` (inside namespace `netns` when given); its lines go to `tx`.
    pub fn spawn(id: RankId, incarnation: u32, netns: Option<&str>, exe: &std::path::Path, args: &[String], log: &std::path::Path, tx: Sender<Msg>) -> Result<RankProc> {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| Error::internal(format!("cannot open {}", log.display())).with_source(e))?;
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::from(log)).env("KVSTAGE_LOG", "info");
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| Error::internal(format!("cannot start rank {id}")).with_source(e))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        std::thread::Builder::new()
            .name(format!("read-{id}"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(Msg { from: id, incarnation, line: Some(line) }).is_err() {
                        return;
                    }
                }
                let _ = tx.send(Msg { from: id, incarnation, line: None });
            })
            .map_err(|e| Error::internal("cannot start a reader thread").with_source(e))?;
        Ok(RankProc { child, stdin })
    }

    /// Sends one command line (a dead process's pipe fails quietly: its EOF tells the router).
    pub fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child (not yet reaped: `wait` only after it).
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Asks it to quit, then kills it after `grace`.
    pub fn stop(mut self, grace: std::time::Duration) {
        self.signal(libc::SIGCONT);
        self.send("quit");
        let until = std::time::Instant::now() + grace;
        while std::time::Instant::now() < until {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
