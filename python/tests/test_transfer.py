"""Staged transfers between two Python processes over 127.0.0.1 with numpy host pools.

This process plays every prefill rank; ``decode_peer.py`` (a separate Python process) plays every
decode rank. The decode pools that arrive are compared, whole, with ``kvref.reference_reshard``.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvref
import kvstage

HERE = os.path.dirname(os.path.abspath(__file__))
ROOM = 42


class Peer:
    """The decode process: JSON lines on stdout, one line on stdin to go on."""

    def __init__(self, cfg, env):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "decode_peer.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )

    def line(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                text = self.proc.stdout.readline()
                if not text:
                    break
                msg = json.loads(text)
                if "error" in msg:
                    pytest.fail("decode process failed:\n" + "\n  caused by: ".join(msg["error"]) + "\n" + msg["traceback"])
                return msg
        self.proc.kill()
        _, err = self.proc.communicate()
        pytest.fail(f"decode process gave no answer within {timeout} s (exit {self.proc.returncode}):\n{err}")

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()


def _pairs(model, p_tp, d_tp):
    """(prefill rank, decode rank) pairs that exchange data, by asking kvstage.head_slice."""
    pairs = []
    for rs in range(p_tp):
        for rd in range(d_tp):
            try:
                kvstage.head_slice(p_tp, d_tp, rs, rd, model.heads)
            except kvstage.ArgumentError:
                continue
            pairs.append((rs, rd))
    return pairs


CASES = {
    # P4 -> D2, page 16, four chunks, drop-in StagingTransfer, one chunk after the other; the
    # rings are engine-owned, so the prefill engines require the same-host path (transport shm).
    "P4-D2": dict(
        model=kvref.Model(layers=3, heads=8, head_dim=16, dtype_bytes=2, page_size=16),
        prefill_tp=4, decode_tp=2, tokens=256, chunk_tokens=64, capacity_pages=40,
        ring_chunks=2, ring_memory="engine", sender="staging_transfer", transport="shm",
    ),
    # P2 -> D4, page 1, three chunks, async operations from one thread per prefill rank; the
    # staging rings are numpy arrays owned by the decode process.
    "P2-D4": dict(
        model=kvref.Model(layers=2, heads=8, head_dim=8, dtype_bytes=4, page_size=1),
        prefill_tp=2, decode_tp=4, tokens=96, chunk_tokens=32, capacity_pages=160,
        ring_chunks=2, ring_memory="numpy", sender="async_threads", transport="tcp",
    ),
    # The same over TCP with each chunk gathered into a staging buffer and written in pieces of
    # one slab (by default TCP writes straight from the pool's rows).
    "P2-D4-pieces": dict(
        model=kvref.Model(layers=2, heads=8, head_dim=8, dtype_bytes=4, page_size=1),
        prefill_tp=2, decode_tp=4, tokens=96, chunk_tokens=32, capacity_pages=160,
        ring_chunks=2, ring_memory="numpy", sender="async_threads", transport="tcp",
        engine_options=dict(send_from_pool=False, send_piece_bytes=1),
    ),
    # P1 -> D4 with two KV heads: each head replicated on two decode ranks; bytearray rings.
    "P1-D4-replicated": dict(
        model=kvref.Model(layers=2, heads=2, head_dim=8, dtype_bytes=1, page_size=4),
        prefill_tp=1, decode_tp=4, tokens=64, chunk_tokens=16, capacity_pages=40,
        ring_chunks=1, ring_memory="bytearray", sender="staging_transfer", transport="tcp",
    ),
}


def _send_staging_transfer(engines, pairs, prefill_pages, addrs, keys, chunks, grid_pages):
    """The engine-shaped drop-in: transfer(session_id, indices, ptr, size, target) -> 0 / -1."""
    helpers = [kvstage.StagingTransfer(e) for e in engines]
    try:
        for c in range(chunks):
            for rs, rd in pairs:
                pages = prefill_pages[rs][c * grid_pages : (c + 1) * grid_pages]
                target = kvstage.TransferTarget(room=ROOM, room_key=keys[rd], chunk_index=c, peer=addrs[rd], timeout_ms=20000)
                rc = helpers[rs].transfer(f"req-{ROOM}/p{rs}-d{rd}", pages, None, None, target)
                assert rc == 0, f"chunk {c} p{rs}->d{rd} fell back"
        assert set(helpers[0].session_ids) == {f"req-{ROOM}/p0-d{rd}" for r, rd in pairs if r == 0}
    finally:
        for h in helpers:
            h.close()


def _send_async_threads(engines, pairs, prefill_pages, addrs, keys, chunks, grid_pages):
    """One thread per prefill rank, each chunk as an Operation (transfer_async + wait)."""
    errors = []

    def run(rs):
        try:
            sessions = {rd: engines[rs].connect(addrs[rd], f"req-{ROOM}/p{rs}-d{rd}") for r, rd in pairs if r == rs}
            for c in range(chunks):
                pages = np.asarray(prefill_pages[rs][c * grid_pages : (c + 1) * grid_pages], dtype=np.int64)
                ops = [s.transfer_async(ROOM, c, pages, timeout_ms=20000, room_key=keys[rd]) for rd, s in sessions.items()]
                for op in ops:
                    with op:
                        assert op.wait() == kvstage.Status.OK
                        assert op.poll() == kvstage.Status.OK
            for s in sessions.values():
                s.close()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rs,)) for rs in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a sender thread hung"


@pytest.mark.parametrize("name", list(CASES))
def test_staged_transfer_between_two_processes(name, lib, child_env, tmp_path):
    case = CASES[name]
    model, p_tp, d_tp = case["model"], case["prefill_tp"], case["decode_tp"]
    capacity, tokens, chunk_tokens = case["capacity_pages"], case["tokens"], case["chunk_tokens"]
    n_pages = tokens // model.page_size
    grid_pages = kvstage.grid_tokens(chunk_tokens, model.page_size) // model.page_size
    chunks = -(-n_pages // grid_pages)
    rng = np.random.default_rng(sum(map(ord, name)))
    prefill_pages = [rng.permutation(capacity)[:n_pages].tolist() for _ in range(p_tp)]
    decode_pages = [rng.permutation(capacity)[:n_pages].tolist() for _ in range(d_tp)]

    out = tmp_path / "decode_pools.npz"
    cfg = dict(
        model=model.__dict__, prefill_tp=p_tp, decode_tp=d_tp, room=ROOM, chunk_tokens=chunk_tokens,
        capacity_pages=capacity, ring_chunks=case["ring_chunks"], ring_memory=case["ring_memory"],
        decode_pages=decode_pages, num_chunks=chunks, out=str(out), transport=case["transport"],
    )
    peer = Peer(cfg, child_env)
    try:
        hello = peer.line(timeout=30)
        addrs, keys = hello["addrs"], hello["keys"]
        assert len(addrs) == d_tp and all(a.startswith("127.0.0.1:") for a in addrs)

        engines, pools = [], []
        for rs in range(p_tp):
            pool, layout = kvref.make_pool(model, rs, p_tp, capacity)
            kvref.fill_random(pool, seed=1000 + rs)
            engine = kvstage.Engine("127.0.0.1:0", transport=case["transport"], **case.get("engine_options", {}))
            engine.register_pool(layout)
            engines.append(engine)
            pools.append(pool)
        pairs = _pairs(model, p_tp, d_tp)
        assert {rd for _, rd in pairs} == set(range(d_tp))

        send = _send_staging_transfer if case["sender"] == "staging_transfer" else _send_async_threads
        send(engines, pairs, prefill_pages, addrs, keys, chunks, grid_pages)
        if case["transport"] == "shm":
            # Every session of every prefill rank wrote in place, none fell back to TCP.
            for rs, engine in enumerate(engines):
                st = engine.stats()
                assert st.shm_sessions == sum(1 for r, _ in pairs if r == rs), st
                assert st.shm_downgrades == 0, st
        peer.go()
        result = peer.line(timeout=60)
    finally:
        peer.close()
        for e in locals().get("engines", []):
            e.close()
    assert peer.proc.returncode == 0, f"decode process exited with {peer.proc.returncode}"

    # Every chunk of every decode rank arrived (one OK event each), then the room (one OK ROOM
    # event, its chunk count in chunk_index), and the rings are empty again.
    CHUNK, ROOM_EVENT = kvstage.RoomEventKind.CHUNK, kvstage.RoomEventKind.ROOM
    for rd in range(d_tp):
        events = result["events"][rd]
        assert sorted(c for kind, _, c, _ in events if kind == CHUNK) == list(range(chunks)), f"decode rank {rd}: events {events}"
        assert events[-1][0] == ROOM_EVENT and events[-1][2] == chunks and sum(1 for e in events if e[0] == ROOM_EVENT) == 1, events
        assert all(room == ROOM and status == kvstage.Status.OK for _, room, _, status in events)
        ring_capacity, live_after_release = result["stats"][rd]
        assert ring_capacity == result["ring_bytes"][rd]
        assert live_after_release == 0

    # Every byte of every decode pool equals the reference reshard (untouched slots stay zero).
    got = np.load(out)
    initial = [np.zeros_like(got[f"pool{rd}"]) for rd in range(d_tp)]
    want = kvref.reference_reshard(model, pools, prefill_pages, initial, decode_pages)
    for rd in range(d_tp):
        assert want[rd].any(), "the reference is not trivial"
        problem = kvref.describe_difference(got[f"pool{rd}"], want[rd])
        assert not problem, f"{name}: decode rank {rd}: {problem}"
