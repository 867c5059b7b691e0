"""Multi-gate mixture of experts (Ma et al., KDD 2018), the model the paper evaluates on synthetic data.

The paper takes "the base model from [32]" without sizes; the defaults are those of SOUFFLE's artifact
(batch 1, 100 input features, 8 single-layer experts of 16 units, 2 tasks), the MMoE paper's synthetic
setting. Each task's tower is one hidden ReLU layer (8 units) and a sigmoid output, as in the MMoE paper.
Every expert and gate reads the same input, the many-small-GEMM pattern that horizontal fusion targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder


@dataclass(frozen=True)
class Config:
    features: int = 100
    experts: int = 8
    expert_hidden: tuple[int, ...] = (16,)  # widths of each expert's MatMul+Add+Relu layers
    tasks: int = 2
    tower_hidden: int = 8
    batch: int = 1


PAPER = Config()
TINY = Config(features=16, experts=3, expert_hidden=(8, 8), tasks=2, tower_hidden=4)


def _dense(b: GraphBuilder, x: str, name: str, cin: int, cout: int) -> str:
    w = b.weight(f"{name}/weight", (cin, cout), scale=1.0 / np.sqrt(cin))
    y = b.node("MatMul", [x, w], name=name)
    return b.node("Add", [y, b.weight(f"{name}/bias", (cout,), scale=0.1)], name=f"{name}/bias_add")


def _expert(b: GraphBuilder, x: str, name: str, c: Config) -> str:
    cin = c.features
    for i, width in enumerate(c.expert_hidden):
        x = b.node("Relu", [_dense(b, x, f"{name}/fc{i}", cin, width)], name=f"{name}/relu{i}")
        cin = width
    return x


def _tower(b: GraphBuilder, x: str, name: str, cin: int, hidden: int) -> str:
    """One task's head: a hidden ReLU layer and a sigmoid probability, [batch, 1]."""
    y = b.node("Relu", [_dense(b, x, f"{name}/fc0", cin, hidden)], name=f"{name}/relu")
    return b.node("Sigmoid", [_dense(b, y, f"{name}/fc1", hidden, 1)], name=f"{name}/sigmoid")


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    c = config
    if not c.expert_hidden:
        raise ValueError("experts need at least one layer")
    b = GraphBuilder("mmoe", seed=seed, opset=17)
    x = b.input("input", [c.batch, c.features])
    axis1 = b.const("axis1", np.array([1], np.int64))
    axis2 = b.const("axis2", np.array([2], np.int64))
    experts = [b.node("Unsqueeze", [_expert(b, x, f"expert{e}", c), axis1], name=f"expert{e}/unsqueeze")
               for e in range(c.experts)]
    stacked = b.node("Concat", experts, name="experts/concat", axis=1)  # [batch, experts, dim]
    dim = c.expert_hidden[-1]
    outputs = []
    for t in range(c.tasks):
        w = b.weight(f"task{t}/gate/weight", (c.features, c.experts))
        gate = b.node("MatMul", [x, w], name=f"task{t}/gate")
        gate = b.node("Softmax", [gate], name=f"task{t}/gate/softmax", axis=-1)
        gate = b.node("Unsqueeze", [gate, axis2], name=f"task{t}/gate/unsqueeze")  # [batch, experts, 1]
        mixed = b.node("Mul", [stacked, gate], name=f"task{t}/weighted")
        mixed = b.node("ReduceSum", [mixed, axis1], name=f"task{t}/mix", keepdims=0)
        outputs.append(_tower(b, mixed, f"task{t}/tower", dim, c.tower_hidden))
    b.node("Concat", outputs, name="output", axis=1)
    b.output("output", [c.batch, c.tasks])
    return b.model()
