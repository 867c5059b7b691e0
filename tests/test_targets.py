"""Short CPU names (cpu_target.CPU_NAMES) and models compiled here for a CPU this host cannot run: they compile
and export (an Arm library linked by the aarch64 cross compiler), and running them here is a TargetError."""

import shutil

import numpy as np
import onnx
import pytest

import souffle_py
from souffle_py import cpu_features, cross_link
from souffle_py.backends import backend_for
from souffle_py.cli import TARGET_HELP
from souffle_py.cpu_target import CPU_NAMES, CpuTarget
from souffle_py.errors import TargetError
from test_cpu_target import _conv_relu_gemm

HAS_AARCH64_LINKER = shutil.which(cross_link.CROSS_COMPILERS["aarch64"][0]) is not None
NEEDS_LINKER = pytest.mark.skipif(not HAS_AARCH64_LINKER, reason="linking for aarch64 needs aarch64-linux-gnu-gcc "
                                                                  "(apt-get install gcc-aarch64-linux-gnu)")
ELF_AARCH64 = 183  # e_machine of an ELF file for AArch64


@pytest.mark.parametrize("name,cpu,arch,lanes,registers", [
    ("avx2", "x86-64-v3", "x86_64", 8, 16), ("x86-64-v3", "x86-64-v3", "x86_64", 8, 16),
    ("avx512", "x86-64-v4", "x86_64", 16, 32), ("x86-64-v4", "x86-64-v4", "x86_64", 16, 32),
    ("znver4", "znver4", "x86_64", 16, 32), ("graviton2", "neoverse-n1", "aarch64", 4, 32),
    ("graviton3", "neoverse-v1", "aarch64", 4, 32), ("grace", "neoverse-v2", "aarch64", 4, 32),
    ("apple-m1", "apple-m1", "aarch64", 4, 32), ("Graviton3", "neoverse-v1", "aarch64", 4, 32)])
def test_a_short_name_is_the_cpu_it_stands_for(name, cpu, arch, lanes, registers):
    target = CpuTarget.from_target(name)
    assert (target.cpu, target.arch, target.lanes, target.registers) == (cpu, arch, lanes, registers)
    assert not target.host and (target.neon if arch == "aarch64" else target.avx2 and target.fma)
    assert target == CpuTarget.from_target({"kind": "llvm", **CPU_NAMES[name.lower()]})
    assert backend_for(name).cpu == target


def test_the_avx_levels_have_no_extension_beyond_their_level():
    avx2, avx512 = CpuTarget.from_target("avx2"), CpuTarget.from_target("avx512")
    assert not avx2.avx512f and avx512.avx512f and avx512.avx512bw and not avx512.avx512_bf16
    assert CpuTarget.from_target("graviton3").sve and not CpuTarget.from_target("graviton2").sve


def test_the_cli_help_names_the_short_names():
    for name in ("avx2", "avx512", "znver4", "graviton2", "graviton3", "grace", "apple-m1"):
        assert name in TARGET_HELP


def _compiled(tmp_path, target, **options):
    path = tmp_path / "model.onnx"
    onnx.save(_conv_relu_gemm(), path)
    return souffle_py.optimize(str(path), target=target, **options)


FEEDS = {"x": np.zeros((1, 8, 6, 6), np.float32)}


@NEEDS_LINKER
def test_a_model_for_graviton3_exports_an_aarch64_library_and_refuses_to_run_here(tmp_path):
    if cpu_features.host_arch() == "aarch64":
        pytest.skip("this host is aarch64")
    compiled = _compiled(tmp_path, "graviton3", cache=False)
    assert compiled.plan.arch == "aarch64" and "neon" in compiled.plan.cpu_features
    assert "T.vectorized(4)" in "\n".join(f.script() for f in compiled.scheduled_functions.values())
    with pytest.raises(TargetError, match="aarch64"):
        compiled.run(FEEDS)  # never loads the library
    exported = tmp_path / "model.tar"
    compiled.export(exported)
    import tarfile

    with tarfile.open(exported) as archive:
        library = archive.extractfile("kernels.so").read()
    assert library[:4] == b"\x7fELF" and int.from_bytes(library[18:20], "little") == ELF_AARCH64
    with pytest.raises(TargetError, match="aarch64"):
        souffle_py.load(exported)
    with pytest.raises(TargetError, match="aarch64.*neon"):
        souffle_py.load(exported, check_cpu=False).run(FEEDS)


@NEEDS_LINKER
def test_the_compile_cache_keeps_a_model_for_another_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    _compiled(tmp_path, "graviton2", cache=True)
    again = _compiled(tmp_path, "graviton2", cache=True)
    assert again.cached and again.plan.arch == "aarch64"
    with pytest.raises(TargetError, match="aarch64"):
        again.run(FEEDS)


def test_a_missing_cross_compiler_is_a_target_error_naming_its_package(tmp_path, monkeypatch):
    if cpu_features.host_arch() == "aarch64":
        pytest.skip("this host is aarch64")
    compiled = _compiled(tmp_path, "graviton2", cache=False)  # compiling needs no cross compiler
    monkeypatch.setattr(cross_link.shutil, "which", lambda name: None)
    with pytest.raises(TargetError, match="apt-get install gcc-aarch64-linux-gnu"):
        compiled.export(tmp_path / "model.tar")


def test_an_x86_model_needing_extensions_this_cpu_lacks_refuses_to_run(tmp_path, monkeypatch):
    compiled = _compiled(tmp_path, "avx512", cache=False)
    assert "avx512f" in compiled.plan.cpu_features
    monkeypatch.setattr(cpu_features, "host_features", lambda: {"avx", "avx2", "fma"})  # an AVX2-only CPU
    with pytest.raises(TargetError, match="avx512f"):
        compiled.run(FEEDS)
