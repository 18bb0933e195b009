"""Audio front end: load audio, and compute exactly the features `CohereAsrFeatureExtractor` computes.

The features are the model's whole view of the audio, and a front end that is only "close" loses
everything (a port with a librosa `power_to_db` front end transcribes far worse: docs/front-end.md). This module
reproduces the reference extractor step by step, in numpy:

    waveform (N,) float32, 16 kHz mono
    -> dither (seeded by N, as the extractor does; 0 disables)
    -> pre-emphasis y[t] = x[t] - 0.97 x[t-1]
    -> STFT: centred (n_fft // 2 zeros each side), symmetric Hann window of win_length padded to n_fft,
       hop hop_length -> power spectrum |X|^2                          (n_fft // 2 + 1, frames)
    -> Slaney mel filter bank (0 .. sr/2, Slaney norm), log(x + 2**-24)  (n_mels, frames)
    -> per-feature normalisation over the valid frames (mean, std with n-1, + 1e-5); padding zeroed

frames = N // hop + 1; valid frames = (N + 2 * (n_fft // 2) - n_fft) // hop.
All parameters come from the checkpoint's preprocessor config (`FrontEndConfig.from_processor`).

Inputs and outputs are numpy arrays. The STFT, window and normalisation run on torch float32 kernels
because the reference does: its float32 rounding is part of the features (see `power_spectrum`,
`normalize`); the tests hold it to the extractor within the parity budget (tests/model/test_audio.py).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import librosa
import numpy as np
import soundfile as sf
import soxr

from ..config import SILENCE_PEAK

logger = logging.getLogger(__name__)

LOG_ZERO_GUARD = 2.0**-24
READ_BLOCK_FRAMES = 1 << 18  # frames per soundfile read
NORM_EPSILON = 1e-5


class AudioError(ValueError):
    """Audio that cannot be turned into model features (names the problem)."""


@dataclass(frozen=True)
class FrontEndConfig:
    """Parameters of the front end (defaults: Cohere Transcribe's released preprocessor config)."""

    sampling_rate: int = 16000
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 128
    preemphasis: float = 0.97
    dither: float = 0.0  # the released extractor uses 1e-5; parity work uses 0
    max_audio_clip_s: float = 35.0
    overlap_chunk_second: float = 5.0
    min_energy_window_samples: int = 1600

    @classmethod
    def from_feature_extractor(cls, fe, dither: float | None = None) -> FrontEndConfig:
        """From a `CohereAsrFeatureExtractor`; `dither=None` keeps the extractor's own value."""
        return cls(
            sampling_rate=int(fe.sampling_rate),
            n_fft=int(fe.n_fft),
            win_length=int(fe.win_length),
            hop_length=int(fe.hop_length),
            n_mels=int(fe.feature_size),
            preemphasis=float(fe.preemphasis or 0.0),
            dither=float(fe.dither if dither is None else dither),
            max_audio_clip_s=float(fe.max_audio_clip_s),
            overlap_chunk_second=float(fe.overlap_chunk_second),
            min_energy_window_samples=int(fe.min_energy_window_samples),
        )

    @classmethod
    def from_processor(cls, processor, dither: float | None = None) -> FrontEndConfig:
        return cls.from_feature_extractor(processor.feature_extractor, dither=dither)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dither: float | None = None) -> FrontEndConfig:
        """From a checkpoint folder's preprocessor/processor config."""
        from transformers import AutoFeatureExtractor  # heavy: only reading a checkpoint's config needs it

        return cls.from_feature_extractor(AutoFeatureExtractor.from_pretrained(str(path)), dither=dither)

    @classmethod
    def from_dict(cls, data: dict) -> FrontEndConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_audio(source, sample_rate: int | None = None, target_rate: int = 16000) -> np.ndarray:
    """float32 mono audio at `target_rate` from a file path or an array.

    Files: wav/flac/ogg (soundfile), mp3 and others (librosa). Arrays: pass `sample_rate`;
    shape (samples,), (samples, channels) or (channels, samples) with at most 8 channels.
    Integer PCM is scaled to [-1, 1); channels are averaged; any rate is resampled.
    """
    if isinstance(source, (str, os.PathLike)):
        data, rate = _read_file(Path(source))
        if sample_rate is not None and sample_rate != rate:
            raise AudioError(f"{source}: file is {rate} Hz but sample_rate={sample_rate} was given")
        name = str(source)
        # a file's layout is known, (samples, channels): every channel is averaged, as the streamed
        # reader (longform) and the Swift WAVReader do, whatever the channel and sample counts
        mono = _to_mono_float(data, name, channels_last=True)
    else:
        if sample_rate is None:
            raise AudioError("sample_rate is required with a raw array (the model expects 16000 Hz audio)")
        data, rate, name = np.asarray(source), int(sample_rate), "audio array"
        mono = _to_mono_float(data, name)
    if rate <= 0:
        raise AudioError(f"{name}: invalid sample rate {rate}")
    check_waveform(mono, name)  # before resampling: the resampler refuses NaN/inf with its own exception
    if rate != target_rate:
        logger.debug("resampling %s from %d Hz to %d Hz", name, rate, target_rate)
        mono = resample(mono, rate, target_rate)
        if mono.size == 0:
            raise AudioError(f"{name} is too short to resample: {data.shape[0]} sample(s) at {rate} Hz give none at "
                             f"{target_rate} Hz")
    check_waveform(mono, name)
    return np.ascontiguousarray(mono, dtype=np.float32)


def resample(mono: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """float32 `mono` from `rate` to `target_rate` Hz: soxr's high quality, the output cut or zero-padded to
    ceil(n x target / rate) samples. Sample for sample `librosa.resample(res_type="soxr_hq")` (what this
    called before: tests/model/test_audio.py), without it: its first call in a process compiles librosa's numba
    code, which takes many seconds in every new process."""
    n = int(np.ceil(mono.shape[0] * float(target_rate) / rate))
    out = soxr.resample(mono, rate, target_rate, quality="soxr_hq")
    out = out[:n] if out.shape[0] >= n else np.pad(out, (0, n - out.shape[0]))
    return np.asarray(out, dtype=np.float32)


def check_file(path: Path) -> None:
    """A named `AudioError` for a missing path, a folder, or a 0-byte file."""
    if not path.exists():
        raise AudioError(f"audio file not found: {path}")
    if not path.is_file():
        raise AudioError(f"not an audio file: {path}")
    if path.stat().st_size == 0:
        raise AudioError(f"audio file is empty (0 bytes): {path}")


def _read_file(path: Path) -> tuple[np.ndarray, int]:
    check_file(path)

    try:
        # block by block, not sf.read: a corrupt header can claim billions of frames, and sf.read allocates
        # what the header claims up front (a small FLAC with one byte changed can ask for tens of GiB)
        with sf.SoundFile(str(path)) as f:
            blocks, rate = [], int(f.samplerate)
            while (block := f.read(READ_BLOCK_FRAMES, dtype="float32", always_2d=True)).shape[0]:
                blocks.append(block)
            channels = f.channels
        data = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
        return data, rate  # (samples, channels)
    except MemoryError:
        raise AudioError(f"audio file {path} decodes to more samples than fit in memory") from None
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data, rate = librosa.load(str(path), sr=None, mono=False)
    except Exception as err:  # audioread/soundfile raise many unrelated types for corrupt files
        raise AudioError(f"cannot decode audio file {path} ({type(err).__name__}): corrupt or unsupported format") from None
    data = np.asarray(data, dtype=np.float32)
    return (data.T if data.ndim == 2 else data), int(rate)


def _to_mono_float(data: np.ndarray, name: str, channels_last: bool = False) -> np.ndarray:
    """float32 mono of integer or float audio; 2-D: `channels_last` (a file's (samples, channels)), else
    the layout is told from the shape (at most 8 channels)."""
    if data.size == 0:  # before the channel average: mean of 0 samples would be 1 NaN
        raise AudioError(f"{name} is empty (0 samples)")
    if data.dtype.kind in "iu":
        info = np.iinfo(data.dtype)
        if data.dtype.kind == "u":
            data = (data.astype(np.float64) - (info.max + 1) / 2) / ((info.max + 1) / 2)
        else:
            data = data.astype(np.float64) / -float(info.min)
    elif data.dtype.kind == "f":
        data = data.astype(np.float32, copy=False)
    elif data.dtype.kind == "b" or data.dtype.kind == "O":
        raise AudioError(f"{name}: audio must be numeric, got dtype {data.dtype}")
    if data.ndim == 2 and channels_last:
        data = data.mean(axis=1)
    elif data.ndim == 2:
        if data.shape[1] <= 8 and data.shape[0] >= data.shape[1]:
            data = data.mean(axis=1)  # (samples, channels)
        elif data.shape[0] <= 8:
            data = data.mean(axis=0)  # (channels, samples)
        else:
            raise AudioError(f"{name}: cannot tell channels from samples in shape {data.shape}")
    elif data.ndim != 1:
        raise AudioError(f"{name}: expected 1-D or 2-D audio, got shape {data.shape}")
    return np.asarray(data, dtype=np.float32)


def check_waveform(waveform: np.ndarray, name: str = "audio") -> None:
    """Errors for audio that is empty or holds NaN/inf."""
    if waveform.size == 0:
        raise AudioError(f"{name} is empty (0 samples)")
    finite = np.isfinite(waveform)
    if not finite.all():
        bad = int((~finite).sum())
        raise AudioError(f"{name} holds {bad} NaN/inf sample(s) of {waveform.size}")


def is_silent(peak: float) -> bool:
    """Digital silence: the one test (`config.SILENCE_PEAK`) behind `check_speech` and
    `longform.check_audio` (where transcription gives an empty transcript marked silent)."""
    return peak < SILENCE_PEAK


def check_speech(waveform: np.ndarray, name: str = "audio") -> None:
    """Error for audio that is empty, holds NaN/inf or is digitally silent, for callers that need
    speech (a parity check)."""
    waveform = np.asarray(waveform, dtype=np.float32)
    check_waveform(waveform, name)
    peak = float(np.max(np.abs(waveform)))
    if is_silent(peak):
        raise AudioError(f"{name} is silent (peak amplitude {peak:.2e}): nothing to transcribe")


# --------------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def mel_filters(config: FrontEndConfig) -> np.ndarray:
    """Slaney mel filter bank (n_mels, n_fft // 2 + 1), float32, as the reference extractor builds it.

    Cached per config (building it costs more than the features of a short clip); read-only.
    """
    from transformers.audio_utils import mel_filter_bank  # heavy: audio imports without transformers

    filters = mel_filter_bank(
        num_frequency_bins=config.n_fft // 2 + 1,
        num_mel_filters=config.n_mels,
        min_frequency=0.0,
        max_frequency=config.sampling_rate / 2,
        sampling_rate=config.sampling_rate,
        norm="slaney",
        mel_scale="slaney",
        dtype=np.float32,
    )
    filters = np.ascontiguousarray(filters.T)
    filters.setflags(write=False)
    return filters


def stft_window(config: FrontEndConfig) -> np.ndarray:
    """Symmetric Hann window of win_length (float32, computed by torch exactly as the reference)."""
    import torch  # heavy: audio imports without torch (bundle, export use FrontEndConfig only)

    return torch.hann_window(config.win_length, periodic=False, dtype=torch.float32).numpy()


def power_spectrum(x: np.ndarray, config: FrontEndConfig) -> np.ndarray:
    """|STFT|^2 (n_fft // 2 + 1, frames) float32: centred, zero padded, frame t = padded[t*hop : t*hop+n_fft].

    Computed with `torch.stft` and `torch.hann_window` in float32, as the reference extractor does: a
    float64 FFT, or a window differing in its last float32 bits, moves near-silent low mel bins in log-mel
    by more than the 1e-4 parity budget.
    """
    import torch  # heavy (see stft_window)

    spectrum = torch.stft(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        config.n_fft,
        hop_length=config.hop_length,
        win_length=config.win_length,
        window=torch.from_numpy(stft_window(config)),
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spectrum).pow(2).sum(-1))
    return magnitude.pow(2).numpy()


def valid_frames(num_samples: int, config: FrontEndConfig) -> int:
    return (num_samples + 2 * (config.n_fft // 2) - config.n_fft) // config.hop_length


def _dither_noise(num_samples: int, config: FrontEndConfig) -> np.ndarray:
    """The extractor's dither: torch normal noise seeded by the valid sample count."""
    import torch  # heavy (see stft_window)

    generator = torch.Generator().manual_seed(num_samples)
    return config.dither * torch.randn(num_samples, dtype=torch.float32, generator=generator).numpy()


def log_mel(waveform: np.ndarray, config: FrontEndConfig | None = None) -> tuple[np.ndarray, int]:
    """(features (n_mels, frames) float32, valid frame count) of one clip.

    Equal to `CohereAsrFeatureExtractor` with the same parameters on the same clip: frames beyond the
    valid count are zero.
    """
    config = config or FrontEndConfig()
    x = np.asarray(waveform, dtype=np.float32)
    if x.ndim != 1:
        raise AudioError(f"log_mel expects mono audio of shape (samples,), got {x.shape}; use load_audio first")
    check_waveform(x)
    n_valid = valid_frames(x.shape[0], config)
    if n_valid < 2:
        raise AudioError(
            f"audio is too short: {x.shape[0]} samples ({x.shape[0] / config.sampling_rate * 1000:.1f} ms) give "
            f"{max(n_valid, 0)} feature frame(s); at least {2 * config.hop_length} samples are needed"
        )
    if config.dither > 0:
        x = x + _dither_noise(x.shape[0], config)
    if config.preemphasis:
        x = np.concatenate([x[:1], x[1:] - np.float32(config.preemphasis) * x[:-1]])

    power = power_spectrum(x, config)  # (n_fft // 2 + 1, frames)
    mel = mel_filters(config) @ power  # (n_mels, frames)
    features = np.log(mel + np.float32(LOG_ZERO_GUARD)).astype(np.float32)

    return normalize(features, n_valid), n_valid


def normalize(features: np.ndarray, n_valid: int) -> np.ndarray:
    """Per-feature normalisation over the first `n_valid` frames; later frames zeroed.

    (x - mean) / (std + 1e-5) with the n-1 standard deviation, in torch float32 with the reference's
    memory layout and reduction order: on constant input (silence) the reference's output is its own
    float32 rounding of the mean divided by 1e-5, which only the same arithmetic reproduces.
    """
    import torch  # heavy (see stft_window)

    x = torch.from_numpy(features).T[None]  # (1, frames, n_mels), strides as the reference's permuted view
    mask = (torch.arange(x.shape[1]) < n_valid)[None, :, None]
    length = torch.tensor([n_valid])
    masked = x * mask
    mean = (masked.sum(dim=1) / length.unsqueeze(-1)).unsqueeze(1)
    variance = ((masked - mean) ** 2 * mask).sum(dim=1) / (length - 1).unsqueeze(-1)
    std = torch.sqrt(variance).unsqueeze(1)
    out = (x - mean) / (std + NORM_EPSILON)
    out = out * mask
    return np.ascontiguousarray(out[0].T.numpy(), dtype=np.float32)


def pad_to_window(features: np.ndarray, n_valid: int, frames: int) -> tuple[np.ndarray, int]:
    """Zero-pad (n_mels, t) features to a fixed (n_mels, frames) window, keeping the valid length.

    Raises `AudioError` if the clip has more valid frames than the window (split it first).
    """
    if n_valid > frames:
        raise AudioError(
            f"clip has {n_valid} feature frames but the window holds {frames}: "
            "split it with split_long_audio (or use a longer window)"
        )
    n_mels, t = features.shape
    out = np.zeros((n_mels, frames), dtype=np.float32)
    keep = min(t, frames)
    out[:, :keep] = features[:, :keep]
    out[:, n_valid:] = 0.0
    return out, n_valid


def window_features(waveform: np.ndarray, frames: int, config: FrontEndConfig | None = None):
    """(1, n_mels, frames) float32 window and the valid frame count, for one clip that fits a window
    of `frames` mel frames (`cohere_coreml.model.shapes.window_frames`)."""
    features, n_valid = log_mel(waveform, config)
    window, n_valid = pad_to_window(features, n_valid, frames)
    return window[None], n_valid


# --------------------------------------------------------------------------------------------------
# Long audio
# --------------------------------------------------------------------------------------------------


def split_points(waveform: np.ndarray, config: FrontEndConfig | None = None) -> list[tuple[int, int]]:
    """(start, end) sample ranges as `CohereAsrFeatureExtractor` splits long audio.

    Clips up to `max_audio_clip_s - overlap_chunk_second` (30 s) stay whole. Longer clips are cut into
    pieces of at most `max_audio_clip_s` (35 s), each at the quietest `min_energy_window_samples`
    window (RMS) within the last `overlap_chunk_second` (5 s) before the 35 s mark.
    """
    config = config or FrontEndConfig()
    total = int(np.asarray(waveform).shape[0])
    if total / config.sampling_rate <= max(0.0, config.max_audio_clip_s - config.overlap_chunk_second):
        return [(0, total)]
    chunk = max(1, int(round(config.max_audio_clip_s * config.sampling_rate)))
    context = max(1, int(round(config.overlap_chunk_second * config.sampling_rate)))
    if total <= chunk:
        return [(0, total)]
    x = np.asarray(waveform, dtype=np.float32)
    ranges: list[tuple[int, int]] = []
    idx = 0
    while idx < total:
        if idx + chunk >= total:
            ranges.append((idx, total))
            break
        search_start = max(idx, idx + chunk - context)
        search_end = min(idx + chunk, total)
        if search_end <= search_start:
            split = idx + chunk
        else:
            split = quietest_window(x, search_start, search_end, config.min_energy_window_samples)
        split = max(idx + 1, min(split, total))
        ranges.append((idx, split))
        idx = split
    return [(s, e) for s, e in ranges if e > s]


def quietest_window(x: np.ndarray, start: int, end: int, window: int) -> int:
    """Start of the quietest (lowest RMS) `window`-sample window of x[start:end], stepping by `window`
    (the midpoint when the span holds no whole window): where `split_points` cuts."""
    segment = x[start:end]
    if segment.shape[0] <= window:
        return (start + end) // 2
    import torch  # heavy (see stft_window)

    # torch for the energies: the same float32 reductions as the reference, so ties break alike
    seg = torch.from_numpy(np.ascontiguousarray(segment))
    best, best_idx = float("inf"), start
    for i in range(0, segment.shape[0] - window, window):
        w = seg[i : i + window]
        energy = torch.sqrt(torch.mean(w * w)).item()
        if energy < best:
            best, best_idx = energy, start + i
    return best_idx


def split_long_audio(waveform: np.ndarray, config: FrontEndConfig | None = None) -> list[np.ndarray]:
    """Pieces of `waveform` at the reference extractor's split points (one piece if short)."""
    return [waveform[s:e] for s, e in split_points(waveform, config)]


# --------------------------------------------------------------------------------------------------
# `cohere-coreml mel`
# --------------------------------------------------------------------------------------------------


def cmd_mel(args) -> int:
    config = FrontEndConfig.from_pretrained(args.model) if args.model else FrontEndConfig()
    wav = load_audio(args.audio)
    pieces = split_points(wav, config)
    for start, end in pieces:
        features, n_valid = log_mel(wav[start:end], config)
        print(
            f"{start / config.sampling_rate:8.2f}s-{end / config.sampling_rate:8.2f}s  features {features.shape} "
            f"valid {n_valid}  mean {features[:, :n_valid].mean():+.4f} std {features[:, :n_valid].std():.4f}"
        )
        if args.save:
            np.save(args.save, features)
    return 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml mel`."""
    p = subparsers.add_parser("mel", help="compute the model's log-mel features of an audio file (stats per window)")
    p.add_argument("audio", help="audio file (wav, flac, mp3, ...); resampled to 16 kHz mono")
    p.add_argument("--model", default=None, help="checkpoint folder whose preprocessor config to use")
    p.add_argument("--save", default=None, help="save the (last window's) features as .npy")
    p.set_defaults(func=cmd_mel)
