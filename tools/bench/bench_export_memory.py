#!/usr/bin/env python
"""Benchmark: peak resident memory and wall time of the full-size export and its q8 quantize, and the sha256
of every weight file they write (so that two versions of the code can be compared byte for byte).

A FULL-SIZE random-weight checkpoint of the released config (`bench_quantize.make_checkpoint`, seed 7,
bf16 safetensors) is written once into --out (reused when present); then, each in its own process under
`/usr/bin/time -v` (its "Maximum resident set size" is the figure):

    cohere-coreml export --model <checkpoint> --out <out>/<label>/f16 --force          (gated, defaults)
    cohere-coreml quantize --bundle <out>/<label>/f16 --out <out>/<label>/q8 --preset q8 --data none --force

Prints and writes <out>/<label>/export_memory.json: peak RSS (kB, GiB, GB), wall and CPU time and the weight files'
sha256 per step; `--compare other.json` prints which weight files differ from another run's. Full size
takes 20-30 minutes and up to ~13 GB (the code before the export streamed its encoder layers): run it
alone. Smoke run (2 encoder layers): --encoder-layers 2.

    uv run python tools/bench/bench_export_memory.py --out out/export-memory --label after
    uv run python tools/bench/bench_export_memory.py --out out/export-memory --label before --steps f16 q8 \\
        --compare out/export-memory/after/export_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quantize import make_checkpoint  # noqa: E402

from cohere_coreml_dev.cli_runs import timed_cli, weight_digests  # noqa: E402

SEED = 7  # the checkpoint of BENCHMARKS.md's full-size export figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/export-memory", help="scratch folder (checkpoint + bundles)")
    parser.add_argument("--label", default="run", help="subfolder of this run's bundles and report")
    parser.add_argument("--steps", nargs="+", choices=("f16", "q8"), default=["f16", "q8"])
    parser.add_argument("--encoder-layers", type=int, default=None, help="smoke runs only (default: the config's 48)")
    parser.add_argument("--export-args", nargs=argparse.REMAINDER, default=[],
                        help="further `cohere-coreml export` options (last on the line)")
    parser.add_argument("--compare", default=None, help="export_memory.json of another run: weight files that differ")
    args = parser.parse_args(argv)
    out = Path(args.out)
    ckpt = out / ("checkpoint" if args.encoder_layers is None else f"checkpoint-{args.encoder_layers}")
    if not (ckpt / "config.json").is_file():
        params = make_checkpoint(ckpt, args.encoder_layers, seed=SEED)
        print(f"checkpoint: {params:,} parameters in {ckpt}", flush=True)
    run = out / args.label
    run.mkdir(parents=True, exist_ok=True)
    f16, q8 = run / "f16", run / "q8"
    commands = {"f16": ["export", "--model", str(ckpt), "--out", str(f16), "--force", *args.export_args],
                "q8": ["quantize", "--bundle", str(f16), "--out", str(q8), "--preset", "q8", "--data", "none",
                       "--force"]}
    report = {"checkpoint": str(ckpt), "steps": {}}
    for step in args.steps:
        res = timed_cli(commands[step], log=run / f"{step}.log")
        if res["returncode"] != 0:
            raise SystemExit(f"{step} failed ({res['returncode']}), log {run / f'{step}.log'}:\n{res['stderr_tail']}")
        bundle = f16 if step == "f16" else q8
        report["steps"][step] = {"command": ["cohere-coreml", *commands[step]], "peak_rss_kb": res["peak_rss_kb"],
                                 "peak_rss_gib": res["peak_rss_gib"], "peak_rss_gb": res["peak_rss_gb"],
                                 "wall_seconds": res["wall_seconds"], "cpu_seconds": res["cpu_seconds"],
                                 "weights_sha256": weight_digests(bundle)}
        print(f"{step}: peak RSS {res['peak_rss_kb']:,} kB ({res['peak_rss_gib']} GiB, {res['peak_rss_gb']} GB), "
              f"wall {res['wall_seconds']} s, CPU {res['cpu_seconds']} s", flush=True)
        for name, digest in report["steps"][step]["weights_sha256"].items():
            print(f"  {digest}  {name}")
        (run / "export_memory.json").write_text(json.dumps(report, indent=2))
    if args.compare:
        other = json.loads(Path(args.compare).read_text())["steps"]
        for step, figures in report["steps"].items():
            theirs = other.get(step, {}).get("weights_sha256")
            if theirs is None:
                print(f"{step}: not in {args.compare}")
                continue
            differ = sorted(n for n in set(theirs) | set(figures["weights_sha256"])
                            if theirs.get(n) != figures["weights_sha256"].get(n))
            print(f"{step}: {len(theirs)} weight files compared, "
                  + ("all identical" if not differ else f"{len(differ)} differ: {', '.join(differ)}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
