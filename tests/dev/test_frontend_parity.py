"""tools/parity/frontend_parity.py: the per-clip distance between `audio.log_mel` and transformers'
`CohereAsrFeatureExtractor` it prints, on a committed clip, and what it says when they differ."""

from __future__ import annotations

import re

import numpy as np

from ..fixture_data import AUDIO_DIR
from ..helpers import load_tool

CLIP = AUDIO_DIR / "de_short.wav"
TOLERANCE = 1e-4  # as tests/model/test_audio.py


def _worst(out: str) -> float:
    return float(re.search(r"worst max \|diff\| on valid frames: (\S+)", out).group(1))


def test_the_tool_prints_each_piece_and_the_worst_difference(capsys):
    tool = load_tool("parity/frontend_parity")
    assert tool.main([str(CLIP)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:2] == ["clip", "piece"] and len(rows) == 3
    name, piece, frames, valid, ref_valid, diff, pad_zero = rows[1].split()
    assert (name, piece, pad_zero) == ("de_short.wav", "0", "True") and valid == ref_valid and int(valid) <= int(frames)
    assert _worst(rows[2]) == float(diff) <= TOLERANCE


def test_a_front_end_that_differs_is_shown(capsys, monkeypatch):
    """A log_mel off by 0.01 on every valid frame: the tool's worst difference says so."""
    tool = load_tool("parity/frontend_parity")
    log_mel = tool.log_mel
    monkeypatch.setattr(tool, "log_mel", lambda piece, config: (lambda f, n: (f + np.float32(0.01), n))(
        *log_mel(piece, config)))
    assert tool.main([str(CLIP)]) == 0
    assert abs(_worst(capsys.readouterr().out) - 0.01) < 1e-3


def test_a_missing_file_is_one_line_on_stderr(tmp_path, capsys):
    tool = load_tool("parity/frontend_parity")
    assert tool.main([str(tmp_path / "nowhere.wav")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("frontend_parity: ") and "nowhere.wav" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
