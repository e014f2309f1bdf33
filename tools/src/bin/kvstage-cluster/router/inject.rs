//! The router's faults: each started on its schedule, lifted when its time comes, and ended when
//! the node serves again (a restarted or reopened decode rank says it is ready).

use super::{node_of, Active, Router};
use crate::faults::{Kind, Plan, Record};
use crate::nodes::RankId;
use std::collections::BTreeMap;

impl Router<'_> {
    pub(super) fn start_fault(&mut self, plan: Plan) {
        let now = self.now();
        let (_, node) = node_of(&plan.node);
        let how;
        let mut skipped = false;
        let mut waiting = 0;
        match plan.kind {
            Kind::DecodeKill => {
                for r in self.ranks_of(true, node) {
                    if let Some(p) = self.procs.get(&r) {
                        p.signal(libc::SIGKILL);
                    }
                    self.ready.insert(r, false);
                }
                how = format!("SIGKILL to every rank process of {}, started again after {} s", plan.node, plan.duration);
                waiting = self.setup.decode_tp as usize;
            }
            Kind::PrefillStop => {
                for r in self.ranks_of(false, node) {
                    if let Some(p) = self.procs.get(&r) {
                        p.signal(libc::SIGSTOP);
                    }
                }
                how = format!("SIGSTOP to every rank process of {}, SIGCONT after {} s", plan.node, plan.duration);
            }
            Kind::LinkDown | Kind::Loss => match &self.net {
                None => {
                    skipped = true;
                    how = "skipped: no network namespaces (loopback run)".into();
                }
                Some(net) => {
                    let r = if plan.kind == Kind::LinkDown {
                        net.link(&plan.node, false).map(|()| format!("v-{} down in the bridge namespace for {} s", plan.node, plan.duration))
                    } else {
                        net.loss(&plan.node, self.cli.loss_burst_pct).map(|h| format!("{h} for {} s", plan.duration))
                    };
                    match r {
                        Ok(h) => how = h,
                        Err(e) => {
                            skipped = true;
                            how = format!("skipped: {e}");
                        }
                    }
                }
            },
            Kind::CloseSessions => {
                for r in self.ranks_of(true, node) {
                    self.send_to(r, "close-all");
                }
                how = format!("every decode engine of {} shut down and started again in its process", plan.node);
                waiting = self.setup.decode_tp as usize;
            }
        }
        self.log(&format!("fault {:?} on {}: {how}", plan.kind, plan.node));
        self.faults.push(Record {
            kind: plan.kind,
            node: plan.node.clone(),
            start_s: now,
            end_s: if skipped { Some(now) } else { None },
            how,
            skipped,
            failed_in_window: 0,
            failures: BTreeMap::new(),
            completed_in_window: 0,
            latency_ms: None,
            first_failure_ms: None,
            noticed_within_dead_peer: None,
            failures_until_ms: None,
            recovery_ms: None,
        });
        if !skipped {
            let lift_at = now + if plan.kind == Kind::CloseSessions { 0.0 } else { plan.duration };
            self.active.push(Active { plan, record: self.faults.len() - 1, lift_at, lifted: false, waiting });
        }
    }

    /// Lifts faults whose time came.
    pub(super) fn lift_due(&mut self) {
        let now = self.now();
        for i in 0..self.active.len() {
            let a = &self.active[i];
            if a.lifted || now < a.lift_at || a.plan.kind == Kind::CloseSessions {
                continue;
            }
            let plan = a.plan.clone();
            let (_, node) = node_of(&plan.node);
            self.active[i].lifted = true;
            let mut end_now = true;
            match plan.kind {
                Kind::DecodeKill => {
                    for r in self.ranks_of(true, node) {
                        if let Err(e) = self.spawn(r) {
                            self.errors.push(format!("restart of {r}: {}", e.chain()));
                        }
                    }
                    end_now = false; // ends when every rank is ready again
                    self.log(&format!("restarting {}", plan.node));
                }
                Kind::PrefillStop => {
                    for r in self.ranks_of(false, node) {
                        if let Some(p) = self.procs.get(&r) {
                            p.signal(libc::SIGCONT);
                        }
                    }
                }
                Kind::LinkDown => {
                    if let Some(Err(e)) = self.net.as_ref().map(|n| n.link(&plan.node, true)) {
                        self.errors.push(e);
                    }
                }
                Kind::Loss => {
                    if let Some(Err(e)) = self.net.as_ref().map(|n| n.restore(&plan.node, self.cli.link_qdisc.as_deref())) {
                        self.errors.push(e);
                    }
                }
                Kind::CloseSessions => {}
            }
            if end_now {
                let rec = self.active[i].record;
                self.faults[rec].end_s = Some(now);
                self.log(&format!("fault {:?} on {} lifted", plan.kind, plan.node));
            }
        }
    }

    /// A rank reported ready (after a restart) or closed-all: ends the fault waiting on it.
    pub(super) fn fault_progress(&mut self, from: RankId, what: &str) {
        let now = self.now();
        for a in self.active.iter_mut() {
            let kind_matches = match what {
                "ready" => a.plan.kind == Kind::DecodeKill && a.lifted,
                _ => a.plan.kind == Kind::CloseSessions,
            };
            if !kind_matches || a.waiting == 0 || node_of(&a.plan.node) != (from.decode, from.node) {
                continue;
            }
            a.waiting -= 1;
            if a.waiting == 0 {
                a.lifted = true;
                self.faults[a.record].end_s = Some(now);
                eprintln!("[{now:8.3}] fault {:?} on {} ended", a.plan.kind, a.plan.node);
            }
        }
    }

    /// Every fault lifted (at the end of the run, whatever their schedule said).
    pub(super) fn lift_all(&mut self) {
        for a in self.active.iter_mut() {
            a.lift_at = a.lift_at.min(0.0);
        }
        self.lift_due();
    }
}
