"""DynamicModel: one compiled model for every shape in a range, by exact-shape specialisation.

souffle-py's schedules are specialised to their shapes (tile sizes, vector widths, the partition itself), so
a kernel with symbolic extents would give up most of what the compiler does. A DynamicModel instead holds one
CompiledModel per concrete shape it has seen, each compiled by the unchanged whole-model pipeline (every
SOUFFLE analysis, partition and schedule runs on that shape), so a call runs at the speed of a static compile
of its shape:

- `optimize(model, dynamic=...)` checks the ranges (dynamic_spec.py) and compiles the `precompile` shapes
  (default: the smallest shape, so that a model the compiler cannot handle fails at optimize(), and the
  compile does not grow with the size of the range);
- `run(feeds)` at a shape not compiled yet compiles it first (logged at INFO: "compiling input_ids[1]=37
  ..."), exactly once even with concurrent callers (a lock per shape; calls at other shapes keep running;
  compiles in one process run one at a time), through the compile cache, so the next process loads it;
  `warm(shapes, background=True)` compiles expected shapes in a thread while the model serves;
- the shapes share their weights: an array equal to one an earlier shape holds is replaced by it, and
  uploaded once (CompiledModel.shared_uploads); each shape keeps its library and workspaces, so a service
  over a wide range sets `max_shapes` (least recently used shapes dropped, compiled again, from the
  compile cache, when called again);
- without a fallback (default) a call at a new shape waits for its compile (the tiny BERT: ~1.5-2.5 s;
  BERT-base: a static compile, ~6 s); with fallback="onnxruntime" it runs at once in an ONNX Runtime
  session of the model (any shape, float32; created on first need) while the shape compiles in a
  background thread, and souffle-py's kernels serve the shape from then on. (TVM Relax with symbolic
  dimensions, the other generic form at hand, runs BERT-base untuned in ~20 s per inference on this CPU:
  slower than waiting for the compile.) Nothing is padded.

`export(path)` writes one file: the ONNX model, every specialised shape (export.py's members: plan, library,
checked against their SHA-256) and their weights once (weights.npz), under a manifest (dynamic.json, itself
checked by dynamic.sha256) listing every member's SHA-256. `souffle_py.load()` (loading.py) reads it back
into a DynamicModel that compiles new shapes where the compiler is installed.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import threading
import time
from typing import Callable, Mapping

import numpy as np

from souffle_py import compile_cache
from souffle_py.dynamic_spec import DynamicSpec
from souffle_py.errors import ExportError, InputError, SouffleError
from souffle_py.export import DYNAMIC, model_from_members, model_members, npz_arrays, sha256, write_members
from souffle_py.runtime import CompiledModel, compiled_from

log = logging.getLogger("souffle_py")

FORMAT = 1
MODEL, WEIGHTS, DYNAMIC_SHA = "model.onnx", "weights.npz", "dynamic.sha256"
PERSISTED_OPTIONS = ("passes", "merge", "database", "fast_math", "grid_sync", "precision", "int8")
FALLBACKS = (None, "onnxruntime")
_COMPILING = threading.Lock()  # compiles in one process run one at a time (of every DynamicModel)


class DynamicModel:
    """Run a model at any shape in its ranges: `run(feeds)`, `benchmark()`, `profile()`, `describe()`,
    `export(path)`, `specialise(shape)`, `warm(shapes, background)`, `specialised_shapes`, `max_shapes`."""

    def __init__(self, proto: "onnx.ModelProto | bytes", spec: DynamicSpec, options: Mapping,
                 compiler: Callable | None, target: str, fallback: str | None = None):
        self._proto = proto  # the ONNX model (its bytes, from an exported file, until the first compile)
        self.spec = spec
        self.options = dict(options)   # optimize()'s keywords for each shape
        self.target = target           # as optimize() was given it (or the specialised shapes' target JSON)
        self._compiler = compiler      # (model, input_shapes=..., target=..., **options) -> CompiledModel
        self._models: dict[tuple, CompiledModel] = {}
        self._compile_seconds: dict[tuple, float] = {}
        self._exported: set[tuple] = set()     # shapes read from an exported file
        self._lock = threading.Lock()          # guards _models and _locks
        self._locks: dict[tuple, threading.Lock] = {}  # one per shape being compiled
        self._weights: dict[str, list[np.ndarray]] = {}  # weight name -> the distinct arrays of that name
        self._uploads: dict = {}               # CompiledModel.shared_uploads of every shape
        self.compile_seconds = 0.0             # optimize()'s time (the precompiled shapes)
        self.cached = False
        if fallback not in FALLBACKS:
            raise InputError(f"fallback must be one of {', '.join(map(repr, FALLBACKS))}, got {fallback!r}")
        self.fallback = fallback               # serves a new shape while it compiles in the background
        self._fallback_session = None
        self._fallback_calls = 0
        self._background: dict[tuple, threading.Thread] = {}  # shapes compiling in the background
        self._failed: dict[tuple, str] = {}    # shapes whose background compile failed (the fallback serves them)
        # at most this many shapes are kept (None: every shape); the least recently used goes first, and a
        # later call at it compiles it again (from the compile cache where it is on)
        self.max_shapes: int | None = None
        self._used: dict[tuple, int] = {}      # shape -> the tick of its last call
        self._ticks = itertools.count()
        self.dropped = 0

    # --- the shapes ----------------------------------------------------------------------------------------
    @property
    def specialised_shapes(self) -> list[dict[str, int]]:
        """The shapes compiled so far, each as symbol -> value, in the order they were compiled."""
        return [dict(zip(self.spec.symbols, key)) for key in list(self._models)]

    def specialise(self, shape) -> CompiledModel:
        """The CompiledModel of `shape` (symbol -> value, or one value per symbol in spec order), compiled now
        if it is not yet."""
        return self._model(self.spec.check_key(shape))

    def warm(self, shapes, background: bool = False) -> "threading.Thread | None":
        """Compile `shapes` (a list of symbol -> value) now, or (background) in a thread of their own, which
        is returned: a service warms the shapes it expects at start while it serves; a call at a shape being
        compiled waits for that compile, calls at compiled shapes run meanwhile."""
        keys = [self.spec.check_key(shape) for shape in shapes]
        if not background:
            for key in keys:
                self._model(key)
            return None

        def compile_all():
            for key in keys:
                try:
                    self._model(key)
                except Exception:  # noqa: BLE001  (a run() at this shape raises it again)
                    log.exception("compiling %s in the background failed", self.spec.label(key))

        thread = threading.Thread(target=compile_all, name="souffle-dynamic-warm", daemon=True)
        thread.start()
        return thread

    def _model(self, key: tuple) -> CompiledModel:
        model = self._models.get(key)
        if model is not None:
            return model
        with self._lock:
            model = self._models.get(key)
            if model is not None:
                return model
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # the first caller compiles; the others at this shape wait for it
            model = self._models.get(key)
            if model is not None:
                return model
            model = self._compile(key)
            with self._lock:
                self._models[key] = model
                self._used[key] = next(self._ticks)
                self._locks.pop(key, None)
                self._drop_beyond_max(key)
            return model

    def _drop_beyond_max(self, keep: tuple) -> None:
        """Drop the least recently used shapes beyond max_shapes (never `keep`, the shape just added); a
        call running one of them finishes on it."""
        if self.max_shapes is None:
            return
        if isinstance(self.max_shapes, bool) or not isinstance(self.max_shapes, int) or self.max_shapes < 1:
            raise InputError(f"max_shapes must be None or a positive integer, got {self.max_shapes!r}")
        while len(self._models) > self.max_shapes:
            victim = min((k for k in self._models if k != keep), key=lambda k: self._used.get(k, -1))
            del self._models[victim]
            self._used.pop(victim, None)
            self.dropped += 1
            log.info("dropped the shape %s (max_shapes=%d, least recently used); a call at it compiles it again",
                     self.spec.short(victim), self.max_shapes)

    def _compile(self, key: tuple) -> CompiledModel:
        if self._compiler is None:
            raise SouffleError(f"this model has no specialisation for {self.spec.label(key)} and the compiler is "
                               "not available here to make one (specialised: "
                               f"{'; '.join(self.spec.short(k) for k in self._models) or 'none'})")
        with _COMPILING:
            start = time.perf_counter()
            log.info("compiling %s ...", self.spec.label(key))
            model = self._compiler(self._onnx_proto(), input_shapes=self.spec.shapes(key), target=self.target,
                                   **self.options)
            self._share_weights(model)
            try:  # LLVM emits a compiled model's machine code at its first call: here, not in a caller's run()
                model._setup()
            except SouffleError:
                pass  # a model this machine cannot run (a CUDA model without a GPU): run() says so
            seconds = time.perf_counter() - start
            self._compile_seconds[key] = seconds
            log.info("%s %s in %.2fs (%d kernel calls)", "loaded" if model.cached else "compiled",
                     self.spec.label(key), seconds, model.num_kernels)
            return model

    def _share_weights(self, model: CompiledModel) -> None:
        """Replace each weight of `model` equal to one an earlier shape holds by that array, so the shapes hold
        (and upload) each weight once. A weight of its own (a shape-dependent constant: BERT's gathered
        position embeddings) is copied out of a later shape's loaded export: as a view it kept that export's
        whole params buffer alive (BERT-base: 0.43 GB more per shape loaded from the compile cache)."""
        later = bool(self._weights)
        for name, values in model.params.items():
            arrays = self._weights.setdefault(name, [])
            same = next((a for a in arrays if _equal(a, values)), None)
            if same is None:
                if later and isinstance(values, np.ndarray) and values.base is not None:
                    values = model.params[name] = values.copy()
                arrays.append(values)
            else:
                model.params[name] = same
        model.shared_uploads = self._uploads

    def _add(self, key: tuple, model: CompiledModel, seconds: float = 0.0) -> None:
        self._share_weights(model)
        self._models[key] = model
        self._compile_seconds[key] = seconds
        self._exported.add(key)

    # --- running -------------------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None
            ) -> dict[str, np.ndarray]:
        """Outputs by name for one inference on `feeds`, at any shape in the ranges (InputError outside them;
        a shape not compiled yet is compiled first). Safe to call from many threads at once."""
        key = self.spec.quick_key(feeds)
        model = self._models.get(key)
        if model is not None:  # a shape compiled before: its model checks every input's shape and dtype
            self._used[key] = next(self._ticks)
            try:
                return model.run(feeds, out)
            except InputError:
                self.spec.key(feeds)  # names the input, axis and range where the feeds do not fit
                raise
        key = self.spec.key(feeds)
        if self.fallback is None or key in self._models:
            return self._model(key).run(feeds, out)
        self._compile_in_background(key)
        return self._fallback_run(feeds, out)

    # --- the generic fallback ------------------------------------------------------------------------------
    def _compile_in_background(self, key: tuple) -> None:
        with self._lock:
            if key in self._models or key in self._background or key in self._failed or self._compiler is None:
                return
            thread = threading.Thread(target=self._background_compile, args=(key,), daemon=True,
                                      name=f"souffle-dynamic {self.spec.short(key)}")
            self._background[key] = thread
        thread.start()

    def _background_compile(self, key: tuple) -> None:
        try:
            self._model(key)
        except Exception as exc:  # noqa: BLE001  (the fallback keeps serving the shape)
            log.exception("compiling %s in the background failed; %s serves it", self.spec.label(key), self.fallback)
            self._failed[key] = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._background.pop(key, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (the fallback's, and warm(background=True)'s are separate threads
        the caller holds); whether none is left."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            with self._lock:
                threads = list(self._background.values())
            if not threads:
                return True
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return False
            threads[0].join(left)

    def _fallback_run(self, feeds, out) -> dict[str, np.ndarray]:
        """One inference by the generic fallback (ONNX Runtime's session of the model, any shape)."""
        session = self._fallback_session
        if session is None:
            with self._lock:
                if self._fallback_session is None:
                    self._fallback_session = _onnxruntime_session(self._onnx_proto())
                session = self._fallback_session
        results = dict(zip((o.name for o in session.get_outputs()), session.run(None, dict(feeds))))
        self._fallback_calls += 1
        if out is None:
            return results
        for name, array in out.items():
            if name not in results or array.shape != results[name].shape or array.dtype != results[name].dtype:
                raise InputError(f"out['{name}'] must be an array of the output's shape and dtype")
            array[...] = results[name]
        return {name: out.get(name, value) for name, value in results.items()}

    def _onnx_proto(self) -> "onnx.ModelProto":
        if isinstance(self._proto, bytes):
            import onnx

            self._proto = onnx.load_model_from_string(self._proto)
        return self._proto

    def _feeds_model(self, feeds, seed: int = 0):
        if feeds is None:
            key = next(iter(self._models), None) or self.spec.bound_key("min")
            feeds = self.spec.random_feeds(key, seed)
        key = self.spec.key(feeds)
        return feeds, self._model(key)

    def benchmark(self, feeds: Mapping[str, np.ndarray] | None = None, repeat: int = 10,
                  warmup: int = 2) -> dict[str, float]:
        """CompiledModel.benchmark at the shape of `feeds` (default: random inputs at the first specialised
        shape)."""
        feeds, model = self._feeds_model(feeds)
        return model.benchmark(feeds, repeat=repeat, warmup=warmup)

    def profile(self, feeds: Mapping[str, np.ndarray] | None = None, repeat: int = 10, stages: bool = False):
        """CompiledModel.profile at the shape of `feeds` (default: the first specialised shape)."""
        feeds, model = self._feeds_model(feeds)
        return model.profile(feeds, repeat=repeat, stages=stages)

    def random_feeds(self, seed: int = 0, shape=None) -> dict[str, np.ndarray]:
        """Random inputs (as CompiledModel.random_feeds) at `shape` (symbol -> value; default: the first
        specialised shape, else the smallest)."""
        if shape is not None:
            key = self.spec.check_key(shape)
        else:
            key = next(iter(self._models), None) or self.spec.bound_key("min")
        return self.spec.random_feeds(key, seed)

    @property
    def output_names(self) -> tuple[str, ...]:
        model = next(iter(self._models.values()), None)
        if model is not None:
            return model.output_names
        return tuple(o.name for o in self._onnx_proto().graph.output)

    @property
    def target_description(self) -> str:
        model = next(iter(self._models.values()), None)
        return model.target_description if model is not None else str(self.target)

    # --- inspection and export -----------------------------------------------------------------------------
    def describe(self, shape=None) -> str:
        """How the model covers its ranges: the bounds, the strategy and every shape specialised so far (with
        `shape`: that shape's CompiledModel.describe())."""
        if shape is not None:
            return self.specialise(shape).describe()
        count = 1
        for _, lo, hi in self.spec.ranges:
            count *= hi - lo + 1
        models = dict(self._models)
        seconds = [self._compile_seconds[k] for k in models if self._compile_seconds.get(k)]
        typical = f" (~{sorted(seconds)[len(seconds) // 2]:.1f} s each so far)" if seconds else ""
        ranges = " x ".join(f"{s} {lo}..{hi}" for s, lo, hi in self.spec.ranges)
        lines = [f"dynamic model, inputs {self.spec.inputs_text()}; target {self.target_description}",
                 f"  covers {ranges} ({count} shapes) by exact-shape specialisation: each shape is compiled by the "
                 "whole-model pipeline on first use (once, whatever the concurrent callers; other shapes keep "
                 "serving meanwhile)" + (" and stored in the compile cache"
                                         if compile_cache.enabled(self.options.get("cache")) else "")
                 + "; nothing is padded",
                 (f"  no generic fallback: a call at a new shape waits for its compile{typical}"
                  if self.fallback is None
                  else f"  generic fallback {self.fallback}: a call at a new shape runs there at once while the shape "
                       f"compiles in the background{typical}; {self._fallback_calls} calls served by it so far, "
                       f"{len(self._background)} shapes compiling now")
                 + ("" if self._compiler is not None else "; the compiler is not available here, so only the "
                    "specialised shapes run"),
                 f"  {len(models)} of {count} shapes specialised:"]
        for key, model in models.items():
            how = ("read from the exported file (compiled in {:.2f} s)" if key in self._exported else
                   "loaded from the compile cache in {:.2f} s" if model.cached else "compiled in {:.2f} s")
            lines.append(f"    {self.spec.short(key)}: {len(model.plan.calls)} kernel calls, {model.distinct_kernels} "
                         f"distinct kernels, " + how.format(self._compile_seconds.get(key, 0.0)))
        lines += [f"    {self.spec.short(key)}: compile failed ({why}); served by {self.fallback}"
                  for key, why in self._failed.items()]
        if self.max_shapes is not None:
            lines.append(f"  keeps at most {self.max_shapes} shapes (least recently used dropped first; "
                         f"{self.dropped} dropped so far)")
        return "\n".join(lines)

    def export(self, path) -> None:
        """Write the ONNX model and every specialised shape to one file: souffle_py.load() reads it back."""
        models = dict(self._models)
        members, weights, names, shapes = {}, {}, {}, []
        for i, (key, model) in enumerate(models.items()):
            folder = f"shape{i}"
            for name, data in model_members(model, params=False).items():
                members[f"{folder}/{name}"] = data
            params = {}
            for name, values in model.params.items():
                if id(values) not in names:
                    names[id(values)] = f"w{len(names)}"
                    weights[names[id(values)]] = values
                params[name] = names[id(values)]
            shapes.append({"key": list(key), "folder": folder, "params": params,
                           "compile_seconds": self._compile_seconds.get(key, 0.0)})
        buffer = io.BytesIO()
        np.savez(buffer, **weights)
        members[WEIGHTS] = buffer.getvalue()
        members[MODEL] = self._onnx_proto().SerializeToString(deterministic=True)
        target = next(iter(models.values())).plan.target if models else self.target
        if not isinstance(target, str):
            raise ExportError("a dynamic model with no specialised shape exports only with a target given by name "
                              "(run or specialise one shape first)")
        manifest = {"format": FORMAT, "spec": self.spec.to_json(), "target": target, "fallback": self.fallback,
                    "options": {k: self.options[k] for k in PERSISTED_OPTIONS if k in self.options},
                    "shapes": shapes, "member_sha256": {n: sha256(d) for n, d in members.items()}}
        members[DYNAMIC] = json.dumps(manifest, indent=1).encode()
        members[DYNAMIC_SHA] = sha256(members[DYNAMIC]).encode()
        write_members(path, members)


def build_dynamic(proto: "onnx.ModelProto", dynamic, precompile, compiler: Callable, target, options: dict,
                  fallback: str | None = None) -> DynamicModel:
    """optimize(dynamic=...): the DynamicModel of `proto` with its `precompile` shapes compiled."""
    start = time.perf_counter()
    spec = DynamicSpec.from_model(proto, dynamic)
    keys = precompile_keys(spec, precompile)
    model = DynamicModel(proto, spec, options, compiler, target, fallback)
    for key in keys:
        model._model(key)
    model.compile_seconds = time.perf_counter() - start
    model.cached = bool(keys) and all(model._models[k].cached for k in keys)
    return model


def precompile_keys(spec: DynamicSpec, precompile) -> list[tuple]:
    """The shapes `precompile` names: "min" (default, None), "max", "none" (or an empty list), one shape
    (symbol -> value) or a list of shapes and "min"/"max"."""
    if precompile is None:
        precompile = "min"
    if isinstance(precompile, str) or isinstance(precompile, Mapping):
        precompile = [precompile]
    keys = []
    for item in precompile:
        if item == "none":
            continue
        if item in ("min", "max"):
            key = spec.bound_key(item)
        elif isinstance(item, Mapping):
            key = spec.check_key(item)
        else:
            raise InputError(f"precompile takes 'min', 'max', 'none', a shape (dict symbol -> value: "
                             f"{spec.symbols}) or a list of them; got {item!r}")
        if key not in keys:
            keys.append(key)
    return keys


def load_dynamic(path, members: dict[str, bytes], compiler: Callable | None, check_cpu: bool = True) -> DynamicModel:
    """The DynamicModel of a file written by DynamicModel.export, every member checked against its SHA-256."""
    text = members[DYNAMIC]
    if members.get(DYNAMIC_SHA, b"").strip() != sha256(text).encode():
        raise ExportError(f"{path} is damaged: member {DYNAMIC} does not match its SHA-256 ({DYNAMIC_SHA})")
    try:
        manifest = json.loads(text)
        if manifest.get("format") != FORMAT:
            raise ExportError(f"{path}: dynamic model format {manifest.get('format')!r}; this souffle-py reads "
                              f"format {FORMAT} (export the model again with this version)")
        spec = DynamicSpec.from_json(manifest["spec"])
        listed = dict(manifest["member_sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path}: unreadable {DYNAMIC} ({type(exc).__name__}: {exc})") from exc
    for name, digest in listed.items():
        if name not in members:
            raise ExportError(f"{path} is damaged: member {name} is missing")
        if sha256(members[name]) != digest:
            raise ExportError(f"{path} is damaged: member {name} does not match its SHA-256")
    try:
        weights = npz_arrays(members[WEIGHTS])
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"{path}: unreadable {WEIGHTS} ({type(exc).__name__}: {exc})") from exc
    model = DynamicModel(members[MODEL], spec, manifest.get("options", {}), compiler, manifest["target"],
                         manifest.get("fallback"))
    for entry in manifest["shapes"]:
        prefix = entry["folder"] + "/"
        own = {name[len(prefix):]: data for name, data in members.items() if name.startswith(prefix)}
        exported = model_from_members(f"{path} ({entry['folder']})", own, check_cpu,
                                      params={name: weights[w] for name, w in entry["params"].items()})
        model._add(spec.check_key(tuple(entry["key"])), compiled_from(exported), entry.get("compile_seconds", 0.0))
    return model


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def _onnxruntime_session(proto: "onnx.ModelProto"):
    """An ONNX Runtime CPU session of `proto` on the threads TVM's runtime uses (the generic fallback)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise SouffleError(f"the fallback 'onnxruntime' needs the onnxruntime package ({exc})") from exc
    from souffle_py.host import num_threads

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads()
    options.inter_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
