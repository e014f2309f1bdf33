#!/usr/bin/env bash
# tests/engines/vllm/run.sh VENV: kvstage's vLLM connector in a real vLLM (the venv that
# install.sh made), end to end: test_vllm.py's checks, a final line "N passed, M failed".
#
# The library: $KVSTAGE_LIBRARY and this checkout's python/ (scripts/engine-tests.sh sets the
# former), or with KVSTAGE_ENGINE_USE_WHEEL=1 the kvstage installed in the venv (a wheel that
# carries libkvstage.so). Bounded: the whole run ends within KVSTAGE_VLLM_TIMEOUT_S (1200 s).
set -uo pipefail
VENV=${1:?usage: run.sh VENV}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PY=$VENV/bin/python
if [[ ${KVSTAGE_ENGINE_USE_WHEEL:-0} == 1 ]]; then
  unset KVSTAGE_LIBRARY PYTHONPATH
  # The wheel's own library, next to the package: no Rust, no KVSTAGE_LIBRARY on the target.
  where=$(cd / && "$PY" -c '
import os, kvstage, kvstage.vllm.connector
lib = kvstage.load_library()
pkg = os.path.dirname(kvstage.__file__)
assert os.path.dirname(os.path.realpath(lib.path)) == os.path.realpath(pkg), f"{lib.path} is not the wheel s library (package in {pkg})"
print(f"{pkg}, library {lib.path} {lib.version}")') || { echo "0 passed, 1 failed"; exit 1; }
  echo "# kvstage from the installed wheel: $where"
else
  export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
  echo "# kvstage from $ROOT/python, library ${KVSTAGE_LIBRARY:-?}"
fi
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

model=$VENV/kvstage-tiny-llama
nice -n 5 "$PY" "$HERE/make_tiny_llama.py" "$model" || { echo "0 passed, 1 failed"; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/kvstage-vllm.XXXXXX")
t0=$SECONDS
# Runs from / so that only the kvstage named above can be imported.
(cd / && timeout -k 10 "${KVSTAGE_VLLM_TIMEOUT_S:-1200}" "$PY" "$HERE/test_vllm.py" "$model" "$work") | tee "$work/summary.txt"
rc=${PIPESTATUS[0]}
last=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$work/summary.txt" | tail -n 1)
if [[ -z $last ]]; then
  echo "# test_vllm.py ended with status $rc and no summary (engine logs in $work)"
  echo "0 passed, 1 failed"
  exit 1
fi
echo "# $((SECONDS - t0)) s"
if ((rc != 0)); then
  echo "# engine logs in $work"
  echo "$last"  # the final line stays the summary
  exit 1
fi
rm -rf "$work"
echo "$last"
