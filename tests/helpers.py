"""Shared test helpers: tiny-checkpoint setup, sensitive fixtures, references, deliberately broken exports.

A comparison with a reference is only evidence when the compared output depends on what is
compared. Random tiny checkpoints barely listen to the audio (their cross-attention contributes
~1e-3 to the log-probs: the same greedy tokens for every clip and for an all-zero memory), so
tests that are about the encoder-to-decoder path use `sensitize` (or the trained default model)
and check `assert_audio_sensitive` first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from .fixture_data import AUDIO_DIR

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(path: str):
    """The script tools/<path>.py (e.g. "train/eval_tiny") as a module (the scripts are not a package)."""
    name = Path(path).name
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# grouped kv heads, encoder width != decoder width (the shape most tests use)
GQA = dict(num_key_value_heads=2, encoder_hidden_size=48, encoder_num_attention_heads=4)
# cross-attention scales of `sensitize`: on seed 3 of the GQA and MQA tiny shapes, six committed
# clips in six languages give six different 8-token greedy outputs (one single output at scale 1);
# every test using it still checks its own fixture (`assert_audio_sensitive`)
SENSITIVE_QK_SCALE = 4.0
SENSITIVE_VO_SCALE = 16.0


def tiny_model(path: Path, seed: int = 0, sensitive: bool = False, **overrides):
    """(model, processor) of a fresh random tiny checkpoint at `path`; dither 0 (parity work).

    `sensitive`: scale the cross-attention projections (`sensitize`) so the output depends on the
    audio; the checkpoint folder is rewritten with the scaled weights (CLI paths load it).
    """
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint, save_checkpoint

    ckpt = make_tiny_checkpoint(path, seed=seed, **overrides)
    model, processor = load_reference(ckpt)
    if sensitive:
        sensitize(model)
        save_checkpoint(model, processor.tokenizer, ckpt, feature_extractor=processor.feature_extractor)
        model, processor = load_reference(ckpt)
    processor.feature_extractor.dither = 0.0
    return model, processor


@torch.no_grad()
def sensitize(model, qk: float = SENSITIVE_QK_SCALE, vo: float = SENSITIVE_VO_SCALE):
    """Scale every decoder layer's cross-attention (q, k by `qk`: sharper attention over frames; v, o
    by `vo`: a larger contribution to the residual stream). In place; returns the model."""
    for layer in model.model.decoder.layers:
        attn = layer.encoder_attn
        for linear in (attn.q_proj, attn.k_proj):
            linear.weight.mul_(qk)
        for linear in (attn.v_proj, attn.o_proj):
            linear.weight.mul_(vo)
    return model


@torch.no_grad()
def reference_ids(model, processor, piece, prompt, max_new_tokens, zero_memory=False) -> list[int]:
    """generate() on one window, as the reference pipeline runs it; new ids only.

    `zero_memory`: the encoder output replaced by zeros (what a decoder that never sees the
    audio would produce), the control of `assert_audio_sensitive`.
    """
    f = processor.feature_extractor(piece, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    kwargs = dict(attention_mask=f["attention_mask"], decoder_input_ids=torch.tensor([list(prompt)]),
                  max_new_tokens=max_new_tokens, do_sample=False)
    if zero_memory:
        enc = model.model.encoder(f["input_features"], attention_mask=f["attention_mask"])
        enc.last_hidden_state = torch.zeros_like(enc.last_hidden_state)
        out = model.generate(encoder_outputs=enc, **kwargs)
    else:
        out = model.generate(input_features=f["input_features"], **kwargs)
    return [int(t) for t in out[0, len(prompt):]]


def assert_audio_sensitive(model, processor, clips, max_new_tokens=8, language="en"):
    """The fixture's greedy tokens depend on the audio: different for different clips, and
    different from a zero-memory run. `clips`: waveforms (16 kHz float32)."""
    from cohere_coreml.model.tokens import prompt_ids

    prompt = prompt_ids(processor.tokenizer, language)
    outputs = [tuple(reference_ids(model, processor, w, prompt, max_new_tokens)) for w in clips]
    assert len(set(outputs)) == len(outputs), f"fixture gives the same tokens for different clips: {outputs}"
    for wav, out in zip(clips, outputs):
        assert list(out) != reference_ids(model, processor, wav, prompt, max_new_tokens, zero_memory=True), \
            "fixture gives the same tokens with an all-zero encoder memory"


def sensitivity_clips():
    """Three committed clips of different lengths and languages for `assert_audio_sensitive`."""
    from cohere_coreml.model.audio import load_audio

    return [load_audio(AUDIO_DIR / name) for name in ("en_short.wav", "de_medium.wav", "zh_medium.wav")]


def broken_encoder_trace(wrapper_cls, length: int = 150):
    """A `trace_encoder` replacement (signature (model, shapes)) that traces `wrapper_cls` instead
    of `EncoderForCoreML`: a deliberately broken export for gate tests."""

    def trace(model, shapes):
        from cohere_coreml.export.encoder import example_inputs
        from cohere_coreml.model.layer_stream import resident_layers

        wrapper = wrapper_cls(model, shapes).eval()
        example = example_inputs(shapes, length)
        with torch.no_grad(), resident_layers(model):  # as `trace_encoder`: a streamed model's layers read
            return torch.jit.trace(wrapper, example, check_trace=False, strict=False)

    return trace


class RecordingRuntime:
    """Wraps a loaded package function (runtime interface) and records what it is given: the input
    names of every call and every `input_ids`."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[list[int]] = []  # input_ids of each call that has them
        self.inputs: list[list[str]] = []  # input names of each call

    def __getattr__(self, name):  # descriptions, backend, ... of the wrapped function
        return getattr(self.inner, name)

    def make_state(self):
        return self.inner.make_state()

    def predict(self, inputs, state=None):
        self.inputs.append(sorted(inputs))
        if "input_ids" in inputs:
            self.calls.append([int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)])
        return self.inner.predict(inputs, state=state)


def record_decoder_inputs(transcriber) -> tuple[RecordingRuntime, RecordingRuntime | None, RecordingRuntime]:
    """Make `transcriber` record what its decoder functions receive: (step, prefill or None, bind)."""
    decoder = transcriber.decoder  # a DecoderRuntime
    decoder.step_model = RecordingRuntime(decoder.step_model)
    bind = RecordingRuntime(decoder.bind_model)  # a host-state decoder has none: it records nothing
    if decoder.bind_model is not None:
        decoder.bind_model = bind
    if decoder.prefill_model is not None:
        decoder.prefill_model = RecordingRuntime(decoder.prefill_model)
    transcriber.prefill = decoder.prefill_model
    return decoder.step_model, decoder.prefill_model, bind


def copy_packages(src: Path, dst: Path, components) -> Path:
    """`dst` (created) holding `src`'s packages of `components` with their gate reports: an export into `dst`
    skips them and writes only the other components."""
    import shutil

    dst.mkdir(parents=True)
    for component in components:
        shutil.copytree(src / f"{component}.mlpackage", dst / f"{component}.mlpackage")
        if (src / f"{component}.parity.json").is_file():
            shutil.copy2(src / f"{component}.parity.json", dst / f"{component}.parity.json")
    return dst



def without_alignment(transcriber):
    """`transcriber` as if its bundle had been exported with --alignment-heads none: the manifest's
    decoder.alignment null with that note (what a bundle without the align function carries)."""
    m = transcriber.bundle.manifest
    transcriber.bundle.manifest = {**m, "decoder": {**m["decoder"], "alignment": None,
                                                    "alignment_note": "exported with --alignment-heads none"}}
    return transcriber


def transcriber_without_alignment(transcriber_class):
    """A stand-in for the `Transcriber` class whose instances have no alignment (`without_alignment`), for CLI runs."""
    return lambda *args, **kwargs: without_alignment(transcriber_class(*args, **kwargs))


class EnergyVad:
    """A stand-in voice-activity model (no network) behind `inference.vad.SpeechProbabilities`: 0.95 for a
    512-sample chunk whose RMS is above 0.01, else 0.05; stateless, so its stream and its whole-signal
    probabilities agree exactly."""

    def _score(self, frames, h, c):
        from cohere_coreml.model import silero

        rms = np.sqrt(np.mean(frames[:, silero.CONTEXT_SAMPLES:] ** 2, axis=1))
        return np.where(rms > 0.01, 0.95, 0.05).astype(np.float32), h, c

    def probabilities(self, wav):
        from cohere_coreml.model import silero

        return self._score(silero.chunk_frames(wav), None, None)[0]

    def stream(self):
        from cohere_coreml.inference.vad import _ChunkStream

        return _ChunkStream(self._score)


def tones(spans, seconds: float, seed: int = 0, sr: int = 16000) -> np.ndarray:
    """Low noise (1e-4) with a 0.3-amplitude 440 Hz tone over each (start_s, end_s) span: speech for EnergyVad."""
    rng = np.random.default_rng(seed)
    wav = rng.normal(0, 1e-4, int(seconds * sr)).astype(np.float32)
    for a, b in spans:
        t = np.arange(int(a * sr), int(b * sr))
        wav[t] += (0.3 * np.sin(2 * np.pi * 440 * t / sr)).astype(np.float32)
    return wav
