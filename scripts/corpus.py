"""Export a corpus of real models (torchvision, timm, transformers) to ONNX with both torch exporters.

    python scripts/corpus.py [--out DIR] [--only NAME ...] [--exporters classic dynamo] [--retry-failed]
    python scripts/corpus.py --list
    python scripts/corpus.py --dynamic --only hf_bert --exporters classic   # symbolic batch and sequence

Every model is built with random weights (seeded: the same recipe gives the same weights), in eval mode, at
batch 1 and its usual input size; nothing is downloaded (transformers models come from their config
classes, with HF_HUB_OFFLINE=1). Each export is cached: `<name>.<exporter>.onnx` is kept when its sidecar
`<name>.<exporter>.json` records the same recipe hash (model, inputs, exporter, library versions), and a
recorded failure is not retried unless --retry-failed. The run ends by writing `manifest.json` (every
export: library, exporter, input shapes, opset, size, or the exporter's message) and `READY`.

--dynamic exports the text models with dynamic axes instead (classic exporter): every token input gets the
dim_params "batch" and "sequence", as a service exports a model it serves at any length, into
`<name>.<exporter>.dynamic.onnx` (what scripts/bench_dynamic.py --model reads).

Needs the `corpus` extra (`pip install -e .[corpus]` or `make corpus`); `make test` never does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS", "")

RECIPE_VERSION = {"classic": 2, "dynamo": 3}  # bump when the way a model is built or exported changes
EXPORTERS = ("classic", "dynamo")
DEFAULT_OUT = os.path.join(os.environ.get("SOUFFLE_CACHE", ".souffle_cache"), "corpus")
SEQUENCE = 128  # tokens for the text models
DYNAMIC_AXES = {0: "batch", 1: "sequence"}  # --dynamic: the token inputs' symbolic dimensions


@dataclass(frozen=True)
class Entry:
    """One corpus model: how to build it (random init) and its inputs (name -> (shape, dtype))."""
    name: str
    library: str
    build: Callable[[], object]
    inputs: dict = field(default_factory=dict)
    note: str = ""

    def recipe(self, exporter: str, versions: dict, dynamic: bool = False) -> str:
        facts = {"name": self.name, "library": self.library, "inputs": self.inputs, "exporter": exporter,
                 "versions": versions, "recipe": RECIPE_VERSION[exporter], "note": self.note}
        text = json.dumps({**facts, **({"dynamic": DYNAMIC_AXES} if dynamic else {})}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _image(size=224):
    return {"pixel_values": ([1, 3, size, size], "float32")}


def _tokens():
    return {"input_ids": ([1, SEQUENCE], "int64"), "attention_mask": ([1, SEQUENCE], "int64")}


def import_torchvision():
    """torchvision, also where its C extension does not load (a CUDA wheel beside a CPU torch): the corpus
    only needs its models, but the import registers fake kernels for two operators the extension defines."""
    import torch
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for name in [m for m in list(sys.modules) if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        import_torchvision.library = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            import_torchvision.library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401
    import torchvision
    return torchvision


def _tv(name, size=224, random_head=False, **kwargs):
    """random_head: torchvision zero-initializes ViT's classifier, whose output would then be all zeros
    (nothing to check); it gets normal(0, 0.02) weights instead."""
    def build():
        import torch
        model = getattr(import_torchvision().models, name)(weights=None, **kwargs)
        if random_head:
            torch.nn.init.normal_(model.heads.head.weight, std=0.02)
        return model
    note = json.dumps(kwargs, sort_keys=True) + (" random_head" if random_head else "")
    return Entry(f"tv_{name}", "torchvision", build, _image(size), note)


def _timm(name, size=224):
    def build():
        import timm
        return timm.create_model(name, pretrained=False)
    return Entry(f"timm_{name}", "timm", build, _image(size))


class _FirstOutput:
    """Wraps a transformers model so that the export has one output, its last hidden state."""

    @staticmethod
    def wrap(model, input_names):
        import torch

        class FirstOutput(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *args):
                out = self.model(**dict(zip(input_names, args)))
                return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state

        return FirstOutput()


def _hf(name, model_class, config_class, inputs=None, encoder=False, **config):
    inputs = inputs or _tokens()

    def build():
        import_torchvision()  # transformers imports torchvision: its fallback has to come first
        import transformers
        cfg = getattr(transformers, config_class)(**config)
        model = getattr(transformers, model_class)(cfg)
        if encoder:
            model = model.get_encoder()
        return _FirstOutput.wrap(model, list(inputs))
    return Entry(f"hf_{name}", "transformers", build, inputs, json.dumps(config, sort_keys=True))


WHISPER_TINY = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                    decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536)

CORPUS = [
    # classic and mobile CNNs
    _tv("resnet18"), _tv("resnet50"), _tv("resnext50_32x4d"), _tv("regnet_y_400mf"), _tv("densenet121"),
    _tv("mobilenet_v2"), _tv("mobilenet_v3_small"), _tv("mobilenet_v3_large"), _tv("shufflenet_v2_x1_0"),
    _tv("squeezenet1_1"), _tv("efficientnet_b0"), _tv("convnext_tiny"), _tv("mnasnet1_0"),
    _tv("googlenet", aux_logits=False, init_weights=True),
    _tv("inception_v3", size=299, aux_logits=False, init_weights=True),
    _timm("ghostnet_100"), _timm("mixnet_s"), _timm("rexnet_100"), _timm("lcnet_100"), _timm("dla34"),
    # vision transformers and hybrids
    _tv("vit_b_16", random_head=True), _tv("swin_t"), _timm("deit_tiny_patch16_224"), _timm("mobilevit_xxs", size=256),
    _timm("levit_128s"), _timm("edgenext_xx_small", size=256), _timm("poolformer_s12"),
    # encoders and decoders
    _hf("bert", "BertModel", "BertConfig"),
    _hf("distilbert", "DistilBertModel", "DistilBertConfig"),
    _hf("roberta", "RobertaModel", "RobertaConfig", vocab_size=50265, max_position_embeddings=514,
        pad_token_id=1),
    _hf("albert", "AlbertModel", "AlbertConfig", hidden_size=768, num_attention_heads=12,
        intermediate_size=3072),
    _hf("electra_small", "ElectraModel", "ElectraConfig"),
    _hf("mobilebert", "MobileBertModel", "MobileBertConfig"),
    _hf("gpt2", "GPT2Model", "GPT2Config", use_cache=False),
    _hf("t5_encoder", "T5EncoderModel", "T5Config"),
    _hf("whisper_tiny_encoder", "WhisperModel", "WhisperConfig",
        {"input_features": ([1, 80, 3000], "float32")}, encoder=True, **WHISPER_TINY),
    _hf("vit", "ViTModel", "ViTConfig", _image(224)),
]
BY_NAME = {entry.name: entry for entry in CORPUS}


def library_versions() -> dict:
    from importlib.metadata import version
    return {p: version(p) for p in ("torch", "torchvision", "timm", "transformers", "onnxscript", "onnx")}


def example_inputs(entry: Entry):
    """Seeded example inputs: token ids inside every vocabulary, a full attention mask, unit normals."""
    import torch
    generator = torch.Generator().manual_seed(0)
    values = []
    for name, (shape, dtype) in entry.inputs.items():
        if name == "attention_mask":
            values.append(torch.ones(shape, dtype=torch.int64))
        elif dtype == "int64":
            values.append(torch.randint(0, 1000, shape, generator=generator, dtype=torch.int64))
        else:
            values.append(torch.randn(shape, generator=generator))
    return tuple(values)


def dynamic_axes(entry: Entry) -> dict:
    """The classic exporter's dynamic_axes for --dynamic: batch and sequence on every token input and the
    output (a model without token inputs has none to make symbolic: an error, not a static export)."""
    tokens = [name for name, (shape, dtype) in entry.inputs.items() if dtype == "int64" and len(shape) == 2]
    if not tokens:
        raise ValueError(f"{entry.name} has no token inputs: --dynamic exports text models only")
    return {**{name: DYNAMIC_AXES for name in tokens}, "output": DYNAMIC_AXES}


def export_one(entry: Entry, exporter: str, path: str, dynamic: bool = False) -> dict:
    """Build the model (seed 0) and export it; returns facts about the written file."""
    import onnx
    import torch
    torch.manual_seed(0)
    model = entry.build().eval()
    args = example_inputs(entry)
    names = list(entry.inputs)
    log = io.StringIO()
    # the classic exporter with gradients on, as a user calls it: under no_grad torchvision's attention takes
    # its fused fast path (aten::_native_multi_head_attention), which it cannot export; the dynamo exporter
    # under no_grad: with gradients on, its decomposition of T5's attention fails (a view of a transpose)
    if dynamic and exporter != "classic":
        raise ValueError("--dynamic exports with the classic exporter only (dynamic_axes)")
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        if exporter == "classic":
            torch.onnx.export(model, args, path, dynamo=False, input_names=names, output_names=["output"],
                              dynamic_axes=dynamic_axes(entry) if dynamic else None)
        else:
            with torch.no_grad():
                program = torch.onnx.export(model, args, dynamo=True, input_names=names,
                                            output_names=["output"], external_data=False)
            program.save(path, external_data=False)
    proto = onnx.load(path, load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"opset": opset, "nodes": len(proto.graph.node), "bytes": os.path.getsize(path),
            "parameters": int(sum(p.numel() for p in model.parameters()))}


def run(out: str, names: list[str], exporters: list[str], retry_failed: bool, log=print,
        dynamic: bool = False) -> dict:
    os.makedirs(out, exist_ok=True)
    versions = library_versions()
    ready = os.path.join(out, "READY")
    if os.path.exists(ready):
        os.remove(ready)
    for entry in [BY_NAME[n] for n in names]:
        for exporter in exporters:
            stem = os.path.join(out, f"{entry.name}.{exporter}" + (".dynamic" if dynamic else ""))
            onnx_path, sidecar = stem + ".onnx", stem + ".json"
            recipe = entry.recipe(exporter, versions, dynamic)
            record = None
            if os.path.exists(sidecar):
                with open(sidecar) as f:
                    record = json.load(f)
                if record.get("recipe") != recipe or (record["status"] == "ok" and not os.path.exists(onnx_path)) \
                        or (record["status"] == "failed" and retry_failed):
                    record = None
            if record is None:
                log(f"exporting {entry.name} ({exporter}) ...")
                start = time.perf_counter()
                record = {"name": entry.name, "library": entry.library, "exporter": exporter,
                          "inputs": {k: {"shape": s, "dtype": d} for k, (s, d) in entry.inputs.items()},
                          "recipe": recipe, "versions": versions,
                          **({"dynamic_axes": DYNAMIC_AXES} if dynamic else {})}
                try:
                    record.update(export_one(entry, exporter, onnx_path, dynamic), status="ok",
                                  file=os.path.basename(onnx_path))
                except Exception as exc:  # any exporter failure is a corpus fact: record it, go on
                    if os.path.exists(onnx_path):
                        os.remove(onnx_path)
                    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
                    record.update(status="failed", error=f"{type(exc).__name__}: " + " | ".join(lines[:3])[:600],
                                  traceback=traceback.format_exc()[-3000:])
                record["export_s"] = round(time.perf_counter() - start, 1)
                with open(sidecar, "w") as f:
                    json.dump(record, f, indent=1)
                log(f"  {record['status']} in {record['export_s']} s"
                    + (f": {record['error'][:200]}" if record["status"] == "failed" else ""))
    manifest = _current_records(out, versions, dynamic)
    summary = {"exports": manifest, "versions": versions, "models": len({m["name"] for m in manifest}),
               "ok": sum(m["status"] == "ok" for m in manifest),
               "failed": sum(m["status"] == "failed" for m in manifest)}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(ready, "w") as f:
        f.write(f"{summary['ok']} exports ok, {summary['failed']} failed, {summary['models']} models; "
                f"see manifest.json\n")
    return summary


def _current_records(out: str, versions: dict, dynamic: bool = False) -> list[dict]:
    """Every export of the corpus in `out` made by its current recipe (also those --only left alone)."""
    records = []
    for entry in CORPUS:
        for exporter in EXPORTERS:
            sidecar = os.path.join(out, f"{entry.name}.{exporter}" + (".dynamic" if dynamic else "") + ".json")
            if not os.path.exists(sidecar):
                continue
            with open(sidecar) as f:
                record = json.load(f)
            if record.get("recipe") == entry.recipe(exporter, versions, dynamic):
                records.append({k: v for k, v in record.items() if k != "traceback"})
    return records


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"export folder (default {DEFAULT_OUT})")
    parser.add_argument("--only", nargs="+", choices=sorted(BY_NAME), metavar="NAME", help="these models only")
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    parser.add_argument("--retry-failed", action="store_true", help="export again what failed before")
    parser.add_argument("--list", action="store_true", help="print the corpus and exit")
    parser.add_argument("--dynamic", action="store_true",
                        help="text models with symbolic batch and sequence (classic exporter; <name>.classic.dynamic.onnx)")
    args = parser.parse_args(argv)
    if args.list:
        for entry in CORPUS:
            print(f"{entry.name:32s} {entry.library:13s} " + ", ".join(
                f"{k}{list(s)}" for k, (s, _) in entry.inputs.items()))
        return 0
    summary = run(args.out, args.only or [e.name for e in CORPUS], args.exporters, args.retry_failed,
                  dynamic=args.dynamic)
    print(f"{summary['ok']} exports ok, {summary['failed']} failed ({summary['models']} models) in {args.out}")
    for m in summary["exports"]:
        if m["status"] == "failed":
            print(f"  FAILED {m['name']} ({m['exporter']}): {m['error'][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
