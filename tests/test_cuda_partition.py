"""The GPU partition (backends/cuda/partition.py) and its stage demands (occupancy.py), without a GPU:
occupancy cuts on synthetic figures, their recorded numbers, ptxas figures of GEMM stages, and a grid
kernel's launch bounds."""

from souffle_py.backends import backend_for
from souffle_py.backends.cuda import nvcc
from souffle_py.backends.cuda.occupancy import REGISTER_ESTIMATE, Demand
from souffle_py.backends.cuda.partition import MAX_GRID_STAGES, gpu_partition
from souffle_py.frontend import import_onnx
from souffle_py.partition import H100, LaunchConfig
from models.registry import build_model
from souffle_py.passes import prepared, transformed
import souffle_py

BERT_TILED = dict(layers=2, hidden=256, ffn=1024, seq=128, heads=4)


def _program(**config):
    backend = backend_for("h100")
    proto = build_model("bert", tiny=True, **config)
    return backend, prepared(import_onnx(proto), backend)


def _synthetic(heavy: str, blocks: int):
    """Every stage 64 registers and `blocks` blocks a round; the TEs named `heavy` 128 registers."""
    def demand_of(op):
        registers = 128 if op.name.endswith(heavy) else REGISTER_ESTIMATE
        return Demand(LaunchConfig(blocks, 256, registers, 0), "synthetic")

    return demand_of


def test_a_contraction_that_shrinks_the_wave_below_the_kernels_work_starts_a_new_grid_kernel():
    _, program = _program(**BERT_TILED)
    groups = gpu_partition(program, H100, _synthetic("ffn_fc1_matmul", blocks=1000))
    cuts = [g.reason for g in groups if g.reason.startswith("cut before CI TE")]
    # once past the first heavy GEMM the kernel runs 2 blocks per SM: the second one costs nothing more
    assert [c.split(":")[0] for c in cuts] == ["cut before CI TE layer0_ffn_fc1_matmul"]
    # 128 registers x 256 threads: 2 blocks per SM, 264 in a wave; 64 registers: 4 per SM, 528
    assert ("its 128 registers/thread and 0 B shared/block leave 2 resident blocks per SM on H100 (4 without "
            "it): a wave of 264 blocks, fewer than the 1000 blocks a round of the kernel's stages takes") in cuts[0]
    assert [g.resident for g in groups] == [4, 2]


def test_no_cut_where_the_kernels_work_fits_the_smaller_wave():
    _, program = _program(**BERT_TILED)
    groups = gpu_partition(program, H100, _synthetic("ffn_fc1_matmul", blocks=200))
    assert len(groups) == 1 and groups[0].reason == "program start" and groups[0].resident == 2


def test_the_stage_limit_still_cuts_long_programs():
    _, program = _program(layers=6)
    groups = gpu_partition(program, H100, _synthetic("none", blocks=1))
    assert len(groups) > 1 and all(len(g.ops) <= MAX_GRID_STAGES for g in groups)
    assert any(g.reason.startswith("stage limit") for g in groups)


def test_gemm_stages_demand_what_ptxas_reports_for_their_schedule_alone():
    backend, program = _program(**BERT_TILED)
    demand_of = backend._demands(program)
    gemm = next(op for op in program.stages if op.name == "layer0_ffn_fc1_matmul")
    demand = demand_of(gemm)
    assert demand.source == "ptxas, the stage alone"
    assert demand.launch.blocks == (128 // 64) * (1024 // 64)           # its 64 x 64 tiles
    assert demand.launch.shared_memory_per_block == 2 * 64 * 18 * 4     # dlight's two operand slices
    assert 16 < demand.launch.registers_per_thread <= 255
    softmax = next(op for op in program.stages if op.name.endswith("softmax_softmax"))
    assert demand_of(softmax).source == "estimate"


def test_a_grid_kernel_is_bounded_to_its_residency():
    """The kernel's launch bounds ask for the blocks per SM its grid needs, so ptxas keeps its registers
    within them and the grid never has to shrink after compiling."""
    model = souffle_py.optimize(build_model("bert", tiny=True, **BERT_TILED), target="h100")
    (launch,) = model.plan.calls[0].launches
    per_sm = -(-launch.blocks // H100.sms)
    assert f"__launch_bounds__(256, {per_sm}) {launch.kernel}(" in nvcc.with_min_blocks(
        model.device_source(), {launch.kernel: per_sm})
    assert launch.registers * 256 * per_sm <= H100.registers_per_sm
    assert launch.resident_blocks_per_sm >= per_sm
