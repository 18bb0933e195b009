"""The compiled-model cache of the Core ML backend: each `.mlpackage` compiled once into a folder named
after its content, then every function of it loaded from that compiled model.

    cache = CompiledCache()                  # $COHERE_COREML_CACHE, else <Caches>/CohereTranscribe/compiled
    path = cache.compiled(package, compile)  # the cached .mlmodelc, compiled by `compile` only when missing
    entries(cache.folder); prune(cache.folder, keep=1); clear(cache.folder)   # `cohere-coreml cache`

The rules below are the Swift package's too (`CompiledModelCache` in
swift/Sources/CohereTranscribe/Runtime/CompiledModelCache.swift) and `example_inference.py`'s install;
docs/runtime.md, "Compiled-model cache", states them once.

Naming: `<cache>/<package name>-<digest[:24]>.mlmodelc`, where the digest is the hex sha256 of the sorted
lines `"<package>/<file>\\t<sha256>\\t<size>"` of the bundle manifest's checksums (`manifest.json` beside
the package), else of the package's file table `"<package>/<file>\\t<size>\\t<mtime>"` (this fallback names
the same files the same way within one language; across Swift and Python only the manifest rule is sure
to agree, since the two read and print modification times each their own way).

Install: compiled into a temporary folder, moved beside its target as `.<entry>.tmp-<pid>-<id>`, marked
complete (a `.complete` file naming the source package), renamed to the target. A target that is
already complete is kept, never replaced (its name says its content is the same) and the fresh copy
dropped; only a target without the marker (left by something outside this rule) is moved aside and
removed. Nothing is deleted in place: a removed entry is first renamed to `.<entry>.trash-<pid>-<id>`,
so no process ever finds a half-deleted entry under a complete name.

Upkeep: a load served from the cache touches the marker (its modification time is the entry's last use).
After an install, the entries compiled from the same source package with other contents (a re-exported
bundle) are removed, then the least recently used others while the folder holds more than the size cap
(`max_bytes`: $COHERE_COREML_CACHE_MAX_GB, default `DEFAULT_MAX_GB`; 0 turns the cap off). Standard
library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "COHERE_COREML_CACHE"  # overrides the default cache folder
MAX_GB_ENV = "COHERE_COREML_CACHE_MAX_GB"  # overrides the size cap (GiB; 0: no cap)
DEFAULT_MAX_GB = 16.0  # room for the full-size fp16, q8 and q4 bundles' compiled models side by side
COMPLETE_MARKER = ".complete"
DIGEST_PREFIX = 24  # hex characters of the digest in a compiled model's name
ENTRY_SUFFIX = ".mlmodelc"
# hidden temporaries of this rule: a staging copy before its rename, an entry moved aside to be removed
TEMPORARY_NAME = re.compile(r"^\.(?P<entry>.+\.mlmodelc)\.(?P<kind>tmp|trash)-(?P<pid>\d+)-[0-9a-f]+$")


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


def default_max_bytes() -> int | None:
    """The size cap: `$COHERE_COREML_CACHE_MAX_GB` GiB (0: none), else `DEFAULT_MAX_GB`."""
    raw = os.environ.get(MAX_GB_ENV)
    try:
        gib = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        raise ValueError(f"{MAX_GB_ENV} must be a number of GiB (0: no cap), got {raw!r}") from None
    if not gib >= 0:
        raise ValueError(f"{MAX_GB_ENV} must be >= 0, got {raw!r}")
    return None if gib == 0 else int(gib * 2**30)


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


# --------------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """One folder of the cache: a compiled model (`complete`), or a temporary of an install or removal."""

    path: Path
    package: str  # the package name the entry was compiled from ("encoder"), "" when unknown
    complete: bool
    size: int  # bytes of its files
    last_used: float  # the marker's modification time (complete), else the folder's
    source: str | None  # the package path recorded in the marker (None: not recorded)
    pid: int | None = None  # a temporary's process

    @property
    def temporary(self) -> bool:
        return self.pid is not None

    def to_dict(self) -> dict:
        return {"name": self.path.name, "package": self.package, "complete": self.complete, "size": self.size,
                "last_used": self.last_used, "source": self.source, "temporary": self.temporary}


def _folder_size(path: Path) -> int:
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's process counts as alive): a temporary's owner."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def read_marker(entry: Path) -> dict | None:
    """The marker of a complete entry (`{"source": ...}`; `{}` for an empty marker), None when incomplete."""
    try:
        raw = (entry / COMPLETE_MARKER).read_bytes()
    except OSError:
        return None
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def _package_of(name: str) -> str:
    stem = name[: -len(ENTRY_SUFFIX)] if name.endswith(ENTRY_SUFFIX) else name
    base, sep, digest = stem.rpartition("-")
    return base if sep and len(digest) == DIGEST_PREFIX else stem


def entries(folder: str | os.PathLike) -> list[CacheEntry]:
    """The cache's entries, least recently used first (an absent folder: none)."""
    folder = Path(folder)
    found = []
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    for path in children:
        if not path.is_dir() or path.is_symlink():
            continue
        temporary = TEMPORARY_NAME.match(path.name)
        if temporary is None and not path.name.endswith(ENTRY_SUFFIX):
            continue  # not ours
        marker = None if temporary else read_marker(path)
        try:
            used = (path / COMPLETE_MARKER).stat().st_mtime if marker is not None else path.stat().st_mtime
        except OSError:
            continue  # removed meanwhile
        found.append(CacheEntry(
            path=path, package=_package_of(temporary.group("entry") if temporary else path.name),
            complete=marker is not None, size=_folder_size(path), last_used=used,
            source=(marker or {}).get("source") if isinstance((marker or {}).get("source"), str) else None,
            pid=int(temporary.group("pid")) if temporary else None))
    return sorted(found, key=lambda e: (e.last_used, e.path.name))


def remove_entry(path: Path) -> bool:
    """Remove one entry: renamed aside (`.<entry>.trash-<pid>-<id>`), then deleted; False when it was gone."""
    path = Path(path)
    match = TEMPORARY_NAME.match(path.name)
    entry_name = match.group("entry") if match else path.name
    trash = path.with_name(f".{entry_name}.trash-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _removable(entry: CacheEntry) -> bool:
    """A temporary only once its process is gone (a live one is an install or removal under way)."""
    return not entry.temporary or not process_alive(entry.pid)


def prune(folder: str | os.PathLike, keep: int | None = None, older_than: float | None = None,
          max_bytes: int | None = None, protect: Iterable[Path] = (), now: float | None = None) -> list[CacheEntry]:
    """Remove entries of `folder` and return them:

    * `keep`: per package name, all but the `keep` most recently used complete entries;
    * `older_than`: complete entries not used for that many seconds;
    * `max_bytes`: the least recently used complete entries while the folder holds more;
    * always: temporaries whose process is gone and entries without a marker (incomplete leftovers).

    `protect` (paths) are never removed (the entry just installed)."""
    now = time.time() if now is None else now
    protected = {Path(p).name for p in protect}
    current = entries(folder)
    doomed: dict[str, CacheEntry] = {}
    for entry in current:
        if entry.path.name in protected:
            continue
        if not entry.complete:
            if _removable(entry):
                doomed[entry.path.name] = entry
        elif older_than is not None and now - entry.last_used > older_than:
            doomed[entry.path.name] = entry
    if keep is not None:
        by_package: dict[str, list[CacheEntry]] = {}
        for entry in current:
            if entry.complete:
                by_package.setdefault(entry.package, []).append(entry)
        for group in by_package.values():
            for entry in group[: max(0, len(group) - keep)]:  # least recently used first
                if entry.path.name not in protected:
                    doomed[entry.path.name] = entry
    if max_bytes is not None:
        total = sum(e.size for e in current if e.path.name not in doomed)
        for entry in current:
            if total <= max_bytes:
                break
            if entry.complete and entry.path.name not in doomed and entry.path.name not in protected:
                doomed[entry.path.name] = entry
                total -= entry.size
    removed = [e for e in doomed.values() if remove_entry(e.path)]
    for entry in removed:
        logger.info("compiled-model cache: removed %s (%.1f MB)", entry.path.name, entry.size / 1e6)
    return removed


def clear(folder: str | os.PathLike) -> list[CacheEntry]:
    """Remove every entry of `folder` (not the temporaries of a live process); returns them."""
    return [e for e in entries(folder) if _removable(e) and remove_entry(e.path)]


# --------------------------------------------------------------------------------------------
# Install
# --------------------------------------------------------------------------------------------


def install(compiled: Path, target: Path, source: str | os.PathLike | None = None) -> bool:
    """Move a freshly compiled model to `target` (staged beside it, marked complete, renamed).

    Returns True when it was installed, False when a complete `target` was already there (kept; the
    fresh copy is dropped). A `target` without the marker is moved aside and removed, then the rename
    is tried again."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    shutil.move(os.fspath(compiled), os.fspath(staging))
    marker = {"source": os.path.abspath(source)} if source is not None else {}
    (staging / COMPLETE_MARKER).write_text(json.dumps(marker), encoding="utf-8")
    for _attempt in range(3):
        try:
            os.rename(staging, target)  # fails while `target` is a non-empty folder
            return True
        except OSError:
            if not target.exists():
                continue  # removed meanwhile: try again
            if read_marker(target) is not None:  # another process installed the same content: use it
                shutil.rmtree(staging, ignore_errors=True)
                return False
            remove_entry(target)  # an incomplete leftover (never one of this rule's installs)
    shutil.rmtree(staging, ignore_errors=True)
    raise OSError(f"cannot install the compiled model at {target}")


def touch(entry: Path) -> None:
    """Record a use of a complete entry (its marker's modification time); a read-only cache is left as is."""
    try:
        os.utime(entry / COMPLETE_MARKER)
    except OSError:
        pass


class CompiledCache:
    """Compiled models of packages, by content, in one folder; counts what this process compiled."""

    def __init__(self, folder: str | os.PathLike | None = None, max_bytes: int | None | str = "default"):
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        self.max_bytes = default_max_bytes() if max_bytes == "default" else max_bytes
        self.compiles = 0  # packages compiled by this object
        self.hits = 0  # loads served from the cache

    def location(self, package: str | os.PathLike) -> Path:
        package = Path(package)
        stem = package.name[: -len(".mlpackage")] if package.name.endswith(".mlpackage") else package.stem
        return self.folder / f"{stem}-{package_digest(package)[:DIGEST_PREFIX]}{ENTRY_SUFFIX}"

    def compiled(self, package: str | os.PathLike, compile_package: Callable[[str], str]) -> Path:
        """The compiled model of `package`: the cached one, else `compile_package(path)` (which returns
        a new temporary `.mlmodelc` folder, as `coremltools.models.utils.compile_model` does) moved in."""
        target = self.location(package)
        if read_marker(target) is not None:
            self.hits += 1
            touch(target)
            return target
        logger.info("compiling %s for Core ML (once; cached as %s)", Path(package).name, target)
        fresh = Path(compile_package(os.fspath(package)))
        self.compiles += 1
        if install(fresh, target, source=package):
            self.after_install(target, package)
        return target

    def after_install(self, target: Path, package: str | os.PathLike) -> list[CacheEntry]:
        """Upkeep after installing `target`: the same package's other contents, then the size cap."""
        source = os.path.abspath(package)
        stale = [e for e in entries(self.folder)
                 if e.complete and e.source == source and e.path.name != target.name]
        removed = [e for e in stale if remove_entry(e.path)]
        for entry in removed:
            logger.info("compiled-model cache: removed %s (an earlier content of %s)", entry.path.name, source)
        if self.max_bytes is not None:
            removed += prune(self.folder, max_bytes=self.max_bytes, protect=[target])
        return removed
