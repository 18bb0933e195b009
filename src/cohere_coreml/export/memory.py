"""Process memory: hand the heap a freed model leaves back to the OS between stages (export, quantize)."""

from __future__ import annotations

import ctypes
import gc
import sys


def release_memory() -> None:
    """Collect garbage, then hand freed heap memory back to the OS.

    glibc keeps freed blocks below its mmap threshold (up to 32 MB each: most weight tensors) in the
    process heap, so after a 2 B model's package is run and freed the process still holds gigabytes
    it no longer uses, and the next stage's peak adds to them; `malloc_trim(0)` returns most of it
    (the full-size figures: docs/quantization.md). A no-op where glibc is absent (macOS returns freed
    memory on its own).
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass
