"""One parity gate for every exported component.

A component's gate runs its package (through `cohere_coreml.runtime`) on a set of cases, compares
with a reference, and returns a `GateReport`: pass/fail, a headline for people, the figures, the
per-case details. `export_gated` is the one way a package is written: to a temporary path, gated,
renamed into place only when the gate passes; the report goes next to it as
`<component>.parity.json` (or `<component>.parity-failed.json` when refused, leaving any older
package and report untouched).

A new component plugs in with a writer (temp path -> package) and a gate (package path ->
GateReport). Single-call programs (the encoder, a front end) build `GateCase`s (inputs +
reference outputs) and use `compare_cases` (PSNR per output, exact integer outputs); stateful or
sequence programs (the decoder) compute their own figures and wrap them in a `GateReport`.
Gate audio ships with the package (`default_gate_audio`), so an installed wheel gates on speech.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..export_errors import ParityError
from ..storage import faults
from ..storage.files import (
    install_package,
    remove_package,
    skip_installed,
    staging_path,
    temporary_dir,
    write_json_atomic,
)
from ..storage.integrity import invalidate_manifest
from .convert import ExportSettings
from .parity import report_correctness

logger = logging.getLogger(__name__)

GATE_AUDIO_PACKAGE_DIR = ("data", "gate_audio")
# the gate of a whole bundle on a held-out set (greedy tokens / WER vs PyTorch; cohere-coreml
# quantize): its report follows the same convention, `heldout.parity.json`
HELDOUT_COMPONENT = "heldout"


@dataclass
class GateReport:
    """The outcome of one component's gate (written as `<component>.parity.json`).

    `details` are the component's figures (thresholds, worst PSNR, KL, ...), flattened into the
    JSON; `cases` the per-case figures; `functions` one report per function of a multifunction
    package (the report passes only when every function passes).
    """

    component: str
    passed: bool
    headline: str  # one line for people: the figures that decided pass/fail
    details: dict[str, Any] = field(default_factory=dict)
    cases: list[dict[str, Any]] = field(default_factory=list)
    functions: dict[str, GateReport] = field(default_factory=dict)
    text: str = ""  # longer human-readable detail (per-output tables), printed by the CLI
    skipped: bool = False

    @classmethod
    def skipped_gate(cls, component: str) -> GateReport:
        return cls(component=component, passed=False, headline="gate skipped (--skip-verify)", skipped=True)

    @classmethod
    def of_functions(cls, component: str, reports: Mapping[str, GateReport], **details) -> GateReport:
        """One report for a multifunction package from its functions' reports."""
        return cls(
            component=component,
            passed=bool(reports) and all(r.passed for r in reports.values()),
            headline="; ".join(f"{fn}: {r.headline}" for fn, r in reports.items()),
            details=dict(details),
            functions=dict(reports),
            text="\n".join(f"[{fn}]\n{r.text}" for fn, r in reports.items() if r.text),
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"component": self.component, "passed": self.passed, "headline": self.headline,
                                **self.details}
        if self.skipped:
            data["skipped"] = True
        if self.cases:
            data["cases"] = self.cases
        if self.functions:
            data["functions"] = {fn: r.to_dict() for fn, r in self.functions.items()}
        return data

    def summary(self) -> str:
        return f"{self.component} parity: {'PASS' if self.passed else ('SKIPPED' if self.skipped else 'FAIL')} - {self.headline}"

    def raise_if_failed(self, package: str | Path) -> None:
        if not self.passed:
            raise ParityError(f"{self.component} parity gate refused {package}: {self.headline}\n{self.text}".rstrip(),
                              report=self)


# --------------------------------------------------------------------------------------------
# Writing a gated package
# --------------------------------------------------------------------------------------------


# A gate prepared before the package is read: `prepare()` computes the reference outputs (with the
# PyTorch model, while it is loaded) and returns `gate(package_path) -> GateReport`, which needs
# nothing but those outputs. So the model can be released before the package is loaded to be gated.
GatePreparer = Callable[[], Callable[[Path], GateReport]]


@dataclass
class StagedPackage:
    """A component's package written to its temporary path, its gate's references computed.

    `finish()` gates it and renames it into place (or refuses it); `discard()` removes it. The
    gate closure holds only numpy references, never the PyTorch model or the converted program.
    """

    component: str
    settings: ExportSettings
    tmp: Path
    gate: Callable[[Path], GateReport] | None  # None: --skip-verify
    # further packages the same writer wrote and the same gate judged, installed with this one:
    # (staging path, installed path) (an encoder in parts: encoder_part2.mlpackage ...)
    companions: list[tuple[Path, Path]] = field(default_factory=list)
    # installed packages the new ones supersede, removed when they are installed (a re-export in fewer parts)
    replaces: list[Path] = field(default_factory=list)
    convert_seconds: float | None = None  # the staging's time, shown on the gate's verdict line

    def _remove_staged(self) -> None:
        remove_package(self.tmp)
        for staged, _ in self.companions:
            remove_package(staged)

    def finish(self) -> GateReport:
        """Gate the staged package; install it and write `<component>.parity.json` when it passes.

        Raises `ParityError` when refused: the package is removed, the figures go to
        `<component>.parity-failed.json`, an older package and report stay untouched.
        """
        component, settings = self.component, self.settings
        path = settings.package_path(component)
        try:
            if self.gate is None:
                logger.warning("%s parity gate skipped (--skip-verify)", component)
                report = GateReport.skipped_gate(component)
            else:
                t0 = time.perf_counter()
                report = self.gate(self.tmp)
                seconds = time.perf_counter() - t0
                converted = f"converted in {self.convert_seconds:.1f} s, " if self.convert_seconds is not None else ""
                # the one line per package at the default verbosity; its cases at DEBUG and in the parity file
                logger.info("%s (%sgated in %.1f s)", report.summary(), converted, seconds)
                report.raise_if_failed(path)
        except ParityError as err:
            self._remove_staged()
            failed = err.report.to_dict() if isinstance(err.report, GateReport) else {"component": component,
                                                                                       "passed": False}
            write_json_atomic({**failed, "error": str(err)}, settings.failed_report_path(component))
            raise
        except BaseException:
            self._remove_staged()
            raise
        finally:
            self.gate = None  # its references are not needed any more
        # the order a kill at any point can interrupt: no manifest over changing files, no report of
        # another package (a package without its report is exported again: `files.skip_installed`)
        try:
            invalidate_manifest(settings.out_dir)
            settings.report_path(component).unlink(missing_ok=True)
            for old in self.replaces:
                remove_package(old)
        except BaseException:
            self._remove_staged()
            raise
        staged = [(self.tmp, path), *self.companions]
        for i, (tmp, target) in enumerate(staged):
            try:
                install_package(tmp, target)  # removes the staging package itself when it fails
            except BaseException:
                for rest, _ in staged[i + 1 :]:
                    remove_package(rest)
                raise
        recorded = report.to_dict()
        if settings.checkpoint_digest is not None:  # what `files.skip_installed` compares on the next export
            recorded["checkpoint_digest"] = settings.checkpoint_digest
        write_json_atomic(recorded, settings.report_path(component))
        settings.failed_report_path(component).unlink(missing_ok=True)
        return report

    def discard(self) -> None:
        self._remove_staged()
        self.gate = None


def stage_gated(component: str, settings: ExportSettings, write: Callable[[Path], Any],
                prepare: GatePreparer, companions: Sequence[tuple[Path, Path]] = (),
                replaces: Sequence[Path] = (), installed: Callable[[], bool] | None = None) -> StagedPackage | None:
    """First half of `export_gated`: `write(tmp_path)`, then `prepare()` the gate's references.

    Returns None when the package and its report exist and `settings.force` is off (skipped;
    `installed()` decides instead when given). `write` should build what it saves (trace, convert)
    itself, so nothing of the conversion outlives it; the gate is not prepared under
    `settings.skip_verify`. `companions` / `replaces`: see `StagedPackage` (`write` writes the companions'
    staging paths too).
    """
    path = settings.package_path(component)
    tmp = staging_path(path)
    if installed() if installed is not None else skip_installed(settings, component):
        return None
    staged = StagedPackage(component=component, settings=settings, tmp=tmp, gate=None,
                           companions=list(companions), replaces=list(replaces))
    staged.discard()  # staging leftovers of this process
    try:
        faults.point(f"stage/{component}", tmp)
        write(tmp)
        faults.point(f"staged/{component}", tmp)
        staged.gate = None if settings.skip_verify else prepare()
    except BaseException:
        staged.discard()
        raise
    return staged


def export_gated(component: str, settings: ExportSettings, write: Callable[[Path], Any],
                 gate: Callable[[Path], GateReport]) -> GateReport | None:
    """Write `<component>.mlpackage` with `write(tmp_path)`, gate it, rename it into place.

    Returns the gate report (also written as `<component>.parity.json`), or None when the package
    exists and `settings.force` is off (skipped). Raises `ParityError` when the gate refuses the
    package: nothing is renamed into place and the figures go to `<component>.parity-failed.json`.
    (`stage_gated` + `StagedPackage.finish`; use those to compute references before the package
    is loaded and free the PyTorch model in between.)
    """
    staged = stage_gated(component, settings, write, lambda: gate)
    return None if staged is None else staged.finish()


# --------------------------------------------------------------------------------------------
# Where a gate runs the package
# --------------------------------------------------------------------------------------------


class GateLoader:
    """Loads the packages of one gate on the export's `gate_units` (`convert.GATE_UNITS`).

    "auto" runs Core ML on the CPU where this machine's Core ML runs the package (macOS 15 for the
    packages' target), else the interpreter: the CPU is one unit on every run (the verdict does not
    depend on which unit Core ML picks), compiles quickly (a Neural Engine compile takes minutes at
    full size) and still puts the program through Core ML's own compiler and runtime; "all" or
    "cpu_and_ne" check the units an app will run, "interpreter" the same numbers as on Linux.
    Core ML compiles into a private cache beside the package (`.gate-compiled.tmp-<pid>-...`, swept
    if the process is killed) that `close()` removes: a gate never writes into the user's
    compiled-model cache, where a staging package's content name would be new on every export.
    """

    def __init__(self, units: str, beside: str | Path):
        self.units = units
        self.beside = Path(beside)
        self._cache = None
        self._choices: dict[str, tuple[str, str]] = {}  # package -> (backend, compute units)

    def __enter__(self) -> GateLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def choice(self, package: str | Path) -> tuple[str, str]:
        """(backend, compute units) for `package`."""
        from ..runtime.coreml_backend import coreml_available, package_needs  # as `load`
        from ..runtime.package import read_package

        if self.units == "interpreter":
            return "mil", "all"
        if self.units != "auto":
            return "coreml", self.units  # asked for: Core ML or a one-line error saying why not
        key = str(package)
        if key not in self._choices:  # the package's spec read once per gate, however often it loads
            ok = coreml_available(package_needs(read_package(package)))[0]
            self._choices[key] = ("coreml", "cpu_only") if ok else ("mil", "all")
        return self._choices[key]

    def runtime_options(self, package: str | Path) -> dict[str, Any]:
        """`backend`, `compute_units` and `cache` for `runtime.load_model` / `DecoderRuntime.load`."""
        backend, units = self.choice(package)
        return {"backend": backend, "compute_units": units, "cache": self._private_cache() if backend == "coreml" else None}

    def load(self, package: str | Path, function_name: str | None = None):
        from ..runtime import load_model  # cohere_coreml.runtime imports torch; gate loads without it

        return load_model(str(package), function_name=function_name, **self.runtime_options(package))

    def describe(self, package: str | Path) -> str:
        backend, units = self.choice(package)
        return f"Core ML {units}" if backend == "coreml" else "interpreter"

    def _private_cache(self):
        from ..runtime.compiled_cache import CompiledCache

        if self._cache is None:
            self.beside.mkdir(parents=True, exist_ok=True)
            self._cache = CompiledCache(temporary_dir(self.beside, "gate-compiled"), max_bytes=None)
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            shutil.rmtree(self._cache.folder, ignore_errors=True)
            self._cache = None


# --------------------------------------------------------------------------------------------
# Single-call programs: cases of inputs and reference outputs
# --------------------------------------------------------------------------------------------


@dataclass
class GateCase:
    """One call of a program: its inputs, the reference outputs, and figures describing the case."""

    inputs: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)


def compare_cases(component: str, package: str | Path, cases: Sequence[GateCase], min_psnr_db: float,
                  exact: Sequence[str] = (), function_name: str | None = None, units: str = "auto",
                  details: Mapping[str, Any] | None = None) -> GateReport:
    """Run `package` on every case (on `units`: `GateLoader`); every reference output must reach
    `min_psnr_db` (names in `exact` must match exactly). Per-case figures come from
    `parity.report_correctness`."""
    if not cases:
        raise ValueError(f"{component} gate has no cases")
    with GateLoader(units, Path(package).parent) as loader:
        return _compare_loaded(component, loader.load(package, function_name), cases, min_psnr_db, exact,
                               function_name, {"runs_on": loader.describe(package), **(details or {})})


def _compare_loaded(component, loaded, cases, min_psnr_db, exact, function_name, details) -> GateReport:
    where = f" function {function_name}" if function_name else ""
    results, texts = [], []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        produced = loaded.predict(case.inputs)
        seconds = time.perf_counter() - t0
        report = report_correctness(case.reference, produced, min_psnr_db, exact=exact)
        report.extra.update({"case": i, **case.info, "predict_seconds": round(seconds, 3)})
        info = " ".join(f"{k}={v}" for k, v in case.info.items() if not isinstance(v, (dict, list)))
        texts.append(f"[{component} gate]{where} case {i} {info}\n{report.summary()}")
        logger.debug("%s", texts[-1])  # also in <component>.parity.json ("cases")
        results.append(report)
    worst = min(r.worst_psnr_db for r in results)
    passed = all(r.passed for r in results)
    return GateReport(
        component=component,
        passed=passed,
        headline=f"worst PSNR {worst:.1f} dB over {len(results)} case(s) (need {min_psnr_db:g} dB)",
        details={
            "package": f"{component}.mlpackage",
            "function": function_name or "main",
            "min_psnr_db": float(min_psnr_db),
            "worst_psnr_db": worst if math.isfinite(worst) else str(worst),
            "backend": type(loaded).__name__,
            **(details or {}),
        },
        cases=[r.to_dict() for r in results],
        text="\n".join(texts),
    )


# --------------------------------------------------------------------------------------------
# Gate audio
# --------------------------------------------------------------------------------------------


def default_gate_audio(max_clips: int | None = None) -> list[Path]:
    """Speech clips shipped with the package (`cohere_coreml/data/gate_audio`), sorted by name."""
    folder = resources.files("cohere_coreml").joinpath(*GATE_AUDIO_PACKAGE_DIR)
    clips = sorted((Path(str(f)) for f in folder.iterdir() if f.name.endswith((".flac", ".wav"))),
                   key=lambda p: p.name)
    return clips[:max_clips] if max_clips is not None else clips
