"""Which instruction-set extensions a CPU library was built for, and whether this CPU has them.

An exported library built for `mcpu=znver4` (AVX-512) dies of SIGILL on a CPU without AVX-512, at the
first kernel that uses an instruction it lacks. The export records the extensions its target enables
(`required_features`), and `load()` compares them with this CPU's, read from /proc/cpuinfo (the kernel's
view of CPUID, so a virtual machine's masked features are absent), before the library is opened.

Only extensions LLVM's code generation can emit for our kernels are compared: AMX, for one, needs explicit
intrinsics that souffle-py never uses, and virtual machines hide it from CPUs whose LLVM name implies it.
"""

from __future__ import annotations

import platform

from souffle_py.errors import TargetError

# LLVM feature name -> /proc/cpuinfo flag, per architecture
X86_FEATURES = {
    "sse": "sse", "sse2": "sse2", "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm",
    "popcnt": "popcnt", "movbe": "movbe", "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni", "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
}
AARCH64_FEATURES = {
    "neon": "asimd", "fullfp16": "asimdhp", "dotprod": "asimddp", "sve": "sve", "sve2": "sve2", "i8mm": "i8mm",
    "bf16": "bf16",
}
FEATURES = {"x86_64": X86_FEATURES, "aarch64": AARCH64_FEATURES}
ARCH_ALIASES = {"amd64": "x86_64", "x86-64": "x86_64", "arm64": "aarch64"}
CPUINFO = "/proc/cpuinfo"


def target_arch(target) -> str:
    """The architecture a CPU target compiles for: its mtriple's, else this machine's."""
    triple = str(target.attrs.get("mtriple", "") or "")
    arch = triple.split("-")[0] if triple else platform.machine()
    return ARCH_ALIASES.get(arch.lower(), arch.lower())


def enabled_features(target) -> set[str]:
    """LLVM's features of the target's CPU, with its mattr's added and removed (LLVM names, all of them)."""
    from tvm.target import codegen

    with target:
        enabled = {str(name) for name in codegen.llvm_get_cpu_features(target)}
    mattr = [str(a) for a in (target.attrs.get("mattr") or [])]
    return (enabled | {a[1:] for a in mattr if a.startswith("+")}) - {a[1:] for a in mattr if a.startswith("-")}


def required_features(target) -> list[str]:
    """The instruction-set extensions (LLVM names) that code built for `target` may use, sorted."""
    known = FEATURES.get(target_arch(target), {})
    return sorted(f for f in enabled_features(target) if f in known)


def host_features() -> set[str] | None:
    """This CPU's extensions, by LLVM name; None where /proc/cpuinfo cannot be read (not Linux)."""
    known = FEATURES.get(host_arch(), {})
    try:
        with open(CPUINFO) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith(("flags", "Features"))), [])
    except OSError:
        return None
    present = set(flags)
    return {name for name, flag in known.items() if flag in present}


def host_arch() -> str:
    arch = platform.machine().lower()
    return ARCH_ALIASES.get(arch, arch)


def check_runnable(arch: str, features, what: str) -> None:
    """Raise TargetError unless this CPU runs code for `arch` using `features`; `what` names the library."""
    if arch and arch != host_arch():
        uses = f" ({', '.join(features)})" if features else ""
        raise TargetError(f"{what} was built for {arch} CPUs{uses}; this machine is {host_arch()}: run it on an "
                          f"{arch} machine, or compile it for this one (target='llvm')")
    have = host_features()
    if have is None:
        return  # nothing to compare with: the library's own loader decides
    missing = sorted(set(features) - have)
    if missing:
        raise TargetError(f"{what} was built for CPUs with {', '.join(missing)}, which this CPU lacks: compile it "
                          f"for this machine (target='llvm' here) or for a CPU this one can run")
