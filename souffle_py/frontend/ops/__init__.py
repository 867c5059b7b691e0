"""Lowering rules, one module per op family; importing this package registers them all."""

from souffle_py.frontend.ops import (activation, conv, einsum, elementwise, index, nn, norm, pool,  # noqa: F401
                                     quantize, reduce, resize, rnn, shape)
