"""model/vad.py: the converted module reproduces the silero-vad package's own model on real audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cohere_coreml.model import silero as vad

CLIP = Path(__file__).resolve().parents[1] / "data" / "audio" / "en_medium.wav"


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    wav, sr = sf.read(str(CLIP), dtype="float32")
    assert sr == vad.SAMPLE_RATE
    return wav[: 5 * sr + 300]  # a partial last chunk: padding is part of what is compared


def test_weights_are_the_reference_models_bit_for_bit():
    ours = vad.load_weights()
    theirs = vad._reference_model()._model.state_dict()
    for name, ref_name in vad._NAMES.items():
        assert torch.equal(ours[name], theirs[ref_name]), name


def test_module_matches_package_model(clip):
    ref = vad.reference_probabilities(clip)
    ours = vad.SileroVad.from_package().probabilities(clip)
    assert ours.shape == ref.shape == (-(-clip.size // vad.CHUNK_SAMPLES),)
    assert np.max(np.abs(ours - ref)) < 1e-5
    assert ref.max() > 0.9 and ref.min() < 0.1  # speech and pauses both present: the comparison can fail


def test_other_weights_are_rejected_by_the_comparison(clip):
    """Broken variant: the package's safetensors checkpoint (not its model's) does not reproduce the oracle."""
    from importlib import resources

    from safetensors.torch import load_file

    other = load_file(str(resources.files("silero_vad.data").joinpath("silero_vad_16k.safetensors")))
    module = vad.SileroVad()
    module.load_state_dict({"stft_basis": other["stft_conv.weight"], **{
        k.replace("lstm_cell", "lstm").replace("final_conv", "out"): v for k, v in other.items()
        if k != "stft_conv.weight"}})
    diff = np.max(np.abs(module.eval().probabilities(clip) - vad.reference_probabilities(clip)))
    assert diff > 1e-2


def test_frames_carry_the_context():
    wav = np.arange(1000, dtype=np.float32)
    frames = vad.chunk_frames(wav, context=np.full(64, -1, np.float32))
    assert frames.shape == (2, 576)
    assert np.all(frames[0, :64] == -1) and np.array_equal(frames[0, 64:], wav[:512])
    assert np.array_equal(frames[1, :64], wav[448:512]) and np.array_equal(frames[1, 64:64 + 488], wav[512:])
    assert np.all(frames[1, 64 + 488:] == 0)


def test_reference_keeps_torch_threads():
    before = torch.get_num_threads()
    vad._REFERENCE.clear()
    vad._reference_model()
    assert torch.get_num_threads() == before
