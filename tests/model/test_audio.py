import numpy as np
import pytest
import soundfile as sf
import torch

from cohere_coreml.model.audio import (
    AudioError,
    FrontEndConfig,
    check_speech,
    load_audio,
    log_mel,
    pad_to_window,
    split_long_audio,
    split_points,
    window_features,
)

from ..fixture_data import audio_manifest

CLIPS = audio_manifest()
TOLERANCE = 1e-4  # max absolute difference on valid frames (issue: <= 1e-4)


def reference_features(waveform, dither=0.0, feature_size=128):
    """(features (n_mels, frames), valid frames) from the transformers extractor, one clip, no batching."""
    from transformers import CohereAsrFeatureExtractor

    fe = CohereAsrFeatureExtractor(dither=dither, feature_size=feature_size)
    out = fe(waveform, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    assert len(out["audio_chunk_index"]) == 1
    return out["input_features"][0].T, int(out["attention_mask"][0].sum())


def assert_same_features(waveform, config=None, dither=0.0, feature_size=128):
    config = config or FrontEndConfig(dither=dither, n_mels=feature_size)
    ours, n_valid = log_mel(waveform, config)
    ref, ref_valid = reference_features(waveform, dither=dither, feature_size=feature_size)
    assert n_valid == ref_valid
    assert ours.shape == ref.shape
    assert np.abs(ours[:, :n_valid] - ref[:, :n_valid]).max() <= TOLERANCE
    assert not ours[:, n_valid:].any() and not ref[:, n_valid:].any()
    return np.abs(ours[:, :n_valid] - ref[:, :n_valid]).max()


# ----------------------------------------------------------------------------------------- features


@pytest.mark.parametrize("clip", [c for c in CLIPS if c.get("seconds", 0) <= 30], ids=lambda c: c["file"])
def test_log_mel_matches_extractor_on_test_clips(clip):
    wav = load_audio(clip["path"])
    assert_same_features(wav)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 15999])
@pytest.mark.parametrize("n", [1, 3, 7, 12345])
def test_resample_is_librosas_soxr_hq_sample_for_sample(rate, n):
    """`audio.resample` calls soxr itself (librosa's resample compiles numba code on its first call): the
    output must stay librosa.resample(res_type="soxr_hq")'s, length (ceil(n x 16000 / rate)) included."""
    import librosa

    from cohere_coreml.model.audio import resample

    wav = (0.1 * np.random.default_rng(rate + n).standard_normal(n)).astype(np.float32)
    want = librosa.resample(wav, orig_sr=rate, target_sr=16000, res_type="soxr_hq").astype(np.float32)
    got = resample(wav, rate, 16000)
    assert got.dtype == np.float32 and got.shape == want.shape and np.array_equal(got, want)


def test_test_clips_exist():
    speech = [c for c in CLIPS if c.get("purpose", "speech") == "speech"]
    assert len(speech) >= 10, "tests/data/audio must hold at least 10 speech clips (tools/data/make_test_audio.py)"
    assert len({c["language"] for c in speech}) >= 3


@pytest.mark.parametrize("seconds", [0.03, 0.05, 1.0, 7.77, 35.0])
def test_log_mel_matches_extractor_on_signals(seconds):
    rng = np.random.default_rng(int(seconds * 100))
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    wav = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)
    assert_same_features(wav)


def test_log_mel_with_dither_matches_extractor():
    wav = (0.1 * np.random.default_rng(1).standard_normal(24000)).astype(np.float32)
    assert_same_features(wav, dither=1e-5)


def test_log_mel_other_mel_count():
    wav = (0.1 * np.random.default_rng(2).standard_normal(16000)).astype(np.float32)
    assert_same_features(wav, feature_size=80)


def test_silence_matches_extractor_and_check_speech_refuses_it():
    wav = np.zeros(16000, dtype=np.float32)
    ours, n_valid = log_mel(wav)
    ref, _ = reference_features(wav)
    assert n_valid == 100
    assert np.abs(ours - ref).max() <= TOLERANCE
    with pytest.raises(AudioError, match="silent"):
        check_speech(wav)


def test_valid_frames_and_padding():
    wav = np.random.default_rng(3).standard_normal(16000 * 2 + 37).astype(np.float32) * 0.1
    features, n_valid = log_mel(wav)
    assert n_valid == (wav.size + 512 - 512) // 160
    assert features.shape == (128, wav.size // 160 + 1)
    window, valid = pad_to_window(features, n_valid, frames=3500)
    assert window.shape == (128, 3500) and valid == n_valid
    np.testing.assert_array_equal(window[:, :n_valid], features[:, :n_valid])
    assert not window[:, n_valid:].any()
    batch, valid = window_features(wav, frames=3500)
    assert batch.shape == (1, 128, 3500) and valid == n_valid


def test_window_frames_for_35_seconds():
    from cohere_coreml.model.shapes import window_frames

    config = FrontEndConfig()
    assert window_frames(35.0, config.sampling_rate, config.hop_length) == 3500


def test_clip_longer_than_window_is_an_error():
    wav = np.random.default_rng(4).standard_normal(16000 * 36).astype(np.float32) * 0.1
    features, n_valid = log_mel(wav)
    with pytest.raises(AudioError, match="longer|split_long_audio"):
        pad_to_window(features, n_valid, frames=3500)


def test_config_from_processor(tiny_reference):
    _, processor = tiny_reference
    config = FrontEndConfig.from_processor(processor, dither=0.0)
    assert (config.n_fft, config.hop_length, config.win_length, config.n_mels) == (512, 160, 400, 128)
    assert FrontEndConfig.from_processor(processor).dither == processor.feature_extractor.dither


# ----------------------------------------------------------------------------------------- long audio


def _long_clip():
    long = [c for c in CLIPS if c.get("seconds", 0) > 70]
    if long:
        return load_audio(long[0]["path"])
    # speech-like bursts with pauses, as a fallback when the committed clip is absent
    rng = np.random.default_rng(5)
    parts = []
    for i in range(40):
        burst = rng.standard_normal(int(16000 * rng.uniform(0.8, 2.5))) * rng.uniform(0.05, 0.3)
        parts += [burst, np.zeros(int(16000 * rng.uniform(0.05, 0.6)))]
    return np.concatenate(parts).astype(np.float32)


def test_split_long_audio_same_boundaries_as_extractor():
    from transformers import CohereAsrFeatureExtractor

    wav = _long_clip()
    assert wav.size > 70 * 16000
    fe = CohereAsrFeatureExtractor(dither=0.0)
    ref_chunks = fe._split_audio_chunks_energy(torch.from_numpy(wav))
    ours = split_long_audio(wav)
    assert [c.shape[0] for c in ours] == [c.shape[0] for c in ref_chunks]
    assert len(ours) >= 3
    assert all(c.shape[0] <= 35 * 16000 for c in ours)
    np.testing.assert_array_equal(np.concatenate(ours), wav)
    # and through the public extractor call: same chunk count and valid frames per chunk
    out = fe(wav, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    assert len(out["audio_chunk_index"]) == len(ours)
    assert out["attention_mask"].sum(axis=1).tolist() == [c.shape[0] // 160 for c in ours]


def test_short_audio_is_not_split():
    wav = np.ones(30 * 16000, dtype=np.float32)
    assert split_points(wav) == [(0, wav.size)]


# ----------------------------------------------------------------------------------------- loading


def test_load_resamples_and_downmixes(tmp_path):
    t = np.arange(44100 * 2) / 44100
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    right = 0.1 * np.sin(2 * np.pi * 440 * t)
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1), 44100, subtype="PCM_16")
    wav = load_audio(path)
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert abs(wav.size - 32000) <= 1
    assert abs(np.abs(wav).max() - 0.3) < 0.01  # channel average


def test_load_int16_array_is_scaled():
    pcm = (np.sin(np.arange(16000) * 0.1) * 16384).astype(np.int16)
    wav = load_audio(pcm, sample_rate=16000)
    assert abs(np.abs(wav).max() - 0.5) < 1e-3


def test_load_channels_first_array():
    x = np.zeros((2, 8000), dtype=np.float32)
    x[0] = 0.2
    wav = load_audio(x, sample_rate=8000)
    assert wav.size == 16000 and abs(wav[100:-100].mean() - 0.1) < 1e-3


# length tolerance in 16 kHz samples: exact (resampling rounding only) except MP3, whose encoder
# delay / padding some libsndfile versions keep
@pytest.mark.parametrize("ext,fmt,tolerance", [(".flac", "FLAC", 1), (".ogg", "OGG", 1), (".mp3", "MP3", 1200)])
def test_load_compressed_formats(tmp_path, ext, fmt, tolerance):
    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile here cannot write {fmt}")
    x = 0.3 * np.sin(np.arange(22050) * 0.05)
    path = tmp_path / f"clip{ext}"
    sf.write(path, x, 22050, format=fmt)
    wav = load_audio(path)
    assert abs(wav.size - 16000) <= tolerance
    assert np.abs(wav).max() > 0.2
    if fmt == "FLAC":  # lossless: the samples are the resampled original
        reference = load_audio(x.astype(np.float32), sample_rate=22050)
        assert np.abs(wav - reference).max() < 1e-3


def test_bad_inputs(tmp_path):
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "missing.wav")
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really audio at all" * 10)
    with pytest.raises(AudioError, match="cannot decode"):
        load_audio(corrupt)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        load_audio(empty)
    with pytest.raises(AudioError, match="sample_rate is required"):
        load_audio(np.zeros(100, dtype=np.float32))
    with pytest.raises(AudioError, match="empty"):
        load_audio(np.zeros(0, dtype=np.float32), sample_rate=16000)
    with pytest.raises(AudioError, match="NaN"):
        load_audio(np.full(1000, np.nan, dtype=np.float32), sample_rate=16000)
    with pytest.raises(AudioError, match="NaN"):
        log_mel(np.array([0.1, np.inf] * 1000, dtype=np.float32))
    with pytest.raises(AudioError, match="too short"):
        log_mel(np.zeros(100, dtype=np.float32))
    with pytest.raises(AudioError, match="mono"):
        log_mel(np.zeros((2, 16000), dtype=np.float32))
    with pytest.raises(AudioError, match="shape"):
        load_audio(np.zeros((2, 3, 4), dtype=np.float32), sample_rate=16000)


def test_long_clip_pieces_match_extractor_batch():
    """Each piece of a long clip gives the features the extractor gives that chunk in its batch."""
    from transformers import CohereAsrFeatureExtractor

    wav = _long_clip()
    fe = CohereAsrFeatureExtractor(dither=0.0)
    ref = fe(wav, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    pieces = split_long_audio(wav)
    assert len(pieces) == ref["input_features"].shape[0]
    for i, piece in enumerate(pieces):
        ours, n_valid = log_mel(piece)
        ref_feats = ref["input_features"][i].T
        assert n_valid == int(ref["attention_mask"][i].sum())
        assert np.abs(ours[:, :n_valid] - ref_feats[:, :n_valid]).max() <= TOLERANCE
        assert not ref_feats[:, n_valid:].any()
