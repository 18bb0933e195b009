"""Voice-activity export: `vad.mlpackage`, Silero VAD's 16 kHz network (`model.silero.SileroVad`, the
weights of the pinned `silero-vad` package) as a multifunction package, gated against the package's own
model.

    block (default)  frames (N, 576) f32, h (1, 128) f32, c (1, 128) f32 -> probability (1, N) f32,
                     h_out (1, 128) f32, c_out (1, 128) f32          N = BLOCK_CHUNKS consecutive chunks
    chunk            the same with N = 1 (the stream: one 32 ms chunk a call)

Row i of `frames` is the 64 samples before chunk i and chunk i's 512 samples (`silero.chunk_frames`).
The LSTM state is an explicit input and output, not a Core ML state: it is 2 x 128 floats copied in and
out per call; it runs on every OS the other packages run on, needs no per-thread state object, and the
interpreter and the Swift loop treat it as plain arrays. Both functions share their weights (one
`merge_functions`). The program computes in fp32 whatever the bundle's precision (`VAD_PRECISION`), as
the front end does: its inputs and outputs are float32.

The traced module computes what `SileroVad` computes, in ops the converter and the Neural Engine take:
the STFT as a matmul over 256-sample windows (not a 256-wide convolution), and the LSTM cell written out
as matrix products and slices (coremltools has no conversion of `aten::lstm_cell`'s `unsafe_chunk`): the
input projection of all N rows is one matmul, then one recurrent step per row, unrolled (N is static).

The weights come from `silero.load_weights` (the package's ONNX file, the tensors of its TorchScript
model), never from the package's safetensors file, which holds another checkpoint.

Gate (`run_gate`): on speech clips (the export's gate audio) and two synthetic signals (digital
silence, white noise), the package's probabilities per chunk (the `block` function over the whole
signal, and the `chunk` function pushed chunk by chunk as a stream) against `silero.reference_probabilities`
(the package's own model): max |diff| within `MAX_ABS_DIFF[precision]`, and the speech segments
`get_speech_timestamps_from_probs` gives from them identical to the oracle's.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION, VAD_METADATA_KEY, VAD_REQUEST_METADATA_KEY
from ..inference.vad import PackageVad
from ..model import silero
from ..model.audio import load_audio
from ..storage.files import save_converted, temporary_dir
from .convert import ExportSettings, convert_module, merge_functions
from .gate import GateLoader, GateReport, StagedPackage, default_gate_audio, stage_gated

logger = logging.getLogger(__name__)

COMPONENT = "vad"
# Chunks per `block` call. The interpreter's time per second of audio hardly moves with N (each chunk's
# recurrent step costs the same, whatever the call), while conversion time and program size grow with N
# (the steps are unrolled) and a signal's last call computes up to N - 1 padding rows; Core ML's per-call
# overhead asks for a few calls per second of audio at most. 32 chunks (1.024 s) a call balances these.
BLOCK_CHUNKS = 32
OUTPUT_NAMES = ("probability", "h_out", "c_out")
# the units it is meant for: small convolutions and a recurrent cell (the manifest's compute_units)
COMPUTE_UNITS = "cpu_and_gpu"
# The program's precision, whatever the export's --precision. An fp16 program's error (up to a few hundredths
# per chunk) moves speech boundaries wherever a probability lies near the 0.5 / 0.35 thresholds, so its
# segments would differ from silero-vad's; the network is small enough for the CPU (fp32 programs run on the
# GPU or CPU, coremltools docs 'Typed Execution'). BENCHMARKS.md, "Voice activity", measures both.
VAD_PRECISION = "fp32"
# max |probability diff| per chunk vs the package's model, per program precision: a few times what each
# program gives on the committed clips (docs/export.md), far below what a perturbed weight or a lost state
# gives (the negative controls of the tests), and inside the margin the 0.5 / 0.35 thresholds leave
MAX_ABS_DIFF = {"fp16": 0.05, "fp32": 1e-4}


def vad_request(settings: ExportSettings, chunks: int = BLOCK_CHUNKS) -> str:
    """What an export asks of vad.mlpackage (recorded in its metadata): the weights' sha256, N, precision.
    A present package recorded with another request is exported again."""
    return f"sha256={silero.source_record()['sha256']};chunks={int(chunks)};precision={settings.precision}"


# --------------------------------------------------------------------------------------------
# The traced module
# --------------------------------------------------------------------------------------------


class VadForCoreML(torch.nn.Module):
    """`SileroVad` for tracing: (frames (N, 576), h (1, 128), c (1, 128)) -> (probability (1, N), h, c)."""

    def __init__(self, vad: silero.SileroVad, carry_state: bool = True):
        super().__init__()
        self.vad = vad
        self.carry_state = carry_state  # False: every call from a zero state (a gate's negative control)

    def features(self, frames):
        """`SileroVad.features` with the STFT as a matmul over 256-sample windows (hop 128) instead of a
        256-wide strided convolution: the Neural Engine caps a convolution's kernel width far below 256."""
        vad, hop = self.vad, 128
        x = torch.nn.functional.pad(frames.unsqueeze(1), (0, silero.CONTEXT_SAMPLES), mode="reflect")  # (N, 1, 640)
        blocks = x.reshape(frames.shape[0], -1, hop)  # (N, 5, 128)
        windows = torch.cat([blocks[:, :-1], blocks[:, 1:]], dim=2)  # (N, 4, 256): window j = samples 128j ...
        spectrum = torch.matmul(windows, vad.stft_basis.squeeze(1).t())  # (N, 4, 258)
        bins = spectrum.shape[-1] // 2
        x = torch.sqrt(spectrum[..., :bins] ** 2 + spectrum[..., bins:] ** 2).transpose(1, 2)  # (N, 129, 4)
        for conv in (vad.conv1, vad.conv2, vad.conv3, vad.conv4):
            x = torch.relu(conv(x))
        return x.squeeze(-1)

    def forward(self, frames, h, c):
        vad, hidden = self.vad, silero.HIDDEN
        if not self.carry_state:
            h, c = h * 0.0, c * 0.0
        feats = self.features(frames)  # (N, 128)
        lstm = vad.lstm
        inputs = torch.nn.functional.linear(feats, lstm.weight_ih, lstm.bias_ih + lstm.bias_hh)  # (N, 4H)
        hs = []
        for i in range(feats.shape[0]):  # PyTorch's gate order: input, forget, cell, output
            g = inputs[i : i + 1] + torch.nn.functional.linear(h, lstm.weight_hh)
            c = torch.sigmoid(g[:, hidden : 2 * hidden]) * c + torch.sigmoid(g[:, :hidden]) * torch.tanh(
                g[:, 2 * hidden : 3 * hidden])
            h = torch.sigmoid(g[:, 3 * hidden :]) * torch.tanh(c)
            hs.append(h)
        out = torch.relu(torch.cat(hs, dim=0))  # (N, H)
        probs = torch.sigmoid(torch.nn.functional.linear(out, vad.out.weight.reshape(1, hidden), vad.out.bias))
        return probs.reshape(1, -1), h, c


def trace_vad(chunks: int, vad: silero.SileroVad | None = None, carry_state: bool = True):
    module = VadForCoreML(vad or silero.SileroVad.from_package(), carry_state).eval()
    example = (torch.zeros(chunks, silero.FRAME_SAMPLES), torch.zeros(1, silero.HIDDEN), torch.zeros(1, silero.HIDDEN))
    with torch.no_grad():
        return torch.jit.trace(module, example, check_trace=False, strict=False)


def describe_io(chunks: int) -> dict[str, str]:
    n, f, hid = chunks, silero.FRAME_SAMPLES, silero.HIDDEN
    return {
        "frames": f"float32 ({n}, {f}): {n} consecutive chunks, row i = the {silero.CONTEXT_SAMPLES} samples "
        f"before chunk i then its {silero.CHUNK_SAMPLES} samples (16 kHz mono; zeros before the audio)",
        "h": f"float32 (1, {hid}): LSTM hidden state before the first row (zeros at a signal's start)",
        "c": f"float32 (1, {hid}): LSTM cell state before the first row (zeros at a signal's start)",
        "probability": f"float32 (1, {n}): speech probability of each row's chunk",
        "h_out": f"float32 (1, {hid}): hidden state after the last row (the next call's h)",
        "c_out": f"float32 (1, {hid}): cell state after the last row (the next call's c)",
    }


def package_record(settings: ExportSettings, chunks: int) -> dict:
    """What vad.mlpackage's metadata records (the manifest's `vad` entry, without io and parity)."""
    return {"model": "silero-vad", "source": silero.source_record(), "sample_rate": silero.SAMPLE_RATE,
            "chunk_samples": silero.CHUNK_SAMPLES, "context_samples": silero.CONTEXT_SAMPLES,
            "hidden": silero.HIDDEN, "precision": settings.precision, "compute_units": COMPUTE_UNITS,
            "functions": {VAD_BLOCK_FUNCTION: {"chunks": int(chunks)}, VAD_CHUNK_FUNCTION: {"chunks": 1}}}


def convert_traced_vad(traced, chunks: int, settings: ExportSettings):
    import coremltools as ct  # heavy: the PyTorch side needs none

    inputs = [ct.TensorType(name="frames", shape=(chunks, silero.FRAME_SAMPLES), dtype=np.float32),
              ct.TensorType(name="h", shape=(1, silero.HIDDEN), dtype=np.float32),
              ct.TensorType(name="c", shape=(1, silero.HIDDEN), dtype=np.float32)]
    outputs = [ct.TensorType(name=name, dtype=np.float32) for name in OUTPUT_NAMES]
    return convert_module(traced, inputs, outputs, settings, metadata={"com.cohere_coreml.component": COMPONENT},
                          descriptions=describe_io(chunks),
                          short_description=f"Silero VAD (16 kHz): speech probability of {chunks} chunk(s) of "
                          f"{silero.CHUNK_SAMPLES} samples, LSTM state in and out")


def write_vad(tmp: Path, settings: ExportSettings, chunks: int = BLOCK_CHUNKS, vad: silero.SileroVad | None = None,
              carry_state: bool = True) -> None:
    """Convert the `block` (N = `chunks`) and `chunk` functions and save them merged as one package at `tmp`."""
    import coremltools as ct  # heavy: the PyTorch side needs none

    vad = vad or silero.SileroVad.from_package()
    scratch = temporary_dir(settings.out_dir, COMPONENT)
    try:
        singles = {}
        for fn, rows in ((VAD_BLOCK_FUNCTION, chunks), (VAD_CHUNK_FUNCTION, 1)):
            singles[fn] = scratch / f"{fn}.mlpackage"
            save_converted(convert_traced_vad(trace_vad(rows, vad, carry_state), rows, settings), singles[fn])
        mlmodel = merge_functions(singles, VAD_BLOCK_FUNCTION, scratch)
        block = ct.models.MLModel(str(singles[VAD_BLOCK_FUNCTION]), skip_model_load=True)  # merging drops metadata
        mlmodel.user_defined_metadata.update(dict(block.user_defined_metadata))
        mlmodel.author, mlmodel.license, mlmodel.version = block.author, block.license, block.version
        mlmodel.short_description = (f"Silero VAD (16 kHz), {silero.PACKAGE} {silero.package_version()}: speech "
                                     f"probability per {silero.CHUNK_SAMPLES}-sample chunk; functions "
                                     f"{VAD_BLOCK_FUNCTION} ({chunks} chunks) and {VAD_CHUNK_FUNCTION} (1)")
        mlmodel.user_defined_metadata[VAD_METADATA_KEY] = json.dumps(package_record(settings, chunks), sort_keys=True)
        mlmodel.user_defined_metadata[VAD_REQUEST_METADATA_KEY] = vad_request(settings, chunks)
        mlmodel.save(str(tmp))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------


def gate_signals(audio_paths=None) -> list[tuple[str, np.ndarray]]:
    """(name, 16 kHz samples): the speech clips (`audio_paths`, default the gate audio shipped with the
    package), 2 s of digital silence and 3 s of seeded white noise at -30 dBFS RMS."""
    paths = list(audio_paths) if audio_paths is not None else default_gate_audio()
    signals = [(Path(p).name, load_audio(p, target_rate=silero.SAMPLE_RATE)) for p in paths]
    rng = np.random.default_rng(0)
    signals.append(("digital_silence", np.zeros(2 * silero.SAMPLE_RATE, np.float32)))
    signals.append(("white_noise", (10 ** (-30 / 20) * rng.standard_normal(3 * silero.SAMPLE_RATE)).astype(np.float32)))
    return signals


def gate_references(signals) -> list[dict]:
    """The oracle per signal: the package model's probabilities and its speech segments."""
    cases = []
    for name, wav in signals:
        probs = silero.reference_probabilities(wav)
        cases.append({"case": name, "wav": np.asarray(wav, np.float32), "probs": probs,
                      "segments": silero.reference_regions(probs, wav.size)})
    return cases


def run_gate(vad: PackageVad, cases: Sequence[dict], precision: str, chunks: int, runs_on: str = "") -> GateReport:
    """The package's probabilities (block over the whole signal; chunk as a stream) vs the oracle's."""
    bound = MAX_ABS_DIFF[precision]
    results, texts = [], []
    for case in cases:
        wav, ref = case["wav"], case["probs"]
        t0 = time.perf_counter()
        whole = vad.probabilities(wav)
        seconds = time.perf_counter() - t0
        padded = np.zeros(ref.size * silero.CHUNK_SAMPLES, np.float32)
        padded[: wav.size] = wav
        streamed = vad.stream().push(padded)
        row = {"case": case["case"], "chunks": int(ref.size), "block_seconds": round(seconds, 3),
               "segments": len(case["segments"])}
        for fn, probs in ((VAD_BLOCK_FUNCTION, whole), (VAD_CHUNK_FUNCTION, streamed)):
            same_size = probs.shape == ref.shape
            diff = float(np.abs(probs - ref).max()) if same_size and ref.size else (0.0 if same_size else float("inf"))
            same = same_size and silero.reference_regions(probs, wav.size) == case["segments"]
            row[fn] = {"max_abs_diff": diff, "segments_identical": bool(same)}
        row["passed"] = all(row[fn]["max_abs_diff"] <= bound and row[fn]["segments_identical"]
                            for fn in (VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION))
        texts.append(f"[{COMPONENT} gate] {row['case']}: {row['chunks']} chunks, block max |diff| "
                     f"{row[VAD_BLOCK_FUNCTION]['max_abs_diff']:.2e}, chunk {row[VAD_CHUNK_FUNCTION]['max_abs_diff']:.2e}"
                     f", segments {'identical' if row[VAD_BLOCK_FUNCTION]['segments_identical'] else 'DIFFER'} "
                     f"({row['segments']})")
        logger.debug("%s", texts[-1])
        results.append(row)
    worst = max((r[fn]["max_abs_diff"] for r in results for fn in (VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION)),
                default=float("inf"))
    identical = bool(results) and all(r[fn]["segments_identical"] for r in results
                                      for fn in (VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION))
    refused = [r["case"] for r in results if not r["passed"]]
    headline = (f"max |diff| {worst:.2e} (<= {bound:g}) over {sum(r['chunks'] for r in results)} chunks of "
                f"{len(results)} signal(s), speech segments {'identical' if identical else 'DIFFER'}"
                + (f"; refused: {', '.join(refused)}" if refused else ""))
    parity = {"oracle": f"{silero.PACKAGE} {silero.package_version()} load_silero_vad()",
              "clips": [r["case"] for r in results], "chunks": sum(r["chunks"] for r in results),
              "max_abs_diff": worst, "max_abs_diff_bound": bound, "segments_identical": identical,
              "segments": sum(r["segments"] for r in results)}
    return GateReport(component=COMPONENT, passed=bool(results) and not refused, headline=headline,
                      details={"package": f"{COMPONENT}.mlpackage", "precision": precision, "chunks": int(chunks),
                               "compute_units": COMPUTE_UNITS, "parity": parity, "runs_on": runs_on},
                      cases=results, text="\n".join(texts))


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def convert_vad(settings: ExportSettings, gate_audio=None, chunks: int = BLOCK_CHUNKS,
                precision: str = VAD_PRECISION) -> Path | None:
    """Export `vad.mlpackage` into `settings.out_dir`, parity-gated against the silero-vad package's model.

    Returns the path, or None when it exists, is current and `settings.force` is off. A failing gate raises
    `ParityError`, writes `vad.parity-failed.json` and leaves no package behind (`gate.stage_gated`)."""
    staged = stage_vad(settings, gate_audio, chunks, precision=precision)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_vad(settings: ExportSettings, gate_audio=None, chunks: int = BLOCK_CHUNKS,
              _vad: silero.SileroVad | None = None, _carry_state: bool = True,
              precision: str = VAD_PRECISION) -> StagedPackage | None:
    """`convert_vad` up to the gate: the package at its temporary path and the oracle's references computed;
    `finish()` gates and installs it. A present package exported for another `vad_request` (weights, N,
    precision) is exported again. `precision`: the program's (`VAD_PRECISION`; the export's --precision does
    not apply). `_vad` / `_carry_state` are for tests that break the package on purpose."""
    from ..bundle.packages import package_metadata
    from ..storage.files import skip_installed

    if int(chunks) < 1:
        raise ValueError(f"the VAD block needs at least 1 chunk, got {chunks}")
    if precision not in MAX_ABS_DIFF:
        raise ValueError(f"the VAD program's precision must be one of {', '.join(MAX_ABS_DIFF)}, got {precision!r}")
    # the VAD's source is the silero-vad package, not the export's checkpoint (a new checkpoint leaves it current)
    settings = settings.replace(checkpoint_digest=None, model_id=silero.PACKAGE, revision=silero.package_version(),
                                license="MIT", precision=precision)
    path = settings.package_path(COMPONENT)
    if path.exists() and not settings.force:
        recorded = package_metadata(path).get(VAD_REQUEST_METADATA_KEY)
        if recorded != vad_request(settings, chunks):
            logger.warning("%s: exported for %r, this export asks for %r: exporting it again", path,
                           recorded or "an unrecorded request", vad_request(settings, chunks))
            settings = settings.replace(force=True)
    if skip_installed(settings, COMPONENT):
        return None
    settings.out_dir.mkdir(parents=True, exist_ok=True)

    def prepare():
        cases = gate_references(gate_signals(gate_audio))

        def gate(tmp: Path) -> GateReport:
            with GateLoader(settings.gate_units, tmp.parent) as loader:
                vad = PackageVad(loader.load(tmp, VAD_BLOCK_FUNCTION), loader.load(tmp, VAD_CHUNK_FUNCTION), chunks)
                return run_gate(vad, cases, settings.precision, chunks, loader.describe(tmp))

        return gate

    return stage_gated(COMPONENT, settings, lambda tmp: write_vad(tmp, settings, chunks, _vad, _carry_state), prepare,
                       installed=lambda: False)  # checked above
