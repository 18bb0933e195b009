"""Training helpers: schedule, batching, tokenizer from SentencePiece pieces."""

import numpy as np
import pytest

from cohere_coreml_dev.synth import sample_sentences
from cohere_coreml_dev.train import TrainConfig, lr_factor, make_batches, train_sentencepiece


def _cfg(**kw):
    return TrainConfig(train_dir="", heldout_dir="", out_dir="", **kw)


def test_lr_schedule_warmup_then_cosine():
    cfg = _cfg(warmup_steps=100, warmup_fraction=0.5, final_lr_fraction=0.05)
    assert lr_factor(0, 0.0, cfg) == pytest.approx(0.01)
    assert lr_factor(49, 0.0, cfg) == pytest.approx(0.5)
    assert lr_factor(10, 0.25, cfg) == pytest.approx(0.5)  # time-based warmup ends first
    assert lr_factor(200, 0.5, cfg) == pytest.approx(0.05 + 0.95 * 0.5)
    assert lr_factor(500, 1.0, cfg) == pytest.approx(0.05)
    assert lr_factor(500, 2.0, cfg) == pytest.approx(0.05)


def test_batches_cover_everything_once_within_frame_cap():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 900, 500)
    batches = make_batches(lengths, 4000, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(500))
    for b in batches:
        assert len(b) * lengths[b].max() <= 4000 or len(b) == 1
    # length-sorted: the spread inside a batch is far below the global spread
    assert np.median([lengths[b].max() - lengths[b].min() for b in batches]) < 100


def test_sentencepiece_tokenizer_covers_corpus_and_round_trips():
    from cohere_coreml.tokens import prompt_ids
    from cohere_coreml_dev.tokenizer import build_tokenizer

    texts = sum((sample_sentences(l, 300, split="train", seed=0) for l in ("en", "de", "es")), [])
    pieces = train_sentencepiece(texts, 200)
    assert 100 < len(pieces) <= 200
    tok = build_tokenizer(pieces)
    for text in texts[::37]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert not any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # pieces, not bytes
        assert tok.decode(ids) == text
    assert len(set(prompt_ids(tok, "en")) & set(prompt_ids(tok, "de"))) == 8  # only the language tokens differ
