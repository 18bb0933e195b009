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
