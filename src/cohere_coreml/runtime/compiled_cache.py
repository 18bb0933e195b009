"""The compiled-model cache of the Core ML backend: each `.mlpackage` compiled once into a folder named
after its content, then every function of it loaded from that compiled model.

    cache = CompiledCache()                  # $COHERE_COREML_CACHE, else <Caches>/CohereTranscribe/compiled
    path = cache.compiled(package, compile)  # the cached .mlmodelc, compiled by `compile` only when missing

The naming rule is the Swift package's (`CoreMLRuntime.cachedLocation(for:)` / `digest(of:)` in
swift/Sources/CohereTranscribe/Runtime/CoreMLRuntime.swift): `<cache>/<package name>-<digest[:24]>.mlmodelc`,
where the digest is the hex sha256 of the sorted lines `"<package>/<file>\\t<sha256>\\t<size>"` of the
bundle manifest's checksums (`manifest.json` beside the package), else of the package's file table
`"<package>/<file>\\t<size>\\t<mtime>"` (this fallback names the same files the same way within one
language; across Swift and Python only the manifest rule is sure to agree, since the two read and print
modification times each their own way). A compiled model is installed complete or not at all: staged beside
its target, marked `.complete`, renamed (a process killed midway leaves nothing that looks complete).
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "COHERE_COREML_CACHE"  # overrides the default cache folder
COMPLETE_MARKER = ".complete"
DIGEST_PREFIX = 24  # hex characters of the digest in a compiled model's name


def default_cache_dir() -> Path:
    """`$COHERE_COREML_CACHE`, else the user's Caches (macOS: ~/Library/Caches; elsewhere $XDG_CACHE_HOME
    or ~/.cache) / CohereTranscribe / compiled: the Swift package's default folder on a Mac."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        caches = Path.home() / "Library" / "Caches"
    else:
        caches = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return caches / "CohereTranscribe" / "compiled"


def _manifest_lines(package: Path) -> list[str]:
    try:
        manifest = json.loads((package.parent / "manifest.json").read_text(encoding="utf-8"))
        files = manifest["checksums"]["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(files, dict):
        return []
    prefix = package.name + "/"
    return [f"{path}\t{entry.get('sha256', '') if isinstance(entry, dict) else ''}\t"
            f"{entry.get('size', -1) if isinstance(entry, dict) else -1}"
            for path, entry in files.items() if path.startswith(prefix)]


def _file_table_lines(package: Path) -> list[str]:
    lines = []
    for root, _dirs, names in os.walk(package):
        for name in names:
            path = Path(root) / name
            if not path.is_file():
                continue
            st = path.stat()
            lines.append(f"{package.name}/{path.relative_to(package).as_posix()}\t{st.st_size}\t{float(st.st_mtime)!r}")
    return lines


def package_digest(package: str | os.PathLike) -> str:
    """Hex sha256 naming `package`'s content (the Swift package's `CoreMLRuntime.digest(of:)` rule)."""
    package = Path(package)
    if not package.is_dir():
        raise FileNotFoundError(f"model package not found: {package}")
    lines = _manifest_lines(package) or _file_table_lines(package)
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


class CompiledCache:
    """Compiled models of packages, by content, in one folder; counts what this process compiled."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        self.compiles = 0  # packages compiled by this object
        self.hits = 0  # loads served from the cache

    def location(self, package: str | os.PathLike) -> Path:
        package = Path(package)
        stem = package.name[: -len(".mlpackage")] if package.name.endswith(".mlpackage") else package.stem
        return self.folder / f"{stem}-{package_digest(package)[:DIGEST_PREFIX]}.mlmodelc"

    def compiled(self, package: str | os.PathLike, compile_package: Callable[[str], str]) -> Path:
        """The compiled model of `package`: the cached one, else `compile_package(path)` (which returns
        a new temporary `.mlmodelc` folder, as `coremltools.models.utils.compile_model` does) moved in."""
        target = self.location(package)
        if (target / COMPLETE_MARKER).is_file():
            self.hits += 1
            return target
        logger.info("compiling %s for Core ML (once; cached as %s)", Path(package).name, target)
        fresh = Path(compile_package(os.fspath(package)))
        self.compiles += 1
        install(fresh, target)
        return target


def install(compiled: Path, target: Path) -> None:
    """Moves a freshly compiled model to `target`: staged beside it, marked complete, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    shutil.move(os.fspath(compiled), os.fspath(staging))
    (staging / COMPLETE_MARKER).write_bytes(b"")
    if target.exists():  # an incomplete leftover of a killed process
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / COMPLETE_MARKER).is_file():  # else another process installed the same content
            raise
