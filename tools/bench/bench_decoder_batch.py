#!/usr/bin/env python
"""Decoding B windows at once (`step_batch`): weight bytes per generated token, wall time per token, memory.

Prints, side by side for B = 1 (the step) and each --batches size:

1. decoder weight bytes read per generated token: at full size from the released config's parameters (no
   export: `decoder_batch_cost.decoder_step_parameters` on the meta device) and on the demo bundle's decoder
   from its step program (`program_step_weights`);
2. interpreter wall time per generated token on the demo decoder (the built-in trained model at the default
   35 s window and 256 new tokens, exported once with one `step_batch` per size, each gated), every row busy,
   the sizes' runs alternated in one process (`time_per_token`);
3. state + call I/O + largest activations per batch size at full size (`memory_figures`): what an app holds to
   decode B windows at once.

Usage: uv run python tools/bench/bench_decoder_batch.py [--batches 2 4 8] [--steps 40] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="demo checkpoint folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8], help="batch sizes besides 1")
    parser.add_argument("--steps", type=int, default=40, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size (alternated)")
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the interpreter")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch

    from cohere_coreml.evaluation import decoder_batch_cost as cost
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.decoder import convert_decoder
    from cohere_coreml.inference.batch_decoding import BatchDecoder
    from cohere_coreml.inference.decoder_runtime import DecoderRuntime
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.shapes import DecoderShapes, cache_capacity, encoder_shapes

    torch.set_num_threads(args.threads)
    full_model = cost.full_size_model()
    full_params = cost.decoder_step_parameters(full_model)
    full_shapes = DecoderShapes.from_config(full_model.config, cache_capacity(args.max_new_tokens),
                                            encoder_shapes(full_model, args.window_seconds).padded_frames)
    sizes = [1, *args.batches]

    model, _ = load_reference(args.model)
    demo_memory = encoder_shapes(model, args.window_seconds).padded_frames
    capacity = cache_capacity(args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-decoder-batch-") as tmp:
        packages = {}
        for b in args.batches:  # one package per size: step (+ step_batch of B), each gated
            out = Path(tmp) / f"b{b}"
            packages[b] = convert_decoder(model, ExportSettings(out_dir=out, precision="fp16"), capacity=capacity,
                                          memory_len=demo_memory, batch=b)["path"]
        first = packages[args.batches[0]]
        demo_params = cost.program_step_weights(first, "main")
        step = DecoderRuntime.load(first, backend="mil", prefill=False, extend=False, align=False)
        batched = {b: BatchDecoder.load(p, backend="mil") for b, p in packages.items()}
        demo_shapes = DecoderShapes.from_config(model.config, capacity, demo_memory)
        memory = cost.random_memory(demo_shapes, valid=demo_memory * 3 // 4)
        times = cost.time_per_token(step, batched, memory, args.steps, args.repeats)
        batch_params = {b: cost.program_step_weights(p, "step_batch") for b, p in packages.items()}

    result = {
        "full_size": {"shapes": full_shapes.to_dict(), "step_parameters": full_params,
                      "weight_bytes_per_token": {b: cost.weight_bytes_per_token(full_params, b) for b in sizes},
                      "weight_bytes_per_token_int8": {b: cost.weight_bytes_per_token(full_params, b, 1) for b in sizes},
                      "memory": {b: cost.memory_figures(full_shapes, b) for b in sizes}},
        "demo": {"model": args.model, "shapes": demo_shapes.to_dict(), "step_weights": demo_params,
                 "step_batch_weights_equal_step": all(v == demo_params for v in batch_params.values()),
                 "weight_bytes_per_token": {b: cost.weight_bytes_per_token(demo_params, b, 1) for b in sizes},
                 "interpreter": times, "steps": args.steps, "repeats": args.repeats, "threads": args.threads},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    full, demo = result["full_size"], result["demo"]
    print(f"full size (released config): a step reads {full_params['read']:,} parameters whole + "
          f"{full_params['per_token']:,} embedding values per token")
    print(f"demo decoder (L{demo_shapes.num_layers} D{demo_shapes.hidden_size} V{demo_shapes.vocab_size}, C {capacity}, "
          f"Tp {demo_memory}): {demo_params['read']:,} weight bytes a call; interpreter, {args.threads} thread(s), "
          f"median of {args.repeats} runs of {args.steps} calls")
    print(f"{'B':>3} {'full MB/token fp16':>19} {'int8':>8} {'demo KB/token':>14} {'demo ms/call':>13} "
          f"{'demo ms/token':>14} {'vs B=1':>7} {'full state MB':>14} {'I/O+act MB':>11}")
    base = demo["interpreter"][1]["ms_per_token"]
    for b in sizes:
        t, m = demo["interpreter"][b], full["memory"][b]
        print(f"{b:>3} {full['weight_bytes_per_token'][b] / 1e6:>19.1f} {full['weight_bytes_per_token_int8'][b] / 1e6:>8.1f} "
              f"{demo['weight_bytes_per_token'][b] / 1e3:>14.1f} {t['ms_per_call']:>13.2f} {t['ms_per_token']:>14.2f} "
              f"{base / t['ms_per_token']:>6.2f}x {m['state'] / 1e6:>14.1f} {(m['call_io'] + m['activations']) / 1e6:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
