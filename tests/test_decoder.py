"""Decoder step: PyTorch wrapper vs transformers, exported programs through the MIL interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.decoder import (
    DecoderExportError,
    DecoderStep,
    build_step_mlmodel,
    convert_decoder,
    count_macs,
    cross_memory_from_model,
    default_capacity,
    run_teacher_forcing,
    teacher_forcing_case,
    teacher_forcing_report,
)

torch.set_num_threads(1)

# (name, make_tiny_checkpoint overrides): grouped kv heads, encoder width != decoder width, 1 head
SHAPES = {
    "gqa_wide_encoder": dict(num_key_value_heads=2, encoder_hidden_size=48, encoder_num_attention_heads=4),
    "mha_3_layers": dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, encoder_hidden_size=64),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, encoder_hidden_size=32, encoder_num_attention_heads=2),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    from cohere_coreml.checkpoint import load_reference, make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("dec") / request.param, seed=1, **SHAPES[request.param])
    model, processor = load_reference(path)
    return request.param, model, processor


def _prompt(processor, lang="en"):
    from cohere_coreml.tokens import prompt_ids

    return prompt_ids(processor.tokenizer, lang)


class TorchStepRuntime:
    """The PyTorch DecoderStep behind the runtime interface (make_state / predict)."""

    backend = "torch"

    def __init__(self, step):
        self.step = step

    def make_state(self):
        self.step.reset()
        return self.step

    def predict(self, inputs, state=None):
        args = [torch.from_numpy(np.asarray(inputs[k])) for k in ("input_ids", "position", "cross_k", "cross_v",
                                                                   "cross_mask")]
        with torch.no_grad():
            return {"log_probs": self.step(*args).numpy()}


def test_default_capacity_and_limits(tiny_reference):
    assert default_capacity() == 288  # round_up(10 + 256, 32)
    assert default_capacity(100) == 128
    assert default_capacity(22) == 32
    model, _ = tiny_reference
    with pytest.raises(DecoderExportError, match="position table"):
        DecoderStep(model, capacity=model.config.max_position_embeddings + 32, memory_len=32)
    with pytest.raises(DecoderExportError):
        default_capacity(0)


def test_pytorch_step_matches_generate(reference):
    """The static-cache wrapper (fp16 cache) greedy-decodes exactly like generate()."""
    name, model, processor = reference
    for seed, lang in ((0, "en"), (1, "ja"), (2, "de")):
        g = torch.Generator().manual_seed(seed)
        frames = 160 + 40 * seed
        feats = torch.randn(1, frames, model.config.encoder_config.num_mel_bins, generator=g)
        mask = torch.zeros(1, frames, dtype=torch.long)
        mask[:, : frames - 30] = 1
        prompt = _prompt(processor, lang)
        with torch.no_grad():
            ref = model.generate(input_features=feats, attention_mask=mask, decoder_input_ids=torch.tensor([prompt]),
                                 max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
            enc = model.model.encoder(feats, attention_mask=mask)
        ck, cv, cm = cross_memory_from_model(model, enc.last_hidden_state, 32, int(enc.attention_mask.sum()))
        rt = TorchStepRuntime(DecoderStep(model, capacity=32, memory_len=32).eval())
        state = rt.make_state()
        ids = []
        lp = None
        for pos, tok in enumerate(prompt):
            lp = rt.predict({"input_ids": np.array([[tok]], np.int32), "position": np.array([pos], np.int32),
                             "cross_k": ck.numpy(), "cross_v": cv.numpy(), "cross_mask": cm.numpy()}, state)["log_probs"]
        pos = len(prompt)
        while len(ids) < 12:
            ids.append(int(lp.argmax()))
            if ids[-1] == model.config.eos_token_id or len(ids) == 12:
                break
            lp = rt.predict({"input_ids": np.array([[ids[-1]]], np.int32), "position": np.array([pos], np.int32),
                             "cross_k": ck.numpy(), "cross_v": cv.numpy(), "cross_mask": cm.numpy()}, state)["log_probs"]
            pos += 1
        assert ids == ref, f"{name} seed {seed}"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_export_parity_gate(reference, tmp_path, precision):
    """convert_decoder writes a stateful package that passes its teacher-forcing gate (interpreter)."""
    from cohere_coreml.bundle import package_io
    from cohere_coreml.convert import ExportSettings

    name, model, processor = reference
    if precision == "fp16" and name != "gqa_wide_encoder":
        pytest.skip("fp16 checked on one shape (CPU budget)")
    cfg = model.config
    settings = ExportSettings(out_dir=tmp_path, precision=precision, model_id=name)
    result = convert_decoder(model, settings, capacity=64, memory_len=32, prompt=_prompt(processor))
    parity = result["parity"]
    assert parity["passed"], parity
    assert parity["argmax_agree"] == parity["argmax_steps"] == parity["steps"] - 9 >= 2
    assert parity["worst_psnr_db"] >= (60 if precision == "fp32" else 35)
    assert parity["mean_kl"] < (1e-4 if precision == "fp32" else 5e-3)
    io = package_io(tmp_path / "decoder.mlpackage")
    cache = [cfg.num_hidden_layers, cfg.num_key_value_heads, 64, cfg.head_dim]
    assert io["states"] == {"self_k": {"shape": cache, "dtype": "float16"},
                            "self_v": {"shape": cache, "dtype": "float16"}}
    assert io["inputs"]["input_ids"] == {"shape": [1, 1], "dtype": "int32"}
    assert io["inputs"]["position"] == {"shape": [1], "dtype": "int32"}
    assert io["inputs"]["cross_k"]["shape"] == [cfg.num_hidden_layers, cfg.num_key_value_heads, 32, cfg.head_dim]
    assert io["inputs"]["cross_mask"]["shape"] == [1, 1, 1, 32]
    assert io["outputs"]["log_probs"]["shape"] == [1, cfg.vocab_size]
    assert (tmp_path / "decoder.parity.json").is_file()


def test_program_structure_and_cost(tiny_reference):
    """Slice-update cache writes, no -inf constants, no encoder-memory projection in the step."""
    model, _ = tiny_reference
    cfg = model.config
    costs = {}
    for tp in (32, 96):
        mlmodel, shapes = build_step_mlmodel(model, capacity=32, memory_len=tp, precision="fp16")
        prog = mlmodel._mil_program
        ops = list(prog.functions["main"].operations)
        types = [op.op_type for op in ops]
        assert types.count("slice_update") == 2 * cfg.num_hidden_layers
        assert types.count("coreml_update_state") == 2 * cfg.num_hidden_layers
        for op in ops:
            if op.op_type == "const" and op.outputs[0].val is not None:
                val = np.asarray(op.outputs[0].val)
                if val.dtype.kind == "f":
                    assert np.all(np.isfinite(val)), f"non-finite constant {op.name}"
        costs[tp] = count_macs(prog)
    # only the cross-attention score/value matmuls grow with the memory: H * 2 * Dh per frame per layer
    assert costs[96]["by_type"]["linear"] == costs[32]["by_type"]["linear"]
    growth = costs[96]["by_type"]["matmul"] - costs[32]["by_type"]["matmul"]
    assert growth == cfg.num_hidden_layers * cfg.num_attention_heads * 2 * cfg.head_dim * (96 - 32)


def test_recompute_variant_costs_more(tiny_reference):
    """Control for the MAC counter: recomputing cross K/V from the memory is counted as linear work."""
    model, _ = tiny_reference
    cfg = model.config
    ours, _ = build_step_mlmodel(model, 32, 64, precision="fp32")
    theirs, _ = build_step_mlmodel(model, 32, 64, precision="fp32", recompute_cross_kv=True)
    extra = count_macs(theirs._mil_program)["by_type"]["linear"] - count_macs(ours._mil_program)["by_type"]["linear"]
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    assert extra == cfg.num_hidden_layers * 2 * 64 * cfg.hidden_size * kv_width


def test_gate_detects_wrong_memory_masking(tiny_reference):
    """The teacher-forcing report fails when the package sees a different cross memory."""
    model, processor = tiny_reference
    case = teacher_forcing_case(model, 32, _prompt(processor), new_tokens=6)
    rt = TorchStepRuntime(DecoderStep(model, capacity=32, memory_len=32).eval())
    good = teacher_forcing_report(case, run_teacher_forcing(rt, case), "fp32")
    assert good["passed"], good
    assert (case.cross_mask < 0).any(), "the gate case must have a padded tail"
    bad_case = teacher_forcing_case(model, 32, _prompt(processor), new_tokens=6)
    bad_case.cross_k = bad_case.cross_k.copy()
    tail = case.cross_mask[0, 0, 0] < 0
    bad_case.cross_k[:, :, tail] = 50.0  # garbage in the padded tail ...
    bad_case.cross_v = bad_case.cross_v.copy()
    bad_case.cross_v[:, :, tail] = 50.0
    bad_case.cross_mask = np.zeros_like(bad_case.cross_mask)  # ... that the mask no longer hides
    bad = teacher_forcing_report(bad_case, run_teacher_forcing(rt, bad_case), "fp32")
    assert not bad["passed"]
    assert bad["worst_psnr_db"] < good["worst_psnr_db"]


def test_gate_refuses_a_step_that_ignores_the_memory_mask(tiny_reference, tmp_path, monkeypatch):
    """A real defect class (cross mask dropped) fails the export gate and leaves no package."""
    import cohere_coreml.decoder as decoder_module
    from cohere_coreml.convert import ExportSettings, ParityError

    class MaskDroppingStep(DecoderStep):
        def forward(self, input_ids, position, cross_k, cross_v, cross_mask):
            return super().forward(input_ids, position, cross_k, cross_v, torch.zeros_like(cross_mask))

    model, processor = tiny_reference
    original = decoder_module.trace_decoder_step

    def broken_trace(step):
        return original(MaskDroppingStep(model, step.shapes.capacity, step.shapes.memory_len))

    monkeypatch.setattr(decoder_module, "trace_decoder_step", broken_trace)
    settings = ExportSettings(out_dir=tmp_path, precision="fp32")
    with pytest.raises(ParityError, match="teacher forcing"):
        convert_decoder(model, settings, capacity=32, memory_len=32, prompt=_prompt(processor))
    assert not any(tmp_path.iterdir()), "nothing may be left behind by a failed gate"


def test_fp16_program_keeps_small_log_probs(tiny_reference, tmp_path):
    """Peaked distributions (log-probs down to -40): the fp16 program must not floor them at log(1e-45).

    coremltools lowers torch.log_softmax to log(softmax(x)), which underflows in fp16; the step uses
    an explicit max-shifted form instead.
    """
    import copy

    from cohere_coreml.convert import psnr
    from cohere_coreml.runtime import load_model

    model, processor = tiny_reference
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.proj_out.bias.copy_(torch.linspace(0.0, -40.0, peaked.config.vocab_size))
    mlmodel, shapes = build_step_mlmodel(peaked, capacity=32, memory_len=32, precision="fp16")
    mlmodel.save(str(tmp_path / "step.mlpackage"))
    rt = load_model(str(tmp_path / "step.mlpackage"), backend="mil")
    case = teacher_forcing_case(peaked, 32, _prompt(processor), new_tokens=3)
    produced = run_teacher_forcing(rt, case)
    assert case.log_probs.min() < -35
    assert np.all(np.isfinite(produced))
    assert abs(produced.min() - case.log_probs.min()) < 0.1
    assert min(psnr(case.log_probs[i], produced[i]) for i in range(len(case.ids))) > 35
