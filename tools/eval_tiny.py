#!/usr/bin/env python
"""Evaluate a checkpoint on a manifest folder: PyTorch greedy WER per language and top-1 margins.

Prints, per language, the normalised WER (jiwer) and the median / 10th-percentile gap between the
best and second-best log-probability of each generated token, then the transcripts that differ.

With --by-position, --data is a folder of multi-utterance clips (`make_heldout_set.py`'s multi/, whose
manifest names each clip's source clips): each utterance's errors in its clip's transcript (aligned,
`metrics.sentence_errors`) beside the same utterance's own clip transcribed alone, by position in the
clip and by the clip's utterance count.

Examples:
  uv run python tools/eval_tiny.py --model models/cohere-tiny-synth --data tests/data/heldout
  uv run python tools/eval_tiny.py --data out/heldout-varied/multi --by-position
"""

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder or Hub id")
    parser.add_argument("--data", default=str(ROOT / "tests" / "data" / "heldout"), help="folder with manifest.json")
    parser.add_argument("--limit-per-language", type=int, default=None, help="evaluate only the first N clips per language")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--by-position", action="store_true",
                        help="multi-utterance clips: errors per position in the clip and per utterance count, "
                             "beside each utterance's own clip alone")
    parser.add_argument("--single-dir", default=None,
                        help="with --by-position: the folder of the source clips (default: single/ beside --data)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(1)
    from cohere_coreml.model.checkpoint import CheckpointError
    from cohere_coreml_dev.evaluate import (
        EvaluationError,
        evaluate_checkpoint,
        format_positions,
        format_reports,
        position_breakdown,
        position_summary,
    )
    from cohere_coreml_dev.synth import SynthError

    if args.by_position:
        logging.getLogger("cohere_coreml_dev").setLevel(logging.INFO)
        try:
            rows = position_breakdown(args.model, args.data, args.single_dir, limit_per_language=args.limit_per_language)
        except (CheckpointError, EvaluationError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        summary = position_summary(rows)
        print(json.dumps({"summary": summary, "utterances": rows}, indent=1, ensure_ascii=False) if args.json
              else format_positions(summary))
        return 0
    try:
        reports = evaluate_checkpoint(args.model, args.data, limit_per_language=args.limit_per_language)
    except (CheckpointError, EvaluationError, SynthError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: vars(r) for k, r in reports.items()}, indent=1, ensure_ascii=False))
        return 0
    print(format_reports(reports))
    for r in reports.values():
        for ref, hyp in r.errors:
            print(f"  [{r.language}] {ref!r} -> {hyp!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
