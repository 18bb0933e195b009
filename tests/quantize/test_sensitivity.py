"""Per-weight sensitivity and `--target-psnr` (`cohere_coreml.quantize.sensitivity`)."""

from __future__ import annotations

import pytest

from cohere_coreml import quantize as Q
from cohere_coreml.export.parity import psnr

from ..fixture_data import HELDOUT_DIR

pytestmark = pytest.mark.slow


def test_sensitivity_and_target_psnr(f16_bundle, tmp_path):
    data = Q.build_gate_data(f16_bundle, Q.gate_clips(HELDOUT_DIR, per_language=1)[:2], max_new_tokens=12)
    dst = tmp_path / "d.mlpackage"
    sec = Q.compress_package(f16_bundle / "decoder.mlpackage", dst, Q.Recipe("int8"))
    sens = Q.sensitivity("decoder", f16_bundle / "decoder.mlpackage", dst, data)
    assert set(sens["per_weight"]) == {c["name"] for c in sec["compressed"]}
    # one weight alone is closer to f16 than all of them together
    assert min(sens["per_weight"].values()) > sens["all"]
    saved = {c["name"]: c["bytes_before"] - c["bytes_after"] for c in sec["compressed"]}
    target = sens["all"] + 3.0
    choice = Q.choose_fp16("decoder", f16_bundle / "decoder.mlpackage", dst, data, sens["per_weight"], saved, target)
    assert choice["met"] and choice["kept_fp16"]
    assert choice["kept_fp16"][0] == min(sens["per_weight"], key=sens["per_weight"].get)  # most sensitive first
    assert choice["steps"][-1]["psnr_db"] >= target > choice["steps"][0]["psnr_db"]
    # each step also records the decoder's log-prob error bound; the first is that of the full int8 package
    full = Q.log_prob_error(data.decoder_ref, Q.decoder_outputs(Q.decoder_runtime(dst), data),
                            data.prompts, data.eos_ids)
    first, last = choice["steps"][0], choice["steps"][-1]
    assert first["log_prob_error_nats"]["max"] == pytest.approx(full["abs_error_nats"]["max"])
    assert first["eos_error_max_nats"] == pytest.approx(full["eos_error_nats"]["max"])
    assert last["log_prob_error_nats"]["p99"] < first["log_prob_error_nats"]["p99"]
    capped = Q.choose_fp16("decoder", f16_bundle / "decoder.mlpackage", dst, data, sens["per_weight"], saved,
                           float("inf"), max_kept=1)
    assert [s["kept_fp16"] for s in capped["steps"]] == [0, 1] and not capped["met"]
    # rebuilding with those weights fp16 gives a real package that reaches the target
    kept = Q.Recipe("int8", keep_fp16=tuple(choice["kept_fp16"]))
    dst2 = tmp_path / "d2.mlpackage"
    sec2 = Q.compress_package(f16_bundle / "decoder.mlpackage", dst2, kept)
    assert sec2["weight_bytes"]["after"] - sec["weight_bytes"]["after"] == choice["extra_bytes"]
    produced = Q.decoder_outputs(Q.decoder_runtime(dst2), data)
    assert min(psnr(r, o) for r, o in zip(data.decoder_ref, produced)) >= target - 0.5
