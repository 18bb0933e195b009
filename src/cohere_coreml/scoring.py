"""Text normalisation and feature batching shared by `metrics` and `engines`.

`normalise_text` is `metrics.basic_normalise` (the normaliser of every language but English);
`features_batch` pads log-mel features into the `transformers` model's input (`engines.PyTorchEngine`,
the dev tools' batched greedy decoding). The held-out gate of `cohere-coreml quantize` scores with
`metrics` alone; the dev package's batched `greedy_decode` lives in tools/cohere_coreml_dev/evaluate.py.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import torch


def normalise_text(text: str) -> str:
    """Lower case, punctuation removed (Unicode category P*), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return re.sub(r"\s+", " ", text).strip()


def features_batch(features: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a list of (n_mels, t) features into torch (B, T, n_mels) + attention mask (B, T)."""
    n_mels = features[0].shape[0]
    t_max = max(f.shape[1] for f in features)
    x = torch.zeros(len(features), t_max, n_mels, dtype=torch.float32)
    mask = torch.zeros(len(features), t_max, dtype=torch.long)
    for i, f in enumerate(features):
        x[i, : f.shape[1]] = torch.from_numpy(np.ascontiguousarray(f.T, dtype=np.float32))
        mask[i, : f.shape[1]] = 1
    return x, mask
