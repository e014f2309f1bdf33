"""Metrics from Python: session and engine counters after a known sequence of transfers, phase
timings of synchronous transfers (in the session's sums), of an operation and in its completion,
and the decode side's arrival-to-scatter times. Both engines live in this process, on 127.0.0.1.
(The ctypes structs against the header: test_header.py.)"""

import threading

import kvref
import kvstage

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=4)
PAGES = 4  # one chunk of 16 tokens per room
CHUNK_BYTES = PAGES * MODEL.page_size * MODEL.heads * MODEL.head_dim * MODEL.dtype_bytes * 2 * MODEL.layers
PHASES = ("watermark_wait_ns", "alloc_wait_ns", "gather_ns", "wire_ns", "ack_ns")


def _delta(after: kvstage.TransferTimings, before: kvstage.TransferTimings) -> kvstage.TransferTimings:
    return kvstage.TransferTimings(*(a - b for a, b in zip(after, before)))


def _full(t: kvstage.TransferTimings) -> None:
    for name in PHASES + ("total_ns",):
        assert getattr(t, name) > 0, (name, t)
    assert t.total_ns >= t.queued_ns + sum(getattr(t, name) for name in PHASES), t


def test_counters_and_timings_after_a_known_sequence(lib):
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, 16)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    ring = CHUNK_BYTES * 2
    decode.register_staging(ring)
    ppool, playout = kvref.make_pool(MODEL, 0, 1, 16)
    kvref.fill_random(ppool, 11)
    # Through a send staging buffer, so that every phase happens (from the pool, the default
    # over TCP, there is no wait for a buffer: alloc_wait_ns is 0).
    prefill = kvstage.Engine(transport="tcp", send_from_pool=False)
    prefill.register_pool(playout)
    session = prefill.connect(decode.listen_address, "stats")
    completions, chunks, rooms = [], [], []
    done = threading.Event()

    def on_op(kind, status, tag, room, chunk, timings, scatter_ns):
        completions.append((kind, tag, status, timings))
        done.set()

    def on_chunk(kind, status, tag, room, chunk, timings, scatter_ns):
        if kind == kvstage.CompletionKind.CHUNK and status == kvstage.Status.OK:
            chunks.append(scatter_ns)
        elif kind == kvstage.CompletionKind.ROOM:
            rooms.append((room, chunk, status, scatter_ns))

    prefill.set_completion_callback(on_op, metrics=True)
    decode.set_completion_callback(on_chunk, metrics=True)
    pages = list(range(PAGES))
    try:
        assert session.stats().transfers_ok == 0
        for room in (1, 2):
            before = session.stats().timings_sum
            opening = decode.open_room(room, pages, chunk_tokens=PAGES * MODEL.page_size)
            assert session.transfer(room, 0, pages, timeout_ms=20000, room_key=opening.key) == kvstage.Status.OK
            # A synchronous transfer's phases: what it added to the session's sums (no queue).
            t = _delta(session.stats().timings_sum, before)
            _full(t)
            assert t.queued_ns == 0
            opening.wait(20000)
        opening = decode.open_room(3, pages, chunk_tokens=PAGES * MODEL.page_size)
        before = session.stats().timings_sum
        op = session.transfer_async(3, 0, pages, timeout_ms=20000, tag=33, room_key=opening.key)
        assert op.wait() == kvstage.Status.OK
        t = op.timings()
        _full(t)
        assert t.queued_ns > 0
        assert _delta(session.stats().timings_sum, before) == t
        assert done.wait(20)
        assert completions == [(kvstage.CompletionKind.OP, 33, kvstage.Status.OK, t)]
        op.close()
        opening.wait(20000)
        # A fallback: 12 pages are more than the ring holds (decided before the room is named: any key).
        before = session.stats().timings_sum
        assert session.transfer(4, 0, list(range(12)), timeout_ms=20000, room_key=1) == kvstage.Status.FALLBACK
        fallback = _delta(session.stats().timings_sum, before)
        assert fallback.gather_ns == fallback.wire_ns == 0 and fallback.total_ns > 0

        s = session.stats()
        assert s.transport == kvstage.Transport.TCP and s.downgraded == 0
        assert (s.bytes_sent, s.chunks_sent, s.transfers_ok, s.transfers_fallback) == (3 * CHUNK_BYTES, 3, 3, 1)
        assert (s.transfers_failed, s.transfers_in_flight, s.timed_transfers) == (0, 0, 4)
        assert s.timings_sum.queued_ns == t.queued_ns
        assert s.timings_sum.total_ns >= s.timings_sum.wire_ns + s.timings_sum.ack_ns > 0

        e = prefill.stats()
        assert (e.bytes_sent, e.chunks_sent, e.transfers_ok, e.transfers_fallback, e.timed_transfers) == (3 * CHUNK_BYTES, 3, 3, 1, 4)
        assert e.timings_sum == s.timings_sum
        d = decode.stats()
        assert (d.bytes_received, d.chunks_received, d.scatter_count) == (3 * CHUNK_BYTES, 3, 3)
        assert CHUNK_BYTES <= d.ring_high_water_bytes <= ring
        assert d.ring_used_bytes == 0
        assert 0 < d.scatter_ns_max <= d.scatter_ns_sum
        for _ in range(1000):  # chunk and room callbacks run just after the room completes
            if len(chunks) == 3 and len(rooms) == 3:
                break
            threading.Event().wait(0.01)
        assert len(chunks) == 3 and all(ns > 0 for ns in chunks) and sum(chunks) == d.scatter_ns_sum
        # One ROOM completion per room (its chunk count in `chunk`), without a scatter time.
        assert sorted(rooms) == [(r, 1, kvstage.Status.OK, 0) for r in (1, 2, 3)]
    finally:
        prefill.set_completion_callback(None)
        decode.set_completion_callback(None)
        session.close()
        prefill.close()
        decode.close()
