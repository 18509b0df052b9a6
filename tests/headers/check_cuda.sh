#!/usr/bin/env bash
# The CUDA headers' rules:
#   check_cuda.sh includes <include-dir>
#       no .hpp includes a .cuh (host code must never need nvcc)
#   check_cuda.sh compile <nvcc> <include-dir> <arch> <skip> [extra nvcc flags...]
#       every .cuh compiles on its own (and twice in a row) with nvcc, -std=c++20, host warnings
#       and nvcc warnings as errors; PTX only (the headers hold templates: nothing to assemble).
#       <skip>: comma-separated headers (relative to <include-dir>) to leave out, or "none".
set -euo pipefail
mode=$1
shift
if [[ $mode == includes ]]; then
  inc=$1
  bad=$(grep -rlE '#include[[:space:]]*[<"][^>"]*\.cuh[>"]' --include='*.hpp' "$inc" || true)
  if [[ -n $bad ]]; then
    echo "FAILED: these .hpp headers include a .cuh:"
    echo "$bad"
    exit 1
  fi
  echo "no .hpp includes a .cuh ($(find "$inc" -name '*.hpp' | wc -l) headers)"
  exit 0
fi
nvcc=$1
inc=$2
arch=$3
skip=",$4,"
shift 4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
count=0
while IFS= read -r h; do
  rel=${h#"$inc"/}
  if [[ $skip == *",$rel,"* ]]; then
    echo "skipped: $rel"
    continue
  fi
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" >"$tmp/tu.cu"
  if ! "$nvcc" -std=c++20 -arch="compute_$arch" -code="compute_$arch" -I"$inc" "$@" \
      -Xcompiler=-Wall,-Wextra,-Wshadow,-Werror -Werror=all-warnings -c "$tmp/tu.cu" \
      -o "$tmp/tu.o" 2>"$tmp/err"; then
    echo "FAILED: $rel"
    head -30 "$tmp/err"
    fail=1
  fi
  count=$((count + 1))
done < <(find "$inc" -name '*.cuh' | sort)
echo "$nvcc: $count .cuh headers checked"
exit $fail
