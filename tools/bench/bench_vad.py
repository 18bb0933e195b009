#!/usr/bin/env python
"""Voice activity (docs/vad.md): what the VAD saves and what it costs, with and without it on one bundle.

Measured, each with `vad="off"` and `vad="on"` (windows decoded, share of the audio decoded, transcript, wall
time):
* noise: 60 s each of digital silence, white noise at -60 dBFS, pink noise at -30 dBFS and a music-like signal
  (chords of harmonic tones with note envelopes and noise percussion, -20 dBFS): the transcript should be empty
  and no window decoded with the VAD;
* sparse: per language, a recording of held-out utterances (tests/data/heldout, cycled when the recording needs
  more) whose pauses fill --pause-share of its time, over pink background noise at -50 dBFS: windows, wall time
  ratio, WER per language with the 95 % bootstrap interval (evaluation.metrics) and the paired interval of the
  VAD's increase, utterances lost (no part of the clip inside a VAD window) and partly lost; each hypothesis word
  is given to the utterance whose span (pauses split in the middle) holds its start (word timings);
* dense: tests/data/audio/en_long_75s.flac and, per language, clips of 4 held-out utterances with 0.3-0.8 s
  pauses: WER with intervals and window counts;
* streaming: per language a dictation of 5 held-out utterances with 1-2 s pauses: the final's lag after each
  utterance's acoustic end (tools/bench/bench_streaming.py's measure) and own-clip agreement, VAD segments vs the
  energy segmenter.

The VAD: the bundle's vad.mlpackage when its manifest has one, else (or with --vad-source torch) the PyTorch
module of the same network (inference.vad.TorchVad) through the same rule.

* with --dictations: the streaming bench's dictations (tools/data/make_dictations.py), energy segmenter vs VAD.
* parity (--sections parity): vad.mlpackage exported here in the shipped precision (export.vad_package's
  VAD_PRECISION) at each of --block-sizes N, and in the other precision at the shipped N, against silero-vad's
  own model on the committed clips (tests/data/audio) and, with --dictations, the dictations: max |probability
  diff| per chunk (block and chunk functions), signals with identical speech segments; per program the
  conversion seconds, package bytes and seconds per audio second in the interpreter.

Example:
  uv run --frozen python tools/data/make_dictations.py --out out/dictations
  uv run --frozen python tools/bench/bench_vad.py --bundle out/demo/cohere-tiny-synth-fp16 --dictations out/dictations \
      --out out/bench-vad
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from cohere_coreml.config import VAD_BLOCK_FUNCTION as VAD_BLOCK
from cohere_coreml.config import VAD_CHUNK_FUNCTION as VAD_CHUNK
from cohere_coreml.evaluation.metrics import error_counts, increase_interval, rate_interval
from cohere_coreml.inference.speech_regions import VadOptions
from cohere_coreml.inference.streaming import stream_array
from cohere_coreml.inference.transcribe import Transcriber, bundle_vad
from cohere_coreml.inference.vad import TorchVad
from cohere_coreml.model.audio import load_audio

logger = logging.getLogger("bench_vad")
ROOT = Path(__file__).resolve().parents[2]
HELDOUT = ROOT / "tests" / "data" / "heldout"
AUDIO = ROOT / "tests" / "data" / "audio"
SR = 16000
LANGUAGES = ("en", "de", "es")


def streaming_bench():
    """tools/bench/bench_streaming.py as a module (its lag and own-clip measures)."""
    spec = importlib.util.spec_from_file_location("bench_streaming", Path(__file__).with_name("bench_streaming.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dbfs(x: np.ndarray, level_db: float) -> np.ndarray:
    """x scaled to an RMS of level_db dBFS."""
    return (x * (10 ** (level_db / 20) / max(float(np.sqrt(np.mean(x.astype(np.float64) ** 2))), 1e-12))).astype(
        np.float32)


def pink(n: int, rng) -> np.ndarray:
    """1/f noise: white noise shaped by 1/sqrt(f) in the frequency domain."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(spectrum.size)
    spectrum[1:] /= np.sqrt(f[1:])
    spectrum[0] = 0
    return np.fft.irfft(spectrum, n).astype(np.float32)


def music(seconds: float, rng) -> np.ndarray:
    """Chords of harmonic tones (a new chord every 0.5 s, each note with an attack-decay envelope) and noise
    bursts as percussion on the beat: music-like, no speech."""
    n = int(seconds * SR)
    t = np.arange(n) / SR
    out = np.zeros(n)
    beat = int(0.5 * SR)
    for k, start in enumerate(range(0, n, beat)):
        end = min(n, start + beat)
        root = 110 * 2 ** (rng.integers(0, 12) / 12)
        env = np.exp(-np.arange(end - start) / (0.25 * SR)) * (1 - np.exp(-np.arange(end - start) / (0.01 * SR)))
        for ratio in (1.0, 1.26, 1.5):  # a major triad
            for h in range(1, 6):
                out[start:end] += env * np.sin(2 * np.pi * root * ratio * h * t[start:end]) / h
        hit = min(end, start + int(0.05 * SR))
        out[start:hit] += rng.standard_normal(hit - start) * np.exp(-np.arange(hit - start) / (0.01 * SR)) * 2
    return dbfs(out, -20.0)


def heldout(language: str) -> list[dict]:
    manifest = json.loads((HELDOUT / "manifest.json").read_text())
    return [{**u, "path": HELDOUT / u["file"]} for u in manifest["utterances"] if u["language"] == language]


def acoustic_span(clip: np.ndarray, above_db: float = 10.0) -> tuple[int, int]:
    """[start, end) samples of a clip's speech: its first to last 10 ms frame more than `above_db` over the clip's
    own noise floor (the 10th percentile of its frame energies; the held-out clips carry their own noise)."""
    frame = 160
    n = clip.size // frame
    e = 10 * np.log10(np.mean(clip[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1) + 1e-12)
    idx = np.nonzero(e > np.percentile(e, 10) + above_db)[0]
    return (int(idx[0]) * frame, int(idx[-1] + 1) * frame) if idx.size else (0, clip.size)


def join(clips: list[np.ndarray], pauses: list[float], lead: float, trail: float, noise_db: float | None, rng):
    """Clips joined with the given pauses (seconds), and the clips' [start, end) samples; background pink noise at
    noise_db dBFS over the whole recording."""
    pieces, spans, pos = [np.zeros(int(lead * SR), np.float32)], [], int(lead * SR)
    for i, clip in enumerate(clips):
        pieces.append(clip)
        spans.append((pos, pos + clip.size))
        pos += clip.size
        gap = int((pauses[i] if i < len(pauses) else trail) * SR)
        pieces.append(np.zeros(gap, np.float32))
        pos += gap
    wav = np.concatenate(pieces)
    if noise_db is not None:
        wav = wav + dbfs(pink(wav.size, rng), noise_db)
    return wav.astype(np.float32), spans


def run(tr: Transcriber, audio, language: str, vad: str, words: bool = False) -> dict:
    gap = getattr(tr, "vad_gap", None)
    options = VadOptions(max_gap_s=gap) if gap is not None else None
    t0 = time.perf_counter()
    result = tr.transcribe(audio, language, vad=vad, word_timestamps=words, vad_options=options)
    wall = time.perf_counter() - t0
    seconds = (audio.size if isinstance(audio, np.ndarray) else load_audio(audio).size) / SR
    decoded = sum(w.duration_s for w in result.windows)
    out = {"vad": vad, "text": result.text, "windows": len(result.windows), "decoded_s": decoded,
           "decoded_share": decoded / seconds, "audio_s": seconds, "wall_s": wall, "silent": result.silent,
           "window_spans": [[round(w.start_s, 3), round(w.start_s + w.duration_s, 3)] for w in result.windows]}
    if words:
        out["words"] = result.words
    return out


def noise_section(tr: Transcriber, seconds: float) -> dict:
    rng = np.random.default_rng(58)
    n = int(seconds * SR)
    signals = {"digital silence": np.zeros(n, np.float32),
               "white noise -60 dBFS": dbfs(rng.standard_normal(n), -60.0),
               "pink noise -30 dBFS": dbfs(pink(n, rng), -30.0),
               "music-like -20 dBFS": music(seconds, rng)}
    out = {}
    for name, wav in signals.items():
        out[name] = {vad: run(tr, wav, "en", vad) for vad in ("off", "on")}
        logger.info("%s: off %d windows %.1f s %r; on %d windows %.1f s %r", name, out[name]["off"]["windows"],
                    out[name]["off"]["wall_s"], out[name]["off"]["text"][:60], out[name]["on"]["windows"],
                    out[name]["on"]["wall_s"], out[name]["on"]["text"][:60])
    return out


def per_utterance(words: list[dict], spans: list[tuple[int, int]]) -> list[str]:
    """Each utterance's hypothesis: the words whose start lies in its span, pauses split in the middle."""
    bounds = [(spans[i][1] + spans[i + 1][0]) / 2 / SR for i in range(len(spans) - 1)]
    texts = [[] for _ in spans]
    for w in words:
        texts[int(np.searchsorted(bounds, w["start"], side="right"))].append(w["word"])
    return [" ".join(t) for t in texts]


def coverage(spans, windows) -> list[float]:
    """Share of each utterance's speech (`acoustic_span` within the recording) inside the windows decoded."""
    out = []
    for a, b in spans:
        inside = sum(max(0, min(b, round(e * SR)) - max(a, round(s * SR))) for s, e in windows)
        out.append(inside / (b - a))
    return out


def sparse_section(tr: Transcriber, seconds: float, pause_share: float, extra_gaps=()) -> dict:
    out = {}
    for language in LANGUAGES:
        rng = np.random.default_rng(LANGUAGES.index(language))
        utts = heldout(language)
        clips, refs, total = [], [], 0
        while total < (1 - pause_share) * seconds * SR:
            u = utts[len(clips) % len(utts)]
            clips.append(load_audio(u["path"]))
            refs.append(u["text"])
            total += clips[-1].size
        pause_total = pause_share / (1 - pause_share) * total / SR
        weights = rng.uniform(0.3, 1.7, len(clips) + 1)
        pauses = list(weights / weights.sum() * pause_total)
        wav, spans = join(clips, pauses[1:-1], pauses[0], pauses[-1], -50.0, rng)
        speech = [(a + s0, a + s1) for (a, _), (s0, s1) in zip(spans, map(acoustic_span, clips))]
        row = {"audio_s": wav.size / SR, "utterances": len(clips), "speech_share": total / wav.size}
        for vad in ("off", "on", *(f"on, max_gap {g:g} s" for g in extra_gaps)):
            if vad.startswith("on, max_gap"):
                tr.vad_gap = float(vad.split()[-2])
            r = run(tr, wav, language, "on" if vad.startswith("on") else "off", words=True)
            tr.vad_gap = None
            hyps = per_utterance(r.pop("words"), spans)
            r["wer"] = error_counts(refs, hyps, language)["rate"]
            r["wer_interval"] = rate_interval(refs, hyps, language)
            r["hypotheses"] = hyps
            row[vad] = r
        cover = coverage(speech, row["on"]["window_spans"])
        row["utterances_lost"] = sum(c == 0 for c in cover)
        row["utterances_partly_lost"] = sum(0 < c < 0.999 for c in cover)
        row["wall_ratio"] = row["on"]["wall_s"] / row["off"]["wall_s"]
        row["vad_wer_increase"] = increase_interval(refs, row["off"]["hypotheses"], row["on"]["hypotheses"], language,
                                                    bound=0.003)
        out[language] = row
        logger.info("sparse %s %.0f s: off %d windows %.0f s WER %.3f; on %d windows %.0f s WER %.3f; lost %d",
                    language, row["audio_s"], row["off"]["windows"], row["off"]["wall_s"], row["off"]["wer"],
                    row["on"]["windows"], row["on"]["wall_s"], row["on"]["wer"], row["utterances_lost"])
    return out


def dense_section(tr: Transcriber, per_language: int) -> dict:
    out = {}
    clips_manifest = json.loads((AUDIO / "manifest.json").read_text())["clips"]
    long_ref = next(c["text"] for c in clips_manifest if c["file"] == "en_long_75s.flac")
    out["en_long_75s"] = {vad: {**(r := run(tr, AUDIO / "en_long_75s.flac", "en", vad)),
                                "wer": error_counts([long_ref], [r["text"]], "en")["rate"]} for vad in ("off", "on")}
    for language in LANGUAGES:
        rng = np.random.default_rng(100 + LANGUAGES.index(language))
        utts = heldout(language)
        refs, hyps = [], {"off": [], "on": []}
        windows = {"off": 0, "on": 0}
        decoded = {"off": 0.0, "on": 0.0}
        for k in range(per_language):
            group = utts[4 * k: 4 * k + 4]
            if len(group) < 4:
                break
            wav, _ = join([load_audio(u["path"]) for u in group], list(rng.uniform(0.3, 0.8, 3)), 0.2, 0.2, None, rng)
            refs.append(" ".join(u["text"] for u in group))
            for vad in ("off", "on"):
                r = run(tr, wav, language, vad)
                hyps[vad].append(r["text"])
                windows[vad] += r["windows"]
                decoded[vad] += r["decoded_s"]
        out[language] = {"clips": len(refs), **{vad: {
            "wer": error_counts(refs, hyps[vad], language)["rate"], "wer_interval": rate_interval(refs, hyps[vad], language),
            "windows": windows[vad], "decoded_s": decoded[vad]} for vad in ("off", "on")}}
        logger.info("dense %s: WER off %.3f on %.3f, windows %d / %d", language, out[language]["off"]["wer"],
                    out[language]["on"]["wer"], windows["off"], windows["on"])
    return out


def streaming_section(tr: Transcriber) -> dict:
    bs = streaming_bench()
    out = {}
    for language in LANGUAGES:
        rng = np.random.default_rng(200 + LANGUAGES.index(language))
        utts = heldout(language)[-5:]
        clips = [load_audio(u["path"]) for u in utts]
        wav, spans = join(clips, list(rng.uniform(1.0, 2.0, 4)), 1.0, 1.5, -50.0, rng)
        # each utterance's speech (`acoustic_span`): the final's lag is measured from its end
        speech = [(a + s0, a + s1) for (a, _), (s0, s1) in zip(spans, map(acoustic_span, clips))]
        d = {"wav": wav, "language": language,
             "utterances": [{"id": u["file"], "start": a / SR, "end": b / SR, "start_sample": a, "end_sample": b}
                            for u, (a, b) in zip(utts, speech)]}
        own = {u["file"]: tr.transcribe(load_audio(u["path"]), language, vad="off").text for u in utts}
        row = {}
        for vad in ("off", "on"):
            t0 = time.perf_counter()
            updates, stats = stream_array(tr, wav, 1600, language, vad=vad)
            wall = time.perf_counter() - t0
            figures = bs.utterance_figures(d, updates, SR, tr.front_end.hop_length)
            lags = [f["final_lag_s"] for f in figures if f["final_lag_s"] is not None]
            verdicts = bs.own_clip_verdicts(d, {"updates": [u.to_dict() for u in updates]}, own)
            row[vad] = {"segments": stats.finals, "partials": stats.partials, "wall_s": wall,
                        "final_lag_s": {"median": float(np.median(lags)) if lags else None,
                                                 "p95": float(np.percentile(lags, 95)) if lags else None},
                        "own_clip_equal": sum(v == "equal" for v in verdicts.values()), "verdicts": verdicts,
                        "encoder_calls_per_s": stats.per_audio_second()["encoder_calls"]}
        out[language] = row
        logger.info("stream %s: lag energy %s VAD %s; own clip %d / %d", language,
                    row["off"]["final_lag_s"], row["on"]["final_lag_s"], row["off"]["own_clip_equal"],
                    row["on"]["own_clip_equal"])
    return out


def dictation_section(tr: Transcriber, folder: Path) -> dict:
    """The streaming bench's dictations (tools/data/make_dictations.py: speech edges exact, one background noise
    over each): per dictation, energy segmenter vs VAD: segments, the final's lag after each utterance's
    synthesis end and acoustic end (bench_streaming's measures), finals equal to the utterance's own clip, WER of
    the joined finals."""
    bs = streaming_bench()
    manifest = json.loads((folder / "manifest.json").read_text())
    out = {}
    for entry in manifest["dictations"]:
        if not entry.get("utterances"):
            continue
        d = {**entry, "wav": load_audio(folder / entry["file"])}
        own = {u["id"]: tr.transcribe(load_audio(HELDOUT / u["file"]), entry["language"], vad="off").text
               for u in entry["utterances"]}
        row = {"utterances": len(entry["utterances"]), "seconds": d["wav"].size / SR}
        for vad in ("off", "on"):
            updates, stats = stream_array(tr, d["wav"], 1600, entry["language"], vad=vad)
            figures = bs.utterance_figures(d, updates, SR, tr.front_end.hop_length)
            verdicts = bs.own_clip_verdicts(d, {"updates": [u.to_dict() for u in updates]}, own)
            text = " ".join(u.text for u in updates if u.type == "final" and u.text)

            def stat(key):
                v = [f[key] for f in figures if f[key] is not None]
                return {"median": float(np.median(v)), "p95": float(np.percentile(v, 95))} if v else None

            row[vad] = {"segments": stats.finals, "partials": stats.partials, "final_lag_s": stat("final_lag_s"),
                        "final_lag_acoustic_s": stat("final_lag_acoustic_s"), "first_partial_s": stat("first_partial_s"),
                        "own_clip_equal": sum(v == "equal" for v in verdicts.values()),
                        "wer": error_counts([entry["text"]], [text], entry["language"])["rate"]}
        out[entry["file"]] = row
        logger.info("dictation %s: segments %d / %d, lag %s / %s, own clip %d / %d of %d", entry["file"],
                    row["off"]["segments"], row["on"]["segments"], row["off"]["final_lag_s"], row["on"]["final_lag_s"],
                    row["off"]["own_clip_equal"], row["on"]["own_clip_equal"], row["utterances"])
    return out


def parity_section(folder: Path, dictations: Path | None, block_sizes: list[int]) -> dict:
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.vad_package import convert_vad, gate_references, gate_signals, run_gate
    from cohere_coreml.inference.vad import PackageVad

    paths = sorted(p for p in AUDIO.iterdir() if p.suffix in (".wav", ".flac"))
    if dictations:
        entries = json.loads((dictations / "manifest.json").read_text())["dictations"]
        paths += [dictations / e["file"] for e in entries]
    cases = gate_references(gate_signals(paths))
    audio_s = sum(c["wav"].size for c in cases) / SR
    out = {"signals": len(cases), "audio_s": audio_s, "programs": {}}
    from cohere_coreml.export.vad_package import BLOCK_CHUNKS, VAD_PRECISION

    other = "fp16" if VAD_PRECISION == "fp32" else "fp32"  # the precision not shipped, at the shipped N
    for precision, chunks in [(VAD_PRECISION, n) for n in block_sizes] + [(other, BLOCK_CHUNKS)]:
        target = folder / f"{precision}-{chunks}"
        t0 = time.perf_counter()
        convert_vad(ExportSettings(out_dir=target, force=True), chunks=chunks, precision=precision)
        convert_s = time.perf_counter() - t0
        package = target / "vad.mlpackage"
        vad = PackageVad.load(package, chunks, backend="mil")
        t0 = time.perf_counter()
        gate = run_gate(vad, cases, precision, chunks, "interpreter")
        run_s = time.perf_counter() - t0
        rows = gate.cases
        worst = {fn: max(r[fn]["max_abs_diff"] for r in rows) for fn in (VAD_BLOCK, VAD_CHUNK)}
        block_s = sum(r["block_seconds"] for r in rows)
        out["programs"][f"{precision}, N={chunks}"] = {
            "precision": precision, "chunks": chunks, "convert_s": convert_s, "run_s": run_s,
            "bytes": sum(f.stat().st_size for f in package.rglob("*") if f.is_file()),
            "block_s_per_audio_s": block_s / audio_s, "max_abs_diff": worst,
            "segments_identical": sum(all(r[fn]["segments_identical"] for fn in worst) for r in rows),
            "segments": sum(r["segments"] for r in rows), "passed": gate.passed}
        logger.info("parity %s N=%d: %s", precision, chunks, gate.headline)
    return out


def pct(x) -> str:
    return f"{100 * x:.1f}"


def interval(r) -> str:
    lo, hi = r["wer_interval"]
    return f"{pct(r['wer'])} [{pct(lo)}-{pct(hi)}]"


def markdown(report: dict) -> str:
    lines = [f"VAD source: {report['vad_source']}; bundle {report['bundle']}; backend {report['backend']}", ""]
    if "parity" in report:
        r = report["parity"]
        lines += [f"Parity vs silero-vad's model: {r['signals']} signals, {r['audio_s']:.0f} s", "",
                  "| program | max abs diff block / chunk | signals with identical segments | segments | "
                  "convert s | bytes | block s per audio s (interpreter) |", "|---|---|---|---|---|---|---|"]
        for name, v in r["programs"].items():
            d = v["max_abs_diff"]
            lines.append(f"| {name} | {d[VAD_BLOCK]:.1e} / {d[VAD_CHUNK]:.1e} | {v['segments_identical']} / {r['signals']} | "
                         f"{v['segments']} | {v['convert_s']:.0f} | {v['bytes']:,} | {v['block_s_per_audio_s']:.4f} |")
        lines.append("")
    if "noise" in report:
        lines += ["| signal (60 s) | windows off / on | decoded % on | transcript on | wall s off / on |",
                  "|---|---|---|---|---|"]
        for name, r in report["noise"].items():
            lines.append(f"| {name} | {r['off']['windows']} / {r['on']['windows']} | {pct(r['on']['decoded_share'])} | "
                         f"{r['on']['text']!r} | {r['off']['wall_s']:.1f} / {r['on']['wall_s']:.1f} |")
        lines.append("")
    if "sparse" in report:
        lines += ["| sparse | audio s | utterances | windows off / on | decoded % on | wall s off / on (ratio) | "
                  "WER % off [95 % CI] | WER % on [95 % CI] | increase [95 % CI] | lost / partly |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for lang, r in report["sparse"].items():
            inc = r["vad_wer_increase"]["interval"]
            lines.append(f"| {lang} | {r['audio_s']:.0f} | {r['utterances']} | {r['off']['windows']} / {r['on']['windows']} | "
                         f"{pct(r['on']['decoded_share'])} | {r['off']['wall_s']:.0f} / {r['on']['wall_s']:.0f} "
                         f"({r['wall_ratio']:.2f}) | {interval(r['off'])} | {interval(r['on'])} | "
                         f"[{pct(inc[0])}, {pct(inc[1])}] | {r['utterances_lost']} / {r['utterances_partly_lost']} |")
            for key in (k for k in r if k.startswith("on, max_gap")):
                v = r[key]
                lines.append(f"| {lang}, {key[4:]} | | | {r['off']['windows']} / {v['windows']} | {pct(v['decoded_share'])} | "
                             f"{r['off']['wall_s']:.0f} / {v['wall_s']:.0f} ({v['wall_s'] / r['off']['wall_s']:.2f}) | | "
                             f"{interval(v)} | | |")
        lines.append("")
    if "dense" in report:
        r = report["dense"]["en_long_75s"]
        lines += ["| dense | clips | windows off / on | WER % off | WER % on |", "|---|---|---|---|---|",
                  f"| en_long_75s | 1 | {r['off']['windows']} / {r['on']['windows']} | {pct(r['off']['wer'])} | "
                  f"{pct(r['on']['wer'])} |"]
        for lang in LANGUAGES:
            r = report["dense"][lang]
            lines.append(f"| {lang}, 4 utterances a clip | {r['clips']} | {r['off']['windows']} / {r['on']['windows']} | "
                         f"{interval(r['off'])} | {interval(r['on'])} |")
        lines.append("")
    if "streaming" in report:
        lines += ["| stream | segments energy / VAD | final lag after speech end, median / p95 s: energy | VAD | "
                  "finals = own clip: energy / VAD |", "|---|---|---|---|---|"]
        for lang, r in report["streaming"].items():
            def lag(x):
                v = x["final_lag_s"]
                return f"{v['median']:.2f} / {v['p95']:.2f}" if v["median"] is not None else "-"
            lines.append(f"| {lang} | {r['off']['segments']} / {r['on']['segments']} | {lag(r['off'])} | {lag(r['on'])} | "
                         f"{r['off']['own_clip_equal']} / {r['on']['own_clip_equal']} of 5 |")
    if "dictations" in report:
        lines += ["", "| dictation | utterances | segments energy / VAD | final lag after synthesis end, median / p95 s: "
                  "energy | VAD | after the acoustic end: energy | VAD | finals = own clip: energy / VAD | "
                  "WER % energy / VAD |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in report["dictations"].items():
            def med(x, key):
                v = x[key]
                return f"{v['median']:.2f} / {v['p95']:.2f}" if v else "-"
            lines.append(f"| {name} | {r['utterances']} | {r['off']['segments']} / {r['on']['segments']} | "
                         f"{med(r['off'], 'final_lag_s')} | {med(r['on'], 'final_lag_s')} | "
                         f"{med(r['off'], 'final_lag_acoustic_s')} | {med(r['on'], 'final_lag_acoustic_s')} | "
                         f"{r['off']['own_clip_equal']} / {r['on']['own_clip_equal']} | "
                         f"{pct(r['off']['wer'])} / {pct(r['on']['wer'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="bundle folder")
    parser.add_argument("--backend", default="mil", choices=("auto", "coreml", "mil"))
    parser.add_argument("--vad-source", default="auto", choices=("auto", "package", "torch"),
                        help="auto: the bundle's vad.mlpackage when it has one, else the PyTorch module")
    parser.add_argument("--noise-seconds", type=float, default=60.0)
    parser.add_argument("--sparse-seconds", type=float, default=600.0, help="length of each language's sparse recording")
    parser.add_argument("--pause-share", type=float, default=0.7)
    parser.add_argument("--sparse-max-gaps", default="35",
                        help="more VAD runs on the sparse recordings with these max_gap_s values (comma-separated)")
    parser.add_argument("--dense-per-language", type=int, default=6, help="clips of 4 utterances per language")
    parser.add_argument("--sections", default="noise,sparse,dense,streaming", help="also: parity")
    parser.add_argument("--block-sizes", default="32", help="N values (chunks per block call) the parity section exports")
    parser.add_argument("--dictations", default=None,
                        help="also stream the dictations of tools/data/make_dictations.py in this folder")
    parser.add_argument("--out", default="out/bench-vad")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    tr = Transcriber(args.bundle, backend=args.backend)
    package = bundle_vad(tr.bundle, args.backend) if args.vad_source != "torch" else None
    if args.vad_source == "package" and package is None:
        sys.exit(f"bundle {args.bundle} has no vad.mlpackage: use --vad-source torch")
    tr._vad = package or TorchVad()
    source = "vad.mlpackage" if package is not None else "PyTorch module (inference.vad.TorchVad)"
    report = {"bundle": args.bundle, "backend": args.backend, "vad_source": source,
              "options": {k: getattr(args, k) for k in ("noise_seconds", "sparse_seconds", "pause_share",
                                                        "dense_per_language")}}
    sections = args.sections.split(",")
    out = Path(args.out)
    if "parity" in sections:
        report["parity"] = parity_section(out / "packages", Path(args.dictations) if args.dictations else None,
                                          [int(n) for n in args.block_sizes.split(",")])
    if "noise" in sections:
        report["noise"] = noise_section(tr, args.noise_seconds)
    if "sparse" in sections:
        gaps = [float(g) for g in args.sparse_max_gaps.split(",") if g]
        report["sparse"] = sparse_section(tr, args.sparse_seconds, args.pause_share, gaps)
    if "dense" in sections:
        report["dense"] = dense_section(tr, args.dense_per_language)
    if "streaming" in sections:
        report["streaming"] = streaming_section(tr)
    if args.dictations:
        report["dictations"] = dictation_section(tr, Path(args.dictations))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vad.json").write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str))
    (out / "bench_vad.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
