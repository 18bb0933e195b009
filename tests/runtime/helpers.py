"""Shared helpers for the runtime tests: convert tiny torch modules / MIL programs to packages."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

logging.getLogger("coremltools").setLevel(logging.ERROR)


def convert_torch(module, example_inputs, path, precision="fp32", input_dtypes=None, states=None,
                  output_names=None, target=None):
    """Trace ``module`` and save an ML program package (default iOS18) to ``path``; returns ``path``."""
    import coremltools as ct

    module = module.eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, tuple(example_inputs))
    input_dtypes = input_dtypes or {}
    inputs = []
    for i, x in enumerate(example_inputs):
        name = f"x{i}"
        dtype = input_dtypes.get(name, np.int32 if not torch.is_floating_point(x) else np.float32)
        inputs.append(ct.TensorType(name=name, shape=tuple(x.shape), dtype=dtype))
    kwargs = {}
    if states:
        kwargs["states"] = states
    if output_names:
        kwargs["outputs"] = [ct.TensorType(name=n) for n in output_names]
    ml = ct.convert(
        traced,
        inputs=inputs,
        convert_to="mlprogram",
        minimum_deployment_target=target or ct.target.macOS15,
        compute_precision=ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16,
        skip_model_load=True,
        **kwargs,
    )
    ml.save(os.fspath(path))
    return path


def save_mil_program(prog, path, precision="fp32"):
    """Convert a PyMIL program (``@mb.program``) to a package at ``path``."""
    import coremltools as ct

    ml = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16,
        skip_model_load=True,
    )
    ml.save(os.fspath(path))
    return path


def max_rel_err(y, ref) -> float:
    y = np.asarray(y, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    return float(np.abs(y - ref).max() / scale)


