"""Train a small Cohere-architecture ASR model on synthetic speech (CPU, one thread by default, wall-clock budget
or a fixed step count).

The model is the exact `transformers` `CohereAsrForConditionalGeneration` with small widths; it is
trained with the real decoder prompt format and the project's own front end, then saved as a
Hugging Face folder that `cohere_coreml.model.checkpoint.load_reference` loads. Recipe (see
`shared/reference/training-small-model.md`): Kaiming re-init of the conv subsampling, an auxiliary
CTC loss on the encoder output (training only, not saved), AdamW with warmup and cosine decay over
the wall-clock budget (or over `steps`, which makes a run repeatable from its seed and thread count),
length-sorted batches capped in feature frames, light SpecAugment.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training data missing or inconsistent, or a run that cannot proceed."""


@dataclass
class TrainConfig:
    train_dir: str
    heldout_dir: str
    out_dir: str
    cache_dir: str = "/tmp/training/cache"
    budget_minutes: float = 45.0
    # > 0: train exactly this many steps, the LR schedule spanning them (the budget is then not used): the
    # same seed, threads and corpus give the same weights on the same machine type
    steps: int = 0
    seed: int = 0
    # tokenizer
    sentencepiece_vocab: int = 384
    # model (encoder: parakeet_encoder fields; decoder: top-level CohereAsrConfig fields)
    encoder_hidden_size: int = 144
    encoder_num_hidden_layers: int = 4
    encoder_num_attention_heads: int = 4
    encoder_intermediate_size: int = 576
    encoder_subsampling_factor: int = 8
    encoder_subsampling_conv_channels: int = 32
    encoder_conv_kernel_size: int = 9
    num_mel_bins: int = 128
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    # optimisation
    peak_lr: float = 1.5e-3
    warmup_steps: int = 400
    warmup_fraction: float = 0.08
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    max_batch_frames: int = 12000
    ctc_weight: float = 0.3
    # the first epochs' batches shortest first instead of in random order (0: none, the committed model's)
    shortest_first_epochs: int = 0
    encoder_dropout: float = 0.1
    # the decoder's regularisation (0: none, the committed model's): dropout on its self- and cross-attention
    # weights (`config.attention_dropout`, the only dropout transformers' Cohere ASR decoder has) and label
    # smoothing of its cross-entropy; both off in the saved checkpoint's config (training only)
    decoder_attention_dropout: float = 0.0
    label_smoothing: float = 0.0
    freq_masks: int = 2
    freq_mask_width: int = 12
    time_masks: int = 1
    time_mask_width: int = 20
    punctuation: bool = True
    eval_every_minutes: float = 5.0
    eval_clips_per_language: int = 10
    eval_max_new_tokens: int = 48
    feature_workers: int = 2
    save_dtype: str = "float16"
    # torch intra-op threads of the training loop (1: the figures of a shared machine; 2 on an idle 2-core one)
    threads: int = 1
    # > 0 (with `steps`): end this run after that many steps of the schedule, its training state saved
    # (`train_state_path`) for a run with `resume` to continue: one training over several sessions
    stop_after: int = 0
    # continue from the training state a run with the same options saved (at `stop_after` or at a periodic
    # check); with `steps`, the weights end as one uninterrupted run's
    resume: bool = False
    # a checkpoint folder (the released format) to start from: its tokenizer and weights instead of a new
    # tokenizer and random weights (fine-tuning); its architecture must be the model fields' above
    init_from: str = ""

    def model_overrides(self) -> dict:
        keys = [
            "encoder_hidden_size", "encoder_num_hidden_layers", "encoder_num_attention_heads",
            "encoder_intermediate_size", "encoder_subsampling_factor", "encoder_subsampling_conv_channels",
            "encoder_conv_kernel_size", "num_mel_bins", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "intermediate_size", "max_position_embeddings",
        ]
        out = {k: getattr(self, k) for k in keys}
        out["num_key_value_heads"] = self.num_attention_heads
        return out


# TrainConfig fields a resumed run may change: where things are (the corpus is checked by its manifest's
# digest instead), how often it checks, when it stops
RESUMABLE_CHANGES = ("train_dir", "out_dir", "cache_dir", "heldout_dir", "eval_every_minutes", "eval_clips_per_language",
                     "eval_max_new_tokens", "feature_workers", "stop_after", "resume")


def train_state_path(cfg: TrainConfig) -> Path:
    """Where a run keeps its training state (in the cache folder, named after the output folder)."""
    digest = hashlib.sha256(str(Path(cfg.out_dir).resolve()).encode()).hexdigest()[:12]
    return Path(cfg.cache_dir) / f"train-state-{digest}.pt"


def _starting_checkpoint(cfg: TrainConfig):
    """(model, tokenizer) of `cfg.init_from`, after checking that its architecture is the configured one."""
    from cohere_coreml.model.checkpoint import CheckpointError, load_reference

    from .checkpoints import build_config

    try:
        base, processor = load_reference(cfg.init_from)
    except CheckpointError as err:
        raise TrainingError(f"init_from: {err}") from None
    tokenizer = processor.tokenizer
    want = build_config(tokenizer, **cfg.model_overrides())
    have = base.config

    def field(config, name):  # build_config's naming: encoder fields as encoder_<field>, and num_mel_bins
        if name == "num_mel_bins":
            return config.encoder_config.num_mel_bins
        if name.startswith("encoder_"):
            return getattr(config.encoder_config, name[len("encoder_"):])
        return getattr(config, name)

    names = [*cfg.model_overrides(), "vocab_size"]
    differ = [f"{name} {field(want, name)} here, {field(have, name)} there" for name in names
              if field(want, name) != field(have, name)]
    if differ:
        raise TrainingError(f"init_from {cfg.init_from}: its architecture is not the configured one ("
                            + "; ".join(differ) + "): pass its sizes (e.g. --encoder-layers, --decoder-layers)")
    return base, tokenizer


def _resume_options(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}))


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_sentencepiece(texts: list[str], vocab_size: int, seed: int = 0) -> list[tuple[str, float]]:
    """Unigram SentencePiece pieces [(piece, score)] trained on `texts` (identity normalisation)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    pieces = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i) or sp.is_control(i):
            continue
        pieces.append((sp.id_to_piece(i), float(sp.get_score(i))))
    return pieces


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------


def _features_of(path: str) -> np.ndarray:
    import torch

    from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel

    torch.set_num_threads(1)
    feats, n_valid = log_mel(load_audio(path), FrontEndConfig(dither=0.0))
    return feats[:, :n_valid].T.astype(np.float16)  # (frames, n_mels)


def cached_features(directory: Path, files: list[str], cache_dir: Path, workers: int = 1):
    """(features (total_frames, n_mels) float16, offsets (n+1,)) of every file, cached on disk."""
    from tqdm import tqdm

    key = hashlib.sha1(("\n".join(files) + str((directory / "manifest.json").stat().st_mtime)).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir / f"features_{key}.npz"
    if cache.exists():
        data = np.load(cache)
        logger.info("features from cache %s", cache)
        return data["features"], data["offsets"]
    paths = [str(directory / f) for f in files]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            feats = list(tqdm(pool.map(_features_of, paths, chunksize=32), total=len(paths), desc="features"))
    else:
        feats = [_features_of(p) for p in tqdm(paths, desc="features")]
    offsets = np.concatenate([[0], np.cumsum([f.shape[0] for f in feats])]).astype(np.int64)
    features = np.concatenate(feats, axis=0)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, features=features, offsets=offsets)
    os.replace(tmp, cache)
    return features, offsets


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def make_batches(lengths: np.ndarray, max_frames: int, rng: np.random.Generator,
                 shuffle: bool = True) -> list[np.ndarray]:
    """Length-sorted batches with (batch size x longest clip) <= max_frames, in random order (without
    `shuffle`: shortest first, the SortaGrad curriculum of Amodei et al. 2016, "Deep Speech 2")."""
    order = np.argsort(lengths + rng.uniform(0, 1, lengths.shape), kind="stable")
    batches, current, longest = [], [], 0
    for i in order:
        longest_new = max(longest, int(lengths[i]))
        if current and longest_new * (len(current) + 1) > max_frames:
            batches.append(np.asarray(current))
            current, longest_new = [], int(lengths[i])
        current.append(int(i))
        longest = longest_new
    if current:
        batches.append(np.asarray(current))
    if shuffle:
        rng.shuffle(batches)
    return batches


def spec_augment(x, lengths, cfg: TrainConfig, gen):
    """In-place frequency and time masks on (B, T, n_mels) normalised features (mask value 0)."""
    import torch

    b, _, n_mels = x.shape
    for i in range(b):
        for _ in range(cfg.freq_masks):
            w = int(torch.randint(0, cfg.freq_mask_width + 1, (1,), generator=gen))
            f0 = int(torch.randint(0, max(1, n_mels - w), (1,), generator=gen))
            x[i, :, f0 : f0 + w] = 0.0
        for _ in range(cfg.time_masks):
            w = int(torch.randint(0, cfg.time_mask_width + 1, (1,), generator=gen))
            t0 = int(torch.randint(0, max(1, int(lengths[i]) - w), (1,), generator=gen))
            x[i, t0 : t0 + w, :] = 0.0
    return x


def lr_factor(step: int, elapsed_fraction: float, cfg: TrainConfig) -> float:
    """Linear warmup (ends after `warmup_steps` or `warmup_fraction` of the budget, whichever is first),
    then cosine decay to `final_lr_fraction` at the end of the wall-clock budget."""
    warm = max((step + 1) / cfg.warmup_steps, elapsed_fraction / cfg.warmup_fraction)
    if warm < 1.0:
        return warm
    frac = min(1.0, max(0.0, elapsed_fraction))
    return cfg.final_lr_fraction + (1 - cfg.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out_dir: str
    steps: int
    epochs: float
    train_seconds: float
    total_seconds: float
    parameters: int
    history: list[dict] = field(default_factory=list)
    # False: stopped at `stop_after`, no checkpoint written; `state_path` holds the state to resume from
    finished: bool = True
    sessions: int = 1  # runs the training took (1 + resumptions)
    state_path: str | None = None


def next_check(elapsed: float, every: float) -> float:
    """When the periodic held-out check runs next: the first multiple of `every` after `elapsed` (seconds),
    so a pause (a stopped process, a busy machine) gives one check, not one per interval it missed."""
    return (elapsed // every + 1) * every


def train(cfg: TrainConfig) -> TrainResult:
    """Run the whole recipe and save the checkpoint folder to `cfg.out_dir`."""
    if cfg.threads < 1:
        raise TrainingError(f"threads must be >= 1, got {cfg.threads}")
    if not cfg.peak_lr > 0:
        raise TrainingError(f"peak_lr must be > 0, got {cfg.peak_lr}")
    if cfg.steps < 0:
        raise TrainingError(f"steps must be >= 0 (0: the wall-clock budget), got {cfg.steps}")
    if cfg.stop_after and not 0 < cfg.stop_after < cfg.steps:
        raise TrainingError(f"stop_after must be between 0 and steps ({cfg.steps}; it needs a step count), "
                            f"got {cfg.stop_after}")
    state_path = train_state_path(cfg)
    if cfg.resume and not state_path.is_file():
        raise TrainingError(f"nothing to resume: no training state for {cfg.out_dir} ({state_path}); "
                            "a run saves one at its checks and at stop_after")
    for name in ("encoder_num_hidden_layers", "num_hidden_layers"):
        if getattr(cfg, name) < 1:
            raise TrainingError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("decoder_attention_dropout", "label_smoothing"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise TrainingError(f"{name} must be in [0, 1), got {getattr(cfg, name)}")
    import torch
    import torch.nn.functional as F
    from transformers import CohereAsrForConditionalGeneration

    from cohere_coreml.model.audio import FrontEndConfig
    from cohere_coreml.model.tokens import eos_id, prompt_ids

    from .checkpoints import build_config, init_subsampling, save_checkpoint
    from .evaluate import greedy_decode, load_eval_set, summarise
    from .synth import read_manifest

    t_start = time.time()
    torch.set_num_threads(cfg.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started in this process
        pass
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)

    train_dir = Path(cfg.train_dir)
    manifest = read_manifest(train_dir)
    utts = manifest.get("utterances") or []
    if not utts:
        raise TrainingError(f"{train_dir}/manifest.json has no utterances")
    texts = [u["text"] for u in utts]
    langs = [u["language"] for u in utts]
    # sentences: a clip of recipe "varied" holds several (synth.Utterance.sentences)
    heldout_texts = {s for u in read_manifest(cfg.heldout_dir)["utterances"] for s in u.get("sentences") or [u["text"]]}
    overlap = heldout_texts & {s for u in utts for s in u.get("sentences") or [u["text"]]}
    if overlap:
        raise TrainingError(f"{len(overlap)} held-out sentences occur in the training set, e.g. {sorted(overlap)[0]!r}")

    # tokenizer: trained on the corpus, or the starting checkpoint's
    base = None
    if cfg.init_from:
        base, tokenizer = _starting_checkpoint(cfg)
    else:
        from .tokenizer import build_tokenizer

        tokenizer = build_tokenizer(train_sentencepiece(texts, cfg.sentencepiece_vocab, cfg.seed))
    eos = eos_id(tokenizer)
    pad = tokenizer.pad_token_id
    token_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    unk = tokenizer.unk_token_id
    n_unk = sum(ids.count(unk) for ids in token_ids)
    if n_unk:
        raise TrainingError(f"{n_unk} <unk> tokens in the training transcripts: tokenizer does not cover the text")
    prompts = {lang: prompt_ids(tokenizer, lang, cfg.punctuation) for lang in sorted(set(langs))}
    logger.info(
        "tokenizer: %d tokens%s; mean %.1f tokens per transcript", len(tokenizer),
        f" (of {cfg.init_from})" if cfg.init_from else "", float(np.mean([len(t) for t in token_ids])),
    )

    # features
    features, offsets = cached_features(train_dir, [u["file"] for u in utts], Path(cfg.cache_dir), cfg.feature_workers)
    lengths = np.diff(offsets)
    logger.info("features: %d clips, %.2f h, %.0f MB", len(utts), lengths.sum() / 100 / 3600, features.nbytes / 1e6)
    eval_cfg = FrontEndConfig(dither=0.0)
    ev_feats, ev_texts, ev_langs, _ = load_eval_set(cfg.heldout_dir, eval_cfg, cfg.eval_clips_per_language)

    # model
    config = build_config(tokenizer, **cfg.model_overrides())
    config.encoder_config.dropout = cfg.encoder_dropout
    config.attention_dropout = cfg.decoder_attention_dropout
    model = CohereAsrForConditionalGeneration(config)
    init_subsampling(model, generator=torch.Generator().manual_seed(cfg.seed))
    if base is not None:  # the same architecture and tokenizer (checked): its weights, in float32
        model.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
        del base
    ctc_head = torch.nn.Linear(config.encoder_config.hidden_size, config.vocab_size)  # training only
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %.2f M parameters, vocab %d", n_params / 1e6, config.vocab_size)

    params = list(model.parameters()) + list(ctc_head.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.peak_lr, betas=cfg.betas,
    )
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    budget = cfg.budget_minutes * 60.0
    history: list[dict] = []
    step, epoch, seen, first_batch, sessions = 0, 0, 0, 0, 1
    losses: list[float] = []
    before_train, before_total = 0.0, 0.0  # seconds of the earlier sessions (resume)
    corpus = hashlib.sha256((train_dir / "manifest.json").read_bytes()).hexdigest()
    if cfg.resume:
        state = torch.load(state_path, weights_only=True)
        saved, now = state["options"], _resume_options(cfg)
        changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        if changed:
            raise TrainingError(f"cannot resume from {state_path}: its run had other options ("
                                + ", ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} here" for k in changed)
                                + "); pass the same options, or drop --resume to start again")
        if state["corpus"] != corpus:
            raise TrainingError(f"cannot resume from {state_path}: {train_dir}/manifest.json is not the corpus it "
                                "was trained on")
        model.load_state_dict(state["model"])
        ctc_head.load_state_dict(state["ctc_head"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, seen, first_batch = state["step"], state["epoch"], state["seen"], state["batch"]
        rng.bit_generator.state = state["epoch_rng"]  # as the epoch began: the same batches, in the same order
        gen.set_state(state["augment_rng"])
        torch.set_rng_state(state["torch_rng"])
        losses, history = list(state["losses"]), list(state["history"])
        before_train, before_total, sessions = state["train_seconds"], state["total_seconds"], state["sessions"] + 1
        if cfg.stop_after and cfg.stop_after <= step:
            raise TrainingError(f"stop_after {cfg.stop_after} is not after the saved state's step {step}")
        logger.info("resumed from %s at step %d (epoch %d, batch %d; session %d)", state_path, step, epoch,
                    first_batch, sessions)

    def save_state(batch_index: int, epoch_rng: dict) -> None:
        """Everything the rest of the run depends on, written whole (a temporary file, then renamed)."""
        state = {"options": _resume_options(cfg), "corpus": corpus, "model": model.state_dict(),
                 "ctc_head": ctc_head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "epoch": epoch, "batch": batch_index, "seen": seen, "epoch_rng": epoch_rng,
                 "augment_rng": gen.get_state(), "torch_rng": torch.get_rng_state(), "losses": losses[-50:],
                 "history": history, "train_seconds": time.time() - t_train,
                 "total_seconds": before_total + time.time() - t_start, "sessions": sessions}
        state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, state_path)

    t_train = time.time() - before_train
    next_eval = next_check(before_train, cfg.eval_every_minutes * 60.0)
    logger.info("training state: %s (saved at each check%s; --resume continues from it)", state_path,
                f" and at step {cfg.stop_after}" if cfg.stop_after else "")
    done = stopped = False
    while not done:
        epoch_rng = rng.bit_generator.state
        batches = make_batches(lengths, cfg.max_batch_frames, rng, shuffle=epoch >= cfg.shortest_first_epochs)
        for index in range(first_batch, len(batches)):
            batch = batches[index]
            elapsed = time.time() - t_train
            if (step >= cfg.steps) if cfg.steps else (elapsed >= budget):
                done = True
                break
            progress = step / cfg.steps if cfg.steps else elapsed / budget  # the LR schedule's clock
            model.train()
            # inputs: (B, T, n_mels) features, (B, T) mask
            t_max = int(lengths[batch].max())
            x = torch.zeros(len(batch), t_max, cfg.num_mel_bins)
            mask = torch.zeros(len(batch), t_max, dtype=torch.long)
            for row, i in enumerate(batch):
                f = features[offsets[i] : offsets[i + 1]]
                x[row, : f.shape[0]] = torch.from_numpy(f.astype(np.float32))
                mask[row, : f.shape[0]] = 1
            spec_augment(x, lengths[batch], cfg, gen)
            # decoder: prompt + transcript (+ eos as the last target); loss on transcript and eos only
            seqs = [prompts[langs[i]] + token_ids[i] + [eos] for i in batch]
            n_prompt = [len(prompts[langs[i]]) for i in batch]
            l_max = max(len(s) for s in seqs) - 1
            dec_in = torch.full((len(batch), l_max), pad, dtype=torch.long)
            target = torch.full((len(batch), l_max), -100, dtype=torch.long)
            for row, s in enumerate(seqs):
                dec_in[row, : len(s) - 1] = torch.tensor(s[:-1])
                p = n_prompt[row]
                target[row, p - 1 : len(s) - 1] = torch.tensor(s[p:])

            with torch.enable_grad():  # whatever the calling thread set (an export or a verify turns it off)
                enc = model.model.encoder(input_features=x, attention_mask=mask)
                out = model(encoder_outputs=enc, decoder_input_ids=dec_in)
                logits, flat = out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1)
                ce = F.cross_entropy(logits, flat, ignore_index=-100, label_smoothing=cfg.label_smoothing)
                if cfg.label_smoothing:  # the logged CE stays the plain one, comparable between runs
                    with torch.no_grad():
                        plain_ce = F.cross_entropy(logits, flat, ignore_index=-100)
                else:
                    plain_ce = ce
                # auxiliary CTC on the encoder output (blank = pad)
                log_probs = ctc_head(enc.last_hidden_state).log_softmax(-1).transpose(0, 1)  # (T', B, V)
                in_lens = enc.attention_mask.sum(-1).long()
                ctc_targets = torch.tensor([t for i in batch for t in token_ids[i]], dtype=torch.long)
                tgt_lens = torch.tensor([len(token_ids[i]) for i in batch], dtype=torch.long)
                ctc = F.ctc_loss(log_probs, ctc_targets, in_lens, tgt_lens, blank=pad, zero_infinity=True)
                loss = ce + cfg.ctc_weight * ctc

            for group in optimizer.param_groups:
                group["lr"] = cfg.peak_lr * lr_factor(step, progress, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            step += 1
            seen += len(batch)
            losses.append(float(plain_ce.detach()))
            if step % 50 == 0:
                logger.info(
                    "step %d epoch %.2f %.1f min: ce %.3f ctc %.3f lr %.2e (%.2f s/step)",
                    step, seen / len(utts), elapsed / 60, float(np.mean(losses[-50:])), float(ctc.detach()),
                    optimizer.param_groups[0]["lr"], elapsed / step,
                )
            if time.time() - t_train >= next_eval:
                next_eval = next_check(time.time() - t_train, cfg.eval_every_minutes * 60.0)
                model.eval()
                decoded = greedy_decode(model, tokenizer, ev_feats, ev_langs, max_new_tokens=cfg.eval_max_new_tokens)
                reports = summarise(ev_texts, decoded, ev_langs)
                entry = {
                    "minute": round((time.time() - t_train) / 60, 2),
                    "step": step,
                    "ce": float(np.mean(losses[-50:])),
                    "wer": {k: round(r.wer, 4) for k, r in reports.items()},
                    "median_margin": {k: round(r.median_margin, 2) for k, r in reports.items()},
                }
                history.append(entry)
                logger.info("eval: %s", json.dumps(entry))
                save_state(index + 1, epoch_rng)
            if step == cfg.stop_after:
                save_state(index + 1, epoch_rng)
                done = stopped = True
                break
        first_batch = 0
        if not done:
            epoch += 1
    train_seconds = time.time() - t_train
    if stopped:
        logger.info("stopped after %d of %d steps (%.1f min training); the training state is in %s", step,
                    cfg.steps, train_seconds / 60, state_path)
        return TrainResult(cfg.out_dir, step, seen / len(utts), train_seconds, before_total + time.time() - t_start,
                           n_params, history, finished=False, sessions=sessions, state_path=str(state_path))

    # save: exact architecture (no CTC head), dropout off, fp16 weights
    model.eval()
    model.config.encoder_config.dropout = 0.0
    model.config.attention_dropout = 0.0
    if cfg.save_dtype == "float16":
        model = model.to(torch.float16)
    from transformers import CohereAsrFeatureExtractor

    fe = CohereAsrFeatureExtractor(feature_size=cfg.num_mel_bins)
    save_checkpoint(model, tokenizer, cfg.out_dir, feature_extractor=fe)
    state_path.unlink(missing_ok=True)  # the checkpoint is complete: nothing left to resume
    total = before_total + time.time() - t_start
    logger.info("saved %s after %d steps (%.1f min training, %.1f min total)", cfg.out_dir, step, train_seconds / 60, total / 60)
    return TrainResult(cfg.out_dir, step, seen / len(utts), train_seconds, total, n_params, history, sessions=sessions)


# ----------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------


def folder_size_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def machine_description() -> str:
    """The CPU the card's timings come from: model name (Linux /proc/cpuinfo, else `platform`) and core count."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def data_description(recipe: str, options: dict | None = None) -> str:
    """The model card's words for a corpus recipe (synth.RECIPES), from the recipe's own constants and the
    corpus's `recipe_options` (recipe "varied": sentence weights, SNR range, same-template share; its defaults
    when None)."""
    from . import synth

    if recipe == "varied":
        options = synth.varied_options(**(options or {}))
        snr = options["snr_db"]
        weights = ", ".join(f"{k}: {100 * w:.0f} %" for k, w in zip(synth.VARIED_SENTENCES, options["sentence_weights"]))
        return (f"1-{max(synth.VARIED_SENTENCES)} sentences per clip ({weights}) joined with "
                f"{synth.VARIED_PAUSE_S[0]}-{synth.VARIED_PAUSE_S[1]} s pauses; leading and trailing silence "
                f"{synth.VARIED_EDGE_S[0]:.0f}-{synth.VARIED_EDGE_S[1]:.0f} s on {100 * synth.VARIED_LONG_EDGES:.0f} % of the "
                f"clips ({synth.VARIED_SHORT_EDGE_S[0]:.0f}-{synth.VARIED_SHORT_EDGE_S[1]} s on the others), digital zeros on "
                f"{100 * synth.VARIED_DIGITAL_EDGES:.0f} % of them, noise on the rest; peak level "
                f"{synth.VARIED_LEVEL_DBFS[0]:.0f}..{synth.VARIED_LEVEL_DBFS[1]:.0f} dBFS; white noise at "
                f"{snr[0]:g}-{snr[1]:g} dB SNR; "
                + (f"each sentence after a clip's first of its predecessor's template with chance "
                   f"{100 * options['same_template']:g} % (else drawn on its own); " if options.get("same_template") else "")
                + "one voice per clip except on "
                f"{100 * synth.VARIED_MIXED_SHARE:.0f} % of the clips of 2+ sentences, whose sentences each have their own "
                f"voice, variant, pitch, level and noise; speed 120-200 wpm "
                f"(each sentence +-{synth.VARIED_SPEED_JITTER}), pitch 30-70; voice variants "
                f"{', '.join(synth.VARIED_HELDOUT_VARIANTS)} kept for the held-out set (`--recipe varied`)")
    return ("several voices and variants, speed 120-200 wpm, pitch 30-70, random gain and leading/trailing "
            "silence, white noise at 15-40 dB SNR")


def robustness_rows(robustness: dict) -> str:
    """Markdown rows: per subset and language, WER with its interval and the median margin (the ratios to
    the single clips, with theirs, are the targets table's: `evaluate.format_targets`)."""
    rows = []
    for subset, reports in robustness.items():
        for lang, r in reports.items():
            ci = f"{100 * r.wer_interval[0]:.2f}-{100 * r.wer_interval[1]:.2f} %" if r.wer_interval else "-"
            rows.append(f"| {subset} | {lang} | {r.clips} | {r.words} | {100 * r.wer:.2f} % | {ci} | {r.median_margin:.2f} |")
    return "\n".join(rows)


# how a fresh checkout makes the committed robustness set (the folder a card's `--robustness` names)
ROBUSTNESS_SET_COMMAND = "uv run python tools/data/make_heldout_set.py --single tests/data/heldout-varied/single --out out/heldout-varied"


def reproduce_commands(checkpoint: str | Path) -> str | None:
    """The commands of a checkpoint card's Reproduce section (None without a card or the section)."""
    card = Path(checkpoint) / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    match = re.search(r"^## Reproduce\n```\n(.*?)\n```", text, flags=re.M | re.S)
    return match.group(1) if match else None


def write_model_card(out_dir: str | Path, cfg: TrainConfig, result: TrainResult, reports: dict, command: str,
                     train_summary: dict, robustness: dict | None = None) -> Path:
    """README.md of the trained checkpoint: data, purpose, measured figures, reproduce command;
    `robustness`: {subset: reports} of the robustness held-out set (tools/data/make_heldout_set.py)."""
    from .evaluate import format_targets, ratio_targets

    out_dir = Path(out_dir)
    all_margins = train_summary.get("overall_margin", {})
    rows = "\n".join(
        f"| {r.language} | {r.clips} | {r.words} | {100 * r.wer:.2f} % | {r.median_margin:.2f} | {r.p10_margin:.2f} |"
        for r in reports.values()
    )
    history = "\n".join(
        f"| {h['minute']:.1f} | {h['step']} | {h['ce']:.3f} | "
        + ", ".join(f"{k} {100 * v:.1f} %" for k, v in h["wer"].items()) + " |"
        for h in result.history
    )
    schedule = (f"{cfg.steps} steps (`--steps {cfg.steps}`: the same seed, thread count and corpus repeat these weights)"
                if cfg.steps else f"the {cfg.budget_minutes:g}-min wall-clock budget (a rerun's step count depends on the "
                f"machine; `--steps {result.steps}` repeats this run's length with a step-based schedule)")
    sessions = ("" if result.sessions == 1 else
                f"; in {result.sessions} sessions, `--stop-after` then `--resume`, which end with one run's weights")
    robustness_section = "" if not robustness else f"""Robustness held-out set (`tools/data/make_heldout_set.py`: held-out sentences, voice variants never
trained on; padded: the same clips with 0-2 s more silence each side; multi: the same clips joined 2-4
at a time):

| subset | language | clips | words | WER | 95 % CI | median margin |
|---|---|---|---|---|---|---|
{robustness_rows(robustness)}

{format_targets(ratio_targets(robustness))}

"""
    origin, tokenizer_origin, reproduce, chain = "trained from scratch", "training transcripts", command, ""
    if cfg.init_from:
        origin = (f"fine-tuned from `{cfg.init_from}` (its tokenizer and weights; {result.steps} steps on the corpus "
                  "below), itself trained from scratch")
        tokenizer_origin = "starting checkpoint's training transcripts"
        reproduce = "\n".join(filter(None, [reproduce_commands(cfg.init_from), command]))
        chain = (f"The last command is this fine-tuning; the ones before it are the starting checkpoint's (its card's), "
                 f"whose output folder is `{cfg.init_from}` here.\n" if reproduce != command else "")
    if robustness:
        chain += (f"`--robustness` is a set of `tools/data/make_heldout_set.py`; the committed one is `{ROBUSTNESS_SET_COMMAND}`.\n")
    card = f"""---
license: apache-2.0
tags: [cohere_asr, test-model, synthetic-speech]
---
# cohere-tiny-synth

A {result.parameters / 1e6:.2f} M-parameter `CohereAsrForConditionalGeneration` (the exact architecture of
Cohere Transcribe, with small widths) {origin} on synthetic espeak-ng speech.

**Purpose: tests and demos of the Core ML conversion pipeline, not real speech recognition.** It
transcribes short synthetic commands (timers, lights, times, dates, sums, colours, prices, phone
digits) in {", ".join(sorted(reports))}; its argmax decisions have large margins, so FP16/INT8 effects on an
exported model can be judged by transcripts. It knows nothing about natural speech.

## Architecture
- Encoder (`parakeet_encoder`): hidden {cfg.encoder_hidden_size}, {cfg.encoder_num_hidden_layers} layers,
  {cfg.encoder_num_attention_heads} heads, FFN {cfg.encoder_intermediate_size}, x{cfg.encoder_subsampling_factor}
  conv subsampling ({cfg.encoder_subsampling_conv_channels} channels), conv kernel {cfg.encoder_conv_kernel_size},
  {cfg.num_mel_bins} mel bins.
- Decoder: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads,
  FFN {cfg.intermediate_size}, {cfg.max_position_embeddings} positions.
- Tokenizer: {train_summary.get('pieces')} SentencePiece unigram pieces trained on the {tokenizer_origin}, plus the
  real special-token set (14 language tokens, `<|pnc|>`...) and 256 byte-fallback pieces
  ({train_summary.get('tokens')} tokens, vocab size {train_summary.get('vocab_size')}).
- Weights stored as float16 safetensors (load as float32 with `load_reference`).
- Trained with the `<|pnc|>` prompt only (transcripts have sentence case and punctuation); the
  `<|nopnc|>` prompt and other languages were never trained.

## Data
espeak-ng speech from a small generated grammar (11 templates per language; numbers, times, dates,
commands), `tools/data/make_synthetic_speech.py`: {train_summary.get('train_clips')} training utterances
({train_summary.get('train_hours', 0):.2f} h), {data_description(train_summary.get('recipe', 'commands'), train_summary.get('recipe_options'))}, seed {cfg.seed}.
Held-out set: `tests/data/heldout/` ({sum(r.clips for r in reports.values())} clips); every held-out sentence is a word combination
that never occurs in training.

## Measured (PyTorch greedy decoding of this folder, normalised WER with jiwer)

| language | clips | words | WER | median top-1 margin (nats) | 10th percentile |
|---|---|---|---|---|---|
{rows}

All languages: median top-1 vs top-2 log-prob margin per generated token {all_margins.get('median', float('nan')):.2f} nats,
10th percentile {all_margins.get('p10', float('nan')):.2f}, {100 * all_margins.get('under_1nat', float('nan')):.1f} % of tokens under 1 nat.

{robustness_section}Training: {result.train_seconds / 60:.1f} min of training ({result.steps} steps, {result.epochs:.1f} epochs) within
{result.total_seconds / 60:.1f} min in total (tokenizer, features, saving{sessions}), {cfg.threads} CPU thread(s) on
{machine_description()}; the learning-rate schedule spans {schedule}. Committed size: {train_summary.get('size_mb', 0):.2f} MB.
Regularisation while training (none of it in the saved config): encoder dropout {cfg.encoder_dropout:g}; SpecAugment,
{cfg.freq_masks} frequency masks of up to {cfg.freq_mask_width} mel bins and {cfg.time_masks} time mask(s) of up to
{cfg.time_mask_width} frames; an auxiliary CTC loss on the encoder (weight {cfg.ctc_weight:g}); decoder attention dropout
{cfg.decoder_attention_dropout:g}; label smoothing {cfg.label_smoothing:g} (the train CE below is the plain one).

WER on the first {cfg.eval_clips_per_language} held-out clips per language during training:

| minute | step | train CE | WER |
|---|---|---|---|
{history}

## Reproduce
```
{reproduce}
```
{chain}(needs `apt-get install espeak-ng`; timings depend on machine load, so results vary slightly.)
"""
    path = out_dir / "README.md"
    path.write_text(card)
    return path
