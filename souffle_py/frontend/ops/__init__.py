"""Lowering rules, one module per op family; importing this package registers them all."""

from souffle_py.frontend.ops import elementwise, nn, reduce, rnn, shape  # noqa: F401
