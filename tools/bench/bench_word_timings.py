#!/usr/bin/env python
"""Word-timing error of the cross-attention aligner against synthesizer word times, PyTorch reference only.

On a word-timing set (tools/data/make_word_timing_set.py: held-out espeak-ng speech whose word start times come
from libespeak-ng's word events; kinds single, padded, multi): every clip is greedily decoded by the
`transformers` model (`generate`), run teacher-forced on its prompt + tokens + eos for the cross-attention
(`model.alignment_reference`), and aligned by the rule (`inference.alignment`) on the heads chosen on the
calibration set (`export.alignment_heads.select_heads`, gated against the naive baseline) or given by --heads.

Printed, per kind and language and over all: clips with a correct transcript, words timed / words with a truth
(a hypothesis word matched to a truth word that has a start), median and 90th percentile |start error|, the same
for ends (the truth's ends are estimates: the next word event, or the last voiced sample), and the naive
baseline (words spread by characters from the first word's start to the last word's end); then per head
(each head alone) over every clip, so a figure the model's attention limits shows where it comes from.
Targets: median |start error| <= 80 ms, p90 <= 300 ms; on the multi clips the aligner's median <= half the
baseline's.

Example:
  uv run --frozen python tools/data/make_word_timing_set.py --out out/word-timing-heldout ...
  uv run --frozen python tools/bench/bench_word_timings.py --data out/word-timing-heldout --per-kind 20
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cohere_coreml.export.alignment_heads import (
    CALIBRATION_SET,
    AlignmentRecord,
    calibration_records,
    match_words,
    read_word_timing_set,
    select_heads,
    truth_span,
)
from cohere_coreml.inference.alignment import (
    AlignmentError,
    check_heads,
    format_heads,
    group_text,
    parse_heads,
    word_groups,
)
from cohere_coreml.model.alignment_reference import encode, frame_seconds, teacher_forced_attention
from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel
from cohere_coreml.model.checkpoint import load_reference
from cohere_coreml.model.tokens import eos_id, prompt_ids

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = CALIBRATION_SET
KINDS = ("single", "padded", "multi")
logger = logging.getLogger("bench_word_timings")


def _heads(text: str, layers: int, heads_per_layer: int) -> list[tuple[int, int]]:
    """--heads: the toolkit's head list, inside the model; a bad one exits with its one-line reason."""
    try:
        return check_heads(parse_heads(text), layers, heads_per_layer)
    except AlignmentError as err:
        raise SystemExit(f"--heads: {str(err).removeprefix('--alignment-heads: ')}") from None


def read_sets(path: str | Path, languages: list[str], limit: int) -> list[tuple[Path, dict]]:
    """(folder, utterance) of a word-timing set: one folder with manifest.json, or a folder holding one per kind
    (single/, padded/, multi/, as tools/data/make_word_timing_set.py writes them)."""
    path = Path(path)
    folders = [path] if (path / "manifest.json").is_file() else [path / k for k in KINDS if (path / k).is_dir()]
    if not folders:
        raise SystemExit(f"{path}: no manifest.json and none of {', '.join(KINDS)}/ in it: not a word-timing set")
    out = []
    for folder in folders:
        folder, utterances = read_word_timing_set(folder, languages, KINDS, limit=limit)
        out += [(folder, u) for u in utterances]
    return out


def calibration_folders(path: str | Path) -> list[Path]:
    path = Path(path)
    return [path] if (path / "manifest.json").is_file() else [path / k for k in KINDS if (path / k).is_dir()]


@torch.no_grad()
def decode_records(model, processor, clips: list[tuple[Path, dict]], max_new_tokens: int) -> list[AlignmentRecord]:
    """Greedy transcripts of the clips and their teacher-forced attention, matched to the truth words."""
    front_end = FrontEndConfig.from_processor(processor, dither=0.0)
    tokenizer = processor.tokenizer
    eos = eos_id(tokenizer)
    frame = frame_seconds(model, processor)
    records = []
    for folder, u in clips:
        audio = load_audio(folder / u["file"], target_rate=front_end.sampling_rate)
        features, n_valid = log_mel(audio, front_end)
        encoded, mask = encode(model, features[:, :n_valid])
        prompt = prompt_ids(tokenizer, u["language"])
        out = model.generate(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=torch.tensor([prompt]),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
        ids = [int(t) for t in out[0, len(prompt):]]
        ids = ids[: ids.index(eos)] if eos in ids else ids
        tf = teacher_forced_attention(model, encoded, prompt, ids, eos)
        pieces = tokenizer.convert_ids_to_tokens(ids)
        words = [group_text(pieces, g) for g in word_groups(pieces, u["language"])]
        hypothesis = tokenizer.decode(ids, skip_special_tokens=True).strip()
        records.append(AlignmentRecord(
            attention=tf.attention, prompt_length=tf.prompt_length, pieces=pieces,
            probabilities=tf.token_probabilities[:-1], language=u["language"], truth=match_words(words, u["words"]),
            span=truth_span(u["words"], len(audio) / front_end.sampling_rate), frame_seconds=frame,
            meta={"file": u["file"], "kind": u.get("kind"), "correct": normal(hypothesis) == normal(u["text"]),
                  "sentences": list(u.get("sentences") or [u["text"]]),
                  "truth_words": sum(1 for w in u["words"] if w.get("start") is not None)}))
    return records


def normal(text: str) -> str:
    return " ".join("".join(ch for ch in w.lower() if ch.isalnum()) for w in text.split())


def ms(values: np.ndarray, q: float) -> str:
    return f"{1000 * np.percentile(values, q):.0f}" if len(values) else "-"


def figures(records: list[AlignmentRecord], heads, lead_rows: int, **options) -> dict:
    starts = np.concatenate([r.start_errors(heads, lead_rows, **options) for r in records] or [np.zeros(0)])
    ends = np.concatenate([r.start_errors(heads, lead_rows, key="end") for r in records] or [np.zeros(0)])
    base = np.concatenate([r.baseline_errors() for r in records] or [np.zeros(0)])
    timed = sum(r.words_with_truth for r in records)
    return {"clips": len(records), "correct": sum(r.meta.get("correct", True) for r in records),
            "timed": timed, "with_truth": sum(r.meta.get("truth_words", r.words_with_truth) for r in records),
            "start_median_ms": ms(starts, 50), "start_p90_ms": ms(starts, 90),
            "end_median_ms": ms(ends, 50), "end_p90_ms": ms(ends, 90), "end_words": len(ends),
            "baseline_median_ms": ms(base, 50), "baseline_p90_ms": ms(base, 90)}


def print_variants(records: list[AlignmentRecord], heads, lead_rows: int, what: str) -> None:
    """The rule's defaults against its options and alternatives, on the same clips and heads (why the defaults)."""
    frame = records[0].frame_seconds
    variants = [("the rule", {}), ("1 row before the text", {"lead": 1}),
                ("a row per input token (not per predicted token)", {"row_shift": 1}),
                ("frame's left edge (not its centre)", {"time_shift": -frame / 2}),
                ("per-frame standardisation", {"standardise": True}), ("median filter, 3 frames", {"median_width": 3}),
                ("median filter, 7 frames", {"median_width": 7}), ("no pause clipping", {"pause_factor": 0.0})]
    multi = [r for r in records if len(r.meta.get("sentences") or ()) > 1]
    print(f"\n| variant ({what}, heads {format_heads(heads)}) | start median / p90 ms | multi-sentence clips |")
    print("|---|---|---|")
    for name, options in variants:
        options = dict(options)
        lead = options.pop("lead", lead_rows)
        f = figures(records, heads, lead, **options)
        fm = figures(multi, heads, lead, **options) if multi else None
        tail = f"{fm['start_median_ms']} / {fm['start_p90_ms']}" if fm else "-"
        print(f"| {name} | {f['start_median_ms']} / {f['start_p90_ms']} | {tail} |")


def print_table(rows: list[tuple[str, str, dict]]) -> None:
    print("| kind | language | clips (correct) | words timed / with truth | start median / p90 ms "
          "| end median / p90 ms | naive baseline start median / p90 ms |")
    print("|---|---|---|---|---|---|---|")
    for kind, language, f in rows:
        print(f"| {kind} | {language} | {f['clips']} ({f['correct']}) | {f['timed']} / {f['with_truth']} "
              f"| {f['start_median_ms']} / {f['start_p90_ms']} | {f['end_median_ms']} / {f['end_p90_ms']} "
              f"| {f['baseline_median_ms']} / {f['baseline_p90_ms']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "cohere-tiny-synth"))
    parser.add_argument("--data", required=True, help="a word-timing set (folder with manifest.json)")
    parser.add_argument("--calibration", default=str(CALIBRATION), help="word-timing set the heads are chosen on")
    parser.add_argument("--heads", help="layer.head,... instead of choosing (e.g. 1.0,1.2)")
    parser.add_argument("--lead-rows", type=int, default=1, help="rows before the text, with --heads")
    parser.add_argument("--languages", default="en,de,es")
    parser.add_argument("--per-kind", type=int, default=20, help="clips per kind and language")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--variants", action="store_true", help="also the rule's options and alternatives")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    languages = [x for x in args.languages.split(",") if x]
    t0 = time.perf_counter()
    model, processor = load_reference(args.model)
    layers, heads_per_layer = model.config.num_hidden_layers, model.config.num_attention_heads

    if args.heads:
        heads, lead_rows = _heads(args.heads, layers, heads_per_layer), args.lead_rows
        choice_text = f"given: heads {format_heads(heads)}, {lead_rows} lead row(s)"
    else:
        evaluated = {s for _, u in read_sets(args.data, languages, args.per_kind)
                     for s in u.get("sentences") or [u["text"]]}
        calibration = [r for folder in calibration_folders(args.calibration)
                       for r in calibration_records(model, processor, folder, languages)
                       if not evaluated.intersection(r.meta["sentences"])]  # no evaluated sentence calibrates
        choice, reason = select_heads(calibration)
        print(f"calibration ({len(calibration)} clips the model transcribes, {args.calibration}): {reason}")
        if choice is None:
            print("no head set passed the gate: nothing to time")
            return 1
        heads, lead_rows = choice.heads, choice.lead_rows
        choice_text = f"chosen: heads {format_heads(heads)}, {lead_rows} lead row(s)"
    print(choice_text)

    clips = read_sets(args.data, languages, args.per_kind)
    if not clips:
        print(f"{args.data}: no clip of kinds {KINDS} in {languages}", file=sys.stderr)
        return 2
    records = decode_records(model, processor, clips, args.max_new_tokens)
    rows = []
    for kind in KINDS:
        for language in languages:
            subset = [r for r in records if r.meta["kind"] == kind and r.language == language]
            if subset:
                rows.append((kind, language, figures(subset, heads, lead_rows)))
        subset = [r for r in records if r.meta["kind"] == kind]
        if subset:
            rows.append((kind, "all", figures(subset, heads, lead_rows)))
    rows.append(("all", "all", figures(records, heads, lead_rows)))
    print()
    print_table(rows)

    print()
    print("| head(s) | start median / p90 ms, all clips | multi clips |")
    print("|---|---|---|")
    multi = [r for r in records if r.meta["kind"] == "multi"]
    per_head = {}
    every = [(la, h) for la in range(layers) for h in range(heads_per_layer)]
    candidates = [[h] for h in every] + [every, heads]
    for hs in candidates:
        f_all, f_multi = figures(records, hs, lead_rows), figures(multi, hs, lead_rows) if multi else None
        label = "all heads (mean)" if hs is every else format_heads(hs) + (" (chosen)" if hs is heads else "")
        per_head[label] = {"all": f_all, "multi": f_multi}
        multi_text = f"{f_multi['start_median_ms']} / {f_multi['start_p90_ms']}" if f_multi else "-"
        print(f"| {label} | {f_all['start_median_ms']} / {f_all['start_p90_ms']} | {multi_text} |")
    if args.variants:
        print_variants(records, heads, lead_rows, "measured clips")
        if not args.heads:
            print_variants(calibration, heads, lead_rows, "calibration clips")
    print(f"\n{len(records)} clips in {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"choice": choice_text, "rows": [
            {"kind": k, "language": la, **f} for k, la, f in rows], "per_head": per_head}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
