"""The export errors, shared by the converter (`convert`), the file installs (`files`) and the parity
arithmetic (`parity`): one leaf module, so none of those needs another just for an exception type."""

from __future__ import annotations


class ExportError(RuntimeError):
    """Conversion or saving of a Core ML package failed."""


class ExportSettingsError(ValueError):
    """Invalid export settings (precision, target, window, package path, ...)."""


class ParityError(ExportError):
    """The exported program does not match PyTorch (the parity gate refused it)."""

    def __init__(self, message: str, report=None):  # report: the GateReport (or CorrectnessReport) refused
        super().__init__(message)
        self.report = report
