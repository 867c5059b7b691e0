"""te_passes/gate_projections.py: a wavefront step's two gate projections of a layer as one reduction,
the same values (sums in another order), and left alone when the cell reads them otherwise."""

from models.registry import build_model
from souffle_py.frontend import import_onnx
from souffle_py.ir.program import TEProgram
from te_passes.check import assert_same_outputs
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL
from te_passes.gate_projections import combine_gate_projections, mark_gate_cells
from te_passes.layout import transpose_gemv_weights
from souffle_py.ir.marks import MEMBER
from te_passes.wavefront import wavefront
from tvm import te


def test_layers_above_the_first_read_one_gate_reduction():
    program = transpose_gemv_weights(wavefront(import_onnx(build_model("lstm", tiny=True, layers=3))), 16)
    combined = combine_gate_projections(program)
    reductions = [op.name for op in combined.stages if op.reduce_axis]
    assert reductions == ["layer0_lstm_x_proj", "layer0_lstm_h_proj", "layer1_lstm_x_proj_gates",
                          "layer2_lstm_x_proj_gates"]
    assert_same_outputs(program, combined)


def _two_projections(read):
    x = te.placeholder((4, 8), name="x")
    h = te.placeholder((4, 8), name="h")
    attrs = {MEMBER: "rnn"}
    k = te.reduce_axis((0, 8), name="k")
    xp = te.compute((4, 8), lambda t, j: te.sum(x[t, k] * 2.0, axis=k), name="xp", attrs=attrs)
    r = te.reduce_axis((0, 8), name="r")
    hp = te.compute((4, 8), lambda t, j: te.sum(h[t, r] * 3.0, axis=r), name="hp", attrs=attrs)
    cell = te.compute((4, 8), lambda t, j: read(xp, hp, t, j), name="cell", attrs=attrs)
    return TEProgram(inputs={"x": x, "h": h}, params={}, param_tensors={}, outputs={"cell": cell})


def test_projections_read_other_than_summed_are_left_alone():
    summed = _two_projections(lambda xp, hp, t, j: te.sigmoid(xp[t, j] + hp[t, j]))
    combined = combine_gate_projections(summed)
    assert [op.name for op in combined.stages] == ["xp_gates", "cell"]
    assert_same_outputs(summed, combined)
    apart = _two_projections(lambda xp, hp, t, j: xp[t, j] * hp[t, j])
    assert combine_gate_projections(apart) is apart


def test_gate_projections_and_their_cells_are_marked_when_each_cell_reads_its_own_unit():
    program = combine_gate_projections(wavefront(import_onnx(build_model("lstm", tiny=True, layers=2))))
    marked = {op.name: dict(op.attrs or {}) for op in mark_gate_cells(program).stages}
    assert marked["layer0_lstm_h_proj"][GATE_BLOCKS] == 4 and marked["layer1_lstm_x_proj_gates"][GATE_BLOCKS] == 4
    assert all(GATE_CELL in marked[f"layer{l}_lstm_{s}"] for l in (0, 1) for s in ("c", "h"))
    other_unit = _two_projections(lambda xp, hp, t, j: xp[t, (j + 1) % 8] + hp[t, (j + 1) % 8])
    assert mark_gate_cells(other_unit) is other_unit


def test_gate_projections_stored_by_groups_of_units_compute_the_same():
    """The CPU's layout (schedule/gates.py): [.., H / U, G, U], read by the cells at their own units."""
    from te_passes.gate_projections import group_gate_projections

    program = mark_gate_cells(import_onnx(build_model("lstm", tiny=True, layers=2, hidden=32, input=16)))
    grouped = group_gate_projections(program, lambda units, gates: 16 if units % 16 == 0 else 0)
    shapes = {op.name: [int(d) for d in op.output(0).shape] for op in grouped.stages if GATE_BLOCKS in op.attrs}
    assert shapes and all(shape[-3:] == [2, 4, 16] for shape in shapes.values())  # 32 units: 2 groups of 16
    assert_same_outputs(program, grouped)
    assert group_gate_projections(program, lambda units, gates: 0) is program  # no groups: left alone
