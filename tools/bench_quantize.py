#!/usr/bin/env python
"""Benchmark: bundle bytes per parameter, quantize time and peak RSS per preset, on a FULL-SIZE
random-weight checkpoint of the released config (transformers' CohereAsrConfig defaults: 48-layer
1280-wide encoder, 8-layer 1024-wide decoder, vocabulary 16384; weights saved as bf16).

Steps (each in its own process, so peak RSS is per step): write the checkpoint; `cohere-coreml
export` (f16 bundle, gates skipped: random weights); `cohere-coreml quantize` per preset (gates
skipped unless --gate; no held-out set: random weights transcribe nothing). Prints and writes
(JSON) a table. Full size takes tens of minutes and ~14 GB: the lead schedules it. Smoke run:

    uv run python tools/bench_quantize.py --encoder-layers 2 --out /tmp/bench_q
    uv run python tools/bench_quantize.py --out /tmp/bench_q            # full size (scheduled)

Targets (issue 12): f16 <= 2.02, q8 <= 1.03, q4 <= 0.56 bytes per checkpoint parameter.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

TARGETS = {"f16": 2.02, "q8": 1.03, "q4": 0.56}
_CHILD = ("import resource, sys; from cohere_coreml.cli import main; rc = main(sys.argv[1:]); "
          "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True); sys.exit(rc)")


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


def run_cli(args: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss = next((int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_KB")), 0)
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(rss / 1024**2, 2), "stdout": proc.stdout}


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/bench_quantize", help="scratch folder (checkpoint + bundles)")
    parser.add_argument("--encoder-layers", type=int, default=None, help="smoke runs only (default: the config's 48)")
    parser.add_argument("--presets", nargs="+", default=["q8", "q8-hybrid", "q4"])
    parser.add_argument("--gate", action="store_true", help="run the gates vs the f16 packages (interpreter; slow)")
    parser.add_argument("--window-seconds", type=float, default=35.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    t0 = time.perf_counter()
    params = make_checkpoint(ckpt, args.encoder_layers)
    figures: dict = {"parameters": params, "encoder_layers": args.encoder_layers or 48,
                     "checkpoint_s": round(time.perf_counter() - t0, 1), "bundles": {}}
    print(f"checkpoint: {params:,} parameters ({figures['checkpoint_s']} s)", flush=True)

    f16 = out / "f16"
    export = run_cli(["export", "--model", str(ckpt), "--out", str(f16), "--force", "--skip-verify",
                      "--window-seconds", str(args.window_seconds)])
    run_cli(["bundle", "finalize", str(f16)])
    figures["bundles"]["f16"] = {"bytes": bundle_bytes(f16), "seconds": export["seconds"],
                                 "peak_rss_gb": export["peak_rss_gb"]}
    for preset in args.presets:
        q = out / preset
        cmd = ["quantize", "--bundle", str(f16), "--out", str(q), "--preset", preset, "--eval-set", "none", "--force"]
        res = run_cli(cmd + ([] if args.gate else ["--skip-gate"]))
        report = json.loads((q / "compression.json").read_text())
        figures["bundles"][preset] = {"bytes": bundle_bytes(q), "seconds": res["seconds"],
                                      "peak_rss_gb": res["peak_rss_gb"],
                                      "uncompressed_tensors": {c: s["tensors"]["uncompressed"]
                                                               for c, s in report["components"].items()},
                                      "gate": report.get("gate")}
    print(f"\n{'bundle':10s} {'bytes':>15s} {'B/param':>8s} {'target':>7s} {'time s':>8s} {'peak RSS GB':>11s}")
    for name, b in figures["bundles"].items():
        b["bytes_per_parameter"] = round(b["bytes"] / params, 4)
        target = TARGETS.get(name)
        print(f"{name:10s} {b['bytes']:>15,} {b['bytes_per_parameter']:>8.4f} {target or '':>7} "
              f"{b['seconds']:>8.1f} {b['peak_rss_gb']:>11.2f}")
    (out / "bench_quantize.json").write_text(json.dumps(figures, indent=2, default=str))
    print(f"\nwrote {out / 'bench_quantize.json'} (time: export for f16, quantize for the others)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
