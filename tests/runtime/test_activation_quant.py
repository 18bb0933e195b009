"""The interpreter's `quantize` / `dequantize` against coremltools' definitions, on hand-computed values.

coremltools (iOS17 ops, `coremltools.optimize._utils.quantize_by_scale_and_zp`): q = clip(round_half_even(
input / scale) + zero_point), the division in the input's dtype; dequantize = (float32(q) - zp) * scale in
the scale's dtype. The fixtures are chosen so that each plausible mistake gives other integers: ties at .5
(half away from zero would round them up), fp16 quotients that become ties only in fp16 (an fp32 division,
the interpreter's earlier implementation, rounds them the other way), saturation at both ends of int8 and
uint8, a zero point, a per-channel scale / zero point along an axis.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.runtime import load_model
from cohere_coreml.runtime import ops as runtime_ops

# fp16 input, scalar fp16 scale (fp16(0.01) = 0.01000213623046875), int8 zero point 0: the fp32 quotients
# 1.4996, 2.5004, 3.4996 are fp16 ties 1.5, 2.5, 3.5 -> 2, 2, 4 (fp32 division: 1, 3, 3); 0.5 / s = 49.99 ->
# 50; +-2 / s -> saturated at 127 / -128.
FP16_X = np.array([0.0149993896484375, 0.0250091552734375, 0.035003662109375, 0.5, 2.0, -2.0, -0.0149993896484375,
                   0.0], np.float16)
FP16_SCALE = np.float16(0.01)
FP16_Q = np.array([2, 2, 4, 50, 127, -128, -2, 0], np.int8)

# fp32 input, scale 0.5, exact ties: 1.25 -> 2.5 -> 2, 1.75 -> 3.5 -> 4, -1.25 -> -2, -1.75 -> -4; uint8 with
# zero point 128: -70 -> -140 + 128 -> 0 (saturated), 70 -> 268 -> 255, 0.25 -> 0.5 -> 0 + 128.
FP32_X = np.array([1.25, 1.75, -1.25, -1.75, -70.0, 70.0, 0.25, 0.0], np.float32)
INT8_Q = np.array([2, 4, -2, -4, -128, 127, 0, 0], np.int8)  # zero point 0
UINT8_Q = np.array([130, 132, 126, 124, 0, 255, 128, 128], np.uint8)  # zero point 128

# per channel along axis 1 of (2, 3): scales (0.5, 1, 2), int8 zero points (0, 1, -1)
AXIS_X = np.array([[1.25, 2.5, 3.0], [-0.75, -2.5, 300.0]], np.float32)
AXIS_SCALE = np.array([0.5, 1.0, 2.0], np.float32)
AXIS_ZP = np.array([0, 1, -1], np.int8)
AXIS_Q = np.array([[2, 3, 1], [-2, -1, 127]], np.int8)  # 2.5->2; 2.5->2 +1=3; 1.5->2 -1=1; -1.5->-2; -2.5->-2 +1; sat


def build_package(path):
    """One program: every fixture quantized, then dequantized twice (scale 1 fp32: the raw integers; and with
    the quantize parameters: the round trip in the input's dtype)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=(8,), dtype=types.fp16), mb.TensorSpec(shape=(8,), dtype=types.fp32),
                             mb.TensorSpec(shape=(2, 3), dtype=types.fp32)], opset_version=ct.target.iOS18)
    def prog(h, f, g):
        one = np.float32(1.0)
        q16 = mb.quantize(input=h, scale=FP16_SCALE, zero_point=np.int8(0), output_dtype="int8")
        q8 = mb.quantize(input=f, scale=np.float32(0.5), output_dtype="int8")
        qu8 = mb.quantize(input=f, scale=np.float32(0.5), zero_point=np.uint8(128), output_dtype="uint8")
        qax = mb.quantize(input=g, scale=AXIS_SCALE, zero_point=AXIS_ZP, axis=1, output_dtype="int8")
        return (mb.dequantize(input=q16, scale=one, name="q16"), mb.dequantize(input=q8, scale=one, name="q8"),
                mb.dequantize(input=qu8, scale=one, name="qu8"), mb.dequantize(input=qax, scale=one, name="qax"),
                mb.dequantize(input=q16, scale=FP16_SCALE, zero_point=np.int8(0), name="dq16"),
                mb.dequantize(input=qu8, scale=np.float32(0.5), zero_point=np.uint8(128), name="dqu8"),
                mb.dequantize(input=qax, scale=AXIS_SCALE, zero_point=AXIS_ZP, axis=-1, name="dqax"))

    ml = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                    pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
    ml.save(str(path))
    return path


def expected() -> dict[str, np.ndarray]:
    return {
        "q16": FP16_Q.astype(np.float32), "q8": INT8_Q.astype(np.float32), "qu8": UINT8_Q.astype(np.float32),
        "qax": AXIS_Q.astype(np.float32),
        "dq16": (FP16_Q.astype(np.float32) * np.float32(FP16_SCALE)).astype(np.float16),
        "dqu8": (UINT8_Q.astype(np.float32) - 128) * np.float32(0.5),
        "dqax": (AXIS_Q.astype(np.float32) - AXIS_ZP.astype(np.float32)) * AXIS_SCALE,
    }


def mismatches(path) -> list[str]:
    out = load_model(path, backend="mil").predict({"h": FP16_X, "f": FP32_X, "g": AXIS_X})
    want = expected()
    return [f"{k}: {out[k].tolist()} != {want[k].tolist()}" for k in want
            if out[k].dtype != want[k].dtype or not np.array_equal(out[k], want[k])]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return build_package(tmp_path_factory.mktemp("actq") / "actq.mlpackage")


def test_hand_values_are_coremltools_value_inference():
    """The hand-computed integers are what coremltools' own definition gives (its value inference)."""
    from coremltools.optimize import _utils as ct_utils

    assert np.array_equal(ct_utils.quantize_by_scale_and_zp(FP16_X, np.array(FP16_SCALE), np.int8(0), "int8"), FP16_Q)
    assert np.array_equal(ct_utils.quantize_by_scale_and_zp(FP32_X, np.float32(0.5), None, "int8"), INT8_Q)
    assert np.array_equal(ct_utils.quantize_by_scale_and_zp(FP32_X, np.float32(0.5), np.uint8(128), "uint8"), UINT8_Q)
    scale = ct_utils.promote_rank_to_same_as_data(AXIS_SCALE, AXIS_X, 1)
    zp = ct_utils.promote_rank_to_same_as_data(AXIS_ZP, AXIS_X, 1)
    assert np.array_equal(ct_utils.quantize_by_scale_and_zp(AXIS_X, scale, zp, "int8"), AXIS_Q)
    # the fixtures separate the plausible mistakes: fp32 division, ties away from zero
    assert not np.array_equal(np.round(FP16_X.astype(np.float32) / np.float32(FP16_SCALE)), FP16_Q)
    assert not np.array_equal(np.clip(np.trunc(FP32_X / 0.5 + np.sign(FP32_X) * 0.5), -128, 127), INT8_Q)


def test_interpreter_matches_hand_values(package):
    assert mismatches(package) == []


def old_fp32_quantize(a):
    """The interpreter's earlier `quantize`: the quotient in fp32 even for an fp16 input."""
    x = a.t("input").to(torch.float32)
    y = torch.round(x / a.t("scale").to(torch.float32).reshape(-1 if a.t("scale").dim() else ()))
    zp = a.t("zero_point")
    if zp is not None:
        y = y + zp.to(torch.float32)
    return torch.clamp(y, *runtime_ops.QUANTIZED_RANGE[a.v("output_dtype")])


def half_away_quantize(a):
    """Round half away from zero instead of half to even."""
    x = a.t("input").to(torch.float32)
    axis = a.v("axis", None)
    y = x / runtime_ops._per_axis(a.t("scale"), x, axis).to(torch.float32)
    if a.dtype("input") == "fp16":
        y = y.to(torch.float16).to(torch.float32)
    y = torch.sign(y) * torch.floor(torch.abs(y) + 0.5)
    zp = runtime_ops._per_axis(a.t("zero_point"), x, axis)
    if zp is not None:
        y = y + zp.to(torch.float32)
    return torch.clamp(y, *runtime_ops.QUANTIZED_RANGE[a.v("output_dtype")])


def no_clamp_quantize(a):
    """No saturation (int8 wraps around when cast)."""
    x = a.t("input").to(torch.float32)
    axis = a.v("axis", None)
    y = x / runtime_ops._per_axis(a.t("scale"), x, axis).to(torch.float32)
    if a.dtype("input") == "fp16":
        y = y.to(torch.float16).to(torch.float32)
    y = torch.round(y)
    zp = runtime_ops._per_axis(a.t("zero_point"), x, axis)
    return (y + zp.to(torch.float32) if zp is not None else y).to(torch.int64)


@pytest.mark.parametrize("broken", [old_fp32_quantize, half_away_quantize, no_clamp_quantize])
def test_broken_quantize_is_rejected(package, monkeypatch, broken):
    monkeypatch.setitem(runtime_ops.OPS, "quantize", broken)
    found = mismatches(package)
    assert found, f"{broken.__name__} was not told apart from coremltools' quantize"
