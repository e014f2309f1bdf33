"""kvstage.prometheus: an engine's counters and gauges read at scrape time, and phase histograms
fed by the completion callback and by an operation's timings (skipped without prometheus_client)."""

import threading

import pytest

import kvref
import kvstage

prometheus_client = pytest.importorskip("prometheus_client")
import kvstage.prometheus  # noqa: E402 - after the skip

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=4)
PAGES = 4
CHUNK_BYTES = PAGES * MODEL.page_size * MODEL.heads * MODEL.head_dim * MODEL.dtype_bytes * 2 * MODEL.layers


def test_counters_gauges_and_phase_histograms(lib):
    registry = prometheus_client.CollectorRegistry()
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, 16)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_staging(CHUNK_BYTES * 2)
    ppool, playout = kvref.make_pool(MODEL, 0, 1, 16)
    kvref.fill_random(ppool, 3)
    # Through a send staging buffer, so that every phase happens (from the pool, the default over
    # TCP, a chunk without a checksum has no gather phase).
    prefill = kvstage.Engine(transport="tcp", send_from_pool=False)
    prefill.register_pool(playout)
    kvstage.prometheus.register(decode, registry, name="decode")
    phases = kvstage.prometheus.register(prefill, registry, name="prefill")
    decode_phases = kvstage.prometheus.PhaseHistograms("decode", registry)
    done = threading.Event()

    def on_completion(*args):
        phases.on_completion(*args)
        done.set()

    # A decode chunk's callback runs just after its room completes: count them to wait for both
    # (each room's ROOM completion, which has no scatter time, is not observed).
    decoded = threading.Semaphore(0)

    def on_decode(*args):
        decode_phases.on_completion(*args)
        if args[0] == kvstage.CompletionKind.CHUNK:
            decoded.release()

    prefill.set_completion_callback(on_completion, metrics=True)
    decode.set_completion_callback(on_decode, metrics=True)
    value = registry.get_sample_value
    pages = list(range(PAGES))
    try:
        session = prefill.connect(decode.listen_address, "prom")
        room = decode.open_room(1, pages, chunk_tokens=PAGES * MODEL.page_size)
        op = session.transfer_async(1, 0, pages, timeout_ms=20000, room_key=room.key)
        assert op.wait() == kvstage.Status.OK and done.wait(20)
        op.close()
        room.wait(20000)
        # An operation observed by hand (not through the callback): its timings once it ended.
        prefill.set_completion_callback(None)
        room = decode.open_room(2, pages, chunk_tokens=PAGES * MODEL.page_size)
        with session.transfer_async(2, 0, pages, timeout_ms=20000, room_key=room.key) as op:
            assert op.wait() == kvstage.Status.OK
            phases.observe(op.timings())
        room.wait(20000)
        # A fallback (more pages than the ring holds) and a stale key (a room that is not open).
        assert session.transfer(3, 0, list(range(12)), timeout_ms=20000, room_key=1) == kvstage.Status.FALLBACK
        with pytest.raises(kvstage.TimeError):
            session.transfer(4, 0, pages, timeout_ms=20000, room_key=1)

        assert value("kvstage_transfers_total", {"engine": "prefill", "outcome": "ok"}) == 2
        assert value("kvstage_transfers_total", {"engine": "prefill", "outcome": "fallback"}) == 1
        assert value("kvstage_transfers_total", {"engine": "prefill", "outcome": "canceled"}) == 1
        assert value("kvstage_bytes_sent_total", {"engine": "prefill"}) == 2 * CHUNK_BYTES
        assert value("kvstage_chunks_received_total", {"engine": "decode"}) == 2
        assert value("kvstage_ring_capacity_bytes", {"engine": "decode"}) == CHUNK_BYTES * 2
        assert value("kvstage_rooms_expired_total", {"engine": "decode"}) == 0
        # Two operations (one through the callback, one by hand), every phase of both observed; the
        # synchronous fallback and the stale transfer were not.
        for phase in kvstage.prometheus.PHASES:
            assert value("kvstage_transfer_phase_seconds_count", {"engine": "prefill", "phase": phase}) == 2, phase
        assert decoded.acquire(timeout=20) and decoded.acquire(timeout=20), "both chunks' callbacks ran"
        assert value("kvstage_scatter_seconds_count", {"engine": "decode"}) == 2
        # Text exposition works (what a Prometheus server scrapes).
        text = prometheus_client.generate_latest(registry).decode()
        assert 'kvstage_transfers_total{engine="prefill",outcome="ok"} 2.0' in text
        session.close()
    finally:
        prefill.set_completion_callback(None)
        decode.set_completion_callback(None)
        prefill.close()
        decode.close()
    # A closed engine yields no samples (its collector stays registered).
    assert value("kvstage_transfers_total", {"engine": "prefill", "outcome": "ok"}) is None
