"""A stateful toy decoder (KV cache in Core ML state, written with slice_update) vs eager torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.export.parity import psnr
from cohere_coreml.runtime import InputValidationError, load_model

D, L, STEPS = 16, 8, 8


class _ToyDecoder(torch.nn.Module):
    """One attention layer: the new key/value go to cache[:, p:p+1]; attends to positions <= p."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)
        self.v = torch.nn.Linear(D, D)
        self.o = torch.nn.Linear(D, D)
        self.register_buffer("k_cache", torch.zeros(1, L, D, dtype=torch.float16))
        self.register_buffer("v_cache", torch.zeros(1, L, D, dtype=torch.float16))

    def forward(self, x, pos):  # x (1, 1, D) fp32, pos (1,) int32
        q, k, v = self.q(x), self.k(x), self.v(x)
        p = pos[0]
        self.k_cache[:, p : p + 1] = k.half()
        self.v_cache[:, p : p + 1] = v.half()
        keys = self.k_cache.float()  # (1, L, D)
        values = self.v_cache.float()
        scores = q @ keys.transpose(1, 2) / D**0.5  # (1, 1, L)
        visible = torch.arange(L)[None, None, :] <= p
        scores = torch.where(visible, scores, torch.full_like(scores, -1e4))
        attn = torch.softmax(scores, dim=-1)
        return self.o(attn @ values), torch.log_softmax(scores, dim=-1)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    import coremltools as ct

    torch.manual_seed(0)
    module = _ToyDecoder().eval()
    with torch.no_grad():  # fp16-representable weights: the package stores them in fp16
        for p in module.parameters():
            p.copy_(p.half().float())
    x = torch.randn(1, 1, D).half().float()
    pos = torch.tensor([0], dtype=torch.int32)
    with torch.no_grad():
        traced = torch.jit.trace(module, (x, pos))
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=(1, L, D), dtype=np.float16), name=n)
        for n in ("k_cache", "v_cache")
    ]
    ml = ct.convert(
        traced,
        inputs=[ct.TensorType("x", shape=(1, 1, D), dtype=np.float16),
                ct.TensorType("pos", shape=(1,), dtype=np.int32)],
        outputs=[ct.TensorType("y"), ct.TensorType("logp")],
        states=states,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    path = tmp_path_factory.mktemp("toy") / "toy.mlpackage"
    ml.save(str(path))
    module.k_cache.zero_()
    module.v_cache.zero_()
    return module, path


def test_toy_decoder_8_steps_matches_eager(toy):
    module, path = toy
    model = load_model(path, backend="mil")
    assert set(model.state_description) == {"k_cache", "v_cache"}
    assert model.state_description["k_cache"] == ((1, L, D), np.float16)
    ops = {s.op_type for s in model._steps}
    assert {"read_state", "slice_update", "coreml_update_state"} <= ops

    state = model.make_state()
    assert not state.read_state("k_cache").any()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 1, D, generator=gen).half().float() for _ in range(STEPS)]
    module.k_cache.zero_()
    module.v_cache.zero_()
    first = None
    for step, x in enumerate(xs):
        with torch.no_grad():
            ref_y, ref_logp = module(x, torch.tensor([step], dtype=torch.int32))
        out = model.predict({"x": x.numpy(), "pos": np.array([step], dtype=np.int32)}, state=state)
        if step == 0:
            first = out
        for name in ("k_cache", "v_cache"):
            got = state.read_state(name).astype(np.float32)
            want = getattr(module, name).float().numpy()
            # rows not written yet are exactly zero; written rows equal within one fp16 ulp
            assert not got[:, step + 1 :].any()
            np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-24)
        assert psnr(ref_y.numpy(), out["y"]) > 50
        # log-softmax: -1e4 at masked positions in both, visible ones within fp16 rounding
        np.testing.assert_allclose(out["logp"][..., : step + 1], ref_logp.numpy()[..., : step + 1], atol=2e-2)

    # a fresh state starts from zeros: step 0 reproduces step 0 of the first sequence
    fresh = model.make_state()
    assert not fresh.read_state("v_cache").any()
    again = model.predict({"x": xs[0].numpy(), "pos": np.array([0], dtype=np.int32)}, state=fresh)
    np.testing.assert_array_equal(again["y"], first["y"])
    assert not fresh.read_state("k_cache")[:, 1:].any()


def test_stateful_model_requires_state(toy):
    _, path = toy
    model = load_model(path, backend="mil")
    with pytest.raises(InputValidationError, match="stateful"):
        model.predict({"x": np.zeros((1, 1, D), np.float16), "pos": np.array([0], np.int32)})
