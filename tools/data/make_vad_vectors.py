#!/usr/bin/env python
"""Write tests/data/vad_vectors.json: the speech-region, window and stream rule's cases (docs/vad.md) with the
answers of the oracles, which Python, Swift and example_inference.py must reproduce exactly (integers):

- regions: silero-vad's own `get_speech_timestamps_from_probs` (model.silero.reference_regions);
- stream: silero-vad's own `VADIterator` fed the probabilities by a stand-in model
  (model.silero.reference_stream_events);
- windows: `inference.speech_regions.pack_windows` (the package has no such step; tests check it by its
  definition as well).

Probabilities are float32 values (as the VAD gives them), so a port may hold them as float32 or double;
thresholds are doubles. Cases: seeded random probabilities, the probabilities of a committed clip (the PyTorch
VAD on the first 40 s of tests/data/audio/en_long_75s.flac), speech longer than max_speech (cut at the longest
silence, or with no silence at the limit), all speech, no speech, speech at the very start and end,
probabilities exactly at the threshold and the negative threshold, the negative threshold's floor, gaps just
below, at and above max_gap, a region exactly the window's length.

    uv run --frozen python tools/data/make_vad_vectors.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cohere_coreml.inference.speech_regions import VadOptions, pack_windows
from cohere_coreml.inference.vad import TorchVad
from cohere_coreml.model import silero
from cohere_coreml.model.audio import load_audio

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "vad_vectors.json"
CLIP = ROOT / "tests" / "data" / "audio" / "en_long_75s.flac"
CLIP_SECONDS = 40
WINDOW_S = 35.0
CHUNK = silero.CHUNK_SAMPLES


def f32(values) -> list[float]:
    """Float32 values as JSON doubles (exact: every float32 is a double)."""
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def runs(*pairs) -> list[float]:
    """Probabilities from (value, count) runs."""
    return [v for value, count in pairs for v in [value] * count]


def region_case(name, probs, n_samples=None, window_s=WINDOW_S, **options) -> dict:
    """`window_s`: the caller's max_speech_s (the bundle's window); `options` may set their own max_speech_s."""
    probs = f32(probs)
    n_samples = len(probs) * CHUNK if n_samples is None else n_samples
    opts = VadOptions(**options)
    limit = opts.max_speech_s if opts.max_speech_s is not None else window_s
    expected = silero.reference_regions(
        probs, n_samples, threshold=opts.threshold, neg_threshold=opts.neg_threshold,
        min_speech_ms=opts.min_speech_ms, min_silence_ms=opts.min_silence_ms, speech_pad_ms=opts.speech_pad_ms,
        max_speech_s=limit)
    return {"name": name, "probs": probs, "n_samples": n_samples, "options": opts.to_dict(),
            "max_speech_s": window_s, "expected": [list(r) for r in expected]}


def window_case(name, regions, n_samples, window_samples, max_gap_samples) -> dict:
    expected = pack_windows(regions, n_samples, window_samples, max_gap_samples)
    return {"name": name, "regions": [list(r) for r in regions], "n_samples": n_samples,
            "window_samples": window_samples, "max_gap_samples": max_gap_samples,
            "expected": [list(w) for w in expected]}


def stream_case(name, probs, **options) -> dict:
    probs = f32(probs)
    opts = VadOptions(**options)
    expected = silero.reference_stream_events(probs, threshold=opts.threshold, min_silence_ms=opts.min_silence_ms,
                                              speech_pad_ms=opts.speech_pad_ms)
    return {"name": name, "probs": probs, "options": opts.to_dict(), "expected": [list(e) for e in expected]}


def clip_probabilities() -> np.ndarray:
    wav = load_audio(CLIP)[: CLIP_SECONDS * silero.SAMPLE_RATE]
    return TorchVad().probabilities(wav)


def random_runs(rng, n) -> np.ndarray:
    """Stretches of speech-like and silence-like probabilities with jitter (regions, gaps, flicker)."""
    levels = rng.random(n // 6 + 1)
    return np.clip(np.repeat(levels, 6)[:n] + rng.normal(0, 0.12, n), 0, 1)


def build() -> dict:
    rng = np.random.default_rng(58)
    real = clip_probabilities()
    n_real = CLIP_SECONDS * silero.SAMPLE_RATE
    s = 31.25  # chunks per second
    regions = [
        region_case("random uniform", rng.random(300), n_samples=300 * CHUNK - 100),
        region_case("random runs", random_runs(rng, 400)),
        region_case("random runs, other options", random_runs(rng, 400), threshold=0.4, min_speech_ms=100,
                    min_silence_ms=300, speech_pad_ms=100),
        region_case("random runs, short max_speech", random_runs(rng, 500), window_s=2.0),
        region_case("clip: en_long_75s, first 40 s", real, n_samples=n_real),
        region_case("clip: en_long_75s, first 40 s, max_speech 4 s", real, n_samples=n_real, window_s=4.0),
        region_case("clip: en_long_75s, first 40 s, threshold 0.8, pad 200 ms", real, n_samples=n_real,
                    threshold=0.8, speech_pad_ms=200),
        region_case("no speech", [0.1] * 200),
        region_case("empty", [], n_samples=0),
        region_case("all speech", [0.9] * 200, n_samples=200 * CHUNK - 37),
        region_case("all speech longer than max_speech, no silence", [0.9] * 200, window_s=2.0),
        region_case("speech longer than max_speech, cut at the longest silence",
                    runs((0.9, 20), (0.1, 4), (0.9, 15), (0.1, 7), (0.9, 20), (0.1, 5), (0.9, 40), (0.1, 30)),
                    window_s=3.0),
        region_case("max_speech_s set in the options, shorter than the window",
                    runs((0.9, 30), (0.1, 6), (0.9, 30), (0.1, 6), (0.9, 30), (0.1, 10)), max_speech_s=2.5),
        region_case("speech at the very start", runs((0.95, 20), (0.05, 60))),
        region_case("speech at the very end", runs((0.05, 60), (0.95, 20)), n_samples=80 * CHUNK - 300),
        region_case("short speech dropped (min_speech)", runs((0.05, 10), (0.9, 7), (0.05, 20), (0.9, 9), (0.05, 20))),
        region_case("probabilities exactly at the threshold", runs((0.2, 10), (0.5, 12), (0.2, 10), (0.49, 12),
                                                                   (0.2, 10))),
        region_case("probabilities exactly at the negative threshold (threshold 0.65: 0.5)",
                    runs((0.1, 5), (0.9, 12), (0.5, 10), (0.9, 12), (0.4999, 10), (0.9, 12), (0.1, 10)),
                    threshold=0.65),
        region_case("explicit negative threshold", runs((0.1, 5), (0.9, 12), (0.25, 10), (0.9, 12), (0.2, 10),
                                                        (0.1, 10)), neg_threshold=0.25),
        region_case("negative threshold floor (threshold 0.1: 0.01)",
                    runs((0.001, 5), (0.3, 12), (0.0101, 10), (0.3, 12), (0.009, 10), (0.3, 12), (0.001, 10)),
                    threshold=0.1),
        # min_silence 64 ms = 1024 samples = 2 chunks after the first silent one: 2 silent chunks keep the region,
        # 3 end it
        region_case("silence just below and exactly min_silence",
                    runs((0.05, 5), (0.9, 12), (0.05, 2), (0.9, 12), (0.05, 3), (0.9, 12), (0.05, 10)),
                    min_silence_ms=64),
        region_case("pads overlap: gap under twice the pad", runs((0.05, 5), (0.9, 12), (0.05, 4), (0.9, 12),
                                                                  (0.05, 10)), speech_pad_ms=80),
        region_case("no pad, no minimum durations", runs((0.05, 3), (0.9, 1), (0.05, 1), (0.9, 2), (0.05, 3)),
                    speech_pad_ms=0, min_speech_ms=0, min_silence_ms=0),
        region_case("one minute of runs at 35 s max_speech", random_runs(rng, int(60 * s))),
    ]
    w = int(WINDOW_S * silero.SAMPLE_RATE)
    gap = 32000
    windows = [
        window_case("empty", [], 0, w, gap),
        window_case("one region", [(1000, 9000)], 20000, w, gap),
        window_case("gap just below max_gap", [(0, 16000), (16000 + gap - 1, 60000)], 100000, w, gap),
        window_case("gap exactly max_gap", [(0, 16000), (16000 + gap, 60000)], 100000, w, gap),
        window_case("gap just above max_gap", [(0, 16000), (16000 + gap + 1, 60000)], 100000, w, gap),
        window_case("a region exactly the window's length", [(5000, 5000 + w)], 5000 + w + 100, w, gap),
        window_case("window full exactly at the last region's end", [(0, 200000), (210000, w)], w + 10, w, gap),
        window_case("window one sample over: the region starts a new window", [(0, 200000), (210000, w + 1)],
                    w + 10, w, gap),
        window_case("many regions packed in time order",
                    [(480, 40000), (50000, 150000), (160000, 300000), (320000, 500000), (560000, 600000),
                     (640000, 900000), (990000, 1000000)], 1000000, w, gap),
        window_case("zero max_gap: only touching regions join", [(0, 1000), (1000, 2000), (2001, 3000)], 3000, w, 0),
        window_case("short window", [(0, 100), (150, 300), (350, 400), (410, 700)], 700, 300, 60),
    ]
    stream = [
        stream_case("random runs", random_runs(rng, 600)),
        stream_case("random runs, other options", random_runs(rng, 600), threshold=0.4, min_silence_ms=300,
                    speech_pad_ms=100),
        stream_case("clip: en_long_75s, first 40 s", real),
        stream_case("speech at the very start", runs((0.95, 20), (0.05, 20))),
        stream_case("probabilities exactly at the threshold", runs((0.2, 5), (0.5, 10), (0.2, 10), (0.49, 10))),
        stream_case("probabilities exactly at threshold - 0.15 (threshold 0.65: 0.5)",
                    runs((0.1, 3), (0.9, 10), (0.5, 10), (0.9, 5), (0.4999, 10)), threshold=0.65),
        stream_case("threshold - 0.15 has no floor (threshold 0.1)",
                    runs((0.0, 3), (0.3, 10), (0.0, 10), (0.3, 5), (0.0, 10)), threshold=0.1),
        stream_case("silence just below and exactly min_silence",
                    runs((0.05, 3), (0.9, 10), (0.05, 2), (0.9, 10), (0.05, 3), (0.9, 4), (0.05, 6)),
                    min_silence_ms=64),
        stream_case("no pad, no min_silence", runs((0.05, 3), (0.9, 1), (0.05, 1), (0.9, 2), (0.05, 3)),
                    speech_pad_ms=0, min_silence_ms=0),
    ]
    return {"about": "made by tools/data/make_vad_vectors.py; the rule is docs/vad.md; probs are float32 values",
            "defaults": VadOptions().to_dict(), "window_s": WINDOW_S, "regions": regions, "windows": windows,
            "stream": stream}


def dumps(data: dict) -> str:
    """One case a line: small diffs, readable."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list):
            body = ",\n".join("  " + json.dumps(case) for case in value)
            lines.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT), help="output file (default: tests/data/vad_vectors.json)")
    args = parser.parse_args(argv)
    data = build()
    Path(args.out).write_text(dumps(data))
    counts = {k: len(data[k]) for k in ("regions", "windows", "stream")}
    print(f"wrote {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
