"""`built_once`: one build per test run, also across workers; a failed build is redone, never read."""

from __future__ import annotations

import pytest

from .shared_builds import built_once


class _Factory:
    """The two tmp_path_factory calls built_once makes, over a folder of this test."""

    def __init__(self, root):
        self.root, self.made = root, 0

    def getbasetemp(self):
        return self.root / "popen-gw0"

    def mktemp(self, name):
        self.made += 1
        path = self.root / f"{name}{self.made}"
        path.mkdir()
        return path


def test_workers_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    factory, calls = _Factory(tmp_path), []

    def build(folder):
        calls.append(folder)
        (folder / "out.txt").write_text("built")

    first = built_once(factory, "bundle", build)
    second = built_once(factory, "bundle", build)  # another worker of the same run
    assert first == second == tmp_path / "bundle" and len(calls) == 1
    assert (first / "out.txt").read_text() == "built" and (tmp_path / "bundle.complete").is_file()


def test_a_failed_build_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    factory = _Factory(tmp_path)

    def broken(folder):
        (folder / "half.txt").write_text("half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        built_once(factory, "bundle", broken)
    assert not (tmp_path / "bundle.complete").exists()
    folder = built_once(factory, "bundle", lambda f: (f / "out.txt").write_text("built"))
    assert sorted(p.name for p in folder.iterdir()) == ["out.txt"]  # the half-written file is gone


def test_alone_each_call_is_a_fresh_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    factory, calls = _Factory(tmp_path), []
    a = built_once(factory, "bundle", calls.append)
    b = built_once(factory, "bundle", calls.append)
    assert a != b and calls == [a, b] and factory.made == 2
