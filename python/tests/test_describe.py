"""Where is this request, from Python: a layer-wise transfer whose layers are never marked is
stuck; with the engine's request id as its trace id, the operation's document says it waits for
layers (naming them), the decode room's says
the chunk is granted with its writer's progress, the engines' name the ring allocation and the
running chunk; once canceled the operation says failed. Both engines live in this process."""

import time

import pytest

import kvref
import kvstage

MODEL = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=4)


def _until(f, what, within=5.0):
    end = time.monotonic() + within
    while True:
        got = f()
        if got is not None:
            return got
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_stuck_layerwise_transfer_described_from_both_sides(lib):
    _, dlayout = kvref.make_pool(MODEL, 0, 1, 16)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_staging(1 << 20)
    _, playout = kvref.make_pool(MODEL, 0, 1, 16)
    prefill = kvstage.Engine(transport="tcp")
    prefill.register_pool(playout)
    session = prefill.connect(decode.listen_address, "described")
    opening = decode.open_room(9, [0, 1, 2, 3], chunk_tokens=16)
    try:
        op = session.transfer_layerwise_async(9, 0, [4, 5, 6, 7], timeout_ms=20000, room_key=opening.key, trace_id="req-9/p0")
        doc = _until(lambda: (lambda d: d if d["phase"] == "waiting_for_layers" else None)(op.describe()), "the op waits for layers")
        assert (doc["session"], doc["trace"], doc["room"], doc["chunk"], doc["status"]) == ("described", "req-9/p0", 9, 0, "KVSTAGE_PENDING")
        assert "layers 0, 1, 2 of the chunk are not marked ready" in doc["waits_on"]
        assert 0 < doc["deadline_left_ms"] <= 20000 and doc["version"] == 1

        room = opening.describe()
        assert (room["state"], room["trace"], room["num_chunks"], room["chunks_done"]) == ("open", "req-9/p0", 1, 0)
        chunk = room["chunks"][0]
        assert chunk["phase"] == "granted" and chunk["grant"]["ring_position"] == 0
        assert [(w["session"], w["landed"], w["ready"]) for w in chunk["writers"]] == [("described", 0, False)]

        engine = decode.describe()
        assert engine["transport"].startswith("tcp (transport tcp)"), engine["transport"]
        assert [(a["room"], a["chunk"]) for a in engine["receiver"]["ring"]["allocations"]] == [(9, 0)]
        assert engine["receiver"]["rooms"][0]["state"] == "open"
        assert prefill.describe()["sessions"][0]["running"] == [{"room": 9, "chunk": 0}]

        op.cancel()
        with pytest.raises(kvstage.TimeError):
            op.wait(20000)
        ended = op.describe()
        assert (ended["phase"], ended["status"], ended["deadline_left_ms"]) == ("failed", "KVSTAGE_E_CANCELED", None)
        assert ended["error"]
        failed = _until(lambda: (lambda d: d if d["state"] == "failed" else None)(opening.describe()), "the room fails")
        assert failed["failure"]["code"] == "KVSTAGE_E_CANCELED" and failed["chunks"][0]["phase"] == "failed"
        # The failed chunk's event, then the failed room's, carry the request's trace id.
        events = [(e.kind, e.room, e.trace, e.status) for e in decode.poll_events()]
        canceled = kvstage.Status.E_CANCELED
        assert events == [(kvstage.RoomEventKind.CHUNK, 9, "req-9/p0", canceled), (kvstage.RoomEventKind.ROOM, 9, "req-9/p0", canceled)]
        # A released opening is not described any more (its key names no open opening).
        opening.release()
        with pytest.raises(kvstage.TimeError, match="room 9 is not open") as info:
            opening.describe()
        assert info.value.code == kvstage.Status.E_STALE_ROOM
    finally:
        session.close()
        prefill.close()
        decode.close()
