#!/usr/bin/env bash
# README's main job: installs what the build lacks (scripts/prereqs.sh build), then runs the staged
# transfer demo. Arguments go to kvstage-demo (`scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/prereqs.sh build
if ! command -v cargo >/dev/null && [[ -f $HOME/.cargo/env ]]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
exec cargo run --release --locked --bin kvstage-demo -- "$@"
