#!/usr/bin/env python
"""Export encoder.mlpackage (35 s window by default), parity-gated against PyTorch.

Thin entry point over `cohere_coreml.encoder` (same options as `cohere-coreml export`, encoder only):

    uv run python exports/export_encoder.py --model CohereLabs/cohere-transcribe-03-2026 --out out/f16
    uv run python exports/export_encoder.py --model models/cohere-tiny-synth --out /tmp/enc --precision fp32
"""

from __future__ import annotations

import argparse
import logging
import sys

from cohere_coreml.convert import ExportError
from cohere_coreml.encoder import add_export_arguments, export_all, settings_from_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_export_arguments(parser)
    parser.set_defaults(components="encoder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("coremltools", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    components = tuple(c.strip() for c in args.components.split(",") if c.strip())
    try:
        results = export_all(args.model, settings_from_args(args), revision=args.revision,
                             components=components, gate_audio=args.gate_audio, buckets=tuple(args.buckets))
    except (ExportError, ValueError) as err:
        print(f"export_encoder: error: {err}", file=sys.stderr)
        return 2
    for name, result in results.items():
        path = result.get("path") if isinstance(result, dict) else result
        print(f"{name}: {path if path else 'exists, skipped (use --force)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
