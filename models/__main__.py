"""python -m models NAME [--tiny] [--seed N] [--<config-field> VALUE ...] -o OUT.onnx

Config flags are generated from the model's Config dataclass, so a new field needs no CLI change.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

import numpy as np
import onnx

from models.registry import MODEL_NAMES, build_model, flag_type, load_module


def _add_config_flags(parser: argparse.ArgumentParser, module) -> None:
    """One flag per Config field; default None so that an unset flag keeps the PAPER or TINY value."""
    hints = typing.get_type_hints(module.Config)
    group = parser.add_argument_group(f"{module.__name__} config (defaults: paper / --tiny)")
    for field in dataclasses.fields(module.Config):
        kind = flag_type(hints[field.name])
        if kind is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{getattr(module.PAPER, field.name)!r} / {getattr(module.TINY, field.name)!r}"
        if kind is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            metavar = kind.__name__.upper() if kind in (int, float, str) else "N,N,..."
            group.add_argument(flag, dest=field.name, type=kind, default=None, metavar=metavar, help=help_text)


def _parser(full: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models", add_help=full,
                                     description="Write a SOUFFLE evaluation model as ONNX.")
    parser.add_argument("name", choices=MODEL_NAMES if full else None, nargs=None if full else "?",
                        help="model to build")
    parser.add_argument("--tiny", action="store_true", help="start from the tiny test configuration")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("-o", "--output", required=full, help="path of the .onnx file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The config flags depend on NAME, so a lenient first pass finds it; --help is left to the full parser.
    name = _parser(full=False).parse_known_args(argv)[0].name
    parser = _parser(full=True)
    if name in MODEL_NAMES:
        try:
            module = load_module(name)
        except ModuleNotFoundError as e:
            parser.error(str(e))
        _add_config_flags(parser, module)

    args = parser.parse_args(argv)
    config_fields = {f.name for f in dataclasses.fields(module.Config)}
    overrides = {k: v for k, v in vars(args).items() if k in config_fields and v is not None}
    model = build_model(args.name, tiny=args.tiny, seed=args.seed, **overrides)
    onnx.save(model, args.output)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer
                 if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))
    print(f"{args.name}: {len(model.graph.node)} nodes, {params:,} parameters -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
