"""Evaluation datasets: a folder with audio and a manifest, or (when reachable) a Hugging Face dataset.

Folder manifests (the first that exists): `manifest.jsonl` (one JSON object per line) or
`manifest.json` (a list, or {"utterances": [...]} / {"clips": [...]}, as tests/data/heldout).
Each entry: "file" or "audio" (path relative to the folder), "text", "language", and optionally
"words" (word-timing sets: the true words with "start" / "end" seconds; the bench then reports the
word-timing error). An entry with a missing file or an empty text is kept and reported as a
per-clip problem by the bench; the rest is still scored.

Hugging Face names ("librispeech_asr", "google/fleurs", optionally "name:config:split") need the
`datasets` package and the Hub; both are checked up front and a missing one is reported in one
line (no download attempt hangs: HF_HUB_OFFLINE is honoured, the Hub probe has a short timeout).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HUB_PROBE_TIMEOUT_S = 5.0


class DatasetError(ValueError):
    """A dataset that cannot be used at all (missing, unreadable manifest, unreachable)."""


@dataclass
class Clip:
    id: str
    audio: Path | None  # None when the entry names no file
    text: str
    language: str
    problem: str | None = None  # why this clip cannot be scored (missing file, empty text)
    index: int | None = None  # position of its entry in a folder's manifest (ids need not be unique)
    # word-timing sets (tools/data/make_word_timing_set.py): the truth's words, {"word", "start", "end"} in seconds
    # (start null where the synthesizer reported no word event); None for a manifest without word times
    words: list[dict] | None = None


@dataclass
class Dataset:
    name: str
    clips: list[Clip]
    manifest_path: str | None
    manifest_sha256: str | None

    def languages(self) -> list[str]:
        return sorted({c.language for c in self.clips})


def _entries(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: not valid JSON ({err})") from None
    if isinstance(data, dict):
        data = data.get("utterances") or data.get("clips") or data.get("items")
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a list of entries (or an 'utterances' list)")
    return data


def load_folder(directory: str | os.PathLike, limit_per_language: int | None = None) -> Dataset:
    directory = Path(directory)
    if not directory.is_dir():
        raise DatasetError(f"dataset folder not found: {directory}")
    path = next((directory / n for n in ("manifest.jsonl", "manifest.json") if (directory / n).is_file()), None)
    if path is None:
        raise DatasetError(f"no manifest.jsonl or manifest.json in {directory}")
    clips: list[Clip] = []
    counts: dict[str, int] = {}
    for i, entry in enumerate(_entries(path)):
        if not isinstance(entry, dict):
            raise DatasetError(f"{path}: entry {i} is not an object")
        language = str(entry.get("language") or "")
        if not language:
            raise DatasetError(f"{path}: entry {i} has no language")
        if limit_per_language is not None and counts.get(language, 0) >= limit_per_language:
            continue
        counts[language] = counts.get(language, 0) + 1
        name = entry.get("file") or entry.get("audio") or entry.get("path")
        if name is not None and not isinstance(name, str):
            raise DatasetError(f"{path}: entry {i}: the audio file must be a string path, got {name!r}")
        text = str(entry.get("text") or "")
        audio = directory / name if name else None
        problem = None
        if audio is None:
            problem = "no audio file named"
        elif not audio.resolve().is_relative_to(directory.resolve()):  # absolute, `..` or a link out of it
            problem = f"audio file outside the dataset folder: {name}"
        elif not audio.is_file():
            problem = f"audio file not found: {audio}"
        elif not text.strip():
            problem = "empty reference transcript"
        words = entry.get("words")
        if words is not None and not (isinstance(words, list) and all(isinstance(w, dict) and "word" in w
                                                                      for w in words)):
            raise DatasetError(f"{path}: entry {i}: 'words' must be a list of {{\"word\", \"start\", ...}} objects")
        clips.append(Clip(id=str(entry.get("id") or name or i), audio=audio, text=text, language=language,
                          problem=problem, index=i, words=words))
    if not clips:
        raise DatasetError(f"{path} lists no clips")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return Dataset(name=str(directory), clips=clips, manifest_path=str(path), manifest_sha256=sha)


def load_dataset(name: str, limit_per_language: int | None = None) -> Dataset:
    """A folder with a manifest, or a Hugging Face dataset name (reported as unreachable when it is)."""
    if Path(name).is_dir():
        return load_folder(name, limit_per_language)
    if Path(name).exists():
        raise DatasetError(f"{name} is not a folder: pass the folder that holds manifest.jsonl / manifest.json")
    return _load_hub(name)


def _load_hub(name: str) -> Dataset:
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(f"{name!r} is not a folder, and Hugging Face datasets are unavailable: the `datasets` "
                           "package is not installed (pass a folder with a manifest instead)")
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DatasetError(f"{name!r}: the Hugging Face Hub is unreachable (offline mode is set)")

    try:
        urllib.request.urlopen("https://huggingface.co/api/datasets?limit=1", timeout=HUB_PROBE_TIMEOUT_S)
    except OSError as err:
        raise DatasetError(f"{name!r}: the Hugging Face Hub is unreachable from here ({err}); "
                           "pass a folder with a manifest instead") from None
    raise DatasetError(f"{name!r}: Hugging Face datasets are not wired into the bench yet; export the clips to a "
                       "folder with a manifest.jsonl (audio, text, language)")
