"""Normalisers and WER/CER counts; dataset folders with per-clip problems."""

from __future__ import annotations

import json

import pytest

from cohere_coreml.evaluation.datasets import DatasetError, load_dataset, load_folder
from cohere_coreml.evaluation.metrics import (
    error_counts,
    increase_interval,
    normalise,
    rate_interval,
    ratio_interval,
    sentence_errors,
    utterance_counts,
    utterance_errors,
)

from ..fixture_data import AUDIO_DIR


def test_normalisers():
    assert normalise("Mr. Smith paid $20, didn't he?", "en") == normalise("mister smith paid twenty dollars did not he", "en")
    assert normalise("¿Cuánto es dos más  TRES?", "es") == "cuánto es dos más tres"
    assert normalise("今天 天气，很好。", "zh") == "今天天气很好"


def test_error_counts_wer_and_cer():
    out = error_counts(["Paint the wall red.", "call Tom"], ["paint the wall blue", "call tom now"], "de")
    assert (out["metric"], out["substitutions"], out["deletions"], out["insertions"], out["units"]) == ("wer", 1, 0, 1, 6)
    assert out["rate"] == pytest.approx(2 / 6)
    assert error_counts(["a b c"], [""], "de")["deletions"] == 3  # an empty hypothesis is never free
    cer = error_counts(["今天天气很好"], ["今天天很好"], "zh")
    assert cer["metric"] == "cer" and cer["deletions"] == 1 and cer["rate"] == pytest.approx(1 / 6)


def test_folder_with_problems(tmp_path):
    (tmp_path / "a.wav").write_bytes((AUDIO_DIR / "en_short.wav").read_bytes())
    lines = [{"audio": "a.wav", "text": "hello", "language": "en"},
             {"audio": "missing.wav", "text": "x", "language": "en"},
             {"audio": "a.wav", "text": "", "language": "de"}]
    (tmp_path / "manifest.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
    ds = load_folder(tmp_path)
    assert [c.problem for c in ds.clips][0] is None
    assert "not found" in ds.clips[1].problem and "empty reference" in ds.clips[2].problem
    assert ds.manifest_sha256 and ds.languages() == ["de", "en"]


def test_hub_names_fail_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match="not installed|unreachable"):
        load_dataset("librispeech_asr")
    with pytest.raises(DatasetError, match="no manifest"):
        load_dataset(str(AUDIO_DIR.parent))


def _clips(n_right: int, n_wrong: int):
    """n_right four-word clips transcribed right and n_wrong with one of four words substituted."""
    refs = ["set a timer now"] * (n_right + n_wrong)
    hyps = ["set a timer now"] * n_right + ["set a time now"] * n_wrong
    return refs, hyps


def test_utterance_errors_add_up_to_error_counts():
    refs, hyps = ["a b c", "", "d e", "f"], ["a x c", "q", "", "f g"]
    per = utterance_errors(refs, hyps, "de")
    assert [i for i, _, _ in per["pairs"]] == [0, 2, 3]  # the empty reference is not scored
    total = error_counts(refs, hyps, "de")
    for key in ("substitutions", "deletions", "insertions", "hits"):
        assert sum(c[key] for _, c, _ in per["pairs"]) == total[key]
    assert [u for _, _, u in per["pairs"]] == [3, 2, 1]


def test_rate_interval_brackets_the_rate_and_narrows_with_more_clips():
    small = rate_interval(*_clips(15, 5), "en")  # 5 % WER over 20 clips
    large = rate_interval(*_clips(150, 50), "en")  # the same rate over 200 clips
    for low, high in (small, large):
        assert low < 0.0625 < high
    assert (large[1] - large[0]) < 0.5 * (small[1] - small[0])  # ~1/sqrt(10) as wide
    assert rate_interval(*_clips(20, 0), "en") == [0.0, 0.0]  # no error in any resample
    assert rate_interval(*_clips(15, 5), "en") == small  # seeded: the same figures on every run
    nan = rate_interval([""], ["x"], "en")
    assert nan[0] != nan[0]


def test_increase_interval_is_paired_and_says_how_sure_a_verdict_is():
    refs, base = _clips(200, 0)
    same = increase_interval(refs, base, list(base), "en", bound=0.005)
    assert same["interval"] == [0.0, 0.0] and same["within_bound"] == 1.0
    # produced: 2 of 200 clips worse (+0.25 points, gate bound 0.5): within the bound, but not surely
    worse = base[:198] + ["set a time now"] * 2
    near = increase_interval(refs, base, worse, "en", bound=0.005)
    assert near["interval"][0] >= 0.0 and near["interval"][1] > 0.005 > 0.0025
    assert 0.5 < near["within_bound"] < 1.0
    far = increase_interval(refs, base, base[:180] + ["set a time now"] * 20, "en", bound=0.005)
    assert far["within_bound"] == 0.0 and far["interval"][0] > 0.005
    # unpaired resampling of the two sides would give the identical pair a non-zero spread: paired gives none
    noisy_base = base[:190] + ["set a time now"] * 10
    assert increase_interval(refs, noisy_base, list(noisy_base), "en")["interval"] == [0.0, 0.0]


def test_ratio_interval_says_how_sure_a_ratio_of_two_rates_is():
    """Multi-utterance WER over single WER, each side's clips resampled on their own."""
    single = utterance_counts(*_clips(180, 20), "en")  # 20 wrong words in 800: 2.5 %
    multi = utterance_counts(*_clips(150, 50), "en")  # 6.25 %: 2.5x
    sure = ratio_interval(multi, single, bound=2.0)
    assert sure["ratio"] == pytest.approx(2.5)
    low, high = sure["interval"]
    assert 1.0 < low < 2.5 < high < 5.0
    assert 0.0 < sure["within_bound"] < 0.5  # over 2x more often than not, but not surely
    assert ratio_interval(single, multi)["ratio"] == pytest.approx(0.4)  # the numerator is the first
    assert ratio_interval(multi, single, bound=2.0) == sure  # seeded
    clean = utterance_counts(*_clips(200, 0), "en")  # no error: any error on the other side is infinitely worse
    worse = ratio_interval(multi, clean, bound=2.0)
    assert worse["ratio"] == float("inf") and worse["interval"] == [float("inf"), float("inf")]
    assert worse["within_bound"] == 0.0
    both = ratio_interval(clean, clean)
    assert both["ratio"] != both["ratio"] and both["interval"][0] != both["interval"][0]  # 0/0: nan
    # one wrong word in 200 clips: most resamples keep an error, some lose it (an infinite ratio)
    rare = utterance_counts(*_clips(199, 1), "en")
    tail = ratio_interval(multi, rare)
    assert tail["interval"][1] == float("inf") and 0 < tail["interval"][0] < tail["ratio"]


def _errors(row):
    return row["substitutions"] + row["deletions"] + row["insertions"]


def test_sentence_errors_put_each_error_on_its_sentence():
    """A transcript of three sentences that skips the second and adds a word inside the third: the second
    sentence's words are deletions, the added word an insertion of the third; the sums are the clip's
    WER counts (the attribution loses nothing)."""
    sentences = ["Wähle zwei drei neun zwei.", "Wähle vier neun vier sieben.", "Ruf Lena um zehn Uhr an."]
    hypothesis = "Wähle zwei drei neun zwei. Ruf Lena bitte um zehn Uhr an."
    rows = sentence_errors(sentences, hypothesis, "de")
    assert [r["units"] for r in rows] == [5, 5, 6]
    assert [(r["deletions"], r["insertions"], r["substitutions"]) for r in rows] == [(0, 0, 0), (5, 0, 0), (0, 1, 0)]
    whole = error_counts([" ".join(sentences)], [hypothesis], "de")
    assert sum(_errors(r) for r in rows) == whole["substitutions"] + whole["deletions"] + whole["insertions"]
    # one digit of the first sentence: only the first sentence pays
    rows = sentence_errors(sentences, "Wähle zwei acht neun zwei. Wähle vier neun vier sieben. Ruf Lena um zehn Uhr an.", "de")
    assert [_errors(r) for r in rows] == [1, 0, 0]
    # insertions before the first reference word belong to the first sentence
    rows = sentence_errors(sentences[:1], "Bitte. Wähle zwei drei neun zwei.", "de")
    assert rows[0]["insertions"] == 1 and rows[0]["hits"] == 5
    assert [r["deletions"] for r in sentence_errors(sentences, "", "de")] == [5, 5, 6]


def test_sentence_errors_normalise_each_sentence_alone():
    """The English normaliser joins number words across a sentence end ("at two. Three." -> "at 23"):
    each sentence (of the references and of the hypothesis) is normalised alone, so a correct transcript
    of two sentences that end and begin with numbers has no error and each sentence keeps its units."""
    sentences = ["Call Emma at two.", "Three four five six is the code."]
    assert normalise(" ".join(sentences), "en").split()[:4] == ["call", "emma", "at", "23456"]  # the joined text
    rows = sentence_errors(sentences, " ".join(sentences), "en")
    assert [_errors(r) for r in rows] == [0, 0] and [r["units"] for r in rows] == [4, 4]
    rows = sentence_errors(sentences, "Call Emma at two. Three four five seven is the code.", "en")
    assert [_errors(r) for r in rows] == [0, 1]
    cer = sentence_errors(["今天天气很好。", "你好。"], "今天天很好。你好吗。", "zh")
    assert [(r["units"], r["deletions"], r["insertions"]) for r in cer] == [(6, 1, 0), (2, 0, 1)]
