"""The PyTorch reference of the alignment attention and the choice of alignment heads with its gate, on the
default model (models/cohere-tiny-synth).

The head choice needs clips the model transcribes: the default model knows only its grammar's sentences in
en/de/es, so the calibration clips here are a few held-out grammar sentences synthesised at test time with their
word times (tools/cohere_coreml_dev/word_timing.py, libespeak-ng). On the committed calibration set's everyday
sentences it transcribes none, so `calibration_records` keeps none of them (the rule: the swapped-text test
below).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from cohere_coreml.export.alignment_heads import (
    CALIBRATION_SET,
    baseline,
    calibration_records,
    evaluate_heads,
    gate,
    gate_records,
    match_words,
    read_word_timing_set,
    select_heads,
    truth_span,
)
from cohere_coreml.model.alignment_reference import encode, frame_seconds, teacher_forced_attention
from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel
from cohere_coreml.model.tokens import eos_id, prompt_ids
from cohere_coreml_dev import word_events, word_timing

from ..fixture_data import AUDIO_DIR

LANGUAGES = ["en", "de", "es"]  # the default model's languages
PER_LANGUAGE = 3
needs_libespeak = pytest.mark.skipif(
    not word_events.available(),
    reason="libespeak-ng not installed (Debian package espeak-ng: apt-get install espeak-ng; CI installs it)")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def timing_set(tmp_path_factory):
    """single/ and multi/ word-timing folders of held-out grammar sentences (seed 3: not the bench's seeds)."""
    if not word_events.available():
        pytest.skip("libespeak-ng not installed")
    return word_timing.make_timing_set(tmp_path_factory.mktemp("timing"), LANGUAGES, PER_LANGUAGE, seed=3,
                                       kinds=["single", "multi"])


@pytest.fixture(scope="module")
def records(trained_reference, timing_set):
    model, processor = trained_reference
    return [r for kind in ("single", "multi") for r in calibration_records(model, processor, timing_set[kind])]


def test_the_reference_gives_every_layer_and_head_over_the_valid_frames(trained_reference):
    model, processor = trained_reference
    tokenizer = processor.tokenizer
    front_end = FrontEndConfig.from_processor(processor, dither=0.0)
    features, n_valid = log_mel(load_audio(AUDIO_DIR / "en_short.wav"), front_end)
    encoded, _ = encode(model, features[:, :n_valid])
    tokens = tokenizer("Hello world.", add_special_tokens=False).input_ids
    prompt = prompt_ids(tokenizer, "en")
    implementation = model.config._attn_implementation
    tf = teacher_forced_attention(model, encoded, prompt, tokens, eos_id(tokenizer))
    assert model.config._attn_implementation == implementation  # eager only inside the pass
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert tf.attention.shape == (layers, heads, len(prompt) + len(tokens) + 1, encoded.last_hidden_state.shape[1])
    assert np.allclose(tf.attention.sum(-1), 1.0, atol=1e-4)  # softmax over the valid frames
    # the probabilities are the model's own: a plain forward (its default attention) gives the same
    with torch.no_grad():
        logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([prompt + tokens])).logits[0]
    p = torch.softmax(logits.double(), -1)[torch.arange(len(prompt) - 1, len(prompt) + len(tokens)),
                                           torch.tensor(tokens + [eos_id(tokenizer)])]
    assert np.allclose(tf.token_probabilities, p.numpy(), atol=1e-5)
    # the attention follows the audio: other audio, other weights
    other, n_other = log_mel(load_audio(AUDIO_DIR / "de_short.wav"), front_end)
    tf2 = teacher_forced_attention(model, encode(model, other[:, :n_other])[0], prompt, tokens, eos_id(tokenizer))
    frames = min(tf.n_frames, tf2.n_frames)
    assert not np.allclose(tf.attention[..., :frames], tf2.attention[..., :frames], atol=1e-2)
    assert frame_seconds(model, processor) == pytest.approx(0.08)  # 160 / 16000 x 8 for this config


@needs_libespeak
def test_the_chosen_heads_pass_the_gate_and_beat_the_baseline(records):
    assert len(records) >= PER_LANGUAGE * len(LANGUAGES)  # most clips are transcribed exactly
    assert any(len(r.meta["sentences"]) > 1 for r in records)  # the gate compares on clips with pauses
    choice, reason = select_heads(records)
    assert choice is not None, reason
    assert choice.median < choice.baseline_median
    assert "\n" not in reason and "refused" not in reason
    accepted, _ = gate(records, choice.heads, choice.lead_rows)
    assert accepted
    # the choice is the best of what it tried: no single head does better
    assert all(choice.median <= evaluate_heads(records, [h], choice.lead_rows)[0] for h in choice.per_head)


@needs_libespeak
@pytest.mark.parametrize("damage", ["uniform", "reversed"])
def test_the_gate_refuses_attention_that_does_not_follow_the_speech(records, damage):
    choice, _ = select_heads(records)
    damaged = []
    for r in records:
        att = np.ones_like(r.attention) / r.attention.shape[-1] if damage == "uniform" else r.attention[..., ::-1]
        damaged.append(type(r)(**{**r.__dict__, "attention": np.ascontiguousarray(att)}))
    accepted, reason = gate(damaged, choice.heads, choice.lead_rows)
    assert not accepted and "refused" in reason and "\n" not in reason
    assert select_heads(damaged)[0] is None  # no head of the damaged attention passes either


@needs_libespeak
def test_the_gate_refuses_no_heads_and_an_empty_set(records):
    assert gate(records, [], 1) == (False, "no alignment head given")
    assert select_heads([]) == (None, "no calibration clip the model transcribes: its attention cannot be calibrated")


@needs_libespeak
def test_the_baseline_is_measured_on_the_same_words(records):
    compared = gate_records(records)
    assert all(len(r.meta["sentences"]) > 1 for r in compared)
    median, p90, n = baseline(compared)
    assert n == sum(r.words_with_truth for r in compared) and 0 < median <= p90


@needs_libespeak
def test_clips_the_model_would_not_transcribe_are_not_calibrated_on(trained_reference, timing_set, tmp_path):
    """A clip whose manifest text is another clip's: the model's first choices differ from it, so it is skipped
    (its attention on words it does not hear says nothing about where they are)."""
    model, processor = trained_reference
    single = timing_set["single"]
    manifest = json.loads((single / "manifest.json").read_text())
    kept = calibration_records(model, processor, single)
    utterances = [u for u in manifest["utterances"] if u["file"] in {r.meta["file"] for r in kept}][:2]
    assert len(utterances) == 2
    a, b = utterances
    a["text"], a["words"], b["text"], b["words"] = b["text"], b["words"], a["text"], a["words"]
    manifest["utterances"] = [a, b]
    for u in (a, b):
        shutil.copy(single / u["file"], tmp_path / u["file"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert calibration_records(model, processor, tmp_path) == []
    assert len(calibration_records(model, processor, tmp_path, require_transcribed=False)) == 2


def test_the_committed_calibration_set_is_a_word_timing_set():
    folder, utterances = read_word_timing_set(CALIBRATION_SET, LANGUAGES)
    assert {u["language"] for u in utterances} == set(LANGUAGES)
    assert any(len(u.get("sentences") or ()) > 1 for u in utterances)  # clips with pauses for the gate


def test_words_match_the_truth_by_text_and_order():
    truth = [{"word": "Wake", "start": 0.5}, {"word": "me", "start": None}, {"word": "up.", "start": 0.9}]
    got = match_words(["Wake", "mi", "up."], truth)
    assert got[0]["start"] == 0.5 and got[1] is None and got[2]["start"] == 0.9
    assert truth_span(truth, 2.0) == (0.5, 2.0)  # the last end unknown: the clip's end
    assert truth_span([{"word": "a", "start": 0.2, "end": 0.6}], 2.0) == (0.2, 0.6)


def test_a_set_without_word_times_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text('{"utterances": [{"file": "a.flac", "language": "en", "text": "a"}]}')
    with pytest.raises(ValueError, match="no 'words'"):
        read_word_timing_set(tmp_path)


def _subset(folder, names):
    """A word-timing set of some of the shipped calibration set's clips."""
    manifest = json.loads((CALIBRATION_SET / "manifest.json").read_text())
    manifest["utterances"] = [u for u in manifest["utterances"] if u["file"] in names]
    folder.mkdir()
    for u in manifest["utterances"]:
        shutil.copy(CALIBRATION_SET / u["file"], folder / u["file"])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_an_explicit_head_list_is_checked_measured_and_kept(trained_reference, tmp_path):
    """`export --alignment-heads L.H,...`: heads outside the model and rows outside the prompt are one-line errors;
    a list inside it is measured on the clips the model transcribes and kept (with their figures) whether or not
    the gate would choose it; on clips it transcribes none of, kept unmeasured, every clip left for the bundle
    check."""
    from cohere_coreml.export.alignment_heads import plan_alignment
    from cohere_coreml.inference.alignment import AlignmentError, parse_heads

    model, processor = trained_reference
    assert parse_heads("1.0, 0.3") == [(1, 0), (0, 3)]
    for bad in ("1", "a.b", "1.0,,x", ""):
        with pytest.raises(AlignmentError, match="--alignment-heads"):
            parse_heads(bad)
    domain = _subset(tmp_path / "domain", {"en_domain_00.flac", "en_domain_03.flac", "de_domain_03.flac"})
    layers = model.config.num_hidden_layers
    with pytest.raises(AlignmentError, match=f"outside the model's {layers} layers"):
        plan_alignment(model, processor, f"{layers}.0", calibration=domain)
    with pytest.raises(AlignmentError, match="--alignment-lead-rows must be 0..9"):
        plan_alignment(model, processor, "1.0", lead_rows=10, calibration=domain)
    plan = plan_alignment(model, processor, "0.3,1.0", lead_rows=2, calibration=domain)
    assert plan.heads == [(0, 3), (1, 0)] and plan.lead_rows == 2 and plan.note is None
    assert plan.calibration["clips"] == len(plan.records) == 3 and plan.calibration["words"] >= 15
    assert plan.calibration["median_s"] == pytest.approx(evaluate_heads(plan.records, plan.heads, 2)[0], abs=1e-4)
    assert plan.metadata()["com.cohere_coreml.alignment"]["heads"] == [[0, 3], [1, 0]]
    everyday = _subset(tmp_path / "everyday", {"en_calibration_00.flac", "de_calibration_03.flac"})
    unmeasured = plan_alignment(model, processor, "1.0", calibration=everyday)
    assert unmeasured.heads == [(1, 0)] and unmeasured.calibration is None and len(unmeasured.records) == 2
    refused = plan_alignment(model, processor, "auto", calibration=everyday)
    assert refused.heads is None and refused.records == [] and "transcribes" in refused.note
    assert refused.metadata() == {"com.cohere_coreml.alignment_note": refused.note}
