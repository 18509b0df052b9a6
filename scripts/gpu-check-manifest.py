#!/usr/bin/env python3
"""The manifest of a scripts/gpu-check bundle: which GPU test suites it has and their tests,
its benchmarks, the toolchain it was built with and the glibc it needs where it runs.

Lists the tests and benchmarks by running the binaries in their listing modes, which need no
GPU. A suite given with --suites must list at least one test (a suite that would run nothing
is an error: exit status 1); one given with --optional is kept only when it lists tests (nccl,
built where NCCL was found). Writes BUNDLE/manifest.json.

Usage: gpu-check-manifest.py --bundle DIR --suites S... [--optional S...] --nvcc V --arch A
                             --commit C
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys


def listed(binary, args):
    r = subprocess.run([binary] + args, capture_output=True, text=True, check=False)
    return r.returncode, r.stdout


def suite_tests(test_cuda, suite):
    # Catch2 v2: one name per line; the exit status is the number of tests listed.
    _, text = listed(test_cuda, ["--list-test-names-only", f"[{suite}]"])
    return [line.strip() for line in text.splitlines() if line.strip()]


def glibc_required(paths):
    """The highest GLIBC_x.y symbol version the binaries need (objdump -T), or None."""
    best = None
    for p in paths:
        try:
            text = subprocess.run(["objdump", "-T", p], capture_output=True, text=True,
                                  check=False).stdout
        except OSError:
            return None
        for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", text):
            t = tuple(int(x) for x in v.split("."))
            if best is None or t > best:
                best = t
    return ".".join(str(x) for x in best) if best else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--suites", nargs="+", required=True)
    ap.add_argument("--optional", nargs="*", default=[])
    ap.add_argument("--nvcc", required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--commit", required=True)
    a = ap.parse_args()
    test_cuda = os.path.join(a.bundle, "bin", "test_cuda")
    bench_cuda = os.path.join(a.bundle, "bin", "bench_cuda")
    env_lib = os.path.join(a.bundle, "lib")
    os.environ["LD_LIBRARY_PATH"] = env_lib + (":" + os.environ["LD_LIBRARY_PATH"]
                                               if os.environ.get("LD_LIBRARY_PATH") else "")

    suites, tests, ok = [], {}, True
    for s in a.suites + a.optional:
        names = suite_tests(test_cuda, s)
        if not names:
            if s in a.optional:
                continue
            print(f"gpu-check: suite [{s}] lists no test: it would run nothing", file=sys.stderr)
            ok = False
        suites.append(s)
        tests[s] = names
    rc, text = listed(bench_cuda, ["--benchmark_list_tests=true"])
    benchmarks = [line.strip() for line in text.splitlines() if line.strip()] if rc == 0 else []
    if not benchmarks:
        print("gpu-check: bench_cuda lists no benchmark", file=sys.stderr)
        ok = False

    manifest = {
        "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": a.commit,
        "nvcc": a.nvcc,
        "arch": a.arch,
        "glibc_required": glibc_required([test_cuda, bench_cuda]),
        "suites": suites,
        "tests": tests,
        "benchmarks": benchmarks,
    }
    with open(os.path.join(a.bundle, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    for s in suites:
        print(f"suite {s:12s} {len(tests[s]):3d} tests")
    print(f"benchmarks: {len(benchmarks)}; needs glibc >= {manifest['glibc_required']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
