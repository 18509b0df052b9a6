#!/usr/bin/env python3
"""Checks examples/06_gpt end to end, on a tiny GPT and a few steps (one ctest per part).

    gpt_check.py PART --exe=PATH [--mpiexec="mpiexec -n"] [--work=DIR]

Parts:
  stages     thread ranks, N = 2: stages 0-3 give the same parameters bit for bit; each against
             the unsharded torch::optim::AdamW reference (loss within 2e-5 per step, fp32); the
             ledger equals the planner's figures; ZeRO-3's gathered peak within its bound; the
             same with --recompute (bit-identical, one all-gather per block per backward); bf16
             within the stated bound of the fp32 reference.
  resume     stop at step K with --save, resume at the same N and stage: bit-identical to the
             uninterrupted run; resume at another N and stage: the same validation loss to 1e-4;
             asynchronous saves (--save-every) on the way; --export then --eval reproduces the
             engine's validation loss exactly.
  mpi        the same under mpiexec (2 processes): bit-identical to thread ranks at the same N,
             resumable from a thread-rank checkpoint.
  errors     a missing or empty corpus, a batch that does not split, a bad flag: a message and a
             non-zero exit status.
Prints FAIL: lines and exits 1 on any failure.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

# A tiny model: 2 blocks, width 64, context 32, 8 sequences per step; 8 steps.
TINY = ["--layers", "2", "--width", "64", "--heads", "4", "--context", "32", "--batch", "8",
        "--steps", "8", "--warmup", "2", "--eval-every", "4", "--val-seqs", "8",
        "--max-bytes", "400000", "--quiet"]
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg, flush=True)


def run(cmd, expect_status=0):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if expect_status is not None and p.returncode != expect_status:
        fail(f"{shlex.join(cmd)} exited with {p.returncode}, expected {expect_status}\n"
             f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
        return None
    return p


def run_json(cmd):
    p = run(cmd + ["--json"])
    if p is None:
        return None
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError as e:
        fail(f"{shlex.join(cmd)}: output is not JSON ({e}): {p.stdout[:500]}")
        return None


def check_memory(j, what):
    led, plan = j["ledger_bytes"], j["planned_bytes"]
    for k in ["working_params", "grads", "master_params", "optimizer_moments",
              "grad_buckets (peak)", "comm_scratch (peak)"]:
        if led[k] != plan[k]:
            fail(f"{what}: ledger {k} = {led[k]} bytes, the planner says {plan[k]}")
    if j["stage"] == 3:
        if plan["gathered_params (peak)"] != j["gathered_bound_bytes"]:
            fail(f"{what}: the planner's gathered bound {plan['gathered_params (peak)']} != the "
                 f"engine's {j['gathered_bound_bytes']}")
        if not 0 < j["gathered_peak_bytes"] <= j["gathered_bound_bytes"]:
            fail(f"{what}: gathered peak {j['gathered_peak_bytes']} not within (0, bound "
                 f"{j['gathered_bound_bytes']}]")
    # The closed form of the model state (docs/accounting.md), with the exact padding: fp32
    # working parameters (their own master), gradients and 2 AdamW moments, Ψ at stage 0, the
    # padded shard S = ceil(Ψ/N) (one flat group at stage 1; per unit at stages 2 and 3).
    psi, n = j["params"], j["ranks"]
    w = 2 if j["dtype"] == "bf16" else 4
    if j["stage"] == 0:
        expect = {"working_params": w * psi, "grads": w * psi, "optimizer_moments": 8 * psi}
    elif j["stage"] == 1:
        s = -(-psi // n)
        expect = {"working_params": w * psi, "grads": w * psi, "optimizer_moments": 8 * s}
    else:
        expect = None
    if expect:
        for k, v in expect.items():
            if led[k] != v:
                fail(f"{what}: {k} = {led[k]} bytes, the closed form gives {v}")


def part_stages(a):
    hashes = {}
    for stage in range(4):
        j = run_json([a.exe, *TINY, "--ranks", "2", "--stage", str(stage), "--compare"])
        if j is None:
            continue
        what = f"stage {stage} fp32, 2 thread ranks"
        hashes[stage] = j["params_hash"]
        ref = j["reference"]
        # fp32: shardkit and torch differ by rounding only (the order of the sums over ranks,
        # AdamW's operation order): measured max |loss diff| 1e-6 over these 8 steps. A wrong
        # tied gradient (one use only) or a missing parameter group changes the loss by 1e-3
        # within a few steps.
        if not ref["max_abs_loss_diff"] <= 2e-5:
            fail(f"{what}: max |loss - torch loss| = {ref['max_abs_loss_diff']} > 2e-5")
        if not ref["max_abs_param_diff"] <= 2e-5:
            fail(f"{what}: max |param - torch param| = {ref['max_abs_param_diff']} > 2e-5")
        if not abs(j["final_val_loss"] - ref["final_val_loss"]) <= 2e-5:
            fail(f"{what}: validation loss {j['final_val_loss']} vs torch {ref['final_val_loss']}")
        if len(j["steps"]) != 8 or any(not math.isfinite(s["grad_norm"]) for s in j["steps"]):
            fail(f"{what}: expected 8 steps with finite gradient norms")
        check_memory(j, what)
        if stage == 3:
            blocks = j["gathers_forward"][1:]
            if j["gathers_forward"][0] != 1 or j["gathers_backward"][0] != 0:
                fail(f"{what}: the root unit was gathered {j['gathers_forward'][0]}/"
                     f"{j['gathers_backward'][0]} times (forward/backward), expected once, kept")
            if blocks != [1] * len(blocks) or j["gathers_backward"][1:] != [1] * len(blocks):
                fail(f"{what}: all-gathers per block {j['gathers_forward']}/"
                     f"{j['gathers_backward']}, expected 1/1")
    if len(set(hashes.values())) != 1:
        fail(f"stages 0-3 at N = 2 differ: parameter hashes {hashes}")
    # Activation recomputation: the same bits, and ZeRO-3 still gathers each block once per
    # backward (no second gather for the re-run forward).
    j = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "3", "--recompute"])
    if j is not None:
        if j["params_hash"] != hashes.get(3):
            fail(f"--recompute changed the parameters: {j['params_hash']} vs {hashes.get(3)}")
        if j["gathers_backward"][1:] != [1] * (len(j["gathers_backward"]) - 1):
            fail(f"--recompute: all-gathers per block in backward {j['gathers_backward']}")
    # Gradient accumulation (stage 1 sums micro-batches locally, stage 3 reduce-scatters each):
    # the reference up to rounding, and the planner's scratch buffers.
    for stage in (1, 3):
        j = run_json([a.exe, *TINY, "--ranks", "2", "--stage", str(stage), "--micro", "2",
                      "--compare"])
        if j is not None:
            if not j["reference"]["max_abs_loss_diff"] <= 2e-5:
                fail(f"--micro 2 stage {stage}: loss vs torch {j['reference']['max_abs_loss_diff']}")
            check_memory(j, f"--micro 2 stage {stage}")
    # bf16 working parameters against the fp32 reference: bf16 rounding of weights,
    # activations and gradients (2^-9 relative); measured max |loss diff| 2e-3 over 8 steps.
    j = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "3", "--dtype", "bf16", "--compare"])
    if j is not None:
        if not j["reference"]["max_abs_loss_diff"] <= 1e-2:
            fail(f"bf16: max |loss - torch fp32 loss| = {j['reference']['max_abs_loss_diff']}")
        check_memory(j, "bf16 stage 3")


def part_resume(a):
    work = a.work
    full = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "2"])
    ck = os.path.join(work, "ckpt")
    half = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "2", "--stop-after", "4",
                     "--save", ck, "--save-every", "2"])
    if full is None or half is None:
        return
    if half["last_step"] != 4 or not os.path.isdir(ck):
        fail(f"--stop-after 4 --save: last step {half['last_step']}, checkpoint present: "
             f"{os.path.isdir(ck)}")
        return
    same = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "2", "--resume", ck])
    if same is not None:
        if same["first_step"] != 4:
            fail(f"resumed run starts at step {same['first_step']}, expected 4")
        if same["params_hash"] != full["params_hash"] or same["final_val_loss"] != full["final_val_loss"]:
            fail(f"resumed at the same N and stage: hash {same['params_hash']} / val "
                 f"{same['final_val_loss']}, uninterrupted {full['params_hash']} / "
                 f"{full['final_val_loss']}")
        for x, y in zip(same["steps"], full["steps"][4:]):
            if x["loss"] != y["loss"]:
                fail(f"resumed step {x['step']}: loss {x['loss']} != {y['loss']}")
                break
    exported = os.path.join(work, "gpt.safetensors")
    # At another N and stage.
    other = run_json([a.exe, *TINY, "--ranks", "4", "--stage", "3", "--resume", ck,
                      "--export", exported])
    if other is not None:
        if not abs(other["final_val_loss"] - full["final_val_loss"]) <= 1e-4:
            fail(f"resumed at N = 4, stage 3: validation loss {other['final_val_loss']} vs "
                 f"{full['final_val_loss']} uninterrupted")
        p = run([a.exe, *TINY, "--eval", exported, "--json"])
        if p is not None:
            v = json.loads(p.stdout)["val_loss"]
            if v != other["final_val_loss"]:
                fail(f"--eval of the export gives {v!r}, the engine's own validation loss was "
                     f"{other['final_val_loss']!r} (expected exactly equal, fp32)")


def part_mpi(a):
    if not a.mpiexec:
        print("no mpiexec: skipped")
        return
    mpi = shlex.split(a.mpiexec)
    threads = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "3"])
    j = run_json([*mpi, "2", a.exe, *TINY, "--stage", "3"])
    if j is not None and threads is not None:
        if j["launch"] != "MPI processes" or j["ranks"] != 2:
            fail(f"under mpiexec: launch {j['launch']}, ranks {j['ranks']}")
        if j["params_hash"] != threads["params_hash"]:
            fail(f"mpiexec -np 2 stage 3: hash {j['params_hash']}, thread ranks "
                 f"{threads['params_hash']}")
        check_memory(j, "mpiexec stage 3")
    ck = os.path.join(a.work, "mpi-ckpt")
    half = run_json([*mpi, "2", a.exe, *TINY, "--stage", "1", "--stop-after", "4", "--save", ck,
                     "--save-every", "2"])
    if half is not None:
        j = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "1", "--resume", ck])
        full = run_json([a.exe, *TINY, "--ranks", "2", "--stage", "1"])
        if j is not None and full is not None and j["params_hash"] != full["params_hash"]:
            fail("an MPI checkpoint resumed on thread ranks (same N, stage) is not bit-identical")


def part_errors(a):
    empty = os.path.join(a.work, "empty")
    os.makedirs(empty, exist_ok=True)
    for args, status, text in [
        (["--data", os.path.join(a.work, "missing")], 1, "does not exist"),
        (["--data", empty], 1, "holds 0 bytes"),
        (["--ranks", "3"], 2, "must be a multiple of ranks"),
        (["--stage", "4"], 2, "--stage"),
        (["--no-such-flag"], 2, "no-such-flag"),
        (["--width", "66"], 2, "multiple of --heads"),
    ]:
        p = run([a.exe, *TINY, *args], expect_status=status)
        if p is not None and text not in p.stderr + p.stdout:
            fail(f"{args}: the message does not say '{text}': {p.stderr.strip()[:300]}")
    p = run([a.exe, "--help"], expect_status=0)
    if p is not None and "--recompute" not in p.stdout:
        fail("--help does not list --recompute")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["stages", "resume", "mpi", "errors"])
    ap.add_argument("--exe", required=True)
    ap.add_argument("--mpiexec", default="")
    ap.add_argument("--work", default="")
    a = ap.parse_args()
    own = not a.work
    a.work = a.work or tempfile.mkdtemp(prefix="gpt-check-")
    try:
        {"stages": part_stages, "resume": part_resume, "mpi": part_mpi,
         "errors": part_errors}[a.part](a)
    finally:
        if own:
            shutil.rmtree(a.work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print(f"gpt check '{a.part}': ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
