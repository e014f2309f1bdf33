"""Direct mode from Python: the decode pool in ``kvstage.SharedMemory`` (numpy arrays over it),
the prefill on the same host copies each chunk from its pages straight into the decode pages (TP
2 -> 1: both prefill ranks' heads remapped into one decode token slot). Every decode token is
compared with the prefill pools through both page tables; the engines' counters and the transport
description say the chunks went directly, and with ``same_host_direct=False`` on either side they
go through the ring."""

import numpy as np
import pytest

import kvref
import kvstage

MODEL = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=16)
CAPACITY = 32


@pytest.mark.parametrize("decode_direct, prefill_direct", [(True, True), (False, True), (True, False)])
def test_a_request_lands_directly_in_shared_decode_pages(lib, decode_direct, prefill_direct):
    total, chunk_tokens = 200, 64
    memory = kvstage.SharedMemory(kvref.pool_bytes(MODEL, 1, CAPACITY))
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, CAPACITY, memory=memory)
    decode = kvstage.Engine(transport="shm", same_host_direct=decode_direct)
    decode.register_pool(dlayout)
    decode.register_staging(1 << 20)
    prefills, sessions, ppools = [], [], []
    for rank in range(2):
        ppool, playout = kvref.make_pool(MODEL, rank, 2, CAPACITY)
        kvref.fill_random(ppool, 5 + rank)
        engine = kvstage.Engine(transport="shm", same_host_direct=prefill_direct)
        engine.register_pool(playout)
        prefills.append(engine)
        ppools.append(ppool)
        sessions.append(engine.connect(decode.listen_address, f"direct-p{rank}"))
    src_pages = list(np.random.default_rng(1).permutation(CAPACITY)[: -(-total // MODEL.page_size)])
    dst_pages = list(np.random.default_rng(2).permutation(CAPACITY)[: -(-total // MODEL.page_size)])
    key = decode.room_open(3, dst_pages, chunk_tokens=chunk_tokens).key
    direct = decode_direct and prefill_direct
    try:
        chunks = -(-total // chunk_tokens)
        for k in range(chunks):
            span = kvstage.chunk_span(total, 0, MODEL.page_size, MODEL.page_size, chunk_tokens, k)
            for session in sessions:
                status = session.transfer(3, k, span.src_pages(src_pages), deadline_ms=20000, room_key=key, num_tokens=span.num_tokens)
                assert status == kvstage.Status.OK
        decode.room_wait(3, 20000)
        # Decode heads 0..1 come from prefill rank 0, heads 2..3 from rank 1.
        want = np.concatenate([p[:, :, kvref.slots(src_pages, MODEL.page_size)[:total]] for p in ppools], axis=3)
        got = dpool[:, :, kvref.slots(dst_pages, MODEL.page_size)[:total]]
        assert (got == want).all(), kvref.describe_difference(got, want)
        stats = decode.stats()
        assert stats.shm_sessions == 2
        assert stats.shm_direct_sessions == (2 if direct else 0)
        assert stats.shm_direct_chunks == (2 * chunks if direct else 0)
        assert sum(e.stats().shm_direct_chunks for e in prefills) == (2 * chunks if direct else 0)
        described = prefills[0].transport_describe()
        if direct:
            assert f"1 direct (decode pool mapped, {chunks} chunk region(s) copied page to page)" in described, described
        elif not prefill_direct:
            assert "direct mode off (same_host_direct 0)" in described, described
    finally:
        for s in sessions:
            s.close()
        for e in prefills:
            e.close()
        decode.close()
        memory.close()


def test_a_view_keeps_its_memory_alive(lib):
    import gc
    import weakref

    memory = kvstage.SharedMemory(1 << 16)
    owner = weakref.ref(memory)
    array = np.frombuffer(memory.memoryview(), dtype=np.uint16)
    del memory
    gc.collect()
    assert owner() is not None, "the memory was freed under a live array"
    array[:] = 3
    assert int(array.sum()) == 3 * (1 << 15)
    del array
    gc.collect()
    assert owner() is None, "the memory outlived its last view"


def test_shared_memory_is_freed_once(lib):
    memory = kvstage.SharedMemory(4096)
    view = np.frombuffer(memory.memoryview(), dtype=np.uint8)
    view[:] = 7
    assert memory.address != 0 and int(view.sum()) == 7 * 4096
    del view
    memory.close()
    memory.close()
    with pytest.raises(kvstage.ArgumentError, match="bytes.*0"):
        kvstage.SharedMemory(0)
