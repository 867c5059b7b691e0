"""The `souffle` command line: `souffle compile model.onnx`, and one subcommand per pipeline tool.

Each subcommand is a `_cmd_*` function registered in `COMMANDS` with its argument setup, so adding one
touches only this table.
"""

from __future__ import annotations

import argparse
import logging
import sys

from souffle_py.errors import SouffleError


def _parse_shapes(items):
    """['x=1,128,768', ...] -> {'x': (1, 128, 768)}."""
    shapes = {}
    for item in items or []:
        name, _, dims = item.partition("=")
        if not dims:
            raise SouffleError(f"--input-shape expects NAME=D0,D1,..., got '{item}'")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return shapes


def _add_model_args(parser):
    parser.add_argument("model", help="path of the ONNX model")
    parser.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                        help="concrete shape for an input with symbolic dimensions (repeatable)")


def _setup_compile(parser):
    _add_model_args(parser)
    parser.add_argument("--target", default="llvm", help="llvm (default) or cuda")
    parser.add_argument("--benchmark", action="store_true", help="also time inference (random inputs)")


def _cmd_compile(args) -> int:
    import souffle_py

    model = souffle_py.optimize(args.model, target=args.target, input_shapes=_parse_shapes(args.input_shape))
    print(model.describe())
    print(f"compiled in {model.compile_seconds:.1f}s")
    if args.benchmark:
        print(f"latency: {model.benchmark()['median_ms']:.2f} ms (median)")
    return 0


COMMANDS = {
    "compile": (_setup_compile, _cmd_compile, "compile a model and list its kernels"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="souffle", description="souffle-py: whole-model DNN optimizer")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress output")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (setup, _, help_text) in COMMANDS.items():
        setup(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return COMMANDS[args.command][1](args)
    except SouffleError as exc:
        print(f"souffle: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
