"""Apply a `Recipe` to one package with `coremltools.optimize.coreml` (the apply step).

Everything that compresses is coremltools (the passes of `linear_quantize_weights` and
`palettize_weights`, see `run_coremltools`); this module runs it per function of multifunction packages (coremltools refuses those: each function is
compressed alone and the results merged with `convert.merge_functions`, which stores identical weights
once), runs the recipe's fallback scheme over what the first pass silently left, collects
coremltools' skip messages, and returns the package's `compression.json` section (`inventory`).

coremltools is imported inside the functions that call it (heavy import, see `recipes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..export.convert import merge_functions, validated_per_pipeline
from ..runtime.package import package_files, read_spec
from ..storage.files import package_size_bytes, save_converted, temporary_dir, weight_file_bytes
from . import activations
from .inventory import compressed_tensors, load_function, package_functions, tensor_report, weight_tensors
from .recipes import WEIGHT_THRESHOLD, QuantizeError, Recipe, scheme_config

logger = logging.getLogger(__name__)


class CoremltoolsSkips(logging.Handler):
    """Collects coremltools' skip messages during compression: {weight name: reason}.

    coremltools logs "Invalid block_sizes; ... not divisible ..." (no name) and then "Cannot
    perform quantization on <name>. Skipped this op."; the unnamed message is the reason.
    """

    NAMED = re.compile(r"(?:Cannot perform quantization on|op named) (\S+?)[.]? ")

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.reasons: dict[str, str] = {}
        self.pending: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        m = self.NAMED.search(msg + " ")
        if m:
            reason = "; ".join(self.pending) or msg
            self.reasons[m.group(1)] = f"coremltools skipped it: {reason}"
            self.pending = []
        elif record.levelno >= logging.WARNING:
            self.pending.append(msg)


@contextlib.contextmanager
def capture_coremltools_skips():
    """coremltools logs skips on its own logger and (block-size messages) on the root logger."""
    ct_logger, root = logging.getLogger("coremltools"), logging.getLogger()
    handler = CoremltoolsSkips()
    level, propagate = ct_logger.level, ct_logger.propagate
    ct_logger.addHandler(handler)
    root.addHandler(handler)
    ct_logger.setLevel(logging.WARNING)
    ct_logger.propagate = False
    try:
        yield handler
    finally:
        ct_logger.removeHandler(handler)
        root.removeHandler(handler)
        ct_logger.setLevel(level)
        ct_logger.propagate = propagate


def optimization_config(recipe: Recipe, weights: dict[str, dict]):
    """`OptimizationConfig` of a recipe for a function whose weights are `weights`."""
    import coremltools.optimize.coreml as cto  # heavy import

    names = {name: None for name, info in weights.items() if recipe.skip_reason(name, info["consumers"])}
    return cto.OptimizationConfig(global_config=scheme_config(recipe.scheme), op_name_configs=names)


# The registered coremltools passes behind `cto.linear_quantize_weights` and `cto.palettize_weights`.
COMPRESSION_PASSES = {"int": "compression::linear_quantize_weights", "pal": "compression::palettize_weights"}


def run_coremltools(mlmodel, scheme: str, config):
    """coremltools' linear quantizer (int8, int4) or palettizer (pal4, pal6) with `config`.

    What `cto.linear_quantize_weights` / `cto.palettize_weights` do (coremltools 9.0,
    optimize/coreml/_post_training_quantization.py: set the registered pass's `config` and
    `joint_compression` options, then `models.utils._apply_graph_pass`), except the conversion back:
    `_apply_graph_pass` ends in `mil_convert` with the default pass pipeline, i.e. the ~90 passes of
    an export (each followed by a validation of the whole program) run again on a program that went
    through them when it was exported. Here that main pipeline is empty; the frontend and backend
    pipelines still run. The weight files are the same bytes as the public functions write and the
    graph stays the exported one (the re-run renames ops and rewrites transpose permutations):
    tests/quantize/test_compress.py compares both on every scheme. Skipping the re-run makes compression
    several times faster (docs/quantization.md).
    """
    from coremltools import _SPECIFICATION_VERSION_IOS_16  # heavy import
    from coremltools.converters.mil.converter import mil_convert
    from coremltools.converters.mil.mil.passes.graph_pass import PassOption
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
    from coremltools.models.utils import _apply_graph_pass

    if mlmodel._is_multifunction():  # as the public functions refuse it
        raise QuantizeError("coremltools compresses single-function models only (compress_package splits them)")
    graph_pass = PASS_REGISTRY[COMPRESSION_PASSES[scheme[:3]]]
    graph_pass.set_options([PassOption("config", config), PassOption("joint_compression", False)])
    with validated_per_pipeline():
        prog = _apply_graph_pass(mlmodel, graph_pass, return_pymil_prog=True)
        spec = mlmodel.get_spec()
        return mil_convert(prog, convert_to="mlprogram", convert_from="milinternal",
                           specification_version=max(spec.specificationVersion, _SPECIFICATION_VERSION_IOS_16),
                           compute_units=mlmodel.compute_unit, model_description=spec.description,
                           skip_model_load=mlmodel.__proxy__ is None, pass_pipeline=PassPipeline.EMPTY)


def compress_per_tensor(mlmodel, recipe: Recipe, weights: dict[str, dict]):
    """A "mixed" recipe: one palettizer pass with each palette tensor's own width
    (`op_name_configs`), then one linear pass for the int8 tensors; the rest stays fp16."""
    import coremltools.optimize.coreml as cto  # heavy import

    schemes = {n: s for n, s in recipe.per_tensor if n in weights and not recipe.skip_reason(n, weights[n]["consumers"])}
    out = mlmodel
    for kind in ("pal", "int"):
        names = {n: scheme_config(s) for n, s in schemes.items() if s.startswith(kind)}
        if names:
            out = run_coremltools(out, next(iter(schemes[n] for n in names)),
                                  cto.OptimizationConfig(global_config=None, op_name_configs=names))
    return out


def compress_mlmodel(mlmodel, recipe: Recipe, weights: dict[str, dict]):
    """Compress a single-function MLModel with coremltools; returns (model, coremltools skip reasons,
    {weight name: why the recipe's fallback scheme compressed it})."""
    import coremltools.optimize.coreml as cto  # heavy import

    with capture_coremltools_skips() as skips:
        if recipe.per_tensor:
            out = compress_per_tensor(mlmodel, recipe, weights)
        else:
            out = run_coremltools(mlmodel, recipe.scheme, optimization_config(recipe, weights))
    fallen: dict[str, str] = {}
    if recipe.fallback:
        done = compressed_tensors(out._mil_program.functions["main"])
        left = [n for n, info in weights.items() if n not in done and not recipe.skip_reason(n, info["consumers"])
                and int(np.prod(info["shape"])) > WEIGHT_THRESHOLD and len(info["shape"]) > 1
                and (not recipe.per_tensor or recipe.scheme_of(n) is not None)]
        if left:
            logger.info("%d weights left by %s: %s", len(left), recipe.scheme, recipe.fallback)
            fallen = {n: skips.reasons.get(n, f"coremltools' {recipe.scheme} skipped it without a reason") for n in left}
            config = cto.OptimizationConfig(global_config=None,
                                            op_name_configs={n: scheme_config(recipe.fallback) for n in left})
            with capture_coremltools_skips() as more:
                out = run_coremltools(out, recipe.fallback, config)
            skips.reasons.update(more.reasons)
    return out, skips.reasons, fallen


def extract_function(path: Path, function_name: str):
    """A single-function MLModel (function renamed `main`) of one function of a package.

    coremltools' compression refuses multifunction models; the weights file is shared, so nothing
    is copied until the model is saved.
    """
    import coremltools as ct  # heavy import

    # read only: coremltools' own loader rewrites the f16 package's Manifest.json (a kill then would
    # leave a stray file in the source bundle)
    spec, weights_dir = read_spec(path), package_files(path)[1]
    functions = spec.mlProgram.functions
    if function_name not in functions:
        raise QuantizeError(f"{path} has no function {function_name!r} (has {sorted(functions)})")
    if len(functions) == 1 and function_name == "main" and not spec.description.functions:
        return ct.models.MLModel(spec, weights_dir=weights_dir, skip_model_load=True)
    # (a package merged from one function keeps a multifunction description, which compression refuses)
    kept = type(functions[function_name])()
    kept.CopyFrom(functions[function_name])
    for name in list(functions.keys()):
        del functions[name]
    functions["main"].CopyFrom(kept)
    desc = spec.description
    fdesc = next(f for f in desc.functions if f.name == function_name)
    for part in ("input", "output", "state"):
        del getattr(desc, part)[:]
        getattr(desc, part).extend(getattr(fdesc, part))
    del desc.functions[:]
    desc.defaultFunctionName = ""
    return ct.models.MLModel(spec, weights_dir=weights_dir, skip_model_load=True)


def compress_package(src: Path, dst: Path, recipe: Recipe, calibration=None, component: str | None = None) -> dict:
    """Write the compressed copy of package `src` to `dst`; returns its report section.

    `recipe.activations` (W8A8): each function's activations are quantized first (`activations`,
    calibrated by the interpreter on `calibration`, a `measure.GateData`; `component` names the package's
    role), then its weights.

    Multifunction packages: every function is compressed alone and the results are merged
    (`convert.merge_functions`: identical weights stored once); the report says
    whether the merged weight file stays the size of one function's (weights shared).
    """

    functions = package_functions(src)
    default = functions[0] if "main" not in functions else "main"
    weights = weight_tensors(load_function(src, default))
    section: dict[str, Any] = {"package": src.name, "recipe": recipe.to_dict(), "functions": functions}
    t0 = time.perf_counter()
    if recipe.scheme is None:
        shutil.copytree(src, dst)
        skips: dict[str, str] = {}
        fallen: dict[str, str] = {}
    else:
        skips, fallen = {}, {}
        act_functions: dict[str, dict] = {}
        scratch = temporary_dir(dst.parent, "compress")
        try:
            singles = {}
            for fn in functions:
                logger.info("compressing %s function %s (%s)", src.name, fn, recipe.scheme)
                model = extract_function(src, fn)
                fn_weights = weight_tensors(load_function(src, fn)) if fn != default else weights
                if recipe.activations and fn_weights:
                    model, act_functions[fn] = activations.quantize_function_activations(
                        model, src, fn, component, calibration, recipe)
                if fn_weights:
                    compressed, fn_skips, fn_fallen = compress_mlmodel(model, recipe, fn_weights)
                    skips.update(fn_skips)
                    fallen.update(fn_fallen)
                else:  # nothing to compress (the decoder's bind_memory): merged as it is
                    compressed = model
                singles[fn] = scratch / f"{fn}.mlpackage"
                save_converted(compressed, singles[fn])
                del compressed, model
            if len(functions) == 1:
                os.rename(singles[default], dst)
            else:
                merged_model = merge_functions(singles, default, scratch)
                source_meta = read_spec(src).description.metadata.userDefined
                merged_model.user_defined_metadata.update(dict(source_meta))
                merged_model.save(str(dst))
                one = weight_file_bytes(singles[default])
                merged_bytes = weight_file_bytes(dst)
                section["multifunction"] = {
                    "single_function_weight_bytes": one, "merged_weight_bytes": merged_bytes,
                    # shared when the merged file is at most the single one plus the weights that
                    # differ between functions (e.g. per-window position tables of encoder buckets)
                    "merged_over_single": round(merged_bytes / max(one, 1), 4),
                }
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    section["compress_seconds"] = round(time.perf_counter() - t0, 2)
    if recipe.activations:
        section["activations"] = activations.summary(act_functions, load_function(dst, default))
    section.update(tensor_report(weights, load_function(dst, default), recipe, skips, fallen))
    section["package_bytes"] = {"before": package_size_bytes(src), "after": package_size_bytes(dst)}
    section["weight_file_bytes"] = {"before": weight_file_bytes(src), "after": weight_file_bytes(dst)}
    return section
