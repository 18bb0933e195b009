"""`cohere-coreml bench`: accuracy, speed by stage, memory, loops and truncations, side by side.

For each engine (the PyTorch reference and every bundle, loaded one after the other in this
process so ratios between rows are meaningful on a noisy machine) over one dataset:

    load (timed apart) -> first clip once (the warm-up, reported as first_run_s) -> every clip:
      check the audio (missing / unreadable -> a per-clip problem; digital silence -> "" with no
      model call) -> engine.transcribe -> hypothesis, windows (start/end, stop reason, timings)

Figures per engine: WER (CER for ja/zh/ko) per language after `metrics.normalise`, with
substitutions / deletions / insertions; RTFx = audio seconds / processing seconds (warm runs);
stage totals (front end, encoder, prompt, decode) and decode tokens per second; load time; peak
RSS of the process (ru_maxrss: cumulative over the engines run so far, in run order) and the
RSS after loading; loop rate (windows stopped by the repetition guard, or whose tokens end in an
n-gram run by `decoding.loop_in`) and truncation rate (windows that hit the token limit).

Writes bench.json (+ tool version, git hash, dataset and bundle manifest hashes, machine),
bench.md (a Markdown table) and bench.png (WER vs bundle size, time per stage) into --out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import resource
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STAGES = ("features_s", "encoder_s", "bind_s", "prompt_s", "decode_s")  # bind: the decoder's bind_memory


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
    import torch

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


def bundle_info(bundle_dir: str | os.PathLike) -> dict:
    """Identity of a benched bundle: manifest hash, preset, whether its quantization gate passed (or was
    skipped), size of its encoder + decoder packages."""
    import json

    d = Path(bundle_dir)
    manifest = d / "manifest.json"
    packages = [d / "encoder.mlpackage", d / "decoder.mlpackage"]
    compression = d / "compression.json"
    gate = json.loads(compression.read_text()).get("gate", {}) if compression.is_file() else {}
    return {"dir": str(d),
            "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
            "preset": json.loads(manifest.read_text()).get("preset", "f16") if manifest.is_file() else None,
            "gate": "skipped" if gate.get("skipped") else ("passed" if gate.get("passed") else
                                                             ("export" if not compression.is_file() else "unknown")),
            "size_mb": round(sum(directory_mb(p) for p in packages if p.exists()), 3)}


def agreement_with(reference: dict, engine: dict) -> dict:
    """Token agreement of `engine` with `reference` (two run_engine sections) on the clips both transcribed."""
    from .metrics import token_agreement

    ref = {c["id"]: c["token_ids"] for c in reference["clips"] if "token_ids" in c}
    pairs = [(ref[c["id"]], c["token_ids"]) for c in engine["clips"] if "token_ids" in c and c["id"] in ref]
    return {"reference": reference["label"], **token_agreement([a for a, _ in pairs], [b for _, b in pairs])}


def run_engine(make_engine, dataset, *, max_new_tokens=None, beams=1, repetition_guard=None, warmup=True,
               progress=False) -> dict:
    """Load one engine and run every clip of `dataset`; returns the engine's section of the report."""
    from .audio import AudioError
    from .decoding import loop_in
    from .longform import check_audio
    from .metrics import error_counts

    rss_before = current_rss_mb()
    t0 = time.perf_counter()
    engine = make_engine()
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_mb()
    options = dict(max_new_tokens=max_new_tokens, beams=beams, repetition_guard=repetition_guard)
    first_run_s = None
    clips = []
    items = dataset.clips
    if progress:
        from tqdm import tqdm

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
            result = engine.transcribe(clip.audio, clip.language, **options)
        except (AudioError, ValueError, RuntimeError) as err:
            if not type(err).__module__.startswith(__package__):
                raise
            row.update(status="problem", problem=str(err))
            continue
        row["processing_s"] = time.perf_counter() - t
        row["hypothesis"] = result.text
        row["token_ids"] = [t for w in result.windows for t in w.token_ids]
        row["windows"] = [
            {"index": w.index, "start_s": round(w.start_s, 3), "end_s": round(w.start_s + w.duration_s, 3),
             "tokens": len([x for x in w.token_ids if x not in engine.eos_ids]), "stop_reason": w.stop_reason,
             "loop": w.stop_reason == "repetition" or loop_in(w.token_ids, engine.eos_ids) is not None,
             **{k: w.timings.get(k, 0.0) for k in STAGES}, "decoder_calls": w.timings.get("decoder_calls", 0)}
            for w in result.windows
        ]
    scored = [c for c in clips if c["status"] in ("ok", "silent")]
    if not scored:
        raise BenchError(f"no clip of {dataset.name} could be scored ({len(clips)} problems)")
    languages = {}
    for lang in sorted({c["language"] for c in scored}):
        sel = [c for c in scored if c["language"] == lang]
        languages[lang] = {"clips": len(sel), **error_counts([c["reference"] for c in sel],
                                                             [c["hypothesis"] for c in sel], lang)}
    windows = [w for c in scored for w in c.get("windows", [])]
    audio_s = sum(c.get("audio_s", 0.0) for c in scored)
    processing_s = sum(c.get("processing_s", 0.0) for c in scored)
    stages = {k: sum(w[k] for w in windows) for k in STAGES}
    tokens = sum(w["tokens"] for w in windows)
    return {
        **engine.describe(),
        "load_s": load_s,
        "first_run_s": first_run_s,
        "rss_before_load_mb": round(rss_before, 1),
        "rss_after_load_mb": round(rss_loaded, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "options": {"max_new_tokens": max_new_tokens, "beams": beams, "repetition_guard": repetition_guard is not None},
        "clips_total": len(clips),
        "clips_scored": len(scored),
        "clips_silent": sum(c["status"] == "silent" for c in clips),
        "problems": [{"id": c["id"], "problem": c["problem"]} for c in clips if c["status"] == "problem"],
        "languages": languages,
        "audio_s": audio_s,
        "processing_s": processing_s,
        "rtfx": audio_s / processing_s if processing_s else float("nan"),
        "stages_s": stages,
        "decode_tokens": tokens,
        "tokens_per_s": tokens / (stages["prompt_s"] + stages["decode_s"]) if windows else float("nan"),
        "windows": len(windows),
        "loop_rate": sum(w["loop"] for w in windows) / len(windows) if windows else 0.0,
        "truncation_rate": (sum(w["stop_reason"] in ("capacity", "max_new_tokens") for w in windows) / len(windows)
                            if windows else 0.0),
        "clips": clips,
    }


def run_bench(bundles, pytorch, data, *, backend="auto", compute_units="all", max_new_tokens=None, beams=1,
              repetition_guard=None, limit_per_language=None, progress=False) -> dict:
    from . import __version__
    from .convert import git_hash
    from .datasets import load_dataset
    from .engines import PyTorchEngine
    from .transcribe import BundleEngine

    if not bundles and not pytorch:
        raise BenchError("nothing to bench: give --bundle DIR (repeatable) and/or --pytorch MODEL")
    dataset = load_dataset(str(data), limit_per_language)
    report = {"tool": "cohere-coreml bench", "tool_version": __version__, "tool_git_hash": git_hash(),
              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "dataset": {"name": dataset.name, "manifest": dataset.manifest_path,
                          "manifest_sha256": dataset.manifest_sha256, "clips": len(dataset.clips),
                          "languages": dataset.languages()},
              "engines": []}
    opts = dict(max_new_tokens=max_new_tokens, beams=beams, repetition_guard=repetition_guard, progress=progress)
    if pytorch:
        section = run_engine(lambda: PyTorchEngine(pytorch), dataset, **opts)
        report["engines"].append({"label": f"pytorch {Path(str(pytorch)).name}", **section})
    for b in bundles or []:
        info = bundle_info(b)
        section = run_engine(lambda: BundleEngine(b, backend=backend, compute_units=compute_units), dataset, **opts)
        label = f"{Path(b).name} ({section.get('precision')}, {section.get('backend')})"
        report["engines"].append({"label": label, "bundle": info, **section})
    if pytorch:  # every bundle's greedy tokens next to the reference's
        for e in report["engines"][1:]:
            e["agreement"] = agreement_with(report["engines"][0], e)
    return report


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def percent(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.2f}"


def format_agreement(a: dict | None) -> str:
    if not a:
        return "-"
    return (f"{a['identical_clips']}/{a['clips']}, "
            f"{a['agreeing_tokens']}/{a['baseline_tokens']}")


def format_markdown(report: dict) -> str:
    langs = sorted({l for e in report["engines"] for l in e["languages"]})
    head = ["engine", "size MB"] + [f"{l} {report['engines'][0]['languages'].get(l, {}).get('metric', 'wer').upper()} %"
                                    for l in langs]
    head += ["S/D/I", "same as reference (clips, tokens)", "loops %", "trunc %", "RTFx", "tokens/s", "load s",
             "first run s", "peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in report["engines"]:
        size = e.get("bundle", {}).get("size_mb")
        sdi = [sum(v[k] for v in e["languages"].values()) for k in ("substitutions", "deletions", "insertions")]
        cells = [e["label"], f"{size:.2f}" if size else "-"]
        cells += [percent(e["languages"].get(l, {}).get("rate")) for l in langs]
        cells += ["/".join(map(str, sdi)), format_agreement(e.get("agreement")), percent(e["loop_rate"]),
                  percent(e["truncation_rate"]), f"{e['rtfx']:.2f}",
                  f"{e['tokens_per_s']:.1f}", f"{e['load_s']:.1f}",
                  f"{e['first_run_s']:.2f}" if e["first_run_s"] is not None else "-", f"{e['peak_rss_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    stage_head = ["engine"] + [s.replace("_s", "") + " s" for s in STAGES] + ["audio s", "clips", "windows", "problems"]
    lines += ["", "| " + " | ".join(stage_head) + " |", "|" + "---|" * len(stage_head)]
    for e in report["engines"]:
        cells = [e["label"]] + [f"{e['stages_s'][s]:.2f}" for s in STAGES]
        cells += [f"{e['audio_s']:.1f}", f"{e['clips_scored']}/{e['clips_total']}", str(e["windows"]),
                  str(len(e["problems"]))]
        lines.append("| " + " | ".join(cells) + " |")
    opts = report["engines"][0]["options"] if report["engines"] else {}
    lines += ["", f"dataset `{report['dataset']['name']}` (manifest sha256 {str(report['dataset']['manifest_sha256'])[:12]}), "
              f"beams {opts.get('beams')}, max_new_tokens {opts.get('max_new_tokens')}, repetition guard "
              f"{'on' if opts.get('repetition_guard') else 'off'}; tool {report['tool_version']} "
              f"({report['tool_git_hash'][:12]}); {report['machine']['platform']}, {report['machine']['cpus']} CPUs"]
    return "\n".join(lines) + "\n"


def write_chart(report: dict, path: Path) -> Path | None:
    """bench.png: mean WER/CER over languages vs package size, and time per audio second by stage."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("no chart: matplotlib is not installed")
        return None
    engines = report["engines"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for e in engines:
        rates = [v["rate"] for v in e["languages"].values()]
        mean = 100 * sum(rates) / len(rates)
        size = e.get("bundle", {}).get("size_mb")
        if size:
            ax1.scatter([size], [mean], s=40)
            ax1.annotate(e["label"], (size, mean), textcoords="offset points", xytext=(4, 4), fontsize=8)
        else:
            ax1.axhline(mean, linestyle="--", color="grey", linewidth=1)
            ax1.annotate(f"{e['label']} (reference)", (0, mean), xycoords=("axes fraction", "data"),
                         textcoords="offset points", xytext=(4, 4), fontsize=8, color="grey")
    ax1.set_xlabel("encoder + decoder packages (MB)")
    ax1.set_ylabel("mean WER / CER over languages (%)")
    ax1.set_title("accuracy vs size")
    sizes = [e.get("bundle", {}).get("size_mb") or 0.0 for e in engines]
    ax1.set_xlim(0, 1.6 * max(sizes + [1.0]))  # room for the labels right of the points
    ax1.set_ylim(bottom=0)
    labels = [e["label"] for e in engines]
    bottom = [0.0] * len(engines)
    for stage in STAGES:
        vals = [1000 * e["stages_s"][stage] / e["audio_s"] if e["audio_s"] else 0.0 for e in engines]
        ax2.barh(labels, vals, left=bottom, label=stage.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("ms of processing per second of audio")
    ax2.set_title("time per stage (warm runs)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"cohere-coreml bench: {Path(report['dataset']['name']).name}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_outputs(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    from .convert import write_json_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json_atomic(report, out / "bench.json")}
    md = out / "bench.md"
    tmp = md.with_name(f"bench.md.tmp-{os.getpid()}")
    tmp.write_text(format_markdown(report))
    os.replace(tmp, md)
    paths["markdown"] = md
    chart = write_chart(report, out / "bench.png")
    if chart:
        paths["chart"] = chart
    return paths


# --------------------------------------------------------------------------------------------------
# `cohere-coreml bench`
# --------------------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from .decoding import RepetitionGuard

    if args.beams < 1:
        raise BenchError(f"--beams must be >= 1, got {args.beams}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run_bench(args.bundle, args.pytorch, args.data, backend=args.backend, compute_units=args.compute_units,
                       max_new_tokens=args.max_new_tokens, beams=args.beams,
                       repetition_guard=RepetitionGuard() if args.repetition_guard else None,
                       limit_per_language=args.limit_per_language, progress=True)
    paths = write_outputs(report, args.out)
    print(format_markdown(report))
    for e in report["engines"]:
        for p in e["problems"]:
            print(f"{e['label']}: clip {p['id']}: {p['problem']}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml bench`."""
    from .transcribe import add_decoding_args

    p = subparsers.add_parser(
        "bench", help="accuracy (WER/CER per language), speed by stage, memory, loops: PyTorch and bundles side by side",
        description="Run the PyTorch reference (--pytorch) and each bundle (--bundle, repeatable) over one dataset "
        "(a folder with manifest.jsonl or manifest.json: audio path, text, language) and write bench.json, "
        "bench.md and bench.png into --out. WER uses the Whisper English normaliser for English and a basic "
        "normaliser otherwise; CER for ja/zh/ko. Model load and the first (warm-up) run are timed apart.")
    p.add_argument("--bundle", action="append", default=[], help="bundle folder (repeatable)")
    p.add_argument("--pytorch", default=None, help="checkpoint folder or Hub id of the PyTorch reference")
    p.add_argument("--data", required=True, help="dataset folder (manifest.jsonl / manifest.json) or a HF dataset name")
    p.add_argument("--limit-per-language", type=int, default=None, help="only the first N clips per language")
    p.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"),
                   help="bundle backend: auto = Core ML when available, else the MIL interpreter (default: %(default)s)")
    p.add_argument("--compute-units", default="all", choices=("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"),
                   help="Core ML compute units (macOS) (default: %(default)s)")
    add_decoding_args(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (PyTorch and the interpreter); 1 is steadier on a shared machine (default: torch's)")
    p.add_argument("--out", default="out/bench", help="output folder (default: %(default)s)")
    p.set_defaults(func=cmd_bench)
