"""Evaluation dataset folders (`cohere_coreml.evaluation.datasets`): the manifest formats `load_folder` accepts,
its per-language limit, clip ids and per-clip problems, the manifest hash, and refusals naming the
problem. (Folders with per-clip problems in a bench run: test_metrics.py, test_bench.py.)"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from cohere_coreml.evaluation.datasets import Dataset, DatasetError, load_dataset, load_folder

from ..fixture_data import AUDIO_DIR, HELDOUT_DIR, heldout_utterances

CLIP = AUDIO_DIR / "en_short.wav"
ENTRIES = [{"file": "a.wav", "text": "hello there", "language": "en"},
           {"file": "b.wav", "text": "hallo", "language": "de"},
           {"file": "c.wav", "text": "good morning", "language": "en"}]


def folder(tmp_path: Path, manifest: str | None, text, clips=("a.wav", "b.wav", "c.wav")) -> Path:
    """A dataset folder with `clips` (copies of one committed clip) and `text` as its manifest."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in clips:
        shutil.copy(CLIP, tmp_path / name)
    if manifest is not None:
        (tmp_path / manifest).write_text(text if isinstance(text, str) else json.dumps(text), encoding="utf-8")
    return tmp_path


def jsonl(entries) -> str:
    return "\n".join(json.dumps(e) for e in entries) + "\n"


def summary(ds: Dataset) -> list[tuple]:
    return [(c.id, c.audio, c.text, c.language, c.problem, c.index) for c in ds.clips]


@pytest.mark.parametrize("manifest, text", [
    ("manifest.jsonl", jsonl(ENTRIES)),
    ("manifest.jsonl", "\n\n" + jsonl(ENTRIES).replace("\n", "\n  \n")),  # blank lines are skipped
    ("manifest.json", ENTRIES),
    ("manifest.json", {"utterances": ENTRIES}),
    ("manifest.json", {"clips": ENTRIES}),
    ("manifest.json", {"items": ENTRIES}),
])
def test_every_manifest_format_reads_the_same_clips(tmp_path, manifest, text):
    ds = load_folder(folder(tmp_path, manifest, text))
    assert summary(ds) == [("a.wav", tmp_path / "a.wav", "hello there", "en", None, 0),
                           ("b.wav", tmp_path / "b.wav", "hallo", "de", None, 1),
                           ("c.wav", tmp_path / "c.wav", "good morning", "en", None, 2)]
    assert ds.name == str(tmp_path) and ds.manifest_path == str(tmp_path / manifest)
    assert ds.languages() == ["de", "en"]


def test_jsonl_wins_over_json(tmp_path):
    path = folder(tmp_path, "manifest.json", ENTRIES[:1])
    (path / "manifest.jsonl").write_text(jsonl(ENTRIES[1:]))
    ds = load_folder(path)
    assert ds.manifest_path == str(path / "manifest.jsonl") and [c.id for c in ds.clips] == ["b.wav", "c.wav"]


def test_audio_keys_and_ids(tmp_path):
    """"file", "audio" or "path" name the clip; the id is the entry's "id", else the file, else its index."""
    entries = [{"audio": "a.wav", "text": "x", "language": "en", "id": "utt-1"},
               {"path": "b.wav", "text": "y", "language": "en"},
               {"file": "c.wav", "audio": "a.wav", "text": "z", "language": "en"},  # "file" first
               {"text": "w", "language": "en"}]
    ds = load_folder(folder(tmp_path, "manifest.jsonl", jsonl(entries)))
    assert [(c.id, c.audio) for c in ds.clips] == [("utt-1", tmp_path / "a.wav"), ("b.wav", tmp_path / "b.wav"),
                                                   ("c.wav", tmp_path / "c.wav"), ("3", None)]
    assert [c.problem for c in ds.clips] == [None, None, None, "no audio file named"]


def test_per_clip_problems_keep_the_clip(tmp_path):
    entries = [{"file": "a.wav", "text": "   ", "language": "en"},
               {"file": "sub/missing.wav", "text": "x", "language": "en"},
               {"file": "b.wav", "text": "fine", "language": "en"}]
    ds = load_folder(folder(tmp_path, "manifest.jsonl", jsonl(entries)))
    assert [c.problem for c in ds.clips] == ["empty reference transcript",
                                             f"audio file not found: {tmp_path / 'sub' / 'missing.wav'}", None]


def test_limit_per_language_keeps_the_first_of_each_in_manifest_order(tmp_path):
    entries = [{"file": "a.wav", "text": f"t{i}", "language": lang}
               for i, lang in enumerate(["en", "de", "en", "en", "fr", "de", "de"])]
    path = folder(tmp_path, "manifest.jsonl", jsonl(entries))
    two = load_folder(path, limit_per_language=2)
    assert [(c.language, c.index) for c in two.clips] == [("en", 0), ("de", 1), ("en", 2), ("fr", 4), ("de", 5)]
    one = load_folder(path, limit_per_language=1)
    assert [(c.language, c.index) for c in one.clips] == [("en", 0), ("de", 1), ("fr", 4)]
    assert len(load_folder(path).clips) == len(entries)  # no limit: every entry
    assert load_dataset(str(path), limit_per_language=1).clips == one.clips  # load_dataset passes it on
    # clips with problems count towards the limit too (they are reported, not silently replaced)
    entries[0]["file"] = "missing.wav"
    (path / "manifest.jsonl").write_text(jsonl(entries))
    first = load_folder(path, limit_per_language=1).clips[0]
    assert first.index == 0 and first.problem.startswith("audio file not found")


def test_committed_heldout_set_reads_as_the_fixture_data_says():
    """tests/data/heldout ({"utterances": [...]}) with a limit: the same clips `heldout_utterances` picks."""
    ds = load_folder(HELDOUT_DIR, limit_per_language=1)
    want = heldout_utterances(1)
    assert sorted((c.language, c.audio, c.text) for c in ds.clips) == sorted(
        (u["language"], u["path"], u["text"]) for u in want)
    assert all(c.problem is None for c in ds.clips) and len(ds.languages()) == len(want) >= 2


def test_manifest_hash_is_of_the_manifest_bytes(tmp_path):
    path = folder(tmp_path, "manifest.jsonl", jsonl(ENTRIES))
    ds = load_folder(path)
    assert ds.manifest_sha256 == hashlib.sha256((path / "manifest.jsonl").read_bytes()).hexdigest()
    (path / "manifest.jsonl").write_text(jsonl(ENTRIES[::-1]))  # same clips, other order: another manifest
    assert load_folder(path).manifest_sha256 != ds.manifest_sha256


@pytest.mark.parametrize("manifest, text, message", [
    ("manifest.json", "{not json", r"manifest.json: not valid JSON"),
    ("manifest.jsonl", jsonl(ENTRIES[:1]) + "{broken\n", r"manifest.jsonl: not valid JSON"),
    ("manifest.json", {"files": ENTRIES}, r"manifest.json: expected a list of entries"),
    ("manifest.json", "42", r"manifest.json: expected a list of entries"),
    ("manifest.json", [ENTRIES[0], ["b.wav", "x", "en"]], r"manifest.json: entry 1 is not an object"),
    ("manifest.jsonl", jsonl([ENTRIES[0], {"file": "b.wav", "text": "x"}]), r"manifest.jsonl: entry 1 has no language"),
    ("manifest.jsonl", jsonl([{"file": "b.wav", "text": "x", "language": ""}]), r"entry 0 has no language"),
    ("manifest.json", [], r"manifest.json lists no clips"),
    ("manifest.jsonl", "\n \n", r"manifest.jsonl lists no clips"),
])
def test_bad_manifests_are_refused_naming_the_file_and_problem(tmp_path, manifest, text, message):
    path = folder(tmp_path, manifest, text)
    with pytest.raises(DatasetError, match=message) as info:
        load_folder(path)
    assert str(path / manifest) in str(info.value)


def test_missing_folder_or_manifest_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="dataset folder not found: .*nowhere"):
        load_folder(tmp_path / "nowhere")
    empty = folder(tmp_path / "empty", None, None)
    with pytest.raises(DatasetError, match="no manifest.jsonl or manifest.json in .*empty"):
        load_folder(empty)
    (empty / "manifest.txt").write_text(jsonl(ENTRIES))  # another name is not a manifest
    with pytest.raises(DatasetError, match="no manifest.jsonl or manifest.json"):
        load_folder(empty)
    (empty / "manifest.jsonl").mkdir()  # a folder of that name is not one either
    with pytest.raises(DatasetError, match="no manifest.jsonl or manifest.json"):
        load_folder(empty)
    with pytest.raises(DatasetError, match="is not a folder"):  # load_dataset given a file
        load_dataset(str(CLIP))


def test_audio_outside_the_dataset_folder_is_not_read(tmp_path):
    """Nothing is read from outside the folder a dataset belongs to: `..`, an absolute path and a link
    out of the folder are problems of their clip (never scored); a subfolder is inside (the control)."""
    outside = tmp_path / "elsewhere.wav"
    shutil.copy(CLIP, outside)
    root = tmp_path / "set"
    (root / "sub").mkdir(parents=True)
    shutil.copy(CLIP, root / "sub" / "in.wav")
    (root / "link.wav").symlink_to(outside)
    entries = [{"file": f, "text": "hello", "language": "en"}
               for f in ("sub/in.wav", "../elsewhere.wav", str(outside), "link.wav")]
    (root / "manifest.json").write_text(json.dumps(entries))
    problems = [c.problem for c in load_folder(root).clips]
    assert problems[0] is None
    assert all(p and "outside the dataset folder" in p for p in problems[1:]), problems


def test_non_utf8_manifest_and_non_string_file_are_named(tmp_path):
    root = folder(tmp_path / "a", None, None)
    (root / "manifest.json").write_bytes(b'[{"file": "a.wav", "text": "caf\xe9", "language": "fr"}]')
    with pytest.raises(DatasetError, match=r"manifest\.json: not UTF-8"):
        load_folder(root)
    root = folder(tmp_path / "b", "manifest.json", [{"file": 5, "text": "x", "language": "en"}])
    with pytest.raises(DatasetError, match=r"entry 0: the audio file must be a string path, got 5"):
        load_folder(root)
