"""Accuracy metrics: text normalisers, WER / CER with substitutions, deletions, insertions (jiwer).

Normalisers (applied to reference and hypothesis alike):
* English: the Whisper English normaliser `transformers` ships (`EnglishTextNormalizer`: lower
  case, brackets and fillers removed, numbers and spellings standardised), with an empty
  British-to-American spelling table (the table lives in Whisper checkpoints, not in the library).
* every other language ("basic", `basic_normalise`): Unicode NFKC, lower case, every punctuation
  character (Unicode category P*) replaced by a space, whitespace collapsed. Accents are kept.
Character error rate (CER) instead of WER for ja, zh, ko (no word spaces): computed on the
basic-normalised text with all whitespace removed.
"""

from __future__ import annotations

import functools
import re
import unicodedata

CER_LANGUAGES = frozenset({"ja", "zh", "ko"})


def basic_normalise(text: str) -> str:
    """Unicode NFKC, lower case, punctuation removed (Unicode category P*), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=1)
def _english():
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer  # heavy: English only

    return EnglishTextNormalizer({})


def normaliser_name(language: str | None) -> str:
    return "whisper-english" if language == "en" else "basic"


def normalise(text: str, language: str | None) -> str:
    if language == "en":
        return re.sub(r"\s+", " ", _english()(text)).strip()
    out = basic_normalise(text)
    return out.replace(" ", "") if language in CER_LANGUAGES else out


def error_counts(references: list[str], hypotheses: list[str], language: str | None) -> dict:
    """{"metric": "wer"|"cer", "rate", "substitutions", "deletions", "insertions", "hits", "units"}.

    Pairs whose normalised reference is empty are skipped (nothing to score against); an empty
    hypothesis counts as all deletions.
    """
    import jiwer  # scoring only: importing the package must not load jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    pairs = [(normalise(r, language), normalise(h, language)) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r]
    metric = "cer" if language in CER_LANGUAGES else "wer"
    counts = {"substitutions": 0, "deletions": 0, "insertions": 0, "hits": 0}
    for ref, hyp in pairs:
        if not hyp:
            units = len(ref) if metric == "cer" else len(ref.split())
            counts["deletions"] += units
            continue
        out = jiwer.process_characters(ref, hyp) if metric == "cer" else jiwer.process_words(ref, hyp)
        for key in counts:
            counts[key] += int(getattr(out, key))
    units = counts["substitutions"] + counts["deletions"] + counts["hits"]
    errors = counts["substitutions"] + counts["deletions"] + counts["insertions"]
    return {"metric": metric, "normaliser": normaliser_name(language), "rate": errors / units if units else float("nan"),
            **counts, "units": units, "scored": len(pairs)}


def token_agreement(baseline: list[list[int]], produced: list[list[int]]) -> dict:
    """How far two engines' greedy token ids agree, clip by clip (the same clips in the same order):
    clips whose ids are identical, and baseline tokens matched at the same position."""
    if len(baseline) != len(produced):
        raise ValueError(f"token agreement needs the same clips: {len(baseline)} vs {len(produced)}")
    return {"clips": len(baseline), "identical_clips": sum(a == b for a, b in zip(baseline, produced)),
            "baseline_tokens": sum(len(a) for a in baseline),
            "agreeing_tokens": sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(baseline, produced))}
