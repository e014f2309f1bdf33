//! The slice path: one write per (buffer, layer, token) of a head slice, pool to pool. Used as
//! the explicit fallback when staging is impossible and as the benchmark baseline.

use super::heads::HeadSlice;
use super::span::PageSpan;
use super::{agreed_field_mismatches, mismatch_error, PoolGeometry, PoolShape};
use crate::error::{Error, FieldMismatch, Result};

/// One write of the slice path: `len` bytes from `src_offset` in source buffer `src_buffer` to
/// `dst_offset` in destination buffer `dst_buffer` (buffer indices as in `KvLayout::bases`). The
/// source bytes are `src_pieces` pieces of `len / src_pieces` bytes, `src_piece_stride` apart
/// (one piece where the prefill pool's heads are adjacent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceOp {
    pub src_buffer: u32,
    pub src_offset: u64,
    pub dst_buffer: u32,
    pub dst_offset: u64,
    pub len: u64,
    pub src_pieces: u32,
    pub src_piece_stride: u64,
}

/// Every write the slice path issues from prefill pool `src` to decode pool `dst` for the heads of
/// `hs`: for each buffer kind (K, V; or the MLA latent), each layer both pools hold, each token of
/// `src_span` / `dst_span` (paired in order; the two sides' page sizes may differ). MHA yields
/// `2 · L · T` ops, MLA `L · T`. The source offsets are `src`'s memory (its strides: a row in one
/// piece per head where its heads are apart); the destination offsets count a token-major pool of
/// `dst`'s shape, which the receiver places in its own layout. No coalescing: this is the
/// per-token list a naive transfer would issue.
pub fn slice_plan<S: PoolGeometry + ?Sized>(src: &S, dst: &PoolShape, hs: &HeadSlice, src_span: &PageSpan, dst_span: &PageSpan) -> Result<Vec<SliceOp>> {
    let geometry = src;
    let src = src.shape();
    src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
    dst.validate().map_err(|e| e.context("decode (dst) pool shape"))?;
    let list = agreed_field_mismatches(src, dst);
    if !list.is_empty() {
        return Err(mismatch_error("prefill and decode pools", list));
    }
    src_span.check(src.page_size, "src_pages", "src_first_token")?;
    dst_span.check(dst.page_size, "dst_pages", "dst_first_token")?;
    if src_span.tokens != dst_span.tokens {
        return Err(Error::invalid_arg("dst_pages", format!("span {} tokens, the source span {}", dst_span.tokens, src_span.tokens)));
    }
    let n = hs.num_heads as u64;
    if n == 0 {
        return Err(Error::invalid_arg("head_slice", "num_heads is 0"));
    }
    if hs.src_head_start as u64 + n > src.local_heads as u64 {
        return Err(Error::invalid_arg(
            "head_slice",
            format!("source heads {}..{} exceed the prefill pool's {} local heads", hs.src_head_start, hs.src_head_start as u64 + n, src.local_heads),
        ));
    }
    if hs.dst_head_start as u64 + n > dst.local_heads as u64 {
        return Err(Error::invalid_arg(
            "head_slice",
            format!("destination heads {}..{} exceed the decode pool's {} local heads", hs.dst_head_start, hs.dst_head_start as u64 + n, dst.local_heads),
        ));
    }
    let layers: Vec<(u32, u32)> = src
        .layer_ids
        .iter()
        .enumerate()
        .filter_map(|(i, id)| dst.layer_index(*id).map(|j| (i as u32, j)))
        .collect();
    if layers.is_empty() {
        return Err(mismatch_error(
            "prefill and decode pools share no layer",
            vec![FieldMismatch {
                field: "layer_ids".into(),
                local: format!("{:?}", src.layer_ids),
                remote: format!("{:?}", dst.layer_ids),
            }],
        ));
    }
    // Pool slot of span token `t`.
    let slot = |span: &PageSpan, ps: u32, t: u64| {
        let at = span.first_token as u64 + t;
        span.pages[(at / ps as u64) as usize] as u64 * ps as u64 + at % ps as u64
    };
    let per_buffer = layers.len() * src_span.tokens as usize;
    let mut ops = Vec::with_capacity(per_buffer * src.buffers_per_layer() as usize);
    for kv in 0..src.buffers_per_layer() {
        let (strides, dtb, hb) = (geometry.strides_of(kv), dst.token_bytes_of(kv), src.head_bytes_of(kv));
        let len = n * hb;
        let pieces = if n == 1 || strides.head == hb { 1 } else { n };
        for &(si, di) in &layers {
            let (sb, db) = (src.buffer_index(kv, si), dst.buffer_index(kv, di));
            for t in 0..src_span.tokens {
                ops.push(SliceOp {
                    src_buffer: sb,
                    src_offset: super::layout::slot_offset(src, strides, slot(src_span, src.page_size, t)) + hs.src_head_start as u64 * strides.head,
                    dst_buffer: db,
                    dst_offset: slot(dst_span, dst.page_size, t) * dtb + hs.dst_head_start as u64 * hb,
                    len,
                    src_pieces: pieces as u32,
                    src_piece_stride: if pieces == 1 { len } else { strides.head },
                });
            }
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;
    use crate::geometry::{head_slice, ModelKind};

    #[test]
    fn count_is_two_l_t_for_mha() {
        let base = PoolShape::new(ModelKind::Mha, 8, 128, 2, 1, 80);
        let (src, dst) = (base.clone().with_tp(1, 4), base.with_tp(0, 2));
        let hs = head_slice(4, 2, 1, 0, 8).unwrap();
        let pages: Vec<u32> = (0..8192).collect();
        let ops = slice_plan(&src, &dst, &hs, &PageSpan::whole(&pages, 1), &PageSpan::whole(&pages, 1)).unwrap();
        // docs/GEOMETRY.md, "Sizes": 70B, P4→D2, 8192-token chunk: 1,310,720 writes of 512 B per pair.
        assert_eq!(ops.len(), 1_310_720);
        assert!(ops.iter().all(|o| o.len == 512));
        assert_eq!(ops[1], SliceOp { src_buffer: 0, src_offset: 512, dst_buffer: 0, dst_offset: 1024 + 512, len: 512, src_pieces: 1, src_piece_stride: 512 });
        assert_eq!(ops[8192 * 80].src_buffer, 80);
    }

    #[test]
    fn mla_and_paged() {
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 4, 3);
        let ops = slice_plan(&mla.clone().with_tp(1, 2), &mla.clone().with_tp(0, 4), &HeadSlice::MLA, &PageSpan::whole(&[5, 2], 4), &PageSpan::whole(&[0, 9], 4)).unwrap();
        assert_eq!(ops.len(), 3 * 2 * 4);
        assert_eq!(ops[5], SliceOp { src_buffer: 0, src_offset: (2 * 4 + 1) * 1152, dst_buffer: 0, dst_offset: (9 * 4 + 1) * 1152, len: 1152, src_pieces: 1, src_piece_stride: 1152 });
        // Prefill pages of 4 from slot 3, decode pages of 2: token 2 is slot 1 of page 2 there and
        // slot 0 of decode page 9.
        let mut big = mla.clone();
        big.page_size = 2;
        let ops = slice_plan(&mla, &big, &HeadSlice::MLA, &PageSpan { pages: &[5, 2], first_token: 3, tokens: 3 }, &PageSpan { pages: &[0, 9], first_token: 0, tokens: 3 }).unwrap();
        assert_eq!(ops.len(), 3 * 3);
        assert_eq!(ops[2], SliceOp { src_buffer: 0, src_offset: (2 * 4 + 1) * 1152, dst_buffer: 0, dst_offset: (9 * 2) * 1152, len: 1152, src_pieces: 1, src_piece_stride: 1152 });
    }

    #[test]
    fn slice_errors() {
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 1, 2);
        let (src, dst) = (base.clone().with_tp(1, 4), base.clone().with_tp(0, 2));
        let hs = HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 2 };
        let one = PageSpan::whole(&[1], 1);
        let e = slice_plan(&src, &dst, &hs, &one, &PageSpan::whole(&[1, 2], 1)).unwrap_err();
        assert!(e.message().contains("`dst_pages`: span 2 tokens, the source span 1"), "{}", e.message());
        let e = slice_plan(&src, &dst, &hs, &PageSpan { pages: &[1], first_token: 1, tokens: 1 }, &one).unwrap_err();
        assert!(e.message().contains("`src_first_token`: 1 is not inside the first page"), "{}", e.message());
        let e = slice_plan(&src, &dst, &HeadSlice { dst_head_start: 3, ..hs }, &one, &one).unwrap_err();
        assert!(e.message().contains("destination heads 3..5 exceed the decode pool's 4 local heads"));
        let e = slice_plan(&src, &dst, &HeadSlice { src_head_start: 1, ..hs }, &one, &one).unwrap_err();
        assert!(e.message().contains("source heads 1..3 exceed"));
        let e = slice_plan(&src, &dst, &HeadSlice { num_heads: 0, ..hs }, &one, &one).unwrap_err();
        assert!(e.message().contains("num_heads is 0"));
        let e = slice_plan(&src, &dst.clone().with_pp(0, 1, vec![7]), &hs, &one, &one).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        let mut d = dst.clone();
        d.dtype_bytes = 4;
        assert_eq!(slice_plan(&src, &d, &hs, &one, &one).unwrap_err().causes(), vec!["dtype_bytes: local 2 != remote 4"]);
    }

    /// A head-major prefill pool: one op per token all the same (the receiver's coverage counts
    /// whole head rows), its source in one piece per head, `head_stride` apart; the destination
    /// offset still counts a token-major decode slot.
    #[test]
    fn head_major_sources_send_a_row_in_pieces() {
        let base = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 2);
        let (src, dst) = (base.clone().with_tp(0, 2), base.with_tp(1, 4));
        let hs = head_slice(2, 4, 0, 1, 8).unwrap(); // decode rank 1 reads heads 2..4 of prefill rank 0
        let strides = crate::geometry::Strides { page: 4 * 16 * 256, token: 256, head: 16 * 256 };
        let pool = crate::geometry::KvLayout::new(src.clone(), 4, crate::geometry::MemoryKind::Host, (0..4).map(|i| 0x10_0000 * (i + 1)).collect()).with_strides(strides);
        pool.validate().unwrap();
        let ops = slice_plan(&pool, &dst, &hs, &PageSpan::whole(&[2], 16), &PageSpan::whole(&[0], 16)).unwrap();
        assert_eq!(ops.len(), 2 * 2 * 16);
        assert_eq!(ops[3], SliceOp { src_buffer: 0, src_offset: 2 * strides.page + 3 * 256 + 2 * strides.head, dst_buffer: 0, dst_offset: 3 * 512, len: 512, src_pieces: 2, src_piece_stride: strides.head });
    }
}
