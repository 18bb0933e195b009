#!/usr/bin/env python
"""Synthesise a small multilingual command corpus with espeak-ng (audio + transcripts + language).

Sentences come from a small generated grammar (numbers, dates, times, short commands) in
English, German and Spanish; voices, variants, rates, pitches, gain, silence and noise vary
with a fixed seed. The held-out split only contains sentences that never occur in the
training split. Needs espeak-ng (`apt-get install espeak-ng`); this script installs nothing.

Example:
  uv run python tools/data/make_synthetic_speech.py --out /tmp/training/train --split train --per-language 4000
  uv run python tools/data/make_synthetic_speech.py --out tests/data/heldout --split heldout --per-language 40
"""

import argparse
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohere_coreml_dev.synth import CORPUS_LANGUAGES, RECIPES, VARIED_MIXED_SHARE, SynthError, make_corpus  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (audio files + manifest.json)")
    parser.add_argument("--split", choices=["train", "heldout"], default="train")
    parser.add_argument("--languages", default=",".join(CORPUS_LANGUAGES),
                        help=f"comma-separated languages (default: {','.join(CORPUS_LANGUAGES)})")
    parser.add_argument("--per-language", type=int, default=4000, help="utterances per language")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-percent", type=int, default=6,
                        help="share of the sentence space reserved for the held-out split")
    parser.add_argument("--format", choices=["flac", "wav"], default="flac")
    parser.add_argument("--workers", type=int, default=1, help="parallel espeak-ng processes")
    parser.add_argument("--recipe", choices=list(RECIPES), default="commands",
                        help="commands: one sentence per clip, short edges (the committed model's data); varied: "
                             f"1-4 sentences with pauses ({100 * VARIED_MIXED_SHARE:.0f} %% of the multi-sentence "
                             "training clips mixing voices and levels), 0-2 s edges, -30..0 dBFS, 10-40 dB SNR "
                             "(see synth.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        utts = make_corpus(
            args.out, [l.strip() for l in args.languages.split(",") if l.strip()], args.per_language,
            split=args.split, seed=args.seed, heldout_percent=args.heldout_percent,
            audio_format=args.format, workers=args.workers, recipe=args.recipe,
        )
    except SynthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(utts)} utterances, {sum(u.seconds for u in utts) / 3600:.2f} h of audio in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
