#!/usr/bin/env bash
# ctest `rdma_hidden_libibverbs`: runs the rdma_none test in a private mount namespace where the
# libibverbs.so.1 file is masked by /dev/null (a host without rdma-core): libkvstage.so must still
# load, the doctor must report libibverbs as not found, and transport RDMA must fail with
# KVSTAGE_E_NO_DEVICE whose causes end with the OS error of ibv_get_device_list.
# Exit 77 (skipped) when not root, without unshare, or without libibverbs installed to mask.
# Usage: check_rdma_hidden.sh <rdma_none executable>
set -euo pipefail
exe=$1
[[ $(id -u) == 0 ]] || { echo "not root: cannot make a private mount namespace: skipped"; exit 77; }
command -v unshare >/dev/null || { echo "no unshare: skipped"; exit 77; }
lib=$( { ldconfig -p 2>/dev/null || true; } | awk '/libibverbs\.so\.1 / {print $NF; exit}')
[[ -n $lib && -e $lib ]] || { echo "libibverbs.so.1 is not installed: nothing to hide: skipped"; exit 77; }
real=$(readlink -f "$lib")
unshare -m true 2>/dev/null || { echo "unshare -m is not permitted here: skipped"; exit 77; }
echo "hiding $real (through $lib) in a private mount namespace"
# --make-rprivate: the bind mount never reaches the host's namespace.
exec unshare -m --propagation private bash -c '
  set -e
  mount --bind /dev/null "$1"
  if [ -s "$1" ]; then echo "FAIL: $1 is still readable after the bind mount" >&2; exit 1; fi
  KVSTAGE_EXPECT_LIBIBVERBS=hidden exec "$2"
' hide "$real" "$exe"
