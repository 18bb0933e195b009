"""PyTorch greedy evaluation of a checkpoint on a manifest folder: WER per language and top-1 margins.

`evaluate_checkpoint` runs the transcriber interface (`engines.PyTorchEngine`, the same code path
as `cohere-coreml bench --pytorch`) over a dataset folder (`datasets.load_folder`) and scores it
with `metrics` (Whisper English normaliser for English, the basic one otherwise; CER for ja/zh/ko),
so its WER equals the bench's. `greedy_decode` (batched `generate()` over whole clips, no long-audio
split) is the training-time evaluation (tools/cohere_coreml_dev/train.py, tools/train/train_tiny.py); the
product's own evaluation path is the bench's (`engines`, `datasets`, `metrics`).

The margin of a generated token is the gap between the best and the second-best log-probability at
that step; a large median margin means argmax decisions survive FP16/INT8 rounding, which is what
makes token-level parity checks of exported models meaningful.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cohere_coreml.evaluation.datasets import DatasetError, load_folder
from cohere_coreml.evaluation.metrics import basic_normalise as normalise_text
from cohere_coreml.evaluation.metrics import (
    error_counts,
    rate_interval,
    ratio_interval,
    sentence_errors,
    utterance_counts,
)
from cohere_coreml.inference.engines import PyTorchEngine, features_batch
from cohere_coreml.model.audio import load_audio, log_mel
from cohere_coreml.model.tokens import decode_ids, eos_id, prompt_ids

logger = logging.getLogger(__name__)


class EvaluationError(ValueError):
    """An evaluation set is missing, empty or inconsistent."""


@dataclass
class Decoded:
    text: str
    ids: list[int]
    margins: list[float]  # top-1 minus top-2 log-prob per generated token (eos included)


def greedy_decode(
    model,
    tokenizer,
    features: list[np.ndarray],
    languages: list[str],
    *,
    punctuation: bool = True,
    max_new_tokens: int = 128,
    batch_size: int = 16,
) -> list[Decoded]:
    """Greedy `model.generate` on (n_mels, valid_frames) features, one prompt per clip's language."""
    if len(features) != len(languages):
        raise EvaluationError(f"{len(features)} feature arrays but {len(languages)} languages")
    eos = eos_id(tokenizer)
    order = np.argsort([-f.shape[1] for f in features], kind="stable")
    results: dict[int, Decoded] = {}
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = [int(i) for i in order[start : start + batch_size]]
            x, mask = features_batch([features[i] for i in idx])
            prompts = torch.tensor([prompt_ids(tokenizer, languages[i], punctuation) for i in idx], dtype=torch.long)
            gen = model.generate(
                input_features=x,
                attention_mask=mask,
                decoder_input_ids=prompts,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = gen.sequences[:, prompts.shape[1] :]  # (B, steps)
            logits = torch.stack(gen.logits, dim=1).float()  # (B, steps, V)
            logp = torch.log_softmax(logits, dim=-1)
            top2 = torch.topk(logp, 2, dim=-1).values  # (B, steps, 2)
            gaps = (top2[..., 0] - top2[..., 1]).numpy()
            for row, i in enumerate(idx):
                ids = new[row].tolist()
                n = ids.index(eos) + 1 if eos in ids else len(ids)
                results[i] = Decoded(decode_ids(tokenizer, ids[:n]), ids[:n], gaps[row, :n].tolist())
    return [results[i] for i in range(len(features))]

@dataclass
class LanguageReport:
    language: str
    clips: int
    words: int
    wer: float
    median_margin: float
    p10_margin: float
    share_under_1nat: float
    errors: list[tuple[str, str]] = field(default_factory=list)  # (reference, hypothesis) that differ
    wer_interval: list[float] = field(default_factory=list)  # 95 % bootstrap interval (metrics.rate_interval)
    # [errors, words] of each clip (metrics.utterance_counts): what a ratio's interval resamples
    utterance_counts: list[list[int]] = field(default_factory=list)


def summarise(refs: list[str], decoded: list[Decoded], languages: list[str]) -> dict[str, LanguageReport]:
    """Per language: WER (CER for ja/zh/ko) with `metrics.error_counts`, and the margins."""
    reports: dict[str, LanguageReport] = {}
    for lang in sorted(set(languages)):
        sel = [i for i, l in enumerate(languages) if l == lang]
        r = [refs[i] for i in sel]
        h = [decoded[i].text for i in sel]
        margins = np.concatenate([np.asarray(decoded[i].margins, dtype=np.float64) for i in sel] or [np.zeros(0)])
        reports[lang] = LanguageReport(
            language=lang,
            clips=len(sel),
            words=sum(len(normalise_text(x).split()) for x in r),
            wer=error_counts(r, h, lang)["rate"],
            wer_interval=rate_interval(r, h, lang),
            utterance_counts=utterance_counts(r, h, lang),
            median_margin=float(np.median(margins)) if margins.size else float("nan"),
            p10_margin=float(np.percentile(margins, 10)) if margins.size else float("nan"),
            share_under_1nat=float(np.mean(margins < 1.0)) if margins.size else float("nan"),
            errors=[(a, b) for a, b in zip(r, h) if normalise_text(a) != normalise_text(b)],
        )
    return reports


def load_eval_set(directory: str | Path, config=None, limit_per_language: int | None = None):
    """(features, texts, languages, files) of a manifest folder, via the project front end."""
    try:
        dataset = load_folder(directory, limit_per_language)
    except DatasetError as err:
        raise EvaluationError(str(err)) from None
    feats, texts, langs, files = [], [], [], []
    for clip in dataset.clips:
        if clip.problem:
            raise EvaluationError(f"{directory}: clip {clip.id}: {clip.problem}")
        f, n = log_mel(load_audio(clip.audio), config)
        feats.append(f[:, :n])
        texts.append(clip.text)
        langs.append(clip.language)
        files.append(clip.audio.name)
    return feats, texts, langs, files


def evaluate_checkpoint(
    model_dir: str | Path, data_dir: str | Path, *, limit_per_language: int | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, LanguageReport]:
    """Evaluate a checkpoint on a manifest folder through the transcriber interface
    (`cohere_coreml.inference.engines.PyTorchEngine`, greedy, one clip at a time)."""
    try:
        dataset = load_folder(data_dir, limit_per_language)
    except DatasetError as err:
        raise EvaluationError(str(err)) from None
    bad = [f"{c.id}: {c.problem}" for c in dataset.clips if c.problem]
    if bad:
        raise EvaluationError(f"{data_dir}: " + "; ".join(bad))
    engine = PyTorchEngine(model_dir, margins=True)
    decoded = [_decode(engine, clip.audio, clip.language, max_new_tokens) for clip in dataset.clips]
    return summarise([c.text for c in dataset.clips], decoded, [c.language for c in dataset.clips])


# Issue 30's targets for a default model, per language: the WER of the padded clips at most 1.5x, of the
# multi-utterance clips at most 2x the single clips' WER (the robustness set, `heldout.SUBSETS`)
MAX_RATIO = {"padded": 1.5, "multi": 2.0}


def evaluate_robustness(model_dir: str | Path, folder: str | Path, **kwargs) -> dict[str, dict[str, LanguageReport]]:
    """{subset: reports} of a robustness set's folder (`tools/data/make_heldout_set.py`: single/, padded/, multi/)."""
    from .heldout import SUBSETS, missing_subsets

    missing = missing_subsets(folder)
    if missing:
        raise EvaluationError(f"{folder}: no {', '.join(missing)}/manifest.json (not a tools/data/make_heldout_set.py folder)")
    return {name: evaluate_checkpoint(model_dir, Path(folder) / name, **kwargs) for name in SUBSETS}


def ratio_targets(robustness: dict[str, dict[str, LanguageReport]]) -> list[dict]:
    """Per target subset (MAX_RATIO) and language: its WER over the single clips', the ratio's 95 %
    bootstrap interval (`metrics.ratio_interval`, each subset's clips resampled on their own), the share of
    resamples within the target, and whether the measured WERs meet it (no error on either side does).
    Then per subset a row for all languages pooled (errors over words; "target": False, the issue sets the
    targets per language): a ratio whose interval is far narrower than one language's."""
    single = robustness.get("single", {})
    rows = []

    def pooled(counts):
        return sum(e for e, _ in counts) / max(sum(u for _, u in counts), 1)

    def row(subset, language, counts, base_counts, limit, target, wer=None, base=None):
        wer, base = pooled(counts) if wer is None else wer, pooled(base_counts) if base is None else base
        sure = ratio_interval(counts, base_counts, bound=limit)
        return {"subset": subset, "language": language, "wer": wer, "single_wer": base, "ratio": sure["ratio"],
                "interval": sure["interval"], "limit": limit, "within_bound": sure["within_bound"],
                "met": bool(wer <= limit * base + 1e-12), "target": target}  # 0 % on both sides meets it

    for subset, limit in MAX_RATIO.items():
        pairs = [(lang, report, single[lang]) for lang, report in robustness.get(subset, {}).items() if lang in single]
        rows += [row(subset, lang, report.utterance_counts, base.utterance_counts, limit, True, report.wer, base.wer)
                 for lang, report, base in pairs]
        if len(pairs) > 1:
            rows.append(row(subset, "all", [c for _, r, _ in pairs for c in r.utterance_counts],
                            [c for _, _, b in pairs for c in b.utterance_counts], limit, False))
    return rows


def format_targets(rows: list[dict]) -> str:
    """A markdown table of `ratio_targets` and a count of the (per-language) targets met."""
    lines = ["| subset | language | WER % | single WER % | ratio [95 % CI] | target | resamples within | met |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["interval"]
        no_errors = r["ratio"] != r["ratio"]  # 0 / 0
        ratio = "- (no errors)" if no_errors else f"{r['ratio']:.2f}x [{low:.2f}-{high:.2f}]".replace("infx", "inf")
        within = "-" if no_errors else f"{100 * r['within_bound']:.0f} %"
        met = ("yes" if r["met"] else "no") + ("" if r["target"] else " (pooled, not a target)")
        lines.append(f"| {r['subset']} | {r['language']} | {100 * r['wer']:.2f} | {100 * r['single_wer']:.2f} | "
                     f"{ratio} | <= {r['limit']:g}x | {within} | {met} |")
    targets = [r for r in rows if r["target"]]
    lines.append(f"\n{sum(r['met'] for r in targets)} of {len(targets)} ratio targets met.")
    return "\n".join(lines)


def template_neighbour_split(multi_dir: str | Path, reports: dict[str, LanguageReport]) -> list[dict]:
    """The multi-utterance clips' WER split by whether a clip has two neighbouring sentences of one grammar
    template (`synth.template_of`: two digit strings, two sums side by side), per language and pooled
    ("all"): {"language", "same_template": bool, "clips", "units", "errors", "wer"}. `reports` are
    `evaluate_checkpoint`'s of `multi_dir` (make_heldout_set.py's multi/, whose rows name their `sentences`);
    their `utterance_counts` follow the manifest's order within a language (a `limit_per_language` run
    scores the first clips)."""
    from .synth import template_of

    multi_rows = multi_sentence_rows(multi_dir)
    cells: dict[tuple[str, bool], list[int]] = {}
    for language, report in reports.items():
        rows = [r for r in multi_rows if r.get("language") == language][: len(report.utterance_counts)]
        if len(rows) != len(report.utterance_counts):
            raise EvaluationError(f"{multi_dir}: {len(report.utterance_counts)} scored {language} clips, "
                                  f"{len(rows)} in its manifest")
        for row, (errors, units) in zip(rows, report.utterance_counts):
            templates = [template_of(t, language) for t in row["sentences"]]
            pair = any(a is not None and a == b for a, b in zip(templates, templates[1:]))
            for key in ((language, pair), ("all", pair)):
                cell = cells.setdefault(key, [0, 0, 0])
                cell[0] += 1
                cell[1] += units
                cell[2] += errors
    order = [*sorted(reports), "all"] if len(reports) > 1 else sorted(reports)
    return [{"language": language, "same_template": pair, "clips": c[0], "units": c[1], "errors": c[2],
             "wer": c[2] / c[1] if c[1] else float("nan")}
            for language in order for pair in (True, False) if (c := cells.get((language, pair)))]


def multi_sentence_rows(multi_dir: str | Path) -> list[dict]:
    """The utterance rows of a multi-utterance folder's manifest (make_heldout_set.py's multi/), each naming
    its `sentences`; an EvaluationError naming the first row without. `template_neighbour_split` reads them;
    eval_tiny checks them before its minutes of evaluation, not after."""
    rows = [r for r in _manifest_rows(Path(multi_dir)) if isinstance(r, dict)]
    for row in rows:
        if not row.get("sentences"):
            raise EvaluationError(f"{row.get('file')}: no sentences (not a multi-utterance clip of make_heldout_set.py)")
    return rows


def format_neighbour_split(rows: list[dict]) -> str:
    lines = ["multi clips by neighbours: two sentences of one template side by side, or none",
             "| language | same-template neighbours | clips | units (normalised words) | WER % |", "|---|---|---|---|---|"]
    lines += [f"| {r['language']} | {'yes' if r['same_template'] else 'no'} | {r['clips']} | {r['units']} | "
              f"{100 * r['wer']:.2f} |" for r in rows]
    return "\n".join(lines)


def _decode(engine, audio: Path, language: str, max_new_tokens: int | None = None) -> Decoded:
    result = engine.transcribe(audio, language, max_new_tokens=max_new_tokens)
    ids = [t for w in result.windows for t in w.token_ids]
    margins = [m for w in result.windows for m in w.decoding.get("margins", [])]
    return Decoded(result.text, ids, margins)


# ---- multi-utterance clips: where the errors fall -------------------------------------------------------

def _manifest_rows(directory: Path) -> list[dict]:
    """The utterance rows of a folder's manifest.json (`synth.read_manifest`), as EvaluationErrors."""
    from .synth import SynthError, read_manifest

    try:
        manifest = read_manifest(directory)
    except (SynthError, OSError, ValueError) as err:
        raise EvaluationError(f"{directory}/manifest.json: not readable as a manifest ({err})") from None
    rows = manifest.get("utterances") if isinstance(manifest, dict) else None
    if not isinstance(rows, list):
        raise EvaluationError(f"{directory}/manifest.json: no list of utterances")
    return rows


def position_rows(multi_rows: list[dict], hypotheses: dict[str, str], alone: dict[str, str]) -> list[dict]:
    """One row per utterance of the multi-utterance clips (manifest rows with `sentences` and `sources`,
    `heldout.derive_multi`): its errors in its clip's transcript (`metrics.sentence_errors`) and in its own
    clip's (`alone`, keyed by source file), its position, its clip's utterance count.
    `hypotheses` is keyed by the multi clip's file."""
    rows = []
    for clip in multi_rows:
        sentences, sources = clip.get("sentences") or [], clip.get("sources") or []
        if len(sentences) != len(sources) or not sources:
            raise EvaluationError(f"{clip.get('file')}: {len(sentences)} sentences for {len(sources)} sources "
                                  "(a multi-utterance clip names one source clip per sentence)")
        language = clip["language"]
        in_clip = sentence_errors(sentences, hypotheses[clip["file"]], language)
        for position, (sentence, source, counts) in enumerate(zip(sentences, sources, in_clip)):
            own = sentence_errors([sentence], alone[source], language)[0]
            rows.append({"clip": clip["file"], "source": source, "language": language, "position": position,
                         "utterances": len(sources), "units": counts["units"],
                         "errors": counts["substitutions"] + counts["deletions"] + counts["insertions"],
                         "errors_alone": own["substitutions"] + own["deletions"] + own["insertions"]})
    return rows


def position_summary(rows: list[dict]) -> list[dict]:
    """Per language (and "all"), by position in the clip and by the clip's utterance count: utterances,
    units, the error rate in the clips and the rate of the same utterances alone."""
    out = []
    for language in ["all", *sorted({r["language"] for r in rows})]:
        mine = [r for r in rows if language in ("all", r["language"])]
        for key, label in (("position", "position"), ("utterances", "clip of")):
            for value in sorted({r[key] for r in mine}):
                sel = [r for r in mine if r[key] == value]
                units = sum(r["units"] for r in sel)
                out.append({"language": language, "by": f"{label} {value + 1 if key == 'position' else value}",
                            "utterances": len(sel), "units": units,
                            "rate": sum(r["errors"] for r in sel) / units if units else float("nan"),
                            "rate_alone": sum(r["errors_alone"] for r in sel) / units if units else float("nan")})
    return out


def position_breakdown(model_dir: str | Path, multi_dir: str | Path, single_dir: str | Path | None = None, *,
                       limit_per_language: int | None = None) -> list[dict]:
    """`position_rows` of a checkpoint's greedy transcripts (`PyTorchEngine`, as `evaluate_checkpoint`) of
    the clips of `multi_dir` and of their source clips in `single_dir` (default: the `single` folder
    beside `multi_dir`, where `make_heldout_set.py` puts it)."""
    multi_dir = Path(multi_dir)
    single_dir = Path(single_dir) if single_dir else multi_dir.parent / "single"
    multi = _manifest_rows(multi_dir)
    single = _manifest_rows(single_dir)
    sources = {row.get("file"): row for row in single if isinstance(row, dict)}
    counts: dict[str, int] = {}
    chosen = []
    for clip in multi:
        if not isinstance(clip, dict) or not clip.get("file") or not clip.get("language"):
            raise EvaluationError(f"{multi_dir}/manifest.json: an entry without file or language: {str(clip)[:80]}")
        missing = [s for s in clip.get("sources") or [] if s not in sources]
        if missing or not clip.get("sources"):
            raise EvaluationError(f"{multi_dir / clip.get('file', '?')}: source clip(s) {', '.join(missing) or '(none named)'} "
                                  f"not in {single_dir}/manifest.json")
        counts[clip["language"]] = counts.get(clip["language"], 0) + 1
        if limit_per_language is None or counts[clip["language"]] <= limit_per_language:
            chosen.append(clip)
    absent = [str(path) for clip in chosen for path in [multi_dir / clip["file"], *(single_dir / s for s in clip["sources"])]
              if not path.is_file()]
    if absent:
        raise EvaluationError(f"{len(absent)} audio file(s) the manifests name are missing, e.g. {absent[0]}")
    engine = PyTorchEngine(model_dir)
    hypotheses, alone = {}, {}
    for i, clip in enumerate(chosen):
        hypotheses[clip["file"]] = _decode(engine, multi_dir / clip["file"], clip["language"]).text
        for source in clip["sources"]:
            alone[source] = _decode(engine, single_dir / source, clip["language"]).text
        if (i + 1) % 20 == 0:
            logger.info("position breakdown: %d / %d multi-utterance clips", i + 1, len(chosen))
    return position_rows(chosen, hypotheses, alone)


def format_positions(summary: list[dict]) -> str:
    lines = [f"{'lang':5s} {'by':12s} {'utts':>5s} {'units':>6s} {'in clip %':>9s} {'alone %':>8s} {'ratio':>6s}"]
    for s in summary:
        ratio = s["rate"] / s["rate_alone"] if s["rate_alone"] else float("inf")
        lines.append(f"{s['language']:5s} {s['by']:12s} {s['utterances']:5d} {s['units']:6d} {100 * s['rate']:9.2f} "
                     f"{100 * s['rate_alone']:8.2f} {ratio:6.2f}")
    return "\n".join(lines)


def format_reports(reports: dict[str, LanguageReport]) -> str:
    lines = [f"{'lang':5s} {'clips':>5s} {'words':>5s} {'WER %':>6s} {'95 % CI':>13s} {'median margin':>13s} "
             f"{'p10 margin':>10s} {'<1 nat':>7s}"]
    for r in reports.values():
        ci = f"{100 * r.wer_interval[0]:.2f}-{100 * r.wer_interval[1]:.2f}" if r.wer_interval else "-"
        lines.append(
            f"{r.language:5s} {r.clips:5d} {r.words:5d} {100 * r.wer:6.2f} {ci:>13s} {r.median_margin:13.2f} "
            f"{r.p10_margin:10.2f} {100 * r.share_under_1nat:6.1f}%"
        )
    return "\n".join(lines)
