"""Torch-module op zoo: small modules through coremltools' torch frontend, interpreter vs torch.

One module with many outputs, converted once at FP32 and once at FP16 precision. FP32: max
error / max |torch| <= 1e-4 per output. FP16: the whole chain runs in fp16 in the package, so
errors accumulate over a few ops: PSNR per output is printed (``pytest -s``) and must exceed
40 dB.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cohere_coreml.parity import psnr
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
