"""Fault injection points for tests: a named call before every write that changes a bundle on disk.

Each place where export, quantize or `bundle finalize` writes, renames or removes a file of a bundle
calls `point(name)` first. In production the call reads one environment variable and returns: nothing
happens unless `COHERE_COREML_FAULT` or `COHERE_COREML_FAULT_TRACE` is set. Tests set them to kill the
process, or make the write fail, at one chosen point (tests/storage/test_faults.py; docs/reliability.md):

    COHERE_COREML_FAULT="<pattern>[:<k>[:<action>]]"
        pattern  fnmatch pattern on point names (`*` = any point, `install/*`, `replace/manifest.json`)
        k        fire at the k-th point (1-based, default 1) whose name matches, counted in this process
        action   kill    SIGKILL this process (no `finally`, no cleanup: what kill -9 or a power cut of
                         the process leaves)
                 enospc  raise OSError(ENOSPC), as a full disk does at that write
                 (default: kill)
    COHERE_COREML_FAULT_TRACE=<file>
        append one line per point reached, `<name>\\t<path>`: how tests enumerate the points of a command

Point names are `<step>/<file or component>`:

    stage/<component>     before a package is written to its hidden staging path (`.<c>.tmp-<pid>.mlpackage`)
    staged/<component>    the staging package complete, not installed
    install/<name>        before a finished package (or quantized bundle folder) is renamed into place
    swap/<name>           an older one moved aside (`.<name>.old-<pid>...`), the new one not yet in place
    write/<file>          before the hidden temporary of an atomically written file (`.<file>.tmp-<pid>`)
    replace/<file>        the temporary written, before it is renamed over `<file>`
    unlink/<file>         before a file is removed (the stale manifest before a bundle changes)
    copy/<folder>         before the f16 bundle's other files are copied into a quantized bundle

`point` must stay cheap and free of side effects when the variables are unset: it is called on
production paths. Nothing here is used by the product otherwise.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal

ENV = "COHERE_COREML_FAULT"
TRACE_ENV = "COHERE_COREML_FAULT_TRACE"
ACTIONS = ("kill", "enospc")

_counts: dict[str, int] = {}  # spec -> matching points reached so far in this process


class FaultSpecError(ValueError):
    """COHERE_COREML_FAULT is malformed (names the problem)."""


def parse(spec: str) -> tuple[str, int, str]:
    """(pattern, k, action) of a `COHERE_COREML_FAULT` value."""
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise FaultSpecError(f"{ENV}={spec!r}: expected <pattern>[:<k>[:<action>]]")
    try:
        k = int(parts[1]) if len(parts) > 1 and parts[1] else 1
    except ValueError:
        raise FaultSpecError(f"{ENV}={spec!r}: k must be an integer, got {parts[1]!r}") from None
    action = parts[2] if len(parts) > 2 else "kill"
    if k < 1 or action not in ACTIONS:
        raise FaultSpecError(f"{ENV}={spec!r}: k must be >= 1 and the action one of {ACTIONS}")
    return parts[0], k, action


def point(name: str, path: str | os.PathLike | None = None) -> None:
    """A fault point: the process is about to change `path` (`name`: see the module docstring)."""
    spec = os.environ.get(ENV)
    trace = os.environ.get(TRACE_ENV)
    if not spec and not trace:
        return
    if trace:
        with open(trace, "a", encoding="utf-8") as f:
            f.write(f"{name}\t{'' if path is None else os.fspath(path)}\n")
    if not spec:
        return
    pattern, k, action = parse(spec)
    if not fnmatch.fnmatchcase(name, pattern):
        return
    _counts[spec] = _counts.get(spec, 0) + 1
    if _counts[spec] != k:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {ENV} at {name})",
                  None if path is None else os.fspath(path))


def reset() -> None:
    """Forget the points counted so far (a forked or in-process test run starts from zero)."""
    _counts.clear()
