#!/usr/bin/env python
"""Export a full-size decoder (random weights) and print its teacher-forcing parity and step time.

The released decoder's shapes (transformers' `CohereAsrConfig` defaults: 8 layers, width 1024,
8 heads, FFN 4096, vocabulary 16384; cache C = 288, memory Tp = 448) with random weights and a
1-layer encoder (the encoder is not part of the step). Runs `convert_decoder` (the same gate the
export uses) through the runtime and prints PSNR / KL per precision, ms per decoder step call (input_ids +
position only) and the one bind_memory call of a window.
Usage:
  uv run python tools/parity/decoder_fullsize_parity.py [--precision fp16 fp32] [--seed 0 7 ...] [--out /tmp/dec_full]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", nargs="+", default=["fp16"], choices=("fp16", "fp32"))
    parser.add_argument("--out", default="/tmp/decoder_fullsize", help="scratch folder for the packages")
    parser.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"))
    parser.add_argument("--prefill", action="store_true", help="also export and time the prompt prefill function")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="torch seeds of the random weights (one export and gate per seed; default: 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("coremltools", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import numpy as np
    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.decoder import convert_decoder
    from cohere_coreml.export.decoder_modules import DecoderExportError
    from cohere_coreml.inference.decoder_runtime import DecoderRuntime
    from cohere_coreml.model.shapes import cache_capacity, encoder_shapes

    torch.set_num_threads(1)
    config = CohereAsrConfig(encoder_config={"num_hidden_layers": 1}, decoder_start_token_id=13764)
    prompt = [13764, 7, 4, 16, 62, 62, 5, 9, 11, 13]  # released English prompt ids (random model: any ids)
    rows = []
    for seed, precision in [(seed, precision) for seed in args.seed for precision in args.precision]:
        torch.manual_seed(seed)
        model = CohereAsrForConditionalGeneration(config).eval()
        out = Path(args.out) / precision
        settings = ExportSettings(out_dir=out, precision=precision, force=True, model_id="random-full-size",
                                  gate_units={"mil": "interpreter", "coreml": "all"}.get(args.backend, "auto"))
        t0 = time.perf_counter()
        memory = encoder_shapes(model, settings.window_seconds).padded_frames  # 448 for the 35 s window
        try:
            result = convert_decoder(model, settings, capacity=cache_capacity(), memory_len=memory, prompt=prompt,
                                     prefill=args.prefill)
        except DecoderExportError as err:  # refused by the gate: its figures are in decoder.parity-failed.json
            failed = json.loads((out / "decoder.parity-failed.json").read_text())
            p = failed.get("details", failed)
            rows.append({"seed": seed, "precision": precision, "passed": False, "error": str(err).splitlines()[0],
                         **{k: p.get(k) for k in ("worst_psnr_db", "mean_kl", "argmax_agree", "argmax_steps",
                                                   "near_tie_flips", "decisive_flips")}})
            continue
        export_s = time.perf_counter() - t0
        decoder = DecoderRuntime.load(result["path"], backend=args.backend, prefill=args.prefill)
        shapes = result["shapes"]
        mem = (shapes["num_layers"], shapes["num_kv_heads"], shapes["memory_len"], shapes["head_dim"])
        memory = {"cross_k": np.zeros(mem, np.float32), "cross_v": np.zeros(mem, np.float32),
                  "cross_mask": np.zeros((1, 1, 1, mem[2]), np.float32)}
        state = decoder.make_state()
        t = time.perf_counter()
        decoder.bind(state, memory)  # once per window
        bind_s = time.perf_counter() - t
        times = []
        for pos in range(12):  # each call binds only input_ids + position
            t = time.perf_counter()
            decoder.step(state, 5, pos)
            times.append(time.perf_counter() - t)
        prompt_s = {"bind_memory_s": bind_s}
        if args.prefill:
            st = decoder.new_state(memory)
            t = time.perf_counter()
            decoder.prefill(st, prompt)
            prompt_s["prefill_1_call_s"] = time.perf_counter() - t
            st = decoder.new_state(memory)
            t = time.perf_counter()
            for pos, tok in enumerate(prompt):
                decoder.step(st, tok, pos)
            prompt_s["prompt_10_step_calls_s"] = time.perf_counter() - t
        p = result["parity"]
        rows.append({"seed": seed, "precision": precision, "passed": bool(p["passed"]),
                     "near_tie_flips": p.get("near_tie_flips"), "decisive_flips": p.get("decisive_flips"),
                     "near_ties": [f for f in p.get("flips", []) if f["near_tie"]],
                     "export_s": export_s, "worst_psnr_db": p["worst_psnr_db"],
                     "mean_kl": p["mean_kl"], "max_kl": p["max_kl"], "argmax": f"{p['argmax_agree']}/{p['argmax_steps']}",
                     "ms_per_call": 1000 * float(np.median(times[2:])), "backend": decoder.backend,
                     "prefill_parity": {k: p["prefill"][k] for k in ("worst_psnr_db", "mean_kl", "argmax_agree")}
                     if "prefill" in p else None, **prompt_s})
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
