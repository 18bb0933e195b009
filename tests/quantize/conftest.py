"""Fixtures of the quantization tests (one module per `cohere_coreml.quantize` module).

Built from the session's fp16 bundle of the trained default model (`trained_bundle`: 4 s encoder
window + a 2 s bucket, i.e. a multifunction encoder; decoder with a prefill function, a
multifunction decoder); the gated q8 bundle is built once for the whole folder.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

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
def q8_bundle(f16_bundle, eval_dir, tmp_path_factory):
    def build(folder):
        report = quantize_bundle(f16_bundle, folder / "q8", "q8", model=str(TRAINED_MODEL), eval_dir=eval_dir)
        (folder / "report.json").write_text(json.dumps(report))  # the workers that did not build it read this

    folder = built_once(tmp_path_factory, "qb", build)
    return folder / "q8", json.loads((folder / "report.json").read_text())
