#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build kvstage (`build`) or to build it and
# run every test (`test`, what CI needs). Idempotent: installs nothing when everything is present.
# Needs root or passwordless sudo only when something is missing; otherwise says what to install.
#
#   scripts/prereqs.sh build    cargo, cmake >= 3.25, a C compiler, libclang-dev, pkg-config
#                               (sideway's rdma-core bindings run cmake and bindgen at build time)
#   scripts/prereqs.sh test     build + g++, valgrind, iproute2, clang-14, libasan, libibverbs,
#                               qemu-system-x86, python3 with numpy, pytest, prometheus_client and venv, ptxas from PyPI
set -euo pipefail
mode=${1:-build}
[[ $mode == build || $mode == test ]] || { echo "usage: $0 build|test" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
say() { echo "prereqs: $*" >&2; }
die() { say "$*"; exit 1; }

if ! command -v cargo >/dev/null && [[ -f $HOME/.cargo/env ]]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (https://rustup.rs), 1.88 or newer"

deb_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
cmake_ok() {
  command -v cmake >/dev/null || return 1
  local v
  v=$(cmake --version | sed -n '1s/^cmake version \([0-9.]*\).*/\1/p')
  printf '3.25\n%s\n' "$v" | sort -V -C
}

missing=()
cmake_ok || missing+=(cmake)
command -v cc >/dev/null || missing+=(gcc)
command -v pkg-config >/dev/null || missing+=(pkg-config)
if command -v dpkg-query >/dev/null; then
  deb_installed libclang-dev || missing+=(libclang-dev)
fi
if [[ $mode == test ]]; then
  command -v c++ >/dev/null || missing+=(g++)
  command -v valgrind >/dev/null || missing+=(valgrind)
  # ip and tc: tests/vanished_host.rs builds network namespaces, a veth pair and a rate limit.
  command -v ip >/dev/null || [[ -x /usr/sbin/ip || -x /sbin/ip ]] || missing+=(iproute2)
  # clang-14 regenerates the CUDA kernels' PTX for the check that the committed PTX is current.
  command -v clang-14 >/dev/null || missing+=(clang-14)
  # AddressSanitizer's runtime (libasan) comes with gcc's development package.
  if command -v gcc >/dev/null && ! echo 'int main(void){return 0;}' |
      gcc -fsanitize=address -x c - -o /dev/null >/dev/null 2>&1; then
    missing+=("libgcc-$(gcc -dumpversion | cut -d. -f1)-dev")
  fi
  if command -v dpkg-query >/dev/null; then
    # rdma-core's libibverbs (dlopen'ed, never linked): the RDMA ctests check "library present, no
    # device" here and, masked in a mount namespace, "no rdma-core".
    deb_installed libibverbs1 || missing+=(libibverbs1 ibverbs-providers)
  fi
  # ctest rdma_vm boots Debian's kernel in qemu with soft-RoCE (scripts/rxe-vm.sh); xz and
  # dpkg-deb unpack the packages it fetches.
  command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
  command -v xz >/dev/null || missing+=(xz-utils)
  command -v python3 >/dev/null || missing+=(python3 python3-pip)
  # The bundled-library test installs the Python package into a fresh virtualenv.
  if command -v python3 >/dev/null && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=("python3-venv")
  fi
fi

if ((${#missing[@]})); then
  if ! command -v apt-get >/dev/null; then
    die "missing ${missing[*]} and no apt-get here: install them with your package manager"
  fi
  sudo=()
  if [[ $(id -u) != 0 ]]; then
    sudo -n true 2>/dev/null || die "missing ${missing[*]}: run as root, or with passwordless sudo, or: sudo apt-get install -y ${missing[*]}"
    sudo=(sudo -n)
  fi
  say "installing ${missing[*]}"
  "${sudo[@]}" apt-get update -q >&2
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
  cmake_ok || die "cmake $(cmake --version | head -n1) is older than 3.25 (workflow presets): install a newer one (pip install cmake)"
fi

if [[ $mode == test ]]; then
  pip_install() {
    # Debian's python refuses a system-wide pip install (PEP 668) unless told.
    python3 -m pip install --quiet --disable-pip-version-check "$@" >&2 ||
      python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "$@" >&2 ||
      die "pip install $* failed"
  }
  python3 -m pip --version >/dev/null 2>&1 || die "python3 has no pip: apt-get install python3-pip"
  # The Python binding's tests (ctest label python).
  if ! python3 -c 'import numpy, pytest, prometheus_client' >/dev/null 2>&1; then
    say "installing numpy, pytest and prometheus_client for python3"
    pip_install numpy pytest prometheus_client
  fi
  # ptxas (NVIDIA's PyPI wheel; no GPU needed) checks the embedded PTX for sm_80 and sm_90.
  if ! python3 -c 'import nvidia.cuda_nvcc' >/dev/null 2>&1; then
    say "installing nvidia-cuda-nvcc-cu12 (ptxas)"
    pip_install nvidia-cuda-nvcc-cu12==12.9.86
  fi
fi
