#!/usr/bin/env python
"""Cost of word timings' align function: one `align` call against one window's decoding, on the interpreter.

Exports the decoder of a checkpoint (default: the built-in trained model, the default 35 s window and 256 new
tokens, with prefill, `--alignment-heads auto` unless --heads is given; the export's gates run) into --out, then
for each calibration clip of the model's own domain that it transcribes (the shipped calibration set): the
window's cross memory from the reference encoder, greedy decoding through `DecoderRuntime` (prefill, then a step
per token until eos) timed, then one `align` call on the same state timed. Prints per clip the tokens, the
decoding and align milliseconds and their ratio, then the median ratio (the target: <= 10 %) and the align
function's off-Neural-Engine ops from the bundle's ane_check.json.
Usage: uv run --frozen python tools/bench/bench_align_cost.py [--model DIR] [--heads 1.0,1.1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"))
    parser.add_argument("--out", default=str(ROOT / "out" / "bench-align"))
    parser.add_argument("--heads", default="auto", help="--alignment-heads of the export (default: auto)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per clip (the minimum is kept)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from cohere_coreml.export.alignment_heads import CALIBRATION_SET, calibration_records
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model
    from cohere_coreml.inference.decoder_runtime import DecoderRuntime
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.reference import cross_memory
    from cohere_coreml.model.tokens import eos_id

    torch.set_num_threads(args.threads)
    model, processor = load_reference(args.model)
    processor.feature_extractor.dither = 0.0
    out = Path(args.out)
    t0 = time.perf_counter()
    export_model(model, processor, ExportSettings(out_dir=out, precision="fp16", force=True), components=("decoder",),
                 prefill=True, alignment_heads=args.heads)
    print(f"export (decoder, --alignment-heads {args.heads}): {time.perf_counter() - t0:.1f} s")
    manifest = json.loads((out / "manifest.json").read_text())["decoder"]
    if manifest["alignment"] is None:
        print(f"no align function: {manifest['alignment_note']}")
        return 1
    memory_len = manifest["memory_shape"][2]
    print(f"heads {manifest['alignment']['heads']}, lead rows {manifest['alignment']['lead_rows']}, "
          f"A = C = {manifest['capacity']}, Tp = {memory_len}")
    decoder = DecoderRuntime.load(out / "decoder.mlpackage", backend="mil", num_threads=args.threads)
    eos = eos_id(processor.tokenizer)
    records = [r for r in calibration_records(model, processor, CALIBRATION_SET) if "_domain_" in r.meta["file"]]
    ratios = []
    print("clip\ttokens\tdecode_ms\talign_ms\tratio")
    for r in records:
        hidden = r.meta["encoded"]
        with torch.no_grad():
            memory = cross_memory(model, hidden, int(hidden.shape[1]), memory_len)
        prompt = r.meta["ids"][: r.prompt_length]
        decode_s, align_s = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            state = decoder.new_state(memory)
            ids = list(prompt)
            log_probs = decoder.prefill(state, prompt)
            while len(ids) < decoder.capacity:
                token = int(np.argmax(log_probs))
                if token == eos:
                    break
                log_probs = decoder.step(state, token, len(ids))
                ids.append(token)
            decode_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            decoder.align(state, ids)
            align_s.append(time.perf_counter() - t)
        ratio = min(align_s) / min(decode_s)
        ratios.append(ratio)
        print(f"{r.meta['file']}\t{len(ids) - len(prompt)}\t{1000 * min(decode_s):.1f}\t{1000 * min(align_s):.1f}\t"
              f"{100 * ratio:.1f} %")
    print(f"median align / decoding: {100 * float(np.median(ratios)):.1f} % over {len(ratios)} windows (target <= 10 %)")
    census = json.loads((out / "ane_check.json").read_text()) if (out / "ane_check.json").exists() else None
    if census is not None:
        print("ane-check:", json.dumps(census.get("packages", census), default=str)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
