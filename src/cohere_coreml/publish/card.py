"""A published bundle's model card (README.md, from its manifest, gate reports and `bench` figures)
and example_inference.py (package data copied into the bundle).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from ..bundle import ane_check
from ..bundle.manifest import MANIFEST_NAME
from ..export.gate import HELDOUT_COMPONENT
from ..storage.integrity import file_table

README = "README.md"
EXAMPLE = "example_inference.py"
PIPELINE_TAG = "automatic-speech-recognition"


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def presets_table(bench: dict) -> list[str]:
    """Markdown lines: every engine of a `cohere-coreml bench` report (PyTorch and bundles of several
    presets on one dataset): WER/CER per language and greedy tokens identical to the reference."""
    from ..evaluation.bench_report import format_agreement, percent  # the table cells bench.md uses

    engines = bench.get("engines", [])
    langs = sorted({lang for e in engines for lang in e["languages"]})
    metric = {lang: next(e["languages"][lang].get("metric", "wer") for e in engines if lang in e["languages"])
              for lang in langs}
    lines = [f"## Presets compared (`cohere-coreml bench`, dataset `{Path(bench['dataset']['name']).name}`, "
             f"{bench['dataset']['clips']} clips)", "",
             "| engine | preset | gate | encoder + decoder MB | "
             + " | ".join(f"{lang} {metric[lang].upper()} %" for lang in langs)
             + " | identical to the reference (clips, tokens) |",
             "|" + "---|" * (5 + len(langs))]
    for e in engines:
        b = e.get("bundle") or {}
        lines.append(f"| {e['label']} | {b.get('preset', '-')} | {b.get('gate', '-')} | "
                     f"{b['size_mb']:.2f} | " if b else f"| {e['label']} | - | - | - | ")
        lines[-1] += " | ".join(percent(e["languages"].get(lang, {}).get("rate")) for lang in langs)
        lines[-1] += f" | {format_agreement(e.get('agreement')) if b else 'reference'} |"
    skipped = any((e.get("bundle") or {}).get("gate") == "skipped" for e in engines)
    lines += ["", ("Gate `skipped`: built with `--skip-gate`, not verified by its gate (measured for comparison, not "
                   "for use). " if skipped else "")
              + f"Tool {bench.get('tool_version')} ({str(bench.get('tool_git_hash'))[:12]}), {bench.get('created_utc')}."]
    return lines


def python_usage() -> list[str]:
    """The model card's Python section: the bundle's own `example_inference.py` (package data,
    `example_source`), which needs numpy, soundfile and coremltools only."""
    return [
        f"Python (macOS 15+, Core ML): [`{EXAMPLE}`]({EXAMPLE}) in this folder transcribes a 16 kHz audio file "
        "with this folder's packages (front end, encoder, decoder: greedy, long audio split into windows); "
        "it needs numpy, soundfile and coremltools only. Read it to port the loop.", "", "```bash",
        "pip install numpy soundfile coremltools", f"python {EXAMPLE} audio.wav --language en   # --json: token ids",
        "```"]


def swift_usage(folder: str) -> list[str]:
    """The model card's Swift section: the package `CohereTranscribe` (Package.swift of cohere-coreml)
    downloads this folder of the repository, checks every file against the manifest's checksums, and
    transcribes files or streams their windows."""
    return [
        "Swift (macOS 15 / iOS 18): the package `CohereTranscribe` of cohere-transcribe-coreml "
        "(Xcode: File > Add Package Dependencies; or `.package(url: \"https://github.com/<org>/cohere-transcribe-coreml\", "
        "branch: \"main\")` and the product `CohereTranscribe`):", "", "```swift", "import CohereTranscribe", "",
        "// download this folder once into Application Support (resumable; every file's size and sha256",
        "// checked against manifest.json before the bundle is used)",
        "let downloader = BundleDownloader(repoId: \"<this repo id>\")",
        f"let bundle = try await downloader.download(folder: \"{folder}\") {{ progress in print(progress.fraction) }}",
        "", "// first launch compiles the packages for the device (minutes on the Neural Engine); later",
        "// launches load the compiled models from Caches",
        "let transcriber = try await CohereTranscriber(bundle: bundle)", "try await transcriber.prewarm()",
        "let result = try await transcriber.transcribe(contentsOf: audioURL, language: \"en\")", "print(result.text)", "",
        "// long files: each 35 s window as soon as it is decoded (cancel the task to stop)",
        "for try await window in transcriber.windows(contentsOf: audioURL, language: \"en\") {",
        "    print(window.startSeconds, window.text)", "}", "```", "",
        "The decoding loop itself (for a port without the package) is in the manifest's documentation "
        "(`docs/bundle.md` of cohere-transcribe-coreml)."]


def activations_note(root: Path) -> str:
    """"fp16 activations", or which components compute with int8 activations (W8A8: compression.json's
    per-component `activations` section)."""
    report = root / "compression.json"
    sections = json.loads(report.read_text()).get("components", {}) if report.is_file() else {}
    int8 = [comp for comp, sec in sections.items() if (sec.get("activations") or {}).get("dtype") == "int8"]
    return f"int8 activations in the {' and '.join(int8)} (W8A8), fp16 elsewhere" if int8 else "fp16 activations"


def low_rank_note(root: Path) -> str:
    """The card's words for a low-rank encoder (preset `lowrank`, or a bundle compressed from one:
    compression.json's `source_compression`), which changes what the encoder computes, not only its
    precision; "" for any other bundle."""
    report = root / "compression.json"
    if not report.is_file():
        return ""
    data = json.loads(report.read_text())
    lowrank = (data.get("components", {}).get("encoder", {}).get("lowrank")
               or data.get("source_compression", {}).get("components", {}).get("encoder", {}).get("lowrank"))
    if not lowrank:
        return ""
    params = lowrank.get("encoder_parameters", {})
    step = "" if data.get("preset") in ("lowrank", "q8-lowrank") else ", after a low-rank encoder (preset `lowrank`)"
    return (f"{step}; the encoder's linears are low-rank factorisations (LiteASR: PCA of calibration activations), "
            f"{params.get('before', 0):,} -> {params.get('after', 0):,} encoder parameters")


def word_timings_section(manifest: dict) -> list[str]:
    """The card's word-timing section: the bundle's alignment heads and their error on the calibration set
    (manifest `decoder.alignment`, measured at export), or why the bundle has none (`alignment_note`)."""
    decoder = manifest.get("decoder") or {}
    lines = ["## Word timings", ""]
    alignment = decoder.get("alignment")
    if not alignment:
        note = decoder.get("alignment_note") or "this bundle was exported without alignment heads"
        return [*lines, f"Not available: {note}. `transcribe --word-timestamps` and `--format srt|vtt` need them "
                        "(docs/word-timings.md)."]
    heads = ", ".join(f"{layer}.{head}" for layer, head in alignment["heads"])
    lines += [f"Each word's start and end come from the decoder's cross-attention on heads {heads} (layer.head), "
              f"{alignment['lead_rows']} row(s) before the text, one `{alignment['function']}` call per window "
              "(`transcribe --word-timestamps`, `--format srt|vtt`; Swift `TranscriptionResult.words`)."]
    cal = alignment.get("calibration")
    if cal:
        lines += ["", "| calibration set | clips | words timed | median abs start error | p90 | naive baseline median |",
                  "|---|---|---|---|---|---|",
                  f"| `{cal['set']}` | {cal['clips']} | {cal['words']} | {1000 * cal['median_s']:.0f} ms | "
                  f"{1000 * cal['p90_s']:.0f} ms | {1000 * cal['baseline_median_s']:.0f} ms |", "",
                  "Measured at export through the PyTorch reference on synthetic speech whose word times come from the "
                  "synthesizer (the heads are chosen on the same clips). The baseline spreads the words by characters "
                  "between the true first start and last end."]
    return lines


def model_card(bundle_dir: str | os.PathLike, bench: dict | None = None, manifest: dict | None = None) -> str:
    """README.md of a bundle: Hub metadata header, files and sizes, gate figures, usage; with a
    `cohere-coreml bench` report, the presets compared on its dataset. `manifest`: the manifest to
    describe (default: the bundle's manifest.json). The card never lists itself, so it depends only on
    the other files: finalizing twice, or again after an interruption, writes the same card."""
    root = Path(bundle_dir)
    m = manifest if manifest is not None else json.loads((root / MANIFEST_NAME).read_text())
    preset = m.get("preset") or ("f16" if not (root / "compression.json").is_file() else "unknown")
    languages = sorted(m.get("languages", {}))
    header = [
        "---",
        "license: apache-2.0",
        "language:", *[f"- {lang}" for lang in languages],
        f"pipeline_tag: {PIPELINE_TAG}",
        "library_name: coreml",
        *([f"base_model: {m['base_model']}"] if m.get("base_model") else []),
        "tags:", "- coreml", "- core-ml", "- apple-neural-engine", "- speech-recognition", "- cohere-transcribe",
        f"- {preset}",
        "---",
    ]
    sizes = {}
    for rel, info in file_table(root).items():
        if rel == README:
            continue
        top = rel.split("/", 1)[0]
        sizes[top] = sizes.get(top, 0) + info["size"]
    name = m.get("base_model") or m.get("model_id") or "model"
    revision = f" (revision `{m['revision']}`)" if m.get("revision") else ""
    lines = [*header, "", f"# {name} for Core ML ({preset})", "",
             f"Core ML bundle of `{name}`{revision} made by cohere-coreml "
             f"{m.get('tool_version')} (`{m.get('tool_git_hash')}`): "
             + ("front end (16 kHz samples -> log-mel features, fp32, CPU/GPU) + " if m.get("frontend") else "")
             + "encoder + stateful decoder (KV cache in Core ML "
             "state)" + (" + Silero VAD (speech probability per 32 ms chunk)" if m.get("vad") else "")
             + f", {activations_note(root)}" + ("" if preset == "f16" else f", weights compressed with preset `{preset}`")
             + low_rank_note(root) + ".",
             "", "## Files", "", "| file | size |", "|---|---|"]
    lines += [f"| `{name}` | {_mb(n)} |" for name, n in sorted(sizes.items())]
    lines += ["", f"Total: {_mb(sum(sizes.values()))}. Every file's sha256 is in `manifest.json` "
              "(`checksums`); `cohere-coreml bundle check DIR` verifies them.", ""]
    lines += ["## Parity (measured at build time, through the project's runtime)", "",
              "| check | reference | figure | threshold | passed |", "|---|---|---|---|---|"]
    fe = _load(root / "frontend.parity.json")  # the front end is never compressed: its f16 export's gate
    if fe and not fe.get("skipped"):
        worst = [w for w in [fe.get("worst"), *(f.get("worst") for f in fe.get("functions", {}).values())] if w]
        signal = [w["signal"] for w in worst if "signal" in w]
        if signal:
            lines.append(f"| front-end features (speech), max abs diff / PSNR | audio.log_mel | "
                         f"{max(w['max_abs_diff'] for w in signal):.2e} / "
                         f"{min(float(w['psnr_db']) for w in signal):.1f} dB | "
                         f"{fe.get('budgets', {}).get('signal', {}).get('max_abs_diff')} / "
                         f"{fe.get('budgets', {}).get('signal', {}).get('min_psnr_db')} dB | {fe.get('passed')} |")
    vad = (m.get("vad") or {}).get("parity")  # never compressed: its export's gate figures
    if vad:
        lines.append(f"| VAD speech probability per chunk, max abs diff; speech segments | silero-vad's own model | "
                     f"{vad['max_abs_diff']:.2e}; {'identical' if vad['segments_identical'] else 'differ'} | "
                     f"{vad['max_abs_diff_bound']}; identical | {vad['segments_identical']} |")
    for comp in ("encoder", "decoder"):
        r = _load(root / f"{comp}.parity.json")
        if not r:
            continue
        ref = r.get("reference", "PyTorch")
        if r.get("skipped"):
            lines.append(f"| {comp} | {ref} | gate skipped at build time | | {r.get('passed')} |")
            continue
        if "mean_kl" in r:
            lines.append(f"| {comp} log-prob PSNR / mean KL | {ref} | {float(r['worst_psnr_db']):.1f} dB / "
                         f"{float(r['mean_kl']):.2e} | {r.get('min_psnr_db', r.get('min_psnr_db_required'))} dB / "
                         f"{r.get('max_mean_kl', r.get('max_kl_allowed'))} | {r.get('passed')} |")
        else:
            # a multifunction package (length buckets) has one report per function: the worst one
            functions = list(r.get("functions", {}).values())
            worst = r.get("worst_psnr_db")
            worst = worst if worst is not None else min(
                (float(f["worst_psnr_db"]) for f in functions), default=float("nan"))
            need = r.get("min_psnr_db", max((f.get("min_psnr_db", 0.0) for f in functions), default=""))
            lines.append(f"| {comp} output PSNR | {ref} | {float(worst):.1f} dB | {need} dB | {r.get('passed')} |")
        if "abs_error_nats" in r:
            e, q = r["abs_error_nats"], r["eos_error_nats"]
            lines.append(f"| {comp} log-prob error (top-{r['top_k']} tokens), nats | f16 decoder | median "
                         f"{e['median']:.3g}, p99 {e['p99']:.3g}, max {e['max']:.3g}; eos max {q['max']:.3g} | | |")
    h = _load(root / f"{HELDOUT_COMPONENT}.parity.json")
    if h and not h.get("skipped"):
        lines += ["", "## Held-out WER (measured at build time)", "",
                  f"| set | clips | WER ({h['baseline']}) | WER (this bundle) | identical token sequences |",
                  "|---|---|---|---|---|",
                  f"| {h.get('eval_set', 'held-out')} | {h['clips']} | {100 * h['wer_baseline']:.2f} % | "
                  f"{100 * h['wer']:.2f} % | {h['identical_clips']}/{h['clips']} |"]
        lines += [f"| {h.get('eval_set', 'held-out')}, {lang} ({v['metric'].upper()}) | {v['clips']} | "
                  f"{100 * v['baseline']:.2f} % | {100 * v['rate']:.2f} % | {v['identical_clips']}/{v['clips']} |"
                  for lang, v in h.get("languages", {}).items()]
        if h.get("verdict"):  # the task verdict (docs/quantization.md), the figure that decided it
            said = ("undecided, built with `--accept-undecided` (the set is too small to show the bound kept)"
                    if h.get("accepted_undecided") else h["verdict"])
            lines += ["", f"Task verdict: {said}, on {h.get('deciding_figure', '-')}."]
    else:
        lines += ["", "Held-out WER: not measured for this bundle."]
    if bench:
        lines += ["", *presets_table(bench)]
    if m.get("decoder"):
        lines += ["", *word_timings_section(m)]
    ane = ane_check.read_summary(root)
    if ane:
        lines += ["", "## Neural Engine check (static, `cohere-coreml ane-check`)", "",
                  f"`{ane}`", "",
                  f"Every program's ops against the published Neural Engine rules, read from the packages at build "
                  f"time (`{ane_check.REPORT_FILE}`: each finding with its rule and source). A prediction, not a "
                  "measurement: Core ML decides the placement on the device."]
    min_os = m.get("min_os") or {}
    lines += ["", "## Requirements", "",
              f"iOS {min_os.get('iOS', '18.0')}+ / macOS {min_os.get('macOS', '15.0')}+ (stateful ML programs); Apple "
              "silicon recommended (Neural Engine). The first Neural Engine load compiles the model and can take "
              "minutes; later loads use the cache.", "",
              "## Use it", "", *python_usage(), "", *swift_usage(preset if preset != "unknown" else root.name), ""]
    return "\n".join(lines)


def example_source() -> str:
    """The standalone example every bundle ships (package data `cohere_coreml/data/example_inference.py`:
    numpy + soundfile + coremltools, the bundle's front-end, encoder and decoder packages)."""
    return resources.files("cohere_coreml").joinpath("data", EXAMPLE).read_text(encoding="utf-8")
