#!/usr/bin/env bash
# Consumer test: install shardkit into a prefix and build a user project against it with
# find_package; then build the same project with add_subdirectory. With "mpi" as the 4th
# argument, also require the `mpi` component and run an MPI program built against it.
# Usage: run.sh <shardkit-build-dir> <shardkit-source-dir> <work-dir> [mpi]
set -euo pipefail
build=$1
src=$2
work=$3
mpi=OFF
[[ ${4:-} == mpi ]] && mpi=ON
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$work/find" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DEXPECT_MPI=$mpi >/dev/null
cmake --build "$work/find" >/dev/null
"$work/find/consumer"
if [[ $mpi == ON ]]; then
  "$work/find/consumer_mpi"
fi
cmake -S "$src/tests/consumer" -B "$work/sub" -G Ninja -DUSE_SUBDIRECTORY=ON -DSHARDKIT_SOURCE_DIR="$src" -DEXPECT_MPI=$mpi >/dev/null
cmake --build "$work/sub" >/dev/null
"$work/sub/consumer"
if [[ $mpi == ON ]]; then
  "$work/sub/consumer_mpi"
fi
