#!/usr/bin/env bash
# ctest `ffi_macro`: every `extern "C" fn kvstage_*` in src/ffi has a body that is exactly one
# ffi_fn!(...) invocation (the macro that clears the last error, catches panics and poisons
# handles), so no export can lack the panic boundary; and no kvstage_ export is defined outside
# src/ffi (the only extern "C" code).
# Usage: check_ffi_macro.sh <source dir>
set -euo pipefail
src=$1
shopt -s globstar nullglob
files=("$src"/src/ffi/**/*.rs)
((${#files[@]})) || { echo "FAIL: no files under $src/src/ffi" >&2; exit 1; }

outside=$(grep -rnE 'extern[[:space:]]+"C"[[:space:]]+fn[[:space:]]+kvstage_' "$src/src" --include='*.rs' | grep -v "^$src/src/ffi/" || true)
if [[ -n $outside ]]; then
  echo "FAIL: kvstage_ exports outside src/ffi:" >&2
  echo "$outside" >&2
  exit 1
fi

awk '
  function report(msg) { printf "FAIL: %s:%d: %s\n", FILENAME, FNR, msg > "/dev/stderr"; bad = 1 }
  FNR == 1 { pending = ""; opened = 0 }
  /extern[ \t]+"C"[ \t]+fn[ \t]+kvstage_/ {
    if (pending != "") report(pending ": no ffi_fn! body found")
    match($0, /fn[ \t]+kvstage_[A-Za-z0-9_]*/)
    pending = substr($0, RSTART + 3, RLENGTH - 3); sub(/^[ \t]+/, "", pending)
    opened = 0; count++
  }
  pending != "" && !opened {
    if ($0 ~ /\{[ \t]*$/) { opened = 1; next }
    if ($0 ~ /;[ \t]*$/) { pending = "" }   # a declaration (extern block), not a definition
    next
  }
  pending != "" && opened {
    if ($0 ~ /^[ \t]*$/ || $0 ~ /^[ \t]*\/\//) next
    if ($0 ~ /^[ \t]*ffi_fn!\(/) { ok++ } else { report(pending ": body does not start with ffi_fn!(") }
    pending = ""; opened = 0
  }
  END {
    if (pending != "") report(pending ": no body found")
    printf "%d exports checked, %d defined through ffi_fn!\n", count, ok
    if (count == 0) { print "FAIL: no exports found" > "/dev/stderr"; bad = 1 }
    exit bad
  }
' "${files[@]}"
