#!/usr/bin/env bash
# Build the venv that tests/engines/sglang/run.sh runs in: sglang from the
# registry WITHOUT its GPU-only dependencies (flashinfer, sgl-kernel, deep-ep,
# cutlass, ...), plus the pure-Python packages its disaggregation modules
# import, plus torch from the registry (CPU use only: the tests never touch a GPU).
#
#   tests/engines/sglang/install.sh VENV
#
# Exit codes: 0 ok; 75 the registry could not be reached (the last stderr line is
# "skip: <pip's error>", which scripts/engine-tests.sh reports as "sglang: skipped: ...");
# anything else a failure (a pinned version the reachable index does not have included). On success VENV/.kvstage-stamp holds the sha256 of this file.
set -euo pipefail
VENV=${1:?usage: install.sh VENV}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
STAMP=$(sha256sum "$HERE/install.sh" | cut -d' ' -f1)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

# Only a registry that could not be reached is a skip: pip's retries name a connection, proxy,
# TLS, DNS or HTTP error. "No matching distribution" alone means the index answered without the
# pinned version: a failure (it also follows those retries when the index is unreachable, which
# the retry lines tell apart).
NETWORK_ERRORS="ConnectionError|NewConnectionError|Max retries exceeded|ReadTimeout|ConnectTimeout|timed out|HTTPError|ProxyError|SSLError|Network is unreachable|Temporary failure in name resolution|Name or service not known|Failed to establish|Connection refused|Connection reset|RemoteDisconnected"
pip_install() {
  if ! nice -n 10 "$VENV/bin/pip" install --disable-pip-version-check -q "$@" >"$LOG" 2>&1; then
    cat "$LOG" >&2
    if grep -qiE "$NETWORK_ERRORS" "$LOG"; then
      echo "skip: $(grep -iE "^ERROR" "$LOG" | tail -1 | sed 's/^ERROR: //')" >&2
      exit 75
    fi
    exit 1
  fi
}

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# torch first, with its own dependencies (the registry's Linux wheel needs the
# nvidia-* runtime wheels just to import, even on a machine with no GPU).
pip_install "torch==2.14.1" "torchvision==0.29.2"
# sglang itself, none of its dependencies.
pip_install --no-deps "sglang==${SGLANG_VERSION}"
# What sglang.srt.disaggregation.{base,common,prefill,decode,utils,mooncake}
# import at module level, pinned where sglang pins them.
pip_install numpy pyzmq requests aiohttp msgspec prometheus-client psutil \
  pydantic fastapi uvicorn orjson setproctitle pybase64 packaging pillow tqdm \
  IPython dill einops gguf partial_json_parser \
  "transformers==5.19.0" "compressed-tensors==0.18.0" "openai==2.8.0" \
  "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11"
# Prove the venv does what run.sh needs before stamping it.
timeout 300 "$VENV/bin/python" -W ignore -c '
import sglang.srt.disaggregation.base, sglang.srt.disaggregation.common
import sglang.srt.disaggregation.utils, sglang.srt.disaggregation.prefill
import sglang.srt.disaggregation.decode, sglang.srt.disaggregation.common.conn
import sglang.srt.plugins, torch, numpy
print("sglang", __import__("sglang").__version__, "torch", torch.__version__)
'
echo "$STAMP" > "$VENV/.kvstage-stamp"
echo "sglang venv ready in $(( $(date +%s) - start ))s, $(du -sh "$VENV" | cut -f1) at $VENV"
