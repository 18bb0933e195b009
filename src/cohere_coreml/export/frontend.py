"""Front-end export: one window of 16 kHz samples in, exactly the encoder's `input_features` out.

`frontend.mlpackage` computes what `cohere_coreml.model.audio.log_mel` + `pad_to_window` compute, so an
app never reimplements the mel spectrogram (WhisperKit's MelSpectrogram model, FluidAudio's Parakeet
preprocessor do the same):

    audio (1, S) fp32, audio_length (1,) int32                 S = window samples (35 s -> 560000)
    -> samples >= audio_length zeroed
    -> pre-emphasis y[0] = x[0], y[t] = x[t] - p x[t-1]; y zeroed beyond audio_length
    -> centred STFT as conv1d with a windowed DFT basis        (1, 2K, F)  K = n_fft // 2 + 1
       (kernel win_length, stride hop; the symmetric Hann window is folded into the basis)
    -> power |X|^2 (computed as sqrt(re^2 + im^2)^2, the reference's rounding)   (1, K, F)
    -> Slaney mel filters (matmul), log(mel + 2**-24)          (1, n_mels, F)
    -> per-bin normalisation over the valid frames (mean, n-1 std, + 1e-5); padding frames 0
    outputs: input_features (1, n_mels, F) fp32, feature_length (1,) int32   F = S // hop

MIL has no FFT that runs everywhere (the interpreter has no `stft`, and a complex op would not run on
the GPU / Neural Engine), so the STFT is a strided convolution with cos / -sin basis rows: one conv,
one matmul, elementwise ops and two reductions. Everything runs in fp32 (compute units CPU/GPU;
fp16 would cost precision the encoder needs). All sizes come from `audio.FrontEndConfig` (the
checkpoint's feature-extractor config); nothing is hard-coded.

valid frames = (audio_length + 2 * (n_fft // 2) - n_fft) // hop, clamped to [0, F], as `log_mel`.

Sizes (S, F per function) come from `shapes.FrontEndShapes`, one per encoder function of the export
plan (`shapes.export_plan`); the export is the `frontend` component of `cohere_coreml.export.pipeline`, written
and gated through `gate.export_gated`; the bundle manifest's "frontend" section is read back from the
package on disk (`bundle.frontend_package_info`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..config import FRONTEND_FUNCTIONS_METADATA_KEY
from ..model.audio import (
    LOG_ZERO_GUARD,
    NORM_EPSILON,
    AudioError,
    FrontEndConfig,
    load_audio,
    log_mel,
    mel_filters,
    pad_to_window,
    stft_window,
)
from ..model.shapes import FrontEndShapes, ShapeError
from ..storage.files import save_converted, skip_installed, temporary_dir
from .convert import ExportError, ExportSettings, convert_module, merge_functions
from .gate import GateCase, GateLoader, GateReport, StagedPackage, default_gate_audio, stage_gated
from .parity import CorrectnessReport, report_correctness

logger = logging.getLogger(__name__)

COMPONENT = "frontend"
INPUT_NAMES = ("audio", "audio_length")
OUTPUT_NAMES = ("input_features", "feature_length")
# The package computes in fp32, which the Neural Engine does not: it is meant for these units.
COMPUTE_UNITS = "cpu_and_gpu"
PRECISION = "fp32"

# Gate thresholds on the valid frames, against `audio.log_mel` (measured margins: docs/front-end.md).
GATE_MIN_PSNR_DB = 100.0
GATE_MAX_ABS_DIFF = 5e-4


class FrontEndInputError(ShapeError):
    """Audio or settings that do not fit the exported front end."""


# --------------------------------------------------------------------------------------------
# The traced module
# --------------------------------------------------------------------------------------------


def dft_basis(config: FrontEndConfig) -> np.ndarray:
    """(2K, 1, win_length) float32 conv weight: rows k < K are w[n] cos(2 pi k m / n_fft), rows K + k
    are -w[n] sin(2 pi k m / n_fft), with m = n + (n_fft - win_length) // 2 the tap's place in the
    n_fft frame and w the reference's float32 symmetric Hann window (`audio.stft_window`).

    Only the win_length taps where the window is non-zero are kept (torch.stft centres the window
    in n_fft with zeros around it), so the conv does 78 % of the work of a full n_fft kernel.
    """
    n_fft, win = config.n_fft, config.win_length
    bins = n_fft // 2 + 1
    offset = (n_fft - win) // 2
    window = stft_window(config).astype(np.float64)  # (win,)
    m = np.arange(win, dtype=np.int64) + offset
    k = np.arange(bins, dtype=np.int64)
    phase = 2.0 * np.pi * ((k[:, None] * m[None, :]) % n_fft) / n_fft  # exact integer reduction first
    real = window[None, :] * np.cos(phase)  # (K, win)
    imag = -window[None, :] * np.sin(phase)
    return np.concatenate([real, imag], axis=0).astype(np.float32)[:, None, :]


class FrontEndForCoreML(nn.Module):
    """Traceable front end: (audio (1, S), audio_length (1,)) -> (features (1, M, F), feature_length (1,))."""

    def __init__(self, config: FrontEndConfig, shapes: FrontEndShapes):
        super().__init__()
        if config.dither:
            raise FrontEndInputError("the exported front end has no dither (use dither=0, as parity work does)")
        self.config = config
        self.shapes = shapes
        self.register_buffer("basis", torch.from_numpy(dft_basis(config)))  # (2K, 1, win)
        self.register_buffer("mel", torch.from_numpy(np.array(mel_filters(config))))  # (M, K)

    def forward(self, audio: torch.Tensor, audio_length: torch.Tensor):
        c, s = self.config, self.shapes
        bins = c.n_fft // 2 + 1
        # audio: (1, S) float32; audio_length: (1,) int32
        length = audio_length.to(torch.int32).clamp(0, s.samples)  # (1,)
        # sample t = row * hop + col is inside when col < length - row * hop: built from two small
        # index vectors, so the program holds no (S,) index constant (coremltools folds one into the
        # weights for shorter windows)
        rows = -(-s.samples // c.hop_length)
        row_start = torch.arange(rows, dtype=torch.int32) * c.hop_length  # (R,)
        col = torch.arange(c.hop_length, dtype=torch.int32)  # (hop,)
        inside = col[None, :] < (length - row_start)[:, None]  # (R, hop)
        inside = inside.reshape(1, rows * c.hop_length)[:, : s.samples].to(audio.dtype)  # (1, S)
        x = audio * inside
        if c.preemphasis:
            x = torch.cat([x[:, :1], x[:, 1:] - c.preemphasis * x[:, :-1]], dim=1) * inside  # (1, S)

        # centred frames: frame t = padded[t*hop : t*hop + n_fft], padded = n_fft//2 zeros + x + zeros;
        # the window's non-zero taps start (n_fft - win) // 2 into the frame
        half, offset = c.n_fft // 2, (c.n_fft - c.win_length) // 2
        needed = (s.frames - 1) * c.hop_length + c.win_length  # samples the conv reads
        left = half - offset
        right = needed - left - s.samples
        if right >= 0:
            padded = nn.functional.pad(x, (left, right))  # (1, needed)
        else:
            padded = nn.functional.pad(x, (left, 0))[:, :needed]
        spectrum = nn.functional.conv1d(padded[:, None, :], self.basis, stride=c.hop_length)  # (1, 2K, F)
        real, imag = spectrum[:, :bins], spectrum[:, bins:]  # (1, K, F) each
        power = torch.sqrt(real * real + imag * imag)
        power = power * power  # |X|^2 as the reference rounds it (sqrt, then square)
        mel = torch.matmul(self.mel, power)  # (1, M, F)
        features = torch.log(mel + LOG_ZERO_GUARD)

        n_valid = torch.div(length + 2 * half - c.n_fft, c.hop_length, rounding_mode="floor").clamp(0, s.frames)
        frame_ids = torch.arange(s.frames, dtype=torch.int32)  # (F,)
        valid = (frame_ids[None, :] < n_valid[:, None]).to(features.dtype)[:, None, :]  # (1, 1, F)
        count = n_valid.to(features.dtype).clamp(min=1.0)[:, None, None]  # (1, 1, 1)
        masked = features * valid
        mean = masked.sum(dim=2, keepdim=True) / count  # (1, M, 1)
        variance = ((masked - mean) ** 2 * valid).sum(dim=2, keepdim=True) / (count - 1.0).clamp(min=1.0)
        std = torch.sqrt(variance)
        out = (features - mean) / (std + NORM_EPSILON) * valid  # (1, M, F)
        return out, n_valid.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Reference (what the package must produce) and window input
# --------------------------------------------------------------------------------------------


def window_input(waveform: np.ndarray, shapes: FrontEndShapes) -> dict[str, np.ndarray]:
    """The package inputs for one clip: samples zero-padded to the window, and the valid count.

    Raises `AudioError` for a clip longer than the window (split it first).
    """
    x = np.asarray(waveform, dtype=np.float32).reshape(-1)
    if x.shape[0] > shapes.samples:
        raise AudioError(
            f"clip has {x.shape[0]} samples but the front-end window holds {shapes.samples} "
            f"({shapes.window_seconds:g} s): split it with split_long_audio"
        )
    audio = np.zeros((1, shapes.samples), dtype=np.float32)
    audio[0, : x.shape[0]] = x
    return {"audio": audio, "audio_length": np.array([x.shape[0]], dtype=np.int32)}


def reference_outputs(waveform: np.ndarray, config: FrontEndConfig, shapes: FrontEndShapes) -> dict[str, np.ndarray]:
    """`audio.log_mel` + `pad_to_window`: (1, M, F) features and the valid count, as the package's outputs."""
    features, n_valid = log_mel(waveform, config)
    window, n_valid = pad_to_window(features, n_valid, frames=shapes.frames)
    return {"input_features": window[None], "feature_length": np.array([n_valid], dtype=np.int32)}


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def trace_frontend(config: FrontEndConfig, shapes: FrontEndShapes, module_cls=FrontEndForCoreML):
    module = module_cls(config, shapes).eval()
    example = (torch.zeros(1, shapes.samples, dtype=torch.float32),
               torch.tensor([shapes.samples // 2], dtype=torch.int32))
    with torch.no_grad():
        return torch.jit.trace(module, example, check_trace=False, strict=False)


def describe_io(shapes: FrontEndShapes) -> dict[str, str]:
    s = shapes
    return {
        "audio": f"float32 (1, {s.samples}): {s.window_seconds:g} s of {s.sample_rate} Hz mono samples; samples "
        ">= audio_length are zero padding (ignored)",
        "audio_length": f"int32 (1,): number of valid samples, 0..{s.samples}",
        "input_features": f"float32 (1, {s.n_mels}, {s.frames}): normalised log-mel features (the encoder's "
        "input_features); frames >= feature_length are zero",
        "feature_length": "int32 (1,): valid mel frames = (audio_length + 2 * (n_fft // 2) - n_fft) // hop "
        "(the encoder's feature_length)",
    }


def convert_traced_frontend(traced, config: FrontEndConfig, shapes: FrontEndShapes, settings: ExportSettings):
    """ML program of the traced front end, fp32 compute precision, with metadata."""
    import coremltools as ct  # heavy: the PyTorch side (gates, tests) needs none

    s = shapes
    inputs = [ct.TensorType(name="audio", shape=(1, s.samples), dtype=np.float32),
              ct.TensorType(name="audio_length", shape=(1,), dtype=np.int32)]
    outputs = [ct.TensorType(name=name) for name in OUTPUT_NAMES]
    metadata = {
        "com.cohere_coreml.component": COMPONENT,
        "com.cohere_coreml.sample_rate": s.sample_rate,
        "com.cohere_coreml.hop_length": s.hop_length,
        "com.cohere_coreml.window_samples": s.samples,
        "com.cohere_coreml.window_frames": s.frames,
        "com.cohere_coreml.compute_units": COMPUTE_UNITS,
        "com.cohere_coreml.front_end": config.to_dict(),
        "com.cohere_coreml.shapes": s.to_dict(),
        "com.cohere_coreml.io": describe_io(s),
    }
    mlmodel = convert_module(
        traced, inputs, outputs, settings.replace(precision="fp32", window_seconds=s.window_seconds),
        metadata=metadata, descriptions=describe_io(s),
        short_description=f"Cohere Transcribe audio front end: {s.window_seconds:g} s of samples -> normalised "
        "log-mel features of the encoder",
        compute_precision=ct.precision.FLOAT32,
    )
    from coremltools.proto import FeatureTypes_pb2 as ft  # heavy: the PyTorch side (gates, tests) needs none

    for out in mlmodel.get_spec().description.output:
        if out.name == "feature_length" and out.type.multiArrayType.dataType != ft.ArrayFeatureType.INT32:
            raise ExportError("feature_length is not int32 in the converted front end")
    return mlmodel


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------

# Budgets per kind of case (max |diff| on valid frames, min PSNR in dB), against `audio.log_mel`.
# "signal": audio with energy in every mel bin's frames. "ill_conditioned": near-silence and digital
# silence, where the reference's own float32 rounding of log(mel + 2**-24) (1 ulp = 1.9e-6 at -16.6),
# divided by a per-bin std near 1e-5, moves its output by tenths vs exact arithmetic (docs/front-end.md);
# any other float32 implementation differs from it by that much there.
GATE_BUDGETS = {
    "signal": {"max_abs_diff": GATE_MAX_ABS_DIFF, "min_psnr_db": GATE_MIN_PSNR_DB},
    "ill_conditioned": {"max_abs_diff": 0.5, "min_psnr_db": 30.0},
}


def gate_case(name: str, waveform: np.ndarray, config: FrontEndConfig, shapes: FrontEndShapes,
              kind: str = "signal") -> GateCase:
    """One gate case: the package inputs of `waveform` and `log_mel`'s outputs for it."""
    if kind not in GATE_BUDGETS:
        raise ValueError(f"unknown gate case kind {kind!r}; choose from {sorted(GATE_BUDGETS)}")
    return GateCase(inputs=window_input(waveform, shapes), reference=reference_outputs(waveform, config, shapes),
                    info={"case": name, "kind": kind, "samples": int(np.asarray(waveform).reshape(-1).shape[0])})


def gate_cases(config: FrontEndConfig, shapes: FrontEndShapes, audio_paths=None) -> list[GateCase]:
    """Speech clips, near-silence, digital silence, a 0.05 s clip and a full window, fitting `shapes`.

    Speech: `audio_paths` or the gate audio shipped with the package (`gate.default_gate_audio`);
    without any, a seeded synthetic voiced signal. Near-silence: the first speech clip scaled to a peak
    of 1e-4, the quietest audio `check_speech` accepts for transcription.
    """
    sr = config.sampling_rate
    paths = list(audio_paths) if audio_paths is not None else default_gate_audio()
    speech = [(Path(p).name, load_audio(p, target_rate=sr)) for p in paths]
    if not speech:
        rng = np.random.default_rng(0)
        t = np.arange(3 * sr) / sr
        wave = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size)
        speech = [("synthetic_voiced", wave.astype(np.float32))]
    cases = [gate_case(name, wav[: shapes.samples], config, shapes) for name, wav in speech]
    first = speech[0][1][: shapes.samples]
    quiet = (first * (1e-4 / max(float(np.abs(first).max()), 1e-30))).astype(np.float32)
    cases.append(gate_case("near_silence", quiet, config, shapes, "ill_conditioned"))
    cases.append(gate_case("digital_silence", np.zeros(min(2 * sr, shapes.samples), dtype=np.float32), config,
                           shapes, "ill_conditioned"))
    short = int(round(0.05 * sr))
    cases.append(gate_case("clip_0.05s", first[:short] if first.shape[0] >= short else np.resize(first, short),
                           config, shapes))
    joined = np.concatenate([w for _, w in speech])
    cases.append(gate_case("full_window", np.resize(joined, shapes.samples).astype(np.float32), config, shapes))
    return cases


def check_case(reference: Mapping, produced: Mapping, kind: str = "signal") -> CorrectnessReport:
    """The gate's figures for one case: PSNR and max |diff| of the valid frames, valid-frame count
    equal, padding frames exactly zero (the padding is compared as its own exact output)."""
    if kind not in GATE_BUDGETS:
        raise ValueError(f"unknown gate case kind {kind!r}; choose from {sorted(GATE_BUDGETS)}")
    budget = GATE_BUDGETS[kind]
    ref = np.asarray(reference["input_features"], dtype=np.float32)  # (1, M, F)
    out = np.asarray(produced.get("input_features", np.zeros(0)), dtype=np.float32)
    n = int(np.asarray(reference["feature_length"]).reshape(-1)[0])
    if out.size == ref.size:
        out = out.reshape(ref.shape)
    ref_parts = {"input_features": ref[..., :n], "padding_frames": np.zeros_like(ref[..., n:]),
                 "feature_length": np.asarray(reference["feature_length"], dtype=np.int32).reshape(1)}
    out_parts = {"feature_length": np.asarray(produced.get("feature_length", [-1])).astype(np.int64).reshape(-1)}
    if out.shape == ref.shape:
        out_parts.update({"input_features": out[..., :n], "padding_frames": out[..., n:]})
    report = report_correctness(ref_parts, out_parts, budget["min_psnr_db"], exact=("feature_length", "padding_frames"))
    for check in report.outputs:
        if check.name == "input_features" and check.passed and check.max_abs_err > budget["max_abs_diff"]:
            check.passed = False
            check.problem = f"max |diff| {check.max_abs_err:.3g} > {budget['max_abs_diff']:g}"
    report.extra.update({"kind": kind, "max_abs_diff_budget": budget["max_abs_diff"], "feature_length": n})
    return report


def run_gate(package: str | Path, cases: Sequence[GateCase], function_name: str | None = None,
             units: str = "auto", loader: GateLoader | None = None) -> GateReport:
    """Run every case through the package (on `units`, or with `loader`: `gate.GateLoader`), compare with
    `log_mel` (`check_case`, the budget of the case's kind) and return the `GateReport` of all cases."""
    if not cases:
        raise ValueError(f"{COMPONENT} gate has no cases")
    if loader is None:
        with GateLoader(units, Path(package).parent) as own:
            return run_gate(package, cases, function_name, loader=own)
    loaded = loader.load(package, function_name)
    where = f" function {function_name}" if function_name else ""
    results, texts = [], []
    for case in cases:
        kind = case.info["kind"]
        t0 = time.perf_counter()
        produced = loaded.predict(case.inputs)
        seconds = time.perf_counter() - t0
        report = check_case(case.reference, produced, kind)
        report.extra.update({**case.info, "predict_seconds": round(seconds, 4)})
        texts.append(f"[{COMPONENT} gate]{where} {case.info['case']} ({kind}, {report.extra['feature_length']} "
                     f"frames)\n{report.summary()}")
        logger.debug("%s", texts[-1])  # also in frontend.parity.json ("cases")
        results.append(report)
    parts, worst = [], {}
    for kind, budget in GATE_BUDGETS.items():
        checks = [next(o for o in r.outputs if o.name == "input_features") for r in results if r.extra["kind"] == kind]
        if checks:
            diff, low = max(c.max_abs_err for c in checks), min(c.psnr_db for c in checks)
            worst[kind] = {"max_abs_diff": diff, "psnr_db": low if math.isfinite(low) else str(low), "cases": len(checks)}
            parts.append(f"{kind}: max |diff| {diff:.2e} (<= {budget['max_abs_diff']:g}), PSNR >= {low:.1f} dB "
                         f"(need {budget['min_psnr_db']:g}) over {len(checks)} case(s)")
    refused = [r.extra["case"] for r in results if not r.passed]
    if refused:
        parts.append(f"refused: {', '.join(map(str, refused))}")
    return GateReport(
        component=COMPONENT,
        passed=all(r.passed for r in results),
        headline="; ".join(parts),
        details={"package": f"{COMPONENT}.mlpackage", "function": function_name or "main", "precision": PRECISION,
                 "compute_units": COMPUTE_UNITS, "budgets": GATE_BUDGETS, "worst": worst,
                 "backend": type(loaded).__name__, "runs_on": loader.describe(package)},
        cases=[r.to_dict() for r in results],
        text="\n".join(texts),
    )


# --------------------------------------------------------------------------------------------
# Export: one function per encoder window (length buckets), gated, written atomically
# --------------------------------------------------------------------------------------------


def convert_frontend(config: FrontEndConfig, settings: ExportSettings, shapes_by_fn: Mapping[str, FrontEndShapes],
                     gate_audio=None, _module_cls=FrontEndForCoreML) -> Path | None:
    """Export `frontend.mlpackage` into `settings.out_dir`, parity-gated against `audio.log_mel`.

    `shapes_by_fn`: {function: FrontEndShapes}, the export plan's (`shapes.ExportPlan.frontend`):
    `main` = the full window, a `window_<s>s` per encoder bucket; one function -> a single-function
    package. Returns the path, or None when it exists and `settings.force` is off. A failing gate
    raises `ParityError`, writes `frontend.parity-failed.json` and leaves no package behind
    (`gate.export_gated`). `_module_cls` is for tests that deliberately break the front end.
    """
    staged = stage_frontend(config, settings, shapes_by_fn, gate_audio, _module_cls)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_frontend(config: FrontEndConfig, settings: ExportSettings, shapes_by_fn: Mapping[str, FrontEndShapes],
                   gate_audio=None, _module_cls=FrontEndForCoreML) -> StagedPackage | None:
    """`convert_frontend` up to the gate: the package at its temporary path (converted inside the
    writer) and the gate's reference cases computed; `finish()` gates and installs it."""
    import coremltools as ct  # heavy: the PyTorch side (gates, tests) needs none

    if "main" not in shapes_by_fn:
        raise FrontEndInputError(f"front-end functions {sorted(shapes_by_fn)} have no 'main' (the full window)")
    if config.dither:
        config = FrontEndConfig.from_dict({**config.to_dict(), "dither": 0.0})
    if skip_installed(settings, COMPONENT):
        return None
    functions_meta = {fn: {"window_seconds": sh.window_seconds, "samples": sh.samples, "frames": sh.frames}
                      for fn, sh in shapes_by_fn.items()}
    settings.out_dir.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path):
        scratch = temporary_dir(settings.out_dir, "frontend")
        try:
            singles = {}
            for fn, shapes in shapes_by_fn.items():
                t0 = time.perf_counter()
                mlmodel = convert_traced_frontend(trace_frontend(config, shapes, _module_cls), config, shapes, settings)
                singles[fn] = scratch / f"{fn}.mlpackage"
                save_converted(mlmodel, singles[fn])
                logger.debug("front end %s (%d samples -> %d frames) converted in %.1f s", fn, shapes.samples,
                            shapes.frames, time.perf_counter() - t0)
            if len(singles) == 1:
                mlmodel = ct.models.MLModel(str(singles["main"]), skip_model_load=True)
            else:
                mlmodel = merge_functions(singles, "main", scratch)
                main = ct.models.MLModel(str(singles["main"]), skip_model_load=True)  # merging drops metadata
                mlmodel.user_defined_metadata.update(dict(main.user_defined_metadata))
                mlmodel.author, mlmodel.license, mlmodel.version = main.author, main.license, main.version
                mlmodel.short_description = main.short_description
            mlmodel.user_defined_metadata[FRONTEND_FUNCTIONS_METADATA_KEY] = json.dumps(functions_meta, sort_keys=True)
            mlmodel.save(str(tmp))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def prepare():
        cases = {fn: gate_cases(config, shapes, gate_audio) for fn, shapes in shapes_by_fn.items()}

        def gate(tmp: Path) -> GateReport:
            with GateLoader(settings.gate_units, tmp.parent) as loader:
                reports = {fn: run_gate(tmp, cases[fn], function_name=fn, loader=loader) for fn in shapes_by_fn}
            if len(reports) == 1:
                report = reports["main"]
                report.details["windows"] = functions_meta
                return report
            return GateReport.of_functions(COMPONENT, reports, windows=functions_meta, precision=PRECISION,
                                           compute_units=COMPUTE_UNITS, budgets=GATE_BUDGETS)

        return gate

    return stage_gated(COMPONENT, settings, write, prepare, installed=lambda: False)  # checked above
