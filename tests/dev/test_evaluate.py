"""Evaluation helpers: text normalisation, WER (`metrics`, through the dev summary), greedy decoding
bookkeeping (the dev package's batched `greedy_decode`)."""

import numpy as np
import pytest
import torch

from cohere_coreml.evaluation.metrics import basic_normalise as normalise_text
from cohere_coreml.inference.engines import features_batch
from cohere_coreml_dev.evaluate import Decoded, EvaluationError, greedy_decode, summarise


def test_normalise_text():
    assert normalise_text("¿Cuánto es dos más  TRES?") == "cuánto es dos más tres"
    assert normalise_text("Set a timer, please.") == "set a timer please"


def test_summarise_word_error_rate():
    """The dev evaluation's WER is `metrics.error_counts` (the one metric; the removed
    `scoring.word_error_rate` gave the same figures on these cases)."""

    def wer(refs, hyps, lang="de"):
        return summarise(refs, [Decoded(h, [], []) for h in hyps], [lang] * len(refs))[lang].wer

    assert wer(["Paint the wall red."], ["paint the wall red"]) == 0.0
    assert wer(["paint the wall red"], ["paint the wall blue"]) == pytest.approx(0.25)
    # an empty hypothesis is never free
    assert wer(["paint the wall red", "call tom"], ["paint the wall red", ""]) >= 2 / 6
    with pytest.raises(EvaluationError):
        greedy_decode(None, None, [np.zeros((8, 3), np.float32)], ["en", "de"])


def test_features_batch_pads_and_masks():
    feats = [np.ones((8, 5), np.float32), 2 * np.ones((8, 3), np.float32)]
    x, mask = features_batch(feats)
    assert x.shape == (2, 5, 8) and mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert torch.all(x[1, 3:] == 0) and torch.all(x[1, :3] == 2)


def test_summarise_margins_and_wer():
    decoded = [Decoded("call tom", [1, 2], [5.0, 1.0]), Decoded("call anna", [1, 2], [3.0, 0.5]), Decoded("x", [1], [9.0])]
    reports = summarise(["Call Tom.", "Call Emma.", "X"], decoded, ["en", "en", "de"])
    assert reports["en"].wer == pytest.approx(0.25)
    assert reports["en"].median_margin == pytest.approx(2.0)
    assert reports["en"].share_under_1nat == pytest.approx(0.25)
    assert reports["en"].errors == [("Call Emma.", "call anna")]
    assert reports["de"].wer == 0.0


def test_greedy_decode_matches_manual_greedy(tmp_path):
    """greedy_decode (batched generate) gives the same ids as a plain step-by-step argmax loop."""
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.tokens import prompt_ids
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", seed=3)
    model, processor = load_reference(path)
    tok = processor.tokenizer
    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((128, 120)).astype(np.float32), rng.standard_normal((128, 80)).astype(np.float32)]
    langs = ["en", "de"]
    out = greedy_decode(model, tok, feats, langs, max_new_tokens=6, batch_size=2)
    for f, lang, d in zip(feats, langs, out):
        x, mask = features_batch([f])
        ids = prompt_ids(tok, lang)
        manual, gaps = [], []
        with torch.no_grad():
            for _ in range(len(d.ids)):
                logits = model(input_features=x, attention_mask=mask, decoder_input_ids=torch.tensor([ids + manual])).logits[0, -1]
                logp = torch.log_softmax(logits, -1)
                top = torch.topk(logp, 2).values
                gaps.append(float(top[0] - top[1]))
                manual.append(int(logp.argmax()))
        assert manual == d.ids
        np.testing.assert_allclose(gaps, d.margins, atol=1e-4)
