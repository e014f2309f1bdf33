"""Direct mode from Python: the decode pool in ``kvstage.SharedMemory`` (numpy arrays over it),
the prefill on the same host copies each chunk from its pages straight into the decode pages (TP
2 -> 1: both prefill ranks' heads remapped into one decode token slot). Every decode token is
compared with the prefill pools through both page tables; the engines' counters and the transport
line of their description say the chunks went directly, and with ``same_host_direct=False`` on either side they
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
    room = decode.open_room(3, dst_pages, chunk_tokens=chunk_tokens)
    direct = decode_direct and prefill_direct
    try:
        chunks = -(-total // chunk_tokens)
        assert room.num_chunks == chunks
        for k in range(chunks):
            span = kvstage.chunk_span(room.grid, total, MODEL.page_size, k)
            for session in sessions:
                status = session.transfer(3, k, span.src_pages(src_pages), timeout_ms=20000, room_key=room.key, num_tokens=span.num_tokens)
                assert status == kvstage.Status.OK
        room.wait(20000)
        # Decode heads 0..1 come from prefill rank 0, heads 2..3 from rank 1.
        want = np.concatenate([p[:, :, kvref.slots(src_pages, MODEL.page_size)[:total]] for p in ppools], axis=3)
        got = dpool[:, :, kvref.slots(dst_pages, MODEL.page_size)[:total]]
        assert (got == want).all(), kvref.describe_difference(got, want)
        stats = decode.stats()
        assert stats.shm_sessions == 2
        assert stats.shm_direct_sessions == (2 if direct else 0)
        assert stats.shm_direct_chunks == (2 * chunks if direct else 0)
        assert sum(e.stats().shm_direct_chunks for e in prefills) == (2 * chunks if direct else 0)
        described = prefills[0].describe()["transport"]
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


PREFILL_CHILD = """
import sys, time
import numpy as np
import kvref, kvstage
model = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=16)
address, room, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pool, layout = kvref.make_pool(model, 0, 1, 32)
kvref.fill_random(pool, 9)
engine = kvstage.Engine(transport="shm", same_host_direct=True)
engine.register_pool(layout)
session = engine.connect(address, "frozen-prefill")
assert session.transfer(room, 0, [0, 1, 2, 3], timeout_ms=20000, room_key=key) == kvstage.Status.OK
print("mapped", flush=True)
time.sleep(120)
"""


def test_shutdown_says_when_the_shared_pool_may_be_freed(lib, child_env):
    """A prefill process maps the decode pool (direct mode) and is frozen (SIGSTOP): it cannot
    unmap when the decode engine stops, so ``shutdown`` raises naming its process and the pool's
    memory cannot be freed (a ``timeout_ms`` of 0 waits the engine's ``default_timeout_ms``, not
    "only look"). Killed, its lease ends with its process: ``shutdown`` returns and the memory is
    the caller's again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    memory = kvstage.SharedMemory(kvref.pool_bytes(MODEL, 1, CAPACITY))
    _, dlayout = kvref.make_pool(MODEL, 0, 1, CAPACITY, memory=memory)
    decode = kvstage.Engine(transport="shm", same_host_direct=True, default_timeout_ms=600)
    decode.register_pool(dlayout)
    decode.register_staging(1 << 20)
    room = decode.open_room(4, [5, 6, 7, 8], chunk_tokens=64)
    child = subprocess.Popen([sys.executable, "-c", PREFILL_CHILD, decode.listen_address, "4", str(room.key)], env=child_env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mapped", "the prefill child did not transfer"
        room.wait(10000)
        assert decode.stats().shm_direct_sessions == 1
        os.kill(child.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(kvstage.TimeError, match=f"process {child.pid} "):
            decode.shutdown(timeout_ms=0)  # the engine default: 600 ms
        assert time.monotonic() - started >= 0.5
        with pytest.raises(kvstage.TimeError, match=f"process {child.pid} "):
            decode.shutdown(timeout_ms=100)
        with pytest.raises(kvstage.ArgumentError, match="live engine"):
            memory.close()  # still the pool of an engine whose peer maps it
        with pytest.raises(kvstage.KVStageError, match="shut down"):
            decode.open_room(5, [9], chunk_tokens=16)
        os.kill(child.pid, signal.SIGKILL)
        decode.shutdown(timeout_ms=10000)
        memory.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        decode.close()
        memory.close()
