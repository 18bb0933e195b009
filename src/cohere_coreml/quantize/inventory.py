"""What a package holds: its functions, its float weight tensors, its compressed tensors, and the
per-tensor report of a compression (`compression.json`'s `compressed` / `uncompressed` lists).

Reads packages only (through `cohere_coreml.runtime.package`); never writes. coremltools' own
rule for "a weight" is imported inside `is_weight` (heavy import, see `recipes`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..runtime.package import load_mil_function, read_package
from .recipes import WEIGHT_THRESHOLD, Recipe

# constexpr ops that mean "this package already holds compressed weights"
COMPRESSED_OPS = ("constexpr_blockwise_shift_scale", "constexpr_lut_to_dense", "constexpr_affine_dequantize",
                  "constexpr_sparse_to_dense", "constexpr_lut_to_sparse", "constexpr_sparse_blockwise_shift_scale")
# suffixes coremltools gives the op replacing const `<name>`
COMPRESSED_SUFFIXES = ("_quantized", "_palettized", "_sparsified")


def package_functions(path: Path) -> list[str]:
    return list(read_package(path).function_names)


def load_function(path: Path, function_name: str | None = None):
    """The PyMIL function of a package (weights loaded), for inspection."""
    return load_mil_function(read_package(path, function_name))


def compressed_ops(path: Path) -> list[str]:
    """Names of the ops of a package that hold compressed weights (empty for an fp16 package)."""
    spec = read_package(path).spec
    found = []
    for fn in spec.mlProgram.functions.values():
        for block in fn.block_specializations.values():
            found += [op.type + ":" + (op.outputs[0].name if op.outputs else "") for op in block.operations
                      if op.type in COMPRESSED_OPS]
    return found


def is_weight(val) -> bool:
    """A float tensor stored in the weight file (coremltools' own rule)."""
    from coremltools.converters.mil.backend.mil.load import should_use_weight_file  # heavy import

    return isinstance(val, np.ndarray) and val.dtype.kind == "f" and bool(should_use_weight_file(val))


def weight_tensors(function) -> dict[str, dict]:
    """{const name: {"shape", "dtype", "bytes", "var", "consumers"}} of the float weights of a PyMIL function."""
    out = {}
    for op in function.operations:
        if op.op_type != "const":
            continue
        val = op.outputs[0].val
        if not is_weight(val):
            continue
        out[op.name] = {"shape": list(val.shape), "dtype": str(val.dtype), "bytes": int(val.nbytes),
                        "var": op.outputs[0].name, "consumers": sorted({c.op_type for c in op.outputs[0].child_ops})}
    return out


def stored_bits(var) -> int:
    """Bit width of a constexpr input as stored (int4 / int8 / fp16 ...)."""
    dt = var.dtype
    try:
        return int(dt.get_bitwidth())
    except (AttributeError, TypeError):
        return int(np.dtype(var.val.dtype).itemsize * 8)


def compressed_tensors(function) -> dict[str, dict]:
    """{original const name: {"op", "bytes", "var"}} for each compressed weight of a PyMIL function.

    bytes = the stored size of the constexpr op's constant inputs (packed bit width x elements).
    """
    out = {}
    for op in function.operations:
        if op.op_type not in COMPRESSED_OPS:
            continue
        if all(c.op_type in COMPRESSED_OPS for o in op.outputs for c in o.child_ops):
            continue  # an inner link of a joint chain
        name = op.name
        for suffix in COMPRESSED_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        stored = 0
        for var in op.inputs.values():
            if isinstance(var, (list, tuple)) or var.val is None or not isinstance(var.val, np.ndarray):
                continue
            stored += int(math.ceil(var.val.size * stored_bits(var) / 8))
        out[name] = {"op": op.op_type, "bytes": stored, "var": op.outputs[0].name}
    return out


def tensor_report(weights: dict[str, dict], compressed_function, recipe: Recipe, skips: dict[str, str],
                  fallen: dict[str, str] | None = None) -> dict:
    """Every weight tensor: compressed (scheme, bytes before/after; a fallback says why) or left fp16
    (with the reason)."""
    done = compressed_tensors(compressed_function)
    fallen = fallen or {}
    compressed, uncompressed = [], []
    for name, info in weights.items():
        if name in done:
            entry = {"name": name, "shape": info["shape"], "scheme": recipe.scheme_of(name), "op": done[name]["op"],
                     "bytes_before": info["bytes"], "bytes_after": done[name]["bytes"]}
            if name in fallen:
                entry.update(scheme=recipe.fallback, fallback_for=f"{recipe.scheme}: {fallen[name]}")
            compressed.append(entry)
            continue
        n = int(np.prod(info["shape"]))
        if recipe.scheme is None:
            reason = "the preset keeps this component fp16"
        else:
            reason = recipe.skip_reason(name, info["consumers"]) or skips.get(name)
        if reason is None and n <= WEIGHT_THRESHOLD:
            reason = f"below coremltools' weight_threshold ({n} <= {WEIGHT_THRESHOLD} elements)"
        if reason is None and len(info["shape"]) <= 1:
            reason = "1-D tensor (coremltools never compresses rank-1 constants)"
        if reason is None:
            reason = "coremltools did not compress it and logged no reason"
        uncompressed.append({"name": name, "shape": info["shape"], "bytes": info["bytes"], "reason": reason})
    before = sum(w["bytes"] for w in weights.values())
    after = sum(c["bytes_after"] for c in compressed) + sum(u["bytes"] for u in uncompressed)
    return {
        "tensors": {"total": len(weights), "compressed": len(compressed), "uncompressed": len(uncompressed)},
        "weight_bytes": {"before": before, "after": after, "ratio": round(after / max(before, 1), 4)},
        "compressed": compressed,
        "uncompressed": uncompressed,
    }
