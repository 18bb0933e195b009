"""Exceptions raised by :mod:`cohere_coreml.runtime`."""

from __future__ import annotations


class RuntimeBackendError(RuntimeError):
    """Base class: a package cannot be loaded or run by the chosen backend."""


class PackageLoadError(RuntimeBackendError):
    """The path is not a readable ML program package, or the function does not exist."""


class UnsupportedOpError(RuntimeBackendError):
    """The MIL interpreter does not implement some op types of the chosen function.

    Raised at load time, before anything runs. ``op_types`` lists every unsupported op type,
    ``function_name`` names the function that uses them.
    """

    def __init__(self, function_name: str, op_types: list[str]):
        self.function_name = function_name
        self.op_types = sorted(set(op_types))
        super().__init__(
            f"function {function_name!r} uses op types the MIL interpreter does not support: "
            + ", ".join(self.op_types)
        )


class BackendUnavailableError(RuntimeBackendError):
    """The requested backend cannot run on this machine (e.g. Core ML off macOS)."""


class InputValidationError(RuntimeBackendError, ValueError):
    """``predict`` was given a missing, unexpected, or wrongly shaped / typed input or state."""
