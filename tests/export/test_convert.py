"""Tests of the shared converter (cohere_coreml.export.convert) on a small traced module. Its neighbours:
tests/storage/test_files.py (atomic installs), tests/export/test_parity.py (PSNR, KL, reports), tests/export/test_memory.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from cohere_coreml.config import round_up
from cohere_coreml.export.convert import MIN_PSNR_DB, ExportError, ExportSettings, ExportSettingsError, convert_module
from cohere_coreml.model.shapes import ShapeError, window_frames


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


# ------------------------------------------------------------------------ validation per pipeline


def _convert_small(settings):
    """`_Small` converted through `convert_module` (fp16: the cast passes run too)."""
    import coremltools as ct

    torch.manual_seed(0)
    traced = torch.jit.trace(_Small().eval(), (torch.zeros(1, 3, 8), torch.tensor([2], dtype=torch.int32)))
    return convert_module(traced, [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32),
                                   ct.TensorType(name="n", shape=(1,), dtype=np.int32)],
                          [ct.TensorType(name="y"), ct.TensorType(name="m")], settings)


def _counting_validations(monkeypatch) -> list:
    """Every `Program.validate` call from here on appends its `check_essential_scope` to the list."""
    from coremltools.converters.mil.mil.program import Program

    calls, validate = [], Program.validate

    def counted(self, check_essential_scope=False):
        calls.append(check_essential_scope)
        return validate(self, check_essential_scope=check_essential_scope)

    monkeypatch.setattr(Program, "validate", counted)
    return calls


@pytest.mark.parametrize("each_pass", [False, True])
def test_pipelines_are_validated_once_each_unless_asked_per_pass(each_pass, monkeypatch, tmp_path):
    """convert_module: coremltools' whole-program check once per pass pipeline (3 of them, plus the
    torch frontend's and the backend's own checks), or after every pass with the variable set; the
    program and weights are the same either way (validation only reads)."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    from cohere_coreml.export.convert import VALIDATE_EACH_PASS_ENV

    apply_pipeline = PassPipelineManager.__dict__["apply_pipeline"]
    monkeypatch.setenv(VALIDATE_EACH_PASS_ENV, "1" if each_pass else "0")
    calls = _counting_validations(monkeypatch)
    settings = ExportSettings(out_dir=tmp_path, precision="fp16", model_id="org/model")
    mlmodel = _convert_small(settings)
    assert PassPipelineManager.__dict__["apply_pipeline"] is apply_pipeline  # restored
    if each_pass:
        assert len(calls) > 100
    else:
        assert 3 <= len(calls) <= 6 and calls.count(True) >= 2  # the main pipeline's end checks scopes
    monkeypatch.setenv(VALIDATE_EACH_PASS_ENV, "1" if not each_pass else "0")
    other = _convert_small(settings)
    # the same program (block names count conversions in this process)
    assert re.sub(r"block\d+", "block", str(mlmodel._mil_program)) == re.sub(r"block\d+", "block", str(other._mil_program))
    for model in (mlmodel, other):
        model.save(str(tmp_path / f"{id(model)}.mlpackage"))
    weights = sorted(tmp_path.glob("*.mlpackage/Data/com.apple.CoreML/weights/weight.bin"))
    assert len(weights) == 2 and weights[0].read_bytes() == weights[1].read_bytes()


def test_a_pass_that_breaks_the_program_still_fails_its_pipeline():
    """Negative control: a pass that leaves an op's input links inconsistent is refused at the end of
    its pipeline with coremltools' own error (the same pipeline without it passes)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.block import InvalidBlockStateError
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline, PassPipelineManager
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY, register_pass

    from cohere_coreml.export.convert import validated_per_pipeline

    name = "cohere_test::drop_a_consumer_link"
    if name not in PASS_REGISTRY:
        @register_pass(namespace="cohere_test")
        class drop_a_consumer_link(AbstractGraphPass):  # noqa: N801 (coremltools registers by class name)
            def apply(self, prog):
                op = prog.functions["main"].operations[-1]
                op.x.remove_child_op(op)  # the op still reads x, x no longer lists it: an invalid block

    def program():
        @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp32)])
        def prog(x):
            return mb.relu(x=mb.add(x=x, y=1.0))
        return prog

    with validated_per_pipeline():
        PassPipelineManager.apply_pipeline(program(), PassPipeline(["common::dead_code_elimination"], "control"))
        with pytest.raises(InvalidBlockStateError, match="consumed"):
            PassPipelineManager.apply_pipeline(program(), PassPipeline([name, "common::dead_code_elimination"], "broken"))
