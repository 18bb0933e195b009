"""A CLI that answers at once: `--help` of every command, `info`, `bundle check` and `upload --dry-run`
run in a fresh process without importing torch, transformers or coremltools (issue 29), and print what
they printed before (the help text the parser formats, the checkpoint's description, the bundle's files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from cohere_coreml.cli import build_parser

from .fixture_data import TRAINED_MODEL

HEAVY = ("torch", "transformers", "coremltools")
COLUMNS = "100"  # one help width in the child and here
MARK = "\n@@heavy-modules@@"
# runs `cohere-coreml ARGS` as the console script does, then lists the heavy packages it imported
CHILD = f"""
import json, sys
from cohere_coreml.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
sys.stdout.flush()
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
print({MARK!r} + json.dumps({{"status": status, "heavy": heavy}}))
"""


def run_cli(*args: str) -> tuple[int, str, list[str], str]:
    """(exit status, stdout, heavy packages imported, stderr) of `cohere-coreml ARGS` in a fresh process."""
    env = {**os.environ, "COLUMNS": COLUMNS}
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=300)
    assert MARK in done.stdout, done.stderr
    out, tail = done.stdout.rsplit(MARK, 1)
    result = json.loads(tail)
    return result["status"], out, result["heavy"], done.stderr


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **action.choices}


# every command (from the parser: a new one is covered too), and `bundle check --help` (its action given)
HELP_CASES = [[name] if name else [] for name in subcommands()] + [["bundle", "check"]]


@pytest.mark.parametrize("command", HELP_CASES, ids=lambda c: " ".join(c) or "top-level")
def test_help_imports_no_heavy_package(command, monkeypatch):
    status, out, heavy, err = run_cli(*command, "--help")
    assert status == 0, err
    assert heavy == [], f"`cohere-coreml {' '.join(command)} --help` imported {heavy}"
    monkeypatch.setenv("COLUMNS", COLUMNS)
    assert out == subcommands()[command[0] if command else ""].format_help()


@pytest.fixture(scope="module")
def reference_info():
    """`describe` of the committed trained model as loaded by transformers (what `info` printed before)."""
    from cohere_coreml.model.checkpoint import describe, load_reference

    return describe(*load_reference(TRAINED_MODEL))


def test_info_reads_the_checkpoint_files_only(reference_info):
    status, out, heavy, err = run_cli("info", "--model", str(TRAINED_MODEL), "--json")
    assert status == 0, err
    assert heavy == []
    assert json.loads(out) == reference_info
    status, text, heavy, err = run_cli("info", "--model", str(TRAINED_MODEL))
    assert (status, heavy) == (0, []), err
    assert f"parameters   {reference_info['parameters']:,} (encoder {reference_info['encoder_parameters']:,})" in text
    assert text.splitlines()[0] == f"checkpoint   {reference_info['source']}"


def test_prepare_default_describe_imports_no_heavy_package(reference_info):
    status, out, heavy, err = run_cli("prepare-default", "--describe", "--json")
    assert (status, heavy) == (0, []), err
    folder, described = out.split("\n", 1)
    assert folder == str(TRAINED_MODEL) and json.loads(described) == reference_info


def test_info_loads_the_reference_when_config_leaves_a_default(reference_info, tmp_path):
    """A config.json without head_dim (transformers derives it): the files do not say it, so `info`
    loads the reference (torch imported, which this test's check sees) and prints the same."""
    folder = tmp_path / "cohere-tiny-synth"
    shutil.copytree(TRAINED_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    status, out, heavy, err = run_cli("info", "--model", str(folder), "--json")
    assert status == 0, err
    assert "torch" in heavy and "transformers" in heavy
    assert json.loads(out) == reference_info


@pytest.fixture()
def small_bundle(tmp_path):
    """A bundle folder of plain files and a manifest with their checksums (all `bundle check` and
    `upload --dry-run` read)."""
    from cohere_coreml.bundle.manifest import write_manifest

    root = tmp_path / "f16"
    (root / "weights").mkdir(parents=True)
    (root / "vocab.json").write_text(json.dumps({"0": "<unk>", "1": "a"}))
    (root / "weights" / "part.bin").write_bytes(bytes(range(256)) * 3)
    write_manifest({"format": "test"}, root)
    return root


def test_bundle_check_imports_no_heavy_package(small_bundle):
    status, out, heavy, err = run_cli("bundle", "check", str(small_bundle))
    assert (status, heavy) == (0, []), err
    size = sum(f.stat().st_size for f in small_bundle.rglob("*") if f.is_file() and f.name != "manifest.json")
    assert out == f"{small_bundle}: 2 files, {size:,} bytes: every sha256 matches manifest.json\n"
    (small_bundle / "weights" / "part.bin").write_bytes(bytes(768))  # same size, other bytes
    status, out, heavy, err = run_cli("bundle", "check", str(small_bundle))
    assert (status, heavy) == (1, [])
    assert "weights/part.bin: sha256 differs from the manifest" in out


def test_upload_dry_run_imports_no_heavy_package(small_bundle):
    status, out, heavy, err = run_cli("upload", "--bundle", str(small_bundle), "--repo-id", "org/name", "--dry-run")
    assert (status, heavy) == (0, []), err
    manifest_bytes = (small_bundle / "manifest.json").stat().st_size
    lines = out.splitlines()
    assert lines[0].startswith("would upload 3 files (") and lines[0].endswith(" bytes) to org/name/f16/")
    assert sorted(line.split()[-1] for line in lines[1:]) == ["f16/manifest.json", "f16/vocab.json",
                                                              "f16/weights/part.bin"]
    assert f"{manifest_bytes:>14,}  f16/manifest.json" in out
