"""Scoring shared by the quantization gate and the dev evaluation: normalised-text WER and PyTorch
greedy decoding of log-mel features (one prompt per clip's language).

`cohere-coreml quantize` gates a quantized bundle on a held-out set: its greedy tokens / WER next
to `greedy_decode` of the checkpoint. `tools/cohere_coreml_dev/evaluate.py` (demo-model
evaluation) uses the same functions.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np


class EvaluationError(ValueError):
    """An evaluation set is missing, empty or inconsistent."""


def normalise_text(text: str) -> str:
    """Lower case, punctuation removed (Unicode category P*), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return re.sub(r"\s+", " ", text).strip()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER of normalised texts (jiwer); an empty hypothesis counts as all deletions."""
    import jiwer

    if len(references) != len(hypotheses):
        raise EvaluationError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    refs = [normalise_text(r) for r in references]
    hyps = [normalise_text(h) for h in hypotheses]
    if not any(refs):
        raise EvaluationError("all references are empty")
    # jiwer refuses empty strings; an empty hypothesis is scored against a placeholder word that
    # never matches, which counts as one substitution plus deletions (never as a correct word).
    hyps = [h if h else "<empty>" for h in hyps]
    return float(jiwer.wer(refs, hyps))


@dataclass
class Decoded:
    text: str
    ids: list[int]
    margins: list[float]  # top-1 minus top-2 log-prob per generated token (eos included)


def features_batch(features: list[np.ndarray]):
    """Pad a list of (n_mels, t) features into torch (B, T, n_mels) + attention mask (B, T)."""
    import torch

    n_mels = features[0].shape[0]
    t_max = max(f.shape[1] for f in features)
    x = torch.zeros(len(features), t_max, n_mels, dtype=torch.float32)
    mask = torch.zeros(len(features), t_max, dtype=torch.long)
    for i, f in enumerate(features):
        x[i, : f.shape[1]] = torch.from_numpy(np.ascontiguousarray(f.T, dtype=np.float32))
        mask[i, : f.shape[1]] = 1
    return x, mask


def greedy_decode(
    model,
    tokenizer,
    features: list[np.ndarray],
    languages: list[str],
    *,
    punctuation: bool = True,
    max_new_tokens: int = 128,
    batch_size: int = 16,
) -> list[Decoded]:
    """Greedy `model.generate` on (n_mels, valid_frames) features, one prompt per clip's language."""
    import torch

    from cohere_coreml.tokens import decode_ids, eos_id, prompt_ids

    if len(features) != len(languages):
        raise EvaluationError(f"{len(features)} feature arrays but {len(languages)} languages")
    eos = eos_id(tokenizer)
    out: list[Decoded] = []
    order = np.argsort([-f.shape[1] for f in features], kind="stable")
    results: dict[int, Decoded] = {}
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = [int(i) for i in order[start : start + batch_size]]
            x, mask = features_batch([features[i] for i in idx])
            prompts = torch.tensor([prompt_ids(tokenizer, languages[i], punctuation) for i in idx], dtype=torch.long)
            gen = model.generate(
                input_features=x,
                attention_mask=mask,
                decoder_input_ids=prompts,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = gen.sequences[:, prompts.shape[1] :]  # (B, steps)
            logits = torch.stack(gen.logits, dim=1).float()  # (B, steps, V)
            logp = torch.log_softmax(logits, dim=-1)
            top2 = torch.topk(logp, 2, dim=-1).values  # (B, steps, 2)
            gaps = (top2[..., 0] - top2[..., 1]).numpy()
            for row, i in enumerate(idx):
                ids = new[row].tolist()
                n = ids.index(eos) + 1 if eos in ids else len(ids)
                results[i] = Decoded(decode_ids(tokenizer, ids[:n]), ids[:n], gaps[row, :n].tolist())
    out = [results[i] for i in range(len(features))]
    return out
