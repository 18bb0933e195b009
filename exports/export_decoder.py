#!/usr/bin/env python
"""Export decoder.mlpackage (stateful KV cache) + manifest.json / vocab.json / tokenizer files.

Thin entry point: `cohere-coreml export --components decoder` (same options; see --help). Export the
encoder into the same --out folder too:

    uv run python exports/export_decoder.py --model CohereLabs/cohere-transcribe-03-2026 --out out/f16
    uv run python exports/export_decoder.py --model models/cohere-tiny-synth --out /tmp/b --precision fp32 \\
        --max-tokens 128
"""

import sys

from cohere_coreml.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", "--components", "decoder", *sys.argv[1:]]))
