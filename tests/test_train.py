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


def test_model_card_describes_the_recipe_and_the_robustness_subsets():
    from cohere_coreml_dev import synth
    from cohere_coreml_dev.evaluate import LanguageReport
    from cohere_coreml_dev.train import data_description, robustness_rows

    varied, commands = data_description("varied"), data_description("commands")
    assert "1-4 sentences" in varied and "-30..0 dBFS" in varied and "10-40 dB SNR" in varied
    assert "50 % of the clips of 2+ sentences" in varied  # the mixed-recording share
    assert all(v in varied for v in synth.VARIED_HELDOUT_VARIANTS)
    assert "15-40 dB SNR" in commands and "sentences" not in commands

    def report(lang, wer):
        return LanguageReport(language=lang, clips=200, words=1000, wer=wer, median_margin=9.0, p10_margin=3.0,
                              share_under_1nat=0.01)

    rows = robustness_rows({"single": {"en": report("en", 0.02)}, "padded": {"en": report("en", 0.03)},
                            "multi": {"en": report("en", 0.05)}}).splitlines()
    assert rows == ["| single | en | 200 | 1000 | 2.00 % | - | - | 9.00 |",
                    "| padded | en | 200 | 1000 | 3.00 % | - | 1.50x | 9.00 |",
                    "| multi | en | 200 | 1000 | 5.00 % | - | 2.50x | 9.00 |"]
    with_ci = report("en", 0.02)
    with_ci.wer_interval = [0.011, 0.032]
    assert robustness_rows({"single": {"en": with_ci}}) == "| single | en | 200 | 1000 | 2.00 % | 1.10-3.20 % | - | 9.00 |"


def test_train_refuses_zero_threads_before_reading_data():
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match="threads must be >= 1, got 0"):
        train(_cfg(threads=0))
