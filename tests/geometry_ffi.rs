//! The geometry C exports, called through their Rust symbols the way C calls them: results,
//! status codes, and the last error naming the argument.

use std::ffi::CStr;

use kvstage::ffi::geometry::*;
use kvstage::ffi::kvstage_error;
use kvstage::ffi::pool::*;
use kvstage::Status;

fn last_error() -> (Status, String, Vec<String>) {
    // SAFETY: kvstage_error_last never returns NULL; strings are NUL-terminated.
    unsafe {
        let e: &kvstage_error = &*kvstage::ffi::last_error::kvstage_error_last();
        let text = |p| CStr::from_ptr(p).to_string_lossy().into_owned();
        let causes = (0..e.cause_count).map(|i| text(*e.causes.add(i))).collect();
        (e.code, text(e.message), causes)
    }
}

#[test]
fn head_slice_examples_and_errors() {
    let mut out = kvstage_head_slice::default();
    // P4→D2, H=8: prefill rank 3 feeds decode rank 1 at heads 2..4.
    assert_eq!(unsafe { kvstage_head_slice_compute(4, 2, 3, 1, 8, &mut out) }, Status::KVSTAGE_OK);
    assert_eq!(out, kvstage_head_slice { src_head_start: 0, num_heads: 2, dst_head_start: 2 });
    // P1→D4, H=2: decode rank 2 reads head 1.
    assert_eq!(unsafe { kvstage_head_slice_compute(1, 4, 0, 2, 2, &mut out) }, Status::KVSTAGE_OK);
    assert_eq!(out, kvstage_head_slice { src_head_start: 1, num_heads: 1, dst_head_start: 0 });
    assert_eq!(last_error().0, Status::KVSTAGE_OK);

    let before = out;
    for (args, name) in [
        ((4, 2, 4, 1, 8), "`src_rank`"),
        ((4, 2, 0, 2, 8), "`dst_rank`"),
        ((0, 2, 0, 0, 8), "`src_tp`"),
        ((4, 2, 0, 0, 6), "`total_kv_heads`"),
        ((4, 2, 2, 0, 8), "`src_rank`"),
    ] {
        let (a, b, c, d, e) = args;
        let st = unsafe { kvstage_head_slice_compute(a, b, c, d, e, &mut out) };
        assert_eq!(st, Status::KVSTAGE_E_INVALID_ARG);
        assert!(st.code() < 0);
        let (code, message, _) = last_error();
        assert_eq!(code, Status::KVSTAGE_E_INVALID_ARG);
        assert!(message.contains(name), "{message} does not name {name}");
        assert_eq!(out, before, "out written on failure");
    }
    assert_eq!(unsafe { kvstage_head_slice_compute(4, 2, 3, 1, 8, std::ptr::null_mut()) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`out`"));
}

#[test]
fn writers_and_grid() {
    // The writers of a chunk, from the staging layout: 8 heads, prefill TP 8 in 2 stages into
    // decode TP 2: each decode rank's 4 heads from 4 prefill ranks, each stage on its own.
    let layers: Vec<u32> = (0..4).collect();
    let mut stages = [layout(0, 8, &layers[..2]), layout(0, 8, &layers[2..])];
    (stages[0].pp_rank, stages[0].pp_size, stages[1].pp_rank, stages[1].pp_size) = (0, 2, 1, 2);
    let dst = layout(0, 2, &layers);
    let mut out = kvstage_staging_layout { struct_size: std::mem::size_of::<kvstage_staging_layout>(), ..Default::default() };
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 2, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 64, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_OK);
    assert_eq!((out.num_writers, out.num_tp_writers), (8, 4));
    // 8 heads do not split over prefill TP 3.
    let uneven = [layout(0, 3, &layers)];
    assert_eq!(unsafe { kvstage_staging_layout_compute(uneven.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 64, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_E_GEOMETRY_INVALID);
    let (_, message, causes) = last_error();
    assert!(message.contains("`prefill_stages[0]`") && causes[0].contains("8 and tp_size 3 do not divide"), "{message}: {causes:?}");
    let mut n = 0u32;
    assert_eq!(unsafe { kvstage_grid_tokens_compute(8200, 64, &mut n) }, Status::KVSTAGE_OK);
    assert_eq!(n, 8192);
    assert_eq!(unsafe { kvstage_grid_tokens_compute(KVSTAGE_DEFAULT_CHUNK_TOKENS, 0, &mut n) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`page_size`"));
    assert_eq!(KVSTAGE_DEFAULT_CHUNK_TOKENS, kvstage::geometry::DEFAULT_CHUNK_TOKENS);
}

fn layout(tp_rank: u32, tp: u32, layers: &[u32]) -> kvstage_kv_layout {
    let mut l = kvstage_kv_layout { struct_size: 0, ..Default::default() };
    assert_eq!(unsafe { kvstage_kv_layout_init(&mut l, std::mem::size_of::<kvstage_kv_layout>()) }, Status::KVSTAGE_OK);
    assert_eq!(l.struct_size, std::mem::size_of::<kvstage_kv_layout>());
    l.page_size = 16;
    l.global_heads = 8;
    l.local_heads = (8 / tp).max(1);
    l.head_dim = 128;
    l.tp_rank = tp_rank;
    l.tp_size = tp;
    l.layer_ids = layers.as_ptr();
    l.num_layers = layers.len();
    l
}

#[test]
fn staging_layout_fills_caller_storage_and_reports_the_count() {
    let layers: Vec<u32> = (0..80).collect();
    let (src, dst) = (layout(0, 4, &layers), layout(1, 2, &layers));
    let stages = [src];
    let mut out = kvstage_staging_layout { struct_size: std::mem::size_of::<kvstage_staging_layout>(), ..Default::default() };
    // Count query.
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_OK);
    assert_eq!((out.num_writers, out.num_tp_writers), (2, 2));
    assert_eq!(out.total_bytes, 1280 << 20);
    assert_eq!((out.row_bytes, out.slab_bytes, out.tokens, out.num_heads, out.buffers_per_layer), (512, 8192 * 512, 8192, 2, 2));
    // Too small: count still reported, error names writers_len.
    let unset = kvstage_staging_writer { struct_size: std::mem::size_of::<kvstage_staging_writer>(), ..Default::default() };
    let mut one = [unset; 1];
    out.num_writers = 0;
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut out, one.as_mut_ptr(), 1) }, Status::KVSTAGE_E_INVALID_ARG);
    assert_eq!(out.num_writers, 2);
    assert!(last_error().1.contains("`writers_len`: 1 entries are too few: the layout has 2 writers"));
    assert_eq!(one[0], unset);
    // Enough room.
    let mut w = [unset; 3];
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut out, w.as_mut_ptr(), 3) }, Status::KVSTAGE_OK);
    assert_eq!(
        w[1],
        kvstage_staging_writer {
            struct_size: std::mem::size_of::<kvstage_staging_writer>(),
            offset: 640 << 20,
            bytes: 640 << 20,
            layers: 80,
            src_tp_rank: 3,
            src_pp_rank: 0,
            tp_writer: 1,
            src_head_start: 0,
            num_heads: 2,
            dst_head_start: 2,
            slab_bytes: 8192 * 512,
            v_slab_bytes: 8192 * 512,
        }
    );
    assert_eq!(w[2], unset);
    // An older caller's smaller struct gets only its fields.
    let mut small = kvstage_staging_layout { struct_size: 16, tokens: 77, ..Default::default() };
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut small, std::ptr::null_mut(), 0) }, Status::KVSTAGE_OK);
    assert_eq!((small.total_bytes, small.tokens, small.struct_size), (1280 << 20, 77, 16));

    // Uneven stages (50 + 30 layers): one region per (stage, head group), sized by what it holds.
    let (first, second): (Vec<u32>, Vec<u32>) = ((0..50).collect(), (50..80).collect());
    let mut s0 = layout(0, 4, &first);
    let mut s1 = layout(0, 4, &second);
    (s0.pp_rank, s0.pp_size, s1.pp_rank, s1.pp_size) = (0, 2, 1, 2);
    let stages = [s0, s1];
    let mut w = [unset; 4];
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 2, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut out, w.as_mut_ptr(), 4) }, Status::KVSTAGE_OK);
    assert_eq!((out.num_writers, out.total_bytes), (4, 1280 << 20));
    let slab = 8192 * 512 * 2;
    assert_eq!(w.map(|w| (w.src_pp_rank, w.tp_writer, w.layers, w.bytes)), [(0, 0, 50, 50 * slab), (0, 1, 50, 50 * slab), (1, 0, 30, 30 * slab), (1, 1, 30, 30 * slab)]);
    assert_eq!(w[3].offset, 2 * 50 * slab + 30 * slab);
    // Stages that leave a decode layer out are refused, naming it.
    s0.pp_size = 1;
    let stages = [s0];
    assert_eq!(unsafe { kvstage_staging_layout_compute(stages.as_ptr(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 8192, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_E_GEOMETRY_MISMATCH);
    assert!(last_error().2[0].starts_with("decode layers: local [50, 51,"), "{:?}", last_error());
}

#[test]
fn staging_layout_errors_name_the_argument_and_field() {
    let layers: Vec<u32> = (0..4).collect();
    let (src, mut dst) = (layout(0, 4, &layers), layout(1, 2, &layers));
    let mut out = kvstage_staging_layout { struct_size: std::mem::size_of::<kvstage_staging_layout>(), ..Default::default() };
    let call = |src: &kvstage_kv_layout, dst: &kvstage_kv_layout, out: &mut kvstage_staging_layout| unsafe {
        kvstage_staging_layout_compute(src, 1, dst, std::ptr::null(), 0, std::ptr::null(), 0, 64, out, std::ptr::null_mut(), 0)
    };
    dst.local_heads = 2;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_E_GEOMETRY_INVALID);
    let (_, message, causes) = last_error();
    assert_eq!(message, "`dst` is not a valid KV layout");
    assert!(causes[0].contains("`local_heads`: 2 != 4"), "{causes:?}");
    dst.local_heads = 4;
    dst.head_dim = 64;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
    assert_eq!(last_error().2, vec!["head_dim: local 64 != remote 128"]);
    dst.head_dim = 128;
    dst.model_kind = 7;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`dst->model_kind`: 7 is not a kvstage_model_kind value"));
    dst.model_kind = 0;
    dst.struct_size = 3;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`dst->struct_size`"));
    dst.struct_size = std::mem::size_of::<kvstage_kv_layout>();
    dst.num_layers = 0;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`dst->num_layers`: 0"));
    dst.num_layers = 4;
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_OK);
    assert_eq!(unsafe { kvstage_staging_layout_compute(std::ptr::null(), 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 64, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`prefill_stages`: is NULL"), "{:?}", last_error());
    // Any token count: a request's last chunk may end inside a page.
    assert_eq!(unsafe { kvstage_staging_layout_compute(&src, 1, &dst, std::ptr::null(), 0, std::ptr::null(), 0, 60, &mut out, std::ptr::null_mut(), 0) }, Status::KVSTAGE_OK);
    assert_eq!(out.tokens, 60);
    // A NULL layer list means layers 0..num_layers-1.
    dst.layer_ids = std::ptr::null();
    assert_eq!(call(&src, &dst, &mut out), Status::KVSTAGE_OK);
}

#[test]
fn kv_layout_conversion_and_validation() {
    let layers = [2u32, 5];
    let mut l = layout(1, 2, &layers);
    l.capacity_pages = 4;
    let bytes = 4 * 16 * 4 * 128 * 2u64;
    let k = [0x10_0000u64, 0x10_0000 + bytes];
    let v = [0x10_0000 + 2 * bytes, 0x10_0000 + 3 * bytes];
    l.k_bases = k.as_ptr();
    l.v_bases = v.as_ptr();
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_OK);
    let kv = unsafe { kv_layout_from_c(&l, "layout") }.unwrap();
    assert_eq!(kv.shape.layer_ids, vec![2, 5]);
    assert_eq!(kv.bases, vec![k[0] as usize, k[1] as usize, v[0] as usize, v[1] as usize]);
    assert_eq!(kv.buffer_bytes(0), bytes);

    let v_overlap = [v[0], v[0] + 8];
    l.v_bases = v_overlap.as_ptr();
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_E_GEOMETRY_INVALID);
    assert!(last_error().2[0].contains("puts rows on bytes of"), "{:?}", last_error());
    l.v_bases = std::ptr::null();
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`layout->v_bases`: is NULL and v_offset is 0"), "{:?}", last_error());
    // MLA ignores v_bases.
    l.model_kind = kvstage_model_kind::KVSTAGE_MODEL_MLA as i32;
    l.global_heads = 1;
    l.local_heads = 1;
    l.head_dim = 256;
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_OK, "{:?}", last_error());
    l.memory_kind = 5;
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`layout->memory_kind`: 5"));
    l.memory_kind = kvstage_memory_kind::KVSTAGE_MEMORY_CUDA as i32;
    assert_eq!(unsafe { kv_layout_from_c(&l, "pool") }.unwrap().memory, kvstage::geometry::MemoryKind::Cuda);
    l.capacity_pages = 0;
    assert_eq!(unsafe { kvstage_kv_layout_validate(&l) }, Status::KVSTAGE_E_GEOMETRY_INVALID);
    assert!(last_error().2[0].contains("`capacity_pages`: is 0"));
    assert_eq!(unsafe { kvstage_kv_layout_init(std::ptr::null_mut(), std::mem::size_of::<kvstage_kv_layout>()) }, Status::KVSTAGE_E_INVALID_ARG);
    // The caller's size must be at least the first published struct's.
    let mut l = kvstage_kv_layout::default();
    assert_eq!(unsafe { kvstage_kv_layout_init(&mut l, 3) }, Status::KVSTAGE_E_INVALID_ARG);
    assert!(last_error().1.contains("`size`"), "{:?}", last_error());
    assert_eq!(unsafe { kvstage_kv_layout_validate(std::ptr::null()) }, Status::KVSTAGE_E_INVALID_ARG);
}
