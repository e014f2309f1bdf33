#!/usr/bin/env bash
# ctest `symbols`: the shared library exports only kvstage_* functions, has SONAME
# libkvstage.so.<major>, and needs nothing beyond libc, libgcc_s, libm, libdl, libpthread and the
# dynamic loader (so it loads on any Linux host; CUDA and verbs are dlopen'ed at run time).
# Usage: check_symbols.sh <libkvstage.so.X.Y.Z> <expected SONAME> <testing|release>
set -euo pipefail
lib=$1 soname=$2 mode=$3
fail=0

command -v nm >/dev/null && command -v readelf >/dev/null || { echo "nm/readelf (binutils) missing" >&2; exit 1; }
[[ -f $lib ]] || { echo "no such library: $lib" >&2; exit 1; }

# Exported (defined, dynamic) symbols, ignoring the linker's own markers.
mapfile -t symbols < <(nm -D --defined-only "$lib" | awk '{print $NF}' | grep -vE '^(_init|_fini|_edata|_end|__bss_start)$' || true)
echo "exported symbols (${#symbols[@]}):"
printf '  %s\n' "${symbols[@]}"
for s in "${symbols[@]}"; do
  if [[ $s != kvstage_* ]]; then
    echo "FAIL: exported symbol without the kvstage_ prefix: $s" >&2
    fail=1
  fi
done
# Only functions (T), no exported data.
if nm -D --defined-only "$lib" | awk '$2 != "T" && $NF ~ /^kvstage_/ {print; bad=1} END {exit !bad}'; then
  echo "FAIL: kvstage_ symbols above are not functions" >&2
  fail=1
fi
(( ${#symbols[@]} > 0 )) || { echo "FAIL: no exported symbols" >&2; fail=1; }

testing_exports=$(printf '%s\n' "${symbols[@]}" | grep -c '^kvstage_testing_' || true)
if [[ $mode == release && $testing_exports != 0 ]]; then
  echo "FAIL: a release build exports kvstage_testing_* functions" >&2
  fail=1
fi
if [[ $mode == testing && $testing_exports == 0 ]]; then
  echo "FAIL: a testing build lacks kvstage_testing_* functions" >&2
  fail=1
fi

dynamic=$(readelf -d "$lib")
actual_soname=$(sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p' <<<"$dynamic")
echo "SONAME: ${actual_soname:-<none>}"
if [[ $actual_soname != "$soname" ]]; then
  echo "FAIL: SONAME is '${actual_soname}', expected '$soname'" >&2
  fail=1
fi

allowed='^(libc\.so\.6|libgcc_s\.so\.1|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|ld-linux[-a-z0-9_.]*\.so\.[0-9]+)$'
mapfile -t needed < <(sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p' <<<"$dynamic")
echo "NEEDED: ${needed[*]}"
for n in "${needed[@]}"; do
  if ! [[ $n =~ $allowed ]]; then
    echo "FAIL: NEEDED $n is not allowed (the library must load on any Linux host)" >&2
    fail=1
  fi
done

if grep -q '(TEXTREL)' <<<"$dynamic"; then
  echo "FAIL: text relocations" >&2
  fail=1
fi

(( fail == 0 )) && echo "symbols: ok"
exit $fail
