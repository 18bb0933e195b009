#!/usr/bin/env python
"""Decoder calls of one window, both state variants: bytes each call binds, bytes the host writes into the
state, the programs' state writes, and each call's time through the runtime.

Exports the decoder of a checkpoint once per `--decoder-state` variant (default: both, the built-in
trained model, the default 35 s window and 256 new tokens: C = 288, Tp = 448; the export's own gate runs),
then through `DecoderRuntime`: a fresh state per window (graph: bind_memory; host: the host writes the
memory), then `--steps` step calls, `--repeats` windows, the variants' windows alternated in one process.
Prints per variant the bytes of every input of a step (from the package's I/O descriptions), the bytes
the host writes into the state per step and per window (graph: 0), the state-writing ops of its programs
(`decoder_gate.state_write_ops`), the median / min ms per step; and the same bytes for the full-size
config (L 8, Hkv 8, Dh 128, C 288, Tp 448) by arithmetic.
Also the bytes per step by path, measured: in place (the interpreter's row write; Swift writes the same rows),
and through the whole-buffer state API that coremltools' MLState offers Python on a Mac (counted on the
interpreter's state with its row write hidden).
Usage: uv run python tools/bench/bench_decoder_step.py [--model DIR] [--precision fp16] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FULL_SIZE = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "capacity": 288, "memory_len": 448}


def io_bytes(io: dict) -> int:
    """Bytes of the inputs a call binds, from a `bundle.package_io` block."""
    import numpy as np

    return int(sum(np.prod(v["shape"]) * np.dtype(v["dtype"]).itemsize for v in io["inputs"].values()))


def host_bytes(s: dict, state_writes: str) -> dict:
    """Bytes the host moves into / out of the decoder state, by arithmetic (fp16, 2 bytes per element).

    host: the memory once per window (cross_k + cross_v + cross_mask); per step one K/V row per layer
    (2 x L x Hkv x Dh) in place (Swift's MLState.withMultiArray(for:), the interpreter), or, with only
    coremltools' MLState API (whole buffers, Core ML on a Mac from Python), both cache buffers read and
    written whole; plus the step's cache_mask input (C). graph: nothing (bind_memory and the step write)."""
    cache = s["num_layers"] * s["num_kv_heads"] * s["capacity"] * s["head_dim"] * 2
    rows = 2 * s["num_layers"] * s["num_kv_heads"] * s["head_dim"] * 2
    memory = 2 * s["num_layers"] * s["num_kv_heads"] * s["memory_len"] * s["head_dim"] * 2 + s["memory_len"] * 2
    if state_writes == "graph":
        return {"window_written": 0, "step_written": 0, "step_read": 0, "step_mask_input": 0,
                "step_written_whole_buffers": 0, "step_read_whole_buffers": 0}
    return {"window_written": memory, "step_written": rows, "step_read": 0, "step_mask_input": s["capacity"] * 2,
            "step_written_whole_buffers": 2 * cache, "step_read_whole_buffers": 2 * cache}


def whole_buffer_bytes(decoder, memory: dict, steps: int) -> dict:
    """Bytes read from and written into the state per step when the state offers only whole-buffer
    `read_state` / `write_state`, as coremltools' `MLState` does (Python on Core ML): the interpreter's
    state with its in-place row write hidden, so `decoder_runtime.write_rows` takes that path; counted."""
    import numpy as np

    state = decoder.new_state(memory)
    counts = {"read": 0, "written": 0}
    read_state, write_state = state.read_state, state.write_state

    def read(name):
        value = read_state(name)
        counts["read"] += np.asarray(value).nbytes
        return value

    def write(name, value):
        counts["written"] += np.asarray(value).nbytes
        write_state(name, value)

    state.read_state, state.write_state, state.write_state_slice = read, write, None
    for pos in range(steps):
        decoder.step(state, 5, pos)
    return {"read": counts["read"] / steps, "written": counts["written"] / steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder")
    parser.add_argument("--precision", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--decoder-state", nargs="+", default=["host", "graph"], choices=("host", "graph"))
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="step calls per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows timed per variant")
    parser.add_argument("--out", default="/tmp/bench_decoder_step", help="scratch folder for the packages")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import torch

    from cohere_coreml.bundle.packages import package_io
    from cohere_coreml.config import STEP_FUNCTION
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.decoder import convert_decoder
    from cohere_coreml.export.decoder_gate import state_write_ops
    from cohere_coreml.inference.decoder_runtime import DecoderRuntime
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.shapes import cache_capacity, encoder_shapes

    torch.set_num_threads(1)
    model, _ = load_reference(args.model)
    memory_len = encoder_shapes(model, args.window_seconds).padded_frames
    variants = {}
    for state_writes in args.decoder_state:
        settings = ExportSettings(out_dir=Path(args.out) / state_writes, precision=args.precision, force=True,
                                  window_seconds=args.window_seconds)
        result = convert_decoder(model, settings, capacity=cache_capacity(args.max_new_tokens), memory_len=memory_len,
                                 state_writes=state_writes)
        decoder = DecoderRuntime.load(result["path"], backend="mil", prefill=False)
        variants[state_writes] = {"result": result, "decoder": decoder, "steps": [], "binds": [], "written": []}
    rng = np.random.default_rng(0)
    first = next(iter(variants.values()))["decoder"]
    memory = {name: rng.standard_normal(first.state_description[name][0]).astype(np.float16)
              for name in ("cross_k", "cross_v")}
    memory["cross_mask"] = np.zeros(first.state_description["cross_mask"][0], np.float16)
    for _ in range(args.repeats):
        for v in variants.values():  # alternated: the box's load changes alike for both
            decoder = v["decoder"]
            t = time.perf_counter()
            state = decoder.new_state(memory)
            v["binds"].append(time.perf_counter() - t)
            before = decoder.state_bytes_written
            for pos in range(args.steps):
                t = time.perf_counter()
                decoder.step(state, 5, pos)
                v["steps"].append(time.perf_counter() - t)
            v["written"].append((decoder.state_bytes_written - before) / args.steps)
    for v in variants.values():  # one more window by the whole-buffer state API (coremltools' MLState)
        v["whole_buffer"] = whole_buffer_bytes(v["decoder"], memory, args.steps)
    report = {"model": args.model, "precision": args.precision, "variants": {}}
    for state_writes, v in variants.items():
        result, steps = v["result"], v["steps"]
        s = result["shapes"]
        report["variants"][state_writes] = {
            "shapes": s,
            "gate": {k: result["parity"][k] for k in ("worst_psnr_db", "mean_kl", "passed")} if result["parity"] else None,
            "step_bytes_bound_per_call": io_bytes(package_io(result["path"], STEP_FUNCTION)),
            "host_bytes_written_per_step_measured": float(np.mean(v["written"])),
            "whole_buffer_bytes_per_step_measured": v["whole_buffer"],
            "host_bytes": host_bytes(s, state_writes),
            "host_bytes_full_size": host_bytes(FULL_SIZE, state_writes),
            "state_write_ops": state_write_ops(result["path"]),
            "step_ms_median": 1000 * float(np.median(steps)), "step_ms_min": 1000 * float(np.min(steps)),
            "window_start_ms_median": 1000 * float(np.median(v["binds"])), "step_calls": len(steps),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for state_writes, r in report["variants"].items():
        s, hb, full = r["shapes"], r["host_bytes"], r["host_bytes_full_size"]
        print(f"[{state_writes}] decoder L={s['num_layers']} Hkv={s['num_kv_heads']} Dh={s['head_dim']} "
              f"C={s['capacity']} Tp={s['memory_len']} ({args.precision}), gate {r['gate']}")
        print(f"  state writes in the programs: {r['state_write_ops']}")
        print(f"  step: {r['step_bytes_bound_per_call']} B bound per call; host writes {hb['step_written']} B per step "
              f"(measured {r['host_bytes_written_per_step_measured']:.0f}), {hb['window_written']} B once per window; "
              f"{r['step_ms_median']:.3f} ms median ({r['step_ms_min']:.3f} min) over {r['step_calls']} calls; "
              f"window start {r['window_start_ms_median']:.3f} ms")
        wb = r["whole_buffer_bytes_per_step_measured"]
        print(f"  per step by path, measured: in place {r['host_bytes_written_per_step_measured']:.0f} B written "
              f"(the interpreter; Swift writes the same rows through MLState.withMultiArray(for:)); whole-buffer "
              f"MLState API (Python on Core ML) {wb['read']:.0f} B read + {wb['written']:.0f} B written "
              f"(arithmetic {hb['step_read_whole_buffers']} + {hb['step_written_whole_buffers']})")
        print(f"  full size: host writes {full['step_written']} B per step in place (whole-buffer MLState API: "
              f"{full['step_read_whole_buffers']} B read + {full['step_written_whole_buffers']} B written), "
              f"{full['window_written']} B once per window, cache_mask {full['step_mask_input']} B per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
