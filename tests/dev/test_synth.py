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

DATA = Path(__file__).resolve().parents[1] / "data"
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


def test_varied_plan_is_deterministic_and_spans_its_ranges():
    jobs = plan_corpus(["en", "de"], 400, split="train", seed=3, recipe="varied")
    assert jobs == plan_corpus(["en", "de"], 400, split="train", seed=3, recipe="varied")
    assert jobs != plan_corpus(["en", "de"], 400, split="train", seed=4, recipe="varied")
    counts = [len(j["sentences"]) for j in jobs]
    assert set(counts) == set(synth.VARIED_SENTENCES)  # 1-4 sentences per clip all occur
    single_share = synth.VARIED_SENTENCE_WEIGHTS[0]
    assert single_share - 0.1 < counts.count(1) / len(counts) < single_share + 0.1
    for j in jobs:
        assert j["text"] == " ".join(j["sentences"]) and len(j["pauses_s"]) == len(j["sentences"]) - 1
        assert len(j["speeds"]) == len(j["sentences"])
        assert all(synth.VARIED_PAUSE_S[0] <= p <= synth.VARIED_PAUSE_S[1] for p in j["pauses_s"])
        assert 0.0 <= j["lead_s"] <= 2.0 and 0.0 <= j["trail_s"] <= 2.0
        assert -30.0 <= j["level_dbfs"] <= 0.0 and 10.0 <= j["snr_db"] <= 40.0
        assert j["variant"] not in synth.VARIED_HELDOUT_VARIANTS
    edges = [max(j["lead_s"], j["trail_s"]) for j in jobs]
    assert max(edges) > 1.5 and min(edges) < 0.1  # long and short silences both occur
    levels = [j["level_dbfs"] for j in jobs]
    assert min(levels) < -25 and max(levels) > -5
    assert 0.15 < np.mean([j["digital_edges"] for j in jobs]) < 0.45


def test_varied_options_move_the_sentence_counts_and_the_noise_and_nothing_else_by_default():
    """The defaults spelled out give the default plan (the committed corpora stay what they were); other
    weights give more long clips and the SNR range bounds every clip's and every mixed sentence's noise;
    values that cannot be options are refused, naming them."""
    base = plan_corpus(["en"], 600, split="train", seed=3, recipe="varied")
    defaults = {"sentence_weights": list(synth.VARIED_SENTENCE_WEIGHTS), "snr_db": list(synth.VARIED_SNR_DB)}
    assert plan_corpus(["en"], 600, split="train", seed=3, recipe="varied", options=defaults) == base
    longer = plan_corpus(["en"], 600, split="train", seed=3, recipe="varied",
                         options={"sentence_weights": [0.1, 0.1, 0.3, 0.5], "snr_db": [3, 12]})
    counts = [len(j["sentences"]) for j in longer]
    assert counts.count(4) / len(counts) > 0.4 > [len(j["sentences"]) for j in base].count(4) / len(base)
    snrs = [j["snr_db"] for j in longer] + [m["snr_db"] for j in longer for m in j.get("mix") or []]
    assert 3.0 <= min(snrs) and max(snrs) <= 12.0 and any(j.get("mix") for j in longer)
    for bad, match in (({"sentence_weights": [0.5, 0.5]}, "4 probabilities"),
                       ({"sentence_weights": [0.5, 0.5, 0.5, -0.5]}, "4 probabilities"),
                       ({"snr_db": [20, 10]}, "low < high")):
        with pytest.raises(SynthError, match=match):
            plan_corpus(["en"], 4, split="train", seed=0, recipe="varied", options=bad)
    with pytest.raises(SynthError, match="takes no options"):
        plan_corpus(["en"], 4, split="train", seed=0, recipe="commands", options=defaults)


def test_template_of_names_the_template_each_sentence_was_made_from():
    rng = np.random.default_rng(0)
    for language, grammar in synth.GRAMMAR.items():
        for template in range(len(grammar["templates"])):
            for _ in range(50):
                assert synth.template_of(synth.sample_sentence(language, rng, template), language) == template
    assert synth.template_of("Dial four four three four.", "en") == synth.template_of("Dial one two three four.", "en")
    assert synth.template_of("Play some music.", "en") is None
    with pytest.raises(SynthError, match="no grammar for language 'xx'"):
        synth.template_of("Dial one.", "xx")


def test_same_template_option_puts_sentences_of_one_template_side_by_side_and_changes_nothing_else():
    """same_template p: each sentence after a clip's first repeats its predecessor's template with chance p
    (independent draws: 1 in 11); only the sentences differ from the plan without it (its own random
    stream), none held out; 0 is the plan without it and is not recorded; held-out and single plans and
    values outside [0, 1] are refused."""
    weights = {"sentence_weights": [0.1, 0.2, 0.3, 0.4]}
    base = plan_corpus(["en", "es"], 500, split="train", seed=3, recipe="varied", options=weights)
    same = plan_corpus(["en", "es"], 500, split="train", seed=3, recipe="varied",
                       options={**weights, "same_template": 0.5})

    def pair_share(jobs):
        pairs = [synth.template_of(a, j["language"]) == synth.template_of(b, j["language"])
                 for j in jobs for a, b in zip(j["sentences"], j["sentences"][1:])]
        return sum(pairs) / len(pairs)

    assert pair_share(base) < 0.15 and 0.45 < pair_share(same) < 0.65  # 1/11 vs 0.5 + 0.5/11
    changed = {k for a, b in zip(base, same) for k in a if a[k] != b[k]}
    assert changed == {"text", "sentences"}
    assert all(j["text"] == " ".join(j["sentences"]) for j in same)
    assert not any(is_heldout(s, j["language"]) for j in same for s in j["sentences"])
    assert synth.varied_options(same_template=0) == synth.varied_options()
    assert "same_template" not in synth.varied_options() and synth.varied_options(same_template=0.5)["same_template"] == 0.5
    assert plan_corpus(["en"], 50, split="train", seed=3, recipe="varied", options={"same_template": 0}) == \
        plan_corpus(["en"], 50, split="train", seed=3, recipe="varied")
    for kw in ({"split": "heldout"}, {"split": "train", "single": True}):
        with pytest.raises(SynthError, match="same-template neighbours are an option of training corpora"):
            plan_corpus(["en"], 4, seed=0, recipe="varied", options={"same_template": 0.5}, **kw)
    with pytest.raises(SynthError, match=r"same-template share must be a probability in \[0, 1\], got 1.5"):
        plan_corpus(["en"], 4, split="train", seed=0, recipe="varied", options={"same_template": 1.5})


def test_varied_heldout_plan_never_shares_a_sentence_or_voice_with_training():
    train = plan_corpus(["es"], 2000, split="train", seed=0, recipe="varied")
    held = plan_corpus(["es"], 200, split="heldout", seed=0, recipe="varied")
    held_sentences = [s for j in held for s in j["sentences"]]
    assert len(held_sentences) == len(set(held_sentences))  # each held-out sentence once
    assert not set(held_sentences) & {s for j in train for s in j["sentences"]}
    assert all(is_heldout(s, "es") for s in held_sentences)
    assert {j["variant"] for j in held} <= set(synth.VARIED_HELDOUT_VARIANTS)
    with pytest.raises(SynthError, match="recipe"):
        plan_corpus(["es"], 2, split="train", seed=0, recipe="fancy")


def test_varied_clip_places_each_sentence_at_its_segment():
    rng = np.random.default_rng(0)
    speech = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (8000, 3000, 5000)]
    job = {"lead_s": 1.5, "trail_s": 0.25, "pauses_s": [0.5, 1.0], "level_dbfs": -20.0, "snr_db": 30.0,
           "digital_edges": True, "seed": 1}
    clip, segments = synth.varied_clip(speech, job)
    lead, p1, p2, trail = 24000, 8000, 16000, 4000
    assert segments == [[lead, lead + 8000], [lead + 8000 + p1, lead + 11000 + p1],
                        [lead + 11000 + p1 + p2, lead + 16000 + p1 + p2]]
    assert clip.size == lead + 16000 + p1 + p2 + trail
    assert not clip[:lead].any() and not clip[segments[-1][1]:].any()  # digital zeros at the edges
    peak_db = 20 * np.log10(np.abs(clip).max())
    assert abs(peak_db - (-20.0)) < 1.0  # the level, within the noise's share
    gain = clip[segments[1][0]:segments[1][1]] / speech[1]
    assert np.median(gain) == pytest.approx(10 ** (-20 / 20) / 0.5, rel=0.05)  # the sentence, scaled, in place
    pause = clip[segments[0][1]:segments[1][0]]
    voiced_rms = np.sqrt(np.mean(np.concatenate([clip[a:b] for a, b in segments]) ** 2))
    assert 25 < 20 * np.log10(voiced_rms / np.sqrt(np.mean(pause**2))) < 35  # noise at ~30 dB SNR
    noisy, _ = synth.varied_clip(speech, {**job, "digital_edges": False})
    assert noisy[:lead].std() > 0 and noisy[segments[-1][1]:].std() > 0



def test_mixed_varied_clip_gives_each_sentence_its_own_level_and_noise():
    rng = np.random.default_rng(0)
    speech = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (8000, 8000)]
    mix = [{"voice": "en-us", "variant": "m1", "pitch": 50, "level_dbfs": -3.0, "snr_db": 35.0},
           {"voice": "en-gb", "variant": "f2", "pitch": 40, "level_dbfs": -27.0, "snr_db": 12.0}]
    job = {"lead_s": 0.5, "trail_s": 0.5, "pauses_s": [1.0], "level_dbfs": -20.0, "snr_db": 30.0,
           "digital_edges": False, "seed": 1, "mix": mix}
    clip, segments = synth.varied_clip(speech, job)
    (a0, b0), (a1, b1) = segments
    for (a, b), m, w in zip(segments, mix, speech):  # each sentence at its own level, not the clip's -20 dBFS
        assert np.median(clip[a:b] / w) == pytest.approx(10 ** (m["level_dbfs"] / 20) / 0.5, rel=0.05)
    rms = lambda x: np.sqrt(np.mean(x**2))  # noqa: E731
    assert 30 < 20 * np.log10(rms(clip[a0:b0]) / rms(clip[:a0])) < 40  # lead: the first sentence's noise
    assert 8 < 20 * np.log10(rms(clip[a1:b1]) / rms(clip[b0:a1])) < 16  # pause: the next sentence's noise
    same, _ = synth.varied_clip(speech, {k: v for k, v in job.items() if k != "mix"})
    assert np.median(same[a1:b1] / speech[1]) == pytest.approx(10 ** (-20 / 20) / 0.5, rel=0.05)  # one level


def test_varied_training_plan_mixes_its_share_of_multi_sentence_clips():
    jobs = plan_corpus(["en"], 400, split="train", seed=0, recipe="varied")
    multi = [j for j in jobs if len(j["sentences"]) > 1]
    mixed = [j for j in multi if "mix" in j]
    assert abs(len(mixed) / len(multi) - synth.VARIED_MIXED_SHARE) < 0.1
    assert not any("mix" in j for j in jobs if len(j["sentences"]) == 1)
    assert all(len(j["mix"]) == len(j["sentences"]) for j in mixed)
    assert any(len({(m["voice"], m["variant"]) for m in j["mix"]}) > 1 for j in mixed)
    assert all(m["variant"] in synth.VARIED_TRAIN_VARIANTS for j in mixed for m in j["mix"])
    heldout = plan_corpus(["en"], 60, split="heldout", seed=0, recipe="varied")
    assert not any("mix" in j for j in heldout)  # held-out clips keep one recording each

@needs_espeak
def test_make_varied_corpus_records_sentences_and_segments(tmp_path):
    utts = synth.make_corpus(tmp_path, ["en"], 6, split="heldout", seed=0, recipe="varied")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["recipe"] == "varied"
    for u, row in zip(utts, manifest["utterances"]):
        wav, sr = sf.read(str(tmp_path / u.file))
        assert sr == 16000 and len(u.segments) == len(u.sentences) == len(row["segments"])
        assert 0 <= u.segments[0][0] and u.segments[-1][1] <= len(wav)
        for (a, b), (c, d) in zip(u.segments, u.segments[1:]):
            assert b + int(0.3 * 16000) - 1 <= c  # pauses of at least 0.3 s between sentences
        lead = wav[: u.segments[0][0]]
        for a, b in u.segments:  # speech where the segments say (SNR >= 10 dB: RMS >= 3.2x the noise's)
            assert lead.size < 1600 or np.sqrt(np.mean(wav[a:b] ** 2)) > 2 * np.sqrt(np.mean(lead**2))
