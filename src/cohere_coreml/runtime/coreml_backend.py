"""Core ML backend (macOS): each package compiled once (`compiled_cache`), each function loaded from
the compiled model with coremltools' `CompiledMLModel`.

What coremltools 9.0 provides (read in its source, coremltools/models/utils.py and _compiled_model.py):
`utils.compile_model(model: str, destination_path=None) -> str` compiles an `.mlpackage` with Core ML
(`_MLModelProxy.compileModel`) into a new temporary `.mlmodelc` folder; `CompiledMLModel(path: str,
compute_units=ComputeUnit.ALL, function_name=None, optimization_hints=None, asset=None)` loads one
function of a compiled model (None: the default function), with `predict(data, state=None)` and
`make_state()` as `MLModel`'s. `MLModel(path.mlpackage, function_name=...)` instead compiles the whole
package again on every load (a temporary `.mlmodelc` per object): minutes per function at full size.
A decoder's state made by one function is passed to the others' `predict` (one state per window).
On Linux the same code runs over tests/coreml_interpreter_shim.py, an emulation of the native layer
coremltools calls (`libcoremlpython._MLModelProxy`) that forwards predictions to the interpreter.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading

import numpy as np

from .base import RuntimeModel, validate_inputs
from .compiled_cache import CompiledCache
from .errors import BackendUnavailableError, InputValidationError, PackageLoadError
from .package import PackageSpec, describe

logger = logging.getLogger(__name__)

_COMPUTE_UNITS = {
    "all": "ALL",
    "cpu_only": "CPU_ONLY",
    "cpu_and_gpu": "CPU_AND_GPU",
    "cpu_and_ne": "CPU_AND_NE",
}


_caches: dict[str, CompiledCache] = {}
_caches_lock = threading.Lock()


def shared_cache(folder=None) -> CompiledCache:
    """The process's `CompiledCache` of `folder` (default: `compiled_cache.default_cache_dir()`)."""
    cache = CompiledCache(folder)
    with _caches_lock:
        return _caches.setdefault(str(cache.folder), cache)


# Core ML specification version of a program -> the first macOS that runs it (coremltools'
# `_SPECIFICATION_VERSION_IOS_16/17/18` are 7/8/9; coremltools.target: iOS16 == macOS13, iOS17 ==
# macOS14, iOS18 == macOS15). A newer specification than listed needs a newer macOS than the last one.
MACOS_FOR_SPECIFICATION = {5: (12, 0), 6: (12, 0), 7: (13, 0), 8: (14, 0), 9: (15, 0)}


def macos_for_specification(version: int) -> tuple[int, ...]:
    """The first macOS whose Core ML runs programs of specification `version`."""
    if version in MACOS_FOR_SPECIFICATION:
        return MACOS_FOR_SPECIFICATION[version]
    newest = max(MACOS_FOR_SPECIFICATION)
    if version > newest:
        return (MACOS_FOR_SPECIFICATION[newest][0] + version - newest, 0)
    return (0,)


def _native():
    return sys.modules.get("coremltools.libcoremlpython")


def macos_version() -> tuple[int, ...] | None:
    """This Mac's macOS version (under the tests' emulation: the version it declares), None off macOS."""
    native = _native()
    if getattr(native, "EMULATION", False):
        return tuple(getattr(native, "MACOS_VERSION", (15, 0)))
    if sys.platform != "darwin":
        return None
    release = platform.mac_ver()[0]
    try:
        return tuple(int(part) for part in release.split("."))
    except ValueError:
        return None


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in (version if len(version) > 1 else (*version, 0)))


def coreml_available(needs: tuple[int, ...] | None = None, what: str = "these packages") -> tuple[bool, str]:
    """(available, reason) for the Core ML backend on this machine (or under the tests' emulation of
    coremltools' native layer, which declares itself with `EMULATION` on `coremltools.libcoremlpython`);
    `needs`: the macOS version the programs to run need (`macos_for_specification`)."""
    version = macos_version()
    if version is None:
        return False, f"Core ML needs macOS (this is {sys.platform})"
    if needs is not None and version < tuple(needs):
        return False, (f"Core ML on macOS {version_text(version)} is too old for {what} (macOS "
                       f"{version_text(tuple(needs))} or later needed)")
    if getattr(_native(), "EMULATION", False):
        return True, ""
    try:
        from coremltools.libcoremlpython import _MLModelProxy  # noqa: F401  # platform-only: a probe
    except Exception as exc:  # pragma: no cover - depends on the platform
        return False, f"coremltools' Core ML runtime is not importable: {exc}"
    return True, ""


def package_needs(pkg: PackageSpec) -> tuple[int, ...]:
    """The macOS version `pkg`'s program needs (from its specification version)."""
    return macos_for_specification(int(pkg.spec.specificationVersion))


class CoreMLModel(RuntimeModel):
    backend = "coreml"

    def __init__(self, pkg: PackageSpec, compute_units: str = "all", cache: CompiledCache | None = None):
        ok, reason = coreml_available(package_needs(pkg), what=os.path.basename(os.path.normpath(pkg.path)))
        if not ok:
            raise BackendUnavailableError(reason)
        import coremltools as ct  # platform-only (macOS) and heavy: the interpreter needs none
        from coremltools.models.utils import compile_model  # as above

        if compute_units not in _COMPUTE_UNITS:
            raise ValueError(f"compute_units must be one of {sorted(_COMPUTE_UNITS)}, got {compute_units!r}")
        self.path = pkg.path
        self.function_name = pkg.function_name
        self.input_description, self.output_description, self.state_description = describe(pkg)
        self.cache = cache if cache is not None else shared_cache()
        try:
            self.compiled_path = self.cache.compiled(pkg.path, compile_model)
        except Exception as exc:  # Core ML's compiler error (RuntimeError / Exception from coremltools)
            raise PackageLoadError(f"Core ML cannot compile {pkg.path}: {exc}") from exc
        # a single-function program is loaded by its default function (name None), as MLModel does
        function = pkg.function_name if len(pkg.function_names) > 1 or pkg.function_name != "main" else None
        self._model = ct.models.CompiledMLModel(str(self.compiled_path), compute_units=getattr(
            ct.ComputeUnit, _COMPUTE_UNITS[compute_units]), function_name=function)

    def make_state(self):
        if not self.state_description:
            raise InputValidationError(f"function {self.function_name!r} has no state")
        return self._model.make_state()

    def predict(self, inputs: dict, state=None) -> dict[str, np.ndarray]:
        arrays = validate_inputs(inputs, self.input_description)
        if self.state_description and state is None:
            raise InputValidationError(
                f"function {self.function_name!r} is stateful; pass state=model.make_state()"
            )
        out = self._model.predict(arrays, state=state) if state is not None else self._model.predict(arrays)
        return {
            name: np.asarray(out[name]).astype(np_dtype, copy=False)
            for name, (_, np_dtype) in self.output_description.items()
        }
