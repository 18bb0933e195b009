"""vad.mlpackage: Silero VAD converted from the pinned package's weights, gated against the package's own model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cohere_coreml.config import VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION, VAD_METADATA_KEY, VAD_REQUEST_METADATA_KEY
from cohere_coreml.export.convert import ExportSettings, ParityError
from cohere_coreml.export.gate import GateLoader
from cohere_coreml.export.vad_package import (
    BLOCK_CHUNKS,
    COMPONENT,
    MAX_ABS_DIFF,
    VAD_PRECISION,
    VadForCoreML,
    gate_references,
    gate_signals,
    run_gate,
    stage_vad,
    vad_request,
)
from cohere_coreml.inference.vad import PackageVad
from cohere_coreml.model import silero

AUDIO = Path(__file__).parents[1] / "data" / "audio"
# the long demo clip and the medium clip whose fp16 probabilities are furthest from the oracle's
GATE_CLIPS = [AUDIO / "en_long_75s.flac", AUDIO / "zh_medium.wav", AUDIO / "de_medium.wav"]


def test_the_traced_cell_is_pytorchs_lstm_cell():
    """The traced module (STFT as a matmul, the LSTM cell written out) computes SileroVad's function: compared in
    float64, where the two summation orders agree to rounding."""
    vad = silero.SileroVad.from_package().double()
    rng = np.random.default_rng(0)
    frames = torch.from_numpy(silero.chunk_frames(rng.standard_normal(5 * 512).astype(np.float32))).double()
    h, c = (torch.from_numpy(0.3 * rng.standard_normal((1, 128))) for _ in range(2))
    with torch.no_grad():
        want = vad(frames, h, c)
        got = VadForCoreML(vad)(frames, h, c)
        dropped = VadForCoreML(vad, carry_state=False)(frames, h, c)
    assert got[0].shape == (1, 5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy().reshape(-1), b.numpy().reshape(-1), rtol=0, atol=1e-10)
    assert float((dropped[0] - want[0].reshape(1, -1)).abs().max()) > 1e-4  # the control differs


def test_the_package_matches_the_package_model_on_committed_audio(vad_package):
    """The shipped package (fp32 in an fp16 bundle): block and chunk functions on the long clip and medium clips."""
    path = vad_package / "vad.mlpackage"
    report = json.loads((vad_package / "vad.parity.json").read_text())
    assert report["passed"] and report["parity"]["segments_identical"]
    with GateLoader("interpreter", vad_package) as loader:
        vad = PackageVad(loader.load(path, VAD_BLOCK_FUNCTION), loader.load(path, VAD_CHUNK_FUNCTION), BLOCK_CHUNKS)
        cases = gate_references(gate_signals(GATE_CLIPS))
        result = run_gate(vad, cases, VAD_PRECISION, BLOCK_CHUNKS)
    assert result.passed, result.headline
    parity = result.details["parity"]
    assert VAD_PRECISION == "fp32" and report["precision"] == VAD_PRECISION
    assert parity["segments_identical"] and parity["max_abs_diff"] <= MAX_ABS_DIFF["fp32"]
    long_case = result.cases[0]
    assert long_case["case"] == "en_long_75s.flac" and long_case["segments"] >= 10  # speech with pauses


def test_package_metadata_records_source_and_request(vad_package):
    from cohere_coreml.bundle.packages import package_io, package_metadata

    meta = package_metadata(vad_package / "vad.mlpackage")
    record = json.loads(meta[VAD_METADATA_KEY])
    assert record["source"] == silero.source_record()
    assert record["functions"] == {"block": {"chunks": BLOCK_CHUNKS}, "chunk": {"chunks": 1}}
    # exported beside an fp16 bundle (the fixture asks for fp16): the program is VAD_PRECISION's all the same
    assert meta[VAD_REQUEST_METADATA_KEY] == vad_request(ExportSettings(precision=VAD_PRECISION))
    assert "precision=fp32" in meta[VAD_REQUEST_METADATA_KEY] and record["precision"] == "fp32"
    io = package_io(vad_package / "vad.mlpackage")  # the default function is block
    assert io["inputs"]["frames"] == {"shape": [BLOCK_CHUNKS, 576], "dtype": "float32"}
    assert io["outputs"]["probability"] == {"shape": [1, BLOCK_CHUNKS], "dtype": "float32"}
    assert package_io(vad_package / "vad.mlpackage", VAD_CHUNK_FUNCTION)["inputs"]["h"]["shape"] == [1, 128]


def _small_export(out: Path, **broken):
    """An fp32 package of 4-chunk blocks, gated on one clip: quick to convert."""
    settings = ExportSettings(out_dir=out, precision="fp16", gate_units="interpreter")  # the VAD's is fp32
    staged = stage_vad(settings, gate_audio=[AUDIO / "en_medium.wav"], chunks=4, **broken)
    return staged.finish()


def test_the_gate_passes_a_small_package_and_refuses_broken_ones(tmp_path):
    report = _small_export(tmp_path / "ok")
    assert report.passed and (tmp_path / "ok" / "vad.mlpackage").is_dir()
    assert report.details["parity"]["max_abs_diff"] <= MAX_ABS_DIFF["fp32"]

    perturbed = silero.SileroVad.from_package()
    with torch.no_grad():
        perturbed.lstm.weight_hh.mul_(1.05)  # 5 % on the recurrent weights
    for name, broken in (("perturbed", {"_vad": perturbed}), ("no_carry", {"_carry_state": False})):
        out = tmp_path / name
        with pytest.raises(ParityError, match="vad parity gate refused"):
            _small_export(out, **broken)
        assert not (out / "vad.mlpackage").exists()
        failed = json.loads((out / "vad.parity-failed.json").read_text())
        assert failed["passed"] is False and failed["parity"]["max_abs_diff"] > MAX_ABS_DIFF["fp32"]


def test_a_package_of_another_request_is_exported_again(tmp_path, caplog):
    _small_export(tmp_path)
    settings = ExportSettings(out_dir=tmp_path, precision="fp32", gate_units="interpreter")
    assert stage_vad(settings, gate_audio=[AUDIO / "en_medium.wav"], chunks=4) is None  # current: skipped
    staged = stage_vad(settings, gate_audio=[AUDIO / "en_medium.wav"], chunks=2)  # another N
    assert staged is not None and "exporting it again" in caplog.text
    staged.discard()
    assert (tmp_path / f"{COMPONENT}.mlpackage").is_dir()  # the present package stays until a new one passes


def test_vad_and_no_vad_change_the_components():
    from cohere_coreml.export.pipeline import COMPONENTS, ExportError, export_components

    default = ",".join(COMPONENTS)
    assert export_components(default, None) == ("encoder", "frontend", "decoder", "vad")  # on by default
    assert export_components(default, False) == ("encoder", "frontend", "decoder")
    assert export_components("encoder", None) == ("encoder",)
    assert export_components("encoder", True) == ("encoder", "vad")
    assert export_components("vad,encoder", True) == ("encoder", "vad")
    with pytest.raises(ExportError, match="nothing to export"):
        export_components("vad", False)


def test_the_cli_reads_vad_flags():
    import argparse

    from cohere_coreml.export.pipeline import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    assert parser.parse_args(["export"]).vad is None
    assert parser.parse_args(["export", "--vad"]).vad is True
    assert parser.parse_args(["export", "--no-vad"]).vad is False
