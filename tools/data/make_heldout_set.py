#!/usr/bin/env python
"""Write the robustness held-out set: single utterances, the same padded, the same joined (issue 30).

single/ is synthesised with espeak-ng (held-out sentences, voice variants never trained on, level
-30..0 dBFS, 10-40 dB SNR); padded/ (0-2 s more silence each side) and multi/ (2-4 utterances with
0.3-2.0 s pauses) are derived from it alone (see tools/cohere_coreml_dev/heldout.py).

Example (the committed single/ is tests/data/heldout-varied/single; derive the other two from it):
  uv run python tools/data/make_heldout_set.py --single tests/data/heldout-varied/single --out out/heldout-varied
  uv run python tools/data/make_heldout_set.py --out out/heldout-varied --per-language 200   # all three, synthesised
  uv run python tools/train/eval_tiny.py --data out/heldout-varied/padded

A validation set (to choose among candidate models without choosing on the held-out set): another seed,
none of the held-out set's sentences:
  uv run python tools/data/make_heldout_set.py --seed 1 --apart-from tests/data/heldout-varied/single --out out/validation-varied

A larger set than the grammar's held-out sentences allow distinct (about 850 per language): several seeds'
single/ sets in one, a sentence recurring across seeds with another voice, level and noise each time
(1000 utterances per language here; --seed then seeds the padded/multi derivation alone):
  uv run python tools/data/make_heldout_set.py --seeds 2,3,4,5,6 --workers 2 --out out/heldout-large
"""

import argparse
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "out" / "heldout-varied"), help="folder for single/, padded/, multi/")
    parser.add_argument("--languages", default="en,de,es")
    parser.add_argument("--per-language", type=int, default=200, help="single utterances per language")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="parallel espeak-ng processes")
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...",
                        help="single/ as these seeds' sets in one (--per-language each; files prefixed s<seed>_)")
    parser.add_argument("--single", default=None, help="an existing single/ folder to derive from (no synthesis)")
    parser.add_argument("--apart-from", action="append", default=[], metavar="SINGLE_DIR",
                        help="a single/ folder none of whose sentences this set may use (repeatable): a validation "
                             "set apart from the held-out set")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.per_language < 1:
        parser.error(f"--per-language must be at least 1 (got {args.per_language})")
    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            parser.error(f"--seeds takes whole numbers separated by commas, got {args.seeds!r}")
        if len(seeds) < 2 or len(set(seeds)) != len(seeds):
            parser.error(f"--seeds takes two or more different seeds, got {args.seeds!r}")
        if args.single:
            parser.error("--seeds synthesises single/; --single derives from an existing one: one or the other")

    from cohere_coreml_dev.heldout import make_heldout_set
    from cohere_coreml_dev.synth import SynthError

    try:
        paths = make_heldout_set(Path(args.out), [x.strip() for x in args.languages.split(",") if x.strip()],
                                 args.per_language, seed=args.seed, workers=args.workers,
                                 single_dir=Path(args.single) if args.single else None,
                                 apart_from=[Path(d) for d in args.apart_from], seeds=seeds)
    except SynthError as exc:
        print(f"make_heldout_set: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
