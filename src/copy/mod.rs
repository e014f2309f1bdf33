//! Copy engines: execute a [`CopyPlan`] between a registered pool and a staging region.
//!
//! Every engine consumes the same plan (see [`crate::geometry::plan`]); the host engine uses
//! memcpy on CPU threads, the CUDA engine ([`cuda`]) launches a kernel over the same slabs ×
//! segments. [`engine_for`] picks the engine for a pool; [`AnyCopyEngine`] picks per call.

use crate::deadline::Deadline;
use crate::error::{Error, Result, Status};
use crate::geometry::{CopyPlan, KvLayout, RowGeometry};

mod any;
mod block;
pub mod cuda;
mod host;
mod nt;
mod parts;
pub mod rows;

pub use any::{check_pool, engine_for, AnyCopyEngine};
pub use cuda::{CudaCopyEngine, HostPin, ReadyFence};
pub use host::HostCopyEngine;
pub use parts::{Component, Components};

/// Gather (pool → staging) and scatter (staging → pool) of one plan.
pub trait CopyEngine: Send + Sync {
    /// Copies the plan's pool rows into the writer region at `staging`.
    ///
    /// # Safety
    /// Every buffer in `pool.bases` must be valid for reads of `pool.buffer_bytes()` bytes, and
    /// `staging` (the start of the writer region, not of the allocation) valid for writes of
    /// `plan.staging_bytes` bytes, neither overlapping the other, for the duration of the call.
    unsafe fn gather(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8) -> Result<()>;

    /// Copies the writer region at `staging` into the plan's pool rows.
    ///
    /// # Safety
    /// As for [`gather`](Self::gather) with reads and writes exchanged.
    unsafe fn scatter(&self, plan: &CopyPlan, pool: &KvLayout, staging: *const u8) -> Result<()>;

    /// [`gather`](Self::gather) ordered after the producer's ready point (see [`ReadyFence`]):
    /// a device engine makes its stream wait for the fence; the default (host engines) blocks the
    /// calling thread on the fence, then gathers. `None`: the KV is valid now. What it waits for
    /// before the copy starts (the fence here, a device's copy lane another copy holds) ends by
    /// `deadline` (`KVSTAGE_E_TIMEOUT`); a copy that started is waited for to its end.
    ///
    /// # Safety
    /// As for [`gather`](Self::gather).
    unsafe fn gather_after(&self, plan: &CopyPlan, pool: &KvLayout, staging: *mut u8, ready: Option<&ReadyFence>, deadline: &Deadline) -> Result<()> {
        if let Some(fence) = ready {
            fence.wait_until(deadline, || false)?;
        }
        // SAFETY: the caller's contract.
        unsafe { self.gather(plan, pool, staging) }
    }

    /// Direct mode's one pass: copies the rows `src` gathers from `src_pool` to where `dst` (a
    /// scatter plan of the same region) puts them in `dst_pool`, with no staging between. The
    /// default copies host pools on the calling thread ([`rows::copy_across`]); a device engine
    /// runs one kernel over device pools (the other pool opened on its device), waiting for its
    /// copy lane no later than `deadline`.
    ///
    /// # Safety
    /// Both plans were checked against their pools ([`check_plan`]), memory that does not
    /// overlap; nobody else writes `dst`'s rows or reads them as done while this runs.
    unsafe fn copy_across(&self, src: &CopyPlan, src_pool: &KvLayout, dst: &CopyPlan, dst_pool: &KvLayout, deadline: &Deadline) -> Result<()> {
        let _ = deadline; // host copies wait for nothing
        use crate::geometry::MemoryKind;
        if src_pool.memory != MemoryKind::Host || dst_pool.memory != MemoryKind::Host {
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!("a direct copy from a {:?} pool into a {:?} pool on the host", src_pool.memory, dst_pool.memory),
            ));
        }
        // SAFETY: the caller's contract, for host memory.
        unsafe { rows::copy_across(src, src_pool, dst, dst_pool) }
    }

    /// Page-locks `len` bytes of host staging memory at `ptr` so that this engine's device↔host
    /// copies run at full speed (the memory stays registered while the returned pin lives; drop
    /// the pin before freeing or reallocating the memory). `Ok(None)`: nothing to do (host engine,
    /// or already page-locked). An error is not fatal: copies still work, only slower.
    fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<Option<HostPin>> {
        let _ = (ptr, len);
        Ok(None)
    }

    /// Stops and joins the threads the engine owns (the host engine's workers), so that the
    /// object owning the engine can end them when it is freed although others still hold the
    /// engine; calls made afterwards still work (on the calling thread). Default: nothing.
    fn shutdown(&self) {}
}

/// Checks a plan against the pool it will run on before any byte moves: buffer indices, the token
/// slot size, every segment within the pool capacity, every slab within the staging region, and
/// segments that tile the chunk. O(slabs + segments).
pub fn check_plan(plan: &CopyPlan, pool: &KvLayout) -> Result<()> {
    pool.validate()?;
    let shape = &pool.shape;
    for kv in 0..shape.buffers_per_layer() {
        check_rows(&plan.rows[kv as usize], plan.pool_page_size, pool, kv)?;
    }
    if plan.segments.is_empty() && plan.tokens != 0 {
        return Err(Error::internal("plan has tokens but no segments"));
    }
    let capacity = pool.capacity_tokens();
    let mut next = 0u64;
    for (i, seg) in plan.segments.iter().enumerate() {
        if seg.staging_token != next || seg.tokens == 0 || seg.tokens > u32::MAX as u64 {
            return Err(Error::internal(format!("plan segment {i} does not tile the chunk (staging token {}, expected {next})", seg.staging_token)));
        }
        next += seg.tokens;
        let ps = shape.page_size as u64;
        if !pool.linear() && seg.pool_token % ps + seg.tokens > ps {
            return Err(Error::internal(format!("plan segment {i} crosses a page of a pool whose pages are not evenly spaced")));
        }
        if seg.pool_token.checked_add(seg.tokens).is_none_or(|e| e > capacity) {
            return Err(Error::invalid_arg(
                "pages",
                format!(
                    "pool tokens {}..{} (pages {}..) lie outside the pool's {} pages",
                    seg.pool_token,
                    seg.pool_token.saturating_add(seg.tokens),
                    seg.pool_token / shape.page_size as u64,
                    pool.capacity_pages
                ),
            ));
        }
    }
    if next != plan.tokens {
        return Err(Error::internal(format!("plan segments cover {next} tokens, plan says {}", plan.tokens)));
    }
    for (i, slab) in plan.slabs.iter().enumerate() {
        if slab.buffer as usize >= pool.bases.len() || slab.kv != pool.kind_of(slab.buffer) {
            return Err(Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!("plan slab {i} names buffer {} of kind {}, the pool has {} buffers", slab.buffer, slab.kv, pool.bases.len()),
            ));
        }
        let slab_bytes = plan.tokens.checked_mul(plan.geometry(slab).row_bytes).ok_or_else(|| Error::internal("plan slab size overflows"))?;
        if slab.staging_offset.checked_add(slab_bytes).is_none_or(|e| e > plan.staging_bytes) {
            return Err(Error::new(
                Status::KVSTAGE_E_STAGING_TOO_SMALL,
                format!(
                    "plan slab {i} at {}..{} exceeds the {}-byte staging region",
                    slab.staging_offset,
                    slab.staging_offset.saturating_add(slab_bytes),
                    plan.staging_bytes
                ),
            ));
        }
    }
    Ok(())
}

/// Checks the rows a plan copies from buffers of kind `kv` against their strides and heads.
fn check_rows(g: &RowGeometry, page_size: u32, pool: &KvLayout, kv: u32) -> Result<()> {
    let (shape, strides) = (&pool.shape, pool.strides_of(kv));
    if (page_size, g.pool_page_stride, g.pool_token_stride) != (shape.page_size, strides.page, strides.token) {
        return Err(Error::new(
            Status::KVSTAGE_E_GEOMETRY_MISMATCH,
            format!(
                "plan pages of {} slots, page stride {}, token stride {} != the pool's {}, {}, {}",
                page_size, g.pool_page_stride, g.pool_token_stride, shape.page_size, strides.page, strides.token
            ),
        ));
    }
    let hb = shape.head_bytes_of(kv);
    let heads = g.row_bytes / hb;
    let first = g.pool_head_offset / strides.head;
    let pieces_fit = if g.piece_bytes == g.row_bytes { heads == 1 || strides.head == hb } else { g.piece_bytes == hb && g.pool_piece_stride == strides.head };
    let rows_fit = g.row_bytes != 0 && g.row_bytes.is_multiple_of(hb) && g.pool_head_offset.is_multiple_of(strides.head) && first + heads <= shape.local_heads as u64;
    if !pieces_fit || !rows_fit {
        return Err(Error::internal(format!(
            "plan rows of {} bytes in pieces of {} (stride {}) at head offset {} do not fit the pool's {} heads of {hb} bytes {} apart",
            g.row_bytes, g.piece_bytes, g.pool_piece_stride, g.pool_head_offset, shape.local_heads, strides.head
        )));
    }
    Ok(())
}
