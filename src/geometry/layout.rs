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
    /// sglang's layout of a K (or latent) buffer: token slots back to back, each `local_heads`
    /// heads of `D·b` bytes.
    pub fn token_major(shape: &PoolShape) -> Strides {
        Strides::token_major_of(shape, 0)
    }

    /// [`Self::token_major`] of buffer kind `kv` (0 = K / latent, 1 = V: heads of `Dv·b`).
    pub fn token_major_of(shape: &PoolShape, kv: u32) -> Strides {
        Strides { page: shape.page_bytes_of(kv), token: shape.token_bytes_of(kv), head: shape.head_bytes_of(kv) }
    }
}

/// What the copy planner needs of a pool: its shape and the strides of each buffer kind (a bare
/// [`PoolShape`] is token-major).
pub trait PoolGeometry {
    fn shape(&self) -> &PoolShape;
    /// The strides of buffer kind `kv` (0 = K / latent, 1 = V).
    fn strides_of(&self, kv: u32) -> Strides;
}

impl PoolGeometry for PoolShape {
    fn shape(&self) -> &PoolShape {
        self
    }
    fn strides_of(&self, kv: u32) -> Strides {
        Strides::token_major_of(self, kv)
    }
}

/// A shape with the strides of its K (or latent) and V buffers.
impl PoolGeometry for (&PoolShape, [Strides; 2]) {
    fn shape(&self) -> &PoolShape {
        self.0
    }
    fn strides_of(&self, kv: u32) -> Strides {
        self.1[(kv as usize).min(1)]
    }
}

impl PoolGeometry for KvLayout {
    fn shape(&self) -> &PoolShape {
        &self.shape
    }
    fn strides_of(&self, kv: u32) -> Strides {
        KvLayout::strides_of(self, kv)
    }
}

/// A registered pool: shape, base addresses and strides.
///
/// `bases[kv * layer_count + layer_idx]` is the start of buffer `kv` (0 = K / latent, 1 = V) of
/// layer `shape.layer_ids[layer_idx]`; each buffer holds `capacity_pages` pages of `page_size`
/// token slots of `local_heads` heads, placed by its kind's [`Strides`] (`strides` for K,
/// `v_strides` for V: the same but where V's heads differ in size and V has buffers of its own).
/// Buffers may interleave (V in K's cell, every layer in one block) as long as no two rows share a
/// byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub shape: PoolShape,
    pub capacity_pages: u64,
    pub memory: MemoryKind,
    pub bases: Vec<usize>,
    pub strides: Strides,
    pub v_strides: Strides,
}

impl KvLayout {
    /// A token-major pool (sglang's layout), each buffer kind with its own head size.
    pub fn new(shape: PoolShape, capacity_pages: u64, memory: MemoryKind, bases: Vec<usize>) -> KvLayout {
        let (strides, v_strides) = (Strides::token_major_of(&shape, 0), Strides::token_major_of(&shape, 1));
        KvLayout { shape, capacity_pages, memory, bases, strides, v_strides }
    }

    /// The same pool with the bytes of every buffer (K and V) laid out by `strides`.
    pub fn with_strides(mut self, strides: Strides) -> KvLayout {
        self.strides = strides;
        self.v_strides = strides;
        self
    }

    /// The same pool with V's buffers laid out by `strides` (K's unchanged).
    pub fn with_v_strides(mut self, strides: Strides) -> KvLayout {
        self.v_strides = strides;
        self
    }

    /// The strides of buffer kind `kv` (0 = K / latent, 1 = V).
    pub fn strides_of(&self, kv: u32) -> Strides {
        if kv == 0 {
            self.strides
        } else {
            self.v_strides
        }
    }

    /// The buffer kinds of the pool (K and V, or the latent).
    fn kinds(&self) -> std::ops::Range<u32> {
        0..self.shape.buffers_per_layer()
    }

    /// Whether token slots are evenly spaced across pages (`page = page_size · token`) in every
    /// buffer: then adjacent pages are one run of slots.
    pub fn linear(&self) -> bool {
        self.kinds().all(|kv| is_linear(&self.shape, self.strides_of(kv)))
    }

    /// Byte offset of token slot `slot` (page `slot / ps`, token `slot % ps`) in a buffer of kind
    /// `kv`.
    pub fn slot_offset(&self, kv: u32, slot: u64) -> u64 {
        slot_offset(&self.shape, self.strides_of(kv), slot)
    }

    /// Buffer kind (0 = K / latent, 1 = V) of `bases[buffer]`.
    pub fn kind_of(&self, buffer: u32) -> u32 {
        buffer / self.shape.layer_count().max(1)
    }

    /// Bytes from the base of a buffer of kind `kv` to the end of its last row (saturating;
    /// `validate` rejects layouts where this overflows). For a token-major pool, `capacity_pages ·
    /// page_bytes`.
    pub fn buffer_bytes_of(&self, kv: u32) -> u64 {
        self.dims(kv).iter().fold(self.shape.head_bytes_of(kv), |end, d| d.stride.saturating_mul(d.count - 1).saturating_add(end))
    }

    /// [`Self::buffer_bytes_of`] the kind of `bases[buffer]`.
    pub fn buffer_bytes(&self, buffer: u32) -> u64 {
        self.buffer_bytes_of(self.kind_of(buffer))
    }

    /// The largest [`Self::buffer_bytes`] of the pool's buffers.
    pub fn max_buffer_bytes(&self) -> u64 {
        self.kinds().map(|kv| self.buffer_bytes_of(kv)).max().unwrap_or(0)
    }

    /// Token slots in each buffer.
    pub fn capacity_tokens(&self) -> u64 {
        self.capacity_pages.saturating_mul(self.shape.page_size as u64)
    }

    /// The strided dimensions of a buffer of kind `kv` that hold more than one index: (page,
    /// token, head).
    fn dims(&self, kv: u32) -> Vec<Dim> {
        let (s, st) = (&self.shape, self.strides_of(kv));
        let v = kv == 1;
        [
            Dim { field: if v { "v_page_stride" } else { "page_stride" }, stride: st.page, count: self.capacity_pages, what: "pages" },
            Dim { field: if v { "v_token_stride" } else { "token_stride" }, stride: st.token, count: s.page_size as u64, what: "token slots" },
            Dim { field: if v { "v_head_stride" } else { "head_stride" }, stride: st.head, count: s.local_heads as u64, what: "heads" },
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
    /// slot's bytes are counted as in a token-major slot (`local_heads` heads of the buffer's
    /// `D·b`): one range per head the bytes touch, or one when the heads are adjacent. Checked
    /// against the pool (buffer index, capacity, slot bounds).
    pub fn slot_ranges(&self, buffer: u32, slot: u64, byte_offset: u64, len: u64) -> Result<Vec<(usize, usize)>> {
        let base = *self.bases.get(buffer as usize).ok_or_else(|| Error::internal(format!("buffer {buffer} is not in the pool")))?;
        let kv = self.kind_of(buffer);
        if slot >= self.capacity_tokens() || byte_offset.checked_add(len).is_none_or(|e| e > self.shape.token_bytes_of(kv)) {
            return Err(Error::internal(format!("slot {slot} [{byte_offset}, +{len}) is outside the pool")));
        }
        let at = base as u64 + self.slot_offset(kv, slot);
        let (hb, head) = (self.shape.head_bytes_of(kv), self.strides_of(kv).head);
        if head == hb {
            return Ok(vec![((at + byte_offset) as usize, len as usize)]);
        }
        let mut out = Vec::new();
        let (mut from, end) = (byte_offset, byte_offset + len);
        while from < end {
            let (h, within) = (from / hb, from % hb);
            let n = (hb - within).min(end - from);
            out.push(((at + h * head + within) as usize, n as usize));
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
        let ext: Vec<Vec<u64>> = self.kinds().map(|kv| self.extents(kv)).collect::<Result<_>>()?;
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
            let kv = self.kind_of(i as u32);
            let buffer_bytes = *ext[kv as usize].last().expect("the outermost extent");
            let end = (base as u64).checked_add(buffer_bytes).filter(|e| *e <= usize::MAX as u64);
            let Some(end) = end else {
                return Err(geometry_invalid(
                    &self.buffer_name(i),
                    format!("{base:#x} + {buffer_bytes} bytes overflows the address space"),
                ));
            };
            spans.push((base as u64, end, i, kv));
        }
        spans.sort_unstable();
        // Buffers whose address ranges overlap may still interleave (K and V in one cell, every
        // layer in one block): compare their rows exactly where both kinds share the strides,
        // else their pages where both share the page stride.
        for (k, a) in spans.iter().enumerate() {
            for b in spans[k + 1..].iter().take_while(|b| b.0 < a.1) {
                let (sa, sb) = (self.strides_of(a.3), self.strides_of(b.3));
                let (ea, eb) = (&ext[a.3 as usize], &ext[b.3 as usize]);
                let delta = (b.0 - a.0) as i128;
                let meet = if sa == sb { rows_meet(&self.dims_sorted(a.3), ea, eb, delta) } else { self.pages_meet(a.3, b.3, ea, eb, delta) };
                if meet {
                    let why = if sa == sb { "puts rows on bytes of" } else { "puts pages on bytes of" };
                    return Err(geometry_invalid(
                        &self.buffer_name(b.2),
                        format!(
                            "{:#x} {why} {} at {:#x} (strides: page {}, token {}, head {}; rows of {} bytes)",
                            b.0,
                            self.buffer_name(a.2),
                            a.0,
                            sb.page,
                            sb.token,
                            sb.head,
                            self.shape.head_bytes_of(b.3)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether a buffer of kind `ka` and one of kind `kb` (other strides) `delta` bytes further
    /// share a byte, comparing whole pages (a page: the extent of its rows): exact where the pages
    /// are each kind's outermost dimension with one stride (K and V halves of a block), else
    /// assumed (their ranges overlap).
    fn pages_meet(&self, ka: u32, kb: u32, ext_a: &[u64], ext_b: &[u64], delta: i128) -> bool {
        let (da, db) = (self.dims_sorted(ka), self.dims_sorted(kb));
        match (da.last(), db.last()) {
            (Some(pa), Some(pb)) if pa.field.ends_with("page_stride") && pb.field.ends_with("page_stride") && pa.stride == pb.stride => {
                rows_meet(std::slice::from_ref(pa), &ext_a[da.len() - 1..], &ext_b[db.len() - 1..], delta)
            }
            _ => true,
        }
    }

    fn dims_sorted(&self, kv: u32) -> Vec<Dim> {
        let mut dims = self.dims(kv);
        dims.sort_by_key(|d| d.stride);
        dims
    }

    /// Checks the strides of buffer kind `kv` and returns the extent of each nest level, innermost
    /// first: `ext[0]` is a head row, `ext[k]` the bytes spanned by the `k` innermost dimensions,
    /// the last a buffer.
    fn extents(&self, kv: u32) -> Result<Vec<u64>> {
        let b = self.shape.dtype_bytes as u64;
        for d in self.dims(kv) {
            if d.stride == 0 || !d.stride.is_multiple_of(b) {
                return Err(geometry_invalid(
                    d.field,
                    format!("{} is not a positive multiple of dtype_bytes {b} (the {} it strides over hold whole elements)", d.stride, d.what),
                ));
            }
        }
        let mut ext = vec![self.shape.head_bytes_of(kv)];
        let mut inner = "a head's row";
        for d in self.dims_sorted(kv) {
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
    page_slot_offset(shape.page_size as u64, strides.page, strides.token, slot)
}

/// Bytes from a buffer's base to token slot `slot` of pages of `page_size` slots (the one formula
/// of the pool's addressing: layouts and copy plans both use it).
pub(crate) fn page_slot_offset(page_size: u64, page_stride: u64, token_stride: u64, slot: u64) -> u64 {
    let ps = page_size.max(1);
    (slot / ps) * page_stride + (slot % ps) * token_stride
}

/// One strided dimension of a buffer.
#[derive(Clone, Copy, Debug)]
struct Dim {
    field: &'static str,
    stride: u64,
    count: u64,
    what: &'static str,
}

/// Whether the rows of a buffer A and those of a buffer B `delta` bytes further, laid out by the
/// same `dims`, share a byte. `ext_a` / `ext_b` are their extents (rows of `ext[0]` bytes: K and
/// V rows may differ in size). The dims nest (innermost first, each stride at least the extents
/// inside it), so at each level only the one or two index differences that bring the inner nests
/// within reach of one another can meet: at most 2^levels cases, exact.
fn rows_meet(dims: &[Dim], ext_a: &[u64], ext_b: &[u64], delta: i128) -> bool {
    let Some((d, inner)) = dims.split_last() else {
        return -(ext_b[0] as i128) < delta && delta < ext_a[0] as i128;
    };
    let (s, n) = (d.stride as i128, d.count as i128);
    let (ea, eb) = (ext_a[inner.len()] as i128, ext_b[inner.len()] as i128);
    // Index differences m with -eb < delta + m·s < ea, within (-n, n).
    let lo = (-eb - delta).div_euclid(s) + 1;
    let hi = (ea - delta - 1).div_euclid(s);
    (lo.max(1 - n)..=hi.min(n - 1)).any(|m| rows_meet(inner, ext_a, ext_b, delta + m * s))
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
        assert_eq!(trt_pool.buffer_bytes(0), 7 * trt.page + 3 * hb + 4 * hb + hb);
        let mut clash = bases;
        clash[3] = clash[1] + 4 * hb as usize; // V of layer 1 on K of layer 1's second head
        let e = err_of(KvLayout::new(shape, 8, MemoryKind::Host, clash).with_strides(trt).validate());
        assert!(e.message().contains("bases[3] (V of layer 1)"), "{}", e.message());
        // V heads of their own size in TensorRT-LLM's block: K's half `[H, N, D]`, then V's `[H, N,
        // Dv]`, strides of their own and one page stride: compared page by page.
        let dv = PoolShape::new(ModelKind::Mha, 2, 64, 2, 4, 2).with_head_dim_v(32);
        let blocks = crate::geometry::LayoutPreset::Trtllm.layout(&dv, 8, MemoryKind::Host, 0x10000);
        assert_ne!(blocks.strides, blocks.v_strides);
        blocks.validate().unwrap();
        let mut shifted = blocks.clone();
        shifted.bases[2] -= 2; // V of layer 0 two bytes into K's half
        let e = err_of(shifted.validate());
        assert!(e.message().contains("bases[2] (V of layer 0)") && e.message().contains("puts pages on bytes of bases[0] (K of layer 0)"), "{}", e.message());
        let mut apart = blocks.clone();
        apart.v_strides.page += 2; // pages of another stride: not compared, refused
        assert!(err_of(apart.validate()).message().contains("puts pages on bytes of"));
    }

    /// `rows_meet` against a brute-force walk over every row of two buffers, K and V rows of
    /// different sizes included.
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
            let d = 1 + next(3) as u32;
            let shape = PoolShape { page_size: 1 + next(4) as u32, ..PoolShape::new(ModelKind::Mha, 1 + next(3) as u32, d, 1, 1, 1).with_head_dim_v(1 + next(3) as u32) };
            let (ra, rb) = (shape.head_bytes_of(0), shape.head_bytes_of(1));
            let row = ra.max(rb);
            let l = KvLayout::new(shape.clone(), 1 + next(3), MemoryKind::Host, vec![64, 64])
                .with_strides(Strides { page: row + next(40), token: row + next(20), head: row + next(12) });
            let (Ok(ea), Ok(eb)) = (l.extents(0), l.extents(1)) else { continue };
            let dims = l.dims_sorted(0);
            let rows: Vec<u64> = (0..l.capacity_pages)
                .flat_map(|p| (0..shape.page_size as u64).flat_map(move |s| (0..shape.local_heads as u64).map(move |h| (p, s, h))))
                .map(|(p, s, h)| p * l.strides.page + s * l.strides.token + h * l.strides.head)
                .collect();
            for delta in -60i128..60 {
                // A's rows [a, a + ra), B's [b + delta, + rb).
                let brute = rows.iter().any(|&a| rows.iter().any(|&b| {
                    let (lo, hi) = (b as i128 + delta, b as i128 + delta + rb as i128);
                    lo < a as i128 + ra as i128 && (a as i128) < hi
                }));
                assert_eq!(rows_meet(&dims, &ea, &eb, delta), brute, "{:?} {:?} delta {delta}", l.strides, shape);
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
        assert_eq!(hm.slot_offset(0, 17), 8192 + 256);
        assert!(!hm.linear() && tm.linear());
        // Pages of one slot: slot t is page t, `page` apart whatever the token stride says.
        let one = KvLayout::new(PoolShape { page_size: 1, ..shape.clone() }, 10, MemoryKind::Host, bases).with_strides(Strides { page: 4096, token: 512, head: 256 });
        one.validate().unwrap();
        assert!(!one.linear());
        assert_eq!(one.slot_offset(0, 3), 3 * 4096);
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
