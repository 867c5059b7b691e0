"""A stack of ONNX recurrent nodes (GRU or LSTM, one or two directions) the way torch.onnx exports
`nn.GRU` / `nn.LSTM`: each layer a node, a bidirectional layer's Y [T, 2, B, H] transposed and reshaped to
[T, B, 2H] for the next. Shared by models/gru.py and models/bilstm.py."""

from __future__ import annotations

import numpy as np
import onnx

from models.common import GraphBuilder

GATES = {"GRU": 3, "LSTM": 4}


def _layer_weights(rng, gates: int, dirs: int, fan_in: int, hidden: int):
    """W [D, GH, I], R [D, GH, H], B [D, 2GH]: N(0, 2/sqrt(I)) input and N(0, 1/sqrt(H)) recurrent weights
    keep the output input-dependent and the recurrence contractive (see models/lstm.py)."""
    def normal(scale, *shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return (normal(2.0 / np.sqrt(fan_in), dirs, gates * hidden, fan_in),
            normal(1.0 / np.sqrt(hidden), dirs, gates * hidden, hidden),
            normal(0.1, dirs, 2 * gates * hidden))


def build_stack(name: str, op: str, layers: int, hidden: int, input_size: int, steps: int, batch: int,
                direction: str, seed: int, **attrs) -> onnx.ModelProto:
    """x [steps, batch, input] -> the last layer's outputs [steps, batch, dirs * hidden]."""
    if layers < 1 or steps < 1:
        raise ValueError(f"layers and steps must be at least 1, got {layers} and {steps}")
    dirs = 2 if direction == "bidirectional" else 1
    b = GraphBuilder(name, seed=seed, opset=17)
    x = b.input("x", [steps, batch, input_size])
    fan_in = input_size
    for layer in range(layers):
        w, r, bias = _layer_weights(b.rng, GATES[op], dirs, fan_in, hidden)
        p = f"layer{layer}"
        y = b.node(op, [x, b.const(f"{p}/W", w), b.const(f"{p}/R", r), b.const(f"{p}/B", bias)],
                   name=f"{p}/{op.lower()}", hidden_size=hidden, direction=direction, **attrs)
        last = layer == layers - 1
        if dirs == 1:
            x = b.node("Squeeze", [y, b.const(f"{p}/squeeze_axes", np.array([1], np.int64))],
                       name="output" if last else f"{p}/squeeze")
        else:
            t = b.node("Transpose", [y], name=f"{p}/transpose", perm=[0, 2, 1, 3])
            x = b.node("Reshape", [t, b.const(f"{p}/shape", np.array([steps, batch, dirs * hidden], np.int64))],
                       name="output" if last else f"{p}/reshape")
        fan_in = dirs * hidden
    b.output("output", [steps, batch, dirs * hidden])
    return b.model()
