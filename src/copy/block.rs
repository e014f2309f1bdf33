//! The one strided copy every host path runs (docs/GEOMETRY.md, "Pool layouts"): `rows × pieces`
//! pieces of `len` bytes, each side
//! with its own row and piece strides (a pool's token and head strides, a staging region's packed
//! rows), merged into as few and as long copies as both sides allow.

use super::nt;

/// One side of a block copy: piece `(i, j)` lies at `at + i·row + j·piece`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Side {
    pub at: usize,
    pub row: usize,
    pub piece: usize,
}

/// The block's shape after merging: `rows × pieces` copies of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub src: Side,
    pub dst: Side,
    pub len: usize,
    pub rows: usize,
    pub pieces: usize,
}

impl Block {
    /// The same bytes as the fewest longest copies: pieces adjacent on both sides become one
    /// (heads adjacent in both a token-major pool and staging); rows adjacent on both sides become
    /// one (whole token slots); where tokens, not heads, are adjacent on both sides (head-major
    /// pages on both sides of a direct copy), a head's tokens become one copy.
    pub fn merged(mut self) -> Block {
        let adjacent = |a: usize, b: usize, len: usize| a == len && b == len;
        if self.pieces > 1 && adjacent(self.src.piece, self.dst.piece, self.len) {
            self.len *= self.pieces;
            self.pieces = 1;
        }
        if self.rows > 1 && self.pieces > 1 && adjacent(self.src.row, self.dst.row, self.len) {
            // A head's tokens are one copy; the heads become the rows.
            self.len *= self.rows;
            self.rows = std::mem::replace(&mut self.pieces, 1);
            self.src.row = self.src.piece;
            self.dst.row = self.dst.piece;
        }
        if self.pieces == 1 && self.rows > 1 && adjacent(self.src.row, self.dst.row, self.len) {
            self.len *= self.rows;
            self.rows = 1;
        }
        self
    }

    /// Copies the block; `streaming` writes with non-temporal stores (the caller fences).
    ///
    /// # Safety
    /// Every piece lies in memory readable at `src` and writable at `dst`, not overlapping.
    pub unsafe fn copy(self, streaming: bool) {
        let b = self.merged();
        // SAFETY: the caller's contract.
        unsafe {
            if streaming {
                return b.each(|s, d| nt::copy(s as *const u8, d as *mut u8, b.len));
            }
            match b.len {
                64 => b.each(fixed::<64>),
                128 => b.each(fixed::<128>),
                256 => b.each(fixed::<256>),
                512 => b.each(fixed::<512>),
                1024 => b.each(fixed::<1024>),
                len => b.each(|s, d| std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len)),
            }
        }
    }

    /// Calls `f(src, dst)` for every piece, row by row.
    #[inline(always)]
    unsafe fn each(&self, f: impl Fn(usize, usize)) {
        let (mut s, mut d) = (self.src.at, self.dst.at);
        for _ in 0..self.rows {
            let (mut ps, mut pd) = (s, d);
            for _ in 0..self.pieces {
                f(ps, pd);
                ps += self.src.piece;
                pd += self.dst.piece;
            }
            s += self.src.row;
            d += self.dst.row;
        }
    }

    /// The block's source pieces as `(address, length)` after merging, in the destination's order
    /// when that is packed rows (a staging region: its rows are never adjacent across heads).
    pub fn src_ranges(self) -> impl Iterator<Item = (usize, usize)> {
        let b = self.merged();
        (0..b.rows).flat_map(move |i| (0..b.pieces).map(move |j| (b.src.at + i * b.src.row + j * b.src.piece, b.len)))
    }
}

/// `N` bytes, a size the compiler unrolls.
#[inline(always)]
fn fixed<const N: usize>(src: usize, dst: usize) {
    // SAFETY: `Block::copy`'s contract.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, N) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(src: (usize, usize), dst: (usize, usize), len: usize, rows: usize, pieces: usize) -> Block {
        Block { src: Side { at: 0, row: src.0, piece: src.1 }, dst: Side { at: 0, row: dst.0, piece: dst.1 }, len, rows, pieces }
    }

    #[test]
    fn merges_what_both_sides_hold_adjacent() {
        // Token-major pool, two adjacent heads of 256 in a 1024-byte slot, into packed rows.
        let b = block((1024, 256), (512, 256), 256, 8, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces), (512, 8, 1));
        // Whole slots: one copy.
        let b = block((512, 256), (512, 256), 256, 8, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces), (4096, 1, 1));
        // Head-major pages both sides (direct mode): one copy per head.
        let b = block((256, 4096), (256, 8192), 256, 16, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces, b.src.row, b.dst.row), (4096, 2, 1, 4096, 8192));
        // Head-major pool into packed rows: nothing merges.
        let b = block((256, 4096), (512, 256), 256, 16, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces), (256, 16, 2));
    }

    /// Every shape copies exactly the bytes of a naive piece-by-piece walk.
    #[test]
    fn copies_what_a_naive_walk_copies() {
        let shapes = [
            ((1024, 256), (512, 256), 256, 8, 2),
            ((512, 256), (512, 256), 256, 8, 2),
            ((256, 4096), (256, 8192), 256, 16, 2),
            ((256, 4096), (512, 256), 256, 16, 2),
            ((512, 4096), (256, 8192), 128, 16, 3),
            ((3, 5), (3, 5), 3, 7, 1),
        ];
        for (s, d, len, rows, pieces) in shapes {
            let size = 40_000;
            let src: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            for streaming in [false, true] {
                let mut got = vec![0u8; size];
                let mut b = block(s, d, len, rows, pieces);
                b.src.at = src.as_ptr() as usize;
                b.dst.at = got.as_mut_ptr() as usize;
                unsafe { b.copy(streaming) };
                nt::fence();
                let mut want = vec![0u8; size];
                for i in 0..rows {
                    for j in 0..pieces {
                        for k in 0..len {
                            want[i * d.0 + j * d.1 + k] = src[i * s.0 + j * s.1 + k];
                        }
                    }
                }
                assert!(got == want, "{s:?} {d:?} {len} × {rows} × {pieces} (streaming {streaming})");
                let ranges: Vec<(usize, usize)> = block(s, d, len, rows, pieces).src_ranges().collect();
                assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), len * rows * pieces);
            }
        }
    }
}
