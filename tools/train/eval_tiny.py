#!/usr/bin/env python
"""Evaluate a checkpoint on a manifest folder: PyTorch greedy WER per language and top-1 margins.

Prints, per language, the normalised WER (jiwer) and the median / 10th-percentile gap between the
best and second-best log-probability of each generated token, then the transcripts that differ.

With --by-position, --data is a folder of multi-utterance clips (`make_heldout_set.py`'s multi/, whose
manifest names each clip's source clips): each utterance's errors in its clip's transcript (aligned,
`metrics.sentence_errors`) beside the same utterance's own clip transcribed alone, by position in the
clip and by the clip's utterance count.

With --robustness, DIR is a robustness set (`make_heldout_set.py`'s folder: single/, padded/, multi/):
each subset evaluated, then issue 30's targets per language (padded WER <= 1.5x and multi WER <= 2x the
single clips'), each ratio with its 95 % bootstrap interval and the share of resamples within the target,
and the multi clips' WER split by whether two neighbouring sentences share a grammar template.

Examples:
  uv run python tools/train/eval_tiny.py --model models/cohere-tiny-synth --data tests/data/heldout
  uv run python tools/train/eval_tiny.py --data out/heldout-varied/multi --by-position
  uv run python tools/train/eval_tiny.py --robustness out/validation-varied
"""

import argparse
import json
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder or Hub id")
    parser.add_argument("--data", default=None, help="folder with manifest.json (default: tests/data/heldout)")
    parser.add_argument("--robustness", default=None, metavar="DIR",
                        help="a robustness set's folder (single/, padded/, multi/): every subset, then the WER ratio "
                             "targets per language")
    parser.add_argument("--limit-per-language", type=int, default=None, help="evaluate only the first N clips per language")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--by-position", action="store_true",
                        help="multi-utterance clips: errors per position in the clip and per utterance count, "
                             "beside each utterance's own clip alone")
    parser.add_argument("--single-dir", default=None,
                        help="with --by-position: the folder of the source clips (default: single/ beside --data)")
    args = parser.parse_args(argv)
    if args.robustness and (args.data or args.by_position):
        parser.error("--robustness evaluates its own subsets: without --data or --by-position")
    args.data = args.data or str(ROOT / "tests" / "data" / "heldout")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(1)
    from cohere_coreml.model.checkpoint import CheckpointError
    from cohere_coreml_dev.evaluate import (
        EvaluationError,
        evaluate_checkpoint,
        evaluate_robustness,
        format_neighbour_split,
        format_positions,
        format_reports,
        format_targets,
        multi_sentence_rows,
        position_breakdown,
        position_summary,
        ratio_targets,
        template_neighbour_split,
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
    if args.robustness:
        multi = Path(args.robustness) / "multi"
        try:
            if (multi / "manifest.json").exists():  # (a missing one is evaluate_robustness's error)
                multi_sentence_rows(multi)  # the neighbour split's rows, before the minutes of evaluation
            subsets = evaluate_robustness(args.model, args.robustness, limit_per_language=args.limit_per_language)
        except (CheckpointError, EvaluationError, SynthError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        targets = ratio_targets(subsets)
        try:
            neighbours = template_neighbour_split(multi, subsets["multi"])
        except (EvaluationError, SynthError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"subsets": {name: {k: vars(r) for k, r in reports.items()} for name, reports in subsets.items()},
                              "targets": targets, "template_neighbours": neighbours}, indent=1, ensure_ascii=False))
            return 0
        for name, reports in subsets.items():
            print(f"{name}:\n{format_reports(reports)}\n")
        print(format_targets(targets))
        print(f"\n{format_neighbour_split(neighbours)}")
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
