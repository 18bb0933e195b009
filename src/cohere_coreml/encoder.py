"""Encoder export: one fixed audio window of log-mel features in, everything the decoder needs out.

The traced module wraps the `transformers` modules of `CohereAsrForConditionalGeneration`:
`model.model.encoder` (ParakeetEncoder, FastConformer), `model.model.decoder.proj` (encoder width
-> decoder width) and every decoder layer's `encoder_attn.k_proj` / `encoder_attn.v_proj`, so the
cross-attention memory is projected once per window, never per decoder step.

The `feature_length` input really masks: it is turned into the same `attention_mask` the feature
extractor returns, and `ParakeetEncoder.forward` applies it in the subsampling convolutions, in
self-attention and in the convolution module, exactly as `transformers` does.

Contract (see docs/contract.md):
    inputs : input_features  float32 (1, M, F)      normalised log-mel; frames >= feature_length are ignored
             feature_length  int32   (1,)           valid mel frames, clamped to [1, F]
    outputs: encoder_hidden_states (1, Tp, Ddec)    after decoder.proj; rows >= encoder_length are zero
             cross_k               (L, Hkv, Tp, Dh)  decoder.layers[i].encoder_attn.k_proj(enc), head layout
             cross_v               (L, Hkv, Tp, Dh)  same with v_proj
             cross_mask            (1, 1, 1, Tp)    additive: 0 for valid frames, -1e4 for padding
             encoder_length        int32 (1,)       valid encoder frames
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .audio import FrontEndConfig, load_audio, log_mel
from .config import BUCKETS_METADATA_KEY, FP16_MASK_VALUE
from .convert import ExportError, ExportSettings, convert_module, merge_functions
from .files import save_converted, skip_installed, temporary_dir
from .gate import GateCase, GateReport, StagedPackage, compare_cases, default_gate_audio, stage_gated
from .parity import psnr
from .reference import cross_memory
from .shapes import EncoderShapes, ShapeError, bucket_shapes, encoder_shapes

logger = logging.getLogger(__name__)

COMPONENT = "encoder"
# Additive mask value for padded encoder frames: finite in fp16 (finfo(fp32).min or -1e9 become -inf).
MASK_VALUE = FP16_MASK_VALUE
# Name under which the fp16-safe eager attention is registered in transformers' AttentionInterface.
_SAFE_ATTENTION = "cohere_coreml_fp16_safe_eager"
# Speech clips the gate uses by default (the packaged gate audio)
DEFAULT_GATE_CLIPS = 2

INPUT_NAMES = ("input_features", "feature_length")
OUTPUT_NAMES = ("encoder_hidden_states", "cross_k", "cross_v", "cross_mask", "encoder_length")


class EncoderInputError(ShapeError):
    """Features or lengths that do not fit the exported encoder's window."""


# --------------------------------------------------------------------------------------------
# fp16-safe attention masking
# --------------------------------------------------------------------------------------------


def _fp16_safe_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' parakeet eager attention with the additive mask clamped to MASK_VALUE.

    ParakeetEncoderAttention fills masked positions with finfo(float32).min, which is -inf in an
    fp16 program; fully masked (padding) rows then give NaN that leaks into valid frames through
    the values of later layers. Clamping keeps the masking (exp(-1e4) == 0) and stays finite.
    """
    from transformers.models.parakeet import modeling_parakeet  # heavy, and it loads sentencepiece (see decoder_gate)

    if attention_mask is not None:
        attention_mask = attention_mask.clamp(min=MASK_VALUE)
    return modeling_parakeet.eager_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


@contextlib.contextmanager
def fp16_safe_encoder_attention(model):
    """Temporarily route the encoder's attention through `_fp16_safe_eager_attention`."""
    from transformers import AttentionInterface  # heavy: this module loads without transformers

    AttentionInterface.register(_SAFE_ATTENTION, _fp16_safe_eager_attention)
    configs = {id(m.config): m.config for m in model.model.encoder.modules() if hasattr(m, "config")}
    previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = _SAFE_ATTENTION
        yield model
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]


# --------------------------------------------------------------------------------------------
# The traced wrapper
# --------------------------------------------------------------------------------------------


class EncoderForCoreML(nn.Module):
    """Traceable encoder: (features, length) -> decoder memory, cross K/V and mask.

    Only wraps the transformers modules; no layer of the model is re-implemented.
    """

    def __init__(self, model, shapes: EncoderShapes):
        super().__init__()
        self.shapes = shapes
        self.encoder = model.model.encoder
        self.proj = model.model.decoder.proj
        self.k_proj = nn.ModuleList([layer.encoder_attn.k_proj for layer in model.model.decoder.layers])
        self.v_proj = nn.ModuleList([layer.encoder_attn.v_proj for layer in model.model.decoder.layers])

    def forward(self, input_features: torch.Tensor, feature_length: torch.Tensor):
        s = self.shapes
        # input_features: (1, M, F) float; feature_length: (1,) int32
        length = feature_length.to(torch.int64).clamp(1, s.frames)  # (1,)
        frame_ids = torch.arange(s.frames, dtype=torch.int64)  # (F,)
        attention_mask = (frame_ids[None, :] < length[:, None]).to(torch.int64)  # (1, F), 1 = valid
        features = input_features.transpose(1, 2)  # (1, F, M), the layout transformers uses
        features = features * attention_mask[:, :, None].to(features.dtype)  # padding is zero by contract

        encoded = self.encoder(input_features=features, attention_mask=attention_mask)
        hidden = encoded.last_hidden_state  # (1, T, He)
        valid = encoded.attention_mask.to(hidden.dtype)  # (1, T), 1 for valid encoder frames
        encoder_length = encoded.attention_mask.to(torch.int32).sum(-1)  # (1,)

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
        return memory, cross_k, cross_v, cross_mask, encoder_length


# --------------------------------------------------------------------------------------------
# Reference (plain transformers, eager PyTorch)
# --------------------------------------------------------------------------------------------


def reference_outputs(model, shapes: EncoderShapes, input_features: np.ndarray, feature_length: int) -> dict:
    """What the exported encoder must produce, computed with transformers' public forward.

    Independent of `EncoderForCoreML`: builds the feature extractor's attention mask, runs
    `model.model.encoder(features, attention_mask=...)`, then the contract's cross memory
    (`cohere_coreml.reference.cross_memory`: `decoder.proj`, each layer's cross-attention
    `k_proj`/`v_proj`, padding).
    """
    s = shapes
    feats = np.asarray(input_features, dtype=np.float32).reshape(1, s.n_mels, s.frames)
    n = int(np.clip(int(np.asarray(feature_length).reshape(-1)[0]), 1, s.frames))
    x = torch.from_numpy(feats).transpose(1, 2).clone()  # (1, F, M)
    x[:, n:, :] = 0.0
    mask = torch.zeros(1, s.frames, dtype=torch.int64)
    mask[:, :n] = 1
    with torch.no_grad():
        out = model.model.encoder(input_features=x, attention_mask=mask)
    return cross_memory(model, out.last_hidden_state, int(out.attention_mask.sum()), s.padded_frames)


def unpadded_reference(model, input_features: np.ndarray) -> np.ndarray:
    """transformers' encoder + proj on an UNPADDED (1, M, n) input, no mask: (1, t, Ddec)."""
    x = torch.from_numpy(np.asarray(input_features, dtype=np.float32)).transpose(1, 2)
    with torch.no_grad():
        hidden = model.model.encoder(input_features=x).last_hidden_state
        return model.model.decoder.proj(hidden).numpy()


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def trace_encoder(model, shapes: EncoderShapes) -> torch.jit.ScriptModule:
    """`torch.jit.trace` of `EncoderForCoreML` (fp16-safe attention masking, eval mode)."""
    model.eval()
    wrapper = EncoderForCoreML(model, shapes).eval()
    example = (
        torch.zeros(1, shapes.n_mels, shapes.frames, dtype=torch.float32),
        torch.tensor([max(1, shapes.frames - 3)], dtype=torch.int32),
    )
    with fp16_safe_encoder_attention(model), torch.no_grad():
        traced = torch.jit.trace(wrapper, example, check_trace=False, strict=False)
    return traced


def describe_io(shapes: EncoderShapes) -> dict[str, str]:
    s = shapes
    return {
        "input_features": f"float32 (1, {s.n_mels}, {s.frames}): normalised log-mel features of one "
        f"{s.window_seconds:g} s window (hop {s.hop_length} at {s.sample_rate} Hz); frames >= feature_length ignored",
        "feature_length": f"int32 (1,): number of valid mel frames, 1..{s.frames}",
        "encoder_hidden_states": f"(1, {s.padded_frames}, {s.decoder_hidden_size}): encoder output after "
        "decoder.proj; rows >= encoder_length are zero",
        "cross_k": f"({s.num_layers}, {s.num_kv_heads}, {s.padded_frames}, {s.head_dim}): per decoder layer, "
        "encoder_attn.k_proj of the memory in head layout",
        "cross_v": f"({s.num_layers}, {s.num_kv_heads}, {s.padded_frames}, {s.head_dim}): per decoder layer, "
        "encoder_attn.v_proj of the memory in head layout",
        "cross_mask": f"(1, 1, 1, {s.padded_frames}): additive cross-attention mask, 0 for valid encoder "
        f"frames, {MASK_VALUE:g} for padding",
        "encoder_length": "int32 (1,): number of valid encoder frames",
    }


def _fp16_except_length_arithmetic():
    """fp16 compute precision for everything that depends on `input_features`.

    The length arithmetic (feature_length -> subsampled lengths -> masks) depends only on
    `feature_length`; in fp16 a length such as 2049 rounds to 2048 and `encoder_length` (and the
    masks) would be off by one for odd lengths above 2048. Those few scalar ops stay fp32.
    """
    import coremltools as ct  # heavy: the PyTorch side (reference, gates) needs none

    memo: dict[int, bool] = {}

    def depends_on_features(var) -> bool:
        stack = [var]
        while stack:
            v = stack[-1]
            if id(v) in memo:
                stack.pop()
                continue
            op = v.op
            if op is None:
                memo[id(v)] = v.name == "input_features"
                stack.pop()
                continue
            parents = [p for p in _op_input_vars(op) if id(p) not in memo]
            if parents:
                stack.extend(parents)
                continue
            memo[id(v)] = any(memo[id(p)] for p in _op_input_vars(op))
            stack.pop()
        return memo[id(var)]

    def selector(op) -> bool:  # True: run this op in fp16
        return any(depends_on_features(v) for v in _op_input_vars(op))

    return ct.transform.FP16ComputePrecision(op_selector=selector)


def _op_input_vars(op):
    for value in op.inputs.values():
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def convert_traced_encoder(traced, shapes: EncoderShapes, settings: ExportSettings, extra_metadata=None):
    import coremltools as ct  # heavy: the PyTorch side (reference, gates) needs none

    s = shapes
    inputs = [
        ct.TensorType(name="input_features", shape=(1, s.n_mels, s.frames), dtype=np.float32),
        ct.TensorType(name="feature_length", shape=(1,), dtype=np.int32),
    ]
    outputs = [ct.TensorType(name=name) for name in OUTPUT_NAMES]
    metadata = {
        "com.cohere_coreml.component": COMPONENT,
        "com.cohere_coreml.sample_rate": s.sample_rate,
        "com.cohere_coreml.hop_length": s.hop_length,
        "com.cohere_coreml.window_frames": s.frames,
        "com.cohere_coreml.encoder_frames": s.encoder_frames,
        "com.cohere_coreml.padded_encoder_frames": s.padded_frames,
        "com.cohere_coreml.cross_mask_value": MASK_VALUE,
        "com.cohere_coreml.shapes": s.to_dict(),
        "com.cohere_coreml.io": describe_io(s),
        **(extra_metadata or {}),
    }
    mlmodel = convert_module(
        traced,
        inputs,
        outputs,
        settings,
        metadata=metadata,
        descriptions=describe_io(s),
        short_description=f"Cohere Transcribe encoder, {s.window_seconds:g} s window, cross-attention K/V "
        "for every decoder layer",
        compute_precision=_fp16_except_length_arithmetic() if settings.precision == "fp16" else None,
    )
    _check_output_dtypes(mlmodel)
    return mlmodel


def _check_output_dtypes(mlmodel) -> None:
    """Integer outputs must stay int32 (the decoder reads them as ints)."""
    from coremltools.proto import FeatureTypes_pb2 as ft  # heavy: the PyTorch side (reference, gates) needs none

    for out in mlmodel.get_spec().description.output:
        if out.name == "encoder_length" and out.type.multiArrayType.dataType != ft.ArrayFeatureType.INT32:
            raise ExportError("encoder_length is not int32 in the converted program")


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


def gate_cases(model, shapes: EncoderShapes, windows, min_psnr_db: float) -> list[GateCase]:
    """`GateCase`s of (features, n_valid) windows, with the reference outputs.

    A partial window also records its discriminating power: how far the right answer is from the
    published ports' bug (the padding treated as speech). Above the threshold, the case could not
    tell an export that ignores its length from a correct one.
    """
    cases = []
    for i, (features, n) in enumerate(windows):
        ref = reference_outputs(model, shapes, features, n)
        info = {"feature_length": int(n)}
        if n < shapes.frames:
            t = int(ref["encoder_length"][0])
            wrong = reference_outputs(model, shapes, features, shapes.frames)["encoder_hidden_states"]
            effect = psnr(ref["encoder_hidden_states"][:, :t], wrong[:, :t])
            info["unmasked_reference_psnr_db"] = effect if np.isfinite(effect) else str(effect)
            info["discriminates_masking"] = bool(effect < min_psnr_db)
            if effect >= min_psnr_db:
                logger.warning("encoder gate case %d: the unmasked reference is %.1f dB from the masked one "
                               "(>= %.0f dB): this case cannot detect ignored masking", i, effect, min_psnr_db)
        inputs = {"input_features": features.astype(np.float32), "feature_length": np.array([n], dtype=np.int32)}
        cases.append(GateCase(inputs=inputs, reference=ref, info=info))
    return cases


def run_gate(package: Path, model, shapes: EncoderShapes, settings: ExportSettings, windows,
             function_name: str | None = None) -> GateReport:
    """Run the package through `cohere_coreml.runtime` on each window, compare with PyTorch."""
    cases = gate_cases(model, shapes, windows, settings.gate_psnr_db)
    return compare_gate_cases(package, cases, settings, function_name)


def compare_gate_cases(package: Path, cases: list[GateCase], settings: ExportSettings,
                       function_name: str | None = None) -> GateReport:
    """The encoder gate on reference cases computed beforehand (`gate_cases`)."""
    return compare_cases(COMPONENT, package, cases, settings.gate_psnr_db, exact=("encoder_length",),
                         function_name=function_name, details={"precision": settings.precision})


def convert_encoder(
    model,
    settings: ExportSettings,
    processor=None,
    clips: list[np.ndarray] | None = None,
    extra_metadata: dict | None = None,
    _wrapper_hook=None,
) -> Path | None:
    """Export `encoder.mlpackage` into `settings.out_dir`, parity-gated.

    Returns the package path, or None when it exists and `settings.force` is False.
    Raises ParityError (and writes nothing) when the program does not match PyTorch.
    `_wrapper_hook(wrapper_cls)` is for tests that deliberately break the export.
    """
    staged = stage_encoder(model, settings, processor, clips, extra_metadata, _wrapper_hook)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_encoder(model, settings: ExportSettings, processor=None, clips: list[np.ndarray] | None = None,
                  extra_metadata: dict | None = None, _wrapper_hook=None) -> StagedPackage | None:
    """`convert_encoder` up to the gate: the package written to its temporary path (traced and
    converted inside the writer, so neither outlives it) and the gate's PyTorch references
    computed. `finish()` the result to gate and install it (the model is not needed any more)."""
    if skip_installed(settings, COMPONENT):
        return None
    shapes = encoder_shapes(model, settings.window_seconds, processor)
    logger.info("encoder shapes: %s", shapes)

    def write(tmp: Path) -> None:
        t0 = time.perf_counter()
        traced = trace_encoder(model, shapes) if _wrapper_hook is None else _wrapper_hook(model, shapes)
        logger.info("traced in %.1f s", time.perf_counter() - t0)
        mlmodel = convert_traced_encoder(traced, shapes, settings, extra_metadata)
        del traced
        logger.info("converted in %.1f s", time.perf_counter() - t0)
        mlmodel.save(str(tmp))

    def prepare():
        cases = gate_cases(model, shapes, gate_inputs(shapes, clips), settings.gate_psnr_db)

        def gate(tmp: Path) -> GateReport:
            report = compare_gate_cases(tmp, cases, settings)
            report.details["shapes"] = shapes.to_dict()
            return report

        return gate

    return stage_gated(COMPONENT, settings, write, prepare)


# --------------------------------------------------------------------------------------------
# Length buckets: one package, one function per window, weights shared
# --------------------------------------------------------------------------------------------


def convert_encoder_buckets(
    model,
    settings: ExportSettings,
    bucket_seconds,
    processor=None,
    gate_audio=None,
    extra_metadata: dict | None = None,
) -> Path | None:
    """Export `encoder.mlpackage` as a multifunction package with one function per window.

    The default function `main` is the full window (`settings.window_seconds`); each shorter
    bucket (e.g. 10 s, 20 s) is a function `window_<s>s` whose input has that bucket's frames but
    whose outputs are padded to the FULL window's memory length Tp, so the decoder (and the
    contract) are unchanged: a short clip only pays for its bucket's encoder compute. Identical
    weights are stored once (`convert.merge_functions`). Every function is gated.
    """
    staged = stage_encoder_buckets(model, settings, bucket_seconds, processor, gate_audio, extra_metadata)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_encoder_buckets(model, settings: ExportSettings, bucket_seconds, processor=None, gate_audio=None,
                          extra_metadata: dict | None = None) -> StagedPackage | None:
    """`convert_encoder_buckets` up to the gate (see `stage_encoder`)."""

    if skip_installed(settings, COMPONENT):
        return None
    shapes_by_fn = bucket_shapes(model, settings.window_seconds, bucket_seconds, processor)
    buckets_meta = {fn: {"window_seconds": sh.window_seconds, "frames": sh.frames,
                         "encoder_frames": sh.encoder_frames, "padded_frames": sh.padded_frames}
                    for fn, sh in shapes_by_fn.items()}
    settings.out_dir.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path):
        scratch = temporary_dir(settings.out_dir, "encoder-buckets")
        try:
            singles = {}
            for fn, shapes in shapes_by_fn.items():
                logger.info("bucket %s: %s", fn, shapes)
                single = scratch / f"{fn}.mlpackage"
                traced = trace_encoder(model, shapes)
                save_converted(convert_traced_encoder(traced, shapes, settings.replace(window_seconds=shapes.window_seconds),
                                                      extra_metadata), single)
                del traced
                singles[fn] = single
            mlmodel = merge_functions(singles, "main", scratch)
            mlmodel.user_defined_metadata[BUCKETS_METADATA_KEY] = json.dumps(buckets_meta, sort_keys=True)
            mlmodel.save(str(tmp))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def prepare():
        cases = {}
        for fn, shapes in shapes_by_fn.items():
            windows = gate_inputs(shapes, gate_features(processor, shapes, gate_audio) if processor else None)
            cases[fn] = gate_cases(model, shapes, windows, settings.gate_psnr_db)

        def gate(tmp: Path) -> GateReport:
            reports = {fn: compare_gate_cases(tmp, cases[fn], settings.replace(window_seconds=sh.window_seconds),
                                              function_name=fn)
                       for fn, sh in shapes_by_fn.items()}
            return GateReport.of_functions(COMPONENT, reports, buckets=buckets_meta)

        return gate

    return stage_gated(COMPONENT, settings, write, prepare)


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
