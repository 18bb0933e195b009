"""Checkpoints: load a Cohere Transcribe checkpoint, and make small ones in the same format.

`load_reference` is the one way the project reads a checkpoint (a Hugging Face Hub id, optionally at
a revision, or a local folder): the `transformers` reference model `CohereAsrForConditionalGeneration`
plus its `CohereAsrProcessor`, in eval mode, weights from safetensors only, never remote code.

`make_tiny_checkpoint` writes a complete Hugging Face folder with the exact architecture at small
widths, so every later stage can be tested here on checkpoints of any shape.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_HUB_ID, round_up

logger = logging.getLogger(__name__)

MODEL_TYPE = "cohere_asr"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Files a checkpoint needs; pickled weights (*.bin, *.pt) are never fetched nor loaded.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.md"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, of the wrong type, unsafe, or unreachable."""


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint came from (recorded in exported packages)."""

    model_id: str
    revision: str | None
    local_dir: Path


def resolve_checkpoint(model: str | os.PathLike, revision: str | None = None) -> CheckpointSource:
    """Local folder for `model` (a folder, or a Hub id fetched into the local cache)."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; a checkpoint is a folder with config.json and *.safetensors")
        return CheckpointSource(model_id=str(path.resolve()), revision=revision, local_dir=path)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") != 1 or os.sep + os.sep in text
    if looks_local or not _HUB_ID.match(text):
        raise CheckpointError(f"checkpoint folder {text!r} does not exist (and it is not a Hub id like 'owner/name')")
    return CheckpointSource(model_id=text, revision=revision, local_dir=_download(text, revision))


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    logger.info("fetching %s%s from the Hugging Face Hub", repo_id, f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise CheckpointError(
            f"the Hub has no accessible repository {repo_id!r} ({type(err).__name__}); check the id, "
            "or log in (HF_TOKEN) for gated models"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"repository {repo_id!r} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OSError) as err:
        raise CheckpointError(
            f"could not reach the Hugging Face Hub to fetch {repo_id!r} ({type(err).__name__}). "
            "Download the checkpoint on a machine with access and pass its local folder instead, "
            "e.g. `--model /path/to/cohere-transcribe-03-2026`."
        ) from None


def check_checkpoint_dir(path: Path) -> dict:
    """Validate a checkpoint folder before anything is loaded; returns its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from None
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"{path} holds a {model_type!r} checkpoint, not a Cohere Transcribe one (model_type {MODEL_TYPE!r})"
        )
    if not list(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
        extra = f" (found {', '.join(pickled)}: pickled weights are never loaded)" if pickled else ""
        raise CheckpointError(f"{path} has no *.safetensors weights{extra}")
    return config


def load_reference(model: str | os.PathLike = DEFAULT_HUB_ID, revision: str | None = None, dtype=None):
    """(model, processor): the `transformers` reference for a Hub id or a local folder.

    The model is a `CohereAsrForConditionalGeneration` in eval mode (float32 unless `dtype` is given),
    loaded from safetensors only, without remote code. Raises `CheckpointError` naming the problem.
    """
    import torch
    from transformers import AutoProcessor, CohereAsrForConditionalGeneration, CohereAsrProcessor

    source = resolve_checkpoint(model, revision)
    check_checkpoint_dir(source.local_dir)
    try:
        reference = CohereAsrForConditionalGeneration.from_pretrained(
            source.local_dir, use_safetensors=True, dtype=dtype or torch.float32
        )
        processor = AutoProcessor.from_pretrained(source.local_dir)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"could not load the checkpoint in {source.local_dir}: {err}") from err
    if not isinstance(processor, CohereAsrProcessor):
        raise CheckpointError(
            f"{source.local_dir} has a {type(processor).__name__}, not a CohereAsrProcessor "
            "(preprocessor_config.json / processor_config.json missing or of another model)"
        )
    reference.eval()
    reference.source = source  # where it came from, for package metadata
    return reference, processor


# --------------------------------------------------------------------------------------------------
# Small checkpoints in the released format
# --------------------------------------------------------------------------------------------------

# Decoder (top-level CohereAsrConfig) fields of the default tiny checkpoint.
TINY_DECODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=128,
    max_position_embeddings=1024,
)
# Encoder (parakeet_encoder) fields; overridable as `encoder_<field>=...`.
TINY_ENCODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=16,
    num_mel_bins=128,
)

# A small fixed piece inventory for random-weight tokenizers (bytes cover everything else).
_TINY_WORDS = (
    "the a to and of set timer for minutes seconds hours turn on off lights alarm at am pm one two three "
    "four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred what is plus "
    "minus red green blue call play stop next is it the de la el en le der die das und"
).split()


def tiny_pieces() -> list[tuple[str, float]]:
    pieces = [("\u2581" + w, -3.0 - 0.01 * i) for i, w in enumerate(dict.fromkeys(_TINY_WORDS))]
    pieces += [(c, -6.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,?!'-:"]
    pieces += [("\u2581" + c, -5.5) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return pieces


def build_config(tokenizer, vocab_size: int | None = None, **overrides):
    """A `CohereAsrConfig` whose special ids come from `tokenizer`.

    `overrides`: any top-level CohereAsrConfig field, any encoder field as `encoder_<field>`, and
    `num_mel_bins` (the encoder's input width and the feature extractor's mel count).
    """
    from transformers import CohereAsrConfig

    encoder = dict(TINY_ENCODER)
    decoder = dict(TINY_DECODER)
    for key, value in overrides.items():
        if key == "num_mel_bins":
            encoder["num_mel_bins"] = value
        elif key.startswith("encoder_"):
            encoder[key[len("encoder_"):]] = value
        else:
            decoder[key] = value
    known_decoder = set(CohereAsrConfig.__dataclass_fields__) if hasattr(CohereAsrConfig, "__dataclass_fields__") else None
    if known_decoder is not None:
        unknown = sorted(k for k in decoder if k not in known_decoder)
        if unknown:
            raise CheckpointError(f"unknown CohereAsrConfig field(s): {', '.join(unknown)}")
    n_tokens = len(tokenizer)
    vocab_size = vocab_size or decoder.pop("vocab_size", None) or round_up(n_tokens, 64)
    decoder.pop("vocab_size", None)
    if vocab_size < n_tokens:
        raise CheckpointError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokens} tokens")
    return CohereAsrConfig(
        encoder_config=encoder,
        vocab_size=vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("\u2581"),
        **decoder,
    )


def init_subsampling(model, generator=None) -> None:
    """Kaiming re-initialisation of the encoder's conv subsampling (see docs/training).

    With the default normal(0.02) init the subsampling stack outputs activations of std ~3e-7, so a
    random or freshly trained encoder effectively ignores its input. ReLU gain for the regular and
    pointwise convs, gain 1 for the depthwise ones, zero biases, fresh linear layer.
    """
    import torch
    from torch import nn

    subsampling = model.model.encoder.subsampling
    with torch.no_grad():
        for layer in subsampling.layers:
            if isinstance(layer, nn.Conv2d):
                depthwise = layer.groups > 1 and layer.groups == layer.in_channels
                nonlinearity = "linear" if depthwise else "relu"
                nn.init.kaiming_normal_(layer.weight, nonlinearity=nonlinearity, generator=generator)
                if layer.bias is not None:
                    layer.bias.zero_()
        subsampling.linear.reset_parameters()


def save_checkpoint(model, tokenizer, out_dir: str | os.PathLike, feature_extractor=None, force: bool = True) -> Path:
    """Write model + processor as a Hugging Face folder, atomically (temp folder, then rename)."""
    from transformers import CohereAsrFeatureExtractor, CohereAsrProcessor, GenerationConfig

    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise CheckpointError(f"{out_dir} exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if feature_extractor is None:
        feature_extractor = CohereAsrFeatureExtractor(feature_size=model.config.encoder_config.num_mel_bins)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.generation_config = GenerationConfig(
            decoder_start_token_id=model.config.decoder_start_token_id,
            bos_token_id=model.config.bos_token_id,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
            max_new_tokens=256,
        )
        model.save_pretrained(tmp)
        CohereAsrProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def make_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, **config_overrides) -> Path:
    """Write a complete random-weight Cohere Transcribe checkpoint folder with small widths.

    Loadable by `load_reference` and `AutoProcessor`. Its tokenizer carries the real special-token
    set and byte fallback. `config_overrides` reach every config field (see `build_config`).
    """
    import torch
    from transformers import CohereAsrForConditionalGeneration

    from .tokens import build_tokenizer

    tokenizer = build_tokenizer(tiny_pieces())
    config = build_config(tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = CohereAsrForConditionalGeneration(config)
    init_subsampling(model)
    model.eval()
    return save_checkpoint(model, tokenizer, out_dir)


def describe(model, processor) -> dict:
    """Shapes and ids of a loaded checkpoint (what `cohere-coreml info` prints)."""
    from .tokens import LANGUAGES, prompt_ids

    config = model.config
    enc = config.encoder_config
    n_params = sum(p.numel() for p in model.parameters())
    n_encoder = sum(p.numel() for p in model.model.encoder.parameters())
    fe = processor.feature_extractor
    return {
        "source": getattr(getattr(model, "source", None), "model_id", None),
        "parameters": n_params,
        "encoder_parameters": n_encoder,
        "encoder": {
            "hidden_size": enc.hidden_size,
            "layers": enc.num_hidden_layers,
            "heads": enc.num_attention_heads,
            "ffn": enc.intermediate_size,
            "subsampling_factor": enc.subsampling_factor,
            "mel_bins": enc.num_mel_bins,
        },
        "decoder": {
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "ffn": config.intermediate_size,
            "max_positions": config.max_position_embeddings,
            "vocab_size": config.vocab_size,
        },
        "tokens": {
            "eos": config.eos_token_id,
            "pad": config.pad_token_id,
            "decoder_start": config.decoder_start_token_id,
            "tokenizer_size": len(processor.tokenizer),
            "prompt_en": prompt_ids(processor.tokenizer, "en") if "en" in LANGUAGES else None,
        },
        "front_end": {
            "sampling_rate": fe.sampling_rate,
            "n_fft": fe.n_fft,
            "win_length": fe.win_length,
            "hop_length": fe.hop_length,
            "mel_bins": fe.feature_size,
            "dither": fe.dither,
        },
    }
