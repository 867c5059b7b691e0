"""Lowering rules, one module per op family; importing this package registers them all."""

from souffle_py.frontend.ops import (activation, conv, einsum, elementwise, nn, norm, pool, reduce,  # noqa: F401
                                     rnn, shape)
