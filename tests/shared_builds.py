"""Session fixtures built once per test run, also when the run is split over workers.

`make test` runs pytest on parallel workers (pytest-xdist, `-n auto --dist loadfile`): each worker
is its own process with its own session, so a session fixture would be built once per worker (an
export of the trained model twice, a gated q8 bundle twice). `built_once` gives every worker the
same folder instead: the first worker to ask builds it under a file lock while the others wait,
then all read it. Run alone (plain `pytest`), it is a fresh folder of the session, as before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """Folder `name` after `build(folder)` ran on it once in this test run (see the module docstring).

    Under workers the folder lives under the run's common temporary root (`getbasetemp().parent`,
    shared by the workers of one run, fresh per run); a `<name>.complete` marker beside it is written
    only after `build` returns, so a build that failed or was killed is redone, never half-read."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent
    folder, done = root / name, root / f"{name}.complete"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.write_text("")
    return folder
