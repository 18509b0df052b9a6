#!/usr/bin/env python3
"""PyTorch's own fused AdamW on the GPU, for scripts/gpu-check's side-by-side with shardkit's
fp32 fused step (bench_cuda's BM_fused_adamw_fp32): torch.optim.AdamW(fused=True) on one fp32
parameter of N elements with an fp32 gradient, timed with CUDA events (median of the steps after
warm-up). Bytes are counted as for shardkit's step: parameter, m and v read and written, the
gradient read, 28 bytes per element.

Writes JSON to --out: {"n", "seconds_per_step", "bytes_per_second", "torch_version", "device"},
or {"error": ...} with exit status 1 when torch or a CUDA device is missing.

Usage: gpu-check-torch.py [--elements N] [--steps S] --out FILE
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=256 << 20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    def fail(why):
        print(f"gpu-check-torch: {why}")
        with open(a.out, "w") as f:
            json.dump({"error": why}, f)
        return 1

    try:
        import torch
    except ImportError as e:
        return fail(f"torch not importable ({e})")
    if not torch.cuda.is_available():
        return fail("torch sees no CUDA device")
    dev = torch.device("cuda")
    n = a.elements
    gen = torch.Generator(device=dev).manual_seed(1)
    p = torch.nn.Parameter(torch.rand(n, device=dev, generator=gen) * 2 - 1)
    p.grad = (torch.rand(n, device=dev, generator=gen) - 0.5) * 0.2
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
    for _ in range(3):  # warm-up; creates m and v
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    times.sort()
    t = times[len(times) // 2]
    result = {"n": n, "seconds_per_step": t, "bytes_per_second": 28.0 * n / t,
              "torch_version": torch.__version__, "device": torch.cuda.get_device_name(dev)}
    print(f"torch.optim.AdamW(fused=True), fp32, {n} elements: {t * 1e3:.3f} ms per step, "
          f"{result['bytes_per_second'] / 1e9:.1f} GB/s (28 bytes per element)")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
