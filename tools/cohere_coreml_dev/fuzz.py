"""Manifest mutations for the fuzz tests (tests/bundle/test_fuzz_manifest.py) and the Swift corpus
(tools/data/make_fuzz_manifests.py -> swift/Tests/CohereTranscribeTests/Bundle/ManifestFuzzTests.swift).

A mutation is (path, operator, value): `path` is a list of keys / indices into the manifest (every
container and leaf of a real exported manifest is a candidate), `operator` one of OPERATORS. The
same operators drive hypothesis (drawn, shrinkable) and a seeded `random.Random` (the Swift corpus).
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import tempfile
from pathlib import Path
from typing import Any

from cohere_coreml.bundle.format import IO_DTYPES, BundleError
from cohere_coreml.bundle.load import Bundle

# values that replace a field: wrong types, empty / odd strings, out-of-range and non-finite numbers
ODD_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, -(2**63), 10**30, 1.5, -0.0, 1e308,
    math.nan, math.inf, -math.inf, "", " ", "x", "main2", "../outside", "/etc/passwd", "a\u0000b", "\u00e9",
    "e\u0301", "window_999s", "float64", "log_probs", "fp32", "q3", "x" * 5000, [], [1], [1, 2, 3], ["a"], [None],
    {}, {"a": 1}, {"main": {}}, {"inputs": {}, "outputs": {}, "states": {}},
)

OPERATORS = ("delete", "replace", "plus_one", "minus_one", "negate", "double", "to_list", "to_dict", "rename_key",
             "append", "truncate", "stringify", "swap_sibling")


def paths(obj, prefix=(), limit_checksums: int = 3) -> list[tuple]:
    """Every path of `obj` (containers and leaves; at most `limit_checksums` entries of checksums.files)."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        items = list(obj.items())
        if prefix == ("checksums", "files"):
            items = items[:limit_checksums]
        for key, value in items:
            out += paths(value, prefix + (key,), limit_checksums)
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:4]):
            out += paths(value, prefix + (i,), limit_checksums)
    return out


def _parent(manifest, path):
    node = manifest
    for key in path[:-1]:
        node = node[key]
    return node


def apply(manifest: dict, path: tuple, operator: str, value: Any = None) -> dict:
    """A deep copy of `manifest` with `operator` applied at `path` (value: for "replace")."""
    out = copy.deepcopy(manifest)
    parent, key = _parent(out, path), path[-1]
    current = parent[key]
    if operator == "delete":
        if isinstance(parent, list):
            parent.pop(key)
        else:
            del parent[key]
        return out
    if operator == "rename_key" and isinstance(parent, dict):
        parent[value if isinstance(value, str) and value not in parent else f"{key}_renamed"] = parent.pop(key)
        return out
    if operator == "swap_sibling":
        siblings = [k for k in (parent if isinstance(parent, dict) else range(len(parent))) if k != key]
        if siblings:
            other = siblings[len(str(value)) % len(siblings)]  # deterministic (no str hash)
            parent[key], parent[other] = parent[other], current
            return out
    new: Any = value
    numeric = isinstance(current, (int, float)) and not isinstance(current, bool)
    if operator == "plus_one" and numeric:
        new = current + 1
    elif operator == "minus_one" and numeric:
        new = current - 1
    elif operator == "negate" and numeric:
        new = -current if current else -1
    elif operator == "double" and numeric:
        new = current * 2
    elif operator == "to_list" and isinstance(current, dict):
        new = list(current.values())
    elif operator == "to_dict" and isinstance(current, list):
        new = {str(i): v for i, v in enumerate(current)}
    elif operator == "append" and isinstance(current, list):
        new = current + [current[-1] if current else 0]
    elif operator == "truncate" and isinstance(current, (list, str)) and current:
        new = current[:-1]
    elif operator == "stringify" and not isinstance(current, str):
        new = json.dumps(current)
    parent[key] = new
    return out


def changed_keys(a, b, prefix: tuple = ()) -> set[str]:
    """Every dict key on the way to a value that differs between `a` and `b` (what an error may name)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: set[str] = set()
        for key in set(a) | set(b):
            if key not in a or key not in b:
                out |= {str(k) for k in prefix if isinstance(k, str)} | {str(key)}
            else:
                out |= changed_keys(a[key], b[key], prefix + (key,))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = set()
        for i, (x, y) in enumerate(zip(a, b)):
            out |= changed_keys(x, y, prefix + (i,))
        return out
    same = type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))
    return set() if same else {str(k) for k in prefix if isinstance(k, str)}


def random_mutations(manifest: dict, rng: random.Random, count: int) -> dict:
    """`manifest` after `count` random (path, operator, value) mutations (paths of the current state)."""
    for _ in range(count):
        candidates = paths(manifest)
        path = candidates[rng.randrange(len(candidates))]
        manifest = apply(manifest, path, rng.choice(OPERATORS), rng.choice(ODD_VALUES))
    return manifest


def corrupt_text(text: str, rng: random.Random) -> str:
    """The JSON text cut, a byte flipped, or an unbalanced bracket: not a manifest any more (mostly)."""
    kind = rng.randrange(4)
    if kind == 0:
        return text[: rng.randrange(len(text))]
    if kind == 1:
        i = rng.randrange(len(text))
        return text[:i] + chr((ord(text[i]) + rng.randrange(1, 95)) % 127 or 65) + text[i + 1:]
    if kind == 2:
        return text + rng.choice(["}", "]", ",", "x", "\u0000"])
    return rng.choice(["", "null", "[]", "42", '"manifest"', "{}", '{"format": "cohere-coreml-bundle"}',
                       '{"format": "cohere-coreml-bundle", "format_version": 1}'])


# one mutation per field and value class: every check of the loaders is hit by construction
TARGETED: tuple[tuple[str, Any], ...] = (("delete", None), ("replace", None), ("replace", -1), ("replace", 0),
                                         ("replace", 2**40), ("replace", math.nan), ("replace", 1.5), ("replace", "x"),
                                         ("replace", []), ("plus_one", None), ("rename_key", "../outside"))


def field_mutations(manifest: dict, path: tuple) -> list[tuple[str, Any]]:
    """(operator, value) of TARGETED, and what only this field takes: another valid dtype (a dtype that
    disagrees with the precision), another file of the bundle or a missing one (a `files` entry)."""
    out = list(TARGETED)
    current = _parent(manifest, path)[path[-1]]
    if path[-1] == "dtype":
        out += [("replace", dtype) for dtype in IO_DTYPES if dtype != current]
    if len(path) == 2 and path[0] == "files" and isinstance(current, str):
        out += [("replace", f"renamed-{current}")] + [("replace", other) for other in sorted(manifest["files"].values())
                                                       if isinstance(other, str) and other != current]
    return out


def paired_mutations(manifest: dict) -> list[dict]:
    """Checks that only two coordinated changes reach: eos ids that agree with each other but not with
    vocab.json; a checksum size and the total that agree with each other but not with the file."""
    out = []
    if isinstance(manifest.get("tokens"), dict):
        out.append(apply(apply(manifest, ("tokens", "eos_token_ids"), "replace", [0]), ("tokens", "eos_token_id"), "replace", 0))
    listed = manifest.get("checksums", {}).get("files") if isinstance(manifest.get("checksums"), dict) else None
    if isinstance(listed, dict) and listed and "total_bytes" in manifest["checksums"]:
        first = sorted(listed)[0]
        out.append(apply(apply(manifest, ("checksums", "files", first, "size"), "plus_one"), ("checksums", "total_bytes"), "plus_one"))
    return out


def targeted(manifest: dict) -> list[tuple[str, str]]:
    """(name, JSON text) of every path of `manifest` mutated by each of its `field_mutations` (a no-op
    skipped), then the `paired_mutations`."""
    texts = []
    for path in paths(manifest):
        for operator, value in field_mutations(manifest, path):
            mutated = apply(manifest, path, operator, value)
            if mutated != manifest:
                texts.append(json.dumps(mutated, allow_nan=True))
    texts += [json.dumps(m, allow_nan=True) for m in paired_mutations(manifest)]
    return [(f"manifest-t{i:04d}.json", text) for i, text in enumerate(texts)]


def corpus(manifest: dict, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` (name, JSON text) mutated manifests, deterministic for `seed`: 1-3 field mutations each,
    one in eight a corrupted text; NaN/Infinity written as JSON extensions (Python reads them)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 8 == 7:
            text = corrupt_text(json.dumps(manifest), rng)
        else:
            text = json.dumps(random_mutations(manifest, rng, rng.randint(1, 3)), allow_nan=True)
        out.append((f"manifest-{i:04d}.json", text))
    return out


# what names a field in a BundleError: `field 'x.y'` (the checks), `files.key ... is refused` (a path),
# `describes no key` (a required file)
_FIELD = re.compile(r"field '([^']+)'")
_FILES_PATH = re.compile(r": (files\.[A-Za-z0-9_]+) .* is refused")
_NO_FILE = re.compile(r" describes no ([A-Za-z0-9_]+):")


def named_field(message: str) -> str | None:
    """The manifest field a BundleError message names, or None (unreadable JSON, a file on disk ...)."""
    if m := _FIELD.search(message):
        return m.group(1)
    if m := _FILES_PATH.search(message):
        return m.group(1)
    if m := _NO_FILE.search(message):
        return f"files.{m.group(1)}"
    return None


def verdicts(bundle_dir: Path, files: list[tuple[str, str]]) -> dict[str, dict]:
    """{name: {"accepted": bool, "stage": None | "manifest" | "packages", "field": str | None, "error": str | None}}:
    `Bundle.load` of each manifest text read beside the files of `bundle_dir` (the bundle it was mutated
    from). "manifest": refused before the packages are opened (the Swift manifest loader's checks);
    "packages": refused only by `check_packages` (a function or io the packages lack; Swift: `checkIO`)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        manifest_dir = Path(tmp)
        for name, text in files:
            (manifest_dir / "manifest.json").write_text(text, encoding="utf-8", errors="surrogatepass")
            verdict = {"accepted": True, "stage": None, "field": None, "error": None}
            for stage, check_package_io in (("manifest", False), ("packages", True)):
                try:
                    Bundle.load([manifest_dir, bundle_dir], check_package_io=check_package_io)
                except BundleError as err:
                    message = str(err).replace(str(manifest_dir), "<manifest>")
                    verdict = {"accepted": False, "stage": stage, "field": named_field(message), "error": message}
                    break
            out[name] = verdict
    return out
