"""load_model interface: backend choice, descriptions, input validation, unsupported ops,
multifunction packages, and the Core ML backend (macOS only)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from cohere_coreml.runtime import (
    BackendUnavailableError,
    InputValidationError,
    MilModel,
    PackageLoadError,
    UnsupportedOpError,
    coreml_available,
    load_model,
)


def _program(body, shapes, dtype="fp32"):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types

    mil_dtype = {"fp32": types.fp32, "fp16": types.fp16, "int32": types.int32}
    placeholders = {name: mb.placeholder(shape=shape, dtype=mil_dtype[dt]) for name, (shape, dt) in shapes.items()}
    with Function(placeholders, opset_version=ct.target.iOS18) as func:
        outs = body(mb, **func.inputs)
        func.set_outputs(list(outs) if isinstance(outs, (tuple, list)) else [outs])
    prog = Program()
    prog.add_function("main", func)
    return prog


def _save(prog, path):
    import coremltools as ct

    ml = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                    pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
    ml.save(str(path))
    return path


@pytest.fixture(scope="module")
def simple(tmp_path_factory):
    """y = x * 2 + ids (cast), x fp32 (2, 3), ids int32 (2, 3)."""
    prog = _program(
        lambda mb, x, ids: mb.add(x=mb.mul(x=x, y=np.float32(2.0)), y=mb.cast(x=ids, dtype="fp32"), name="y"),
        {"x": ((2, 3), "fp32"), "ids": ((2, 3), "int32")},
    )
    return _save(prog, tmp_path_factory.mktemp("simple") / "simple.mlpackage")


def test_auto_backend_and_descriptions(simple):
    model = load_model(simple)
    if not coreml_available()[0]:
        assert isinstance(model, MilModel) and model.backend == "mil"
    assert model.input_description == {"x": ((2, 3), np.float32), "ids": ((2, 3), np.int32)}
    assert list(model.output_description) == ["y"]
    assert model.output_description["y"] == ((2, 3), np.float32)
    assert model.state_description == {}
    out = model.predict({"x": np.ones((2, 3)), "ids": np.arange(6).reshape(2, 3)})
    np.testing.assert_array_equal(out["y"], 2.0 + np.arange(6).reshape(2, 3))
    assert out["y"].dtype == np.float32


def test_input_validation(simple):
    model = load_model(simple, backend="mil")
    x, ids = np.ones((2, 3), np.float32), np.zeros((2, 3), np.int32)
    with pytest.raises(InputValidationError, match="missing input.*ids"):
        model.predict({"x": x})
    with pytest.raises(InputValidationError, match="unexpected input.*extra"):
        model.predict({"x": x, "ids": ids, "extra": x})
    with pytest.raises(InputValidationError, match=r"'x'.*expected shape \(2, 3\).*got \(3, 2\)"):
        model.predict({"x": x.T, "ids": ids})
    with pytest.raises(InputValidationError, match="non-integral"):
        model.predict({"x": x, "ids": ids + 0.5})
    with pytest.raises(InputValidationError, match="outside the int32 range"):
        model.predict({"x": x, "ids": np.full((2, 3), 2**40)})
    with pytest.raises(InputValidationError, match="has no state"):
        model.predict({"x": x, "ids": ids}, state=object())
    with pytest.raises(InputValidationError, match="has no state"):
        model.make_state()
    assert isinstance(InputValidationError("m"), ValueError)


def test_bad_paths_and_backends(simple, tmp_path):
    with pytest.raises(PackageLoadError, match="not found"):
        load_model(tmp_path / "nope.mlpackage")
    with pytest.raises(ValueError, match="backend"):
        load_model(simple, backend="tpu")
    with pytest.raises(PackageLoadError, match="function 'other'.*available functions: \\['main'\\]"):
        load_model(simple, backend="mil", function_name="other")
    if sys.platform != "darwin":
        with pytest.raises(BackendUnavailableError, match="macOS"):
            load_model(simple, backend="coreml")


def test_unsupported_ops_named_before_execution(tmp_path):
    prog = _program(
        lambda mb, x: mb.space_to_depth(x=mb.upsample_nearest_neighbor(x=x, scale_factor_height=2, scale_factor_width=2), block_size=2),
        {"x": ((1, 2, 4, 4), "fp32")},
    )
    path = _save(prog, tmp_path / "unsupported.mlpackage")
    with pytest.raises(UnsupportedOpError) as info:
        load_model(path, backend="mil")
    err = info.value
    assert err.function_name == "main"
    assert err.op_types == ["space_to_depth", "upsample_nearest_neighbor"]
    assert "space_to_depth" in str(err) and "upsample_nearest_neighbor" in str(err) and "'main'" in str(err)


@pytest.fixture(scope="module")
def multifunction(tmp_path_factory):
    import coremltools as ct

    d = tmp_path_factory.mktemp("multi")
    weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10  # shared by both functions
    add = _program(lambda mb, x: mb.add(x=mb.linear(x=x, weight=weights), y=np.float32(1.0), name="y"), {"x": ((2, 3), "fp32")})
    mul = _program(lambda mb, x: mb.mul(x=mb.linear(x=x, weight=weights), y=np.float32(3.0), name="y"), {"x": ((2, 3), "fp32")})
    p_add, p_mul = _save(add, d / "add.mlpackage"), _save(mul, d / "mul.mlpackage")
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(p_add), src_function_name="main", target_function_name="plus_one")
    desc.add_function(str(p_mul), src_function_name="main", target_function_name="times_three")
    desc.default_function_name = "times_three"
    path = d / "multi.mlpackage"
    ct.utils.save_multifunction(desc, str(path))
    return path, weights


def test_multifunction_runs_named_function(multifunction):
    path, weights = multifunction
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    lin = x @ weights.T
    plus = load_model(path, backend="mil", function_name="plus_one")
    times = load_model(path, backend="mil", function_name="times_three")
    default = load_model(path, backend="mil")
    assert plus.function_name == "plus_one" and default.function_name == "times_three"
    np.testing.assert_allclose(plus.predict({"x": x})["y"], lin + 1, rtol=1e-6)
    np.testing.assert_allclose(times.predict({"x": x})["y"], lin * 3, rtol=1e-6)
    np.testing.assert_allclose(default.predict({"x": x})["y"], lin * 3, rtol=1e-6)
    with pytest.raises(PackageLoadError, match="plus_one.*times_three"):
        load_model(path, backend="mil", function_name="minus")


@pytest.mark.skipif(not coreml_available()[0], reason=coreml_available()[1] or "Core ML available")
@pytest.mark.macos
def test_coreml_backend_matches_interpreter(simple, multifunction):
    x = np.random.RandomState(1).randn(2, 3).astype(np.float32)
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    cm = load_model(simple, backend="coreml", compute_units="cpu_only")
    mil = load_model(simple, backend="mil")
    assert cm.input_description == mil.input_description
    assert cm.output_description == mil.output_description
    np.testing.assert_allclose(cm.predict({"x": x, "ids": ids})["y"], mil.predict({"x": x, "ids": ids})["y"], rtol=1e-6)
    path, _ = multifunction
    cm_plus = load_model(path, backend="coreml", function_name="plus_one", compute_units="cpu_only")
    mil_plus = load_model(path, backend="mil", function_name="plus_one")
    np.testing.assert_allclose(cm_plus.predict({"x": x})["y"], mil_plus.predict({"x": x})["y"], rtol=1e-6)


def test_num_threads_restored_and_validated(simple):
    import torch

    before = torch.get_num_threads()
    model = load_model(simple, backend="mil", num_threads=1)
    out = model.predict({"x": np.ones((2, 3)), "ids": np.zeros((2, 3), np.int32)})
    np.testing.assert_array_equal(out["y"], np.full((2, 3), 2.0))
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        load_model(simple, backend="mil", num_threads=0)
