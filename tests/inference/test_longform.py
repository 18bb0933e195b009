"""Streamed windows equal audio.split_points; files are checked (silent / empty / corrupt / NaN) before use."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml.inference.longform import check_audio, iter_windows
from cohere_coreml.model.audio import AudioError, FrontEndConfig, load_audio, split_points

from ..fixture_data import AUDIO_DIR


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    """~3.7 min at 16 kHz (the 75 s clip three times + a medium clip): 7 windows."""
    wav = np.concatenate([load_audio(AUDIO_DIR / "en_long_75s.flac")] * 3 + [load_audio(AUDIO_DIR / "en_medium.wav")])
    path = tmp_path_factory.mktemp("long") / "long.flac"
    sf.write(path, wav, 16000)
    return path, load_audio(path)


def test_streamed_windows_equal_split_points(long_clip):
    path, wav = long_clip
    config = FrontEndConfig()
    expected = split_points(wav, config)
    got = list(iter_windows(path, config))
    assert len(expected) >= 6
    assert [(s, e) for s, e, _ in got] == expected
    for s, e, piece in got:
        np.testing.assert_array_equal(piece, wav[s:e])


@pytest.mark.parametrize("seconds", [0.5, 29.0, 33.0, 35.0, 35.01, 70.2])
def test_streamed_edges(tmp_path, seconds):
    """Clip lengths at the rule's edges (30 s whole, 35 s chunk): same pieces as split_points."""
    rng = np.random.default_rng(int(seconds * 100))
    wav = (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)
    wav[::7000] = 0.0
    path = tmp_path / "clip.wav"
    sf.write(path, wav, 16000, subtype="FLOAT")
    got = [(s, e) for s, e, _ in iter_windows(path)]
    assert got == split_points(load_audio(path))


def test_other_rates_and_arrays_are_split_whole():
    path = AUDIO_DIR / "en_stereo_44k.flac"
    wav = load_audio(path)
    assert [(s, e) for s, e, _ in iter_windows(path)] == split_points(wav)
    assert [(s, e) for s, e, _ in iter_windows(wav)] == split_points(wav)


def test_check_audio(tmp_path):
    assert check_audio(AUDIO_DIR / "en_medium.wav").status == "ok"
    assert check_audio(AUDIO_DIR / "en_stereo_44k.flac").status == "ok"  # resampled path
    silent = check_audio(AUDIO_DIR / "silence_2s.wav")
    assert silent.status == "silent" and silent.seconds == pytest.approx(2.0)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError, match=r"empty \(0 samples\)"):
        check_audio(empty)
    with pytest.raises(AudioError, match=r"empty \(0 samples\)"):  # not "1 NaN/inf sample(s) of 1"
        load_audio(empty)
    nan = tmp_path / "nan.wav"
    x = np.full(16000, 0.1, np.float32)
    x[100] = np.nan
    sf.write(nan, x, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="1 NaN/inf"):
        check_audio(nan)
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF" + b"garbage" * 20)
    with pytest.raises(AudioError, match="cannot decode"):
        check_audio(corrupt)
    with pytest.raises(AudioError, match="not found"):
        check_audio(tmp_path / "missing.wav")


def test_check_audio_arrays():
    """Arrays go through the same decision as files (the Python API passes arrays)."""
    from cohere_coreml.config import SILENCE_PEAK

    assert check_audio(np.zeros(16000, np.float32)).status == "silent"
    quiet = np.zeros(16000, np.float32)
    quiet[5] = -2 * SILENCE_PEAK
    loud = check_audio(quiet)
    assert loud.status == "ok" and loud.peak == pytest.approx(2 * SILENCE_PEAK) and loud.seconds == 1.0
    with pytest.raises(AudioError, match=r"empty \(0 samples\)"):
        check_audio(np.zeros(0, np.float32))
    with pytest.raises(AudioError, match="1 NaN/inf"):
        check_audio(np.array([0.1, np.inf], np.float32))
