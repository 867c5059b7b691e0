"""Dynamic dimensions: which input axes vary, over which range, and which of them must agree.

`optimize(model, dynamic=...)` takes, per input, axis -> (min, max):
    {"input_ids": {0: (1, 8), 1: (1, 512)}}
or, per symbolic dimension of the ONNX graph (its dim_param), name -> (min, max):
    {"batch": (1, 8), "sequence": (1, 512)}
(both forms mix). Axes that share a dim_param in the model are one symbol: a range given for one of them
covers all, and at run time they must have one value. Every symbolic input dimension needs a range (give
(n, n) to fix one); a fixed dimension cannot be made dynamic (the graph's constants are computed for it).

DynamicSpec is a pure description (no TVM): it checks a spec against the model's inputs
(DynamicShapeError naming the input, axis or name) and a run's feeds against the ranges (InputError
naming input, axis and range), and turns a run's feeds into the key of its shape.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from souffle_py.errors import DynamicShapeError, InputError


@dataclass(frozen=True)
class InputDims:
    """One model input: each dimension a fixed size (int) or the name of its symbol (str)."""

    name: str
    dims: tuple
    dtype: str


@dataclass(frozen=True)
class DynamicSpec:
    inputs: tuple[InputDims, ...]
    ranges: tuple[tuple[str, int, int], ...]  # (symbol, min, max), in the order the inputs first use them

    # --- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, proto: "onnx.ModelProto", dynamic) -> "DynamicSpec":
        """The spec of `dynamic` for the graph inputs of `proto`, checked (DynamicShapeError)."""
        import onnx

        if not isinstance(dynamic, Mapping) or not dynamic:
            raise DynamicShapeError("dynamic must be a non-empty dict: input name -> {axis: (min, max)}, or "
                                    f"symbolic dimension name -> (min, max); got {dynamic!r}")
        inputs, symbol_at = [], {}  # symbol_at: (input, axis) -> symbol for every symbolic axis
        weights = {init.name for init in proto.graph.initializer}
        for vi in (vi for vi in proto.graph.input if vi.name not in weights):
            if not vi.type.HasField("tensor_type"):
                raise DynamicShapeError(f"input '{vi.name}' is not a tensor; only tensor inputs are supported")
            tensor_type = vi.type.tensor_type
            if not tensor_type.HasField("shape"):
                raise DynamicShapeError(f"input '{vi.name}' has no shape in the model, so its rank is unknown; "
                                        "give the model input a shape (symbolic dimensions allowed)")
            dims = []
            for axis, dim in enumerate(tensor_type.shape.dim):
                if dim.HasField("dim_value") and dim.dim_value > 0:
                    dims.append(int(dim.dim_value))
                else:
                    symbol = dim.dim_param or f"{vi.name}[{axis}]"
                    dims.append(symbol)
                    symbol_at[(vi.name, axis)] = symbol
            dtype = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)))
            inputs.append(InputDims(vi.name, tuple(dims), dtype))
        by_name = {i.name: i for i in inputs}
        symbols = {s for s in symbol_at.values()}
        ranges: dict[str, tuple[int, int]] = {}

        def give(symbol, value, what):
            bounds = _range(value, what)
            if symbol in ranges and ranges[symbol] != bounds:
                raise DynamicShapeError(f"{what}: range {bounds[0]}..{bounds[1]} conflicts with "
                                        f"{ranges[symbol][0]}..{ranges[symbol][1]} given for the same symbolic "
                                        f"dimension '{symbol}'")
            ranges[symbol] = bounds

        for key, value in dynamic.items():
            if isinstance(value, Mapping):
                if key not in by_name:
                    raise DynamicShapeError(f"dynamic names '{key}', which is not an input of the model (its "
                                            f"inputs: {sorted(by_name)})")
                spec = by_name[key]
                for axis, bounds in value.items():
                    try:
                        index = operator.index(axis)
                    except TypeError:
                        index = None
                    if index is None or isinstance(axis, bool) or not -len(spec.dims) <= index < len(spec.dims):
                        raise DynamicShapeError(f"dynamic['{key}'] names axis {axis!r}, but input '{key}' has rank "
                                                f"{len(spec.dims)} (axes 0..{len(spec.dims) - 1})")
                    index %= len(spec.dims)
                    if isinstance(spec.dims[index], int):
                        raise DynamicShapeError(f"input '{key}' axis {index} is fixed to {spec.dims[index]} in the "
                                                "model; only symbolic dimensions can be dynamic (export the model "
                                                "with this axis dynamic)")
                    give(spec.dims[index], bounds, f"dynamic['{key}'][{index}]")
            elif key in symbols:
                give(key, value, f"dynamic['{key}']")
            elif key in by_name:
                raise DynamicShapeError(f"dynamic['{key}'] must map axes to ranges, e.g. {{'{key}': {{1: (1, 512)}}}}, "
                                        f"got {value!r}")
            else:
                named = sorted({s for s in symbols if "[" not in s})
                raise DynamicShapeError(f"dynamic names '{key}', which is neither an input of the model (its "
                                        f"inputs: {sorted(by_name)}) nor a symbolic dimension of its inputs "
                                        f"({', '.join(repr(s) for s in named) or 'it names none'})")
        for (name, axis), symbol in symbol_at.items():
            if symbol not in ranges:
                called = f" ('{symbol}')" if "[" not in symbol else ""
                raise DynamicShapeError(f"input '{name}' axis {axis} is symbolic{called} but dynamic gives it no "
                                        f"range: add {{'{name}': {{{axis}: (min, max)}}}} (or (n, n) to fix it)")
        order = list(dict.fromkeys(symbol_at.values()))
        return cls(tuple(inputs), tuple((s, *ranges[s]) for s in order))

    # --- at run time -------------------------------------------------------------------------------------------
    def key(self, feeds) -> tuple[int, ...]:
        """The value of each symbol in `feeds` (InputError naming what does not fit)."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> numpy array, got {type(feeds).__name__}")
        missing = [i.name for i in self.inputs if i.name not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model expects " + self.inputs_text())
        unexpected = [n for n in feeds if n not in {i.name for i in self.inputs}]
        if unexpected:
            raise InputError(f"unexpected input(s) {unexpected}; the model's inputs are "
                             f"{[i.name for i in self.inputs]}")
        bounds = {s: (lo, hi) for s, lo, hi in self.ranges}
        seen: dict[str, tuple[int, str, int]] = {}
        for spec in self.inputs:
            value = feeds[spec.name]
            shape = getattr(value, "shape", None)
            if not isinstance(value, np.ndarray):
                raise InputError(f"input '{spec.name}' must be a numpy array, got {type(value).__name__}")
            if str(value.dtype) != spec.dtype:
                raise InputError(f"input '{spec.name}' has dtype {value.dtype}, expected {spec.dtype}")
            if len(shape) != len(spec.dims):
                raise InputError(f"input '{spec.name}' has shape {list(shape)} (rank {len(shape)}), expected rank "
                                 f"{len(spec.dims)}: {self.dims_text(spec)}")
            for axis, (size, dim) in enumerate(zip(shape, spec.dims)):
                if isinstance(dim, int):
                    if size != dim:
                        raise InputError(f"input '{spec.name}' has shape {list(shape)}: axis {axis} must be {dim} "
                                         f"({self.dims_text(spec)})")
                    continue
                lo, hi = bounds[dim]
                if not lo <= size <= hi:
                    called = f" ('{dim}')" if "[" not in dim else ""
                    raise InputError(f"input '{spec.name}' axis {axis}{called} is {size}, outside the range "
                                     f"{lo}..{hi} the model was compiled for")
                if dim in seen and seen[dim][0] != size:
                    first_size, first_name, first_axis = seen[dim]
                    raise InputError(f"input '{spec.name}' axis {axis} is {size} but input '{first_name}' axis "
                                     f"{first_axis} is {first_size}: both are the symbolic dimension '{dim}'")
                seen.setdefault(dim, (size, spec.name, axis))
        return tuple(seen[s][0] for s, _, _ in self.ranges)

    def quick_key(self, feeds) -> tuple[int, ...] | None:
        """The key of `feeds` read from the first axis of each symbol, unchecked (None where it cannot be
        read): the run() fast path, whose CompiledModel then checks every input's whole shape and dtype."""
        try:
            return tuple(feeds[name].shape[axis] for name, axis in self._first_axes)
        except (KeyError, IndexError, AttributeError, TypeError):
            return None

    @property
    def _first_axes(self) -> tuple[tuple[str, int], ...]:
        first = self.__dict__.get("_first")
        if first is None:
            where = {}
            for spec in self.inputs:
                for axis, dim in enumerate(spec.dims):
                    if isinstance(dim, str):
                        where.setdefault(dim, (spec.name, axis))
            first = tuple(where[s] for s in self.symbols)
            object.__setattr__(self, "_first", first)
        return first

    def check_key(self, values) -> tuple[int, ...]:
        """A shape given by the caller (a dict symbol -> value, or a key tuple), checked against the ranges."""
        if isinstance(values, Mapping):
            unknown = sorted(set(values) - {s for s, _, _ in self.ranges})
            if unknown:
                raise InputError(f"shape names {unknown}; the dynamic dimensions are {self.symbols}")
            absent = [s for s, _, _ in self.ranges if s not in values]
            if absent:
                raise InputError(f"shape gives no value for {absent}; the dynamic dimensions are {self.symbols}")
            values = tuple(values[s] for s, _, _ in self.ranges)
        values = tuple(values)
        if len(values) != len(self.ranges):
            raise InputError(f"a shape gives one value per dynamic dimension {self.symbols}, got {values!r}")
        for value, (symbol, lo, hi) in zip(values, self.ranges):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
                raise InputError(f"'{symbol}' = {value!r} is outside its range {lo}..{hi}")
        return tuple(int(v) for v in values)

    # --- shapes ------------------------------------------------------------------------------------------------
    @property
    def symbols(self) -> list[str]:
        return [s for s, _, _ in self.ranges]

    def shapes(self, key: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The concrete shape of every input with a symbolic dimension at `key` (optimize's input_shapes)."""
        values = dict(zip(self.symbols, key))
        return {i.name: tuple(values.get(d, d) for d in i.dims) for i in self.inputs
                if any(isinstance(d, str) for d in i.dims)}

    def bound_key(self, which: str) -> tuple[int, ...]:
        return tuple(lo if which == "min" else hi for _, lo, hi in self.ranges)

    def label(self, key: tuple[int, ...]) -> str:
        """`key` in words: 'input_ids[0]=2 (batch), input_ids[1]=37 (sequence)'."""
        where = {}
        for spec in self.inputs:
            for axis, dim in enumerate(spec.dims):
                if isinstance(dim, str):
                    where.setdefault(dim, f"{spec.name}[{axis}]")
        return ", ".join(f"{where[s]}={v}" + (f" ({s})" if "[" not in s else "") for s, v in zip(self.symbols, key))

    def short(self, key: tuple[int, ...]) -> str:
        return ", ".join(f"{s}={v}" for s, v in zip(self.symbols, key))

    def dims_text(self, spec: InputDims) -> str:
        bounds = {s: (lo, hi) for s, lo, hi in self.ranges}
        parts = [str(d) if isinstance(d, int) else f"{d}:{bounds[d][0]}..{bounds[d][1]}" for d in spec.dims]
        return f"'{spec.name}' [{', '.join(parts)}] {spec.dtype}"

    def inputs_text(self) -> str:
        return ", ".join(self.dims_text(i) for i in self.inputs)

    def random_feeds(self, key: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs at `key` for tests and benchmarks: standard-normal floats, 0/1 integers and booleans (as
        ExecutionPlan.random_feeds)."""
        rng = np.random.default_rng(seed)
        values = dict(zip(self.symbols, key))
        feeds = {}
        for spec in self.inputs:
            shape = tuple(values.get(d, d) for d in spec.dims)
            value = rng.standard_normal(shape) if spec.dtype.startswith("float") else rng.integers(0, 2, shape)
            feeds[spec.name] = value.astype(spec.dtype)
        return feeds

    # --- persistence -------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"inputs": [{"name": i.name, "dims": list(i.dims), "dtype": i.dtype} for i in self.inputs],
                "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, data: dict) -> "DynamicSpec":
        return cls(tuple(InputDims(i["name"], tuple(i["dims"]), i["dtype"]) for i in data["inputs"]),
                   tuple((s, int(lo), int(hi)) for s, lo, hi in data["ranges"]))


def _range(value, what: str) -> tuple[int, int]:
    """(min, max) of a range given as a 2-sequence of positive integers, min <= max."""
    try:
        lo, hi = value
        lo, hi = operator.index(lo), operator.index(hi)
    except (TypeError, ValueError):
        raise DynamicShapeError(f"{what} must be a range (min, max) of positive integers, got {value!r}") from None
    if isinstance(value, (str, bytes)) or lo < 1:
        raise DynamicShapeError(f"{what} must be a range (min, max) of positive integers, got {value!r}")
    if lo > hi:
        raise DynamicShapeError(f"{what}: min {lo} > max {hi}")
    return int(lo), int(hi)
