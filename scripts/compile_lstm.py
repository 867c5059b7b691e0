"""Compile the stacked LSTM (default: 10 layers x 100 steps, hidden 256) and compare it with ONNX Runtime.

    python scripts/compile_lstm.py [--tiny] [--spelling op|unrolled] [--layers N] [--steps N] [--repeat N]
"""

import sys

from compare import compile_and_compare, model_parser

if __name__ == "__main__":
    sys.exit(compile_and_compare("lstm", model_parser("lstm", __doc__).parse_args()))
