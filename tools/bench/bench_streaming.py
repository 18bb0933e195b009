#!/usr/bin/env python
"""Streaming bench (issue 20) on the dictations of tools/data/make_dictations.py, in audio time.

The virtual clock: every dictation is fed in chunks of --chunk seconds as fast as possible and each
update carries the audio time at which it was decided (`Update.audio_time`), i.e. what the updates
would be with infinitely fast compute; no figure here depends on this machine's speed.

Measured:
* segmenter: per frame speech decisions (the default thresholds) on the dictations: the noise excess
  over the floor in pauses, the longest non-speech run inside an utterance, the shortest run between
  two utterances (the hangover must lie between the last two);
* final == offline: every final's token ids against `Transcriber.transcribe` of that segment's samples;
* final == own clip: per utterance, the final against the offline transcript of the held-out clip it was
  made of, and, to tell why they differ, both against the offline transcript of the utterance cut from
  the dictation with its own clip's edges (a final unlike that cut: the segmentation; that cut unlike
  the own clip: the level and background noise the dictation gave it);
* WER of the joined finals vs the references, next to the offline WER of the whole file;
* per utterance: time to first partial after its speech start, lag from its speech end to its final
  (from the synthesis end, and from the acoustic end: its last frame 6 dB above the dictation's
  background), median and p95; flicker (tokens shown in an update and changed or dropped by the next
  update of the segment), and confirmed tokens the final changed; per language;
* compute per audio second (encoder calls, encoder audio-seconds of the buckets run, decoder calls,
  decoder tokens fed: a prefill call P, an extend call K with its padding, a step 1) against the
  offline transcription of the same file (--no-extend: forced prefixes fed by steps, the fallback);
* a sweep (hop, n, hangover, hop growth), one factor at a time, on one dictation per language.

Example:
  uv run --frozen python tools/data/make_dictations.py --out out/dictations
  uv run --frozen python tools/bench/bench_streaming.py --bundle out/stream-bundle --data out/dictations --out out/stream-bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from cohere_coreml.evaluation.datasets import load_folder
from cohere_coreml.evaluation.metrics import error_counts
from cohere_coreml.inference.streaming import (
    SILENCE_DB,
    StreamConfig,
    common_prefix,
    frame_energies_db,
    frames_of,
    stream_array,
)
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.model.audio import load_audio

logger = logging.getLogger("bench_streaming")

HELDOUT_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "heldout"

ACOUSTIC_END_DB = 6.0  # an utterance's acoustic end: its last frame this far above the dictation's background
SWEEP = [  # one factor at a time around the defaults
    {}, {"hop_s": 0.25}, {"hop_s": 1.0}, {"agreement": 1}, {"agreement": 3},
    {"hangover_s": 0.15}, {"hangover_s": 0.45}, {"hop_growth": 0.0},
]


def percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def frame_energies(wav: np.ndarray, frame: int) -> np.ndarray:
    n = wav.size // frame
    return frame_energies_db(wav[: n * frame].reshape(n, frame))


def segmenter_measurement(dictations, config: StreamConfig, frame: int, sr: int) -> dict:
    """Speech decisions as the segmenter takes them (running floor + on_db), against the known times."""
    window = frames_of(config.floor_window_s, frame, sr)
    excess, inside, between = [], [], []
    for d in dictations:
        e = frame_energies(d["wav"], frame)
        floor = np.array([e[max(0, k - window + 1): k + 1].min() for k in range(e.size)])
        speech = (e > floor + config.on_db) & (e > SILENCE_DB)  # the segmenter's rule, in dB
        utts = d["utterances"]
        spans = []
        for u in utts:
            a, b = u["start_sample"] // frame, -(-u["end_sample"] // frame)
            idx = np.nonzero(speech[a:b])[0]
            if idx.size == 0:
                spans.append(None)
                continue
            spans.append((a + idx[0], a + idx[-1]))
            runs = np.diff(idx) - 1
            inside.append(int(runs.max()) if runs.size else 0)
        for i in range(len(utts) - 1):
            b0 = -(-utts[i]["end_sample"] // frame)
            a1 = utts[i + 1]["start_sample"] // frame
            excess.extend((e[b0:a1] - floor[b0:a1]).tolist())
            if spans[i] and spans[i + 1]:
                between.append(int(spans[i + 1][0] - spans[i][1] - 1))
    ms = 1000.0 * frame / sr
    return {"on_db": config.on_db, "floor_window_s": config.floor_window_s,
            "pause_noise_excess_db": {"median": percentile(excess, 50), "p99.9": percentile(excess, 99.9),
                                      "max": float(max(excess))},
            "longest_gap_inside_utterance_ms": {"median": percentile(inside, 50) * ms,
                                                "p95": percentile(inside, 95) * ms, "max": max(inside) * ms},
            "shortest_gap_between_utterances_ms": {"min": min(between) * ms, "p5": percentile(between, 5) * ms,
                                                   "median": percentile(between, 50) * ms}}


def acoustic_ends(d, frame: int) -> list[float]:
    e = frame_energies(d["wav"], frame)
    background = float(np.median(np.concatenate(
        [e[d["utterances"][i]["end_sample"] // frame + 1: d["utterances"][i + 1]["start_sample"] // frame]
         for i in range(len(d["utterances"]) - 1)])))
    out = []
    for u in d["utterances"]:
        a, b = u["start_sample"] // frame, -(-u["end_sample"] // frame)
        idx = np.nonzero(e[a:b] > background + ACOUSTIC_END_DB)[0]
        out.append((a + (idx[-1] if idx.size else b - a - 1) + 1) * frame)
    return out


def utterance_figures(d, updates, sr: int, frame: int) -> list[dict]:
    finals = [u for u in updates if u.type == "final"]
    partials = [u for u in updates if u.type == "partial"]
    ends = acoustic_ends(d, frame)
    rows = []
    for u, acoustic_end in zip(d["utterances"], ends):
        s, e = u["start"], u["end"]
        first = next((p for p in partials if p.audio_time >= s and p.start < e), None)
        covering = [f for f in finals if f.start < e and f.end > s]
        last = covering[-1] if covering else None
        rows.append({"id": u["id"], "first_partial_s": None if first is None else first.audio_time - s,
                     "final_lag_s": None if last is None else last.audio_time - e,
                     "final_lag_acoustic_s": None if last is None else last.audio_time - acoustic_end / sr})
    return rows


def covering_finals(run, u) -> list[dict]:
    """The finals of a run whose [start, end) overlaps utterance `u`'s."""
    return [f for f in run["updates"] if f["type"] == "final" and f["start"] < u["end"] and f["end"] > u["start"]]


def own_clip_verdicts(d, run, own_text: dict[str, str]) -> dict[str, str]:
    """{utterance id: verdict} of the final covering it against the offline transcript of the utterance's
    own clip: "equal" (one final covers it and no other utterance, with that text), "text" (such a final
    with other text), "merged" (its final covers a neighbour too), "split" (several finals cover it) or
    "missing" (none does)."""
    out = {}
    for u in d["utterances"]:
        covering = covering_finals(run, u)
        if not covering:
            out[u["id"]] = "missing"
        elif len(covering) > 1:
            out[u["id"]] = "split"
        elif any(v is not u and covering[0]["start"] < v["end"] and covering[0]["end"] > v["start"]
                 for v in d["utterances"]):
            out[u["id"]] = "merged"
        else:
            out[u["id"]] = "equal" if covering[0]["text"] == own_text[u["id"]] else "text"
    return out


def in_place_clip(d, u) -> np.ndarray | None:
    """Utterance `u`'s samples as they lie in dictation `d` (its level, the dictation's background noise),
    with as much of the dictation before and after its speech as its own clip has edges (`clip_edges`,
    tools/data/make_dictations.py): its own clip but for the audio the dictation changed. None for a manifest
    without the edges (written before they were recorded)."""
    edges = u.get("clip_edges")
    if edges is None:
        return None
    return d["wav"][max(0, u["start_sample"] - edges[0]): min(d["wav"].size, u["end_sample"] + edges[1])]


def own_clip_decomposition(verdicts, own_text: dict[str, str], in_place_text: dict[str, str]) -> dict:
    """Where a final departs from its utterance's own clip: in the segmentation (the final is not the
    offline transcript of the utterance cut in place, `in_place_clip`) or in the audio the dictation
    changed (that cut is not transcribed as the own clip is). `verdicts`: [(dictation, run, own_clip_verdicts)]."""
    counts = Counter()
    for d, run, x in verdicts:
        for u in d["utterances"]:
            finals = covering_finals(run, u)
            final_text = finals[0]["text"] if len(finals) == 1 else None
            in_place = in_place_text[u["id"]]
            counts["utterances"] += 1
            counts["final_equals_in_place"] += x[u["id"]] in ("equal", "text") and final_text == in_place
            counts["in_place_equals_own_clip"] += in_place == own_text[u["id"]]
            counts["final_equals_own_clip"] += x[u["id"]] == "equal"
    return dict(counts)


def final_equals_own_clip(d, run, own_text: dict[str, str]) -> dict[str, bool]:
    """{utterance id: the one final covering it (and no other utterance) has the text of the offline
    transcript of the utterance's own clip}: False when the utterance is split over finals, merged with
    a neighbour into one, or transcribed differently (`own_clip_verdicts` says which)."""
    return {k: v == "equal" for k, v in own_clip_verdicts(d, run, own_text).items()}


def flicker(updates) -> dict:
    """Tokens shown then changed or dropped by the segment's next update; confirmed tokens the final changed."""
    by_segment: dict[int, list] = {}
    for u in updates:
        by_segment.setdefault(u.segment, []).append(u)
    revised = confirmed_revised = shown = 0
    for ups in by_segment.values():
        for a, b in zip(ups, ups[1:]):
            revised += len(a.token_ids) - len(common_prefix([a.token_ids, b.token_ids]))
            shown += len(a.token_ids)
            if b.type == "final":
                confirmed_revised += len(a.confirmed_token_ids) - len(
                    common_prefix([a.confirmed_token_ids, b.token_ids]))
    final_tokens = sum(len(u.token_ids) for u in updates if u.type == "final")
    return {"revised_tokens": revised, "partial_tokens_shown": shown, "confirmed_revised_by_final": confirmed_revised,
            "final_tokens": final_tokens}


def offline_compute(t: Transcriber, result, seconds: float) -> dict:
    frames = dict(t.encoder_buckets)  # {encoder function: frames}
    enc = sum(frames.get(w.timings["encoder_function"], t.window_frames) for w in result.windows)
    return {"encoder_calls": len(result.windows) / seconds, "encoder_audio_s": enc * 0.01 / seconds,
            "decoder_calls": sum(w.timings["decoder_calls"] for w in result.windows) / seconds,
            "decoder_tokens": sum(w.timings["decoder_tokens_fed"] for w in result.windows) / seconds}


def run_dictation(t: Transcriber, d, config: StreamConfig, chunk: int, check_offline: bool) -> dict:
    sr = t.front_end.sampling_rate
    t0 = time.perf_counter()
    updates, stats = stream_array(t, d["wav"], chunk, d["language"], config=config)
    wall = time.perf_counter() - t0
    finals = [u for u in updates if u.type == "final"]
    out = {"file": d["file"], "language": d["language"], "seconds": d["wav"].size / sr, "wall_s": wall,
           "segments": len(finals), "partials": stats.partials, "stats": stats.to_dict(),
           "flicker": flicker(updates), "text": " ".join(f.text for f in finals if f.text)}
    out["wer"] = error_counts([d["text"]], [out["text"]], d["language"])["rate"]
    if d["utterances"]:
        out["utterances"] = utterance_figures(d, updates, sr, t.front_end.hop_length)
    if check_offline:
        mismatches = 0
        for f in finals:
            samples = d["wav"][int(round(f.start * sr)): int(round(f.end * sr))]
            offline = t.transcribe(samples, d["language"])
            ids = [tok for w in offline.windows for tok in w.token_ids if tok not in t.eos_ids]
            mismatches += int(ids != f.token_ids or offline.text != f.text)
        out["final_offline_mismatches"] = mismatches
        full = t.transcribe(d["wav"], d["language"])
        out["offline_text"] = full.text
        out["offline_wer"] = error_counts([d["text"]], [full.text], d["language"])["rate"]
        out["offline_compute"] = offline_compute(t, full, d["wav"].size / sr)
        out["updates"] = [u.to_dict() for u in updates]
    return out


def summarise(runs) -> dict:
    rows = [r for run in runs for r in run.get("utterances", [])]

    def stat(key):
        v = [r[key] for r in rows if r[key] is not None]
        return {"median": percentile(v, 50), "p95": percentile(v, 95), "n": len(v),
                "missing": len(rows) - len(v)}

    flick = {k: sum(run["flicker"][k] for run in runs) for k in runs[0]["flicker"]}
    audio = sum(run["seconds"] for run in runs)
    per_s = {k: sum(run["stats"][src] for run in runs) / audio for k, src in
             (("encoder_calls", "encoder_calls"), ("decoder_calls", "decoder_calls"),
              ("decoder_tokens", "decoder_tokens"))}
    per_s["encoder_audio_s"] = sum(run["stats"]["encoder_frames"] for run in runs) * 0.01 / audio
    # the finals alone are the offline transcription of the segments: the streaming overhead is the rest
    finals_only = {"encoder_calls": sum(run["stats"]["finals"] for run in runs) / audio,
                   "decoder_calls": sum(run["stats"]["final_decoder_calls"] for run in runs) / audio,
                   "decoder_tokens": sum(run["stats"]["final_decoder_tokens"] for run in runs) / audio,
                   "encoder_audio_s": sum(run["stats"]["final_encoder_frames"] for run in runs) * 0.01 / audio}
    out = {"utterances": len(rows), "first_partial_s": stat("first_partial_s"), "final_lag_s": stat("final_lag_s"),
           "final_lag_acoustic_s": stat("final_lag_acoustic_s"), "flicker": flick,
           "flicker_per_final_token": flick["revised_tokens"] / max(flick["final_tokens"], 1),
           "compute_per_audio_s": per_s, "offline_segments_compute_per_audio_s": finals_only,
           "compute_ratio_vs_offline_segments": {k: per_s[k] / finals_only[k] for k in per_s},
           "wer": float(np.mean([run["wer"] for run in runs]))}
    if all("offline_compute" in run for run in runs):
        off = {k: sum(run["offline_compute"][k] * run["seconds"] for run in runs) / audio
               for k in runs[0]["offline_compute"]}
        out["offline_compute_per_audio_s"] = off
        out["compute_ratio_vs_offline"] = {k: per_s[k] / off[k] for k in per_s}
        out["offline_wer"] = float(np.mean([run["offline_wer"] for run in runs]))
        out["final_offline_mismatches"] = sum(run["final_offline_mismatches"] for run in runs)
        out["segments"] = sum(run["segments"] for run in runs)
    return out


def render_markdown(report: dict) -> str:
    """The tables of docs/streaming.md from a report.json."""
    lines = []
    if "summary_dictations" in report:
        s, per = report["summary_dictations"], report["per_language"]
        langs = sorted(per)

        def ms(d, key, q):
            return f"{d[key][q]:.3f}"

        lines += ["| figure | all | " + " | ".join(langs) + " |", "|---|---|" + "---|" * len(langs)]
        rows = [("first partial after speech start, median / p95 (s)",
                 lambda d: f"{ms(d, 'first_partial_s', 'median')} / {ms(d, 'first_partial_s', 'p95')}"),
                ("final lag after speech end (synthesis end), median / p95 (s)",
                 lambda d: f"{ms(d, 'final_lag_s', 'median')} / {ms(d, 'final_lag_s', 'p95')}"),
                ("final lag after the acoustic end, median / p95 (s)",
                 lambda d: f"{ms(d, 'final_lag_acoustic_s', 'median')} / {ms(d, 'final_lag_acoustic_s', 'p95')}"),
                ("flicker: partial tokens changed or dropped by the next update / shown",
                 lambda d: f"{d['flicker']['revised_tokens']} / {d['flicker']['partial_tokens_shown']}"),
                ("confirmed tokens the final changed / final tokens",
                 lambda d: f"{d['flicker']['confirmed_revised_by_final']} / {d['flicker']['final_tokens']}"),
                ("dictation WER, streamed finals", lambda d: f"{100 * d['wer']:.1f} %"),
                ("dictation WER, offline whole file", lambda d: f"{100 * d['offline_wer']:.1f} %"),
                ("finals != offline of their segment / segments",
                 lambda d: f"{d['final_offline_mismatches']} / {d['segments']}")]
        for name, fn in rows:
            lines.append(f"| {name} | {fn(s)} | " + " | ".join(fn(per[lang]) for lang in langs) + " |")
        if "finals_equal_own_clip" in report:
            own = report["finals_equal_own_clip"]
            other = ", ".join(f"{k} {v}" for k, v in own.get("verdicts", {}).items() if k != "equal")
            lines.append(f"| finals = offline of the utterance's own clip / utterances | {own['equal']} / {own['utterances']}"
                         + (f" (others: {other})" if other else "") + " |")
        if "own_clip_decomposition" in report:
            dec = report["own_clip_decomposition"]
            lines.append(f"| ... the segmentation: finals = offline of the utterance cut in place with its own clip's "
                         f"edges / utterances | {dec['final_equals_in_place']} / {dec['utterances']} |")
            lines.append(f"| ... the dictation's audio (level, background noise): that cut = its own clip, offline / "
                         f"utterances | {dec['in_place_equals_own_clip']} / {dec['utterances']} |")
        if "offline_per_utterance_wer" in report:
            w = report["offline_per_utterance_wer"]
            lines.append("| WER, offline, each held-out clip alone | | " + " | ".join(
                f"{100 * w[lang]:.1f} %" for lang in langs) + " |")
        lines += ["", "| compute per audio second | encoder calls | encoder audio-s | decoder calls | "
                  "decoder tokens fed |", "|---|---|---|---|---|"]
        for name, key in (("streaming (partials + finals)", "compute_per_audio_s"),
                          ("offline, the segments (the finals alone)", "offline_segments_compute_per_audio_s"),
                          ("ratio", "compute_ratio_vs_offline_segments"),
                          ("offline, whole file", "offline_compute_per_audio_s"),
                          ("ratio vs whole file", "compute_ratio_vs_offline")):
            d = s[key]
            lines.append(f"| {name} | {d['encoder_calls']:.3g} | {d['encoder_audio_s']:.3g} | "
                         f"{d['decoder_calls']:.3g} | {d['decoder_tokens']:.3g} |")
    if report.get("sweep"):
        lines += ["", "| change | first partial median | final lag median / p95 | flicker | confirmed changed by final "
                  "| WER | encoder audio-s / s (ratio vs segments) | decoder calls / s (ratio) | decoder tokens fed / s "
                  "(ratio) |", "|---|---|---|---|---|---|---|---|---|"]
        for row in report["sweep"]:
            s = row["summary"]
            r = s["compute_ratio_vs_offline_segments"]
            c = s["compute_per_audio_s"]
            change = ", ".join(f"{k} {v:g}" for k, v in row["change"].items()) or "defaults"
            lines.append(f"| {change} | {s['first_partial_s']['median']:.2f} s | {s['final_lag_s']['median']:.2f} / "
                         f"{s['final_lag_s']['p95']:.2f} s | {s['flicker']['revised_tokens']} | "
                         f"{s['flicker']['confirmed_revised_by_final']} | {100 * s['wer']:.1f} % | "
                         f"{c['encoder_audio_s']:.2f} ({r['encoder_audio_s']:.2f}x) | "
                         f"{c['decoder_calls']:.1f} ({r['decoder_calls']:.2f}x) | "
                         f"{c['decoder_tokens']:.1f} ({r['decoder_tokens']:.2f}x) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, nargs="+")
    parser.add_argument("--data", default="out/dictations", help="folder written by tools/data/make_dictations.py")
    parser.add_argument("--out", default="out/stream-bench")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--chunk", type=float, default=0.1, help="seconds per fed chunk (default: %(default)s)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-extend", action="store_true",
                        help="do not use the decoder's extend function (forced prefixes fed by steps: the fallback)")
    parser.add_argument("--only", nargs="+", metavar="FILE", help="only these dictation files (manifest 'file')")
    parser.add_argument("--no-main", action="store_true", help="only the sweep")
    parser.add_argument("--render", metavar="REPORT", help="print the markdown tables of a report.json and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render_markdown(json.loads(Path(args.render).read_text())), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    data = Path(args.data)
    manifest = json.loads((data / "manifest.json").read_text())
    t = Transcriber(args.bundle, backend=args.backend, use_extend=not args.no_extend)
    sr = t.front_end.sampling_rate
    dictations = [dict(d, wav=load_audio(data / d["file"], target_rate=sr)) for d in manifest["dictations"]
                  if not args.only or d["file"] in args.only]
    config = StreamConfig()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunk = max(1, int(round(args.chunk * sr)))
    name = "sweep.json" if args.no_main else "report.json"
    report = {"bundle": args.bundle, "config": dataclasses.asdict(config), "chunk_s": args.chunk,
              "extend": t.decoder.extend_model is not None,
              "decoder_plan": {"prompt_length": len(t.prompt("en")), "capacity": t.decoder.capacity,
                               "prefill_length": t.decoder.prefill_length, "extend_length": t.decoder.extend_length},
              "segmenter": segmenter_measurement([d for d in dictations if d["utterances"]], config,
                                                 t.front_end.hop_length, sr)}
    logger.info("segmenter: %s", report["segmenter"])
    if not args.no_main:
        runs = []
        for d in dictations:
            run = run_dictation(t, d, config, chunk, check_offline=True)
            logger.info("%s: %d segments, WER %.3f (offline %.3f), %d final/offline mismatches, wall %.1f s", d["file"],
                        run["segments"], run["wer"], run["offline_wer"], run["final_offline_mismatches"], run["wall_s"])
            runs.append(run)
        report["runs"] = runs
        # offline, each held-out utterance alone (the clips the dictations are made of): the model's own WER
        clips = [c for d in dictations if d["utterances"] for c in d["utterances"]]
        heldout = {c.id: c for c in load_folder(Path(manifest.get("heldout_dir") or HELDOUT_DIR)).clips}
        by_language: dict[str, tuple[list, list]] = {}
        own_text = {}
        for u in clips:
            clip = heldout[u["id"]]
            refs, hyps = by_language.setdefault(clip.language, ([], []))
            refs.append(clip.text)
            own_text[u["id"]] = t.transcribe(str(clip.audio), clip.language).text
            hyps.append(own_text[u["id"]])
        report["offline_per_utterance_wer"] = {lang: error_counts(r, h, lang)["rate"] for lang, (r, h) in
                                               sorted(by_language.items())}
        logger.info("offline, utterance by utterance: %s", report["offline_per_utterance_wer"])
        # per utterance: is its final the offline transcript of the utterance's own clip (not only of the
        # segment's samples, which final_offline_mismatches compares)?
        verdicts = [(d, run, own_clip_verdicts(d, run, own_text)) for d, run in zip(dictations, runs)
                    if d["utterances"]]
        counts = Counter(v for _, _, x in verdicts for v in x.values())
        report["finals_equal_own_clip"] = {
            "utterances": sum(counts.values()), "equal": counts["equal"], "verdicts": dict(sorted(counts.items())),
            "differing": [{"id": u["id"], "dictation": d["file"], "verdict": x[u["id"]], "own_clip": own_text[u["id"]],
                           "finals": [f["text"] for f in covering_finals(run, u)]}
                          for d, run, x in verdicts for u in d["utterances"] if x[u["id"]] != "equal"]}
        logger.info("finals equal to their utterance's own clip offline: %d of %d (%s)", counts["equal"],
                    sum(counts.values()), dict(sorted(counts.items())))
        # the same question split in two: the segmentation, and the audio the dictation changed
        in_place_text = {}
        for d, _, _ in verdicts:
            for u in d["utterances"]:
                samples = in_place_clip(d, u)
                if samples is None:
                    break
                in_place_text[u["id"]] = t.transcribe(samples, d["language"]).text
        if len(in_place_text) == len(own_text):
            report["own_clip_decomposition"] = own_clip_decomposition(verdicts, own_text, in_place_text)
            for row in report["finals_equal_own_clip"]["differing"]:
                row["in_place"] = in_place_text[row["id"]]
            logger.info("own clip, decomposed: %s", report["own_clip_decomposition"])
        else:
            logger.info("the dictations' manifest has no clip_edges (older tools/data/make_dictations.py): "
                        "no in-place decomposition")
        dictation_runs = [r for r in runs if "utterances" in r]
        report["summary"] = summarise(runs)
        report["summary_dictations"] = summarise(dictation_runs)
        report["per_language"] = {lang: summarise([r for r in dictation_runs if r["language"] == lang])
                                  for lang in sorted({r["language"] for r in dictation_runs})}
        (out_dir / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        logger.info("summary: %s", json.dumps(report["summary_dictations"], indent=1))
    if not args.no_sweep:
        sweep_set = [next(d for d in dictations if d["utterances"] and d["language"] == lang)
                     for lang in sorted({d["language"] for d in dictations if d["utterances"]})]
        report["sweep"] = []
        for change in SWEEP:
            cfg = dataclasses.replace(config, **change)
            sweep_runs = [run_dictation(t, d, cfg, chunk, check_offline=False) for d in sweep_set]
            s = summarise(sweep_runs)
            report["sweep"].append({"change": change, "config": dataclasses.asdict(cfg), "summary": s,
                                    "segments": sum(r["segments"] for r in sweep_runs)})
            logger.info("sweep %s: first partial %.2f, lag %.2f/%.2f, flicker %d, WER %.3f, enc %.2f, dec %.1f",
                        change, s["first_partial_s"]["median"], s["final_lag_s"]["median"],
                        s["final_lag_s"]["p95"], s["flicker"]["revised_tokens"], s["wer"],
                        s["compute_per_audio_s"]["encoder_audio_s"], s["compute_per_audio_s"]["decoder_calls"])
            (out_dir / name).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    (out_dir / (Path(name).stem + ".md")).write_text(render_markdown(report))
    print(out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
