"""Decoder step: PyTorch wrapper vs transformers, exported programs through the MIL interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cohere_coreml.decoder import (
    NEGATIVE_CONTROLS,
    DecoderExportError,
    DecoderStep,
    TorchStepRuntime,
    build_step_mlmodel,
    convert_decoder,
    count_macs,
    negative_controls,
    run_teacher_forcing,
    teacher_forcing_case,
    teacher_forcing_report,
)
from cohere_coreml.reference import cross_memory
from cohere_coreml.shapes import ShapeError, cache_capacity

from .helpers import GQA, tiny_model

torch.set_num_threads(1)

# (name, make_tiny_checkpoint overrides): grouped kv heads, encoder width != decoder width, 1 head
SHAPES = {
    "gqa_wide_encoder": GQA,
    "mha_3_layers": dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, encoder_hidden_size=64),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, encoder_hidden_size=32, encoder_num_attention_heads=2),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    """A random tiny checkpoint of each shape, made sensitive to its cross memory (`sensitize`)."""
    model, processor = tiny_model(tmp_path_factory.mktemp("dec") / request.param, seed=1, sensitive=True,
                                  **SHAPES[request.param])
    return request.param, model, processor


def _prompt(processor, lang="en", punctuation=True):
    from cohere_coreml.tokens import prompt_ids

    return prompt_ids(processor.tokenizer, lang, punctuation)


def test_default_capacity_and_limits(tiny_reference):
    assert cache_capacity() == 288  # round_up(10 + 256, 32)
    assert cache_capacity(100) == 128
    assert cache_capacity(22) == 32
    model, _ = tiny_reference
    with pytest.raises(ShapeError, match="position table"):
        DecoderStep(model, capacity=model.config.max_position_embeddings + 32, memory_len=32)
    with pytest.raises(ShapeError):
        cache_capacity(0)


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
        memory = cross_memory(model, enc.last_hidden_state, int(enc.attention_mask.sum()), 32)
        ck, cv, cm = (torch.from_numpy(memory[k]) for k in ("cross_k", "cross_v", "cross_mask"))
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


@pytest.mark.parametrize("reference,precision", [
    pytest.param("gqa_wide_encoder", "fp32"),
    pytest.param("mha_3_layers", "fp32"),
    pytest.param("mqa", "fp32"),
    pytest.param("gqa_wide_encoder", "fp16"),  # fp16 on one shape (CPU budget)
], indirect=["reference"])
def test_export_parity_gate(reference, tmp_path, precision):
    """convert_decoder writes a stateful package that passes its teacher-forcing gate (interpreter),
    and the gate case could have refused a broken package (negative controls)."""
    from cohere_coreml.bundle import package_io
    from cohere_coreml.convert import ExportSettings

    name, model, processor = reference
    cfg = model.config
    settings = ExportSettings(out_dir=tmp_path, precision=precision, model_id=name)
    result = convert_decoder(model, settings, capacity=64, memory_len=32, prompt=_prompt(processor),
                             control_prompt=_prompt(processor, "de", punctuation=False))
    parity = result["parity"]
    assert parity["passed"], parity
    assert set(parity["controls"]) == set(NEGATIVE_CONTROLS)
    if precision == "fp32":  # sensitised weights: every break lands far below 60 dB (measured 30-41 dB)
        assert parity["discriminates"], parity["controls"]
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
    assert [p.name for p in tmp_path.iterdir()] == ["decoder.parity-failed.json"], "only the refused gate's figures"


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


# --- negative controls: the gate must refuse broken packages, and say when it cannot -----------


class ZeroMemoryStep(DecoderStep):
    """Broken: the cross memory never reaches the step."""

    def forward(self, input_ids, position, cross_k, cross_v, cross_mask):
        return super().forward(input_ids, position, torch.zeros_like(cross_k), torch.zeros_like(cross_v), cross_mask)


class SwappedKVStep(DecoderStep):
    """Broken: cross K and V wired the wrong way round."""

    def forward(self, input_ids, position, cross_k, cross_v, cross_mask):
        return super().forward(input_ids, position, cross_v, cross_k, cross_mask)


class PermutedLayersStep(DecoderStep):
    """Broken: layer i attends to the cross K/V of layer L-1-i."""

    def forward(self, input_ids, position, cross_k, cross_v, cross_mask):
        return super().forward(input_ids, position, cross_k.flip(0), cross_v.flip(0), cross_mask)


def wrong_prompt_step(control_prompt):
    """Broken: the prompt slots read other prompt ids (e.g. a hard-coded language)."""

    class WrongPromptStep(DecoderStep):
        def forward(self, input_ids, position, cross_k, cross_v, cross_mask):
            table = torch.tensor(control_prompt, dtype=torch.int32)
            slot = position.clamp(max=len(control_prompt) - 1)
            ids = torch.where(position < len(control_prompt), table[slot], input_ids.view(-1)).view(1, 1)
            return super().forward(ids, position, cross_k, cross_v, cross_mask)

    return WrongPromptStep


BROKEN_STEPS = {"zero_memory": lambda cp: ZeroMemoryStep, "swapped_kv": lambda cp: SwappedKVStep,
                "permuted_layers": lambda cp: PermutedLayersStep, "wrong_prompt": wrong_prompt_step}


@pytest.fixture(scope="module")
def trained_case(trained_reference):
    """Gate case of the trained default model (its outputs depend on memory and prompt)."""
    model, processor = trained_reference
    case = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=12)
    return model, processor, case


def test_trained_model_gate_case_is_sensitive(trained_case):
    """Sensitivity first: every negative control moves the reference far below the fp32 and fp16
    floors; a correct step passes."""
    model, processor, case = trained_case
    good = teacher_forcing_report(case, run_teacher_forcing(TorchStepRuntime(DecoderStep(model, 32, 64)), case),
                                  "fp32")
    assert good["passed"] and good["worst_psnr_db"] > 80, good["worst_psnr_db"]
    for precision in ("fp32", "fp16"):
        controls = negative_controls(model, case, precision, control_prompt=_prompt(processor, "de", False))
        for name in NEGATIVE_CONTROLS:
            c = controls[name]
            assert c["applicable"] and c["discriminates"], (precision, name, c)
            assert c["worst_psnr_db"] < 20 and c["argmax_agree"] < c["argmax_steps"], (name, c)


@pytest.mark.parametrize("broken", list(BROKEN_STEPS))
def test_gate_refuses_broken_steps(trained_case, broken):
    """Each defect class, built as a step module, fails the gate's report on the trained model."""
    model, processor, case = trained_case
    cls = BROKEN_STEPS[broken](_prompt(processor, "de", False))
    report = teacher_forcing_report(case, run_teacher_forcing(TorchStepRuntime(cls(model, 32, 64)), case), "fp32")
    assert not report["passed"]
    assert report["worst_psnr_db"] < 60 and report["mean_kl"] > 1e-4


def test_gate_refuses_a_packaged_zero_memory_step(trained_reference, tmp_path, monkeypatch):
    """The same break through the real export path (trace, convert, interpreter): refused, no
    package written, only the refusal's figures (decoder.parity-failed.json)."""
    import cohere_coreml.decoder as decoder_module
    from cohere_coreml.convert import ExportSettings, ParityError

    model, processor = trained_reference
    original = decoder_module.trace_decoder_step
    monkeypatch.setattr(decoder_module, "trace_decoder_step",
                        lambda step: original(ZeroMemoryStep(model, step.shapes.capacity, step.shapes.memory_len)))
    settings = ExportSettings(out_dir=tmp_path, precision="fp32")
    with pytest.raises(ParityError, match="teacher forcing"):
        convert_decoder(model, settings, capacity=32, memory_len=64, prompt=_prompt(processor))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder.parity-failed.json"]
    failed = json.loads((tmp_path / "decoder.parity-failed.json").read_text())
    assert failed["passed"] is False and failed["component"] == "decoder"


def test_gate_warns_when_the_case_cannot_discriminate(tiny_reference, caplog):
    """Random weights (the unscaled tiny checkpoint): zero memory, swapped K/V and permuted layers
    score ~80 dB with every argmax right, so the gate could not refuse them. The report says so
    and a warning names each one."""
    model, processor = tiny_reference
    case = teacher_forcing_case(model, 32, _prompt(processor), new_tokens=6)
    with caplog.at_level("WARNING", logger="cohere_coreml.decoder"):
        controls = negative_controls(model, case, "fp32", control_prompt=_prompt(processor, "de", False))
    blind = [name for name, c in controls.items() if c["applicable"] and not c["discriminates"]]
    assert {"zero_memory", "swapped_kv"} <= set(blind), controls
    for name in blind:
        assert controls[name]["worst_psnr_db"] >= 60
        assert f"a package with {name.replace('_', ' ')} would pass" in caplog.text
    # one layer: nothing to permute, the control is recorded as not applicable
    import dataclasses

    from cohere_coreml.decoder import control_case

    single = dataclasses.replace(case, cross_k=case.cross_k[:1], cross_v=case.cross_v[:1])
    assert control_case(single, "permuted_layers") is None
