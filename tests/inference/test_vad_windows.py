"""Offline transcription with a voice-activity model (docs/vad.md): probabilities over the file in blocks, speech
regions packed into windows, only those windows transcribed, every time on the original timeline."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml.bundle.format import BundleError
from cohere_coreml.inference.engines import Engine, VadUnavailableError, WindowResult
from cohere_coreml.inference.longform import iter_ranges, plan_speech, speech_probabilities
from cohere_coreml.inference.speech_regions import VadOptions, pack_windows, speech_regions
from cohere_coreml.inference.transcribe import Transcriber, bundle_vad
from cohere_coreml.inference.vad import TorchVad
from cohere_coreml.model.audio import FrontEndConfig, load_audio

from ..fixture_data import AUDIO_DIR, heldout_utterances
from ..helpers import EnergyVad, tones

SR = 16000


class FakeEngine(Engine):
    """Records each window it is asked to transcribe; its word sits 0.1 s into the window."""

    kind, name, load_s, eos_ids = "fake", "fake", 0.0, set()

    def __init__(self, vad=None):
        self.front_end = FrontEndConfig()
        self.vad = vad
        self.calls = []

    def prompt(self, language, punctuation=True):
        return [1]

    def speech_probabilities(self, vad="auto"):
        return None if vad == "off" else self.vad if self.vad is not None else super().speech_probabilities(vad)

    def transcribe_window(self, waveform, prompt, *, index, start_s, max_new_tokens, beams, repetition_guard,
                          word_timestamps=False, language=None):
        self.calls.append((start_s, np.array(waveform)))
        words = [{"word": f"w{index}", "start": start_s + 0.1, "end": start_s + 0.2, "probability": 1.0}]
        return WindowResult(index=index, start_s=start_s, duration_s=len(waveform) / SR, token_ids=[5],
                            text=f"w{index}", truncated=False, stop_reason="eos",
                            words=words if word_timestamps else None)


SPANS = [(1.0, 2.0), (2.5, 3.0), (8.0, 9.0), (9.5, 50.0), (52.5, 53.0)]


def test_windows_hold_the_speech_only_and_keep_the_original_timeline():
    wav = tones(SPANS, 60.0)
    engine = FakeEngine(EnergyVad())
    result = engine.transcribe(wav, "en", word_timestamps=True)
    plan = plan_speech(wav, EnergyVad())
    seconds = result.vad.pop("seconds")
    assert result.vad == plan.summary() and result.vad["windows"] == len(result.windows) >= 4
    assert 0 < seconds < 60  # the VAD pass's own time, reported beside the windows'
    assert [round(s * SR) for s, _ in engine.calls] == [s for s, _ in plan.windows]
    for (start_s, piece), (start, end) in zip(engine.calls, plan.windows):
        np.testing.assert_array_equal(piece, wav[start:end])  # the original samples, nothing else
        assert end - start <= 35 * SR
    for span in SPANS:  # every tone inside one window
        assert any(s <= span[0] * SR and span[1] * SR <= e for s, e in plan.windows) or span[1] - span[0] > 35
    covered = np.zeros(wav.size, bool)
    for s, e in plan.windows:
        covered[s:e] = True
    assert not covered[int(3.2 * SR) : int(7.8 * SR)].any(), "a 5 s pause is never decoded"
    assert covered[int(9.5 * SR) : int(50.0 * SR)].all(), "the 40.5 s tone is cut into windows, not dropped"
    assert result.vad["decoded_share"] < 0.95
    assert [w["start"] for w in result.words] == pytest.approx([w.start_s + 0.1 for w in result.windows])
    assert result.to_dict()["vad"]["windows"] == len(result.windows)


def test_windows_follow_the_rule_on_the_probabilities():
    wav = tones(SPANS, 60.0)
    options = VadOptions(min_silence_ms=300, speech_pad_ms=100, max_gap_s=0.2)
    plan = plan_speech(wav, EnergyVad(), options)
    regions = speech_regions(EnergyVad().probabilities(wav), wav.size, options, 35.0)
    assert plan.regions == regions
    assert plan.windows == pack_windows(regions, wav.size, 35 * SR, int(0.2 * SR))
    assert len(plan.windows) > len(plan_speech(wav, EnergyVad()).windows), "a shorter max_gap makes more windows"


def test_no_speech_is_an_empty_transcript_with_no_window_and_off_is_todays_split():
    noise = np.random.default_rng(1).normal(0, 1e-3, 60 * SR).astype(np.float32)
    engine = FakeEngine(EnergyVad())
    result = engine.transcribe(noise, "en")
    assert result.text == "" and result.windows == [] and not engine.calls and not result.silent
    assert result.vad["windows"] == 0 and result.vad["decoded_s"] == 0
    off = engine.transcribe(noise, "en", vad="off")
    assert len(off.windows) == 2 and off.vad is None and "vad" not in off.to_dict()


def test_files_give_the_arrays_windows(tmp_path):
    wav = tones(SPANS, 60.0, seed=2)
    flac = tmp_path / "clip.flac"
    sf.write(flac, wav, SR, subtype="PCM_24")
    wav = load_audio(flac)  # what the file holds
    want = plan_speech(wav, EnergyVad())
    got = plan_speech(flac, EnergyVad())
    assert (got.windows, got.n_samples, got.loaded) == (want.windows, want.n_samples, None)
    for (s, e, piece), (s2, e2, piece2) in zip(iter_ranges(flac, got), iter_ranges(wav, want), strict=True):
        assert (s, e) == (s2, e2)
        np.testing.assert_array_equal(piece, piece2)
    resampled = tmp_path / "clip44.wav"  # another rate: loaded whole, resampled as today
    sf.write(resampled, tones(SPANS, 60.0, seed=2).repeat(2), 2 * SR, subtype="FLOAT")
    plan = plan_speech(resampled, EnergyVad())
    assert plan.loaded is not None and plan.n_samples == 60 * SR
    assert [p.size for _, _, p in iter_ranges(resampled, plan)] == [e - s for s, e in plan.windows]


def test_block_probabilities_equal_the_whole_signals():
    """The file is scored in blocks through the VAD's stream: the same probabilities as the whole signal."""
    wav = load_audio(AUDIO_DIR / "en_long_75s.flac")[: 12 * SR + 100]
    vad = TorchVad()
    blocks = [wav[:1000], wav[1000:1000], wav[1000 : 5 * SR + 7], wav[5 * SR + 7 :]]
    got, total = speech_probabilities(blocks, vad)
    want = vad.probabilities(wav)
    assert total == wav.size and got.shape == want.shape == (-(-wav.size // 512),)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert speech_regions(got, total) == speech_regions(want, total)


def test_vad_modes_and_the_missing_vad_message():
    engine = FakeEngine()
    assert engine.speech_probabilities("auto") is None and engine.speech_probabilities("off") is None
    with pytest.raises(VadUnavailableError):
        engine.transcribe(tones([(1.0, 2.0)], 5.0), "en", vad="on")
    with pytest.raises(ValueError, match="vad must be one of auto, on, off"):
        engine.transcribe(tones([(1.0, 2.0)], 5.0), "en", vad="yes")
    with pytest.raises(TypeError, match="vad_options must be a VadOptions"):
        FakeEngine(EnergyVad()).transcribe(tones([(1.0, 2.0)], 5.0), "en", vad_options={"threshold": 0.3})
    tr = object.__new__(Transcriber)  # a bundle without vad: no model needed to decide
    tr.bundle = SimpleNamespace(manifest={"files": {}}, dirs=[Path("out/f16")], paths={})
    tr.backend, tr.compute_units = "mil", "all"
    assert tr.speech_probabilities("auto") is None and tr.speech_probabilities("off") is None
    with pytest.raises(VadUnavailableError) as err:
        tr.speech_probabilities("on")
    assert str(err.value) == ("bundle out/f16 has no vad.mlpackage: re-export with `cohere-coreml export --vad` "
                              "(the default)")
    missing = SimpleNamespace(manifest={"files": {"vad": "vad.mlpackage"}, "vad": {"model": "silero-vad"}},
                              dirs=[Path("/nonexistent")], paths={})
    with pytest.raises(BundleError, match="bundle is missing vad.mlpackage"):
        bundle_vad(missing)


def test_the_bundles_vad_loads_on_its_manifests_compute_units(trained_bundle, monkeypatch):
    """As the front end: the manifest's `vad.compute_units` (the export's), not the recogniser's."""
    import cohere_coreml.inference.vad as vad_module
    from cohere_coreml.bundle.load import Bundle

    asked = []
    monkeypatch.setattr(vad_module, "vad_for", lambda bundle, backend, compute_units: asked.append(compute_units))
    bundle = Bundle.load(trained_bundle)
    assert bundle.manifest["vad"]["compute_units"] == "cpu_and_gpu"
    bundle_vad(bundle, "mil", "all")
    bundle.manifest["vad"].pop("compute_units")  # an entry without them: the caller's
    bundle_vad(bundle, "mil", "cpu_only")
    assert asked == ["cpu_and_gpu", "cpu_only"]


@pytest.fixture(scope="module")
def demo_transcriber(trained_bundle):
    """The session bundle's Transcriber with the PyTorch VAD as its VAD (the rule's oracle scores with it)."""
    tr = Transcriber(trained_bundle, backend="mil")
    tr._vad = TorchVad()
    return tr


def test_word_timings_with_leading_silence_are_on_the_original_timeline(demo_transcriber):
    """A held-out clip after 1.5 s of low noise: the VAD's window starts after the noise; its words equal the
    words of that window's audio transcribed alone (no VAD), moved by the window's start (within one frame)."""
    tr = demo_transcriber
    frame = tr.alignment["frame_seconds"]
    lead = np.random.default_rng(3).normal(0, 1e-3, int(1.5 * SR)).astype(np.float32)
    checked = 0
    for u in heldout_utterances(2)[:2]:
        clip = load_audio(u["path"])
        wav = np.concatenate([lead, clip])
        on = tr.transcribe(wav, u["language"], word_timestamps=True, vad="on")
        assert on.vad["windows"] == len(on.windows) == 1
        window = on.windows[0]
        assert 1.5 - 0.2 <= window.start_s and window.start_s + window.duration_s <= wav.size / SR
        start = round(window.start_s * SR)
        alone = tr.transcribe(wav[start : start + round(window.duration_s * SR)], u["language"],
                              word_timestamps=True, vad="off")
        assert on.text == alone.text
        assert [w["word"] for w in on.words] == [w["word"] for w in alone.words]
        for a, b in zip(on.words, alone.words):
            assert abs(a["start"] - (b["start"] + window.start_s)) <= frame + 1e-6
            assert abs(a["end"] - (b["end"] + window.start_s)) <= frame + 1e-6
            assert a["start"] >= window.start_s - 1e-6
        checked += len(on.words)
    assert checked >= 2


# --------------------------------------------------------------------------------------------------
# CLI and bench
# --------------------------------------------------------------------------------------------------


def run_cli(capsys, *args):
    from cohere_coreml.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def padded_clip(tmp_path_factory):
    """A held-out English clip between 6 s of low noise and 3 s more (16 kHz FLAC)."""
    rng = np.random.default_rng(4)
    wav = np.concatenate([rng.normal(0, 1e-3, 6 * SR).astype(np.float32),
                          load_audio(heldout_utterances(2)[3]["path"]),
                          rng.normal(0, 1e-3, 3 * SR).astype(np.float32)])
    path = tmp_path_factory.mktemp("vad-cli") / "padded.flac"
    sf.write(path, wav, SR, subtype="PCM_24")
    return path


def test_cli_vad_errors_are_one_line(trained_bundle_without_vad, padded_clip, capsys):
    base = [str(padded_clip), "--bundle", str(trained_bundle_without_vad), "--language", "en", "--backend", "mil"]
    for extra in ([], ["--stream", "--no-pace"]):
        code, out, err = run_cli(capsys, "transcribe", *base, "--vad", "on", *extra)
        assert code != 0 and out == ""
        assert err.strip().splitlines()[-1].endswith(
            f"bundle {trained_bundle_without_vad} has no vad.mlpackage: re-export with `cohere-coreml export --vad` (the default)")
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    for flag, value, words in (("--vad-threshold", "1.5", "VAD threshold must be between 0 and 1"),
                               ("--vad-min-speech-ms", "-5", "VAD min_speech_ms must be a whole number"),
                               ("--vad-max-gap-s", "-1", "VAD max_gap_s must be >= 0")):
        code, out, err = run_cli(capsys, "transcribe", *base, flag, value)
        assert code != 0 and out == "" and words in err and "Traceback" not in err, err
    data = tmp_dataset(padded_clip)
    code, out, err = run_cli(capsys, "bench", "--bundle", str(trained_bundle_without_vad), "--data", str(data), "--vad", "on",
                             "--out", str(data / "out"))
    assert code != 0 and out == "" and "has no vad.mlpackage" in err and "Traceback" not in err


def tmp_dataset(clip: Path) -> Path:
    folder = clip.parent / "data"
    folder.mkdir(exist_ok=True)
    (folder / clip.name).write_bytes(clip.read_bytes())
    entry = {"audio": clip.name, "text": heldout_utterances(2)[3]["text"], "language": "en"}
    (folder / "manifest.jsonl").write_text(json.dumps(entry) + "\n")
    return folder


def test_cli_transcribes_the_speech_windows_only(trained_bundle, padded_clip, capsys, monkeypatch):
    """With a VAD (the PyTorch module standing in for the bundle's package) the JSON names the windows decoded,
    on the file's timeline; text output is the transcript alone; bench reports the share of audio decoded."""
    vad = TorchVad()
    monkeypatch.setattr(Transcriber, "speech_probabilities",
                        lambda self, mode="auto": None if mode == "off" else vad)
    base = [str(padded_clip), "--bundle", str(trained_bundle), "--language", "en", "--backend", "mil"]
    code, out, _ = run_cli(capsys, "transcribe", *base, "--json")
    data = json.loads(out)
    assert code == 0 and data["vad"]["windows"] == len(data["windows"]) == 1
    window = data["windows"][0]
    assert 5.5 <= window["start_s"] and window["start_s"] + window["duration_s"] <= 6.0 + 4.0
    assert data["vad"]["decoded_share"] < 0.5
    code, out, _ = run_cli(capsys, "transcribe", *base)
    assert code == 0 and out == data["text"] + "\n"
    folder = tmp_dataset(padded_clip)
    code, out, _ = run_cli(capsys, "bench", "--bundle", str(trained_bundle), "--data", str(folder),
                           "--backend", "mil", "--out", str(folder / "out"))
    report = json.loads((folder / "out" / "bench.json").read_text())
    engine = report["engines"][0]
    assert code == 0 and engine["vad"]["on"] and engine["windows"] == 1
    assert engine["decoded_share"] == pytest.approx(data["vad"]["decoded_share"], abs=1e-3)
    assert "(VAD)" in out
