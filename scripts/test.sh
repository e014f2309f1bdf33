#!/usr/bin/env bash
# README's test command: installs what the tests lack (scripts/prereqs.sh test), then configures
# build/dev, builds the library with its test-only exports and every C/C++ test, and runs all of
# them (cmake --workflow --preset dev).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/prereqs.sh test
if ! command -v cargo >/dev/null && [[ -f $HOME/.cargo/env ]]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
exec cmake --workflow --preset dev
