#!/usr/bin/env python
"""Reference data for the Swift package's tests (what `make swift-fixtures` runs).

Exports the default model's test bundle and writes what the Python pipeline says about it (token
lists -> text, split points, `cohere-coreml transcribe --json` per clip and window) under --out;
see tools/cohere_coreml_dev/swift_fixtures.py for the layout. Re-runs reuse what is there.

Example:
  uv run python tools/data/make_swift_fixtures.py --out out/swift-fixtures \\
      --demo-clips en_medium.wav de_medium.wav es_medium.wav en_long_75s.flac --demo-languages en,de,es,en
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
    parser.add_argument("--out", default=str(ROOT / "out" / "swift-fixtures"), help="fixture folder")
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder")
    parser.add_argument("--demo-clips", nargs="+", required=True, help="files in tests/data/audio (Makefile DEMO_CLIPS)")
    parser.add_argument("--demo-languages", required=True, help="comma-separated, one per clip (DEMO_LANGUAGES)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the processes that make references (default: 2; the Swift tests' "
                             "interpreter child must have as many)")
    parser.add_argument("--jobs", type=int, default=2, help="fixture jobs run at once after the test bundle (default: 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from cohere_coreml_dev.swift_fixtures import FixtureError, make_fixtures

    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be at least 1 (got {args.jobs}, {args.threads})")
    languages = args.demo_languages.split(",")
    if len(languages) != len(args.demo_clips):
        parser.error(f"{len(args.demo_clips)} demo clips but {len(languages)} languages")
    try:
        out = make_fixtures(Path(args.out), ROOT, Path(args.model), list(zip(args.demo_clips, languages)),
                            threads=args.threads, jobs=args.jobs)
    except FixtureError as err:
        print(f"make_swift_fixtures: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
