"""tools/cohere_coreml_dev/swift_fixtures.py: when the Swift step's test bundle is exported again."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from cohere_coreml.bundle.format import FORMAT_VERSION
from cohere_coreml_dev import swift_fixtures

MODEL = Path(__file__).resolve().parents[2] / "models" / "cohere-tiny-synth"


@pytest.fixture
def model(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(MODEL, copy)
    return copy


def test_model_digest_follows_the_weights_not_the_card(model):
    before = swift_fixtures.model_digest(model)
    (model / "README.md").write_text("another card\n")
    assert swift_fixtures.model_digest(model) == before
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one bit of the last tensor
    (model / "model.safetensors").write_bytes(bytes(weights))
    changed = swift_fixtures.model_digest(model)
    assert changed != before
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text() + " ")
    assert swift_fixtures.model_digest(model) != changed


def test_the_test_bundle_is_re_exported_when_the_weights_change(model, tmp_path, monkeypatch):
    """The export keeps packages already present, so a bundle made from other weights must be exported
    with --force: after a retraining, the fixtures would otherwise compare the old model with itself."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        bundle = Path(cmd[cmd.index("--out") + 1])
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(swift_fixtures.subprocess, "run", fake_run)
    out = tmp_path / "fixtures"
    swift_fixtures.export_bundle(out, model, 1)  # first export: nothing to force
    swift_fixtures.export_bundle(out, model, 1)  # same weights and arguments: the packages are kept
    assert ["--force" in c for c in calls] == [False, False]
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    swift_fixtures.export_bundle(out, model, 1)
    assert "--force" in calls[-1]
    swift_fixtures.export_bundle(out, model, 1)  # the new stamp is written: kept again
    assert "--force" not in calls[-1]
    # a stamp of the earlier format (the arguments alone) is stale too
    (out / "bundle.export-args.json").write_text(json.dumps(list(swift_fixtures.EXPORT_ARGS)))
    swift_fixtures.export_bundle(out, model, 1)
    assert "--force" in calls[-1]


def test_a_bundle_without_a_vad_has_no_vad_reference(tmp_path, monkeypatch):
    """vad_regions.json exists only for a bundle with a VAD: the Swift end-to-end test skips on its absence, so a
    stale file from an earlier bundle with one must go."""
    from cohere_coreml.bundle import load

    class NoVad:
        vad_chunks = None
        manifest: dict = {}

    monkeypatch.setattr(load.Bundle, "load", classmethod(lambda cls, *a, **k: NoVad()))
    stale = tmp_path / "vad_regions.json"
    stale.write_text("{}")
    assert swift_fixtures.vad_regions(tmp_path / "bundle", tmp_path, [], 1) is None
    assert not stale.exists()
