#!/usr/bin/env bash
# ctest cuda_gpu_runner_dryrun: the GPU runner's script, right the first time. Bundles the build
# (scripts/gpu-bundle.sh) and runs scripts/gpu-runner.sh twice on this GPU-less machine:
#   1. as is: every GPU step must skip cleanly and the script exit 0;
#   2. with the fake libcuda (ctests/fake_libcuda.cpp: host memory, emulated kernels) on
#      LD_LIBRARY_PATH and KVSTAGE_REQUIRE_GPU=1: every step must run and pass (a tiny benchmark;
#      the client check with numpy host pools, as torch is absent here; skipped without numpy).
# Usage: gpu-runner-dryrun.sh <build dir> <fake libcuda dir>
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=$1 fake=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
scripts/gpu-bundle.sh "$build" "$work/bundle" >/dev/null
echo "== dry run 1: no GPU"
OUT=$work/out1 scripts/gpu-runner.sh "$work/bundle" >/dev/null 2>&1 || { cat "$work/out1/gpu-runner.log"; exit 1; }
tail -n1 "$work/out1/gpu-runner.log"
grep -q ' 0 failed' "$work/out1/gpu-runner.log"
echo "== dry run 2: fake libcuda"
# As on the runner, the build tree's library must not be reachable (the test programs' RUNPATH
# names it): as root, hide it in a mount namespace of its own.
hide=()
if [[ $(id -u) == 0 ]] && unshare -m true 2>/dev/null; then
    hide=(unshare -m bash -c 'mount -t tmpfs none "$0" && exec "$@"' "$(cd "$build/lib" && pwd)")
else
    echo "not root: the build tree's library stays reachable in this dry run"
fi
# The kernel check runs every case in the emulator: minutes on a busy 2-core machine.
if ! OUT=$work/out2 LD_LIBRARY_PATH=$fake KVSTAGE_REQUIRE_GPU=1 KVSTAGE_BENCH_ARGS="--tokens 64 --iters 1" KVSTAGE_GPU_TEST_TIMEOUT_S=600 \
    KVSTAGE_TORCH_CHECK_BACKEND=numpy "${hide[@]}" scripts/gpu-runner.sh "$work/bundle" >/dev/null 2>&1; then
    cat "$work/out2/gpu-runner.log"
    exit 1
fi
tail -n1 "$work/out2/gpu-runner.log"
grep -q ', 0 failed,' "$work/out2/gpu-runner.log" || { cat "$work/out2/gpu-runner.log"; exit 1; }
[[ -s $work/out2/bench.json && -s $work/out2/doctor.txt ]]
# The doctor says whether a NIC can reach the GPU's memory (the fake can: dma-buf and GPUDirect).
# As an H200 (driver 580) reported: writes ordering owner.
grep -q 'dma-buf export: yes, GPUDirect RDMA: yes, RDMA writes ordering: owner (100)' "$work/out2/doctor.txt" || { cat "$work/out2/doctor.txt"; exit 1; }
echo "gpu-runner dry runs: ok"
