"""Metrics from Python: session and engine counters after a known sequence of transfers, phase
timings of a synchronous transfer, of an operation and in its completion, and the decode side's
arrival-to-scatter times. Both engines live in this process, on 127.0.0.1."""

import ctypes
import os
import re
import threading

import pytest

import kvref
import kvstage
from kvstage import _lib

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=4)
PAGES = 4  # one chunk of 16 tokens per room
CHUNK_BYTES = PAGES * MODEL.page_size * MODEL.heads * MODEL.head_dim * MODEL.dtype_bytes * 2 * MODEL.layers
PHASES = ("watermark_wait_ns", "alloc_wait_ns", "gather_ns", "wire_ns", "ack_ns")


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
    completions, chunks = [], []
    done = threading.Event()

    def on_op(kind, status, tag, room, chunk, timings, scatter_ns):
        completions.append((tag, status, timings))
        done.set()

    def on_chunk(kind, status, tag, room, chunk, timings, scatter_ns):
        if status == kvstage.Status.OK:
            chunks.append(scatter_ns)

    prefill.set_completion_callback(on_op, metrics=True)
    decode.set_completion_callback(on_chunk, metrics=True)
    pages = list(range(PAGES))
    try:
        assert session.stats().transfers_ok == 0
        for room in (1, 2):
            key = decode.room_open(room, pages, chunk_tokens=PAGES * MODEL.page_size).key
            assert session.transfer(room, 0, pages, deadline_ms=20000, room_key=key) == kvstage.Status.OK
            t = kvstage.transfer_timings_last()
            _full(t)
            assert t.queued_ns == 0
            decode.room_wait(room, 20000)
        key = decode.room_open(3, pages, chunk_tokens=PAGES * MODEL.page_size).key
        op = session.transfer_async(3, 0, pages, deadline_ms=20000, tag=33, room_key=key)
        assert op.wait() == kvstage.Status.OK
        t = op.timings()
        _full(t)
        assert t.queued_ns > 0
        assert done.wait(20)
        assert completions == [(33, kvstage.Status.OK, t)]
        op.close()
        decode.room_wait(3, 20000)
        # A fallback: 12 pages are more than the ring holds (decided before the room is named: any key).
        assert session.transfer(4, 0, list(range(12)), deadline_ms=20000, room_key=1) == kvstage.Status.FALLBACK
        assert kvstage.transfer_timings_last().gather_ns == 0

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
        for _ in range(1000):  # chunk callbacks run just after the room completes
            if len(chunks) == 3:
                break
            threading.Event().wait(0.01)
        assert len(chunks) == 3 and all(ns > 0 for ns in chunks) and sum(chunks) == d.scatter_ns_sum
    finally:
        prefill.set_completion_callback(None)
        decode.set_completion_callback(None)
        session.close()
        prefill.close()
        decode.close()


HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "include", "kvstage.h")
C_TYPES = {
    "size_t": ctypes.c_size_t,
    "uint64_t": ctypes.c_uint64,
    "uint32_t": ctypes.c_uint32,
    "int32_t": ctypes.c_int32,
    "enum kvstage_status": ctypes.c_int,
}


def _header_struct(text: str, name: str, known: dict) -> type:
    """A ctypes Structure built from the header's definition of `name` (fields of the types above
    or of structs built before)."""
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), text, re.S)
    assert m, f"{name} not in the header"
    fields = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        ctype, field = decl.rsplit(" ", 1)
        array = re.fullmatch(r"(\w+)\[(\w+)\]", field)
        if array:  # char trace_id[KVSTAGE_TRACE_ID_SIZE]
            size = re.search(r"#define %s (\d+)" % array.group(2), text) if not array.group(2).isdigit() else None
            n = int(size.group(1)) if size else int(array.group(2))
            assert ctype == "char", f"{name}.{field}: arrays of {ctype} not mapped"
            fields.append((array.group(1), ctypes.c_char * n))
            continue
        if ctype.startswith("struct "):
            fields.append((field, known[ctype[len("struct ") :]]))
        else:
            assert ctype in C_TYPES, f"{name}.{field}: type {ctype} not mapped"
            fields.append((field, C_TYPES[ctype]))
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def test_ctypes_structs_match_the_header():
    """The binding's metric structs have the header's fields, offsets and sizes."""
    if not os.path.exists(HEADER):
        pytest.skip("include/kvstage.h is not in this tree")
    with open(HEADER, encoding="utf-8") as f:
        text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S))
    known: dict = {}
    for name in ("kvstage_transfer_timings", "kvstage_engine_stats", "kvstage_session_stats", "kvstage_completion", "kvstage_chunk_event", "kvstage_chunk_span"):
        want = known[name] = _header_struct(text, name, known)
        got = getattr(_lib, name)
        assert [f[0] for f in got._fields_] == [f[0] for f in want._fields_], name
        for field, _ in want._fields_:
            assert getattr(got, field).offset == getattr(want, field).offset, (name, field)
        assert ctypes.sizeof(got) == ctypes.sizeof(want), name
