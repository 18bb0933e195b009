"""Files of an export: packages installed atomically, text/JSON written atomically, temporaries swept.

* `write_package_atomic(write, path)` / `save_package_atomic(mlmodel, path)`: write to
  `.<name>.tmp-<pid>.mlpackage` next to `path`, optionally run a verification callback on the temporary
  package, then rename into place (`install_package`); an existing package is kept (skipped) unless
  `force`; `skip_installed` is that rule for a gated component (package AND its parity report);
* `write_text_atomic` / `write_json_atomic`: a file is always either the old one or the new one;
* `sweep_stale_temporaries`, `temporary_dir`: hidden temporaries of this package, removed once the
  process that made them is gone;
* `package_size_bytes`, `weight_file_bytes`: sizes of a package on disk.
* `save_converted`: save a converted / compressed model and delete coremltools' temporary copy.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..export_errors import ExportSettingsError
from ..runtime.compiled_cache import process_alive
from . import faults
from .integrity import invalidate_manifest

logger = logging.getLogger(__name__)




def save_package_atomic(
    mlmodel,
    path: str | Path,
    force: bool = False,
    verify: Callable[[Path], Any] | None = None,
) -> bool:
    """Save `mlmodel` to `path` (an `.mlpackage` folder) without ever leaving a partial package.

    The package is written to `.<name>.tmp-<pid>.mlpackage` next to `path`; `verify(tmp_path)` (if given) runs on that
    temporary package and may raise (e.g. `ParityError`), in which case the temporary package is
    removed and the exception propagates. Only then is it renamed to `path`.

    Returns:
        True when written, False when `path` already exists and `force` is False (skipped).
    """
    return write_package_atomic(lambda tmp: mlmodel.save(str(tmp)), path, force=force, verify=verify)


def skip_existing(path: Path, force: bool) -> bool:
    """True (and one log line) when the package at `path` exists and `force` is off: skip its export."""
    if Path(path).exists() and not force:
        logger.info("%s exists, skipping (use --force to overwrite)", path)
        return True
    return False


def stale_reason(settings, component: str) -> str | None:  # settings: a `convert.ExportSettings`
    """Why a component's package present in `settings.out_dir` must be exported again, or None (present
    and current, or absent): no gate report beside it (`<component>.parity.json` is written right after the
    package is installed, so an export interrupted between the two leaves a package without one), or a
    report that names another checkpoint or none (`settings.checkpoint_digest`, when known): e.g. an old
    `out/demo` after the default model changed."""
    path, report = settings.package_path(component), settings.report_path(component)
    if not path.exists():
        return None
    if not report.is_file():
        return f"it has no {report.name} (an interrupted export?)"
    if settings.checkpoint_digest is None:
        return None
    try:
        recorded = json.loads(report.read_text()).get("checkpoint_digest")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded == settings.checkpoint_digest:
        return None
    return (f"it was exported from {f'checkpoint {recorded}' if recorded else 'an unrecorded checkpoint'}, "
            f"not from this one ({settings.checkpoint_digest})")


def skip_installed(settings, component: str) -> bool:  # settings: a `convert.ExportSettings`
    """`skip_existing` for a gated component: skipped only when its package AND its gate report are in
    place and current (`stale_reason`); a stale package is exported again (not an error: the export
    asked for this checkpoint's package in this folder)."""
    reason = None if settings.force else stale_reason(settings, component)
    if reason is not None:
        logger.warning("%s: %s: exporting it again", settings.package_path(component), reason)
        return False
    return skip_existing(settings.package_path(component), settings.force)


def write_package_atomic(
    write: Callable[[Path], Any],
    path: str | Path,
    force: bool = False,
    verify: Callable[[Path], Any] | None = None,
) -> bool:
    """`save_package_atomic` for any writer: `write(tmp_path)` creates the package (e.g.
    a merged multifunction package: `convert.merge_functions`)."""
    path = Path(path)
    tmp = staging_path(path)
    if skip_existing(path, force):
        return False
    _remove(tmp)
    try:
        write(tmp)
        if verify is not None:
            verify(tmp)
    except BaseException:
        _remove(tmp)
        raise
    install_package(tmp, path)
    return True


def staging_path(path: str | Path) -> Path:
    """The temporary path a package is written to before `install_package` renames it to `path`."""
    path = Path(path)
    if path.suffix != ".mlpackage":
        raise ExportSettingsError(f"package path must end with .mlpackage, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # coremltools insists on the .mlpackage extension, so the temporary name keeps it
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}.mlpackage")


def install_package(tmp: str | Path, path: str | Path) -> None:
    """Rename the finished package `tmp` to `path`, replacing an older one only once `tmp` is in place.

    A bundle manifest next to `path` stops describing the folder here, so it is removed first
    (`integrity.invalidate_manifest`): an interrupted install never leaves a manifest over other files."""
    tmp, path = Path(tmp), Path(path)
    old = path.with_name(f".{path.stem}.old-{os.getpid()}.mlpackage")
    try:
        invalidate_manifest(path.parent)
        faults.point(f"install/{path.stem}", path)
        if path.exists():
            os.rename(path, old)
            faults.point(f"swap/{path.stem}", path)
        os.rename(tmp, path)
    except BaseException:
        _remove(tmp)
        if old.exists() and not path.exists():
            os.rename(old, path)
        raise
    _remove(old)
    logger.debug("wrote %s", path)


def remove_package(path: str | Path) -> None:
    """Delete a (temporary) package folder if present."""
    _remove(Path(path))


def write_json_atomic(data: Any, path: str | Path, if_changed: bool = False) -> Path:
    """`data` as indented JSON at `path`, atomically (`write_text_atomic`)."""
    path = Path(path)
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n",
                      if_changed=if_changed)
    return path


def write_text_atomic(path: str | Path, text: str, if_changed: bool = False,
                      before_change: Callable[[], Any] | None = None) -> bool:
    """Write `text` to `path` so that `path` is always either the old file or the new one.

    The text goes to the hidden `.<name>.tmp-<pid>` (never listed as a bundle file, removed when the
    write fails, e.g. on a full disk; swept by `sweep_stale_temporaries` after a kill), then is renamed
    over `path`. With `if_changed`, a file that already holds `text` is left alone (False returned).
    `before_change()` runs just before the first change (e.g. removing a manifest the change makes stale).
    Mode: the process umask's default (0644 usually), like any new file.
    """
    path = Path(path)
    data = text.encode("utf-8")
    if if_changed and path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if before_change is not None:
        before_change()
    faults.point(f"write/{path.name}", path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        faults.point(f"replace/{path.name}", path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


# temporaries of this package: `.<name>.tmp-<pid>...`, `.<name>.old-<pid>...`, `.<prefix>.tmp-<pid>-XXXX`
TEMPORARY_NAME = re.compile(r"^\..+?\.(?:tmp|old)-(\d+)(?:[.-]|$)")


def sweep_stale_temporaries(folder: str | Path, prefix: str = "") -> list[Path]:
    """Remove the hidden temporaries (`.<name>.tmp-<pid>...`, `.<name>.old-<pid>...`) in `folder` whose
    process is gone: what a killed export or quantize leaves. Only names starting with `.<prefix>`;
    a live process's temporaries (a concurrent run) are kept. Returns what was removed."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        m = TEMPORARY_NAME.match(entry.name)
        if m is None or not entry.name.startswith(f".{prefix}") or entry.is_symlink() or process_alive(int(m.group(1))):
            continue
        _remove(entry)
        removed.append(entry)
        logger.info("removed %s (left by an interrupted run, process %s)", entry, m.group(1))
    return removed


def temporary_dir(parent: str | Path, name: str) -> Path:
    """A new hidden scratch folder `.<name>.tmp-<pid>-XXXX` in `parent` (swept once its process is gone)."""
    return Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent))


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def save_converted(mlmodel, path: str | Path) -> None:
    """Save a model coremltools just converted or compressed to `path`, then delete the temporary
    package coremltools wrote it to (`tempfile`'s folder), which coremltools removes only when the
    process exits: a loop over functions otherwise keeps one copy per function on disk (full size: 3.5
    GB per encoder bucket; a 6-function export filled the disk), and a killed process leaves them for
    good. The object must not be used after this (its weights were in that package)."""
    mlmodel.save(str(path))
    if getattr(mlmodel, "is_temp_package", False) and getattr(mlmodel, "package_path", None):
        shutil.rmtree(mlmodel.package_path, ignore_errors=True)


def package_size_bytes(path: str | Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tree_bytes(path: str | Path) -> int:
    """Bytes of a folder as `du -sb` counts them: the apparent size (st_size) of the folder itself and
    of every file, directory and symbolic link under it (links not followed), each inode once (hard
    links). Directories count their own entry (4096 bytes and up on ext4; other file systems differ)."""
    root = os.fspath(path)
    st = os.lstat(root)
    seen, total = {(st.st_dev, st.st_ino)}, st.st_size
    for top, dirs, files in os.walk(root):  # followlinks=False: a linked folder counts as its link
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(top, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def weight_file_bytes(path: str | Path) -> int:
    """Bytes of the package's weight blob(s) (`Data/com.apple.CoreML/weights/*`)."""
    weights = Path(path) / "Data" / "com.apple.CoreML" / "weights"
    return sum(f.stat().st_size for f in weights.rglob("*") if f.is_file()) if weights.exists() else 0
