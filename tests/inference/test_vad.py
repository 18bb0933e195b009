"""inference/vad.py: the stream gives the same probabilities as the whole-signal call, however audio arrives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml.inference import vad

CLIP = Path(__file__).resolve().parents[1] / "data" / "audio" / "en_medium.wav"


@pytest.fixture(scope="module")
def engine():
    return vad.TorchVad()


@pytest.mark.parametrize("sizes", [(512,), (100, 700, 3), (4000,)])
def test_stream_matches_whole_signal(engine, sizes):
    wav, _ = sf.read(str(CLIP), dtype="float32")
    wav = wav[: 512 * 40]
    whole = engine.probabilities(wav)
    stream, got, pos, i = engine.stream(), [], 0, 0
    while pos < wav.size:
        step = sizes[i % len(sizes)]
        got.append(stream.push(wav[pos : pos + step]))
        pos, i = pos + step, i + 1
    got = np.concatenate(got)
    assert got.shape == whole.shape
    assert np.max(np.abs(got - whole)) < 1e-5
    # broken variant: a stream that drops the context between pushes differs
    stream = engine.stream()
    first = stream.push(wav[:512 * 20])
    stream._context[:] = 0
    rest = stream.push(wav[512 * 20:])
    assert np.max(np.abs(np.concatenate([first, rest]) - whole)) > 1e-4
