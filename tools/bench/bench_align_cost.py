#!/usr/bin/env python
"""Cost of word timings' align function: one window's `align` calls against its decoding, on the interpreter.

Exports the decoder of a checkpoint (default: the built-in trained model, the default 35 s window and 256 new
tokens, with prefill, `--alignment-heads auto` unless --heads is given; the export's gates run) into --out, then
for each calibration clip of the model's own domain that it transcribes (the shipped calibration set): the
window's cross memory from the reference encoder, greedy decoding through `DecoderRuntime` (prefill, then a step
per token until eos) timed, then `DecoderRuntime.align` on the same state from the first row the rule reads
(prompt length - 1 - lead rows; K rows a call) timed. Prints per clip the tokens, the align calls, the decoding and
align milliseconds and their ratio, then the median and range of the ratio (the target: <= 10 %) and the align
function's Neural Engine census from the bundle's ane_check.json.
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
    from cohere_coreml.inference.decoder_runtime import DecoderRuntime, align_starts
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
    lead_rows = manifest["alignment"]["lead_rows"]
    print(f"heads {manifest['alignment']['heads']}, lead rows {lead_rows}, K = {manifest['alignment']['length']}, "
          f"C = {manifest['capacity']}, Tp = {memory_len}")
    decoder = DecoderRuntime.load(out / "decoder.mlpackage", backend="mil", num_threads=args.threads)
    eos = eos_id(processor.tokenizer)
    records = [r for r in calibration_records(model, processor, CALIBRATION_SET) if "_domain_" in r.meta["file"]]
    ratios = []
    print("clip\ttokens\tcalls\tdecode_ms\talign_ms\tms_per_call\tratio")
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
            rows_from = len(prompt) - 1 - lead_rows  # the first row the rule reads
            decoder.align(state, ids, rows_from=rows_from)
            align_s.append(time.perf_counter() - t)
        calls = len(align_starts(len(ids), rows_from, decoder.align_length, decoder.capacity))
        ratio = min(align_s) / min(decode_s)
        ratios.append(ratio)
        print(f"{r.meta['file']}\t{len(ids) - len(prompt)}\t{calls}\t{1000 * min(decode_s):.1f}\t"
              f"{1000 * min(align_s):.1f}\t{1000 * min(align_s) / calls:.1f}\t{100 * ratio:.1f} %")
    print(f"align / decoding: median {100 * float(np.median(ratios)):.1f} %, range {100 * min(ratios):.1f}-"
          f"{100 * max(ratios):.1f} % over {len(ratios)} windows (target <= 10 %)")
    census = json.loads((out / "ane_check.json").read_text()) if (out / "ane_check.json").exists() else None
    if census is not None:
        print("ane-check:", json.dumps(census.get("packages", census), default=str)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
