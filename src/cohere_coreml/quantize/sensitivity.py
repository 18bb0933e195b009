"""Per-weight sensitivity and `--target-psnr`: which weights to keep fp16 (the analysis step).

Each weight is quantized alone, through the interpreter: its quantized value (the compressed
package's own, decompressed by the runtime exactly as coremltools does) replaces the fp16
constant in the loaded f16 program, so one load of each package serves every weight. The score
is the component's output PSNR vs the f16 references of `measure.GateData`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..runtime import load_model
from .inventory import compressed_tensors, load_function, weight_tensors
from .measure import (
    GateData,
    decoder_outputs,
    decoder_psnr,
    decoder_runtime,
    encoder_outputs,
    encoder_psnr,
    log_prob_error,
)

SENSITIVITY_WINDOWS = (0, -1)  # encoder sensitivity: the first clip and the full window of speech


def component_score(component: str, model, data: GateData, reference) -> float:
    """Output PSNR of a component vs `reference`. `model`: the encoder's loaded function, or the
    decoder's `DecoderRuntime`."""
    if component == "encoder":
        return encoder_psnr(reference, encoder_outputs(model, data))
    return decoder_psnr(reference, decoder_outputs(model, data))


def weight_swaps(f16_package: Path, quantized_package: Path, quant_model) -> dict[str, tuple[str, Any]]:
    """{weight name: (f16 var name, quantized value as loaded by the runtime)}."""
    weights = weight_tensors(load_function(f16_package))
    done = compressed_tensors(load_function(quantized_package))
    return {n: (weights[n]["var"], quant_model.constant(d["var"])) for n, d in done.items() if n in weights}


def sensitivity(component: str, f16_package: Path, quantized_package: Path, data: GateData,
                names: Sequence[str] | None = None) -> dict:
    """Output PSNR (dB, vs the f16 package) of the component with ONE weight quantized, per weight.

    Returns {"all": PSNR with every weight quantized, "per_weight": {name: PSNR}, "windows"}.
    """
    f16 = load_model(str(f16_package), backend="mil")
    quant = load_model(str(quantized_package), backend="mil")
    reference = data.encoder_ref if component == "encoder" else data.decoder_ref
    swaps = weight_swaps(f16_package, quantized_package, quant)
    names = [n for n in (names or swaps) if n in swaps]
    if component == "decoder":  # the step's constants are swapped; bind_memory has none
        scored_quant, scored_f16 = decoder_runtime(quantized_package, quant), decoder_runtime(f16_package, f16)
    else:
        scored_quant, scored_f16 = quant, f16
    result = {"all": component_score(component, scored_quant, data, reference), "per_weight": {},
              "windows": len(data.windows)}
    for name in tqdm(names, desc=f"{component} sensitivity", unit="weight", leave=False):
        with f16.replaced_constants(dict([swaps[name]])):
            result["per_weight"][name] = component_score(component, scored_f16, data, reference)
    return result


def choose_fp16(component: str, f16_package: Path, quantized_package: Path, data: GateData,
                per_weight: dict[str, float], bytes_saved: dict[str, int], target_psnr: float,
                max_kept: int | None = None) -> dict:
    """Keep the most sensitive weights fp16 (lowest single-weight PSNR first) until the component's
    output PSNR with everything else quantized reaches `target_psnr` (or `max_kept` are kept).
    Returns the kept names, the PSNR after each step (for the decoder also the log-prob error
    bound, median / p99 / max nats over the top tokens and the eos id's max: what each extra byte
    buys) and the extra bytes."""
    f16 = load_model(str(f16_package), backend="mil")
    quant = load_model(str(quantized_package), backend="mil")
    reference = data.encoder_ref if component == "encoder" else data.decoder_ref
    swaps = weight_swaps(f16_package, quantized_package, quant)
    scored = decoder_runtime(f16_package, f16) if component == "decoder" else f16  # constants swapped in f16
    order = sorted(per_weight, key=lambda n: per_weight[n])
    kept: list[str] = []
    steps = []
    while True:
        swap = dict(swaps[n] for n in order if n not in kept)
        step: dict[str, Any] = {"kept_fp16": len(kept), "extra_bytes": int(sum(bytes_saved.get(n, 0) for n in kept))}
        with f16.replaced_constants(swap):
            if component == "encoder":
                score = encoder_psnr(reference, encoder_outputs(f16, data))
            else:
                produced = decoder_outputs(scored, data)
                score = decoder_psnr(reference, produced)
                lp = log_prob_error(reference, produced, data.prompts, data.eos_ids)
                step["log_prob_error_nats"] = {k: lp["abs_error_nats"].get(k) for k in ("median", "p99", "max")}
                step["eos_error_max_nats"] = lp["eos_error_nats"].get("max")
        steps.append({**step, "psnr_db": score})
        if score >= target_psnr or len(kept) == len(order) or (max_kept is not None and len(kept) >= max_kept):
            break
        kept.append(order[len(kept)])
    return {"target_psnr_db": target_psnr, "met": steps[-1]["psnr_db"] >= target_psnr, "kept_fp16": kept,
            "steps": steps, "extra_bytes": steps[-1]["extra_bytes"]}
