//! A registered KV pool: its shape, where its buffers lie and how a buffer's bytes are laid out,
//! as byte strides (docs/GEOMETRY.md, "KV pool" and "Pool layouts").
//!
//! Only the shape crosses the wire; the strides are each side's own. So any layout sends to any
//! other: the staging rows stay token-major whatever the pools look like.

use super::{geometry_invalid, MemoryKind, PoolShape};
use crate::error::{Error, Result};

/// Byte strides shared by every buffer of a pool: byte `e` of local head `h` of token `s` of page
/// `p` of buffer `i` lies at `bases[i] + p·page + s·token + h·head + e`.
///
/// sglang's token-major pool is `head = D·b`, `token = local_heads·D·b`, `page = ps·token`; vLLM's
/// and TensorRT-LLM's layouts are other strides over the same indices (a block holding every
/// layer is a page stride larger than one layer's page, its layers' bases a layer stride apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strides {
    pub page: u64,
    pub token: u64,
    pub head: u64,
}

impl Strides {
    /// sglang's layout: token slots back to back, each `local_heads` heads of `D·b` bytes.
    pub fn token_major(shape: &PoolShape) -> Strides {
        Strides { page: shape.page_bytes(), token: shape.token_bytes(), head: shape.head_bytes() }
    }
}

/// What the copy planner needs of a pool: its shape and its strides (a bare [`PoolShape`] is
/// token-major).
pub trait PoolGeometry {
    fn shape(&self) -> &PoolShape;
    fn strides(&self) -> Strides;
}

impl PoolGeometry for PoolShape {
    fn shape(&self) -> &PoolShape {
        self
    }
    fn strides(&self) -> Strides {
        Strides::token_major(self)
    }
}

impl PoolGeometry for (&PoolShape, Strides) {
    fn shape(&self) -> &PoolShape {
        self.0
    }
    fn strides(&self) -> Strides {
        self.1
    }
}

impl PoolGeometry for KvLayout {
    fn shape(&self) -> &PoolShape {
        &self.shape
    }
    fn strides(&self) -> Strides {
        self.strides
    }
}

/// A registered pool: shape, base addresses and strides.
///
/// `bases[kv * layer_count + layer_idx]` is the start of buffer `kv` (0 = K / latent, 1 = V) of
/// layer `shape.layer_ids[layer_idx]`; each buffer holds `capacity_pages` pages of `page_size`
/// token slots of `local_heads` heads, placed by [`Strides`]. Buffers may interleave (V in K's
/// cell, every layer in one block) as long as no two rows share a byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub shape: PoolShape,
    pub capacity_pages: u64,
    pub memory: MemoryKind,
    pub bases: Vec<usize>,
    pub strides: Strides,
}

impl KvLayout {
    /// A token-major pool (sglang's layout).
    pub fn new(shape: PoolShape, capacity_pages: u64, memory: MemoryKind, bases: Vec<usize>) -> KvLayout {
        let strides = Strides::token_major(&shape);
        KvLayout { shape, capacity_pages, memory, bases, strides }
    }

    /// The same pool with its bytes laid out by `strides`.
    pub fn with_strides(mut self, strides: Strides) -> KvLayout {
        self.strides = strides;
        self
    }

    /// Whether token slots are evenly spaced across pages (`page = page_size · token`): then
    /// adjacent pages are one run of slots.
    pub fn linear(&self) -> bool {
        is_linear(&self.shape, self.strides)
    }

    /// Byte offset of token slot `slot` (page `slot / ps`, token `slot % ps`) in a buffer.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        slot_offset(&self.shape, self.strides, slot)
    }

    /// Bytes from a buffer's base to the end of its last row (saturating; `validate` rejects
    /// layouts where this overflows). For a token-major pool, `capacity_pages · page_bytes`.
    pub fn buffer_bytes(&self) -> u64 {
        self.dims().iter().fold(self.shape.head_bytes(), |end, d| d.stride.saturating_mul(d.count - 1).saturating_add(end))
    }

    /// Token slots in each buffer.
    pub fn capacity_tokens(&self) -> u64 {
        self.capacity_pages.saturating_mul(self.shape.page_size as u64)
    }

    /// The strided dimensions of a buffer that hold more than one index: (page, token, head).
    fn dims(&self) -> Vec<Dim> {
        let s = &self.shape;
        [
            Dim { field: "page_stride", stride: self.strides.page, count: self.capacity_pages, what: "pages" },
            Dim { field: "token_stride", stride: self.strides.token, count: s.page_size as u64, what: "token slots" },
            Dim { field: "head_stride", stride: self.strides.head, count: s.local_heads as u64, what: "heads" },
        ]
        .into_iter()
        .filter(|d| d.count > 1)
        .collect()
    }

    fn buffer_name(&self, i: usize) -> String {
        let layers = self.shape.layer_ids.len().max(1);
        let (kv, idx) = (i / layers, i % layers);
        let which = match (self.shape.kind, kv) {
            (super::ModelKind::Mla, _) => "latent",
            (_, 0) => "K",
            _ => "V",
        };
        let id = self.shape.layer_ids.get(idx).copied().unwrap_or(u32::MAX);
        format!("bases[{i}] ({which} of layer {id})")
    }

    /// The memory of bytes `[byte_offset, +len)` of token slot `slot` of buffer `buffer`, where the
    /// slot's bytes are counted as in a token-major slot (`local_heads` heads of `D·b`): one range
    /// per head the bytes touch, or one when the heads are adjacent. Checked against the pool
    /// (buffer index, capacity, slot bounds).
    pub fn slot_ranges(&self, buffer: u32, slot: u64, byte_offset: u64, len: u64) -> Result<Vec<(usize, usize)>> {
        let base = *self.bases.get(buffer as usize).ok_or_else(|| Error::internal(format!("buffer {buffer} is not in the pool")))?;
        if slot >= self.capacity_tokens() || byte_offset.checked_add(len).is_none_or(|e| e > self.shape.token_bytes()) {
            return Err(Error::internal(format!("slot {slot} [{byte_offset}, +{len}) is outside the pool")));
        }
        let at = base as u64 + self.slot_offset(slot);
        let hb = self.shape.head_bytes();
        if self.strides.head == hb {
            return Ok(vec![((at + byte_offset) as usize, len as usize)]);
        }
        let mut out = Vec::new();
        let (mut from, end) = (byte_offset, byte_offset + len);
        while from < end {
            let (head, within) = (from / hb, from % hb);
            let n = (hb - within).min(end - from);
            out.push(((at + head * self.strides.head + within) as usize, n as usize));
            from += n;
        }
        Ok(out)
    }

    /// Checks the shape, the capacity, the number of bases, NULL bases, the strides (element
    /// aligned, each at least what it strides over), address-space overflow and buffers whose rows
    /// share a byte (`KVSTAGE_E_GEOMETRY_INVALID`, naming the field and the values).
    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        if self.capacity_pages == 0 {
            return Err(geometry_invalid("capacity_pages", "is 0 (a pool holds at least one page)"));
        }
        let ext = self.extents()?;
        let buffer_bytes = *ext.last().expect("the innermost extent");
        let expected = self.shape.buffers_per_layer() as usize * self.shape.layer_ids.len();
        if self.bases.len() != expected {
            return Err(geometry_invalid(
                "bases",
                format!(
                    "holds {} pointers, expected {expected} ({} per layer × {} layers)",
                    self.bases.len(),
                    self.shape.buffers_per_layer(),
                    self.shape.layer_ids.len()
                ),
            ));
        }
        let mut spans = Vec::with_capacity(self.bases.len());
        for (i, &base) in self.bases.iter().enumerate() {
            if base == 0 {
                return Err(geometry_invalid(&self.buffer_name(i), "is NULL"));
            }
            let end = (base as u64).checked_add(buffer_bytes).filter(|e| *e <= usize::MAX as u64);
            let Some(end) = end else {
                return Err(geometry_invalid(
                    &self.buffer_name(i),
                    format!("{base:#x} + {buffer_bytes} bytes overflows the address space"),
                ));
            };
            spans.push((base as u64, end, i));
        }
        spans.sort_unstable();
        let dims = self.dims_sorted();
        // Buffers whose address ranges overlap may still interleave (K and V in one cell, every
        // layer in one block): compare their rows exactly.
        for (k, a) in spans.iter().enumerate() {
            for b in spans[k + 1..].iter().take_while(|b| b.0 < a.1) {
                if rows_meet(&dims, &ext, self.shape.head_bytes(), (b.0 - a.0) as i128) {
                    return Err(geometry_invalid(
                        &self.buffer_name(b.2),
                        format!(
                            "{:#x} puts rows on bytes of {} at {:#x} (strides: page {}, token {}, head {}; rows of {} bytes)",
                            b.0,
                            self.buffer_name(a.2),
                            a.0,
                            self.strides.page,
                            self.strides.token,
                            self.strides.head,
                            self.shape.head_bytes()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn dims_sorted(&self) -> Vec<Dim> {
        let mut dims = self.dims();
        dims.sort_by_key(|d| d.stride);
        dims
    }

    /// Checks the strides and returns the extent of each nest level, innermost first: `ext[0]` is
    /// a head row, `ext[k]` the bytes spanned by the `k` innermost dimensions, the last a buffer.
    fn extents(&self) -> Result<Vec<u64>> {
        let b = self.shape.dtype_bytes as u64;
        for d in self.dims() {
            if d.stride == 0 || !d.stride.is_multiple_of(b) {
                return Err(geometry_invalid(
                    d.field,
                    format!("{} is not a positive multiple of dtype_bytes {b} (the {} it strides over hold whole elements)", d.stride, d.what),
                ));
            }
        }
        let mut ext = vec![self.shape.head_bytes()];
        let mut inner = "a head's row";
        for d in self.dims_sorted() {
            let e = *ext.last().expect("the innermost extent");
            if d.stride < e {
                return Err(geometry_invalid(
                    d.field,
                    format!("{} is less than the {e} bytes of {inner} it strides over (its {} would share bytes)", d.stride, d.what),
                ));
            }
            let next = d.stride.checked_mul(d.count - 1).and_then(|x| x.checked_add(e)).filter(|x| *x <= isize::MAX as u64);
            let Some(next) = next else {
                return Err(geometry_invalid(
                    d.field,
                    format!("{} {} of {} bytes overflow the address space", d.count, d.what, d.stride),
                ));
            };
            ext.push(next);
            inner = d.what;
        }
        Ok(ext)
    }

    /// Every page index must be below `capacity_pages` (`KVSTAGE_E_INVALID_ARG` naming `pages`).
    pub fn check_pages(&self, pages: &[u32], arg: &str) -> Result<()> {
        match pages.iter().position(|&p| p as u64 >= self.capacity_pages) {
            None => Ok(()),
            Some(i) => Err(Error::invalid_arg(
                arg,
                format!("{arg}[{i}] = {} is outside the pool (capacity_pages {})", pages[i], self.capacity_pages),
            )),
        }
    }
}

/// Whether slot `t` lies at `t · token` (pages evenly spaced): with pages of one slot too, where
/// the token stride strides over nothing and only an equal page stride makes slots adjacent.
pub(crate) fn is_linear(shape: &PoolShape, strides: Strides) -> bool {
    strides.page == shape.page_size as u64 * strides.token
}

pub(crate) fn slot_offset(shape: &PoolShape, strides: Strides, slot: u64) -> u64 {
    let ps = shape.page_size as u64;
    (slot / ps) * strides.page + (slot % ps) * strides.token
}

/// One strided dimension of a buffer.
#[derive(Clone, Copy, Debug)]
struct Dim {
    field: &'static str,
    stride: u64,
    count: u64,
    what: &'static str,
}

/// Whether the rows of a buffer and those of a buffer `delta` bytes further share a byte.
/// `dims` nest (innermost first, each stride at least the extent `ext[k]` of the ones inside
/// it), so at each level only the one or two index differences that bring the inner nests within
/// reach of one another can meet: at most 2^levels cases, exact.
fn rows_meet(dims: &[Dim], ext: &[u64], row: u64, delta: i128) -> bool {
    let Some((d, inner)) = dims.split_last() else {
        return delta.abs() < row as i128;
    };
    let (s, e, n) = (d.stride as i128, ext[inner.len()] as i128, d.count as i128);
    // Index differences m with |delta + m·s| < e, within (-n, n).
    let lo = (-e - delta).div_euclid(s) + 1;
    let hi = (e - delta - 1).div_euclid(s);
    (lo.max(1 - n)..=hi.min(n - 1)).any(|m| rows_meet(inner, ext, row, delta + m * s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;
    use crate::geometry::ModelKind;

    fn mha() -> PoolShape {
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 4).with_tp(1, 4)
    }

    fn err_of(r: Result<()>) -> Error {
        r.expect_err("validation should fail")
    }

    fn layout() -> KvLayout {
        let shape = mha();
        let bb = 10 * shape.page_bytes() as usize;
        KvLayout::new(shape, 10, MemoryKind::Host, (0..8).map(|i| 0x10_0000 + i * bb).collect())
    }

    #[test]
    fn every_layout_validation_error_names_its_field() {
        layout().validate().unwrap();
        let mut l = layout();
        l.capacity_pages = 0;
        assert!(err_of(l.validate()).message().contains("`capacity_pages`: is 0"));
        let mut l = layout();
        l.capacity_pages = u64::MAX / 2;
        assert!(err_of(l.validate()).message().contains("overflow the address space"));
        let mut l = layout();
        l.bases.pop();
        assert!(err_of(l.validate()).message().contains("`bases`: holds 7 pointers, expected 8 (2 per layer × 4 layers)"));
        let mut l = layout();
        l.bases[5] = 0;
        assert!(err_of(l.validate()).message().contains("`bases[5] (V of layer 1)`: is NULL"));
        let mut l = layout();
        l.bases[7] = usize::MAX - 100;
        assert!(err_of(l.validate()).message().contains("overflows the address space"));
        let mut l = layout();
        l.bases[3] = l.bases[2] + 100;
        let e = err_of(l.validate());
        assert!(e.message().contains("bases[3] (K of layer 3)") && e.message().contains("puts rows on bytes of bases[2]"), "{}", e.message());
        let mut l = layout();
        l.shape.head_dim = 0;
        assert!(err_of(l.validate()).message().contains("`head_dim`"));
    }

    #[test]
    fn stride_errors_name_the_field_and_both_values() {
        let shape = mha(); // 2 local heads of 256 bytes, pages of 16
        let with = |page, token, head| KvLayout::new(shape.clone(), 10, MemoryKind::Host, (0..8).map(|i| 0x1000_0000 + i * 0x100_0000).collect()).with_strides(Strides { page, token, head });
        with(16 * 512, 512, 256).validate().unwrap();
        // Head-major pages (TensorRT-LLM): a head's 16 tokens are one run.
        with(16 * 512, 256, 16 * 256).validate().unwrap();
        // Padded pages.
        with(16 * 512 + 64, 512, 256).validate().unwrap();
        let e = err_of(with(16 * 512, 511, 256).validate());
        assert!(e.message().contains("`token_stride`: 511 is not a positive multiple of dtype_bytes 2"), "{}", e.message());
        let e = err_of(with(16 * 512, 256, 256).validate());
        assert!(e.message().contains("`head_stride`: 256 is less than the 4096 bytes of token slots it strides over"), "{}", e.message());
        let e = err_of(with(16 * 512, 384, 256).validate());
        assert!(e.message().contains("`token_stride`: 384 is less than the 512 bytes of heads it strides over"), "{}", e.message());
        let e = err_of(with(16 * 512, 512, 128).validate());
        assert!(e.message().contains("`head_stride`: 128 is less than the 256 bytes of a head's row"), "{}", e.message());
        let e = err_of(with(15 * 512, 512, 256).validate());
        assert!(e.message().contains("`page_stride`: 7680 is less than the 8192 bytes of token slots"), "{}", e.message());
    }

    /// K and V in one cell (vLLM): V's base is K's plus `D·b`, with cells of `2·D·b`; shifted by
    /// less than a row, they meet.
    #[test]
    fn interleaved_buffers_are_checked_row_by_row() {
        let shape = PoolShape::new(ModelKind::Mha, 2, 64, 2, 4, 2);
        let (hb, cell) = (128u64, 256u64);
        // LBHNC: [layer][page][head][token][K‖V].
        let strides = Strides { page: 2 * 4 * cell, token: cell, head: 4 * cell };
        let layer = 8 * 2 * 4 * cell;
        let pool = |v_offset: u64| {
            let k: Vec<usize> = (0..2).map(|l| 0x10000 + (l * layer) as usize).collect();
            let v: Vec<usize> = k.iter().map(|b| b + v_offset as usize).collect();
            KvLayout::new(shape.clone(), 8, MemoryKind::Host, [k, v].concat()).with_strides(strides)
        };
        pool(hb).validate().unwrap();
        let e = err_of(pool(hb - 2).validate());
        assert!(e.message().contains("bases[2] (V of layer 0)") && e.message().contains("puts rows on bytes of bases[0] (K of layer 0)"), "{}", e.message());
        // A V shifted by a whole page lands on K's next page.
        let e = err_of(pool(strides.page).validate());
        assert!(e.message().contains("puts rows on bytes of bases[0]"), "{}", e.message());
        // TensorRT-LLM: [block][layer][K/V][head][token][dim], every buffer inside every block.
        let trt = Strides { page: 2 * 2 * 2 * 4 * hb, token: hb, head: 4 * hb };
        let kv = 2 * 4 * hb;
        let bases: Vec<usize> = [0u64, 1].iter().flat_map(|&v| (0..2u64).map(move |l| (0x10000 + l * 2 * kv + v * kv) as usize)).collect();
        let trt_pool = KvLayout::new(shape.clone(), 8, MemoryKind::Host, bases.clone()).with_strides(trt);
        trt_pool.validate().unwrap();
        assert_eq!(trt_pool.buffer_bytes(), 7 * trt.page + 3 * hb + 4 * hb + hb);
        let mut clash = bases;
        clash[3] = clash[1] + 4 * hb as usize; // V of layer 1 on K of layer 1's second head
        let e = err_of(KvLayout::new(shape, 8, MemoryKind::Host, clash).with_strides(trt).validate());
        assert!(e.message().contains("bases[3] (V of layer 1)"), "{}", e.message());
    }

    /// `rows_meet` against a brute-force walk over every row of two buffers.
    #[test]
    fn rows_meet_matches_brute_force() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        for _ in 0..3000 {
            let shape = PoolShape { page_size: 1 + next(4) as u32, ..PoolShape::new(ModelKind::Mha, 1 + next(3) as u32, 1 + next(3) as u32, 1, 1, 1) };
            let hb = shape.head_bytes();
            let mut l = KvLayout::new(shape.clone(), 1 + next(3), MemoryKind::Host, vec![64]);
            l.strides = Strides { page: hb + next(40), token: hb + next(20), head: hb + next(12) };
            let Ok(ext) = l.extents() else { continue };
            let dims = l.dims_sorted();
            let rows: Vec<u64> = (0..l.capacity_pages)
                .flat_map(|p| (0..shape.page_size as u64).flat_map(move |s| (0..shape.local_heads as u64).map(move |h| (p, s, h))))
                .map(|(p, s, h)| p * l.strides.page + s * l.strides.token + h * l.strides.head)
                .collect();
            for delta in -60i128..60 {
                let brute = rows.iter().any(|&a| rows.iter().any(|&b| (b as i128 + delta - a as i128).abs() < hb as i128));
                assert_eq!(rows_meet(&dims, &ext, hb, delta), brute, "{:?} {:?} delta {delta}", l.strides, shape);
            }
        }
    }

    #[test]
    fn slot_ranges_split_by_head_where_heads_are_apart() {
        let shape = mha();
        let bases: Vec<usize> = (0..8).map(|i| 0x100000 + i * 0x100000).collect();
        let tm = KvLayout::new(shape.clone(), 10, MemoryKind::Host, bases.clone());
        assert_eq!(tm.slot_ranges(0, 17, 100, 300).unwrap(), vec![(0x100000 + 17 * 512 + 100, 300)]);
        let hm = tm.clone().with_strides(Strides { page: 16 * 512, token: 256, head: 16 * 256 });
        hm.validate().unwrap();
        assert_eq!(hm.slot_ranges(0, 17, 100, 300).unwrap(), vec![(0x100000 + 8192 + 256 + 100, 156), (0x100000 + 8192 + 4096 + 256, 144)]);
        assert!(hm.slot_ranges(0, 160, 0, 1).is_err());
        assert!(hm.slot_ranges(0, 0, 500, 13).is_err());
        assert_eq!(hm.slot_offset(17), 8192 + 256);
        assert!(!hm.linear() && tm.linear());
        // Pages of one slot: slot t is page t, `page` apart whatever the token stride says.
        let one = KvLayout::new(PoolShape { page_size: 1, ..shape.clone() }, 10, MemoryKind::Host, bases).with_strides(Strides { page: 4096, token: 512, head: 256 });
        one.validate().unwrap();
        assert!(!one.linear());
        assert_eq!(one.slot_offset(3), 3 * 4096);
    }

    #[test]
    fn check_pages_names_the_first_bad_page() {
        let l = layout();
        l.check_pages(&[0, 9, 3], "pages").unwrap();
        let e = l.check_pages(&[0, 10], "pages").unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("pages[1] = 10 is outside the pool (capacity_pages 10)"), "{}", e.message());
    }
}
