#!/usr/bin/env python
"""Regenerate the committed test clips in tests/data/audio/ (needs espeak-ng: `apt-get install espeak-ng`)."""

import argparse
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohere_coreml_dev.synth import SynthError, make_test_audio  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "tests" / "data" / "audio"),
                        help="output folder (default: tests/data/audio)")
    parser.add_argument("--seed", type=int, default=0, help="seed for pauses and noise of the long clip")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        clips = make_test_audio(args.out, seed=args.seed)
    except SynthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for c in clips:
        print(f"{c.file:24s} {c.language or '-':3s} {c.sample_rate:6d} Hz x{c.channels} {c.seconds:7.3f} s  {c.purpose}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
