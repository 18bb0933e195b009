"""Decoder step: PyTorch wrapper vs transformers, exported programs through the MIL interpreter."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from cohere_coreml.decoder import (
    NEGATIVE_CONTROLS,
    DecoderBind,
    DecoderExportError,
    DecoderStep,
    StatefulDecoder,
    TorchDecoder,
    build_step_mlmodel,
    convert_decoder,
    count_macs,
    negative_controls,
    run_teacher_forcing,
    teacher_forcing_case,
    teacher_forcing_gate,
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
        rt = TorchDecoder(StatefulDecoder(model, capacity=32, memory_len=32))
        state = rt.new_state(memory)  # bind_memory: the cross memory into the state, once
        ids = []
        lp = None
        for pos, tok in enumerate(prompt):
            lp = rt.step(state, tok, pos)
        pos = len(prompt)
        while len(ids) < 12:
            ids.append(int(lp.argmax()))
            if ids[-1] == model.config.eos_token_id or len(ids) == 12:
                break
            lp = rt.step(state, ids[-1], pos)
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
    assert parity["memory"]["passed"], parity["memory"]
    package = tmp_path / "decoder.mlpackage"
    io = package_io(package)
    cache = [cfg.num_hidden_layers, cfg.num_key_value_heads, 64, cfg.head_dim]
    mem = [cfg.num_hidden_layers, cfg.num_key_value_heads, 32, cfg.head_dim]
    states = {"self_k": {"shape": cache, "dtype": "float16"}, "self_v": {"shape": cache, "dtype": "float16"},
              "cross_k": {"shape": mem, "dtype": "float16"}, "cross_v": {"shape": mem, "dtype": "float16"},
              "cross_mask": {"shape": [1, 1, 1, 32], "dtype": "float16"}}
    assert io["states"] == states
    # the step binds only O(1) inputs: no cross memory, nothing of the encoder's length
    assert io["inputs"] == {"input_ids": {"shape": [1, 1], "dtype": "int32"},
                            "position": {"shape": [1], "dtype": "int32"}}
    assert io["outputs"]["log_probs"]["shape"] == [1, cfg.vocab_size]
    bind = package_io(package, "bind_memory")
    program = "float16" if precision == "fp16" else "float32"  # as the encoder package outputs it
    assert bind["inputs"] == {"encoder_cross_k": {"shape": mem, "dtype": program},
                              "encoder_cross_v": {"shape": mem, "dtype": program},
                              "encoder_cross_mask": {"shape": [1, 1, 1, 32], "dtype": program}}
    assert bind["outputs"] == {"memory_length": {"shape": [1], "dtype": "int32"}}
    assert bind["states"] == states
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
        assert types.count("coreml_update_state") == 2 * cfg.num_hidden_layers  # the step writes only self_k/v
        assert set(prog.functions["main"].inputs) == {"input_ids", "position", "self_k", "self_v", "cross_k",
                                                      "cross_v", "cross_mask"}
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
    rt = TorchDecoder(StatefulDecoder(model, capacity=32, memory_len=32))
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

    class MaskDroppingBind(DecoderBind):
        def bind_memory(self, cross_k, cross_v, cross_mask):
            return super().bind_memory(cross_k, cross_v, torch.zeros_like(cross_mask))

    model, processor = tiny_reference
    original = decoder_module.trace_decoder_bind

    def broken_trace(bind):
        return original(MaskDroppingBind(model, bind.shapes.capacity, bind.shapes.memory_len))

    monkeypatch.setattr(decoder_module, "trace_decoder_bind", broken_trace)
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

    from cohere_coreml.convert import ExportSettings, psnr
    from cohere_coreml.decoder_runtime import DecoderRuntime

    model, processor = tiny_reference
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.proj_out.bias.copy_(torch.linspace(0.0, -40.0, peaked.config.vocab_size))
    settings = ExportSettings(out_dir=tmp_path, precision="fp16", skip_verify=True)
    result = convert_decoder(peaked, settings, capacity=32, memory_len=32, prompt=_prompt(processor))
    rt = DecoderRuntime.load(result["path"], backend="mil")
    case = teacher_forcing_case(peaked, 32, _prompt(processor), new_tokens=3)
    produced = run_teacher_forcing(rt, case)
    assert case.log_probs.min() < -35
    assert np.all(np.isfinite(produced))
    assert abs(produced.min() - case.log_probs.min()) < 0.1
    assert min(psnr(case.log_probs[i], produced[i]) for i in range(len(case.ids))) > 35


# --- negative controls: the gate must refuse broken packages, and say when it cannot -----------


class ZeroMemoryBind(DecoderBind):
    """Broken: the cross memory never reaches the state (e.g. a state write the tracer dropped)."""

    def bind_memory(self, cross_k, cross_v, cross_mask):
        return super().bind_memory(torch.zeros_like(cross_k), torch.zeros_like(cross_v), cross_mask)


class SwappedKVBind(DecoderBind):
    """Broken: cross K and V wired the wrong way round."""

    def bind_memory(self, cross_k, cross_v, cross_mask):
        return super().bind_memory(cross_v, cross_k, cross_mask)


class PermutedLayersBind(DecoderBind):
    """Broken: layer i attends to the cross K/V of layer L-1-i."""

    def bind_memory(self, cross_k, cross_v, cross_mask):
        return super().bind_memory(cross_k.flip(0), cross_v.flip(0), cross_mask)


def wrong_prompt_step(control_prompt):
    """Broken: the prompt slots read other prompt ids (e.g. a hard-coded language)."""

    class WrongPromptStep(DecoderStep):
        def run_tokens(self, input_ids, positions, *args, **kwargs):
            table = torch.tensor(control_prompt, dtype=torch.int32)
            slot = positions.clamp(max=len(control_prompt) - 1)
            ids = torch.where(positions < len(control_prompt), table[slot], input_ids.view(-1)).view(1, -1)
            return super().run_tokens(ids, positions, *args, **kwargs)

    return WrongPromptStep


# each defect as a module of the package: the three memory defects in bind_memory, the prompt one in the step
BROKEN_MODULES = {"zero_memory": lambda cp: ZeroMemoryBind, "swapped_kv": lambda cp: SwappedKVBind,
                  "permuted_layers": lambda cp: PermutedLayersBind, "wrong_prompt": wrong_prompt_step}


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
    good = teacher_forcing_report(case, run_teacher_forcing(TorchDecoder(StatefulDecoder(model, 32, 64)), case),
                                  "fp32")
    assert good["passed"] and good["worst_psnr_db"] > 80, good["worst_psnr_db"]
    for precision in ("fp32", "fp16"):
        controls = negative_controls(model, case, precision, control_prompt=_prompt(processor, "de", False))
        for name in NEGATIVE_CONTROLS:
            c = controls[name]
            assert c["applicable"] and c["discriminates"], (precision, name, c)
            assert c["worst_psnr_db"] < 20 and c["argmax_agree"] < c["argmax_steps"], (name, c)
            # the near-tie rule tolerates flips the step's own error explains: a broken package's error is
            # large, so its refusal comes from PSNR / KL, which the rule never relaxes
            assert c["near_tie_flips"] + c["decisive_flips"] == c["argmax_steps"] - c["argmax_agree"], (name, c)


@pytest.mark.parametrize("broken", list(BROKEN_MODULES))
def test_gate_refuses_broken_modules(trained_case, broken):
    """Each defect class, built as a module (bind_memory or step), fails the gate's report on the
    trained model."""
    model, processor, case = trained_case
    cls = BROKEN_MODULES[broken](_prompt(processor, "de", False))
    report = teacher_forcing_report(case, run_teacher_forcing(TorchDecoder(cls(model, 32, 64)), case), "fp32")
    assert not report["passed"]
    assert report["worst_psnr_db"] < 60 and report["mean_kl"] > 1e-4


def test_gate_refuses_a_packaged_zero_memory_bind(trained_reference, tmp_path, monkeypatch):
    """The same break through the real export path (trace, convert, interpreter): refused, no
    package written, only the refusal's figures (decoder.parity-failed.json)."""
    import cohere_coreml.decoder as decoder_module
    from cohere_coreml.convert import ExportSettings, ParityError

    model, processor = trained_reference
    original = decoder_module.trace_decoder_bind
    monkeypatch.setattr(decoder_module, "trace_decoder_bind",
                        lambda bind: original(ZeroMemoryBind(model, bind.shapes.capacity, bind.shapes.memory_len)))
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


# --- the cross memory lives in the state: bind_memory once per window ------------------------------


@pytest.fixture(scope="module")
def trained_package(trained_reference, tmp_path_factory):
    """fp16 decoder package of the trained model (C 32, Tp 64, with prefill), gate skipped: the tests
    below check the state themselves."""
    from cohere_coreml.convert import ExportSettings

    model, processor = trained_reference
    out = tmp_path_factory.mktemp("bound")
    settings = ExportSettings(out_dir=out, precision="fp16", skip_verify=True)
    return convert_decoder(model, settings, capacity=32, memory_len=64, prompt=_prompt(processor), prefill=True)["path"]


def test_bind_memory_writes_the_state(trained_reference, trained_package):
    """After bind_memory the state holds exactly the encoder outputs (fp16-rounded), the self cache
    left by a previous window is zero, and memory_length counts the valid frames; the program
    writes every state with coreml_update_state."""
    from cohere_coreml.decoder_runtime import DecoderRuntime, DecoderRuntimeError
    from cohere_coreml.quantize import load_function

    model, processor = trained_reference
    decoder = DecoderRuntime.load(trained_package, backend="mil")
    case = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=2, seed=3)
    state = decoder.make_state()
    for name in ("self_k", "self_v"):
        shape, dtype = decoder.state_description[name]
        state.write_state(name, np.full(shape, 7.0, dtype=dtype))
    bound = decoder.bind(state, case.memory)
    assert bound == int((case.cross_mask == 0).sum()) < 64
    for name, value in case.memory.items():
        got = state.read_state(name)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, value.astype(np.float16), err_msg=name)
    assert not state.read_state("self_k").any() and not state.read_state("self_v").any()
    assert (case.cross_k[:, :, bound:] != 0).any(), "the case's padded tail must hold garbage the state keeps"
    ops = [op for op in load_function(trained_package, "bind_memory").operations if op.op_type == "coreml_update_state"]
    assert sorted(op.state.name for op in ops) == ["cross_k", "cross_mask", "cross_v", "self_k", "self_v"]
    with pytest.raises(DecoderRuntimeError, match="encoder_length"):  # a mask that disagrees with the encoder's length
        decoder.bind(decoder.make_state(), {**case.memory, "encoder_length": np.array([bound + 1], np.int32)})


def test_step_reads_the_bound_window(trained_reference, trained_package):
    """A state bound to another window's memory gives other log-probs than the right one; re-binding a
    used state to a window gives exactly what a fresh state bound to it gives (prefill and step)."""
    from cohere_coreml.decoder_runtime import DecoderRuntime

    model, processor = trained_reference
    decoder = DecoderRuntime.load(trained_package, backend="mil")
    a = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=6, seed=0)
    b = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=6, seed=5)
    right = run_teacher_forcing(decoder, a)
    wrong_memory = dataclasses.replace(a, cross_k=b.cross_k, cross_v=b.cross_v, cross_mask=b.cross_mask)
    wrong = run_teacher_forcing(decoder, wrong_memory)
    assert teacher_forcing_report(a, right, "fp16")["passed"]
    assert np.abs(right - wrong).max() > 1.0
    assert not teacher_forcing_report(a, wrong, "fp16")["passed"]
    # one state, used for window b, then re-bound to window a
    state = decoder.new_state(b.memory)
    for pos, tok in enumerate(b.ids):
        decoder.step(state, tok, pos)
    decoder.bind(state, a.memory)
    again = [decoder.prefill(state, a.ids[:a.prompt_len])]
    again += [decoder.step(state, tok, pos) for pos, tok in enumerate(a.ids) if pos >= a.prompt_len]
    fresh = decoder.new_state(a.memory)
    expected = [decoder.prefill(fresh, a.ids[:a.prompt_len])]
    expected += [decoder.step(fresh, tok, pos) for pos, tok in enumerate(a.ids) if pos >= a.prompt_len]
    np.testing.assert_array_equal(np.stack(again), np.stack(expected))
    # prefill + steps decide as the step-only run does
    assert list(np.stack(expected).argmax(-1)) == list(right[a.prompt_len - 1:].argmax(-1))


def test_older_decoder_package_is_refused(trained_reference, tmp_path):
    """A step-only package (the format-1 layout: no bind_memory) is refused with a message to re-export."""
    from cohere_coreml.bundle import BundleError, decoder_package_info
    from cohere_coreml.decoder_runtime import DecoderRuntime, DecoderRuntimeError

    model, _ = trained_reference
    mlmodel, _ = build_step_mlmodel(model, capacity=32, memory_len=64, precision="fp16")
    path = tmp_path / "decoder.mlpackage"
    mlmodel.user_defined_metadata["com.cohere_coreml.decoder_shapes"] = "{}"
    mlmodel.save(str(path))
    with pytest.raises(DecoderRuntimeError, match="no 'bind_memory' function.*re-export"):
        DecoderRuntime.load(path, backend="mil")
    with pytest.raises(BundleError, match="bind_memory.*re-export"):
        decoder_package_info(path)


def test_serve_runtime_binds_and_steps_on_one_state(trained_reference, trained_package):
    """The Swift package's Linux path (`cohere-coreml serve-runtime`): a state made from the step
    function, bound by bind_memory (read back over the protocol), then a step: the same log-probs as
    `DecoderRuntime` in process."""
    from cohere_coreml.decoder_runtime import DecoderRuntime

    from .runtime.test_serve import _request, _serve

    model, processor = trained_reference
    case = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=1, seed=2)
    req = _request({"op": "load", "path": str(trained_package), "function": "main"})  # m1
    req += _request({"op": "load", "path": str(trained_package), "function": "bind_memory"})  # m2
    req += _request({"op": "make_state", "model": "m1"})  # s3
    req += _request({"op": "predict", "model": "m2", "state": "s3"},
                    {"encoder_" + k: v.astype(np.float16) for k, v in case.memory.items()})
    req += _request({"op": "read_state", "state": "s3", "name": "cross_k"})
    req += _request({"op": "predict", "model": "m1", "state": "s3"},
                    {"input_ids": np.array([[case.ids[0]]], np.int32), "position": np.array([0], np.int32)})
    req += _request({"op": "quit"})
    responses = _serve(req)
    assert all(h["ok"] for h, _ in responses), [h for h, _ in responses if not h["ok"]]
    step_load, bind_load = responses[1][0], responses[2][0]
    assert set(step_load["inputs"]) == {"input_ids", "position"} and step_load["states"] == bind_load["states"]
    assert int(responses[4][1]["memory_length"][0]) == int((case.cross_mask == 0).sum())
    np.testing.assert_array_equal(responses[5][1]["cross_k"], case.cross_k.astype(np.float16))
    decoder = DecoderRuntime.load(trained_package, backend="mil")
    want = decoder.step(decoder.new_state(case.memory), case.ids[0], 0)
    np.testing.assert_array_equal(responses[6][1]["log_probs"].reshape(-1), want)


def test_beam_search_state_copies_carry_the_bound_memory(trained_reference, trained_package):
    """Beam search on the package: every returned hypothesis scores exactly what a fresh state bound to
    the same memory gives it (so each copied state held the right cache AND the window's memory); a
    copy of the self cache alone (the format-1 copy) does not reproduce the next log-probs."""
    from cohere_coreml.decoder_runtime import DecoderRuntime
    from cohere_coreml.decoding import beam_search, copy_state

    model, processor = trained_reference
    decoder = DecoderRuntime.load(trained_package, backend="mil")
    case = teacher_forcing_case(model, 64, _prompt(processor), new_tokens=1, seed=4)
    prompt = case.ids[: case.prompt_len]
    state = decoder.new_state(case.memory)
    lp = decoder.prefill(state, prompt)
    searched = beam_search(lambda tok, pos, st: decoder.step(st, tok, pos), decoder, state, lp, len(prompt),
                           limit=8, reason_at_limit="max_new_tokens", eos_ids={model.config.eos_token_id}, beams=3)
    assert searched["calls"] > 8 and len(searched["hypotheses"]) == 3
    assert len({tuple(t) for t, _, _ in searched["hypotheses"]}) == 3
    for tokens, normalised, _ in searched["hypotheses"]:
        fresh = decoder.new_state(case.memory)
        row = np.asarray(decoder.prefill(fresh, prompt), np.float64)
        score = 0.0
        for i, tok in enumerate(tokens):
            score += float(row[tok])
            if i + 1 < len(tokens):
                row = np.asarray(decoder.step(fresh, tok, len(prompt) + i), np.float64)
        assert normalised == pytest.approx(score / len(tokens), rel=0, abs=1e-9), tokens
    # the copy holds all five buffers; without the bound memory the next step differs
    full = copy_state(decoder, state)
    for name in decoder.state_description:
        np.testing.assert_array_equal(full.read_state(name), state.read_state(name))
    cache_only = decoder.make_state()
    for name in ("self_k", "self_v"):
        cache_only.write_state(name, state.read_state(name))
    nxt = searched["token_ids"][0]
    a = decoder.step(full, nxt, len(prompt) + 8)
    b = decoder.step(cache_only, nxt, len(prompt) + 8)
    assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() > 1.0


def _near_tie_case(steps: int = 6, vocab: int = 64, seed: int = 0):
    """A synthetic teacher-forcing reference: clear winners except one near-tie at step 3."""
    from cohere_coreml.decoder import TeacherForcingCase

    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1, (steps, vocab))
    winners = rng.integers(0, vocab, steps)
    logits[np.arange(steps), winners] += 6.0
    runner = (winners[3] + 1) % vocab
    logits[3, runner] = logits[3, winners[3]] - 0.002  # a near-tie: 0.002 nats apart
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    z = np.zeros((1, 1, 4, 2), np.float32)
    case = TeacherForcingCase(cross_k=z, cross_v=z, cross_mask=np.zeros((1, 1, 1, 4), np.float32),
                              ids=list(range(steps)), log_probs=lp.astype(np.float32), prompt_len=1)
    return case, winners, runner


def test_argmax_flips_tolerate_near_ties_and_refuse_decisive_flips():
    """A flip whose reference margin is within twice the error measured on the step's other top tokens
    is a near-tie (reported, passes); the same error with a flip of a clear winner refuses."""
    from cohere_coreml.decoder import argmax_flips

    case, winners, runner = _near_tie_case()
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.004, case.log_probs.shape)  # a correct fp16 package's error level
    produced = case.log_probs + noise
    produced[3, runner] = case.log_probs[3, winners[3]] + 0.001  # the near-tie flips
    flips = argmax_flips(case.log_probs, produced)
    assert flips["flips"] == 1 and flips["near_tie_flips"] == 1 and flips["decisive_flips"] == 0
    row = flips["rows"][0]
    assert row["position"] == 3 and row["ref_token"] == winners[3] and row["out_token"] == runner
    assert row["ref_margin_nats"] <= 2 * row["step_error_nats"]
    report = teacher_forcing_report(case, produced.astype(np.float32), "fp16")
    assert report["passed"] and report["near_tie_flips"] == 1 and report["argmax_agree"] == report["argmax_steps"] - 1
    assert "near-tie flip" in teacher_forcing_gate(report).headline

    decisive = case.log_probs + noise
    other = (winners[1] + 7) % decisive.shape[1]
    decisive[1, other] = decisive[1, winners[1]] + 0.01  # a 6-nat winner loses: no measured error explains it
    flips = argmax_flips(case.log_probs, decisive)
    assert flips["decisive_flips"] == 1 and flips["rows"][0]["position"] == 1
    report = teacher_forcing_report(case, decisive.astype(np.float32), "fp16")
    assert not report["passed"] and report["decisive_flips"] == 1
    assert "beyond what the measured error explains" in teacher_forcing_gate(report).text
    assert argmax_flips(case.log_probs, case.log_probs)["flips"] == 0
