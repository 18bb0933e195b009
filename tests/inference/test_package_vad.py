"""inference.vad.PackageVad: the bundle's vad.mlpackage through the runtime gives the PyTorch module's
probabilities (within the gate's bound, same speech segments), whole or streamed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cohere_coreml.export.vad_package import BLOCK_CHUNKS, MAX_ABS_DIFF
from cohere_coreml.inference.vad import PackageVad, TorchVad, VadPackageError, vad_for
from cohere_coreml.model import silero
from cohere_coreml.model.audio import load_audio

AUDIO = Path(__file__).resolve().parents[1] / "data" / "audio"
BOUND = MAX_ABS_DIFF["fp16"]  # the session's package is fp16


@pytest.fixture(scope="module")
def package_vad(vad_package):
    return PackageVad.load(vad_package / "vad.mlpackage", BLOCK_CHUNKS, backend="mil")


@pytest.fixture(scope="module")
def torch_vad():
    return TorchVad()


@pytest.mark.parametrize("clip", ["en_long_75s.flac", "fr_medium.wav"])
def test_probabilities_match_the_pytorch_module(package_vad, torch_vad, clip):
    wav = load_audio(AUDIO / clip, target_rate=16000)
    got, want = package_vad.probabilities(wav), torch_vad.probabilities(wav)
    assert got.shape == want.shape == (-(-wav.size // 512),) and got.dtype == np.float32
    assert float(np.abs(got - want).max()) <= BOUND
    assert silero.reference_regions(got, wav.size) == silero.reference_regions(want, wav.size)


def test_padded_rows_are_discarded_and_the_state_carried(package_vad, torch_vad):
    """Signals of fewer, exactly N and more than N chunks (a partial last block)."""
    wav = load_audio(AUDIO / "en_medium.wav", target_rate=16000)
    for chunks in (3, BLOCK_CHUNKS, BLOCK_CHUNKS + 5):
        piece = wav[: chunks * 512 - 100]
        got, want = package_vad.probabilities(piece), torch_vad.probabilities(piece)
        assert got.shape == (chunks,) and float(np.abs(got - want).max()) <= BOUND
    assert package_vad.probabilities(np.zeros(0, np.float32)).shape == (0,)


def test_stream_gives_the_whole_signals_probabilities(package_vad):
    wav = load_audio(AUDIO / "fr_medium.wav", target_rate=16000)
    wav = wav[: wav.size // 512 * 512]
    whole = package_vad.probabilities(wav)
    at_once = package_vad.stream().push(wav)
    stream, pieces, pos, i = package_vad.stream(), [], 0, 0
    sizes = (100, 700, 3, 4000)
    while pos < wav.size:
        pieces.append(stream.push(wav[pos : pos + sizes[i % 4]]))
        pos, i = pos + sizes[i % 4], i + 1
    np.testing.assert_array_equal(np.concatenate(pieces), at_once)  # same calls of the chunk function
    assert float(np.abs(at_once - whole).max()) <= BOUND  # the chunk function vs the block function


class _Dropped:
    """A loaded function whose state input is zeroed every call (a package that drops the carry)."""

    def __init__(self, model):
        self.model, self.function_name, self.input_description = model, model.function_name, model.input_description

    def predict(self, inputs):
        return self.model.predict({**inputs, "h": inputs["h"] * 0, "c": inputs["c"] * 0})


class _NoCellState(_Dropped):
    def predict(self, inputs):
        return {k: v for k, v in self.model.predict(inputs).items() if k != "c_out"}


def test_broken_packages_are_rejected(package_vad, torch_vad):
    wav = load_audio(AUDIO / "en_medium.wav", target_rate=16000)
    want = torch_vad.probabilities(wav)
    dropped = PackageVad(_Dropped(package_vad.block), package_vad.chunk, BLOCK_CHUNKS)
    assert float(np.abs(dropped.probabilities(wav) - want).max()) > BOUND  # the comparison sees a lost state
    with pytest.raises(VadPackageError, match="gave no c_out"):
        PackageVad(_NoCellState(package_vad.block), package_vad.chunk, BLOCK_CHUNKS).probabilities(wav)
    with pytest.raises(VadPackageError, match=rf"takes frames \({BLOCK_CHUNKS}, 576\), the manifest says \(16, 576\)"):
        PackageVad(package_vad.block, package_vad.chunk, 16)  # N other than the package's
    with pytest.raises(VadPackageError, match=rf"'block' takes frames \({BLOCK_CHUNKS}, 576\), the manifest says \(1, 576\)"):
        PackageVad(package_vad.block, package_vad.block, BLOCK_CHUNKS)  # the block function as the stream's


def test_vad_for_reads_the_bundle(trained_bundle):
    from cohere_coreml.bundle.load import Bundle

    vad = vad_for(Bundle.load(trained_bundle), backend="mil")
    assert isinstance(vad, PackageVad) and vad.chunks == BLOCK_CHUNKS
