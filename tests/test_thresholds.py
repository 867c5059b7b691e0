"""No hardware budget hides in a rule: every module-level number of the CPU rules and passes whose name says
it is a register, lane, cache or byte budget is either a count of the target's (cpu_target.CpuTarget via
schedule/blocks.py and budgets.py), a measured threshold in schedule/thresholds.py with its provenance, or
an ISA fact listed here with why (issue 50: a constant fitted on one CPU is a bug on the next)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCOPE = [*sorted((ROOT / "souffle_py" / "schedule").glob("*.py")), *sorted((ROOT / "te_passes").glob("*.py")),
         ROOT / "souffle_py" / "partition.py", *sorted((ROOT / "souffle_py" / "backends").glob("cpu*.py"))]
BUDGET = re.compile(r"BYTES|REGISTER|ACCUMULATOR|LANES|CACHE|(^|_)L[123](_|$)|VECTOR")
HOME = {"souffle_py/schedule/thresholds.py"}
# ISA facts and limits that are not a machine's budget: (module, name) -> why it stays a number
FACTS = {
    ("souffle_py/schedule/bf16_gemm.py", "LANES"): "float32 lanes of the vdpbf16ps zmm intrinsic the module emits",
    ("te_passes/precision.py", "LANES"): "the same instruction's packed weight panel (bf16 needs AVX512_BF16)",
    ("souffle_py/schedule/conv.py", "CONV_MIN_LANES"): "the narrowest float32 vector of any ISA served (128 bits)",
    ("souffle_py/schedule/streaming.py", "CACHE_LINE"): "64-byte lines on every x86 and Arm server CPU; a "
                                                        "CpuTarget field once a 128-byte-line target is served",
    ("souffle_py/schedule/streaming.py", "L2"): "the prefetch intrinsic's locality argument (keep in L2)",
    ("souffle_py/schedule/bf16_conv.py", "MAX_VECTORS"): "the tile's shape: one broadcast input pair feeds two "
                                                        "instructions, in the target's vectors",
    ("te_passes/horizontal.py", "SMALL_PARAM_BYTES"): "how much duplicated weight a stack may cost: a program "
                                                      "size, not a machine's",
}


def _numeric(node) -> bool:
    """A literal number or arithmetic of literal numbers (1 << 20, 256 * KiB with KiB a literal)."""
    return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Name, ast.Load))
               for n in ast.walk(node)) and any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float))
                                                and not isinstance(n.value, bool) for n in ast.walk(node))


def budget_constants():
    for path in SCOPE:
        rel = str(path.relative_to(ROOT))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id.isupper() and BUDGET.search(target.id) \
                            and node.value is not None and _numeric(node.value):
                        yield rel, target.id


def test_no_hardware_budget_outside_the_target_and_the_thresholds_table():
    found = [(rel, name) for rel, name in budget_constants() if rel not in HOME and (rel, name) not in FACTS]
    assert not found, ("numbers named as hardware budgets outside cpu_target / budgets / thresholds.py: "
                       f"{found}; derive them from CpuTarget.current() or move them to thresholds.py")


def test_the_scan_sees_the_table_and_the_listed_facts():
    """The scan is not blind: it finds thresholds.py's byte thresholds and every fact listed above."""
    found = set(budget_constants())
    assert ("souffle_py/schedule/thresholds.py", "L2_CHUNK_BYTES") in found
    assert set(FACTS) <= found, set(FACTS) - found
