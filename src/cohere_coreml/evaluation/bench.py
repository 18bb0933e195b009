"""`cohere-coreml bench`: accuracy, speed by stage, memory, loops and truncations, side by side.

For each engine (the PyTorch reference and every bundle, loaded one after the other in this
process so ratios between rows are meaningful on a noisy machine) over one dataset:

    load (timed apart) -> first clip once (the warm-up, reported as first_run_s) -> every clip:
      check the audio (missing / unreadable -> a per-clip problem; digital silence -> "" with no
      model call) -> engine.transcribe -> hypothesis, windows (start/end, stop reason, timings)

Figures per engine: WER (CER for ja/zh/ko) per language after `metrics.normalise`, with
substitutions / deletions / insertions; RTFx = audio seconds / processing seconds (warm runs);
stage totals (VAD, front end, encoder, prompt, decode), each stage's RTFx beside the whole file's (with the encoder
ahead of a batched decode the stages overlap), decode tokens per second (of the decoder's time and of the whole
file's), the decoder batch and encoder-ahead used and the decoder's wait for encoder outputs; load time; peak
RSS of the process (ru_maxrss: cumulative over the engines run so far, in run order) and the
RSS after loading; loop rate (windows stopped by the repetition guard, or whose tokens end in an
n-gram run by `decoding.loop_in`) and truncation rate (windows that hit the token limit).
On a dataset whose manifest has word times (a word-timing set: tools/data/make_word_timing_set.py), each engine
that can time words (a bundle with alignment; the PyTorch reference with heads: --alignment-heads, or the first
bundle's) also reports the word-timing error: its words matched to the truth's by text
(`export.alignment_heads.match_words`, as the head choice matches them), median and 90th percentile |start
error|, and words timed / words with a true start.

Device runs (`--merge-engine FILE.json`, repeatable): the JSON of `cohere-transcribe-swift bench` (the
Swift package on a Mac, an iOS device, or Linux through the interpreter) becomes a row too. It is refused
unless its dataset manifest sha256 is --data's; its hypotheses are scored here against --data's references
by `summarise`, the scoring of every row, and its windows built by `window_row`; its cold and warm load,
memory and Core ML placement are kept (a "device runs" table in bench.md). With --pytorch, its token ids
are compared with the reference's like every bundle's.

Writes bench.json (+ tool version, git hash, dataset and bundle manifest hashes, machine),
bench.md (a Markdown table) and bench.png (WER vs bundle size, time per stage) into --out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import __version__, git_hash
from ..bundle.load import Bundle
from ..cli_options import HelpFormatter, add_bundle_arg, add_decoder_batch_arg, add_decoding_args
from ..export.alignment_heads import match_words
from ..inference.alignment import DEFAULT_LEAD_ROWS, parse_heads
from ..inference.decoding import TOKEN_LIMITS, RepetitionGuard, StopReason, loop_in
from ..inference.engines import PyTorchEngine
from ..inference.longform import check_audio
from ..inference.speech_regions import VadOptions, add_vad_args, vad_options_of
from ..inference.transcribe import Transcriber
from ..model.audio import AudioError
from .bench_report import STAGES, format_markdown, write_outputs
from .datasets import load_dataset
from .metrics import error_counts, rate_interval, token_agreement

logger = logging.getLogger(__name__)



class BenchError(RuntimeError):
    """The bench cannot run (no engine given, nothing to score)."""


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (MB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KB on Linux


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def machine() -> dict:
    import torch  # heavy: a bench run needs it (the interpreter, the reference); `bench --help` does not

    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


def directory_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def bundle_folders(bundle: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The folders of one bundle (`--bundle DIR` or `--bundle DIR,DIR2`: files searched in order)."""
    return [Path(bundle)] if isinstance(bundle, (str, os.PathLike)) else [Path(d) for d in bundle]


def bundle_info(bundle: str | os.PathLike | Sequence[str | os.PathLike]) -> dict:
    """Identity of a benched bundle (one folder, or several searched in order): manifest hash, preset,
    whether its quantization gate passed (or was skipped), size of its encoder + decoder packages."""
    dirs = bundle_folders(bundle)

    def first(name: str) -> Path:  # the file the bundle uses: in the first folder holding it
        return next((d / name for d in dirs if (d / name).exists()), dirs[0] / name)

    manifest = first("manifest.json")
    packages = [first("encoder.mlpackage"), first("decoder.mlpackage")]
    compression = first("compression.json")
    gate = json.loads(compression.read_text()).get("gate", {}) if compression.is_file() else {}
    return {"dir": ",".join(str(d) for d in dirs),
            "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
            "preset": json.loads(manifest.read_text()).get("preset", "f16") if manifest.is_file() else None,
            "gate": "skipped" if gate.get("skipped") else ("passed" if gate.get("passed") else
                                                             ("export" if not compression.is_file() else "unknown")),
            "size_mb": round(sum(directory_mb(p) for p in packages if p.exists()), 3)}


def agreement_with(reference: dict, engine: dict) -> dict:
    """Token agreement of `engine` with `reference` (two run_engine sections) on the clips both transcribed."""
    ref = {c["id"]: c["token_ids"] for c in reference["clips"] if "token_ids" in c}
    pairs = [(ref[c["id"]], c["token_ids"]) for c in engine["clips"] if "token_ids" in c and c["id"] in ref]
    return {"reference": reference["label"], **token_agreement([a for a, _ in pairs], [b for _, b in pairs])}


def word_timing_errors(words: Sequence[dict], truth: Sequence[dict]) -> dict:
    """One clip's |start error| (seconds) of every hypothesis word matched by text to a truth word with a start,
    and how many truth words have one."""
    matched = match_words([w["word"] for w in words], truth)
    errors = [abs(w["start"] - t["start"]) for w, t in zip(words, matched) if t is not None and t.get("start") is not None]
    return {"start_errors": [round(e, 4) for e in errors],
            "truth_words": sum(1 for t in truth if t.get("start") is not None)}


def word_timing_summary(clips: list[dict]) -> dict | None:
    """Median / 90th percentile |start error| over the clips' timed words, words timed / words with a truth."""
    rows = [c["word_timing"] for c in clips if c.get("word_timing")]
    if not rows:
        return None
    errors = np.array([e for r in rows for e in r["start_errors"]], dtype=np.float64)
    return {"clips": len(rows), "words_timed": int(errors.size), "truth_words": sum(r["truth_words"] for r in rows),
            "median_s": float(np.median(errors)) if errors.size else None,
            "p90_s": float(np.percentile(errors, 90)) if errors.size else None}


def run_engine(make_engine, dataset, *, max_new_tokens=None, beams=1, repetition_guard=None, warmup=True,
               progress=False, word_timestamps=False, vad="auto", vad_options=None) -> dict:
    """Load one engine and run every clip of `dataset`; returns the engine's section of the report.
    `word_timestamps`: time the words of the clips with a truth (when the engine has alignment); `vad`,
    `vad_options`: voice activity as `Engine.transcribe` takes them (the section says whether it ran)."""
    rss_before = current_rss_mb()
    t0 = time.perf_counter()
    engine = make_engine()
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_mb()
    vad_on = engine.speech_probabilities(vad) is not None  # `on` without a VAD: one line, before any clip
    options = dict(max_new_tokens=max_new_tokens, beams=beams, repetition_guard=repetition_guard, vad=vad,
                   vad_options=vad_options)
    timed = bool(word_timestamps) and getattr(engine, "alignment", None) is not None
    if word_timestamps and not timed:
        logger.warning("%s %s has no word alignment: no word-timing error for it", engine.kind, engine.name)
    first_run_s = None
    clips = []
    items = dataset.clips
    if progress:
        items = tqdm(items, desc=f"{engine.kind} {engine.name}", unit="clip")
    for clip in items:
        row = {"id": clip.id, "language": clip.language, "reference": clip.text, "status": "ok"}
        clips.append(row)
        if clip.problem:
            row.update(status="problem", problem=clip.problem)
            continue
        try:
            check = check_audio(clip.audio, engine.front_end)
        except AudioError as err:
            row.update(status="problem", problem=str(err))
            continue
        row["audio_s"] = check.seconds
        if check.status == "silent":
            row.update(status="silent", hypothesis="", windows=[], processing_s=0.0)
            continue
        if warmup and first_run_s is None:
            t = time.perf_counter()
            engine.transcribe(clip.audio, clip.language, **options)
            first_run_s = time.perf_counter() - t
        t = time.perf_counter()
        try:
            result = engine.transcribe(clip.audio, clip.language, **options,
                                       **({"word_timestamps": True} if timed and clip.words else {}))
        except (AudioError, ValueError, RuntimeError) as err:
            if not type(err).__module__.startswith(__name__.split(".")[0]):  # the package's own errors
                raise
            row.update(status="problem", problem=str(err))
            continue
        row["processing_s"] = time.perf_counter() - t
        row["vad_s"] = (result.vad or {}).get("seconds", 0.0)  # the VAD pass over the clip, before its windows
        row["hypothesis"] = result.text
        row["token_ids"] = [t for w in result.windows for t in w.token_ids]
        if timed and clip.words:
            row["word_timing"] = word_timing_errors(result.words, clip.words)
        row["windows"] = [window_row(w.index, w.start_s, w.start_s + w.duration_s, w.token_ids, w.stop_reason,
                                     w.timings, engine.eos_ids) for w in result.windows]
    return {
        **engine.describe(),
        "load_s": load_s,
        "first_run_s": first_run_s,
        "rss_before_load_mb": round(rss_before, 1),
        "rss_after_load_mb": round(rss_loaded, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "options": {"max_new_tokens": max_new_tokens, "beams": beams, "repetition_guard": repetition_guard is not None},
        "vad": {"mode": vad, "on": vad_on, "options": (vad_options.to_dict() if vad_options else None) if vad_on else None},
        **summarise(clips, dataset.name),
    }


def window_row(index, start_s, end_s, token_ids, stop_reason, timings: dict, eos_ids) -> dict:
    """One window of a report's clip: times, tokens (eos excluded), stop reason, loop flag, stage timings.
    Built the same way for in-process engines and for merged device runs (`merge_engine`)."""
    return {"index": index, "start_s": round(start_s, 3), "end_s": round(end_s, 3),
            "tokens": len([x for x in token_ids if x not in eos_ids]), "stop_reason": stop_reason,
            "loop": stop_reason == StopReason.REPETITION or loop_in(token_ids, eos_ids) is not None,
            **{k: timings.get(k, 0.0) for k in STAGES}, "decoder_calls": timings.get("decoder_calls", 0),
            "encoder_wait_s": timings.get("encoder_wait_s")}


def summarise(clips: list[dict], dataset_name: str) -> dict:
    """An engine's figures from its clip rows (status ok / silent / problem): error counts per language
    after `metrics.normalise`, rates, stage totals, tokens/s, loop and truncation rates. The one scoring
    path of every row, in-process or merged."""
    scored = [c for c in clips if c["status"] in ("ok", "silent")]
    if not scored:
        raise BenchError(f"no clip of {dataset_name} could be scored ({len(clips)} problems)")
    languages = {}
    for lang in sorted({c["language"] for c in scored}):
        sel = [c for c in scored if c["language"] == lang]
        refs, hyps = [c["reference"] for c in sel], [c["hypothesis"] for c in sel]
        # rate_interval: the 95 % bootstrap interval of the rate over the clips (metrics.rate_interval)
        languages[lang] = {"clips": len(sel), **error_counts(refs, hyps, lang), "rate_interval": rate_interval(refs, hyps, lang)}
    windows = [w for c in scored for w in c.get("windows", [])]
    audio_s = sum(c.get("audio_s", 0.0) for c in scored)
    decoded_s = sum(w["end_s"] - w["start_s"] for w in windows)  # the audio the windows cover (all of it without VAD)
    processing_s = sum(c.get("processing_s", 0.0) for c in scored)
    stages = {k: sum(w[k] for w in windows) for k in STAGES}
    tokens = sum(w["tokens"] for w in windows)
    # each stage's own real-time factor (audio seconds / the stage's seconds; the decoder's: bind + prompt +
    # decode) beside the whole file's: with the encoder ahead of the decoder the stages overlap, so the whole
    # file takes less than their sum
    vad_s = sum(c.get("vad_s", 0.0) for c in scored)
    groups = {"front_end": ("features_s",), "encoder": ("encoder_s",), "decoder": ("bind_s", "prompt_s", "decode_s")}
    stage_rtfx = {"vad": audio_s / vad_s if vad_s else None,
                  **{g: (audio_s / t if (t := sum(stages[k] for k in keys)) else None) for g, keys in groups.items()}}
    waits = [w["encoder_wait_s"] for w in windows if w.get("encoder_wait_s") is not None]
    return {
        "clips_total": len(clips),
        "clips_scored": len(scored),
        "clips_silent": sum(c["status"] == "silent" for c in clips),
        "problems": [{"id": c["id"], "problem": c["problem"]} for c in clips if c["status"] == "problem"],
        "languages": languages,
        "audio_s": audio_s,
        "processing_s": processing_s,
        "rtfx": audio_s / processing_s if processing_s else float("nan"),
        "stages_s": stages,
        "vad_s": vad_s,
        "stage_rtfx": stage_rtfx,
        # the batched decoder's wait for the windows' encoder outputs (None: no batched decode)
        "encoder_wait_s": sum(waits) if waits else None,
        "decode_tokens": tokens,
        "tokens_per_s_whole": tokens / processing_s if processing_s else float("nan"),
        "tokens_per_s": tokens / (stages["prompt_s"] + stages["decode_s"]) if windows else float("nan"),
        "windows": len(windows),
        "decoded_s": decoded_s,
        "decoded_share": decoded_s / audio_s if audio_s else 0.0,
        "decoder_calls": sum(w["decoder_calls"] for w in windows),
        "ms_per_decoder_call": (1000 * (stages["prompt_s"] + stages["decode_s"]) / sum(w["decoder_calls"] for w in windows)
                                if any(w["decoder_calls"] for w in windows) else None),
        "loop_rate": sum(w["loop"] for w in windows) / len(windows) if windows else 0.0,
        "truncation_rate": (sum(w["stop_reason"] in TOKEN_LIMITS for w in windows) / len(windows)
                            if windows else 0.0),
        "word_timing": word_timing_summary(scored),
        "clips": clips,
    }


SWIFT_TOOL = "cohere-transcribe-swift bench"


def _swift_label(data: dict, clips: int, dataset_clips: int) -> str:
    bundle = data.get("bundle") or {}
    name = Path(str(bundle.get("dir") or "bundle")).name
    units = (data.get("compute_units") or {}).get("flag") or "default units"
    if data.get("runtime") == "coreml":
        device = (data.get("machine") or {}).get("device") or "device"
        label = f"swift coreml {device} ({name}, {bundle.get('precision')}, {units})"
    else:
        label = f"swift {data.get('runtime')} ({name}, {bundle.get('precision')})"
    return label + (f" [{clips}/{dataset_clips} clips]" if clips < dataset_clips else "")


def device_vad(options: dict) -> dict:
    """A device run's voice activity, as `run_engine` records it for in-process engines: the mode asked and
    whether the VAD ran (`vad_on`, the mode resolved against the bundle by the device; a run without that
    field: on only when "on" was asked). The device bench takes no --vad-* option: Silero's defaults."""
    mode = options.get("vad") or "auto"
    on = bool(options["vad_on"]) if options.get("vad_on") is not None else mode == "on"
    return {"mode": mode, "on": on, "options": VadOptions().to_dict() if on else None}


def merge_engine(path: str | os.PathLike, dataset, every_index: set[int] | None = None) -> dict:
    """An engine row from the JSON of `cohere-transcribe-swift bench` (a run on a Mac, an iOS device or,
    through the interpreter, Linux) over `dataset`: refused unless the JSON's dataset manifest sha256 is
    this dataset's. The hypotheses are scored against this dataset's references by `summarise` (the
    scoring of every row); windows are built by `window_row` from the device's token ids and timings.
    The device's load times, memory and placement are kept under "swift" and "placement". `every_index`: the
    entries of the whole manifest when `dataset` is a --limit-per-language selection (the device's other clips
    are then left out, with a warning)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise BenchError(f"--merge-engine {path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise BenchError(f"--merge-engine {path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("tool") != SWIFT_TOOL:
        raise BenchError(f"--merge-engine {path}: not the output of `{SWIFT_TOOL}` (its \"tool\" is "
                         f"{data.get('tool') if isinstance(data, dict) else None!r})")
    got = (data.get("dataset") or {}).get("manifest_sha256")
    if got != dataset.manifest_sha256:
        raise BenchError(f"--merge-engine {path}: dataset manifest sha256 mismatch: the device run read a manifest "
                         f"with sha256 {got} ({(data.get('dataset') or {}).get('manifest')}), --data {dataset.name} has "
                         f"{dataset.manifest_sha256} ({dataset.manifest_path}); rerun the device bench on the same "
                         "dataset folder")
    by_index = {c.index: c for c in dataset.clips}
    bundle = data.get("bundle") or {}
    eos = set(bundle.get("eos_token_ids") or [])
    clips, seen, outside = [], set(), 0
    for sc in data.get("clips") or []:  # matched by manifest entry (ids need not be unique), the id checked
        clip = by_index.get(sc.get("index"))
        if clip is None and sc.get("index") in (every_index or ()):
            outside += 1
            continue
        if clip is None or clip.id != sc.get("id"):
            raise BenchError(f"--merge-engine {path}: clip {sc.get('id')!r} (entry {sc.get('index')}) is not in "
                             f"{dataset.manifest_path}")
        if clip.index in seen:
            raise BenchError(f"--merge-engine {path}: entry {clip.index} ({clip.id!r}) is listed twice")
        seen.add(clip.index)
        row = {"id": clip.id, "language": clip.language, "reference": clip.text, "status": "ok"}
        clips.append(row)
        if clip.problem:  # the dataset's own verdict, as for every other engine
            row.update(status="problem", problem=clip.problem)
            continue
        if sc.get("status") not in ("ok", "silent"):
            row.update(status="problem", problem=f"device: {sc.get('problem') or sc.get('status')}")
            continue
        row["audio_s"] = float(sc.get("audio_s") or 0.0)
        if sc["status"] == "silent":
            row.update(status="silent", hypothesis="", windows=[], processing_s=0.0)
            continue
        row["processing_s"] = float(sc["processing_s"])
        row["hypothesis"] = sc["hypothesis"]
        row["token_ids"] = [t for w in sc["windows"] for t in w["token_ids"]]
        row["windows"] = [window_row(w["index"], w["start_s"], w["end_s"], w["token_ids"], w["stop_reason"], w, eos)
                          for w in sc["windows"]]
    if outside:
        logger.warning("%s: %d clip(s) of the device run are outside --limit-per-language: left out", path, outside)
    if not clips:
        raise BenchError(f"--merge-engine {path}: lists no clip of this selection of {dataset.name}")
    load, memory, options = data.get("load") or {}, data.get("memory") or {}, data.get("options") or {}
    units = data.get("compute_units") or {}
    section = {
        "kind": "swift", "name": Path(str(bundle.get("dir") or "bundle")).name, "backend": data.get("runtime"),
        "compute_units": None if data.get("runtime") != "coreml" else (  # as Transcriber.describe: None off Core ML
            units.get("flag") or f"front end {units.get('front_end')}, encoder {units.get('encoder')}, "
                                 f"decoder {units.get('decoder')}"),
        "precision": bundle.get("precision"), "model_id": bundle.get("model_id"), "capacity": bundle.get("capacity"),
        "prefill": bundle.get("prefill"),
        "load_s": load.get("cold_s"),
        "warm_load_s": load.get("warm_s"),
        "first_run_s": data.get("first_run_s"),
        "rss_before_load_mb": memory.get("before_load_mb"),
        "rss_after_load_mb": memory.get("after_load_mb"),
        "peak_rss_mb": memory.get("peak_mb"),
        "options": {"max_new_tokens": options.get("max_new_tokens"), "beams": options.get("beams", 1),
                    "repetition_guard": bool(options.get("repetition_guard"))},
        "vad": device_vad(options),
        **summarise(clips, dataset.name),
    }
    section["swift"] = {"source": str(path), "created_utc": data.get("created_utc"), "machine": data.get("machine"),
                        "load": load, "memory": memory, "options": options, "device_totals": data.get("totals"),
                        "dataset_clips": len(dataset.clips)}
    section["placement"] = data.get("placement")
    section["placement_reason"] = data.get("placement_reason")
    info = {k: bundle.get(k) for k in ("dir", "manifest_sha256", "preset", "gate", "size_mb")}
    return {"label": _swift_label(data, len(clips), len(dataset.clips)), "bundle": info, **section}


def reference_alignment(bundles, alignment_heads: str | None, lead_rows: int | None) -> tuple[tuple, int] | None:
    """The PyTorch reference's alignment heads and rows before the text: --alignment-heads (and
    --alignment-lead-rows), else the first bundle's manifest (so its words are compared on the same heads)."""
    if alignment_heads:
        return parse_heads(alignment_heads), int(lead_rows if lead_rows is not None else DEFAULT_LEAD_ROWS)
    for b in bundles or []:
        block = (Bundle.load(bundle_folders(b)).manifest.get("decoder") or {}).get("alignment")
        if block:
            return tuple(tuple(h) for h in block["heads"]), int(lead_rows if lead_rows is not None else block["lead_rows"])
    return None


def bundle_has_vad(bundle) -> bool:
    """The bundle (one folder, or several searched in order) lists a vad.mlpackage in its manifest."""
    manifest = next((d / "manifest.json" for d in bundle_folders(bundle) if (d / "manifest.json").is_file()), None)
    m = json.loads(manifest.read_text()) if manifest else {}
    return bool(m.get("vad")) and "vad" in (m.get("files") or {})


def reference_vad(vad: str, bundles) -> str:
    """The PyTorch reference's VAD mode beside `bundles`: with "auto" it runs its VAD (the same network and rule)
    when every benched bundle has one, so it decodes the windows they decode and their tokens compare alike."""
    if vad == "auto" and bundles and all(bundle_has_vad(b) for b in bundles):
        return "on"
    return vad


def run_bench(bundles, pytorch, data, *, backend="auto", compute_units="all", max_new_tokens=None, beams=1,
              repetition_guard=None, limit_per_language=None, progress=False, merge=(), alignment_heads=None,
              alignment_lead_rows=None, vad="auto", vad_options=None, decoder_batch=None,
              encoder_ahead=None) -> dict:
    """`bundles`: one entry per bundle, a folder or the list of its folders (searched in order).
    `alignment_heads` ("L.H,..."): the PyTorch reference's heads for the word-timing error (default: the first
    bundle's). `vad`: each engine's voice activity ("auto": a bundle's vad.mlpackage when it has one; the PyTorch
    reference's as `reference_vad` decides). `decoder_batch`: windows a bundle decodes at once (None: the bundle's
    batched step; 1: one at a time; `Transcriber`); `encoder_ahead`: windows encoded ahead of a batched decode (None:
    B; 0: none)."""
    if not bundles and not pytorch and not merge:
        raise BenchError("nothing to bench: give --bundle DIR[,DIR...] (repeatable: one bundle each), --pytorch MODEL and/or --merge-engine FILE")
    dataset = load_dataset(str(data), limit_per_language)
    every_index = {c.index for c in (load_dataset(str(data)) if limit_per_language else dataset).clips}
    merged = [merge_engine(m, dataset, every_index) for m in merge]  # checked before any model loads
    report = {"tool": "cohere-coreml bench", "tool_version": __version__, "tool_git_hash": git_hash(),
              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "dataset": {"name": dataset.name, "manifest": dataset.manifest_path,
                          "manifest_sha256": dataset.manifest_sha256, "clips": len(dataset.clips),
                          "languages": dataset.languages(), "word_times": any(c.words for c in dataset.clips)},
              "engines": []}
    timed = any(c.words for c in dataset.clips)  # a word-timing set: the engines' word-timing error too
    opts = dict(max_new_tokens=max_new_tokens, beams=beams, repetition_guard=repetition_guard, progress=progress,
                word_timestamps=timed, vad=vad, vad_options=vad_options)
    if pytorch:
        heads = reference_alignment(bundles, alignment_heads, alignment_lead_rows) if timed else None
        section = run_engine(lambda: PyTorchEngine(pytorch, alignment_heads=heads[0] if heads else None,
                                                   lead_rows=heads[1] if heads else DEFAULT_LEAD_ROWS),
                             dataset, **{**opts, "vad": reference_vad(vad, bundles)})
        report["engines"].append({"label": f"pytorch {Path(str(pytorch)).name}", **section})
    for b in bundles or []:
        dirs = bundle_folders(b)
        info = bundle_info(dirs)
        section = run_engine(lambda: Transcriber(dirs, backend=backend, compute_units=compute_units,
                                                 decoder_batch=decoder_batch, encoder_ahead=encoder_ahead),
                             dataset, **opts)
        label = f"{','.join(d.name for d in dirs)} ({section.get('precision')}, {section.get('backend')})"
        report["engines"].append({"label": label, "bundle": info, **section})
    for row in merged:
        if report["engines"] and row["options"] != report["engines"][0]["options"]:
            logger.warning("%s ran with %s, this run with %s: the rows are not decoded alike", row["label"],
                           row["options"], report["engines"][0]["options"])
        report["engines"].append(row)
    if pytorch:  # every bundle's (and device run's) greedy tokens next to the reference's
        for e in report["engines"][1:]:
            e["agreement"] = agreement_with(report["engines"][0], e)
    return report


# --------------------------------------------------------------------------------------------------
# `cohere-coreml bench`
# --------------------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    if args.beams < 1:
        raise BenchError(f"--beams must be >= 1, got {args.beams}")
    if args.threads:
        import torch  # heavy (see machine)

        torch.set_num_threads(args.threads)
    options = vad_options_of(args)  # bad --vad-* values: one line, before any model loads
    report = run_bench(args.bundle, args.pytorch, args.data, backend=args.backend, compute_units=args.compute_units,
                       max_new_tokens=args.max_new_tokens, beams=args.beams,
                       repetition_guard=RepetitionGuard() if args.repetition_guard else None,
                       limit_per_language=args.limit_per_language, progress=True, merge=args.merge_engine,
                       alignment_heads=args.alignment_heads, alignment_lead_rows=args.alignment_lead_rows,
                       vad=args.vad, vad_options=options, decoder_batch=args.decoder_batch,
                       encoder_ahead=args.encoder_ahead)
    paths = write_outputs(report, args.out)
    print(format_markdown(report))
    for e in report["engines"]:
        for p in e["problems"]:
            print(f"{e['label']}: clip {p['id']}: {p['problem']}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml bench`."""
    p = subparsers.add_parser(
        "bench", help="accuracy (WER/CER per language), speed by stage, memory, loops: PyTorch and bundles side by side",
        description="Run the PyTorch reference (--pytorch) and each bundle (--bundle, repeatable) over one dataset "
        "(a folder with manifest.jsonl or manifest.json: audio path, text, language), add device runs of the Swift "
        "package (--merge-engine, the JSON of `cohere-transcribe-swift bench`), and write bench.json, "
        "bench.md and bench.png into --out. WER uses the Whisper English normaliser for English and a basic "
        "normaliser otherwise; CER for ja/zh/ko. Model load and the first (warm-up) run are timed apart.",
        formatter_class=HelpFormatter)
    add_bundle_arg(p, repeatable=True, required=False)
    p.add_argument("--pytorch", default=None, help="checkpoint folder or Hub id of the PyTorch reference")
    p.add_argument("--merge-engine", action="append", default=[], metavar="FILE.json",
                   help="the JSON of `cohere-transcribe-swift bench` on the same dataset (a Mac, an iOS device, or the "
                   "interpreter): scored here like the other engines and added as a row (repeatable; refused when its "
                   "dataset manifest sha256 differs from --data's)")
    p.add_argument("--data", required=True, help="dataset folder (manifest.jsonl / manifest.json) or a HF dataset name")
    p.add_argument("--limit-per-language", type=int, default=None, help="only the first N clips per language")
    p.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"),
                   help="bundle backend: auto = Core ML when available, else the MIL interpreter (default: %(default)s)")
    p.add_argument("--compute-units", default="all", choices=("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"),
                   help="Core ML compute units (macOS) (default: %(default)s)")
    add_decoding_args(p)
    add_vad_args(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (PyTorch and the interpreter); 1 is steadier on a shared machine (default: torch's)")
    p.add_argument("--alignment-heads", default=None, metavar="L.H,...",
                   help="on a dataset with word times: the PyTorch reference's alignment heads (layer.head, 0-based) "
                   "for its word-timing error (default: the first bundle's manifest heads)")
    p.add_argument("--alignment-lead-rows", type=int, default=None, metavar="N",
                   help="with --alignment-heads: rows before the text (default: the bundle's, else 1)")
    add_decoder_batch_arg(p)
    p.add_argument("--out", default="out/bench", help="output folder (default: %(default)s)")
    p.set_defaults(func=cmd_bench)
