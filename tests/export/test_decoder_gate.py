"""The decoder's export gate (cohere_coreml.export.decoder_gate): teacher forcing against transformers, the
negative controls (broken modules and broken inputs it must refuse, and the warning when the case cannot
discriminate), the near-tie rule on argmax flips."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import numpy as np
import pytest
import torch

from cohere_coreml.export.decoder import TorchDecoder, convert_decoder
from cohere_coreml.export.decoder_gate import (
    NEGATIVE_CONTROLS,
    TeacherForcingCase,
    control_case,
    negative_controls,
    run_teacher_forcing,
    teacher_forcing_case,
    teacher_forcing_gate,
    teacher_forcing_report,
)
from cohere_coreml.export.decoder_modules import DecoderBind, DecoderStep, StatefulDecoder
from cohere_coreml.export.parity import argmax_flips
from cohere_coreml.model.tokens import prompt_ids

torch.set_num_threads(1)


def _prompt(processor, lang="en", punctuation=True):
    return prompt_ids(processor.tokenizer, lang, punctuation)


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
    import cohere_coreml.export.decoder as decoder_module
    from cohere_coreml.export.convert import ExportSettings, ParityError

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
        convert_decoder(model, settings, capacity=32, memory_len=32, prompt=_prompt(processor), state_writes="graph")
    assert [p.name for p in tmp_path.iterdir()] == ["decoder.parity-failed.json"], "only the refused gate's figures"


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
        controls = negative_controls(partial(TorchDecoder.of, model), case, precision,
                                     control_prompt=_prompt(processor, "de", False))
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
    import cohere_coreml.export.decoder as decoder_module
    from cohere_coreml.export.convert import ExportSettings, ParityError

    model, processor = trained_reference
    original = decoder_module.trace_decoder_bind
    monkeypatch.setattr(decoder_module, "trace_decoder_bind",
                        lambda bind: original(ZeroMemoryBind(model, bind.shapes.capacity, bind.shapes.memory_len)))
    settings = ExportSettings(out_dir=tmp_path, precision="fp32")
    with pytest.raises(ParityError, match="teacher forcing"):
        convert_decoder(model, settings, capacity=32, memory_len=64, prompt=_prompt(processor), state_writes="graph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder.parity-failed.json"]
    failed = json.loads((tmp_path / "decoder.parity-failed.json").read_text())
    assert failed["passed"] is False and failed["component"] == "decoder"


def test_gate_refuses_host_steps_that_return_wrong_rows(trained_reference, tmp_path, monkeypatch):
    """The host-state export: a step whose new K/V rows are not the token's (zeros, or the layers' rows in
    reverse order) is refused by the export gate through the real path (trace, convert, interpreter,
    the host's writes); the right one passes, and its programs write no state."""
    import cohere_coreml.export.decoder as decoder_module
    from cohere_coreml.export.convert import ExportSettings, ParityError
    from cohere_coreml.export.decoder_gate import state_write_ops
    from cohere_coreml.export.decoder_modules import DecoderStepHost

    class ZeroRows(DecoderStepHost):
        def forward(self, input_ids, position, cache_mask):
            lp, k, v = super().forward(input_ids, position, cache_mask)
            return lp, k * 0, v * 0

    class LayersReversed(DecoderStepHost):  # each layer's rows written into another layer's cache
        def forward(self, input_ids, position, cache_mask):
            lp, k, v = super().forward(input_ids, position, cache_mask)
            return lp, torch.flip(k, [0]), torch.flip(v, [0])

    model, processor = trained_reference
    original = decoder_module.trace_decoder_step
    for broken in (ZeroRows, LayersReversed):
        out = tmp_path / broken.__name__
        monkeypatch.setattr(decoder_module, "trace_decoder_step",
                            lambda step, cls=broken: original(cls(model, step.shapes.capacity, step.shapes.memory_len)))
        with pytest.raises(ParityError, match="teacher forcing"):
            convert_decoder(model, ExportSettings(out_dir=out, precision="fp16"), capacity=32, memory_len=64,
                            prompt=_prompt(processor), state_writes="host")
        assert sorted(p.name for p in out.iterdir()) == ["decoder.parity-failed.json"]
    monkeypatch.setattr(decoder_module, "trace_decoder_step", original)
    good = convert_decoder(model, ExportSettings(out_dir=tmp_path / "good", precision="fp16"), capacity=32,
                           memory_len=64, prompt=_prompt(processor), state_writes="host")
    assert good["parity"]["passed"] and good["parity"]["state_writes"] == "host"
    assert good["parity"]["discriminates"], good["parity"]["controls"]
    assert not any(any(c.values()) for c in state_write_ops(good["path"]).values())


def test_gate_warns_when_the_case_cannot_discriminate(tiny_reference, caplog):
    """Random weights (the unscaled tiny checkpoint): zero memory, swapped K/V and permuted layers
    score ~80 dB with every argmax right, so the gate could not refuse them. The report says so
    and a warning names each one."""
    model, processor = tiny_reference
    case = teacher_forcing_case(model, 32, _prompt(processor), new_tokens=6)
    with caplog.at_level("WARNING", logger="cohere_coreml.export.decoder_gate"):
        controls = negative_controls(partial(TorchDecoder.of, model), case, "fp32",
                                     control_prompt=_prompt(processor, "de", False))
    blind = [name for name, c in controls.items() if c["applicable"] and not c["discriminates"]]
    assert {"zero_memory", "swapped_kv"} <= set(blind), controls
    for name in blind:
        assert controls[name]["worst_psnr_db"] >= 60
        assert f"a package with {name.replace('_', ' ')} would pass" in caplog.text
    # one layer: nothing to permute, the control is recorded as not applicable
    single = dataclasses.replace(case, cross_k=case.cross_k[:1], cross_v=case.cross_v[:1])
    assert control_case(single, "permuted_layers") is None


def _near_tie_case(steps: int = 6, vocab: int = 64, seed: int = 0):
    """A synthetic teacher-forcing reference: clear winners except one near-tie at step 3."""
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



def test_gate_checks_the_align_function_against_the_reference(trained_reference, tmp_path, monkeypatch):
    """The align function through the real export path (trace, convert, interpreter): its word boundaries agree
    with the reference's (`transformers` attention on the same heads and rows) within one encoder frame on at least
    99 % of the calibration words, recorded in the parity report with negative controls that would fail; a package
    whose align function reads other heads than the plan's is refused, no package written."""
    import cohere_coreml.export.decoder as decoder_module
    from cohere_coreml.export.alignment_heads import (
        AGREEMENT_REQUIRED,
        CALIBRATION_SET,
        AlignmentPlan,
        calibration_records,
    )
    from cohere_coreml.export.convert import ExportSettings, ParityError
    from cohere_coreml.export.decoder_modules import DecoderAlign

    model, processor = trained_reference
    records = calibration_records(model, processor, CALIBRATION_SET, languages=["en"])
    assert records, "the default model transcribes its own domain's calibration clips"
    heads = [(1, 0), (1, 1)]
    plan = AlignmentPlan(heads=heads, lead_rows=1, note=None, calibration=None, records=records, frame_seconds=0.08)
    # K = 8 tokens a call: the gate's calls from the first row it reads take the rows before from the cache
    good = convert_decoder(model, ExportSettings(out_dir=tmp_path / "good", precision="fp16"), capacity=32,
                           memory_len=64, prompt=_prompt(processor), state_writes="host", alignment=plan,
                           extend_len=8)
    check = good["parity"]["alignment"]
    assert check["passed"] and check["fraction"] >= AGREEMENT_REQUIRED and check["words"] >= 15
    assert check["discriminates"] and max(check["controls"].values()) < AGREEMENT_REQUIRED
    assert "within one frame of the reference" in good["parity"]["headline"]

    original = decoder_module.trace_decoder_align
    monkeypatch.setattr(decoder_module, "trace_decoder_align", lambda align: original(
        DecoderAlign(model, align.shapes.capacity, align.shapes.memory_len, [(0, 2), (0, 3)], align.extend_len)))
    out = tmp_path / "other-heads"
    with pytest.raises(ParityError, match="align function's word boundaries agree"):
        convert_decoder(model, ExportSettings(out_dir=out, precision="fp16"), capacity=32, memory_len=64,
                        prompt=_prompt(processor), state_writes="host", alignment=plan, extend_len=8)
    assert sorted(p.name for p in out.iterdir()) == ["decoder.parity-failed.json"]
    failed = json.loads((out / "decoder.parity-failed.json").read_text())
    assert failed["alignment"]["passed"] is False and failed["alignment"]["fraction"] < AGREEMENT_REQUIRED
