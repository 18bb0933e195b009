"""Core ML backend (macOS only): a thin wrapper over ``coremltools.models.MLModel``."""

from __future__ import annotations

import logging
import sys

import numpy as np

from .base import RuntimeModel, validate_inputs
from .errors import BackendUnavailableError, InputValidationError
from .package import PackageSpec, describe

logger = logging.getLogger(__name__)

_COMPUTE_UNITS = {
    "all": "ALL",
    "cpu_only": "CPU_ONLY",
    "cpu_and_gpu": "CPU_AND_GPU",
    "cpu_and_ne": "CPU_AND_NE",
}


def coreml_available() -> tuple[bool, str]:
    """(available, reason) for the Core ML backend on this machine."""
    if sys.platform != "darwin":
        return False, f"Core ML needs macOS (this is {sys.platform})"
    try:
        from coremltools.libcoremlpython import _MLModelProxy  # noqa: F401  # platform-only: a probe
    except Exception as exc:  # pragma: no cover - depends on the platform
        return False, f"coremltools' Core ML runtime is not importable: {exc}"
    return True, ""


class CoreMLModel(RuntimeModel):
    backend = "coreml"

    def __init__(self, pkg: PackageSpec, compute_units: str = "all"):
        ok, reason = coreml_available()
        if not ok:
            raise BackendUnavailableError(reason)
        import coremltools as ct  # platform-only (macOS) and heavy: the interpreter needs none

        if compute_units not in _COMPUTE_UNITS:
            raise ValueError(f"compute_units must be one of {sorted(_COMPUTE_UNITS)}, got {compute_units!r}")
        self.path = pkg.path
        self.function_name = pkg.function_name
        self.input_description, self.output_description, self.state_description = describe(pkg)
        kwargs = {}
        if len(pkg.function_names) > 1 or pkg.function_name != "main":
            kwargs["function_name"] = pkg.function_name
        self._model = ct.models.MLModel(
            pkg.path, compute_units=getattr(ct.ComputeUnit, _COMPUTE_UNITS[compute_units]), **kwargs
        )

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
