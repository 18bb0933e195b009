"""coremltools compression of one package: multifunction merge, skip reasons, the fallback pass
(`cohere_coreml.quantize.compress`)."""

from __future__ import annotations

import pytest

from cohere_coreml import quantize as Q
from cohere_coreml.bundle import package_io
from cohere_coreml.quantize import measure
from cohere_coreml.runtime import load_model

from ..fixture_data import HELDOUT_DIR

pytestmark = pytest.mark.slow


def test_q8_multifunction_decoder_keeps_prefill_and_shares_weights(q8_bundle):
    out, report = q8_bundle
    functions = set(Q.package_functions(out / "decoder.mlpackage"))
    host = "bind_memory" not in functions  # the default export: the host-state decoder (no bind function)
    assert functions == {"main", "prefill"} | (set() if host else {"bind_memory"})
    mf = report["components"]["decoder"]["multifunction"]
    # merged package holds the step's weights once (prefill adds no copy)
    assert mf["merged_over_single"] < 1.02, mf
    # every function keeps the compressed step's states (a graph decoder's bind_memory, without weights, too)
    io = {fn: package_io(out / "decoder.mlpackage", fn) for fn in sorted(functions)}
    assert all(f["states"] == io["main"]["states"] for f in io.values())
    assert set(io["main"]["inputs"]) == {"input_ids", "position"} | ({"cache_mask"} if host else set())
    assert Q.compressed_ops(out / "decoder.mlpackage")


def test_int4_skips_are_visible(f16_bundle, tmp_path):
    """Width 144 is not a multiple of the int4 block (32): coremltools skips those weights with a
    log line only; the report names each one and the reason."""
    sec = Q.compress_package(f16_bundle / "encoder.mlpackage", tmp_path / "e.mlpackage", Q.Recipe("int4"))
    skipped = {u["name"]: u["reason"] for u in sec["uncompressed"]}
    name = "encoder_layers_0_self_attn_q_proj_weight_to_fp16"  # (144, 144)
    assert "not divisible by block size 32" in skipped[name]
    assert any(c["name"].endswith("k_proj_0_weight_to_fp16") for c in sec["compressed"])  # (128, 128) works


def test_palette_fallback_compresses_what_the_palettizer_skips(f16_bundle, tmp_path):
    """coremltools' per-grouped-channel palettizer silently skips the encoder's folded relative-position
    projections (1, H, D, 2T-1: a channel axis of 1, shorter than the group); without a fallback the
    report lists them as skipped without a reason; q4's recipe compresses them with int8 instead, says
    why, and the package still runs close to f16."""
    src = f16_bundle / "encoder.mlpackage"
    plain = Q.compress_package(src, tmp_path / "plain.mlpackage", Q.Recipe("pal4"))
    silent = {u["name"] for u in plain["uncompressed"] if "no reason" in u["reason"]}
    assert silent and all(len(u["shape"]) == 4 and u["shape"][0] == 1
                          for u in plain["uncompressed"] if u["name"] in silent)
    recipe = Q.PRESETS["q4"]["encoder"]
    assert recipe.fallback == "int8"
    sec = Q.compress_package(src, tmp_path / "q4.mlpackage", recipe)
    fell = {c["name"]: c for c in sec["compressed"] if c.get("fallback_for")}
    assert set(fell) == silent
    assert all(c["scheme"] == "int8" and c["op"] == "constexpr_blockwise_shift_scale" and "pal4" in c["fallback_for"]
               for c in fell.values())
    assert not any("no reason" in u["reason"] for u in sec["uncompressed"])
    assert sec["weight_bytes"]["after"] < plain["weight_bytes"]["after"]
    data = measure.build_gate_data(f16_bundle, measure.gate_clips(HELDOUT_DIR, per_language=1)[:1], max_new_tokens=4)
    out = measure.encoder_outputs(load_model(str(tmp_path / "q4.mlpackage"), backend="mil"), data)
    assert measure.encoder_psnr(data.encoder_ref, out) >= Q.GATES["q4"]["encoder_psnr_db"]
