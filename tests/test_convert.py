"""Tests of the shared converter (cohere_coreml.convert) on a small traced module. Its neighbours:
tests/test_files.py (atomic installs), tests/test_parity.py (PSNR, KL, reports), tests/test_memory.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cohere_coreml.config import round_up
from cohere_coreml.convert import MIN_PSNR_DB, ExportError, ExportSettings, ExportSettingsError, convert_module
from cohere_coreml.shapes import ShapeError, window_frames


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, n):
        # x: (1, 3, 8) float; n: (1,) int32
        return self.lin(x) * n.to(x.dtype), (n + 1).to(torch.int32)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    import coremltools as ct

    torch.manual_seed(0)
    traced = torch.jit.trace(_Small().eval(), (torch.zeros(1, 3, 8), torch.tensor([2], dtype=torch.int32)))
    settings = ExportSettings(out_dir=tmp_path_factory.mktemp("conv"), precision="fp32", model_id="org/model",
                              revision="abc123")
    mlmodel = convert_module(
        traced,
        [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32),
         ct.TensorType(name="n", shape=(1,), dtype=np.int32)],
        [ct.TensorType(name="y"), ct.TensorType(name="m")],
        settings,
        metadata={"com.cohere_coreml.component": "small", "com.cohere_coreml.shapes": {"x": [1, 3, 8]}},
        descriptions={"x": "the input", "y": "the output"},
    )
    return mlmodel, settings


def test_settings_validation():
    assert ExportSettings().precision == "fp16"
    assert ExportSettings().deployment_target == "macOS15"
    assert ExportSettings(precision="fp32").gate_psnr_db == MIN_PSNR_DB["fp32"] == 60.0
    assert ExportSettings(precision="fp16").gate_psnr_db == 35.0
    with pytest.raises(ExportSettingsError, match="precision"):
        ExportSettings(precision="int8")
    with pytest.raises(ExportSettingsError, match="deployment_target"):
        ExportSettings(deployment_target="iOS16")
    with pytest.raises(ExportSettingsError, match="window_seconds"):
        ExportSettings(window_seconds=0)
    with pytest.raises(ExportSettingsError, match="window_seconds"):
        ExportSettings(window_seconds=float("nan"))
    assert issubclass(ExportSettingsError, ValueError) and issubclass(ExportError, RuntimeError)


def test_window_frames_and_round_up():
    assert window_frames(35.0, 16000, 160) == 3500
    assert window_frames(2.0, 16000, 160) == 200
    assert round_up(438, 32) == 448 and round_up(448, 32) == 448 and round_up(1, 32) == 32
    with pytest.raises(ShapeError, match="shorter than one mel frame"):
        window_frames(0.001, 16000, 160)


def test_metadata_and_descriptions(small_model):
    mlmodel, _ = small_model
    spec = mlmodel.get_spec()
    meta = dict(spec.description.metadata.userDefined)
    assert meta["com.cohere_coreml.source_model"] == "org/model"
    assert meta["com.cohere_coreml.source_revision"] == "abc123"
    assert meta["com.cohere_coreml.precision"] == "fp32"
    assert meta["com.cohere_coreml.deployment_target"] == "macOS15"
    assert meta["com.cohere_coreml.license"] == "Apache-2.0"
    assert meta["com.cohere_coreml.tool_git_hash"]
    assert json.loads(meta["com.cohere_coreml.shapes"]) == {"x": [1, 3, 8]}
    assert spec.description.metadata.license == "Apache-2.0"
    descr = {f.name: f.shortDescription for f in list(spec.description.input) + list(spec.description.output)}
    assert descr["x"] == "the input" and descr["y"] == "the output"
    assert spec.specificationVersion >= 9  # iOS18 / macOS15
    # the int32 output stays int32
    from coremltools.proto import FeatureTypes_pb2 as ft

    outs = {o.name: o.type.multiArrayType.dataType for o in spec.description.output}
    assert outs["m"] == ft.ArrayFeatureType.INT32


def test_unknown_description_is_refused():
    import coremltools as ct

    traced = torch.jit.trace(_Small().eval(), (torch.zeros(1, 3, 8), torch.tensor([2], dtype=torch.int32)))
    with pytest.raises(ExportError, match="unknown features"):
        convert_module(
            traced,
            [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32),
             ct.TensorType(name="n", shape=(1,), dtype=np.int32)],
            [ct.TensorType(name="y"), ct.TensorType(name="m")],
            ExportSettings(precision="fp32"),
            descriptions={"nope": "x"},
        )
