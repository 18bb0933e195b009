"""Shared Core ML converter used by every exported component (encoder, decoder, ...).

One place decides how a traced PyTorch module becomes an `.mlpackage`:

* `ExportSettings`: precision (fp16 | fp32), deployment target (macOS 15 / iOS 18 by default),
  window length, output folder, `force` and `skip_verify`;
* `convert_module(...)`: `coremltools.convert` to an ML program with the settings' target and
  precision, then metadata (source model id and revision, tool version and git hash, license,
  shapes, sample rate, window) in `user_defined_metadata`, and input/output descriptions in the
  spec;
* `save_package_atomic(...)`: write to `.<name>.tmp-<pid>.mlpackage`, optionally run a verification
  callback on the temporary package, then rename into place; an existing package is kept
  (skipped) unless `force`;
* `psnr`, `kl_divergence`, `report_correctness(...)`: the parity gate's arithmetic. A failing gate
  raises `ParityError` and the temporary package is deleted, so nothing half-verified is left.

The layout follows Apple's ml-stable-diffusion `torch2coreml.py` (one `convert_<component>()`
per part, skip what exists, PSNR gate) and argmax whisperkittools (metadata in every package).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cohere_coreml.config import DEFAULT_WINDOW_SECONDS

logger = logging.getLogger(__name__)

PRECISIONS = ("fp16", "fp32")
# Minimum PSNR (dB) of every output vs PyTorch, per program precision.
MIN_PSNR_DB = {"fp32": 60.0, "fp16": 35.0}
# Deployment targets accepted by name (attribute names of `coremltools.target`).
DEPLOYMENT_TARGETS = ("macOS15", "iOS18", "macOS26", "iOS26")


class ExportError(RuntimeError):
    """Conversion or saving of a Core ML package failed."""


class ExportSettingsError(ValueError):
    """Invalid export settings (precision, target, window, ...)."""


class ParityError(ExportError):
    """The exported program does not match PyTorch (the parity gate refused it)."""

    def __init__(self, message: str, report=None):  # report: the GateReport (or CorrectnessReport) refused
        super().__init__(message)
        self.report = report


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

    def __post_init__(self):
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.precision not in PRECISIONS:
            raise ExportSettingsError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.deployment_target not in DEPLOYMENT_TARGETS:
            raise ExportSettingsError(
                f"deployment_target must be one of {DEPLOYMENT_TARGETS}, got {self.deployment_target!r} "
                "(the stateful decoder needs at least macOS15/iOS18)"
            )
        if not (isinstance(self.window_seconds, (int, float)) and math.isfinite(self.window_seconds)):
            raise ExportSettingsError(f"window_seconds must be a finite number, got {self.window_seconds!r}")
        if self.window_seconds <= 0:
            raise ExportSettingsError(f"window_seconds must be > 0, got {self.window_seconds}")

    @property
    def gate_psnr_db(self) -> float:
        """PSNR threshold (dB) every output must reach."""
        return float(self.min_psnr_db) if self.min_psnr_db is not None else MIN_PSNR_DB[self.precision]

    def ct_target(self):
        import coremltools as ct

        return getattr(ct.target, self.deployment_target)

    def ct_compute_precision(self):
        import coremltools as ct

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


def git_hash(short: bool = False) -> str:
    """Git commit of the tool's source tree, `unknown` outside a checkout (suffix `-dirty`)."""
    src = Path(__file__).resolve().parent
    try:
        args = ["git", "-C", str(src), "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        rev = subprocess.run(args, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def base_metadata(settings: ExportSettings, component: str) -> dict[str, str]:
    """Metadata every package carries (all values strings, as Core ML requires)."""
    import coremltools as ct
    import torch
    import transformers

    from cohere_coreml import __version__

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
        "com.cohere_coreml.created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
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
    import coremltools as ct

    component = str((metadata or {}).get("com.cohere_coreml.component", "model"))
    kwargs = {}
    if states:
        kwargs["states"] = list(states)
    try:
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


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_package_atomic(
    mlmodel,
    path: str | Path,
    force: bool = False,
    verify: Callable[[Path], Any] | None = None,
) -> bool:
    """Save `mlmodel` to `path` (an `.mlpackage` folder) without ever leaving a partial package.

    The package is written to `.<name>.tmp-<pid>.mlpackage` next to `path`; `verify(tmp_path)` (if given) runs on that
    temporary package and may raise (e.g. `ParityError`), in which case the temporary package is
    removed and the exception propagates. Only then is it renamed to `path`.

    Returns:
        True when written, False when `path` already exists and `force` is False (skipped).
    """
    return write_package_atomic(lambda tmp: mlmodel.save(str(tmp)), path, force=force, verify=verify)


def skip_existing(path: Path, force: bool) -> bool:
    """True (and one log line) when the package at `path` exists and `force` is off: skip its export."""
    if Path(path).exists() and not force:
        logger.info("%s exists, skipping (use --force to overwrite)", path)
        return True
    return False


def skip_installed(settings: ExportSettings, component: str) -> bool:
    """`skip_existing` for a gated component: skipped only when its package AND its gate report
    (`<component>.parity.json`, written right after the package is installed) are in place. A package
    without its report is what an export interrupted between the two leaves: it is exported again."""
    path, report = settings.package_path(component), settings.report_path(component)
    if path.exists() and not settings.force and not report.is_file():
        logger.warning("%s has no %s (an interrupted export?): exporting it again", path, report.name)
        return False
    return skip_existing(path, settings.force)


def write_package_atomic(
    write: Callable[[Path], Any],
    path: str | Path,
    force: bool = False,
    verify: Callable[[Path], Any] | None = None,
) -> bool:
    """`save_package_atomic` for any writer: `write(tmp_path)` creates the package (e.g.
    `coremltools.utils.save_multifunction(descriptor, tmp_path)`)."""
    path = Path(path)
    tmp = staging_path(path)
    if skip_existing(path, force):
        return False
    _remove(tmp)
    try:
        write(tmp)
        if verify is not None:
            verify(tmp)
    except BaseException:
        _remove(tmp)
        raise
    install_package(tmp, path)
    return True


def staging_path(path: str | Path) -> Path:
    """The temporary path a package is written to before `install_package` renames it to `path`."""
    path = Path(path)
    if path.suffix != ".mlpackage":
        raise ExportSettingsError(f"package path must end with .mlpackage, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # coremltools insists on the .mlpackage extension, so the temporary name keeps it
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}.mlpackage")


def install_package(tmp: str | Path, path: str | Path) -> None:
    """Rename the finished package `tmp` to `path`, replacing an older one only once `tmp` is in place.

    A bundle manifest next to `path` stops describing the folder here, so it is removed first
    (`integrity.invalidate_manifest`): an interrupted install never leaves a manifest over other files."""
    from . import faults
    from .integrity import invalidate_manifest

    tmp, path = Path(tmp), Path(path)
    old = path.with_name(f".{path.stem}.old-{os.getpid()}.mlpackage")
    try:
        invalidate_manifest(path.parent)
        faults.point(f"install/{path.stem}", path)
        if path.exists():
            os.rename(path, old)
            faults.point(f"swap/{path.stem}", path)
        os.rename(tmp, path)
    except BaseException:
        _remove(tmp)
        if old.exists() and not path.exists():
            os.rename(old, path)
        raise
    _remove(old)
    logger.info("wrote %s", path)


def remove_package(path: str | Path) -> None:
    """Delete a (temporary) package folder if present."""
    _remove(Path(path))


def write_json_atomic(data: Any, path: str | Path, if_changed: bool = False) -> Path:
    """`data` as indented JSON at `path`, atomically (`write_text_atomic`)."""
    path = Path(path)
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n",
                      if_changed=if_changed)
    return path


def write_text_atomic(path: str | Path, text: str, if_changed: bool = False,
                      before_change: Callable[[], Any] | None = None) -> bool:
    """Write `text` to `path` so that `path` is always either the old file or the new one.

    The text goes to the hidden `.<name>.tmp-<pid>` (never listed as a bundle file, removed when the
    write fails, e.g. on a full disk; swept by `sweep_stale_temporaries` after a kill), then is renamed
    over `path`. With `if_changed`, a file that already holds `text` is left alone (False returned).
    `before_change()` runs just before the first change (e.g. removing a manifest the change makes stale).
    Mode: the process umask's default (0644 usually), like any new file.
    """
    from . import faults

    path = Path(path)
    data = text.encode("utf-8")
    if if_changed and path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if before_change is not None:
        before_change()
    faults.point(f"write/{path.name}", path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        faults.point(f"replace/{path.name}", path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


# temporaries of this package: `.<name>.tmp-<pid>...`, `.<name>.old-<pid>...`, `.<prefix>.tmp-<pid>-XXXX`
TEMPORARY_NAME = re.compile(r"^\..+?\.(?:tmp|old)-(\d+)(?:[.-]|$)")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale_temporaries(folder: str | Path, prefix: str = "") -> list[Path]:
    """Remove the hidden temporaries (`.<name>.tmp-<pid>...`, `.<name>.old-<pid>...`) in `folder` whose
    process is gone: what a killed export or quantize leaves. Only names starting with `.<prefix>`;
    a live process's temporaries (a concurrent run) are kept. Returns what was removed."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        m = TEMPORARY_NAME.match(entry.name)
        if m is None or not entry.name.startswith(f".{prefix}") or entry.is_symlink() or _alive(int(m.group(1))):
            continue
        _remove(entry)
        removed.append(entry)
        logger.info("removed %s (left by an interrupted run, process %s)", entry, m.group(1))
    return removed


def temporary_dir(parent: str | Path, name: str) -> Path:
    """A new hidden scratch folder `.<name>.tmp-<pid>-XXXX` in `parent` (swept once its process is gone)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent))


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def release_memory() -> None:
    """Collect garbage, then hand freed heap memory back to the OS.

    glibc keeps freed blocks below its mmap threshold (up to 32 MB each: most weight tensors) in the
    process heap, so after a 2 B model's package is run and freed the process still holds gigabytes
    it no longer uses, and the next stage's peak adds to them. Measured on the full-size f16 bundle:
    5.08 GB resident after `quantize.build_gate_data` returns, 0.77 GB after `malloc_trim(0)`. A no-op
    where glibc is absent (macOS returns freed memory on its own).
    """
    import ctypes
    import gc
    import sys

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def package_size_bytes(path: str | Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weight_file_bytes(path: str | Path) -> int:
    """Bytes of the package's weight blob(s) (`Data/com.apple.CoreML/weights/*`)."""
    weights = Path(path) / "Data" / "com.apple.CoreML" / "weights"
    return sum(f.stat().st_size for f in weights.rglob("*") if f.is_file()) if weights.exists() else 0


# --------------------------------------------------------------------------------------------
# Parity arithmetic
# --------------------------------------------------------------------------------------------


def psnr(reference: np.ndarray, produced: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) of `produced` against `reference`.

    peak = max |reference| (1.0 if the reference is all zero); identical arrays give +inf,
    any non-finite value in `produced` (where the reference is finite) gives -inf.
    """
    ref = np.asarray(reference, dtype=np.float64)
    out = np.asarray(produced, dtype=np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"psnr: shape mismatch {ref.shape} vs {out.shape}")
    if not np.all(np.isfinite(out)):
        return float("-inf")
    mse = float(np.mean((ref - out) ** 2)) if ref.size else 0.0
    if mse == 0.0:
        return float("inf")
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    if peak == 0.0:
        peak = 1.0
    return 10.0 * math.log10(peak * peak / mse)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def kl_divergence(reference_logits: np.ndarray, produced_logits: np.ndarray, axis: int = -1) -> float:
    """Mean KL(P_ref || P_out) over all rows; inputs are logits or log-probabilities."""
    lp = log_softmax(reference_logits, axis)
    lq = log_softmax(produced_logits, axis)
    if not np.all(np.isfinite(lq)):
        return float("inf")
    kl = np.sum(np.exp(lp) * (lp - lq), axis=axis)
    return float(np.mean(kl))


@dataclass
class OutputCheck:
    name: str
    shape: tuple[int, ...]
    psnr_db: float
    max_abs_err: float
    ref_max_abs: float
    passed: bool
    problem: str | None = None


@dataclass
class CorrectnessReport:
    """Per-output parity figures; `passed` only when every output reaches `min_psnr_db`."""

    min_psnr_db: float
    outputs: list[OutputCheck] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def worst_psnr_db(self) -> float:
        return min((o.psnr_db for o in self.outputs), default=float("-inf"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "min_psnr_db": self.min_psnr_db,
            "worst_psnr_db": _finite_or_str(self.worst_psnr_db),
            "outputs": [
                {**dataclasses.asdict(o), "psnr_db": _finite_or_str(o.psnr_db), "shape": list(o.shape)}
                for o in self.outputs
            ],
            **self.extra,
        }

    def summary(self) -> str:
        lines = [f"parity gate (min PSNR {self.min_psnr_db:g} dB): {'PASS' if self.passed else 'FAIL'}"]
        for o in self.outputs:
            flag = "ok " if o.passed else "BAD"
            extra = f"  ({o.problem})" if o.problem else ""
            lines.append(
                f"  {flag} {o.name:<24} {str(o.shape):<22} PSNR {o.psnr_db:8.2f} dB  "
                f"max|err| {o.max_abs_err:.3g}  max|ref| {o.ref_max_abs:.3g}{extra}"
            )
        return "\n".join(lines)

    def raise_if_failed(self, what: str = "exported program") -> None:
        if not self.passed:
            raise ParityError(f"{what} does not match PyTorch:\n{self.summary()}", report=self)


def _finite_or_str(x: float):
    return x if math.isfinite(x) else str(x)


def report_correctness(
    reference: Mapping[str, np.ndarray],
    produced: Mapping[str, np.ndarray],
    min_psnr: float,
    exact: Sequence[str] = (),
) -> CorrectnessReport:
    """Compare every reference output with the produced one.

    Args:
        reference: name -> PyTorch array.
        produced: name -> array from the exported program (extra names are ignored).
        min_psnr: threshold in dB every float output must reach.
        exact: names that must match exactly (integer outputs such as lengths).

    A missing output, a shape mismatch or a non-finite value fails that output.
    """
    report = CorrectnessReport(min_psnr_db=float(min_psnr))
    for name, ref in reference.items():
        ref = np.asarray(ref)
        if name not in produced:
            report.outputs.append(OutputCheck(name, tuple(ref.shape), float("-inf"), float("inf"),
                                              _maxabs(ref), False, "missing output"))
            continue
        out = np.asarray(produced[name])
        if out.size == ref.size and out.shape != ref.shape and np.squeeze(out).shape == np.squeeze(ref).shape:
            out = out.reshape(ref.shape)
        if out.shape != ref.shape:
            report.outputs.append(OutputCheck(name, tuple(ref.shape), float("-inf"), float("inf"),
                                              _maxabs(ref), False, f"shape {out.shape} != {ref.shape}"))
            continue
        ref64 = ref.astype(np.float64)
        out64 = out.astype(np.float64)
        finite = bool(np.all(np.isfinite(out64)))
        err = float(np.max(np.abs(ref64 - out64))) if ref.size and finite else (0.0 if finite else float("inf"))
        if name in exact:
            ok = finite and np.array_equal(ref64, out64)
            value = float("inf") if ok else float("-inf")
            report.outputs.append(OutputCheck(name, tuple(ref.shape), value, err, _maxabs(ref), ok,
                                              None if ok else "must match exactly"))
            continue
        value = psnr(ref64, out64)
        ok = finite and value >= min_psnr
        problem = None if finite else "non-finite values"
        report.outputs.append(OutputCheck(name, tuple(ref.shape), value, err, _maxabs(ref), ok, problem))
    return report


def _maxabs(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.max(np.abs(a))) if a.size else 0.0
