"""Global analysis of a TE program (SOUFFLE sec. 5): tensor-level facts and islpy element-level dependences.

    analysis = analyze(program)
    analysis.tes["layer0_attn_q_matmul"].klass          # "CI"
    analysis.tes[name].accesses[0].map                   # islpy.Map, output element -> input elements
    analysis.chain_map(["D", "C", "B", "A"])             # composed along a producer chain
    analysis.dependence("output", "hidden_states")       # over every path
    image(access.map, (0, 3, 5))                         # the elements output element (0, 3, 5) reads

See docs/analysis.md for what is computed and why.
"""

from souffle_py.ir.analysis.element_level import (DATA_DEPENDENT, ONE_TO_MANY, ONE_TO_ONE, Access, affine_form, bounded,
                                              compose, image, maps_equal, parse_map, te_accesses)
from souffle_py.ir.analysis.program_analysis import (ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE, ProgramAnalysis, TEInfo,
                                                 analyze)
from souffle_py.ir.analysis.report import counts, summary, to_json
from souffle_py.ir.analysis.reuse import SpatialReuse, TemporalReuse
from souffle_py.ir.analysis.tensor_level import CI_THRESHOLD, LivePeak, TensorInfo, TEStats, te_flops, te_stats

__all__ = [
    "analyze", "ProgramAnalysis", "TEInfo", "TEStats", "TensorInfo", "Access", "SpatialReuse", "TemporalReuse",
    "LivePeak", "CI_THRESHOLD", "ONE_TO_ONE", "ONE_TO_MANY", "DATA_DEPENDENT", "ONE_RELIES_ON_ONE",
    "ONE_RELIES_ON_MANY", "affine_form", "bounded", "compose", "image", "maps_equal", "parse_map", "te_accesses",
    "te_flops", "te_stats", "counts", "summary", "to_json",
]
