"""PyTorch reference of the alignment attention: the cross-attention of every decoder layer and head, from
one teacher-forced pass of `transformers`' Cohere ASR model over a window's prompt + text tokens + eos.

This wraps the reference model, it does not re-implement it: the pass is `CohereAsrForConditionalGeneration`
itself, with eager attention (the implementation that returns its weights) and `output_attentions=True`,
whose `cross_attentions` hold, per layer, the softmax weights (1, heads, positions, encoder frames). The
weights are cut to the encoder's valid frames. The word-timing rule (`inference.alignment`) reads the rows it
needs from them (`alignment_rows`); the bundle's alignment function must give the same rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class AlignmentReferenceError(ValueError):
    """Inputs the teacher-forced pass cannot take (no tokens where some are needed, empty features)."""


@dataclass
class TeacherForcedAttention:
    """One window's teacher-forced pass.

    attention            (layers, heads, positions, frames) float32: positions = prompt + tokens + eos,
                         frames = the encoder's valid frames
    token_probabilities  (len(tokens) + 1,) float64: each text token's probability, then eos's, at the
                         position that predicts it
    top1                 (len(tokens) + 1,) bool: that token is the model's first choice there (all True: greedy
                         decoding gives exactly these tokens)
    prompt_length        tokens of the prompt
    """

    attention: np.ndarray
    token_probabilities: np.ndarray
    top1: np.ndarray
    prompt_length: int

    @property
    def n_frames(self) -> int:
        return int(self.attention.shape[-1])


def frame_seconds(model, processor) -> float:
    """One encoder frame in seconds, from the configs: the front end's hop times the encoder's subsampling
    (Cohere Transcribe: 160 samples at 16 kHz x 8 = 80 ms)."""
    fe = processor.feature_extractor
    return float(fe.hop_length) * int(model.config.encoder_config.subsampling_factor) / float(fe.sampling_rate)


@contextlib.contextmanager
def eager_attention(model):
    """The model with eager attention (the one that returns its weights) inside, as it was after."""
    before = model.config._attn_implementation
    if before != "eager":
        model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        if before != "eager":
            model.set_attn_implementation(before)


@torch.no_grad()
def encode(model, features: np.ndarray):
    """The encoder's output for log-mel `features` (n_mels, frames), all frames valid (one clip, no padding)."""
    if features.ndim != 2 or features.shape[1] < 1:
        raise AlignmentReferenceError(f"features must be (n_mels, frames) with frames >= 1, got {features.shape}")
    x = torch.from_numpy(np.ascontiguousarray(features.T, dtype=np.float32))[None]
    mask = torch.ones(1, x.shape[1], dtype=torch.long)
    return model.model.encoder(x, attention_mask=mask), mask


@torch.no_grad()
def teacher_forced_attention(model, encoder_output, prompt: Sequence[int], tokens: Sequence[int],
                             eos_id: int) -> TeacherForcedAttention:
    """Cross-attention of every layer and head for prompt + tokens + eos over the valid encoder frames, and
    each token's probability (`encoder_output`: the model's encoder output, `encode`)."""
    prompt = [int(t) for t in prompt]
    tokens = [int(t) for t in tokens]
    if not prompt:
        raise AlignmentReferenceError("the prompt is empty: the first text token needs a row that predicts it")
    ids = torch.tensor([prompt + tokens + [int(eos_id)]])
    hidden = encoder_output.last_hidden_state
    enc_mask = getattr(encoder_output, "attention_mask", None)
    n_valid = int(enc_mask[0].sum()) if enc_mask is not None else int(hidden.shape[1])
    with eager_attention(model):
        out = model(encoder_outputs=encoder_output, decoder_input_ids=ids, output_attentions=True, use_cache=False)
    attention = torch.stack([layer[0] for layer in out.cross_attentions])[..., :n_valid]  # (L, H, N, F)
    log_probs = torch.log_softmax(out.logits[0].double(), dim=-1)
    targets = tokens + [int(eos_id)]
    p = len(prompt)
    rows = log_probs[p - 1: p - 1 + len(targets)]
    chosen = rows[torch.arange(len(targets)), torch.tensor(targets)]
    return TeacherForcedAttention(attention=attention.float().numpy(), token_probabilities=torch.exp(chosen).numpy(),
                                  top1=(chosen >= rows.max(dim=-1).values).numpy(), prompt_length=p)
