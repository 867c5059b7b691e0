"""Run tiny models compiled for Arm (aarch64) under qemu-aarch64 here, and compare them with ONNX Runtime.

No Arm hardware: the aarch64 export (linked by aarch64-linux-gnu-gcc) runs in an arm64 Debian root under
qemu-user, its Python with the aarch64 wheels of souffle-py's dependencies, and this checkout on its path.
Correctness only: emulated speed says nothing of an Arm CPU's.

    apt-get install qemu-user debootstrap gcc-aarch64-linux-gnu
    python scripts/run_aarch64.py --setup            # the arm64 root and wheels (once; ~400 MB)
    python scripts/run_aarch64.py [--target graviton3] [--models conv bert lstm ...]

qemu 7.2 (Debian 12) shows the host's /proc/cpuinfo to the emulated program, so the runner tells
cpu_features the extensions of `-cpu max` (all of AArch64's that souffle-py records) instead.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WHEELS = ["apache-tvm==0.27.0.post1", "apache-tvm-ffi==0.1.14.post1", "numpy==2.4.6", "onnx==1.23.2",
          "islpy==2026.2.2", "psutil==7.2.2", "cloudpickle==3.1.2", "ml_dtypes", "protobuf", "typing_extensions"]
INNER = """
import sys
import numpy as np
from souffle_py import cpu_features
cpu_features.host_features = lambda: set(cpu_features.AARCH64_FEATURES)  # qemu -cpu max has them all
import souffle_py
outputs = souffle_py.load(sys.argv[1]).run(dict(np.load(sys.argv[2])))
np.savez(sys.argv[3], **outputs)
"""


def setup(root: Path) -> None:
    """An arm64 Debian root with Python 3.11 (debootstrap's first stage, its packages unpacked) and the
    aarch64 wheels unpacked into root/opt/site."""
    if not (root / "usr/bin/python3.11").exists():
        subprocess.run(["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase", "--include=python3",
                        "bookworm", str(root), "http://deb.debian.org/debian"], check=True)
        for deb in sorted(glob.glob(str(root / "var/cache/apt/archives/*.deb"))):
            subprocess.run(["dpkg", "-x", deb, str(root)], check=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux2014_aarch64",
                        "--platform", "manylinux_2_28_aarch64", "-d", wheels, *WHEELS], check=True)
        for wheel in glob.glob(f"{wheels}/*.whl"):
            zipfile.ZipFile(wheel).extractall(root / "opt/site")


def model_of(name: str):
    if name == "conv":
        from test_cpu_target import _conv_relu_gemm

        return _conv_relu_gemm()
    from models.registry import build_model

    return build_model(name, tiny=True)


def feeds_of(compiled, rng) -> dict:
    return {spec.name: (rng.standard_normal(spec.shape).astype(spec.dtype) if np.dtype(spec.dtype).kind == "f"
                        else rng.integers(0, 2, spec.shape).astype(spec.dtype)) for spec in compiled.inputs}


def run_one(name: str, target: str, root: Path, folder: Path) -> float:
    """The largest difference from ONNX Runtime, relative to the reference's largest magnitude."""
    import souffle_py
    from souffle_py.baselines import OnnxRuntimeModel

    model = model_of(name)
    compiled = souffle_py.optimize(model, target=target, cache=False)
    compiled.export(folder / f"{name}.tar")
    feeds = feeds_of(compiled, np.random.default_rng(0))
    np.savez(folder / f"{name}-feeds.npz", **feeds)
    env = {**os.environ, "PYTHONPATH": f"{root}/opt/site:{ROOT}"}
    subprocess.run(["qemu-aarch64", "-cpu", "max", "-L", str(root), str(root / "usr/bin/python3.11"), "-c", INNER,
                    str(folder / f"{name}.tar"), str(folder / f"{name}-feeds.npz"), str(folder / f"{name}-out.npz")],
                   check=True, env=env)
    ours = dict(np.load(folder / f"{name}-out.npz"))
    reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    return max(float(np.abs(ours[k] - reference[k]).max() / max(np.abs(reference[k]).max(), 1e-6))
               for k in reference)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT / ".souffle_cache/arm64root")
    parser.add_argument("--setup", action="store_true", help="make the arm64 root and unpack the wheels")
    parser.add_argument("--target", default="graviton2")
    parser.add_argument("--models", nargs="+", default=["conv", "bert", "lstm", "resnext", "efficientnet", "swin",
                                                        "mmoe"])
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    if args.setup:
        setup(args.root)
        return 0
    failed = 0
    with tempfile.TemporaryDirectory(prefix="souffle-aarch64-") as folder:
        for name in args.models:
            error = run_one(name, args.target, args.root, Path(folder))
            ok = error <= args.tolerance
            failed += not ok
            print(f"{name:14s} {args.target}: max relative difference from ONNX Runtime {error:.2e} "
                  f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
