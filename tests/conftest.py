"""Shared fixtures: small checkpoints the project makes itself, and the committed test audio."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from .fixture_data import TRAINED_BUCKETS, TRAINED_MAX_NEW_TOKENS, TRAINED_MODEL, TRAINED_WINDOW_S
from .shared_builds import built_once

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_finish(session):
    """What collection imported (torch, coremltools, transformers: ~450 k objects) is frozen out of the
    garbage collector: `coremltools.convert` ends in a full `gc.collect()`, 0.25 s each over those objects
    and a test run converts hundreds of programs. Objects made later (models, programs) are collected as
    before; nothing frozen was garbage (modules and their globals live as long as the process)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def autograd_left_as_found():
    """A test (and the library code it calls) leaves autograd on: a library call that switched it off for
    the thread once broke a later training test on the same xdist worker. Fails the test that leaks it."""
    yield
    torch = sys.modules.get("torch")  # not imported here: most tests never load torch
    if torch is not None and not torch.is_grad_enabled():
        torch.set_grad_enabled(True)  # so the next test on this worker starts clean
        pytest.fail("autograd was left off (torch.set_grad_enabled(False) outside a context manager)")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-weight tiny checkpoint in the released Hugging Face format (default shape)."""
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    """(model, processor) of `tiny_checkpoint`, loaded through `load_reference`."""
    from cohere_coreml.model.checkpoint import load_reference

    return load_reference(tiny_checkpoint)


# The committed trained model (fixture_data.TRAINED_MODEL): its transcripts depend on the audio and
# on the prompt, so it is the fixture for end-to-end checks. Exported once per test run (`built_once`:
# also when the run is split over workers), as users run
# it (fp16, a length bucket, the prefill function), with a short window: the held-out clips are 1.6-4 s.
@pytest.fixture(scope="session")
def trained_reference():
    """(model, processor) of models/cohere-tiny-synth, dither 0."""
    from cohere_coreml.model.checkpoint import load_reference

    model, processor = load_reference(TRAINED_MODEL)
    processor.feature_extractor.dither = 0.0
    return model, processor


@pytest.fixture(scope="session")
def vad_package(tmp_path_factory) -> Path:
    """A folder holding the fp16 vad.mlpackage (`export --vad`, gated on the packaged gate audio) and its
    vad.parity.json: converted once per test run; bundles that need a VAD copy it (`copy_packages`), so their
    export skips it."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.vad_package import convert_vad

    def build(folder: Path) -> None:
        convert_vad(ExportSettings(out_dir=folder / "vad", precision="fp16"))

    return built_once(tmp_path_factory, "vad", build) / "vad"


@pytest.fixture(scope="session")
def trained_bundle(trained_reference, vad_package, tmp_path_factory) -> Path:
    """fp16 bundle of the trained model: 4 s encoder window + 2 s bucket, decoder with prefill, and the VAD
    (`vad_package`, copied in: the export finds it current and skips it)."""
    import torch

    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model

    from .helpers import copy_packages

    torch.set_num_threads(1)
    model, processor = trained_reference

    def build(folder: Path) -> None:
        copy_packages(vad_package, folder / "bundle", ("vad",))
        settings = ExportSettings(out_dir=folder / "bundle", precision="fp16", model_id="cohere-tiny-synth",
                                  window_seconds=TRAINED_WINDOW_S)
        export_model(model, processor, settings, max_new_tokens=TRAINED_MAX_NEW_TOKENS, buckets=TRAINED_BUCKETS,
                     prefill=True)

    return built_once(tmp_path_factory, "trained", build) / "bundle"


@pytest.fixture(scope="session")
def trained_bundle_without_vad(trained_bundle, tmp_path_factory) -> Path:
    """`trained_bundle` as a bundle exported with `--no-vad` (or before the VAD) has it: no vad.mlpackage, no
    manifest `vad` / `files.vad`, checksums of the files left."""
    import json
    import shutil

    from cohere_coreml.bundle.manifest import refresh_manifest

    def build(folder: Path) -> None:
        out = folder / "bundle"
        shutil.copytree(trained_bundle, out)
        shutil.rmtree(out / "vad.mlpackage")
        (out / "vad.parity.json").unlink()
        manifest = json.loads((out / "manifest.json").read_text())
        manifest.pop("vad")
        manifest["files"].pop("vad")
        (out / "manifest.json").write_text(json.dumps(manifest))
        refresh_manifest(out)

    return built_once(tmp_path_factory, "trained-no-vad", build) / "bundle"


@pytest.fixture(scope="session")
def trained_parts_bundle(trained_reference, trained_bundle, tmp_path_factory) -> Path:
    """`trained_bundle` with its encoder in 2 parts (export --encoder-parts 2): the front end and decoder
    are the session bundle's (copied, so the export skips them), the encoder exported in parts."""
    import torch

    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model

    from .helpers import copy_packages

    torch.set_num_threads(1)
    model, processor = trained_reference

    def build(folder: Path) -> None:
        out = copy_packages(trained_bundle, folder / "bundle", ("decoder", "frontend", "vad"))
        settings = ExportSettings(out_dir=out, precision="fp16", model_id="cohere-tiny-synth",
                                  window_seconds=TRAINED_WINDOW_S)
        export_model(model, processor, settings, max_new_tokens=TRAINED_MAX_NEW_TOKENS, buckets=TRAINED_BUCKETS,
                     prefill=True, encoder_parts=2)

    return built_once(tmp_path_factory, "trained-parts", build) / "bundle"
