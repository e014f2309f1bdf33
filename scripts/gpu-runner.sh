#!/usr/bin/env bash
# The one script for a GPU machine (no Rust there): runs the bundle made by scripts/gpu-bundle.sh
# and writes everything to $OUT (default ./gpu-out): gpu-runner.log, bench.json, doctor.txt.
#
#   scripts/gpu-runner.sh [BUNDLE_DIR]      (default build/gpu-bundle)
#
# Steps, each under a timeout: nvidia-smi; kvstage-cuda doctor; every `gpu` ctest of the bundle
# (kernels bit-exact vs the host engine, staged transfer between device pools, detection) plus the
# stub-libcuda test; the gather/scatter benchmark vs device memcpy (ratios); the PyTorch
# real-client check (P4->D2, P2->D4 through ctypes; a layer-wise transfer whose layers are produced
# on a slow stream); compute-sanitizer memcheck of the kernel check where the image has it
# (sanitizer.txt). With a GPU present KVSTAGE_REQUIRE_GPU=1, so a
# skip is a failure; without one everything skips and the script exits 0 (that is how it is
# tested on CPU machines). KVSTAGE_BENCH_ARGS overrides the benchmark's arguments (default
# "--iters 20"; a dry run against the fake libcuda uses "--tokens 64 --iters 1");
# KVSTAGE_GPU_TEST_TIMEOUT_S each ctest's limit (default 180 s; the dry run's emulated kernels are
# far slower than a GPU). Ends with 'N passed, N failed, N skipped'; exit 1 when anything failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bundle=$(cd "${1:-build/gpu-bundle}" 2>/dev/null && pwd) || { echo "gpu-runner: no bundle ${1:-build/gpu-bundle} (scripts/gpu-bundle.sh)" >&2; exit 1; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
log=$OUT/gpu-runner.log
: >"$log"
exec > >(tee -a "$log") 2>&1

started=$SECONDS
passed=0 failed=0 skipped=0
failures=()
note() { printf '\n==== [%4d s] %s\n' "$((SECONDS - started))" "$*"; }
result() { # $1 name, $2 exit code
    case $2 in
        0) passed=$((passed + 1)); echo "---- $1: PASSED" ;;
        77) skipped=$((skipped + 1)); echo "---- $1: SKIPPED" ;;
        124|137) failed=$((failed + 1)); failures+=("$1 (timeout)"); echo "---- $1: FAILED (timeout)" ;;
        *) failed=$((failed + 1)); failures+=("$1 (exit $2)"); echo "---- $1: FAILED (exit $2)" ;;
    esac
}

note "bundle $bundle"
cat "$bundle/MANIFEST"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpus=0
if command -v nvidia-smi >/dev/null; then
    note "nvidia-smi"
    timeout 30 nvidia-smi || true
    gpus=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
export KVSTAGE_REQUIRE_GPU=${KVSTAGE_REQUIRE_GPU:-$([[ $gpus -gt 0 ]] && echo 1 || echo 0)}
echo "GPUs listed: $gpus; KVSTAGE_REQUIRE_GPU=$KVSTAGE_REQUIRE_GPU"

note "kvstage-cuda doctor"
timeout 60 "$bundle/bin/kvstage-cuda" doctor | tee "$OUT/doctor.txt"

while IFS=$'\t' read -r name env cmd; do
    [[ -n $name ]] || continue
    note "test $name: $cmd"
    vars=()
    if [[ $env != - ]]; then
        # The stub libcuda goes first; the bundle's library must stay reachable (the test programs'
        # RUNPATH names the build tree, which the runner does not have).
        IFS=';' read -r -a vars <<<"${env//STUB_DIR/$bundle/stub_cuda:$LD_LIBRARY_PATH}"
    fi
    # shellcheck disable=SC2086 # cmd is a word list from tests.tsv
    (cd "$bundle" && timeout "${KVSTAGE_GPU_TEST_TIMEOUT_S:-180}" env "${vars[@]}" $cmd)
    result "$name" $?
done <"$bundle/tests.tsv"

bench_args=${KVSTAGE_BENCH_ARGS:---iters 20}
note "benchmark: gather/scatter vs device memcpy ($bench_args)"
# shellcheck disable=SC2086 # a word list
timeout 240 "$bundle/bin/kvstage-cuda" bench $bench_args --json "$OUT/bench.json"
result bench $?

note "PyTorch real-client check"
py=$(command -v python3 || command -v python || true)
if [[ -n $py ]]; then
    timeout 180 "$py" "$bundle/gpu_torch_check.py" --backend "${KVSTAGE_TORCH_CHECK_BACKEND:-torch}" \
        --lib "$bundle/lib/libkvstage.so"
    result torch_check $?
else
    echo "no python"; result torch_check 77
fi

# On a GPU, under compute-sanitizer memcheck (where the image has it): the kernel check (every
# selftest case: token-major pools, the named layouts, padded pages, direct copies between
# layouts), and transfers through a device ring by TCP (pinned bounce, events) and by CUDA IPC
# from a second process, and direct mode's across kernel into a decode pool opened by CUDA IPC. A
# bad memory access of a kernel, or a driver call answered with an error, fails.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1 || true)
if [[ $gpus -gt 0 && -n $sanitizer ]]; then
    : >"$OUT/sanitizer.txt"
    for cmd in "bin/kvstage-cuda check" "bin/gpu_transfer device-tcp" "bin/gpu_transfer device-ipc" "bin/gpu_transfer device-direct"; do
        note "compute-sanitizer memcheck: $cmd"
        # The kernel check runs every selftest case (token-major and strided layouts) three times.
        limit=150
        [[ $cmd == *kvstage-cuda* ]] && limit=300
        # shellcheck disable=SC2086 # a word list
        (cd "$bundle" && timeout "$limit" "$sanitizer" --tool memcheck --target-processes all --error-exitcode 1 $cmd) >"$OUT/sanitizer.part" 2>&1
        rc=$?
        cat "$OUT/sanitizer.part" >>"$OUT/sanitizer.txt"
        grep '^=========' "$OUT/sanitizer.part" | tail -n 12
        rm -f "$OUT/sanitizer.part"
        result "memcheck ${cmd#bin/}" $rc
    done
fi

note "summary"
((failed)) && printf '  failed: %s\n' "${failures[@]}"
echo "log: $log"
echo "$passed passed, $failed failed, $skipped skipped"
((failed == 0))
