"""Energy-threshold sweep of the low-rank encoder (issue 21), in PyTorch: which thresholds per layer type.

For each configuration (thresholds per layer type; a type not named stays full), the default model's
encoder is calibrated once (unmodified), rewritten (`quantize.lowrank`) on a fresh copy, and the held-out
set transcribed by `engines.PyTorchEngine` with the rewritten encoder; printed per configuration: encoder
parameter reduction, MACs per frame, tokens identical to the unmodified model, error rate per language.

    uv run --frozen python tools/bench/lowrank_sweep.py --model models/cohere-tiny-synth --data tests/data/heldout \\
        [--calibration DIR] [--out out/lowrank_sweep.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time

from cohere_coreml.evaluation.datasets import DatasetError
from cohere_coreml.inference.engines import PyTorchEngine
from cohere_coreml.quantize import lowrank
from cohere_coreml.quantize.compression_gates import compare_transcripts, engine_transcripts, heldout_dataset
from cohere_coreml.quantize.recipes import QuantizeError

TYPES = tuple(lowrank.LAYER_TYPES)
# one type at a time (the others full), then joint settings
SINGLE = (0.9, 0.95, 0.98, 0.99, 0.995)
JOINT = [
    {"attn_qk": 0.95, "attn_vo": 0.98, "ffn": 0.98, "conv_pw": 0.99},
    {"attn_qk": 0.9, "attn_vo": 0.95, "ffn": 0.95, "conv_pw": 0.98},
    {"attn_qk": 0.9, "attn_vo": 0.95, "ffn": 0.95, "conv_pw": 0.99},
    {"attn_qk": 0.9, "attn_vo": 0.98, "ffn": 0.95, "conv_pw": 0.99},
    {"attn_qk": 0.9, "attn_vo": 0.95, "ffn": 0.9, "conv_pw": 0.98},
    {"attn_qk": 0.9, "attn_vo": 0.9, "ffn": 0.9, "conv_pw": 0.95},
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--calibration", default=None, help="calibration folder (default: --data)")
    p.add_argument("--single", action="store_true", help="also the one-type-at-a-time sweep")
    p.add_argument("--config", action="append", type=json.loads, default=None,
                   help='a joint setting as JSON (repeatable), e.g. \'{"ffn": 0.99}\'; default: the JOINT list')
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:  # both folders checked before any model work
        dataset = heldout_dataset(args.data)
        clips = lowrank.calibration_clips(args.calibration or args.data)
    except (QuantizeError, DatasetError) as err:
        print(f"lowrank_sweep: error: {err}", file=sys.stderr)
        return 2
    engine = PyTorchEngine(args.model)
    original = copy.deepcopy(engine.model.model.encoder)
    baseline = engine_transcripts(lambda: engine, dataset)
    t0 = time.perf_counter()
    analysis = lowrank.calibrate(engine.model, engine.processor, clips)
    print(json.dumps({"calibration_seconds": round(time.perf_counter() - t0, 1), "clips": len(clips),
                      "spectrum": analysis.spectrum()}))
    configs = ([{t: e} for t in TYPES for e in SINGLE] if args.single else []) + (args.config or JOINT)
    rows = []
    for thresholds in configs:
        engine.model.model.encoder = copy.deepcopy(original)
        plans = lowrank.plan_ranks(engine.model.model.encoder, analysis, thresholds)
        lowrank.rewrite_encoder(engine.model.model.encoder, analysis, plans)
        s = lowrank.summary(plans, lowrank.encoder_parameters(original),
                            lowrank.encoder_parameters(engine.model.model.encoder))
        cmp = compare_transcripts(baseline, engine_transcripts(lambda: engine, dataset))
        row = {"thresholds": thresholds, "param_reduction": s["encoder_parameters"]["reduction"],
               "params": s["encoder_parameters"], "macs_per_frame": s["macs_per_frame"],
               "identical": f"{cmp['identical_clips']}/{cmp['clips']}",
               "rate": {lang: [round(100 * v["baseline"], 2), round(100 * v["rate"], 2)]
                        for lang, v in cmp["languages"].items()},
               "worst_increase_points": round(100 * cmp["worst_increase"], 2),
               "ranks": {t: [p.rank for p in plans if p.layer_type == t] for t in TYPES}}
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"spectrum": analysis.spectrum(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
