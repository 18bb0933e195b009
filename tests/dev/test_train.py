"""Training helpers: schedule, batching, tokenizer from SentencePiece pieces."""

import json
from pathlib import Path

import numpy as np
import pytest

from cohere_coreml_dev.synth import sample_sentences
from cohere_coreml_dev.train import TrainConfig, lr_factor, make_batches, next_check, train_sentencepiece


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


def test_periodic_check_after_a_pause_runs_once_then_keeps_its_interval():
    every = 300.0
    assert next_check(0.0, every) == 300.0
    assert next_check(300.0, every) == 600.0
    # stopped for 17 minutes: one check at 17.8 min, the next at 20 (not at 10, 15, 20, ... in a row)
    assert next_check(17.8 * 60, every) == 1200.0
    assert next_check(1200.5, every) == 1500.0


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


def test_shortest_first_batches_are_the_same_batches_in_length_order():
    lengths = np.random.default_rng(0).integers(50, 900, 500)
    shuffled = make_batches(lengths, 4000, np.random.default_rng(1))
    ordered = make_batches(lengths, 4000, np.random.default_rng(1), shuffle=False)
    longest = [int(lengths[b].max()) for b in ordered]
    assert longest == sorted(longest)
    assert [int(lengths[b].max()) for b in shuffled] != longest  # the default order is random
    assert sorted(map(tuple, shuffled)) == sorted(map(tuple, ordered))


def test_sentencepiece_tokenizer_covers_corpus_and_round_trips():
    from cohere_coreml.model.tokens import prompt_ids
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
    tuned = data_description("varied", {"sentence_weights": [0.15, 0.2, 0.3, 0.35], "snr_db": [5, 40]})
    assert "4: 35 %" in tuned and "5-40 dB SNR" in tuned and "4: 13 %" in varied
    assert "template" not in tuned + varied
    paired = data_description("varied", {"same_template": 0.5})
    assert "of its predecessor's template with chance 50 %" in paired

    def report(lang, wer):
        return LanguageReport(language=lang, clips=200, words=1000, wer=wer, median_margin=9.0, p10_margin=3.0,
                              share_under_1nat=0.01)

    rows = robustness_rows({"single": {"en": report("en", 0.02)}, "padded": {"en": report("en", 0.03)},
                            "multi": {"en": report("en", 0.05)}}).splitlines()
    assert rows == ["| single | en | 200 | 1000 | 2.00 % | - | 9.00 |",
                    "| padded | en | 200 | 1000 | 3.00 % | - | 9.00 |",
                    "| multi | en | 200 | 1000 | 5.00 % | - | 9.00 |"]  # ratios: the targets table's
    with_ci = report("en", 0.02)
    with_ci.wer_interval = [0.011, 0.032]
    assert robustness_rows({"single": {"en": with_ci}}) == "| single | en | 200 | 1000 | 2.00 % | 1.10-3.20 % | 9.00 |"


def test_a_fine_tuned_models_card_names_its_start_and_reproduces_both_runs(tmp_path):
    """--init-from: the card says fine-tuned from the checkpoint (not "trained from scratch") and its
    Reproduce section holds the starting checkpoint's commands, then this run's."""
    from cohere_coreml_dev.evaluate import LanguageReport
    from cohere_coreml_dev.train import TrainResult, write_model_card

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("# base\n\n## Reproduce\n```\nuv run python tools/train/train_tiny.py --steps 7600\n```\n")
    reports = {"en": LanguageReport(language="en", clips=30, words=150, wer=0.0, median_margin=9.0, p10_margin=3.0,
                                    share_under_1nat=0.0)}
    result = TrainResult(out_dir=str(tmp_path / "out"), steps=2000, epochs=1.4, train_seconds=60.0, total_seconds=90.0,
                         parameters=2_950_000)
    (tmp_path / "out").mkdir()

    def card(init_from, **options):
        cfg = TrainConfig(train_dir="d", heldout_dir="h", out_dir=str(tmp_path / "out"), steps=2000, init_from=init_from,
                          **options)
        return write_model_card(tmp_path / "out", cfg, result, reports, "uv run python tools/train/train_tiny.py --init-from B",
                                {"recipe": "varied"}).read_text()

    tuned = card(str(base))
    assert "decoder attention dropout\n0; label smoothing 0 (" in tuned  # the committed model's: none
    assert "decoder attention dropout\n0.2; label smoothing 0.1 (" in card(str(base), label_smoothing=0.1,
                                                                           decoder_attention_dropout=0.2)
    assert f"fine-tuned from `{base}`" in tuned and "widths) trained from scratch" not in tuned
    assert ("```\nuv run python tools/train/train_tiny.py --steps 7600\n"
            "uv run python tools/train/train_tiny.py --init-from B\n```" in tuned)
    assert f"the ones before it are the starting checkpoint's (its card's), whose output folder is `{base}` here" in tuned
    scratch = card("")
    assert "widths) trained from scratch" in scratch and "--steps 7600" not in scratch
    (base / "README.md").unlink()  # a start without a card: this run's command alone
    assert "```\nuv run python tools/train/train_tiny.py --init-from B\n```" in card(str(base))
    # with a robustness set: its rows, then each ratio once, in the targets table with its interval
    cfg = TrainConfig(train_dir="d", heldout_dir="h", out_dir=str(tmp_path / "out"), steps=2000)
    subsets = {name: {"en": LanguageReport(language="en", clips=200, words=1000, wer=wer, median_margin=9.0,
                                           p10_margin=3.0, share_under_1nat=0.0,
                                           utterance_counts=[[int(wer * 1000), 1000]])}
               for name, wer in (("single", 0.02), ("padded", 0.03), ("multi", 0.05))}
    text = write_model_card(tmp_path / "out", cfg, result, reports, "c", {"recipe": "varied"}, subsets).read_text()
    assert "| multi | en | 200 | 1000 | 5.00 % | - | 9.00 |" in text
    assert text.count("2.50x") == 1 and "| multi | en | 5.00 | 2.00 | 2.50x [" in text
    assert "1 of 2 ratio targets met." in text  # padded 1.5x meets its 1.5x
    assert ("the committed one is `uv run python tools/data/make_heldout_set.py --single tests/data/heldout-varied"
            in text)
    assert "make_heldout_set" not in scratch  # no robustness set, no word of one


@pytest.mark.parametrize("name,value", [("label_smoothing", -0.1), ("label_smoothing", 1.0),
                                        ("decoder_attention_dropout", 1.0)])
def test_train_refuses_regularisation_outside_0_1_before_reading_data(name, value):
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match=rf"{name} must be in \[0, 1\), got {value}"):
        train(_cfg(**{name: value}))


def test_train_refuses_zero_threads_before_reading_data():
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match="threads must be >= 1, got 0"):
        train(_cfg(threads=0))


def test_train_refuses_negative_steps_before_reading_data():
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match="steps must be >= 0"):
        train(_cfg(steps=-1))


@pytest.mark.parametrize("name", ["encoder_num_hidden_layers", "num_hidden_layers"])
def test_train_refuses_zero_layers_before_reading_data(name):
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match=f"{name} must be >= 1, got 0"):
        train(_cfg(**{name: 0}))


def _noise_corpus(folder, n=24, seed=0):
    """A training folder the trainer accepts without espeak-ng: noise clips labelled with grammar sentences."""
    import json

    import soundfile as sf

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    utts = []
    for i, (lang, text) in enumerate(zip(["en", "de", "es"] * n, sample_sentences("en", n, split="train", seed=seed))):
        name = f"{lang}_{i:03d}.flac"
        sf.write(str(folder / name), (0.1 * rng.standard_normal(int(16000 * rng.uniform(0.5, 1.5)))).astype(np.float32),
                 16000, subtype="PCM_16")
        utts.append({"file": name, "language": lang, "text": text})
    (folder / "manifest.json").write_text(json.dumps({"split": "train", "utterances": utts}))
    return folder


# a model and trainer small enough to train a few steps in a test
SMALL = dict(encoder_hidden_size=32, encoder_num_hidden_layers=1, encoder_num_attention_heads=2,
             encoder_intermediate_size=64, encoder_subsampling_conv_channels=8, hidden_size=32,
             num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, sentencepiece_vocab=120,
             max_position_embeddings=128, eval_clips_per_language=1, feature_workers=1)


@pytest.mark.slow
def test_a_step_count_repeats_a_run_from_its_seed(tmp_path):
    """--steps: two runs of the same seed give the same weights (the schedule runs on steps, not time);
    another seed gives others, so the comparison can fail. The second run starts with autograd off, as
    after an export in the same process: training turns it on for itself."""
    import torch
    from safetensors.numpy import load_file

    from cohere_coreml_dev.train import train

    corpus = _noise_corpus(tmp_path / "train")
    small = dict(SMALL, steps=6, warmup_steps=2)

    def run(name, seed):
        cfg = TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / name),
                          cache_dir=str(tmp_path / f"cache-{name}"), seed=seed, **small)
        result = train(cfg)
        assert result.steps == 6
        return load_file(str(tmp_path / name / "model.safetensors"))

    first = run("a", 0)
    with torch.no_grad():
        again = run("b", 0)
    other = run("c", 1)
    assert first.keys() == again.keys()
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert any(not np.array_equal(first[k], other[k]) for k in first)


@pytest.mark.slow
def test_decoder_regularisation_changes_the_training_and_is_off_in_the_saved_config(tmp_path):
    """label_smoothing and decoder_attention_dropout each change the trained weights (each against the
    same seed without it, so an option that does not reach the loss or the model fails) and the saved
    config has no attention dropout (the released format; inference unaffected)."""
    import json

    from safetensors.numpy import load_file

    from cohere_coreml_dev.train import train

    corpus = _noise_corpus(tmp_path / "train")

    def run(name, **options):
        cfg = TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / name),
                          cache_dir=str(tmp_path / "cache"), seed=0, **dict(SMALL, steps=6, warmup_steps=2), **options)
        train(cfg)
        return load_file(str(tmp_path / name / "model.safetensors")), json.loads((tmp_path / name / "config.json").read_text())

    base, _ = run("base")
    smoothed, _ = run("smoothed", label_smoothing=0.2)
    dropped, config = run("dropped", decoder_attention_dropout=0.3)
    for other in (smoothed, dropped):
        assert any(not np.array_equal(base[k], other[k]) for k in base)
    assert config["attention_dropout"] == 0.0 and config["encoder_config"]["dropout"] == 0.0


@pytest.mark.slow
def test_the_first_epochs_run_shortest_first_when_asked(tmp_path, monkeypatch):
    """shortest_first_epochs=2: the first two epochs' batches unshuffled, the later ones shuffled (the
    noise corpus fits one batch, so each step is an epoch)."""
    import cohere_coreml_dev.train as train_module

    calls = []

    def recording(lengths, max_frames, rng, shuffle=True):
        calls.append(shuffle)
        return make_batches(lengths, max_frames, rng, shuffle)

    monkeypatch.setattr(train_module, "make_batches", recording)
    corpus = _noise_corpus(tmp_path / "train", n=6)
    cfg = TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / "out"),
                      cache_dir=str(tmp_path / "cache"), steps=4, warmup_steps=2, shortest_first_epochs=2, **SMALL)
    assert train_module.train(cfg).steps == 4
    assert calls[:4] == [False, False, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [None, "optimizer", "dropout_rng"])
def test_a_run_stopped_and_resumed_ends_with_the_uninterrupted_runs_weights(tmp_path, monkeypatch, broken):
    """stop_after, then resume: the weights of one uninterrupted run. The state is saved mid-epoch (several
    batches per epoch) and the run crosses an epoch after it; SpecAugment and dropout draw from their
    generators. Broken resumptions (the optimizer's moments or the dropout generator not restored) end
    elsewhere, so the comparison can fail."""
    import torch
    from safetensors.numpy import load_file

    import cohere_coreml_dev.train as train_module

    corpus = _noise_corpus(tmp_path / "train")
    small = dict(SMALL, steps=8, warmup_steps=2, max_batch_frames=600)

    def cfg(name, **kw):
        return TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / name),
                           cache_dir=str(tmp_path / "cache"), **small, **kw)

    straight = train_module.train(cfg("straight"))
    assert straight.finished and straight.steps == 8 and straight.sessions == 1 and straight.epochs > 1
    first = train_module.train(cfg("split", stop_after=3))
    assert not first.finished and first.steps == 3 and Path(first.state_path).is_file()
    assert 0 < first.epochs < 1  # stopped inside the first epoch
    assert not (tmp_path / "split").exists()  # no checkpoint until the run ends
    if broken == "optimizer":
        monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None)
    elif broken == "dropout_rng":
        monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    second = train_module.train(cfg("split", resume=True))
    assert second.finished and second.steps == 8 and second.sessions == 2
    assert not Path(first.state_path).exists()  # the checkpoint is complete: nothing left to resume
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    same = all(np.array_equal(a[k], b[k]) for k in a)
    assert same is (broken is None)


@pytest.mark.slow
def test_a_run_killed_after_a_periodic_check_resumes_from_it_to_the_same_weights(tmp_path, monkeypatch):
    """A check every step (each saves the state); the run dies in the sixth check, so the state is step 5's,
    saved after a check: the resumed run (checks still every step) ends with the weights of a run without
    checks, so the checks neither perturb the training nor lose a step of it."""
    from safetensors.numpy import load_file

    import cohere_coreml_dev.evaluate as evaluate
    from cohere_coreml_dev.train import train

    corpus = _noise_corpus(tmp_path / "train")
    small = dict(SMALL, steps=8, warmup_steps=2, max_batch_frames=600)

    def cfg(name, **kw):
        return TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / name),
                           cache_dir=str(tmp_path / "cache"), **small, **kw)

    assert train(cfg("straight")).finished
    decode, calls = evaluate.greedy_decode, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("killed by the test")
        return decode(*args, **kwargs)

    monkeypatch.setattr(evaluate, "greedy_decode", dying)
    with pytest.raises(RuntimeError, match="killed by the test"):
        train(cfg("killed", eval_every_minutes=1e-9))
    monkeypatch.setattr(evaluate, "greedy_decode", decode)
    resumed = train(cfg("killed", eval_every_minutes=1e-9, resume=True))
    assert resumed.sessions == 2 and [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6, 7, 8]
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # finished: its checks leave nothing in the cache but the features (no state, no weights of a check)
    assert all(f.name.startswith("features_") for f in (tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_a_resume_refuses_other_options_or_another_corpus(tmp_path):
    import json

    from cohere_coreml_dev.train import TrainingError, train

    corpus = _noise_corpus(tmp_path / "train")
    small = dict(SMALL, warmup_steps=2)

    def cfg(train_dir=corpus, **kw):
        return TrainConfig(train_dir=str(train_dir), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / "out"),
                           cache_dir=str(tmp_path / "cache"), **{**small, **kw})

    assert not train(cfg(steps=6, stop_after=2)).finished
    with pytest.raises(TrainingError, match=r"other options \(steps 6 there, 7 here\)"):
        train(cfg(steps=7, resume=True))
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["utterances"] = manifest["utterances"][:-1]
    other = tmp_path / "other"
    other.mkdir()
    for u in manifest["utterances"]:
        (other / u["file"]).symlink_to(corpus / u["file"])
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainingError, match="is not the corpus it was trained on"):
        train(cfg(train_dir=other, steps=6, resume=True))
    with pytest.raises(TrainingError, match="stop_after 2 is not after the saved state's step 2"):
        train(cfg(steps=6, stop_after=2, resume=True))
    assert train(cfg(steps=6, resume=True, eval_every_minutes=1.0)).finished  # where and how often it checks may change


@pytest.mark.slow
def test_a_run_from_a_checkpoint_starts_from_its_weights_and_keeps_its_tokenizer(tmp_path):
    """--init-from: a run on another corpus keeps the starting checkpoint's tokenizer (a run without it
    trains a tokenizer of its own, so the comparison can fail) and starts from its weights: at a learning
    rate too small to move an fp16 weight it ends with them, where the run from random weights does not."""
    from safetensors.numpy import load_file

    from cohere_coreml_dev.train import train

    small = dict(SMALL, warmup_steps=2)
    base_corpus, corpus = _noise_corpus(tmp_path / "base", seed=0), _noise_corpus(tmp_path / "train", seed=1)

    def run(name, train_dir, **kw):
        train(TrainConfig(train_dir=str(train_dir), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / name),
                          cache_dir=str(tmp_path / f"cache-{name}"), **{**small, **kw}))
        return (load_file(str(tmp_path / name / "model.safetensors")),
                json.loads((tmp_path / name / "tokenizer.json").read_text()))

    base, base_tok = run("base", base_corpus, steps=4)
    tuned, tuned_tok = run("tuned", corpus, steps=2, init_from=str(tmp_path / "base"), peak_lr=1e-12)
    fresh, fresh_tok = run("fresh", corpus, steps=2, peak_lr=1e-12)
    assert tuned_tok == base_tok and fresh_tok != base_tok
    # the learned weights; batch norm's running statistics follow the batches whatever the learning rate
    learned = [k for k in base if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert tuned.keys() == base.keys() and len(learned) > 20
    assert [k for k in learned if not np.array_equal(tuned[k], base[k])] == []
    assert [k for k in learned if fresh[k].shape == base[k].shape and not np.array_equal(fresh[k], base[k])]


def test_a_run_from_a_checkpoint_refuses_another_architecture(tmp_path):
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint
    from cohere_coreml_dev.train import TrainingError, train

    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    corpus = _noise_corpus(tmp_path / "train")
    cfg = TrainConfig(train_dir=str(corpus), heldout_dir="tests/data/heldout", out_dir=str(tmp_path / "out"),
                      cache_dir=str(tmp_path / "cache"), steps=2, init_from=str(checkpoint), **SMALL)
    with pytest.raises(TrainingError, match=r"its architecture is not the configured one \(encoder_hidden_size 32 "
                                            r"here, \d+ there;.*num_hidden_layers 1 here"):
        train(cfg)
    with pytest.raises(TrainingError, match="init_from: "):
        train(TrainConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "train")}))  # a corpus, not a checkpoint
    with pytest.raises(TrainingError, match="peak_lr must be > 0"):
        train(_cfg(peak_lr=0.0))
    assert not (tmp_path / "out").exists()


def test_train_refuses_a_resume_without_state_and_a_stop_outside_the_steps_before_reading_data(tmp_path):
    from cohere_coreml_dev.train import TrainingError, train

    with pytest.raises(TrainingError, match="nothing to resume: no training state for"):
        train(_cfg(resume=True, cache_dir=str(tmp_path)))
    for steps, stop_after in ((0, 5), (5, 5), (5, -1)):
        with pytest.raises(TrainingError, match=f"stop_after must be between 0 and steps .*got {stop_after}"):
            train(_cfg(steps=steps, stop_after=stop_after))


def _train_tiny():
    from ..helpers import load_tool

    return load_tool("train/train_tiny")


def _present_corpus(folder, *, per_language=1, seed=0, recipe="commands", languages=("en", "de", "es"), **manifest):
    """A corpus folder whose manifest is the one train_tiny's defaults ask for (`--per-language 1`), but for
    the fields given: train_tiny uses it as it is (no synthesis)."""
    folder.mkdir()
    utts = [{"file": f"{lang}_{i}.flac", "language": lang} for lang in languages for i in range(per_language)]
    (folder / "manifest.json").write_text(json.dumps({"seed": seed, "recipe": recipe, **manifest, "utterances": utts}))
    return folder


def _recording_train_tiny(tmp_path, monkeypatch, pick):
    """train_tiny with `train` replaced by a stand-in that records `pick(cfg)` and stops with a
    TrainingError (exit 1), over a present corpus (no synthesis): (tool, base arguments, recorded)."""
    import cohere_coreml_dev.train as train_module

    seen = []

    def fake_train(cfg):
        seen.append(pick(cfg))
        raise train_module.TrainingError("stopped by the test")

    monkeypatch.setattr(train_module, "train", fake_train)
    corpus = _present_corpus(tmp_path / "train")  # present: no synthesis
    return _train_tiny(), ["--train-dir", str(corpus), "--per-language", "1", "--out", str(tmp_path / "out")], seen


def test_train_tiny_layer_flags_reach_the_model_config(tmp_path, monkeypatch, capsys):
    """--encoder-layers / --decoder-layers set the trained architecture (the card reports them); the
    defaults stay TrainConfig's."""
    tool, base, seen = _recording_train_tiny(tmp_path, monkeypatch, lambda cfg: cfg.model_overrides())
    assert tool.main(base + ["--encoder-layers", "3", "--decoder-layers", "4"]) == 1
    assert tool.main(base) == 1
    assert "stopped by the test" in capsys.readouterr().err
    defaults = _cfg()
    assert (seen[0]["encoder_num_hidden_layers"], seen[0]["num_hidden_layers"]) == (3, 4)
    assert (seen[1]["encoder_num_hidden_layers"], seen[1]["num_hidden_layers"]) == (
        defaults.encoder_num_hidden_layers, defaults.num_hidden_layers)


def test_train_tiny_card_command_leaves_out_the_session_flags():
    """The card's reproduce command: a run split over sessions ends with one run's weights."""
    tool = _train_tiny()
    assert tool.reproduce_args(["--steps", "10", "--stop-after", "4", "--out", "m", "--resume", "--stop-after=5",
                                "--seed", "1"]) == ["--steps", "10", "--out", "m", "--seed", "1"]


def test_train_tiny_stopped_run_says_how_to_continue_and_writes_no_card(tmp_path, monkeypatch, capsys):
    import cohere_coreml_dev.train as train_module

    seen = []

    def fake_train(cfg):
        seen.append((cfg.stop_after, cfg.resume))
        return train_module.TrainResult(cfg.out_dir, 4, 0.5, 1.0, 2.0, 10, finished=False, sessions=1,
                                        state_path=str(tmp_path / "state.pt"))

    monkeypatch.setattr(train_module, "train", fake_train)
    monkeypatch.setattr(train_module, "write_model_card", lambda *a, **k: pytest.fail("a card for a stopped run"))
    corpus = _present_corpus(tmp_path / "train")
    base = ["--train-dir", str(corpus), "--per-language", "1", "--out", str(tmp_path / "out"), "--steps", "10",
            "--stop-after", "4"]
    assert _train_tiny().main(base) == 0
    assert _train_tiny().main(base + ["--resume"]) == 0
    assert seen == [(4, False), (4, True)]
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "stopped after 4 of 10 steps" in captured.err and "with --resume continues it" in captured.err
    with pytest.raises(SystemExit) as exc:
        _train_tiny().main(["--stop-after", "4"])
    assert exc.value.code == 2
    assert "--stop-after needs --steps" in capsys.readouterr().err


def _stopped_synthesis(monkeypatch):
    """train_tiny whose corpus synthesis records its keyword arguments and stops (SynthError, exit 1), and
    whose training fails the test if reached: (tool module, the recorded keyword arguments)."""
    import cohere_coreml_dev.synth as synth_module
    import cohere_coreml_dev.train as train_module

    synthesised = []

    def fake_make_corpus(out_dir, languages, per_language, **kw):
        synthesised.append(kw)
        raise synth_module.SynthError("stopped by the test")

    monkeypatch.setattr(synth_module, "make_corpus", fake_make_corpus)
    monkeypatch.setattr(train_module, "train", lambda cfg: pytest.fail("trained"))
    return _train_tiny(), synthesised


def test_train_tiny_corpus_seed_reaches_the_synthesis_or_refuses_a_corpus_of_another(tmp_path, monkeypatch, capsys):
    """--corpus-seed: the seed of a missing corpus's synthesis (--seed without it); an existing corpus
    synthesised with another seed is refused (exit 1, naming both) before any training."""
    import cohere_coreml_dev.train as train_module

    tool, synthesised = _stopped_synthesis(monkeypatch)
    assert tool.main(["--seed", "0", "--corpus-seed", "5", "--train-dir", str(tmp_path / "new")]) == 1
    assert tool.main(["--seed", "3", "--train-dir", str(tmp_path / "new")]) == 1
    assert [kw["seed"] for kw in synthesised] == [5, 3]
    corpus = _present_corpus(tmp_path / "corpus", seed=3)
    capsys.readouterr()
    assert tool.main(["--corpus-seed", "5", "--per-language", "1", "--train-dir", str(corpus)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "synthesised with seed 3, not 5 (--corpus-seed, else --seed)" in err

    def reached(cfg):
        raise train_module.TrainingError("reached training")

    monkeypatch.setattr(train_module, "train", reached)
    assert tool.main(["--corpus-seed", "3", "--seed", "0", "--per-language", "1", "--train-dir", str(corpus)]) == 1
    assert "reached training" in capsys.readouterr().err  # the corpus asked for is used as it is


def test_train_tiny_refuses_an_existing_corpus_another_command_synthesised(tmp_path, monkeypatch, capsys):
    """An existing corpus is used as it is, so one left by another command (the default --train-dir is shared)
    is refused before training, each difference named: its seed without --corpus-seed, its recipe, its
    languages or utterances per language; the corpus this command synthesises is used."""
    import cohere_coreml_dev.train as train_module

    tool, synthesised = _stopped_synthesis(monkeypatch)
    base = ["--per-language", "2", "--languages", "en,de"]
    cases = [
        (dict(seed=1), [], "synthesised with seed 1, not 0 (--corpus-seed, else --seed)"),
        (dict(recipe="varied"), [], "recipe 'varied', not --recipe 'commands'"),
        (dict(per_language=3), [], "utterances per language {'en': 3, 'de': 3}, not {'en': 2, 'de': 2}"),
        (dict(languages=("en", "de", "es")), [], "not {'en': 2, 'de': 2} (--languages, --per-language)"),
        (dict(seed=7), ["--seed", "7", "--recipe", "varied"], "recipe 'commands', not --recipe 'varied'"),
    ]
    for i, (manifest, args, problem) in enumerate(cases):
        corpus = _present_corpus(tmp_path / f"c{i}", **{"per_language": 2, "languages": ("en", "de"), **manifest})
        assert tool.main([*base, *args, "--train-dir", str(corpus)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {corpus} holds another corpus than this command's: ") and problem in err
        assert "pass another --train-dir to synthesise it" in err
    assert synthesised == []  # none resynthesised over

    def reached(cfg):
        raise train_module.TrainingError("reached training")

    monkeypatch.setattr(train_module, "train", reached)
    same = _present_corpus(tmp_path / "same", seed=7, per_language=2, languages=("en", "de"))
    assert tool.main([*base, "--seed", "7", "--train-dir", str(same)]) == 1
    assert "reached training" in capsys.readouterr().err


def test_train_tiny_regularisation_flags_reach_the_config_or_refuse(tmp_path, monkeypatch, capsys):
    tool, base, seen = _recording_train_tiny(tmp_path, monkeypatch,
                                             lambda cfg: (cfg.label_smoothing, cfg.decoder_attention_dropout))
    assert tool.main(base + ["--label-smoothing", "0.1", "--decoder-attention-dropout", "0.2"]) == 1
    assert tool.main(base) == 1
    assert seen == [(0.1, 0.2), (0.0, 0.0)]
    for flag, value in (("--label-smoothing", "1"), ("--decoder-attention-dropout", "-0.5")):
        with pytest.raises(SystemExit) as exc:
            tool.main(base + [flag, value])
        assert exc.value.code == 2
        assert f"{flag} must be at least 0 and below 1 (got {float(value):g})" in capsys.readouterr().err
    assert len(seen) == 2  # refused before training


def test_train_tiny_shortest_first_flag_reaches_the_config(tmp_path, monkeypatch, capsys):
    tool, base, seen = _recording_train_tiny(tmp_path, monkeypatch, lambda cfg: cfg.shortest_first_epochs)
    assert tool.main(base + ["--shortest-first-epochs", "1"]) == 1 and tool.main(base) == 1
    assert seen == [1, 0]
    with pytest.raises(SystemExit) as exc:
        tool.main(base + ["--shortest-first-epochs", "-1"])
    assert exc.value.code == 2
    assert "--shortest-first-epochs must be at least 0 (got -1)" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--encoder-layers", "--decoder-layers"])
def test_train_tiny_refuses_zero_layers(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        _train_tiny().main([flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be at least 1 (got 0)" in capsys.readouterr().err


def test_train_tiny_refuses_an_incomplete_robustness_set_before_training(tmp_path, capsys):
    """A robustness folder without single/ (as `make_heldout_set.py --single X --out Y` left it before it
    linked X there) is refused at the start, naming the subset, not after the training it would follow."""
    for name in ("padded", "multi"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        _train_tiny().main(["--robustness", str(tmp_path), "--train-dir", str(tmp_path / "no-corpus")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--robustness" in err and "no single/manifest.json (" in err
    assert not (tmp_path / "no-corpus").exists()  # nothing synthesised


def test_train_tiny_corpus_options_reach_the_corpus_or_refuse_another(tmp_path, monkeypatch, capsys):
    """--sentence-weights / --snr-db: passed to the synthesis of a missing corpus; an existing corpus of
    other options is refused (exit 1, naming both) before any training; on recipe commands, or as words,
    they are usage errors (exit 2)."""
    tool, synthesised = _stopped_synthesis(monkeypatch)
    args = ["--recipe", "varied", "--sentence-weights", "0.1,0.2,0.3,0.4", "--snr-db", "5,40"]
    assert tool.main([*args, "--train-dir", str(tmp_path / "new")]) == 1
    assert [kw["options"] for kw in synthesised] == [{"sentence_weights": [0.1, 0.2, 0.3, 0.4], "snr_db": [5.0, 40.0]}]
    corpus = _present_corpus(tmp_path / "corpus", recipe="varied")  # the default options
    args += ["--per-language", "1"]
    capsys.readouterr()
    assert tool.main([*args, "--train-dir", str(corpus)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'snr_db': [10.0, 40.0]" in err and "'snr_db': [5.0, 40.0]" in err
    assert tool.main(["--recipe", "varied", "--same-template", "0.5", "--train-dir", str(tmp_path / "new2")]) == 1
    assert synthesised[-1]["options"] == {"same_template": 0.5}
    capsys.readouterr()
    assert tool.main(["--recipe", "varied", "--same-template", "0.5", "--per-language", "1",
                      "--train-dir", str(corpus)]) == 1
    assert "'same_template': 0.5" in capsys.readouterr().err  # the corpus of independent draws is refused
    for bad in (["--sentence-weights", "0.5,0.5,0,0"], ["--recipe", "varied", "--snr-db", "low,high"],
                ["--same-template", "0.5"], ["--recipe", "varied", "--same-template", "2"]):
        with pytest.raises(SystemExit) as exc:
            tool.main([*bad, "--train-dir", str(corpus)])
        assert exc.value.code == 2
