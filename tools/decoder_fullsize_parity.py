#!/usr/bin/env python
"""Export a full-size decoder (random weights) and print its teacher-forcing parity and step time.

The released decoder's shapes (transformers' `CohereAsrConfig` defaults: 8 layers, width 1024,
8 heads, FFN 4096, vocabulary 16384; cache C = 288, memory Tp = 448) with random weights and a
1-layer encoder (the encoder is not part of the step). Runs `convert_decoder` (the same gate the
export uses) through the runtime and prints PSNR / KL per precision and ms per decoder call.
Usage: uv run python tools/decoder_fullsize_parity.py [--precision fp16 fp32] [--out /tmp/dec_full]
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("coremltools", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import numpy as np
    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml.convert import ExportSettings
    from cohere_coreml.decoder import convert_decoder
    from cohere_coreml.shapes import cache_capacity, encoder_shapes
    from cohere_coreml.runtime import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = CohereAsrConfig(encoder_config={"num_hidden_layers": 1}, decoder_start_token_id=13764)
    model = CohereAsrForConditionalGeneration(config).eval()
    prompt = [13764, 7, 4, 16, 62, 62, 5, 9, 11, 13]  # released English prompt ids (random model: any ids)
    rows = []
    for precision in args.precision:
        out = Path(args.out) / precision
        settings = ExportSettings(out_dir=out, precision=precision, force=True, model_id="random-full-size")
        t0 = time.perf_counter()
        memory = encoder_shapes(model, settings.window_seconds).padded_frames  # 448 for the 35 s window
        result = convert_decoder(model, settings, capacity=cache_capacity(), memory_len=memory, prompt=prompt,
                                 backend=args.backend, prefill=args.prefill)
        export_s = time.perf_counter() - t0
        runtime = load_model(result["path"], backend=args.backend)
        shapes = result["shapes"]
        state = runtime.make_state()
        mem = (shapes["num_layers"], shapes["num_kv_heads"], shapes["memory_len"], shapes["head_dim"])
        inputs = {"input_ids": np.array([[5]], np.int32), "cross_k": np.zeros(mem, np.float32),
                  "cross_v": np.zeros(mem, np.float32), "cross_mask": np.zeros((1, 1, 1, mem[2]), np.float32)}
        times = []
        for pos in range(12):
            t = time.perf_counter()
            runtime.predict({**inputs, "position": np.array([pos], np.int32)}, state=state)
            times.append(time.perf_counter() - t)
        prompt_s = {}
        if args.prefill:
            pre = load_model(result["path"], backend=args.backend, function_name="prefill")
            cross = {k: v for k, v in inputs.items() if k != "input_ids"}
            t = time.perf_counter()
            pre.predict({"input_ids": np.array([prompt], np.int32), **cross}, state=runtime.make_state())
            prompt_s["prefill_1_call_s"] = time.perf_counter() - t
            st = runtime.make_state()
            t = time.perf_counter()
            for pos, tok in enumerate(prompt):
                runtime.predict({"input_ids": np.array([[tok]], np.int32), "position": np.array([pos], np.int32),
                                 **cross}, state=st)
            prompt_s["prompt_10_step_calls_s"] = time.perf_counter() - t
        p = result["parity"]
        rows.append({"precision": precision, "export_s": export_s, "worst_psnr_db": p["worst_psnr_db"],
                     "mean_kl": p["mean_kl"], "max_kl": p["max_kl"], "argmax": f"{p['argmax_agree']}/{p['argmax_steps']}",
                     "ms_per_call": 1000 * float(np.median(times[2:])), "backend": runtime.backend,
                     "prefill_parity": {k: p["prefill"][k] for k in ("worst_psnr_db", "mean_kl", "argmax_agree")}
                     if "prefill" in p else None, **prompt_s})
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
