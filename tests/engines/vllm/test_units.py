"""kvstage's vLLM connector, unit level: its scheduler and worker classes in this process, real
kvstage engines and vLLM's CPU cache kernel, no vLLM engine started.

    python test_units.py

Checks bad kv_transfer_params from a client (M1), a hostile peer against the prefill's bootstrap
listener (M2-M4), a room whose release raises (M6), a TP-2 prefill with one KV head whose rank
the pairing leaves out (M5), the in-block order agreed in the push (M7). Prints one line per
check and "N passed, M failed".
"""

import errno
import json
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

import vllm.distributed.parallel_state as ps
from kvstage.vllm import connector as C

LOG = []


class _Grab(logging.Handler):
    def emit(self, record):
        LOG.append(record.getMessage())


logging.getLogger("vllm.kvstage").addHandler(_Grab())
logging.getLogger("vllm.kvstage").setLevel(logging.DEBUG)

HEAD_DIM = 32
LAYERS = 2
BLOCKS = 16


def free_ports(n):
    """n consecutive free TCP ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


def config(role, block_size=32, heads=2, tp=1, extra=None):
    ex = {"host": "127.0.0.1", "lease_s": 30, "load_timeout_s": 5, "staging_bytes": 8 << 20}
    ex.update(extra or {})
    ktc = SimpleNamespace(
        engine_id="e", is_kv_producer=role in ("kv_producer", "kv_both"), is_kv_consumer=role in ("kv_consumer", "kv_both"),
        kv_connector_extra_config=ex,
    )
    mc = SimpleNamespace(get_head_size=lambda: HEAD_DIM, get_total_num_kv_heads=lambda: heads)
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=block_size), model_config=mc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def worker(role, block_size=32, heads=2, tp=1, rank=0, extra=None, seed=None):
    ps.get_tensor_model_parallel_rank = lambda: rank
    ps.get_tensor_model_parallel_world_size = lambda: tp
    cfg = config(role, block_size, heads, tp, extra)
    w = C._Worker(cfg, C._options(cfg))
    local = max(1, heads // tp)
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    caches = {f"model.layers.{i}.self_attn.attn": (torch.rand(BLOCKS, local, block_size, 2 * HEAD_DIM, generator=g) if seed is not None
                                                   else torch.zeros(BLOCKS, local, block_size, 2 * HEAD_DIM)) for i in range(LAYERS)}
    w.register_kv_caches(caches)
    return w


def wait_finished(w, kind, req_id, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        sending, recving = w.take_finished(True)
        if req_id in (sending if kind == "send" else recving):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{req_id} not finished {kind}ing within {timeout} s")


def send_meta(req_id, blocks, ntokens):
    m = C.KvstageConnectorMetadata()
    m.send[req_id] = C._Send(req_id, blocks, ntokens)
    return m


def real_push(p, d, port, req, ntokens=70, tp=1, whole=True):
    """The prefill holds `req`; the decode loads it; the bytes must equal."""
    pb = list(range(1, 1 + -(-ntokens // p.block_size)))
    db = list(range(3, 3 + -(-ntokens // d.block_size)))
    stats = d.opts["stats_file"]
    before = len(open(stats).readlines()) if stats and os.path.exists(stats) else 0
    p.start(send_meta(req, pb, ntokens))
    d._start_recv(C._Recv(f"d-{req}", db, 0, ntokens, f"127.0.0.1:{port}", req, tp, p.block_size))
    wait_finished(d, "recv", f"d-{req}")
    row = [json.loads(x) for x in open(stats).readlines()[before:]]
    assert len(row) == 1 and row[0]["ok"], f"load {row}"
    assert not d.take_failed_blocks(), "failed blocks reported"
    for layer in range(LAYERS):
        for i, (a, b) in enumerate(zip(pb, db)):
            if whole and p.block_size == d.block_size:
                assert torch.equal(p.tensors[layer][a], d.tensors[layer][b]), f"layer {layer} block {a}->{b} differs"
    if not whole or p.block_size != d.block_size:  # token by token through the backend's order: compare as attention reads it
        n = ntokens
        pk = canon(p, pb)[..., :n, :]
        dk = canon(d, db)[..., :n, :]
        assert torch.equal(pk, dk), "the received KV differs (token-major view)"
    return row[0]


def canon(w, blocks):
    """[layers, heads, tokens, 2*D] token-major K‖V of `blocks`, whatever the in-block order."""
    out = []
    for layer in range(LAYERS):
        r = w._region(layer)[torch.tensor(blocks)]  # [b, h, 2*N*D]
        if w.positions is not None and not isinstance(w.positions, str):
            r = r[:, :, w.positions]
        b, h, _ = r.shape
        n = w.block_size
        k = r[:, :, : n * HEAD_DIM].reshape(b, h, n, HEAD_DIM)
        v = r[:, :, n * HEAD_DIM:].reshape(b, h, n, HEAD_DIM)
        kv = torch.cat([k, v], -1).permute(1, 0, 2, 3).reshape(h, b * n, 2 * HEAD_DIM)
        out.append(kv)
    return torch.stack(out)


def ask(port, raw, timeout=5.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        s.settimeout(timeout)
        buf = b""
        while not buf.endswith(b"\n"):
            part = s.recv(4096)
            if not part:
                break
            buf += part
    return json.loads(buf) if buf else None


# -- checks -----------------------------------------------------------------------------------


def bad_params_fall_back():
    s = C._Scheduler(config("kv_consumer"), C._options(config("kv_consumer")))
    good = {"do_remote_prefill": True, "remote_bootstrap": "127.0.0.1:17600", "remote_request_id": "x", "remote_tp_size": 1,
            "remote_block_size": 32, "remote_num_tokens": 50}
    cases = [("remote_bootstrap", "nohostport"), ("remote_bootstrap", 12), ("remote_bootstrap", "h:99999"), ("remote_request_id", None),
             ("remote_tp_size", "2"), ("remote_tp_size", 0), ("remote_block_size", -1), ("remote_block_size", [32]),
             ("remote_num_tokens", 49), ("remote_tp_size", None)]
    for key, val in cases:
        params = dict(good, **{key: val})
        req = SimpleNamespace(request_id=f"r-{key}", kv_transfer_params=params, prompt_token_ids=list(range(50)), status=None)
        del LOG[:]
        n, is_async = s.get_num_new_matched_tokens(req, 0)
        assert (n, is_async) == (0, False), f"{key}={val!r}: matched {n}, async {is_async}"
        assert any(key in m and repr(val) in m for m in LOG), f"{key}={val!r}: no WARNING naming it: {LOG}"
        s.update_state_after_alloc(req, None, 0)  # vLLM calls it with 0 external tokens: no raise
    # not a consumer: a warning, computed locally (before: ValueError in the scheduler)
    sp = C._Scheduler(config("kv_producer"), C._options(config("kv_producer")))
    req = SimpleNamespace(request_id="r-role", kv_transfer_params=dict(good), prompt_token_ids=list(range(50)), status=None)
    assert sp.get_num_new_matched_tokens(req, 0) == (0, False)
    # hybrid blocks after the count: the load fails at once instead of raising or hanging
    req = SimpleNamespace(request_id="r-hybrid", kv_transfer_params=dict(good), prompt_token_ids=list(range(50)), status=None)
    assert s.get_num_new_matched_tokens(req, 0) == (50, True)
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([1, 2], [3, 4]))
    s.update_state_after_alloc(req, blocks, 50)
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert "r-hybrid" in meta.recv and meta.recv["r-hybrid"].error, f"no failed load queued: {meta.recv}"
    # params changed between the count and the allocation
    req = SimpleNamespace(request_id="r-late", kv_transfer_params=dict(good), prompt_token_ids=list(range(50)), status=None)
    assert s.get_num_new_matched_tokens(req, 0) == (50, True)
    req.kv_transfer_params["remote_tp_size"] = "x"
    s.update_state_after_alloc(req, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([5, 6],)), 50)
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert meta.recv["r-late"].error and meta.recv["r-late"].block_ids == [5, 6], meta.recv
    # a hybrid model is refused at start
    try:
        C.KvstageConnector(config("kv_consumer"), C.KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[1, 2]))
    except ValueError as e:
        assert "KV cache groups" in str(e)
    else:
        raise AssertionError("a hybrid model was not refused")
    return f"{len(cases)} bad fields fell back with a WARNING naming them; hybrid refused"


def recv_never_stuck(d):
    """A load whose set-up fails (bad bootstrap, a scheduler error) still finishes, failed."""
    for i, bad in enumerate(("nohostport", "127.0.0.1:notaport")):
        r = C._Recv(f"stuck{i}", [7], 0, 10, bad, "x", 1, 32)
        d._start_recv(r)
        wait_finished(d, "recv", r.req_id, 5)
        assert 7 in d.take_failed_blocks(), "its blocks were not reported failed"
    r = C._Recv("stuck-err", [], 0, 0, "", "", 1, 32, error="boom")
    d._start_recv(r)
    wait_finished(d, "recv", "stuck-err", 5)
    assert "stuck-err" in d.take_failed_recv()
    assert d._receiving == 0, f"{d._receiving} loads still counted"
    return "bad bootstrap and a failed set-up finished receiving, failed"


def hostile_peer(p, d, port):
    C._MSG_DEADLINE_S = 1.0
    out = []
    rep = ask(port, b"this is not json\n")
    assert rep and not rep["ok"], rep
    out.append("garbage")
    rep = ask(port, json.dumps({"op": "push", "req": "r", "decode_rank": 0, "decode_tp": 1}).encode() + b"\n")
    assert rep and not rep["ok"] and "grid" in rep["error"], rep
    out.append("missing grid")
    rep = ask(port, json.dumps({"op": "push", "req": "r", "decode_rank": 0, "decode_tp": 3, "grid": [1, 32, 1, 1, 32, 0], "room": 1, "key": 1,
                                "addr": "127.0.0.1:1"}).encode() + b"\n")
    assert rep and not rep["ok"] and "decode_tp" in rep["error"] or "pair" in rep.get("error", ""), rep
    out.append(f"decode_tp 3: {rep['error'][-80:]}")
    rep = ask(port, json.dumps({"op": "push", "req": "r", "decode_rank": 5, "decode_tp": 1, "grid": [1, 32, 1, 1, 32, 0]}).encode() + b"\n")
    assert rep and not rep["ok"] and "decode_rank" in rep["error"], rep
    # a trickling sender is cut at the message deadline, not kept alive by each byte
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    closed = None
    try:
        for _ in range(40):
            s.sendall(b" ")
            time.sleep(0.1)
            s.setblocking(False)
            try:
                if s.recv(4096) is not None:
                    closed = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
    except OSError:
        closed = time.monotonic() - t0
    s.close()
    assert closed is not None and closed < 3.0, f"a trickling sender was still connected after {time.monotonic() - t0:.1f} s"
    out.append(f"trickle cut after {closed:.1f} s")
    # many unique fake ids: parked pushes are capped, the oldest answered with an error
    conns = []
    grid = [1, 32, 1, 1, 32, 0]
    for i in range(C._MAX_PARKED + 20):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(json.dumps({"op": "push", "req": f"fake{i}", "decode_rank": 0, "decode_tp": 1, "grid": grid, "room": 1, "key": 1,
                              "addr": "127.0.0.1:1", "trace": "t"}).encode() + b"\n")
        conns.append(c)
    time.sleep(1.0)
    with p._cond:
        parked = p._parked_count()
    assert parked <= C._MAX_PARKED, f"{parked} parked"
    conns[0].settimeout(3)
    first = conns[0].recv(4096)
    assert first and b"dropped" in first, first
    for c in conns:
        c.close()
    out.append(f"{C._MAX_PARKED + 20} fake ids: {parked} parked, oldest answered")
    # releases of many unique ids: _gone stays bounded
    for i in range(C._GONE_MAX + 200):
        with p._cond:
            p._note_gone(f"g{i}", "test")
    assert len(p._gone) <= C._GONE_MAX, len(p._gone)
    # transient accept errors: keep accepting
    real = p._listener

    class Flaky:
        n = 0

        def accept(self):
            if Flaky.n < 3:
                Flaky.n += 1
                raise OSError(errno.EMFILE if Flaky.n < 3 else errno.ECONNABORTED, "test")
            return real.accept()

        def fileno(self):
            return real.fileno()

        def close(self):
            real.close()

    p._listener = Flaky()
    time.sleep(0.5)
    rep = ask(port, b"garbage again\n")
    assert rep and not rep["ok"], rep
    assert Flaky.n == 3
    p._listener = real
    out.append("EMFILE/ECONNABORTED survived")
    row = real_push(p, d, port, "after-hostile")
    out.append(f"then a real push: {row['bytes']} bytes")
    return "; ".join(out)


def decode_failure_tells_prefill(p, d, port):
    """S4: a decode load that fails before it asks the prefill (here: its room cannot open)
    tells the prefill it needs nothing: the blocks are freed now, not after lease_s."""
    p.start(send_meta("s4", [1, 2], 50))
    d._start_recv(C._Recv("d-s4", [999], 0, 50, f"127.0.0.1:{port}", "s4", 1, 32))
    wait_finished(d, "recv", "d-s4", 5)
    d.take_failed_blocks()
    took = wait_finished(p, "send", "s4", 5)
    return f"the prefill freed the request {took:.2f} s after the decode's failure (lease 30 s)"


def release_retry(d):
    class Room:
        calls = 0

        def release(self):
            Room.calls += 1
            if Room.calls < 3:
                raise C.kvstage.TimeError("a same-host writer still holds the pages") if hasattr(C.kvstage, "TimeError") else RuntimeError("held")

    d.take_failed_blocks()  # earlier checks' failures
    for ok in (True, False):
        Room.calls = 0
        r = C._Recv(f"rel-{ok}", [9, 10], 0, 40, "127.0.0.1:1", "x", 1, 32)
        with d._cond:
            d._receiving += 1
        d._complete_recv(r, ok, Room())
        for step in range(1):
            sending, recving = d.take_finished(False)
            assert r.req_id not in recving, f"reported finished while its room is held (release call {Room.calls})"
            assert not d.take_failed_blocks()
        sending, recving = d.take_finished(False)
        assert r.req_id in recving and Room.calls == 3, f"not reported after the release succeeded ({Room.calls} calls)"
        failed = d.take_failed_blocks()
        assert failed == (set() if ok else {9, 10}), failed
    return "reported only once release() succeeded (3rd call), failed blocks then"


def tp2_mqa(tmp):
    port = free_ports(2)
    ex = {"bootstrap_port": port}
    p0 = worker("kv_producer", heads=1, tp=2, rank=0, extra=ex, seed=5)
    p1 = worker("kv_producer", heads=1, tp=2, rank=1, extra=ex, seed=5)
    d = worker("kv_consumer", heads=1, tp=1, rank=0, extra={"stats_file": os.path.join(tmp, "mqa.jsonl")})
    try:
        recv = C._Recv("m", [1], 0, 20, f"127.0.0.1:{port}", "mq", 2, 32)
        ranks = d._prefill_ranks(recv)
        assert len(ranks) == 1, f"pairing asks prefill ranks {ranks}"
        left = 1 - ranks[0]
        row = real_push(p0 if ranks[0] == 0 else p1, d, port, "mq", ntokens=20, tp=2)
        other = (p0, p1)[left]
        other.start(send_meta("mq", [1], 20)) if "mq" not in other._held and "mq" not in other._gone else None
        took = wait_finished(other, "send", "mq", 5)
        return f"decode asks prefill rank {ranks[0]} only; rank {left} freed its blocks {took:.2f} s later (lease 30 s); {row['bytes']} bytes"
    finally:
        for w in (p0, p1, d):
            w.shutdown()


def layout_agreed(tmp):
    """M7: the push names the decode's in-block order; a prefill whose order differs repacks to
    token-major and says so; the decode un-repacks by that answer."""
    port = free_ports(1)
    p = worker("kv_producer", extra={"bootstrap_port": port}, seed=7)
    d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "m7.jsonl")})
    try:
        assert p.layout_id == d.layout_id and "/32" in p.layout_id, (p.layout_id, d.layout_id)
        # pretend the prefill's kernel had another order: same block size, yet it must repack
        p.layout_id = "perm-other/32"
        row = real_push(p, d, port, "m7", ntokens=50, whole=False)
        pk, dk = canon(p, [1, 2])[..., :50, :], canon(d, [3, 4])[..., :50, :]
        assert torch.equal(pk, dk), "the decode did not put the token-major copy back in its order"
        return f"layout {d.layout_id}; a prefill with another order sent token-major, the decode un-repacked: equal ({row['bytes']} bytes)"
    finally:
        p.shutdown()
        d.shutdown()


def main():
    tmp = tempfile.mkdtemp(prefix="kvstage-vllm-units.")
    passed = failed = 0

    def check(name, fn, *a):
        nonlocal passed, failed
        t0 = time.time()
        try:
            detail = fn(*a)
            passed += 1
            print(f"ok   unit_{name} ({time.time() - t0:.1f} s): {detail}", flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAIL unit_{name} ({time.time() - t0:.1f} s): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=4, file=sys.stdout)

    check("bad_kv_transfer_params_fall_back", bad_params_fall_back)
    port = free_ports(1)
    p = d = None
    try:
        p = worker("kv_producer", extra={"bootstrap_port": port}, seed=1)
        d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "d.jsonl")})
        check("real_push", lambda: f"{real_push(p, d, port, 'first')['bytes']} bytes, equal")
        check("recv_never_stuck", recv_never_stuck, d)
        check("hostile_peer_then_real_push", hostile_peer, p, d, port)
        check("decode_failure_before_push_frees_prefill", decode_failure_tells_prefill, p, d, port)
        check("room_release_retried_before_reporting", release_retry, d)
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"FAIL unit_setup: {type(e).__name__}: {e}", flush=True)
    finally:
        for w in (p, d):
            if w is not None:
                w.shutdown()
    check("tp2_mqa_left_out_rank_freed", tp2_mqa, tmp)
    check("block_layout_agreed_in_push", layout_agreed, tmp)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
