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


class VadPackageError(RuntimeError):
    """vad.mlpackage cannot be used as the bundle format says (wrong function, shapes or outputs)."""


class PackageVad:
    """vad.mlpackage (`export --vad`) through the project's runtime: `block` (N chunks a call) scores
    whole signals, `chunk` (one chunk a call) the stream.

    `block` / `chunk`: loaded functions (`runtime.load_model(path, function_name=...)`: interpreter or Core
    ML); `chunks`: N, the block's rows (the manifest's `vad.functions.block.chunks`, checked against the
    function's input). A signal's chunks go in calls of N rows from a zero state, the state carried from
    call to call; the last call's missing rows are zero frames whose outputs are discarded (the state after
    them is never used)."""

    def __init__(self, block, chunk, chunks: int):
        self.chunks = int(chunks)
        for model, rows in ((block, self.chunks), (chunk, 1)):
            shape = tuple(model.input_description.get("frames", ((), None))[0])
            if shape != (rows, silero.FRAME_SAMPLES):
                raise VadPackageError(f"vad.mlpackage function {model.function_name!r} takes frames {shape}, the "
                                      f"manifest says ({rows}, {silero.FRAME_SAMPLES}): re-export the bundle")
        self.block, self.chunk = block, chunk

    @classmethod
    def load(cls, path, chunks: int, backend: str = "auto", compute_units: str = "all") -> PackageVad:
        from ..config import VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION
        from ..runtime import load_model

        return cls(load_model(str(path), backend=backend, function_name=VAD_BLOCK_FUNCTION, compute_units=compute_units),
                   load_model(str(path), backend=backend, function_name=VAD_CHUNK_FUNCTION, compute_units=compute_units),
                   chunks)

    @staticmethod
    def _call(model, frames, h, c):
        out = model.predict({"frames": frames, "h": h, "c": c})
        missing = sorted({"probability", "h_out", "c_out"} - set(out))
        if missing:
            raise VadPackageError(f"vad.mlpackage function {model.function_name!r} gave no {', '.join(missing)}")
        return (np.asarray(out["probability"], np.float32).reshape(-1), np.asarray(out["h_out"], np.float32),
                np.asarray(out["c_out"], np.float32))

    def probabilities(self, wav: np.ndarray) -> np.ndarray:
        frames = silero.chunk_frames(wav)
        n, rows = frames.shape[0], self.chunks
        h = np.zeros((1, silero.HIDDEN), np.float32)
        c = np.zeros((1, silero.HIDDEN), np.float32)
        out = []
        for start in range(0, n, rows):
            block = np.zeros((rows, silero.FRAME_SAMPLES), np.float32)
            block[: min(rows, n - start)] = frames[start : start + rows]
            probs, h, c = self._call(self.block, block, h, c)
            out.append(probs[: min(rows, n - start)])
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _score(self, frames, h, c):
        probs = []
        for row in frames:
            p, h, c = self._call(self.chunk, row[None], h, c)
            probs.append(p)
        return (np.concatenate(probs) if probs else np.zeros(0, np.float32)), h, c

    def stream(self) -> ProbabilityStream:
        return _ChunkStream(self._score)


def vad_for(bundle, backend: str = "auto", compute_units: str = "all") -> PackageVad | None:
    """The bundle's vad.mlpackage as a `PackageVad` (N from the manifest's `vad.functions.block.chunks`), or
    None when the bundle has no VAD (`vad` absent or null: exported before it, or with `export --no-vad`)."""
    chunks = bundle.vad_chunks
    if chunks is None:
        return None
    return PackageVad.load(bundle.paths["vad"], chunks, backend=backend, compute_units=compute_units)
