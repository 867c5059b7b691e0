"""Lower a checked ONNX graph to a TEProgram, node by node, through the rule table.

Nodes whose inputs are all compile-time constants are folded with onnx's reference evaluator (so shape
arithmetic such as Shape -> Gather -> Concat -> Reshape needs no TE at all); every other node goes through
its rule. Each TE a rule creates is renamed after its ONNX node, so kernels and reports can be traced back.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tvm import te

from souffle_py.errors import SouffleError, UnsupportedError, UnsupportedNodesError
from souffle_py.frontend import ops  # noqa: F401  (registers the rules)
from souffle_py.frontend.context import KNOWN_ATTRIBUTES, RULES, NodeContext, sanitize
from souffle_py.frontend.loader import graph_inputs
from souffle_py.frontend.ops.util import SUPPORTED_DTYPES
from souffle_py.ir.program import TEProgram
from souffle_py.ir.graph import compute_ops, rebuild, tensor_key

log = logging.getLogger(__name__)

NEVER_FOLD_PREFIXES = ("Random",)  # nondeterministic: must not be frozen at compile time
# kept a TE over its integer constant, so that te_passes/int8_gemm.py sees the int8 weight (frontend/ops/quantize.py)
NEVER_FOLD_TYPES = frozenset({"DequantizeLinear"})
# operators of ONNX Runtime's com.microsoft domain that its quantization tools emit, lowered like ONNX's own
MICROSOFT_OPS = frozenset({"QLinearAdd", "QLinearMul"})
UNAVAILABLE = object()  # the value of an output whose node could not be lowered (its readers are checked alone)


def _gather_elements(node, data, indices):
    """GatherElements as np.take_along_axis, negative indices counted from the end."""
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0) % data.ndim
    return [np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis)]


# Folds done with numpy where onnx's reference evaluator fails: its GatherElements takes np.choose, which
# allows at most 32 values along the axis (Funnel's relative-position embeddings gather 512 rows; unfolded,
# their four 0.3 GFLOP projections ran at every inference, which ONNX Runtime folds away).
NUMPY_FOLDS = {"GatherElements": _gather_elements}


class _Names:
    """Unique, C-safe names for placeholders and TE ops."""

    def __init__(self):
        self.used: set[str] = set()

    def __call__(self, base: str) -> str:
        base = sanitize(base)
        name, n = base, 1
        while name in self.used:
            name, n = f"{base}_{n}", n + 1
        self.used.add(name)
        return name


def lower(proto: onnx.ModelProto) -> TEProgram:
    """The TEProgram of a model that `loader.load_model` has checked and made concrete (the ONNX-level
    folds, e.g. conv_branches.py, are passes: passes/folds.py)."""
    return _Lowering(proto).run()


def node_display_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


class _Lowering:
    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto
        self.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.names = _Names()
        self.values: dict[str, object] = {}
        self.param_tensors: dict[str, te.Tensor] = {}
        self.params: dict[str, np.ndarray] = {}
        self._param_of_value: dict[str, te.Tensor] = {}
        self._derived_params: dict[tuple, te.Tensor] = {}
        self.origins: dict[str, str] = {}
        self.known_ops: set = set()
        self.inferred = {vi.name: vi for vi in list(proto.graph.value_info) + list(proto.graph.output)}

    def run(self) -> TEProgram:
        graph = self.proto.graph
        for init in graph.initializer:
            self.values[init.name] = numpy_helper.to_array(init)
        inputs = {}
        for vi in graph_inputs(self.proto):
            tt = vi.type.tensor_type
            shape = [d.dim_value for d in tt.shape.dim]
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
            if str(dtype) not in SUPPORTED_DTYPES:  # e.g. strings, bfloat16, float8: TVM has no such dtype
                raise UnsupportedError(vi.name, "graph input", f"element type "
                                       f"{onnx.TensorProto.DataType.Name(tt.elem_type)} is not supported")
            inputs[vi.name] = te.placeholder(shape, str(dtype), name=self.names(vi.name))
            self.values[vi.name] = inputs[vi.name]
        errors = []
        for index, node in enumerate(graph.node):
            name = node_display_name(node, index)
            try:
                self._lower_node(node, name)
            except UnsupportedError as exc:  # every unsupported node is named at once, not the first alone
                errors.append(exc)
                for out_name in node.output:
                    self.values[out_name] = UNAVAILABLE
        if errors:
            raise errors[0] if len(errors) == 1 else UnsupportedNodesError(errors)
        outputs = {}
        for vi in graph.output:
            if vi.name not in self.values:
                raise SouffleError(f"graph output '{vi.name}' is not produced by any node")
            value = self.values[vi.name]
            outputs[vi.name] = self.tensor_of(vi.name) if isinstance(value, np.ndarray) else value
        return TEProgram(inputs=inputs, params=self.params, param_tensors=self.param_tensors,
                         outputs=outputs, origins=self.origins)

    def tensor_of(self, value_name: str) -> te.Tensor:
        """The parameter placeholder of a compile-time constant (one per ONNX value, made on first use)."""
        if value_name not in self._param_of_value:
            self._param_of_value[value_name] = self.new_param(self.values[value_name], value_name)
        return self._param_of_value[value_name]

    def new_param(self, array: np.ndarray, base_name: str) -> te.Tensor:
        """A parameter placeholder holding `array`: the one made before from the same `base_name` where it
        holds the same values (an initializer shared by several convs is blocked for each of them, and
        would otherwise be stored and streamed from memory once per conv), else a fresh one."""
        array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes a 0-d array 1-d
        key = (base_name, array.shape, str(array.dtype))
        earlier = self._derived_params.get(key)
        if earlier is not None and np.array_equal(self.params[earlier.op.name], array):
            return earlier
        name = self.names(base_name)
        self.params[name] = array
        self.param_tensors[name] = te.placeholder(array.shape, str(array.dtype), name=name)
        self._derived_params[key] = self.param_tensors[name]
        return self.param_tensors[name]

    def _lower_node(self, node: onnx.NodeProto, name: str) -> None:
        microsoft = node.domain == "com.microsoft" and node.op_type in MICROSOFT_OPS
        if node.domain not in ("", "ai.onnx") and not microsoft:
            raise UnsupportedError(name, node.op_type, f"operators of domain '{node.domain}' are not supported")
        for attr in node.attribute:
            if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise UnsupportedError(name, node.op_type, "control flow with subgraphs is not supported")
        if any(self.values.get(i) is UNAVAILABLE for i in node.input if i):
            self._check_alone(node, name)  # it reads an unlowered node's output: what can be said without it
            for out_name in node.output:
                self.values[out_name] = UNAVAILABLE
            return
        values = []
        for i, input_name in enumerate(node.input):
            if not input_name:
                values.append(None)
            elif input_name not in self.values:
                raise SouffleError(f"node '{name}' ({node.op_type}): input {i} '{input_name}' "
                                   "is not produced by any earlier node")
            else:
                values.append(self.values[input_name])
        present = [v for v in values if v is not None]
        results = None
        if all(isinstance(v, np.ndarray) for v in present) and not node.op_type.startswith(NEVER_FOLD_PREFIXES) \
                and not (node.op_type in NEVER_FOLD_TYPES and present[0].size > 1):
            results = self._fold(node, name, values)
        if results is None:
            results = self._apply_rule(node, name, values)
        for out_name, result in zip(node.output, results):
            if out_name:
                self.values[out_name] = result

    def _fold(self, node, name, values) -> list[np.ndarray] | None:
        """The node's outputs computed by onnx's reference evaluator (by numpy for NUMPY_FOLDS), or None where
        it cannot (it implements some old opset forms, e.g. Unsqueeze-11's axes attribute, with the newest
        version): then the node is lowered by its rule like any other, its constant inputs becoming parameters."""
        feeds = {n: v for n, v in zip(node.input, values) if n}
        try:
            if node.op_type in NUMPY_FOLDS:
                return NUMPY_FOLDS[node.op_type](node, *values)
            # a one-node model, not the bare node: only a model makes the evaluator pick the implementation
            # of the model's opset (a bare node gets the newest one)
            graph = helper.make_graph(
                [node], "fold", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                 for n, v in feeds.items()],
                [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
            results = ReferenceEvaluator(model).run(None, feeds)
            outputs = iter(np.asarray(r) for r in results)
            return [next(outputs) if o else None for o in node.output]
        except Exception as exc:
            if node.op_type not in RULES:
                raise UnsupportedError(name, node.op_type, f"constant folding failed: {exc}") from None
            log.info("node '%s' (%s): constant folding failed (%s); lowering it instead", name, node.op_type, exc)
            return None

    def _check_alone(self, node, name) -> None:
        """The checks a node passes or fails whatever its inputs: a rule for its op type, its attributes."""
        if node.op_type not in RULES:
            raise UnsupportedError(name, node.op_type, "this operator type is not supported "
                                   f"(supported: {', '.join(sorted(RULES))})")
        unknown = sorted(a.name for a in node.attribute if a.name not in KNOWN_ATTRIBUTES[node.op_type])
        if unknown:
            raise UnsupportedError(name, node.op_type, f"attribute(s) {unknown} are not supported")

    def _apply_rule(self, node, name, values) -> list:
        self._check_alone(node, name)
        rule = RULES[node.op_type]
        ctx = NodeContext(node, name, self.opset, values, self.tensor_of, self.new_param)
        try:
            results = list(rule(ctx))
        except SouffleError:
            raise
        except Exception as exc:  # a TVM or numpy failure inside a rule is our bug, but name the node
            raise SouffleError(f"internal error while lowering node '{name}' ({node.op_type}): "
                               f"{type(exc).__name__}: {exc}") from exc
        results += [None] * (len(node.output) - len(results))
        missing = [o for o, r in zip(node.output, results) if o and r is None]
        if missing:
            raise UnsupportedError(name, node.op_type, f"output(s) {missing} are not supported")
        results = self._rename(results[: len(node.output)], name)
        self._check_shapes(node, name, results)
        return results

    def _rename(self, results: list, node_name: str) -> list:
        """Give the TEs a rule created names derived from the node, and record their origin."""
        tensors = [r for r in results if isinstance(r, te.Tensor)]
        new_ops = compute_ops(tensors, stop=self.known_ops)
        mapping = {}
        for op in new_ops:
            base = node_name if len(new_ops) == 1 else f"{node_name}_{op.name}"
            new_op = rebuild(op, mapping, name=self.names(base))
            for i in range(op.num_outputs):
                mapping[tensor_key(op.output(i))] = new_op.output(i)
            self.known_ops.add(new_op)
            self.origins[new_op.name] = node_name
        return [mapping.get(tensor_key(r), r) if isinstance(r, te.Tensor) else r for r in results]

    def _check_shapes(self, node, name, results) -> None:
        for out_name, result in zip(node.output, results):
            vi = self.inferred.get(out_name)
            if not out_name or result is None or vi is None or not vi.type.tensor_type.HasField("shape"):
                continue
            dims = vi.type.tensor_type.shape.dim
            if not all(d.HasField("dim_value") for d in dims):
                continue
            expected = tuple(d.dim_value for d in dims)
            got = tuple(int(d) for d in result.shape)
            if expected != got:
                raise SouffleError(f"internal error lowering node '{name}' ({node.op_type}): output "
                                   f"'{out_name}' has shape {got}, ONNX shape inference says {expected}")
