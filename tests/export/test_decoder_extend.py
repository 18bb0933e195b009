"""The decoder's `extend` function: K tokens from a given cache slot in one call (forced prefixes).

Exported with the other decoder functions on one state, gated by teacher forcing against PyTorch
(`decoder_gate.run_extend_teacher_forcing`), planned by `decoder_runtime.feed_plan`, used by
`Transcriber.decode` for any prompt prefill does not serve; bundles without it fall back to steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohere_coreml.config import EXTEND_FUNCTION, PREFILL_FUNCTION, STEP_FUNCTION
from cohere_coreml.export.decoder import TorchDecoder, convert_decoder
from cohere_coreml.export.decoder_gate import run_extend_teacher_forcing, teacher_forcing_case, teacher_forcing_report
from cohere_coreml.export.decoder_modules import StatefulDecoder
from cohere_coreml.export.parity import argmax_flips
from cohere_coreml.inference.decoder_runtime import (
    DecoderRuntime,
    DecoderRuntimeError,
    FeedCall,
    extend_inputs,
    feed_plan,
)
from cohere_coreml.model.tokens import prompt_ids

CAPACITY, MEMORY, K = 32, 64, 16  # K: a small extend length, so that slot P + K fits the test cache


def _prompt(processor):
    return prompt_ids(processor.tokenizer, "en")


@pytest.fixture(scope="module", params=["host", "graph"])
def extend_package(request, trained_reference, tmp_path_factory):
    """fp16 decoder of the trained model with prefill and extend (K 16), through its gate; both state
    variants (host: the host writes the K new rows of each extend call)."""
    from cohere_coreml.export.convert import ExportSettings

    model, processor = trained_reference
    settings = ExportSettings(out_dir=tmp_path_factory.mktemp("extend"), precision="fp16")
    return convert_decoder(model, settings, capacity=CAPACITY, memory_len=MEMORY, prompt=_prompt(processor),
                           prefill=True, extend=True, extend_len=K, state_writes=request.param)


# --- the plan (pure) ----------------------------------------------------------------------------


def test_feed_plan():
    # the bare prompt with prefill: one call; a longer prefix: extend calls, a lone tail token as a step
    assert feed_plan(10, 0, 64, prefill_length=10, extend_length=32) == [FeedCall(PREFILL_FUNCTION, 0, 10, 10)]
    # the rows after token 7 are read (a prompt of 8 and a draft of 2): a prefill call returns only its last
    assert feed_plan(10, 0, 64, prefill_length=10, extend_length=32, rows_from=7) == [
        FeedCall(EXTEND_FUNCTION, 0, 10, 32)]
    assert feed_plan(10, 0, 64, prefill_length=10, extend_length=32, rows_from=9) == [
        FeedCall(PREFILL_FUNCTION, 0, 10, 10)]
    assert feed_plan(25, 0, 64, prefill_length=10, extend_length=32) == [FeedCall(EXTEND_FUNCTION, 0, 25, 32)]
    assert feed_plan(33, 0, 64, 10, 32) == [FeedCall(EXTEND_FUNCTION, 0, 32, 32), FeedCall(STEP_FUNCTION, 32, 1, 1)]
    assert feed_plan(34, 0, 64, 10, 32) == [FeedCall(EXTEND_FUNCTION, 0, 32, 32), FeedCall(EXTEND_FUNCTION, 32, 2, 32)]
    # K slots past the cache: steps for the rest
    assert feed_plan(40, 0, 48, 10, 32) == [FeedCall(EXTEND_FUNCTION, 0, 32, 32)] + [
        FeedCall(STEP_FUNCTION, i, 1, 1) for i in range(32, 40)]
    # a bundle without extend (or without prefill): steps
    assert feed_plan(12, 0, 64, 10, None) == [FeedCall(STEP_FUNCTION, i, 1, 1) for i in range(12)]
    assert feed_plan(10, 0, 64, None, 32) == [FeedCall(EXTEND_FUNCTION, 0, 10, 32)]
    assert feed_plan(10, 5, 64, 10, 32) == [FeedCall(EXTEND_FUNCTION, 0, 10, 32)]  # prefill only from slot 0


def test_extend_inputs_refuse_what_the_function_cannot_take():
    ids, position = extend_inputs([7, 8, 9], 4, 8, 16)
    assert ids.tolist() == [[7, 8, 9, 0, 0, 0, 0, 0]] and position.tolist() == [4]
    assert ids.dtype == position.dtype == np.int32
    with pytest.raises(DecoderRuntimeError, match="1..8 tokens"):
        extend_inputs([], 0, 8, 16)
    with pytest.raises(DecoderRuntimeError, match="1..8 tokens"):
        extend_inputs(list(range(9)), 0, 8, 16)
    with pytest.raises(DecoderRuntimeError, match="past the cache"):
        extend_inputs([1], 9, 8, 16)


# --- the gate ---------------------------------------------------------------------------------------


def test_extend_is_gated_with_the_other_functions(extend_package):
    parity = extend_package["parity"]
    assert extend_package["functions"]["extend"] == EXTEND_FUNCTION and extend_package["extend_length"] == K
    ext = parity["extend"]
    assert parity["passed"] and ext["passed"]
    # two extend calls (slot 0: its last row; slot P: every real row) and the steps after them
    assert ext["steps"] >= 6 and ext["argmax_agree"] == ext["argmax_steps"] == ext["steps"]
    assert ext["worst_psnr_db"] >= ext["min_psnr_db_required"] and ext["mean_kl"] <= ext["max_kl_allowed"]


class _Broken(TorchDecoder):
    """A PyTorch twin with one extend defect (the kinds a wrong export would have)."""

    def __init__(self, module, defect):
        super().__init__(module)
        self.defect = defect

    def extend(self, state, ids, start, extend_len=K):
        padded, position = extend_inputs(ids, start, extend_len, self.module.shapes.capacity)
        first = 0 if self.defect == "slot_zero" else int(position[0])  # ignores `position`
        with torch.no_grad():
            rows = state.run_tokens(torch.from_numpy(padded), torch.arange(first, first + extend_len, dtype=torch.int32),
                                    all_rows=True).numpy()[0]
        if self.defect == "shifted_rows":  # the rows one slot late (the row after the next token)
            rows = rows[1:]
        return rows[: len(ids)]


def test_the_extend_gate_refuses_a_broken_extend(trained_reference):
    model, processor = trained_reference
    case = teacher_forcing_case(model, MEMORY, _prompt(processor), new_tokens=12, seed=2)
    make = lambda: StatefulDecoder(model, CAPACITY, MEMORY)  # noqa: E731
    trimmed, rows = run_extend_teacher_forcing(_Broken(make(), None), case, K)
    assert teacher_forcing_report(trimmed, rows, "fp16")["passed"]  # the twin as the package computes it
    for defect in ("shifted_rows", "slot_zero"):
        trimmed, rows = run_extend_teacher_forcing(_Broken(make(), defect), case, K)
        assert not teacher_forcing_report(trimmed, rows, "fp16")["passed"], defect


# --- the runtime ----------------------------------------------------------------------------------


def test_feed_uses_extend_and_gives_the_steps_decisions(trained_reference, extend_package):
    """A forced prefix (prompt + 6 tokens) fed by one extend call predicts what 16 step calls predict,
    and a package loaded without extend falls back to the steps."""
    model, processor = trained_reference
    case = teacher_forcing_case(model, MEMORY, _prompt(processor), new_tokens=8, seed=4)
    prefix = case.ids[:16]
    with_extend = DecoderRuntime.load(extend_package["path"], backend="mil")
    steps_only = DecoderRuntime.load(extend_package["path"], backend="mil", extend=False)
    assert with_extend.extend_length == K and steps_only.extend_model is None
    a = with_extend.feed(with_extend.new_state(case.memory), prefix)
    b = steps_only.feed(steps_only.new_state(case.memory), prefix)
    assert (a.calls, a.tokens_fed) == (1, K) and (b.calls, b.tokens_fed) == (16, 16)
    # a row after every token (the decisions a draft is verified with), as the steps give them; against
    # the reference, by the gates' near-tie rule (row 1, a prompt row of this case, is a near-tie:
    # 291 vs 417 are 0.0007 nats apart, and which way fp16 moves it depends on the CPU's kernels)
    assert [int(np.argmax(r)) for r in a.after] == [int(np.argmax(r)) for r in b.after]
    flips = argmax_flips(case.log_probs[:16], np.stack(a.after))
    assert flips["decisive_flips"] == 0, flips["rows"]
    assert flips["flips"] <= 2 and all(r["ref_margin_nats"] < 0.01 for r in flips["rows"]), flips["rows"]
    np.testing.assert_allclose(np.stack(a.after), np.stack(b.after), atol=0.05)
    # the bare prompt still goes through prefill (offline decoding unchanged)
    assert with_extend.plan(len(case.ids[:case.prompt_len])) == [FeedCall(PREFILL_FUNCTION, 0, 10, 10)]
