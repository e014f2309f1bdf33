"""The decode side of the two-process transfer tests, run as its own Python process.

Usage: ``python decode_peer.py '<json config>'``. It plays every decode rank (one engine, numpy
pool and staging ring each), opens the room, prints ``{"addrs": [...], "keys": [...]}`` (each
rank's key of the opening, what an engine's bootstrap carries to the prefill side) as one line,
then waits for a line on stdin. It then waits for the room on every rank, collects room events
(``[kind, room, chunk_index, status]``) and ring statistics, releases the room, saves the pools to ``config["out"]`` (``.npz``, ``pool0``,
``pool1``, ...) and prints the results as one JSON line. A failure prints ``{"error": ...}`` with
the exception and its cause chain, and exits 1.
"""

import json
import sys
import traceback

import numpy as np

import kvref
import kvstage


def chain(e: BaseException) -> list:
    out = []
    while e is not None:
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__
    return out


def main() -> int:
    cfg = json.loads(sys.argv[1])
    model = kvref.Model(**cfg["model"])
    p_tp, d_tp = cfg["prefill_tp"], cfg["decode_tp"]
    room, chunk_tokens = cfg["room"], cfg["chunk_tokens"]
    ranks = []
    for rd in range(d_tp):
        pool, layout = kvref.make_pool(model, rd, d_tp, cfg["capacity_pages"])
        # The decode engines serve what the prefill side asks for ("shm" needs the same-host path).
        transport = "auto" if cfg.get("transport") == "shm" else "tcp"
        engine = kvstage.Engine("127.0.0.1:0", transport=transport, chunk_tokens=chunk_tokens)
        engine.register_pool(layout)
        grid = kvstage.grid_tokens(chunk_tokens, model.page_size)
        per_chunk = kvstage.staging_layout(model.shape(0, p_tp), layout, grid).total_bytes
        ring_bytes = per_chunk * cfg["ring_chunks"]
        if cfg["ring_memory"] == "numpy":
            ring = np.zeros(ring_bytes, dtype=np.uint8)
            engine.register_staging(ring_bytes, ring)
        elif cfg["ring_memory"] == "bytearray":
            engine.register_staging(ring_bytes, bytearray(ring_bytes))
        else:
            engine.register_staging(ring_bytes)
        opening = engine.open_room(room, cfg["decode_pages"][rd], chunk_tokens)
        if opening.num_chunks != cfg["num_chunks"]:
            raise AssertionError(f"rank {rd}: room has {opening.num_chunks} chunks, expected {cfg['num_chunks']}")
        ranks.append((engine, pool, ring_bytes, opening))
    print(json.dumps({"addrs": [e.listen_address for e, _, _, _ in ranks], "keys": [o.key for _, _, _, o in ranks]}), flush=True)

    sys.stdin.readline()  # the prefill side has sent everything (or gave up)
    result = {"events": [], "stats": [], "ring_bytes": []}
    for engine, _pool, ring_bytes, opening in ranks:
        opening.wait(timeout_ms=cfg.get("wait_ms", 20000))
        events = engine.poll_events()
        stats = engine.stats()
        opening.release()
        after = engine.stats()
        result["events"].append([[int(e.kind), e.room, e.chunk_index, int(e.status)] for e in events])
        result["stats"].append([stats.ring_capacity, after.ring_live_allocations])
        result["ring_bytes"].append(ring_bytes)
    np.savez(cfg["out"], **{f"pool{i}": pool for i, (_, pool, _, _) in enumerate(ranks)})
    for engine, _, _, _ in ranks:
        engine.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception as e:  # noqa: BLE001 - report everything to the parent
        print(json.dumps({"error": chain(e), "traceback": traceback.format_exc()}), flush=True)
        status = 1
    sys.exit(status)
