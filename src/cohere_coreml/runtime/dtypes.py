"""Mapping MIL builtin types to the torch / numpy representations the interpreter uses.

Representation inside the interpreter (see docs/runtime.md, "Precision policy"):
- fp16 values are held in float32 torch tensors whose values are exactly representable in
  fp16 (rounded with round-to-nearest-even at every op output, overflow gives +-inf);
- fp32 in float32; int32 (and other ints) in their torch integer dtype; bool in torch.bool.
"""

from __future__ import annotations

import numpy as np
import torch

# MIL dtype name -> (torch dtype used to hold it, numpy dtype at the interface)
_REPR = {
    "fp16": (torch.float32, np.float16),
    "fp32": (torch.float32, np.float32),
    "fp64": (torch.float64, np.float64),
    "int32": (torch.int32, np.int32),
    "int64": (torch.int64, np.int64),
    "int16": (torch.int16, np.int16),
    "uint16": (torch.int32, np.uint16),
    "int8": (torch.int8, np.int8),
    "uint8": (torch.uint8, np.uint8),
    "uint32": (torch.int64, np.uint32),
    "bool": (torch.bool, np.bool_),
}


def mil_dtype_name(builtin) -> str:
    """'fp16', 'fp32', 'int32', 'bool', ... for a MIL builtin type (tensor or scalar)."""
    from coremltools.converters.mil.mil import types  # heavy: importing the runtime loads no coremltools

    if types.is_tensor(builtin):
        builtin = builtin.get_primitive()
    if types.is_state(builtin):
        builtin = builtin.wrapped_type().get_primitive()
    name = types.builtin_to_string(builtin)
    return {"fp64": "fp64", "double": "fp64", "float": "fp32"}.get(name, name)


def torch_dtype(name: str) -> torch.dtype:
    return _REPR[name][0]


def numpy_dtype(name: str):
    return _REPR[name][1]


def is_known(name: str) -> bool:
    return name in _REPR


def is_float(name: str) -> bool:
    return name in ("fp16", "fp32", "fp64")


def coerce(t: torch.Tensor, name: str) -> torch.Tensor:
    """Convert an op result to the representation of MIL dtype ``name``.

    fp16 results are rounded to fp16 (this is the "fp16 at every op boundary" rule).
    """
    if name == "fp16":
        if t.dtype != torch.float32:
            t = t.to(torch.float32)
        return t.to(torch.float16).to(torch.float32)
    target = _REPR[name][0]
    if t.dtype != target:
        t = t.to(target)
    return t


def from_numpy(arr: np.ndarray, name: str) -> torch.Tensor:
    """Numpy array (of the MIL dtype ``name``) -> interpreter representation, same shape (a rank-0
    array stays rank-0: ``np.ascontiguousarray`` would make it (1,))."""
    arr = np.asarray(arr)
    if name in ("fp16", "fp32"):
        if arr.dtype == np.float16:  # torch converts half -> float much faster than numpy
            return torch.from_numpy(np.asarray(arr, order="C")).to(torch.float32)
        t = torch.from_numpy(np.asarray(arr, dtype=np.float32, order="C"))
        return coerce(t, name) if name == "fp16" else t
    return torch.from_numpy(np.asarray(arr.astype(numpy_dtype(name), copy=False), order="C")).to(
        torch_dtype(name)
    )


def to_numpy(t: torch.Tensor, np_dtype) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np_dtype, copy=False)
