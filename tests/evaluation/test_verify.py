"""verify (stage-by-stage parity), the bundle manifest, and the transcribe/verify/export CLI."""

from __future__ import annotations

import json

import pytest
import torch

from ..fixture_data import AUDIO_DIR
from ..helpers import GQA, assert_audio_sensitive, sensitivity_clips, tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A sensitised tiny GQA checkpoint (encoder width != decoder width; its tokens depend on the
    audio, checked) exported through the CLI (fp32)."""
    from cohere_coreml.cli import main

    root = tmp_path_factory.mktemp("verify")
    model, processor = tiny_model(root / "ckpt", seed=7, sensitive=True, **GQA)
    assert_audio_sensitive(model, processor, sensitivity_clips())
    ckpt = root / "ckpt"
    out = root / "bundle"
    assert main(["export", "--model", str(ckpt), "--out", str(out), "--precision", "fp32", "--max-tokens", "40", "--no-vad",
                 "--gate-audio", str(AUDIO_DIR / "en_medium.wav")]) == 0
    return ckpt, out


def test_manifest(exported):
    from transformers import AutoProcessor

    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.model.tokens import LANGUAGES

    ckpt, out = exported
    processor = AutoProcessor.from_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    bundle = Bundle.load(out)
    m = bundle.manifest
    assert m["format"] == "cohere-coreml-bundle" and m["precision"] == "fp32"
    for name in ("encoder.mlpackage", "decoder.mlpackage", "vocab.json", "tokenizer.json"):
        assert (out / name).exists()
    assert set(m["languages"]) == set(LANGUAGES)
    for lang in LANGUAGES:
        assert m["languages"][lang]["punctuation"] == processor.get_decoder_prompt_ids(lang, punctuation=True)
        assert m["languages"][lang]["no_punctuation"] == processor.get_decoder_prompt_ids(lang, punctuation=False)
    assert m["tokens"]["eos_token_id"] == config["eos_token_id"]
    assert m["decoder"]["capacity"] == 64  # round_up(10 + 40, 32)
    assert m["decoder"]["max_new_tokens"] == 64 - 10 + 1
    assert m["decoder"]["num_key_value_heads"] == 2 and m["decoder"]["vocab_size"] == config["vocab_size"]
    assert m["decoder"]["io"]["states"]["self_k"]["shape"] == m["decoder"]["cache_shape"]
    enc_out = m["encoder"]["io"]["outputs"]
    assert enc_out["cross_k"]["shape"] == m["decoder"]["memory_shape"] == m["decoder"]["io"]["states"]["cross_k"]["shape"]
    # the default host-state decoder: the host writes the encoder's memory into the states it names
    assert m["decoder"]["state_writes"] == "host" and m["decoder"]["bind_io"] is None
    assert m["decoder"]["memory_states"] == {"cross_k": "cross_k", "cross_v": "cross_v", "cross_mask": "cross_mask"}
    assert enc_out["cross_k"]["shape"] == m["decoder"]["io"]["states"]["cross_k"]["shape"]
    assert set(m["decoder"]["io"]["inputs"]) == {"input_ids", "position", "cache_mask"}
    assert m["encoder"]["window_frames"] == 3500 and m["encoder"]["memory_len"] == 448
    assert m["audio"]["sampling_rate"] == 16000 and m["audio"]["dither"] == 0.0
    vocab = json.loads((out / "vocab.json").read_text())
    assert vocab[str(m["tokens"]["eos_token_id"])] == "<|endoftext|>"


def test_verify_bundle_stages(exported):
    from cohere_coreml.evaluation.verify import format_table, verify_bundle
    from cohere_coreml.model.checkpoint import load_reference

    ckpt, out = exported
    model, processor = load_reference(ckpt)
    clips = [AUDIO_DIR / "en_short.wav", AUDIO_DIR / "fr_medium.wav"]
    report = verify_bundle(model, processor, out, clips, languages=["en", "fr"], backend="mil", max_new_tokens=6)
    s = report["summary"]
    assert s["clips"] == 2 and s["windows"] == 2
    assert s["mel_worst_psnr_db"] > 100  # same arithmetic as the extractor, float32 noise only
    assert s["encoder_worst_psnr_db"] > 60
    assert s["decoder_worst_psnr_db"] > 60 and s["decoder_max_kl"] < 1e-4
    assert s["tokens_identical_windows"] == 2 and s["tokens_compared"] == 12
    for clip in report["clips"]:
        w = clip["windows"][0]
        assert w["decoder"]["steps"] == 10 + 5  # prompt + fed generated tokens
        assert w["tokens"]["bundle_text"] == w["tokens"]["reference_text"]
    json.dumps(report)
    table = format_table(report)
    assert "fr_medium.wav" in table and "identical token windows 2/2" in table


def test_verify_detects_a_different_checkpoint(exported, tmp_path):
    """Same shapes, other weights: the decoder stage and the tokens must show the mismatch."""
    from cohere_coreml.evaluation.verify import verify_bundle

    ckpt, out = exported
    model, processor = tiny_model(tmp_path / "other", seed=8, sensitive=True, **GQA)
    report = verify_bundle(model, processor, out, [AUDIO_DIR / "en_short.wav"], backend="mil", max_new_tokens=6)
    s = report["summary"]
    assert s["encoder_worst_psnr_db"] < 30
    assert s["decoder_worst_psnr_db"] < 30
    assert s["tokens_identical_windows"] == 0


def test_verify_refuses_incompatible_checkpoint(exported, tmp_path):
    from cohere_coreml.evaluation.verify import VerifyError, verify_bundle
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    ckpt, out = exported
    model, processor = load_reference(make_tiny_checkpoint(tmp_path / "wide", seed=0, hidden_size=32))
    with pytest.raises(VerifyError, match="hidden_size"):
        verify_bundle(model, processor, out, [AUDIO_DIR / "en_short.wav"], backend="mil", max_new_tokens=2)


def test_cli_transcribe_and_verify(exported, capsys):
    from cohere_coreml.cli import main

    ckpt, out = exported
    clip = str(AUDIO_DIR / "de_short.wav")
    assert main(["transcribe", clip, "--bundle", str(out), "--language", "de", "--backend", "mil",
                 "--max-new-tokens", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["windows"]) == 1 and len(data["windows"][0]["token_ids"]) == 4
    assert data["language"] == "de" and data["windows"][0]["truncated"] is True

    assert main(["transcribe", clip, "--bundle", str(out), "--language", "xx"]) == 2
    assert "Unsupported language" in capsys.readouterr().err
    assert main(["transcribe", clip, "--bundle", str(ckpt), "--language", "de"]) == 2
    assert "manifest.json" in capsys.readouterr().err

    assert main(["verify", "--model", str(ckpt), "--bundle", str(out), "--audio", clip, "--language", "de",
                 "--backend", "mil", "--max-new-tokens", "3", "--strict"]) == 0
    table = capsys.readouterr().out
    assert "de_short.wav" in table and "identical token windows 1/1" in table


def test_bundle_split_over_folders(exported, tmp_path):
    """Bundle.load searches several folders; a missing package is named in the error."""
    import shutil

    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle

    ckpt, out = exported
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(out, first, ignore=shutil.ignore_patterns("decoder.mlpackage"))
    second.mkdir()
    with pytest.raises(BundleError, match="decoder.mlpackage"):
        Bundle.load(first)
    shutil.copytree(out / "decoder.mlpackage", second / "decoder.mlpackage")
    bundle = Bundle.load([first, second])
    assert bundle.paths["decoder"] == second / "decoder.mlpackage"
    assert bundle.paths["encoder"] == first / "encoder.mlpackage"
    (first / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not readable JSON"):
        Bundle.load([first, second])


# --------------------------------------------------------------------------------------------
# Token verdicts: identical, near-tie or DIFFERS (on the trained model's session bundle)
# --------------------------------------------------------------------------------------------


def test_verdicts_in_domain_clips_are_identical(trained_reference, trained_bundle):
    """Held-out clips (the trained model's own domain): every window "same", counted per tag."""
    from cohere_coreml.evaluation.verify import SAME, format_table, verify_bundle

    from ..fixture_data import heldout_utterances

    model, processor = trained_reference
    utts = heldout_utterances(1)
    report = verify_bundle(model, processor, trained_bundle, [u["path"] for u in utts],
                           languages=[u["language"] for u in utts], backend="mil",
                           tags=["in-domain"] * len(utts))
    s = report["summary"]
    assert s["tokens_identical_windows"] == s["windows"] == len(utts)
    assert s["tokens_near_tie_windows"] == s["tokens_differing_windows"] == 0
    assert s["by_tag"] == {"in-domain": {"windows": len(utts), SAME: len(utts), "near-tie": 0, "DIFFERS": 0}}
    assert all(w["tokens"]["verdict"] == SAME for c in report["clips"] for w in c["windows"])
    table = format_table(report)
    assert "in-domain: identical token windows 3/3, near-tie 0, DIFFERS 0" in table
    assert "token differences" not in table


def _swapped_memory(monkeypatch):
    """A real defect: the encoder's cross K and V swapped before the decoder sees them."""
    from cohere_coreml.inference.transcribe import Transcriber

    encode = Transcriber.encode

    def swapped(self, features, n_valid):
        out = dict(encode(self, features, n_valid))
        out["cross_k"], out["cross_v"] = out["cross_v"], out["cross_k"]
        return out

    monkeypatch.setattr(Transcriber, "encode", swapped)


def test_verdicts_a_swapped_cross_memory_differs(trained_reference, trained_bundle, monkeypatch, capsys, caplog):
    """The broken variant: every window whose tokens change is DIFFERS (never near-tie), the table
    names the step, and `cohere-coreml verify` exits 1."""
    from cohere_coreml.cli import main
    from cohere_coreml.evaluation.verify import DIFFERS, verify_bundle

    from ..fixture_data import TRAINED_MODEL, heldout_utterances

    _swapped_memory(monkeypatch)
    model, processor = trained_reference
    utts = heldout_utterances(1)
    report = verify_bundle(model, processor, trained_bundle, [u["path"] for u in utts],
                           languages=[u["language"] for u in utts], backend="mil")
    windows = [w for c in report["clips"] for w in c["windows"]]
    assert report["summary"]["tokens_differing_windows"] == len(windows) == len(utts)
    for w in windows:
        d = w["tokens"]["difference"]
        assert d["verdict"] == DIFFERS and d["step"] == w["tokens"]["common_prefix"]
        assert d["reference_token"] == w["tokens"]["reference"][d["step"]]
        assert d["bundle_token"] == w["tokens"]["bundle"][d["step"]]
        assert d["before"]["passed"] is False  # far outside the export gate before the flip
    u = utts[0]
    assert main(["verify", "--model", str(TRAINED_MODEL), "--bundle", str(trained_bundle), "--audio", str(u["path"]),
                 "--language", u["language"], "--backend", "mil"]) == 1
    out = capsys.readouterr()
    # the table's tokens column: the verdict at the step where the tokens part (the report's, above)
    step = windows[0]["tokens"]["difference"]["step"]
    assert f"DIFFERS {step}/" in out.out and "token differences" in out.out and f"DIFFERS at step {step}" in out.out
    assert "differ from the reference beyond a near-tie" in caplog.text


def test_verdicts_the_near_tie_bound(trained_reference, trained_bundle):
    """`judge_difference` at the rule's boundary: the same bundle rows, a reference whose runner-up
    sits 0.5x (near-tie) or 4x (DIFFERS) the measured step error below its top token."""
    import numpy as np

    from cohere_coreml.config import NEAR_TIE_FACTOR
    from cohere_coreml.evaluation.verify import DIFFERS, NEAR_TIE, judge_difference
    from cohere_coreml.export.decoder_gate import teacher_forcing_case
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio, log_mel, pad_to_window

    from ..fixture_data import heldout_utterances

    model, processor = trained_reference
    u = heldout_utterances(1)[0]
    tr = Transcriber(trained_bundle, backend="mil")
    wav = load_audio(u["path"], target_rate=tr.front_end.sampling_rate)
    feats, n_valid = log_mel(wav, tr.front_end)
    memory = tr.encode(pad_to_window(feats, n_valid, frames=tr.window_frames)[0], n_valid)  # the bundle's own
    ref = processor.feature_extractor(wav, sampling_rate=tr.front_end.sampling_rate, return_tensors="pt",
                                      return_attention_mask=True)
    with torch.no_grad():
        enc = model.model.encoder(ref["input_features"], attention_mask=ref["attention_mask"].long())
    case = teacher_forcing_case(model, int(tr.bundle.manifest["encoder"]["memory_len"]), tr.bundle.prompt(u["language"]),
                                enc.last_hidden_state, enc.attention_mask, tail_garbage=0)
    k = 2  # the third generated token
    row = case.prompt_len - 1 + k
    ref_ids = case.ids[case.prompt_len:] + [int(case.log_probs[-1].argmax())]
    a = ref_ids[k]
    b = int(np.argsort(-case.log_probs[row])[1])  # the reference's runner-up at that step
    bundle_ids = ref_ids[:k] + [b]
    probe = judge_difference(tr.decoder, memory, ref_ids, bundle_ids, case.ids, case.log_probs, case.prompt_len,
                             "fp16")
    error = probe["step_error_nats"]
    assert 0 < error < 0.1 and probe["ref_margin_nats"] > NEAR_TIE_FACTOR * error  # a real margin: DIFFERS
    assert probe["verdict"] == DIFFERS and probe["before"]["passed"]
    for scale, verdict in ((0.5, NEAR_TIE), (4.0, DIFFERS)):
        lp = case.log_probs.copy()
        lp[row, b] = lp[row, a] - scale * error
        got = judge_difference(tr.decoder, memory, ref_ids, bundle_ids, case.ids, lp, case.prompt_len, "fp16")
        assert got["verdict"] == verdict, (scale, got)
        assert got["ref_margin_nats"] == pytest.approx(scale * error, rel=1e-6)
        assert got["step_error_nats"] == pytest.approx(error, rel=1e-9)  # measured on the other top tokens


def test_verdicts_a_length_difference():
    from cohere_coreml.evaluation.verify import DIFFERS, judge_difference

    got = judge_difference(None, {}, [5, 6, 7], [5, 6], [1, 2, 5, 6], None, 2, "fp16")
    assert got["verdict"] == DIFFERS and got["step"] == 2 and "lengths differ" in got["reason"]
