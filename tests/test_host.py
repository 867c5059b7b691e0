"""host.py: CPU features the host's CPUID flags show but LLVM's name for the CPU leaves out."""

import tvm

from souffle_py.backends.cpu import host_target
from souffle_py.host import missing_cpu_features

FLAGS = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n"


def test_a_masked_cpu_model_gets_the_features_its_flags_show(tmp_path):
    """A VM reporting CPU model 167 is "rocketlake" to LLVM, which has no AVX512_BF16: precision="bf16" was
    refused (and 21 tests skipped) on a Xeon whose /proc/cpuinfo lists avx512_bf16."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(FLAGS)
    assert missing_cpu_features({"avx512f"}, str(cpuinfo)) == ["+avx512bf16"]
    assert missing_cpu_features({"avx512f", "avx512bf16"}, str(cpuinfo)) == []
    cpuinfo.write_text("flags\t\t: fpu sse avx512f\n")
    assert missing_cpu_features({"avx512f"}, str(cpuinfo)) == []
    assert missing_cpu_features({"avx512f"}, str(tmp_path / "absent")) == []


def test_the_host_target_has_every_feature_the_flags_show():
    target = host_target()
    reported = {str(name) for name in tvm.target.codegen.llvm_get_cpu_features(target)}
    assert not missing_cpu_features(reported)
