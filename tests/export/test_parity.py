"""The parity arithmetic (cohere_coreml.export.parity): PSNR, the one KL, per-output reports. The argmax-flip
rule is tested with the decoder gate that applies it (tests/export/test_decoder_gate.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cohere_coreml.export.parity import kl_rows, psnr, report_correctness
from cohere_coreml.export_errors import ParityError


def test_psnr_and_kl():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    assert psnr(a, a) == math.inf
    noise = 1e-3 * rng.standard_normal(a.shape)
    expected = 10 * math.log10(float(np.max(np.abs(a))) ** 2 / np.mean(noise**2))
    assert psnr(a, a + noise) == pytest.approx(expected, rel=1e-9)
    bad = a.copy()
    bad[0, 0] = np.nan
    assert psnr(a, bad) == -math.inf
    with pytest.raises(ValueError):
        psnr(a, a[:2])
    assert kl_rows(a, a).mean() == pytest.approx(0.0, abs=1e-12)
    assert kl_rows(a, a + 5.0).mean() == pytest.approx(0.0, abs=1e-9)  # shift invariant (logits)
    assert kl_rows(a, -a).mean() > 0.1


def test_kl_rows_against_the_analytic_value():
    """P = (1/2, 1/2), Q = (9/10, 1/10): KL(P || Q) = ln(5/3), KL(Q || P) = 0.9 ln 1.8 + 0.1 ln 0.2.
    Given as fp16-like log-probs (each row off by a constant: they do not sum to 1), as logits, and
    batched; a KL that does not renormalise the reference, or measures the other direction, is refused."""
    p, q = np.log([0.5, 0.5]), np.log([0.9, 0.1])
    forward, backward = math.log(5 / 3), 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    assert kl_rows(p, q) == pytest.approx(forward, rel=1e-12)
    assert kl_rows(q, p) == pytest.approx(backward, rel=1e-12)
    assert kl_rows(p + 0.01, q - 0.02) == pytest.approx(forward, rel=1e-12)  # unnormalised rows
    assert kl_rows(np.array([3.0, 3.0]), np.log([9.0, 1.0]) + 7.0) == pytest.approx(forward, rel=1e-12)  # logits
    batch = kl_rows(np.stack([p, q, p]), np.stack([q, p, p]))  # (3, 2) -> (3,)
    np.testing.assert_allclose(batch, [forward, backward, 0.0], rtol=1e-12, atol=1e-15)
    assert kl_rows(p, [0.0, np.nan]) == math.inf and kl_rows(p, [0.0, -np.inf]) == math.inf

    def reference_not_renormalised(ref, out):  # the broken variant: only the produced side renormalised
        lq = np.asarray(out, np.float64) - np.log(np.sum(np.exp(out)))
        return float(np.sum(np.exp(ref) * (ref - lq)))

    # the fixture tells them apart: the broken variant is off by about the reference's offset
    assert reference_not_renormalised(p, q) == pytest.approx(forward, rel=1e-12)  # normalised: the same
    assert abs(reference_not_renormalised(p + 0.01, q) - forward) > 5e-3
    assert kl_rows(p + 0.01, q) == pytest.approx(forward, rel=1e-12)
    assert abs(kl_rows(p, q) - backward) > 0.1  # the direction matters


def test_report_correctness():
    rng = np.random.default_rng(1)
    ref = {"h": rng.standard_normal((2, 8)).astype(np.float32), "n": np.array([5], np.int32)}
    good = {"h": ref["h"] + 1e-6, "n": np.array([5], np.int32)}
    r = report_correctness(ref, good, 60.0, exact=("n",))
    assert r.passed and r.worst_psnr_db > 60
    assert "PASS" in r.summary()
    r.raise_if_failed()

    off_by_one = {"h": ref["h"], "n": np.array([6], np.int32)}
    r = report_correctness(ref, off_by_one, 60.0, exact=("n",))
    assert not r.passed
    with pytest.raises(ParityError, match="n"):
        r.raise_if_failed()

    noisy = {"h": ref["h"] + 0.1 * rng.standard_normal((2, 8)), "n": ref["n"]}
    assert not report_correctness(ref, noisy, 60.0, exact=("n",)).passed
    assert not report_correctness(ref, {"n": ref["n"]}, 60.0, exact=("n",)).passed  # missing output
    assert not report_correctness(ref, {"h": ref["h"][:1], "n": ref["n"]}, 60.0).passed  # wrong shape
    d = report_correctness(ref, good, 60.0, exact=("n",)).to_dict()
    json.dumps(d)
    assert d["passed"] is True and len(d["outputs"]) == 2
