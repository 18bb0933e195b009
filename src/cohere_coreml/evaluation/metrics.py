"""Accuracy metrics: text normalisers, WER / CER with substitutions, deletions, insertions (jiwer).

Normalisers (applied to reference and hypothesis alike):
* English: the Whisper English normaliser `transformers` ships (`EnglishTextNormalizer`: lower
  case, brackets and fillers removed, numbers and spellings standardised), with an empty
  British-to-American spelling table (the table lives in Whisper checkpoints, not in the library).
* every other language ("basic", `basic_normalise`): Unicode NFKC, lower case, every punctuation
  character (Unicode category P*) replaced by a space, whitespace collapsed. Accents are kept.
Character error rate (CER) instead of WER for ja, zh, ko (no word spaces): computed on the
basic-normalised text with all whitespace removed.

Confidence intervals (`rate_interval`, `increase_interval`): percentile bootstrap over utterances
(resampled with replacement, the rate re-pooled as errors / reference units); an increase between
two engines on the same utterances is resampled paired (the same draw for both sides).
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


def utterance_errors(references: list[str], hypotheses: list[str], language: str | None) -> dict:
    """`error_counts` per pair: {"metric", "normaliser", "pairs": [(index, counts dict, units)]} of the
    scored pairs (normalised reference not empty; an empty hypothesis is all deletions)."""
    import jiwer  # scoring only: importing the package must not load jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    metric = "cer" if language in CER_LANGUAGES else "wer"
    pairs = []
    for i, (r, h) in enumerate(zip(references, hypotheses)):
        ref, hyp = normalise(r, language), normalise(h, language)
        if not ref:
            continue
        if not hyp:
            units = len(ref) if metric == "cer" else len(ref.split())
            counts = {"substitutions": 0, "deletions": units, "insertions": 0, "hits": 0}
        else:
            out = jiwer.process_characters(ref, hyp) if metric == "cer" else jiwer.process_words(ref, hyp)
            counts = {key: int(getattr(out, key)) for key in ("substitutions", "deletions", "insertions", "hits")}
        pairs.append((i, counts, counts["substitutions"] + counts["deletions"] + counts["hits"]))
    return {"metric": metric, "normaliser": normaliser_name(language), "pairs": pairs}


_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")


def _units(text: str, language: str | None, metric: str) -> list[str]:
    """Normalised units (words, or characters for CER) of `text`, each sentence normalised alone: the
    English normaliser joins number words across a sentence end ("at two. Three." -> "at 23")."""
    pieces = [normalise(p, language) for p in _SENTENCE_END.split(text.strip())]
    return [u for p in pieces for u in (list(p) if metric == "cer" else p.split())]


def sentence_errors(sentences: list[str], hypothesis: str, language: str | None) -> list[dict]:
    """One hypothesis of a clip of several sentences, its errors attributed to the sentences:
    [{"substitutions", "deletions", "insertions", "hits", "units"}] per sentence, in order.

    The sentences' normalised units (each sentence normalised alone, as is each sentence of the
    hypothesis; words, characters for ja/zh/ko) are aligned as one sequence to the hypothesis's (jiwer);
    a substitution or deletion belongs to the sentence of its reference unit, an insertion to the
    sentence of the reference unit before it (the first sentence when it comes first). A hypothesis that
    skips a sentence costs that sentence its units as deletions. Where alignments of the same cost
    differ (a sentence said twice, next to one of the same shape), jiwer's choice decides; the sums
    are this alignment's counts either way (`error_counts` of the joined sentences, except in English,
    whose normaliser, given the joined text, joins number words across the sentence ends)."""
    import jiwer

    metric = "cer" if language in CER_LANGUAGES else "wer"
    refs = [_units(s, language, metric) for s in sentences]
    owner = [i for i, r in enumerate(refs) for _ in r]
    ref, hyp = [u for r in refs for u in r], _units(hypothesis, language, metric)
    out = [{"substitutions": 0, "deletions": 0, "insertions": 0, "hits": 0, "units": len(r)} for r in refs]
    if not ref:
        return out
    if not hyp:
        for row in out:
            row["deletions"] = row["units"]
        return out
    # jiwer joins on spaces: characters and words alike become one "word" each (no unit holds a space)
    alignment = jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]
    for chunk in alignment:
        if chunk.type == "insert":
            out[owner[max(chunk.ref_start_idx - 1, 0)]]["insertions"] += chunk.hyp_end_idx - chunk.hyp_start_idx
            continue
        key = {"equal": "hits", "substitute": "substitutions", "delete": "deletions"}[chunk.type]
        for j in range(chunk.ref_start_idx, chunk.ref_end_idx):
            out[owner[j]][key] += 1
    return out


def error_counts(references: list[str], hypotheses: list[str], language: str | None) -> dict:
    """{"metric": "wer"|"cer", "rate", "substitutions", "deletions", "insertions", "hits", "units"}.

    Pairs whose normalised reference is empty are skipped (nothing to score against); an empty
    hypothesis counts as all deletions.
    """
    per = utterance_errors(references, hypotheses, language)
    counts = {key: sum(c[key] for _, c, _ in per["pairs"]) for key in ("substitutions", "deletions", "insertions", "hits")}
    units = counts["substitutions"] + counts["deletions"] + counts["hits"]
    errors = counts["substitutions"] + counts["deletions"] + counts["insertions"]
    return {"metric": per["metric"], "normaliser": per["normaliser"], "rate": errors / units if units else float("nan"),
            **counts, "units": units, "scored": len(per["pairs"])}


BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_LEVEL = 0.95


def _errors_units(per: dict):
    import numpy as np

    errors = np.array([c["substitutions"] + c["deletions"] + c["insertions"] for _, c, _ in per["pairs"]], dtype=np.int64)
    units = np.array([u for _, _, u in per["pairs"]], dtype=np.int64)
    return errors, units


def _resampled_rates(errors, units, draws):
    import numpy as np

    total = units[draws].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, errors[draws].sum(axis=1) / np.maximum(total, 1), np.nan)


def _draws(n: int, samples: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def _percentiles(values, level: float) -> list[float]:
    import numpy as np

    values = values[~np.isnan(values)]
    if not values.size:
        return [float("nan"), float("nan")]
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def rate_interval(references: list[str], hypotheses: list[str], language: str | None, *,
                  samples: int = BOOTSTRAP_SAMPLES, level: float = BOOTSTRAP_LEVEL, seed: int = 0) -> list[float]:
    """[low, high]: the `level` bootstrap interval of `error_counts(...)["rate"]` over utterances
    (nan, nan without a scored pair)."""
    errors, units = _errors_units(utterance_errors(references, hypotheses, language))
    if not errors.size:
        return [float("nan"), float("nan")]
    return _percentiles(_resampled_rates(errors, units, _draws(errors.size, samples, seed)), level)


def increase_interval(references: list[str], baseline: list[str], produced: list[str], language: str | None, *,
                      bound: float | None = None, samples: int = BOOTSTRAP_SAMPLES, level: float = BOOTSTRAP_LEVEL,
                      seed: int = 0) -> dict:
    """How sure a rate increase (produced - baseline, same references) is: {"interval": [low, high]}, the
    paired bootstrap's `level` interval, and with `bound` "within_bound": the share of resamples whose
    increase is at most `bound` (how often the same verdict would come out on another draw of utterances)."""
    import numpy as np

    base = _errors_units(utterance_errors(references, baseline, language))
    mine = _errors_units(utterance_errors(references, produced, language))
    if not base[0].size:
        return {"interval": [float("nan"), float("nan")], **({"within_bound": float("nan")} if bound is not None else {})}
    draws = _draws(base[0].size, samples, seed)
    increase = _resampled_rates(*mine, draws) - _resampled_rates(*base, draws)
    out = {"interval": _percentiles(increase, level), "samples": samples, "level": level}
    if bound is not None:
        valid = increase[~np.isnan(increase)]
        out["within_bound"] = float(np.mean(valid <= bound + 1e-12)) if valid.size else float("nan")
    return out


def utterance_counts(references: list[str], hypotheses: list[str], language: str | None) -> list[list[int]]:
    """[errors, reference units] of each scored pair (`utterance_errors`): what `ratio_interval` resamples."""
    errors, units = _errors_units(utterance_errors(references, hypotheses, language))
    return [[int(e), int(u)] for e, u in zip(errors, units)]


def _ratio(num_errors, num_units, den_errors, den_units):
    """Rate over rate, elementwise: inf where only the denominator's rate is 0, nan where both are."""
    import numpy as np

    with np.errstate(invalid="ignore", divide="ignore"):
        num = np.where(num_units > 0, num_errors / np.maximum(num_units, 1), np.nan)
        den = np.where(den_units > 0, den_errors / np.maximum(den_units, 1), np.nan)
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, np.nan))


def ratio_interval(numerator: list[list[int]], denominator: list[list[int]], *, bound: float | None = None,
                   samples: int = BOOTSTRAP_SAMPLES, level: float = BOOTSTRAP_LEVEL, seed: int = 0) -> dict:
    """How sure a ratio of two rates measured on different clips is (the WER of padded or multi-utterance
    clips over the single clips'): `numerator`, `denominator` are `utterance_counts` lists, each resampled
    on its own (unpaired: its clips need not match the other side's). {"ratio", "interval": [low, high],
    the `level` bootstrap interval} and with `bound` "within_bound", the share of resamples whose ratio is
    at most `bound`. A denominator rate of 0 gives an infinite ratio (nan when both are 0, left out)."""
    import numpy as np

    num = np.asarray(numerator, dtype=np.int64).reshape(-1, 2)
    den = np.asarray(denominator, dtype=np.int64).reshape(-1, 2)
    ratio = float(_ratio(num[:, 0].sum(), num[:, 1].sum(), den[:, 0].sum(), den[:, 1].sum()))
    out = {"ratio": ratio, "interval": [float("nan"), float("nan")], "samples": samples, "level": level}
    if bound is not None:
        out["within_bound"] = float("nan")
    if not (num.size and den.size):
        return out
    a, b = _draws(len(num), samples, seed), _draws(len(den), samples, seed + 1)
    values = _ratio(num[a, 0].sum(1), num[a, 1].sum(1), den[b, 0].sum(1), den[b, 1].sum(1))
    values = values[~np.isnan(values)]
    if values.size:  # no interpolation: an infinite resample stays an end point, not a nan
        tail = 100 * (1 - level) / 2
        out["interval"] = [float(np.percentile(values, tail, method="inverted_cdf")),
                           float(np.percentile(values, 100 - tail, method="inverted_cdf"))]
        if bound is not None:
            out["within_bound"] = float(np.mean(values <= bound + 1e-12))
    return out


def token_agreement(baseline: list[list[int]], produced: list[list[int]]) -> dict:
    """How far two engines' greedy token ids agree, clip by clip (the same clips in the same order):
    clips whose ids are identical, and baseline tokens matched at the same position."""
    if len(baseline) != len(produced):
        raise ValueError(f"token agreement needs the same clips: {len(baseline)} vs {len(produced)}")
    return {"clips": len(baseline), "identical_clips": sum(a == b for a, b in zip(baseline, produced)),
            "baseline_tokens": sum(len(a) for a in baseline),
            "agreeing_tokens": sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(baseline, produced))}
