//! Pure work-request planning for one chunk: the bytes are cut into RDMA WRITE work requests of at
//! most `wr_bytes`, striped in contiguous runs over the session's queue pairs, every
//! `signal_every`-th work request of a QP (and its last one) is signalled, and the very last work
//! request of QP 0 is the WRITE_WITH_IMM that tells the receiver the chunk is complete.

/// One work request of a chunk write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedWr {
    /// Offset in the chunk (the same in the local staging buffer and in the remote region).
    pub offset: u64,
    pub len: u32,
    /// Produces a completion (the unsignalled ones before it are retired with it).
    pub signaled: bool,
    /// The WRITE_WITH_IMM carrying the chunk's completion.
    pub imm: bool,
}

/// The work requests of one chunk, per queue pair, in posting order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WritePlan {
    pub per_qp: Vec<Vec<PlannedWr>>,
}

impl WritePlan {
    /// The number of signalled completions QP `q` produces.
    pub fn signals(&self, q: usize) -> usize {
        self.per_qp[q].iter().filter(|w| w.signaled).count()
    }

    /// True when the immediate must wait for the other QPs' data (RC orders work requests only
    /// within one QP, so with several QPs the imm is posted after their completions).
    pub fn imm_waits_for_others(&self) -> bool {
        self.per_qp.iter().skip(1).any(|q| !q.is_empty())
    }
}

/// Plans the write of `len` bytes. `wr_bytes >= 1`, `signal_every >= 1`, `qps >= 1`.
pub fn plan_writes(len: u64, wr_bytes: u32, signal_every: u32, qps: u32) -> WritePlan {
    let wr_bytes = wr_bytes.max(1) as u64;
    let signal_every = signal_every.max(1) as usize;
    let qps = qps.max(1) as u64;
    let pieces = len.div_ceil(wr_bytes);
    let mut per_qp: Vec<Vec<PlannedWr>> = vec![Vec::new(); qps as usize];
    if pieces == 0 {
        // Nothing to move: a zero-length write-with-immediate still completes the chunk.
        per_qp[0].push(PlannedWr { offset: 0, len: 0, signaled: true, imm: true });
        return WritePlan { per_qp };
    }
    for (q, wrs) in per_qp.iter_mut().enumerate() {
        let q = q as u64;
        let (first, last) = (q * pieces / qps, (q + 1) * pieces / qps);
        for p in first..last {
            let offset = p * wr_bytes;
            let n = (len - offset).min(wr_bytes) as u32;
            let idx = (p - first) as usize;
            let is_last = p + 1 == last;
            wrs.push(PlannedWr { offset, len: n, signaled: is_last || (idx + 1).is_multiple_of(signal_every), imm: false });
        }
    }
    // QP 0 always has a piece (first = 0, last = pieces / qps >= 1 unless pieces < qps, in which
    // case the runs are spread so that run 0 still starts at 0: move QP 0's imm to its last piece,
    // or give it the last piece of the whole chunk when its run is empty).
    if per_qp[0].is_empty() {
        let donor = per_qp.iter().rposition(|q| !q.is_empty()).expect("pieces > 0");
        let mut wr = per_qp[donor].pop().expect("non-empty");
        if let Some(prev) = per_qp[donor].last_mut() {
            prev.signaled = true;
        }
        wr.signaled = true;
        per_qp[0].push(wr);
    }
    let last = per_qp[0].last_mut().expect("QP 0 has a piece");
    last.imm = true;
    last.signaled = true;
    WritePlan { per_qp }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(len: u64, wr: u32, every: u32, qps: u32) -> std::result::Result<(), TestCaseError> {
        let plan = plan_writes(len, wr, every, qps);
        prop_assert_eq!(plan.per_qp.len(), qps.max(1) as usize);
        // Coverage: every byte exactly once, in pieces of at most wr bytes.
        let mut all: Vec<PlannedWr> = plan.per_qp.iter().flatten().copied().collect();
        all.sort_by_key(|w| w.offset);
        let mut next = 0u64;
        for w in &all {
            prop_assert_eq!(w.offset, next);
            prop_assert!(w.len as u64 <= wr.max(1) as u64);
            prop_assert!(w.len > 0 || len == 0);
            next += w.len as u64;
        }
        prop_assert_eq!(next, len);
        // Exactly one imm, the last WR of QP 0, signalled.
        let imms: Vec<_> = plan.per_qp.iter().enumerate().flat_map(|(q, v)| v.iter().map(move |w| (q, *w))).filter(|(_, w)| w.imm).collect();
        prop_assert_eq!(imms.len(), 1);
        prop_assert_eq!(imms[0].0, 0);
        prop_assert_eq!(Some(&imms[0].1), plan.per_qp[0].last());
        prop_assert!(imms[0].1.signaled);
        for q in &plan.per_qp {
            // The last WR of every non-empty QP is signalled; no run of unsignalled WRs is longer
            // than signal_every - 1 (bounded send-queue use).
            if let Some(l) = q.last() {
                prop_assert!(l.signaled);
            }
            let mut run = 0;
            for w in q {
                if w.signaled { run = 0 } else { run += 1 }
                prop_assert!(run < every.max(1) as usize);
            }
            // Within a QP the pieces are contiguous except for a moved imm.
            for pair in q.windows(2) {
                prop_assert!(pair[0].offset < pair[1].offset);
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn plans_cover_every_byte_once(len in 0u64..200_000, wr in 1u32..70_000, every in 1u32..40, qps in 1u32..9) {
            check(len, wr, every, qps)?;
        }
    }

    #[test]
    fn examples() {
        let p = plan_writes(10, 4, 2, 1);
        assert_eq!(
            p.per_qp[0],
            vec![
                PlannedWr { offset: 0, len: 4, signaled: false, imm: false },
                PlannedWr { offset: 4, len: 4, signaled: true, imm: false },
                PlannedWr { offset: 8, len: 2, signaled: true, imm: true },
            ]
        );
        assert!(!p.imm_waits_for_others());
        assert_eq!(p.signals(0), 2);
        let striped = plan_writes(16, 4, 16, 2);
        assert_eq!(striped.per_qp[0].iter().map(|w| w.offset).collect::<Vec<_>>(), vec![0, 4]);
        assert_eq!(striped.per_qp[1].iter().map(|w| w.offset).collect::<Vec<_>>(), vec![8, 12]);
        assert!(striped.imm_waits_for_others());
        // Fewer pieces than QPs: QP 0 still carries the imm.
        let few = plan_writes(4, 4, 1, 4);
        assert_eq!(few.per_qp[0].len(), 1);
        assert!(few.per_qp[0][0].imm);
        assert_eq!(few.per_qp.iter().map(Vec::len).sum::<usize>(), 1);
        let empty = plan_writes(0, 4, 1, 3);
        assert_eq!(empty.per_qp[0], vec![PlannedWr { offset: 0, len: 0, signaled: true, imm: true }]);
    }
}
