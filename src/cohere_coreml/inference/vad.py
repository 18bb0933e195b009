"""Speech probabilities per 32 ms chunk, from one interface: the bundle's vad.mlpackage or the PyTorch module.

`probabilities(wav)` scores a whole 16 kHz signal from a fresh state (the last chunk zero-padded, as
silero-vad's get_speech_timestamps does); `stream()` gives an object whose `push(samples)` returns the
probabilities of the chunks those samples complete, carrying the recurrent state and the 64-sample
context from call to call. The speech-region rule (`speech_regions`) turns probabilities into regions.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..model import silero


class ProbabilityStream(Protocol):
    def push(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities (float32, one per completed 512-sample chunk, possibly none) of the chunks these
        samples complete; samples beyond the last whole chunk are kept for the next call."""


class SpeechProbabilities(Protocol):
    def probabilities(self, wav: np.ndarray) -> np.ndarray:
        """(ceil(len(wav) / 512),) float32 from a fresh state."""

    def stream(self) -> ProbabilityStream: ...


class _ChunkStream:
    """Splits pushed samples into 512-sample chunks and scores each with `score(frames, h, c)`."""

    def __init__(self, score):
        self._score = score
        self._pending = np.zeros(0, np.float32)
        self._context = np.zeros(silero.CONTEXT_SAMPLES, np.float32)
        self._h = np.zeros((1, silero.HIDDEN), np.float32)
        self._c = np.zeros((1, silero.HIDDEN), np.float32)

    def push(self, samples: np.ndarray) -> np.ndarray:
        self._pending = np.concatenate([self._pending, np.asarray(samples, np.float32).reshape(-1)])
        whole = self._pending.size // silero.CHUNK_SAMPLES * silero.CHUNK_SAMPLES
        if whole == 0:
            return np.zeros(0, np.float32)
        ready, self._pending = self._pending[:whole], self._pending[whole:]
        frames = silero.chunk_frames(ready, self._context)
        self._context = ready[-silero.CONTEXT_SAMPLES:].copy()
        probs, self._h, self._c = self._score(frames, self._h, self._c)
        return probs


class TorchVad:
    """The PyTorch module (`model.silero.SileroVad`, the package's weights): what the reference engine uses."""

    def __init__(self, module: silero.SileroVad | None = None):
        self.module = module or silero.SileroVad.from_package()

    def probabilities(self, wav: np.ndarray) -> np.ndarray:
        return self.module.probabilities(wav)

    @torch.no_grad()
    def _score(self, frames, h, c):
        probs, h, c = self.module(torch.from_numpy(frames), torch.from_numpy(h), torch.from_numpy(c))
        return probs.numpy().astype(np.float32), h.numpy(), c.numpy()

    def stream(self) -> ProbabilityStream:
        return _ChunkStream(self._score)
