#!/usr/bin/env python
"""Quantize an exported f16 bundle to INT8 W8A16 (preset q8 by default), gated.

Thin entry point: `cohere-coreml quantize` (same options; see --help):

    uv run python tools/quantize_to_int8.py --bundle f16/ --out q8/
    uv run python tools/quantize_to_int8.py --bundle f16/ --out q8/ --model models/cohere-tiny-synth \\
        --data tests/data/heldout
"""

import sys

from cohere_coreml.cli import main

if __name__ == "__main__":
    sys.exit(main(["quantize", *sys.argv[1:]]))
