"""Cohere Transcribe -> Core ML conversion toolkit.

One folder per stage (runtime, storage, model, bundle, inference, export, evaluation, publish, quantize;
README "Layout"); each folder's `__init__` docstring lists its modules and the stages it may import.
"""

from __future__ import annotations

import subprocess
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

