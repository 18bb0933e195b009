"""Shared fixtures: small checkpoints the project makes itself, and the committed test audio."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA_DIR = Path(__file__).parent / "data"
AUDIO_DIR = DATA_DIR / "audio"


def audio_manifest() -> list[dict]:
    """Entries of tests/data/audio/manifest.json (file, language, text, sample_rate, channels, ...)."""
    path = AUDIO_DIR / "manifest.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    entries = data["clips"] if isinstance(data, dict) else data
    return [dict(e, path=AUDIO_DIR / e["file"]) for e in entries]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-weight tiny checkpoint in the released Hugging Face format (default shape)."""
    from cohere_coreml.checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    """(model, processor) of `tiny_checkpoint`, loaded through `load_reference`."""
    from cohere_coreml.checkpoint import load_reference

    return load_reference(tiny_checkpoint)
