"""PyTorch greedy evaluation of a checkpoint on a manifest folder: WER per language and top-1 margins.

The margin of a generated token is the gap between the best and the second-best log-probability at
that step; a large median margin means argmax decisions survive FP16/INT8 rounding, which is what
makes token-level parity checks of exported models meaningful.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cohere_coreml.scoring import (  # noqa: F401 (one definition, shared with the quantization gate)
    Decoded,
    EvaluationError,
    features_batch,
    greedy_decode,
    normalise_text,
    word_error_rate,
)

logger = logging.getLogger(__name__)


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


def summarise(refs: list[str], decoded: list[Decoded], languages: list[str]) -> dict[str, LanguageReport]:
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
            wer=word_error_rate(r, h),
            median_margin=float(np.median(margins)) if margins.size else float("nan"),
            p10_margin=float(np.percentile(margins, 10)) if margins.size else float("nan"),
            share_under_1nat=float(np.mean(margins < 1.0)) if margins.size else float("nan"),
            errors=[(a, b) for a, b in zip(r, h) if normalise_text(a) != normalise_text(b)],
        )
    return reports


def load_eval_set(directory: str | Path, config=None, limit_per_language: int | None = None):
    """(features, n_valid, texts, languages, files) of a manifest folder, via the project front end."""
    from cohere_coreml.audio import load_audio, log_mel
    from .synth import read_manifest

    directory = Path(directory)
    manifest = read_manifest(directory)
    utts = manifest.get("utterances")
    if not utts:
        raise EvaluationError(f"{directory}/manifest.json has no utterances")
    counts: dict[str, int] = {}
    feats, texts, langs, files = [], [], [], []
    for u in utts:
        if limit_per_language is not None and counts.get(u["language"], 0) >= limit_per_language:
            continue
        counts[u["language"]] = counts.get(u["language"], 0) + 1
        f, n = log_mel(load_audio(directory / u["file"]), config)
        feats.append(f[:, :n])
        texts.append(u["text"])
        langs.append(u["language"])
        files.append(u["file"])
    return feats, texts, langs, files


def evaluate_checkpoint(
    model_dir: str | Path, data_dir: str | Path, *, limit_per_language: int | None = None, batch_size: int = 16
) -> dict[str, LanguageReport]:
    """Load a checkpoint with `load_reference` and evaluate it on a manifest folder."""
    from cohere_coreml.audio import FrontEndConfig
    from cohere_coreml.checkpoint import load_reference

    model, processor = load_reference(model_dir)
    config = FrontEndConfig.from_processor(processor, dither=0.0)
    feats, texts, langs, _ = load_eval_set(data_dir, config, limit_per_language)
    decoded = greedy_decode(model, processor.tokenizer, feats, langs, batch_size=batch_size)
    return summarise(texts, decoded, langs)


def format_reports(reports: dict[str, LanguageReport]) -> str:
    lines = [f"{'lang':5s} {'clips':>5s} {'words':>5s} {'WER %':>6s} {'median margin':>13s} {'p10 margin':>10s} {'<1 nat':>7s}"]
    for r in reports.values():
        lines.append(
            f"{r.language:5s} {r.clips:5d} {r.words:5d} {100 * r.wer:6.2f} {r.median_margin:13.2f} "
            f"{r.p10_margin:10.2f} {100 * r.share_under_1nat:6.1f}%"
        )
    return "\n".join(lines)
