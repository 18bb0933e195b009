"""Compressed weights: the interpreter's decompression equals coremltools' own, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.export.parity import psnr
from cohere_coreml.runtime import load_model

from .helpers import convert_torch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.conv = torch.nn.Conv1d(64, 64, 3, padding=1)

    def forward(self, x):  # (1, 5, 64)
        return self.conv(self.lin(x).transpose(1, 2))


def _configs():
    import coremltools.optimize.coreml as cto

    lq, pal, prune = cto.OpLinearQuantizerConfig, cto.OpPalettizerConfig, cto.OpMagnitudePrunerConfig
    return {
        # name: (deployment target, [(function, config, kwargs), ...], constexpr op types emitted)
        "int8_per_channel": ("ios18", [("quant", lq(mode="linear_symmetric", dtype="int8", granularity="per_channel"), {})], "constexpr_blockwise_shift_scale"),
        "uint8_affine": ("ios18", [("quant", lq(mode="linear", dtype="uint8", granularity="per_tensor"), {})], "constexpr_blockwise_shift_scale"),
        "int4_per_block32": ("ios18", [("quant", lq(mode="linear", dtype="int4", granularity="per_block", block_size=32), {})], "constexpr_blockwise_shift_scale"),
        "palette4": ("ios18", [("pal", pal(nbits=4, mode="kmeans"), {})], "constexpr_lut_to_dense"),
        "palette6_grouped": ("ios18", [("pal", pal(nbits=6, mode="kmeans", granularity="per_grouped_channel", group_size=16), {})], "constexpr_lut_to_dense"),
        "palette8": ("ios18", [("pal", pal(nbits=8, mode="kmeans"), {})], "constexpr_lut_to_dense"),
        "palette2_vector": ("ios18", [("pal", pal(nbits=2, mode="kmeans", cluster_dim=2), {})], "constexpr_lut_to_dense"),
        "sparse": ("ios18", [("prune", prune(target_sparsity=0.5), {})], "constexpr_sparse_to_dense"),
        "sparse_palette4": ("ios18", [("prune", prune(target_sparsity=0.5), {}), ("pal", pal(nbits=4), {"joint_compression": True})], "constexpr_lut_to_sparse,constexpr_sparse_to_dense"),
        "sparse_int8": ("ios18", [("prune", prune(target_sparsity=0.5), {}), ("quant", lq(dtype="int8"), {"joint_compression": True})], "constexpr_sparse_blockwise_shift_scale,constexpr_sparse_to_dense"),
        "ios16_int8_affine": ("ios16", [("quant", lq(mode="linear", dtype="int8"), {})], "constexpr_affine_dequantize"),
        "ios16_palette4": ("ios16", [("pal", pal(nbits=4, mode="kmeans"), {})], "constexpr_lut_to_dense"),
        "ios16_sparse": ("ios16", [("prune", prune(target_sparsity=0.5), {})], "constexpr_sparse_to_dense"),
    }


@pytest.fixture(scope="module")
def base_models(tmp_path_factory):
    import coremltools as ct

    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(1, 5, 64)
    d = tmp_path_factory.mktemp("qbase")
    out = {}
    for name, target in (("ios18", ct.target.macOS15), ("ios16", ct.target.macOS13)):
        path = convert_torch(net, [x], d / f"{name}.mlpackage", precision="fp16", target=target)
        out[name] = ct.models.MLModel(str(path), skip_model_load=True)
    with torch.no_grad():
        ref = net(x).numpy()
    return out, x.numpy(), ref


def _compress(mlmodel, steps):
    import coremltools.optimize.coreml as cto

    fns = {"quant": cto.linear_quantize_weights, "pal": cto.palettize_weights, "prune": cto.prune_weights}
    for fn, cfg, kwargs in steps:
        mlmodel = fns[fn](mlmodel, cto.OptimizationConfig(global_config=cfg), **kwargs)
    return mlmodel


def _reference_weights(prog):
    """var name -> coremltools' materialized value, for every constexpr output used by a real op."""
    ref = {}
    for op in prog.functions["main"].operations:
        if not op.op_type.startswith("constexpr_"):
            continue
        if all(c.op_type.startswith("constexpr_") for o in op.outputs for c in o.child_ops):
            continue
        vals = op.materialized_val_inference()
        vals = vals if isinstance(vals, tuple) else (vals,)
        for var, val in zip(op.outputs, vals):
            ref[var.name] = (op.op_type, np.asarray(val))
    return ref


@pytest.mark.parametrize("name", list(_configs()))
def test_decompression_bit_exact(name, base_models, tmp_path):
    bases, x, ref_out = base_models
    target, steps, op_types = _configs()[name]
    compressed = _compress(bases[target], steps)
    emitted = {op.op_type for op in compressed._mil_program.functions["main"].operations}
    assert {t for t in emitted if t.startswith("constexpr_")} == set(op_types.split(","))
    reference = _reference_weights(compressed._mil_program)
    assert len(reference) == 2, f"{name}: expected both weights compressed, got {list(reference)}"
    path = tmp_path / f"{name}.mlpackage"
    compressed.save(str(path))

    model = load_model(path, backend="mil")
    # compressed data (indices, scales, LUTs, masks) is read once at load: no torch copy is kept of
    # anything that only feeds constexpr ops (4-bit indices as int32 took ~10 bytes per parameter)
    data_vars = {v.name for op in compressed._mil_program.functions["main"].operations
                 if op.op_type.startswith("constexpr_") for v in op.inputs.values()}
    assert data_vars and not data_vars & set(model._consts), sorted(data_vars & set(model._consts))
    for var_name, (op_type, want) in reference.items():
        got = model._consts[var_name].numpy().astype(want.dtype)
        assert got.shape == want.shape, (op_type, var_name)
        # bit-for-bit: compare the raw bits of the fp16 / fp32 values
        assert np.array_equal(got.view(f"u{want.itemsize}"), want.view(f"u{want.itemsize}")), (op_type, var_name)

    # and the compressed model still computes the network (coarse: compression error)
    (out,) = model.predict({"x0": x}).values()
    assert psnr(ref_out, out) > (12 if "2" in name or "4" in name or "sparse" in name else 25)
