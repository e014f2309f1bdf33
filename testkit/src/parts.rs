//! Request parts of the cluster's rooms (`--aux-rows`, `--state-bytes`): aux buffers with rows of
//! 64 to 512 bytes and one state component over every layer, sharded by TP along one group, two
//! items of each (rooms alternate between them, as between their page sets). Prefill ranks fill
//! their items with a reference computed from each byte's global identity; the decode side checks
//! its items against the same reference.

use kvstage::engine::Engine;
use kvstage::geometry::{ComponentKind, ComponentSpec, RequestParts, StateItem};
use kvstage::Result;

use crate::cluster::Setup;

/// Row sizes the aux buffers cycle through.
const ROW_BYTES: [u64; 4] = [64, 128, 256, 512];
const ITEMS: u64 = 2;

/// The reference byte `byte` of global item bytes of component `c`, layer `layer`.
fn reference(c: usize, layer: u32, byte: u64) -> u8 {
    (byte.wrapping_mul(13).wrapping_add(layer as u64 * 7 + c as u64 * 101) % 251) as u8 | 1
}

impl Setup {
    pub fn has_parts(&self) -> bool {
        self.aux_rows > 0 || self.state_bytes > 0
    }

    /// Elements of the state item's one group (bf16): `state_bytes` over every layer, a multiple
    /// of 64 (so that it shards over any TP size up to 64).
    fn state_dim(&self) -> u32 {
        ((self.state_bytes / (self.model.layers as u64 * 2)) / 64 * 64).max(64) as u32
    }

    /// The components every rank registers.
    pub fn part_specs(&self) -> Vec<ComponentSpec> {
        let mut out: Vec<ComponentSpec> = (0..self.aux_rows as usize)
            .map(|i| ComponentSpec { name: format!("aux{i}"), kind: ComponentKind::Aux { row_bytes: ROW_BYTES[i % 4] }, layer_ids: vec![], page_size: 0 })
            .collect();
        if self.state_bytes > 0 {
            let item = StateItem { outer: 1, groups: vec![self.state_dim()], dtype_bytes: 2, replicated: false };
            out.push(ComponentSpec { name: "state".into(), kind: ComponentKind::State { item }, layer_ids: (0..self.model.layers).collect(), page_size: 0 });
        }
        out
    }

    /// What room `room` names of its request on either side.
    pub fn request_parts(&self, room: u64) -> Option<RequestParts> {
        let item = room % ITEMS;
        self.has_parts().then(|| RequestParts { aux_row: item, state_slots: if self.state_bytes > 0 { vec![item] } else { vec![] }, pools: vec![] })
    }

    /// Bytes of request parts one room moves to all decode ranks (aux rows once per decode rank).
    pub fn room_part_bytes(&self) -> u64 {
        let aux: u64 = (0..self.aux_rows as usize).map(|i| ROW_BYTES[i % 4]).sum();
        let state = if self.state_bytes > 0 { self.state_dim() as u64 * 2 * self.model.layers as u64 } else { 0 };
        aux * self.decode_tp as u64 + state
    }
}

/// One rank's component memory: per component, per layer, two items.
pub struct PartsMemory {
    specs: Vec<ComponentSpec>,
    buffers: Vec<Vec<Vec<u8>>>,
    tp_rank: u32,
    tp: u32,
}

impl PartsMemory {
    /// Allocates rank `tp_rank` of `tp`'s components and registers them with `engine`; `fill`
    /// writes the reference into both items (prefill ranks).
    pub fn register(setup: &Setup, engine: &Engine, tp_rank: u32, tp: u32, fill: bool) -> Result<PartsMemory> {
        let specs = setup.part_specs();
        let mut m = PartsMemory { buffers: Vec::new(), specs, tp_rank, tp };
        for s in &m.specs {
            let item = s.item_bytes(tp, 1);
            m.buffers.push((0..s.layer_ids.len().max(1)).map(|_| vec![0u8; (ITEMS * item) as usize]).collect());
        }
        if fill {
            for item in 0..ITEMS {
                m.each(item, |b, want| *b = want);
            }
        }
        let list = m.specs.iter().zip(&m.buffers).map(|(s, bufs)| (s.clone(), ITEMS, bufs.iter().map(|b| b.as_ptr() as usize).collect())).collect();
        engine.register_components(list)?;
        Ok(m)
    }

    /// Visits every byte of item `item` with its reference value.
    fn each(&mut self, item: u64, mut f: impl FnMut(&mut u8, u8)) {
        for (c, s) in self.specs.iter().enumerate() {
            let bytes = s.item_bytes(self.tp, 1);
            // This rank's share of a sharded row starts `tp_rank` shares into the global item.
            let global_start = match &s.kind {
                ComponentKind::State { .. } => self.tp_rank as u64 * bytes,
                _ => 0,
            };
            for (li, buf) in self.buffers[c].iter_mut().enumerate() {
                let layer = s.layer_ids.get(li).copied().unwrap_or(0);
                for k in 0..bytes {
                    f(&mut buf[(item * bytes + k) as usize], reference(c, layer, global_start + k));
                }
            }
        }
    }

    /// Bytes of item `item` that differ from the reference, and the first of them.
    pub fn verify(&mut self, item: u64) -> (u64, Option<String>) {
        let (mut bad, mut first) = (0, None);
        let names: Vec<String> = self.specs.iter().map(|s| s.name.clone()).collect();
        let mut at = 0usize;
        self.each(item, |b, want| {
            if *b != want {
                bad += 1;
                first.get_or_insert_with(|| format!("request part byte {at} ({names:?}): {} != {want}", *b));
            }
            at += 1;
        });
        (bad, first)
    }
}
