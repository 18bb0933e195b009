"""Fixtures of the quantization tests (one module per `cohere_coreml.quantize` module).

Built from the session's fp16 bundle of the trained default model (`trained_bundle`: 4 s encoder
window + a 2 s bucket, i.e. a multifunction encoder; decoder with a prefill function, a
multifunction decoder); the gated q8 bundle is built once for the whole folder.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from cohere_coreml.quantize import command as quantize_command
from cohere_coreml.quantize import quantize_bundle

from ..fixture_data import HELDOUT_DIR, TRAINED_MODEL, heldout_utterances
from ..shared_builds import built_once

torch.set_num_threads(1)


@pytest.fixture(scope="package")
def f16_bundle(trained_bundle):
    return trained_bundle


@pytest.fixture(scope="package")
def eval_dir(tmp_path_factory):
    """One held-out clip per language (the gate's evaluation folder)."""
    d = tmp_path_factory.mktemp("eval")
    utts = [{k: v for k, v in u.items() if k != "path"} for u in heldout_utterances(per_language=1)]
    for u in utts:
        shutil.copy(HELDOUT_DIR / u["file"], d / u["file"])
    (d / "manifest.json").write_text(json.dumps({"utterances": utts}))
    return d


@pytest.fixture(scope="package")
def f16_gate_data(f16_bundle, tmp_path_factory):
    """`measure.build_gate_data` of the f16 bundle, run once per test run for each list of clips and shared
    by the builds that gate against it (the q8 bundle, the gated mixed and low-rank bundles, the refused
    build and its rebuild): the f16 bundle's own encoder outputs and greedy decode of the gate windows, a
    function of the (never modified) f16 bundle and the clips' audio only, so every build gets what its
    own run would have computed. Returns `build_gate_data`'s replacement: other bundles (a low-rank bundle
    as a source) still run it."""
    real = quantize_command.build_gate_data
    source = Path(f16_bundle).resolve()

    def shared(bundle_dir, clips, *args, **kwargs):
        if Path(bundle_dir).resolve() != source:
            return real(bundle_dir, clips, *args, **kwargs)
        key = hashlib.sha256()  # the clips by content (eval_dir is a copy per worker), language and order
        for path, lang in clips:
            key.update(hashlib.sha256(Path(path).read_bytes()).digest() + f"{lang}\0".encode())
        key.update(repr((args, sorted(kwargs.items()))).encode())

        def build(folder):
            (folder / "data.pkl").write_bytes(pickle.dumps(real(bundle_dir, clips, *args, **kwargs)))

        folder = built_once(tmp_path_factory, f"gate-data-{key.hexdigest()[:16]}", build)
        return pickle.loads((folder / "data.pkl").read_bytes())  # a fresh copy for each build

    return shared


@pytest.fixture
def shared_gate_data(f16_gate_data, monkeypatch):
    """`quantize_bundle` in this test takes the f16 references from `f16_gate_data`."""
    monkeypatch.setattr(quantize_command, "build_gate_data", f16_gate_data)


@pytest.fixture(scope="package")
def q8_bundle(f16_bundle, eval_dir, f16_gate_data, tmp_path_factory):
    def build(folder):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(quantize_command, "build_gate_data", f16_gate_data)
            # one clip per language cannot decide the task verdict (rule of three): taken undecided, as a user can
            report = quantize_bundle(f16_bundle, folder / "q8", "q8", model=str(TRAINED_MODEL), eval_dir=eval_dir,
                                     accept_undecided=True)
        (folder / "report.json").write_text(json.dumps(report))  # the workers that did not build it read this

    folder = built_once(tmp_path_factory, "qb", build)
    return folder / "q8", json.loads((folder / "report.json").read_text())
