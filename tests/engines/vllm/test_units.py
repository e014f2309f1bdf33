"""kvstage's vLLM connector, unit level: its scheduler and worker classes in this process, real
kvstage engines and vLLM's CPU cache kernel, no vLLM engine started.

    python test_units.py

Checks bad kv_transfer_params from a client (M1), a hostile peer against the prefill's bootstrap
listener (M2-M4), a room whose release raises (M6), a TP-2 prefill with one KV head whose rank
the pairing leaves out (M5), the in-block order agreed in the push (M7), an fp8 kv_cache_dtype
(S3), a stale push from an earlier decode run (S9), a flood of connections and loads on bounded
threads (S10), bootstrap messages authenticated with cluster_token (S8). Prints one line per
check and "N passed, M failed".
"""

import errno
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace

import torch

import vllm.distributed.parallel_state as ps
import kvstage
from kvstage.vllm import bootstrap as B, connector as C, decode as D, metadata as M, options as O, repack as R, scheduler as S, worker as W

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


def config(role, block_size=32, heads=2, tp=1, extra=None, kv_cache_dtype="auto", dtype=torch.float32):
    ex = {"host": "127.0.0.1", "lease_s": 30, "load_timeout_s": 5, "staging_bytes": 8 << 20}
    ex.update(extra or {})
    ktc = SimpleNamespace(
        engine_id="e", is_kv_producer=role in ("kv_producer", "kv_both"), is_kv_consumer=role in ("kv_consumer", "kv_both"),
        kv_connector_extra_config=ex,
    )
    mc = SimpleNamespace(get_head_size=lambda: HEAD_DIM, get_total_num_kv_heads=lambda: heads, dtype=dtype)
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=block_size, cache_dtype=kv_cache_dtype),
                           model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def worker(role, block_size=32, heads=2, tp=1, rank=0, extra=None, seed=None, kv_cache_dtype="auto", dtype=torch.float32):
    """A worker on caches as vLLM's CPU backend allocates them: the model's dtype, or bytes for an
    fp8 kv_cache_dtype (filled with random bytes that are finite fp8 values when seeded)."""
    ps.get_tensor_model_parallel_rank = lambda: rank
    ps.get_tensor_model_parallel_world_size = lambda: tp
    cfg = config(role, block_size, heads, tp, extra, kv_cache_dtype, dtype)
    w = W._Worker(cfg, O._options(cfg))
    local = max(1, heads // tp)
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    shape = (BLOCKS, local, block_size, 2 * HEAD_DIM)

    def cache():
        if kv_cache_dtype.startswith("fp8"):
            return torch.randint(0, 0x70, shape, dtype=torch.uint8, generator=g) if seed is not None else torch.zeros(shape, dtype=torch.uint8)
        return torch.rand(shape, generator=g).to(dtype) if seed is not None else torch.zeros(shape, dtype=dtype)

    caches = {f"model.layers.{i}.self_attn.attn": cache() for i in range(LAYERS)}
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
    m.send[req_id] = M._Send(req_id, blocks, ntokens)
    return m


def real_push(p, d, port, req, ntokens=70, tp=1, whole=True):
    """The prefill holds `req`; the decode loads it; the bytes must equal."""
    pb = list(range(1, 1 + -(-ntokens // p.block_size)))
    db = list(range(3, 3 + -(-ntokens // d.block_size)))
    stats = d.opts["stats_file"]
    before = len(open(stats).readlines()) if stats and os.path.exists(stats) else 0
    p.start(send_meta(req, pb, ntokens))
    d._start_recv(M._Recv(f"d-{req}", db, 0, ntokens, f"127.0.0.1:{port}", req, tp, p.block_size))
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
        r = R._region(w.tensors[layer])[torch.tensor(blocks)]  # [b, h, 2*N*D]
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
    s = S._Scheduler(config("kv_consumer"), O._options(config("kv_consumer")))
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
    sp = S._Scheduler(config("kv_producer"), O._options(config("kv_producer")))
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
        r = M._Recv(f"stuck{i}", [7], 0, 10, bad, "x", 1, 32)
        d._start_recv(r)
        wait_finished(d, "recv", r.req_id, 5)
        assert 7 in d.take_failed_blocks(), "its blocks were not reported failed"
    r = M._Recv("stuck-err", [], 0, 0, "", "", 1, 32, error="boom")
    d._start_recv(r)
    wait_finished(d, "recv", "stuck-err", 5)
    assert "stuck-err" in d.take_failed_recv()
    assert d._receiving == 0, f"{d._receiving} loads still counted"
    return "bad bootstrap and a failed set-up finished receiving, failed"


def hostile_peer(p, d, port):
    deadline_s, B._MSG_DEADLINE_S = B._MSG_DEADLINE_S, 1.0
    try:
        return _hostile_peer(p, d, port)
    finally:
        B._MSG_DEADLINE_S = deadline_s


def _hostile_peer(p, d, port):
    out = []
    rep = ask(port, b"this is not json\n")
    assert rep and not rep["ok"], rep
    out.append("garbage")
    rep = ask(port, b"[" * 5000 + b"\n")  # json.loads raises RecursionError, not ValueError
    assert rep and not rep["ok"], rep
    rep = ask(port, b"still here?\n")
    assert rep and not rep["ok"], f"the bootstrap stopped answering after a deeply nested message: {rep}"
    out.append("deep nesting")
    rep = ask(port, json.dumps({"op": "push", "req": "\u00e9" * 20000, "decode_rank": 0, "decode_tp": 1}).encode() + b"\n")
    assert rep and not rep["ok"] and len(rep["error"]) <= B._MAX_ERROR_CHARS, f"a {len(rep.get('error', ''))}-character error"
    out.append("long error capped")
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
    for i in range(B._MAX_PARKED + 20):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(json.dumps({"op": "push", "req": f"fake{i}", "decode_rank": 0, "decode_tp": 1, "grid": grid, "room": 1, "key": 1,
                              "addr": "127.0.0.1:1", "trace": "t"}).encode() + b"\n")
        conns.append(c)
    time.sleep(1.0)
    with p._cond:
        parked = p._parked_count()
    assert parked <= B._MAX_PARKED, f"{parked} parked"
    conns[0].settimeout(3)
    first = conns[0].recv(4096)
    assert first and b"dropped" in first, first
    for c in conns:
        c.close()
    out.append(f"{B._MAX_PARKED + 20} fake ids: {parked} parked, oldest answered")
    # releases of many unique ids: _gone stays bounded
    for i in range(B._GONE_MAX + 200):
        with p._cond:
            p._note_gone(f"g{i}", "test")
    assert len(p._gone) <= B._GONE_MAX, len(p._gone)
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
    d._start_recv(M._Recv("d-s4", [999], 0, 50, f"127.0.0.1:{port}", "s4", 1, 32))
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
                raise kvstage.TimeError("a same-host writer still holds the pages") if hasattr(kvstage, "TimeError") else RuntimeError("held")

    d.take_failed_blocks()  # earlier checks' failures
    for ok in (True, False):
        Room.calls = 0
        r = M._Recv(f"rel-{ok}", [9, 10], 0, 40, "127.0.0.1:1", "x", 1, 32)
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
        recv = M._Recv("m", [1], 0, 20, f"127.0.0.1:{port}", "mq", 2, 32)
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


def repack_in_windows(tmp):
    """S2: between block sizes the prefill repacks a request chunk by chunk, only the blocks each
    chunk reads: a request of more blocks than repack_blocks moves (was refused whole), and
    behind a decode prefix hit only the suffix's blocks are copied."""
    port = free_ports(1)
    p = worker("kv_producer", extra={"bootstrap_port": port, "repack_blocks": 2}, seed=5)
    d = worker("kv_consumer", block_size=64, extra={"stats_file": os.path.join(tmp, "s2.jsonl"), "chunk_tokens": 64})
    copied = []
    out = p._repacker.out
    p._repacker.out = lambda blocks, slots: (copied.append(list(blocks)), out(blocks, slots))[1]
    try:
        row = real_push(p, d, port, "s2", ntokens=250)  # 8 prefill blocks, repack_blocks 2
        whole = sorted(b for c in copied for b in c)
        assert whole == list(range(1, 9)) and max(map(len, copied)) <= 2, f"repacked {copied}"
        # The decode holds the first 128 tokens (2 of its blocks): 122 tokens move into 2 blocks.
        copied.clear()
        pb, db = list(range(1, 9)), [9, 10]
        p.start(send_meta("s2b", pb, 250))
        d._start_recv(M._Recv("d-s2b", db, 128, 250, f"127.0.0.1:{port}", "s2b", 1, 32))
        wait_finished(d, "recv", "d-s2b")
        last = json.loads(open(d.opts["stats_file"]).readlines()[-1])
        assert last["ok"], f"load {last}"
        assert sorted(b for c in copied for b in c) == list(range(5, 9)), f"behind a 128-token prefix the prefill repacked {copied}"
        assert torch.equal(canon(p, pb)[..., 128:250, :], canon(d, db)[..., :122, :]), "the suffix differs (token-major view)"
        return f"250 tokens in windows of {max(map(len, copied))} blocks ({row['bytes']} bytes); behind a 128-token prefix blocks {sorted(b for c in copied for b in c)} only"
    finally:
        p.shutdown()
        d.shutdown()


def fp8_cache(tmp):
    """S3: an fp8 kv_cache_dtype (vLLM's CPU backend: uint8 caches, bf16 model): the layout's
    element is the cache's byte, the probe reads the kernel's placement for fp8 (the model's dtype
    in, kv_cache_dtype named), and a push between different block sizes lands every byte."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    port = free_ports(1)
    fp8 = dict(kv_cache_dtype="fp8", dtype=torch.bfloat16)
    p = worker("kv_producer", extra={"bootstrap_port": port}, seed=11, **fp8)
    d = worker("kv_consumer", block_size=64, extra={"stats_file": os.path.join(tmp, "fp8.jsonl")}, **fp8)
    try:
        assert p.layout.dtype_bytes == 1 and d.layout.dtype_bytes == 1, (p.layout.dtype_bytes, d.layout.dtype_bytes)
        assert not isinstance(p.positions, str) and p.positions is not None, f"the probe failed for fp8: positions {p.positions!r}"
        # The probed placement is the kernel's: write known K/V (exact in e4m3) through it and
        # read them back through the positions.
        n, h = 32, 1
        g = torch.Generator().manual_seed(3)
        k = torch.randint(1, 9, (n, h, HEAD_DIM), generator=g).to(torch.bfloat16)
        v = torch.randint(1, 9, (n, h, HEAD_DIM), generator=g).to(torch.bfloat16)
        cache = torch.zeros(1, h, n, 2 * HEAD_DIM, dtype=torch.uint8)
        kc, vc = cache.view(1, h, 2 * n, HEAD_DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(n), _get_attn_isa(torch.bfloat16, n, HEAD_DIM, "fp8"), kv_cache_dtype="fp8")
        canon_bytes = cache.view(-1)[p.positions]
        want = torch.cat([k.reshape(-1), v.reshape(-1)]).float().to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(canon_bytes, want), "the probed placement does not match the kernel's fp8 writes"
        row = real_push(p, d, port, "fp8", ntokens=70, whole=False)
        want_bytes = 70 * 2 * 2 * HEAD_DIM * LAYERS  # tokens x heads x K+V x layers, one byte each
        assert row["bytes"] == want_bytes, f"{row['bytes']} bytes landed, {want_bytes} expected"
        return f"fp8: 1-byte elements, probe matches the kernel, 32->64 push landed {row['bytes']} bytes, equal"
    finally:
        p.shutdown()
        d.shutdown()


def read_reply(c, timeout=5.0):
    """The one JSON line the bootstrap answers on connection `c` (None: no answer in `timeout`)."""
    c.settimeout(timeout)
    buf = b""
    try:
        while not buf.endswith(b"\n"):
            part = c.recv(4096)
            if not part:
                break
            buf += part
    except socket.timeout:
        return None
    return json.loads(buf) if buf else None


def stale_push_refused(tmp):
    """S9: a push left over from a previous run of the decode (same request id and decode rank,
    another decode incarnation, started earlier) is refused naming both incarnations, not parked
    and later sent; a stale push arriving after the live one is refused at once; the live load
    completes."""
    port = free_ports(1)
    p = worker("kv_producer", extra={"bootstrap_port": port}, seed=9)
    d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "s9.jsonl")})
    conns = []
    try:
        def stale(req):
            c = socket.create_connection(("127.0.0.1", port))
            conns.append(c)
            c.sendall(json.dumps({"op": "push", "req": req, "decode_rank": 0, "decode_tp": 1, "grid": [1, 32, 1, 2, 32, 0], "room": 1,
                                  "key": 1, "addr": "127.0.0.1:1", "trace": "old", "incarnation": "oldrun", "started": d.started - 1000.0,
                                  "layout": d.layout_id, "block_size": 32}).encode() + b"\n")
            return c

        old = stale("s9")
        time.sleep(0.3)  # parked: the request is not held yet
        d._start_recv(M._Recv("d-s9", [3, 4], 0, 50, f"127.0.0.1:{port}", "s9", 1, 32))
        rep = read_reply(old)
        assert rep is not None and not rep["ok"], f"the stale push was not refused when the live one came: {rep}"
        for word in ("oldrun", d.incarnation):
            assert word in rep["error"], f"the refusal does not name {word}: {rep['error']}"
        p.start(send_meta("s9", [1, 2], 50))
        wait_finished(d, "recv", "d-s9")
        assert not d.take_failed_blocks(), "the live load failed"
        late = read_reply(stale("s9b"), timeout=0.3)  # another request: parked, no answer yet
        assert late is None, late
        # after the live push: a stale one for a request still held is refused at once
        d._start_recv(M._Recv("d-s9c", [5, 6], 0, 50, f"127.0.0.1:{port}", "s9c", 1, 32))
        time.sleep(0.3)
        rep2 = read_reply(stale("s9c"))
        assert rep2 is not None and not rep2["ok"] and "oldrun" in rep2["error"] and d.incarnation in rep2["error"], rep2
        p.start(send_meta("s9c", [1, 2], 50))
        wait_finished(d, "recv", "d-s9c")
        assert not d.take_failed_blocks(), "the second live load failed"
        return f"refused: {rep['error'][-120:]}"
    finally:
        for c in conns:
            c.close()
        p.shutdown()
        d.shutdown()


def slow_decode_holds_no_other(tmp):
    """A decode whose kvstage engine takes the prefill's whole load_timeout_s to answer the
    connection (it accepts and never speaks) holds up only the pushes to it: a push to another
    decode, sent while that connection is pending, is sent and lands before the slow one ends."""
    port = free_ports(1)
    p = worker("kv_producer", extra={"bootstrap_port": port}, seed=11)
    d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "slowdec.jsonl")})
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    hole.settimeout(10)
    held = []
    slow = None
    try:
        p.start(send_meta("slowA", [1, 2], 50))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(json.dumps({"op": "push", "req": "slowA", "decode_rank": 0, "decode_tp": 1, "grid": [1, 32, 1, 2, 32, 0], "room": 1,
                                 "key": 1, "addr": f"127.0.0.1:{hole.getsockname()[1]}", "trace": "slowA", "layout": d.layout_id,
                                 "block_size": 32}).encode() + b"\n")
        c, _ = hole.accept()  # the prefill is connecting to the slow decode now
        held.append(c)
        row = real_push(p, d, port, "fastB")
        early = read_reply(slow, timeout=0.05)
        assert early is None, f"the push to the slow decode ended before the other one landed: {early}"
        rep = read_reply(slow, timeout=float(p.opts["load_timeout_s"]) + 10)
        assert rep is not None and not rep["ok"] and "not reachable" in rep["error"], f"the slow decode's push: {rep}"
        return f"{row['bytes']} bytes landed while the slow decode's connection was pending; it then failed: {rep['error'][-90:]}"
    finally:
        for c in held + ([slow] if slow else []):
            c.close()
        hole.close()
        p.shutdown()
        d.shutdown()


def proxy_refuses_n(tmp):
    """S7: ``n`` > 1 through the proxy is refused with a 400 naming it, before any engine is asked
    (the upstream URLs here answer nothing); n = 1 goes on to the prefill, which is not reachable:
    502 naming it."""
    import asyncio

    from aiohttp import ClientSession, web

    from kvstage.vllm.proxy import make_app

    async def run():
        dead = f"http://127.0.0.1:{free_ports(1)}"
        runner = web.AppRunner(make_app([dead], [dead], timeout_s=5))
        await runner.setup()
        port = free_ports(1)
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "n": 2}) as r:
                    two = (r.status, await r.json())
                try:
                    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "n": 1}) as r:
                        one = r.status
                except Exception as e:  # noqa: BLE001 - the proxy may drop the connection to a dead upstream
                    one = type(e).__name__
        finally:
            await runner.cleanup()
        return two, one

    (status, body), one = asyncio.run(run())
    assert status == 400 and "n is 2" in body.get("error", ""), f"n=2: {status} {body}"
    assert one == 502, f"n=1 with the prefill gone: {one}, expected 502"
    return f"n=2: 400 {body['error']}; n=1: {one}"


def threads(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def flood_bounded(tmp):
    """S10: a flood of bootstrap connections (peers that connect and send nothing) holds no
    thread each and does not hold up a real push sent while they are all still connected; a
    flood of loads (against a prefill that does not answer yet) uses at most the bounded load
    threads; every load still ends (failed), and a real push works afterwards."""
    silent, loaders = 96, getattr(D, "_LOAD_THREADS", 64)
    port = free_ports(1)
    p = worker("kv_producer", extra={"bootstrap_port": port}, seed=13)
    d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "s10.jsonl")})
    conns = []
    hung = socket.socket()
    try:
        time.sleep(0.6)  # readers of earlier checks' workers end within 0.5 s of their shutdown
        before = len(threads("kvstage-bootstrap"))
        for _ in range(silent):
            conns.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.5)
        peak_p = len(threads("kvstage-bootstrap")) - before
        assert peak_p <= 0, f"{silent} silent bootstrap peers: {peak_p} more bootstrap threads"
        during = real_push(p, d, port, "amid-flood")
        for c in conns:
            c.setblocking(False)
            try:
                assert c.recv(1) != b"", "a silent peer was closed before its message deadline"
            except BlockingIOError:
                pass
        for c in conns:
            c.close()
        # loads against a "prefill" that accepts and never answers (until it closes)
        hung.bind(("127.0.0.1", 0))
        hung.listen(1024)
        hport = hung.getsockname()[1]
        n = loaders + 40
        for i in range(n):
            d._start_recv(M._Recv(f"fl{i}", [1 + i % (BLOCKS - 1)], 0, 10, f"127.0.0.1:{hport}", f"x{i}", 1, 32))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(threads("kvstage-recv")) < min(n, loaders):
            time.sleep(0.05)
        time.sleep(0.3)
        peak_d = len(threads("kvstage-recv"))
        assert 0 < peak_d <= loaders, f"{n} loads at once: {peak_d} load threads (bound {loaders})"
        hung.close()
        want, done = {f"fl{i}" for i in range(n)}, set()
        deadline = time.monotonic() + 30
        while not want <= done and time.monotonic() < deadline:
            done |= d.take_finished(True)[1]
            time.sleep(0.02)
        assert want <= done, f"{len(want - done)} of {n} loads never ended"
        d.take_failed_blocks()
        assert d._receiving == 0, f"{d._receiving} loads still counted"
        row = real_push(p, d, port, "after-flood")
        return f"{silent} silent peers: {peak_p} more threads, a push amid them landed {during['bytes']} bytes; {n} loads: {peak_d} load threads, all ended; then {row['bytes']} bytes"
    finally:
        hung.close()
        for c in conns:
            c.close()
        p.shutdown()
        d.shutdown()


def authenticated_bootstrap(tmp):
    """S8: with cluster_token set, the prefill's bootstrap refuses a message without a MAC, with
    one made with another token, or altered after it was made; the decode's own pushes (signed)
    load."""
    import hashlib
    import hmac

    port = free_ports(1)
    tok = {"cluster_token": "s8-secret"}
    p = worker("kv_producer", extra={"bootstrap_port": port, **tok}, seed=17)
    d = worker("kv_consumer", extra={"stats_file": os.path.join(tmp, "s8.jsonl"), **tok})
    try:
        msg = {"op": "push", "req": "s8-fake", "decode_rank": 0, "decode_tp": 1, "grid": [1, 32, 1, 2, 32, 0], "room": 1, "key": 1,
               "addr": "127.0.0.1:1", "trace": "t"}

        def mac(m, key):
            return hmac.new(key.encode(), json.dumps(m, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()

        out = []
        for name, m in (("no MAC", msg), ("another token's MAC", dict(msg, mac=mac(msg, "other"))),
                        ("altered after its MAC", dict(msg, mac=mac(msg, "s8-secret"), room=2))):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(json.dumps(m).encode() + b"\n")
                rep = read_reply(c, timeout=3)
            assert rep is not None and not rep["ok"] and "authenticat" in rep["error"], f"{name}: {rep}"
            out.append(name)
        with p._cond:
            assert "s8-fake" not in p._parked, "an unauthenticated push was parked"
        row = real_push(p, d, port, "s8")
        return f"refused {', '.join(out)}; the decode's signed push loaded {row['bytes']} bytes"
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
    check("fp8_kv_cache_dtype", fp8_cache, tmp)
    check("repack_in_windows", repack_in_windows, tmp)
    check("stale_push_refused", stale_push_refused, tmp)
    check("flood_uses_bounded_threads", flood_bounded, tmp)
    check("slow_decode_holds_no_other", slow_decode_holds_no_other, tmp)
    check("proxy_refuses_n_above_1", proxy_refuses_n, tmp)
    check("bootstrap_authenticated_with_cluster_token", authenticated_bootstrap, tmp)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
