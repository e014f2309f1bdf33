"""Completions in an event loop: the engine's descriptor with asyncio, the callback (operations,
decode chunks and whole rooms), and room events polled by opening. Both engines live in this
process, on 127.0.0.1."""

import asyncio
import threading
import time

import numpy as np
import pytest

import kvref
import kvstage

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=4)
PAGES = 4  # one chunk of 16 tokens per room


def _pair(rooms):
    """A decode engine (pool, ring, the rooms open), a prefill engine connected to it and each
    room's opening."""
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, 16)
    decode = kvstage.Engine()
    decode.register_pool(dlayout)
    decode.register_staging(4 << 20)
    opened = {room: decode.open_room(room, list(range(PAGES)), chunk_tokens=PAGES * MODEL.page_size) for room in rooms}
    ppool, playout = kvref.make_pool(MODEL, 0, 1, 16)
    kvref.fill_random(ppool, 7)
    prefill = kvstage.Engine(transfer_threads=2)
    prefill.register_pool(playout)
    session = prefill.connect(decode.listen_address, "completions")
    return decode, dpool, prefill, ppool, session, opened


def _expected(dpool, ppool):
    return kvref.reference_reshard(MODEL, [ppool], [list(range(PAGES))], [dpool], [list(range(PAGES))])[0]


def test_asyncio_waits_on_the_completion_descriptor(lib):
    rooms = list(range(10, 30))
    decode, dpool, prefill, ppool, session, opened = _pair(rooms)
    try:
        ops = {room: session.transfer_async(room, 0, list(range(PAGES)), timeout_ms=20000, tag=room, room_key=opened[room].key) for room in rooms}

        async def until_done():
            finished = 0
            while finished < len(ops):
                # The descriptor wakes the loop; nothing here polls in a busy loop.
                finished += await asyncio.wait_for(prefill.completions(), timeout=20)
            return finished

        assert asyncio.run(until_done()) == len(rooms)
        assert all(op.poll() == kvstage.Status.OK for op in ops.values())

        async def decode_side():
            seen = {}
            while sum(len(v) for v in seen.values()) < 2 * len(rooms):
                await asyncio.wait_for(decode.completions(), timeout=20)
                for room in rooms:
                    seen.setdefault(room, []).extend((e.kind, e.chunk_index, e.ok) for e in opened[room].poll_events())
            return seen

        # Per room its chunk's event, then the room's (chunk_index: the chunk count).
        CHUNK, ROOM = kvstage.RoomEventKind.CHUNK, kvstage.RoomEventKind.ROOM
        assert asyncio.run(decode_side()) == {room: [(CHUNK, 0, True), (ROOM, 1, True)] for room in rooms}
        want = _expected(dpool, ppool)
        assert kvref.describe_difference(dpool, want) == ""
        for op in ops.values():
            op.close()
    finally:
        session.close()
        prefill.close()
        decode.close()


def test_callback_reports_every_operation_with_its_tag_and_room_events_filter(lib):
    rooms = [1, 2, 3]
    decode, dpool, prefill, ppool, session, opened = _pair(rooms)
    seen, decode_completions = [], []
    done = threading.Event()

    def on_completion(kind, status, tag, room, chunk):
        seen.append((kind, status, tag))
        if len(seen) == len(rooms):
            done.set()

    def on_decode(kind, status, tag, room, chunk, room_key):
        decode_completions.append((kind, room, chunk, status, room_key))

    decode.set_completion_callback(on_decode, keys=True)
    prefill.set_completion_callback(on_completion)
    try:
        ops = [session.transfer_async(room, 0, list(range(PAGES)), timeout_ms=20000, tag=1000 + room, room_key=opened[room].key) for room in rooms]
        assert done.wait(20), f"callbacks seen: {seen}"
        assert sorted(t for _, _, t in seen) == [1001, 1002, 1003]
        assert all(kind == kvstage.CompletionKind.OP and status == kvstage.Status.OK for kind, status, _ in seen)
        for room in rooms:
            opened[room].wait(20000)
        # Room 2's events only (its chunk, then the room); the others stay queued for the
        # engine-wide poll.
        CHUNK, ROOM = kvstage.RoomEventKind.CHUNK, kvstage.RoomEventKind.ROOM
        assert [(e.kind, e.room, e.chunk_index, e.room_key) for e in opened[2].poll_events()] == [(CHUNK, 2, 0, opened[2].key), (ROOM, 2, 1, opened[2].key)]
        assert sorted((e.room, e.kind) for e in decode.poll_events()) == [(1, CHUNK), (1, ROOM), (3, CHUNK), (3, ROOM)]
        # A room completes before its events' callbacks have run (after the library's lock is
        # released): wait for the callbacks, bounded. Each room: its chunk, then the room (whose
        # `chunk` is the room's chunk count), with the opening's key.
        deadline = time.monotonic() + 10
        while len(decode_completions) < 2 * len(rooms) and time.monotonic() < deadline:
            time.sleep(0.01)
        C = kvstage.CompletionKind
        ok = kvstage.Status.OK
        assert sorted(decode_completions) == sorted(
            [(C.CHUNK, room, 0, ok, opened[room].key) for room in rooms] + [(C.ROOM, room, 1, ok, opened[room].key) for room in rooms]
        )
        for room in rooms:  # the chunk's completion comes before its room's
            mine = [c[0] for c in decode_completions if c[1] == room]
            assert mine == [C.CHUNK, C.ROOM], (room, mine)
        assert np.array_equal(dpool, _expected(dpool, ppool))
        prefill.set_completion_callback(None)
        for op in ops:
            op.close()
    finally:
        session.close()
        prefill.close()
        decode.close()


def test_layer_wise_transfer_lands_once_every_layer_is_marked(lib):
    """Layers marked out of order on a layer-wise operation: nothing completes while one is
    missing; then the decode pool holds the reference bytes. Marks are checked."""
    room = 40
    decode, dpool, prefill, ppool, session, opened = _pair([room])
    try:
        op = session.transfer_layerwise_async(room, 0, list(range(PAGES)), timeout_ms=20000, room_key=opened[room].key)
        op.layers_ready(1)
        with pytest.raises(kvstage.ArgumentError, match="layer 1 was already marked ready"):
            op.layers_ready(1)
        with pytest.raises(kvstage.ArgumentError, match="layer 2 is not a layer of this pool"):
            op.layers_ready(2)
        with pytest.raises(TypeError):
            op.layers_ready(0, event="not an event")
        with pytest.raises(ValueError):
            op.layers_ready(0, event=1, stream=2)

        class Unrecorded:  # a torch.cuda.Event before its first record has no handle
            cuda_event = 0

        with pytest.raises(ValueError, match="never recorded"):
            op.layers_ready(0, event=Unrecorded())
        assert op.poll() == kvstage.Status.PENDING
        op.layers_ready(0)
        assert op.wait(20000) == kvstage.Status.OK
        opened[room].wait(20000)
        assert kvref.describe_difference(dpool, _expected(dpool, ppool)) == ""
        op.close()
    finally:
        session.close()
        prefill.close()
        decode.close()


def test_a_callback_replaced_from_inside_a_callback_outlives_its_running_call(lib):
    """The library does not wait for the running call when the callback is replaced from inside
    it: the binding keeps the running call's thunk alive (freeing it under its own frame would
    crash the process), and lets it go once a replacement from outside has waited for it."""
    import gc
    import weakref

    rooms = [1, 2]
    decode, dpool, prefill, ppool, session, opened = _pair(rooms)
    calls = {"first": 0, "second": 0}
    done = threading.Event()
    refs = []

    def second(kind, status, tag, room, chunk):
        calls["second"] += 1
        done.set()

    def first(kind, status, tag, room, chunk):
        calls["first"] += 1
        refs.append(weakref.ref(prefill._callback))
        prefill.set_completion_callback(second)
        gc.collect()
        # Still inside the first callback's thunk: it must be alive.
        assert refs[0]() is not None

    prefill.set_completion_callback(first)
    try:
        op = session.transfer_async(1, 0, list(range(PAGES)), timeout_ms=20000, tag=1, room_key=opened[1].key)
        assert op.wait(20000) == kvstage.Status.OK
        deadline = time.monotonic() + 10
        while calls["first"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        gc.collect()
        assert calls["first"] == 1 and refs[0]() is not None, "the replaced thunk was freed while its call could still run"
        op2 = session.transfer_async(2, 0, list(range(PAGES)), timeout_ms=20000, tag=2, room_key=opened[2].key)
        assert op2.wait(20000) == kvstage.Status.OK
        assert done.wait(20), f"calls: {calls}"
        # Replaced from outside a callback: the library waited for every earlier call.
        prefill.set_completion_callback(None)
        gc.collect()
        assert refs[0]() is None, "a retired thunk was kept after a replacement from outside"
        op.close()
        op2.close()
    finally:
        session.close()
        prefill.close()
        decode.close()


def test_calls_that_could_wait_on_the_callback_thread_are_refused_inside_a_callback(lib):
    """room_wait, room_release and an op wait from inside a completion callback would wait for the
    thread running it: refused with UNSUPPORTED naming the call, whatever the timeout (0, the engine
    default, included); a poll is allowed."""
    rooms = [1]
    decode, dpool, prefill, ppool, session, opened = _pair(rooms)
    seen = {}
    done = threading.Event()
    ops = []

    def on_chunk(kind, status, tag, room, chunk):
        for name, call in (("room_wait", lambda: opened[room].wait(1000)), ("room_release", lambda: opened[room].release())):
            try:
                call()
                seen[name] = "returned"
            except kvstage.KVStageError as e:
                seen[name] = (e.code, str(e))
        done.set()

    def on_op(kind, status, tag, room, chunk):
        for name, timeout_ms in (("op_wait", 1000), ("op_wait 0", 0)):
            try:
                ops[0].wait(timeout_ms)
                seen[name] = "returned"
            except kvstage.KVStageError as e:
                seen[name] = (e.code, str(e))
        seen["op_poll"] = ops[0].poll()

    decode.set_completion_callback(on_chunk)
    prefill.set_completion_callback(on_op)
    try:
        ops.append(session.transfer_async(1, 0, list(range(PAGES)), timeout_ms=20000, tag=1, room_key=opened[1].key))
        assert ops[0].wait(20000) == kvstage.Status.OK
        assert done.wait(20), f"seen: {seen}"
        deadline = time.monotonic() + 10
        while "op_poll" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        for name in ("room_wait", "room_release", "op_wait", "op_wait 0"):
            status, text = seen[name]
            assert status == kvstage.Status.E_UNSUPPORTED and f"kvstage_{name.split()[0]}" in text and "completion callback" in text, seen
        assert isinstance(seen["op_poll"], kvstage.Status), seen
        decode.set_completion_callback(None)
        prefill.set_completion_callback(None)
        opened[1].release()
        ops[0].close()
    finally:
        session.close()
        prefill.close()
        decode.close()
