"""Weight inventory and the per-tensor report of compression.json (`cohere_coreml.quantize.inventory`)."""

from __future__ import annotations

import json

import pytest

from cohere_coreml.quantize import compressed_ops, load_function, weight_tensors

pytestmark = pytest.mark.slow


def test_q8_report_lists_every_weight(f16_bundle, q8_bundle):
    out, report = q8_bundle
    on_disk = json.loads((out / "compression.json").read_text())
    assert on_disk["preset"] == "q8"
    for comp in ("encoder", "decoder"):
        sec = on_disk["components"][comp]
        weights = weight_tensors(load_function(f16_bundle / f"{comp}.mlpackage"))
        listed = {c["name"] for c in sec["compressed"]} | {u["name"] for u in sec["uncompressed"]}
        assert listed == set(weights), comp  # every weight tensor, once
        assert sec["tensors"]["compressed"] > 0
        assert all(u["reason"] for u in sec["uncompressed"])
        for c in sec["compressed"]:  # int8: about half the fp16 bytes (+ one fp16 scale per channel)
            assert c["bytes_after"] < 0.6 * c["bytes_before"], c
        assert sec["weight_file_bytes"]["after"] < sec["weight_file_bytes"]["before"]
        assert compressed_ops(out / f"{comp}.mlpackage")
    dec = on_disk["components"]["decoder"]
    kept = {u["name"]: u["reason"] for u in dec["uncompressed"]}
    assert "recipe" in kept["proj_out_weight_to_fp16"]
    assert not any("coremltools did not compress" in r for r in kept.values())
    # an fp16 package holds no compressed op
    assert not compressed_ops(f16_bundle / "decoder.mlpackage")
