"""The compiled-model cache's folder rules (runtime/compiled_cache.py; the Swift package's CompiledModelCache
and its tests hold the same rules): installs that never delete a complete model, even with two processes
compiling and loading one package at once; last use; upkeep after an install; list / clear / prune and the
`cohere-coreml cache` command. No Core ML needed: a compile here is a copy of the package, as the tests'
emulation makes one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cohere_coreml.cli import main
from cohere_coreml.runtime import compiled_cache
from cohere_coreml.runtime.compiled_cache import (
    COMPLETE_MARKER,
    TEMPORARY_NAME,
    CompiledCache,
    clear,
    entries,
    install,
    prune,
)

RACE = Path(__file__).with_name("cache_race.py")


def compiled_copy(folder: Path, text: str, size: int = 0) -> Path:
    """A freshly "compiled" model: a new folder holding one file that says `text`, padded to `size` bytes."""
    out = folder / f"fresh-{uuid.uuid4().hex}" / "model.mlmodelc"
    out.mkdir(parents=True)
    data = text.encode()
    (out / "weights").write_bytes(data + b"\0" * max(0, size - len(data)))
    return out


def said(entry: Path) -> str:
    return (entry / "weights").read_bytes().split(b"\0")[0].decode()


def name(package: str, n: int) -> str:
    return f"{package}-{n:024x}.mlmodelc"


def old_install(compiled: Path, target: Path) -> None:
    """The rule before this one (the broken variant): a target that exists is deleted first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    shutil.move(os.fspath(compiled), os.fspath(staging))
    (staging / COMPLETE_MARKER).write_bytes(b"")
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)


def test_an_install_keeps_a_complete_target(tmp_path):
    target = tmp_path / "cache" / name("encoder", 1)
    assert install(compiled_copy(tmp_path, "first"), target) is True
    second = compiled_copy(tmp_path, "second")
    assert install(second, target) is False  # the same content by its name: kept, the fresh copy dropped
    assert said(target) == "first" and not second.exists()
    assert [e.path.name for e in entries(target.parent)] == [target.name]
    # the rule it replaces deletes the complete model (under a process that may be loading it)
    old_install(compiled_copy(tmp_path, "third"), target)
    assert said(target) == "third"


def test_an_install_replaces_an_incomplete_leftover(tmp_path):
    target = tmp_path / "cache" / name("decoder", 2)
    target.mkdir(parents=True)
    (target / "junk").write_text("half")
    assert install(compiled_copy(tmp_path, "fresh"), target, source=tmp_path / "b" / "decoder.mlpackage") is True
    assert said(target) == "fresh" and not (target / "junk").exists()
    assert json.loads((target / COMPLETE_MARKER).read_text()) == {"source": str(tmp_path / "b" / "decoder.mlpackage")}
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no staging or trash left


def test_two_processes_compiling_and_loading_one_package_at_once(trained_bundle, tmp_path):
    """Two processes, 50 rounds, each round a new cache folder both compile into and load from at once
    (met at a barrier): 0 failures, one complete entry per folder, no temporary left."""
    rounds, processes = 50, 2
    package = trained_bundle / "frontend.mlpackage"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(compiled_cache.__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    children = [subprocess.Popen([sys.executable, str(RACE), str(tmp_path), str(package), str(rounds),
                                  str(processes), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env) for i in range(processes)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["failures"] for r in results] == [[]] * processes
    for r in range(rounds):
        found = entries(tmp_path / f"cache{r}")
        assert [(e.complete, e.temporary) for e in found] == [(True, False)], r
        assert sorted(p.name for p in (tmp_path / f"cache{r}").iterdir()) == [found[0].path.name]


def test_a_hit_touches_the_marker_and_an_install_prunes_the_same_packages_earlier_contents(trained_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(trained_bundle, bundle)
    package = bundle / "frontend.mlpackage"
    cache = CompiledCache(tmp_path / "cache", max_bytes=None)

    def compile_copy(path):
        out = tmp_path / f"c-{uuid.uuid4().hex}" / "frontend.mlmodelc"
        shutil.copytree(path, out)
        return str(out)

    first = cache.compiled(package, compile_copy)
    os.utime(first / COMPLETE_MARKER, (1, 1))
    assert cache.compiled(package, compile_copy) == first and cache.hits == 1
    assert (first / COMPLETE_MARKER).stat().st_mtime > time.time() - 60  # the use is recorded
    other = cache.folder / name("frontend", 7)  # the same package name from another bundle: another source
    install(compiled_copy(tmp_path, "q8"), other, source=tmp_path / "q8" / "frontend.mlpackage")
    manifest = json.loads((bundle / "manifest.json").read_text())  # the bundle re-exported: other content
    key = next(k for k in manifest["checksums"]["files"] if k.startswith("frontend.mlpackage/"))
    manifest["checksums"]["files"][key]["sha256"] = "0" * 64
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    second = cache.compiled(package, compile_copy)
    assert second != first and not first.exists()  # the earlier content of this package is gone
    assert {e.path.name for e in entries(cache.folder)} == {second.name, other.name}  # the other source's stays


def test_the_size_cap_removes_the_least_recently_used_others(tmp_path):
    folder = tmp_path / "cache"
    for i, age in enumerate((300, 200, 100)):
        target = folder / name("encoder", i)
        install(compiled_copy(tmp_path, f"e{i}", size=1000), target)
        os.utime(target / COMPLETE_MARKER, (time.time() - age, time.time() - age))
    new = folder / name("decoder", 9)
    install(compiled_copy(tmp_path, "new", size=1000), new)
    os.utime(new / COMPLETE_MARKER, (1, 1))  # the oldest of all, but just installed: protected
    cache = CompiledCache(folder, max_bytes=2500)
    removed = cache.after_install(new, tmp_path / "decoder.mlpackage")
    assert [e.path.name for e in removed] == [name("encoder", 0), name("encoder", 1)]
    assert {e.path.name for e in entries(folder)} == {name("encoder", 2), new.name}


def populated(tmp_path) -> tuple[Path, list[str], Path, Path]:
    """A cache folder of four entries last used 40, 10, 1 and 20 days ago, an interrupted install of a process
    that is gone and one of this process."""
    folder = tmp_path / "cache"
    names = []
    now = time.time()
    for i, (package, days) in enumerate((("encoder", 40), ("encoder", 10), ("encoder", 1), ("decoder", 20))):
        target = folder / name(package, i)
        install(compiled_copy(tmp_path, f"{package} {i}", size=100), target)
        os.utime(target / COMPLETE_MARKER, (now - days * 86400, now - days * 86400))
        names.append(target.name)
    dead = folder / f".{name('encoder', 9)}.tmp-999999-0123abcd"
    live = folder / f".{name('encoder', 8)}.tmp-{os.getpid()}-89ef"
    dead.mkdir()
    live.mkdir()
    return folder, names, dead, live


def test_entries_prune_and_clear(tmp_path):
    folder, names, dead, live = populated(tmp_path)
    listed = entries(folder)
    complete = [e for e in listed if e.complete]
    assert [e.path.name for e in complete] == [names[0], names[3], names[1], names[2]]  # least recently used first
    assert [e.package for e in complete] == ["encoder", "decoder", "encoder", "encoder"]
    assert all(e.size >= 100 for e in complete) and {e.pid for e in listed if e.temporary} == {999999, os.getpid()}
    assert {e.path.name for e in prune(folder, keep=2)} == {names[0], dead.name}  # and the dead process's leftover
    assert [e.path.name for e in prune(folder, older_than=15 * 86400)] == [names[3]]
    assert {e.path.name for e in clear(folder)} == {names[1], names[2]}
    assert [e.path.name for e in entries(folder)] == [live.name]  # a live process's install is left alone


def test_temporary_names_are_swifts():
    """The names the Swift package writes and parses (CompiledModelCacheTests.testTemporaryNamesArePythons)."""
    m = TEMPORARY_NAME.match(".encoder-0123456789abcdef01234567.mlmodelc.tmp-4242-9f0e")
    assert m and (m["entry"], m["kind"], m["pid"]) == ("encoder-0123456789abcdef01234567.mlmodelc", "tmp", "4242")
    assert TEMPORARY_NAME.match(".decoder-x.mlmodelc.trash-7-ab")["kind"] == "trash"
    assert TEMPORARY_NAME.match(".encoder.mlmodelc.tmp-12-XYZ") is None
    assert TEMPORARY_NAME.match("encoder-1.mlmodelc") is None
    assert compiled_cache._package_of("encoder_part2-0123456789abcdef01234567.mlmodelc") == "encoder_part2"


def test_size_cap_from_the_environment(monkeypatch):
    monkeypatch.delenv(compiled_cache.MAX_GB_ENV, raising=False)
    assert compiled_cache.default_max_bytes() == int(compiled_cache.DEFAULT_MAX_GB * 2**30)
    monkeypatch.setenv(compiled_cache.MAX_GB_ENV, "0")
    assert compiled_cache.default_max_bytes() is None
    monkeypatch.setenv(compiled_cache.MAX_GB_ENV, "1.5")
    assert compiled_cache.default_max_bytes() == int(1.5 * 2**30)
    monkeypatch.setenv(compiled_cache.MAX_GB_ENV, "lots")
    with pytest.raises(ValueError, match="COHERE_COREML_CACHE_MAX_GB"):
        compiled_cache.default_max_bytes()


# --------------------------------------------------------------------------------------------
# `cohere-coreml cache`
# --------------------------------------------------------------------------------------------


def test_cache_command_list_prune_clear(tmp_path, capsys):
    folder, names, dead, live = populated(tmp_path)
    assert main(["cache", "list", "--cache", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("6 entries, ") and out[-1].endswith(f" MB in {folder}")
    assert [line.split()[-1] for line in out[:-1] if line.endswith(".mlmodelc")] == [
        names[0], names[3], names[1], names[2]]
    assert "40 d ago" in out[0] and sum("incomplete" in line for line in out) == 2
    assert main(["cache", "list", "--cache", str(folder), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["folder"] == str(folder) and len(listed["entries"]) == 6
    assert main(["cache", "prune", "--cache", str(folder), "--keep", "1", "--older-than", "15d"]) == 0
    assert capsys.readouterr().out.startswith("removed 4 entries")  # encoders 0 and 1, the decoder, the dead one
    assert {e.path.name for e in entries(folder)} == {names[2], live.name}
    assert main(["cache", "clear", "--cache", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("removed 1 entry, ")
    assert [e.path.name for e in entries(folder)] == [live.name]


@pytest.mark.parametrize("argv, message", [
    (["cache", "prune"], "say what to prune"),
    (["cache", "prune", "--older-than", "3x"], "expected a number and a unit"),
    (["cache", "prune", "--keep", "0"], "expected a whole number >= 1"),
    (["cache", "prune", "--max-gb", "-1"], "expected a number of GiB >= 0"),
])
def test_cache_command_bad_input_is_one_line(argv, message, tmp_path, capsys):
    try:
        code = main(argv + ["--cache", str(tmp_path)])
    except SystemExit as exit_:  # argparse's refusal of a flag's value
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)
