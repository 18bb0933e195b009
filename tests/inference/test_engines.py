"""The transcriber interface: the batch runner's robustness, and the PyTorch reference engine."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from cohere_coreml.inference.engines import Engine, PyTorchEngine, transcribe_files
from cohere_coreml.inference.transcribe import WindowResult

from ..fixture_data import AUDIO_DIR

torch.set_num_threads(1)


class CountingEngine(Engine):
    """Records which windows reach the model; its text is the window's sample count."""

    kind, name, load_s = "fake", "fake", 0.0

    def __init__(self):
        from cohere_coreml.model.audio import FrontEndConfig

        self.front_end, self.eos_ids, self.windows = FrontEndConfig(), {3}, []

    def prompt(self, language, punctuation=True):
        return [1, 2]

    def transcribe_window(self, waveform, prompt, *, index, start_s, max_new_tokens, beams, repetition_guard):
        self.windows.append(len(waveform))
        timings = {"encoder_s": 0.0, "decoder_calls": 1, "ms_per_decoder_call": 0.0}
        return WindowResult(index, start_s, len(waveform) / 16000, [3], f"n{len(waveform)}", False, "eos", timings)


def test_batch_checks_every_file_before_loading(tmp_path):
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    events = []
    engine = CountingEngine()

    def make():
        events.append("load")
        return engine

    paths = [AUDIO_DIR / "silence_2s.wav", empty, tmp_path / "missing.flac", AUDIO_DIR / "en_short.wav"]
    entries, failed = transcribe_files(paths, make, "en")
    assert failed and events == ["load"]
    assert [e["status"] for e in entries] == ["silent", "error", "error", "ok"]
    assert entries[0]["text"] == "" and entries[0]["windows"] == [] and entries[0]["silent"]
    assert "empty (0 samples)" in entries[1]["error"] and "not found" in entries[2]["error"]
    assert entries[3]["text"].startswith("n") and len(engine.windows) == 1  # the silent file never reached it


def test_batch_of_silence_loads_no_model():
    entries, failed = transcribe_files([AUDIO_DIR / "silence_2s.wav"], lambda: pytest.fail("model loaded"), "en")
    assert not failed and entries[0]["status"] == "silent"


def test_cli_reports_bad_files_and_exit_status(tmp_path, capsys, caplog, monkeypatch):
    """`cohere-coreml transcribe` on silence + a corrupt file + speech, with a fake bundle engine: the
    results alone on stdout (the corrupt file has no entry), the corrupt file named in the log, exit 1."""
    import json

    import cohere_coreml.inference.transcribe as transcribe
    from cohere_coreml.cli import main

    monkeypatch.setattr(transcribe, "Transcriber", lambda *a, **k: CountingEngine())
    corrupt = tmp_path / "bad.wav"
    corrupt.write_bytes(b"RIFF" + b"x" * 64)
    files = [str(AUDIO_DIR / "silence_2s.wav"), str(corrupt), str(AUDIO_DIR / "de_short.wav")]
    rc = main(["transcribe", *files, "--bundle", str(tmp_path), "--language", "de", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert [(d["audio"], d["status"]) for d in data] == [(files[0], "silent"), (files[2], "ok")]
    assert not any("error" in d for d in data)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("bad.wav" in m and "cannot decode" in m for m in errors)
    caplog.clear()
    rc = main(["transcribe", *files, "--bundle", str(tmp_path), "--language", "de"])
    out = capsys.readouterr().out
    assert rc == 1 and "bad.wav" not in out and "ERROR" not in out
    assert out == f"== {files[0]}\n(silent)\n== {files[2]}\n{data[1]['text']}\n"
    rc = main(["transcribe", str(AUDIO_DIR / "de_short.wav"), "--bundle", str(tmp_path), "--language", "de"])
    assert rc == 0 and capsys.readouterr().out == data[1]["text"] + "\n"
    rc = main(["transcribe", str(corrupt), "--bundle", str(tmp_path), "--language", "de", "--json"])
    assert rc == 1 and capsys.readouterr().out == ""  # one input file that failed: nothing on stdout


@pytest.mark.parametrize("peak_ratio", [0.5, 2.0])
def test_api_and_batch_agree_on_silence(tmp_path, peak_ratio):
    """One place decides silence (longform.check_audio, config.SILENCE_PEAK): the batch runner of
    `cohere-coreml transcribe` and `Engine.transcribe` (the Python API's loop) give the same status,
    on both sides of the threshold, for a file and for an array; silence never reaches the model."""
    from cohere_coreml.config import SILENCE_PEAK

    wav = np.zeros(16000, np.float32)
    wav[::400] = peak_ratio * SILENCE_PEAK
    path = tmp_path / "quiet.wav"
    sf.write(path, wav, 16000, subtype="FLOAT")
    silent = peak_ratio < 1
    engine = CountingEngine()
    entries, failed = transcribe_files([path], lambda: engine, "en")
    assert not failed and entries[0]["status"] == ("silent" if silent else "ok")
    assert entries[0]["silent"] is silent
    for source in (path, wav):
        result = engine.transcribe(source, "en")
        assert result.silent is silent and (result.text == "") is silent and (result.windows == []) is silent
    assert len(engine.windows) == (0 if silent else 3)  # batch + file + array
    if silent:
        api = engine.transcribe(path, "en").to_dict()
        assert {k: entries[0][k] for k in api} == api  # the CLI's JSON holds the API's result


@pytest.fixture(scope="module")
def trained():
    from ..fixture_data import TRAINED_MODEL

    if not (TRAINED_MODEL / "config.json").is_file():
        pytest.skip("the committed trained model is missing")
    return PyTorchEngine(TRAINED_MODEL, margins=True)


def test_pytorch_engine_equals_batched_greedy_decode(trained):
    """The engine's windows (features + encoder + generate(encoder_outputs=...)) give the ids and
    margins of the dev evaluation's greedy_decode (input_features straight into a batched generate())."""
    from cohere_coreml.model.audio import load_audio, log_mel
    from cohere_coreml_dev.evaluate import greedy_decode

    clips = [("en_medium.wav", "en"), ("de_medium.wav", "de"), ("es_short.wav", "es")]
    feats = []
    for name, _ in clips:
        f, n = log_mel(load_audio(AUDIO_DIR / name), trained.front_end)
        feats.append(f[:, :n])
    ref = greedy_decode(trained.model, trained.tokenizer, feats, [l for _, l in clips], max_new_tokens=64)
    for (name, lang), r in zip(clips, ref):
        result = trained.transcribe(AUDIO_DIR / name, lang, max_new_tokens=64)
        w = result.windows[0]
        assert w.token_ids == r.ids and result.text == r.text
        np.testing.assert_allclose(w.decoding["margins"], r.margins, atol=1e-4)
        assert w.stop_reason == "eos" and w.timings["encoder_s"] > 0


def test_pytorch_engine_limits_and_beams(trained):
    w = trained.transcribe(AUDIO_DIR / "en_medium.wav", "en", max_new_tokens=3).windows[0]
    assert len(w.token_ids) == 3 and w.stop_reason == "max_new_tokens" and w.truncated
    greedy = trained.transcribe(AUDIO_DIR / "es_medium.wav", "es")
    beam1 = trained.transcribe(AUDIO_DIR / "es_medium.wav", "es", beams=1)
    assert greedy.token_ids == beam1.token_ids
    beam3 = trained.transcribe(AUDIO_DIR / "es_medium.wav", "es", beams=3)
    assert beam3.windows[0].stop_reason == "eos" and beam3.windows[0].decoding["beams"] == 3
