"""Silero VAD (16 kHz) in PyTorch: the weights the pinned `silero-vad` package ships, in a module this
project's converter traces, and the package's own model as the oracle.

The network (silero-vad's `tinygrad_model.py` writes the same graph out; the package's TorchScript
model runs it): for each chunk of `CHUNK_SAMPLES` = 512 samples (32 ms) the input frame is the
`CONTEXT_SAMPLES` = 64 samples before the chunk followed by the chunk (576 samples; zeros before the
audio starts), reflect-padded by 64 on the right; a fixed STFT basis as a strided conv (258 x 256,
hop 128) gives 4 magnitude frames of 129 bins; four conv + ReLU layers (the last two with stride 2)
reduce them to one 128-vector; an LSTM cell carries (h, c) from chunk to chunk; ReLU, a 1 x 1 conv and
a sigmoid give the chunk's speech probability. `get_speech_timestamps` pads the last chunk with zeros
to 512 samples and resets the state per audio, as `SileroVad.probabilities` does.

Weights: read from the package's `silero_vad_16k_op15.onnx` (protobuf data; no code runs). That file's
tensors are the TorchScript model's, bit for bit (tested); the package's `silero_vad_16k.safetensors`
holds another checkpoint whose probabilities differ from the package's own model, so converting it
would not reproduce the oracle.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import numpy as np
import torch

SAMPLE_RATE = 16000
CHUNK_SAMPLES = 512
CONTEXT_SAMPLES = 64
FRAME_SAMPLES = CONTEXT_SAMPLES + CHUNK_SAMPLES
HIDDEN = 128
PACKAGE = "silero-vad"
WEIGHTS_FILE = "silero_vad_16k_op15.onnx"
_ONNX_PREFIX = "model."
# this module's parameter name -> the package model's (TorchScript state_dict, ONNX initializer minus "model.")
_NAMES = {
    "stft_basis": "stft.forward_basis_buffer",
    **{f"conv{i + 1}.{t}": f"encoder.{i}.reparam_conv.{t}" for i in range(4) for t in ("weight", "bias")},
    **{f"lstm.{t}": f"decoder.rnn.{t}" for t in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
    "out.weight": "decoder.decoder.2.weight",
    "out.bias": "decoder.decoder.2.bias",
}


class VadError(ValueError):
    """The VAD's weights or input are unusable (one line, names the problem)."""


def package_version() -> str:
    from importlib.metadata import version

    return version(PACKAGE)


def weights_path():
    return resources.files("silero_vad.data").joinpath(WEIGHTS_FILE)


def source_record() -> dict:
    """Where the converted weights came from: package, version, file and its sha256 (for the manifest)."""
    data = weights_path().read_bytes()
    return {"package": PACKAGE, "version": package_version(), "file": WEIGHTS_FILE,
            "sha256": hashlib.sha256(data).hexdigest()}


def load_weights() -> dict[str, torch.Tensor]:
    """The package's 16 kHz weights, named as `SileroVad`'s parameters."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_model_from_string(weights_path().read_bytes())
    found = {init.name[len(_ONNX_PREFIX):]: numpy_helper.to_array(init) for init in model.graph.initializer
             if init.name.startswith(_ONNX_PREFIX)}
    missing = sorted(set(_NAMES.values()) - set(found))
    if missing:
        raise VadError(f"{WEIGHTS_FILE} of {PACKAGE} {package_version()} lacks {', '.join(missing)}")
    return {ours: torch.from_numpy(np.array(found[theirs], dtype=np.float32)) for ours, theirs in _NAMES.items()}


class SileroVad(torch.nn.Module):
    """One or more chunks a call: `frames` (N, 576) float32, rows in time order, state (h, c) each (1, 128)
    -> (probabilities (N,), h, c). The LSTM runs over the N rows in order (unrolled: N is static when traced)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stft_basis", torch.zeros(258, 1, 256))
        self.conv1 = torch.nn.Conv1d(129, 128, 3, padding=1)
        self.conv2 = torch.nn.Conv1d(128, 64, 3, stride=2, padding=1)
        self.conv3 = torch.nn.Conv1d(64, 64, 3, stride=2, padding=1)
        self.conv4 = torch.nn.Conv1d(64, 128, 3, padding=1)
        self.lstm = torch.nn.LSTMCell(128, HIDDEN)
        self.out = torch.nn.Conv1d(HIDDEN, 1, 1)

    @classmethod
    def from_package(cls) -> SileroVad:
        module = cls()
        module.load_state_dict(load_weights())
        return module.eval()

    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, 576) -> (N, 128): everything before the recurrent cell, per chunk."""
        x = torch.nn.functional.pad(frames.unsqueeze(1), (0, CONTEXT_SAMPLES), mode="reflect")
        x = torch.nn.functional.conv1d(x, self.stft_basis, stride=128)
        x = torch.sqrt(x[:, :129] ** 2 + x[:, 129:] ** 2)
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = torch.relu(conv(x))
        return x.squeeze(-1)

    def forward(self, frames: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        feats = self.features(frames)
        probs = []
        for i in range(feats.shape[0]):
            h, c = self.lstm(feats[i : i + 1], (h, c))
            probs.append(torch.sigmoid(self.out(torch.relu(h).unsqueeze(-1))).reshape(1))
        return torch.cat(probs), h, c

    @torch.no_grad()
    def probabilities(self, wav: np.ndarray) -> np.ndarray:
        """Speech probability per 512-sample chunk of `wav` (16 kHz mono), from a fresh state."""
        frames = chunk_frames(wav)
        h = torch.zeros(1, HIDDEN)
        c = torch.zeros(1, HIDDEN)
        probs, _, _ = self(torch.from_numpy(frames), h, c)
        return probs.numpy().astype(np.float32)


def chunk_frames(wav: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
    """(N, 576) float32 frames of `wav`: each chunk of 512 samples after the 64 samples before it.

    `context`: the 64 samples before `wav` (a stream's previous chunk), zeros when None. The last chunk
    is zero-padded to 512 samples, as silero-vad's get_speech_timestamps does."""
    wav = np.asarray(wav, dtype=np.float32).reshape(-1)
    n = -(-wav.size // CHUNK_SAMPLES)
    ctx = np.zeros(CONTEXT_SAMPLES, np.float32) if context is None else np.asarray(context, np.float32)
    if ctx.shape != (CONTEXT_SAMPLES,):
        raise VadError(f"VAD context must be {CONTEXT_SAMPLES} samples, got {ctx.size}")
    padded = np.concatenate([ctx, wav, np.zeros(n * CHUNK_SAMPLES - wav.size, np.float32)])
    index = np.arange(n)[:, None] * CHUNK_SAMPLES + np.arange(FRAME_SAMPLES)[None, :]
    return padded[index]


def reference_probabilities(wav: np.ndarray) -> np.ndarray:
    """The oracle: the `silero-vad` package's own model (`load_silero_vad()`), chunk by chunk from a
    reset state, the last chunk zero-padded: the probabilities its get_speech_timestamps thresholds."""
    model = _reference_model()
    model.reset_states()
    wav = np.asarray(wav, dtype=np.float32).reshape(-1)
    out = []
    with torch.no_grad():
        for start in range(0, wav.size, CHUNK_SAMPLES):
            chunk = np.zeros(CHUNK_SAMPLES, np.float32)
            piece = wav[start : start + CHUNK_SAMPLES]
            chunk[: piece.size] = piece
            out.append(float(model(torch.from_numpy(chunk)[None], SAMPLE_RATE).item()))
    return np.asarray(out, dtype=np.float32)


def reference_regions(probs, n_samples: int, *, threshold: float = 0.5, neg_threshold: float | None = None,
                      min_speech_ms: int = 250, min_silence_ms: int = 100, speech_pad_ms: int = 30,
                      max_speech_s: float = float("inf")) -> list[tuple[int, int]]:
    """The oracle of the region rule: the package's `get_speech_timestamps_from_probs` at 16 kHz, in samples
    of a signal of `n_samples`, cutting over-long speech at the longest silence (its defaults)."""
    found = _package().get_speech_timestamps_from_probs(
        [float(p) for p in probs], sampling_rate=SAMPLE_RATE, threshold=threshold, neg_threshold=neg_threshold,
        min_speech_duration_ms=min_speech_ms, min_silence_duration_ms=min_silence_ms, speech_pad_ms=speech_pad_ms,
        max_speech_duration_s=max_speech_s, audio_length_samples=int(n_samples))
    return [(int(s["start"]), int(s["end"])) for s in found]


class _GivenProbabilities:
    """A stand-in for the package's model: returns the given probabilities one call after another."""

    def __init__(self, probs):
        self._probs = [float(p) for p in probs]
        self._next = 0

    def reset_states(self):
        self._next = 0

    def __call__(self, x, sr):
        prob = self._probs[self._next]
        self._next += 1
        return torch.tensor(prob, dtype=torch.float64)


def reference_stream_events(probs, *, threshold: float = 0.5, min_silence_ms: int = 100,
                            speech_pad_ms: int = 30) -> list[tuple[int, str, int]]:
    """The oracle of the stream rule: the package's `VADIterator` fed one 512-sample chunk per probability
    by a stand-in model -> [(chunk index, "start" | "end", sample)]."""
    iterator = _package().VADIterator(_GivenProbabilities(probs), threshold=threshold, sampling_rate=SAMPLE_RATE,
                                      min_silence_duration_ms=min_silence_ms, speech_pad_ms=speech_pad_ms)
    chunk = torch.zeros(CHUNK_SAMPLES)
    events = []
    for i in range(len(probs)):
        event = iterator(chunk)
        if event:
            (kind, sample), = event.items()
            events.append((i, kind, int(sample)))
    return events


_REFERENCE = {}


def _package():
    """The `silero_vad` package, imported once with the caller's torch thread count kept (its import sets 1)."""
    if "package" not in _REFERENCE:
        threads = torch.get_num_threads()
        try:
            import silero_vad

            _REFERENCE["package"] = silero_vad
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE["package"]


def _reference_model():
    """The package's model, loaded once. Importing silero_vad calls torch.set_num_threads(1) for the whole
    process; the caller's thread count is put back."""
    if "model" not in _REFERENCE:
        threads = torch.get_num_threads()
        try:
            _REFERENCE["model"] = _package().load_silero_vad()
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE["model"]
