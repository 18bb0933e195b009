"""Shared Core ML converter used by every exported component (encoder, decoder, front end).

One place decides how a traced PyTorch module becomes an ML program:

* `ExportSettings`: precision (fp16 | fp32), deployment target (macOS 15 / iOS 18 by default),
  window length, output folder, `force` and `skip_verify`, and the gate's PSNR floor (`MIN_PSNR_DB`);
* `convert_module(...)`: `coremltools.convert` to an ML program with the settings' target and
  precision (each pass pipeline validated once: `validated_per_pipeline`), then metadata (source
  model id and revision, tool version and git hash, license, shapes, sample rate, window) in
  `user_defined_metadata`, and input/output descriptions in the spec.

Writing the package (atomic installs, temporaries) is `cohere_coreml.storage.files`; the gate's arithmetic
(PSNR, KL, per-output reports) is `cohere_coreml.export.parity`; the errors are `cohere_coreml.export_errors`.

The layout follows Apple's ml-stable-diffusion `torch2coreml.py` (one `convert_<component>()`
per part, skip what exists, PSNR gate) and argmax whisperkittools (metadata in every package).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cohere_coreml.config import DEFAULT_WINDOW_SECONDS

from .. import __version__, git_hash

# the errors of an export, importable from here as well (most exporters import them with the settings)
from ..export_errors import ExportError as ExportError
from ..export_errors import ExportSettingsError as ExportSettingsError
from ..export_errors import ParityError as ParityError

logger = logging.getLogger(__name__)

PRECISIONS = ("fp16", "fp32")
# Minimum PSNR (dB) of every output vs PyTorch, per program precision.
MIN_PSNR_DB = {"fp32": 60.0, "fp16": 35.0}
# Deployment targets accepted by name (attribute names of `coremltools.target`).
DEPLOYMENT_TARGETS = ("macOS15", "iOS18", "macOS26", "iOS26")
# what the parity gates run packages on (`gate.GateLoader`): "interpreter" (the project's MIL
# interpreter), Core ML on one of its compute-unit sets, or "auto": Core ML on the CPU where this
# machine's Core ML runs the package, else the interpreter (docs/export.md, "Where the gates run")
GATE_UNITS = ("auto", "interpreter", "cpu_only", "cpu_and_gpu", "cpu_and_ne", "all")


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSettings:
    """How to export one or more components.

    Attributes:
        out_dir: folder that receives `<component>.mlpackage` and `<component>.parity.json`.
        precision: "fp16" (default, what ships) or "fp32" (reference-grade program).
        deployment_target: attribute name of `coremltools.target` ("macOS15" == "iOS18" opset).
        window_seconds: audio window of the encoder (35 s -> 3500 mel frames at hop 160 / 16 kHz).
        force: overwrite packages that already exist (otherwise they are skipped).
        skip_verify: do not run the parity gate (for people who know why).
        min_psnr_db: override of the gate threshold (default from `MIN_PSNR_DB[precision]`).
        model_id / revision: recorded in the package metadata.
        checkpoint_digest: `checkpoint.checkpoint_digest` of the checkpoint being exported (None: unknown),
            recorded in each gate report; a package whose report names another checkpoint is not skipped.
        gate_units: where the gates run the packages (`GATE_UNITS`; default "auto": Core ML's CPU where
            Core ML can run them, else the interpreter).
    """

    out_dir: Path = Path("out")
    precision: str = "fp16"
    deployment_target: str = "macOS15"
    window_seconds: float = DEFAULT_WINDOW_SECONDS
    force: bool = False
    skip_verify: bool = False
    min_psnr_db: float | None = None
    model_id: str = "unknown"
    revision: str | None = None
    license: str = "Apache-2.0"
    checkpoint_digest: str | None = None
    gate_units: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.precision not in PRECISIONS:
            raise ExportSettingsError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.deployment_target not in DEPLOYMENT_TARGETS:
            raise ExportSettingsError(
                f"deployment_target must be one of {DEPLOYMENT_TARGETS}, got {self.deployment_target!r} "
                "(the stateful decoder needs at least macOS15/iOS18)"
            )
        if self.gate_units not in GATE_UNITS:
            raise ExportSettingsError(f"gate_units must be one of {GATE_UNITS}, got {self.gate_units!r}")
        if not (isinstance(self.window_seconds, (int, float)) and math.isfinite(self.window_seconds)):
            raise ExportSettingsError(f"window_seconds must be a finite number, got {self.window_seconds!r}")
        if self.window_seconds <= 0:
            raise ExportSettingsError(f"window_seconds must be > 0, got {self.window_seconds}")

    @property
    def gate_psnr_db(self) -> float:
        """PSNR threshold (dB) every output must reach."""
        return float(self.min_psnr_db) if self.min_psnr_db is not None else MIN_PSNR_DB[self.precision]

    def ct_target(self):
        import coremltools as ct  # heavy: bundle and export import this module without it

        return getattr(ct.target, self.deployment_target)

    def ct_compute_precision(self):
        import coremltools as ct  # heavy: bundle and export import this module without it

        return ct.precision.FLOAT16 if self.precision == "fp16" else ct.precision.FLOAT32

    def package_path(self, component: str) -> Path:
        return self.out_dir / f"{component}.mlpackage"

    def report_path(self, component: str) -> Path:
        """Gate figures of the package in place (written only with the package)."""
        return self.out_dir / f"{component}.parity.json"

    def failed_report_path(self, component: str) -> Path:
        """Gate figures of a refused export (no package was written; an older package and its
        report, if any, are left untouched)."""
        return self.out_dir / f"{component}.parity-failed.json"

    def replace(self, **changes) -> ExportSettings:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------




def base_metadata(settings: ExportSettings, component: str) -> dict[str, str]:
    """Metadata every package carries (all values strings, as Core ML requires)."""
    import coremltools as ct  # heavy: bundle and export import this module without it
    import torch  # heavy (as coremltools)
    import transformers  # heavy (as coremltools)


    return {
        "com.cohere_coreml.component": component,
        "com.cohere_coreml.source_model": settings.model_id,
        "com.cohere_coreml.source_revision": settings.revision or "unknown",
        "com.cohere_coreml.tool_version": __version__,
        "com.cohere_coreml.tool_git_hash": git_hash(),
        "com.cohere_coreml.precision": settings.precision,
        "com.cohere_coreml.deployment_target": settings.deployment_target,
        "com.cohere_coreml.window_seconds": f"{settings.window_seconds:g}",
        "com.cohere_coreml.license": settings.license,
        "com.cohere_coreml.created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "com.cohere_coreml.coremltools_version": ct.__version__,
        "com.cohere_coreml.torch_version": torch.__version__,
        "com.cohere_coreml.transformers_version": transformers.__version__,
    }


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------

# Set to 1: coremltools' own validation after every graph pass (to find which pass broke a program).
VALIDATE_EACH_PASS_ENV = "COHERE_COREML_VALIDATE_EACH_PASS"


# coremltools' progress bars: module -> the name it imported `tqdm.tqdm` under (one bar per op walk and per
# pass pipeline: four lines a conversion on a terminal)
_CONVERTER_BARS = {"coremltools.converters.mil.frontend.torch.ops": "_tqdm",
                   "coremltools.converters.mil.mil.passes.pass_pipeline": "tqdm"}


@contextlib.contextmanager
def quiet_third_party():
    """Within: third-party chatter of tracing and converting is hidden unless the package logs at DEBUG
    (`cohere-coreml -v`): coremltools' progress bars, and what `torch.jit.trace` draws from `transformers`
    by reading every attribute of the model (the `is_gradient_checkpointing` FutureWarning and the
    `loss_type` warning of its deprecated properties). The export's own progress lines say what runs.

    The bars are coremltools' own `tqdm` calls (no option turns them off: `coremltools.convert` has
    none), swapped for disabled ones in the two modules that draw them and put back on exit.
    """
    if logging.getLogger("cohere_coreml").isEnabledFor(logging.DEBUG):
        yield
        return
    import importlib
    import warnings
    from functools import partial

    from tqdm import tqdm

    swapped = []
    for module_name, attribute in _CONVERTER_BARS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # another coremltools layout: its bars show
            continue
        if getattr(module, attribute, None) is tqdm:
            swapped.append((module, attribute))
            setattr(module, attribute, partial(tqdm, disable=True))
    transformers_log = logging.getLogger("transformers")
    level = transformers_log.level
    transformers_log.setLevel(max(level, logging.ERROR))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            yield
    finally:
        transformers_log.setLevel(level)
        for module, attribute in swapped:
            setattr(module, attribute, tqdm)


@contextlib.contextmanager
def validated_per_pipeline():
    """Within: coremltools validates each pass pipeline's program once, after its last pass.

    coremltools 9's `PassPipelineManager.apply_pipeline` runs `Program.validate()` (every op's
    input/output links and every var's visibility, forced where `Block.validate` alone leaves it to
    coremltools' DEBUG flag) before the pipeline and after each of its passes: about 110 whole-program
    checks per conversion, a large share of an export's time (docs/export.md).
    Validation only reads the program, so the packages are the same bytes either way
    (tests/export/test_convert.py); a pass that leaves the program invalid still fails the conversion, at
    its pipeline's end, with coremltools' error, and `COHERE_COREML_VALIDATE_EACH_PASS=1` restores the
    per-pass checks that name the pass.
    Not thread-safe (it swaps a class attribute); the exporters convert one program at a time.
    """
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    from coremltools.converters.mil.mil.program import Program

    apply_pipeline = PassPipelineManager.__dict__["apply_pipeline"]  # the staticmethod itself
    if os.environ.get(VALIDATE_EACH_PASS_ENV) == "1" or getattr(apply_pipeline.__func__, "deferred", False):
        yield  # asked for per-pass checks, or already deferred by an enclosing conversion
        return
    validate = Program.validate

    def skipped(self, check_essential_scope=False):
        return None

    def apply_then_validate(prog, pass_pipeline):
        Program.validate = skipped  # only within the pipeline: the converters' own checks stay
        try:
            apply_pipeline.__func__(prog, pass_pipeline)
        finally:
            Program.validate = validate
        # as coremltools checks after its dead-code elimination pass: ops keep their essential scopes
        prog.validate(check_essential_scope="common::dead_code_elimination" in pass_pipeline.passes)

    apply_then_validate.deferred = True
    PassPipelineManager.apply_pipeline = staticmethod(apply_then_validate)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = apply_pipeline


def convert_module(
    traced,
    inputs: Sequence,
    outputs: Sequence,
    settings: ExportSettings,
    *,
    states: Sequence | None = None,
    metadata: Mapping[str, Any] | None = None,
    descriptions: Mapping[str, str] | None = None,
    short_description: str | None = None,
    compute_precision=None,
):
    """Convert a traced module (`torch.jit.trace`) into an ML program `ct.models.MLModel`.

    Args:
        traced: a `torch.jit.ScriptModule` (or anything `coremltools.convert` accepts).
        inputs: `ct.TensorType` list, in the traced forward's argument order.
        outputs: `ct.TensorType` list naming the outputs (in return order).
        settings: precision and deployment target.
        states: `ct.StateType` list for stateful models (needs macOS15/iOS18).
        metadata: extra key -> value pairs (non-strings are JSON-encoded) merged over
            `base_metadata` into `user_defined_metadata`.
        descriptions: input/output/state name -> human description written into the spec.
        short_description: the model's description.
        compute_precision: override (e.g. `ct.transform.FP16ComputePrecision(op_selector=...)`).

    Raises:
        ExportError: when coremltools cannot convert the graph (message names the component).
    """
    import coremltools as ct  # heavy: bundle and export import this module without it

    component = str((metadata or {}).get("com.cohere_coreml.component", "model"))
    kwargs = {}
    if states:
        kwargs["states"] = list(states)
    try:
        with validated_per_pipeline(), quiet_third_party():
            mlmodel = ct.convert(
                traced,
                convert_to="mlprogram",
                inputs=list(inputs),
                outputs=list(outputs),
                minimum_deployment_target=settings.ct_target(),
                compute_precision=compute_precision if compute_precision is not None else settings.ct_compute_precision(),
                compute_units=ct.ComputeUnit.ALL,
                skip_model_load=True,
                **kwargs,
            )
    except Exception as exc:  # coremltools raises many types; name the failing component
        raise ExportError(f"coremltools could not convert the {component}: {type(exc).__name__}: {exc}") from exc

    meta = base_metadata(settings, component)
    for key, value in (metadata or {}).items():
        meta[str(key)] = _stringify(value)
    apply_metadata(mlmodel, meta, descriptions or {}, settings, short_description)
    return mlmodel


def merge_functions(singles: Mapping[str, Path], default: str, scratch: Path):
    """One multifunction MLModel from single-function packages: each package's `main` becomes the
    function named by its key, `default` the default function; identical weights are stored once.
    Written to `scratch/merged.mlpackage` one weight at a time (`cohere_coreml.export.multifunction`); a
    package holding a blob dtype that path cannot copy goes through
    `coremltools.utils.save_multifunction` (all weights in memory at once). Merging drops the
    packages' metadata: the caller sets what the merged package records."""
    import coremltools as ct  # heavy: the PyTorch side needs none

    from . import multifunction  # imports coremltools (see above)

    merged = scratch / "merged.mlpackage"
    unsupported = set()
    for single in singles.values():
        unsupported |= multifunction.unsupported_blob_dtypes(ct.utils.load_spec(str(single)))
    if not unsupported:
        multifunction.write_multifunction(singles, default, merged)
    else:
        logger.warning("merging %s through coremltools.utils.save_multifunction (all weights in memory): "
                       "blob dtypes %s have no lean copy", list(singles), sorted(unsupported))
        descriptor = ct.utils.MultiFunctionDescriptor()
        for fn, single in singles.items():
            descriptor.add_function(str(single), src_function_name="main", target_function_name=fn)
        descriptor.default_function_name = default
        ct.utils.save_multifunction(descriptor, str(merged))
    return ct.models.MLModel(str(merged), skip_model_load=True)


def apply_metadata(mlmodel, meta: Mapping[str, str], descriptions: Mapping[str, str], settings: ExportSettings,
                   short_description: str | None = None) -> None:
    """Write metadata and I/O descriptions into the model's spec (in place)."""
    mlmodel.author = "cohere_coreml " + meta.get("com.cohere_coreml.tool_version", "")
    mlmodel.license = settings.license
    mlmodel.version = meta.get("com.cohere_coreml.tool_git_hash", "unknown")
    if short_description:
        mlmodel.short_description = short_description
    mlmodel.user_defined_metadata.update({str(k): str(v) for k, v in meta.items()})
    desc = mlmodel._spec.description  # the MLModel's own spec (get_spec() returns a copy)
    features = list(desc.input) + list(desc.output) + list(getattr(desc, "state", []))
    names = {f.name for f in features}
    unknown = sorted(set(descriptions) - names)
    if unknown:
        raise ExportError(f"descriptions given for unknown features {unknown}; model has {sorted(names)}")
    for feature in features:
        if feature.name in descriptions:
            feature.shortDescription = descriptions[feature.name]
