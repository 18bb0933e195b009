#!/usr/bin/env python
"""Benchmark: what each extra byte of `--target-psnr` buys, as the decoder's log-prob error bound.

Compresses the decoder of an f16 bundle with one scheme (every weight, nothing skipped), measures
each weight's sensitivity (decoder output PSNR vs f16 with only that weight quantized), then keeps
the most sensitive weights fp16 one at a time (`quantize.sensitivity.choose_fp16`, the steps `--target-psnr`
takes) and prints, per step, the extra bytes and the per-step log-prob error vs the f16 decoder
(median / p99 / max nats over the f16 top-16 tokens, and the eos id's max): the bound on which
near-ties quantization can flip, and how fast keeping weights fp16 lowers it.

    uv run python tools/bench/bench_sensitivity.py --bundle f16 --data tests/data/heldout
    uv run python tools/bench/bench_sensitivity.py --bundle /tmp/bench_full/f16 --max-kept 6   # full size
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", default="f16", help="an f16 bundle (default: %(default)s)")
    parser.add_argument("--data", default="none",
                        help="evaluation folder whose clips (2 per language) the gate data uses; 'none' (default): "
                        "the speech clips shipped with the package")
    parser.add_argument("--scheme", default="int8", help="compression scheme of the decoder (default: %(default)s)")
    parser.add_argument("--max-kept", type=int, default=8, help="stop after this many weights kept fp16")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from cohere_coreml import quantize as Q

    bundle = Path(args.bundle)
    t0 = time.perf_counter()
    clips = Q.clips_of(None if args.data == "none" else args.data)
    data = Q.build_gate_data(bundle, clips)
    f16_package = bundle / "decoder.mlpackage"
    with tempfile.TemporaryDirectory() as tmp:
        quantized = Path(tmp) / "decoder.mlpackage"
        section = Q.compress_package(f16_package, quantized, Q.Recipe(args.scheme))
        saved = {c["name"]: c["bytes_before"] - c["bytes_after"] for c in section["compressed"]}
        sens = Q.sensitivity("decoder", f16_package, quantized, data)
        choice = Q.choose_fp16("decoder", f16_package, quantized, data, sens["per_weight"], saved,
                               target_psnr=float("inf"), max_kept=args.max_kept)
    steps = data.decoder_ref and sum(len(r) - len(p) + 1 for r, p in zip(data.decoder_ref, data.prompts))
    print(f"decoder of {bundle}, {args.scheme} everywhere, {len(data.windows)} sequences, {steps} decoding steps "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'kept fp16':>9s} {'weight added':40s} {'extra MB':>9s} {'PSNR dB':>8s} "
          f"{'|dlogp| median / p99 / max':>28s} {'eos max':>8s}")
    kept = [""] + choice["kept_fp16"]
    for step, name in zip(choice["steps"], kept):
        e = step["log_prob_error_nats"]
        print(f"{step['kept_fp16']:>9d} {name[-40:]:40s} {step['extra_bytes'] / 1e6:>9.3f} {step['psnr_db']:>8.1f} "
              f"{e['median']:>10.4f} / {e['p99']:.4f} / {e['max']:.4f} {step['eos_error_max_nats']:>8.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bundle": str(bundle), "scheme": args.scheme, "steps": steps,
                                               "sensitivity": sens, "choice": choice}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
