#!/usr/bin/env python
"""Interpreter wall time of one streaming hop's work, composed from measured calls (issue 20).

Times, through the runtime, the calls a hop makes on an already exported bundle (nothing is exported
here): the encoder (every function of the bundle, once warm), bind_memory, the decoder step, and
prefill / extend when the bundle has them. Then composes, for the schedule a `tools/bench/bench_streaming.py`
report measured (its updates), the wall time per partial, per final and per audio second:

    encoder: each call's bucket (the report's encoder frames; a bundle without that bucket: the
             measured functions' seconds per frame, scaled linearly to the bucket's frames: an estimate)
    decoder: bind + the calls of `feed_plan` for the forced prefix + one step per generated token but
             the last (from the updates: prompt + confirmed tokens forced, generated = hypothesis - confirmed)

A prefill or extend call the bundle lacks is estimated as the measured step time x the ratio of that
call to a step measured on --ratio-bundle (a small bundle that has them), and marked as an estimate.

    uv run --frozen python tools/bench/bench_hop_walltime.py --bundle out/fullsize/f16 \\
        --report out/stream-bench/report.json --ratio-bundle out/stream-bundle --out out/hop-walltime.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from cohere_coreml.bundle.load import Bundle
from cohere_coreml.config import EXTEND_FUNCTION, EXTEND_LENGTH, PREFILL_FUNCTION, STEP_FUNCTION
from cohere_coreml.inference.decoder_runtime import DecoderRuntime, feed_plan
from cohere_coreml.model.shapes import LengthMasks
from cohere_coreml.runtime import load_model

logger = logging.getLogger("bench_hop_walltime")


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn() (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(bundle_dir: str, repeats: int, steps: int, threads: int | None) -> dict:
    bundle = Bundle.load(bundle_dir)
    m = bundle.manifest
    functions = m["encoder"].get("functions") or {"main": {"frames": m["encoder"]["window_frames"]}}
    n_mels = int(m["encoder"]["num_mel_bins"])
    masks = LengthMasks.from_manifest(m["encoder"]["length_masks"])
    rng = np.random.default_rng(0)
    out = {"bundle": bundle_dir, "encoder_s": {}, "encoder_frames": {}}
    memory = None
    for fn, spec in sorted(functions.items(), key=lambda kv: int(kv[1]["frames"])):
        frames = int(spec["frames"])
        model = load_model(str(bundle.paths["encoder"]), backend="mil", function_name=fn, num_threads=threads)
        feats = rng.normal(0, 1, (1, n_mels, frames)).astype(np.float32)
        inputs = {"input_features": feats, **masks.inputs(frames, frames)}
        out["encoder_s"][fn] = timed(lambda model=model, inputs=inputs: model.predict(inputs), repeats)
        out["encoder_frames"][fn] = frames
        logger.info("encoder %s (%d frames): %.3f s", fn, frames, out["encoder_s"][fn])
        if fn == "main":
            memory = model.predict(inputs)
        del model
    decoder = DecoderRuntime.load(bundle.paths["decoder"], backend="mil", num_threads=threads)
    state = decoder.make_state()
    out["bind_s"] = timed(lambda: decoder.bind(state, memory), repeats)
    prompt = bundle.prompt("en")
    step_times = []
    for i, token in enumerate(prompt + [prompt[-1]] * steps):
        t0 = time.perf_counter()
        decoder.step(state, token, i)
        step_times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(step_times[1:])
    if decoder.prefill_model is not None:
        out["prefill_s"] = timed(lambda: decoder.prefill(state, prompt), repeats)
    if decoder.extend_model is not None:
        out["extend_s"] = timed(lambda: decoder.extend(state, prompt * 3, 0), repeats)
    out["capacity"], out["prefill_length"], out["extend_length"] = (decoder.capacity, decoder.prefill_length,
                                                                   decoder.extend_length)
    logger.info("decoder: bind %.3f s, step %.3f s, prefill %s, extend %s", out["bind_s"], out["step_s"],
                out.get("prefill_s"), out.get("extend_s"))
    return out


EOS = -1  # stands for the eos id in a replayed decode (the updates carry no eos)


def replay_decode(prompt_len: int, draft: list[int], emitted: list[int], capacity: int, prefill_length: int | None,
                  extend_length: int | None) -> dict[str, int]:
    """Decoder calls per function of `Transcriber.decode(prompt, draft=draft)` that emitted `emitted` then
    eos: the same plan and draft rule, replayed on the token ids (decisions are the updates' tokens)."""
    calls = {PREFILL_FUNCTION: 0, EXTEND_FUNCTION: 0, STEP_FUNCTION: 0}
    limit = capacity - prompt_len + 1
    draft = draft[: max(0, limit - 1)] if extend_length else []
    for c in feed_plan(prompt_len + len(draft), 0, capacity, prefill_length, extend_length):
        calls[c.function] += 1
    position, redrafted = prompt_len, False
    for n, token in enumerate(emitted + [EOS], start=1):
        if token == EOS or n >= limit:
            break
        if draft and token == draft[0]:
            draft, redrafted, position = draft[1:], False, position + 1
            continue
        rest = draft[1:][: min(extend_length - 1, limit - n - 1)] if draft and not redrafted else []
        if rest and position + extend_length <= capacity:
            for c in feed_plan(1 + len(rest), position, capacity, prefill_length, extend_length):
                calls[c.function] += 1
            draft, redrafted, position = rest, True, position + 1
            continue
        draft = []
        calls[STEP_FUNCTION] += 1
        position += 1
    return calls


def schedule(report: dict, prompt_len: int, capacity: int, prefill_length: int | None,
             extend_length: int | None) -> dict:
    """Per-function decoder calls and encoder frames of every partial / final in the report's runs (the
    decodes replayed from the updates; checked against the counted decoder calls)."""
    totals = {"audio_s": 0.0, "partials": 0, "finals": 0, "encoder_frames": 0,
              "calls": {PREFILL_FUNCTION: 0, EXTEND_FUNCTION: 0, STEP_FUNCTION: 0}}
    per_update = []
    for run in report["runs"]:
        totals["audio_s"] += run["seconds"]
        confirmed: dict[int, list[int]] = {}
        last: dict[int, list[int]] = {}
        for u in run["updates"]:
            if u["type"] == "partial":
                c = confirmed.get(u["segment"], [])
                draft = last[u["segment"]][len(c):] if u["segment"] in last else []
                calls = replay_decode(prompt_len + len(c), draft, u["token_ids"][len(c):], capacity,
                                      prefill_length, extend_length)
                confirmed[u["segment"]], last[u["segment"]] = u["confirmed_token_ids"], u["token_ids"]
            else:
                calls = replay_decode(prompt_len, [], u["token_ids"], capacity, prefill_length, extend_length)
            per_update.append({"type": u["type"], "segment_s": u["end"] - u["start"], "calls": calls})
            for k, v in calls.items():
                totals["calls"][k] += v
            totals["partials" if u["type"] == "partial" else "finals"] += 1
        totals["encoder_frames"] += run["stats"]["encoder_frames"]
    totals["decoder_calls_counted"] = sum(run["stats"]["decoder_calls"] for run in report["runs"])
    totals["decoder_calls_replayed"] = sum(totals["calls"].values())
    return {"totals": totals, "updates": per_update}


def compose(measured: dict, sched: dict, ratios: dict) -> dict:
    """Wall seconds per audio second and per update, from the measured call times."""
    enc = measured["encoder_s"]
    per_frame = max(enc[fn] / measured["encoder_frames"][fn] for fn in enc)  # the worst measured s/frame
    call_s = {STEP_FUNCTION: measured["step_s"]}
    estimated = {}
    for fn in (PREFILL_FUNCTION, EXTEND_FUNCTION):
        key = f"{fn}_s"
        if key in measured:
            call_s[fn] = measured[key]
        else:
            call_s[fn] = measured["step_s"] * ratios[fn]
            estimated[fn] = f"step x {ratios[fn]:.2f} (the {fn} / step ratio of the ratio bundle)"
    t = sched["totals"]
    encoder_calls = t["partials"] + t["finals"]
    decoder_wall = sum(t["calls"][fn] * call_s[fn] for fn in call_s) + encoder_calls * measured["bind_s"]
    # each encoder call runs the smallest bucket holding its segment (shapes.choose_bucket's rule): its
    # measured time when the bundle has that bucket, else the worst measured seconds per frame x frames
    buckets = sorted(measured["encoder_frames"].values())
    by_frames = {measured["encoder_frames"][fn]: enc[fn] for fn in enc}
    encoder_wall, bucket_frames, scaled = 0.0, 0, 0
    for u in sched["updates"]:
        need = math.ceil(round(u["segment_s"] * 100, 6))  # 10 ms mel frames of the segment
        frames = next((b for b in buckets if b >= need), buckets[-1])
        bucket_frames += frames
        encoder_wall += by_frames.get(frames, frames * per_frame)
        scaled += frames not in by_frames
    if bucket_frames != t["encoder_frames"]:  # the rule above is not the schedule's: fall back to frames
        logger.warning("buckets from segment lengths give %d frames, the schedule ran %d: encoder scaled by frames",
                       bucket_frames, t["encoder_frames"])
        encoder_wall, scaled = t["encoder_frames"] * per_frame, len(sched["updates"])
    audio = t["audio_s"]
    updates = sched["updates"]

    def update_wall(u):
        return sum(u["calls"][fn] * call_s[fn] for fn in call_s) + measured["bind_s"]

    partial_dec = [update_wall(u) for u in updates if u["type"] == "partial"]
    final_dec = [update_wall(u) for u in updates if u["type"] == "final"]
    return {"encoder_s_per_frame": per_frame, "encoder_s_per_audio_s_of_window": per_frame * 100,
            "encoder_calls_scaled_by_frames": scaled,
            "call_s": call_s, "estimated": estimated,
            "wall_s_per_audio_s": {"encoder": encoder_wall / audio, "decoder": decoder_wall / audio,
                                   "total": (encoder_wall + decoder_wall) / audio},
            "decoder_s_per_partial": {"median": statistics.median(partial_dec), "max": max(partial_dec)},
            "decoder_s_per_final": {"median": statistics.median(final_dec), "max": max(final_dec)},
            "calls_per_audio_s": {fn: n / audio for fn, n in t["calls"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="the bundle whose calls are timed (e.g. the full-size one)")
    parser.add_argument("--report", required=True, help="a tools/bench/bench_streaming.py report.json (its updates)")
    parser.add_argument("--ratio-bundle", help="a bundle with prefill and extend: their time / a step's, "
                        "for a --bundle that lacks them")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="interpreter threads")
    parser.add_argument("--out", default="out/hop-walltime.json")
    parser.add_argument("--measured", default=None,
                        help="an earlier --out JSON: compose from its measured call times (nothing is timed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = json.loads(Path(args.report).read_text())
    earlier = json.loads(Path(args.measured).read_text()) if args.measured else {}
    result = {"measured": earlier.get("measured") or measure(args.bundle, args.repeats, args.steps, args.threads)}
    ratios = {PREFILL_FUNCTION: float("nan"), EXTEND_FUNCTION: float("nan")}
    if args.ratio_bundle:
        small = earlier.get("ratio_bundle") or measure(args.ratio_bundle, args.repeats, args.steps, args.threads)
        result["ratio_bundle"] = small
        ratios = {fn: small[f"{fn}_s"] / small["step_s"] for fn in (PREFILL_FUNCTION, EXTEND_FUNCTION)
                  if f"{fn}_s" in small}
    # the schedule as the report's bundle decoded it (its prefill length, K, capacity)
    cfg = report.get("decoder_plan", {"prompt_length": 10, "capacity": 288, "prefill_length": 10,
                                      "extend_length": EXTEND_LENGTH if report.get("extend") else None})
    sched = schedule(report, cfg["prompt_length"], cfg["capacity"], cfg["prefill_length"], cfg["extend_length"])
    result["schedule"] = sched["totals"]
    result["composed"] = compose(result["measured"], sched, ratios)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"schedule": sched["totals"], "composed": result["composed"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
