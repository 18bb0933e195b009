"""W8A8 (`quantize.activations`): the interpreter's statistics are what coremltools' calibration records, and
`apply_stats` gives the program coremltools' own `linear_quantize_activations` writes from them.

coremltools' calibration runs Core ML predictions (macOS only). Here its `ModelDebugger.predict_intermediate_outputs`
(the one call that needs Core ML) is answered by the interpreter, so coremltools' unmodified calibration and
insertion code run end to end on Linux: the reference the tests compare with. The seam (`CALIBRATION_SEAM`) is
pinned: removing it, or a coremltools that no longer calls it, is an error, never a silently unquantized model.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from cohere_coreml.quantize import activations, quantize_bundle
from cohere_coreml.quantize.inventory import load_function
from cohere_coreml.quantize.recipes import GATES, PRESETS, QuantizeError
from cohere_coreml.runtime import load_model

from ..runtime.helpers import convert_torch


class TinyAttention(nn.Module):
    """linear -> scores + mask -> softmax -> conv -> relu -> linear + residual (x0: (1, 8, 16), x1: mask (1, 8, 8))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.out = nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)

    def forward(self, x0, x1):
        h = self.q(x0)
        s = torch.matmul(h, h.transpose(1, 2)) + x1
        a = torch.matmul(torch.softmax(s, -1), h)
        c = self.conv(a.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.relu(c)) + x0


def samples(n: int = 2) -> list[dict]:
    rng = np.random.RandomState(3)
    out = []
    for i in range(n):  # the first sample's range is wider: the last-sample statistics differ from all-sample
        x = rng.uniform(-3.0 / (i + 1), 3.0 / (i + 1), (1, 8, 16)).astype(np.float32)
        mask = np.where(rng.uniform(size=(1, 8, 8)) < 0.2, -10000.0, 0.0).astype(np.float32)
        out.append({"x0": x, "x1": mask})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import coremltools as ct

    path = tmp_path_factory.mktemp("w8a8") / "tiny.mlpackage"
    convert_torch(TinyAttention(), [torch.zeros(1, 8, 16), torch.zeros(1, 8, 8)], path, precision="fp16")
    return path, ct.models.MLModel(str(path), skip_model_load=True)


@pytest.fixture
def core_ml_by_interpreter(monkeypatch, tiny):
    """coremltools' calibration with its Core ML predictions answered by the interpreter."""
    from coremltools.optimize.coreml.experimental._model_debugger import ModelDebugger

    model = load_model(tiny[0], backend="mil")

    def predict(self, inputs, intermediate_output_names, compute_units=None):
        values = model.intermediates(inputs)
        wanted = set(intermediate_output_names) | set(model.output_description)
        return {k: v for k, v in values.items() if k in wanted}

    monkeypatch.setattr(ModelDebugger, "predict_intermediate_outputs", predict)
    return model


def coremltools_stats(mlmodel, data):
    from coremltools.optimize.coreml.experimental._post_training_quantization import _get_activation_calibration_stats

    return {k: {s: float(v[s]) for s in ("rmin", "rmax")} for k, v in
            _get_activation_calibration_stats(mlmodel, [dict(d) for d in data]).items()}


def interpreter_stats(model, mlmodel, data, reduction):
    names, concats = activations.calibration_tensors(mlmodel)
    return activations.adjust_concats(activations.ranges(model, data, reduction=reduction), concats), names


def test_interpreter_records_what_coremltools_calibration_records(tiny, core_ml_by_interpreter):
    mlmodel, data = tiny[1], samples()
    ref = coremltools_stats(mlmodel, data)
    ours, names = interpreter_stats(core_ml_by_interpreter, mlmodel, data, "last")
    assert set(ref) == set(names) | {"x0", "x1"}  # coremltools' tensor selection: intermediates and inputs
    assert {k: ours[k] for k in ref} == ref


def test_coremltools_keeps_only_the_last_sample(tiny, core_ml_by_interpreter):
    """coremltools 9.0 overwrites rmin/rmax before comparing: only the last sample counts. The default
    ("all") is the range over every sample; when a coremltools release fixes this, this test fails and the
    note in `activations` (and reduction "last") can go."""
    mlmodel, data = tiny[1], samples()
    ref = coremltools_stats(mlmodel, data)
    ours, _ = interpreter_stats(core_ml_by_interpreter, mlmodel, data, "all")
    wider = [k for k in ref if ours[k] != ref[k]]
    assert wider and all(ours[k]["rmin"] <= ref[k]["rmin"] and ours[k]["rmax"] >= ref[k]["rmax"] for k in ref)
    # "all" is the union of the per-sample ranges, by hand
    one = [interpreter_stats(core_ml_by_interpreter, mlmodel, [d], "all")[0] for d in data]
    for k in wider:
        assert ours[k] == {"rmin": min(o[k]["rmin"] for o in one), "rmax": max(o[k]["rmax"] for o in one)}


def program_signature(mlmodel):
    """Op types in order, and every quantize op's (input, scale, zero point; symmetric: none, i.e. 0)."""
    from coremltools.converters.mil.converter import mil_convert  # noqa: F401  (loads the op registry)
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = mlmodel.get_spec()
    prog = load(spec, specification_version=spec.specificationVersion, file_weights_dir=mlmodel.weights_dir)
    fn = prog.functions["main"]
    quant = [(op.inputs["input"].name, float(op.inputs["scale"].val),
              int(op.inputs["zero_point"].val) if "zero_point" in op.inputs else 0)
             for op in fn.operations if op.op_type == "quantize"]
    return [op.op_type for op in fn.operations if op.op_type != "const"], quant


def test_apply_stats_is_coremltools_program(tiny, core_ml_by_interpreter):
    """Given the same statistics, `apply_stats` writes the program coremltools' own end-to-end call does."""
    import coremltools.optimize.coreml as cto

    mlmodel, data = tiny[1], samples(1)
    config = activations.activation_config()
    reference = cto.linear_quantize_activations(mlmodel, config, [dict(d) for d in data])
    ours = activations.apply_stats(mlmodel, interpreter_stats(core_ml_by_interpreter, mlmodel, data, "all")[0], config)
    ref_ops, ref_q = program_signature(reference)
    assert ref_q, "the reference inserted no quantize op"
    assert program_signature(ours) == (ref_ops, ref_q)


def test_scale_is_coremltools_symmetric_int8(tiny):
    """Hand value: symmetric int8 scale = max(|rmin|, |rmax|) / 127 (fp16), zero point 0."""
    mlmodel = tiny[1]
    names, _ = activations.calibration_tensors(mlmodel)
    stats = {n: {"rmin": -1.0, "rmax": 1.0} for n in [*names, "x0", "x1"]}
    assert "x0_to_fp16" in stats
    stats["x0_to_fp16"] = {"rmin": -3.0, "rmax": 2.5}
    _, quant = program_signature(activations.apply_stats(mlmodel, stats))
    scales = {name: scale for name, scale, _ in quant}
    assert scales["x0_to_fp16"] == float(np.float16(3.0 / 127))  # the fp32 input, cast to fp16 by the program
    assert scales["linear_0_cast_fp16"] == float(np.float16(1.0 / 127))
    assert {zp for _, _, zp in quant} == {0}


def test_softmax_inputs_skipped_and_counted(tiny):
    """The scores + mask `add` feeding the softmax keeps fp16 (its -10000 mask would round every score to
    0); the counts name the ops reading int8 activations. Broken variant: without the skip it is int8."""
    path, mlmodel = tiny
    program = load_function(path, "main")
    names, _ = activations.calibration_tensors(mlmodel)
    stats = activations.ranges(load_model(path, backend="mil"), samples())
    skip = activations.softmax_input_ops(program)
    assert len(skip) == 1
    kept = activations.apply_stats(mlmodel, stats, activations.activation_config(skip))
    broken = activations.apply_stats(mlmodel, stats, activations.activation_config())
    kept_counts = activations.quantized_activation_ops(load_function_of(kept))
    broken_counts = activations.quantized_activation_ops(load_function_of(broken))
    assert kept_counts["int8_ops"] == {"add": 1, "conv": 1, "linear": 2}  # the residual add, not the mask add
    assert broken_counts["int8_ops"]["add"] == 2


def test_pairs_made_identities_give_the_f16_program_and_the_rebuild_drops_them(tiny, tmp_path):
    """Sensitivity per activation runs the quantized program itself with some quantize -> dequantize pairs
    made identities (`PairsDisabled`, the interpreter's observer replacing each dequantize output by the
    tensor its quantize read): every pair disabled is the f16 program's output, none disabled the quantized
    one's, one disabled something between. The ops `choose_fp16_activations` keeps for a pair, left fp16 in
    the rebuild, remove that pair and keep the others. Broken variant: an observer whose return value is
    ignored gives the quantized output with every pair disabled (the first assertion)."""
    path, mlmodel = tiny
    stats = activations.ranges(load_model(path, backend="mil"), samples())
    skip = activations.softmax_input_ops(load_function(path, "main"))
    quantized = activations.apply_stats(mlmodel, stats, activations.activation_config(skip))
    qpath = tmp_path / "q.mlpackage"
    quantized.save(str(qpath))
    pairs = activations.quantize_pairs(load_function(qpath, "main"))
    assert len(pairs) >= 3 and all(p["dequantized"] for p in pairs)
    assert all(p["consumers"] or p["producer"] for p in pairs)
    f16, q = load_model(path, backend="mil"), load_model(qpath, backend="mil")
    x = samples(1)[0]
    out = next(iter(f16.output_description))
    ref, plain = f16.predict(x)[out], q.predict(x)[out]
    assert not np.array_equal(ref, plain)
    with q.observed(activations.PairsDisabled(pairs)):
        assert np.array_equal(q.predict(x)[out], ref)
    with q.observed(activations.PairsDisabled([])):
        assert np.array_equal(q.predict(x)[out], plain)
    with q.observed(activations.PairsDisabled(pairs[:1])):
        one = q.predict(x)[out]
    assert not np.array_equal(one, plain) and not np.array_equal(one, ref)
    first = pairs[0]
    keep = sorted({n for n in (*first["consumers"], first["producer"]) if n})
    rebuilt = activations.apply_stats(mlmodel, stats, activations.activation_config([*skip, *keep]))
    left = activations.quantize_pairs(load_function_of(rebuilt))
    assert first["input"] not in {p["input"] for p in left} and 0 < len(left) < len(pairs)


def test_disabled_pairs_in_a_chain_give_the_fp16_tensor():
    """A quantize reading another pair's dequantize output (x -> q/dq A -> q/dq B): with both disabled, B's
    dequantize output is x itself, not A's rounded tensor. Broken variant: saving a quantize's input before
    replacing it hands B the rounded tensor (A stays active though disabled)."""
    a = {"quantize": "qa", "input": "x", "dequantized": ["dqa"], "consumers": [], "producer": None}
    b = {"quantize": "qb", "input": "dqa", "dequantized": ["dqb"], "consumers": ["lin"], "producer": None}
    both = activations.PairsDisabled([a, b])
    assert both("x", "fp16") is None
    assert both("dqa", "rounded by a") == "fp16"
    assert both("dqb", "rounded by b") == "fp16"
    only_b = activations.PairsDisabled([b])  # A active: B's dequantize output is A's rounded tensor
    assert only_b("x", "fp16") is None and only_b("dqa", "rounded by a") is None
    assert only_b("dqb", "rounded by b") == "rounded by a"


def load_function_of(mlmodel):
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = mlmodel.get_spec()
    return load(spec, specification_version=spec.specificationVersion,
                file_weights_dir=mlmodel.weights_dir).functions["main"]


def test_seam_missing_is_an_error(tiny, monkeypatch):
    import importlib

    module = importlib.import_module(activations.CALIBRATION_SEAM[0])
    monkeypatch.delattr(module, activations.CALIBRATION_SEAM[1])
    with pytest.raises(QuantizeError, match="has no"):
        activations.apply_stats(tiny[1], {})


def test_seam_not_called_is_an_error(tiny, monkeypatch):
    """A coremltools whose linear_quantize_activations no longer calibrates through the seam."""
    import coremltools.optimize.coreml as cto

    monkeypatch.setattr(cto, "linear_quantize_activations", lambda model, config, sample_data: model)
    with pytest.raises(QuantizeError, match="did not call"):
        activations.apply_stats(tiny[1], {})


def test_recorder_reductions():
    rec = activations.RangeRecorder(["a"], "all")
    last = activations.RangeRecorder(["a"], "last")
    for r in (rec, last):
        for vals in ([-2.0, 5.0], [-1.0, 1.0]):
            r.next_sample()
            r("a", torch.tensor(vals))
            r("a", torch.tensor([0.5]))  # a second value of the same tensor in one sample (a decoder step)
            r("b", torch.tensor([100.0]))  # not asked for
            r("a", torch.tensor([True]))  # bool: never
    assert rec.stats == {"a": {"rmin": -2.0, "rmax": 5.0}}
    assert last.stats == {"a": {"rmin": -1.0, "rmax": 1.0}}
    with pytest.raises(QuantizeError):
        activations.RangeRecorder(None, "median")


def test_q8a8_preset():
    """q8's weights; int8 activations in the encoder only (the decoder's did not hold the held-out gate)."""
    assert PRESETS["q8a8"]["encoder"] == dataclasses.replace(
        PRESETS["q8"]["encoder"], activations="int8", activation_target_psnr=45.0)
    # the activations are kept fp16 to a target above the fidelity gate the preset shares with q8
    assert PRESETS["q8a8"]["encoder"].activation_target_psnr > GATES["q8a8"]["encoder_psnr_db"]
    assert PRESETS["q8a8"]["decoder"] == PRESETS["q8"]["decoder"]
    assert GATES["q8a8"] == GATES["q8"]


def test_q8a8_bundle(f16_bundle, tmp_path):
    """The preset end to end on the package's multifunction encoder (window + bucket): every function
    calibrated by the interpreter on the gate audio (computed even with --skip-verify: the statistics need
    it), compression.json counts the int8 ops and the activations kept fp16 by their sensitivity. (Its gates
    are the q8 ones, docs/quantization.md.) The fixture's all-int8 encoder already meets q8's 35 dB gate (its
    shorter window), not the preset's 45 dB target, so the choice keeps some activations fp16. Broken
    variant: a rebuild that drops the chosen ops (the recipe's keep_fp16_activations not passed on) leaves
    every function's kept list empty and the rebuilt program with every pair (the assertions on them)."""
    target = PRESETS["q8a8"]["encoder"].activation_target_psnr
    report = quantize_bundle(f16_bundle, tmp_path / "q8a8", "q8a8", skip_verify=True)
    assert report["gate"] == {"skipped": True}
    act = report["components"]["encoder"]["activations"]
    assert act["statistics"]["source"].startswith("cohere_coreml interpreter")
    assert act["quantized"]["int8_ops"]["linear"] > 0 and act["quantized"]["int8_ops"]["conv"] > 0
    assert len(act["functions"]) == len(report["components"]["encoder"]["functions"]) == 2
    assert all(f["samples"] == act["statistics"]["samples"] > 1 for f in act["functions"].values())
    assert "activations" not in report["components"]["decoder"]
    # the activations kept fp16 by their sensitivity (measured in the first build, applied in the rebuild)
    sens = report["components"]["encoder"]["activation_sensitivity"]
    assert sens["target_psnr_db"] == target and len(sens["per_activation"]) > 0
    assert sens["all_int8_psnr_db"] < target <= sens["predicted_psnr_db"] and sens["met"]
    kept = set(sens["keep_ops"])
    assert kept and sens["pairs_kept_fp16"]
    for fn in act["functions"].values():  # every function of the rebuild left the chosen ops fp16
        assert set(fn["kept_fp16_for_sensitivity"]) <= kept and fn["kept_fp16_for_sensitivity"]
    rebuilt = activations.quantize_pairs(load_function(tmp_path / "q8a8" / "encoder.mlpackage", "main"))
    assert len(rebuilt) <= len(sens["per_activation"]) - len(sens["pairs_kept_fp16"])
    assert not {p["input"] for p in rebuilt} & set(sens["inputs_kept_fp16"])
    written = json.loads((tmp_path / "q8a8" / "compression.json").read_text())
    assert written["components"]["encoder"]["activations"] == act
    # the interpreter runs the quantize / dequantize ops of the written encoder
    assert any(s.op_type == "quantize" for s in load_model(tmp_path / "q8a8" / "encoder.mlpackage",
                                                           backend="mil")._steps)
