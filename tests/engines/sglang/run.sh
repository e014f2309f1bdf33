#!/usr/bin/env bash
# kvstage as sglang's transfer backend, driven by sglang's own classes (see test_backend.py).
#
#   tests/engines/sglang/run.sh VENV [SCENARIO...]
#
# VENV: what install.sh built. Library under test: $KVSTAGE_LIBRARY (default: the repo's
# target/release/libkvstage.so) with the checkout's python/ ($KVSTAGE_PYTHON_DIR overrides it);
# with KVSTAGE_ENGINE_USE_WHEEL=1, the kvstage wheel installed in VENV (its own library, its own
# entry point). Prints "N passed, M failed" last; non-zero on any failure.
set -uo pipefail
VENV=${1:?usage: run.sh VENV [SCENARIO...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
EP_DIR=$(mktemp -d)
trap 'rm -rf "$EP_DIR"' EXIT
if [ "${KVSTAGE_ENGINE_USE_WHEEL:-0}" = 1 ]; then
  unset KVSTAGE_LIBRARY
  # The wheel alone: its package, its library and the entry point its metadata declares
  # (python/pyproject.toml's [project.entry-points."sglang.srt.plugins"]), which sglang's
  # load_plugins() must find by itself. Nothing from the checkout is put on the path.
  if ! (cd / && "$VENV/bin/python" - <<'PY')
import sys
from importlib.metadata import distribution, entry_points
try:
    import kvstage
except ImportError as e:
    sys.exit(f"sglang: no kvstage wheel in this venv ({e})")
eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvstage"]
if not eps or eps[0].value != "kvstage.sglang.plugin:register" or eps[0].dist is None or eps[0].dist.name != "kvstage":
    sys.exit(f"sglang: the installed kvstage wheel declares no sglang.srt.plugins entry point kvstage ({eps})")
if "site-packages" not in kvstage.__file__:
    sys.exit(f"sglang: kvstage imports from {kvstage.__file__}, not the installed wheel")
print(f"sglang: kvstage {distribution('kvstage').version} from {kvstage.__file__}, entry point from its wheel")
PY
  then
    echo "0 passed, 1 failed"
    exit 1
  fi
else
  export KVSTAGE_LIBRARY=${KVSTAGE_LIBRARY:-$ROOT/target/release/libkvstage.so}
  if [ ! -e "$KVSTAGE_LIBRARY" ]; then
    echo "sglang: no kvstage library at $KVSTAGE_LIBRARY (build it, or set KVSTAGE_LIBRARY)"
    echo "0 passed, 1 failed"
    exit 1
  fi
  # The package under test is the checkout's, not installed: declare its sglang.srt.plugins
  # entry point as python/pyproject.toml does (what a wheel carries), in a throwaway dist-info
  # on the path, so that sglang's load_plugins() finds it by itself; skipped when the venv
  # already has a distribution declaring it. (A wheel run adds none: see above.)
  if ! "$VENV/bin/python" - <<'PY' 2>/dev/null
import sys
from importlib.metadata import entry_points
sys.exit(0 if any(ep.name == "kvstage" for ep in entry_points(group="sglang.srt.plugins")) else 1)
PY
  then
    mkdir -p "$EP_DIR/kvstage_sglang_plugin-0.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: kvstage-sglang-plugin\nVersion: 0.0\n' > "$EP_DIR/kvstage_sglang_plugin-0.0.dist-info/METADATA"
    printf '[sglang.srt.plugins]\nkvstage = kvstage.sglang.plugin:register\n' > "$EP_DIR/kvstage_sglang_plugin-0.0.dist-info/entry_points.txt"
  fi
  export PYTHONPATH="${KVSTAGE_PYTHON_DIR:-$ROOT/python}:$EP_DIR${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONWARNINGS=ignore
export KVSTAGE_LOG=${KVSTAGE_LOG:-warn}
export SGLANG_LOGGING_LEVEL=${SGLANG_LOGGING_LEVEL:-WARNING}
timeout -k 10 ${KVSTAGE_SGLANG_TEST_TIMEOUT_S:-900} "$VENV/bin/python" "$HERE/test_backend.py" "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "sglang: test run exceeded ${KVSTAGE_SGLANG_TEST_TIMEOUT_S:-900}s"
  echo "0 passed, 1 failed"
  exit 1
fi
exit $rc
