#!/usr/bin/env bash
# Every public header compiles on its own (and twice in a row) with the given compiler,
# -std=c++20 -Wall -Wextra -Wpedantic -Werror.
# Usage: check.sh <compiler> <include-dir> [--mpi "<MPI compile flags>"] [-flag ...] [header-to-skip ...]
# shardkit/comm/mpi.hpp and shardkit/comm/mpi/*.hpp need MPI's include flags: they are checked
# with the flags given by --mpi, and skipped (and reported as skipped) without them. Other arguments that start with '-' are extra
# compiler flags for every header (e.g. -isystem/usr/include/eigen3 for the adapters); the rest
# are headers (relative to <include-dir>) not to check.
set -euo pipefail
cxx=$1
inc=$2
shift 2
mpi_flags=
have_mpi=0
if [[ ${1:-} == --mpi ]]; then
  mpi_flags=$2
  have_mpi=1
  shift 2
fi
skip=" "
flags=()
for a in "$@"; do
  if [[ $a == -* ]]; then flags+=("$a"); else skip+="$a "; fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
count=0
skipped=0
while IFS= read -r h; do
  rel=${h#"$inc"/}
  if [[ $skip == *" $rel "* ]]; then
    skipped=$((skipped + 1))
    continue
  fi
  extra=()
  if [[ $rel == shardkit/comm/mpi.hpp || $rel == shardkit/comm/mpi/* ]]; then
    if ((!have_mpi)); then
      echo "skipped: $rel (MPI not found)"
      skipped=$((skipped + 1))
      continue
    fi
    read -r -a extra <<<"$mpi_flags"
  fi
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" >"$tmp/tu.cpp"
  if ! "$cxx" -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I"$inc" "${flags[@]}" \
    "${extra[@]}" "$tmp/tu.cpp" 2>"$tmp/err"; then
    echo "FAILED: $rel"
    head -20 "$tmp/err"
    fail=1
  fi
  count=$((count + 1))
done < <(find "$inc" -name '*.hpp' | sort)
echo "$cxx: $count headers checked, $skipped skipped (${skip# })"
exit $fail
