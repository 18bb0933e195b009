"""Synthetic speech: grammar determinism, held-out disjointness, committed audio sets, espeak-ng wrapper."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml_dev import synth
from cohere_coreml_dev.synth import (
    CORPUS_LANGUAGES,
    SynthError,
    is_heldout,
    number_words,
    plan_corpus,
    sample_sentence,
    sample_sentences,
)

DATA = Path(__file__).parent / "data"
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")


def test_number_words():
    assert number_words(42, "en") == "forty two"
    assert number_words(13, "en") == "thirteen"
    assert number_words(21, "de") == "einundzwanzig"
    assert number_words(57, "de") == "siebenundfünfzig"
    assert number_words(35, "es") == "treinta y cinco"
    assert number_words(22, "es") == "veintidós"
    with pytest.raises(SynthError):
        number_words(60, "en")
    with pytest.raises(SynthError):
        number_words(5, "xx")


def test_grammar_is_deterministic():
    for lang in CORPUS_LANGUAGES:
        a = sample_sentences(lang, 50, split="train", seed=1)
        b = sample_sentences(lang, 50, split="train", seed=1)
        c = sample_sentences(lang, 50, split="train", seed=2)
        assert a == b
        assert a != c
    assert plan_corpus(["en", "de"], 20, split="train", seed=4) == plan_corpus(["en", "de"], 20, split="train", seed=4)


def test_sentences_fill_every_slot():
    rng = np.random.default_rng(0)
    for lang in CORPUS_LANGUAGES:
        for _ in range(200):
            text = sample_sentence(lang, rng)
            assert "{" not in text and "}" not in text
            assert text[-1] in ".?"


def test_heldout_sentences_never_in_train():
    for lang in CORPUS_LANGUAGES:
        train = set(sample_sentences(lang, 3000, split="train", seed=0))
        heldout = sample_sentences(lang, 60, split="heldout", seed=0, unique=True)
        assert len(set(heldout)) == 60
        assert not train & set(heldout)
        assert all(is_heldout(t, lang) for t in heldout)
        assert not any(is_heldout(t, lang) for t in train)
        # held-out sentences are new combinations of known words: every word occurs in training
        train_words = {w for t in train for w in t.rstrip(".?").split()}
        unseen = {w for t in heldout for w in t.rstrip(".?").split()} - train_words
        assert not unseen, unseen


def test_unknown_language_and_split():
    with pytest.raises(SynthError, match="available"):
        sample_sentences("ja", 3, split="train", seed=0)
    with pytest.raises(SynthError, match="split"):
        sample_sentences("en", 3, split="dev", seed=0)


def test_committed_heldout_set():
    manifest = json.loads((DATA / "heldout" / "manifest.json").read_text())
    utts = manifest["utterances"]
    langs = {u["language"] for u in utts}
    assert langs == {"en", "de", "es"}
    for lang in langs:
        texts = [u["text"] for u in utts if u["language"] == lang]
        assert len(texts) >= 24 and len(set(texts)) == len(texts)
        assert all(is_heldout(t, lang, manifest["heldout_percent"]) for t in texts)
    for u in utts[::15]:
        info = sf.info(str(DATA / "heldout" / u["file"]))
        assert info.samplerate == 16000 and info.channels == 1
        assert abs(info.duration - u["seconds"]) < 0.01


def test_committed_test_audio_manifest():
    folder = DATA / "audio"
    clips = json.loads((folder / "manifest.json").read_text())["clips"]
    speech = [c for c in clips if c["purpose"] == "speech"]
    assert len(speech) >= 10
    assert len({c["language"] for c in speech}) >= 3
    assert min(c["seconds"] for c in speech) < 1.5 and max(c["seconds"] for c in speech) > 10
    purposes = " ".join(c["purpose"] for c in clips)
    assert "silence" in purposes and "stereo" in purposes and "long" in purposes
    total = sum((folder / c["file"]).stat().st_size for c in clips)
    assert total < 5e6
    for c in clips:
        info = sf.info(str(folder / c["file"]))
        assert info.samplerate == c["sample_rate"] and info.channels == c["channels"], c["file"]
        assert abs(info.duration - c["seconds"]) < 1e-3, c["file"]
    by_purpose = {c["purpose"]: c for c in clips}
    assert by_purpose["stereo 44.1 kHz resampling and channel averaging"]["sample_rate"] == 44100
    assert by_purpose["very short clip (0.05 s)"]["seconds"] == pytest.approx(0.05)
    assert by_purpose["long audio (> 70 s) splitting"]["seconds"] > 70
    silence, _ = sf.read(str(folder / by_purpose["silence"]["file"]))
    assert np.all(silence == 0)


def test_missing_espeak_says_how_to_install(monkeypatch):
    monkeypatch.setattr(synth.shutil, "which", lambda name: None)
    with pytest.raises(SynthError, match="apt-get install espeak-ng"):
        synth.find_espeak()


@needs_espeak
def test_speak_returns_16k_speech():
    wav = synth.speak("Set a timer for five minutes.", "en-us", speed=160)
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert 1.0 < wav.shape[0] / 16000 < 4.0
    assert np.abs(wav).max() > 0.05
    faster = synth.speak("Set a timer for five minutes.", "en-us", speed=240)
    assert faster.shape[0] < wav.shape[0]
    with pytest.raises(SynthError):
        synth.speak("   ", "en-us")


@needs_espeak
def test_make_corpus_small(tmp_path):
    utts = synth.make_corpus(tmp_path, ["en", "es"], 3, split="heldout", seed=0)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [u["file"] for u in manifest["utterances"]] == [u.file for u in utts]
    for u in utts:
        wav, sr = sf.read(str(tmp_path / u.file))
        assert sr == 16000 and abs(len(wav) / sr - u.seconds) < 0.01
        assert is_heldout(u.text, u.language)
