"""No import circle in souffle_py/ and te_passes/, imports inside functions included.

Each module's imports are read with `ast` (every `import` and `from ... import` statement, wherever it
stands) and resolved to the package's modules: `from a.b import c` is an edge to a.b.c when c is a
submodule, else to a.b. A package's __init__ counts when it is named, not when Python merely runs it on
the way to a submodule (that is how every package with submodules works, and no circle). A circle is a
strongly connected component of more than one module, or a module that imports itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("souffle_py", "te_passes")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join([*package, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a module below a.b.c: a.b.c
                    target = target.rpartition(".")[0]
                if target and target.split(".")[0] in PACKAGES and target not in PACKAGES:
                    edges.add(target)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a circle (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_finds_a_circle_through_a_function_level_import():
    graph = {"souffle_py.a": {"souffle_py.b"}, "souffle_py.b": {"souffle_py.c"}, "souffle_py.c": {"souffle_py.a"},
             "souffle_py.d": {"souffle_py.a"}}
    assert circles(graph) == [["souffle_py.a", "souffle_py.b", "souffle_py.c"]]
    source = "def f():\n    from souffle_py.schedule import tuning\n"
    tree_imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    assert tree_imports and tree_imports[0].module == "souffle_py.schedule"  # found inside the function


def test_the_graph_sees_the_real_edges():
    graph = import_graph(module_files())
    assert "souffle_py.errors" in graph["souffle_py.api"] or "souffle_py.backends" in graph["souffle_py.api"]
    assert "souffle_py.backends.cpu" in graph["souffle_py.backends"]  # backend_for's function-level import


def test_no_import_circle_in_the_packages():
    found = circles(import_graph(module_files()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_ir_core_sits_below_everything():
    """souffle_py/ir (program, graph, exprs, marks, analysis) imports nothing of souffle-py outside it but
    the errors: te_passes, the passes, the schedules and the backends build on it, never the reverse."""
    graph = import_graph(module_files())
    core = {name for name in graph if name.startswith("souffle_py.ir")}
    assert {"souffle_py.ir.program", "souffle_py.ir.graph", "souffle_py.ir.marks", "souffle_py.ir.analysis"} <= core
    above = {name: sorted(t for t in graph[name] if not t.startswith("souffle_py.ir") and t != "souffle_py.errors")
             for name in core}
    assert not {k: v for k, v in above.items() if v}, above
