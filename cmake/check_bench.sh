#!/usr/bin/env bash
# ctest bench_json: runs kvstage-bench on a tiny geometry with --json and checks that the report
# parses, has every section with positive figures, and says the decode bytes were verified (staged
# always; slice unless time-boxed, whose bytes are not checked); then
# the same at load (--inflight 4), a short inflight sweep and a transport sweep (tcp with each
# chunk written in pieces, shm through the ring, shm direct): the CPU per request adds up by process and thread group; the load fields (inflight, request
# latencies, raw TCP streams, the library's thread peak) are present and consistent; then the
# same-host path: --transport shm, and auto, must report every session (params.links, staged.link)
# on shm with the staged bytes verified, in direct mode unless --no-direct (staged.path, and chunks
# counted as direct exactly then); the default (tcp) reports tcp; then --layer-ms: both
# kinds' exposed times are present and positive and both kinds' decode bytes were verified; then
# --stuck-peer: the report holds the stuck request as both sides describe it (its operation still
# pending in a waiting phase, the stuck decode rank's room open with that chunk not done) and the
# prefill side logged the stall. No timing is asserted. Usage: check_bench.sh <kvstage-bench>
set -euo pipefail
bench=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tiny=(--layers 2 --kv-heads 4 --head-dim 16 --dtype-bytes 2 --prefill-tp 2 --decode-tp 1
  --page-size 4 --tokens 64 --chunk-tokens 32 --reps 2 --warmup 1 --slice-seconds 0.2)
"$bench" "${tiny[@]}" --json "$out/bench.json"
"$bench" "${tiny[@]}" --inflight 4 --json "$out/load.json"
"$bench" "${tiny[@]}" --sweep inflight --inflight 2 --json "$out/sweep.json" >/dev/null
# Every byte mover in one run, each chunk written in pieces of one slab where it is staged (tcp).
"$bench" "${tiny[@]}" --sweep transport --piece-bytes 1 --json "$out/transports.json" >/dev/null
# A slice run time-boxed to nothing (the last --slice-seconds wins): one page per chunk is sent.
"$bench" "${tiny[@]}" --slice-seconds 0 --json "$out/boxed.json" >/dev/null
# The same-host path, required and chosen by auto (both processes are on this host).
"$bench" "${tiny[@]}" --transport shm --json "$out/shm.json" >/dev/null
"$bench" "${tiny[@]}" --transport auto --inflight 2 --json "$out/auto.json" >/dev/null
# Layer-wise against whole-chunk sending behind a simulated prefill (1 ms per layer).
"$bench" "${tiny[@]}" --layer-ms 1 --json "$out/layers.json" >/dev/null
# A decode rank that stops reading (prefill TP 1 feeds decode ranks 0 and 1).
"$bench" --layers 2 --kv-heads 4 --head-dim 16 --dtype-bytes 2 --prefill-tp 1 --decode-tp 2 --page-size 4 \
  --tokens 64 --chunk-tokens 32 --stuck-peer --stuck-seconds 1 --inflight 1 --json "$out/stuck.json" >/dev/null 2>"$out/stuck.err"
grep -q "no progress for" "$out/stuck.err" || { echo "bench_json: --stuck-peer logged no stall report" >&2; exit 1; }
python3 - "$out/stuck.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
stuck = report["stuck_request"]
op, room = stuck["op"], stuck["decode_room"]
assert op["status"] == "KVSTAGE_PENDING" and op["phase"].startswith("waiting_for_") and op["waits_on"], op
assert op["room"] == room["room"] == stuck["room"] and op["session"].endswith("-d%d" % report["stuck_peer"]["stuck_decode_rank"]), stuck
assert room["state"] == "open" and room["chunks"][op["chunk"]]["phase"] != "done", room
print("bench_json: --stuck-peer describes the stuck request from both sides:", op["phase"], "/", room["chunks"][op["chunk"]]["phase"])
PY
python3 - "$out/bench.json" "$out/load.json" "$out/sweep.json" "$out/boxed.json" "$out/shm.json" "$out/auto.json" "$out/layers.json" "$out/transports.json" <<'PY'
import json, sys

def check_cpu(name, section):
    """CPU per request: both processes' totals add up to the section's figure, each process's
    thread groups to its total."""
    parts = section["cpu_s_per_request_parts"]
    total = parts["prefill"]["total"] + parts["decode"]["total"]
    assert abs(total - section["cpu_s_per_request"]) < 1e-9, f"{name}: process totals {total} != {section['cpu_s_per_request']}"
    for side in ("prefill", "decode"):
        p = parts[side]
        assert p["total"] >= 0 and abs(sum(p["threads"].values()) - p["total"]) < 1e-9, f"{name}.{side}: threads {p['threads']} != total {p['total']}"

def check(report, inflight, full=True):
    sections = ("staged", "slice", "raw_tcp", "raw_tcp_memory", "memcpy", "gather", "scatter") if full else ("staged", "raw_tcp", "raw_tcp_memory")
    for name in sections:
        section = report[name]
        for key in ("bytes", "seconds_median", "seconds_p99", "gbps", "latency_p50_s", "latency_p99_s"):
            assert section[key] > 0, f"{name}.{key} = {section[key]!r} is not positive"
        assert section["latency_p99_s"] >= section["latency_p50_s"], f"{name}: p99 below p50"
        expected = inflight if name == "staged" else 1
        assert section["inflight"] == expected, f"{name}.inflight = {section['inflight']!r}, expected {expected}"
    staged = report["staged"]
    assert staged["requests"] >= max(report["params"]["reps"], 2 * inflight), f"staged.requests = {staged['requests']}"
    assert staged["operations"] > 0 and staged["request_gbps"] > 0
    assert report["raw_tcp"]["streams"] == report["raw_tcp_memory"]["streams"] == report["params"]["sessions"] == 2, "raw TCP uses one stream per session"
    for name in ("staged", "raw_tcp", "raw_tcp_memory"):
        check_cpu(name, report[name])
    ratios = ("staged_over_raw_tcp", "staged_over_raw_tcp_memory", "staged_p99_over_p50") + (("staged_over_slice", "gather_over_memcpy") if full else ())
    for key in ratios:
        assert report["ratios"][key] > 0, f"ratios.{key} is not positive"
    threads = report["threads"]
    # Per prefill engine at least its transfer workers and its session reader.
    assert threads["max_kvstage"] >= 2 * (report["params"]["transfer_threads"] + 1), f"threads = {threads}"
    assert threads["max_total"] >= threads["max_kvstage"] and threads["samples"] > 0, f"threads = {threads}"
    assert report["params"]["inflight"] == inflight
    assert report["staged"]["verified"] is True, "staged: decode bytes were not verified"
    if full:
        slice_ = report["slice"]
        assert slice_["verified"] is (not slice_["time_boxed"]), \
            f"slice: verified {slice_['verified']!r} with time_boxed {slice_['time_boxed']!r}"
    assert "verified" not in report, "verified is per section"
    assert report["params"]["prefill_tp"] == 2 and report["params"]["decode_tp"] == 1
    # Which link the sessions ended up on: tcp unless asked otherwise (the baselines' links never change).
    link = {"tcp": "tcp", "shm": "shm", "auto": "shm"}[report["params"]["transport"]]
    assert report["params"]["links"] == [link] * report["params"]["sessions"], f"params.links = {report['params']['links']}"
    assert staged["link"] == link and staged["downgraded_sessions"] == 0, \
        f"staged: link {staged['link']!r}, {staged['downgraded_sessions']} downgraded ({staged.get('shm_downgrade')})"
    path = link if link == "tcp" else ("shm-direct" if report["params"]["direct"] else "shm-ring")
    assert staged["path"] == path and (staged["direct_chunks"] > 0) == (path == "shm-direct"), \
        f"staged: path {staged['path']!r} with {staged['direct_chunks']} direct chunks, expected {path}"
    if full:
        assert report["slice"]["link"] == "tcp", "slice writes go on the TCP control streams"
        assert report["ratios"]["staged_over_memcpy"] > 0, "ratios.staged_over_memcpy is not positive"

check(json.load(open(sys.argv[1])), 1)
check(json.load(open(sys.argv[2])), 4)
sweep = json.load(open(sys.argv[3]))
assert [p["params"]["inflight"] for p in sweep] == [1, 2], "the inflight sweep runs 1, 2"
for point in sweep:
    check(point, point["params"]["inflight"], full=False)
boxed = json.load(open(sys.argv[4]))
check(boxed, 1)
assert boxed["slice"]["time_boxed"] is True and boxed["slice"]["verified"] is False, boxed["slice"]
shm = json.load(open(sys.argv[5]))
assert shm["params"]["transport"] == "shm"
check(shm, 1)
auto = json.load(open(sys.argv[6]))
assert auto["params"]["transport"] == "auto"
check(auto, 2)
transports = json.load(open(sys.argv[8]))
assert [(p["params"]["transport"], p["staged"]["path"]) for p in transports] == [("tcp", "tcp"), ("shm", "shm-ring"), ("shm", "shm-direct")], \
    "the transport sweep runs tcp, shm through the ring, shm direct"
for point in transports:
    assert point["params"]["send_piece_bytes"] == 1
    check(point, 1, full=False)
layers = json.load(open(sys.argv[7]))
exposed = layers["exposed"]
assert layers["layers"] == 2 and layers["layer_ms"] == 1 and layers["reps"] == 2, layers
assert exposed["whole_s"] > 0 and exposed["layerwise_s"] > 0 and exposed["ratio"] > 0, exposed
assert len(exposed["whole_samples"]) == len(exposed["layerwise_samples"]) == 2, exposed
assert layers["verified_whole"] is True and layers["verified_layerwise"] is True, layers
print("bench_json: all sections present and positive, verified, CPU per process and thread adding up; at load (inflight 4),"
      " in an inflight sweep and a transport sweep (tcp in one-slab pieces, shm ring, shm direct) too;"
      " a time-boxed slice run says it was not verified; --transport shm and auto ran the staged section over shm, verified;"
      " --layer-ms reports both exposed times, both kinds verified")
PY
