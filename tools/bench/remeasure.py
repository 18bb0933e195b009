#!/usr/bin/env python
"""Run the re-measurement queue of BENCHMARKS.md ("How to regenerate") after the default model changes: the commands of
its table, in its order, one at a time, from the repository's root. Each job's output goes to
`<logs>/<job>.log`; each run's exit code and wall time to `<logs>/times.jsonl` as it ends; a table of
the runs (the doc's seconds beside the measured ones) to stdout at the end. Exit code 2 of a job is a
result (a gate refused its bundle); any other failure stops the queue unless --keep-going.

Run it on an otherwise idle machine: rows marked [T] in the doc are wall-clock timings, [M] peak memory.
First the doc's "Before" steps (the padded and multi held-out subsets, the WAV copy for the Swift run).

Examples:
  uv run python tools/bench/remeasure.py --list
  uv run python tools/bench/remeasure.py                          # the whole table (~1.5 h)
  uv run python tools/bench/remeasure.py --from presets           # resume a stopped queue
  uv run python tools/bench/remeasure.py --only bench90 beams4
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[2]

from cohere_coreml_dev.figures import RESULT_CODES, RemeasureError, read_jobs, run_jobs, select, summary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", type=Path, default=ROOT / "BENCHMARKS.md", help="the doc whose table to run")
    p.add_argument("--logs", type=Path, default=ROOT / "out" / "logs" / "remeasure",
                   help="folder of the jobs' logs and times.jsonl (default: out/logs/remeasure)")
    p.add_argument("--from", dest="start", metavar="JOB", help="start at this job (the ones before it are skipped)")
    p.add_argument("--only", nargs="+", metavar="JOB", help="run only these jobs (in the table's order)")
    p.add_argument("--keep-going", action="store_true", help="run the remaining jobs after a failed one")
    p.add_argument("--list", action="store_true", help="print the jobs and the doc's seconds, run nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        jobs = select(read_jobs(args.doc), only=args.only, start=args.start)
    except RemeasureError as e:
        print(f"remeasure: {e}", file=sys.stderr)
        return 2
    if args.list:
        for job in jobs:
            print(f"{job.name}\t{job.runs} x {job.seconds} s\t{job.command}")
        print(f"{len(jobs)} jobs, {sum(j.runs for j in jobs)} runs, "
              f"{sum(j.runs * j.seconds for j in jobs) / 60:.0f} min by the doc's seconds")
        return 0
    records = run_jobs(jobs, args.logs, cwd=ROOT, keep_going=args.keep_going)
    print(summary(records))
    expected = sum(j.runs for j in jobs)
    failed = [r for r in records if r["returncode"] not in RESULT_CODES]
    if failed or len(records) < expected:
        print(f"remeasure: {len(failed)} failed, {expected - len(records)} not run; logs in {args.logs}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
