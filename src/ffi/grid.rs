//! The chunk grid: how a request's tokens are cut into chunks, and where each chunk lies in the
//! prefill and decode page lists (their page sizes may differ).

use super::{ffi_fn, out_arg, write_versioned};
use crate::error::{Error, Status};
use crate::geometry;

/// Tokens per chunk of the chunk grid: `max(1, chunk_tokens / page_size) · page_size`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_grid_tokens(chunk_tokens: u32, page_size: u32, out: *mut u32) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        if page_size == 0 {
            return Err(Error::invalid_arg("page_size", "is 0"));
        }
        *out = geometry::grid_tokens(chunk_tokens, page_size);
        Ok(Status::KVSTAGE_OK)
    })
}

/// Where one chunk of a request lies on both sides (`kvstage_chunk_span_compute`). Set `struct_size`
/// before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_chunk_span {
    pub struct_size: usize,
    /// Chunks of the request (the room's chunk count).
    pub num_chunks: u32,
    /// Tokens of this chunk: the chunk grid's, the request's last chunk possibly fewer.
    pub num_tokens: u32,
    /// The chunk's first request token (`decode_prefix_tokens + chunk_index · grid tokens`).
    pub first_token: u64,
    /// Prefill side: `src_pages` of the transfer are pages `[src_first_page, src_first_page +
    /// src_num_pages)` of the request's prefill page list (page `k` holds request tokens
    /// `[k · src_page_size, …)`); `src_token_offset` and `num_tokens` go into the descriptor as
    /// they are.
    pub src_first_page: u64,
    pub src_num_pages: u32,
    pub src_token_offset: u32,
    /// Decode side: pages `[dst_first_page, dst_first_page + dst_num_pages)` of the room's page
    /// list (the pages after the decode side's cached prefix).
    pub dst_first_page: u64,
    pub dst_num_pages: u32,
}

/// Chunk `chunk_index` of a request of `total_tokens` tokens whose first `decode_prefix_tokens`
/// the decode side already holds (whole decode pages), on the decode room's chunk grid
/// (`kvstage_grid_tokens(chunk_tokens, dst_page_size)` tokens a chunk; pass the room's
/// `chunk_tokens`, or what `kvstage_session_room_grid` reports), with prefill pages of
/// `src_page_size` and decode pages of `dst_page_size` tokens (`chunk_tokens` 0 is refused: unlike
/// `kvstage_room_open`, this function cannot know the engine's default). Pure: no engine, no I/O.
/// `KVSTAGE_E_INVALID_ARG` names the bad argument: a page size of 0, a prefix that is not whole
/// decode pages or leaves nothing to send, a chunk past the request's `num_chunks`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_chunk_span_compute(
    total_tokens: u64,
    decode_prefix_tokens: u64,
    src_page_size: u32,
    dst_page_size: u32,
    chunk_tokens: u32,
    chunk_index: u32,
    out: *mut kvstage_chunk_span,
) -> Status {
    ffi_fn!(status {
        let s = geometry::chunk_span(total_tokens, decode_prefix_tokens, src_page_size, dst_page_size, chunk_tokens, chunk_index)?;
        let filled = kvstage_chunk_span {
            struct_size: std::mem::size_of::<kvstage_chunk_span>(),
            num_chunks: s.num_chunks,
            num_tokens: s.num_tokens,
            first_token: s.first_token,
            src_first_page: s.src_first_page,
            src_num_pages: s.src_num_pages,
            src_token_offset: s.src_token_offset,
            dst_first_page: s.dst_first_page,
            dst_num_pages: s.dst_num_pages,
        };
        write_versioned(out, filled, "out")?;
        Ok(Status::KVSTAGE_OK)
    })
}
