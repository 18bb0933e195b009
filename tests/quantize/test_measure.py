"""The f16 references and the measurements against them (`cohere_coreml.quantize.measure`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cohere_coreml.quantize import measure
from cohere_coreml.quantize.recipes import QuantizeError

from ..fixture_data import HELDOUT_DIR


def test_log_prob_error_measures_the_difference():
    rng = np.random.default_rng(0)
    ref = [np.log(np.full((5, 8), 1 / 8))]
    out = [ref[0].copy()]
    out[0][:, 3] += 0.5  # eos id 3 raised by 0.5 nats at every step
    e = measure.log_prob_error(ref, out, prompts=[[0, 1]], eos_ids=[3], top_k=8)
    assert e["eos_error_nats"]["max"] == pytest.approx(0.5) and e["eos_error_nats"]["mean_signed"] == pytest.approx(0.5)
    assert e["flip_bound_nats"]["max"] == pytest.approx(0.5)
    assert e["steps"] == 4  # from the last prompt token on
    same = measure.log_prob_error(ref, ref, [[0, 1]], [3])
    assert same["abs_error_nats"]["max"] == 0.0
    # fp16 log-probs that do not sum to 1: identical outputs still have KL 0
    rows = [np.float16(rng.standard_normal((6, 50)) * 4).astype(np.float32)]
    rows[0] -= np.log(np.sum(np.exp(rows[0]), -1, keepdims=True))
    rows[0] = rows[0].astype(np.float16).astype(np.float32)
    assert measure.log_prob_error(rows, rows, [[0]], [3])["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    # and a real difference has a KL above 0 (the parity.kl_rows figure, both sides renormalised)
    moved = [rows[0] + np.float32(0.3) * (np.arange(50) == 7)]
    assert measure.log_prob_error(rows, moved, [[0]], [3])["mean_kl"] > 1e-4
    del rng


def test_gate_clips_are_the_first_of_each_language(tmp_path):
    """The gate clips come from `datasets.load_folder` (the bench's reader): the first N per language
    in manifest order; a clip the gates cannot use is named."""
    utts = json.loads((HELDOUT_DIR / "manifest.json").read_text())["utterances"]
    clips = measure.gate_clips(HELDOUT_DIR, per_language=2)
    expected = {}
    for u in utts:
        if len(expected.setdefault(u["language"], [])) < 2:
            expected[u["language"]].append(HELDOUT_DIR / u["file"])
    assert sorted(clips) == sorted((p, lang) for lang, paths in expected.items() for p in paths)
    assert len(measure.gate_clips(HELDOUT_DIR, per_language=1)) == len(expected)
    (tmp_path / "manifest.json").write_text(json.dumps({"utterances": [
        {"file": "missing.flac", "language": "en", "text": "hello"}]}))
    with pytest.raises(QuantizeError, match="missing.flac"):
        measure.gate_clips(tmp_path)
