"""PyTorch greedy evaluation of a checkpoint on a manifest folder: WER per language and top-1 margins.

The margin of a generated token is the gap between the best and the second-best log-probability at
that step; a large median margin means argmax decisions survive FP16/INT8 rounding, which is what
makes token-level parity checks of exported models meaningful.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class EvaluationError(ValueError):
    """An evaluation set is missing, empty or inconsistent."""


def normalise_text(text: str) -> str:
    """Lower case, punctuation removed (Unicode category P*), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return re.sub(r"\s+", " ", text).strip()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER of normalised texts (jiwer); an empty hypothesis counts as all deletions."""
    import jiwer

    if len(references) != len(hypotheses):
        raise EvaluationError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    refs = [normalise_text(r) for r in references]
    hyps = [normalise_text(h) for h in hypotheses]
    if not any(refs):
        raise EvaluationError("all references are empty")
    # jiwer refuses empty strings; an empty hypothesis is scored against a placeholder word that
    # never matches, which counts as one substitution plus deletions (never as a correct word).
    hyps = [h if h else "<empty>" for h in hyps]
    return float(jiwer.wer(refs, hyps))


@dataclass
class Decoded:
    text: str
    ids: list[int]
    margins: list[float]  # top-1 minus top-2 log-prob per generated token (eos included)


def features_batch(features: list[np.ndarray]):
    """Pad a list of (n_mels, t) features into torch (B, T, n_mels) + attention mask (B, T)."""
    import torch

    n_mels = features[0].shape[0]
    t_max = max(f.shape[1] for f in features)
    x = torch.zeros(len(features), t_max, n_mels, dtype=torch.float32)
    mask = torch.zeros(len(features), t_max, dtype=torch.long)
    for i, f in enumerate(features):
        x[i, : f.shape[1]] = torch.from_numpy(np.ascontiguousarray(f.T, dtype=np.float32))
        mask[i, : f.shape[1]] = 1
    return x, mask


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
    import torch

    from cohere_coreml.tokens import decode_ids, eos_id, prompt_ids

    if len(features) != len(languages):
        raise EvaluationError(f"{len(features)} feature arrays but {len(languages)} languages")
    eos = eos_id(tokenizer)
    out: list[Decoded] = []
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
    out = [results[i] for i in range(len(features))]
    return out


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
