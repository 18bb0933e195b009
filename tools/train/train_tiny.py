#!/usr/bin/env python
"""Train the small synthetic-speech Cohere-architecture model (models/cohere-tiny-synth).

Steps: synthesise the training corpus with espeak-ng if it is not there yet
(`apt-get install espeak-ng`; one already in --train-dir must be the one this command synthesises: its seed,
recipe, options, languages and size, else it is refused), train within a wall-clock budget (or for exactly
--steps steps, which repeats a run from its seed and thread count) on one CPU thread by default, save a Hugging
Face folder (float16 safetensors + tokenizer + processor), evaluate it on the committed held-out
set and write the model card with the measured figures.

Example (the committed model's command, as its card's Reproduce section gives it, without the folders):
  uv run python tools/train/train_tiny.py --per-language 10000 --recipe varied --steps 7600 --threads 2 \\
      --out models/cohere-tiny-synth

A training longer than one session: the run keeps its training state in the cache folder (at every
periodic check, and at --stop-after); the same command with --resume continues it, from where it
stopped or was killed, to the weights of one uninterrupted run (with --steps):
  uv run python tools/train/train_tiny.py ... --steps 20000 --stop-after 8000
  uv run python tools/train/train_tiny.py ... --steps 20000 --resume

Fine-tuning: --init-from starts from a checkpoint folder's tokenizer and weights (its sizes must be the
model options') instead of a new tokenizer and random weights, on the corpus of --train-dir (synthesised
with --corpus-seed when that differs from the training's --seed), usually with a lower --peak-lr:
  uv run python tools/train/train_tiny.py --init-from models/cohere-tiny-synth --train-dir D --steps 2000 \\
      --peak-lr 5e-4 --out out/tiny-tuned
"""

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[2]


def reproduce_args(argv: list[str]) -> list[str]:
    """The arguments that give the trained weights: without --stop-after / --resume (a run split over
    sessions ends with one run's weights)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--stop-after":
            skip = True
        elif a != "--resume" and not a.startswith("--stop-after="):
            out.append(a)
    return out


def corpus_options(parser, args) -> dict | None:
    """recipe "varied"'s options from --sentence-weights / --snr-db / --same-template (None when none is given)."""
    if args.sentence_weights is None and args.snr_db is None and args.same_template is None:
        return None
    if args.recipe != "varied":
        parser.error("--sentence-weights, --snr-db and --same-template are options of --recipe varied")
    options = {}
    for flag, key, value in (("--sentence-weights", "sentence_weights", args.sentence_weights),
                             ("--snr-db", "snr_db", args.snr_db)):
        if value is not None:
            try:
                options[key] = [float(x) for x in value.split(",")]
            except ValueError:
                parser.error(f"{flag} takes numbers separated by commas, got {value!r}")
    if args.same_template is not None:
        if not 0.0 <= args.same_template <= 1.0:
            parser.error(f"--same-template must be a probability in [0, 1] (got {args.same_template:g})")
        options["same_template"] = args.same_template
    return options


def check_corpus(train_dir, *, recipe: str, options: dict | None, seed: int, languages: list[str],
                 per_language: int) -> None:
    """SynthError unless the existing corpus in `train_dir` is the one this command synthesises: its recipe and
    the recipe's options, its synthesis seed, its languages and utterances per language (an existing corpus is
    used as it is, so a stale one left by another command would otherwise train another model in silence)."""
    from collections import Counter

    from cohere_coreml_dev.synth import SynthError, read_manifest, varied_options

    manifest = read_manifest(train_dir)
    problems = []
    if manifest.get("seed") != seed:
        problems.append(f"synthesised with seed {manifest.get('seed')}, not {seed} (--corpus-seed, else --seed)")
    have_recipe = manifest.get("recipe", "commands")
    if have_recipe != recipe:
        problems.append(f"recipe {have_recipe!r}, not --recipe {recipe!r}")
    elif recipe == "varied":
        have, want = manifest.get("recipe_options") or varied_options(), varied_options(**(options or {}))
        if have != want:
            problems.append(f"recipe options {have}, not {want}")
    counts = dict(Counter(u.get("language") for u in manifest.get("utterances", [])))
    want_counts = {lang: per_language for lang in languages}
    if counts != want_counts:
        problems.append(f"utterances per language {counts}, not {want_counts} (--languages, --per-language)")
    if problems:
        raise SynthError(f"{train_dir} holds another corpus than this command's: {'; '.join(problems)}: pass "
                         "another --train-dir to synthesise it")


def main(argv=None) -> int:
    from cohere_coreml_dev.synth import VARIED_SENTENCE_WEIGHTS, VARIED_SNR_DB
    from cohere_coreml_dev.train import TrainConfig

    defaults = TrainConfig(train_dir="", heldout_dir="", out_dir="")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "models" / "cohere-tiny-synth"), help="checkpoint folder to write")
    parser.add_argument("--train-dir", default="/tmp/training/train", help="training corpus (synthesised if missing)")
    parser.add_argument("--heldout-dir", default=str(ROOT / "tests" / "data" / "heldout"), help="held-out set")
    parser.add_argument("--cache-dir", default="/tmp/training/cache", help="feature cache")
    parser.add_argument("--languages", default="en,de,es")
    parser.add_argument("--per-language", type=int, default=4000, help="training utterances per language")
    parser.add_argument("--budget-minutes", type=float, default=defaults.budget_minutes,
                        help="wall-clock training budget (the LR schedule spans it); unused with --steps")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="train exactly this many steps, the LR schedule spanning them: repeatable from --seed "
                             "with the same --threads and corpus (0: the wall-clock budget)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--corpus-seed", type=int, default=None,
                        help="the seed of the training corpus's synthesis (default: --seed); an existing corpus made "
                             "with another seed is refused")
    parser.add_argument("--vocab", type=int, default=defaults.sentencepiece_vocab, help="SentencePiece pieces")
    parser.add_argument("--encoder-layers", type=int, default=defaults.encoder_num_hidden_layers,
                        help="Conformer encoder layers (encoder_config.num_hidden_layers)")
    parser.add_argument("--decoder-layers", type=int, default=defaults.num_hidden_layers,
                        help="Transformer decoder layers (num_hidden_layers)")
    parser.add_argument("--shortest-first-epochs", type=int, default=defaults.shortest_first_epochs,
                        help="run the first N epochs' batches shortest clips first instead of in random order "
                             "(a curriculum; 0: random order throughout, as the committed model was trained)")
    parser.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing,
                        help="label smoothing of the decoder's cross-entropy, in [0, 1) (0: none, as the committed "
                             "model was trained)")
    parser.add_argument("--decoder-attention-dropout", type=float, default=defaults.decoder_attention_dropout,
                        help="dropout on the decoder's attention weights while training, in [0, 1) (0: none, as the "
                             "committed model was trained; the saved config has 0)")
    parser.add_argument("--stop-after", type=int, default=0, metavar="N",
                        help="with --steps: end this run after N steps of the schedule, the training state saved in "
                             "the cache folder, no checkpoint written; the same command with --resume continues it "
                             "(a training longer than one session)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the training state a run with the same options left (at --stop-after, or at "
                             "its last periodic check if it was killed); with --steps, the weights end as one "
                             "uninterrupted run's")
    parser.add_argument("--init-from", default="", metavar="CHECKPOINT",
                        help="start from this checkpoint folder's tokenizer and weights (fine-tuning) instead of a new "
                             "tokenizer and random weights; its sizes must be the model options'")
    parser.add_argument("--peak-lr", type=float, default=defaults.peak_lr,
                        help="the learning rate after warm-up (lower for --init-from)")
    parser.add_argument("--eval-every-minutes", type=float, default=defaults.eval_every_minutes)
    parser.add_argument("--feature-workers", type=int, default=defaults.feature_workers)
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch threads of the training loop (2 on an idle 2-core machine)")
    parser.add_argument("--recipe", choices=["commands", "varied"], default="commands",
                        help="corpus recipe when the training corpus is synthesised (synth.RECIPES)")
    parser.add_argument("--sentence-weights", default=None, metavar="P1,P2,P3,P4",
                        help="recipe varied: the probabilities of 1, 2, 3 and 4 sentences per clip (default "
                             + ",".join(f"{w:g}" for w in VARIED_SENTENCE_WEIGHTS) + ")")
    parser.add_argument("--snr-db", default=None, metavar="LOW,HIGH",
                        help="recipe varied: the range of the white noise's SNR in dB (default "
                             + ",".join(f"{x:g}" for x in VARIED_SNR_DB) + ")")
    parser.add_argument("--same-template", type=float, default=None, metavar="P",
                        help="recipe varied: the chance that each sentence after a clip's first repeats the template "
                             "of the one before it (two digit strings side by side; default 0: independent draws)")
    parser.add_argument("--synth-workers", type=int, default=2, help="espeak-ng processes of that synthesis")
    parser.add_argument("--robustness", default=None,
                        help="a folder of tools/data/make_heldout_set.py (single/, padded/, multi/): evaluated too, in the card")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1 (got {args.threads})")
    if args.shortest_first_epochs < 0:
        parser.error(f"--shortest-first-epochs must be at least 0 (got {args.shortest_first_epochs})")
    for flag, value in (("--label-smoothing", args.label_smoothing),
                        ("--decoder-attention-dropout", args.decoder_attention_dropout)):
        if not 0.0 <= value < 1.0:
            parser.error(f"{flag} must be at least 0 and below 1 (got {value:g})")
    if not args.peak_lr > 0:
        parser.error(f"--peak-lr must be above 0 (got {args.peak_lr})")
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        parser.error(f"--init-from {args.init_from}: not a checkpoint folder (no config.json)")
    if args.steps < 0:
        parser.error(f"--steps must be at least 0 (got {args.steps}; 0 uses the wall-clock budget)")
    if args.stop_after and not 0 < args.stop_after < args.steps:
        parser.error(f"--stop-after needs --steps and a value between 0 and it (got --stop-after {args.stop_after}, "
                     f"--steps {args.steps})")
    for flag, value in (("--encoder-layers", args.encoder_layers), ("--decoder-layers", args.decoder_layers)):
        if value < 1:
            parser.error(f"{flag} must be at least 1 (got {value})")
    if args.robustness:  # checked before hours of training, not after them
        from cohere_coreml_dev.heldout import missing_subsets

        missing = missing_subsets(args.robustness)
        if missing:
            parser.error(f"--robustness {args.robustness}: no {', '.join(missing)}/manifest.json (make the set with "
                         f"tools/data/make_heldout_set.py --out {args.robustness}, --single to derive it from a single/ folder)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from cohere_coreml_dev.evaluate import evaluate_checkpoint, format_reports
    from cohere_coreml_dev.synth import SynthError, make_corpus
    from cohere_coreml_dev.train import TrainingError, folder_size_bytes, train, write_model_card

    languages = [l.strip() for l in args.languages.split(",") if l.strip()]
    try:
        options = corpus_options(parser, args)
        corpus_seed = args.seed if args.corpus_seed is None else args.corpus_seed
        if not (Path(args.train_dir) / "manifest.json").exists():
            make_corpus(args.train_dir, languages, args.per_language, split="train", seed=corpus_seed,
                        recipe=args.recipe, workers=args.synth_workers, options=options)
        else:  # an existing corpus is used as it is: it must be the one asked for
            check_corpus(args.train_dir, recipe=args.recipe, options=options, seed=corpus_seed, languages=languages,
                         per_language=args.per_language)
        cfg = TrainConfig(
            train_dir=args.train_dir, heldout_dir=args.heldout_dir, out_dir=args.out, cache_dir=args.cache_dir,
            budget_minutes=args.budget_minutes, seed=args.seed, sentencepiece_vocab=args.vocab,
            eval_every_minutes=args.eval_every_minutes, feature_workers=args.feature_workers,
            threads=args.threads, steps=args.steps,
            encoder_num_hidden_layers=args.encoder_layers, num_hidden_layers=args.decoder_layers,
            shortest_first_epochs=args.shortest_first_epochs, label_smoothing=args.label_smoothing,
            decoder_attention_dropout=args.decoder_attention_dropout, stop_after=args.stop_after, resume=args.resume,
            init_from=args.init_from, peak_lr=args.peak_lr,
        )
        result = train(cfg)
    except (SynthError, TrainingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not result.finished:
        print(f"stopped after {result.steps} of {cfg.steps} steps (session {result.sessions}); no checkpoint yet. "
              f"The same command with --resume continues it (training state: {result.state_path})", file=sys.stderr)
        return 0

    reports = evaluate_checkpoint(args.out, args.heldout_dir)
    print(format_reports(reports))
    import numpy as np

    from cohere_coreml.model.audio import FrontEndConfig
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.tokens import BYTE_TOKENS, SPECIAL_TOKENS
    from cohere_coreml_dev.evaluate import greedy_decode, load_eval_set
    from cohere_coreml_dev.synth import read_manifest

    model, processor = load_reference(args.out)
    feats, texts, langs, _ = load_eval_set(args.heldout_dir, FrontEndConfig.from_processor(processor, dither=0.0))
    decoded = greedy_decode(model, processor.tokenizer, feats, langs)
    margins = np.concatenate([np.asarray(d.margins) for d in decoded])
    manifest = read_manifest(args.train_dir)
    tok = processor.tokenizer
    summary = {
        "overall_margin": {
            "median": float(np.median(margins)),
            "p10": float(np.percentile(margins, 10)),
            "under_1nat": float(np.mean(margins < 1.0)),
        },
        "pieces": len(tok) - len(SPECIAL_TOKENS) - len(BYTE_TOKENS),
        "tokens": len(tok),
        "vocab_size": model.config.vocab_size,
        "train_clips": len(manifest["utterances"]),
        "train_hours": sum(u["seconds"] for u in manifest["utterances"]) / 3600,
        "recipe": manifest.get("recipe", "commands"),
        "recipe_options": manifest.get("recipe_options"),
    }
    robustness = None
    if args.robustness:
        from cohere_coreml_dev.evaluate import evaluate_robustness

        robustness = evaluate_robustness(args.out, args.robustness)
        summary["robustness_wer"] = {name: {k: r.wer for k, r in reps.items()} for name, reps in robustness.items()}
    summary["size_mb"] = folder_size_bytes(args.out) / 1e6  # before the card; the card adds ~3 kB
    command = "uv run python tools/train/train_tiny.py " + " ".join(shlex.quote(a) for a in reproduce_args(argv or sys.argv[1:]))
    write_model_card(args.out, cfg, result, reports, command, summary, robustness)
    summary["size_mb"] = folder_size_bytes(args.out) / 1e6
    summary.update(
        train_minutes=result.train_seconds / 60, total_minutes=result.total_seconds / 60, steps=result.steps,
        wer={k: r.wer for k, r in reports.items()},
        median_margin={k: r.median_margin for k, r in reports.items()},
        errors={k: r.errors for k, r in reports.items()},
        history=result.history,
    )
    print(json.dumps(summary, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
