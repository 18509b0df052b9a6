#!/usr/bin/env python3
"""The summary of scripts/gpu-check: each GPU test suite with its test count and verdict, the
CUDA benchmarks' bandwidths and their ratios against a device-to-device copy of the same bytes,
fused AdamW in fp32 against PyTorch's, and the pass/fail of the targets.

Reads Google Benchmark JSON (bench_cuda --benchmark_out_format=json, with or without
repetitions). Benchmarks timed with UseManualTime() are named "<name>/<arg>/manual_time"; the
targets are matched on "<name>/<arg>" with that suffix removed. --suites reads gpu-check's
suites.tsv (suite, exit status, seconds, JUnit XML) and --manifest the bundle's test lists: a
suite passes when it exited 0 and its JUnit report shows test cases and no failure. --torch
reads scripts/gpu-check-torch.py's JSON, --example the main example's GPU run (--json): it fails
like a suite unless the GPU and the host engine agree bit for bit. --no-device writes the summary of a run that found no
device. Writes summary.json next to the benchmark JSON (or to --out). Exit status: 0 every suite
passed and every target met, 2 a suite failed or ran nothing, 3 a target missed or absent.

Usage: gpu-check-summary.py [BENCH_JSON] [--tests TOTAL PASSED FAILED SKIPPED]
                            [--suites TSV] [--manifest JSON] [--torch JSON]
                            [--example JSON] [--no-device REASON] [--out FILE]
"""
import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

# Bandwidth of the kernel over a device-to-device copy of the same bytes, at 256M elements.
TARGETS = {"BM_fused_adamw/268435456": 0.90, "BM_flatten/268435456": 0.90,
           # ZeRO-Offload's copies over a plain pinned cudaMemcpyAsync of the same bytes
           "BM_offload_to_host/536870912": 0.80, "BM_offload_to_device/536870912": 0.80}
# shardkit's fp32 fused AdamW over torch.optim.AdamW(fused=True) on the same size, same device.
TORCH_TARGET = ("BM_fused_adamw_fp32/268435456", 1.0)


def read_suites(tsv, manifest):
    """Each suite of suites.tsv: its listed tests, exit status, JUnit counts and verdict."""
    listed = (manifest or {}).get("tests", {})
    suites = []
    with open(tsv) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4:
                continue
            name, rc, seconds, xml = parts[:4]
            if xml and not os.path.isabs(xml):
                xml = os.path.join(os.path.dirname(os.path.abspath(tsv)), xml)
            entry = {"suite": name, "tests": len(listed.get(name, [])), "exit_status": rc,
                     "seconds": int(seconds or 0), "test_cases_run": 0, "failures": 0}
            if rc == "not_run":
                entry["verdict"] = "not run"
                suites.append(entry)
                continue
            try:
                root = ET.parse(xml).getroot()
                cases = root.iter("testcase")
                run = fails = 0
                for c in cases:
                    run += 1
                    if c.find("failure") is not None or c.find("error") is not None:
                        fails += 1
                entry["test_cases_run"], entry["failures"] = run, fails
            except (OSError, ET.ParseError):
                entry["junit"] = "missing or unreadable"
            if rc == "77":
                entry["verdict"] = "no device"
            elif rc == "0" and entry["test_cases_run"] > 0 and entry["failures"] == 0:
                entry["verdict"] = "passed"
            elif rc == "124" or rc == "137":
                entry["verdict"] = "timed out"
            elif entry["test_cases_run"] == 0:
                entry["verdict"] = "ran nothing"
            else:
                entry["verdict"] = "failed"
            suites.append(entry)
    return suites


def base_name(name):
    for suffix in ("/manual_time", "/real_time"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def summarize(bench, tests, suites=None, torch=None):
    """Returns (lines of text, summary dict, all targets met)."""
    rows, verdicts, bandwidth = [], {}, {}
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
        bandwidth[name] = bw
        if name in TARGETS:
            verdicts[name] = (ratio, TARGETS[name], ratio >= TARGETS[name])

    lines = []
    if suites is not None:
        lines.append("GPU test suites:")
        for e in suites:
            lines.append(f"  {e['suite']:12s} {e['tests']:3d} tests  {e['test_cases_run']:4d} "
                         f"cases run  {e['failures']:3d} failed  {e['seconds']:4d} s  "
                         f"{e['verdict']}")
        lines.append("suites that ran: " + (" ".join(e["suite"] for e in suites
                                                     if e["verdict"] not in ("not run",))
                                            or "none"))
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
    lines.append("targets (256M elements: bandwidth over a device-to-device copy of the same bytes,"
                 " read + write counted; offload copies of 512 MiB: over a plain pinned"
                 " cudaMemcpyAsync):")
    ok = True
    for name, target in TARGETS.items():
        if name not in verdicts:
            lines.append(f"  {name:32s} no result                  MISSED")
            ok = False
            continue
        ratio, t, good = verdicts[name]
        ok = ok and good
        lines.append(f"  {name:32s} {ratio:.3f} (target >= {t:.2f})  {'met' if good else 'MISSED'}")
    torch_verdict = None
    name, t = TORCH_TARGET
    torch_bw = float((torch or {}).get("bytes_per_second", 0.0))
    if torch_bw > 0 and name in bandwidth:
        ratio = bandwidth[name] / torch_bw
        torch_verdict = {"ratio": ratio, "target": t, "met": ratio >= t,
                         "shardkit_bytes_per_second": bandwidth[name],
                         "torch_bytes_per_second": torch_bw, "torch": torch}
        lines.append(f"  {name + ' vs torch':32s} {ratio:.3f} (target >= {t:.2f})  "
                     f"{'met' if ratio >= t else 'MISSED'}  (torch.optim.AdamW(fused=True) "
                     f"{torch_bw / 1e9:.1f} GB/s, torch {torch.get('torch_version', '?')})")
        ok = ok and ratio >= t
    elif torch is not None or suites is not None:
        why = (torch or {}).get("error", "no torch.json")
        lines.append(f"  {name + ' vs torch':32s} not measured ({why})  MISSED")
        ok = False
    failed_tests = tests is not None and tests["failed"] != 0
    failed_suites = suites is not None and (
        not suites or any(e["verdict"] != "passed" for e in suites))
    summary = {
        "status": "ok" if ok and not failed_tests and not failed_suites else "failed",
        "suites": suites,
        "suites_ran": [e["suite"] for e in suites or [] if e["verdict"] != "not run"],
        "torch": torch_verdict,
        "tests": tests,
        "device": ctx.get("gpu"),
        "targets": {k: {"ratio": v[0], "target": v[1], "met": v[2]} for k, v in verdicts.items()},
        "benchmarks": [{"name": r[0], "bytes_moved": r[1], "bytes_per_second": r[2],
                        "copy_bytes_per_second": r[3], "vs_copy": r[4]} for r in rows],
    }
    summary["failed_suites"] = bool(failed_suites)
    return lines, summary, ok


def example_verdict(ex):
    """The main example on the GPU (shardkit_example_01_mlp_zero_cuda --json): each stage's
    GPU losses and parameters against the host engine's, bit for bit."""
    lines = ["main example on the GPU (examples/01_mlp_zero/cuda), against the host engine:"]
    if "error" in ex or "runs" not in ex:
        lines.append(f"  not run or no result ({ex.get('error', 'no runs')})  FAILED")
        return lines, {"passed": False, "error": ex.get("error", "no runs")}
    def loss(x):  # JSON has no NaN: a NaN loss arrives as null
        return "nan" if x is None else f"{x:.4f}"
    for r in ex["runs"]:
        losses = r.get("gpu_loss") or [None]
        lines.append(f"  stage {r['stage']}, {r['ranks']} ranks, {r['steps']} steps: loss "
                     f"{loss(losses[0])} -> {loss(losses[-1])}, parameters differing "
                     f"{r['params_differing']} of {r['params_compared']}, "
                     f"{'bit-identical' if r['bit_identical'] else 'DIFFERENT'}")
    passed = bool(ex.get("bit_identical")) and bool(ex.get("loss_fell"))
    lines.append(f"  {'passed' if passed else 'FAILED'}")
    return lines, {"passed": passed, "runs": ex["runs"]}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError) as e:
        return {"error": str(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", nargs="?")
    ap.add_argument("--tests", nargs=4, type=int, metavar=("TOTAL", "PASSED", "FAILED", "SKIPPED"))
    ap.add_argument("--suites")
    ap.add_argument("--manifest")
    ap.add_argument("--torch")
    ap.add_argument("--example")
    ap.add_argument("--no-device", metavar="REASON")
    ap.add_argument("--out")
    a = ap.parse_args()
    manifest = load(a.manifest) if a.manifest else None
    if a.no_device is not None:
        summary = {"status": "no_device", "reason": a.no_device, "built": manifest is not None,
                   "suites_ran": [], "suites_prepared": (manifest or {}).get("suites", []),
                   "manifest": manifest}
        with open(a.out or "summary.json", "w") as f:
            json.dump(summary, f, indent=1)
        print(f"no device: {a.no_device}; nothing was run")
        return 77
    tests = None
    if a.tests:
        tests = dict(zip(("total", "passed", "failed", "skipped"), a.tests))
    bench = load(a.bench_json) if a.bench_json else {}
    if "error" in bench:
        print(f"no benchmark results: {bench['error']}")
        bench = {}
    suites = read_suites(a.suites, manifest) if a.suites else None
    torch = load(a.torch) if a.torch else None
    lines, summary, ok = summarize(bench, tests, suites, torch)
    summary["manifest"] = manifest
    if a.example:
        ex_lines, ex = example_verdict(load(a.example))
        lines += ex_lines
        summary["example"] = ex
        if not ex["passed"]:
            summary["failed_suites"] = True
            summary["status"] = "failed"
    print("\n".join(lines))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.bench_json or ".")),
                                "summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    if summary["failed_suites"] or (tests is not None and tests["failed"] != 0):
        return 2
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
