#!/usr/bin/env bash
# Every public header compiles on its own (and twice in a row) with the given compiler,
# -std=c++20 -Wall -Wextra -Wpedantic -Werror. Usage: check.sh <compiler> <include-dir>
# [header-to-skip ...]
set -euo pipefail
cxx=$1
inc=$2
shift 2
skip=" $* "
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
count=0
while IFS= read -r h; do
  rel=${h#"$inc"/}
  [[ $skip == *" $rel "* ]] && continue
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" >"$tmp/tu.cpp"
  if ! "$cxx" -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I"$inc" "$tmp/tu.cpp" 2>"$tmp/err"; then
    echo "FAILED: $rel"
    head -20 "$tmp/err"
    fail=1
  fi
  count=$((count + 1))
done < <(find "$inc" -name '*.hpp' | sort)
echo "$cxx: $count headers checked"
exit $fail
