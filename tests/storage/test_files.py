"""Atomic installs of packages (cohere_coreml.storage.files) on a small converted module; a folder's bytes as
`du -sb` counts them."""

from __future__ import annotations

import os
import subprocess

import coremltools as ct
import numpy as np
import pytest
import torch

from cohere_coreml.export.convert import ExportSettings, convert_module
from cohere_coreml.export_errors import ExportSettingsError, ParityError
from cohere_coreml.storage.files import save_package_atomic, tree_bytes, weight_file_bytes


@pytest.fixture(scope="module")
def small_model():
    """A one-layer ML program (x (1, 3, 8) -> y (1, 3, 4)): something to save."""
    torch.manual_seed(0)
    traced = torch.jit.trace(torch.nn.Linear(8, 4).eval(), (torch.zeros(1, 3, 8),))
    mlmodel = convert_module(traced, [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32)],
                             [ct.TensorType(name="y")], ExportSettings(precision="fp32"))
    return mlmodel


def test_save_atomic_skip_force_and_failed_verify(small_model, tmp_path):
    mlmodel = small_model
    path = tmp_path / "small.mlpackage"
    assert save_package_atomic(mlmodel, path) is True
    assert (path / "Manifest.json").exists()
    assert weight_file_bytes(path) > 0
    stamp = (path / "Manifest.json").stat().st_mtime_ns
    # present and not forced: skipped, untouched
    assert save_package_atomic(mlmodel, path) is False
    assert (path / "Manifest.json").stat().st_mtime_ns == stamp

    seen = []

    def failing(tmp):
        seen.append(tmp)
        assert tmp.exists() and tmp != path
        raise ParityError("deliberate")

    # forced but the verification fails: the old package survives, no temp left behind
    with pytest.raises(ParityError):
        save_package_atomic(mlmodel, path, force=True, verify=failing)
    assert path.exists() and (path / "Manifest.json").stat().st_mtime_ns == stamp
    assert not seen[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.mlpackage"]

    # a fresh path with a failing verification leaves nothing at all
    fresh = tmp_path / "fresh.mlpackage"
    with pytest.raises(ParityError):
        save_package_atomic(mlmodel, fresh, verify=failing)
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.mlpackage"]

    with pytest.raises(ExportSettingsError):
        save_package_atomic(mlmodel, tmp_path / "bad.bin")


def test_tree_bytes_counts_as_du_sb(tmp_path):
    """Files, nested folders (their own entries), a folder grown past one block by many entries, a
    hard link (once), symbolic links (the link, not its target): the same figure as `du -sb`; the
    sum of file sizes (what the mixed budget used to count) is not."""
    root = tmp_path / "bundle"
    (root / "a.mlpackage" / "Data" / "weights").mkdir(parents=True)
    (root / "a.mlpackage" / "Data" / "weights" / "weight.bin").write_bytes(b"w" * 100_003)
    (root / "manifest.json").write_text("{}")
    (root / "empty").touch()
    many = root / "many"
    many.mkdir()
    for i in range(300):
        (many / f"file-with-a-long-name-{i:04d}.json").write_text(str(i))
    os.link(root / "manifest.json", root / "hard-link.json")
    os.symlink("a.mlpackage", root / "linked-folder")
    os.symlink("manifest.json", root / "linked-file")
    du = int(subprocess.run(["du", "-sb", str(root)], check=True, capture_output=True, text=True).stdout.split()[0])
    assert os.stat(many).st_size > os.stat(root / "a.mlpackage").st_size  # the grown folder counts its size
    assert tree_bytes(root) == du
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) != du
    assert tree_bytes(root / "manifest.json") == 2
