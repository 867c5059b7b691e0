"""The ONNX-level folds every target runs before lowering (level "onnx": they rewrite the checked model,
where the pattern is one node pattern and the result is again a model any lowering reads)."""

from __future__ import annotations

from souffle_py.passes.manager import Pass


def _conv_branches(model, context):
    from souffle_py.frontend.conv_branches import fold_conv_branches

    return fold_conv_branches(model)


FOLDS = (
    Pass("fold_conv_branches", "horizontal", _conv_branches, level="onnx",
         doc="convs of one input summed, as one conv (re-parameterized blocks: frontend/conv_branches.py)"),
)
