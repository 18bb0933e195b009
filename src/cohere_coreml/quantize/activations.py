"""W8A8: int8 activations from statistics the interpreter records, inserted by coremltools' own passes.

coremltools' `linear_quantize_activations` (coremltools.optimize.coreml, 9.0) is two steps:

    _get_activation_calibration_stats(mlmodel, sample_data, group size)   Core ML predictions: macOS only
        -> {tensor name: {"rmin", "rmax"}}: every non-const op output reachable from the outputs that
           Core ML can return (not bool), minus the model outputs, plus the inputs; then the inputs and
           output of every concat share one range (`_adjust_concat_surrounding_activation_stats`)
    graph passes on those statistics: compression::insert_prefix_quantize_dequantize_pair (in front of
        the x (and y) input of conv / linear / avg_pool / max_pool / add), ...insert_suffix_... (after
        dequantize -> conv/add/pool/linear [-> activation]), common::dequantize_quantize_pair_elimination

On Linux the first step cannot run. `interpreter_stats` records the same tensors' ranges by running the
f16 package's function in the interpreter (`MilModel.observed`) on the gate audio, with coremltools'
own tensor selection (`ModelDebugger`) and concat rule; `apply_stats` then calls the public
`linear_quantize_activations` with that one function (the seam, `CALIBRATION_SEAM`) replaced by the
recorded statistics, so everything else (op selection, scales, insertion, clean-up, conversion) is
coremltools' code and the program is the one it writes on macOS from the same statistics. If a
coremltools release stops calling the seam, `apply_stats` raises instead of returning an unquantized
model (and tests/quantize/test_activations.py fails).

Differences on purpose (docs/quantization.md, "W8A8"): coremltools 9.0 keeps the range of the LAST
calibration sample only (`ModelDebugger.record_intermediate_output` and `_update_tensor_range` overwrite
rmin/rmax before taking the min/max with them); the intent (and what is recorded here) is the range over
all samples, `reduction="last"` reproduces 9.0 exactly. Every tensor's range is recorded (coremltools'
passes also read model outputs and state-only tensors, which its calibration leaves out). The config
skips integer `add`s (coremltools' pass fails on them) and the `add` feeding each softmax (the attention
mask's -10000 would round every score to 0), and the ops whose weights the recipe keeps fp16.

Which activations stay fp16 (`pair_sensitivity`, `choose_fp16_activations`): the built W8A8 program is run in
the interpreter with quantize -> dequantize pairs made identities (`PairsDisabled`), so each activation's
cost is measured with coremltools' own scales and rounding; the most costly are kept fp16 (their ops left
out of the config) until the encoder reaches the recipe's target, and the package is rebuilt.

coremltools is imported inside the functions (heavy import, see `recipes`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path
from unittest import mock

import numpy as np

from ..config import MEMORY_NAMES, PREFILL_FUNCTION, STEP_FUNCTION
from ..inference.decoder_runtime import DecoderRuntime
from ..runtime import load_model
from .inventory import load_function
from .measure import GateData, bind_function, decoder_outputs, decoder_runtime
from .recipes import QuantizeError, Recipe

logger = logging.getLogger(__name__)

# the one coremltools internal replaced (module, attribute): its calibration by Core ML predictions
CALIBRATION_SEAM = ("coremltools.optimize.coreml._post_training_quantization", "_get_activation_calibration_stats")
REDUCTIONS = ("all", "last")
# the op types coremltools' insert_prefix_quantize_dequantize_pair quantizes the inputs of (9.0)
QUANTIZED_OP_TYPES = ("conv", "avg_pool", "max_pool", "linear", "add")


def integer_input_ops(function) -> list[str]:
    """Ops of the types coremltools' passes quantize whose activation inputs are not float (e.g. the
    encoder's int32 length arithmetic, `add` of int32): coremltools 9.0 would build a quantize of an int32
    tensor with an fp32 scale and fail, so the config skips them by name."""
    from coremltools.converters.mil.mil import types  # heavy import

    out = []
    for op in function.operations:
        if op.op_type not in QUANTIZED_OP_TYPES:
            continue
        live = [op.inputs[k] for k in ("x", "y") if k in op.inputs]
        if any(not types.is_float(v.dtype) for v in live):
            out.append(op.name)
    return out


def softmax_input_ops(function) -> list[str]:
    """`add` ops whose output feeds a softmax: the attention logits plus the mask and position scores. The
    mask's -10000 at padded frames sets a per-tensor int8 range of ~+-10000 (scale ~79), which rounds every
    real score to 0: quantizing them takes the encoder far below its gate (docs/quantization.md, "W8A8")."""
    return [op.name for op in function.operations if op.op_type == "add"
            and any(c.op_type == "softmax" for c in op.outputs[0].child_ops)]


def activation_config(skip_ops=()):
    """int8, symmetric, per tensor (coremltools' documented W8A8 activation config); `skip_ops`: op names
    left fp16."""
    import coremltools.optimize.coreml as cto  # heavy import

    return cto.OptimizationConfig(global_config=cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8"),
                                  op_name_configs={name: None for name in skip_ops})


def calibration_tensors(mlmodel) -> tuple[list[str], list[list[str]]]:
    """The tensors coremltools' calibration records ranges of (the function inputs come on top) and the
    concat groups whose ranges it unifies, by coremltools' own `ModelDebugger`."""
    from coremltools.optimize.coreml.experimental._model_debugger import ModelDebugger  # heavy import

    debugger = ModelDebugger(mlmodel)
    outputs = {o.name for o in mlmodel.get_spec().description.output}
    names = [n for n in debugger.get_intermediate_output_names(lambda op: op.spec.type != "const")
             if n not in outputs]
    ops = debugger.block_info.operations
    # predict_intermediate_outputs skips what Core ML cannot return (bool): those get no statistics
    names = [n for n in names if ModelDebugger.get_output_feature_type(n, ops) is not None]
    return sorted(names), debugger._get_concat_op_info()


class RangeRecorder:
    """Per-tensor min / max of the observed values of `names` (None: every tensor; an interpreter observer).

    reduction "all": over every sample; "last": each `next_sample()` starts afresh (coremltools 9.0)."""

    def __init__(self, names: Iterable[str] | None = None, reduction: str = "all"):
        if reduction not in REDUCTIONS:
            raise QuantizeError(f"unknown reduction {reduction!r}; choose from {REDUCTIONS}")
        self.names, self.reduction = (None if names is None else set(names)), reduction
        self.stats: dict[str, dict[str, float]] = {}
        self.samples = 0
        self.seen_in_sample: set[str] = set()

    def next_sample(self) -> None:
        self.samples += 1
        self.seen_in_sample = set()

    def __call__(self, name: str, value) -> None:
        import torch  # the interpreter's values (it has imported torch already); not needed to import this module

        if (self.names is not None and name not in self.names) or not isinstance(value, torch.Tensor) \
                or value.dtype == torch.bool or value.numel() == 0:
            return
        lo, hi = float(value.min()), float(value.max())
        old = self.stats.get(name)
        fresh = old is None or (self.reduction == "last" and name not in self.seen_in_sample)
        self.seen_in_sample.add(name)
        self.stats[name] = {"rmin": lo, "rmax": hi} if fresh else {
            "rmin": min(lo, old["rmin"]), "rmax": max(hi, old["rmax"])}


def adjust_concats(stats: dict, concat_groups: list[list[str]]) -> dict:
    """coremltools' own rule: inputs and output of each concat share one range."""
    from coremltools.optimize.coreml.experimental._post_training_quantization import (  # heavy import
        _adjust_concat_surrounding_activation_stats,
    )

    adjusted = collections.defaultdict(dict, {k: dict(v) for k, v in stats.items()})
    _adjust_concat_surrounding_activation_stats(concat_groups, adjusted)
    return dict(adjusted)


def encoder_samples(model, data: GateData) -> Iterable[dict[str, np.ndarray]]:
    """The gate windows as inputs of one encoder function (a bucket takes the first frames of each)."""
    yield from data.encoder_inputs(int(model.input_description["input_features"][0][-1]))


def ranges(model, samples: Iterable[dict], names: Iterable[str] | None = None, reduction: str = "all") -> dict:
    """Per-tensor ranges of a stateless interpreter model (`MilModel`) over `samples` (predict inputs)."""
    recorder = RangeRecorder(names, reduction)
    with model.observed(recorder):
        for sample in samples:
            recorder.next_sample()
            model.predict(sample)
    return recorder.stats


def interpreter_stats(package: Path, function: str, component: str, data: GateData, names: Iterable[str] | None,
                      reduction: str = "all") -> tuple[dict, int]:
    """Ranges of `names` while the interpreter runs `function` of `package` on the gate data: the encoder
    on every gate window, the decoder step (`main`) teacher-forced on every gate sequence (one sample per
    sequence). Returns (statistics, samples)."""
    model = load_model(str(package), backend="mil", function_name=function)
    if component == "encoder":
        samples = list(encoder_samples(model, data))
        return ranges(model, samples, names, reduction), len(samples)
    recorder = RangeRecorder(names, reduction)
    with model.observed(recorder):
        if component == "decoder" and function == STEP_FUNCTION:
            decoder = decoder_runtime(package, step=model)
            for i in range(len(data.sequences)):
                recorder.next_sample()
                decoder_outputs(decoder, data.subset([i]))
        elif component == "decoder" and function == PREFILL_FUNCTION:  # the prompt of each gate sequence
            decoder = DecoderRuntime(load_model(str(package), backend="mil", function_name=STEP_FUNCTION),
                                     bind_function(package), model)
            for enc, prompt in zip(data.encoder_ref, data.prompts):
                recorder.next_sample()
                decoder.prefill(decoder.new_state({k: enc[k] for k in MEMORY_NAMES}), prompt)
        else:
            raise QuantizeError(f"no activation calibration for {component} function {function!r} "
                                f"(encoder functions, the decoder's {STEP_FUNCTION!r} and {PREFILL_FUNCTION!r})")
    return recorder.stats, recorder.samples


@contextlib.contextmanager
def calibration_replaced(stats: dict, calls: list):
    """coremltools' calibration (`CALIBRATION_SEAM`) replaced by precomputed statistics."""
    import importlib

    module = importlib.import_module(CALIBRATION_SEAM[0])
    if not callable(getattr(module, CALIBRATION_SEAM[1], None)):
        raise QuantizeError(f"coremltools has no {'.'.join(CALIBRATION_SEAM)} (moved in this coremltools "
                            "version): activation statistics cannot be supplied")

    def precomputed(fpmodel, sample_data, calibration_op_group_size=-1):
        calls.append(fpmodel)
        return collections.defaultdict(dict, {k: dict(v) for k, v in stats.items()})

    with mock.patch.object(module, CALIBRATION_SEAM[1], precomputed):
        yield


def apply_stats(mlmodel, stats: dict, config=None):
    """coremltools' `linear_quantize_activations` on `mlmodel` with `stats` as its calibration result."""
    import coremltools.optimize.coreml as cto  # heavy import

    calls: list = []
    with calibration_replaced(stats, calls):
        out = cto.linear_quantize_activations(mlmodel, config or activation_config(), sample_data=[])
    if len(calls) != 1 or calls[0] is not mlmodel:
        raise QuantizeError(f"coremltools' linear_quantize_activations did not call {'.'.join(CALIBRATION_SEAM)} "
                            "once on the model: the interpreter's statistics were not used")
    return out


def recipe_kept_ops(function, recipe: Recipe | None) -> list[str]:
    """Ops reading a weight the recipe keeps fp16 (the decoder's LM head `proj_out`, kept for its sensitivity):
    their activations stay fp16 too (coremltools then inserts no pair before or after them)."""
    if recipe is None:
        return []
    out = []
    for op in function.operations:
        consts = [v for v in op.inputs.values() if not isinstance(v, (list, tuple)) and v.op is not None
                  and v.op.op_type == "const"]
        if op.op_type in QUANTIZED_OP_TYPES and any(recipe.skip_reason(v.name, [op.op_type]) for v in consts):
            out.append(op.name)
    return out


def quantize_function_activations(mlmodel, package: Path, function: str, component: str, data: GateData | None,
                                  recipe: Recipe | None = None, reduction: str = "all"):
    """int8 activations for one single-function model extracted from `package` (its `function`), calibrated
    by the interpreter on `data`; returns (model, report)."""
    if data is None:
        raise QuantizeError("int8 activations need calibration audio (the gate data): not with --skip-verify alone")
    names, concats = calibration_tensors(mlmodel)
    # coremltools records the inputs' ranges and those of op outputs that reach a model output, never the
    # outputs' own, nor tensors that only reach a state write: a pass reading one of those (the encoder's
    # output `encoder_hidden_states` feeds the cross-attention K/V linears; the decoder's K/V projections
    # feed only the cache update) fails with KeyError 'rmin'. Every tensor's range is recorded here; the
    # extra ones are used only where coremltools would have failed.
    raw, samples = interpreter_stats(package, function, component, data, None, reduction)
    missing = sorted(set(names) - set(raw))
    if missing:  # a tensor coremltools would calibrate that the interpreter never produced
        raise QuantizeError(f"{package.name}:{function}: no statistics for {len(missing)} tensors, e.g. {missing[:3]}")
    stats = adjust_concats(raw, concats)
    logger.info("%s:%s: activation ranges of %d tensors over %d samples (interpreter)", package.name, function,
                len(stats), samples)
    program = load_function(package, function)
    integer, scores, kept = integer_input_ops(program), softmax_input_ops(program), recipe_kept_ops(program, recipe)
    present = {op.name for op in program.operations}
    sensitive = sorted(n for n in (recipe.keep_fp16_activations if recipe is not None else ()) if n in present)
    out = apply_stats(mlmodel, stats, activation_config([*integer, *scores, *kept, *sensitive]))
    return out, {"skipped_softmax_inputs": len(scores), "tensors_calibrated": len(stats),
                 "coremltools_tensors": len(names), "samples": samples, "concat_groups": len(concats),
                 "skipped_integer_ops": len(integer), "skipped_by_recipe": sorted(kept),
                 "kept_fp16_for_sensitivity": sensitive}


def quantized_activation_ops(function) -> dict:
    """The ops of a MIL function reading an activation through quantize -> dequantize, per op type: `int8_ops`
    the op types coremltools quantizes (conv / linear / pool / add: int8 x int8 on a Neural Engine that has it),
    `reads_dequantized` the other readers of those tensors (fp16 ops on int8-rounded values); and the number of
    quantize ops."""
    int8_ops: collections.Counter = collections.Counter()
    others: collections.Counter = collections.Counter()
    quantize_ops = 0
    for op in function.operations:
        if op.op_type == "quantize":
            quantize_ops += 1
        readers = [v.op for v in op.inputs.values() if not isinstance(v, (list, tuple)) and v.op is not None]
        if any(r.op_type == "dequantize" and r.inputs["input"].op is not None
               and r.inputs["input"].op.op_type == "quantize" for r in readers):
            (int8_ops if op.op_type in QUANTIZED_OP_TYPES else others)[op.op_type] += 1
    return {"quantize_ops": quantize_ops, "int8_ops": dict(sorted(int8_ops.items())),
            "reads_dequantized": dict(sorted(others.items()))}


def summary(functions: dict[str, dict], function, reduction: str = "all") -> dict:
    """The `activations` section of compression.json for one package."""
    first = next(iter(functions.values()))
    return {"dtype": "int8", "mode": "linear_symmetric, per tensor",
            "statistics": {"source": "cohere_coreml interpreter (f16 package, gate audio)",
                           "samples": first["samples"],
                           "samples_are": "the gate windows: each gate clip (--data: 2 per language; else the "
                                          "packaged speech clips) and one full window of them back to back; the "
                                          "decoder: teacher forcing on the f16 bundle's greedy tokens",
                           "reduction": "min/max over all samples" if reduction == "all" else
                           "last sample (coremltools 9.0)",
                           "coremltools_seam": ".".join(CALIBRATION_SEAM)},
            "functions": functions, "quantized": quantized_activation_ops(function)}



# --------------------------------------------------------------------------------------------
# Which activations to keep fp16: per quantize/dequantize pair, in the quantized program itself
# --------------------------------------------------------------------------------------------


def quantize_pairs(function) -> list[dict]:
    """Every quantize op of a (quantized) MIL function with the tensor it reads (`input`), the outputs of the
    dequantize ops reading it (`dequantized`), the ops of `QUANTIZED_OP_TYPES` reading those (`consumers`:
    coremltools' prefix pair sits before them) and the one writing its input, looked for through at most one
    op of another type (`producer`: its suffix pair sits after it, [-> activation])."""
    out = []
    for op in function.operations:
        if op.op_type != "quantize":
            continue
        x = op.inputs["input"]
        deq = [c for c in op.outputs[0].child_ops if c.op_type == "dequantize"]
        consumers = sorted({c.name for d in deq for c in d.outputs[0].child_ops if c.op_type in QUANTIZED_OP_TYPES})
        producer = x.op
        if producer is not None and producer.op_type not in QUANTIZED_OP_TYPES:
            before = [v.op for v in producer.inputs.values() if not isinstance(v, (list, tuple)) and v.op is not None
                      and v.op.op_type in QUANTIZED_OP_TYPES]
            producer = before[0] if len(before) == 1 else None
        out.append({"quantize": op.name, "input": x.name, "dequantized": [d.outputs[0].name for d in deq],
                    "consumers": consumers,
                    "producer": producer.name if producer is not None and producer.op_type in QUANTIZED_OP_TYPES
                    else None})
    return out


class PairsDisabled:
    """Interpreter observer (`MilModel.observed`) making some quantize -> dequantize pairs an identity: each
    dequantize output of a disabled pair is replaced by the fp16 tensor its quantize read. A quantize reading
    the dequantize output of another disabled pair reads the replaced tensor (the value saved is the one the
    later ops see), so a chain of disabled pairs is the fp16 program too."""

    def __init__(self, pairs: list[dict]):
        self.inputs = {p["input"] for p in pairs}
        self.replace = {d: p["input"] for p in pairs for d in p["dequantized"]}
        self.saved: dict = {}

    def __call__(self, name: str, value):
        out = self.saved[self.replace[name]] if name in self.replace else None
        if name in self.inputs:
            self.saved[name] = value if out is None else out
        return out


def pair_psnr(model, pairs: list[dict], disabled: list[dict], data: GateData, reference) -> float:
    """Encoder PSNR vs `reference` of the quantized program `model` with the `disabled` pairs made identities."""
    from .measure import encoder_outputs, encoder_psnr

    with model.observed(PairsDisabled(disabled)):
        return encoder_psnr(reference, encoder_outputs(model, data))


def pair_sensitivity(package: Path, data: GateData) -> dict:
    """Per quantize/dequantize pair of a W8A8 encoder package's default function: the encoder's PSNR vs the
    f16 references of `data` with ONLY that activation int8 (every other pair an identity), and with every
    pair (`all`). The program is coremltools' own, so scales and rounding are the real ones."""
    function = load_function(package)
    pairs = quantize_pairs(function)
    model = load_model(str(package), backend="mil")
    reference = data.encoder_ref
    per = {}
    from tqdm import tqdm

    for i, pair in enumerate(tqdm(pairs, desc="activation sensitivity", unit="pair", leave=False)):
        per[pair["quantize"]] = pair_psnr(model, pairs, pairs[:i] + pairs[i + 1:], data, reference)
    return {"all": pair_psnr(model, pairs, [], data, reference), "per_pair": per, "pairs": pairs,
            "windows": len(data.windows)}


def choose_fp16_activations(package: Path, data: GateData, sens: dict, target_psnr: float) -> dict:
    """The fewest pairs, most sensitive first (lowest PSNR alone), whose removal brings the quantized
    program's encoder PSNR to `target_psnr` (bisection on their number, each step the real program with
    those pairs made identities), and the ops to leave fp16 in the rebuild (`keep_ops`: their consumers
    and producers, so coremltools inserts neither pair). Returns the steps measured too."""
    model = load_model(str(package), backend="mil")
    pairs = sorted(sens["pairs"], key=lambda p: sens["per_pair"][p["quantize"]])
    steps: dict[int, float] = {}

    def psnr_with(k: int) -> float:
        if k not in steps:
            steps[k] = pair_psnr(model, pairs, pairs[:k], data, data.encoder_ref)
        return steps[k]

    lo, hi = 0, len(pairs)  # psnr_with(hi) is the f16 program's (every pair an identity)
    if psnr_with(0) < target_psnr:
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if psnr_with(mid) >= target_psnr:
                hi = mid
            else:
                lo = mid
        k = hi
    else:
        k = 0
    kept = pairs[:k]
    keep_ops = sorted({n for p in kept for n in (*p["consumers"], p["producer"]) if n})
    return {"target_psnr_db": target_psnr, "pairs_kept_fp16": [p["quantize"] for p in kept],
            "inputs_kept_fp16": [p["input"] for p in kept], "keep_ops": keep_ops,
            "predicted_psnr_db": psnr_with(k), "met": psnr_with(k) >= target_psnr,
            "steps": [{"pairs_kept_fp16": n, "psnr_db": round(v, 2)} for n, v in sorted(steps.items())]}
