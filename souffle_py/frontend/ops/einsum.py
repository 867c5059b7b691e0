"""Einsum as one TE: the output labels are its spatial axes, every other label a reduction axis.

One contraction TE (rather than a chain of transposes and MatMuls) keeps the element-level dependences
explicit for the analysis; a two-operand contraction over one label is a GEMM to the default schedules.
"""

from __future__ import annotations

import string

from tvm import te

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import dtype_of, shape_of

ELLIPSIS_LABELS = string.digits  # stand-ins for the axes an ellipsis covers (never valid subscripts)


def parse(equation: str, ranks) -> tuple[list[str], str]:
    """Operand label strings and the output label string, with every '...' expanded to digit labels that
    are aligned from the right across operands (numpy broadcasting)."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"{len(terms)} operand terms for {len(ranks)} inputs")
    ellipsis_rank = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    if ellipsis_rank > len(ELLIPSIS_LABELS):
        raise ValueError(f"an ellipsis over {ellipsis_rank} axes")
    full = ELLIPSIS_LABELS[:ellipsis_rank]
    expanded = []
    for term, rank in zip(terms, ranks):
        covered = rank - len(term.replace("...", ""))
        if "..." in term and covered >= 0:
            term = term.replace("...", full[ellipsis_rank - covered:])
        if len(term) != rank or not all(c.isalpha() or c in full for c in term):
            raise ValueError(f"term '{term}' does not label the {rank} axes of its operand")
        expanded.append(term)
    if arrow:
        output = rhs.replace("...", full)
    else:
        counts = {c: "".join(expanded).count(c) for c in set("".join(expanded)) if c.isalpha()}
        output = full + "".join(sorted(c for c, n in counts.items() if n == 1))
    if len(set(output)) != len(output) or any(c not in "".join(expanded) for c in output):
        raise ValueError(f"output labels '{rhs}' must be distinct labels of the inputs")
    return expanded, output


def einsum(operands, terms, output: str) -> te.Tensor:
    sizes: dict[str, int] = {}
    for t, term in zip(operands, terms):
        for label, size in zip(term, shape_of(t)):
            known = sizes.get(label, 1)
            if size != known and 1 not in (size, known):
                raise ValueError(f"label '{label}' has sizes {known} and {size}")
            sizes[label] = max(known, size)
    reduced = sorted({c for term in terms for c in term} - set(output))
    raxes = {c: te.reduce_axis((0, sizes[c]), name=f"r_{c}") for c in reduced}

    def body(*idx):
        index = dict(zip(output, idx), **raxes)
        product = None
        for t, term in zip(operands, terms):
            value = t(*[0 if size == 1 else index[c] for c, size in zip(term, shape_of(t))])
            product = value if product is None else product * value
        return te.sum(product, axis=list(raxes.values())) if raxes else product

    return te.compute(tuple(sizes[c] for c in output), body, name="einsum")


@register("Einsum", attributes=["equation"])
def lower_einsum(ctx):
    operands = [ctx.tensor(i) for i in range(ctx.num_inputs)]
    if len({dtype_of(t) for t in operands}) != 1:
        raise ctx.unsupported(f"operands have different dtypes {[dtype_of(t) for t in operands]}")
    try:
        terms, output = parse(ctx.attr("equation"), [t.ndim for t in operands])
        return [einsum(operands, terms, output)]
    except ValueError as exc:
        raise ctx.unsupported(f"equation {ctx.attr('equation')!r}: {exc}") from None
