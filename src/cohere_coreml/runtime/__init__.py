"""Run exported ``.mlpackage`` files: Core ML on macOS, the project's MIL interpreter elsewhere.

    from cohere_coreml.runtime import load_model
    m = load_model("encoder.mlpackage")            # backend="auto" | "coreml" | "mil"
    out = m.predict({"input_features": feats})     # dict name -> np.ndarray
    st = m.make_state(); m.predict(inputs, state=st)

See docs/runtime.md.

Takes: a `.mlpackage` path (and a function name), input arrays, a state.
Gives: output arrays and states, through one interface whichever backend runs them.
May import: nothing of the package (its own errors only).
"""

from __future__ import annotations

import logging
import os

from .base import RuntimeModel
from .coreml_backend import CoreMLModel, coreml_available, macos_version, package_needs
from .errors import (
    BackendUnavailableError,
    InputValidationError,
    PackageLoadError,
    RuntimeBackendError,
    UnsupportedOpError,
)
from .package import read_package

BACKENDS = ("auto", "coreml", "mil")

logger = logging.getLogger(__name__)
_noticed: set[str] = set()  # the reasons "auto" chose the interpreter on a Mac, said once per process


def load_model(
    path: str | os.PathLike,
    backend: str = "auto",
    function_name: str | None = None,
    compute_units: str = "all",
    num_threads: int | None = None,
    cache=None,
) -> RuntimeModel:
    """Load one function of an ML program package.

    Args:
        path: ``.mlpackage`` directory.
        backend: "coreml" (macOS only), "mil" (the interpreter, any platform), or "auto"
            (Core ML when this Mac's macOS runs the package's program, else the interpreter; on a
            Mac, the reason is logged once as a warning). "coreml" where Core ML cannot run the
            program raises `BackendUnavailableError` naming the macOS version it needs.
        function_name: function of a multifunction package (default: its default function).
        compute_units: Core ML compute units: "all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"
            (ignored by the interpreter).
        num_threads: interpreter only: torch threads for the large ops (default: the caller's
            ``torch.get_num_threads()``); small ops always run on one thread. Restored after
            each ``predict``.
        cache: Core ML only: the `compiled_cache.CompiledCache` to compile into (default: the
            process's cache of the user's folder, `coreml_backend.shared_cache()`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    pkg = read_package(path, function_name)
    if backend == "auto":
        ok, reason = coreml_available(package_needs(pkg))
        backend = "coreml" if ok else "mil"
        if not ok and macos_version() is not None and reason not in _noticed:
            _noticed.add(reason)
            logger.warning("%s: using the interpreter", reason)
    if backend == "coreml":
        return CoreMLModel(pkg, compute_units=compute_units, cache=cache)
    from .interpreter import MilModel  # imports torch: loaded on first use, not with the package

    return MilModel(pkg, num_threads=num_threads)


_INTERPRETER_NAMES = ("MilModel", "MilState", "supported_op_types")


def __getattr__(name: str):
    """The interpreter's names, imported on first access (it imports torch; the rest of the package does not)."""
    if name in _INTERPRETER_NAMES:
        from . import interpreter

        return getattr(interpreter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "load_model",
    "RuntimeModel",
    "MilModel",
    "MilState",
    "CoreMLModel",
    "coreml_available",
    "supported_op_types",
    "RuntimeBackendError",
    "UnsupportedOpError",
    "PackageLoadError",
    "InputValidationError",
    "BackendUnavailableError",
]
