"""Encoder MACs of the released (2 B) config, full vs low-rank, analytically (issue 21).

The released encoder is built on PyTorch's meta device (shapes only: no weights, no memory) and run once
on a meta 35 s window; forward hooks count each Linear / Conv's multiply-adds from its output shape. The
attention matmuls (not modules) are added analytically per layer: Q K^T and A V (T^2 D each) and the
relative-position term Q R^T (T (2T-1) D). The relative-position projection of the positions is left out:
the conversion folds it into constants. The low-rank encoder applies, per layer type, the rank fractions
(rank / min(in, out)) measured on the default model (`compression.json` of a lowrank bundle); a rank that
saves nothing leaves the tensor full (`lowrank.saves`). Also printed: the bytes of the calibration
statistics for that config (`lowrank.statistics_bytes`: float64 covariances, groups, kept axes).

    uv run --frozen python tools/bench/lowrank_fullsize_macs.py --compression out/lowrank/compression.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn as nn
from transformers import CohereAsrConfig
from transformers.models.parakeet.modeling_parakeet import ParakeetEncoder

from cohere_coreml.quantize import lowrank

WINDOW_FRAMES = 3500  # 35 s at hop 160


def rank_fractions(compression: dict) -> dict[str, float]:
    """Mean rank / min(in, out) per layer type of a lowrank bundle (a full tensor counts as 1)."""
    tensors = compression["components"]["encoder"]["lowrank"]["tensors"]
    out: dict[str, list[float]] = {}
    for t in tensors:
        out.setdefault(t["layer_type"], []).append(
            (t["rank"] if t["rank"] is not None else min(t["in_features"], t["out_features"]))
            / min(t["in_features"], t["out_features"]))
    return {k: float(np.mean(v)) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", required=True, help="compression.json of a lowrank bundle of the default model")
    args = p.parse_args()
    fractions = rank_fractions(json.loads(open(args.compression).read()))
    config = CohereAsrConfig().encoder_config
    with torch.device("meta"):
        encoder = ParakeetEncoder(config).eval()
    macs: dict[str, int] = {}

    def hook(name):
        def count(module, inputs, output):
            per_out = (module.in_features if isinstance(module, nn.Linear)
                       else (module.in_channels // module.groups) * int(np.prod(module.kernel_size)))
            macs[name] = macs.get(name, 0) + int(np.prod(output.shape)) * per_out
        return count

    for name, module in encoder.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and "relative_k_proj" not in name:
            module.register_forward_hook(hook(name))
    with torch.no_grad():
        out = encoder(torch.zeros(1, WINDOW_FRAMES, config.num_mel_bins, device="meta"))
    t, d = out.last_hidden_state.shape[1], config.hidden_size
    attention = config.num_hidden_layers * (2 * t * t * d + t * (2 * t - 1) * d)
    targets = lowrank.targets(encoder)
    full_targets = sum(macs[n] for n in targets)
    low_targets = saved_params = 0
    for name, module in targets.items():
        w_out, w_in = module.weight.shape[0], module.weight.shape[1]
        r = int(round(fractions[lowrank.layer_type(name)] * min(w_in, w_out)))
        if lowrank.saves(r, w_in, w_out):
            low_targets += macs[name] * r * (w_in + w_out) // (w_in * w_out)
            saved_params += w_in * w_out - r * (w_in + w_out)
        else:
            low_targets += macs[name]
    encoder_params = lowrank.encoder_parameters(encoder)
    rest = sum(macs.values()) - full_targets + attention
    params_full = sum(int(np.prod(m.weight.shape)) for m in targets.values())
    print(json.dumps({
        "config": {"layers": config.num_hidden_layers, "hidden": d, "ffn": config.intermediate_size,
                   "window_frames": WINDOW_FRAMES, "encoder_frames": t},
        "rank_fractions_from_default_model": {k: round(v, 4) for k, v in fractions.items()},
        "gmacs_per_window": {"factorisable_full": round(full_targets / 1e9, 2), "factorisable_lowrank": round(low_targets / 1e9, 2),
                             "rest (subsampling, depthwise, attention matmuls)": round(rest / 1e9, 2),
                             "encoder_full": round((full_targets + rest) / 1e9, 2),
                             "encoder_lowrank": round((low_targets + rest) / 1e9, 2)},
        "encoder_macs_reduction": round(1 - (low_targets + rest) / (full_targets + rest), 4),
        "factorisable_weight_params_full": params_full,
        "encoder_params": {"full": encoder_params, "lowrank": encoder_params - saved_params,
                           "reduction": round(saved_params / encoder_params, 4)},
        "calibration_statistics_bytes": lowrank.statistics_bytes(lowrank.features(m) for m in targets.values()),
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
