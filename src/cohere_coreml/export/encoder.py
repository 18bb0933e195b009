"""Encoder export: one fixed audio window of log-mel features in, everything the decoder needs out.

The traced module wraps the `transformers` modules of `CohereAsrForConditionalGeneration`:
`model.model.encoder` (ParakeetEncoder, FastConformer: its subsampling, positional encoding and
layers), `model.model.decoder.proj` (encoder width -> decoder width) and every decoder layer's
`encoder_attn.k_proj` / `encoder_attn.v_proj`, so the cross-attention memory is projected once per
window, never per decoder step.

The length masks are inputs (docs/ane.md): the host computes them from the window's valid
mel frames (`shapes.LengthMasks`, transformers' own length arithmetic) and passes them as fp16 0/1
masks, so the program holds no int / fp32 / bool length arithmetic (floor, floor_div, less, casts:
off the Neural Engine). The masks act where `ParakeetEncoder.forward` applies its `attention_mask`:
after every subsampling convolution, on the attention scores (padded keys) and before each
convolution module's depthwise convolution (padded frames zeroed); `host_length_masks` routes them
there with hooks on the transformers modules, none of which is re-implemented. Padded query rows
then differ from transformers' (they attend to the valid frames instead of uniformly), but no valid
frame reads a padded row and the outputs zero them: the gate compares every output with the
unmodified transformers forward.

Contract (see docs/contract.md), one encoder program (or the first/last of its parts, `EncoderPart`):
    inputs : input_features      float32 (1, M, F)    normalised log-mel; frames >= n are ignored
             feature_mask        float16 (1, F)       1 for the n valid mel frames, 0 after
             subsampling_mask_k  float16 (1, T_k)     the same after stride convolution k (k < S)
             encoder_mask        float16 (1, T)       the same for the encoder frames (T = T_S)
    outputs: encoder_hidden_states (1, Tp, Ddec)     after decoder.proj; rows >= encoder_length are zero
             cross_k               (L, Hkv, Tp, Dh)   decoder.layers[i].encoder_attn.k_proj(enc), head layout
             cross_v               (L, Hkv, Tp, Dh)   same with v_proj
             cross_mask            (1, 1, 1, Tp)      additive: 0 for valid frames, -1e4 for padding
The window's encoder_length is the host's (`LengthMasks.encoder_length`), not an output.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..config import FP16_MASK_VALUE, LENGTH_MASKS_METADATA_KEY
from ..model.audio import FrontEndConfig, load_audio, log_mel
from ..model.layer_stream import resident_layers, run_together
from ..model.reference import cross_memory
from ..model.shapes import ENCODER_MASK, EncoderShapes, ShapeError
from .convert import ExportError, ExportSettings, convert_module, quiet_third_party
from .gate import GateCase, GateReport, compare_cases, default_gate_audio
from .parity import psnr

logger = logging.getLogger(__name__)

COMPONENT = "encoder"
# Additive mask value for padded encoder frames: finite in fp16 (finfo(fp32).min or -1e9 become -inf).
MASK_VALUE = FP16_MASK_VALUE
# Name under which the host-masked attention is registered in transformers' AttentionInterface.
_HOST_MASK_ATTENTION = "cohere_coreml_host_mask_eager"
# Speech clips the gate uses by default (the packaged gate audio)
DEFAULT_GATE_CLIPS = 2

FEATURES_INPUT = "input_features"
HIDDEN_NAME = "hidden_states"  # between two parts of an encoder: the conformer's hidden state (1, T, He), in
HIDDEN_OUTPUT = "hidden_states_out"  # ... and out (a program's input and output cannot share a name)
OUTPUT_NAMES = ("encoder_hidden_states", "cross_k", "cross_v", "cross_mask")


class EncoderInputError(ShapeError):
    """Features or lengths that do not fit the exported encoder's window."""


def encoder_inputs(shapes: EncoderShapes, features: np.ndarray, n_valid: int) -> dict[str, np.ndarray]:
    """The whole encoder's (or its first part's) inputs for a window: features (1, M, F) float32 and
    the host's length masks for `n_valid` valid mel frames."""
    return {FEATURES_INPUT: np.asarray(features, dtype=np.float32).reshape(1, shapes.n_mels, shapes.frames),
            **shapes.masks.inputs(n_valid, shapes.frames)}


def example_inputs(shapes: EncoderShapes, n_valid: int | None = None, first: bool = True) -> tuple[torch.Tensor, ...]:
    """Tracing inputs of an encoder program (a partial window: every mask has zeros and ones)."""
    n = max(1, shapes.frames - 3) if n_valid is None else int(n_valid)
    masks = {k: torch.from_numpy(v) for k, v in shapes.masks.inputs(n, shapes.frames).items()}
    if first:
        return (torch.zeros(1, shapes.n_mels, shapes.frames, dtype=torch.float32), *masks.values())
    return (torch.zeros(1, shapes.encoder_frames, shapes.encoder_hidden_size), masks[ENCODER_MASK])


# --------------------------------------------------------------------------------------------
# Host length masks, routed into the transformers modules
# --------------------------------------------------------------------------------------------


def _host_mask_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' parakeet eager attention with the host's key mask added to the scores.

    ParakeetEncoderAttention passes its position scores (`matrix_bd`) as `attention_mask`; with the
    layer called without a mask they are unmasked, and the additive key mask of `host_length_masks`
    (0 valid, MASK_VALUE padded: finite in fp16, where transformers' finfo(float32).min is -inf and a
    fully masked row NaN) is added here. exp(MASK_VALUE + x) == 0: padded keys get no weight.
    """
    from transformers.models.parakeet import modeling_parakeet  # heavy, and it loads sentencepiece (see decoder_gate)

    key_mask = getattr(module, "_cohere_key_mask", None)
    if key_mask is not None:
        attention_mask = attention_mask + key_mask.to(attention_mask.dtype)
    return modeling_parakeet.eager_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


@contextlib.contextmanager
def host_length_masks(encoder, stage_masks, encoder_mask: torch.Tensor, layers=None):
    """Route the host's masks into `encoder` (ParakeetEncoder) while it is called WITHOUT its
    attention_mask (so transformers computes no length arithmetic):

    * `stage_masks` (1, T_k), k = 1..S: multiply the output of every subsampling Conv2d (a stride
      convolution moves to the next mask; a 1x1 pointwise one keeps it), as
      `ParakeetEncoderSubsamplingConv2D.forward` multiplies by its channel mask;
    * `encoder_mask` (1, T): padded keys get MASK_VALUE in every layer's attention scores (the
      registered `_host_mask_attention`), and each convolution module's depthwise convolution sees
      its padded frames zeroed (transformers' `masked_fill(all_masked_rows, 0.0)`).

    `layers`: the encoder layers to mask (default all). Hooks and attributes are removed on exit.
    """
    from transformers import AttentionInterface  # heavy: this module loads without transformers

    AttentionInterface.register(_HOST_MASK_ATTENTION, _host_mask_attention)
    layers = list(encoder.layers) if layers is None else list(layers)
    handles, configs = [], {}
    key_mask = ((1.0 - encoder_mask) * MASK_VALUE)[:, None, None, :]  # (1, 1, 1, T) additive, fp16 arithmetic
    valid = encoder_mask[:, None, :]  # (1, 1, T): times (B, C, T)
    try:
        if stage_masks:
            stage = -1
            for layer in encoder.subsampling.layers:
                if isinstance(layer, nn.Conv2d):
                    if layer.stride != (1, 1):
                        stage += 1
                    mask = stage_masks[max(stage, 0)][:, None, :, None]  # (1, 1, T_k, 1)
                    handles.append(layer.register_forward_hook(lambda _m, _a, out, mask=mask: out * mask))
        for layer in layers:
            layer.self_attn._cohere_key_mask = key_mask
            configs[id(layer.self_attn.config)] = layer.self_attn.config
            handles.append(layer.conv.depthwise_conv.register_forward_pre_hook(
                lambda _m, args: (args[0] * valid.to(args[0].dtype),)))
        previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
        for cfg in configs.values():
            cfg._attn_implementation = _HOST_MASK_ATTENTION
        yield encoder
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers:
            layer.self_attn.__dict__.pop("_cohere_key_mask", None)
        for key, cfg in configs.items():
            cfg._attn_implementation = previous.get(key, cfg._attn_implementation)


# --------------------------------------------------------------------------------------------
# The traced wrapper
# --------------------------------------------------------------------------------------------


class EncoderForCoreML(nn.Module):
    """Traceable encoder program: consecutive layers [start, stop) of the conformer.

    The first program (start 0) takes the features and the length masks and runs the subsampling
    first; the last one (stop = all layers) ends with `decoder.proj` and the cross K/V; a program
    that is both is the whole encoder. Between parts flows the conformer's hidden state (1, T, He).
    Only wraps the transformers modules; `forward` follows `ParakeetEncoder.forward` (subsampling,
    input scale, positional encoding, layers) with the masks of `host_length_masks`.
    """

    def __init__(self, model, shapes: EncoderShapes, layers: tuple[int, int] | None = None):
        super().__init__()
        self.shapes = shapes
        self.encoder = model.model.encoder
        n = len(self.encoder.layers)
        self.start, self.stop = layers if layers is not None else (0, n)
        if not 0 <= self.start < self.stop <= n:
            raise ShapeError(f"encoder layers [{self.start}, {self.stop}) are not a range of the {n} layers")
        self.first, self.last = self.start == 0, self.stop == n
        self.proj = model.model.decoder.proj
        self.k_proj = nn.ModuleList([layer.encoder_attn.k_proj for layer in model.model.decoder.layers])
        self.v_proj = nn.ModuleList([layer.encoder_attn.v_proj for layer in model.model.decoder.layers])

    def forward(self, *inputs: torch.Tensor):
        s = self.shapes
        enc = self.encoder
        layers = enc.layers[self.start : self.stop]
        if self.first:
            # input_features (1, M, F) float; masks (1, F), (1, T_1) ... (1, T) fp16 0/1
            input_features, feature_mask, *stage_masks = inputs
            encoder_mask = stage_masks[-1]
            features = input_features.transpose(1, 2) * feature_mask[:, :, None].to(input_features.dtype)  # (1, F, M)
            with host_length_masks(enc, stage_masks, encoder_mask, layers):
                hidden = enc.subsampling(features) * enc.input_scale  # (1, T, He)
                hidden = self._layers(hidden, layers)
        else:
            hidden, encoder_mask = inputs  # (1, T, He), (1, T)
            with host_length_masks(enc, (), encoder_mask, layers):
                hidden = self._layers(hidden, layers)
        if not self.last:
            return hidden
        valid = encoder_mask.to(hidden.dtype)  # (1, T), 1 for valid encoder frames
        pad = s.padded_frames - s.encoder_frames
        memory = self.proj(hidden)  # (1, T, Ddec)
        memory = nn.functional.pad(memory * valid[:, :, None], (0, 0, 0, pad))  # (1, Tp, Ddec)
        valid_p = nn.functional.pad(valid, (0, pad))  # (1, Tp)
        cross_mask = ((1.0 - valid_p) * MASK_VALUE)[:, None, None, :]  # (1, 1, 1, Tp)

        keys, values = [], []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            # (1, Tp, Hkv * Dh) -> (Hkv, Tp, Dh)
            keys.append(k_proj(memory).view(s.padded_frames, s.num_kv_heads, s.head_dim).transpose(0, 1))
            values.append(v_proj(memory).view(s.padded_frames, s.num_kv_heads, s.head_dim).transpose(0, 1))
        cross_k = torch.stack(keys, dim=0)  # (L, Hkv, Tp, Dh)
        cross_v = torch.stack(values, dim=0)  # (L, Hkv, Tp, Dh)
        return memory, cross_k, cross_v, cross_mask

    def _layers(self, hidden: torch.Tensor, layers) -> torch.Tensor:
        """`ParakeetEncoder.forward`'s layer loop (eval: no dropout, no layer drop), no attention_mask."""
        position_embeddings = self.encoder.encode_positions(hidden)  # depends on the shape only: constant
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings)
        return hidden


# --------------------------------------------------------------------------------------------
# Reference (plain transformers, eager PyTorch)
# --------------------------------------------------------------------------------------------


def reference_outputs(model, shapes: EncoderShapes, input_features: np.ndarray, feature_length: int,
                      boundaries=()) -> dict:
    """What the exported encoder must produce, computed with transformers' public forward.

    Independent of `EncoderForCoreML`: builds the feature extractor's attention mask, runs
    `model.model.encoder(features, attention_mask=...)`, then the contract's cross memory
    (`cohere_coreml.model.reference.cross_memory`: `decoder.proj`, each layer's cross-attention
    `k_proj`/`v_proj`, padding). `boundaries` (first layers of the parts after the first): also
    transformers' hidden state entering each of those layers, as "hidden_states" [(1, T, He) float32].
    """
    s = shapes
    feats = np.asarray(input_features, dtype=np.float32).reshape(1, s.n_mels, s.frames)
    n = int(np.clip(int(np.asarray(feature_length).reshape(-1)[0]), 1, s.frames))
    x = torch.from_numpy(feats).transpose(1, 2).clone()  # (1, F, M)
    x[:, n:, :] = 0.0
    mask = torch.zeros(1, s.frames, dtype=torch.int64)
    mask[:, :n] = 1
    with torch.no_grad():
        out = model.model.encoder(input_features=x, attention_mask=mask, output_hidden_states=bool(boundaries))
    ref = cross_memory(model, out.last_hidden_state, int(out.attention_mask.sum()), s.padded_frames)
    if boundaries:  # hidden_states[k]: the input of layer k (hidden_states[0]: after the subsampling)
        ref["hidden_states"] = [out.hidden_states[b].numpy() for b in boundaries]
    return ref


def unpadded_reference(model, input_features: np.ndarray) -> np.ndarray:
    """transformers' encoder + proj on an UNPADDED (1, M, n) input, no mask: (1, t, Ddec)."""
    x = torch.from_numpy(np.asarray(input_features, dtype=np.float32)).transpose(1, 2)
    with torch.no_grad():
        hidden = model.model.encoder(input_features=x).last_hidden_state
        return model.model.decoder.proj(hidden).numpy()


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def trace_encoder(model, shapes: EncoderShapes, layers: tuple[int, int] | None = None) -> torch.jit.ScriptModule:
    """`torch.jit.trace` of `EncoderForCoreML` (the whole encoder, or its layers [start, stop))."""
    model.eval()
    wrapper = EncoderForCoreML(model, shapes, layers).eval()
    # a streamed reference (`layer_stream`): the traced layers read for the trace; the traced program keeps
    # the tensors it holds until it is dropped, the model none of them
    with torch.no_grad(), quiet_third_party(), resident_layers(model, wrapper.start, wrapper.stop):
        traced = torch.jit.trace(wrapper, example_inputs(shapes, first=wrapper.first), check_trace=False, strict=False)
    return traced


def describe_io(shapes: EncoderShapes) -> dict[str, str]:
    s = shapes
    masks = s.masks
    frames = s.mask_frames
    texts = {
        "input_features": f"float32 (1, {s.n_mels}, {s.frames}): normalised log-mel features of one "
        f"{s.window_seconds:g} s window (hop {s.hop_length} at {s.sample_rate} Hz); frames past feature_mask ignored",
        HIDDEN_NAME: f"(1, {s.encoder_frames}, {s.encoder_hidden_size}): the conformer's hidden state between "
        "two parts of the encoder",
        HIDDEN_OUTPUT: f"(1, {s.encoder_frames}, {s.encoder_hidden_size}): the conformer's hidden state between "
        "two parts of the encoder (out)",
        "encoder_hidden_states": f"(1, {s.padded_frames}, {s.decoder_hidden_size}): encoder output after "
        "decoder.proj; rows past encoder_mask are zero",
        "cross_k": f"({s.num_layers}, {s.num_kv_heads}, {s.padded_frames}, {s.head_dim}): per decoder layer, "
        "encoder_attn.k_proj of the memory in head layout",
        "cross_v": f"({s.num_layers}, {s.num_kv_heads}, {s.padded_frames}, {s.head_dim}): per decoder layer, "
        "encoder_attn.v_proj of the memory in head layout",
        "cross_mask": f"(1, 1, 1, {s.padded_frames}): additive cross-attention mask, 0 for valid encoder "
        f"frames, {MASK_VALUE:g} for padding",
    }
    rule = (f"L_k = (L_k-1 + {2 * masks.padding} - {masks.kernel_size}) // {masks.stride} + 1, L_0 = valid mel "
            "frames")
    for k, (name, n) in enumerate(zip(masks.names, frames)):
        what = "mel frames" if k == 0 else ("encoder frames" if k == masks.stages else f"frames after stride convolution {k}")
        texts[name] = f"float16 (1, {n}): 1 for the L_{k} valid {what}, 0 after ({rule})"
    return texts


def convert_traced_encoder(traced, shapes: EncoderShapes, settings: ExportSettings, extra_metadata=None,
                           first: bool = True, last: bool = True):
    """The traced encoder program as an ML program: fp16 end to end for an fp16 export (the length
    arithmetic is the host's: nothing in it needs fp32 or integers)."""
    import coremltools as ct  # heavy: the PyTorch side (reference, gates) needs none

    s = shapes
    frames = dict(zip(s.masks.names, s.mask_frames))
    if first:
        inputs = [ct.TensorType(name=FEATURES_INPUT, shape=(1, s.n_mels, s.frames), dtype=np.float32)]
        inputs += [ct.TensorType(name=name, shape=(1, n), dtype=np.float16) for name, n in frames.items()]
    else:
        dtype = np.float16 if settings.precision == "fp16" else np.float32
        inputs = [ct.TensorType(name=HIDDEN_NAME, shape=(1, s.encoder_frames, s.encoder_hidden_size), dtype=dtype),
                  ct.TensorType(name=ENCODER_MASK, shape=(1, s.encoder_frames), dtype=np.float16)]
    outputs = [ct.TensorType(name=name) for name in (OUTPUT_NAMES if last else (HIDDEN_OUTPUT,))]
    io = describe_io(s)
    names = [i.name for i in inputs] + [o.name for o in outputs]
    metadata = {
        "com.cohere_coreml.component": COMPONENT,
        "com.cohere_coreml.sample_rate": s.sample_rate,
        "com.cohere_coreml.hop_length": s.hop_length,
        "com.cohere_coreml.window_frames": s.frames,
        "com.cohere_coreml.encoder_frames": s.encoder_frames,
        "com.cohere_coreml.padded_encoder_frames": s.padded_frames,
        "com.cohere_coreml.cross_mask_value": MASK_VALUE,
        LENGTH_MASKS_METADATA_KEY: s.masks.to_manifest(),
        "com.cohere_coreml.shapes": s.to_dict(),
        "com.cohere_coreml.io": {k: io[k] for k in names},
        **(extra_metadata or {}),
    }
    return convert_module(
        traced,
        inputs,
        outputs,
        settings,
        metadata=metadata,
        descriptions={k: io[k] for k in names},
        short_description=f"Cohere Transcribe encoder, {s.window_seconds:g} s window, cross-attention K/V "
        "for every decoder layer",
    )


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------


def gate_inputs(shapes: EncoderShapes, clips: list[np.ndarray] | None = None, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """(features (1, M, F), n_valid) pairs for the parity gate.

    `clips` are real log-mel feature arrays (M, n) (e.g. committed speech through `audio.log_mel`);
    without them, two synthetic inputs (a partial window and a full one) are used.
    """
    s = shapes
    cases: list[tuple[np.ndarray, int]] = []
    for feats in clips or []:
        feats = np.asarray(feats, dtype=np.float32)
        if feats.ndim != 2 or feats.shape[0] != s.n_mels:
            raise EncoderInputError(f"gate clip features must be (n_mels={s.n_mels}, frames), got {feats.shape}")
        n = min(feats.shape[1], s.frames)
        window = np.zeros((1, s.n_mels, s.frames), dtype=np.float32)
        window[0, :, :n] = feats[:, :n]
        cases.append((window, n))
    if not cases:
        rng = np.random.default_rng(seed)
        for n in (max(1, (s.frames * 3) // 5), s.frames):
            window = np.zeros((1, s.n_mels, s.frames), dtype=np.float32)
            window[0, :, :n] = rng.standard_normal((s.n_mels, n)).astype(np.float32)
            cases.append((window, n))
    return cases


@dataclass
class EncoderGateCase(GateCase):
    """A gate case of an encoder in parts: also transformers' hidden state entering each later part."""

    parts: list[np.ndarray] = field(default_factory=list)


def gate_cases(model, shapes: EncoderShapes, windows, min_psnr_db: float, boundaries=()) -> list[EncoderGateCase]:
    """`GateCase`s of (features, n_valid) windows, with the reference outputs (and, for an encoder in
    parts starting at layers `boundaries`, the hidden states between them).

    A partial window also records its discriminating power: how far the right answer is from the
    published ports' bug (the padding treated as speech). Above the threshold, the case could not
    tell an export that ignores its length from a correct one.
    """
    windows = list(windows)
    # every reference pass at once: a streamed model reads each encoder layer once for all of them
    partial_windows = [k for k, (_, n) in enumerate(windows) if n < shapes.frames]
    passes = run_together(model, [functools.partial(reference_outputs, model, shapes, f, n, boundaries)
                                  for f, n in windows]
                          + [functools.partial(reference_outputs, model, shapes, windows[k][0], shapes.frames)
                             for k in partial_windows])
    unmasked = dict(zip(partial_windows, passes[len(windows):], strict=True))
    cases = []
    for i, (features, n) in enumerate(windows):
        ref = passes[i]
        hidden = ref.pop("hidden_states", [])
        t = int(ref.pop("encoder_length")[0])  # the host's figure, not a program output
        info = {"feature_length": int(n), "encoder_length": t}
        if shapes.masks.encoder_length(n) != t:
            raise ExportError(f"the host length masks give {shapes.masks.encoder_length(n)} encoder frames for {n} "
                              f"mel frames, transformers {t}")
        if n < shapes.frames:
            wrong = unmasked[i]["encoder_hidden_states"]
            effect = psnr(ref["encoder_hidden_states"][:, :t], wrong[:, :t])
            info["unmasked_reference_psnr_db"] = effect if np.isfinite(effect) else str(effect)
            info["discriminates_masking"] = bool(effect < min_psnr_db)
            if effect >= min_psnr_db:
                logger.warning("encoder gate case %d: the unmasked reference is %.1f dB from the masked one "
                               "(>= %.0f dB): this case cannot detect ignored masking", i, effect, min_psnr_db)
        inputs = encoder_inputs(shapes, features, n)
        cases.append(EncoderGateCase(inputs=inputs, reference=ref, info=info, parts=hidden))
    return cases


def run_gate(package: Path, model, shapes: EncoderShapes, settings: ExportSettings, windows,
             function_name: str | None = None) -> GateReport:
    """Run the package through `cohere_coreml.runtime` on each window, compare with PyTorch."""
    cases = gate_cases(model, shapes, windows, settings.gate_psnr_db)
    return compare_gate_cases(package, cases, settings, function_name)


def compare_gate_cases(package: Path, cases: list[GateCase], settings: ExportSettings,
                       function_name: str | None = None) -> GateReport:
    """The encoder gate on reference cases computed beforehand (`gate_cases`)."""
    return compare_cases(COMPONENT, package, cases, settings.gate_psnr_db, function_name=function_name,
                         units=settings.gate_units, details={"precision": settings.precision})


# --------------------------------------------------------------------------------------------
# Real speech for the gate
# --------------------------------------------------------------------------------------------


def gate_features(processor, shapes: EncoderShapes, audio_paths=None) -> list[np.ndarray]:
    """Log-mel features (M, n) of real speech for the gate (dither 0, like parity work).

    One entry per clip (cut to the window), plus one full window made of the clips' frames
    back to back, so the gate sees both a partial and a full `feature_length`.
    """
    paths = list(audio_paths) if audio_paths else default_gate_audio(max_clips=DEFAULT_GATE_CLIPS)
    if not paths:
        return []
    config = FrontEndConfig.from_processor(processor, dither=0.0) if processor is not None else FrontEndConfig()
    if config.n_mels != shapes.n_mels:
        raise EncoderInputError(f"front end has {config.n_mels} mel bins, the encoder expects {shapes.n_mels}")
    feats = []
    for path in paths:
        mel, n_valid = log_mel(load_audio(path, target_rate=config.sampling_rate), config)
        feats.append(np.asarray(mel[:, :n_valid], dtype=np.float32))
    clips = [f[:, : shapes.frames] for f in feats]
    if all(c.shape[1] >= shapes.frames for c in clips):  # make sure a partial window is checked
        clips.append(feats[0][:, : max(1, (shapes.frames * 3) // 5)])
    if all(c.shape[1] < shapes.frames for c in clips):  # ... and a full one
        joined = np.concatenate(feats, axis=1)
        reps = -(-shapes.frames // joined.shape[1])
        clips.append(np.tile(joined, (1, reps))[:, : shapes.frames])
    return clips
