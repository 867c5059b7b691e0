"""The CPU a model is compiled for, described by what its schedules need: vector width, vector registers, FMA
pipes, instruction-set extensions, caches and threads (`CpuTarget`), built from the TVM target, not from
the machine doing the compiling.

The schedule rules read the target being compiled for through `CpuTarget.current()`, which the CPU backend
sets with `using()` around its passes, partitioning, scheduling and build (a context variable, like TVM's
`Target.current()`), so that a register or cache budget follows the target without an argument threaded
through every rule. Outside such a context the current target is the host.

The host is read (CPUID flags, sysfs cache sizes) only for a target that names the host's CPU, or none;
any other CPU's caches come from `KNOWN_CPUS`, a small table of documented parts. `CPU_NAMES` are the short
names users type for the machines they deploy to ("avx2", "graviton3"; docs/targets.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os

import tvm

from souffle_py.cpu_features import enabled_features, host_arch, target_arch
from souffle_py.errors import TargetError
from souffle_py.host import missing_cpu_features, num_threads

KiB, MiB = 1 << 10, 1 << 20
CPU_KINDS = ("llvm", "cpu")


@dataclasses.dataclass(frozen=True)
class KnownCpu:
    """Per-core L1d and L2, the L3 of a typical part (bytes), and FMA pipes per core."""

    l1d: int
    l2: int
    l3: int
    fma_units: int = 2


# LLVM CPU name -> its caches (vendors' datasheets; L3: the part named in the comment, for one socket)
KNOWN_CPUS = {
    "haswell": KnownCpu(32 * KiB, 256 * KiB, 8 * MiB),              # Core i7-4770
    "x86-64-v3": KnownCpu(32 * KiB, 256 * KiB, 8 * MiB),            # the Haswell baseline
    "x86-64-v4": KnownCpu(32 * KiB, 1 * MiB, 38 * MiB + 512 * KiB),  # the Skylake-SP baseline (as skylake-avx512)
    "skylake-avx512": KnownCpu(32 * KiB, 1 * MiB, 38 * MiB + 512 * KiB),  # Xeon Platinum 8180
    "cascadelake": KnownCpu(32 * KiB, 1 * MiB, 35 * MiB + 768 * KiB),    # Xeon Platinum 8280
    "icelake-server": KnownCpu(48 * KiB, 1 * MiB + 256 * KiB, 60 * MiB),  # Xeon Platinum 8380
    "sapphirerapids": KnownCpu(48 * KiB, 2 * MiB, 105 * MiB),       # Xeon Platinum 8480+
    "emeraldrapids": KnownCpu(48 * KiB, 2 * MiB, 320 * MiB),        # Xeon Platinum 8592+
    "graniterapids": KnownCpu(48 * KiB, 2 * MiB, 504 * MiB),        # Xeon 6980P
    "alderlake": KnownCpu(48 * KiB, 1 * MiB + 256 * KiB, 30 * MiB),  # Core i9-12900K (P-cores)
    "znver3": KnownCpu(32 * KiB, 512 * KiB, 32 * MiB),              # per CCD
    "znver4": KnownCpu(32 * KiB, 1 * MiB, 32 * MiB),                # per CCD; 512-bit FMAs double-pumped
    "znver5": KnownCpu(48 * KiB, 1 * MiB, 32 * MiB),                # per CCD
    "neoverse-n1": KnownCpu(64 * KiB, 1 * MiB, 32 * MiB),           # Ampere Altra (system cache)
    "neoverse-v1": KnownCpu(64 * KiB, 1 * MiB, 32 * MiB, 4),        # AWS Graviton3
    "neoverse-v2": KnownCpu(64 * KiB, 2 * MiB, 114 * MiB, 4),       # NVIDIA Grace
    "apple-m1": KnownCpu(128 * KiB, 3 * MiB, 8 * MiB, 4),           # a P-core's share of 12 MiB; system cache
}
AARCH64_LINUX = "aarch64-linux-gnu"
# short names -> the target they stand for: the x86-64 levels every AVX2 / AVX-512 CPU runs (not one part's
# tuning), and Arm parts by their LLVM core (64-bit Linux, linked by Debian's aarch64 cross toolchain)
CPU_NAMES = {
    "avx2": {"mcpu": "x86-64-v3"}, "x86-64-v3": {"mcpu": "x86-64-v3"}, "haswell": {"mcpu": "haswell"},
    "avx512": {"mcpu": "x86-64-v4"}, "x86-64-v4": {"mcpu": "x86-64-v4"},
    "skylake-avx512": {"mcpu": "skylake-avx512"}, "sapphirerapids": {"mcpu": "sapphirerapids"},
    "znver3": {"mcpu": "znver3"}, "znver4": {"mcpu": "znver4"}, "znver5": {"mcpu": "znver5"},
    "graviton2": {"mtriple": AARCH64_LINUX, "mcpu": "neoverse-n1"},
    "graviton3": {"mtriple": AARCH64_LINUX, "mcpu": "neoverse-v1"},
    "grace": {"mtriple": AARCH64_LINUX, "mcpu": "neoverse-v2"},
    "apple-m1": {"mtriple": AARCH64_LINUX, "mcpu": "apple-m1"},  # Linux on Apple silicon (Asahi); not macOS
}
DEFAULT_CPU = KnownCpu(32 * KiB, 1 * MiB, 32 * MiB)  # an unknown CPU (and a host without sysfs)

X86_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512bf16", "avx512vnni", "avxvnni", "amx-tile",
                "amx-bf16")
ARM_FEATURES = ("neon", "sve", "sve2", "bf16", "dotprod")


@dataclasses.dataclass(frozen=True)
class CpuTarget:
    """A CPU as the schedules see it. `features` are LLVM's names (avx512f, avx512bf16, neon, sve, ...)."""

    cpu: str
    arch: str
    features: frozenset = frozenset()
    vector_bits: int = 128
    registers: int = 16          # vector registers of the ISA (AVX-512 and AArch64: 32; AVX2: 16)
    fma_units: int = 2           # vector FMA pipes per core
    l1d_bytes: int = DEFAULT_CPU.l1d  # per core
    l2_bytes: int = DEFAULT_CPU.l2    # per core
    l3_bytes: int = DEFAULT_CPU.l3
    threads: int = 1
    host: bool = False           # described from this machine (CPUID flags, sysfs)

    @property
    def lanes(self) -> int:
        """float32 lanes of a vector register."""
        return self.vector_bits // 32

    def has(self, feature: str) -> bool:
        return feature in self.features

    avx2 = property(lambda self: self.has("avx2"))
    fma = property(lambda self: self.has("fma"))
    avx512f = property(lambda self: self.has("avx512f"))
    avx512bw = property(lambda self: self.has("avx512bw"))
    avx512_bf16 = property(lambda self: self.has("avx512bf16"))
    avx512_vnni = property(lambda self: self.has("avx512vnni"))
    avxvnni = property(lambda self: self.has("avxvnni"))
    amx = property(lambda self: self.has("amx-tile"))
    neon = property(lambda self: self.has("neon"))
    sve = property(lambda self: self.has("sve"))

    @classmethod
    def from_target(cls, target) -> "CpuTarget":
        """The CpuTarget of `target`: a tvm Target of kind llvm, a target string ("llvm", "llvm -mcpu=haswell
        -num-cores=4", or a JSON object), a dict, or a CpuTarget (returned as is)."""
        if isinstance(target, CpuTarget):
            return target
        return _described(_canonical(target_of(target)))

    @classmethod
    def host_cpu(cls) -> "CpuTarget":
        """The machine doing the compiling (read once per thread count: set_num_threads changes it)."""
        return _host_described(os.environ.get("TVM_NUM_THREADS"))  # what num_threads() reads, cheaply

    @classmethod
    def current(cls) -> "CpuTarget":
        """The CPU being compiled for (`using`), else the host."""
        return _CURRENT.get() or cls.host_cpu()


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("souffle_cpu_target", default=None)


@contextlib.contextmanager
def using(target):
    """Compile for `target` (anything `CpuTarget.from_target` takes) inside the block."""
    token = _CURRENT.set(CpuTarget.from_target(target))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current() -> CpuTarget:
    return CpuTarget.current()


def host_target() -> tvm.target.Target:
    """The host CPU with its vector extensions and core count (TVM 0.27 rejects "llvm -num-cores 2"), plus
    the extensions its CPUID flags show but LLVM's name for it lacks (host.missing_cpu_features)."""
    cpu, extra = _host_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": num_threads(),
                              **({"mattr": list(extra)} if extra else {})})


@functools.cache
def _host_cpu() -> tuple[str, tuple[str, ...]]:
    """LLVM's name for the host CPU and the features to add to it (read once per process)."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    plain = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    reported = {str(name) for name in tvm.target.codegen.llvm_get_cpu_features(plain)}
    return cpu, tuple(missing_cpu_features(reported))


def target_of(target) -> tvm.target.Target:
    """A tvm Target of kind llvm from a Target, a dict, a JSON string, a CLI string ("llvm -mcpu=haswell
    -mattr=+avx2,+fma -num-cores=4", which TVM 0.27 no longer parses) or a short name (`CPU_NAMES`: "avx2",
    "graviton3"); "llvm" or "cpu" alone: the host."""
    if isinstance(target, tvm.target.Target):
        parsed = target
    else:
        if isinstance(target, str):
            text = target.strip()
            if text.lower() in CPU_KINDS:
                return host_target()
            target = ({"kind": "llvm", **CPU_NAMES[text.lower()]} if text.lower() in CPU_NAMES
                      else json.loads(text) if text.startswith("{") else _cli_dict(text))
        if not isinstance(target, dict):
            raise TargetError(f"a CPU target is a tvm Target, a dict, a JSON object or a string such as "
                              f"'llvm -mcpu=haswell'; got {type(target).__name__}")
        target = {**target, "kind": "llvm" if target.get("kind") == "cpu" else target.get("kind")}
        try:
            parsed = tvm.target.Target(target)
        except Exception as exc:  # noqa: BLE001  (TVM's error names the bad key)
            raise TargetError(f"CPU target {target} is not a valid tvm target: {exc}") from None
    if parsed.kind.name != "llvm":
        raise TargetError(f"target {parsed} is not a CPU (llvm) target")
    return parsed


def _cli_dict(text: str) -> dict:
    """{"kind": ..., key: value} of "llvm -key=value ..." (mattr: a list, num-cores: an int)."""
    kind, *flags = text.split()
    out: dict = {"kind": kind.lower()}
    for flag in flags:
        key, sep, value = flag.lstrip("-").partition("=")
        if not flag.startswith("-") or not sep or not value:
            raise TargetError(f"CPU target '{text}': '{flag}' is not of the form -key=value")
        out[key] = ([v for v in value.split(",") if v] if key == "mattr"
                    else int(value) if key == "num-cores" else value)
    return out


def _canonical(target: tvm.target.Target) -> str:
    return json.dumps(json.loads(str(target)), sort_keys=True)  # str(Target): its JSON in TVM 0.27


@functools.lru_cache(maxsize=64)
def _described(key: str) -> CpuTarget:
    target = tvm.target.Target(json.loads(key))
    attrs = target.attrs
    cpu = str(attrs.get("mcpu", "") or "")
    triple = str(attrs.get("mtriple", "") or "")
    arch = target_arch(target)
    if cpu and not tvm.target.codegen.llvm_is_valid_cpu(cpu, triple or tvm.target.codegen.llvm_get_system_triple()):
        raise TargetError(f"CPU target {target}: LLVM does not know the CPU '{cpu}' for {arch}")
    is_host = arch == host_arch() and cpu in ("", _host_cpu()[0])
    features = enabled_features(target)
    if is_host:
        features |= {f.lstrip("+") for f in _host_cpu()[1]}
    x86 = arch == "x86_64"
    vector_bits = (512 if "avx512f" in features else 256 if "avx" in features else 128) if x86 else 128
    known = KNOWN_CPUS.get(cpu, DEFAULT_CPU)
    caches = _host_caches(known) if is_host else known
    cores = attrs.get("num-cores")
    return CpuTarget(
        cpu=cpu or (_host_cpu()[0] if is_host else "generic"), arch=arch,
        features=frozenset(f for f in features if f in (*X86_FEATURES, *ARM_FEATURES, "avx")),
        vector_bits=vector_bits, registers=32 if (not x86 or "avx512f" in features) else 16,
        fma_units=known.fma_units if ("fma" in features or not x86) else 1,
        l1d_bytes=caches.l1d, l2_bytes=caches.l2, l3_bytes=caches.l3,
        threads=int(cores) if cores else num_threads(), host=is_host)


@functools.lru_cache(maxsize=8)
def _host_described(threads: str | None) -> CpuTarget:
    return CpuTarget.from_target(host_target())


SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"


def _host_caches(fallback: KnownCpu) -> KnownCpu:
    """The host's L1d, L2 and L3 from sysfs (Linux); `fallback`'s where unreadable."""
    sizes = {}
    try:
        for entry in sorted(os.listdir(SYSFS_CACHE)):
            with open(f"{SYSFS_CACHE}/{entry}/level") as f:
                level = int(f.read())
            with open(f"{SYSFS_CACHE}/{entry}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{SYSFS_CACHE}/{entry}/size") as f:
                text = f.read().strip()
            sizes.setdefault(level, int(text.rstrip("KM")) * {"K": KiB, "M": MiB}.get(text[-1], 1))
    except (OSError, ValueError):
        pass
    return KnownCpu(sizes.get(1, fallback.l1d), sizes.get(2, fallback.l2), sizes.get(3, fallback.l3),
                    fallback.fma_units)
