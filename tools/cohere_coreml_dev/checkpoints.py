"""Small checkpoints in the released Hugging Face format, for tests and the demo model.

`make_tiny_checkpoint` writes a complete folder with the exact Cohere Transcribe architecture at
small widths, loadable by `cohere_coreml.model.checkpoint.load_reference`, so every stage can be tested
on checkpoints of any shape. Not part of the product package.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from cohere_coreml.config import round_up
from cohere_coreml.model.checkpoint import CheckpointError

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
    """Kaiming re-initialisation of the encoder's conv subsampling (docs/design-notes.md, "Training the default model").

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

    from .tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tiny_pieces())
    config = build_config(tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = CohereAsrForConditionalGeneration(config)
    init_subsampling(model)
    model.eval()
    return save_checkpoint(model, tokenizer, out_dir)
