#!/usr/bin/env python
"""Export encoder.mlpackage (35 s window by default), parity-gated against PyTorch.

Thin entry point: `cohere-coreml export --components encoder` (same options; see --help):

    uv run python exports/export_encoder.py --model CohereLabs/cohere-transcribe-03-2026 --out out/f16
    uv run python exports/export_encoder.py --model models/cohere-tiny-synth --out /tmp/enc --precision fp32
"""

import sys

from cohere_coreml.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", "--components", "encoder", *sys.argv[1:]]))
