//! The slice path: one write per (buffer, layer, token) of a head slice, pool to pool. Used as
//! the explicit fallback when staging is impossible and as the benchmark baseline.

use super::heads::HeadSlice;
use super::{agreed_field_mismatches, mismatch_error, PoolShape};
use crate::error::{Error, FieldMismatch, Result};

/// One write of the slice path: `len` bytes from `src_offset` in source buffer `src_buffer` to
/// `dst_offset` in destination buffer `dst_buffer` (buffer indices as in `KvLayout::bases`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceOp {
    pub src_buffer: u32,
    pub src_offset: u64,
    pub dst_buffer: u32,
    pub dst_offset: u64,
    pub len: u64,
}

/// Every write the slice path issues from prefill pool `src` to decode pool `dst` for the heads of
/// `hs`: for each buffer kind (K, V; or the MLA latent), each layer both pools hold, each token of
/// `src_pages` / `dst_pages` (paired in order). MHA yields `2 · L · T` ops, MLA `L · T`. No
/// coalescing: this is the per-token list a naive transfer would issue.
pub fn slice_plan(src: &PoolShape, dst: &PoolShape, hs: &HeadSlice, src_pages: &[u32], dst_pages: &[u32]) -> Result<Vec<SliceOp>> {
    src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
    dst.validate().map_err(|e| e.context("decode (dst) pool shape"))?;
    let list = agreed_field_mismatches(src, dst);
    if !list.is_empty() {
        return Err(mismatch_error("prefill and decode pools", list));
    }
    if src_pages.len() != dst_pages.len() {
        return Err(Error::invalid_arg(
            "dst_pages",
            format!("holds {} pages, src_pages {}", dst_pages.len(), src_pages.len()),
        ));
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
    let ps = src.page_size as u64;
    let (stb, dtb, hb) = (src.token_bytes(), dst.token_bytes(), src.head_bytes());
    let len = n * hb;
    let per_buffer = layers.len() * src_pages.len() * ps as usize;
    let mut ops = Vec::with_capacity(per_buffer * src.buffers_per_layer() as usize);
    for kv in 0..src.buffers_per_layer() {
        for &(si, di) in &layers {
            let (sb, db) = (src.buffer_index(kv, si), dst.buffer_index(kv, di));
            for (&sp, &dp) in src_pages.iter().zip(dst_pages) {
                for t in 0..ps {
                    ops.push(SliceOp {
                        src_buffer: sb,
                        src_offset: (sp as u64 * ps + t) * stb + hs.src_head_start as u64 * hb,
                        dst_buffer: db,
                        dst_offset: (dp as u64 * ps + t) * dtb + hs.dst_head_start as u64 * hb,
                        len,
                    });
                }
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
        let ops = slice_plan(&src, &dst, &hs, &pages, &pages).unwrap();
        // GEOMETRY.md: 70B, P4→D2, 8192-token chunk: 1,310,720 writes of 512 B per pair.
        assert_eq!(ops.len(), 1_310_720);
        assert!(ops.iter().all(|o| o.len == 512));
        assert_eq!(ops[1], SliceOp { src_buffer: 0, src_offset: 512, dst_buffer: 0, dst_offset: 1024 + 512, len: 512 });
        assert_eq!(ops[8192 * 80].src_buffer, 80);
    }

    #[test]
    fn mla_and_paged() {
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 4, 3);
        let ops = slice_plan(&mla.clone().with_tp(1, 2), &mla.with_tp(0, 4), &HeadSlice::MLA, &[5, 2], &[0, 9]).unwrap();
        assert_eq!(ops.len(), 3 * 2 * 4);
        assert_eq!(ops[5], SliceOp { src_buffer: 0, src_offset: (2 * 4 + 1) * 1152, dst_buffer: 0, dst_offset: (9 * 4 + 1) * 1152, len: 1152 });
    }

    #[test]
    fn slice_errors() {
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 1, 2);
        let (src, dst) = (base.clone().with_tp(1, 4), base.clone().with_tp(0, 2));
        let hs = HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 2 };
        assert!(slice_plan(&src, &dst, &hs, &[1], &[1, 2]).unwrap_err().message().contains("`dst_pages`: holds 2 pages, src_pages 1"));
        let e = slice_plan(&src, &dst, &HeadSlice { dst_head_start: 3, ..hs }, &[1], &[1]).unwrap_err();
        assert!(e.message().contains("destination heads 3..5 exceed the decode pool's 4 local heads"));
        let e = slice_plan(&src, &dst, &HeadSlice { src_head_start: 1, ..hs }, &[1], &[1]).unwrap_err();
        assert!(e.message().contains("source heads 1..3 exceed"));
        let e = slice_plan(&src, &dst, &HeadSlice { num_heads: 0, ..hs }, &[1], &[1]).unwrap_err();
        assert!(e.message().contains("num_heads is 0"));
        let e = slice_plan(&src, &dst.clone().with_pp(0, 1, vec![7]), &hs, &[1], &[1]).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        let mut d = dst.clone();
        d.page_size = 4;
        assert_eq!(slice_plan(&src, &d, &hs, &[1], &[1]).unwrap_err().causes(), vec!["page_size: local 1 != remote 4"]);
    }
}
