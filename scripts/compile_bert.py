"""Compile BERT (default: BERT-base, seq 128) with souffle-py and compare it with ONNX Runtime.

    python scripts/compile_bert.py [--tiny] [--layers N] [--layernorm op|primitive] [--repeat N]
"""

import sys

from compare import compile_and_compare, model_parser

if __name__ == "__main__":
    sys.exit(compile_and_compare("bert", model_parser("bert", __doc__).parse_args()))
