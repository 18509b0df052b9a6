#!/usr/bin/env python3
"""shardkit's host optimizer step against its peers, side by side in one process: the same
sizes, the same thread count, tensors allocated the same way (by torch), interleaved repetitions
(each repetition runs every contender in turn, starting with a different one each time).
scripts/bench --peers runs it once per thread count in the peers' virtual environment.

Contenders (AdamW, lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01):
  shardkit_fp32        host::parallel_fused_step<adamw, float, float> (benchmarks/peer_step.cpp):
                       fp32 params, grads, moments; 28 bytes/element
  shardkit_fp32_own    the same step on shardkit's own host buffers (core/memory.hpp: staggered,
                       on 2 MiB pages), as a shardkit engine holds its shards; every other
                       contender steps tensors torch allocated
  stream_fp32          the roofline: the fp32 step's bytes (read p, m, v, g; write p, m, v) with
                       one add per array, on torch's tensors
  torch_fused          torch.optim.AdamW(fused=True)
  torch_foreach        torch.optim.AdamW(foreach=True)
  torch_forloop        torch.optim.AdamW(foreach=False)
  deepspeed_fp32       deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), fp32
  shardkit_bf16        mixed precision: bf16 grads in, fp32 master/m/v, bf16 copy out (28 B/elem)
  deepspeed_fp32_copy  DeepSpeed's fp32 step, then the bf16 copy of the params (ZeRO-Offload's
                       pattern: DeepSpeedCPUAdam 0.19 no longer writes the 16-bit copy itself)
  deepspeed_bf16       DeepSpeed's own 16-bit mode: bf16 params and grads, fp32 moments, no fp32
                       master (22 bytes/element; a weaker algorithm, listed for completeness)

The contenders above each step tensors of their own, so where the allocator happened to put
them (relative to each other, to the page and cache-set boundaries) is part of their time. The
"_same" contenders take that out: they step one shared set of fp32 tensors p, m, v, g that torch
allocated once per size, in turn (torch's and DeepSpeed's optimizer state is pointed at the
shared m and v):
  shardkit_fp32_same, stream_fp32_same, torch_fused_same, deepspeed_fp32_same
Their same-run ratios compare the steps alone. (The values drift as four optimizers and the
roofline pass take turns on them; every one stays finite, which is all their speed depends on.)

--huge-pages sets THP_MEM_ALLOC_ENABLE=1 before torch loads, so that torch's own tensors (those
of every contender but shardkit_fp32_own) sit on transparent huge pages; the default leaves
torch's allocator as it ships (4 KiB pages). meta.anon_huge_kib says how much memory the process
held on huge pages once every contender had allocated.

Prints one JSON document: {"meta": ..., "results": [{"n", "threads", "pages", "name",
"seconds", "gelems", "cpu_seconds"}]}; seconds is the median over repetitions of each repetition's median
step time (wall clock); cpu_seconds the same for the CPU time of the calling thread, which on one
thread is the whole step (every contender runs it on the caller) and, unlike the wall clock, does
not count the time other processes hold the core.
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time


def anon_huge_kib():
    """Memory this process holds on transparent huge pages (/proc/self/smaps_rollup), in KiB."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="libshardkit_peer_step.so")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="16777216,33554432")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--huge-pages", action="store_true",
                    help="torch's tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE=1)")
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.huge_pages:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    pages = "2MiB" if args.huge_pages else "4KiB"
    import torch

    torch.set_num_threads(args.threads)
    lib = ctypes.CDLL(os.path.abspath(args.lib))
    lib.shardkit_peer_team.restype = ctypes.c_void_p
    lib.shardkit_peer_team.argtypes = [ctypes.c_int]
    lib.shardkit_peer_team_free.argtypes = [ctypes.c_void_p]
    lib.shardkit_peer_isa.restype = ctypes.c_char_p
    lib.shardkit_peer_prefetch.restype = ctypes.c_int
    f = ctypes.c_float
    ptr = ctypes.c_void_p
    lib.shardkit_peer_adamw_fp32.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_size_t,
                                             ctypes.c_uint64, f, f, f, f, f]
    lib.shardkit_peer_adamw_bf16.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_size_t,
                                             ctypes.c_uint64, f, f, f, f, f]
    lib.shardkit_peer_stream_fp32.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_size_t]
    lib.shardkit_peer_own_new.restype = ctypes.c_void_p
    lib.shardkit_peer_own_new.argtypes = [ptr, ptr, ctypes.c_size_t]
    lib.shardkit_peer_own_free.argtypes = [ptr]
    lib.shardkit_peer_own_adamw_fp32.argtypes = [ptr, ptr, ctypes.c_uint64, f, f, f, f, f]
    team = lib.shardkit_peer_team(args.threads)

    ds = None
    ds_version = None
    if not args.no_deepspeed:
        try:
            os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            ds = DeepSpeedCPUAdam
            ds_version = deepspeed.__version__
        except Exception as e:  # reported, not fatal: torch still runs
            print(f"peers.py: DeepSpeed unavailable ({e}); skipping it", file=sys.stderr)

    lr, b1, b2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 0.01
    results = []
    anon_huge = {}
    for n in [int(x) for x in args.sizes.split(",") if x]:
        gen = torch.Generator().manual_seed(1)
        p0 = torch.rand(n, generator=gen) - 0.5
        g0 = (torch.rand(n, generator=gen) - 0.5) * 1e-2
        contenders = {}

        def shardkit_fp32():
            p, g = p0.clone(), g0.clone()
            m, v = torch.zeros(n), torch.zeros(n)
            t = [0]

            def step():
                t[0] += 1
                lib.shardkit_peer_adamw_fp32(team, p.data_ptr(), m.data_ptr(), v.data_ptr(),
                                             g.data_ptr(), n, t[0], lr, b1, b2, eps, wd)
            return step

        def shardkit_fp32_own():
            own = lib.shardkit_peer_own_new(p0.data_ptr(), g0.data_ptr(), n)
            owned.append(own)
            t = [0]

            def step():
                t[0] += 1
                lib.shardkit_peer_own_adamw_fp32(team, own, t[0], lr, b1, b2, eps, wd)
            return step

        def stream_fp32():
            p, g = p0.clone(), g0.clone()
            m, v = torch.zeros(n), torch.zeros(n)

            def step():
                lib.shardkit_peer_stream_fp32(team, p.data_ptr(), m.data_ptr(), v.data_ptr(),
                                              g.data_ptr(), n)
            return step

        def shardkit_bf16():
            p, g = p0.clone(), g0.to(torch.bfloat16)
            m, v = torch.zeros(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            t = [0]

            def step():
                t[0] += 1
                lib.shardkit_peer_adamw_bf16(team, p.data_ptr(), m.data_ptr(), v.data_ptr(),
                                             g.data_ptr(), out.data_ptr(), n, t[0], lr, b1, b2,
                                             eps, wd)
            return step

        # One set of tensors that every "_same" contender steps (see the docstring).
        same = {"p": p0.clone(), "g": g0.clone(), "m": torch.zeros(n), "v": torch.zeros(n)}

        def shardkit_fp32_same():
            t = [0]

            def step():
                t[0] += 1
                lib.shardkit_peer_adamw_fp32(team, same["p"].data_ptr(), same["m"].data_ptr(),
                                             same["v"].data_ptr(), same["g"].data_ptr(), n, t[0],
                                             lr, b1, b2, eps, wd)
            return step

        def stream_fp32_same():
            def step():
                lib.shardkit_peer_stream_fp32(team, same["p"].data_ptr(), same["m"].data_ptr(),
                                              same["v"].data_ptr(), same["g"].data_ptr(), n)
            return step

        def torch_fused_same():
            prm = torch.nn.Parameter(same["p"])  # shares the storage
            prm.grad = same["g"]
            opt = torch.optim.AdamW([prm], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                    fused=True)
            opt.step()  # creates the state, which then points at the shared moments
            st = opt.state[prm]
            st["exp_avg"], st["exp_avg_sq"] = same["m"], same["v"]
            assert prm.data_ptr() == same["p"].data_ptr()
            return opt.step

        def deepspeed_fp32_same():
            prm = torch.nn.Parameter(same["p"])
            prm.grad = same["g"]
            opt = ds([prm], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adamw_mode=True)
            opt.state[prm].update(step=0, exp_avg=same["m"], exp_avg_sq=same["v"])
            return opt.step

        def torch_adamw(**kw):
            def make():
                prm = torch.nn.Parameter(p0.clone())
                prm.grad = g0.clone()
                opt = torch.optim.AdamW([prm], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                        **kw)
                return opt.step
            return make

        def deepspeed(dtype=torch.float32, copy=False):
            def make():
                prm = torch.nn.Parameter(p0.clone().to(dtype))
                prm.grad = g0.clone().to(dtype)
                opt = ds([prm], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adamw_mode=True)
                if not copy:
                    return opt.step
                out = torch.empty(n, dtype=torch.bfloat16)

                def step():
                    opt.step()
                    out.copy_(prm.data)
                return step
            return make

        owned = []
        contenders["shardkit_fp32"] = shardkit_fp32
        contenders["shardkit_fp32_own"] = shardkit_fp32_own
        contenders["stream_fp32"] = stream_fp32
        contenders["torch_fused"] = torch_adamw(fused=True)
        contenders["torch_foreach"] = torch_adamw(foreach=True)
        contenders["torch_forloop"] = torch_adamw(foreach=False)
        contenders["shardkit_bf16"] = shardkit_bf16
        if ds is not None:
            contenders["deepspeed_fp32"] = deepspeed()
            contenders["deepspeed_fp32_copy"] = deepspeed(copy=True)
            contenders["deepspeed_bf16"] = deepspeed(dtype=torch.bfloat16)
        contenders["shardkit_fp32_same"] = shardkit_fp32_same
        contenders["stream_fp32_same"] = stream_fp32_same
        contenders["torch_fused_same"] = torch_fused_same
        if ds is not None:
            contenders["deepspeed_fp32_same"] = deepspeed_fp32_same
        steps = {name: make() for name, make in contenders.items()}
        for s in steps.values():  # warm-up: first touch, lazy state, op loading
            s()
        anon_huge[n] = anon_huge_kib()
        per_rep = {name: [] for name in steps}
        per_rep_cpu = {name: [] for name in steps}
        names = list(steps)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                times, cpu = [], []
                for _ in range(args.steps):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    steps[name]()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
                per_rep[name].append(statistics.median(times))
                per_rep_cpu[name].append(statistics.median(cpu))
        for name in names:
            sec = statistics.median(per_rep[name])
            results.append({"n": n, "threads": args.threads, "pages": pages, "name": name,
                            "seconds": sec,
                            "gelems": n / sec / 1e9, "reps": per_rep[name],
                            "cpu_seconds": statistics.median(per_rep_cpu[name])})
        bad = [k for k, x in same.items() if not bool(torch.isfinite(x).all())]
        if bad:  # the shared tensors' speed is only comparable while their values are finite
            sys.exit(f"peers.py: the shared tensors {bad} hold non-finite values at n = {n}")
        del steps, contenders, same
        for own in owned:
            lib.shardkit_peer_own_free(own)

    lib.shardkit_peer_team_free(team)
    doc = {"meta": {"torch": torch.__version__, "deepspeed": ds_version,
                    "shardkit_isa": lib.shardkit_peer_isa().decode(),
                    "shardkit_prefetch": "on" if lib.shardkit_peer_prefetch() else "off",
                    "python": platform.python_version(), "threads": args.threads,
                    "reps": args.reps, "steps": args.steps, "pages": pages,
                    "anon_huge_kib": anon_huge},
           "results": results}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
