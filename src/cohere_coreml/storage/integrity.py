"""Bundle integrity: sha256 and size of every file, the manifest sections that record them, checks.

`manifest_sections(bundle_dir)` returns what the manifest gains (preset and recipe, minimum OS
versions, `checksums`: every file of the bundle with sha256 and size, the files inside each
`.mlpackage` included), computed from the files on disk; `bundle.write_manifest` (the one manifest
writer) merges it in last.
`check_bundle(dir)` re-hashes every file and names each one that is missing, has another size or
another hash, or is not listed; `check_sizes` is the cheap variant used when a bundle is loaded.
`cohere-coreml bundle check DIR` runs the full check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from pathlib import Path

from . import faults

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"  # never listed: it cannot hold its own hash
COMPRESSION_FILE = "compression.json"  # written by cohere_coreml.quantize; names the preset and recipes
CHUNK = 1 << 20
# Core ML specification version -> minimum OS versions (coremltools' _SPECIFICATION_VERSION_IOS_*)
MIN_OS = {
    7: {"iOS": "16.0", "macOS": "13.0", "tvOS": "16.0", "watchOS": "9.0", "visionOS": "1.0"},
    8: {"iOS": "17.0", "macOS": "14.0", "tvOS": "17.0", "watchOS": "10.0", "visionOS": "1.0"},
    9: {"iOS": "18.0", "macOS": "15.0", "tvOS": "18.0", "watchOS": "11.0", "visionOS": "2.0"},
    10: {"iOS": "26.0", "macOS": "26.0", "tvOS": "26.0", "watchOS": "26.0", "visionOS": "26.0"},
}


class IntegrityError(ValueError):
    """A bundle's files do not match its manifest (names every file that differs)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


def safe_path(rel, what: str = "manifest path") -> str:
    """`rel` when it is a plain relative path inside a bundle: posix separators, no leading `/`, no drive,
    no empty, `.` or `..` component, no backslash or control character, NFC; else IntegrityError naming it."""
    problem = None
    if not isinstance(rel, str) or not rel:
        problem = "not a non-empty string"
    elif rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        problem = "absolute"
    elif "\\" in rel:
        problem = "contains a backslash"
    elif any(ord(c) < 32 or ord(c) == 127 for c in rel):
        problem = "contains a control character"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        problem = "not normalised (empty, '.' or '..' component)"
    elif unicodedata.normalize("NFC", rel) != rel:
        problem = "not in Unicode NFC"
    if problem:
        raise IntegrityError(f"{what} {rel!r} is refused: {problem}; bundle paths are relative and stay inside the bundle",
                             [f"{rel!r}: unsafe path ({problem})"])
    return rel


def _symlinks_on(root: Path, rel: str) -> str | None:
    """The first component of `root/rel` (or `root` itself) that is a symbolic link, as a relative path."""
    if root.is_symlink():
        return "."
    here = root
    for i, part in enumerate(rel.split("/")):
        here = here / part
        if here.is_symlink():
            return "/".join(rel.split("/")[: i + 1])
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def bundle_files(bundle_dir: str | os.PathLike) -> list[Path]:
    """Every file of a bundle (relative paths, sorted), the manifest and hidden temporaries excluded.

    A symbolic link anywhere in the bundle (hidden names included; the bundle folder itself) is refused
    with an IntegrityError naming it: links are never followed, hashed or published."""
    root = Path(bundle_dir)
    if root.is_symlink():
        raise IntegrityError(f"{root} is a symbolic link: point at the bundle folder itself",
                             [f"{root}: symbolic link"])
    out, links = [], []
    for folder, dirs, names in os.walk(root, followlinks=False):
        for name in sorted(dirs + names):
            path = Path(folder) / name
            rel = path.relative_to(root)
            if path.is_symlink():
                links.append(rel.as_posix())
            elif name in names and path.is_file() and rel.as_posix() != MANIFEST_NAME \
                    and not any(p.startswith(".") for p in rel.parts):
                out.append(rel)
    if links:
        raise IntegrityError(f"{root} holds {len(links)} symbolic link(s), refused (a bundle holds regular files only): "
                             + ", ".join(sorted(links)), [f"{rel}: symbolic link" for rel in sorted(links)])
    return sorted(out)


def file_table(bundle_dir: str | os.PathLike) -> dict[str, dict]:
    """{relative posix path: {"sha256", "size"}} of every bundle file, computed from disk."""
    root = Path(bundle_dir)
    return {rel.as_posix(): {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
            for rel in bundle_files(root)}


def min_os(bundle_dir: str | os.PathLike) -> dict[str, str]:
    """Minimum OS versions: the highest Core ML specification version among the bundle's packages."""
    # read_spec reads only (coremltools' loader rewrites each package's Manifest.json)
    from ..runtime.package import read_spec  # cohere_coreml.runtime imports torch; integrity loads without it

    versions = [read_spec(p).specificationVersion for p in sorted(Path(bundle_dir).glob("*.mlpackage"))]
    if not versions:
        return {}
    v = max(versions)
    return {"spec_version": int(v), **MIN_OS.get(int(v), {})}


def manifest_sections(bundle_dir: str | os.PathLike) -> dict:
    """What the manifest gains from the files on disk: preset, recipe, min_os, checksums.

    Call it last, when every other file of the bundle is written (README.md, compression.json...).
    """
    root = Path(bundle_dir)
    compression = root / COMPRESSION_FILE
    if compression.is_file():
        data = json.loads(compression.read_text())
        preset = data.get("preset", "unknown")
        recipe = {comp: sec.get("recipe") for comp, sec in data.get("components", {}).items()}
    else:
        preset, recipe = "f16", {"encoder": None, "decoder": None}
    files = file_table(root)
    return {"preset": preset, "recipe": recipe, "min_os": min_os(root),
            "checksums": {"algorithm": "sha256", "files": files,
                          "total_bytes": sum(f["size"] for f in files.values())}}


def invalidate_manifest(bundle_dir: str | os.PathLike) -> bool:
    """Remove `bundle_dir/manifest.json` before a file it describes changes (export installs a package,
    replaces the tokenizer or vocab): until the new manifest is written last, the folder holds no
    manifest rather than one that describes other files, so an interrupted export leaves nothing that
    `Bundle.load` or `bundle check` accepts. True when there was one."""
    path = Path(bundle_dir) / MANIFEST_NAME
    if not path.is_file():
        return False
    faults.point(f"unlink/{MANIFEST_NAME}", path)
    path.unlink()
    logger.info("removed %s until the bundle is complete again", path)
    return True


def _listed(manifest: dict, manifest_path: Path) -> dict[str, dict]:
    checksums = manifest.get("checksums") if isinstance(manifest, dict) else None
    files = checksums.get("files") if isinstance(checksums, dict) else None
    if not isinstance(files, dict) or not files:
        raise IntegrityError(f"{manifest_path} has no checksums (written before integrity records existed): "
                             "rebuild the bundle or run `cohere-coreml bundle finalize`")
    for rel in files:
        safe_path(rel, f"{manifest_path}: checksums entry")
    check_table(files)
    return files


def check_table(files) -> None:
    """IntegrityError naming the entry unless `files` is {safe relative path: {"sha256": 64 hex, "size": int >= 0}}."""
    if not isinstance(files, dict):
        raise IntegrityError(f"manifest field 'checksums.files' must be an object, got {type(files).__name__}",
                             ["checksums.files: not an object"])
    for rel, want in files.items():
        safe_path(rel, "manifest checksums entry")
        size = want.get("size") if isinstance(want, dict) else None
        digest = want.get("sha256") if isinstance(want, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 \
                or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise IntegrityError(f"manifest field 'checksums.files.{rel}' must be {{\"sha256\": 64 hex digits, "
                                 f"\"size\": bytes >= 0}}, got {str(want)[:80]}", [f"{rel}: malformed checksum entry"])


def _read_manifest(bundle_dir: Path) -> tuple[dict, Path]:
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise IntegrityError(f"{bundle_dir} has no {MANIFEST_NAME}", [MANIFEST_NAME + ": missing"])
    try:
        return json.loads(path.read_text(encoding="utf-8")), path
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise IntegrityError(f"{path} is not valid JSON: {err}", [MANIFEST_NAME + ": unreadable"]) from err


def check_bundle(bundle_dir: str | os.PathLike, hashes: bool = True) -> dict:
    """Verify every listed file (size, and sha256 when `hashes`) and that no unlisted file exists.

    Returns {"files": n, "bytes": total} when everything matches; raises IntegrityError naming
    every file that differs otherwise.
    """
    root = Path(bundle_dir)
    manifest, manifest_path = _read_manifest(root)
    listed = _listed(manifest, manifest_path)
    on_disk = bundle_files(root)  # refuses symbolic links before anything is read through one
    problems = []
    for rel, want in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{rel}: size {size} != {want['size']} in the manifest")
        elif hashes and sha256_file(path) != want["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    for rel in on_disk:
        if rel.as_posix() not in listed:
            problems.append(f"{rel.as_posix()}: not listed in the manifest")
    if problems:
        raise IntegrityError(f"{root}: {len(problems)} file(s) do not match {MANIFEST_NAME}:\n  " + "\n  ".join(problems),
                             problems)
    return {"files": len(listed), "bytes": sum(v["size"] for v in listed.values())}


def check_sizes(bundle_dirs, manifest: dict) -> None:
    """Presence and size of every listed file, searched over one or more folders (cheap; for
    loading). No-op for manifests without checksums."""
    checksums = manifest.get("checksums")
    if checksums is None:
        return
    if not isinstance(checksums, dict):
        raise IntegrityError(f"manifest field 'checksums' must be an object, got {type(checksums).__name__}",
                             ["checksums: not an object"])
    listed = checksums.get("files")
    if not listed:
        return
    check_table(listed)
    total = checksums.get("total_bytes")
    if total is not None and total != sum(v["size"] for v in listed.values()):
        raise IntegrityError(f"manifest field 'checksums.total_bytes' is {str(total)[:40]} but the listed files hold "
                             f"{sum(v['size'] for v in listed.values())} bytes", ["checksums.total_bytes: wrong"])
    dirs = [Path(bundle_dirs)] if isinstance(bundle_dirs, (str, os.PathLike)) else [Path(d) for d in bundle_dirs]
    problems = []
    for rel, want in sorted(listed.items()):
        safe_path(rel, "manifest checksums entry")
        path = next((d / rel for d in dirs if (d / rel).is_file()), None)
        link = next((f"{d}/{found}" for d in dirs if (found := _symlinks_on(d, rel))), None)
        if link is not None:
            problems.append(f"{rel}: reached through a symbolic link ({link}), refused")
        elif path is None:
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{rel}: size {path.stat().st_size} != {want['size']} in the manifest")
    if problems:
        where = ", ".join(map(str, dirs))
        raise IntegrityError(f"{where}: {len(problems)} file(s) do not match {MANIFEST_NAME}:\n  " + "\n  ".join(problems),
                             problems)
