"""Contractions on schedules of their own inside grid kernels (backends/cuda/grid_stages.py), without a
GPU: convolutions as implicit-GEMM stages (dlight's GEMM rule, transplanted), GEMMs that are not whole
tiles padded to them, and the patterns that made grid schedules fail (two stages re-indexing one input
into shared memory; a padded copy computed where the convolution before it writes), each compiled for an
H100 and run on the CPU phase by phase (blocks and warps of each phase in a shuffled order) against
ONNX Runtime."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from conv_graphs import Graph
from gpu_util import run_phases_on_cpu, syncs_in_divergent_code
from models.registry import build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import grid_stages
from souffle_py.backends.cuda.report import grid_figures
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.frontend import import_onnx
from souffle_py.passes import prepared

RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture(autouse=True)
def small_contractions_take_their_own_schedules(monkeypatch):
    """The tiny graphs' convolutions (a few MFLOP) take the path of large ones (grid_stages.OWN_SCHEDULE_MFLOP:
    64 MFLOP); test_small_convolutions_keep_the_launch_nest_and_large_ones_their_own_schedule has the
    threshold itself."""
    monkeypatch.setattr(grid_stages, "OWN_SCHEDULE_MFLOP", 0)


def _padded_3x3():
    g = Graph(16, 16)
    return g.model(g.op("Relu", g.conv("x", 32)))


def _strided_then_residual():
    """A 7 x 7 stride-2 stem, then a 1 x 1 conv whose residual add is its epilogue."""
    g = Graph(8, 32)
    stem = g.op("Relu", g.conv("x", 32, kernel=7, stride=2))
    return g.model(g.op("Add", g.conv(stem, 32, kernel=1), stem))


def _one_input_two_convs():
    """Two convolutions of one computed map (a ResNeXt block's first conv and its shortcut): both re-index
    it into shared memory, which gave two blocks of one name ("Found 2 blocks with the name:
    s1_reindex_shared") and a grid schedule that failed. (Their sum would be folded into one conv, two
    1 x 1 convs of one stride stacked into one.)"""
    g = Graph(16, 16)
    x = g.op("Relu", g.conv("x", 32, kernel=1))
    branch = g.conv(g.op("Relu", g.conv(x, 32, kernel=1)), 64, stride=2)
    return g.model(g.op("Mul", branch, g.conv(x, 64, kernel=1, stride=2, pad=0)))


def _pad_before_a_grouped_conv():
    """A conv whose output only a padded copy reads, for a grouped conv (no schedule of its own): the
    padded copy was computed in the conv's write-back, and its border never."""
    g = Graph(16, 16)
    return g.model(g.conv(g.op("Relu", g.conv("x", 32, kernel=1)), 32, groups=8))


def _inception_and_dense():
    """Inception's 1 x 7 then 7 x 1 convolutions, and DenseNet's: each conv reads the concatenation of the
    maps before it."""
    g = Graph(16, 12)
    first = g.op("Relu", g.conv("x", 16, kernel=(1, 7)))
    second = g.op("Relu", g.conv(first, 16, kernel=(7, 1)))
    return g.model(g.conv(g.concat("x", first, second), 32, kernel=1))


def _shared_weight():
    """Two GEMMs of one weight (ALBERT's layers share theirs): both stage it through shared memory, which
    gave two blocks `in1_shared` (grid.py's tile) or `in1_reindex_shared` (dlight's)."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((128, 128)) / np.sqrt(128)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w"], ["y"])]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 128])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _softmax_sum_first(heads: int = 2, seq: int = 128, dim: int = 64):
    """exp(x - m) / sum(exp(x - m)) @ V with the row maxima `m` an input: the kernel starts with the sum (a
    warp per row), whose only reader, the normalization, P.V computes in its shared-memory loads (a
    prologue). The warp reduction's epilogue move took P.V's load into the sum's loop nest, and TVM no
    longer lowered the sum to shuffles (T5's encoder, dynamo export, a kernel cut before its softmax sum)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, heads, seq, dim)).astype(np.float32), "v"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    nodes = [helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Exp", ["d"], ["e"]),
             helper.make_node("Exp", ["d"], ["e2"]), helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
             helper.make_node("Div", ["e2", "s"], ["p"]), helper.make_node("MatMul", ["p", "v"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, heads, seq, seq]),
              helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, heads, seq, 1])]
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, heads, seq, dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


PATTERNS = {"padded-3x3": _padded_3x3, "strided-residual": _strided_then_residual,
            "one-input-two-convs": _one_input_two_convs, "shared-weight": _shared_weight,
            "softmax-sum-first": _softmax_sum_first, "inception-dense": _inception_and_dense, "pad-before-grouped": _pad_before_a_grouped_conv,
            "resnext": lambda: build_model("resnext", tiny=True),
            "bert-200-rows": lambda: build_model("bert", tiny=True, layers=1, hidden=320, ffn=1280, seq=200,
                                                 heads=4)}


@pytest.mark.parametrize("name", [*PATTERNS, "shared-weight-grid-tile"])
def test_contraction_stages_run_phase_by_phase_match_onnx_runtime(name, monkeypatch):
    """Every pattern on its stages' own schedules; the shared weight also on grid.py's tile (no stage
    schedule)."""
    monkeypatch.setenv("SOUFFLE_STRICT", "1")  # a grid schedule that fails is an error here
    if name.endswith("-grid-tile"):
        monkeypatch.setattr("souffle_py.backends.cuda.schedule.stage_schedules", lambda *args: {})
    proto = PATTERNS[name.removesuffix("-grid-tile")]()
    backend = backend_for("h100")
    program = prepared(import_onnx(proto), backend)
    kernels = backend.fused_kernels(program, False)
    assert len(kernels) == 1
    scheduled = schedule_kernels(kernels, backend.default_scheduler())
    (func,) = scheduled.functions.values()
    if not name.endswith("-grid-tile"):
        sources = func.attrs["souffle.stage_schedules"]  # every contraction chosen keeps its schedule
        assert len(sources) == len(func.attrs["souffle.own_schedules"]) and \
            {str(source) for source in sources.values()} == {"dlight Matmul"}
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of, reverse=True)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL * max(1.0, np.abs(expected[key]).max()))


def test_convolutions_are_implicit_gemm_stages_of_one_grid_kernel():
    model = souffle_py.optimize(_strided_then_residual(), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert launch.grid and launch.cooperative and len(launch.stage_schedules) == 2
    assert "2 GEMM stages on their own dlight Matmul schedules" in model.describe()
    pads = [stage for stage in call.stages if stage.endswith("_pad")]
    source = model.device_source()
    assert pads and "__syncthreads()" in source and syncs_in_divergent_code(source) == []
    # the stem's padded input is computed in its shared-memory loads: no buffer of its own
    assert not any(arg.endswith("_pad") for arg in call.args)
    figures = grid_figures(model.plan)
    assert (figures.launches, figures.grid_kernels, figures.share, figures.fallbacks) == (1, 1, 1.0, ())


def test_a_large_grouped_convolution_keeps_a_tiled_kernel_and_says_why():
    g = Graph(64, 56)
    model = souffle_py.optimize(g.model(g.op("Relu", g.conv("x", 128, groups=2))), target="h100")
    tiled = [c for c in model.plan.calls if not any(l.grid for l in c.launches)]
    assert len(tiled) == 1 and tiled[0].reason.endswith(
        "a 231 MFLOP convolution that dlight's GEMM rule does not schedule as an implicit GEMM (grouped or "
        "depthwise) keeps a tiled kernel of its own (>= 64 MFLOP)")


def test_small_convolutions_keep_the_launch_nest_and_large_ones_their_own_schedule(monkeypatch):
    """From 64 MFLOP on (what kept a tiled kernel of its own) a convolution is an implicit-GEMM stage; a
    smaller one stays a thread per output (its stage alone on dlight's schedule takes ~80 registers, which
    cut EfficientNet-b0 into a kernel more)."""
    monkeypatch.setattr(grid_stages, "OWN_SCHEDULE_MFLOP", grid_stages.OWN_KERNEL_MFLOP)
    g = Graph(64, 56)
    large = g.op("Relu", g.conv("x", 64))  # 3 x 3, 64 -> 64 at 56 x 56: 231 MFLOP
    model = souffle_py.optimize(g.model(g.op("Relu", g.conv(large, 16, kernel=1))), target="h100")  # 6 MFLOP
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert [call.stages[i] for i, _ in launch.stage_schedules] == ["Conv_0_conv"]
