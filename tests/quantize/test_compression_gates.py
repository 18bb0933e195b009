"""The held-out gate (`cohere_coreml.quantize.compression_gates`): every language bounded, scored by `metrics` alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml import quantize as Q
from cohere_coreml.evaluation.datasets import load_folder
from cohere_coreml.inference.engines import PyTorchEngine
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.quantize.compression_gates import engine_transcripts

from ..fixture_data import HELDOUT_DIR, TRAINED_MODEL


def test_heldout_gate_bounds_every_language():
    """One language made worse is refused even when the average over languages stays within 0.5 points;
    the same error spread thin passes. Per-language rates are the bench's (metrics.error_counts), and
    the overall rate pools the same counts (one metric)."""
    # no digits: the English normaliser (Whisper's) splits "word0" into two words, the basic one does not
    refs = ["alpha beta gamma delta epsilon"] * 40  # 40 clips x 5 words per language
    base = {"files": [f"{l}{i}.wav" for l in "ab" for i in range(40)], "refs": refs * 2,
            "languages": ["en"] * 40 + ["de"] * 40, "ids": [[i, 1] for i in range(80)], "texts": refs * 2}

    def produced(wrong: list[int]) -> dict:
        texts = [t.replace("alpha", "alfa") if i in wrong else t for i, t in enumerate(base["texts"])]
        ids = [[i, 9] if i in wrong else ids for i, ids in enumerate(base["ids"])]
        return {**base, "texts": texts, "ids": ids}

    one_language = produced([40, 41])  # 2 de words of 200 wrong: de +1.0 point, overall +0.5, en unchanged
    cmp = Q.compare_transcripts(base, one_language)
    assert cmp["languages"]["de"]["increase"] == pytest.approx(0.01) and cmp["languages"]["en"]["increase"] == 0
    assert cmp["worst_increase"] == pytest.approx(0.01) and cmp["wer_increase"] == pytest.approx(0.005)
    assert cmp["languages"]["de"]["identical_clips"] == 38 and cmp["identical_clips"] == 78
    assert cmp["differing_files"] == ["b0.wav", "b1.wav"]

    def gate(prod):
        return Q.heldout_report(base, prod, "f16 bundle", "heldout", Q.GATES["q8"])

    refused = gate(one_language)
    assert not refused.passed and "worst language de" in refused.headline and "+1.00 points" in refused.headline
    assert gate(produced([0, 40])).passed  # +0.5 points in each language: at the bound
    assert not gate(produced([0, 1, 40])).passed  # en +1.0
    assert gate(base).passed
    # an empty hypothesis counts as all deletions (metrics.error_counts), never as a correct clip
    empty = {**base, "texts": ["" if i == 0 else t for i, t in enumerate(base["texts"])]}
    assert Q.compare_transcripts(base, empty)["languages"]["en"]["increase"] == pytest.approx(5 / 200)


def test_heldout_gate_says_how_sure_its_verdict_is():
    """The report gives each language's increase a paired-bootstrap interval and the share of resamples
    within the gate's bound: a pass at the bound is a coin toss, a wide margin is not."""
    refs = ["alpha beta gamma delta epsilon"] * 200  # 200 clips x 5 words
    base = {"files": [f"a{i}.wav" for i in range(200)], "refs": refs, "languages": ["en"] * 200,
            "ids": [[i] for i in range(200)], "texts": list(refs)}

    def produced(wrong: int) -> dict:
        return {**base, "texts": ["alfa beta gamma delta epsilon"] * wrong + refs[wrong:],
                "ids": [[-1]] * wrong + base["ids"][wrong:]}

    bound = Q.GATES["q8"]["max_wer_increase"]
    at_bound = Q.heldout_report(base, produced(5), "pytorch", "heldout", Q.GATES["q8"])  # +0.5 points of 0.5
    en = at_bound.details["languages"]["en"]
    assert at_bound.passed and en["increase"] == pytest.approx(bound)
    assert en["increase_interval"][0] < bound < en["increase_interval"][1]
    assert 0.3 < en["within_bound"] < 0.8
    assert "within the bound in" in at_bound.headline and "95 % interval" in at_bound.headline
    low, high = en["rate_interval"]
    assert low < en["rate"] < high
    clear = Q.heldout_report(base, produced(1), "pytorch", "heldout", Q.GATES["q8"]).details["languages"]["en"]
    assert clear["within_bound"] > 0.95 > en["within_bound"]
    worse = Q.heldout_report(base, produced(20), "pytorch", "heldout", Q.GATES["q8"])
    assert not worse.passed and worse.details["languages"]["en"]["within_bound"] == 0.0


@pytest.mark.slow
def test_heldout_runs_the_bench_engines_with_the_long_audio_split(f16_bundle, tmp_path):
    """The gate's transcripts are the engines' own (`Engine.transcribe` over `datasets.load_folder`):
    the PyTorch side of a clip longer than one 35 s window is split at the reference extractor's
    points (several windows, all their tokens: before, it decoded the whole clip at once), equal to
    `PyTorchEngine` run by hand; the bundle side is `Transcriber`'s transcript of each clip."""
    utts = json.loads((HELDOUT_DIR / "manifest.json").read_text())["utterances"]
    en = [u for u in utts if u["language"] == "en"][:20]
    wav = np.concatenate([sf.read(HELDOUT_DIR / u["file"], dtype="float32")[0] for u in en])
    assert len(wav) / 16000 > 40  # longer than one window
    sf.write(tmp_path / "long.flac", wav, 16000)
    (tmp_path / "manifest.json").write_text(json.dumps({"utterances": [
        {"file": "long.flac", "language": "en", "text": " ".join(u["text"] for u in en)}]}))
    torch_side = engine_transcripts(lambda: PyTorchEngine(TRAINED_MODEL), load_folder(tmp_path))
    by_hand = PyTorchEngine(TRAINED_MODEL).transcribe(tmp_path / "long.flac", "en", max_new_tokens=96)
    assert len(by_hand.windows) >= 2
    assert torch_side["ids"] == [[t for w in by_hand.windows for t in w.token_ids]]
    assert torch_side["texts"] == [by_hand.text] and torch_side["files"] == ["long.flac"]
    assert len(torch_side["ids"][0]) > len(by_hand.windows[0].token_ids)  # every window's tokens
    # the bundle side: Transcriber over the same folder (first clip of the held-out set)
    first = tmp_path / "first"
    first.mkdir()
    shutil.copy(HELDOUT_DIR / utts[0]["file"], first / utts[0]["file"])
    (first / "manifest.json").write_text(json.dumps({"utterances": [utts[0]]}))
    bundle_side = engine_transcripts(lambda: Transcriber(f16_bundle, backend="mil"), load_folder(first))
    res = Transcriber(f16_bundle, backend="mil").transcribe(first / utts[0]["file"], "en", max_new_tokens=96)
    assert bundle_side["ids"] == [[t for w in res.windows for t in w.token_ids]] and bundle_side["texts"] == [res.text]
