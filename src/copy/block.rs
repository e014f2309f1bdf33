//! The one strided copy every host path runs (docs/GEOMETRY.md, "Pool layouts"): `rows × pieces ×
//! planes` pieces of `len` bytes, each side with its own row, piece and plane strides (a pool's
//! token and head strides, a staging region's packed rows, the K and V slabs of one layer copied in
//! one pass), merged into as few and as long copies as both sides allow.

use super::nt;

/// One side of a block copy: piece `(i, j, k)` lies at `at + i·row + j·piece + k·plane`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Side {
    pub at: usize,
    pub row: usize,
    pub piece: usize,
    pub plane: usize,
}

/// The block's shape after merging: `rows × pieces × planes` copies of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub src: Side,
    pub dst: Side,
    pub len: usize,
    pub rows: usize,
    pub pieces: usize,
    pub planes: usize,
}

impl Block {
    /// The same bytes as the fewest longest copies: pieces adjacent on both sides become one
    /// (heads adjacent in both a token-major pool and staging); rows adjacent on both sides become
    /// one (whole token slots); where tokens, not heads, are adjacent on both sides (head-major
    /// pages on both sides of a direct copy), a head's tokens become one copy.
    pub fn merged(mut self) -> Block {
        let adjacent = |a: usize, b: usize, len: usize| a == len && b == len;
        // A vLLM cell's K and V, adjacent in both pools of a direct copy, are one piece.
        if self.planes > 1 && adjacent(self.src.plane, self.dst.plane, self.len) {
            self.len *= self.planes;
            self.planes = 1;
        }
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
                let (mut ks, mut kd) = (ps, pd);
                for _ in 0..self.planes {
                    f(ks, kd);
                    ks += self.src.plane;
                    kd += self.dst.plane;
                }
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
        (0..b.rows).flat_map(move |i| (0..b.pieces).flat_map(move |j| (0..b.planes).map(move |k| (b.src.at + i * b.src.row + j * b.src.piece + k * b.src.plane, b.len))))
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

    type Strides = (usize, usize, usize);

    fn block(src: Strides, dst: Strides, len: usize, rows: usize, pieces: usize, planes: usize) -> Block {
        let side = |(row, piece, plane): Strides| Side { at: 0, row, piece, plane };
        Block { src: side(src), dst: side(dst), len, rows, pieces, planes }
    }

    #[test]
    fn merges_what_both_sides_hold_adjacent() {
        // Token-major pool, two adjacent heads of 256 in a 1024-byte slot, into packed rows.
        let b = block((1024, 256, 0), (512, 256, 0), 256, 8, 2, 1).merged();
        assert_eq!((b.len, b.rows, b.pieces), (512, 8, 1));
        // Whole slots: one copy.
        let b = block((512, 256, 0), (512, 256, 0), 256, 8, 2, 1).merged();
        assert_eq!((b.len, b.rows, b.pieces), (4096, 1, 1));
        // Head-major pages both sides (direct mode): one copy per head.
        let b = block((256, 4096, 0), (256, 8192, 0), 256, 16, 2, 1).merged();
        assert_eq!((b.len, b.rows, b.pieces, b.src.row, b.dst.row), (4096, 2, 1, 4096, 8192));
        // Head-major pool into packed rows: nothing merges.
        let b = block((256, 4096, 0), (512, 256, 0), 256, 16, 2, 1).merged();
        assert_eq!((b.len, b.rows, b.pieces), (256, 16, 2));
        // K‖V cells of head-major pages both sides, K and V in one pass: one copy per head.
        let b = block((512, 8192, 256), (512, 16384, 256), 256, 16, 2, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces, b.planes, b.src.row, b.dst.row), (8192, 2, 1, 1, 8192, 16384));
        // K‖V cells into a K slab and a V slab of packed rows: nothing merges.
        let b = block((512, 8192, 256), (512, 256, 1 << 20), 256, 16, 2, 2).merged();
        assert_eq!((b.len, b.rows, b.pieces, b.planes), (256, 16, 2, 2));
    }

    /// Every shape copies exactly the bytes of a naive piece-by-piece walk.
    #[test]
    fn copies_what_a_naive_walk_copies() {
        let shapes = [
            ((1024, 256, 0), (512, 256, 0), 256, 8, 2, 1),
            ((512, 256, 0), (512, 256, 0), 256, 8, 2, 1),
            ((256, 4096, 0), (256, 8192, 0), 256, 16, 2, 1),
            ((256, 4096, 0), (512, 256, 0), 256, 16, 2, 1),
            ((512, 4096, 0), (256, 8192, 0), 128, 16, 3, 1),
            ((3, 5, 0), (3, 5, 0), 3, 7, 1, 1),
            ((512, 8192, 256), (512, 256, 20_000), 256, 16, 2, 2),
            ((512, 256, 20_000), (512, 8192, 256), 256, 16, 2, 2),
            ((512, 8192, 256), (512, 8192 + 16 * 512, 256), 256, 16, 2, 2),
            ((96, 1000, 48), (32, 16, 2000), 16, 9, 2, 2),
        ];
        for (s, d, len, rows, pieces, planes) in shapes {
            let size = 40_000;
            let src: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            for streaming in [false, true] {
                let mut got = vec![0u8; size];
                let mut b = block(s, d, len, rows, pieces, planes);
                b.src.at = src.as_ptr() as usize;
                b.dst.at = got.as_mut_ptr() as usize;
                unsafe { b.copy(streaming) };
                nt::fence();
                let mut want = vec![0u8; size];
                for i in 0..rows {
                    for j in 0..pieces {
                        for k in 0..planes {
                            for x in 0..len {
                                want[i * d.0 + j * d.1 + k * d.2 + x] = src[i * s.0 + j * s.1 + k * s.2 + x];
                            }
                        }
                    }
                }
                let shape = (s, d, len, rows, pieces, planes);
                assert!(got == want, "{shape:?} (streaming {streaming})");
                let ranges: Vec<(usize, usize)> = block(s, d, len, rows, pieces, planes).src_ranges().collect();
                assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), len * rows * pieces * planes);
            }
        }
    }
}
