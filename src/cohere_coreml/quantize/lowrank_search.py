"""The low-rank presets' thresholds searched to the gate (`lowrank` / `q8-lowrank`, docs/quantization.md).

One scale on the preset's four retained-energy thresholds (`recipes.LOWRANK_ENERGY`), each candidate the
checkpoint's encoder planned and rewritten by `lowrank` from ONE calibration's principal axes (no new
statistics) and judged in PyTorch: its encoder PSNR vs the unmodified encoder on the gate windows (the floor
against broken programs), then the held-out task verdict (`compression_gates.decide`) vs the unmodified
model. A bisection over the scales returns the smallest encoder that passes, the way `mixed` searches its
plan to a byte budget. The analysis and rewrite are `lowrank`'s; this module only chooses among them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..model.shapes import encoder_shapes
from .lowrank import FP16_BYTES, Analysis, calibrate, encoder_parameters, lowrank_model, plan_ranks, rewrite_encoder

logger = logging.getLogger(__name__)


# One scale on the preset's four thresholds: a type's lost energy 1 - e becomes s (1 - e). The types keep
# the ratios their one-type-at-a-time sweep set (docs/quantization.md), so the search is over one number
# and a bisection over these candidates needs at most four evaluations. Largest encoder first (s = 1: the
# preset's own thresholds). The small scales are there for a model whose task verdict moves at the base
# thresholds already: at s = 0.05 a type keeps 99.75-99.95 % of its energy, and the ranks still save on a
# Conformer whose activations are low-rank (LiteASR, arXiv 2502.20583).
ENERGY_SCALES = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


def scaled_energy(base: Mapping[str, float], scale: float) -> dict[str, float]:
    """The thresholds of one candidate: each type's lost energy times `scale` (at least 0.5 kept)."""
    return {t: round(max(0.5, 1.0 - scale * (1.0 - float(e))), 6) for t, e in base.items()}


def bisect_largest_passing(count: int, passes: Callable[[int], bool]) -> int | None:
    """The largest index in [0, count) whose candidate passes, assuming passing is monotone (every
    candidate before a passing one passes: smaller ranks never do better); None when the first fails.
    Evaluates at most ceil(log2(count + 1)) candidates."""
    lo, hi, best = 0, count - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if passes(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def candidate_psnr(reference: list[dict], model, shapes, windows) -> float:
    """Worst PSNR of the (rewritten) model's encoder outputs (`export.encoder.reference_outputs`: the
    contract's cross memory) vs `reference` over the gate windows."""
    from ..export.encoder import reference_outputs
    from .measure import encoder_psnr

    return encoder_psnr(reference, [reference_outputs(model, shapes, feats, n) for feats, n in windows])


@dataclass
class SearchSettings:
    """What the search needs beyond the calibration: the gate windows (features, valid frames), the
    held-out folders in order (`--data`, then `--more-data`), the preset's gates (`encoder_psnr_db`: the
    floor; `max_wer_increase`: the task bound), the scales, a cache of the unmodified model's held-out
    transcripts per folder (shared with the bundle's held-out gate), and `accept_undecided`
    (`--accept-undecided`: a candidate undecided on the last folder counts as passing, so the search
    chooses the smallest encoder not shown to exceed the bound)."""

    windows: list
    heldout: list[Path]
    gates: dict
    scales: tuple[float, ...] = ENERGY_SCALES
    limit_per_language: int | None = None
    baselines: dict = field(default_factory=dict)
    accept_undecided: bool = False

    def rewritten_model(self, model_ref: str, clips: list[Path], base: Mapping[str, float], window_seconds: float):
        """The checkpoint calibrated on `clips` once, the thresholds searched (`search_energy` from `base`), and
        the model rewritten with the chosen ones: (model, processor, `lowrank_model`'s report with the search
        under "search"). None passing raises `QuantizeGateError` with every candidate's figures."""
        from ..inference.engines import PyTorchEngine  # the held-out side of each candidate

        engine = PyTorchEngine(model_ref)
        model, processor = engine.model, engine.processor
        analysis = calibrate(model, processor, clips)
        found = search_energy(engine, analysis, base, self, window_seconds)
        del engine
        raise_if_none_passed(found)
        report = lowrank_model(model, processor, clips, found["thresholds"], analysis=analysis)
        report["search"] = found
        return model, processor, report


def search_energy(engine, analysis: Analysis, base: Mapping[str, float], settings: SearchSettings,
                  window_seconds: float) -> dict:
    """The smallest encoder whose gate passes, among `scaled_energy(base, s)` for s in `settings.scales`:
    each candidate evaluated is `engine`'s model (a `PyTorchEngine`) with its encoder rewritten from the one
    `analysis` (no new calibration): its encoder PSNR vs the unmodified encoder on the gate windows (the
    floor), then the task verdict on the held-out folders (`compression_gates.decide`: the first decided
    set; tokens and error rates vs the unmodified model). Returns the search report (`chosen`: the index,
    None when no candidate passes; `candidates`: every one evaluated, in order)."""
    from .compression_gates import decide, engine_transcripts, heldout_dataset

    model = engine.model
    original = model.model.encoder
    shapes = encoder_shapes(model, window_seconds, engine.processor)
    from ..export.encoder import reference_outputs

    reference = [reference_outputs(model, shapes, feats, n) for feats, n in settings.windows]
    params_before = encoder_parameters(original)
    tried: list[dict] = []

    def evaluate(i: int) -> bool:
        scale = settings.scales[i]
        thresholds = scaled_energy(base, scale)
        model.model.encoder = copy.deepcopy(original)
        try:
            plans = plan_ranks(model.model.encoder, analysis, thresholds)
            rewrite_encoder(model.model.encoder, analysis, plans)
            after = encoder_parameters(model.model.encoder)
            row = {"scale": scale, "thresholds": thresholds, "encoder_parameters": after,
                   "encoder_fp16_bytes": FP16_BYTES * after, "reduction": round(1 - after / params_before, 4),
                   "encoder_psnr_db": round(candidate_psnr(reference, model, shapes, settings.windows), 2)}
            floor = settings.gates["encoder_psnr_db"]
            if row["encoder_psnr_db"] < floor:
                row.update(passed=False, decided_by=f"encoder PSNR {row['encoder_psnr_db']:.1f} dB < floor {floor} dB")
            else:
                def transcripts(folder: Path):
                    dataset = heldout_dataset(folder, settings.limit_per_language)
                    key = (str(folder.resolve()), settings.limit_per_language)
                    if key not in settings.baselines:
                        model.model.encoder, rewritten = original, model.model.encoder
                        try:
                            settings.baselines[key] = engine_transcripts(lambda: engine, dataset)
                        finally:
                            model.model.encoder = rewritten
                    return settings.baselines[key], engine_transcripts(lambda: engine, dataset), "pytorch"

                verdict = decide(settings.heldout, transcripts, settings.gates,
                                 accept_undecided=settings.accept_undecided)
                d = verdict.details
                row.update(passed=verdict.passed, decided_by=d["deciding_figure"], heldout=d["steps"],
                           identical_clips=f"{d['identical_clips']}/{d['clips']}",
                           languages={lang: {k: v[k] for k in ("clips", "rate", "rate_interval", "baseline",
                                                               "baseline_rate_interval", "increase_interval")}
                                      for lang, v in d["languages"].items()})
        finally:
            model.model.encoder = original
        # not passed: refused (the floor, or an interval wholly above the bound) or undecided on the last set
        outcome = "pass" if row["passed"] else ((row.get("heldout") or [{}])[-1].get("verdict") or "refused")
        logger.info("low-rank search: scale %g (%s): encoder -%.1f %%, %.1f dB, %s (%s)", scale, thresholds,
                    100 * row["reduction"], row["encoder_psnr_db"], outcome, row["decided_by"])
        tried.append(row)
        return bool(row["passed"])

    chosen = bisect_largest_passing(len(settings.scales), evaluate)
    return {"rule": "one scale s on the preset's thresholds (lost energy 1 - e -> s (1 - e)), bisection over "
                    "the scales for the smallest encoder whose gate passes (floor, then the task verdict), "
                    "candidates evaluated in PyTorch on one calibration's principal axes",
            "base_thresholds": dict(base), "scales": list(settings.scales),
            "chosen": None if chosen is None else settings.scales[chosen],
            "thresholds": None if chosen is None else scaled_energy(base, settings.scales[chosen]),
            "candidates": tried}


def raise_if_none_passed(found: dict) -> None:
    """`QuantizeGateError` naming every candidate's scale, size, PSNR and deciding figure when the search
    chose none (its report is the refusal's figures)."""
    if found["chosen"] is not None:
        return
    from .compression_gates import QuantizeGateError

    rows = "; ".join(f"s={c['scale']:g}: -{100 * c['reduction']:.1f} %, {c['encoder_psnr_db']:.1f} dB, "
                     f"{c['decided_by']}" for c in found["candidates"])
    raise QuantizeGateError(f"no low-rank candidate passes its gate ({rows})",
                            {"component": "lowrank_search", "passed": False, **found})
