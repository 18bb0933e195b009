"""Where the committed test data lives and what it holds: audio clips, the held-out set, the trained
model and the export settings of its session bundle (`conftest.trained_bundle`). Plain values and
readers, imported by tests and by conftest.py (tests never import conftest itself)."""

from __future__ import annotations

import json
from pathlib import Path

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


TRAINED_MODEL = Path(__file__).resolve().parents[1] / "models" / "cohere-tiny-synth"
HELDOUT_DIR = DATA_DIR / "heldout"
TRAINED_WINDOW_S = 4.0
TRAINED_BUCKETS = (2.0,)
TRAINED_MAX_NEW_TOKENS = 54  # -> cache capacity round_up(10 + 54, 32) = 64


def heldout_utterances(per_language: int) -> list[dict]:
    """The first `per_language` held-out utterances of each language (tests/data/heldout)."""
    data = json.loads((HELDOUT_DIR / "manifest.json").read_text())
    picked: dict[str, list[dict]] = {}
    for u in data["utterances"]:
        if len(picked.setdefault(u["language"], [])) < per_language:
            picked[u["language"]].append(dict(u, path=HELDOUT_DIR / u["file"]))
    return [u for lang in sorted(picked) for u in picked[lang]]
