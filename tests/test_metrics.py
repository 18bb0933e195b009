"""Normalisers and WER/CER counts; dataset folders with per-clip problems."""

from __future__ import annotations

import json

import pytest

from cohere_coreml.datasets import DatasetError, load_dataset, load_folder
from cohere_coreml.metrics import error_counts, normalise

from .fixture_data import AUDIO_DIR


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
