#!/usr/bin/env python
"""Export decoder.mlpackage (stateful KV cache) + manifest.json / vocab.json / tokenizer files.

Thin entry point over `cohere_coreml.bundle.export_decoder_bundle` (same options as
`cohere-coreml export`, decoder only; export the encoder into the same --out folder too):

    uv run python exports/export_decoder.py --model CohereLabs/cohere-transcribe-03-2026 --out out/f16
    uv run python exports/export_decoder.py --model models/cohere-tiny-synth --out /tmp/b --precision fp32 \
        --max-tokens 128
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
    parser.set_defaults(components="decoder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("coremltools", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    components = tuple(c.strip() for c in args.components.split(",") if c.strip())
    try:
        results = export_all(args.model, settings_from_args(args), revision=args.revision, components=components,
                             gate_audio=args.gate_audio, max_new_tokens=args.max_tokens, prefill=args.prefill)
    except (ExportError, ValueError) as err:
        print(f"export_decoder: error: {err}", file=sys.stderr)
        return 2
    for name, result in results.items():
        path = result.get("path") if isinstance(result, dict) else result
        print(f"{name}: {path if path else 'exists, skipped (use --force)'}")
        if isinstance(result, dict) and result.get("parity"):
            p = result["parity"]
            print(f"  parity: worst PSNR {p['worst_psnr_db']:.1f} dB, mean KL {p['mean_kl']:.3g}, "
                  f"argmax {p['argmax_agree']}/{p['argmax_steps']} decoding steps")
        if isinstance(result, dict) and result.get("manifest"):
            print(f"  manifest: {result['manifest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
