//! Slice-path byte coverage of one writer in one chunk: which (destination buffer, token) rows
//! arrived. A chunk's slice writer is complete only when every row it owes arrived exactly once.

use crate::geometry::PoolShape;

#[derive(Clone, Debug)]
pub struct Coverage {
    /// Row of each destination buffer in `bits`, `None` for buffers this writer does not carry.
    rows: Vec<Option<u32>>,
    tokens: u32,
    bits: Vec<u64>,
    covered: u64,
    expected: u64,
}

impl Coverage {
    /// The rows writer `src` owes decode rank `dst` for a chunk of `tokens` tokens: every buffer of
    /// every layer both hold, every token.
    pub fn new(src: &PoolShape, dst: &PoolShape, tokens: u32) -> Coverage {
        let mut rows = vec![None; (dst.buffers_per_layer() * dst.layer_count()) as usize];
        let mut next = 0u32;
        for kv in 0..dst.buffers_per_layer() {
            for (j, id) in dst.layer_ids.iter().enumerate() {
                if src.layer_index(*id).is_some() {
                    rows[dst.buffer_index(kv, j as u32) as usize] = Some(next);
                    next += 1;
                }
            }
        }
        let expected = next as u64 * tokens as u64;
        Coverage { rows, tokens, bits: vec![0; expected.div_ceil(64) as usize], covered: 0, expected }
    }

    /// Whether `buffer` is one this writer carries (so a slice for it may be accepted).
    pub fn carries(&self, buffer: u32) -> bool {
        self.rows.get(buffer as usize).is_some_and(|r| r.is_some())
    }

    fn bit(&self, buffer: u32, token: u32) -> Option<u64> {
        let row = (*self.rows.get(buffer as usize)?)?;
        (token < self.tokens).then(|| row as u64 * self.tokens as u64 + token as u64)
    }

    /// Whether the row was already written.
    pub fn has(&self, buffer: u32, token: u32) -> bool {
        self.bit(buffer, token).is_some_and(|b| self.bits[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    /// Marks the row written; false when it is not this writer's or was written before.
    pub fn mark(&mut self, buffer: u32, token: u32) -> bool {
        let Some(b) = self.bit(buffer, token) else { return false };
        let (word, mask) = ((b / 64) as usize, 1u64 << (b % 64));
        if self.bits[word] & mask != 0 {
            return false;
        }
        self.bits[word] |= mask;
        self.covered += 1;
        true
    }

    pub fn progress(&self) -> (u64, u64) {
        (self.covered, self.expected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::ModelKind;

    #[test]
    fn counts_every_row_once_and_only_the_writers_layers() {
        let dst = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 4);
        let src = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 4).with_pp(0, 2, vec![0, 1]);
        let mut c = Coverage::new(&src, &dst, 32);
        assert_eq!(c.progress(), (0, 2 * 2 * 32));
        assert!(c.carries(dst.buffer_index(1, 1)) && !c.carries(dst.buffer_index(0, 2)));
        assert!(!c.mark(dst.buffer_index(0, 3), 0), "layer 3 belongs to the other stage");
        assert!(!c.mark(dst.buffer_index(0, 0), 32), "token past the chunk");
        for kv in 0..2 {
            for l in 0..2 {
                for t in 0..32 {
                    assert!(c.mark(dst.buffer_index(kv, l), t));
                }
            }
        }
        assert!(!c.mark(dst.buffer_index(0, 0), 5), "a row written twice");
        assert_eq!(c.progress(), (128, 128));
        assert!(c.has(dst.buffer_index(1, 0), 31));
    }
}
