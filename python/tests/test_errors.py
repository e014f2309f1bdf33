"""Failures as exceptions: classes per family, session ids, cause chains; fallback as a return
value; timeouts (0: the engine default), cancel, room openings and closed handles. Both sides live in this process (two engines on
127.0.0.1)."""

import threading
import time

import numpy as np
import pytest

import kvref
import kvstage
from kvstage import Status

# 2 layers, 2 KV heads of 8 bf16 elements, 4-token pages; 16-token chunks of 4 pages.
MODEL = kvref.Model(layers=2, heads=2, head_dim=8, dtype_bytes=2, page_size=4)
CAPACITY = 16
CHUNK_TOKENS = 16
PAGES = [3, 4, 5, 6, 9, 1, 2, 0]  # two chunks
ROOM = 7


def decode_engine(ring_bytes, model=MODEL, rooms=(ROOM,), **options):
    """The decode engine, its pool and each room's opening (a kvstage.Room)."""
    pool, layout = kvref.make_pool(model, 0, 1, CAPACITY)
    engine = kvstage.Engine(chunk_tokens=CHUNK_TOKENS, **options)
    engine.register_pool(layout)
    if ring_bytes:
        engine.register_staging(ring_bytes)
    opened = {}
    for room in rooms:
        opened[room] = engine.open_room(room, PAGES, CHUNK_TOKENS)
        assert opened[room].num_chunks == 2 and opened[room].key != 0
    return engine, pool, opened


def prefill_engine(tp_rank=0, tp=2, model=MODEL, seed=1, **options):
    pool, layout = kvref.make_pool(model, tp_rank, tp, CAPACITY)
    kvref.fill_random(pool, seed)
    engine = kvstage.Engine(**options)
    engine.register_pool(layout)
    return engine, pool


def chunk_pages(chunk):
    return PAGES[4 * chunk : 4 * chunk + 4]


def chain_texts(e):
    out = []
    c = e.__cause__
    while c is not None:
        out.append(str(c))
        c = c.__cause__
    return out


# --- geometry mismatch -----------------------------------------------------------------------------


def test_geometry_mismatch_raises_with_the_field_diff_in_the_cause_chain(lib):
    other = kvref.Model(layers=2, heads=2, head_dim=16, dtype_bytes=4, page_size=4)
    dec, _, opened = decode_engine(1 << 16, model=other)
    pre, _ = prefill_engine()
    with dec, pre:
        with pytest.raises(kvstage.GeometryError) as info:
            pre.connect(dec.listen_address, "mismatch-1", timeout_ms=5000)
        e = info.value
        assert isinstance(e, kvstage.KVStageError)
        assert e.code == Status.E_GEOMETRY_MISMATCH and e.code_name == "KVSTAGE_E_GEOMETRY_MISMATCH"
        assert e.klass == kvstage.ErrorClass.GEOMETRY
        assert e.session == "mismatch-1"
        assert "mismatch-1" in str(e)
        # The C causes, outermost first, are both a tuple of strings and a __cause__ chain.
        assert len(e.causes) >= 2
        assert chain_texts(e) == list(e.causes)
        assert isinstance(e.__cause__, kvstage.KVStageCause) and e.__cause__.depth == 0
        assert e.root_cause is not e and e.root_cause.__cause__ is None
        text = " | ".join(e.causes)
        assert "head_dim" in text and "dtype_bytes" in text
        assert "8" in text and "16" in text

        # The same failure through the drop-in: raised, not a fallback.
        st = kvstage.StagingTransfer(pre, connect_timeout_ms=5000)
        target = kvstage.TransferTarget(room=ROOM, room_key=opened[ROOM].key, chunk_index=0, peer=dec.listen_address)
        with pytest.raises(kvstage.GeometryError) as info:
            st.transfer("mismatch-2", chunk_pages(0), None, None, target)
        assert info.value.session == "mismatch-2"
        assert any("head_dim" in c for c in info.value.causes)
        assert st.session_ids == ()


def test_connection_refused_is_a_transport_error_with_the_session(lib):
    with kvstage.Engine() as gone:
        address = gone.listen_address
    pre, _ = prefill_engine()
    with pre:
        with pytest.raises(kvstage.TransportError) as info:
            pre.connect(address, "refused-1", timeout_ms=2000)
    e = info.value
    assert e.code == Status.E_TRANSPORT and e.session == "refused-1"
    assert address in e.message
    assert any("refused" in c.lower() for c in e.causes)


def test_a_session_whose_peer_went_says_it_is_dead(lib):
    dec, _pool, opened = decode_engine(1 << 16)
    pre, _ = prefill_engine()
    with pre:
        session = pre.connect(dec.listen_address, "dead-1", timeout_ms=5000)
        assert session.stats().dead_status == 0
        dec.close()
        with pytest.raises(kvstage.TransportError) as info:
            session.transfer(ROOM, 0, chunk_pages(0), 5000, room_key=opened[ROOM].key)
        assert info.value.code == Status.E_PEER_GONE
        # The one check an engine needs after any failure: free it and connect again.
        assert session.stats().dead_status == Status.E_PEER_GONE


# --- fallback --------------------------------------------------------------------------------------


def test_fallback_returns_minus_one_and_the_slice_path_delivers(lib):
    dec, dec_pool, opened = decode_engine(512)  # a chunk needs 2048 bytes of ring
    pre0, pool0 = prefill_engine(0, 2, seed=10)
    pre1, pool1 = prefill_engine(1, 2, seed=11)
    with dec, pre0, pre1:
        addr = dec.listen_address
        helpers = [kvstage.StagingTransfer(pre0), kvstage.StagingTransfer(pre1)]
        for chunk in range(2):
            for rs, st in enumerate(helpers):
                target = {"room": ROOM, "room_key": opened[ROOM].key, "chunk_index": chunk, "peer": addr}  # a mapping works too
                assert st.transfer(f"fallback/p{rs}", chunk_pages(chunk), 0, 0, target) == -1
                assert st.transfer_slices(f"fallback/p{rs}", chunk_pages(chunk), target) == 0
        # The Session API says the same with a status.
        assert helpers[0].session("fallback/p0").transfer(ROOM, 0, chunk_pages(0), room_key=opened[ROOM].key) == Status.FALLBACK
        opened[ROOM].wait(timeout_ms=10000)
        assert dec.stats().ring_live_allocations == 0
        events = dec.poll_events()
        chunks = [e.chunk_index for e in events if e.kind == kvstage.RoomEventKind.CHUNK]
        assert sorted(chunks) == [0, 1] and all(e.ok for e in events)
        assert [(e.kind, e.chunk_index) for e in events[2:]] == [(kvstage.RoomEventKind.ROOM, 2)]
        want = kvref.reference_reshard(MODEL, [pool0, pool1], [PAGES, PAGES], [np.zeros_like(dec_pool)], [PAGES])
        assert not kvref.describe_difference(dec_pool, want[0])
        for st in helpers:
            st.close()


# --- deadlines, cancel, room errors ----------------------------------------------------------------


def blocked(session, room, key, timeout_ms):
    """Writer 0 of 2 sends chunk 0 (which then holds the whole one-chunk ring, waiting for writer 1),
    so chunk 1 waits for ring space: an operation that blocks in back-pressure."""
    assert session.transfer(room, 0, chunk_pages(0), timeout_ms=5000, room_key=key) == Status.OK
    op = session.transfer_async(room, 1, chunk_pages(1), timeout_ms=timeout_ms, room_key=key)
    assert op.wait(200) == Status.PENDING
    assert op.poll() == Status.PENDING
    return op


def test_deadline_and_cancel_raise_time_errors(lib):
    dec, _, opened = decode_engine(2048, rooms=(ROOM, ROOM + 1))
    pre, _ = prefill_engine(0, 2)
    with dec, pre:
        session = pre.connect(dec.listen_address, "blocked-1")
        with blocked(session, ROOM, opened[ROOM].key, 400) as op:
            with pytest.raises(kvstage.TimeError) as info:
                op.wait(5000)
            e = info.value
            assert e.code == Status.E_TIMEOUT and e.klass == kvstage.ErrorClass.TIMEOUT
            assert e.session == "blocked-1"
            assert "room 7 chunk 1" in e.message
            assert any("watermark" in c for c in e.causes)

        with pytest.raises(kvstage.TimeError) as info:  # the decode room failed with it
            opened[ROOM].wait(timeout_ms=2000)

        op = blocked(session, ROOM + 1, opened[ROOM + 1].key, 10000)
        op.cancel()
        with pytest.raises(kvstage.TimeError) as info:
            op.wait(2000)
        assert info.value.code == Status.E_CANCELED
        with pytest.raises(kvstage.TimeError):  # repeatable
            op.poll()
        op.close()
        session.close()


def test_a_timeout_of_zero_is_the_engine_default_everywhere(lib):
    """``timeout_ms`` 0 waits the engine's ``default_timeout_ms`` (here 400 ms), in an operation
    wait (no longer "only look": ``poll`` looks) and in a room wait; ``TIMEOUT_INFINITE`` is no
    limit for an operation that then ends by its own timeout."""
    dec, _, opened = decode_engine(2048, default_timeout_ms=400)
    pre, _ = prefill_engine(0, 2, default_timeout_ms=400)
    with dec, pre:
        session = pre.connect(dec.listen_address, "zero-1")
        with blocked(session, ROOM, opened[ROOM].key, 10000) as op:  # its own timeout: 10 s
            assert op.poll() == Status.PENDING
            started = time.monotonic()
            assert op.wait(0) == Status.PENDING
            assert 0.3 <= time.monotonic() - started < 5
            op.cancel()
            with pytest.raises(kvstage.TimeError) as info:
                op.wait(kvstage.TIMEOUT_INFINITE)
            assert info.value.code == Status.E_CANCELED
        room = dec.open_room(ROOM + 1, PAGES, CHUNK_TOKENS)
        started = time.monotonic()
        with pytest.raises(kvstage.TimeError) as info:
            room.wait(0)
        assert info.value.code == Status.E_TIMEOUT and 0.3 <= time.monotonic() - started < 5
        # An operation without a timeout of its own (0) ends by the engine's default.
        with blocked(session, ROOM + 1, room.key, 0) as op:
            with pytest.raises(kvstage.TimeError) as info:
                op.wait(kvstage.TIMEOUT_INFINITE)
            assert info.value.code == Status.E_TIMEOUT
        session.close()


def test_room_wait_times_out(lib):
    dec, _, opened = decode_engine(4096)
    with dec:
        t0 = time.monotonic()
        with pytest.raises(kvstage.TimeError) as info:
            opened[ROOM].wait(timeout_ms=100)
        assert info.value.code == Status.E_TIMEOUT
        assert time.monotonic() - t0 < 5
        with dec.open_room(ROOM + 5, PAGES, CHUNK_TOKENS) as room:
            assert room.num_chunks == 2 and room.key != 0
        room.release()  # an opening no longer open: nothing done


def test_a_stale_room_key_writes_nothing_and_the_current_one_lands(lib):
    """Room 7 is opened for request A, released (A canceled) and opened again for request B: a
    transfer still naming A's opening gets ``E_STALE_ROOM`` and writes nothing; B's key lands."""
    dec, dec_pool, opened = decode_engine(1 << 16)
    pre0, pool0 = prefill_engine(0, 2, seed=20)
    pre1, pool1 = prefill_engine(1, 2, seed=21)
    with dec, pre0, pre1:
        stale_key = opened[ROOM].key
        opened[ROOM].release()
        current = dec.open_room(ROOM, PAGES, CHUNK_TOKENS)
        key = current.key
        assert key not in (0, stale_key)
        sessions = [pre0.connect(dec.listen_address, "stale-p0"), pre1.connect(dec.listen_address, "stale-p1")]
        with pytest.raises(kvstage.TimeError) as info:
            sessions[0].transfer(ROOM, 0, chunk_pages(0), timeout_ms=5000, room_key=stale_key)
        assert info.value.code == Status.E_STALE_ROOM and info.value.session == "stale-p0"
        assert "room 7" in str(info.value) and str(key) not in str(info.value)
        with pytest.raises(kvstage.ArgumentError) as info:
            sessions[0].transfer(ROOM, 0, chunk_pages(0), room_key=0)
        assert "desc->room_key" in info.value.message
        assert np.all(dec_pool == 0), "a stale transfer wrote into the decode pool"
        for chunk in range(2):
            for s in sessions:  # the stale session goes on with the right key
                assert s.transfer(ROOM, chunk, chunk_pages(chunk), timeout_ms=5000, room_key=key) == Status.OK
        with pytest.raises(kvstage.TimeError) as info:  # the released opening is not the room any more
            opened[ROOM].wait(timeout_ms=10000)
        assert info.value.code == Status.E_STALE_ROOM
        current.wait(timeout_ms=10000)
        want = kvref.reference_reshard(MODEL, [pool0, pool1], [PAGES, PAGES], [np.zeros_like(dec_pool)], [PAGES])
        assert not kvref.describe_difference(dec_pool, want[0])
        with pytest.raises(kvstage.TimeError) as info:  # the released opening sees none of B's events
            opened[ROOM].poll_events()
        assert info.value.code == Status.E_STALE_ROOM
        events = dec.poll_events()
        assert sorted((e.kind, e.chunk_index) for e in events) == [(kvstage.RoomEventKind.CHUNK, 0), (kvstage.RoomEventKind.CHUNK, 1), (kvstage.RoomEventKind.ROOM, 2)]
        assert all(e.ok and e.room_key == key for e in events)
        for s in sessions:
            s.close()


def test_room_wait_and_release_are_bound_to_their_opening(lib):
    """A wait on request A's opening ends when A is released, not on B's opening of the same id;
    A's Room released again (explicitly, then by its with block: the library does nothing for an
    opening no longer open) leaves B open; A's calls name A's opening only."""
    dec, _, opened = decode_engine(4096, rooms=())
    with dec:
        a = dec.open_room(ROOM, PAGES, CHUNK_TOKENS)
        errors = []

        def wait():
            try:
                a.wait(timeout_ms=10000)
            except kvstage.KVStageError as e:
                errors.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        with a:
            a.release()
            b = dec.open_room(ROOM, PAGES, CHUNK_TOKENS)
            assert b.key != a.key and str(b.key) not in repr(b)
            a.release()
        waiter.join(10)
        assert not waiter.is_alive()
        assert errors and errors[0].code == Status.E_CANCELED, errors
        assert "released" in errors[0].message
        with pytest.raises(kvstage.TimeError) as info:  # B is still open: its wait times out
            b.wait(timeout_ms=100)
        assert info.value.code == Status.E_TIMEOUT
        assert b.describe()["state"] == "open"
        for call in (lambda: a.wait(timeout_ms=100), a.describe, a.poll_events):
            with pytest.raises(kvstage.TimeError) as info:  # A's key names no open opening
                call()
            assert info.value.code == Status.E_STALE_ROOM
        b.release()


# --- closed handles --------------------------------------------------------------------------------


def test_closed_handles_raise(lib):
    dec, _, opened = decode_engine(4096)
    pre, _ = prefill_engine(0, 2)
    with dec:
        with pre:
            session = pre.connect(dec.listen_address, "closing-1")
            op = session.transfer_async(ROOM, 0, chunk_pages(0), timeout_ms=5000, room_key=opened[ROOM].key)
            assert op.wait(5000) == Status.OK
            op.close()
            op.close()  # idempotent
            with pytest.raises(kvstage.ClosedHandleError) as info:
                op.poll()
            assert info.value.session == "closing-1" and info.value.code == Status.E_INVALID_ARG
            with pytest.raises(kvstage.ClosedHandleError):
                op.wait(10)
            with pytest.raises(kvstage.ClosedHandleError):
                op.cancel()
            with session:
                pass
            assert session.closed
            with pytest.raises(kvstage.ClosedHandleError) as info:
                session.transfer(ROOM, 0, chunk_pages(0), room_key=opened[ROOM].key)
            assert "closed" in str(info.value) and isinstance(info.value, ValueError)
            other = pre.connect(dec.listen_address, "closing-2")
        assert pre.closed and other.closed  # closing an engine closes its sessions first
        for call in (lambda: pre.stats(), lambda: pre.listen_address, lambda: pre.connect("127.0.0.1:1", "x"),
                     lambda: pre.poll_events(), lambda: pre.open_room(1, [0]), lambda: other.transfer_slices(ROOM, 0, [0], room_key=opened[ROOM].key)):
            with pytest.raises(kvstage.ClosedHandleError):
                call()
        with pytest.raises(kvstage.ClosedHandleError):
            with pre:
                pass
        pre.close()


def test_garbage_collected_handles_are_freed(lib):
    import gc
    import weakref

    engine = kvstage.Engine()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


# --- errors from the library and from the binding --------------------------------------------------


def test_library_argument_errors_name_the_field(lib):
    with pytest.raises(kvstage.ArgumentError) as info:
        kvstage.Engine(worker_threads=0)
    assert "options->worker_threads" in info.value.message and info.value.klass == kvstage.ErrorClass.CONFIG
    with pytest.raises(kvstage.ArgumentError) as info:
        kvstage.head_slice(4, 2, 2, 0, 8)
    assert "src_rank" in info.value.message
    with pytest.raises(kvstage.ArgumentError):
        kvstage.Engine(transport="carrier-pigeon")
    with kvstage.Engine() as e:
        with pytest.raises(kvstage.ArgumentError) as info:
            e.open_room(1, [0, 1])  # no pool registered
        assert info.value.code < 0


def test_panic_is_an_internal_error_and_poisons_the_engine(lib):
    if not lib.testing:
        pytest.skip("library built without the test-only exports (feature `testing`)")
    engine = kvstage.Engine()
    with pytest.raises(kvstage.InternalError) as info:
        engine._testing_panic()
    assert info.value.code == Status.E_PANIC
    assert any(c.startswith("panic:") for c in info.value.causes)
    with pytest.raises(kvstage.InternalError) as info:
        engine.stats()
    assert info.value.code == Status.E_POISONED
    engine.close()  # a poisoned handle can still be freed


def test_exception_classes_follow_the_status_families(lib):
    families = {
        0: kvstage.ArgumentError, 1: kvstage.GeometryError, 2: kvstage.TimeError, 3: kvstage.TransportError,
        4: kvstage.ProtocolError, 5: kvstage.DeviceError, 9: kvstage.InternalError,
    }
    for status in Status:
        if status < 0:
            assert kvstage.error_class_for(status) is families[(-status) // 10], status
    assert kvstage.error_class_for(-77) is kvstage.KVStageError
    # The binding's names agree with the library's for every code and for unknown ones.
    for code in [s.value for s in Status] + [-77, 3, 1000]:
        assert kvstage.status_name(code) == lib.kvstage_status_name(code).decode(), code


def test_errors_pickle_with_their_attributes_and_chain():
    import pickle

    e = kvstage.GeometryError("mismatch", code=Status.E_GEOMETRY_MISMATCH, klass=kvstage.ErrorClass.GEOMETRY,
                              session="s-1", causes=("head_dim: local 8 != remote 16", "inner"))
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is kvstage.GeometryError and str(back) == str(e)
    assert (back.code, back.klass, back.session, back.causes) == (e.code, e.klass, e.session, e.causes)
    assert chain_texts(back) == list(e.causes) and back.root_cause.depth == 1


def test_errors_are_per_thread(lib):
    """The last error is read on the thread that failed: concurrent failures do not mix."""
    seen = {}

    def fail(i):
        try:
            kvstage.head_slice(4, 2, 2 + (i % 2), 0, 8)
        except kvstage.ArgumentError as e:
            seen[i] = e.message

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8
    for i, message in seen.items():
        assert f"prefill rank {2 + (i % 2)} does not write" in message
