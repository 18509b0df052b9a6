#!/usr/bin/env python3
"""The summary of scripts/gpu-check: GPU test counts, the CUDA benchmarks' bandwidths and their
ratios against a device-to-device copy of the same bytes, and the pass/fail of the targets.

Reads Google Benchmark JSON (bench_cuda --benchmark_out_format=json, with or without
repetitions). Benchmarks timed with UseManualTime() are named "<name>/<arg>/manual_time"; the
targets are matched on "<name>/<arg>" with that suffix removed. Writes summary.json next to the
benchmark JSON (or to --out). Exit status: 0 every target met, 3 a target missed or absent.

Usage: gpu-check-summary.py BENCH_JSON [--tests TOTAL PASSED FAILED SKIPPED] [--out FILE]
"""
import argparse
import json
import os
import sys

# Bandwidth of the kernel over a device-to-device copy of the same bytes, at 256M elements.
TARGETS = {"BM_fused_adamw/268435456": 0.90, "BM_flatten/268435456": 0.90}


def base_name(name):
    for suffix in ("/manual_time", "/real_time"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def summarize(bench, tests):
    """Returns (lines of text, summary dict, all targets met)."""
    rows, verdicts = [], {}
    for b in bench.get("benchmarks", []):
        # With repetitions keep the median only; without, the single run.
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("error_occurred"):
            rows.append((base_name(b.get("run_name", b["name"])), 0.0, 0.0, 0.0, 0.0))
            continue
        name = base_name(b.get("run_name", b["name"]))
        bw = float(b.get("bytes_per_second", 0.0))
        ratio = float(b.get("vs_copy", 0.0))
        copy = float(b.get("copy_bytes_per_second", 0.0))
        rows.append((name, float(b.get("bytes_moved", 0.0)), bw, copy, ratio))
        if name in TARGETS:
            verdicts[name] = (ratio, TARGETS[name], ratio >= TARGETS[name])

    lines = []
    if tests is not None:
        lines.append(f"GPU tests: {tests['passed']} passed, {tests['failed']} failed, "
                     f"{tests['skipped']} skipped (of {tests['total']} ctest groups)")
    ctx = bench.get("context", {})
    lines.append(f"device: {ctx.get('gpu', '?')} ({ctx.get('gpu_sms', '?')} SMs)")
    lines.append(f"{'benchmark':34s} {'MB moved':>10s} {'GB/s':>9s} {'copy GB/s':>10s} "
                 f"{'vs copy':>8s}")
    for name, moved, bw, copy, ratio in rows:
        lines.append(f"{name:34s} {moved / 1e6:10.1f} {bw / 1e9:9.1f} {copy / 1e9:10.1f} "
                     f"{ratio:8.3f}")
    lines.append("targets (256M elements; bandwidth over a device-to-device copy of the same bytes,"
                 " read + write counted):")
    ok = True
    for name, target in TARGETS.items():
        if name not in verdicts:
            lines.append(f"  {name:32s} no result                  MISSED")
            ok = False
            continue
        ratio, t, good = verdicts[name]
        ok = ok and good
        lines.append(f"  {name:32s} {ratio:.3f} (target >= {t:.2f})  {'met' if good else 'MISSED'}")
    failed_tests = tests is not None and tests["failed"] != 0
    summary = {
        "status": "ok" if ok and not failed_tests else "failed",
        "tests": tests,
        "device": ctx.get("gpu"),
        "targets": {k: {"ratio": v[0], "target": v[1], "met": v[2]} for k, v in verdicts.items()},
        "benchmarks": [{"name": r[0], "bytes_moved": r[1], "bytes_per_second": r[2],
                        "copy_bytes_per_second": r[3], "vs_copy": r[4]} for r in rows],
    }
    return lines, summary, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json")
    ap.add_argument("--tests", nargs=4, type=int, metavar=("TOTAL", "PASSED", "FAILED", "SKIPPED"))
    ap.add_argument("--out")
    a = ap.parse_args()
    tests = None
    if a.tests:
        tests = dict(zip(("total", "passed", "failed", "skipped"), a.tests))
    try:
        with open(a.bench_json) as f:
            bench = json.load(f)
    except (OSError, ValueError) as e:
        print(f"no benchmark results: {e}")
        bench = {}
    lines, summary, ok = summarize(bench, tests)
    print("\n".join(lines))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.bench_json)), "summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
