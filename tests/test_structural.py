"""StructuralMap (souffle_py/structural.py): IR keys up to structural equality, names ignored."""

from tvm import te

from souffle_py.structural import StructuralMap


def _double(name: str, n: int = 8):
    x = te.placeholder((n,), name=f"{name}_in")
    return te.create_prim_func([x, te.compute((n,), lambda i: x[i] * 2, name=f"{name}_out")])


def test_equal_functions_share_an_entry_whatever_their_names():
    found = StructuralMap()
    found.set(_double("a"), "first")
    assert found.get(_double("b")) == "first" and found.get(_double("c", 16)) is None
    assert found.setdefault(_double("d"), lambda: "second") == "first"
    assert not found.has(_double("a"), extra="cuda")  # the extra key separates
    found.set(_double("a"), None, extra="cuda")
    assert found.has(_double("e"), extra="cuda") and found.get(_double("e"), extra="cuda", default=1) is None
