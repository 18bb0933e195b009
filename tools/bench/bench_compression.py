#!/usr/bin/env python
"""Benchmark (issue 21): every compression preset on one model and one held-out set, one table.

The held-out folder is split first: its first `--calibration-per-language` clips per language are
the calibration audio of the presets that calibrate (lowrank, q8-lowrank) and are scored by no row;
every row (f16 included) is scored on the same remaining clips.

For each preset: `cohere-coreml quantize --bundle F16 --preset P --model M --data D` in its own
process (gates on: each package vs the f16 one, the bundle vs PyTorch on the held-out set). A preset
its gate refuses is rebuilt with `--skip-verify` so it still gets a size and a held-out figure (in
this process, through the same `quantize.compression_gates.heldout_gate`), marked REFUSED. The f16 bundle's own
row is its held-out figure vs PyTorch. Per row: bytes, bytes per checkpoint parameter, encoder PSNR,
decoder PSNR / mean KL / log-prob error (median, p99, max nats) vs the f16 packages, error rate per
language (WER, or CER for ja/zh/ko) next to PyTorch's, clips and tokens identical to PyTorch.

Writes OUT/bench_compression.json, OUT/bench_compression.md (the table) and OUT/bench_compression.png
(error rate against bytes; the Pareto front: the rows no other row beats on both). `--full-size
FILE` adds the bytes per parameter at full size from tools/bench/bench_quantize.py's JSON (random weights:
sizes only) for the presets it measured.

    uv run --frozen python tools/bench/bench_compression.py --out out/bench-compression
    uv run --frozen python tools/bench/bench_compression.py --out out/bench-compression --rows q8 'lowrank' \\
        'lowrank-q4=q4 --bundle {out}/lowrank'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohere_coreml_dev.cli_runs import bundle_bytes, checkpoint_parameters, gate_figures, run_cli  # noqa: E402
from cohere_coreml_dev.compression_table import (  # noqa: E402
    heldout_row,
    markdown,
    mean_rate,
    pareto_front,
    parse_row,
    split_folder,
    token_disagreement,
)

logger = logging.getLogger("bench_compression")
CALIBRATED = ("lowrank", "q8-lowrank")  # presets that take --calibration

# label=preset [quantize flags]; `{out}` stands for --out. Rows whose preset this build does not have
# are left out (logged); rows run in order, so a row may start from an earlier row's bundle.
DEFAULT_ROWS = ("q8", "q8-hybrid", "q4", "q8a8", "lowrank", "q8-lowrank",
                "mixed-4.3M=mixed --target-bytes 4300000 --sensitivity-file {out}/sens-f16.json",
                "mixed-3.9M=mixed --target-bytes 3900000 --sensitivity-file {out}/sens-f16.json",
                "lowrank-q4=q4 --bundle {out}/lowrank",
                "lowrank-mixed-3.6M=mixed --bundle {out}/lowrank --target-bytes 3600000 --sensitivity-file {out}/sens-lowrank.json",
                "lowrank-mixed-3.75M=mixed --bundle {out}/lowrank --target-bytes 3750000 --sensitivity-file {out}/sens-lowrank.json")


def measure_heldout(f16: Path, bundle: Path, data: Path, model: str) -> dict:
    """Held-out figures of a bundle no gate produced (the f16 bundle, an ungated rebuild)."""
    from cohere_coreml.quantize import GATES, heldout_gate  # loads torch: only when a row needs it

    return heldout_row(heldout_gate(f16, bundle, data, GATES["q8"], model=model, limit_per_language=None).details)


def run_row(label: str, preset: str, flags: list[str], args, params: int) -> dict:
    out = Path(args.out)
    flags = [f.replace("{out}", str(out)) for f in flags]
    q = out / label
    cmd = ["quantize", "--bundle", str(args.bundle), "--out", str(q), "--preset", preset, "--model", str(args.model),
           "--data", str(args.evaluation), "--force", *flags]
    if preset in CALIBRATED:
        cmd += ["--calibration", str(args.calibration)]
    for folder in args.more_data:  # the larger sets the task verdict reads while undecided
        cmd += ["--more-data", str(folder)]
    res = run_cli(cmd, check=False, log=out / f"quantize-{label}.log")
    row: dict = {"label": label, "preset": preset, "flags": flags, "seconds": res["seconds"],
                 "peak_rss_gb": res["peak_rss_gb"], "passed": res["returncode"] == 0}
    if res["returncode"] != 0:
        refusal = out / f"{label}.parity-failed.json"
        if not refusal.is_file():
            row["error"] = res["stderr_tail"].strip().splitlines()[-1] if res["stderr_tail"].strip() else "failed"
            logger.error("%s: quantize failed without a gate verdict: %s", label, row["error"])
            return row
        gate = json.loads(refusal.read_text())["gate"]
        row["gate"] = gate_figures(gate)
        row["refused_by"] = [name for name, g in gate.items() if isinstance(g, dict) and g.get("passed") is False]
        run_cli(cmd + ["--skip-verify"], log=out / f"quantize-{label}-ungated.log")
        row.update(heldout_row(gate["heldout"]) if "heldout" in gate
                   else measure_heldout(Path(args.bundle), q, Path(args.evaluation), str(args.model)))
    else:
        report = json.loads((q / "compression.json").read_text())
        row["gate"] = gate_figures(report["gate"])
        row.update(heldout_row(report["gate"]["heldout"]))
    row["bytes"] = bundle_bytes(q)
    row["bytes_per_parameter"] = row["bytes"] / params
    return row


def write_chart(report: dict, path: Path) -> None:
    import matplotlib  # heavy and optional: only the chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), as matplotlib requires

    rows = [r for r in report["rows"] if r.get("languages")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    panels = ((axes[0], "pareto_front", lambda r: 100 * mean_rate(r["languages"]), "mean WER / CER over languages (%)"),
              (axes[1], "pareto_front_tokens", lambda r: 100 * token_disagreement(r), "PyTorch tokens not reproduced (%)"))
    for ax, key, error, label in panels:
        for r in rows:
            x, y = r["bytes"] / 1e6, error(r)
            ax.scatter([x], [y], marker="o" if r["passed"] else "x",
                       color="C0" if r["label"] in report[key] else "grey")
            ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = sorted((r for r in rows if r["label"] in report[key]), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] / 1e6 for r in front], [error(r) for r in front], color="C0", linewidth=1,
                label="Pareto front (gates passed)")
        ax.set_xlabel("bundle (MB)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"compression presets: {Path(report['model']).name}, held-out clips not used for calibration "
                 "(x: refused by its gate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(report: dict, out: Path) -> str:
    """The fronts, the table and the chart of a report (also `--replot` of a saved one)."""
    report["pareto_front"] = pareto_front(report["rows"])
    report["pareto_front_tokens"] = pareto_front(report["rows"], error=token_disagreement)
    (out / "bench_compression.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "bench_compression.md").write_text(table)
    write_chart(report, out / "bench_compression.png")
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-compression", help="scratch folder (bundles, logs, table)")
    parser.add_argument("--model", default=None, help="PyTorch checkpoint folder (default: the default model)")
    parser.add_argument("--bundle", default=None,
                        help="its f16 bundle (default: exported into --out from --model)")
    parser.add_argument("--data", default="tests/data/heldout", help="held-out folder (default: %(default)s)")
    parser.add_argument("--calibration-per-language", type=int, default=10,
                        help="the first N clips per language of --data calibrate (lowrank presets) and are never "
                        "scored; every row is scored on the rest (default: %(default)s)")
    parser.add_argument("--more-data", action="append", default=[], metavar="DIR",
                        help="larger held-out folders passed to every row's quantize (its task verdict reads them "
                        "while undecided), e.g. tests/data/heldout-varied/single")
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help="rows as 'label=preset [quantize flags]' or a preset name (default: every preset)")
    parser.add_argument("--full-size", default=None, help="tools/bench/bench_quantize.py's JSON of a full-size run")
    parser.add_argument("--replot", action="store_true", help="only re-render OUT/bench_compression.json (no run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.replot:
        print(render(json.loads((Path(args.out) / "bench_compression.json").read_text()), Path(args.out)))
        return 0
    from cohere_coreml.quantize import PRESETS  # the presets this build has

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:  # `prepare-default` prints the default model's folder last
        res = run_cli(["prepare-default"])
        args.model = [line for line in res["stdout"].splitlines() if line.strip() and
                      not line.startswith("PEAK_RSS_KB")][-1].strip()
    params = checkpoint_parameters(Path(args.model))
    if args.bundle is None:
        args.bundle = out / "f16"
        if not (args.bundle / "manifest.json").is_file():
            run_cli(["export", "--model", str(args.model), "--out", str(args.bundle), "--force"], log=out / "export.log")
    args.calibration, args.evaluation = split_folder(Path(args.data), out, args.calibration_per_language)
    rows = [parse_row(s) for s in args.rows]
    for label, preset, _ in rows:
        if preset not in PRESETS:
            logger.warning("row %s left out: this build has no preset %r (it has %s)", label, preset, sorted(PRESETS))
    rows = [r for r in rows if r[1] in PRESETS]
    report: dict = {"model": str(args.model), "data": f"{args.data} minus {args.calibration_per_language} calibration "
                    "clips per language", "parameters": params, "rows": []}
    f16 = {"label": "f16", "preset": "f16", "flags": [], "passed": True, "bytes": bundle_bytes(Path(args.bundle))}
    f16["bytes_per_parameter"] = f16["bytes"] / params
    f16.update(measure_heldout(Path(args.bundle), Path(args.bundle), args.evaluation, str(args.model)))
    report["rows"].append(f16)
    for label, preset, flags in rows:
        logger.info("row %s: preset %s %s", label, preset, " ".join(flags))
        row = run_row(label, preset, flags, args, params)
        report["rows"].append(row)
        print(f"{label}: {'pass' if row['passed'] else 'REFUSED'}, {row.get('bytes', 0):,} bytes, "
              f"{row['seconds']} s", flush=True)
    if args.full_size:
        full = json.loads(Path(args.full_size).read_text())
        report["full_size"] = {name: b["bytes"] / full["parameters"] for name, b in full["bundles"].items()}
    table = render(report, out)
    print(table)
    print(f"wrote {out / 'bench_compression.md'}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
