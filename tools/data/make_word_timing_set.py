#!/usr/bin/env python
"""Write a word-timing set: espeak-ng speech whose word start times are the synthesizer's own word events.

The held-out timing set (for measuring word timings; not committed): held-out sentences and voices never
trained on (the robustness held-out set's recipe), en/de/es, as single sentences (single/), the same padded
with 0-2 s more silence (padded/) and 2-4 of them joined with pauses (multi/), each a manifest folder whose
utterances carry `kind` and `words` ([{word, char_start, start, end}], seconds; `end` is an estimate):
  uv run --frozen python tools/data/make_word_timing_set.py --out out/word-timing --per-language 20

The calibration set for choosing alignment heads (committed as src/cohere_coreml/data/word_timing_calibration): a few
clips in each of the 14 languages Cohere Transcribe declares, of sentences written for it:
  uv run --frozen python tools/data/make_word_timing_set.py --calibration

Both need libespeak-ng (Debian package espeak-ng). See tools/cohere_coreml_dev/word_timing.py.
"""

import argparse
import logging
import shlex
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_DIR = "src/cohere_coreml/data/word_timing_calibration"


def _list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help=f"output folder (default: out/word-timing; with --calibration {CALIBRATION_DIR})")
    parser.add_argument("--languages", default=None,
                        help="comma-separated (default: en,de,es; with --calibration all 14 calibration languages)")
    parser.add_argument("--per-language", type=int, default=None,
                        help="single clips per language (default 20); with --calibration clips per language, 1-4 "
                             "(default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=None,
                        help="some of single,padded,multi (default all; single/ is always written: the others "
                             "derive from it); not with --calibration")
    parser.add_argument("--workers", type=int, default=1, help="parallel syntheses (held-out set)")
    parser.add_argument("--calibration", action="store_true",
                        help="write the calibration set for alignment-head selection instead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.per_language is not None and args.per_language < 1:
        parser.error(f"--per-language must be at least 1 (got {args.per_language})")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1 (got {args.workers})")
    if args.calibration and args.kinds is not None:
        parser.error("--kinds is for the held-out set; the calibration set's clips are fixed (single and multi)")

    from cohere_coreml_dev import word_events, word_timing
    from cohere_coreml_dev.synth import SynthError

    if not word_events.available():
        print("make_word_timing_set: libespeak-ng (libespeak-ng.so.1) was not found: install it with "
              "`apt-get install espeak-ng` (Debian/Ubuntu)", file=sys.stderr)
        return 1
    command = "uv run --frozen python tools/data/make_word_timing_set.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    try:
        if args.calibration:
            out = Path(args.out or ROOT / CALIBRATION_DIR)
            languages = _list(args.languages) if args.languages else list(word_timing.CALIBRATION_LANGUAGES)
            rows = word_timing.make_calibration_set(out, languages, args.per_language or 4, seed=args.seed,
                                                    command=command.strip())
            timed, total = word_timing.coverage(rows)
            print(f"calibration\t{out}\t{len(rows)} clips\t{timed}/{total} words timed")
            return 0
        kinds = _list(args.kinds) if args.kinds else list(word_timing.KINDS)
        paths = word_timing.make_timing_set(Path(args.out or ROOT / "out" / "word-timing"),
                                            _list(args.languages or "en,de,es"), args.per_language or 20,
                                            seed=args.seed, kinds=kinds, workers=args.workers,
                                            command=command.strip())
    except SynthError as exc:
        print(f"make_word_timing_set: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
