"""Low-rank encoder (LiteASR, arXiv 2502.20583): PCA of the encoder linears' outputs, two smaller linears.

The analysis steps apart from the apply steps:

    targets              the encoder tensors that may be factorised: every Conformer block's attention
                         q/k/v/out projections, feed-forward linears and pointwise (kernel-1) convolutions
                         (a kernel-1 Conv1d is a linear over channels). Depthwise convolutions, the
                         subsampling and the relative-position projection (folded into constants by the
                         conversion) stay as they are.
    collect_statistics   passes of the UNMODIFIED transformers encoder over calibration features: one for
                         the mean of every target's output, then one per group of targets for the
                         covariance around it (float64 sums, memory constant in the number of clips; a
                         group's (out, out) accumulators stay under `STATISTICS_BUDGET_BYTES`)
    analyse              PCA by eigendecomposition of each covariance (float64) as soon as its group's pass
                         ends, then the covariance is freed: kept are the eigenvalues and the leading
                         `kept_rank` principal axes (the largest rank that saves anything: no plan uses more)
    plan_ranks           per tensor, the smallest rank keeping a layer type's energy threshold; a rank
                         that saves nothing (r * (in + out) >= in * out) leaves the tensor full
    rewrite_encoder      apply: each planned module replaced in place by two smaller ones,
                         y ~ V_r V_r^T (W x + b - mu) + mu = V_r (V_r^T W) x + (V_r V_r^T (b - mu) + mu)
                         (`LowRankLinear`: `down` without bias, `up` with it), so the encoder wrapper and
                         its export trace the rewritten model unchanged
    (lowrank_search)     the thresholds searched to the gate (`lowrank_search.search_energy`), each candidate
                         planned and rewritten by the functions here from one analysis
    export_lowrank_encoder  calibration, plan, rewrite, then the project's encoder export (same windows and
                         settings as the f16 bundle), gated against the rewritten PyTorch model

MACs are per encoder frame (one output row of each linear); bytes are fp16 weights + biases.

Memory of the statistics (float64; `statistics_bytes`): in the released config (48 layers, d_model 1280,
FFN 5120: 480 targets) all (out, out) covariances together are tens of GB, so they are never held at once.
One pass of the encoder over the calibration audio gives every mean, then one pass per group of targets
its covariances: at any time one group's accumulators (<= 2 GiB) + one eigendecomposition's workspace (the
covariance's copy, the vectors and LAPACK's 2 out^2) + the kept axes of every target so far (sum of out x
kept_rank).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn

from ..bundle.manifest import MANIFEST_NAME
from ..evaluation.datasets import DatasetError, load_folder
from ..export.convert import ExportSettings
from ..export.encoder import COMPONENT, gate_features
from ..export.encoder_packages import stage_encoder, stage_encoder_buckets
from ..export.memory import release_memory
from ..inference.engines import features_batch
from ..model.audio import FrontEndConfig, load_audio, log_mel, split_long_audio
from ..model.checkpoint import load_reference
from ..model.shapes import encoder_shapes
from ..storage.files import package_size_bytes, temporary_dir, weight_file_bytes
from .compress import compress_package
from .recipes import QuantizeError, Recipe

if TYPE_CHECKING:  # the search imports this module (one way); annotations only
    from . import lowrank_search

logger = logging.getLogger(__name__)

FP16_BYTES = 2
# Layer types (each gets its own retained-energy threshold) by the module's name inside the encoder.
LAYER_TYPES: dict[str, re.Pattern] = {
    "attn_qk": re.compile(r"layers\.\d+\.self_attn\.[qk]_proj"),
    "attn_vo": re.compile(r"layers\.\d+\.self_attn\.[vo]_proj"),
    "ffn": re.compile(r"layers\.\d+\.feed_forward\d+\.linear\d+"),
    "conv_pw": re.compile(r"layers\.\d+\.conv\.pointwise_conv\d+"),
}


def layer_type(name: str) -> str | None:
    """The layer type of an encoder module name (None: not a target)."""
    return next((t for t, pattern in LAYER_TYPES.items() if pattern.fullmatch(name)), None)


def is_pointwise(module: nn.Module) -> bool:
    return (isinstance(module, nn.Conv1d) and module.kernel_size == (1,) and module.groups == 1
            and module.stride == (1,) and module.padding in ((0,), "valid") and module.dilation == (1,))


def targets(encoder: nn.Module) -> dict[str, nn.Module]:
    """{name inside the encoder: module} of every tensor that may be factorised (Linear or kernel-1 Conv1d)."""
    found = {}
    for name, module in encoder.named_modules():
        if layer_type(name) is None:
            continue
        if not (isinstance(module, nn.Linear) or is_pointwise(module)):
            raise QuantizeError(f"encoder module {name} is a {type(module).__name__}, not a linear or a kernel-1 "
                                "convolution: the low-rank rewrite does not know it")
        found[name] = module
    if not found:
        raise QuantizeError("the encoder has no attention, feed-forward or pointwise-convolution modules to factorise")
    return found


def weight_matrix(module: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """(W (out, in), b (out,)) in float64 of a Linear or kernel-1 Conv1d (zero bias when it has none)."""
    w = module.weight.detach().double().reshape(module.weight.shape[0], -1).numpy()
    b = (module.bias.detach().double().numpy() if module.bias is not None else np.zeros(w.shape[0]))
    return w, b


def output_rows(module: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """A module's output as (frames, out) float64: Linear (..., out); Conv1d (B, out, T)."""
    if isinstance(module, nn.Conv1d):
        output = output.transpose(1, 2)
    return output.reshape(-1, output.shape[-1]).double()


# --------------------------------------------------------------------------------------------
# Calibration statistics (analysis)
# --------------------------------------------------------------------------------------------


# The most float64 (out, out) covariance accumulators one calibration pass holds (`statistic_groups`).
STATISTICS_BUDGET_BYTES = 2 * 2**30
FLOAT64_BYTES = 8


@dataclass
class OutputMean:
    """Per tensor: frames seen and the mean (out,) of its outputs (float64)."""

    count: int
    mean: np.ndarray


@dataclass
class OutputStatistics(OutputMean):
    """OutputMean and the covariance (out, out) of the outputs (float64, divided by n)."""

    cov: np.ndarray


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear or kernel-1 Conv1d, from its weight's shape (no copy)."""
    return int(np.prod(module.weight.shape[1:])), int(module.weight.shape[0])


def calibration_clips(folder: str | Path) -> list[Path]:
    """The audio files of a calibration folder (the dataset format of `--data`: `datasets.load_folder`)."""
    try:
        dataset = load_folder(folder)
    except DatasetError as err:  # e.g. a clip without a language: tests/data/audio's silence clip
        raise QuantizeError(f"calibration folder: {err}") from err
    bad = [f"{c.id}: {c.problem}" for c in dataset.clips if c.problem]
    if bad:
        raise QuantizeError(f"{folder}: calibration clips that cannot be read: " + "; ".join(bad))
    if not dataset.clips:
        raise QuantizeError(f"{folder}: no calibration clips")
    return [Path(c.audio) for c in dataset.clips]


def calibration_features(clips: Iterable[Path], front_end: FrontEndConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(features (1, T, n_mels), mask (1, T)) of every window of every clip, through the project's front end
    (long clips split as transcription splits them); read again on each pass (nothing is kept)."""
    for path in clips:
        for piece in split_long_audio(load_audio(path, target_rate=front_end.sampling_rate), front_end):
            feats, n_valid = log_mel(piece, front_end)
            yield features_batch([feats[:, :n_valid]])


def covariance_bytes(out_features: int) -> int:
    """Bytes of one target's float64 (out, out) covariance accumulator."""
    return FLOAT64_BYTES * out_features * out_features


def statistic_groups(out_features: Mapping[str, int], budget_bytes: int = STATISTICS_BUDGET_BYTES) -> list[list[str]]:
    """The targets of {name: out features}, in order, cut into consecutive groups whose covariance accumulators
    together stay within `budget_bytes` (a target over the budget on its own is a group of one)."""
    groups: list[list[str]] = []
    used = 0
    for name, out_f in out_features.items():
        size = covariance_bytes(out_f)
        if not groups or used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def run_encoder(encoder: nn.Module, windows: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
                hooks: Mapping[nn.Module, Callable[[np.ndarray], None]]) -> None:
    """One pass of the encoder over `windows()`, each module's output rows (frames, out) float64 given to its hook."""
    handles = [m.register_forward_hook(lambda module, inputs, output, record=record:
                                       record(output_rows(module, output).numpy())) for m, record in hooks.items()]
    try:
        for x, mask in windows():
            encoder(x, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def output_means(encoder: nn.Module, modules: Mapping[str, nn.Module],
                 windows: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, OutputMean]:
    """Pass 1: frames and mean of every module's outputs (float64 sums of the rows, window by window)."""
    sums = {n: np.zeros(features(m)[1]) for n, m in modules.items()}
    counts = dict.fromkeys(modules, 0)

    def hook(name):
        def record(rows):
            sums[name] += rows.sum(0)
            counts[name] += rows.shape[0]
        return record

    run_encoder(encoder, windows, {m: hook(n) for n, m in modules.items()})
    if not all(counts.values()):
        raise QuantizeError("the calibration audio gave no encoder frames")
    return {n: OutputMean(count=counts[n], mean=sums[n] / counts[n]) for n in modules}


@torch.no_grad()
def output_covariances(encoder: nn.Module, modules: Mapping[str, nn.Module], means: Mapping[str, OutputMean],
                       windows: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, np.ndarray]:
    """Pass 2 for one group: covariance (divided by n) of each module's outputs around its mean."""
    outer = {n: np.zeros((features(m)[1],) * 2) for n, m in modules.items()}

    def hook(name):
        def record(rows):
            centred = rows - means[name].mean
            outer[name] += centred.T @ centred
        return record

    run_encoder(encoder, windows, {m: hook(n) for n, m in modules.items()})
    for n, acc in outer.items():
        acc /= means[n].count  # in place: no second copy of the group
    return outer


def collect_statistics(encoder: nn.Module, windows: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
                       names: Iterable[str] | None = None, *,
                       budget_bytes: int = STATISTICS_BUDGET_BYTES) -> Iterator[dict[str, OutputStatistics]]:
    """Mean, then covariance, of every target's outputs over the calibration windows, yielded group by group
    (`statistic_groups`): one pass of the unmodified encoder for every mean, then one per group for its
    covariances (`windows()` yields the same (features, mask) on every pass). A target's float64 sums are
    the same whatever the groups (its rows, in the same order); a group's covariances are freed once the
    caller drops them (do so before asking for the next group, or two groups are held)."""
    modules = targets(encoder)
    names = list(names) if names is not None else list(modules)
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise QuantizeError(f"not low-rank targets of the encoder: {unknown}")
    means = output_means(encoder, {n: modules[n] for n in names}, windows)
    groups = statistic_groups({n: features(modules[n])[1] for n in names}, budget_bytes)
    for i, group in enumerate(groups, 1):
        logger.info("calibration group %d/%d: %d targets, %.1f GB of statistics", i, len(groups), len(group),
                    sum(covariance_bytes(features(modules[n])[1]) for n in group) / 1e9)
        covs = output_covariances(encoder, {n: modules[n] for n in group}, means, windows)
        yield {n: OutputStatistics(count=means[n].count, mean=means[n].mean, cov=covs.pop(n)) for n in group}


def principal_axes(cov: np.ndarray, columns: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues descending (out,), the leading `columns` eigenvectors (default all) as columns
    (out, columns)) of a covariance, float64."""
    values, vectors = np.linalg.eigh(np.asarray(cov, dtype=np.float64))
    order = np.argsort(values)[::-1]
    return np.clip(values[order], 0.0, None), vectors[:, order[:columns]]


def energy_curve(eigenvalues: np.ndarray) -> np.ndarray:
    """Fraction of the output variance kept at rank 1..out (cumulative, ends at 1)."""
    total = float(np.sum(eigenvalues))
    return np.cumsum(eigenvalues) / total if total > 0 else np.ones(len(eigenvalues))


def rank_for_energy(eigenvalues: np.ndarray, threshold: float) -> int:
    """The smallest rank keeping at least `threshold` of the variance (>= 1)."""
    if not 0.0 < threshold <= 1.0:
        raise QuantizeError(f"an energy threshold must be in (0, 1], got {threshold}")
    curve = energy_curve(eigenvalues)
    return int(min(len(curve), np.searchsorted(curve, threshold - 1e-12) + 1))


def saves(rank: int, in_features: int, out_features: int) -> bool:
    """Whether two linears of rank `rank` are smaller (and cheaper) than the full (out, in) one."""
    return rank * (in_features + out_features) < in_features * out_features


def kept_rank(in_features: int, out_features: int, max_rank: int) -> int:
    """How many principal axes the analysis keeps: the largest rank that `saves` anything (no plan uses a
    larger one), at least 1, at most `max_rank`."""
    largest = (in_features * out_features - 1) // (in_features + out_features)  # largest r: r (in + out) < in out
    return max(1, min(largest, max_rank))


def statistics_bytes(shapes: Iterable[tuple[int, int]], budget_bytes: int = STATISTICS_BUDGET_BYTES) -> dict:
    """Float64 bytes of the calibration statistics of targets of (in, out) `shapes`: all covariances at once,
    the largest group's accumulators, one eigendecomposition's workspace (the covariance's copy, the vectors,
    LAPACK syevd's 2 out^2) and the kept axes (out x kept_rank each)."""
    shapes = list(shapes)
    covs = [covariance_bytes(out_f) for _, out_f in shapes]
    groups = statistic_groups({str(i): out_f for i, (_, out_f) in enumerate(shapes)}, budget_bytes)
    largest = max(sum(covs[int(n)] for n in g) for g in groups)
    kept = sum(FLOAT64_BYTES * out_f * kept_rank(in_f, out_f, min(in_f, out_f)) for in_f, out_f in shapes)
    return {"covariances_all": sum(covs), "groups": len(groups), "encoder_passes": 1 + len(groups),
            "largest_group": largest, "eigh_workspace": 4 * max(covs), "kept_axes": kept,
            # before groups: the accumulators and their divided copy; then the covariances and all full axes
            "peak_before_groups": 2 * sum(covs),
            "peak_at_most": largest + 4 * max(covs) + kept}


# --------------------------------------------------------------------------------------------
# Ranks (analysis)
# --------------------------------------------------------------------------------------------


@dataclass
class TensorPlan:
    """One target: its shape, the rank chosen (None: left full) and the figures compression.json reports."""

    name: str
    layer_type: str
    kind: str  # "linear" or "conv1x1"
    in_features: int
    out_features: int
    threshold: float
    rank: int | None
    energy_kept: float
    rank_for_threshold: int  # the energy rule's rank, even when it saves nothing

    @property
    def params_before(self) -> int:
        return self.in_features * self.out_features + self.out_features

    @property
    def params_after(self) -> int:
        if self.rank is None:
            return self.params_before
        return self.rank * (self.in_features + self.out_features) + self.out_features

    @property
    def macs_before(self) -> int:  # per frame
        return self.in_features * self.out_features

    @property
    def macs_after(self) -> int:
        return self.macs_before if self.rank is None else self.rank * (self.in_features + self.out_features)

    def to_dict(self) -> dict:
        return {**asdict(self), "params": {"before": self.params_before, "after": self.params_after},
                "bytes_fp16": {"before": FP16_BYTES * self.params_before, "after": FP16_BYTES * self.params_after},
                "macs_per_frame": {"before": self.macs_before, "after": self.macs_after}}


@dataclass
class Analysis:
    """What the calibration found: frames and mean (no covariance: each is freed once its axes are taken),
    eigenvalues, the leading principal axes and the largest useful rank of every target."""

    stats: dict[str, OutputMean] = field(default_factory=dict)
    eigenvalues: dict[str, np.ndarray] = field(default_factory=dict)  # (out,) descending
    axes: dict[str, np.ndarray] = field(default_factory=dict)  # (out, kept_rank), columns
    max_rank: dict[str, int] = field(default_factory=dict)  # min(in, out): the output covariance has at most this rank

    def add(self, name: str, stats: OutputStatistics, in_features: int) -> None:
        """One target's eigenvalues and kept axes from its statistics (the covariance is not kept)."""
        out_features = len(stats.mean)
        self.max_rank[name] = min(in_features, out_features)
        self.stats[name] = OutputMean(count=stats.count, mean=stats.mean)
        self.eigenvalues[name], self.axes[name] = principal_axes(
            stats.cov, kept_rank(in_features, out_features, self.max_rank[name]))

    def basis(self, name: str, rank: int) -> np.ndarray:
        """The leading `rank` principal axes (out, rank) of a target; more than were kept is an error."""
        kept = self.axes[name].shape[1]
        if rank > kept:
            raise QuantizeError(f"{name}: a rank-{rank} plan needs {rank} principal axes, the calibration kept "
                                f"{kept} (the largest rank that saves anything, at most min(in, out))")
        return self.axes[name][:, :rank]

    def spectrum(self, energies=(0.9, 0.95, 0.98, 0.99, 0.995, 0.999)) -> dict:
        """Per layer type: the rank each energy needs as a fraction of min(in, out), mean over its tensors."""
        by_type: dict[str, list[list[float]]] = {}
        for name, values in self.eigenvalues.items():
            fractions = [rank_for_energy(values, e) / self.max_rank[name] for e in energies]
            by_type.setdefault(layer_type(name), []).append(fractions)
        return {t: {f"{e:g}": round(float(np.mean([row[i] for row in rows])), 4) for i, e in enumerate(energies)}
                for t, rows in by_type.items()}


def plan_ranks(encoder: nn.Module, analysis: Analysis, thresholds: Mapping[str, float]) -> list[TensorPlan]:
    """Per target: the smallest rank whose kept energy reaches its layer type's threshold; a type
    without a threshold (or 1.0), or a rank that saves nothing, leaves the tensor full."""
    unknown = sorted(set(thresholds) - set(LAYER_TYPES))
    if unknown:
        raise QuantizeError(f"unknown layer type(s) {unknown}; choose from {sorted(LAYER_TYPES)}")
    plans = []
    for name, module in targets(encoder).items():
        if name not in analysis.eigenvalues:
            continue
        kind = "conv1x1" if isinstance(module, nn.Conv1d) else "linear"
        in_f, out_f = features(module)
        t = layer_type(name)
        threshold = float(thresholds.get(t, 1.0))
        values = analysis.eigenvalues[name]
        r = rank_for_energy(values, threshold)
        rank = r if threshold < 1.0 and saves(r, in_f, out_f) else None
        if rank is not None:
            analysis.basis(name, rank)  # raises when the calibration kept fewer axes
        kept = float(energy_curve(values)[(rank or out_f) - 1])
        plans.append(TensorPlan(name=name, layer_type=t, kind=kind, in_features=in_f, out_features=out_f,
                                threshold=threshold, rank=rank, energy_kept=kept, rank_for_threshold=r))
    return plans


# --------------------------------------------------------------------------------------------
# Rewrite (apply)
# --------------------------------------------------------------------------------------------


def factorise(weight: np.ndarray, bias: np.ndarray, mean: np.ndarray, basis: np.ndarray):
    """(down (r, in), up (out, r), up_bias (out,)) with up @ (down @ x) + up_bias = V V^T (W x + b - mu) + mu,
    V = `basis` (out, r) with orthonormal columns (float64)."""
    down = basis.T @ weight  # (r, in)
    up_bias = basis @ (basis.T @ (bias - mean)) + mean  # (out,)
    return down, basis.copy(), up_bias


class LowRankLinear(nn.Sequential):
    """Two smaller linears (or kernel-1 convolutions) in place of one: `down` (in -> r, no bias), `up` (r -> out)."""

    def __init__(self, original: nn.Module, down: np.ndarray, up: np.ndarray, up_bias: np.ndarray):
        rank, in_f = down.shape
        out_f = up.shape[0]
        dtype = original.weight.dtype
        if isinstance(original, nn.Conv1d):
            first, second = nn.Conv1d(in_f, rank, 1, bias=False, dtype=dtype), nn.Conv1d(rank, out_f, 1, dtype=dtype)
        else:
            first, second = nn.Linear(in_f, rank, bias=False, dtype=dtype), nn.Linear(rank, out_f, dtype=dtype)
        with torch.no_grad():
            first.weight.copy_(torch.from_numpy(down).reshape(first.weight.shape))
            second.weight.copy_(torch.from_numpy(up).reshape(second.weight.shape))
            second.bias.copy_(torch.from_numpy(up_bias))
        super().__init__(OrderedDict(down=first, up=second))


def rewrite_encoder(encoder: nn.Module, analysis: Analysis, plans: Iterable[TensorPlan]) -> int:
    """Replace every planned module (rank not None) in place; returns how many were replaced."""
    modules = targets(encoder)
    replaced = 0
    for plan in plans:
        if plan.rank is None:
            continue
        module = modules[plan.name]
        w, b = weight_matrix(module)
        down, up, up_bias = factorise(w, b, analysis.stats[plan.name].mean, analysis.basis(plan.name, plan.rank))
        parent_name, _, child = plan.name.rpartition(".")
        setattr(encoder.get_submodule(parent_name), child, LowRankLinear(module, down, up, up_bias))
        replaced += 1
    return replaced


def encoder_parameters(encoder: nn.Module) -> int:
    return int(sum(p.numel() for p in encoder.parameters()))


def summary(plans: list[TensorPlan], params_before: int, params_after: int) -> dict:
    """compression.json's `lowrank` section (figures per tensor, per type, encoder totals)."""
    by_type: dict[str, dict] = {}
    for p in plans:
        t = by_type.setdefault(p.layer_type, {"tensors": 0, "factorised": 0, "params_before": 0, "params_after": 0,
                                              "macs_per_frame_before": 0, "macs_per_frame_after": 0,
                                              "threshold": p.threshold})
        t["tensors"] += 1
        t["factorised"] += p.rank is not None
        t["params_before"] += p.params_before
        t["params_after"] += p.params_after
        t["macs_per_frame_before"] += p.macs_before
        t["macs_per_frame_after"] += p.macs_after
    return {
        "method": "LiteASR: PCA (eigendecomposition, float64) of each output's covariance on the calibration audio, "
                  "passes of the unmodified encoder (the means, then the covariances in groups of targets); "
                  "y ~ V_r V_r^T (W x + b - mu) + mu",
        "units": {"macs": "multiply-adds per encoder frame (one output row)", "bytes": "fp16 weights + biases"},
        "encoder_parameters": {"before": params_before, "after": params_after,
                               "reduction": round(1 - params_after / params_before, 4)},
        "macs_per_frame": {"before": sum(p.macs_before for p in plans), "after": sum(p.macs_after for p in plans)},
        "by_type": by_type,
        "tensors": [p.to_dict() for p in plans],
    }


# --------------------------------------------------------------------------------------------
# The preset's encoder: calibrate, rewrite, export (apply)
# --------------------------------------------------------------------------------------------


def analyse(encoder: nn.Module, windows: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
            names: Iterable[str] | None = None, *, budget_bytes: int = STATISTICS_BUDGET_BYTES) -> Analysis:
    """`collect_statistics` group by group, each covariance reduced to its eigenvalues and kept axes and
    freed before the next group's pass."""
    modules = targets(encoder)
    analysis = Analysis()
    for group in collect_statistics(encoder, windows, names, budget_bytes=budget_bytes):
        for name in list(group):
            analysis.add(name, group.pop(name), features(modules[name])[0])
    return analysis


def calibrate(model, processor, clips: list[Path], budget_bytes: int = STATISTICS_BUDGET_BYTES) -> Analysis:
    """Statistics and principal axes of the unmodified model's encoder targets on `clips`."""
    front_end = FrontEndConfig.from_processor(processor, dither=0.0)
    logger.info("calibration: %d clips, one pass of the encoder for the means, then one per group of targets",
                len(clips))
    return analyse(model.model.encoder, lambda: calibration_features(clips, front_end), budget_bytes=budget_bytes)


def lowrank_model(model, processor, clips: list[Path], thresholds: Mapping[str, float],
                  analysis: Analysis | None = None) -> dict:
    """Calibrate on `clips` (or reuse `analysis`), plan the ranks and rewrite `model`'s encoder in place;
    returns the summary."""
    encoder = model.model.encoder
    before = encoder_parameters(encoder)
    analysis = analysis if analysis is not None else calibrate(model, processor, clips)
    plans = plan_ranks(encoder, analysis, thresholds)
    replaced = rewrite_encoder(encoder, analysis, plans)
    after = encoder_parameters(encoder)
    logger.info("low-rank encoder: %d/%d tensors factorised, encoder parameters %d -> %d (-%.1f %%)",
                replaced, len(plans), before, after, 100 * (1 - after / before))
    report = summary(plans, before, after)
    report["thresholds"] = dict(thresholds)
    report["calibration_clips"] = len(clips)
    report["spectrum"] = {"rank_fraction_for_energy": analysis.spectrum()}
    return report


def bundle_windows(manifest: dict) -> tuple[float, tuple[float, ...]]:
    """(window seconds, shorter bucket seconds) of an f16 bundle's encoder, from its manifest."""
    audio, enc = manifest["audio"], manifest["encoder"]
    seconds = {fn: f["frames"] * audio["hop_length"] / audio["sampling_rate"]
               for fn, f in enc.get("functions", {"main": {"frames": enc["window_frames"]}}).items()}
    full = seconds.pop("main", enc["window_frames"] * audio["hop_length"] / audio["sampling_rate"])
    return full, tuple(sorted(seconds.values()))


def export_lowrank_encoder(model, processor, settings: ExportSettings, buckets: tuple[float, ...],
                           parts: int = 1) -> dict:
    """Export the (rewritten) model's encoder with the project's encoder export into `settings.out_dir`
    (in `parts` programs, as the f16 bundle's), gated against that PyTorch model (`encoder.parity.json`);
    returns the gate report's dict."""
    staged = (stage_encoder_buckets(model, settings, buckets, processor, parts=parts) if buckets
              else stage_encoder(model, settings, processor, clips=None if settings.skip_verify else
                                 encoder_gate_clips(processor, model, settings), parts=parts))
    report = staged.finish()
    logger.info("low-rank encoder conversion gate: %s", report.headline)
    return report.to_dict()


def encoder_gate_clips(processor, model, settings: ExportSettings):
    """The export's encoder gate speech (`encoder.gate_features` on the packaged clips), as `export` uses it."""
    return gate_features(processor, encoder_shapes(model, settings.window_seconds, processor))


def build_lowrank_encoder(f16_bundle: Path, dst: Path, recipe: Recipe, model_ref: str, calibration: Path,
                          thresholds: Mapping[str, float], *, skip_verify: bool = False,
                          keep_parts: Path | None = None, search: lowrank_search.SearchSettings | None = None) -> dict:
    """The preset's encoder package at `dst`: the checkpoint calibrated and rewritten, its encoder exported
    with the f16 bundle's windows and parts (gated against the rewritten PyTorch model), then `recipe`
    applied (`compress_package`: a copy for fp16, int8 for q8-lowrank); returns its compression.json
    section. With `search` (`lowrank_search.SearchSettings`), `thresholds` are the base of the search: the
    candidate it chooses is built (its report under `lowrank.search`), and none passing raises
    `QuantizeGateError`. An encoder in parts: `dst` is the first part; the fp16 packages of every part are
    exported into `keep_parts` (left for the caller to compress the others, and to remove)."""
    manifest = json.loads((Path(f16_bundle) / MANIFEST_NAME).read_text())
    window, buckets = bundle_windows(manifest)
    parts = len(manifest["encoder"].get("parts") or [None])
    clips = calibration_clips(calibration)
    if search is not None:  # the thresholds searched to the gate on one calibration (quantize.lowrank_search)
        model, processor, report = search.rewritten_model(model_ref, clips, thresholds, window)
    else:
        model, processor = load_reference(model_ref)
        report = lowrank_model(model, processor, clips, thresholds)
    report["calibration"] = str(calibration)
    scratch = keep_parts if keep_parts is not None else temporary_dir(Path(dst).parent, "lowrank")
    try:
        settings = ExportSettings(out_dir=scratch, precision=manifest.get("precision", "fp16"), window_seconds=window,
                                  skip_verify=skip_verify, model_id=manifest.get("model_id") or "unknown",
                                  revision=manifest.get("revision"))
        report["conversion_gate"] = export_lowrank_encoder(model, processor, settings, buckets, parts=parts)
        del model
        release_memory()  # the PyTorch model before the package is compressed and gated
        section = compress_package(scratch / f"{COMPONENT}.mlpackage", Path(dst), recipe)
    finally:
        if keep_parts is None:
            shutil.rmtree(scratch, ignore_errors=True)
    # compress_package's before/after are the rewritten fp16 package and `dst`; the bundle's "before" is the f16 encoder
    f16_encoder = Path(f16_bundle) / f"{COMPONENT}.mlpackage"
    report["package_bytes"] = {"f16": package_size_bytes(f16_encoder), "lowrank_fp16": section["package_bytes"]["before"],
                               "after": section["package_bytes"]["after"]}
    report["weight_file_bytes"] = {"f16": weight_file_bytes(f16_encoder),
                                   "lowrank_fp16": section["weight_file_bytes"]["before"],
                                   "after": section["weight_file_bytes"]["after"]}
    section["lowrank"] = report
    return section
