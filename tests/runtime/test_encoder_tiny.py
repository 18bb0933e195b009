"""A tiny transformers CohereAsr (parakeet) encoder through the MIL interpreter vs eager torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.export.parity import psnr
from cohere_coreml.runtime import load_model

from .helpers import convert_torch, max_rel_err


class _Encoder(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, features, length):  # features (1, T, n_mels), length (1,)
        frames = features.shape[1]
        mask = torch.arange(frames)[None, :] < length[:, None]
        return self.encoder(features, attention_mask=mask).last_hidden_state


@pytest.fixture(scope="module")
def tiny_encoder():
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    torch.manual_seed(0)
    cfg = CohereAsrConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32,
        encoder_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, subsampling_conv_channels=8, num_mel_bins=16),
    )
    model = CohereAsrForConditionalGeneration(cfg).eval()
    # non-trivial batch-norm statistics (they are folded into the conv by the converter)
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm1d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
    return _Encoder(model.model.encoder).eval()


@pytest.mark.parametrize("length", [96, 80])
def test_encoder_fp32_matches_torch(tiny_encoder, tmp_path, length):
    x = torch.randn(1, 96, 16)
    n = torch.tensor([length], dtype=torch.int32)
    path = convert_torch(tiny_encoder, [x, n], tmp_path / "enc.mlpackage", precision="fp32")
    model = load_model(path, backend="mil")
    with torch.no_grad():
        ref = tiny_encoder(x, n).numpy()
    y = model.predict({"x0": x.numpy(), "x1": n.numpy()})
    (out,) = y.values()
    assert out.shape == ref.shape
    assert max_rel_err(out, ref) <= 1e-4


def test_encoder_fp16_within_rounding(tiny_encoder, tmp_path):
    # No padding: with padding, transformers' finfo(float32).min mask becomes -inf in fp16 and the
    # fully masked query rows give NaN (a property of the model, reproduced by the interpreter).
    x = torch.randn(1, 96, 16)
    n = torch.tensor([96], dtype=torch.int32)
    path = convert_torch(tiny_encoder, [x, n], tmp_path / "enc16.mlpackage", precision="fp16")
    model = load_model(path, backend="mil")
    with torch.no_grad():
        ref = tiny_encoder(x.half().float(), n).numpy()
    (out,) = model.predict({"x0": x.numpy(), "x1": n.numpy()}).values()
    assert np.isfinite(out).all()
    assert psnr(ref, out) > 50
