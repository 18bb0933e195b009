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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from cohere_coreml.convert import (
    ExportError,
    ExportSettings,
    ParityError,
    convert_module,
    psnr,
    report_correctness,
    round_up,
    save_package_atomic,
    skip_existing,
    window_frames,
    write_json_atomic,
    write_package_atomic,
)

from cohere_coreml.config import ANE_MULTIPLE, FP16_MASK_VALUE

logger = logging.getLogger(__name__)

COMPONENT = "encoder"
# Additive mask value for padded encoder frames: finite in fp16 (finfo(fp32).min or -1e9 become -inf).
MASK_VALUE = FP16_MASK_VALUE
# The memory's time axis is padded to a multiple of this (Neural Engine friendly; 438 -> 448).
TIME_MULTIPLE = ANE_MULTIPLE
# Name under which the fp16-safe eager attention is registered in transformers' AttentionInterface.
_SAFE_ATTENTION = "cohere_coreml_fp16_safe_eager"

INPUT_NAMES = ("input_features", "feature_length")
OUTPUT_NAMES = ("encoder_hidden_states", "cross_k", "cross_v", "cross_mask", "encoder_length")


class EncoderInputError(ValueError):
    """Features or lengths that do not fit the exported encoder's window."""


@dataclass(frozen=True)
class EncoderShapes:
    """All sizes of the exported encoder, read from the model config and the front end."""

    n_mels: int  # M
    frames: int  # F, mel frames of one window
    encoder_frames: int  # T, encoder frames for F frames
    padded_frames: int  # Tp, T rounded up to TIME_MULTIPLE
    encoder_hidden_size: int
    decoder_hidden_size: int  # Ddec
    num_layers: int  # L (decoder layers)
    num_kv_heads: int  # Hkv
    head_dim: int  # Dh
    sample_rate: int
    hop_length: int
    window_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _front_end_params(processor) -> tuple[int, int]:
    """(sample_rate, hop_length) of the feature extractor (defaults of CohereAsrFeatureExtractor)."""
    fe = getattr(processor, "feature_extractor", processor)
    sample_rate = int(getattr(fe, "sampling_rate", 16000) or 16000)
    hop_length = int(getattr(fe, "hop_length", 160) or 160)
    return sample_rate, hop_length


def encoder_output_length(model, frames) -> torch.Tensor:
    """Encoder frames for `frames` mel frames, with transformers' own subsampling arithmetic."""
    lengths = torch.as_tensor(frames).reshape(-1)
    return model.model.encoder._get_subsampling_output_length(lengths).to(torch.int32)


def encoder_shapes(model, window_seconds: float = 35.0, processor=None, frames: int | None = None,
                   memory_frames: int | None = None) -> EncoderShapes:
    """Shapes of the exported encoder for a window.

    `memory_frames` (length buckets): pad the memory to this many frames instead of
    round_up(T, 32), so a shorter window's outputs have the full window's shapes.
    """
    config = model.config
    enc = config.encoder_config
    sample_rate, hop_length = _front_end_params(processor)
    if frames is None:
        frames = window_frames(window_seconds, sample_rate, hop_length)
    t = int(encoder_output_length(model, frames)[0])
    if t < 1:
        raise EncoderInputError(f"a window of {frames} mel frames gives no encoder frame")
    padded = round_up(t, TIME_MULTIPLE) if memory_frames is None else int(memory_frames)
    if padded < t:
        raise EncoderInputError(f"memory of {padded} frames cannot hold the {t} encoder frames of {frames} mel frames")
    return EncoderShapes(
        n_mels=int(enc.num_mel_bins),
        frames=int(frames),
        encoder_frames=t,
        padded_frames=padded,
        encoder_hidden_size=int(enc.hidden_size),
        decoder_hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(config.head_dim),
        sample_rate=sample_rate,
        hop_length=hop_length,
        window_seconds=float(window_seconds),
    )


# --------------------------------------------------------------------------------------------
# fp16-safe attention masking
# --------------------------------------------------------------------------------------------


def _fp16_safe_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' parakeet eager attention with the additive mask clamped to MASK_VALUE.

    ParakeetEncoderAttention fills masked positions with finfo(float32).min, which is -inf in an
    fp16 program; fully masked (padding) rows then give NaN that leaks into valid frames through
    the values of later layers. Clamping keeps the masking (exp(-1e4) == 0) and stays finite.
    """
    from transformers.models.parakeet import modeling_parakeet

    if attention_mask is not None:
        attention_mask = attention_mask.clamp(min=MASK_VALUE)
    return modeling_parakeet.eager_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


@contextlib.contextmanager
def fp16_safe_encoder_attention(model):
    """Temporarily route the encoder's attention through `_fp16_safe_eager_attention`."""
    from transformers import AttentionInterface

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
    `model.model.encoder(features, attention_mask=...)`, then `decoder.proj` and each layer's
    cross-attention `k_proj`/`v_proj` (the decoder's own code path), then the contract's padding.
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
        t_valid = int(out.attention_mask.sum())
        memory = model.model.decoder.proj(out.last_hidden_state)  # (1, T, Ddec)
        memory[:, t_valid:, :] = 0.0
        memory = nn.functional.pad(memory, (0, 0, 0, s.padded_frames - s.encoder_frames))
        ks, vs = [], []
        for layer in model.model.decoder.layers:
            attn = layer.encoder_attn
            # exactly CohereAsrCrossAttention's projection: (1, Tp, -1, Dh).transpose(1, 2)
            ks.append(attn.k_proj(memory).view(1, s.padded_frames, -1, attn.head_dim).transpose(1, 2)[0])
            vs.append(attn.v_proj(memory).view(1, s.padded_frames, -1, attn.head_dim).transpose(1, 2)[0])
    cross_mask = np.full((1, 1, 1, s.padded_frames), MASK_VALUE, dtype=np.float32)
    cross_mask[..., :t_valid] = 0.0
    return {
        "encoder_hidden_states": memory.numpy(),
        "cross_k": torch.stack(ks).numpy(),
        "cross_v": torch.stack(vs).numpy(),
        "cross_mask": cross_mask,
        "encoder_length": np.array([t_valid], dtype=np.int32),
    }


def unpadded_reference(model, input_features: np.ndarray) -> np.ndarray:
    """transformers' encoder + proj on an UNPADDED (1, M, n) input, no mask: (1, t, Ddec)."""
    x = torch.from_numpy(np.asarray(input_features, dtype=np.float32)).transpose(1, 2)
    with torch.no_grad():
        hidden = model.model.encoder(input_features=x).last_hidden_state
        return model.model.decoder.proj(hidden).numpy()


# --------------------------------------------------------------------------------------------
# Conversion and gate
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
    import coremltools as ct

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
    import coremltools as ct

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
    from coremltools.proto import FeatureTypes_pb2 as ft

    for out in mlmodel.get_spec().description.output:
        if out.name == "encoder_length" and out.type.multiArrayType.dataType != ft.ArrayFeatureType.INT32:
            raise ExportError("encoder_length is not int32 in the converted program")


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


def run_gate(package: Path, model, shapes: EncoderShapes, settings: ExportSettings, cases,
             function_name: str | None = None) -> dict:
    """Run the package through `cohere_coreml.runtime` on each case, compare with PyTorch."""
    from cohere_coreml.runtime import load_model

    loaded = load_model(str(package), backend="auto", function_name=function_name)
    results = []
    passed = True
    worst = float("inf")
    for i, (features, n) in enumerate(cases):
        ref = reference_outputs(model, shapes, features, n)
        t0 = time.perf_counter()
        produced = loaded.predict(
            {"input_features": features.astype(np.float32), "feature_length": np.array([n], dtype=np.int32)}
        )
        seconds = time.perf_counter() - t0
        report = report_correctness(ref, produced, settings.gate_psnr_db, exact=("encoder_length",))
        report.extra.update({"case": i, "feature_length": int(n), "predict_seconds": round(seconds, 3)})
        if n < shapes.frames:
            # Discriminating power: how far is the right answer from the published ports' bug (the
            # padding treated as speech)? If that is above the threshold, this case could not tell
            # an export that ignores its length from a correct one.
            t = int(ref["encoder_length"][0])
            wrong = reference_outputs(model, shapes, features, shapes.frames)["encoder_hidden_states"]
            effect = psnr(ref["encoder_hidden_states"][:, :t], wrong[:, :t])
            report.extra["unmasked_reference_psnr_db"] = effect if np.isfinite(effect) else str(effect)
            report.extra["discriminates_masking"] = bool(effect < settings.gate_psnr_db)
            if effect >= settings.gate_psnr_db:
                logger.warning("encoder gate case %d: the unmasked reference is %.1f dB from the masked one "
                               "(>= %.0f dB): this case cannot detect ignored masking", i, effect,
                               settings.gate_psnr_db)
        logger.debug("encoder gate case %d (feature_length %d):\n%s", i, n, report.summary())
        where = f" function {function_name}" if function_name else ""
        print(f"[encoder gate]{where} case {i} feature_length={n}\n{report.summary()}", flush=True)
        results.append(report)
        passed = passed and report.passed
        worst = min(worst, report.worst_psnr_db)
    summary = {
        "component": COMPONENT,
        "package": f"{COMPONENT}.mlpackage",
        "function": function_name or "main",
        "precision": settings.precision,
        "min_psnr_db": settings.gate_psnr_db,
        "passed": passed,
        "worst_psnr_db": worst if np.isfinite(worst) else str(worst),
        "backend": type(loaded).__name__,
        "cases": [r.to_dict() for r in results],
    }
    if not passed:
        failed = next(r for r in results if not r.passed)
        raise ParityError(f"encoder parity gate refused {package}:\n{failed.summary()}", report=failed)
    return summary


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
    path = settings.package_path(COMPONENT)
    if skip_existing(path, settings.force):
        return None
    shapes = encoder_shapes(model, settings.window_seconds, processor)
    logger.info("encoder shapes: %s", shapes)
    t0 = time.perf_counter()
    traced = trace_encoder(model, shapes) if _wrapper_hook is None else _wrapper_hook(model, shapes)
    logger.info("traced in %.1f s", time.perf_counter() - t0)
    mlmodel = convert_traced_encoder(traced, shapes, settings, extra_metadata)
    del traced
    logger.info("converted in %.1f s", time.perf_counter() - t0)

    gate: dict[str, Any] = {}

    def verify(tmp: Path):
        if settings.skip_verify:
            logger.warning("parity gate skipped (--skip-verify)")
            gate.update({"component": COMPONENT, "skipped": True})
            return
        cases = gate_inputs(shapes, clips)
        gate.update(run_gate(tmp, model, shapes, settings, cases))

    try:
        save_package_atomic(mlmodel, path, force=settings.force, verify=verify)
    except ParityError as err:
        failed = {"component": COMPONENT, "passed": False, "error": str(err)}
        if err.report is not None:
            failed["report"] = err.report.to_dict()
        write_json_atomic(failed, settings.failed_report_path(COMPONENT))
        raise
    gate["shapes"] = shapes.to_dict()
    write_json_atomic(gate, settings.report_path(COMPONENT))
    settings.failed_report_path(COMPONENT).unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# Length buckets: one package, one function per window, weights shared
# --------------------------------------------------------------------------------------------


def bucket_function_name(window_seconds: float) -> str:
    return "window_" + f"{window_seconds:g}".replace(".", "_") + "s"


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
    weights are stored once (`coremltools.utils.save_multifunction`). Every function is gated.
    """
    import shutil
    import tempfile

    import coremltools as ct

    path = settings.package_path(COMPONENT)
    if skip_existing(path, settings.force):
        return None
    full = encoder_shapes(model, settings.window_seconds, processor)
    buckets = sorted({float(b) for b in bucket_seconds if float(b) != float(settings.window_seconds)})
    too_long = [b for b in buckets if b > settings.window_seconds]
    if too_long:
        raise EncoderInputError(f"bucket(s) {too_long} s are longer than the window ({settings.window_seconds} s)")
    windows = [(None, settings.window_seconds)] + [(bucket_function_name(b), b) for b in buckets]
    shapes_by_fn: dict[str, EncoderShapes] = {}
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".encoder-buckets-", dir=settings.out_dir))
    gate: dict[str, Any] = {"component": COMPONENT, "functions": {}}
    try:
        descriptor = None
        for fn_name, seconds in windows:
            fn = fn_name or "main"
            shapes = encoder_shapes(model, seconds, processor, memory_frames=full.padded_frames)
            shapes_by_fn[fn] = shapes
            logger.info("bucket %s: %s", fn, shapes)
            single = scratch / f"{fn}.mlpackage"
            traced = trace_encoder(model, shapes)
            convert_traced_encoder(traced, shapes, settings.replace(window_seconds=seconds), extra_metadata).save(
                str(single)
            )
            del traced
            if descriptor is None:
                descriptor = ct.utils.MultiFunctionDescriptor()
            descriptor.add_function(str(single), src_function_name="main", target_function_name=fn)
        descriptor.default_function_name = "main"

        buckets_meta = {fn: {"window_seconds": sh.window_seconds, "frames": sh.frames,
                             "encoder_frames": sh.encoder_frames, "padded_frames": sh.padded_frames}
                        for fn, sh in shapes_by_fn.items()}

        def write(tmp: Path):
            merged = scratch / "merged.mlpackage"
            ct.utils.save_multifunction(descriptor, str(merged))
            mlmodel = ct.models.MLModel(str(merged), skip_model_load=True)
            mlmodel.user_defined_metadata["com.cohere_coreml.buckets"] = json.dumps(buckets_meta, sort_keys=True)
            mlmodel.save(str(tmp))

        def verify(tmp: Path):
            if settings.skip_verify:
                gate["skipped"] = True
                return
            for fn, shapes in shapes_by_fn.items():
                cases = gate_inputs(shapes, gate_features(processor, shapes, gate_audio) if processor else None)
                gate["functions"][fn] = run_gate(tmp, model, shapes, settings.replace(window_seconds=shapes.window_seconds),
                                                 cases, function_name=fn)

        try:
            write_package_atomic(write, path, force=settings.force, verify=verify)
        except ParityError as err:
            failed = {"component": COMPONENT, "passed": False, "error": str(err), **gate}
            write_json_atomic(failed, settings.failed_report_path(COMPONENT))
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gate["passed"] = not gate.get("skipped") and all(g["passed"] for g in gate["functions"].values())
    gate["buckets"] = buckets_meta
    write_json_atomic(gate, settings.report_path(COMPONENT))
    settings.failed_report_path(COMPONENT).unlink(missing_ok=True)
    return path


def package_buckets(path) -> dict[str, int]:
    """{function name: mel frames} of an exported encoder package (one entry without buckets)."""
    import coremltools as ct

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    meta = dict(spec.description.metadata.userDefined)
    if "com.cohere_coreml.buckets" in meta:
        return {fn: int(b["frames"]) for fn, b in json.loads(meta["com.cohere_coreml.buckets"]).items()}
    frames = meta.get("com.cohere_coreml.window_frames")
    if frames is None:
        frames = next(tuple(i.type.multiArrayType.shape)[-1] for i in spec.description.input
                      if i.name == "input_features")
    return {"main": int(frames)}


def choose_bucket(buckets: dict[str, int], n_frames: int) -> str:
    """The function with the smallest window that holds `n_frames` valid mel frames."""
    fitting = [(frames, fn) for fn, frames in buckets.items() if frames >= n_frames]
    if not fitting:
        raise EncoderInputError(f"{n_frames} mel frames do not fit any encoder window {sorted(buckets.values())}; "
                                "split the audio first")
    return min(fitting)[1]


# --------------------------------------------------------------------------------------------
# Real speech for the gate
# --------------------------------------------------------------------------------------------


def default_gate_audio(max_clips: int = 2) -> list[Path]:
    """Committed speech clips of the repository (`tests/data/audio`), medium-length ones first."""
    from cohere_coreml.config import REPO_ROOT

    audio_dir = REPO_ROOT / "tests" / "data" / "audio"
    manifest = audio_dir / "manifest.json"
    if not manifest.is_file():
        return []
    data = json.loads(manifest.read_text())
    clips = data["clips"] if isinstance(data, dict) else data
    speech = [c for c in clips if c.get("purpose") == "speech" and (audio_dir / c["file"]).is_file()]
    speech.sort(key=lambda c: (not c["file"].endswith("_medium.wav"), c["file"]))
    return [audio_dir / c["file"] for c in speech[:max_clips]]


def gate_features(processor, shapes: EncoderShapes, audio_paths=None) -> list[np.ndarray]:
    """Log-mel features (M, n) of real speech for the gate (dither 0, like parity work).

    One entry per clip (cut to the window), plus one full window made of the clips' frames
    back to back, so the gate sees both a partial and a full `feature_length`.
    """
    from cohere_coreml.audio import FrontEndConfig, load_audio, log_mel

    paths = list(audio_paths) if audio_paths else default_gate_audio()
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


# --------------------------------------------------------------------------------------------
# Export command (`cohere-coreml export`, `make export`, exports/export_encoder.py)
# --------------------------------------------------------------------------------------------

EXPORT_COMPONENTS = ("encoder", "decoder")


def export_all(
    model_ref: str,
    settings: ExportSettings,
    revision: str | None = None,
    components=EXPORT_COMPONENTS,
    gate_audio=None,
    max_new_tokens: int = 256,
    buckets=(),
    prefill: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint and export the requested components into `settings.out_dir`.

    Encoder first (its window fixes the decoder's memory length). Each component is parity
    gated unless `settings.skip_verify`; a failing gate raises `ParityError` and writes nothing.
    Returns {component: package path or None (skipped: already present)}.
    """
    from cohere_coreml.checkpoint import load_reference

    unknown = sorted(set(components) - set(EXPORT_COMPONENTS))
    if unknown:
        raise ExportError(f"unknown component(s) {unknown}; choose from {EXPORT_COMPONENTS}")
    torch.set_grad_enabled(False)
    model, processor = load_reference(model_ref, revision=revision)
    source = getattr(model, "source", None)
    settings = settings.replace(
        model_id=source.model_id if source is not None else str(model_ref),
        revision=(source.revision if source is not None else revision) or settings.revision,
    )
    shapes = encoder_shapes(model, settings.window_seconds, processor)
    results: dict[str, Any] = {}
    if "encoder" in components:
        clips = None
        if not settings.skip_verify:
            clips = gate_features(processor, shapes, gate_audio)
            if not clips:
                logger.warning("no speech clips found for the encoder gate: using synthetic features")
        if buckets:  # one multifunction package: `main` = full window, `window_<s>s` = shorter buckets
            results["encoder"] = convert_encoder_buckets(model, settings, buckets, processor, gate_audio)
        else:
            results["encoder"] = convert_encoder(model, settings, processor, clips=clips)
    if "decoder" in components:
        # decoder.mlpackage + manifest.json / vocab.json / tokenizer files (cohere_coreml.bundle)
        from cohere_coreml.bundle import export_decoder_bundle

        results["decoder"] = export_decoder_bundle(model, processor, settings, max_new_tokens=max_new_tokens,
                                                   prefill=prefill)
    return results


def add_export_arguments(parser) -> None:
    from cohere_coreml.config import DEFAULT_HUB_ID, DEFAULT_OUT_DIR, DEFAULT_WINDOW_SECONDS

    parser.add_argument("--model", default=DEFAULT_HUB_ID, help="Hugging Face Hub id or local checkpoint folder "
                        f"(default: {DEFAULT_HUB_ID})")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    parser.add_argument("--out", default=str(DEFAULT_OUT_DIR / "export"), help="output folder for the packages")
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                        help="program precision (fp16 ships; fp32 is reference-grade). Gate: >= 35 dB PSNR for "
                        "fp16, >= 60 dB for fp32")
    parser.add_argument("--window-seconds", type=float, default=DEFAULT_WINDOW_SECONDS,
                        help="encoder audio window in seconds (35 s -> 3500 mel frames)")
    parser.add_argument("--deployment-target", default="macOS15", help="coremltools target name (macOS15/iOS18)")
    parser.add_argument("--components", default=",".join(EXPORT_COMPONENTS),
                        help="comma-separated components to export (default: encoder,decoder)")
    parser.add_argument("--gate-audio", nargs="+", default=None,
                        help="speech files for the encoder parity gate (default: the committed test clips)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="new tokens one window can decode; the decoder cache holds round_up(10 + N, 32) "
                        "slots (default: %(default)s, the upstream limit)")
    parser.add_argument("--buckets", type=float, nargs="+", default=(),
                        help="extra shorter encoder windows in seconds (e.g. --buckets 10 20): encoder.mlpackage "
                        "gets one function per window (weights shared, outputs padded to the full window)")
    parser.add_argument("--prefill", action="store_true",
                        help="add a prompt prefill function to decoder.mlpackage (one call for the 10 prompt "
                        "tokens; multifunction package sharing weights and state with the step)")
    parser.add_argument("--force", action="store_true", help="overwrite packages that already exist")
    parser.add_argument("--skip-verify", action="store_true",
                        help="do not run the parity gates (packages are written unchecked)")


def settings_from_args(args) -> ExportSettings:
    return ExportSettings(
        out_dir=Path(args.out),
        precision=args.precision,
        deployment_target=args.deployment_target,
        window_seconds=args.window_seconds,
        force=args.force,
        skip_verify=args.skip_verify,
    )


def cmd_export(args) -> int:
    settings = settings_from_args(args)
    components = tuple(c.strip() for c in args.components.split(",") if c.strip())
    results = export_all(args.model, settings, revision=args.revision, components=components,
                         gate_audio=args.gate_audio, max_new_tokens=args.max_tokens,
                         buckets=tuple(getattr(args, "buckets", ()) or ()), prefill=args.prefill)
    for name, result in results.items():
        path = result.get("path") if isinstance(result, dict) else result
        skipped = not path or (isinstance(result, dict) and result.get("written") is False)
        print(f"{name}: {'exists, skipped (use --force)' if skipped else path}")
        if isinstance(result, dict) and result.get("parity") and "mean_kl" in result["parity"]:
            p = result["parity"]
            print(f"  parity: worst PSNR {p['worst_psnr_db']:.1f} dB, mean KL {p['mean_kl']:.3g}, "
                  f"argmax {p['argmax_agree']}/{p['argmax_steps']} decoding steps")
        if isinstance(result, dict) and result.get("manifest"):
            print(f"  manifest: {result['manifest']}")
    return 0


def add_export_command(subparsers) -> None:
    """Register `cohere-coreml export` (called by cli.py's stage-command hook)."""
    p = subparsers.add_parser(
        "export",
        help="export encoder.mlpackage (+ decoder.mlpackage), parity-gated against PyTorch",
        description="Convert a Cohere Transcribe checkpoint into Core ML packages. Each package is checked "
        "through the project's runtime against PyTorch (PSNR gate); a failing gate exits non-zero and "
        "leaves no package behind. Figures are written next to the package as <component>.parity.json.",
    )
    add_export_arguments(p)
    p.set_defaults(func=cmd_export)
