"""One of the racing processes of tests/runtime/test_compiled_cache.py: `rounds` times, meet the other
processes at a file barrier, then compile (a stand-in: the package copied into a new temporary
folder, as Core ML's compiler makes a new `.mlmodelc`) and load (every file of the installed entry read,
its marker checked) the same package through a fresh `CompiledCache` of that round's folder. Prints one
JSON line: the failures, with their errors. Standard library only (no torch, no coremltools).

    python cache_race.py CACHE_ROOT PACKAGE ROUNDS PROCESSES INDEX
"""

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cohere_coreml.runtime.compiled_cache import COMPLETE_MARKER, CompiledCache


def barrier(folder: Path, name: str, index: int, processes: int, timeout: float = 60.0) -> None:
    (folder / f"{name}-{index}").touch()
    deadline = time.monotonic() + timeout
    while sum((folder / f"{name}-{i}").exists() for i in range(processes)) < processes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: the other processes did not arrive")
        time.sleep(0.0005)


def main() -> int:
    root, package, rounds, processes, index = Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    sync = root / "sync"
    sync.mkdir(parents=True, exist_ok=True)
    expected = sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file())
    failures = []

    def compile_copy(path: str) -> str:
        out = Path(tempfile.mkdtemp(prefix="race-compile-")) / "model.mlmodelc"
        shutil.copytree(path, out)
        return str(out)

    for r in range(rounds):
        barrier(sync, f"round{r}", index, processes)
        try:
            entry = CompiledCache(root / f"cache{r}", max_bytes=None).compiled(package, compile_copy)
            for _ in range(3):  # a load reads the compiled model's files, and a later load reads them again
                if not (entry / COMPLETE_MARKER).is_file():
                    raise RuntimeError(f"{entry} has no {COMPLETE_MARKER}")
                got = sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*")
                             if p.is_file() and p.name != COMPLETE_MARKER)
                if got != expected:
                    raise RuntimeError(f"{entry} holds {len(got)} of the package's {len(expected)} files")
                for name in got:
                    (entry / name).read_bytes()
        except Exception as exc:  # noqa: BLE001 - every failure is counted and named
            failures.append(f"round {r}: {type(exc).__name__}: {exc}")
    print(json.dumps({"index": index, "pid": os.getpid(), "failures": failures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
