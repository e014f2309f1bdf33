//! Layer-wise sending: a chunk's transfer starts before its KV is complete (the ring space is
//! requested at once) and the caller marks model layers ready as the prefill computes them; the
//! transfer gathers and writes each marked batch into its place in the granted range.
//!
//! The gate is shared by the caller (marking) and the transfer (taking batches). Marking wakes the
//! session so that the transfer, blocked with its deadline and cancel checks, sees the batch.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;

use super::wake::Waker;
use crate::copy::ReadyFence;
use crate::error::{Error, Result};
use crate::geometry::KvLayout;

/// Layers marked ready together, and the point after which their KV is valid.
#[derive(Debug)]
pub struct LayerBatch {
    /// Model layer ids, ascending.
    pub layers: Vec<u32>,
    pub ready: Option<ReadyFence>,
}

pub struct LayerGate {
    /// The pool sent from: its model layer ids are what may be marked.
    pool: Arc<KvLayout>,
    state: Mutex<GateState>,
    waker: Arc<dyn Waker>,
}

#[derive(Default)]
struct GateState {
    marked: BTreeSet<u32>,
    pending: Vec<LayerBatch>,
}

impl std::fmt::Debug for LayerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerGate({:?} marked)", self.state.lock().marked)
    }
}

impl LayerGate {
    /// A gate for a transfer from `pool`; `waker` wakes the session the transfer waits on.
    pub fn new(pool: Arc<KvLayout>, waker: Arc<dyn Waker>) -> Arc<LayerGate> {
        Arc::new(LayerGate { pool, state: Mutex::default(), waker })
    }

    /// [`mark`](Self::mark) after the caller's `CUstream` work or `CUevent` (both 0: valid now),
    /// captured now, on the caller's thread, as for a whole-chunk transfer's ready point.
    pub fn mark_after(&self, first: u32, count: u32, cuda_stream: usize, cuda_event: usize) -> Result<()> {
        let ready = ReadyFence::capture(&self.pool, cuda_stream, cuda_event)?;
        self.mark(first, count, ready)
    }

    /// Marks model layers `[first, first + count)` ready after `ready` (`None`: valid now).
    /// Every layer must be one of the pool's and not marked before (a second mark is a caller
    /// bug: which ready point would hold?); nothing is marked when one is not.
    pub fn mark(&self, first: u32, count: u32, ready: Option<ReadyFence>) -> Result<()> {
        if count == 0 {
            return Err(Error::invalid_arg("num_layers", "0 (mark at least one layer)"));
        }
        let end = first.checked_add(count).ok_or_else(|| Error::invalid_arg("first_layer", format!("{first} + {count} layers overflows")))?;
        let ids = &self.pool.shape.layer_ids;
        let mut st = self.state.lock();
        for layer in first..end {
            if ids.binary_search(&layer).is_err() {
                return Err(Error::invalid_arg("first_layer", format!("layer {layer} is not a layer of this pool (layer ids {ids:?})")));
            }
            if st.marked.contains(&layer) {
                return Err(Error::invalid_arg("first_layer", format!("layer {layer} was already marked ready")));
            }
        }
        st.marked.extend(first..end);
        st.pending.push(LayerBatch { layers: (first..end).collect(), ready });
        drop(st);
        self.waker.wake();
        Ok(())
    }

    /// The batches marked since the last call, in marking order.
    pub fn take(&self) -> Vec<LayerBatch> {
        std::mem::take(&mut self.state.lock().pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{MemoryKind, ModelKind, PoolShape};
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Count(AtomicUsize);
    impl Waker for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn marks_are_checked_whole_and_each_wakes_the_session() {
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let shape = PoolShape::new(ModelKind::Mha, 2, 8, 2, 4, 8).with_pp(1, 2, vec![4, 5, 6, 7]);
        let pool = Arc::new(KvLayout::new(shape, 1, MemoryKind::Host, Vec::new()));
        let gate = LayerGate::new(pool, woken.clone());
        gate.mark(5, 2, None).unwrap();
        assert!(gate.mark(3, 2, None).unwrap_err().message().contains("layer 3 is not a layer of this pool"));
        assert!(gate.mark(6, 2, None).unwrap_err().message().contains("layer 6 was already marked"));
        assert!(gate.mark(4, 0, None).is_err());
        assert!(gate.mark(u32::MAX, 2, None).is_err());
        gate.mark(7, 1, None).unwrap();
        gate.mark(4, 1, None).unwrap();
        let got: Vec<Vec<u32>> = gate.take().into_iter().map(|b| b.layers).collect();
        assert_eq!(got, vec![vec![5, 6], vec![7], vec![4]], "a refused mark marks nothing");
        assert!(gate.take().is_empty());
        assert_eq!(woken.0.load(Ordering::SeqCst), 3);
    }
}
