"""Compile one of the evaluated models with souffle-py and compare it with ONNX Runtime: max abs diff,
median latency, kernel calls and compile time, both systems on TVM_NUM_THREADS threads (default 2).

    python scripts/compile_model.py NAME [--tiny] [--repeat N] [--<config field> VALUE ...]

NAME is one of bert, lstm, gru, bilstm, resnext, efficientnet, swin, mmoe; without --tiny the paper's configuration.
"""

import argparse
import os
import sys

os.environ.setdefault("TVM_NUM_THREADS", "2")  # before souffle_py (imported by compare) starts TVM

from compare import compile_and_compare, model_parser  # noqa: E402
from models.registry import MODEL_NAMES  # noqa: E402


def main(argv) -> int:
    first = argparse.ArgumentParser(description=__doc__, add_help=False)
    first.add_argument("name", choices=MODEL_NAMES)
    known, rest = first.parse_known_args(argv)
    parser = model_parser(known.name, __doc__)
    parser.prog = f"{os.path.basename(__file__)} {known.name}"
    return compile_and_compare(known.name, parser.parse_args(rest))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
