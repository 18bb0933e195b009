"""Torch-module op zoo: small modules through coremltools' torch frontend, interpreter vs torch.

One module with many outputs, converted once at FP32 and once at FP16 precision. FP32: max
error / max |torch| <= 1e-4 per output. FP16: the whole chain runs in fp16 in the package, so
errors accumulate over a few ops: PSNR per output is printed (``pytest -s``) and must exceed
40 dB.

Then a toy decoder step with the KV cache as inputs and outputs (no Core ML state) and scalar
(rank-0) position arithmetic, as other projects convert Cohere's decoder: several steps, the
interpreter's caches fed back, vs torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cohere_coreml.export.parity import psnr
from cohere_coreml.runtime import load_model

from .helpers import convert_torch, max_rel_err

OUTPUTS = [
    "conv2d_strided_grouped", "conv1d_depthwise", "batch_norm", "gelu_exact", "gelu_tanh", "layer_norm",
    "log_softmax", "embedding", "einsum_scores", "matmul_t", "softmax", "avg_pool", "max_pool",
    "pad_reflect", "masked_fill", "cumsum", "clamp_where", "glu", "rel_shift",
]


class _Zoo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv2d = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
        self.dw = torch.nn.Conv1d(8, 8, 5, padding=2, groups=8)
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.ln = torch.nn.LayerNorm(8)
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, img, seq, ids):  # img (1, 4, 9, 10), seq (1, 6, 8), ids (1, 5) int32
        outs = [self.conv2d(img)]
        x = seq.transpose(1, 2)  # (1, 8, 6)
        outs.append(self.dw(x))
        outs.append(self.bn(self.lin(seq).transpose(1, 2)))  # not foldable into a conv
        outs.append(F.gelu(seq))
        outs.append(F.gelu(seq, approximate="tanh"))
        outs.append(self.ln(seq))
        outs.append(F.log_softmax(seq * 3, dim=-1))
        outs.append(self.emb(ids.long()))
        q = seq.view(1, 6, 2, 4).transpose(1, 2)  # (1, 2, 6, 4)
        outs.append(torch.einsum("bhqd,bhkd->bhqk", q, q))
        outs.append(torch.matmul(seq.transpose(1, 2), seq))
        outs.append(torch.softmax(seq, dim=1))
        outs.append(F.avg_pool2d(img, 2))
        outs.append(F.max_pool2d(img, 3, stride=2, padding=1))
        outs.append(F.pad(x, (2, 1), mode="reflect"))
        mask = torch.arange(6)[None, :, None] > 3
        outs.append(seq.masked_fill(mask, -1e4))
        outs.append(torch.cumsum(seq, dim=1))
        outs.append(torch.where(seq > 0.2, seq.clamp(max=0.9), seq * 0.5))
        outs.append(F.glu(seq, dim=-1))
        # relative-position shift as in transformers' parakeet attention
        scores = torch.einsum("bhqd,bhkd->bhqk", q, q)  # (1, 2, 6, 6)
        b, h, qlen, plen = scores.shape
        shifted = F.pad(scores, (1, 0)).view(b, h, -1, qlen)[:, :, 1:].view(b, h, qlen, plen)
        outs.append(shifted)
        return tuple(outs)


@pytest.fixture(scope="module")
def zoo_module():
    torch.manual_seed(0)
    module = _Zoo().eval()
    with torch.no_grad():
        module.bn.running_mean.uniform_(-0.5, 0.5)
        module.bn.running_var.uniform_(0.5, 2.0)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 4, 9, 10, generator=gen), torch.randn(1, 6, 8, generator=gen),
              torch.randint(0, 50, (1, 5), generator=gen, dtype=torch.int32)]
    return module, inputs


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def zoo_results(request, zoo_module, tmp_path_factory):
    module, inputs = zoo_module
    precision = request.param
    path = convert_torch(module, inputs, tmp_path_factory.mktemp("tzoo") / f"zoo_{precision}.mlpackage",
                         precision=precision, output_names=OUTPUTS)
    model = load_model(path, backend="mil")
    feeds = {f"x{i}": x.numpy() for i, x in enumerate(inputs)}
    out = model.predict(feeds)
    ref_inputs = [x.half().float() if precision == "fp16" and x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        refs = [r.numpy() for r in module(*ref_inputs)]
    return precision, out, dict(zip(OUTPUTS, refs))


@pytest.mark.parametrize("name", OUTPUTS)
def test_torch_zoo(zoo_results, name):
    precision, out, refs = zoo_results
    got, ref = out[name].astype(np.float32), refs[name]
    assert got.shape == ref.shape
    if precision == "fp32":
        err = max_rel_err(got, ref)
        print(f"torch zoo fp32 {name}: max rel err {err:.2e}")
        assert err <= 1e-4
    else:
        value = psnr(ref, got)
        print(f"torch zoo fp16 {name}: PSNR {value:.1f} dB, max rel err {max_rel_err(got, ref):.2e}")
        assert value > 40


# ---------------------------------------------------------------- decoder step, cache in / cache out
V, D, HEADS, LAYERS, T, STEPS = 13, 16, 2, 2, 8, 6


class _CacheIODecoderStep(torch.nn.Module):
    """One decoder step: token (1, 1) int32, position (1,) int32, caches (LAYERS, 1, HEADS, T, D / HEADS)
    in; logits and the caches with row `position` written out. `position[0]` is rank-0 in the MIL
    program: it feeds a scalar gather (position table), scalar slices (gain table, cache[:, :, p:p + 1])
    and `p + 1`."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.pos_table = torch.nn.Parameter(torch.randn(T, D) * 0.5)
        self.pos_gain = torch.nn.Parameter(torch.rand(T) + 0.5)
        self.ln = torch.nn.ModuleList(torch.nn.LayerNorm(D) for _ in range(LAYERS))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in range(LAYERS))
        self.o = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(LAYERS))
        self.ff = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, V)

    def forward(self, token, position, k_cache, v_cache):
        p = position[0]
        h = self.emb(token) + F.embedding(p, self.pos_table) * self.pos_gain[p]
        bias = torch.where(torch.arange(T) < p + 1, 0.0, -1e4)  # attend to rows <= p
        hd = D // HEADS
        keys, values = [], []
        for i in range(LAYERS):
            q, k, v = self.qkv[i](self.ln[i](h)).view(1, 1, 3, HEADS, hd).permute(2, 0, 3, 1, 4)
            kc, vc = k_cache[i].clone(), v_cache[i].clone()
            kc[:, :, p:p + 1] = k
            vc[:, :, p:p + 1] = v
            keys.append(kc)
            values.append(vc)
            att = torch.softmax(q @ kc.transpose(-1, -2) / hd**0.5 + bias, dim=-1) @ vc
            h = h + self.o[i](att.transpose(1, 2).reshape(1, 1, D))
            h = h + self.ff[i](h)
        return self.head(h), torch.stack(keys), torch.stack(values)


@pytest.fixture(scope="module")
def cache_io_decoder(tmp_path_factory):
    torch.manual_seed(2)
    module = _CacheIODecoderStep().eval()
    cache = (LAYERS, 1, HEADS, T, D // HEADS)
    example = [torch.tensor([[3]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
               torch.randn(cache), torch.randn(cache)]
    path = convert_torch(module, example, tmp_path_factory.mktemp("cacheio") / "step.mlpackage",
                         output_names=["logits", "k_out", "v_out"])
    return module, path, load_model(path, backend="mil")


def test_cache_io_decoder_shapes_follow_type_inference(cache_io_decoder):
    """Every op output has the shape coremltools infers for it (rank-0 values included)."""
    from coremltools.converters.mil.mil import types

    from cohere_coreml.runtime.package import load_mil_function, read_package

    _, path, model = cache_io_decoder
    function = load_mil_function(read_package(path))
    inferred = {v.name: tuple(v.shape) for op in function.operations for v in op.outputs
                if types.is_tensor(v.sym_type) or types.is_scalar(v.sym_type)}
    shape = model.input_description["x2"][0]
    feeds = {"x0": np.array([[4]], np.int32), "x1": np.array([3], np.int32),
             "x2": np.ones(shape, np.float32), "x3": np.ones(shape, np.float32)}
    values = model.intermediates(feeds)
    scalars = [name for name, s in inferred.items() if s == () and name in values]
    assert scalars  # the position is rank-0 in this program
    for name, value in values.items():
        assert value.shape == inferred[name], (name, value.shape, inferred[name])


def test_cache_io_decoder_steps_match_torch(cache_io_decoder):
    module, _, model = cache_io_decoder
    assert {"concat", "gather", "slice_update"} <= {s.op_type for s in model._steps}
    shape = model.input_description["x2"][0]
    tokens = torch.randint(0, V, (STEPS,), generator=torch.Generator().manual_seed(3)).tolist()
    k_ref = v_ref = torch.zeros(shape)
    k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for step, token in enumerate(tokens):
        out = model.predict({"x0": np.array([[token]], np.int32), "x1": np.array([step], np.int32), "x2": k, "x3": v})
        with torch.no_grad():
            logits, k_ref, v_ref = module(torch.tensor([[token]], dtype=torch.int32),
                                          torch.tensor([step], dtype=torch.int32), k_ref, v_ref)
        k, v = out["k_out"], out["v_out"]  # the interpreter's caches feed its next step
        assert not k[:, :, :, step + 1:].any() and k[:, :, :, step].any()  # row `step` written, later rows untouched
        for name, got, ref in (("logits", out["logits"], logits), ("k", k, k_ref), ("v", v, v_ref)):
            assert got.shape == tuple(ref.shape)
            err = max_rel_err(got, ref.numpy())
            print(f"cache-io decoder step {step} {name}: max rel err {err:.2e}")
            assert err <= 1e-4, (step, name, err)
