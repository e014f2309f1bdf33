#!/usr/bin/env bash
# ctest bench_json: runs kvstage-bench on a tiny geometry with --json and checks that the report
# parses, has every section with positive figures, and says the decode bytes were verified.
# No timing is asserted. Usage: check_bench.sh <kvstage-bench>
set -euo pipefail
bench=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$bench" --layers 2 --kv-heads 4 --head-dim 16 --dtype-bytes 2 --prefill-tp 2 --decode-tp 1 \
  --page-size 4 --tokens 64 --chunk-tokens 32 --reps 2 --warmup 1 --slice-seconds 0.2 \
  --json "$out/bench.json"
python3 - "$out/bench.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for name in ("staged", "slice", "raw_tcp", "memcpy", "gather", "scatter"):
    section = report[name]
    for key in ("bytes", "seconds_median", "seconds_p99", "gbps"):
        assert section[key] > 0, f"{name}.{key} = {section[key]!r} is not positive"
for key in ("staged_over_raw_tcp", "staged_over_slice", "gather_over_memcpy"):
    assert report["ratios"][key] > 0, f"ratios.{key} is not positive"
assert report["verified"] is True, "decode bytes were not verified"
assert report["params"]["prefill_tp"] == 2 and report["params"]["decode_tp"] == 1
print("bench_json: all sections present and positive, verified")
PY
