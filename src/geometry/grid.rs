//! The chunk grid: how a request's pages are cut into staging chunks.
//!
//! Chunks hold `grid_tokens(chunk_tokens, page_size)` tokens each and start at the decode-side
//! cached prefix: chunk `i` covers tokens `[prefix + i·G, prefix + (i+1)·G)` of the request. Page
//! `j` of the request's page list holds tokens `[j·ps, (j+1)·ps)`.

use std::ops::Range;

use crate::error::{Error, Result};

/// Default chunk size in tokens.
pub const DEFAULT_CHUNK_TOKENS: u32 = 8192;

/// Tokens per chunk: `max(1, chunk_tokens / page_size) · page_size` (8192/64 → 8192, 16/64 → 64,
/// 8200/64 → 8192). `page_size` 0 (rejected by every shape validation) counts as 1.
pub fn grid_tokens(chunk_tokens: u32, page_size: u32) -> u32 {
    let page_size = page_size.max(1);
    // chunk_tokens / page_size · page_size ≤ chunk_tokens, and page_size alone fits: no overflow.
    (chunk_tokens / page_size).max(1) * page_size
}

fn check_page_size(page_size: u32) -> Result<()> {
    if page_size == 0 {
        return Err(Error::invalid_arg("page_size", "is 0"));
    }
    Ok(())
}

/// One piece of a send: pages `pages` (indices into the request's page list) all belonging to
/// chunk `chunk_index`, starting `chunk_page_offset` pages into that chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GridPiece {
    pub chunk_index: u32,
    pub pages: Range<usize>,
    pub chunk_page_offset: u32,
}

impl GridPiece {
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Tokens in the piece.
    pub fn tokens(&self, page_size: u32) -> u64 {
        self.pages.len() as u64 * page_size as u64
    }
}

/// Splits the send of request pages `[start_page, end_page)` on the chunk grid whose base is the
/// decode-side cached prefix (`decode_prefix_tokens`, which must be page aligned), so that every
/// piece names exactly one chunk. An empty range is one empty (metadata-only) piece of the chunk
/// that would hold `start_page`.
///
/// Errors (`KVSTAGE_E_INVALID_ARG`): `page_size` 0, a prefix that is not a multiple of
/// `page_size`, `start_page > end_page`, a range that starts inside the decode-side prefix, and a
/// chunk index beyond `u32`.
pub fn split_grid(
    start_page: usize,
    end_page: usize,
    page_size: u32,
    decode_prefix_tokens: u64,
    chunk_tokens: u32,
) -> Result<Vec<GridPiece>> {
    check_page_size(page_size)?;
    let grid = grid_tokens(chunk_tokens, page_size);
    if !decode_prefix_tokens.is_multiple_of(page_size as u64) {
        return Err(Error::invalid_arg(
            "decode_prefix_tokens",
            format!("{decode_prefix_tokens} is not a multiple of page_size {page_size} (the decode-side prefix must be page aligned)"),
        ));
    }
    if start_page > end_page {
        return Err(Error::invalid_arg("start_page", format!("{start_page} is after end_page {end_page}")));
    }
    let prefix_pages = decode_prefix_tokens / page_size as u64;
    if (start_page as u64) < prefix_pages {
        return Err(Error::invalid_arg(
            "start_page",
            format!(
                "{start_page} lies inside the decode-side cached prefix ({prefix_pages} pages = {decode_prefix_tokens} tokens)"
            ),
        ));
    }
    let per_chunk = (grid / page_size) as u64;
    let chunk_of = |page: usize| -> Result<(u32, u32)> {
        let rel = page as u64 - prefix_pages;
        let idx = u32::try_from(rel / per_chunk)
            .map_err(|_| Error::invalid_arg("end_page", format!("page {page} lies in chunk {} beyond u32", rel / per_chunk)))?;
        Ok((idx, (rel % per_chunk) as u32))
    };
    if start_page == end_page {
        let (chunk_index, chunk_page_offset) = chunk_of(start_page)?;
        return Ok(vec![GridPiece { chunk_index, pages: start_page..start_page, chunk_page_offset }]);
    }
    chunk_of(end_page - 1)?;
    let mut out = Vec::new();
    let mut page = start_page;
    while page < end_page {
        let (chunk_index, chunk_page_offset) = chunk_of(page)?;
        let room = (per_chunk - chunk_page_offset as u64) as usize;
        let end = end_page.min(page.saturating_add(room));
        out.push(GridPiece { chunk_index, pages: page..end, chunk_page_offset });
        page = end;
    }
    Ok(out)
}

/// Chunks of a request of `total_tokens` tokens of which the decode side caches the first
/// `decode_prefix_tokens`: `ceil((total − prefix) / G)`, at least 1 (an empty transfer still sends
/// one metadata-only chunk). Bounds every chunk index the receiver accepts.
pub fn chunk_count(total_tokens: u64, decode_prefix_tokens: u64, page_size: u32, chunk_tokens: u32) -> Result<u32> {
    check_page_size(page_size)?;
    let grid = grid_tokens(chunk_tokens, page_size) as u64;
    if decode_prefix_tokens > total_tokens {
        return Err(Error::invalid_arg(
            "decode_prefix_tokens",
            format!("{decode_prefix_tokens} exceeds the request's {total_tokens} tokens"),
        ));
    }
    let n = (total_tokens - decode_prefix_tokens).div_ceil(grid).max(1);
    u32::try_from(n).map_err(|_| Error::invalid_arg("total_tokens", format!("{total_tokens} tokens make {n} chunks, beyond u32")))
}

/// Where chunk `chunk` of a request lies on both sides: what the decode side's room and the
/// prefill side's transfer descriptor must name ([`chunk_span`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChunkSpan {
    /// Chunks of the request (the room's chunk count).
    pub num_chunks: u32,
    /// The chunk carries request tokens `[first_token, first_token + num_tokens)`.
    pub first_token: u64,
    pub num_tokens: u32,
    /// Prefill side: pages `[src_first_page, src_first_page + src_num_pages)` of the request's
    /// page list (page `k` holds request tokens `[k·src_page_size, …)`), the first token
    /// `src_token_offset` slots into the first of them.
    pub src_first_page: u64,
    pub src_num_pages: u32,
    pub src_token_offset: u32,
    /// Decode side: pages `[dst_first_page, dst_first_page + dst_num_pages)` of the room's page
    /// list (the pages after the decode side's cached prefix).
    pub dst_first_page: u64,
    pub dst_num_pages: u32,
}

/// Chunk `chunk` of a request of `total_tokens` tokens whose first `decode_prefix_tokens` the
/// decode side already holds (whole decode pages), on the decode side's chunk grid
/// (`grid_tokens(chunk_tokens, dst_page_size)` tokens per chunk, the last one shorter), with
/// prefill pages of `src_page_size` and decode pages of `dst_page_size` tokens.
///
/// Errors (`KVSTAGE_E_INVALID_ARG`, naming the argument): a page size of 0, a prefix that is not
/// whole decode pages or leaves nothing to send, a chunk index past the request's chunks.
pub fn chunk_span(
    total_tokens: u64,
    decode_prefix_tokens: u64,
    src_page_size: u32,
    dst_page_size: u32,
    chunk_tokens: u32,
    chunk: u32,
) -> Result<ChunkSpan> {
    for (name, size) in [("src_page_size", src_page_size), ("dst_page_size", dst_page_size)] {
        if size == 0 {
            return Err(Error::invalid_arg(name, "is 0"));
        }
    }
    if chunk_tokens == 0 {
        // Not the engine default `kvstage_room_open` takes it for: this function cannot know it.
        return Err(Error::invalid_arg("chunk_tokens", "is 0: pass the room's chunk tokens (kvstage_session_room_grid reports them)"));
    }
    if !decode_prefix_tokens.is_multiple_of(dst_page_size as u64) {
        return Err(Error::invalid_arg(
            "decode_prefix_tokens",
            format!("{decode_prefix_tokens} is not whole decode pages (dst_page_size {dst_page_size}): the decode side caches whole pages"),
        ));
    }
    if decode_prefix_tokens >= total_tokens {
        return Err(Error::invalid_arg(
            "decode_prefix_tokens",
            format!("{decode_prefix_tokens} leaves none of the request's {total_tokens} tokens to send"),
        ));
    }
    let num_chunks = chunk_count(total_tokens, decode_prefix_tokens, dst_page_size, chunk_tokens)?;
    if chunk >= num_chunks {
        return Err(Error::invalid_arg("chunk_index", format!("{chunk} is past the request's {num_chunks} chunks")));
    }
    let grid = grid_tokens(chunk_tokens, dst_page_size) as u64;
    let first = decode_prefix_tokens + chunk as u64 * grid;
    let end = total_tokens.min(first.saturating_add(grid));
    let (sps, dps) = (src_page_size as u64, dst_page_size as u64);
    let src_first_page = first / sps;
    let dst_first_page = (first - decode_prefix_tokens) / dps;
    Ok(ChunkSpan {
        num_chunks,
        first_token: first,
        num_tokens: (end - first) as u32, // at most one grid of u32 tokens
        src_first_page,
        src_num_pages: u32::try_from(end.div_ceil(sps) - src_first_page)
            .map_err(|_| Error::invalid_arg("src_page_size", format!("{src_page_size} makes more than 2^32 pages per chunk")))?,
        src_token_offset: (first % sps) as u32,
        dst_first_page,
        dst_num_pages: ((end - decode_prefix_tokens).div_ceil(dps) - dst_first_page) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    fn piece(chunk_index: u32, pages: Range<usize>, off: u32) -> GridPiece {
        GridPiece { chunk_index, pages, chunk_page_offset: off }
    }

    #[test]
    fn grid_tokens_examples() {
        assert_eq!(grid_tokens(8192, 64), 8192);
        assert_eq!(grid_tokens(16, 64), 64);
        assert_eq!(grid_tokens(8200, 64), 8192);
        assert_eq!(grid_tokens(0, 16), 16);
        assert_eq!(grid_tokens(u32::MAX, 1), u32::MAX);
        assert_eq!(grid_tokens(u32::MAX, u32::MAX), u32::MAX);
        assert_eq!(grid_tokens(8192, 0), 8192);
        assert_eq!(chunk_count(10, 0, 0, 8).unwrap_err().message(), "invalid argument `page_size`: is 0");
    }

    #[test]
    fn split_on_a_prefix_based_grid() {
        // ps 16, grid 64 tokens = 4 pages, decode prefix 2 pages: chunks start at pages 2, 6, 10, ...
        assert_eq!(
            split_grid(2, 13, 16, 32, 64).unwrap(),
            vec![piece(0, 2..6, 0), piece(1, 6..10, 0), piece(2, 10..13, 0)]
        );
        // A later send that starts mid-chunk.
        assert_eq!(split_grid(7, 11, 16, 32, 64).unwrap(), vec![piece(1, 7..10, 1), piece(2, 10..11, 0)]);
        // Empty range: one metadata-only piece.
        assert_eq!(split_grid(10, 10, 16, 32, 64).unwrap(), vec![piece(2, 10..10, 0)]);
        // No prefix, grid smaller than a page rounds up to a page.
        assert_eq!(split_grid(0, 3, 64, 0, 16).unwrap(), vec![piece(0, 0..1, 0), piece(1, 1..2, 0), piece(2, 2..3, 0)]);
    }

    #[test]
    fn split_errors() {
        let e = split_grid(2, 4, 16, 33, 64).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("`decode_prefix_tokens`: 33 is not a multiple of page_size 16"));
        let e = split_grid(5, 4, 16, 0, 64).unwrap_err();
        assert!(e.message().contains("`start_page`: 5 is after end_page 4"));
        let e = split_grid(1, 4, 16, 32, 64).unwrap_err();
        assert!(e.message().contains("`start_page`: 1 lies inside the decode-side cached prefix (2 pages = 32 tokens)"));
        let e = split_grid(0, 4, 0, 0, 64).unwrap_err();
        assert!(e.message().contains("`page_size`"));
        let e = split_grid(0, usize::MAX, 1, 0, 1).unwrap_err();
        assert!(e.message().contains("beyond u32"), "{}", e.message());
    }

    #[test]
    fn chunk_spans_for_every_page_size_pair() {
        let span = |total, prefix, sps, dps, ct, c| chunk_span(total, prefix, sps, dps, ct, c).unwrap();
        // Prefill pages of 64, decode pages of 16, decode prefix 16: the chunk starts 16 slots into
        // prefill page 0; 100 tokens end 4 slots into decode page 5 of the room.
        assert_eq!(span(100, 16, 64, 16, 8192, 0), ChunkSpan {
            num_chunks: 1,
            first_token: 16,
            num_tokens: 84,
            src_first_page: 0,
            src_num_pages: 2,
            src_token_offset: 16,
            dst_first_page: 0,
            dst_num_pages: 6,
        });
        // Prefill 16, decode 64, prefix 64, chunks of 128: chunk 1 is tokens 192..300.
        assert_eq!(span(300, 64, 16, 64, 128, 1), ChunkSpan {
            num_chunks: 2,
            first_token: 192,
            num_tokens: 108,
            src_first_page: 12,
            src_num_pages: 7,
            src_token_offset: 0,
            dst_first_page: 2,
            dst_num_pages: 2,
        });
        // Chunks that end inside prefill pages: prefill 48, decode 16, grid 32.
        let c = span(200, 0, 48, 16, 32, 2);
        assert_eq!((c.first_token, c.num_tokens, c.src_first_page, c.src_num_pages, c.src_token_offset), (64, 32, 1, 1, 16));
        let e = |r: Result<ChunkSpan>| r.unwrap_err().message().to_owned();
        assert!(e(chunk_span(100, 8, 64, 16, 8192, 0)).contains("`decode_prefix_tokens`: 8 is not whole decode pages"));
        assert!(e(chunk_span(64, 64, 64, 16, 8192, 0)).contains("leaves none of the request's 64 tokens"));
        assert!(e(chunk_span(100, 0, 64, 16, 64, 2)).contains("`chunk_index`: 2 is past the request's 2 chunks"));
        assert!(e(chunk_span(100, 0, 0, 16, 64, 0)).contains("`src_page_size`: is 0"));
        assert!(e(chunk_span(100, 0, 16, 16, 0, 0)).contains("`chunk_tokens`: is 0: pass the room's chunk tokens"));
        // Near the end of u64: no overflow, the last chunk ends with the request.
        let last = span(u64::MAX, u64::MAX - 99, 1, 4, 64, 1);
        assert_eq!((last.first_token, last.num_tokens, last.src_num_pages, last.dst_num_pages), (u64::MAX - 35, 35, 35, 9));
    }

    #[test]
    fn chunk_counts() {
        assert_eq!(chunk_count(20000, 0, 16, 8192).unwrap(), 3);
        assert_eq!(chunk_count(16384, 0, 16, 8192).unwrap(), 2);
        assert_eq!(chunk_count(100, 100, 16, 8192).unwrap(), 1);
        assert_eq!(chunk_count(8192 + 64, 64, 64, 8192).unwrap(), 1);
        assert!(chunk_count(10, 20, 1, 8).unwrap_err().message().contains("exceeds"));
        assert!(chunk_count(u64::MAX, 0, 1, 1).unwrap_err().message().contains("beyond u32"));
    }
}
