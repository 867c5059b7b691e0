"""nvcc: compile the generated CUDA C to a device binary, read each kernel's resources from ptxas, and
hand that binary to TVM's CUDA runtime.

TVM 0.27 keeps a built CUDA module as source and compiles it when it is first loaded on a GPU, through
the global `tvm_callback_cuda_compile` (NVRTC by default, which needs the cuda-python bindings). souffle-py
compiles at build time instead, with nvcc (on any machine with the CUDA toolkit, GPU or not), and
registers a callback that returns that binary for the source it was made from. So the resource figures
are those of the code that runs, and an exported model runs on a GPU machine without any CUDA compiler.
Unknown sources (TVM Relax's, MetaSchedule's) are compiled with nvcc on the spot.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Mapping

from souffle_py.errors import SouffleError

_BINARIES: dict[str, bytes] = {}
_CALLBACK = "tvm_callback_cuda_compile"
_installed = False


class NvccError(SouffleError):
    """nvcc rejected the generated code; `kernels` are the __global__ functions its errors point into."""

    def __init__(self, source: str, log: str, archs):
        lines = sorted({int(n) for n in re.findall(r"kernels\.cu\((\d+)\): error", log)})
        starts = [(source.count("\n", 0, m.start()) + 1, m.group(1)) for m in _DEFINITION.finditer(source)]
        named = re.findall(r"error\s*:\s*Entry function '(\w+)'", log)  # ptxas: e.g. too much shared data
        self.kernels = sorted({next((k for start, k in reversed(starts) if start <= line), "") for line in lines}
                              .union(named) - {""})
        errors = [line.strip() for line in log.splitlines() if "error" in line and ":" in line]
        self.first_error = errors[0].split("kernels.cu")[-1] if errors else log.strip()[-300:]
        super().__init__(f"nvcc failed on the generated CUDA code ({', '.join(archs)}) in "
                         f"{', '.join(self.kernels) or 'unknown kernels'}:\n{log.strip()[-3000:]}")


_DEFINITION = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\([^;{]*\)\s*\{')


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one __global__ function."""

    registers: int
    shared_bytes: int   # static shared memory per block
    spill_bytes: int    # spill stores + spill loads


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


NVCC_ENV = "SOUFFLE_NVCC"  # a path to nvcc, or "none": never compile here (an exported model must not need it)


def nvcc_path() -> str:
    """$SOUFFLE_NVCC, else the nvcc on PATH or under CUDA_HOME / /usr/local/cuda, else a SouffleError."""
    chosen = os.environ.get(NVCC_ENV, "")
    if chosen.lower() == "none":
        raise SouffleError(f"nvcc is disabled ({NVCC_ENV}=none), and this CUDA source has no device binary "
                           "built for it: it would have to be compiled here")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise SouffleError(f"{NVCC_ENV}={chosen} is not an executable nvcc")
        return chosen
    found = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not found and home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            found = os.path.join(home, "bin", "nvcc")
    if not found:
        raise SouffleError("compiling for cuda needs nvcc (the CUDA toolkit): none on PATH, CUDA_HOME or "
                           "/usr/local/cuda")
    return found


def compile_cuda(source: str, archs: tuple[str, ...], fast_math: bool = True, output: str = "fatbin",
                 min_blocks_per_sm: Mapping[str, int] | None = None
                 ) -> tuple[bytes, dict[str, dict[str, KernelResources]]]:
    """(binary, {arch: {kernel: resources}}): a fatbin with SASS for each arch plus the last arch's PTX
    (which newer GPUs JIT), or a cubin for a single arch. `min_blocks_per_sm`: kernels whose blocks must
    fit that many to an SM (a cooperative grid sized for it): their launch bounds say so, and ptxas keeps
    their registers within it (spilling, which it reports, if it must)."""
    source = with_min_blocks(source, min_blocks_per_sm or {})
    flags = ["-O3", "-Xptxas", "-v", "--expt-relaxed-constexpr", "-U__CUDA_NO_HALF_OPERATORS__",
             "-U__CUDA_NO_HALF_CONVERSIONS__"] + (["--use_fast_math"] if fast_math else [])
    for i, arch in enumerate(archs):
        number = arch.removeprefix("sm_")
        codes = f"sm_{number}" + (f",compute_{number}" if output == "fatbin" and i == len(archs) - 1 else "")
        flags += ["-gencode", f"arch=compute_{number},code=[{codes}]"]
    with tempfile.TemporaryDirectory(prefix="souffle-nvcc-") as folder:
        src, out = os.path.join(folder, "kernels.cu"), os.path.join(folder, f"kernels.{output}")
        with open(src, "w") as f:
            f.write(source)
        result = subprocess.run([nvcc_path(), f"--{output}", *flags, "-o", out, src], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise NvccError(source, result.stderr, archs)
        with open(out, "rb") as f:
            binary = f.read()
    return binary, parse_ptxas(result.stderr)


def with_min_blocks(source: str, min_blocks_per_sm: Mapping[str, int]) -> str:
    """`source` with `__launch_bounds__(threads, blocks)` for the kernels named (TVM writes only the
    threads)."""
    for kernel, blocks in min_blocks_per_sm.items():
        source = re.sub(rf"__launch_bounds__\((\d+)\) {re.escape(kernel)}\(",
                        lambda m: f"__launch_bounds__({m.group(1)}, {blocks}) {kernel}(", source)
    return source


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict[str, dict[str, KernelResources]]:
    """{arch: {kernel: resources}} from `ptxas -v` output."""
    found: dict[str, dict[str, KernelResources]] = {}
    kernel = arch = None
    spill = 0
    for line in log.splitlines():
        if (m := _ENTRY.search(line)):
            kernel, arch, spill = m.group(1), m.group(2), 0
        elif kernel and (m := _SPILL.search(line)):
            spill = int(m.group(1)) + int(m.group(2))
        elif kernel and (m := _USED.search(line)):
            found.setdefault(arch, {})[kernel] = KernelResources(int(m.group(1)), int(m.group(2) or 0), spill)
            kernel = None
    return found


def register_binary(key: str, binary: bytes) -> None:
    """Make `binary` what TVM's CUDA runtime loads for the source whose key is `key`."""
    install_callback()
    _BINARIES[key] = binary


def install_callback() -> None:
    """Register the compile callback (once per process): registered binaries by source, else nvcc."""
    global _installed
    if _installed:
        return
    import tvm_ffi

    try:  # TVM's own callback registers itself on import; ours replaces it
        import tvm.support.nvcc  # noqa: F401
    except Exception:
        pass

    def compile_callback(code, *_):
        binary = _BINARIES.get(source_key(code))
        if binary is None:
            binary, _ = compile_cuda(code, (_current_arch(),))
        return bytearray(binary)  # what TVM's own nvcc callback returns

    tvm_ffi.register_global_func(_CALLBACK, compile_callback, override=True)
    _installed = True


def _current_arch() -> str:
    """The present GPU's arch, for sources compiled on demand."""
    import tvm

    try:
        return "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    except Exception:
        return "sm_90"


def cuda_source(executable) -> str:
    """The CUDA C of a built module (TVM keeps it in an imported module of kind 'cuda'), or ""."""
    def modules(module):
        yield module
        for imported in module.imports:
            yield from modules(imported)

    return next((m.inspect_source() for m in modules(executable.mod) if m.kind == "cuda"), "")
