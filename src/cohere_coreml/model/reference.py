"""PyTorch reference of the cross-attention memory: what encoder.mlpackage must output and what the
decoder's gate feeds decoder.mlpackage. One definition, used by both gates and by `verify`.

From the encoder's last hidden state (before `decoder.proj`) and the number of valid encoder
frames, exactly the contract (docs/contract.md):

    encoder_hidden_states (1, Tp, Ddec)   decoder.proj(hidden); rows >= encoder_length are ZERO
    cross_k, cross_v      (L, Hkv, Tp, Dh) each decoder layer's encoder_attn.k_proj / v_proj of that
                                           memory, in CohereAsrCrossAttention's head layout
    cross_mask            (1, 1, 1, Tp)   additive: 0 for valid frames, FP16_MASK_VALUE for padding
    encoder_length        int32 (1,)

Padded rows are zeroed (as the exported encoder does) before the projections, so padded K/V rows
are the projections' biases. Under the cross mask they carry no weight, so the decoder's output
does not depend on them; the encoder's gate compares them too.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import FP16_MASK_VALUE
from .shapes import ShapeError


@torch.no_grad()
def cross_memory(model, encoder_hidden: torch.Tensor, n_valid: int, memory_len: int) -> dict[str, np.ndarray]:
    """Contract outputs for `encoder_hidden` (1, T, Denc) with `n_valid` valid frames, padded to Tp."""
    decoder = model.model.decoder
    t = int(encoder_hidden.shape[1])
    if t > memory_len:
        raise ShapeError(f"encoder memory has {t} frames, more than the padded length {memory_len}")
    n_valid = int(n_valid)
    memory = decoder.proj(encoder_hidden)  # (1, T, Ddec)
    memory[:, n_valid:, :] = 0.0
    memory = torch.nn.functional.pad(memory, (0, 0, 0, memory_len - t))  # (1, Tp, Ddec)
    ks, vs = [], []
    for layer in decoder.layers:
        attn = layer.encoder_attn
        # exactly CohereAsrCrossAttention's projection: (1, Tp, -1, Dh).transpose(1, 2)
        ks.append(attn.k_proj(memory).view(1, memory_len, -1, attn.head_dim).transpose(1, 2)[0])
        vs.append(attn.v_proj(memory).view(1, memory_len, -1, attn.head_dim).transpose(1, 2)[0])
    cross_mask = np.full((1, 1, 1, memory_len), FP16_MASK_VALUE, dtype=np.float32)
    cross_mask[..., :n_valid] = 0.0
    return {
        "encoder_hidden_states": memory.numpy(),
        "cross_k": torch.stack(ks).numpy(),  # (L, Hkv, Tp, Dh)
        "cross_v": torch.stack(vs).numpy(),
        "cross_mask": cross_mask,
        "encoder_length": np.array([n_valid], dtype=np.int32),
    }
