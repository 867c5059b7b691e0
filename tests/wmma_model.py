"""A numpy model of the wmma calls in generated CUDA, for checking a tensor-core stage's fragment addressing
without a GPU: each 16 x 16 x 16 `load_matrix_sync` reads its window of a shared-memory tile with its `ldm`
and layout, `mma_sync` multiplies and adds in float32, `store_matrix_sync` writes its window row-major.

`run_stage` executes one stage's wmma calls (the body of its per-block tile loop, cooperative loads and
write-backs left out, each K step's shared tiles loaded once) for every warp of a block, over operand tiles
of random values whose row padding holds NaN, and returns the accumulator tile it stores: it must be the
product of the operand tiles, every element of it written (a fragment reading padding, another warp's
rows, or storing to the wrong place shows as NaN or a wrong value)."""

from __future__ import annotations

import re

import numpy as np

WARPS = 8
FRAGMENT = 16
FRAGMENT_DECL = re.compile(r"wmma::fragment<nvcuda::wmma::(\w+), 16, 16, 16, \w+(?:, nvcuda::wmma::(\w+))?> (\w+)\[\d+\];")
SHARED_DECL = re.compile(r"__shared__ alignas\(\d+\) (\w+) (\w+)\[(\d+)\];")
FOR = re.compile(r"for \(int (\w+) = 0; \1 < (.+); \+\+\1\) \{$")
CALLS = [(re.compile(r"nvcuda::wmma::fill_fragment\((\w+)\[(.+?)\], .+\);$"), "fill('{0}', {1})"),
         (re.compile(r"nvcuda::wmma::load_matrix_sync\((\w+)\[(.+?)\], \(&\((\w+)\[(.+)\]\)\), (\d+)\);$"),
          "load('{0}', {1}, '{2}', {3}, {4})"),
         (re.compile(r"nvcuda::wmma::mma_sync\((\w+)\[(.+?)\], (\w+)\[(.+?)\], (\w+)\[(.+?)\], (\w+)\[(.+?)\]\);$"),
          "mma('{0}', {1}, '{2}', {3}, '{4}', {5}, '{6}', {7})"),
         (re.compile(r"nvcuda::wmma::store_matrix_sync\(\(&\((\w+)\[(.+)\]\)\), (\w+)\[(.+?)\], (\d+), "
                     r"nvcuda::wmma::mem_row_major\);$"), "store('{0}', {1}, '{2}', {3}, {4})")]


def stages(source: str) -> list[str]:
    """The tensor-core stages of `source` (loops of a per-block extent whose body multiplies fragments), each
    as Python code calling fill, load, mma and store, over the warp index `ty`."""
    lines = [line.strip() for line in source.splitlines()]
    found, i = [], 0
    while i < len(lines):
        match = FOR.match(lines[i])
        end = _end(lines, i) if match else i + 1
        if match and "blockIdx" in match.group(2) and any("mma_sync" in line for line in lines[i:end]):
            found.append(_translate(lines[i + 1:end - 1]))
        i = end if match and "blockIdx" in match.group(2) else i + 1
    return found


def _end(lines, start) -> int:
    """The line after the block that opens at `start`."""
    depth, j = 0, start
    while True:
        depth += lines[j].endswith("{") - lines[j].startswith("}")
        j += 1
        if depth == 0:
            return j


def _translate(body) -> str:
    code, i, depth = [], 0, 0
    while i < len(body):
        line = body[i]
        if line.startswith("}"):
            depth -= 1
        elif line.endswith("{"):
            end = _end(body, i)
            match = FOR.match(line)
            if match is None or not any("wmma::" in inner for inner in body[i:end]):
                i = end  # a cooperative load, a write-back, a condition: no fragments
                continue
            # the K loop, whose tiles the block reloads at each step: modelled once
            steps = 1 if "__syncthreads();" in body[i + 1:end] else _python(match.group(2))
            code.append("    " * depth + f"for {match.group(1)} in range({steps}):")
            depth += 1
        else:
            for pattern, template in CALLS:
                call = pattern.match(line)
                if call:
                    code.append("    " * depth + template.format(*(_python(g) for g in call.groups())))
        i += 1
    return "\n".join(code)


def _python(expr: str) -> str:
    return expr.replace("((int)threadIdx.y)", "ty").replace("/", "//")


def run_stage(source: str, code: str, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(A tile, B tile (rows: output columns, as staged), the stored accumulator tile, its expected value) of
    one stage (`code`, from `stages`) of `source`, all its warps run."""
    kinds = {name: (kind, layout) for kind, layout, name in FRAGMENT_DECL.findall(source)}
    sizes = {name: int(size) for _, name, size in SHARED_DECL.findall(source)}
    aligned = {name: 8 if dtype == "float" else 16 for dtype, name, _ in SHARED_DECL.findall(source)}  # 32 bytes
    operand = {kind: None for kind in ("matrix_a", "matrix_b")}
    for name, _, buffer, _, ldm in re.findall(r"load\('(\w+)', (.+?), '(\w+)', (.+), (\d+)\)", code):
        operand[kinds[name][0]] = (buffer, int(ldm))
    (store_buffer, store_ldm), = set(re.findall(r"store\('(\w+)', .+, (\d+)\)", code))
    memory = {}
    for kind, (buffer, ldm) in operand.items():
        tile = np.full((sizes[buffer] // ldm, ldm), np.nan)
        tile[:, :ldm - 8] = rng.standard_normal((sizes[buffer] // ldm, ldm - 8))  # rows padded by 8
        memory[buffer] = tile.reshape(-1)
    memory[store_buffer] = np.full(sizes[store_buffer], np.nan)
    for ty in range(WARPS):
        fragments = {name: {} for name in kinds}

        def fill(name, index):
            fragments[name][index] = np.zeros((FRAGMENT, FRAGMENT))

        def load(name, index, buffer, offset, ldm):
            window = memory[buffer][_window(memory[buffer], offset, ldm, aligned[buffer])]
            kind, layout = kinds[name]
            # matrix_a (m x k) row-major: A[i][k] = p[i * ldm + k]; matrix_b (k x n) col-major: B[k][j] = p[j * ldm + k]
            fragments[name][index] = window.T if (kind, layout) == ("matrix_b", "col_major") else window

        def mma(d, di, a, ai, b, bi, c, ci):
            fragments[d][di] = fragments[c][ci] + fragments[a][ai] @ fragments[b][bi]

        def store(buffer, offset, name, index, ldm):
            at = _window(memory[buffer], offset, ldm, aligned[buffer])
            assert np.isnan(memory[buffer][at]).all(), "a window stored twice"
            memory[buffer][at] = fragments[name][index]

        exec(code, {"range": range, "ty": ty, "fill": fill, "load": load, "mma": mma, "store": store})
    (a_buffer, a_ldm), (b_buffer, b_ldm) = operand["matrix_a"], operand["matrix_b"]
    a = memory[a_buffer].reshape(-1, a_ldm)[:, :a_ldm - 8]
    b = memory[b_buffer].reshape(-1, b_ldm)[:, :b_ldm - 8]
    return a, b, memory[store_buffer].reshape(-1, int(store_ldm)), a @ b.T


def _window(flat: np.ndarray, offset: int, ldm: int, aligned: int) -> np.ndarray:
    """The indices of the 16 x 16 window at `offset` of a row-major tile of row length `ldm`: wmma needs its
    pointer 32-byte aligned (`aligned` elements) and the window inside the tile."""
    assert offset % aligned == 0 and offset % ldm + FRAGMENT <= ldm and offset + (FRAGMENT - 1) * ldm + FRAGMENT <= flat.size
    return offset + np.arange(FRAGMENT)[:, None] * ldm + np.arange(FRAGMENT)[None, :]
