"""coremltools compression of one package: multifunction merge, skip reasons, the fallback pass
(`cohere_coreml.quantize.compress`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cohere_coreml import quantize as Q
from cohere_coreml.bundle.packages import package_io
from cohere_coreml.quantize import compress as C
from cohere_coreml.quantize import measure
from cohere_coreml.runtime import load_model
from cohere_coreml.storage.files import save_converted

from ..fixture_data import HELDOUT_DIR

pytestmark = pytest.mark.slow


def test_q8_multifunction_decoder_keeps_prefill_and_shares_weights(q8_bundle):
    out, report = q8_bundle
    functions = set(Q.package_functions(out / "decoder.mlpackage"))
    host = "bind_memory" not in functions  # the default export: the host-state decoder (no bind function)
    # the session bundle's decoder has word timings' align function (export --alignment-heads auto) and the
    # batched step (export --decoder-batch, host state): kept too
    assert functions == {"main", "prefill", "align"} | ({"step_batch"} if host else {"bind_memory"})
    mf = report["components"]["decoder"]["multifunction"]
    # merged package holds the step's weights once (prefill and step_batch add no copy)
    assert mf["merged_over_single"] < 1.02, mf
    # every function keeps the compressed step's states (a graph decoder's bind_memory, without weights, too),
    # step_batch its own of B rows
    io = {fn: package_io(out / "decoder.mlpackage", fn) for fn in sorted(functions)}
    assert all(f["states"] == io["main"]["states"] for fn, f in io.items() if fn != "step_batch")
    if host:
        assert io["step_batch"]["states"] == package_io(Path(report["source"]) / "decoder.mlpackage",
                                                        "step_batch")["states"]
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


def _public_coremltools(mlmodel, scheme, config):
    """What `compress.run_coremltools` stands for: coremltools' public functions."""
    import coremltools.optimize.coreml as cto

    if scheme in ("int8", "int4"):
        return cto.linear_quantize_weights(mlmodel, config)
    return cto.palettize_weights(mlmodel, config)


def _ops(path, fn):
    return [(op.op_type, op.name) for op in Q.load_function(path, fn).operations
            if op.op_type != "const" and not op.op_type.startswith("constexpr_")]


def _weights(path):
    from cohere_coreml.runtime.package import package_files

    return (Path(package_files(path)[1]) / "weight.bin").read_bytes()


@pytest.mark.parametrize("component", ["encoder", "decoder"])
def test_compression_writes_the_weights_of_coremltools_public_functions(f16_bundle, tmp_path, monkeypatch, component):
    """`run_coremltools` skips the conversion pipeline that coremltools' public functions run again:
    the weight file is the same bytes as through `cto.linear_quantize_weights` / `cto.palettize_weights`
    with every scheme (a mixed recipe of pal4, pal6, int4 and int8 tensors and the int8 fallback on the
    encoder; q8's recipe on the stateful decoder), and the graph is the exported one, op for op (the
    public functions' re-run renames ops and rewrites transposes)."""
    src = f16_bundle / f"{component}.mlpackage"
    weights = Q.weight_tensors(Q.load_function(src, "main"))
    if component == "encoder":
        names = sorted(n for n, i in weights.items() if len(i["shape"]) > 1 and np.prod(i["shape"]) > Q.WEIGHT_THRESHOLD)
        schemes = ["pal4", "pal6"] + ["int4", "int8"] * len(names)  # (palettes are slow to fit: one tensor each)
        recipe = Q.Recipe("mixed", per_tensor=tuple(zip(names, schemes)), fallback="int8")
    else:
        recipe = Q.PRESETS["q8"]["decoder"]
    out = {}
    for way in ("fast", "public"):
        if way == "public":
            monkeypatch.setattr(C, "run_coremltools", _public_coremltools)
        model, _, fallen = C.compress_mlmodel(C.extract_function(src, "main"), recipe, weights)
        save_converted(model, tmp_path / f"{way}.mlpackage")
        done = C.compressed_tensors(Q.load_function(tmp_path / f"{way}.mlpackage", "main"))
        out[way] = ({n: (c["op"], c["bytes"]) for n, c in done.items()}, fallen)
    (fast, fast_fallen), (public, public_fallen) = out["fast"], out["public"]
    ops = {"constexpr_blockwise_shift_scale"} | ({"constexpr_lut_to_dense"} if component == "encoder" else set())
    assert {op for op, _ in fast.values()} == ops, fast
    assert bool(fast_fallen) == (component == "encoder") and fast_fallen == public_fallen
    assert fast == public
    assert _weights(tmp_path / "fast.mlpackage") == _weights(tmp_path / "public.mlpackage")
    assert _ops(tmp_path / "fast.mlpackage", "main") == _ops(src, "main")
    assert _ops(tmp_path / "public.mlpackage", "main") != _ops(src, "main")  # what the fast path skips
