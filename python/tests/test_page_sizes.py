"""Prefill and decode pools with different page sizes from Python: a request cut into chunks by
``chunk_span`` on the room's grid (decode page size and cached prefix included, as the prefill
session learns it), the decode side holding a cached prefix that ends inside a prefill page, every
decode token compared with the prefill pool's token through both page tables (numpy), the slots
after the request's last token untouched. Both engines live in this process, on 127.0.0.1."""

from dataclasses import replace

import numpy as np
import pytest

import kvref
import kvstage

PREFILL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=64)
DECODE = replace(PREFILL, page_size=16)


def _grid(chunk_tokens, page_size, prefix_tokens, num_pages=0, num_chunks=0):
    """A grid as a decode side would have opened it (chunk_span reads its chunk tokens, decode
    page size and prefix)."""
    return kvstage.RoomGrid(key=1, chunk_tokens=chunk_tokens, num_chunks=num_chunks, num_pages=num_pages, page_size=page_size, prefix_tokens=prefix_tokens)


def test_chunk_span_examples(lib):
    span = kvstage.chunk_span(_grid(8192, 16, 16, 6, 1), 100, 64, 0)
    assert span == kvstage.ChunkSpan(
        num_chunks=1, first_token=16, num_tokens=84, src_first_page=0, src_num_pages=2, src_token_offset=16, dst_first_page=0, dst_num_pages=6
    )
    assert span.src_pages([9, 4, 7]) == [9, 4]
    # Chunk 1 of 128-token chunks on 16-token decode pages after a 32-token prefix.
    span = kvstage.chunk_span(_grid(128, 16, 32), 300, 64, 1)
    assert (span.num_chunks, span.first_token, span.num_tokens) == (3, 160, 128)
    assert (span.src_first_page, span.src_num_pages, span.src_token_offset, span.dst_first_page, span.dst_num_pages) == (2, 3, 32, 8, 8)
    with pytest.raises(kvstage.ArgumentError, match="prefix_tokens.*8 is not whole decode pages"):
        kvstage.chunk_span(_grid(8192, 16, 8), 100, 64, 0)
    with pytest.raises(kvstage.ArgumentError, match="chunk_index.*past the request's 1 chunks"):
        kvstage.chunk_span(_grid(8192, 16, 16), 100, 64, 1)
    with pytest.raises(TypeError, match="RoomGrid"):
        kvstage.chunk_span((8192, 16, 16), 100, 64, 0)


@pytest.mark.parametrize("src, dst, prefix", [(PREFILL, DECODE, 16), (DECODE, PREFILL, 64), (PREFILL, DECODE, 0)])
def test_a_request_between_page_sizes(lib, src, dst, prefix):
    total, chunk_tokens = 300, 128
    ppool, playout = kvref.make_pool(src, 0, 1, 24)
    kvref.fill_random(ppool, 11)
    dpool, dlayout = kvref.make_pool(dst, 0, 1, 24)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_staging(1 << 20)
    prefill = kvstage.Engine(transport="tcp")
    prefill.register_pool(playout)
    session = prefill.connect(decode.listen_address, "page-sizes")
    src_pages = list(np.random.default_rng(1).permutation(24)[: -(-total // src.page_size)])
    dst_pages = list(np.random.default_rng(2).permutation(24)[: -(-(total - prefix) // dst.page_size)])
    room = decode.open_room(5, dst_pages, chunk_tokens=chunk_tokens, prefix_tokens=prefix)
    try:
        # The prefill side learns the grid (its decode page size and prefix) from the decode side.
        grid = session.room_grid(5, room_key=room.key)
        assert grid == room.grid and (grid.page_size, grid.prefix_tokens) == (dst.page_size, prefix)
        first = kvstage.chunk_span(grid, total, src.page_size, 0)
        assert first.num_chunks == grid.num_chunks
        for k in range(first.num_chunks):
            span = kvstage.chunk_span(grid, total, src.page_size, k)
            status = session.transfer(
                5, k, span.src_pages(src_pages), timeout_ms=20000, room_key=room.key, src_token_offset=span.src_token_offset, num_tokens=span.num_tokens
            )
            assert status == kvstage.Status.OK
        room.wait(20000)
        # Request token t: prefill slot slots(src_pages)[t]; decode slot slots(dst_pages)[t - prefix].
        want = ppool[:, :, kvref.slots(src_pages, src.page_size)[prefix:total]]
        dst_slots = kvref.slots(dst_pages, dst.page_size)
        got = dpool[:, :, dst_slots[: total - prefix]]
        assert (got == want).all(), kvref.describe_difference(got, want)
        assert not dpool[:, :, dst_slots[total - prefix :]].any(), "slots past the request's last token were written"
    finally:
        session.close()
        prefill.close()
        decode.close()
