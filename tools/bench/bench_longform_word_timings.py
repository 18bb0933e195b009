"""Word timings of long audio: offline windows and a stream's finals, against the synthesizer's word times.

Joins the clips of a word-timing set (tools/data/make_word_timing_set.py; per language, in manifest order, until
--seconds) into one long clip, the truth's word starts moved by each clip's offset, then times its words two ways
with a bundle (`Transcriber`, interpreter by default):

    offline   `transcribe(..., word_timestamps=True)`: the long-form windows (the bundle's window length)
    stream    `streaming.stream_array(..., word_timestamps=True)`: the finals' words (speech segments)

and prints per language and way: words timed / words with a truth, median and 90th percentile |start error|
(words matched to the truth by text, as `bench` does): whether long audio gets the single clips' error figures
(BENCHMARKS.md "Word timings"). That word times are in order and inside their windows / segments is tested in
tests/inference/test_words.py and test_streaming.py.

Usage: uv run --frozen python tools/bench/bench_longform_word_timings.py --bundle out/demo/cohere-tiny-synth-fp16 \\
           --data out/word-timing/multi [--seconds 75] [--languages en,de,es]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from cohere_coreml.export.alignment_heads import match_words
from cohere_coreml.inference.streaming import stream_array
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.model.audio import load_audio

logger = logging.getLogger("bench_longform_word_timings")


def long_clip(folder: Path, language: str, seconds: float, rate: int) -> tuple[np.ndarray, list[dict]]:
    """The set's clips of `language` joined until `seconds`, and their words on the joined timeline."""
    manifest = json.loads((folder / "manifest.json").read_text())
    pieces, truth, offset = [], [], 0.0
    for u in (u for u in manifest["utterances"] if u["language"] == language):
        if offset >= seconds:
            break
        audio = load_audio(folder / u["file"], target_rate=rate)
        pieces.append(audio)
        truth += [{**w, "start": None if w["start"] is None else w["start"] + offset} for w in u["words"]]
        offset += len(audio) / rate
    if not pieces:
        raise SystemExit(f"{folder}: no clip of language {language!r}")
    return np.concatenate(pieces).astype(np.float32), truth


def errors(words: list[dict], truth: list[dict]) -> tuple[np.ndarray, int]:
    """|start error| of every timed word matched to a truth word with a start, and how many such truth words."""
    matched = match_words([w["word"] for w in words], truth)
    errs = [abs(w["start"] - t["start"]) for w, t in zip(words, matched) if t is not None and t["start"] is not None]
    return np.asarray(errs), sum(t["start"] is not None for t in truth)


def row(label: str, errs: np.ndarray, with_truth: int) -> str:
    if not len(errs):
        return f"| {label} | 0 / {with_truth} | - | - |"
    return (f"| {label} | {len(errs)} / {with_truth} | {1000 * np.median(errs):.0f} | "
            f"{1000 * np.percentile(errs, 90):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", required=True, help="a bundle whose decoder has the align function")
    parser.add_argument("--data", required=True, help="a word-timing set (folder with manifest.json)")
    parser.add_argument("--seconds", type=float, default=75.0, help="length of each language's joined clip")
    parser.add_argument("--languages", default="en,de,es")
    parser.add_argument("--backend", default="mil")
    parser.add_argument("--chunk", type=int, default=1600, help="stream chunk in samples")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tr = Transcriber(args.bundle, backend=args.backend)
    if tr.alignment is None:
        raise SystemExit(f"{args.bundle}: no alignment in this bundle (re-export with --alignment-heads auto)")
    rate = int(tr.front_end.sampling_rate)
    print("| clip, way | words timed / with a truth | start median (ms) | p90 (ms) |")
    print("|---|---|---|---|")
    for language in args.languages.split(","):
        audio, truth = long_clip(Path(args.data), language, args.seconds, rate)
        label = f"{language} {len(audio) / rate:.0f} s"
        offline = tr.transcribe(audio, language, word_timestamps=True)
        print(row(f"{label}, offline ({len(offline.windows)} windows)", *errors(offline.words or [], truth)), flush=True)
        updates, _ = stream_array(tr, audio, args.chunk, language, word_timestamps=True)
        finals = [u for u in updates if u.type == "final"]
        words = [w for u in finals for w in (u.words or [])]
        print(row(f"{label}, stream ({len(finals)} finals)", *errors(words, truth)), flush=True)


if __name__ == "__main__":
    main()
