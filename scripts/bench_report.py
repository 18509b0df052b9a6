#!/usr/bin/python3
"""Turns the Google Benchmark JSON of shardkit's suites into the results page: ratios against
the baseline measured in the same binary and run (medians of the repetitions), a Markdown
summary, and PNG plots (matplotlib).

Usage: scripts/bench_report.py RESULTS_DIR [--readme benchmarks/README.md]
RESULTS_DIR holds <suite>.json (optimizer, convert, collectives, engine), engine_mpi.json,
mpi_reduce.txt and meta.txt (each optional); the
summary goes to RESULTS_DIR/summary.md and the plots to RESULTS_DIR/*.png. With --readme, the
part of that file between the bench:begin and bench:end markers is replaced by the summary.
"""

import argparse
import json
import os
import re
import statistics
import sys

UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def load(path):
    """Median rows of one suite: {name without /real_time: row}, row['t'] in seconds. Uses the
    median aggregates when present, else the median of the single runs."""
    with open(path) as f:
        data = json.load(f)
    runs = {}
    medians = {}
    cv = {}
    for b in data.get("benchmarks", []):
        name = b.get("run_name", b["name"]).replace("/real_time", "")
        row = dict(b)
        row["t"] = b["real_time"] * UNIT[b.get("time_unit", "ns")]
        agg = b.get("aggregate_name") if b.get("run_type") == "aggregate" else None
        if agg == "median":
            medians[name] = row
        elif agg == "cv":
            cv[name] = b["real_time"]  # a fraction
        elif agg is None:
            runs.setdefault(name, []).append(row)
    rows = dict(medians)
    for name, rs in runs.items():
        if name not in rows:
            rs = sorted(rs, key=lambda r: r["t"])
            rows[name] = rs[len(rs) // 2]
    for name, row in rows.items():
        row["cv"] = cv.get(name)
    return data.get("context", {}), rows


def parse(name):
    parts = name.split("/")
    keys = {}
    for p in parts[2:]:
        k, _, v = p.partition(":")
        keys[k] = v
    return parts[0], parts[1], keys


def fmt_bytes(b):
    b = float(b)
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:g} {unit}" if (b / f) >= 10 else f"{b / f:.3g} {unit}"
    return f"{b:g} B"


def fmt_size(n):
    n = int(n)
    for unit, f in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


def gbs(x):
    return f"{x / 1e9:.2f}"


def ratio(x):
    return f"{x:.2f}×" if x is not None else "–"


def plt_or_none():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("bench_report: matplotlib not found (Debian: python3-matplotlib); no plots",
              file=sys.stderr)
        return None


# ---- optimizer ------------------------------------------------------------------------------
def optimizer(rows, out, plt, targets):
    by = {}
    isa = {}
    for name, r in rows.items():
        _, what, k = parse(name)
        if what.startswith("isa_"):
            isa[(k["isa"], what[4:])] = r
            continue
        by[(int(k["n"]), int(k["threads"]), what)] = r
    sizes = sorted({k[0] for k in by})
    threads = sorted({k[1] for k in by})
    md = ["### Optimizer step (host)", "",
          "Bandwidth counts 28 bytes per element for every column (GB/s, medians); ratios are of "
          "times in the same run: roofline = `rmw` (one read-modify-write pass over the same "
          "bytes), naive = the five-pass scalar loop.", "",
          "| elements | threads | fused bf16 | fused fp32 | rmw (roofline) | memcpy | naive | "
          "bf16 / roofline | fp32 / roofline | bf16 vs naive |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    roof, naive = [], []
    for n in sizes:
        for t in threads:
            g = {w: by.get((n, t, w)) for w in ("adamw_bf16", "adamw_fp32", "rmw", "memcpy",
                                                  "naive_adam")}
            if not all(g.values()):
                continue
            bw = {w: r["bytes_per_second"] for w, r in g.items()}
            rb = g["rmw"]["t"] / g["adamw_bf16"]["t"]
            rf = g["rmw"]["t"] / g["adamw_fp32"]["t"]
            rn = g["naive_adam"]["t"] / g["adamw_bf16"]["t"]
            roof.append((n, t, rb, rf))
            naive.append((n, t, rn))
            md.append(f"| {fmt_size(n)} | {t} | {gbs(bw['adamw_bf16'])} | {gbs(bw['adamw_fp32'])} | "
                      f"{gbs(bw['rmw'])} | {gbs(bw['memcpy'])} | {gbs(bw['naive_adam'])} | "
                      f"{ratio(rb)} | {ratio(rf)} | {ratio(rn)} |")
    if roof:
        big = [x for x in roof if x[0] >= (16 << 20)] or roof
        for col, label in ((2, "bf16 grads, bf16 copy out"), (3, "all fp32")):
            for t in threads:
                xs = [x[col] for x in big if x[1] == t]
                if not xs:
                    continue
                med = statistics.median(xs)
                # issue 16: the mixed-precision step ≥ 0.90× on one thread; the rest ≥ 0.75×
                floor = 0.90 if (col == 2 and t == 1) else 0.75
                targets.append((f"Fused AdamW ({label}, {t} thread{'s' if t > 1 else ''}) ≥ "
                                f"{floor:.2f}× the read-modify-write roofline",
                                f"{min(xs):.2f}–{max(xs):.2f}× (median {med:.2f}×) over sizes "
                                f"≥ {fmt_size(big[0][0])} elements", med >= floor))
        ns = [x[2] for x in naive]
        targets.append(("Fused AdamW ≥ 2.5× the naive scalar loop",
                        f"{min(ns):.1f}–{max(ns):.1f}× (median {statistics.median(ns):.1f}×)",
                        statistics.median(ns) >= 2.5))
    lt = []
    for n in sizes:
        for t in threads:
            a, b = by.get((n, t, "adamw_fp32")), by.get((n, t, "torch_adamw_fp32"))
            if a and b:
                lt.append((n, t, b["t"] / a["t"], b["bytes_per_second"]))
    if lt:
        md += ["", "LibTorch's C++ `torch::optim::AdamW` (fp32, one parameter tensor, "
               "`torch::set_num_threads`) in the same binary, against shardkit's fp32 step:", "",
               "| elements | threads | LibTorch GB/s | shardkit fp32 / LibTorch (speed) |",
               "|---:|---:|---:|---:|"]
        for n, t, q, bw in lt:
            md.append(f"| {fmt_size(n)} | {t} | {gbs(bw)} | {ratio(q)} |")
    if isa:
        names = sorted({k[0] for k in isa}, key=lambda x: ["baseline", "avx2", "avx512",
                                                           "avx512bf16"].index(x)
                       if x in ("baseline", "avx2", "avx512", "avx512bf16") else 9)
        n0 = int(next(iter(isa.values()))["elements"])
        md += ["", f"Every build of the host loops on this CPU ({fmt_size(n0)} elements, 1 "
               "thread; GB/s at 28 bytes/element; ratio = the build's roofline time / its "
               "step time):", "",
               "| build | fused bf16 | fused fp32 | rmw (roofline) | bf16 / roofline | "
               "fp32 / roofline |", "|---|---:|---:|---:|---:|---:|"]
        for i in names:
            b, f, r = isa.get((i, "adamw_bf16")), isa.get((i, "adamw_fp32")), isa.get((i, "rmw"))
            if not (b and f and r):
                continue
            md.append(f"| {i} | {gbs(b['bytes_per_second'])} | {gbs(f['bytes_per_second'])} | "
                      f"{gbs(r['bytes_per_second'])} | {ratio(r['t'] / b['t'])} | "
                      f"{ratio(r['t'] / f['t'])} |")
    md += prefetch_table(rows)
    if plt and sizes:
        fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.2), squeeze=False)
        for ax, t in zip(axes[0], threads):
            for w, style in (("adamw_bf16", "o-"), ("adamw_fp32", "s-"), ("rmw", "k--"),
                             ("memcpy", "k:"), ("naive_adam", "x-"), ("torch_adamw_fp32", "d-")):
                xs = [n for n in sizes if (n, t, w) in by]
                ax.plot(xs, [by[(n, t, w)]["bytes_per_second"] / 1e9 for n in xs], style,
                        label=w + (" (roofline)" if w == "rmw" else ""))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("elements")
            ax.set_ylabel("GB/s (28 bytes/element)")
            ax.set_title(f"optimizer step, {t} thread(s)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "optimizer.png"), dpi=90)
        plt.close(fig)
        md += ["", "![optimizer step bandwidth](results/optimizer.png)"]
    return md


def prefetch_table(rows):
    """The suite's `prefetch_<op>/prefetch:on|off` pairs (same binary, same run): how much
    faster each loop runs with software prefetch (kernels/host/prefetch.hpp)."""
    pairs = {}
    for name, r in rows.items():
        _, what, k = parse(name)
        if what.startswith("prefetch_") and k.get("prefetch") in ("on", "off"):
            pairs.setdefault((what[len("prefetch_"):], int(k["n"])), {})[k["prefetch"]] = r
    lines = [(op, n, p) for (op, n), p in sorted(pairs.items()) if "on" in p and "off" in p]
    if not lines:
        return []
    md = ["", "Software prefetch on and off (kernels/host/prefetch.hpp; one thread; time off / "
          "time on above 1: prefetch pays):", "",
          "| loop | elements | on GB/s | off GB/s | off / on |", "|---|---:|---:|---:|---:|"]
    for op, n, p in lines:
        md.append(f"| {op} | {fmt_size(n)} | {gbs(p['on']['bytes_per_second'])} | "
                  f"{gbs(p['off']['bytes_per_second'])} | {ratio(p['off']['t'] / p['on']['t'])} |")
    return md


# ---- convert --------------------------------------------------------------------------------
def convert(rows, out, plt, targets):
    memcpy = {}
    ops = {}
    reads = {}  # cast then read, by store kind
    for name, r in rows.items():
        _, what, k = parse(name)
        if what == "memcpy":
            memcpy[int(k["bytes"])] = r
        elif what.startswith("cast_read_"):
            reads.setdefault(what.rsplit("_", 1)[1], {})[int(k["n"])] = r
        elif not what.startswith("prefetch_"):  # prefetch_table's
            ops.setdefault(what, {})[int(k["n"])] = r
    md = ["### Flatten/pad and casts", "",
          "Traffic = bytes read + bytes written; each operation against memcpy moving the same "
          "traffic, same run.", "",
          "| operation | elements | traffic | GB/s | memcpy GB/s | ratio to memcpy |",
          "|---|---:|---:|---:|---:|---:|"]
    flat = {}
    for op in sorted(ops):
        for n in sorted(ops[op]):
            r = ops[op][n]
            m = memcpy.get(int(r["bytes"]))
            q = m["t"] / r["t"] if m else None
            # the *_cached casts are the same binary's baseline for the streaming stores
            if ((op.startswith("flatten") or "f16" in op) and not op.endswith("_cached")
                    and q is not None):
                flat.setdefault(op, []).append(q)
            md.append(f"| {op} | {int(r['elements'])} | {fmt_bytes(r['bytes'])} | "
                      f"{gbs(r['bytes_per_second'])} | "
                      f"{gbs(m['bytes_per_second']) if m else '–'} | {ratio(q)} |")
    for op, qs in sorted(flat.items()):
        # issue 16: the fp32 -> bf16 flatten and the fp16 casts ≥ 0.9× memcpy
        if op == "flatten_bf16":
            what, floor = "Flatten/pad (bf16 → bf16)", 0.8
        elif op == "flatten_f32_bf16":
            what, floor = "Flatten/pad (fp32 → bf16, with the cast)", 0.9
        else:
            what, floor = f"Cast {op[5:].replace('_', ' → ')}", 0.9
        targets.append((f"{what} ≥ {floor}× memcpy",
                        f"{min(qs):.2f}–{max(qs):.2f}× (median {statistics.median(qs):.2f}×) "
                        "over all sizes", statistics.median(qs) >= floor))
    if reads.get("cached") and reads.get("streaming"):
        md += ["", "A cast fp32 → bf16 followed by a read of its output: time with ordinary stores "
               "over time with streaming stores (above 1: streaming pays; "
               "host::streaming_threshold() is set where it starts to):", "",
               "| elements | bytes read + written by the cast | cached µs | streaming µs | "
               "cached / streaming |", "|---:|---:|---:|---:|---:|"]
        for n in sorted(set(reads["cached"]) & set(reads["streaming"])):
            c, t = reads["cached"][n]["t"], reads["streaming"][n]["t"]
            md.append(f"| {n} | {fmt_bytes(6 * n)} | {c * 1e6:.1f} | {t * 1e6:.1f} | {ratio(c / t)} |")
    md += prefetch_table(rows)
    if plt and ops:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for op in sorted(ops):
            xs = sorted(ops[op])
            ax.plot([ops[op][n]["bytes"] for n in xs],
                    [ops[op][n]["bytes_per_second"] / 1e9 for n in xs], "o-", label=op)
        xs = sorted(memcpy)
        ax.plot(xs, [memcpy[b]["bytes_per_second"] / 1e9 for b in xs], "k--", label="memcpy")
        ax.set_xscale("log")
        ax.set_xlabel("traffic per call (bytes read + written)")
        ax.set_ylabel("GB/s")
        ax.set_title("flatten/pad and casts against memcpy")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "convert.png"), dpi=90)
        plt.close(fig)
        md += ["", "![flatten and cast bandwidth](results/convert.png)"]
    return md


# ---- collectives ----------------------------------------------------------------------------
def collectives(rows, out, plt, targets):
    by = {}
    lat = {}
    for name, r in rows.items():
        _, what, k = parse(name)
        if what.startswith("latency_"):
            lat[(what[8:], int(k["ranks"]))] = r
            continue
        by[(what, int(k["ranks"]), int(k["bytes"]))] = r
    ops = ["all_reduce", "reduce_scatter", "all_gather"]
    ranks = sorted({k[1] for k in by})
    sizes = sorted({k[2] for k in by})
    md = ["### Thread-communicator collectives", "",
          "fp32 sum, out of place; size = the full array (nccl-tests). busbw in GB/s (median); "
          "ratio = time / time of the memcpy lower bound (every rank copying, at the same time, "
          "the least traffic the collective needs of it), same run.", ""]
    big = {o: [] for o in ops}
    for n in ranks:
        md += [f"N = {n}:", "",
               "| size | " + " | ".join(f"{o} busbw | {o} / bound" for o in ops) + " |",
               "|---:|" + "---:|---:|" * len(ops)]
        for b in sizes:
            cells = []
            for o in ops:
                r, lb = by.get((o, n, b)), by.get(("bound_" + o, n, b))
                if not r or not lb:
                    cells += ["–", "–"]
                    continue
                q = r["t"] / lb["t"]
                if b >= (1 << 20):
                    big[o].append(q)
                cells += [gbs(r["busbw"]), ratio(q)]
            md.append(f"| {fmt_bytes(b)} | " + " | ".join(cells) + " |")
        md.append("")
    for o in ops:
        if big[o]:
            lim = 1.2 if o == "all_reduce" else 1.3  # issue 16: the one-pass all-reduce ≤ 1.2×
            targets.append((f"Thread {o} ≤ {lim}× the memcpy lower bound (≥ 1 MB)",
                            f"{min(big[o]):.2f}–{max(big[o]):.2f}× (median "
                            f"{statistics.median(big[o]):.2f}×)",
                            statistics.median(big[o]) <= lim))
    if lat:
        md += ["Small collectives: time per 4 KiB collective (µs, each rank issuing 256 back to "
               "back) against N threads passing a spin barrier (bench::spin_barrier) as often, "
               "same binary:", "",
               "| ranks | spin barrier (µs) | " + " | ".join(f"{o} (µs) | ratio" for o in ops) +
               " |", "|---:|---:|" + "---:|---:|" * len(ops)]
        for n in sorted({k[1] for k in lat}):
            b = lat.get(("spin_barrier", n))
            if not b:
                continue
            tb = 1.0 / b["items_per_second"]
            cells = []
            for o in ops:
                r = lat.get((o, n))
                if r:
                    t = 1.0 / r["items_per_second"]
                    cells += [f"{t * 1e6:.2f}", ratio(t / tb)]
                else:
                    cells += ["–", "–"]
            md.append(f"| {n} | {tb * 1e6:.2f} | " + " | ".join(cells) + " |")
        md.append("")
    if plt and by:
        fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4.2), squeeze=False)
        for ax, n in zip(axes[0], ranks):
            for i, o in enumerate(ops):
                c = f"C{i}"
                xs = [b for b in sizes if (o, n, b) in by]
                ax.plot(xs, [by[(o, n, b)]["busbw"] / 1e9 for b in xs], "o-", color=c, label=o)
                xs = [b for b in sizes if ("bound_" + o, n, b) in by]
                ax.plot(xs, [by[("bound_" + o, n, b)]["busbw"] / 1e9 for b in xs], "--", color=c,
                        label=o + " memcpy bound")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes (full array)")
            ax.set_ylabel("busbw GB/s")
            ax.set_title(f"thread communicator, N = {n}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "collectives.png"), dpi=90)
        plt.close(fig)
        md += ["![collective bus bandwidth](results/collectives.png)"]
    return md


# ---- engine ---------------------------------------------------------------------------------
ENGINE_TARGETS = ((1, 1.1), (2, 1.1), (3, 1.3))  # thread ranks (N = 4): stage, ratio to stage 0
ENGINE_MPI_TARGETS = ((1, 1.05), (2, 1.05), (3, 1.2))  # one core per MPI process


def fmt_params(p):
    p = int(p)
    return f"{p / 1e6:.1f}M" if p >= 1e6 else f"{p / 1e3:.1f}K"


def engine(rows, out, plt, targets, context=None):
    """engine/step/stage:S/ranks:N/params:P: step time against Ψ, one line per (stage, N), and
    the ratio of each stage to stage 0 at the same Ψ and N. (Older runs had no ranks key: N = 4.)"""
    by = {}
    fresh = {}  # engine/step_fresh: ZeRO-3 without reusing gathered buffers, by (N, Ψ)
    kept = {}  # engine/step_kept: ZeRO-3 keeping its gathered buffers between steps, by (N, Ψ)
    for name, r in rows.items():
        _, op, k = parse(name)
        n = int(k.get("ranks", r.get("ranks", 4)))
        key = (int(k["stage"]), n, int(k.get("params", r.get("params", 0))))
        if op == "step_fresh":
            fresh[key[1:]] = r
        elif op == "step_kept":
            kept[key[1:]] = r
        else:
            by[key] = r
    if not by:
        return []
    stages = sorted({k[0] for k in by})
    ranks = sorted({k[1] for k in by})
    psis = sorted({k[2] for k in by})
    cores = next(iter(by.values())).get("cores")
    md = ["### Engine step", "",
          "One full step (hooks, grad_ready of every gradient, step()) of L units of a d×d "
          "weight and a bias, bf16 working parameters, AdamW, N thread ranks; median time and "
          "ratio to stage 0 at the same Ψ and N, same run."]
    if cores:
        over = [n for n in ranks if n > cores]
        if over:
            md[-1] += (f" N = {', '.join(map(str, over))} oversubscribes the {int(cores)} "
                       "cores: the ranks take turns, so those times grow with N by design.")
    md += ["", "| Ψ | N | " + " | ".join(f"stage {s} (ms)" for s in stages) + " | " +
           " | ".join(f"{s} / 0" for s in stages if s != 0) + " | bytes sent by rank 0 (stage " +
           f"{stages[-1]}) |", "|---:|---:|" + "---:|" * (2 * len(stages) - 1 + 1)]
    for p in psis:
        for n in ranks:
            if not any((s, n, p) in by for s in stages):
                continue
            base = by.get((0, n, p))
            cells = [f"{by[(s, n, p)]['t'] * 1e3:.2f}" if (s, n, p) in by else "skipped"
                     for s in stages]
            qs = [ratio(by[(s, n, p)]["t"] / base["t"]) if base and (s, n, p) in by else "–"
                  for s in stages if s != 0]
            last = by.get((stages[-1], n, p))
            sent = f"{int(last['sent']):,}" if last else "–"
            md.append(f"| {fmt_params(p)} | {n} | " + " | ".join(cells) + " | " + " | ".join(qs) +
                      f" | {sent} |")
    pairs = [(n, p) for (n, p) in sorted(fresh) if (3, n, p) in by]
    if pairs:
        md += ["", "ZeRO-3 with `engine_options::reuse_gathered_buffers` off (every gather in a "
               "buffer of its own, allocated and freed) against the default (released units' "
               "buffers reused within the step), same run:", "",
               "| Ψ | N | stage 3, fresh buffers (ms) | stage 3 (ms) | fresh / reused |",
               "|---:|---:|---:|---:|---:|"]
        for n, p in pairs:
            a, b = fresh[(n, p)]["t"], by[(3, n, p)]["t"]
            md.append(f"| {fmt_params(p)} | {n} | {a * 1e3:.2f} | {b * 1e3:.2f} | "
                      f"{ratio(a / b)} |")
    pairs = [(n, p) for (n, p) in sorted(kept) if (3, n, p) in by and (0, n, p) in by]
    if pairs:
        md += ["", "ZeRO-3 with `engine_options::keep_gathered_buffers` (the reused buffers kept "
               "from one step to the next, so a step allocates none) against the default, same "
               "run; rank 0's forward hooks (where ZeRO-3 gathers) in brackets:", "",
               "| Ψ | N | stage 3, buffers kept (ms) | stage 3 (ms) | kept / default | "
               "kept / stage 0 |", "|---:|---:|---:|---:|---:|---:|"]
        for n, p in pairs:
            a, b, z = kept[(n, p)], by[(3, n, p)], by[(0, n, p)]
            fa, fb = a.get("fwd_ms"), b.get("fwd_ms")
            br = (lambda f: f" ({f:.2f})" if f is not None else "")
            md.append(f"| {fmt_params(p)} | {n} | {a['t'] * 1e3:.2f}{br(fa)} | "
                      f"{b['t'] * 1e3:.2f}{br(fb)} | {ratio(a['t'] / b['t'])} | "
                      f"{ratio(a['t'] / z['t'])} |")
    skipped = (context or {}).get("engine_skipped")
    if skipped:
        md += ["", "Skipped (host memory): " + skipped + "."]
    # The targets at N = 4 (the thread-rank case), at the largest Ψ measured there.
    at4 = [p for p in psis if (0, 4, p) in by]
    if at4:
        p = at4[-1]
        for s, lim in ENGINE_TARGETS:
            if (s, 4, p) in by:
                q = by[(s, 4, p)]["t"] / by[(0, 4, p)]["t"]
                targets.append((f"Stage {s} step ≤ {lim}× stage 0 (N = 4 threads, "
                                f"{fmt_params(p)} params)", f"{q:.2f}×", q <= lim))
    if plt:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        styles = ["-", "--", "-.", ":"]
        for j, n in enumerate(ranks):
            for s in stages:
                xs = [p for p in psis if (s, n, p) in by]
                if xs:
                    ax.plot(xs, [by[(s, n, p)]["t"] * 1e3 for p in xs], styles[j % 4], marker="o",
                            markersize=3, color=f"C{s}", label=f"stage {s}, N = {n}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters Ψ")
        ax.set_ylabel("step time (ms)")
        ax.set_title("engine step, thread ranks (colour: stage; line style: N)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(ranks))
        fig.tight_layout()
        fig.savefig(os.path.join(out, "engine.png"), dpi=90)
        plt.close(fig)
        md += ["", "![engine step time against Ψ](results/engine.png)"]
    return md


def engine_mpi(path, out, plt, targets):
    """benchmarks/engine_mpi.cpp's JSON: one process per rank, stages stepped in turn."""
    with open(path) as f:
        d = json.load(f)
    res = d.get("results", [])
    if not res:
        return []
    n = d.get("processes")
    by = {(r["params"], r["stage"]): r for r in res if not r.get("kept_gathered_buffers")}
    kept = {r["params"]: r for r in res if r.get("kept_gathered_buffers")}
    psis = sorted({r["params"] for r in res})
    stages = sorted({r["stage"] for r in res})
    md = ["### Engine step over MPI, one core per rank", "",
          f"`shardkit_bench_engine_mpi`: {n} processes, the stages' engines built together "
          f"and stepped in turn; median of {d.get('reps')} rounds of the slowest rank's time "
          "per step, and the median over rounds of the ratio to the same round's stage 0.", "",
          "| Ψ | " + " | ".join(f"stage {s} (ms)" for s in stages) + " | " +
          " | ".join(f"{s} / 0" for s in stages if s != 0) + " |",
          "|---:|" + "---:|" * (2 * len(stages) - 1)]
    for p in psis:
        cells = [f"{by[(p, s)]['median_s'] * 1e3:.2f}" if (p, s) in by else "–" for s in stages]
        qs = [ratio(by[(p, s)]["ratio"]) if (p, s) in by else "–" for s in stages if s != 0]
        md.append(f"| {fmt_params(p)} | " + " | ".join(cells) + " | " + " | ".join(qs) + " |")
    if kept:
        md += ["", "Stage 3 with `engine_options::keep_gathered_buffers` (its gathered buffers "
               "kept from one step to the next), stepped in the same rounds: " +
               ", ".join(f"{fmt_params(p)}: {kept[p]['median_s'] * 1e3:.2f} ms, "
                         f"{ratio(kept[p]['ratio'])} stage 0" for p in sorted(kept)) + "."]
    if any("forward_s" in r for r in res):
        md += ["", "Where the step's time goes (ms; each part's slowest rank, medians over the "
               "rounds): the forward's hooks (ZeRO-3 gathers there), the backward's hooks and "
               "`grad_ready` (ZeRO-2/3 reduce-scatter there), and `step()`.", "",
               "| Ψ | stage | forward | backward | step() |", "|---:|---:|---:|---:|---:|"]
        rows_ = [(p, str(s), by[(p, s)]) for p in psis for s in stages if (p, s) in by]
        rows_ += [(p, "3, kept", kept[p]) for p in sorted(kept)]
        for p, label, r in sorted(rows_, key=lambda x: (x[0], x[1])):
            if "forward_s" in r:
                md.append(f"| {fmt_params(p)} | {label} | {r['forward_s'] * 1e3:.2f} | "
                          f"{r['backward_s'] * 1e3:.2f} | {r['step_call_s'] * 1e3:.2f} |")
    if d.get("skipped"):
        md += ["", "Skipped (host memory): " + "; ".join(d["skipped"]) + "."]
    for s, lim in ENGINE_MPI_TARGETS:
        qs = [by[(p, s)]["ratio"] for p in psis if (p, s) in by]
        if qs:
            targets.append((f"Stage {s} step ≤ {lim}× stage 0 (MPI, one core per rank, every Ψ)",
                            f"{min(qs):.2f}–{max(qs):.2f}×", max(qs) <= lim))
    if plt:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for s in stages:
            xs = [p for p in psis if (p, s) in by]
            ax.plot(xs, [by[(p, s)]["median_s"] * 1e3 for p in xs], marker="o", color=f"C{s}",
                    label=f"stage {s}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters Ψ")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"engine step over MPI, {n} processes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "engine_mpi.png"), dpi=90)
        plt.close(fig)
        md += ["", "![engine step over MPI](results/engine_mpi.png)"]
    return md


# ---- peers: torch and DeepSpeed in the same process (benchmarks/peers.py) --------------------
PEER_TARGETS = (  # (ours, theirs, floor, label); floor None: reported, not a target
    ("shardkit_fp32_same", "deepspeed_fp32_same", 1.05,
     "fp32 AdamW step ≥ 1.05× DeepSpeed's CPU Adam, on the same tensors"),
    ("shardkit_fp32_same", "torch_fused_same", 1.05,
     "fp32 AdamW step ≥ 1.05× torch's fused AdamW, on the same tensors"),
    ("shardkit_fp32", "deepspeed_fp32", 1.05,
     "fp32 AdamW step ≥ 1.05× DeepSpeed's CPU Adam, each on tensors of its own"),
    ("shardkit_fp32", "torch_fused", 1.05,
     "fp32 AdamW step ≥ 1.05× torch's fused AdamW, each on tensors of its own"),
    ("shardkit_fp32", "torch_forloop", 4.0, "fp32 AdamW step ≥ 4× torch's for-loop AdamW"),
    ("shardkit_bf16", "deepspeed_fp32_copy", 1.0,
     "mixed-precision step ≥ 1.0× DeepSpeed's CPU Adam with the 16-bit copy"),
    ("shardkit_fp32_own", "torch_fused", None, ""),
    ("shardkit_fp32_own", "deepspeed_fp32", None, ""),
    ("shardkit_fp32", "stream_fp32", None, ""),
    ("torch_fused", "stream_fp32", None, ""),
    ("shardkit_fp32_same", "stream_fp32_same", None, ""),
    ("torch_fused_same", "stream_fp32_same", None, ""),
    ("deepspeed_fp32_same", "stream_fp32_same", None, ""),
)


def paired_ratios(ours, theirs):
    """Time of theirs / time of ours within each repetition (the two ran within a second of each
    other, so the machine's slow swings in memory bandwidth cancel); None where repetitions are
    not saved."""
    ra, rb = ours.get("reps"), theirs.get("reps")
    if ra and rb and len(ra) == len(rb):
        return [y / x for x, y in zip(ra, rb)]
    return None


def paired_ratio(ours, theirs):
    """The median over repetitions of paired_ratios, or the ratio of the medians where
    repetitions are not saved."""
    qs = paired_ratios(ours, theirs)
    return statistics.median(qs) if qs else theirs["seconds"] / ours["seconds"]


def median_ci95(xs):
    """A distribution-free 95% interval for the median of xs: the order statistics x_(k) and
    x_(n+1-k), k the largest rank with P(Binomial(n, 1/2) < k) <= 2.5%, so that the true median
    lies between them with at least 95% probability whatever the distribution. None for fewer
    than 6 values, which cannot give one."""
    xs = sorted(xs)
    n = len(xs)
    term, below, k = 0.5 ** n, 0.0, 0  # term = P(B = j)
    for j in range(n):
        if below + term > 0.025:
            break
        below += term
        k = j + 1
        term *= (n - j) / (j + 1)
    return (xs[k - 1], xs[n - k]) if k else None


def verdict(ci, floor):
    """Where a median stands against a floor, judged by its interval: met (all of the interval at
    or above the floor), missed (all of it below), open (it straddles the floor, or no interval:
    the repetitions do not decide)."""
    if ci is None:
        return "open"
    return "met" if ci[0] >= floor else "missed" if ci[1] < floor else "open"


def peers(paths, out, plt, targets):
    res, meta = [], {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        meta = meta or d.get("meta", {})
        res += d.get("results", [])
    if not res:
        return []
    for r in res:
        r.setdefault("pages", "4KiB")
    by = {(r["n"], r["threads"], r["pages"], r["name"]): r for r in res}
    sizes = sorted({r["n"] for r in res})
    threads = sorted({r["threads"] for r in res})
    pages = sorted({r["pages"] for r in res}, key=lambda x: x != "4KiB")
    rows = [(n, t, pg) for n in sizes for t in threads for pg in pages]
    names = []
    for r in res:
        if r["name"] not in names:
            names.append(r["name"])
    md = ["### Peers: torch and DeepSpeed, same process", "",
          f"`scripts/bench --peers`: torch {meta.get('torch')}, DeepSpeed "
          f"{meta.get('deepspeed')}, shardkit's {meta.get('shardkit_isa')} build (software "
          f"prefetch {meta.get('shardkit_prefetch', 'on')}); one Python "
          "process per thread count and page size (`torch.set_num_threads`, `OMP_NUM_THREADS`; "
          "pages: torch's allocator as shipped, 4 KiB, or on transparent huge pages with "
          "`THP_MEM_ALLOC_ENABLE=1`), tensors allocated by torch except shardkit_fp32_own's "
          "(shardkit's own buffers, always on huge pages), contenders interleaved; median over "
          f"{meta.get('reps')} repetitions of each repetition's median of {meta.get('steps')} "
          "steps. Each contender steps tensors of its own, except the `_same` ones, which take "
          "turns on one shared set, so that where the tensors lie is the same for all of them. "
          "Giga-elements per second (AdamW; stream_fp32 is the roofline, the same bytes with "
          "one add per array):", "",
          "| elements | threads | pages | " + " | ".join(names) + " |",
          "|---:|---:|---|" + "---:|" * len(names)]
    for n, t, pg in rows:
        cells = [f"{by[(n, t, pg, x)]['gelems']:.3f}" if (n, t, pg, x) in by else "–"
                 for x in names]
        if any(c != "–" for c in cells):
            md.append(f"| {fmt_size(n)} | {t} | {pg} | " + " | ".join(cells) + " |")
    md += ["", "Same-run ratios (time of theirs / time of ours; median over repetitions of the "
           "ratio within each repetition):", "",
           "| elements | threads | pages | " +
           " | ".join(f"{a} / {b}" for a, b, _, _ in PEER_TARGETS) + " |",
           "|---:|---:|---|" + "---:|" * len(PEER_TARGETS)]
    got = {i: [] for i in range(len(PEER_TARGETS))}
    for n, t, pg in rows:
        cells = []
        for i, (a, b, _, _) in enumerate(PEER_TARGETS):
            ra, rb = by.get((n, t, pg, a)), by.get((n, t, pg, b))
            if ra and rb:
                q = paired_ratio(ra, rb)
                cells.append(ratio(q))
                if n >= (16 << 20):
                    got[i].append((n, t, pg, q))
            else:
                cells.append("–")
        if any(c != "–" for c in cells):
            md.append(f"| {fmt_size(n)} | {t} | {pg} | " + " | ".join(cells) + " |")
    # One thread: the same ratios from the CPU time of the calling thread, which a loaded
    # machine does not inflate (every contender runs the whole step on that thread).
    for n, t, pg in rows:
        if t != 1:
            continue
        cells = []
        for a, b, _, _ in PEER_TARGETS:
            ra, rb = by.get((n, 1, pg, a)), by.get((n, 1, pg, b))
            if ra and rb and ra.get("cpu_seconds") and rb.get("cpu_seconds"):
                cells.append(ratio(rb["cpu_seconds"] / ra["cpu_seconds"]))
            else:
                cells.append("–")
        if any(c != "–" for c in cells):
            md.append(f"| {fmt_size(n)} | 1 (CPU time) | {pg} | " + " | ".join(cells) + " |")
    # How sure each target's median is: its interval over the repetitions and the verdict.
    floors = [(i, x) for i, x in enumerate(PEER_TARGETS) if x[2] is not None]
    sure = {i: [] for i, _ in floors}
    md += ["", "How sure the targets' medians are: each same-run ratio above with its "
           "distribution-free 95% interval over the repetitions (order statistics), and against "
           "the target's floor: met (the whole interval at or above it), missed (all of it "
           "below), open (it straddles the floor: these repetitions do not decide):", "",
           "| elements | threads | pages | " +
           " | ".join(f"{a} / {b} (≥ {fl:g})" for _, (a, b, fl, _) in floors) + " |",
           "|---:|---:|---|" + "---|" * len(floors)]
    for n, t, pg in rows:
        cells = []
        for i, (a, b, fl, _) in floors:
            ra, rb = by.get((n, t, pg, a)), by.get((n, t, pg, b))
            qs = paired_ratios(ra, rb) if ra and rb else None
            if not qs:
                cells.append("–")
                continue
            ci = median_ci95(qs)
            v = verdict(ci, fl)
            if n >= (16 << 20):
                sure[i].append((pg, v))
            span = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "no interval"
            cells.append(f"{statistics.median(qs):.2f} ({span}) {v}")
        if any(c != "–" for c in cells):
            md.append(f"| {fmt_size(n)} | {t} | {pg} | " + " | ".join(cells) + " |")
    for i, (a, b, floor, label) in enumerate(PEER_TARGETS):
        if floor is None:
            continue
        for pg in pages:
            xs = [x for x in got[i] if x[2] == pg]
            if xs:
                worst = min(xs, key=lambda x: x[3])
                vs = [v for p, v in sure.get(i, []) if p == pg]
                tally = ", ".join(f"{vs.count(k)} {k}" for k in ("met", "open", "missed")
                                  if vs.count(k))
                targets.append((label + f" (≥ 16Mi elements, every thread count, {pg} pages)",
                                f"{worst[3]:.2f}–{max(x[3] for x in xs):.2f}× (lowest at "
                                f"{fmt_size(worst[0])}, {worst[1]} thread(s))" +
                                (f"; by the cells' 95% intervals: {tally}"
                                 if tally else ""),
                                worst[3] >= floor))
    if plt:
        fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
        series = [(t, pg) for t in threads for pg in pages]
        for ax, n in zip(axes[0], sizes):
            w = 0.8 / max(len(series), 1)
            for j, (t, pg) in enumerate(series):
                xs = [i + j * w for i in range(len(names))]
                ax.bar(xs, [by[(n, t, pg, x)]["gelems"] if (n, t, pg, x) in by else 0
                            for x in names], width=w, label=f"{t} thread(s), {pg} pages")
            ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(names))])
            ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel("Gelem/s")
            ax.set_title(f"AdamW step, {fmt_size(n)} elements")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "peers.png"), dpi=90)
        plt.close(fig)
        md += ["", "![peers](results/peers.png)"]
    return md


# ---- MPI: mpi_comm against the raw MPI calls (benchmarks/mpi_reduce.cpp's table) -------------
def mpi(path, targets):
    rows = []
    for line in open(path):
        m = re.match(r"\s*(\d+) (KiB|MiB)\s*\|\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*\|"
                     r"\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)x", line)
        if m:
            b = int(m.group(1)) << (10 if m.group(2) == "KiB" else 20)
            rows.append((b, *(float(m.group(i)) for i in range(3, 9))))
    if not rows:
        return []
    md = ["### MPI communicator", "",
          "`mpi_comm` (rank-ordered reduction: an all-to-all of slices, then a local sum in rank "
          "order; bit-identical to the thread communicator) against `MPI_Reduce_scatter_block` "
          "and `MPI_Allreduce` of the same buffer, float sum, 4 processes; median of the "
          "slowest rank's time per call.", "",
          "| buffer | reduce-scatter MPI (µs) | shardkit (µs) | ratio | all-reduce MPI (µs) | "
          "shardkit (µs) | ratio |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for b, rs_m, rs_s, rs_q, ar_m, ar_s, ar_q in rows:
        md.append(f"| {fmt_bytes(b)} | {rs_m:.1f} | {rs_s:.1f} | {rs_q:.2f}× | {ar_m:.1f} | "
                  f"{ar_s:.1f} | {ar_q:.2f}× |")
    for name, col in (("reduce_scatter", 3), ("all_reduce", 6)):
        big = [r[col] for r in rows if r[0] >= (1 << 20)] or [r[col] for r in rows]
        targets.append((f"MPI {name} wrapper ≤ 1.05× the raw MPI call (≥ 1 MiB)",
                        f"{min(big):.2f}–{max(big):.2f}× (median {statistics.median(big):.2f}×)",
                        statistics.median(big) <= 1.05))
    return md


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--readme")
    a = ap.parse_args()
    plt = plt_or_none()
    targets = []
    sections = []
    context = {}
    for suite, fn in (("optimizer", optimizer), ("convert", convert),
                      ("collectives", collectives), ("engine", engine)):
        path = os.path.join(a.results, suite + ".json")
        if not os.path.exists(path):
            continue
        ctx, rows = load(path)
        context = context or ctx
        if fn is engine:
            sections.append(engine(rows, a.results, plt, targets, ctx))
        else:
            sections.append(fn(rows, a.results, plt, targets))
    engine_mpi_path = os.path.join(a.results, "engine_mpi.json")
    if os.path.exists(engine_mpi_path):
        sections.append(engine_mpi(engine_mpi_path, a.results, plt, targets))
    peer_paths = sorted(p for p in (os.path.join(a.results, f) for f in os.listdir(a.results))
                        if os.path.basename(p).startswith("peers_") and p.endswith(".json"))
    if peer_paths:
        sections.append(peers(peer_paths, a.results, plt, targets))
    mpi_path = os.path.join(a.results, "mpi_reduce.txt")
    if os.path.exists(mpi_path):
        sections.append(mpi(mpi_path, targets))
    meta = ""
    mp = os.path.join(a.results, "meta.txt")
    if os.path.exists(mp):
        meta = open(mp).read().strip()
    md = ["## Latest results", ""]
    if meta:
        md += [meta, ""]
    if context:
        md += [f"Google Benchmark context: {context.get('num_cpus')} CPUs at "
               f"{context.get('mhz_per_cpu')} MHz, host ISA of shardkit's loops: "
               f"{context.get('shardkit_host_isa', 'see optimizer.json')} (software prefetch "
               f"{context.get('shardkit_host_prefetch', 'on')}), library build "
               f"{context.get('library_build_type')}.", ""]
    md += ["### Targets", "", "| target | measured | met |", "|---|---|:---:|"]
    for name, got, ok in targets:
        md.append(f"| {name} | {got} | {'yes' if ok else '**no**'} |")
    md.append("")
    for s in sections:
        md += s + [""]
    text = "\n".join(md).rstrip() + "\n"
    with open(os.path.join(a.results, "summary.md"), "w") as f:
        f.write(text)
    if a.readme:
        with open(a.readme) as f:
            readme = f.read()
        new, k = re.subn(r"<!-- bench:begin -->.*<!-- bench:end -->",
                         lambda _: "<!-- bench:begin -->\n" + text + "<!-- bench:end -->", readme,
                         flags=re.S)
        if k != 1:
            sys.exit("bench_report: the README has no bench:begin/bench:end markers")
        with open(a.readme, "w") as f:
            f.write(new)
    print(text)


if __name__ == "__main__":
    main()
