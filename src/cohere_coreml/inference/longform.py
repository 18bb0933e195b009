"""Audio in, windows out, with bounded memory: check a file before any model loads, then stream it.

* `check_audio(path or array)`: read the file once, block by block, and say whether it can be
  transcribed: "ok", "silent" (digital silence: peak below `config.SILENCE_PEAK`, nothing to
  transcribe, no model call needed) or an `AudioError` naming the problem (missing, empty, corrupt,
  NaN/inf). The one place that decides silence: the CLI's batch runner, `bench`, and every
  transcriber's `transcribe` (`engines.Engine.transcribe`, `transcribe.Transcriber.transcribe`) ask it.
* `iter_windows(source, config)`: (start, end, samples) pieces at exactly the split points of
  `audio.split_points` (the reference extractor's), read from the file as they are needed: at most
  one window (35 s) plus one read block is held, so a clip of many minutes costs the memory of one
  window. Files at another sample rate than the model's, or formats soundfile cannot read, are
  loaded whole (resampling needs the whole signal); arrays are split in place.
* With a voice-activity model (docs/vad.md): `plan_speech(source, vad, options, config)` scores the
  whole signal block by block (a stream of 512-sample chunks: one float per 32 ms is kept), turns the
  probabilities into speech regions and packs them into windows (`speech_regions`); `iter_ranges`
  then reads only those windows' samples. Audio outside the windows is never encoded or decoded; the
  windows' starts are positions in the original audio, so every reported time stays on its timeline.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from ..model.audio import (
    AudioError,
    FrontEndConfig,
    check_file,
    check_waveform,
    is_silent,
    load_audio,
    quietest_window,
    split_points,
)
from .speech_regions import CHUNK_SAMPLES, SAMPLE_RATE, VadOptions, pack_windows, speech_regions

logger = logging.getLogger(__name__)

BLOCK_SECONDS = 10.0  # read size while streaming


@dataclass
class AudioCheck:
    path: str
    status: str  # "ok" | "silent"
    seconds: float
    sample_rate: int
    peak: float
    streamable: bool  # read block by block (native rate, soundfile format)


def _soundfile_info(path: Path):
    try:
        return sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None


def _blocks(path: Path, block: int) -> Iterator[np.ndarray]:
    """float32 mono blocks of a soundfile-readable file (channels averaged as audio.load_audio)."""
    try:
        with sf.SoundFile(str(path)) as f:
            while True:
                data = f.read(block, dtype="float32", always_2d=True)  # (samples, channels)
                if data.shape[0] == 0:
                    return
                yield data.mean(axis=1).astype(np.float32) if data.shape[1] > 1 else data[:, 0].copy()
    except (sf.LibsndfileError, RuntimeError) as err:
        raise AudioError(f"cannot decode audio file {path} ({type(err).__name__}): corrupt or unsupported format") from err


def check_audio(source, config: FrontEndConfig | None = None) -> AudioCheck:
    """Read `source` (a file path, or a float32 mono array at the model's rate) once and classify it;
    raises `AudioError` (named problem) when it is unusable."""
    config = config or FrontEndConfig()
    if not isinstance(source, (str, os.PathLike)):
        wav = np.asarray(source, dtype=np.float32)
        check_waveform(wav, "audio array")  # empty, NaN/inf
        peak = float(np.max(np.abs(wav)))
        return AudioCheck("audio array", _status(peak), wav.size / config.sampling_rate, config.sampling_rate, peak,
                          False)
    path = Path(source)
    check_file(path)
    info = _soundfile_info(path)
    if info is not None and int(info.samplerate) == config.sampling_rate:
        total, peak, bad = 0, 0.0, 0
        for block in _blocks(path, int(BLOCK_SECONDS * config.sampling_rate)):
            finite = np.isfinite(block)
            bad += int((~finite).sum())
            total += block.size
            if finite.any():
                peak = max(peak, float(np.max(np.abs(block[finite]))))
        if total == 0:
            raise AudioError(f"{path} is empty (0 samples)")
        if bad:
            raise AudioError(f"{path} holds {bad} NaN/inf sample(s) of {total}")
        streamable = True
    else:
        wav = load_audio(path, target_rate=config.sampling_rate)  # raises for empty / NaN / corrupt
        total, peak, streamable = wav.size, float(np.max(np.abs(wav))), False
    return AudioCheck(str(path), _status(peak), total / config.sampling_rate, config.sampling_rate, peak, streamable)


def _status(peak: float) -> str:
    return "silent" if is_silent(peak) else "ok"


def iter_windows(source, config: FrontEndConfig | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, end, float32 samples) per window, at the `audio.split_points` positions.

    `source`: a file path (streamed when it is at the model's rate and soundfile reads it) or a
    float32 mono array at the model's rate.
    """
    config = config or FrontEndConfig()
    if not isinstance(source, (str, os.PathLike)):
        wav = np.asarray(source, dtype=np.float32)
        check_waveform(wav, "audio array")
        for start, end in split_points(wav, config):
            yield start, end, wav[start:end]
        return
    path = Path(source)
    info = _soundfile_info(path)
    if info is None or int(info.samplerate) != config.sampling_rate:
        wav = load_audio(path, target_rate=config.sampling_rate)
        for start, end in split_points(wav, config):
            yield start, end, wav[start:end]
        return
    check_file(path)  # the same named errors as load_audio for missing / empty files
    yield from _stream(path, config)


def _stream(path: Path, config: FrontEndConfig) -> Iterator[tuple[int, int, np.ndarray]]:
    """split_points' loop over a buffer that holds at most chunk + one block of samples.

    split_points keeps a clip of <= 35 s (chunk) whole and otherwise cuts at the quietest window in
    the last 5 s before idx + chunk, which only needs samples idx .. idx + chunk: so a buffer of
    chunk + 1 samples from idx tells both whether this is the last piece and where to cut.
    """
    sr = config.sampling_rate
    chunk = max(1, int(round(config.max_audio_clip_s * sr)))
    context = max(1, int(round(config.overlap_chunk_second * sr)))
    blocks = _blocks(path, int(BLOCK_SECONDS * sr))
    buffer = np.zeros(0, dtype=np.float32)  # samples from absolute index `offset`
    offset, idx, eof, total = 0, 0, False, 0
    while True:
        while not eof and buffer.size - (idx - offset) <= chunk:
            block = next(blocks, None)
            if block is None:
                eof = True
                break
            if not np.all(np.isfinite(block)):
                raise AudioError(f"{path} holds NaN/inf samples (from {(total + np.argmin(np.isfinite(block))) / sr:.2f} s)")
            buffer = np.concatenate([buffer[idx - offset :], block])
            offset = idx
            total += block.size
        rest = buffer[idx - offset :]
        if rest.size == 0:
            if total == 0:
                raise AudioError(f"{path} is empty (0 samples)")
            return
        if rest.size <= chunk:  # the last piece (or a clip of <= 35 s, kept whole)
            yield idx, idx + rest.size, rest.copy()
            return
        search_start, search_end = max(0, chunk - context), chunk  # relative to idx
        split = quietest_window(rest, search_start, search_end, config.min_energy_window_samples)
        split = max(1, min(split, rest.size))
        yield idx, idx + split, rest[:split].copy()
        idx += split
        buffer = buffer[idx - offset :]
        offset = idx


# --------------------------------------------------------------------------------------------------
# Speech windows (a voice-activity model's regions)
# --------------------------------------------------------------------------------------------------


@dataclass
class SpeechPlan:
    """What the VAD kept of one clip: its length, the speech regions and the windows packed from them
    ([start, end) in samples of the original audio at the model's rate)."""

    n_samples: int
    regions: list[tuple[int, int]]
    windows: list[tuple[int, int]]
    sample_rate: int
    loaded: np.ndarray | None = None  # the whole signal, when the source had to be loaded whole (resampled)

    @property
    def audio_s(self) -> float:
        return self.n_samples / self.sample_rate

    @property
    def windows_s(self) -> float:
        return sum(e - s for s, e in self.windows) / self.sample_rate

    def summary(self) -> dict:
        """The figures a result reports: windows, regions, audio and decoded seconds, their ratio."""
        return {"windows": len(self.windows), "regions": len(self.regions), "audio_s": self.audio_s,
                "decoded_s": self.windows_s, "decoded_share": self.windows_s / self.audio_s if self.n_samples else 0.0}


def _source_blocks(source, config: FrontEndConfig) -> tuple[Iterator[np.ndarray], np.ndarray | None]:
    """(float32 blocks of the signal at the model's rate, the whole signal when it had to be loaded whole)."""
    block = int(BLOCK_SECONDS * config.sampling_rate)
    if not isinstance(source, (str, os.PathLike)):
        wav = np.asarray(source, dtype=np.float32)
        check_waveform(wav, "audio array")
        return (wav[i : i + block] for i in range(0, wav.size, block)), None
    path = Path(source)
    info = _soundfile_info(path)
    if info is None or int(info.samplerate) != config.sampling_rate:
        wav = load_audio(path, target_rate=config.sampling_rate)
        return (wav[i : i + block] for i in range(0, wav.size, block)), wav
    check_file(path)
    return _blocks(path, block), None


def speech_probabilities(blocks, vad) -> tuple[np.ndarray, int]:
    """(one probability per 512-sample chunk, sample count) of a signal given in blocks, through
    `vad.stream()` (the state and context carried across blocks, the last chunk zero-padded: the same
    probabilities as `vad.probabilities` of the whole signal, without holding it)."""
    stream = vad.stream()
    out, total = [], 0
    for block in blocks:
        total += block.size
        out.append(np.asarray(stream.push(block), np.float32))
    rest = -total % CHUNK_SAMPLES
    if rest:
        out.append(np.asarray(stream.push(np.zeros(rest, np.float32)), np.float32))
    probs = np.concatenate(out) if out else np.zeros(0, np.float32)
    expected = -(-total // CHUNK_SAMPLES)
    if probs.size != expected:
        raise RuntimeError(f"the VAD gave {probs.size} probabilities for {expected} chunks of {total} samples")
    return probs, total


def plan_speech(source, vad, options: VadOptions | None = None, config: FrontEndConfig | None = None,
                window_s: float | None = None) -> SpeechPlan:
    """Speech regions and windows of `source` (a path or a float32 mono array at the model's rate) from the
    speech probabilities of `vad` (`inference.vad.SpeechProbabilities`): regions of at most the model's
    window (`window_s`, default `config.max_audio_clip_s`; `options.max_speech_s` when shorter), packed
    greedily with pauses of at most `options.max_gap_s` inside a window (docs/vad.md)."""
    config = config or FrontEndConfig()
    options = options or VadOptions()
    if config.sampling_rate != SAMPLE_RATE:
        raise AudioError(f"the VAD runs at {SAMPLE_RATE} Hz; this model's audio is {config.sampling_rate} Hz")
    blocks, loaded = _source_blocks(source, config)
    probs, total = speech_probabilities(blocks, vad)
    if total == 0:
        raise AudioError(f"{source if isinstance(source, (str, os.PathLike)) else 'audio array'} is empty (0 samples)")
    window_s = float(config.max_audio_clip_s if window_s is None else window_s)
    window = int(round(window_s * config.sampling_rate))
    regions = speech_regions(probs, total, options, options.max_speech_for(window_s))
    windows = [_at_least(w, 2 * config.hop_length, total)
               for w in pack_windows(regions, total, window, options.max_gap_samples())]
    return SpeechPlan(total, regions, windows, config.sampling_rate, loaded)


def _at_least(window: tuple[int, int], samples: int, total: int) -> tuple[int, int]:
    """A window widened to the front end's minimum (two feature frames) with the audio before it: only
    options without a minimum speech length or pad make one that short."""
    start, end = window
    if end - start >= samples:
        return window
    start = max(0, end - samples)
    return start, min(total, start + samples)


def iter_ranges(source, plan: SpeechPlan, config: FrontEndConfig | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, end, float32 samples) of each window of `plan`, read from the file range by range (a path at
    the model's rate), from the loaded signal (a resampled file) or from the array."""
    config = config or FrontEndConfig()
    if plan.loaded is not None or not isinstance(source, (str, os.PathLike)):
        wav = plan.loaded if plan.loaded is not None else np.asarray(source, dtype=np.float32)
        for start, end in plan.windows:
            yield start, end, wav[start:end]
        return
    path = Path(source)
    try:
        with sf.SoundFile(str(path)) as f:
            for start, end in plan.windows:
                f.seek(start)
                data = f.read(end - start, dtype="float32", always_2d=True)
                samples = data.mean(axis=1).astype(np.float32) if data.shape[1] > 1 else data[:, 0].copy()
                if samples.size != end - start:
                    raise AudioError(f"{path} ended at sample {start + samples.size} inside a speech window "
                                     f"[{start}, {end}): it changed while being read")
                yield start, end, samples
    except (sf.LibsndfileError, RuntimeError) as err:
        raise AudioError(f"cannot decode audio file {path} ({type(err).__name__}): corrupt or unsupported format") from err
