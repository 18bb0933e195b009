#!/usr/bin/env python
"""Decoder calls of one window: bytes each call binds and its time through the runtime.

Exports the decoder of a checkpoint (default: the built-in trained model, the default 35 s window and
256 new tokens: C = 288, Tp = 448; the export's own gate runs), then through `DecoderRuntime`:
bind_memory once, then `--steps` step calls, `--repeats` times. Prints the bytes of every input of the
step and bind functions (from the package's I/O descriptions) and the median / min ms per call.
Usage: uv run python tools/bench_decoder_step.py [--model DIR] [--precision fp16] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def io_bytes(io: dict) -> int:
    """Bytes of the inputs a call binds, from a `bundle.package_io` block."""
    import numpy as np

    return int(sum(np.prod(v["shape"]) * np.dtype(v["dtype"]).itemsize for v in io["inputs"].values()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder")
    parser.add_argument("--precision", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="step calls per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows timed")
    parser.add_argument("--out", default="/tmp/bench_decoder_step", help="scratch folder for the package")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import torch

    from cohere_coreml.bundle import package_io
    from cohere_coreml.checkpoint import load_reference
    from cohere_coreml.config import BIND_FUNCTION, STEP_FUNCTION
    from cohere_coreml.convert import ExportSettings
    from cohere_coreml.decoder import convert_decoder
    from cohere_coreml.decoder_runtime import DecoderRuntime
    from cohere_coreml.shapes import cache_capacity, encoder_shapes

    torch.set_num_threads(1)
    model, _ = load_reference(args.model)
    settings = ExportSettings(out_dir=Path(args.out), precision=args.precision, force=True,
                              window_seconds=args.window_seconds)
    memory_len = encoder_shapes(model, args.window_seconds).padded_frames
    result = convert_decoder(model, settings, capacity=cache_capacity(args.max_new_tokens), memory_len=memory_len)
    path = result["path"]
    decoder = DecoderRuntime.load(path, backend="mil", prefill=False)
    bind_io, step_io = package_io(path, BIND_FUNCTION), package_io(path, STEP_FUNCTION)
    rng = np.random.default_rng(0)
    memory = {name.removeprefix("encoder_"): rng.standard_normal(v["shape"]).astype(v["dtype"])
              for name, v in bind_io["inputs"].items()}
    memory["cross_mask"][:] = 0.0
    steps, binds = [], []
    for _ in range(args.repeats):
        state = decoder.make_state()
        t = time.perf_counter()
        decoder.bind(state, memory)
        binds.append(time.perf_counter() - t)
        for pos in range(args.steps):
            t = time.perf_counter()
            decoder.step(state, 5, pos)
            steps.append(time.perf_counter() - t)
    report = {
        "model": args.model, "precision": args.precision, "shapes": result["shapes"],
        "gate": {k: result["parity"][k] for k in ("worst_psnr_db", "mean_kl", "passed")} if result["parity"] else None,
        "step_bytes_per_call": io_bytes(step_io), "bind_bytes_per_window": io_bytes(bind_io),
        "step_ms_median": 1000 * float(np.median(steps)), "step_ms_min": 1000 * float(np.min(steps)),
        "bind_ms_median": 1000 * float(np.median(binds)), "step_calls": len(steps),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = report["shapes"]
        print(f"decoder L={s['num_layers']} Hkv={s['num_kv_heads']} Dh={s['head_dim']} C={s['capacity']} "
              f"Tp={s['memory_len']} ({args.precision}), gate {report['gate']}")
        print(f"step: {report['step_bytes_per_call']} B bound per call, {report['step_ms_median']:.3f} ms median "
              f"({report['step_ms_min']:.3f} min) over {len(steps)} calls")
        print(f"bind_memory: {report['bind_bytes_per_window']} B once per window, {report['bind_ms_median']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
