#!/usr/bin/env python
"""Benchmark: bundle bytes per parameter, quantize time and peak RSS per preset, on a FULL-SIZE
random-weight checkpoint of the released config (transformers' CohereAsrConfig defaults: 48-layer
1280-wide encoder, 8-layer 1024-wide decoder, vocabulary 16384; weights saved as bf16).

Steps (each in its own process, so peak RSS is per step): write the checkpoint; `cohere-coreml
export` with its gates (the f16 bundle; `make export`); `cohere-coreml quantize` per preset with its
gates vs the f16 packages (encoder PSNR; decoder PSNR, KL and the per-step log-prob error in nats; no
held-out set: random weights transcribe nothing). A preset its gate refuses is rebuilt with
`--skip-verify` so its size is still measured; the refused figures come from `<preset>.parity-failed.json`.
Prints and writes (JSON) a table. Full size takes about an hour and ~16 GB: run it alone. Smoke run:

    uv run python tools/bench/bench_quantize.py --encoder-layers 2 --out /tmp/bench_q
    uv run python tools/bench/bench_quantize.py --out /tmp/bench_q            # full size (run alone)

Targets (issue 12): f16 <= 2.02, q8 <= 1.03, q4 <= 0.56 bytes per checkpoint parameter; the gated
export's peak RSS <= 16 GB. Issue 27: the export splits the encoder (`--encoder-parts`, default auto:
under the iOS limit of 1 GiB per program); every bundle's programs are listed with their weight file
against that limit. A preset `q4@lowrank` is q4 over the `lowrank` bundle (the lowrank->q4 chain;
`lowrank` needs --calibration: a folder like --data, a few clips suffice for sizes).

    uv run python tools/bench/bench_quantize.py --presets q8 lowrank q4@lowrank --calibration DIR --out /tmp/bq
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohere_coreml_dev.cli_runs import bundle_bytes, gate_figures, run_cli  # noqa: E402

TARGETS = {"f16": 2.02, "q8": 1.03, "q4": 0.56}
IOS_LIMIT = 1 << 30  # ane_check.WEIGHT_LIMITS["ios"]


def programs(bundle: Path) -> dict[str, int]:
    """{package: weight file bytes} of every program of a bundle."""
    from cohere_coreml.storage.files import weight_file_bytes

    return {p.name: weight_file_bytes(p) for p in sorted(bundle.glob("*.mlpackage"))}


def make_checkpoint(out: Path, encoder_layers: int | None, seed: int = 0) -> int:
    """Released-config checkpoint with random weights (bf16 safetensors); returns its parameter count."""
    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml_dev.checkpoints import init_subsampling, save_checkpoint, tiny_pieces
    from cohere_coreml_dev.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tiny_pieces())
    config = CohereAsrConfig()
    if encoder_layers:
        config.encoder_config.num_hidden_layers = encoder_layers
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.decoder_start_token_id = tokenizer.convert_tokens_to_ids("\u2581")
    torch.manual_seed(seed)
    model = CohereAsrForConditionalGeneration(config).eval()
    init_subsampling(model)
    params = sum(p.numel() for p in model.parameters())
    save_checkpoint(model.to(torch.bfloat16), tokenizer, out)
    return params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/bench_quantize", help="scratch folder (checkpoint + bundles)")
    parser.add_argument("--encoder-layers", type=int, default=None, help="smoke runs only (default: the config's 48)")
    parser.add_argument("--presets", nargs="+", default=["q8", "q8-hybrid", "q4"])
    parser.add_argument("--skip-gates", action="store_true",
                        help="no export or quantize gates (smoke runs: sizes, times and RSS of conversion alone)")
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--encoder-parts", default="auto", help="the export's --encoder-parts (default: auto)")
    parser.add_argument("--calibration", default=None, help="calibration folder of the lowrank preset")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse the checkpoint and f16 bundle of an earlier run in --out (re-measure the presets)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    f16, saved = out / "f16", out / "bench_quantize.json"
    if args.reuse and saved.is_file() and (f16 / "manifest.json").is_file():  # checkpoint and f16 bundle of a run
        figures = json.loads(saved.read_text())
        figures["bundles"] = {"f16": figures["bundles"]["f16"]}
        params = figures["parameters"]
        print(f"reusing {ckpt} ({params:,} parameters) and {f16}", flush=True)
    else:
        t0 = time.perf_counter()
        params = make_checkpoint(ckpt, args.encoder_layers)
        figures = {"parameters": params, "encoder_layers": args.encoder_layers or 48,
                   "checkpoint_s": round(time.perf_counter() - t0, 1), "bundles": {}}
        print(f"checkpoint: {params:,} parameters ({figures['checkpoint_s']} s)", flush=True)
        gate_flag = ["--skip-verify"] if args.skip_gates else []
        export = run_cli(["export", "--model", str(ckpt), "--out", str(f16), "--force",
                          "--window-seconds", str(args.window_seconds), "--encoder-parts", str(args.encoder_parts),
                          *gate_flag], log=out / "export.log")
        run_cli(["bundle", "finalize", str(f16)])
        figures["bundles"]["f16"] = {"bytes": bundle_bytes(f16), "seconds": export["seconds"],
                                     "peak_rss_gb": export["peak_rss_gb"],
                                     "gates": {p.name.split(".")[0]: json.loads(p.read_text())["headline"]
                                               for p in sorted(f16.glob("*.parity.json"))}}
        print(f"f16 export: {export['seconds']} s, peak RSS {export['peak_rss_gb']} GB", flush=True)
        saved.write_text(json.dumps(figures, indent=2, default=str))
    figures["bundles"]["f16"]["programs"] = programs(f16)
    for name in args.presets:
        preset, _, source = name.partition("@")  # q4@lowrank: q4 over the lowrank bundle
        q = out / name
        cmd = ["quantize", "--bundle", str(out / source if source else f16), "--out", str(q), "--preset", preset,
               "--data", "none", "--force"]
        if preset in ("lowrank", "q8-lowrank"):
            cmd += ["--model", str(ckpt), "--calibration", str(args.calibration)]
        res = run_cli(cmd + (["--skip-verify"] if args.skip_gates else []), check=args.skip_gates,
                      log=out / f"quantize-{preset}.log")
        entry: dict = {"seconds": res["seconds"], "peak_rss_gb": res["peak_rss_gb"]}
        if res["returncode"] != 0:  # refused by its gate: figures from the refusal, size from an ungated build
            refusal = out / f"{name}.parity-failed.json"
            if not refusal.is_file():
                raise SystemExit(f"quantize {preset} failed ({res['returncode']}):\n{res['stderr_tail']}")
            entry["gate"] = {"passed": False, **gate_figures(json.loads(refusal.read_text())["gate"])}
            res = run_cli(cmd + ["--skip-verify"], log=out / f"quantize-{preset}-ungated.log")
            entry.update(ungated_seconds=res["seconds"], ungated_peak_rss_gb=res["peak_rss_gb"])
        report = json.loads((q / "compression.json").read_text())
        entry.setdefault("gate", {"passed": report["gate"].get("passed"), **gate_figures(report["gate"])})
        entry.update(bytes=bundle_bytes(q), uncompressed_tensors={c: s["tensors"]["uncompressed"]
                                                                  for c, s in report["components"].items()},
                     programs=programs(q))
        figures["bundles"][name] = entry
        rebuilt = (f"; refused, rebuilt with --skip-verify: {entry['ungated_seconds']} s, peak RSS "
                   f"{entry['ungated_peak_rss_gb']} GB" if "ungated_seconds" in entry else "")
        print(f"{name}: {entry['seconds']} s, peak RSS {entry['peak_rss_gb']} GB{rebuilt}, gate {entry['gate']}",
              flush=True)
    print(f"\n{'bundle':10s} {'bytes':>15s} {'B/param':>8s} {'target':>7s} {'time s':>8s} {'peak RSS GB':>11s}")
    for name, b in figures["bundles"].items():
        b["bytes_per_parameter"] = round(b["bytes"] / params, 4)
        target = TARGETS.get(name)
        print(f"{name:10s} {b['bytes']:>15,} {b['bytes_per_parameter']:>8.4f} {target or '':>7} "
              f"{b['seconds']:>8.1f} {b['peak_rss_gb']:>11.2f}")
    print(f"\n{'bundle':10s} programs: weight file bytes (iOS limit {IOS_LIMIT:,} per program)")
    for name, b in figures["bundles"].items():
        listed = ", ".join(f"{p} {n:,}{' OVER' if n > IOS_LIMIT else ''}" for p, n in b.get("programs", {}).items())
        print(f"{name:10s} {listed}")
    print(f"\n{'vs f16':10s} {'gate':>6s} {'enc dB':>7s} {'dec dB':>7s} {'mean KL':>9s} {'argmax':>8s} "
          f"{'|dlogp| median / p99 / max (nats)':>34s} {'eos max':>8s}")
    for name, b in figures["bundles"].items():
        g = b.get("gate")
        if not g or g.get("decoder_psnr_db") is None:
            continue
        lp, eos = g["log_prob_error_nats"], g["eos_error_nats"]
        print(f"{name:10s} {'pass' if g['passed'] else 'REFUSED':>6s} {g['encoder_psnr_db'] or float('nan'):>7.1f} "
              f"{g['decoder_psnr_db']:>7.1f} {g['decoder_mean_kl']:>9.2e} {g['argmax']:>8s} "
              f"{lp['median']:>10.4f} / {lp['p99']:.4f} / {lp['max']:.4f} {eos.get('max', float('nan')):>8.4f}")
    saved.write_text(json.dumps(figures, indent=2, default=str))
    print(f"\nwrote {saved} (time: gated export for f16, gated quantize for the others)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
