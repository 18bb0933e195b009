"""Parity arithmetic: how far an exported program's outputs are from PyTorch's.

* `psnr`: peak signal-to-noise ratio of one array against its reference (every gate's figure);
* `kl_rows`: KL(P_ref || P_out) per row of log-prob (or logit) matrices, both sides renormalised;
* `argmax_flips` / `flip_row`: argmax disagreements of log-prob rows, each judged against the error
  measured at that step (near-tie or decisive; the rule of the decoder gate, the quantization gate and
  verify's token verdicts);
* `report_correctness` / `CorrectnessReport`: per-output PSNR (and exact integer outputs) of one
  call of a program, as `gate.compare_cases` and the front end's gate score their cases.

Used by the gate (`gate`, `decoder_gate`), the encoder and front-end exports, `verify` and `quantize`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import NEAR_TIE_FACTOR, NEAR_TIE_TOP_K
from ..export_errors import ParityError

# --------------------------------------------------------------------------------------------
# Distances
# --------------------------------------------------------------------------------------------


def psnr(reference: np.ndarray, produced: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) of `produced` against `reference`.

    peak = max |reference| (1.0 if the reference is all zero); identical arrays give +inf,
    any non-finite value in `produced` (where the reference is finite) gives -inf.
    """
    ref = np.asarray(reference, dtype=np.float64)
    out = np.asarray(produced, dtype=np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"psnr: shape mismatch {ref.shape} vs {out.shape}")
    if not np.all(np.isfinite(out)):
        return float("-inf")
    mse = float(np.mean((ref - out) ** 2)) if ref.size else 0.0
    if mse == 0.0:
        return float("inf")
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    if peak == 0.0:
        peak = 1.0
    return 10.0 * math.log10(peak * peak / mse)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """log-softmax in float64 (max-shifted): logits or unnormalised log-probs -> normalised log-probs."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def kl_rows(reference: np.ndarray, produced: np.ndarray, axis: int = -1) -> np.ndarray:
    """KL(P_ref || P_out) in nats per row: (..., V) -> (...); the one KL of the project.

    Both arguments are logits or log-probabilities; each row of both is renormalised first
    (`log_softmax`): a program's fp16 log-probs do not sum to exactly 1 (two identical fp16 rows
    would otherwise give KL ~6e-5, not 0), and logits give the KL of their softmax. A row whose
    produced values are not all finite gives +inf.
    """
    lp = log_softmax(reference, axis)
    lq = log_softmax(produced, axis)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=axis)
    return np.where(np.all(np.isfinite(lq), axis=axis), kl, np.inf)


# --------------------------------------------------------------------------------------------
# Argmax disagreements of log-prob rows
# --------------------------------------------------------------------------------------------


def flip_row(ref_row: np.ndarray, out_row: np.ndarray, a: int, b: int, top_k: int = NEAR_TIE_TOP_K,
             factor: float = NEAR_TIE_FACTOR) -> dict:
    """One argmax disagreement judged against the error measured at its step: the reference's token `a`,
    the produced token `b`, of one (V,) log-prob row each.

    margin = ref[a] - ref[b]; error = max |out - ref| over the reference's top-`top_k` tokens other than
    a and b (the error level of that step, measured on tokens the flip does not involve: the two flipped
    tokens' own errors always explain the flip). The flip is a near-tie when margin <= `factor` x error:
    what the measured error could flip; otherwise it is decisive."""
    ref = np.asarray(ref_row, np.float64).reshape(-1)
    out = np.asarray(out_row, np.float64).reshape(-1)
    top = [int(t) for t in np.argsort(-ref)[: top_k + 2] if t not in (a, b)][:top_k]
    error = float(np.max(np.abs(out[top] - ref[top]))) if top else 0.0
    margin = float(ref[a] - ref[b])
    finite = bool(np.isfinite(margin) and np.isfinite(error))
    return {"ref_token": int(a), "out_token": int(b), "ref_margin_nats": margin, "step_error_nats": error,
            "near_tie": bool(finite and margin <= factor * error)}


def argmax_flips(ref_log_probs: np.ndarray, out_log_probs: np.ndarray, positions=None,
                 top_k: int = NEAR_TIE_TOP_K, factor: float = NEAR_TIE_FACTOR) -> dict:
    """Argmax disagreements of `out` vs `ref` ((steps, V) log-probs), each judged by `flip_row` (a
    near-tie the measured error could flip, or decisive: what refuses). Returns counts and one row per flip."""
    ref = np.asarray(ref_log_probs, np.float64).reshape(len(ref_log_probs), -1)
    out = np.asarray(out_log_probs, np.float64).reshape(len(out_log_probs), -1)
    positions = list(range(len(ref))) if positions is None else list(positions)
    rows = []
    for i, pos in enumerate(positions):
        a, b = int(ref[i].argmax()), int(out[i].argmax())
        if a != b:
            rows.append({"position": int(pos), **flip_row(ref[i], out[i], a, b, top_k, factor)})
    near = sum(r["near_tie"] for r in rows)
    return {"flips": len(rows), "near_tie_flips": near, "decisive_flips": len(rows) - near, "top_k": top_k,
            "factor": factor, "rows": rows}


# --------------------------------------------------------------------------------------------
# Per-output report of a single-call program
# --------------------------------------------------------------------------------------------


@dataclass
class OutputCheck:
    name: str
    shape: tuple[int, ...]
    psnr_db: float
    max_abs_err: float
    ref_max_abs: float
    passed: bool
    problem: str | None = None


@dataclass
class CorrectnessReport:
    """Per-output parity figures; `passed` only when every output reaches `min_psnr_db`."""

    min_psnr_db: float
    outputs: list[OutputCheck] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def worst_psnr_db(self) -> float:
        return min((o.psnr_db for o in self.outputs), default=float("-inf"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "min_psnr_db": self.min_psnr_db,
            "worst_psnr_db": _finite_or_str(self.worst_psnr_db),
            "outputs": [
                {**dataclasses.asdict(o), "psnr_db": _finite_or_str(o.psnr_db), "shape": list(o.shape)}
                for o in self.outputs
            ],
            **self.extra,
        }

    def summary(self) -> str:
        lines = [f"parity gate (min PSNR {self.min_psnr_db:g} dB): {'PASS' if self.passed else 'FAIL'}"]
        for o in self.outputs:
            flag = "ok " if o.passed else "BAD"
            extra = f"  ({o.problem})" if o.problem else ""
            lines.append(
                f"  {flag} {o.name:<24} {str(o.shape):<22} PSNR {o.psnr_db:8.2f} dB  "
                f"max|err| {o.max_abs_err:.3g}  max|ref| {o.ref_max_abs:.3g}{extra}"
            )
        return "\n".join(lines)

    def raise_if_failed(self, what: str = "exported program") -> None:
        if not self.passed:
            raise ParityError(f"{what} does not match PyTorch:\n{self.summary()}", report=self)


def _finite_or_str(x: float):
    return x if math.isfinite(x) else str(x)


def report_correctness(
    reference: Mapping[str, np.ndarray],
    produced: Mapping[str, np.ndarray],
    min_psnr: float,
    exact: Sequence[str] = (),
) -> CorrectnessReport:
    """Compare every reference output with the produced one.

    Args:
        reference: name -> PyTorch array.
        produced: name -> array from the exported program (extra names are ignored).
        min_psnr: threshold in dB every float output must reach.
        exact: names that must match exactly (integer outputs such as lengths).

    A missing output, a shape mismatch or a non-finite value fails that output.
    """
    report = CorrectnessReport(min_psnr_db=float(min_psnr))
    for name, ref in reference.items():
        ref = np.asarray(ref)
        if name not in produced:
            report.outputs.append(OutputCheck(name, tuple(ref.shape), float("-inf"), float("inf"),
                                              _maxabs(ref), False, "missing output"))
            continue
        out = np.asarray(produced[name])
        if out.size == ref.size and out.shape != ref.shape and np.squeeze(out).shape == np.squeeze(ref).shape:
            out = out.reshape(ref.shape)
        if out.shape != ref.shape:
            report.outputs.append(OutputCheck(name, tuple(ref.shape), float("-inf"), float("inf"),
                                              _maxabs(ref), False, f"shape {out.shape} != {ref.shape}"))
            continue
        ref64 = ref.astype(np.float64)
        out64 = out.astype(np.float64)
        finite = bool(np.all(np.isfinite(out64)))
        err = float(np.max(np.abs(ref64 - out64))) if ref.size and finite else (0.0 if finite else float("inf"))
        if name in exact:
            ok = finite and np.array_equal(ref64, out64)
            value = float("inf") if ok else float("-inf")
            report.outputs.append(OutputCheck(name, tuple(ref.shape), value, err, _maxabs(ref), ok,
                                              None if ok else "must match exactly"))
            continue
        value = psnr(ref64, out64)
        ok = finite and value >= min_psnr
        problem = None if finite else "non-finite values"
        report.outputs.append(OutputCheck(name, tuple(ref.shape), value, err, _maxabs(ref), ok, problem))
    return report


def _maxabs(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.max(np.abs(a))) if a.size else 0.0
