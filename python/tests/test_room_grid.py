"""The chunk grid from Python: the decode side's opening carries its grid (key, chunk tokens, chunk
and page counts, decode page size, cached prefix), a prefill session asks for the same grid, a
chunk cut on a wrong guess is refused with both sides' values (and fails the room, which that
writer could not complete), and the room opened again after a cached prefix is delivered chunk by
chunk as ``chunk_span`` cuts it on the grid the session learnt.
Both engines live in this process, on 127.0.0.1."""

import pytest

import kvref
import kvstage

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=4)


def test_room_grid_and_a_wrong_guess(lib):
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, 16)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_staging(1 << 20)
    ppool, playout = kvref.make_pool(MODEL, 0, 1, 16)
    kvref.fill_random(ppool, 5)
    prefill = kvstage.Engine(transport="tcp")
    prefill.register_pool(playout)
    session = prefill.connect(decode.listen_address, "grid")
    pages = list(range(10))
    room = decode.open_room(3, pages, chunk_tokens=16)  # 4 pages a chunk: 4 + 4 + 2
    try:
        assert room.key != 0 and room.num_chunks == 3
        assert room.grid == kvstage.RoomGrid(key=room.key, chunk_tokens=16, num_chunks=3, num_pages=10, page_size=4, prefix_tokens=0)
        assert str(room.key) not in repr(room.grid) + repr(room)  # the key is a capability
        grid = session.room_grid(3, timeout_ms=5000, room_key=room.key)
        assert grid == room.grid
        with pytest.raises(kvstage.TimeError, match="room 4: the room key names no open opening"):
            session.room_grid(4, timeout_ms=5000, room_key=room.key)
        with pytest.raises(kvstage.TimeError) as stale:
            session.room_grid(3, timeout_ms=5000, room_key=room.key ^ 1)
        assert stale.value.code == kvstage.Status.E_STALE_ROOM
        with pytest.raises(kvstage.GeometryError) as info:
            session.transfer(3, 0, pages[:3], timeout_ms=5000, room_key=room.key)
        assert "sender has 12 tokens, receiver expects 16" in str(info.value.causes) + str(info.value)
        with pytest.raises(kvstage.GeometryError, match="writer 0 \\(session grid"):
            room.wait(1)
        room.release()

        # Opened again after a cached prefix of two decode pages: the grid says so, and
        # chunk_span cuts the request (prefill pages 0..11, tokens 0..47) on it.
        room = decode.open_room(3, pages, chunk_tokens=16, prefix_tokens=8)
        grid = session.room_grid(3, timeout_ms=5000, room_key=room.key)
        assert grid == room.grid
        assert (grid.prefix_tokens, grid.page_size, grid.num_chunks, grid.num_pages) == (8, 4, 3, 10)
        total, request_pages = 8 + 10 * MODEL.page_size, list(range(12))
        for k in range(grid.num_chunks):
            span = kvstage.chunk_span(grid, total, MODEL.page_size, k)
            assert span.first_token == 8 + 16 * k and span.dst_first_page == 4 * k
            status = session.transfer(
                3, k, span.src_pages(request_pages), timeout_ms=20000, room_key=room.key,
                src_token_offset=span.src_token_offset, num_tokens=span.num_tokens,
            )
            assert status == kvstage.Status.OK
        room.wait(20000)
        # Decode slots 0..39 (pages 0..9) hold request tokens 8..47 (prefill slots 8..47).
        assert (dpool[:, :, : 10 * MODEL.page_size] == ppool[:, :, 8:48]).all()
    finally:
        session.close()
        prefill.close()
        decode.close()
