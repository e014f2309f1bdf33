"""Side by side: KvstageConnector, vLLM's NixlConnector and MooncakeConnector, same vLLM, same
model, same prompts, one run. A benchmark, not a test: it prints a table (and JSON to --out).

    python bench_connectors.py MODEL_DIR WORK_DIR [--connectors kvstage,nixl,mooncake]
                               [--tokens 512] [--concurrency 1,8] [--reps 3]

For each connector a prefill and a decode engine (offline LLM, one process each; one pair at a
time) on one host. Per batch of C concurrent requests (C = 1: per request):

- ``first_token_s``: from the prefill's end (its generate() returned) to the decode's first token
  (the decode's generate() of 1 token returned, with the KV moved by the connector);
- the transfer's own time as each connector reports it: kvstage's per-request load time (its
  ``stats_file``: from the decode's bootstrap message to the room complete, the prefill's
  sending included); NIXL's and Mooncake's "Avg xfer time (ms)" (their KV transfer metrics in
  vLLM's stats log, ``VLLM_LOG_STATS_INTERVAL`` 1 s, weighted by their transfer counts, over the
  whole run);
- ``cpu_s``: CPU seconds of both engines' process trees (user + system) from the prefill's end to
  the decode's first token;
- ``equal``: the decode's token equals the same engine's local run.

Needs nixl and nixl-cu13 (``--no-deps``) and mooncake-transfer-engine-non-cuda in the venv for
those two; a connector that cannot start is reported with its error.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_vllm import Engine  # noqa: E402


def tree_cpu(pid):
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def configs(name, work):
    """(prefill ktc, decode ktc, prefill env, decode env, prefill params fn, decode params fn)."""
    if name == "kvstage":
        stats = os.path.join(work, "bench-kvstage-decode.stats.jsonl")  # what Engine.stat_rows reads
        base = {"kv_connector": "KvstageConnector", "kv_connector_module_path": "kvstage.vllm"}
        extra = {"host": "127.0.0.1", "bootstrap_port": 17700, "staging_bytes": 512 << 20, "stats_file": stats}
        pre = dict(base, kv_role="kv_producer", kv_connector_extra_config=extra)
        dec = dict(base, kv_role="kv_consumer", kv_connector_extra_config=extra)
        return pre, dec, {}, {}, lambda: {"do_remote_decode": True}, lambda got, sent: got
    if name == "nixl":
        ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        first = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None}
        env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (
            ktc, ktc, dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT="17710"), dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT="17711"),
            lambda: dict(first), lambda got, sent: got,
        )
    if name == "mooncake":
        extra = {"mooncake_protocol": "tcp"}
        pre = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "bench-prefill", "kv_connector_extra_config": extra}
        dec = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "engine_id": "bench-decode", "kv_connector_extra_config": extra}
        env = {"VLLM_HOST_IP": "127.0.0.1"}

        def first():
            return {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex}

        def second(got, sent):
            return {"do_remote_prefill": True, "transfer_id": sent["transfer_id"], "remote_engine_id": "bench-prefill", "remote_bootstrap_addr": "127.0.0.1:17720"}

        return pre, dec, dict(env, VLLM_MOONCAKE_BOOTSTRAP_PORT="17720"), dict(env, VLLM_MOONCAKE_BOOTSTRAP_PORT="17721"), first, second
    raise SystemExit(f"unknown connector {name}")


def run_connector(name, a, seed0):
    pre_ktc, dec_ktc, pre_env, dec_env, first, second = configs(name, a.work)
    kv = a.kv_mb << 20
    pre_env = dict(pre_env, VLLM_LOG_STATS_INTERVAL="1")
    dec_env = dict(dec_env, VLLM_LOG_STATS_INTERVAL="1")
    p = Engine(f"bench-{name}-prefill", a.work, a.model, 32, env=pre_env, ktc=pre_ktc, kv_bytes=kv, log_stats=True)
    d = Engine(f"bench-{name}-decode", a.work, a.model, 32, env=dec_env, ktc=dec_ktc, kv_bytes=kv, log_stats=True)
    rows = []
    try:
        p.wait_ready(600)
        d.wait_ready(600)
        # warm-up: one request through the pair
        rng = random.Random(seed0)
        warm = [[rng.randrange(3, 1024) for _ in range(a.tokens)]]
        sent = [first()]
        got = p.generate(warm, 1, sent)
        d.generate(warm, 1, [second(o["kv_transfer_params"], s) for o, s in zip(got, sent)], timeout=600)
        for conc in a.concurrency:
            for rep in range(a.reps if conc == 1 else max(1, a.reps // 2)):
                rng = random.Random(seed0 * 1000 + conc * 10 + rep)
                prompts = [[rng.randrange(3, 1024) for _ in range(a.tokens)] for _ in range(conc)]
                local = p.generate(prompts, 1)  # the same engine, no disaggregation (and caches them on P)
                sent = [first() for _ in prompts]
                before_stats = len(d.stat_rows())
                got = p.generate(prompts, 1, sent)
                t0 = time.perf_counter()
                c0 = tree_cpu(p.proc.pid) + tree_cpu(d.proc.pid)
                out = d.generate(prompts, 1, [second(o["kv_transfer_params"], s) for o, s in zip(got, sent)], timeout=600)
                t1 = time.perf_counter()
                c1 = tree_cpu(p.proc.pid) + tree_cpu(d.proc.pid)
                kst = [x["ms"] for x in d.stat_rows()[before_stats:] if x.get("ok")] if name == "kvstage" else []
                rows.append({
                    "connector": name, "concurrency": conc, "rep": rep,
                    "first_token_s": t1 - t0,
                    "cpu_s": c1 - c0, "equal": all(o["tokens"] == l["tokens"] for o, l in zip(out, local)),
                    "errors": [o["finish_reason"] for o in out if o["finish_reason"] not in ("length", "stop")],
                    "kvstage_load_ms": kst,
                })
                r = rows[-1]
                print(f"# {name} c={conc} rep {rep}: first token {r['first_token_s']*1000:.0f} ms, cpu {r['cpu_s']:.2f} s, equal {r['equal']} {r['errors'] or ''}"
                      + (f", kvstage loads {[round(x) for x in kst]} ms" if kst else ""), flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the table
        rows.append({"connector": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"# {name}: {rows[-1]['error']}", flush=True)
    finally:
        p.stop()
        d.stop()
    xfer = own_xfer_ms([p.log_path, d.log_path])
    for r in rows:
        r["own_xfer_ms_run_avg"] = xfer
    return rows


def own_xfer_ms(logs):
    """NIXL's and Mooncake's own transfer time: their "KV Transfer metrics" lines, weighted."""
    import re

    n_sum, t_sum = 0, 0.0
    for path in logs:
        for line in open(path, errors="replace"):
            if "KV Transfer metrics" not in line:
                continue
            n = re.search(r"Num successful transfers=(\d+)", line)
            t = re.search(r"Avg xfer time \(ms\)=([0-9.]+)", line)
            if n and t and int(n.group(1)):
                n_sum += int(n.group(1))
                t_sum += int(n.group(1)) * float(t.group(1))
    return round(t_sum / n_sum, 1) if n_sum else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("work")
    ap.add_argument("--connectors", default="kvstage,nixl,mooncake")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-mb", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    os.makedirs(a.work, exist_ok=True)
    with open(os.path.join(a.model, "config.json")) as f:
        mc = json.load(f)
    per_token = mc["num_hidden_layers"] * mc["num_key_value_heads"] * 2 * mc["head_dim"] * 4
    print(f"# model {a.model}: {mc['num_hidden_layers']} layers, {mc['num_key_value_heads']} KV heads of {mc['head_dim']}, float32: "
          f"{per_token} B of KV per token, {per_token * a.tokens / 2**20:.1f} MiB per {a.tokens}-token request", flush=True)
    rows = []
    for i, name in enumerate(a.connectors.split(",")):
        rows += run_connector(name, a, i + 1)
    print()
    print("| connector | concurrency | prefill end -> decode first token (ms, median) | the transfer's own time (ms) | CPU s (both engines) | equal tokens |")
    print("|---|---|---|---|---|---|")
    for name in a.connectors.split(","):
        mine = [r for r in rows if r["connector"] == name]
        if any("error" in r for r in mine):
            print(f"| {name} | - | did not run: {next(r['error'] for r in mine if 'error' in r)} | | | |")
            continue
        for conc in a.concurrency:
            rs = [r for r in mine if r["concurrency"] == conc]
            if not rs:
                continue
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
            kms = [x for r in rs for x in r["kvstage_load_ms"]]
            own = f"{statistics.median(kms):.0f} (median of {len(kms)} loads)" if kms else f"{rs[0]['own_xfer_ms_run_avg']} (its average over the run)"
            print(f"| {name} | {conc} | {med('first_token_s')*1000:.0f} | {own} | {med('cpu_s'):.2f} | {all(r['equal'] for r in rs)} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
