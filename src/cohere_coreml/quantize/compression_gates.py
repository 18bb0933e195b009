"""The gates of a quantized bundle: each package vs the f16 one, and the bundle on a held-out set.

Both follow the export's one interface (`cohere_coreml.export.gate.GateReport`): `component_gate` is the
`gate` callback of `gate.export_gated` (`<component>.parity.json`), `heldout_gate` the report of the
whole bundle (`heldout.parity.json`).

The held-out gate is the bench's evaluation path: the clips of `datasets.load_folder`, transcribed
by `engines.PyTorchEngine` (the checkpoint) and the bundle engine (`transcribe.Transcriber`, an `Engine`), both
through `engines.Engine.transcribe` (the long-audio split included), scored by `metrics`
(`error_counts`: WER, or CER for ja/zh/ko, after the language's normaliser) and
`metrics.token_agreement`. The baseline runs first and is freed before the bundle loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from ..evaluation.datasets import Dataset, load_folder
from ..evaluation.metrics import BOOTSTRAP_SAMPLES, error_counts, increase_interval, rate_interval, token_agreement
from ..export.gate import HELDOUT_COMPONENT, GateReport
from ..export.memory import release_memory
from ..inference.engines import Engine, PyTorchEngine
from ..inference.transcribe import Transcriber
from ..runtime import load_model
from .measure import (
    GateData,
    batch_agreement,
    decoder_outputs,
    decoder_runtime,
    encoder_outputs,
    encoder_psnr,
    log_prob_error,
)
from .recipes import PSNR_ROLE, QuantizeError, bundle_components

logger = logging.getLogger(__name__)

HELDOUT_MAX_NEW_TOKENS = 96  # per window, both engines (held-out clips are short sentences)


class QuantizeGateError(RuntimeError):
    """A quantized bundle failed its gate; nothing was written (`report`: the refusing GateReport's dict)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def encoder_parts_gate(comp: str, packages: list[Path], f16_bundle: Path, data: GateData, preset: str,
                       gates: dict) -> GateReport:
    """Parts 1..k of a quantized encoder in parts (`packages`: the parts compressed so far, `comp` the k-th)
    chained, vs the f16 bundle's parts 1..k chained, on the gate windows: worst PSNR of the last part's
    outputs (the whole encoder, when k is the last part: the same figure as `component_gate`'s) or of
    part k's hidden state. One part of each is loaded at a time."""
    f16_parts = [Path(f16_bundle) / f"{c}.mlpackage" for c in bundle_components(f16_bundle)[: len(packages)]]
    ref_states = out_states = data.encoder_inputs()
    for f16_part, part in zip(f16_parts, packages):
        f16, quantized = load_model(str(f16_part), backend="mil"), load_model(str(part), backend="mil")

        def step(model, states, inputs):
            if "input_features" in model.input_description:
                return [model.predict(x) for x in inputs]
            return [model.predict({"hidden_states": st["hidden_states_out"], "encoder_mask": x["encoder_mask"]})
                    for st, x in zip(states, inputs)]

        inputs = data.encoder_inputs()
        ref_states, out_states = step(f16, ref_states, inputs), step(quantized, out_states, inputs)
        del f16, quantized
        release_memory()
    worst = encoder_psnr(ref_states, out_states)
    need = gates["encoder_psnr_db"]
    passed = bool(worst >= need)
    what = "encoder" if "hidden_states_out" not in ref_states[0] else f"encoder parts 1-{len(packages)} (hidden state)"
    return GateReport(
        component=comp, passed=passed,
        headline=f"{what} PSNR {worst:.1f} dB {'>=' if passed else '<'} {need} dB vs the f16 encoder's "
        f"({len(data.windows)} windows)",
        details={"reference": f"f16 {', '.join(p.name for p in f16_parts)} chained (runtime)", "preset": preset,
                 "worst_psnr_db": worst, "min_psnr_db": need, "windows": len(data.windows),
                 "parts": len(packages)})


def component_gate(comp: str, package: Path, data: GateData, preset: str, gates: dict) -> GateReport:
    """A quantized package vs the f16 one, through the runtime, on the f16 references of `data`.

    encoder: worst PSNR over the float outputs of every window. decoder: teacher forcing on the f16
    bundle's greedy tokens and the f16 encoder's memory: PSNR, KL and the log-prob error figures.
    """
    if comp == "encoder":
        loaded = load_model(str(package), backend="mil")
        worst = encoder_psnr(data.encoder_ref, encoder_outputs(loaded, data))
        need = gates["encoder_psnr_db"]
        passed = bool(worst >= need)
        role = PSNR_ROLE.get(preset, "fidelity")
        return GateReport(
            component=comp, passed=passed,
            headline=f"encoder PSNR {worst:.1f} dB {'>=' if passed else '<'} {'floor ' if role == 'floor' else ''}"
            f"{need} dB vs the f16 encoder ({len(data.windows)} windows)",
            details={"reference": "f16 encoder.mlpackage (runtime)", "preset": preset, "worst_psnr_db": worst,
                     "min_psnr_db": need, "role": role, "windows": len(data.windows)})
    single = decoder_outputs(decoder_runtime(package), data)
    lp = log_prob_error(data.decoder_ref, single, data.prompts, data.eos_ids)
    batch = batch_agreement(package, data, single, gates["decoder_psnr_db"])  # None: no step_batch
    passed = bool(lp["worst_psnr_db"] >= gates["decoder_psnr_db"] and lp["mean_kl"] <= gates["decoder_mean_kl"]
                  and lp["decisive_flips"] == 0  # argmax flips refuse unless near-ties the measured error explains
                  and (batch is None or batch["passed"]))
    return GateReport(
        component=comp, passed=passed,
        headline=f"decoder PSNR {lp['worst_psnr_db']:.1f} dB (min {gates['decoder_psnr_db']}), mean KL "
        f"{lp['mean_kl']:.3g} (max {gates['decoder_mean_kl']}), argmax {lp['argmax_agree']}/{lp['steps']} vs the "
        f"f16 decoder ({lp['near_tie_flips']} near-tie, {lp['decisive_flips']} decisive flips)"
        + ("" if batch is None else f"; step_batch: {batch['size']} rows {batch['worst_psnr_db']:.1f} dB vs the step, "
           f"{batch['decisive_flips']} decisive flips"),
        details={"reference": "f16 decoder.mlpackage, teacher forcing on the f16 bundle's greedy tokens and the "
                 "f16 encoder's memory", "preset": preset, **lp, "min_psnr_db": gates["decoder_psnr_db"],
                 "max_mean_kl": gates["decoder_mean_kl"], **({} if batch is None else {"batch": batch})})


# --------------------------------------------------------------------------------------------
# Held-out set: greedy tokens and error rates vs PyTorch (or vs the f16 bundle without a checkpoint)
# --------------------------------------------------------------------------------------------


def heldout_dataset(eval_dir: str | os.PathLike, limit_per_language: int | None = None) -> Dataset:
    """The evaluation folder's clips (`datasets.load_folder`); every clip must be scorable."""
    dataset = load_folder(eval_dir, limit_per_language)
    bad = [f"{c.id}: {c.problem}" for c in dataset.clips if c.problem]
    if bad:
        raise QuantizeError(f"{eval_dir}: the held-out gate needs every clip: " + "; ".join(bad))
    return dataset


def engine_transcripts(make_engine: Callable[[], Engine], dataset: Dataset,
                       max_new_tokens: int = HELDOUT_MAX_NEW_TOKENS) -> dict:
    """Greedy token ids (all windows, eos included) and texts of every clip through one engine
    (`Engine.transcribe`); the engine is freed before returning. Without voice activity (`vad="off"`, the
    energy windows) on every side: a bundle's vad.mlpackage is copied uncompressed, so the gate compares the
    compressed encoder and decoder on the same windows as the PyTorch reference, which has no VAD of its own."""
    engine = make_engine()
    ids, texts = [], []
    for clip in tqdm(dataset.clips, desc=f"held-out through {engine.kind} {Path(engine.name).name}", unit="clip",
                     leave=False):
        result = engine.transcribe(clip.audio, clip.language, max_new_tokens=max_new_tokens, vad="off")
        ids.append([t for w in result.windows for t in w.token_ids])
        texts.append(result.text)
    del engine
    release_memory()
    return {"files": [os.path.relpath(c.audio, dataset.name) for c in dataset.clips],
            "refs": [c.text for c in dataset.clips], "languages": [c.language for c in dataset.clips],
            "ids": ids, "texts": texts}


def compare_transcripts(baseline: dict, produced: dict, bound: float | None = None) -> dict:
    """Token agreement, and per language the error rate (`metrics.error_counts`: WER, or CER for
    ja/zh/ko, the bench's measure) of both sides and its increase; `worst_increase` is the largest
    per-language increase (what the held-out gate bounds: an average over languages would hide one
    language made worse). `wer` / `wer_baseline`: the same error counts pooled over all languages
    (errors / reference units). Per language, how sure the increase is (`metrics.increase_interval`, a
    paired bootstrap over the clips): its 95 % interval and, given the gate's `bound`, the share of
    resamples within it."""
    languages = {}
    pooled = {"baseline": [0, 0], "produced": [0, 0]}  # [errors, units]
    for lang in sorted(set(baseline["languages"])):
        pick = [i for i, x in enumerate(baseline["languages"]) if x == lang]
        refs = [baseline["refs"][i] for i in pick]
        base = error_counts(refs, [baseline["texts"][i] for i in pick], lang)
        mine = error_counts(refs, [produced["texts"][i] for i in pick], lang)
        for side, counts in (("baseline", base), ("produced", mine)):
            pooled[side][0] += counts["substitutions"] + counts["deletions"] + counts["insertions"]
            pooled[side][1] += counts["units"]
        sure = increase_interval(refs, [baseline["texts"][i] for i in pick], [produced["texts"][i] for i in pick], lang,
                                 bound=bound)
        languages[lang] = {"clips": len(pick), "units": base["units"], "metric": base["metric"], "baseline": base["rate"],
                           "rate": mine["rate"], "increase": mine["rate"] - base["rate"],
                           "increase_interval": sure["interval"],
                           **({"within_bound": sure["within_bound"]} if bound is not None else {}),
                           "rate_interval": rate_interval(refs, [produced["texts"][i] for i in pick], lang),
                           "baseline_rate_interval": rate_interval(refs, [baseline["texts"][i] for i in pick], lang),
                           "identical_clips": sum(baseline["ids"][i] == produced["ids"][i] for i in pick)}
    wer_base, wer = (errors / units if units else float("nan") for errors, units in pooled.values())
    return {**token_agreement(baseline["ids"], produced["ids"]), "wer_baseline": wer_base, "wer": wer,
            "wer_increase": wer - wer_base, "languages": languages,
            "worst_increase": max((v["increase"] for v in languages.values()), default=0.0),
            "differing_files": [f for f, a, b in zip(produced["files"], baseline["ids"], produced["ids"]) if a != b]}


# --------------------------------------------------------------------------------------------
# The task verdict (docs/quantization.md, "The task verdict"): decided by the bootstrap interval
# --------------------------------------------------------------------------------------------

# a verdict of one held-out set: every language's increase interval within the bound ("pass"), one
# language's wholly above it ("refuse"), else "undecided" (the next, larger set is evaluated)
VERDICTS = ("pass", "refuse", "undecided")
_EPS = 1e-12
# The rule of three (Hanley & Lippman-Hand, JAMA 1983): when none of n trials showed an event, the 95 %
# upper confidence bound on its rate is about 3 / n. Read per reference unit (word; character for
# ja/zh/ko), a set of U units that showed no error added bounds the unseen increase at 3 / U: a bootstrap
# over clips that all agree gives a zero-width interval, which says nothing about a set too small to
# have shown a change.
UNSEEN_CHANGE_EVENTS = 3.0


def unseen_increase(units: int) -> float:
    """The least upper end a language's increase interval is given (`UNSEEN_CHANGE_EVENTS` / `units`):
    the rule of three on its reference units; infinite for a language with none."""
    return UNSEEN_CHANGE_EVENTS / units if units > 0 else float("inf")


def language_verdict(interval: list[float], bound: float, units: int) -> str:
    """"kept" when the whole 95 % interval of a language's increase, its upper end at least
    `unseen_increase(units)`, is at most `bound`; "exceeded" when the interval is wholly above it; else
    "undecided". One differing word never decides: the resamples that leave its clip out put the
    interval's low end at the baseline's rate, its high end well above. Nor does a small set whose every
    clip agrees: its interval is [0, 0], but the rule of three's upper end exceeds the bound."""
    low, high = interval
    if low > bound + _EPS:
        return "exceeded"
    if max(high, unseen_increase(units)) <= bound + _EPS:
        return "kept"
    return "undecided"


def set_verdict(cmp: dict, bound: float) -> dict:
    """The verdict of one held-out set's `compare_transcripts` (with its intervals) and the figure that
    decided it: the exceeded language's interval (refuse), the highest upper end (pass), or the
    language whose interval or rule-of-three end holds the bound highest (undecided)."""
    langs = cmp["languages"]
    per = {lang: language_verdict(v["increase_interval"], bound, v["units"]) for lang, v in langs.items()}

    def upper(lang: str) -> float:
        return max(langs[lang]["increase_interval"][1], unseen_increase(langs[lang]["units"]))

    def figure(lang: str) -> str:
        v = langs[lang]
        lo, hi = v["increase_interval"]
        three = unseen_increase(v["units"])
        return (f"{lang} {v['metric'].upper()} {100 * v['increase']:+.2f} points, 95 % interval "
                f"{100 * lo:+.2f}..{100 * hi:+.2f}" + (f" (at least +{100 * three:.2f} by the rule of three on "
                f"{v['units']} {'words' if v['metric'] == 'wer' else 'characters'})" if three > hi else "")
                + f" ({v['clips']} clips)")

    exceeded = [lang for lang, v in per.items() if v == "exceeded"]
    undecided = [lang for lang, v in per.items() if v == "undecided"]
    if exceeded:
        lang = max(exceeded, key=lambda x: langs[x]["increase_interval"][0])
        return {"verdict": "refuse", "languages": per, "deciding_language": lang,
                "deciding_figure": f"{figure(lang)}: wholly above +{100 * bound:.2f}"}
    if undecided:
        lang = max(undecided, key=upper)
        return {"verdict": "undecided", "languages": per, "deciding_language": lang,
                "deciding_figure": f"{figure(lang)}: holds +{100 * bound:.2f}"}
    lang = max(per, key=upper, default=None)
    return {"verdict": "pass", "languages": per, "deciding_language": lang,
            "deciding_figure": (f"{figure(lang)}: within +{100 * bound:.2f}" if lang else "no scored clip")}


def heldout_report(baseline: dict, produced: dict, base_name: str, eval_set: str, gates: dict,
                   last: bool = True, accept_undecided: bool = False) -> GateReport:
    """The held-out verdict on two `engine_transcripts` of the same clips (`set_verdict`): passed when
    every language's increase interval is within `gates["max_wer_increase"]`, refused when one is wholly
    above it. Undecided on the `last` set: refused, the bound not shown kept (`details["verdict"]` says
    "undecided"), unless `accept_undecided` (`--accept-undecided`: the user takes the build on a set too
    small to decide; `details["accepted_undecided"]`); on an earlier set the caller evaluates the next one
    (`heldout_gate`)."""
    bound = gates["max_wer_increase"]
    cmp = compare_transcripts(baseline, produced, bound=bound)
    cmp["baseline"] = base_name
    cmp["eval_set"] = eval_set
    cmp["max_wer_increase"] = bound
    verdict = set_verdict(cmp, bound)
    cmp.update(verdict=verdict["verdict"], language_verdicts=verdict["languages"],
               deciding_figure=verdict["deciding_figure"])
    accepted = verdict["verdict"] == "undecided" and last and accept_undecided
    cmp["accepted_undecided"] = accepted
    passed = verdict["verdict"] == "pass" or accepted
    worst = max(cmp["languages"], key=lambda lang: cmp["languages"][lang]["increase"])
    w = cmp["languages"][worst]
    said = {"pass": "passed", "refuse": "refused",
            "undecided": ("accepted undecided (--accept-undecided)" if accepted else
                          "refused: undecided on the largest set given" if last else "undecided")}[verdict["verdict"]]
    return GateReport(
        component=HELDOUT_COMPONENT, passed=passed,
        headline=f"held-out {eval_set}: {said} on {verdict['deciding_figure']}; {cmp['identical_clips']}/"
        f"{cmp['clips']} clips identical to {base_name}, WER {100 * cmp['wer']:.2f} % vs "
        f"{100 * cmp['wer_baseline']:.2f} %; worst language {worst}: {w['metric'].upper()} {100 * w['rate']:.2f} % vs "
        f"{100 * w['baseline']:.2f} % (within the bound in {100 * w['within_bound']:.0f} % of {BOOTSTRAP_SAMPLES} "
        "resamples of the clips)",
        details=cmp)


def decide(sets: Sequence[str | os.PathLike], evaluate: Callable[[Path], tuple[dict, dict, str]],
           gates: dict, accept_undecided: bool = False) -> GateReport:
    """The task verdict over held-out sets in order (smallest first): `evaluate(folder)` gives (baseline
    transcripts, produced transcripts, baseline name); the first decided set's report is the verdict
    (`details["steps"]`: every set's verdict and figure), an undecided last set refuses (passes, marked,
    with `accept_undecided`)."""
    steps, report = [], None
    for i, folder in enumerate(sets):
        baseline, produced, base_name = evaluate(Path(folder))
        report = heldout_report(baseline, produced, base_name, Path(folder).name, gates, last=i == len(sets) - 1,
                                accept_undecided=accept_undecided)
        steps.append({"eval_set": str(folder), "clips": report.details["clips"], "verdict": report.details["verdict"],
                      "figure": report.details["deciding_figure"]})
        logger.info("held-out verdict on %s: %s (%s)", folder, report.details["verdict"], report.details["deciding_figure"])
        if report.details["verdict"] != "undecided":
            break
    if report is None:
        raise QuantizeError("the held-out verdict needs at least one held-out folder")
    report.details["steps"] = steps
    if len(steps) > 1:
        report.headline += " (after " + "; ".join(f"{Path(s['eval_set']).name}: {s['verdict']}" for s in steps[:-1]) + ")"
    return report


def heldout_gate(f16_dir: Path, q_dir: Path, eval_dir: Path, gates: dict, *, model: str | None,
                 limit_per_language: int | None, more: Sequence[str | os.PathLike] = (),
                 baselines: dict | None = None, accept_undecided: bool = False) -> GateReport:
    """The task verdict (`decide`) of the quantized bundle vs PyTorch (`model`; computed first, the model
    freed before the bundle is loaded), or vs the f16 bundle without a checkpoint: on `eval_dir`, then,
    while undecided, on each of the larger sets `more`. `baselines`: {folder: baseline transcripts}
    already computed (the low-rank search's PyTorch side), reused. `accept_undecided`: see `heldout_report`."""
    baselines = {} if baselines is None else baselines

    def evaluate(folder: Path) -> tuple[dict, dict, str]:
        dataset = heldout_dataset(folder, limit_per_language)
        key = (str(folder.resolve()), limit_per_language)
        if model:
            if key not in baselines:
                baselines[key] = engine_transcripts(lambda: PyTorchEngine(model), dataset)
            baseline, base_name = baselines[key], "pytorch"
        else:
            baseline = engine_transcripts(lambda: Transcriber(f16_dir, backend="mil"), dataset)
            base_name = "f16 bundle"
        produced = engine_transcripts(lambda: Transcriber(q_dir, backend="mil"), dataset)
        return baseline, produced, base_name

    return decide([eval_dir, *more], evaluate, gates, accept_undecided=accept_undecided)
