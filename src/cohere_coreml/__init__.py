"""Cohere Transcribe -> Core ML conversion toolkit.

One folder per stage (runtime, storage, model, bundle, inference, export, evaluation, publish, quantize;
README "Layout"). The module paths from before the folders (`cohere_coreml.transcribe`, ...) still import,
with a DeprecationWarning naming the new path; `cohere_coreml.bundle`, `.export` and `.publish`, which were
modules and are now folders, still give the names those modules had.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

__version__ = "0.1.0"


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


# module paths before the stage folders (issue 28) -> where the module is now
MOVED_MODULES = {
    "checkpoint": "model.checkpoint", "reference": "model.reference", "audio": "model.audio",
    "shapes": "model.shapes", "tokens": "model.tokens",
    "integrity": "storage.integrity", "files": "storage.files", "faults": "storage.faults",
    "ane_check": "bundle.ane_check",
    "decoding": "inference.decoding", "decoder_runtime": "inference.decoder_runtime",
    "encoder_runtime": "inference.encoder_runtime", "engines": "inference.engines", "longform": "inference.longform",
    "streaming": "inference.streaming", "transcribe": "inference.transcribe",
    "convert": "export.convert", "multifunction": "export.multifunction", "encoder": "export.encoder",
    "decoder": "export.decoder", "frontend": "export.frontend", "gate": "export.gate",
    "decoder_gate": "export.decoder_gate", "parity": "export.parity", "memory": "export.memory",
    "bench": "evaluation.bench", "verify": "evaluation.verify", "metrics": "evaluation.metrics",
    "datasets": "evaluation.datasets",
}
# the modules that became folders of the same name -> the folder's modules that hold their names
REPLACED_MODULES = {
    "bundle": ("format", "packages", "manifest", "checks", "package_checks", "load"),
    "export": ("pipeline",),
    "publish": ("hub", "card"),
}


def replaced_module_attribute(package: str, name: str):
    """`cohere_coreml.bundle.Bundle` and the like: a name of the module a folder replaced, looked up in the
    folder's modules (imported on first use; the folder's `__getattr__` calls this)."""
    if not name.startswith("__"):
        for module in REPLACED_MODULES[package.rsplit(".", 1)[-1]]:
            found = getattr(importlib.import_module(f"{package}.{module}"), name, None)
            if found is not None:
                return found
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `cohere_coreml.<old path>` as the module at its new path (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(__name__) + 1:] if fullname.startswith(__name__ + ".") else None
        return importlib.util.spec_from_loader(fullname, self) if old in MOVED_MODULES else None

    def create_module(self, spec):
        new = f"{__name__}.{MOVED_MODULES[spec.name[len(__name__) + 1:]]}"
        warnings.warn(f"{spec.name} is now {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):  # the module at the new path is already executed
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
