"""souffle_py/ir/graph.py: the sweep every rewriting pass makes over a TE program."""

import numpy as np
import tvm
from tvm import te

from souffle_py.ir.graph import sweep, tensor_key


def _chain():
    x = te.placeholder((4, 8), name="x")
    a = te.compute((4, 8), lambda i, j: x[i, j] * 2.0, name="a")
    b = te.compute((4, 8), lambda i, j: a[i, j] + 1.0, name="b")
    c = te.compute((4, 8), lambda i, j: b[i, j] * b[i, j], name="c")
    return x, a, b, c


def test_a_kept_chain_is_not_rebuilt():
    x, a, b, c = _chain()
    new_of, replaced = sweep([a.op, b.op, c.op], lambda op, reads: None)
    assert new_of == {} and replaced == 0


def test_readers_of_a_replaced_te_are_rebuilt_over_it():
    x, a, b, c = _chain()

    def rewrite(op, reads):
        if op.name != "a":
            return None
        return te.compute((4, 8), lambda i, j: x[i, j] + x[i, j], name="a2").op

    new_of, replaced = sweep([a.op, b.op, c.op], rewrite)
    assert replaced == 1
    assert set(new_of) == {tensor_key(t) for t in (a, b, c)}
    assert new_of[tensor_key(b)].op.input_tensors[0].op.name == "a2"


def test_a_layout_change_is_read_through_its_reader():
    x, a, b, c = _chain()

    def rewrite(op, reads):  # b stored transposed; its readers read bt[j, i]
        if op.name != "b":
            return None
        bt = te.compute((8, 4), lambda j, i: reads.get(tensor_key(a), a)[i, j] + 1.0, name="bt")
        return bt.op, lambda i, j: bt[j, i]

    new_of, replaced = sweep([a.op, b.op, c.op], rewrite)
    assert replaced == 1
    lib = tvm.compile(te.create_prim_func([x, new_of[tensor_key(c)]]), target="llvm")
    data = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = tvm.runtime.tensor(np.zeros((4, 8), np.float32))
    lib["main"](tvm.runtime.tensor(data), out)
    np.testing.assert_allclose(out.numpy(), (data * 2 + 1) ** 2)
