#!/usr/bin/env python3
"""shardkit's safetensors files and the Python safetensors library read each other's files.

  interop_check.py --helper <shardkit_io_helper> --work <dir> --venv <dir>

Creates (once; reused while it works) a virtual environment with the PyPI packages safetensors
and numpy, then, in it:
  - fp32: a file exported by shardkit (3 thread ranks, ZeRO-3) loads with safetensors.numpy:
    the names, shapes, dtypes, metadata and every value's bits are what shardkit wrote; a
    slice read through safe_open is the same part of the tensor;
  - bf16: safe_open opens shardkit's bf16 export: keys, dtype BF16, shapes and metadata as
    written (numpy has no bfloat16: the values are compared as the raw 16-bit words at the
    offsets the header gives);
  - a file written by safetensors.numpy.save_file (F32 and F16, a scalar, a zero-size tensor)
    is imported by shardkit (io::safetensors_file + add_from_safetensors, at two world sizes
    and stages) with the same values.
Exit status 0 when all hold; otherwise a message says what did not. Without PyPI the test
fails (it is never skipped): pip's own message is shown.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import venv

PACKAGES = ["safetensors", "numpy"]


def fail(msg):
    sys.exit("interop_check: " + msg)


def ensure_venv(path):
    """The virtual environment's python, creating the environment when it is not ready."""
    py = os.path.join(path, "bin", "python")
    ready = os.path.join(path, ".shardkit-ready")
    if os.path.exists(ready) and os.path.exists(py):
        r = subprocess.run([py, "-c", "import safetensors, numpy"], capture_output=True)
        if r.returncode == 0:
            return py
    shutil.rmtree(path, ignore_errors=True)
    try:
        venv.create(path, with_pip=True, clear=True)
    except Exception as e:  # e.g. Debian without python3-venv (no ensurepip)
        fail(f"could not create a virtual environment in {path}: {e} "
             "(Debian: apt-get install python3-venv)")
    r = subprocess.run([py, "-m", "pip", "install", "--disable-pip-version-check",
                        "--timeout", "60", "--retries", "2", *PACKAGES],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"could not install {' and '.join(PACKAGES)} from PyPI into {path}: this test needs "
             f"PyPI access (CI has it). pip said:\n{r.stdout}\n{r.stderr}")
    r = subprocess.run([py, "-c", "import safetensors, numpy"], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' and '.join(PACKAGES)} installed but do not import:\n{r.stderr}")
    with open(ready, "w") as f:
        f.write("ok\n")
    return py


def helper(args, *cmd):
    r = subprocess.run([args.helper, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"`{args.helper} {' '.join(cmd)}` exited with {r.returncode}:\n{r.stdout}{r.stderr}")
    return r.stdout


def check_fp32_export(args):
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = os.path.join(args.work, "shardkit-fp32.safetensors")
    expect_path = path + ".json"
    helper(args, "export", path, "--ranks", "3", "--stage", "3", "--dtype", "fp32",
           "--expect", expect_path)
    with open(expect_path) as f:
        expect = json.load(f)
    got = load_file(path)
    names = [t["name"] for t in expect["tensors"]]
    if sorted(got) != sorted(names):
        fail(f"fp32: safetensors.numpy reads tensors {sorted(got)}, shardkit wrote {sorted(names)}")
    for t in expect["tensors"]:
        a = got[t["name"]]
        if a.dtype != np.float32:
            fail(f"fp32: {t['name']} reads as {a.dtype}")
        if list(a.shape) != t["shape"]:
            fail(f"fp32: {t['name']} has shape {list(a.shape)}, shardkit wrote {t['shape']}")
        bits = np.ascontiguousarray(a).view(np.uint32).ravel().tolist()
        if bits != t["bits"]:
            fail(f"fp32: the values of {t['name']} differ from what shardkit wrote")
    with safe_open(path, framework="np") as f:
        if f.metadata() != expect["metadata"]:
            fail(f"fp32: metadata {f.metadata()}, shardkit wrote {expect['metadata']}")
        if sorted(f.keys()) != sorted(names):
            fail(f"fp32: safe_open lists {sorted(f.keys())}")
        w = next(t for t in expect["tensors"] if t["name"] == "block1.weight")  # [16, 4]
        part = f.get_slice("block1.weight")[3:7]
        want = np.array(w["bits"], dtype=np.uint32).reshape(16, 4)[3:7]
        if not np.array_equal(np.ascontiguousarray(part).view(np.uint32), want):
            fail("fp32: a slice of block1.weight read through safe_open differs")
    print(f"fp32: {len(names)} tensors of shardkit's export read by safetensors.numpy as written")


def check_bf16_export(args):
    import numpy as np
    from safetensors import safe_open

    path = os.path.join(args.work, "shardkit-bf16.safetensors")
    expect_path = path + ".json"
    helper(args, "export", path, "--ranks", "2", "--stage", "1", "--dtype", "bf16",
           "--expect", expect_path)
    with open(expect_path) as f:
        expect = json.load(f)
    names = [t["name"] for t in expect["tensors"]]
    with safe_open(path, framework="np") as f:
        if sorted(f.keys()) != sorted(names):
            fail(f"bf16: safe_open lists {sorted(f.keys())}, shardkit wrote {sorted(names)}")
        if f.metadata() != expect["metadata"]:
            fail(f"bf16: metadata {f.metadata()}, shardkit wrote {expect['metadata']}")
        for t in expect["tensors"]:
            s = f.get_slice(t["name"])
            if s.get_dtype() != "BF16":
                fail(f"bf16: {t['name']} has dtype {s.get_dtype()}")
            if list(s.get_shape()) != t["shape"]:
                fail(f"bf16: {t['name']} has shape {s.get_shape()}, shardkit wrote {t['shape']}")
    # the values: 16-bit words at the offsets of the header, as the format defines them
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for t in expect["tensors"]:
        b, e = header[t["name"]]["data_offsets"]
        words = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<u2").tolist()
        if words != t["bits"]:
            fail(f"bf16: the values of {t['name']} differ from shardkit's bf16 parameters")
    print(f"bf16: {len(names)} tensors of shardkit's export opened by safe_open as written")


def check_python_file(args):
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(12345)
    tensors = {
        "layer.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "layer.bias": np.array([0.5, -2.25, 65504.0, 6.103515625e-05, -0.0], dtype=np.float16),
        "scale": np.array(3.25, dtype=np.float32),
        "nothing": np.zeros((2, 0), dtype=np.float32),
        "embedding": rng.uniform(-1, 1, (37, 5)).astype(np.float32),
    }
    path = os.path.join(args.work, "python.safetensors")
    save_file(tensors, path, metadata={"written_by": "safetensors.numpy"})
    for ranks, stage in (("2", "3"), ("3", "0")):
        out = os.path.join(args.work, f"imported-{ranks}-{stage}.json")
        helper(args, "import", path, "--ranks", ranks, "--stage", stage, "--json", out)
        with open(out) as f:
            got = json.load(f)
        if sorted(got) != sorted(tensors):
            fail(f"import on {ranks} ranks at stage {stage}: tensors {sorted(got)}, "
                 f"the file has {sorted(tensors)}")
        for name, a in tensors.items():
            if got[name]["shape"] != list(a.shape):
                fail(f"import: {name} has shape {got[name]['shape']}, the file {list(a.shape)}")
            want = np.ascontiguousarray(a.astype(np.float32)).view(np.uint32).ravel().tolist()
            if got[name]["bits"] != want:
                fail(f"import on {ranks} ranks at stage {stage}: the values of {name} differ")
    print(f"python: a file of safetensors.numpy imported by shardkit with the same values")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--helper", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.in_venv:
        py = ensure_venv(args.venv)
        os.execv(py, [py, os.path.abspath(__file__), "--helper", args.helper, "--work", args.work,
                      "--venv", args.venv, "--in-venv"])
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    import safetensors
    print(f"safetensors {safetensors.__version__}")
    check_fp32_export(args)
    check_bf16_export(args)
    check_python_file(args)
    print("interop ok")


if __name__ == "__main__":
    main()
