#!/usr/bin/env bash
# CUDA consumer test: install shardkit into a prefix and build a CUDA project against it with
# find_package(shardkit COMPONENTS cuda nccl).
# Usage: run_cuda.sh <shardkit-build-dir> <shardkit-source-dir> <work-dir> <cuda-architecture>
set -euo pipefail
build=$1
src=$2
work=$3
arch=$4
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer/cuda" -B "$work/find" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
cmake --build "$work/find" >/dev/null
"$work/find/consumer_cuda"
