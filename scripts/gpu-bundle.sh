#!/usr/bin/env bash
# Packs what the GPU runner needs (it has no Rust toolchain): the library, every ctest of label
# `gpu` (executables copied, commands listed), kvstage-cuda (doctor/check/bench), the stub-libcuda
# test, and the PyTorch real-client check. Run on the CPU machine after a build:
#
#   cmake --workflow --preset dev          # or any build with KVSTAGE_BUILD_TESTS=ON
#   scripts/gpu-bundle.sh [BUILD_DIR] [BUNDLE_DIR]     (defaults: build/dev, build/gpu-bundle)
#
# then on the runner (the bundle travels with the work tree, e.g. as a carried ignored path):
#   scripts/gpu-runner.sh [BUNDLE_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:-build/dev}
bundle=${2:-build/gpu-bundle}
[[ -f $build/CTestTestfile.cmake ]] || { echo "gpu-bundle: $build is not a CMake build with tests" >&2; exit 1; }
command -v python3 >/dev/null || { echo "gpu-bundle: python3 needed" >&2; exit 1; }

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/stub_cuda"
strip_copy() { # $1 source file, $2 destination: copy without debug info (smaller bundle)
    cp "$1" "$2"
    if command -v strip >/dev/null; then strip --strip-debug "$2" 2>/dev/null || true; fi
}

# The library under its SONAME and plain name.
# The file the build's libkvstage.so link names (a build tree may hold an older version's too).
real=$(basename "$(readlink -f "$build/lib/libkvstage.so")")
strip_copy "$build/lib/$real" "$bundle/lib/$real"
soname=$(readelf -d "$bundle/lib/$real" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
# Plain copies, no symbolic links (file transfers to the runner may drop links).
cp "$bundle/lib/$real" "$bundle/lib/$soname"
cp "$bundle/lib/$real" "$bundle/lib/libkvstage.so"

# Every ctest labelled gpu: copy its program, keep its arguments (they must not be build paths).
ctest --test-dir "$build" -L gpu --show-only=json-v1 >"$bundle/ctest-gpu.json"
python3 - "$bundle" "$build" <<'PY'
import json, os, shutil, sys
bundle, build = sys.argv[1], os.path.abspath(sys.argv[2])
tests = json.load(open(os.path.join(bundle, "ctest-gpu.json")))["tests"]
rows = []
for t in tests:
    cmd = t["command"]
    prog = cmd[0]
    # `cmake -E env K=V ... prog args`: unwrap.
    env = []
    if os.path.basename(prog) == "cmake" and cmd[1:3] == ["-E", "env"]:
        rest = cmd[3:]
        while rest and "=" in rest[0] and not rest[0].startswith("-"):
            env.append(rest.pop(0))
        prog, cmd = rest[0], rest
    for a in cmd[1:]:
        if a.startswith(build):
            sys.exit(f"gpu-bundle: test {t['name']} passes a build path ({a}); the bundle cannot carry it")
    dst = os.path.join(bundle, "bin", os.path.basename(prog))
    shutil.copy2(prog, dst)
    rows.append("\t".join([t["name"], ";".join(env) or "-", " ".join(["bin/" + os.path.basename(prog)] + cmd[1:])]))
    print(f"gpu-bundle: test {t['name']}: {rows[-1].split(chr(9))[2]}")
open(os.path.join(bundle, "tests.tsv"), "w").write("\n".join(rows) + "\n")
PY
for f in "$bundle"/bin/*; do strip --strip-debug "$f" 2>/dev/null || true; done

# kvstage-cuda for doctor and bench (also a gpu test, copied above when it is one).
cuda_bin=$(sed -n 's/^KVSTAGE_CARGO_TARGET_DIR:PATH=//p' "$build/CMakeCache.txt" | head -n1)/release/kvstage-cuda
[[ -x $cuda_bin ]] || { echo "gpu-bundle: $cuda_bin missing (cargo build --release)" >&2; exit 1; }
strip_copy "$cuda_bin" "$bundle/bin/kvstage-cuda"

# The stub-libcuda test: must pass with a real driver installed too (the stub wins).
strip_copy "$build/ctests/cuda_stub_libcuda" "$bundle/bin/cuda_stub_libcuda"
cp "$build/ctests/stub_cuda/libcuda.so.1" "$bundle/stub_cuda/"
printf 'cuda_stub_libcuda\tKVSTAGE_EXPECT_STUB=1;LD_LIBRARY_PATH=STUB_DIR\tbin/cuda_stub_libcuda\n' >>"$bundle/tests.tsv"

cp scripts/gpu_torch_check.py "$bundle/"
cp include/kvstage.h "$bundle/"
{
    echo "kvstage GPU bundle"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (work tree differs)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) from $build"
    echo "tests:"
    cut -f1 "$bundle/tests.tsv" | sed 's/^/  /'
} >"$bundle/MANIFEST"
du -sh "$bundle"
echo "gpu-bundle: $bundle ready; on the GPU machine: scripts/gpu-runner.sh $bundle"
