#!/usr/bin/env bash
# scripts/gpu-check --no-build where there is no CUDA device: a bundle made of this build's
# test_cuda and bench_cuda (manifest included) must be found, started, and stopped at the device
# probe with exit status 77, the "no usable CUDA device" message and a summary.json whose status
# is no_device and that lists the prepared suites; without a bundle the exit status is 1. On a
# machine with a device this test covers nothing and is skipped (exit status 78).
#
# Usage: no_device.sh SOURCE_DIR TEST_CUDA BENCH_CUDA WORK_DIR
set -uo pipefail
src=$1 test_cuda=$2 bench_cuda=$3 work=$4
if "$test_cuda" --probe-device >/dev/null 2>&1; then
  echo "a CUDA device is present: the no-device path cannot be checked here"
  exit 78
fi
rm -rf "$work" && mkdir -p "$work/bundle/bin" "$work/bundle/lib" "$work/out"
cp "$test_cuda" "$bench_cuda" "$work/bundle/bin/"
suites=$(sed -n 's/^ *set(_gpu_areas \(.*\))$/\1/p' "$src/tests/CMakeLists.txt")
python3 "$src/scripts/gpu-check-manifest.py" --bundle "$work/bundle" --suites $suites \
  --optional nccl --nvcc test --arch test --commit test || { echo "FAIL: manifest"; exit 1; }

OUT=$work/out "$src/scripts/gpu-check" --no-build --bundle "$work/bundle" >"$work/run.log" 2>&1
rc=$?
cat "$work/run.log"
[[ $rc == 77 ]] || { echo "FAIL: exit status $rc, expected 77"; exit 1; }
grep -q "FAILED - no usable CUDA device" "$work/run.log" || { echo "FAIL: no message"; exit 1; }
python3 - "$work/out/summary.json" <<'PY' || { echo "FAIL: summary.json"; exit 1; }
import json, sys
s = json.load(open(sys.argv[1]))
assert s["status"] == "no_device", s
assert s["suites_ran"] == [], s
assert "engine" in s["suites_prepared"], s
PY

OUT=$work/out "$src/scripts/gpu-check" --no-build --bundle "$work/none" >"$work/none.log" 2>&1
rc=$?
[[ $rc == 1 ]] && grep -q "no bundle" "$work/none.log" || { echo "FAIL: no bundle: exit $rc"; exit 1; }
echo "gpu-check --no-build: no-device path ok"
