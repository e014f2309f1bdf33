#!/usr/bin/env bash
# ctest `install_consumer` (label install): install into a temporary prefix, move the prefix (the
# package must be relocatable), check the layout, then
#   1. configure, build and run ctests/consumer (find_package(kvstage REQUIRED), kvstage::kvstage
#      and kvstage::static) against that prefix;
#   2. compile ctests/consumer/consumer.c with `pkg-config --cflags --libs kvstage` and run it.
# Usage: install_consumer.sh <cmake> <build dir> <consumer src> <work dir> <cc> <libdir> <includedir> <version> <soversion>
set -euo pipefail
cmake=$1 build=$2 consumer=$3 work=$4 cc=$5 libdir=$6 includedir=$7 version=$8
soversion=$9 # the SONAME's version: MAJOR, or 0.MINOR while the major is 0

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
stage=$work/stage
prefix=$work/moved-prefix

step "cmake --install into $stage"
"$cmake" --install "$build" --prefix "$stage"
step "relocate the prefix to $prefix"
mv "$stage" "$prefix"

step "layout"
lib=$prefix/$libdir
[[ -f $lib/libkvstage.so.$version && ! -L $lib/libkvstage.so.$version ]] || fail "$lib/libkvstage.so.$version is not a regular file"
[[ -L $lib/libkvstage.so.$soversion ]] || fail "$lib/libkvstage.so.$soversion is not a symlink"
[[ $(readlink "$lib/libkvstage.so.$soversion") == "libkvstage.so.$version" ]] || fail "libkvstage.so.$soversion -> $(readlink "$lib/libkvstage.so.$soversion")"
[[ -L $lib/libkvstage.so ]] || fail "$lib/libkvstage.so is not a symlink"
[[ $(readlink "$lib/libkvstage.so") == "libkvstage.so.$soversion" ]] || fail "libkvstage.so -> $(readlink "$lib/libkvstage.so")"
for f in "$lib/libkvstage.a" "$prefix/$includedir/kvstage.h" \
         "$lib/cmake/kvstage/kvstageConfig.cmake" "$lib/cmake/kvstage/kvstageConfigVersion.cmake" \
         "$lib/pkgconfig/kvstage.pc"; do
  [[ -f $f ]] || fail "missing $f"
done
if grep -rqF "$stage" "$lib/cmake/kvstage" "$lib/pkgconfig"; then
  fail "the installed package hard-codes the install prefix (not relocatable)"
fi
(cd "$prefix" && find . | sort)

step "find_package consumer (CMake)"
"$cmake" -S "$consumer" -B "$work/consumer-build" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=Release \
  -DKVSTAGE_EXPECTED_VERSION="$version"
"$cmake" --build "$work/consumer-build"
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p'; }
needed "$work/consumer-build/kvstage_consumer" | grep -qx "libkvstage.so.$soversion" \
  || fail "kvstage_consumer does not record NEEDED libkvstage.so.$soversion"
if needed "$work/consumer-build/kvstage_consumer_static" | grep -q libkvstage; then
  fail "kvstage_consumer_static needs a shared libkvstage"
fi
"$work/consumer-build/kvstage_consumer"
"$work/consumer-build/kvstage_consumer_static"

step "pkg-config consumer"
command -v pkg-config >/dev/null || fail "pkg-config not found (apt-get install -y pkg-config)"
export PKG_CONFIG_PATH=$lib/pkgconfig
unset PKG_CONFIG_LIBDIR PKG_CONFIG_SYSROOT_DIR
pc_version=$(pkg-config --modversion kvstage)
[[ $pc_version == "$version" ]] || fail "pkg-config --modversion kvstage = $pc_version, expected $version"
flags=$(pkg-config --cflags --libs kvstage)
echo "pkg-config --cflags --libs kvstage: $flags"
[[ $flags == *"$prefix"* || $flags == *"$(cd "$prefix" && pwd -P)"* ]] || fail "pkg-config flags do not point into $prefix"
# shellcheck disable=SC2086 # word splitting of the flags is intended
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror -DKVSTAGE_EXPECTED_VERSION="\"$version\"" \
  "$consumer/consumer.c" -o "$work/pkgconfig_consumer" $flags
LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$work/pkgconfig_consumer"

printf '\ninstall_consumer: ok\n'
