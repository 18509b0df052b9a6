#!/usr/bin/env bash
# Consumer test: install shardkit into a prefix and build a user project against it with
# find_package; then build the same project with add_subdirectory.
# Usage: run.sh <shardkit-build-dir> <shardkit-source-dir> <work-dir>
set -euo pipefail
build=$1
src=$2
work=$3
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$work/find" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/find" >/dev/null
"$work/find/consumer"
cmake -S "$src/tests/consumer" -B "$work/sub" -G Ninja -DUSE_SUBDIRECTORY=ON -DSHARDKIT_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/sub" >/dev/null
"$work/sub/consumer"
