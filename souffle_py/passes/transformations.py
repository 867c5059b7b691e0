"""The SOUFFLE TE transformations every target runs first (the paper's ablation switches them): vertical
composition, then horizontal grouping. Vertical first, so horizontal grouping sees one TE per chain (BERT's
Q/K/V bias epilogues then combine like their GEMMs); the other order would group every reshape and
transpose of a chain separately. Each gets a fresh analysis of its input program."""

from __future__ import annotations

from souffle_py.passes.manager import Pass


def _vertical(program, context):
    from te_passes.vertical import vertical

    return vertical(program)


def _horizontal(program, context):
    from te_passes.horizontal import horizontal

    return horizontal(program)


TRANSFORMATIONS = (
    Pass("vertical", "vertical", _vertical, doc="compose one-relies-on-one chains (te_passes/vertical.py)"),
    Pass("horizontal", "horizontal", _horizontal, doc="combine independent same-kind TEs (te_passes/horizontal.py)"),
)
