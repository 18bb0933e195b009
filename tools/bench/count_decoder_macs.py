#!/usr/bin/env python
"""Static multiply-add count of one decode step, full-size Cohere Transcribe decoder.

Builds (does not run) two MIL programs with random weights from the full-size config
(transformers' `CohereAsrConfig` defaults = the released model: 8 layers, width 1024, 8 heads,
FFN 4096, vocabulary 16384):

  1. the exported step: cross K/V come precomputed from the encoder package (Tp padded frames);
  2. the design published ports use: the step takes the encoder memory (1, T, 1024) and
     recomputes each layer's cross K/V projections from the T encoder frames at every step.

and prints multiply-adds per decoder call for both and their ratio (target <= 1/20).
Usage: uv run python tools/bench/count_decoder_macs.py [--frames 438] [--capacity 288] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=438, help="encoder frames T of one window (438 for 35 s)")
    parser.add_argument("--capacity", type=int, default=None, help="cache slots C (default round_up(10+256, 32))")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml.export.decoder import build_step_mlmodel
    from cohere_coreml.model.shapes import cache_capacity, memory_len
    from cohere_coreml_dev.macs import count_macs

    torch.set_num_threads(1)
    # full-size decoder; a 1-layer encoder (the encoder is not part of the decode step)
    config = CohereAsrConfig(encoder_config={"num_hidden_layers": 1})
    model = CohereAsrForConditionalGeneration(config).eval()
    capacity = args.capacity or cache_capacity()
    padded = memory_len(args.frames)

    exported, shapes = build_step_mlmodel(model, capacity, padded, precision="fp16")
    ours = count_macs(exported._mil_program)
    del exported
    recompute, _ = build_step_mlmodel(model, capacity, args.frames, precision="fp16", recompute_cross_kv=True)
    theirs = count_macs(recompute._mil_program)

    result = {
        "config": {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                   "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                   "ffn": config.intermediate_size, "vocab": config.vocab_size},
        "capacity": capacity,
        "encoder_frames": args.frames,
        "padded_frames": padded,
        "exported_step_macs": ours["total"],
        "exported_by_type": ours["by_type"],
        "recompute_cross_kv_step_macs": theirs["total"],
        "recompute_by_type": theirs["by_type"],
        "ratio": ours["total"] / theirs["total"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"decoder config: {result['config']}, cache C={capacity}, encoder frames T={args.frames} (padded {padded})")
    print(f"{'program':<42} {'MACs/step':>16} {'linear':>16} {'matmul':>14}")
    for name, r in (("exported step (precomputed cross K/V)", ours),
                    ("recompute cross K/V every step", theirs)):
        print(f"{name:<42} {r['total']:>16,} {r['by_type'].get('linear', 0):>16,} {r['by_type'].get('matmul', 0):>14,}")
    print(f"ratio exported / recompute = {result['ratio']:.4f} (1/{1 / result['ratio']:.1f}); target <= 1/20: "
          f"{'MET' if result['ratio'] <= 1 / 20 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
