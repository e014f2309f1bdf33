//! Per-request state items (Mamba/GDN conv and SSM states) under a TP change: the pure plan of
//! which bytes of a prefill rank's slot go where in a decode rank's slot.

use super::{ffi_fn, out_arg, slice_arg, versioned_struct, write_array};
use crate::error::{Error, Result, Status};
use crate::geometry::{self, StateItem};

/// One state item (one slot of one layer): `outer` rows of `sum(group_dims)` elements of
/// `dtype_bytes` each. Sharded (`replicated` 0), each TP rank holds, per row, its share of every
/// group, groups back to back: rank `r` of `tp` holds elements `[r·g/tp, (r+1)·g/tp)` of a group of
/// `g` (a conv state's key, key and value groups each sharded on their own; one group: the whole
/// row). Replicated (`replicated` 1): whole on every rank. Fill with `kvstage_state_item_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_state_item {
    pub struct_size: usize,
    pub outer: u32,
    pub dtype_bytes: u32,
    /// Global elements of each group of a row, `num_groups` entries.
    pub group_dims: *const u32,
    pub num_groups: usize,
    /// 1: the item is whole on every rank (nothing to shard); 0: sharded by groups.
    pub replicated: i32,
}

impl Default for kvstage_state_item {
    fn default() -> Self {
        kvstage_state_item {
            struct_size: std::mem::size_of::<Self>(),
            outer: 1,
            dtype_bytes: 2,
            group_dims: std::ptr::null(),
            num_groups: 0,
            replicated: 0,
        }
    }
}

/// `len` bytes at `src_offset` of the prefill rank's slot go to `dst_offset` of the decode rank's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_byte_range {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// Fills `item` with defaults (sets `struct_size`; one row, 2-byte elements, sharded; set
/// `group_dims` and `num_groups`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_state_item_init(item: *mut kvstage_state_item) -> Status {
    ffi_fn!(status {
        *out_arg(item, "item")? = kvstage_state_item::default();
        Ok(Status::KVSTAGE_OK)
    })
}

pub(super) unsafe fn state_item(ptr: *const kvstage_state_item) -> Result<StateItem> {
    let raw: kvstage_state_item = unsafe { versioned_struct(ptr, "item", std::mem::size_of::<kvstage_state_item>()) }?;
    let groups = unsafe { slice_arg(raw.group_dims, raw.num_groups, "item->group_dims") }?;
    let replicated = match raw.replicated {
        0 => false,
        1 => true,
        other => return Err(Error::invalid_arg("item->replicated", format!("{other} is neither 0 nor 1"))),
    };
    Ok(StateItem { outer: raw.outer, groups: groups.to_vec(), dtype_bytes: raw.dtype_bytes, replicated })
}

/// Which bytes of prefill rank `src_rank`'s slot (of `src_tp` ranks) go where in decode rank
/// `dst_rank`'s slot (of `dst_tp`) for `item`: byte ranges in row order, adjacent ones merged,
/// into `out[capacity]`; `*count` receives their number, also when `capacity` is too small
/// (`KVSTAGE_E_INVALID_ARG`); `out` NULL with `capacity` 0 is a count query. No range: the two
/// ranks share no element (`KVSTAGE_OK`, count 0). A decode slot is assembled from every prefill
/// rank's ranges (prefill TP larger) or cut from one rank's (smaller); a replicated item comes
/// whole from prefill rank `dst_rank · src_tp / dst_tp` (rounded down) alone. Slot sizes: `outer · Σ(group_dims) /
/// tp · dtype_bytes` (sharded), `outer · Σ(group_dims) · dtype_bytes` (replicated).
/// `KVSTAGE_E_INVALID_ARG` names the field: a group that does not split among either side's TP
/// ranks (both values), ranks not below their TP size, zero sizes.
#[no_mangle]
pub unsafe extern "C" fn kvstage_state_slice_compute(
    item: *const kvstage_state_item,
    src_tp: u32,
    dst_tp: u32,
    src_rank: u32,
    dst_rank: u32,
    out: *mut kvstage_byte_range,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let item = unsafe { state_item(item) }?;
        let ranges: Vec<kvstage_byte_range> = geometry::state_slice(&item, src_tp, dst_tp, src_rank, dst_rank)?
            .iter()
            .map(|r| kvstage_byte_range { src_offset: r.src, dst_offset: r.dst, len: r.len })
            .collect();
        unsafe { write_array(&ranges, out, capacity, count, "ranges") }
    })
}
