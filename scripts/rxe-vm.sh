#!/usr/bin/env bash
# Runs test executables on real RDMA verbs on a host without RDMA hardware: boots Debian's own
# kernel (linux-image-amd64) in qemu, loads soft-RoCE (rdma_rxe) on a veth pair inside the VM and
# runs each test there, passing its exit code back.
#
#   scripts/rxe-vm.sh [--work DIR] [--timeout S] [--env K=V]... [--arg A]... TEST ...
#
# `--env` and `--arg` (one argument each) apply to the next TEST only. Every test runs in the same boot, one after another,
# with RXE_DEV=rxe0, RXE_GID_INDEX (the IPv4 RoCE v2 GID of rxe0) and, when the kernel gives the
# second end of the veth pair its own device, RXE_DEV2=rxe1. Exit: 0 when every test exited 0,
# 1 when one did not (or the VM failed), 77 when qemu or the Debian packages cannot be had
# (KVSTAGE_REQUIRE_RDMA_VM=1 turns that into 1: a CI runner must not skip).
#
# What goes into the VM: the kernel and the modules rxe needs, busybox, iproute2 (ip, rdma),
# libibverbs with the rxe provider, and each test with the shared libraries ldd finds for it
# (libkvstage included). All of it comes from Debian packages fetched with `apt-get download`,
# cached under the work directory (default build/rxe-vm); only qemu-system-x86 is installed on the
# host. The VM has no network card: nothing leaves it.
#
# Facts that cost time: rdma_rxe needs the crc32 shash, loaded by hand (no modprobe in the VM);
# busybox's shell runs its own `ip` applet unless given iproute2's by path; the uncompressed
# vmlinux booted through the PVH entry saves 5-12 s of TCG decompression; the IPv4-mapped GID is
# found by content, not assumed at an index. Under TCG (the KVM here cannot run a stock kernel)
# the verbs are real but slow: no timing from the VM means anything.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$repo/build/rxe-vm
timeout_s=600
tests=() envs=() args=() pending=() pending_args=()
while (($#)); do
  case $1 in
    --work) work=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --env) pending+=("$2"); shift 2 ;;
    --arg) pending_args+=("$(printf '%q' "$2")"); shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) tests+=("$(readlink -f "$1")"); envs+=("${pending[*]:-}"); args+=("${pending_args[*]:-}"); pending=() pending_args=(); shift ;;
  esac
done
((${#tests[@]})) || { echo "rxe-vm: no test given (--help)" >&2; exit 2; }
mkdir -p "$work" && work=$(cd "$work" && pwd)

log() { echo "[rxe-vm $(date +%T)] $*" >&2; }
unavailable() {
  log "unavailable: $*"
  if [[ ${KVSTAGE_REQUIRE_RDMA_VM:-0} == 1 ]]; then exit 1; fi
  exit 77
}

# --- the host's part: qemu, and the packages for the VM --------------------------------------------
if ! command -v qemu-system-x86_64 >/dev/null; then
  command -v apt-get >/dev/null || unavailable "no qemu-system-x86_64 and no apt-get to install it"
  log "installing qemu-system-x86"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86; } \
    >/dev/null 2>&1 || unavailable "cannot install qemu-system-x86"
fi
debs=$work/debs root=$work/root vm=$work/vm
# Load order; each module's dependencies come before it.
mods="udp_tunnel ip6_udp_tunnel ib_core ib_uverbs crc32_generic rdma_rxe veth"
mkdir -p "$debs"
if ! ls "$debs"/linux-image-*.deb >/dev/null 2>&1; then
  command -v apt-get >/dev/null || unavailable "no apt-get to fetch the kernel"
  apt-cache policy linux-image-amd64 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -qq >/dev/null 2>&1 || true
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  [[ -n $kpkg ]] || unavailable "no linux-image-amd64 package"
  pkgs="$kpkg busybox-static ibverbs-utils libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200
        iproute2 libbpf1 libelf1 libmnl0 libbsd0 libcap2 libmd0 zlib1g libc6"
  log "downloading $(echo $pkgs)"
  chmod 777 "$debs" # apt-get download runs as _apt
  (cd "$debs" && apt-get download $pkgs >/dev/null 2>&1) || unavailable "apt-get download failed"
  rm -rf "$root"
fi
if [[ ! -e $root/.extracted ]]; then
  rm -rf "$root"; mkdir -p "$root"
  for d in "$debs"/*.deb; do
    case ${d##*/} in
      linux-image-*) # hundreds of MB of modules: only the kernel and the ones loaded here
        pats=(); for m in $mods; do pats+=("*/$m.ko*"); done
        dpkg-deb --fsys-tarfile "$d" | tar -x -C "$root" --wildcards './boot/*' "${pats[@]}" ;;
      *) dpkg-deb -x "$d" "$root" ;;
    esac
  done
  touch "$root/.extracted"
fi
kver=$(ls "$root/lib/modules" | head -n1)
vmlinuz=$root/boot/vmlinuz-$kver
busybox=$root/bin/busybox
libdir=/usr/lib/x86_64-linux-gnu

# --- the VM's root file system (an initramfs) -------------------------------------------------------
rm -rf "$vm/rootfs"; r=$vm/rootfs
mkdir -p "$r"/{bin,proc,sys,dev,tmp,etc/libibverbs.d,modules,tests,usr/bin,usr/sbin,lib64} "$r$libdir/libibverbs"
ln -s usr/lib "$r/lib"
cp "$busybox" "$r/bin/busybox"
for a in $("$busybox" --list); do [[ -e $r/bin/$a ]] || ln -s busybox "$r/bin/$a"; done
rm -f "$r/bin/ip" # iproute2's, below
for m in $mods; do
  f=$(find "$root/lib/modules/$kver" \( -name "$m.ko" -o -name "$m.ko.xz" -o -name "$m.ko.zst" \) | head -n1)
  [[ -n $f ]] || { log "module $m is not in $kver"; exit 1; }
  case $f in
    *.xz) xz -dc "$f" >"$r/modules/$m.ko" ;;
    *.zst) zstd -qdc "$f" >"$r/modules/$m.ko" ;;
    *) cp "$f" "$r/modules/$m.ko" ;;
  esac
done
# An ELF and every library ldd resolves for it, Debian's extracted copy first (the VM's glibc
# must match its loader), the host's otherwise (libkvstage, a test's own libraries).
ldpath=$root/lib/x86_64-linux-gnu:$root$libdir:$root$libdir/libibverbs
copy_libs() {
  { LD_LIBRARY_PATH=$ldpath ldd "$1" || true; } | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}' |
    while read -r lib; do
      base=${lib##*/}
      [[ -e $r$libdir/$base ]] && continue
      if [[ $base == ld-linux-x86-64.so.2 ]]; then
        src=$root/lib/x86_64-linux-gnu/$base; [[ -e $src ]] || src=$lib
        cp -L "$src" "$r$libdir/$base"; ln -sf "../usr/lib/x86_64-linux-gnu/$base" "$r/lib64/$base"
      else
        cp -L "$lib" "$r$libdir/$base"
      fi
    done
}
copy_elf() { cp -L "$1" "$2"; copy_libs "$1"; }
copy_elf "$root/bin/ip" "$r/usr/sbin/ip"
copy_elf "$root/usr/bin/rdma" "$r/usr/sbin/rdma"
copy_elf "$root/usr/bin/ibv_devinfo" "$r/usr/bin/ibv_devinfo"
cp -L "$root$libdir/libibverbs.so.1" "$r$libdir/"
ln -sf libibverbs.so.1 "$r$libdir/libibverbs.so"
cp -L "$root$libdir"/libibverbs/librxe-rdmav*.so "$r$libdir/libibverbs/"
copy_libs "$root$libdir"/libibverbs/librxe-rdmav*.so
cp "$root/etc/libibverbs.d/rxe.driver" "$r/etc/libibverbs.d/"
echo 'root:x:0:0:root:/:/bin/sh' >"$r/etc/passwd"
echo '127.0.0.1 localhost' >"$r/etc/hosts"

# Each test in its own directory with a script that sets its environment and runs it.
for i in "${!tests[@]}"; do
  t=${tests[$i]} d=$r/tests/$i
  [[ -x $t ]] || { log "not an executable: $t"; exit 2; }
  mkdir -p "$d"
  copy_elf "$t" "$d/${t##*/}"
  {
    for kv in ${envs[$i]}; do printf 'export %q\n' "$kv"; done
    printf 'exec timeout %s ./%q %s\n' "$timeout_s" "${t##*/}" "${args[$i]}"
  } >"$d/run.sh"
done

cat >"$r/init" <<EOF
#!/bin/sh
mods="$mods"
EOF
cat >>"$r/init" <<'EOF'
export PATH=/usr/sbin:/usr/bin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/shm; mount -t tmpfs tmpfs /dev/shm
ulimit -l unlimited  # memory registration pins pages
say() { echo "RXE-VM: $*"; }
fail() { say "SETUP-FAILED $*"; dmesg | tail -n 20; poweroff -f; }
for m in $mods; do insmod /modules/$m.ko || fail "insmod $m"; done
echo 0 >/proc/sys/net/ipv6/conf/default/accept_dad
ip=/usr/sbin/ip
$ip link set lo up
$ip link add veth0 type veth peer name veth1 || fail "veth"
$ip addr add 192.0.2.1/24 dev veth0; $ip addr add 192.0.2.2/24 dev veth1
$ip link set veth0 up; $ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0"
rdma link add rxe1 type rxe netdev veth1 || say "no second device (rxe1 on veth1)"
gid_of() { # the index of device $1's IPv4-mapped GID for address suffix $2
  for _ in $(seq 1 50); do
    g=$(grep -l "ffff:$2\$" /sys/class/infiniband/$1/ports/1/gids/* 2>/dev/null | head -n1)
    [ -n "$g" ] && { echo "${g##*/}"; return; }; sleep 0.1
  done
}
export RXE_DEV=rxe0 RXE_GID_INDEX=$(gid_of rxe0 c000:0201)
[ -n "$RXE_GID_INDEX" ] || fail "no IPv4 GID on rxe0"
[ -d /sys/class/infiniband/rxe1 ] && export RXE_DEV2=rxe1
say "kernel $(uname -r); devices: $(ls /sys/class/infiniband | tr '\n' ' ')gid $RXE_GID_INDEX"
for d in /tests/*; do
  name=$(tail -n1 $d/run.sh | sed 's/.* \.\///; s/ .*//')
  say "RUN ${d##*/} $name"
  (cd $d && sh ./run.sh); rc=$?
  say "RESULT ${d##*/} $rc"
done
say "DONE"
poweroff -f
EOF
chmod +x "$r/init"
(cd "$r" && find . | "$busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$vm/initrd.gz")

# The kernel: the ELF vmlinux inside the bzImage, booted through PVH (no TCG decompression).
kernel=$vmlinuz
if [[ ! -s $vm/vmlinux-$kver ]]; then
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -n1 | cut -d: -f1 || true)
  [[ -n $off ]] && tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream >"$vm/vmlinux-$kver" 2>/dev/null || true
fi
head -c 4 "$vm/vmlinux-$kver" 2>/dev/null | grep -q ELF && kernel=$vm/vmlinux-$kver
accel=tcg cpu=max
if [[ -w /dev/kvm ]] && { [[ -d /sys/module/kvm_intel ]] || [[ -d /sys/module/kvm_amd ]]; }; then accel=kvm cpu=host; fi
log "booting $kver ($accel) with ${#tests[@]} test(s)"
console=$vm/console.log
set +e
timeout $((timeout_s * ${#tests[@]} + 120)) qemu-system-x86_64 -accel $accel -cpu $cpu -m 1024 -smp 2 \
  -nodefaults -no-user-config -display none -serial stdio -no-reboot \
  -kernel "$kernel" -initrd "$vm/initrd.gz" -append "console=ttyS0 quiet loglevel=3 panic=-1" \
  </dev/null 2>&1 | sed -u 's/\r$//' | tee "$console"
qemu_rc=${PIPESTATUS[0]}
set -e

# --- the verdict ------------------------------------------------------------------------------------
grep -aq 'RXE-VM: SETUP-FAILED' "$console" && { log "the VM could not set up soft-RoCE"; exit 1; }
failed=0
for i in "${!tests[@]}"; do
  rc=$(grep -a "^RXE-VM: RESULT $i " "$console" | awk '{print $4}' || true)
  case ${rc:-none} in
    0) log "passed: ${envs[$i]} ${tests[$i]##*/} ${args[$i]}" ;;
    *) log "FAILED (exit ${rc:-none, the VM ended first}): ${envs[$i]} ${tests[$i]##*/} ${args[$i]}"; failed=1 ;;
  esac
done
((qemu_rc == 0)) || { log "qemu exited with $qemu_rc"; failed=1; }
exit $failed
