"""`cohere-coreml export`: a checkpoint in, parity-gated Core ML packages and a bundle out.

The pipeline, in order:

    checkpoint.load_reference          the transformers model + processor
    shapes.export_plan                 every static shape (window, memory length, cache, buckets)
    stage_export                       for each requested component, its module converts it to a
                                       temporary package and computes its gate's PyTorch references
                                       (gate.stage_gated); then the model can be freed
    StagedExport.finish                each package is gated (loaded through the runtime) and renamed
                                       into place only when its gate passes (<component>.parity.json)
    ane_check.write_report             ane_check.json: the static Neural Engine census of the packages (docs/ane.md)
    bundle.write_bundle                last: manifest.json from the packages on disk + tokenizer

The PyTorch model and the gates' copies of the packages are never in memory together
(`export_checkpoint` frees the model between the two halves): the peak is the larger of the two.

Components (`COMPONENTS`) know nothing of each other or of the bundle: each receives the
`ExportJob` (model, processor, settings, plan, gate audio, options) and returns its staged package
(`gate.StagedPackage`) or None (skipped: already present). Adding a component (like the front end, or a quantized variant)
is one `Component` entry here plus its module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bundle import ane_check
from ..bundle.manifest import write_bundle
from ..bundle.packages import decoder_package_info, package_metadata
from ..config import (
    ALIGN_REQUEST_METADATA_KEY,
    CONTROL_LANGUAGE,
    DECODER_BATCH_DEFAULT,
    DECODER_STATE_DEFAULT,
    DECODER_STATE_HOST,
    DECODER_STATES,
    DEFAULT_HUB_ID,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_OUT_DIR,
    DEFAULT_WINDOW_SECONDS,
    GATE_LANGUAGE,
)
from ..model import checkpoint, layer_stream
from ..model.audio import FrontEndConfig
from ..model.shapes import ExportPlan, export_plan
from ..model.tokens import prompt_ids
from ..storage.files import stale_reason, sweep_stale_temporaries
from ..storage.integrity import invalidate_manifest
from .convert import GATE_UNITS, MIN_PSNR_DB, ExportError, ExportSettings
from .gate import StagedPackage
from .memory import release_memory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportJob:
    """Everything a component's export needs; shapes come from `plan`, never from another component."""

    model: Any  # CohereAsrForConditionalGeneration (eval, float32)
    processor: Any  # CohereAsrProcessor
    settings: ExportSettings
    plan: ExportPlan
    prompt: list[int]  # decoder prompt of the gates (config.GATE_LANGUAGE, with punctuation)
    control_prompt: list[int]  # another prompt (config.CONTROL_LANGUAGE, no punctuation): the decoder
    # gate's "wrong prompt" negative control
    gate_audio: Sequence[str | Path] | None = None  # speech for the gates (default: the packaged clips)
    buckets: tuple[float, ...] = ()
    prefill: bool = False
    extend: bool = False  # the decoder's `extend` function (forced prefixes K tokens per call)
    decoder_state: str = DECODER_STATE_DEFAULT  # who writes the decoder state: "host" | "graph" (docs/decoder.md)
    decoder_batch: int = 1  # rows of the decoder's batched step (1: none; `resolve_decoder_batch`)
    encoder_parts: int | str = "auto"  # programs of consecutive encoder layers: N, or "auto" (under `platform`'s limit)
    platform: str = "ios"  # whose per-program weight limit "auto" keeps the parts under (docs/ane.md)
    alignment_heads: str = "auto"  # the decoder's align function: "auto" | "none" | "L.H,..." (docs/word-timings.md)
    alignment_lead_rows: int = 1  # rows before the text, for an explicit head list ("auto" chooses its own)
    alignment_calibration: str | Path | None = None  # the word-timing set "auto" chooses on (default: the package's)


@dataclass(frozen=True)
class Component:
    """One exported package: `<name>.mlpackage`, gated, with `<name>.parity.json`."""

    name: str
    # writes the package to its temporary path and computes the gate's PyTorch references;
    # None when skipped (present). `StagedPackage.finish()` gates and installs it, model-free.
    stage: Callable[[ExportJob], StagedPackage | None]


def _stage_encoder(job: ExportJob) -> StagedPackage | None:
    from . import encoder, encoder_packages  # load torch: this module imports without it

    parts = {"parts": job.encoder_parts, "platform": job.platform}
    if job.buckets:  # one multifunction package: `main` = full window, `window_<s>s` = shorter buckets
        return encoder_packages.stage_encoder_buckets(job.model, job.settings, job.buckets, job.processor, job.gate_audio,
                                             **parts)
    clips = None
    if not job.settings.skip_verify:
        clips = encoder.gate_features(job.processor, job.plan.window, job.gate_audio)
        if not clips:
            logger.warning("no speech clips for the encoder gate: using synthetic features")
    return encoder_packages.stage_encoder(job.model, job.settings, job.processor, clips=clips, **parts)


def _stage_frontend(job: ExportJob) -> StagedPackage | None:
    """frontend.mlpackage: samples -> the encoder's input_features, one function per encoder window."""
    from . import frontend  # loads torch (as encoder)

    config = FrontEndConfig.from_processor(job.processor, dither=0.0)
    if config.n_mels != job.plan.window.n_mels:
        raise ExportError(f"the front end has {config.n_mels} mel bins, the encoder expects {job.plan.window.n_mels}")
    return frontend.stage_frontend(config, job.settings, job.plan.frontend, gate_audio=job.gate_audio)


def _stage_decoder(job: ExportJob) -> StagedPackage | None:
    from . import decoder  # loads transformers (seconds): the cli imports this module for every command

    shapes = job.plan.decoder
    settings = job.settings
    path = settings.package_path("decoder")
    request = _alignment_request(job)
    if path.exists() and not settings.force and stale_reason(settings, "decoder") is None:  # to be skipped
        info = decoder_package_info(path)
        present = info["shapes"]
        if (present["capacity"], present["memory_len"]) != (shapes.capacity, shapes.memory_len):
            raise ExportError(f"{path} has cache {present['capacity']} / memory {present['memory_len']}, the export "
                              f"asks for {shapes.capacity} / {shapes.memory_len}; use --force to re-export")
        if info["state_writes"] != job.decoder_state:
            raise ExportError(f"{path} is a {info['state_writes']}-state decoder, the export asks for "
                              f"--decoder-state {job.decoder_state}; use --force to re-export")
        present_batch = (info.get("batch") or {}).get("size", 1)
        if present_batch != job.decoder_batch:  # another --decoder-batch, or a package from before the batched step
            logger.warning("%s: its batched step has %d window(s), this export asks for %d: exporting it again",
                           path, present_batch, job.decoder_batch)
            settings = dataclasses.replace(settings, force=True)
        recorded = package_metadata(path).get(ALIGN_REQUEST_METADATA_KEY)
        if recorded != request:  # another --alignment-heads / calibration set, or a package from before them
            logger.warning("%s: its alignment was exported for %r, this export asks for %r: exporting it again",
                           path, recorded or "nothing (an export that predates the align function)", request)
            settings = dataclasses.replace(settings, force=True)
    if settings.force or not path.exists() or stale_reason(settings, "decoder") is not None:
        alignment = _plan_alignment(job)
        alignment.request = request
    else:
        alignment = None  # the package is present and skipped: no calibration
    staged, _ = decoder.stage_decoder(job.model, settings, capacity=shapes.capacity, memory_len=shapes.memory_len,
                                      prompt=job.prompt, prefill=job.prefill,
                                      control_prompt=job.control_prompt, extend=job.extend,
                                      state_writes=job.decoder_state, alignment=alignment, batch=job.decoder_batch)
    return staged


def _alignment_request(job: ExportJob) -> str:
    """`alignment_heads.alignment_request` of the job; an unreadable calibration set: ExportError (one line)."""
    from .alignment_heads import CalibrationError, alignment_request

    try:
        return alignment_request(job.alignment_heads, job.alignment_lead_rows, job.alignment_calibration)
    except CalibrationError as err:
        raise ExportError(str(err)) from None


def _plan_alignment(job: ExportJob):
    """The decoder's alignment heads (`alignment_heads.plan_alignment`); a bad list or set: ExportError (one line)."""
    from ..inference.alignment import AlignmentError
    from .alignment_heads import CalibrationError, plan_alignment

    t0 = time.perf_counter()
    try:
        plan = plan_alignment(job.model, job.processor, job.alignment_heads, job.alignment_lead_rows,
                              job.alignment_calibration)
    except (AlignmentError, CalibrationError) as err:
        raise ExportError(str(err)) from None
    if job.alignment_heads != "none":
        logger.info("alignment heads: calibration took %.1f s", time.perf_counter() - t0)
    return plan


def _stage_vad(job: ExportJob) -> StagedPackage | None:
    """vad.mlpackage: Silero VAD from the pinned silero-vad package (not from the checkpoint), in the export's
    precision; gated on the export's gate audio against the package's own model."""
    from . import vad_package  # loads torch (as encoder)

    return vad_package.stage_vad(job.settings, gate_audio=job.gate_audio)


# Export order: no component reads another (all take their shapes from the plan), but gating the
# cheaper ones first fails fast. All are exported by default: every bundle carries the front end, and
# the VAD unless `--no-vad` (a bundle without it transcribes as before).
COMPONENTS: dict[str, Component] = {
    "encoder": Component("encoder", _stage_encoder),
    "frontend": Component("frontend", _stage_frontend),
    "decoder": Component("decoder", _stage_decoder),
    "vad": Component("vad", _stage_vad),
}
# the recogniser's components: an export without the VAD (`--no-vad`; tests that need none)
MODEL_COMPONENTS = ("encoder", "frontend", "decoder")


@dataclass
class ExportResult:
    """Per component: the package path and whether it was written (False: present, skipped), its
    gate report (the written `<component>.parity.json`, None when skipped); and the manifest."""

    packages: dict[str, dict[str, Any]]
    manifest: Path


@dataclass(frozen=True)
class ModelInfo:
    """What the bundle needs of the checkpoint once the packages are converted (no weights)."""

    config: Any
    generation_config: Any
    source: Any

    @classmethod
    def of(cls, model) -> ModelInfo:
        return cls(config=model.config, generation_config=getattr(model, "generation_config", None),
                   source=getattr(model, "source", None))


@dataclass
class StagedExport:
    """Every requested component converted and written to its temporary path, with its gate's
    PyTorch references: nothing here holds the PyTorch model. `finish()` runs the gates (loading
    each package), installs the packages that pass and writes the bundle."""

    settings: ExportSettings
    model_info: ModelInfo
    processor: Any
    staged: dict[str, StagedPackage | None]  # None: present, skipped

    def finish(self) -> ExportResult:
        packages: dict[str, dict[str, Any]] = {}
        try:
            for name in list(self.staged):
                staged = self.staged.pop(name)
                report = None if staged is None else staged.finish()
                packages[name] = {
                    "path": self.settings.package_path(name),
                    "written": staged is not None,
                    "report": None if report is None else json.loads(self.settings.report_path(name).read_text()),
                }
        finally:
            self.discard()
        # the static Neural Engine census of the installed packages, before the manifest so that its
        # checksums list ane_check.json (a change of it removes the stale manifest first, as for any file)
        out_dir = self.settings.out_dir
        ane_check.write_report(out_dir, before_change=lambda: invalidate_manifest(out_dir))
        return ExportResult(packages=packages, manifest=write_bundle(self.settings.out_dir, self.model_info,
                                                                     self.processor))

    def discard(self) -> None:
        """Remove the packages not gated yet (after a refusal or an interruption)."""
        for staged in self.staged.values():
            if staged is not None:
                staged.discard()
        self.staged.clear()


def stage_export(model, processor, settings: ExportSettings, components: Sequence[str] = tuple(COMPONENTS),
                 gate_audio=None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, buckets=(), prefill: bool = False,
                 extend: bool = False,
                 decoder_state: str = DECODER_STATE_DEFAULT, encoder_parts: int | str = "auto",
                 platform: str = "ios", alignment_heads: str = "auto", alignment_lead_rows: int = 1,
                 alignment_calibration=None, decoder_batch: int | None = None) -> StagedExport:
    """The PyTorch half of an export: convert every component and compute its gate's references.

    After this returns the model is no longer needed (the caller may free it), so the gates'
    interpreter copies of the packages never sit next to the PyTorch weights in memory.
    """
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown:
        raise ExportError(f"unknown component(s) {unknown}; choose from {tuple(COMPONENTS)}")
    decoder_batch = resolve_decoder_batch(decoder_batch, decoder_state)
    sweep_stale_temporaries(settings.out_dir)  # staging packages of an export that was killed
    prompt = prompt_ids(processor.tokenizer, GATE_LANGUAGE)
    control_prompt = prompt_ids(processor.tokenizer, CONTROL_LANGUAGE, punctuation=False)
    plan = export_plan(model, processor, settings.window_seconds, max_new_tokens, prompt_len=len(prompt),
                       bucket_seconds=buckets)
    job = ExportJob(model=model, processor=processor, settings=settings, plan=plan, prompt=prompt,
                    control_prompt=control_prompt,
                    gate_audio=gate_audio, buckets=tuple(buckets), prefill=prefill,
                    extend=extend, decoder_state=decoder_state, encoder_parts=encoder_parts, platform=platform,
                    decoder_batch=decoder_batch, alignment_heads=alignment_heads, alignment_lead_rows=alignment_lead_rows,
                    alignment_calibration=alignment_calibration)
    result = StagedExport(settings=settings, model_info=ModelInfo.of(model), processor=processor, staged={})
    try:
        for name in (c for c in COMPONENTS if c in components):
            logger.info("%s: converting", name)  # progress: its verdict line follows once every component is converted
            t0 = time.perf_counter()
            result.staged[name] = COMPONENTS[name].stage(job)
            if result.staged[name] is not None:
                result.staged[name].convert_seconds = time.perf_counter() - t0
    except BaseException:
        result.discard()
        raise
    return result


def resolve_decoder_batch(batch: int | None, decoder_state: str) -> int:
    """The rows of the decoder's batched step: `batch`, or by default DECODER_BATCH_DEFAULT for the host-state
    decoder and 1 (none) for the graph one, which decodes one window at a time (a batch asked of it: ExportError)."""
    if batch is None:
        return DECODER_BATCH_DEFAULT if decoder_state == DECODER_STATE_HOST else 1
    if int(batch) < 1:
        raise ExportError(f"--decoder-batch must be >= 1, got {batch}")
    if int(batch) > 1 and decoder_state != DECODER_STATE_HOST:
        raise ExportError(f"--decoder-batch {batch} needs --decoder-state host: the graph-state decoder writes its "
                          "state in the graph and decodes one window at a time (use --decoder-batch 1)")
    return int(batch)


def export_model(model, processor, settings: ExportSettings, components: Sequence[str] = tuple(COMPONENTS),
                 gate_audio=None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, buckets=(), prefill: bool = False,
                 extend: bool = False,
                 decoder_state: str = DECODER_STATE_DEFAULT, encoder_parts: int | str = "auto",
                 platform: str = "ios", alignment_heads: str = "auto", alignment_lead_rows: int = 1,
                 alignment_calibration=None, decoder_batch: int | None = None) -> ExportResult:
    """Export `components` of a loaded checkpoint into `settings.out_dir`, then write the bundle.

    Each component is parity gated unless `settings.skip_verify`; a failing gate raises
    `ParityError` and leaves that package (and the manifest) as they were. All components are
    converted (and their references computed) before the first gate runs; the caller keeps
    `model` alive here (`export_checkpoint` frees it before gating).
    """
    return stage_export(model, processor, settings, components, gate_audio=gate_audio,
                        max_new_tokens=max_new_tokens, buckets=buckets, prefill=prefill,
                        extend=extend, decoder_state=decoder_state, encoder_parts=encoder_parts,
                        platform=platform, alignment_heads=alignment_heads, alignment_lead_rows=alignment_lead_rows,
                        alignment_calibration=alignment_calibration, decoder_batch=decoder_batch).finish()


def export_checkpoint(model_ref: str, settings: ExportSettings, revision: str | None = None,
                      base_model: str | None = None, stream_layers: bool = True, **options) -> ExportResult:
    """Load a checkpoint (Hub id or folder) and export it; package metadata records its source.

    Peak memory is the larger of (PyTorch model + conversion) and (gating one package), not their
    sum: every component is converted and its references computed (`stage_export`), then the model
    is freed, then the gates load the packages (`StagedExport.finish`). `stream_layers` (default): the
    encoder layers are read from the checkpoint while they are used (`layer_stream`: one part's layers
    while it converts, one layer at a time in a reference pass), not held all at once; the packages are
    the same bytes either way.
    """
    import torch  # heavy (as encoder)

    load = layer_stream.load_streamed_reference if stream_layers else checkpoint.load_reference
    with torch.no_grad():  # no autograd graph; the caller's setting is back afterwards
        model, processor = load(model_ref, revision=revision)
        if base_model is not None:  # the Hub id of a checkpoint given as a folder whose config names none
            model.source = dataclasses.replace(model.source, model_id=checkpoint.check_hub_id(base_model),
                                               base_model=base_model)
        source = model.source
        logger.info("sha256 of %s's files (packages in %s from another checkpoint are exported again)",
                    source.model_id, settings.out_dir)
        settings = settings.replace(model_id=source.model_id, revision=source.revision or settings.revision,
                                    checkpoint_digest=checkpoint.checkpoint_digest(source.local_dir))
        staged = stage_export(model, processor, settings, **options)
        del model
        release_memory()
        return staged.finish()


# --------------------------------------------------------------------------------------------
# `cohere-coreml export` (also `make export`, exports/*.py)
# --------------------------------------------------------------------------------------------


def cmd_export(args) -> int:
    settings = ExportSettings(out_dir=Path(args.out), precision=args.precision, deployment_target=args.deployment_target,
                              window_seconds=args.window_seconds, force=args.force, skip_verify=args.skip_verify,
                              gate_units=args.gate_units)
    components = export_components(args.components, args.vad)
    resolve_decoder_batch(args.decoder_batch, args.decoder_state)  # a batch the decoder cannot have: before any load
    result = export_checkpoint(args.model, settings, revision=args.revision, base_model=args.base_model,
                               components=components,
                               gate_audio=args.gate_audio, max_new_tokens=args.max_tokens,
                               buckets=tuple(args.buckets or ()), prefill=args.prefill,
                               extend=args.extend, decoder_state=args.decoder_state,
                               encoder_parts=args.encoder_parts, platform=args.platform,
                               alignment_heads=args.alignment_heads, alignment_lead_rows=args.alignment_lead_rows,
                               alignment_calibration=args.alignment_calibration, decoder_batch=args.decoder_batch)
    for name, package in result.packages.items():  # one line per package (its gate's cases: <name>.parity.json)
        line = f"{name}: {package['path'] if package['written'] else 'exists, skipped (use --force)'}"
        report = package["report"]
        if report is not None:
            verdict = "PASS" if report["passed"] else ("SKIPPED" if report.get("skipped") else "FAIL")
            line += f"  parity {verdict}: {report['headline']}"
            if report.get("parts"):  # an encoder in parts (--encoder-parts)
                line += "; parts " + ", ".join(f"{p['package']} (layers {p['layers'][0]}-{p['layers'][1] - 1})"
                                               for p in report["parts"])
        print(line)
    print(f"manifest: {result.manifest}")
    return 0


def export_components(components: str, vad: bool | None) -> tuple[str, ...]:
    """The components of `--components` (comma-separated) with `--vad` (True: added), `--no-vad` (False:
    removed) or neither (None: as listed; the default list holds the VAD)."""
    names = tuple(c.strip() for c in components.split(",") if c.strip())
    if vad is not None:
        names = tuple(c for c in names if c != "vad") + (("vad",) if vad else ())
    if not names:
        raise ExportError("nothing to export: --components names no component (with --no-vad, name one of "
                          f"{', '.join(MODEL_COMPONENTS)})")
    return names


def _encoder_parts(value: str) -> int | str:
    """--encoder-parts: 'auto' or a positive number of parts."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive number of parts, got {value!r}")
    return int(value)


def _alignment_heads(value: str) -> str:
    """--alignment-heads: 'auto', 'none' or a LAYER.HEAD list (checked against the model at export)."""
    if value in ("auto", "none"):
        return value
    from ..inference.alignment import AlignmentError, format_heads, parse_heads

    try:
        return format_heads(parse_heads(value))
    except AlignmentError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--alignment-heads: ")) from None


def add_command(subparsers) -> None:
    """Register `cohere-coreml export`."""
    p = subparsers.add_parser(
        "export",
        help="export encoder.mlpackage, frontend.mlpackage, decoder.mlpackage and the bundle, parity-gated",
        description="Convert a Cohere Transcribe checkpoint into Core ML packages. Each package is checked "
        "through the project's runtime against PyTorch (the front end: against audio.log_mel) (parity gate); "
        "a failing gate exits non-zero and "
        "leaves no package behind. Figures are written next to the package as <component>.parity.json; "
        "manifest.json, vocab.json and the tokenizer files are written last, describing the packages present.",
    )
    p.add_argument("--model", default=DEFAULT_HUB_ID, help="Hugging Face Hub id or local checkpoint folder "
                   f"(default: {DEFAULT_HUB_ID})")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--base-model", default=None, metavar="ORG/NAME",
                   help="Hub id of the checkpoint, recorded in the manifest and the model card, when --model is a "
                   "folder whose config.json names none (a local path is never recorded)")
    p.add_argument("--out", default=str(DEFAULT_OUT_DIR / "export"), help="output folder (default: %(default)s)")
    p.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                   help="program precision (fp16 ships; fp32 is reference-grade). Gate: >= "
                   f"{MIN_PSNR_DB['fp16']:g} dB PSNR for fp16, >= {MIN_PSNR_DB['fp32']:g} dB for fp32")
    p.add_argument("--window-seconds", type=float, default=DEFAULT_WINDOW_SECONDS,
                   help="encoder audio window in seconds (default: %(default)s s -> 3500 mel frames at hop 160)")
    p.add_argument("--deployment-target", default="macOS15", help="coremltools target name (macOS15/iOS18)")
    p.add_argument("--components", default=",".join(COMPONENTS),
                   help="comma-separated components to export (default: %(default)s)")
    p.add_argument("--vad", action=argparse.BooleanOptionalAction, default=None,
                   help="vad.mlpackage, Silero VAD (speech probability per 32 ms chunk, from the pinned silero-vad "
                   "package, gated against its own model): on by default (in --components); --no-vad leaves it out "
                   "(the bundle transcribes without a VAD, as before). docs/export.md")
    p.add_argument("--gate-audio", nargs="+", default=None,
                   help="speech files for the encoder, front-end and VAD parity gates (default: the clips shipped "
                   "with the package)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="new tokens one window can decode; the decoder cache holds round_up(10 + N, 32) "
                   "slots (default: %(default)s, the upstream limit)")
    p.add_argument("--buckets", type=float, nargs="+", default=(),
                   help="extra shorter encoder windows in seconds (e.g. --buckets 10 20): encoder.mlpackage "
                   "and frontend.mlpackage get one function per window (encoder weights shared, encoder outputs "
                   "padded to the full window)")
    p.add_argument("--prefill", action="store_true",
                   help="add a prompt prefill function to decoder.mlpackage (one call for the 10 prompt "
                   "tokens; multifunction package sharing weights and state with the step)")
    p.add_argument("--extend", action="store_true",
                   help="add an extend function to decoder.mlpackage (up to 32 tokens from a given cache slot in "
                   "one call: the forced prefix of a streaming partial; docs/decoder.md)")
    p.add_argument("--decoder-state", choices=DECODER_STATES, default=DECODER_STATE_DEFAULT,
                   help="who writes the decoder's state: 'host' (its functions only read the KV cache and the "
                   "cross memory and return each call's new K/V rows, which the app writes; the Neural Engine "
                   "compiler refused in-graph state writes at a runtime position in published ports) or 'graph' "
                   "(the functions write the cache, a bind_memory function the memory). Default: %(default)s; "
                   "docs/decoder.md")
    p.add_argument("--decoder-batch", type=int, default=None, metavar="B",
                   help="add step_batch to decoder.mlpackage: one decode step for B windows at once (long audio's "
                   "windows decoded together; weights shared with the step; host-state decoder only); 1: none. "
                   f"Default: {DECODER_BATCH_DEFAULT} with --decoder-state host, 1 with graph; docs/decoder.md")
    p.add_argument("--encoder-parts", default="auto", type=_encoder_parts, metavar="auto|N",
                   help="the encoder as N programs of consecutive layers (encoder.mlpackage, encoder_part2.mlpackage, "
                   "...: the subsampling in the first, the memory projections in the last), chained through the "
                   "hidden state; 'auto' (default): the fewest whose weights stay under --platform's per-program "
                   "limit (docs/ane.md)")
    p.add_argument("--platform", choices=("ios", "macos"), default="ios",
                   help="target whose Neural Engine weight limit --encoder-parts auto keeps every program under: "
                   "ios 1 GiB (default), macos 2 GiB")
    p.add_argument("--alignment-heads", default="auto", metavar="auto|none|L.H,...", type=_alignment_heads,
                   help="the decoder cross-attention heads word timings read (an `align` function in "
                   "decoder.mlpackage): 'auto' (default) chooses them on --alignment-calibration with the PyTorch "
                   "model and leaves them out when no choice beats a naive baseline; 'none' leaves the function out; "
                   "or a list of LAYER.HEAD (0-based), measured and kept as given. docs/word-timings.md")
    p.add_argument("--alignment-lead-rows", type=int, default=1, metavar="N",
                   help="rows before the text the word-timing rule reads, with an explicit --alignment-heads list "
                   "('auto' chooses its own; default: %(default)s)")
    p.add_argument("--alignment-calibration", default=None, metavar="DIR",
                   help="word-timing set (manifest.json with word times) --alignment-heads auto chooses on and the "
                   "gate checks the align function with (default: the set shipped with the package)")
    p.add_argument("--force", action="store_true", help="overwrite packages that already exist")
    p.add_argument("--skip-verify", action="store_true",
                   help="do not run the parity gates (packages are written unchecked)")
    p.add_argument("--gate-units", choices=GATE_UNITS, default="auto",
                   help="what the parity gates run each package on: 'auto' (default) Core ML on the CPU where "
                   "this machine's Core ML runs the packages (one unit, no Neural Engine compile, Core ML's own "
                   "compiler checked), else the MIL interpreter; 'interpreter'; or a Core ML compute-unit set "
                   "(cpu_only, cpu_and_gpu, cpu_and_ne, all: the units an app runs). Gates compile into a "
                   "private cache removed when they end (docs/export.md)")
    p.set_defaults(func=cmd_export)
