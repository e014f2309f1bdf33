#!/usr/bin/env bash
# scripts/engine-tests.sh NAME...   (NAME: vllm, sglang)
#
# Runs kvstage inside real serving engines. For each NAME:
#   1. a venv at ${KVSTAGE_ENGINE_VENVS:-$HOME/.cache/kvstage/engines}/NAME, made by
#      tests/engines/NAME/install.sh VENV when it is missing or when its stamp file
#      VENV/.kvstage-stamp differs from the hash of that install.sh (so later runs reuse it);
#   2. tests/engines/NAME/run.sh VENV, which prints a final line "N passed, M failed" and exits
#      non-zero on any failure.
# A registry download that fails during install.sh (its exit status 75, its last stderr line
# "skip: <pip's error>") is reported as "NAME: skipped: <pip's error>" and does not fail the run;
# any other failure does.
#
# The library under test: $KVSTAGE_LIBRARY, default target/release/libkvstage.so of this
# checkout, with this checkout's python/. KVSTAGE_ENGINE_WHEEL=/path/kvstage-*.whl tests a wheel
# instead: it is installed into each venv (--no-deps --force-reinstall), run.sh runs with
# KVSTAGE_ENGINE_USE_WHEEL=1 (no KVSTAGE_LIBRARY, no PYTHONPATH: the wheel's own library), and it
# is uninstalled again afterwards, so the cached venv stays as install.sh made it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VENVS=${KVSTAGE_ENGINE_VENVS:-$HOME/.cache/kvstage/engines}
(($#)) || { echo "usage: scripts/engine-tests.sh NAME... (vllm, sglang)" >&2; exit 2; }

wheel=${KVSTAGE_ENGINE_WHEEL:-}
if [[ -n $wheel ]]; then
  [[ -f $wheel ]] || { echo "engine-tests: KVSTAGE_ENGINE_WHEEL=$wheel: no such file" >&2; exit 1; }
  wheel=$(realpath "$wheel")
  unset KVSTAGE_LIBRARY
  export KVSTAGE_ENGINE_USE_WHEEL=1
else
  unset KVSTAGE_ENGINE_USE_WHEEL
  lib=${KVSTAGE_LIBRARY:-$ROOT/target/release/libkvstage.so}
  [[ -e $lib ]] || { echo "engine-tests: no library at $lib (build it, or set KVSTAGE_LIBRARY)" >&2; exit 1; }
  export KVSTAGE_LIBRARY=$(realpath "$lib")
fi

status=0
for name in "$@"; do
  dir=$ROOT/tests/engines/$name
  [[ -x $dir/install.sh && -x $dir/run.sh ]] || { echo "$name: no tests/engines/$name/{install,run}.sh" >&2; status=1; continue; }
  venv=$VENVS/$name
  stamp=$(sha256sum "$dir/install.sh" | cut -d' ' -f1)
  if [[ ! -f $venv/.kvstage-stamp || $(cat "$venv/.kvstage-stamp") != "$stamp" ]]; then
    echo "== $name: installing into $venv"
    errlog=$(mktemp)
    t0=$SECONDS
    bash "$dir/install.sh" "$venv" 2> >(tee "$errlog" >&2)
    rc=$?
    wait # the tee
    if ((rc == 75)); then
      why=$(grep '^skip: ' "$errlog" | tail -n 1)
      echo "$name: skipped: ${why#skip: }"
      rm -f "$errlog"
      continue
    elif ((rc != 0)); then
      echo "$name: install.sh failed (status $rc)" >&2
      rm -f "$errlog"
      status=1
      continue
    fi
    rm -f "$errlog"
    echo "$stamp" >"$venv/.kvstage-stamp"
    echo "== $name: installed in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1)"
  else
    echo "== $name: reusing $venv"
  fi
  if [[ -n $wheel ]]; then
    echo "== $name: installing $(basename "$wheel") into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel" || { echo "$name: installing the wheel failed" >&2; status=1; continue; }
  fi
  echo "== $name: tests/engines/$name/run.sh"
  t0=$SECONDS
  if bash "$dir/run.sh" "$venv"; then
    echo "== $name: ok in $((SECONDS - t0)) s"
  else
    echo "== $name: FAILED after $((SECONDS - t0)) s" >&2
    status=1
  fi
  if [[ -n $wheel ]]; then
    "$venv/bin/python" -m pip uninstall -q -y kvstage || status=1
  fi
done
exit $status
