"""The chunk grid from Python: a prefill session asks the decode side for a room's grid, a chunk
cut on a wrong guess is refused with both sides' values (and fails the room, which that writer
could not complete), and the grid it learnt delivers the room opened again.
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
    key = decode.room_open(3, pages, chunk_tokens=16).key  # 4 pages a chunk: 4 + 4 + 2
    try:
        grid = session.room_grid(3, timeout_ms=5000, room_key=key)
        assert grid == kvstage.RoomGrid(chunk_tokens=16, num_chunks=3, num_pages=10)
        with pytest.raises(kvstage.TimeError, match="room 4: the room key names no open opening"):
            session.room_grid(4, timeout_ms=5000, room_key=key)
        with pytest.raises(kvstage.TimeError) as stale:
            session.room_grid(3, timeout_ms=5000, room_key=key ^ 1)
        assert stale.value.code == kvstage.Status.E_STALE_ROOM
        with pytest.raises(kvstage.GeometryError) as info:
            session.transfer(3, 0, pages[:3], deadline_ms=5000, room_key=key)
        assert "sender has 12 tokens, receiver expects 16" in str(info.value.causes) + str(info.value)
        with pytest.raises(kvstage.GeometryError, match="writer 0 \\(session grid"):
            decode.room_wait(3, 1)
        decode.room_release(3)
        key = decode.room_open(3, pages, chunk_tokens=16).key
        per_chunk = grid.chunk_tokens // MODEL.page_size
        for k in range(grid.num_chunks):
            chunk = pages[k * per_chunk:(k + 1) * per_chunk]
            assert session.transfer(3, k, chunk, deadline_ms=20000, room_key=key) == kvstage.Status.OK
        decode.room_wait(3, 20000)
        assert (dpool[:, :, : 10 * MODEL.page_size] == ppool[:, :, : 10 * MODEL.page_size]).all()
    finally:
        session.close()
        prefill.close()
        decode.close()
