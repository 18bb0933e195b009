#!/usr/bin/env python
"""Benchmark the MIL interpreter on a random-weight Cohere Transcribe encoder vs eager torch.

Builds the encoder from CohereAsrConfig defaults (48 layers, 1.9 B parameters; use --layers
for a quick reduced-depth run), times torch fp32 eager on one 35 s window (3500 mel frames),
converts it to an ML program, runs the package through the interpreter on the same input and
prints both times, their ratio (target <= 3), peak RSS of each process and the parity (PSNR).

The full-size run needs about 14 GB of RAM for the conversion and takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cohere_coreml.runtime.interpreter_bench import BenchConfig, format_results, run_benchmark


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="encoder layers (default: the config default, 48)")
    p.add_argument("--frames", type=int, default=3500, help="mel frames of the window (default 3500 = 35 s)")
    p.add_argument("--precision", choices=["fp16", "fp32"], default="fp16", help="package compute precision")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both runtimes (default: torch's)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the best is reported (default 1)")
    p.add_argument("--out-dir", default="/tmp/bench_runtime", help="scratch directory (package, input, reference)")
    p.add_argument("--reuse", action="store_true", help="reuse the package/reference already in --out-dir")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = BenchConfig(
        out_dir=args.out_dir, layers=args.layers, frames=args.frames, precision=args.precision,
        threads=args.threads, warmup=args.warmup, repeats=args.repeats, reuse_package=args.reuse,
    )
    results = run_benchmark(cfg)
    print(format_results(results))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
