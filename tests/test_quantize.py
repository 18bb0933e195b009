"""Quantized bundles: compression report, multifunction packages, sensitivity, gates, refusals.

Built from the session's fp16 bundle of the trained default model (`trained_bundle`: 4 s encoder
window + a 2 s bucket, i.e. a multifunction encoder; decoder with a prefill function, a
multifunction decoder); quantized variants are written to this module's own folders.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from .conftest import HELDOUT_DIR, TRAINED_MODEL, heldout_utterances

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

HELDOUT = HELDOUT_DIR


@pytest.fixture(scope="module")
def f16_bundle(trained_bundle):
    return trained_bundle


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    """One held-out clip per language (the gate's evaluation folder)."""
    d = tmp_path_factory.mktemp("eval")
    utts = [{k: v for k, v in u.items() if k != "path"} for u in heldout_utterances(per_language=1)]
    for u in utts:
        shutil.copy(HELDOUT / u["file"], d / u["file"])
    (d / "manifest.json").write_text(json.dumps({"utterances": utts}))
    return d


@pytest.fixture(scope="module")
def q8_bundle(f16_bundle, eval_dir, tmp_path_factory):
    from cohere_coreml.quantize import quantize_bundle

    out = tmp_path_factory.mktemp("qb") / "q8"
    report = quantize_bundle(f16_bundle, out, "q8", model=str(TRAINED_MODEL), eval_dir=eval_dir)
    return out, report


def test_q8_report_lists_every_weight(f16_bundle, q8_bundle):
    from cohere_coreml.quantize import compressed_ops, load_function, weight_tensors

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


def test_q8_multifunction_decoder_keeps_prefill_bind_and_shares_weights(q8_bundle):
    from cohere_coreml.bundle import package_io
    from cohere_coreml.quantize import compressed_ops, package_functions

    out, report = q8_bundle
    assert set(package_functions(out / "decoder.mlpackage")) == {"main", "bind_memory", "prefill"}
    mf = report["components"]["decoder"]["multifunction"]
    # merged package holds the step's weights once (prefill and bind_memory add no copy)
    assert mf["merged_over_single"] < 1.02, mf
    # bind_memory has no weights: merged as it is, with the same states as the compressed step
    io = {fn: package_io(out / "decoder.mlpackage", fn) for fn in ("main", "bind_memory", "prefill")}
    assert io["bind_memory"]["states"] == io["main"]["states"] == io["prefill"]["states"]
    assert set(io["main"]["inputs"]) == {"input_ids", "position"}
    assert compressed_ops(out / "decoder.mlpackage")


def test_q8_gate_figures_and_bundle(f16_bundle, q8_bundle):
    from cohere_coreml.integrity import check_bundle
    from cohere_coreml.transcribe import Transcriber

    out, report = q8_bundle
    gate = report["gate"]
    assert gate["passed"] and gate["heldout"]["baseline"] == "pytorch"
    d = gate["decoder"]
    assert d["argmax_agree"] == d["steps"] and 0 < d["abs_error_nats"]["max"] < 1.0
    assert set(d["eos_error_nats"]) >= {"median", "p99", "max"}
    for name in ("encoder.parity.json", "decoder.parity.json", "heldout.parity.json", "README.md",
                 "example_inference.py", "compression.json"):
        assert (out / name).is_file(), name
    # the gates' reports follow the export's convention: GateReport dicts in <component>.parity.json
    for name in ("encoder", "decoder", "heldout"):
        written = json.loads((out / f"{name}.parity.json").read_text())
        assert written["component"] == name and written["passed"] is True and written["headline"]
        assert written == json.loads(json.dumps(gate[name])), name
    assert not list(out.glob("*.parity-failed.json"))
    # the held-out gate bounds every language; the card lists them
    held, card = gate["heldout"], (out / "README.md").read_text()
    assert set(held["languages"]) == {"de", "en", "es"} and held["worst_increase"] <= 0.005
    assert all(f", {lang} (WER) | 1 |" in card for lang in held["languages"])
    assert check_bundle(out)["files"] > 10
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["preset"] == "q8" and manifest["recipe"]["decoder"]["scheme"] == "int8"
    assert manifest["min_os"]["iOS"] == "18.0"
    # the front end is not compressed: the f16 package and its gate report, byte for byte
    f16 = json.loads((f16_bundle / "manifest.json").read_text())
    fe_files = {k: v for k, v in manifest["checksums"]["files"].items() if k.startswith("frontend.")}
    assert "frontend.parity.json" in fe_files and any(k.startswith("frontend.mlpackage/") for k in fe_files)
    assert fe_files == {k: v for k, v in f16["checksums"]["files"].items() if k.startswith("frontend.")}
    assert manifest["frontend"] == f16["frontend"] and "front-end features" in (out / "README.md").read_text()
    # the quantized bundle transcribes like the reference on a held-out clip, with either front end
    ref = json.loads((HELDOUT / "manifest.json").read_text())["utterances"][0]["text"]
    for front_end in ("python", "package"):
        res = Transcriber(out, backend="mil", front_end=front_end).transcribe(HELDOUT / "en_heldout_00000.flac",
                                                                              language="en")
        assert res.text.strip(" .?").lower() == ref.strip(" .?").lower(), front_end


def test_quantizing_twice_is_refused(f16_bundle, q8_bundle, tmp_path):
    from cohere_coreml.quantize import QuantizeError, quantize_bundle

    out, _ = q8_bundle
    with pytest.raises(QuantizeError, match="already a 'q8' bundle"):
        quantize_bundle(out, tmp_path / "again", "q8", skip_gate=True)
    # a bundle without its compression report but with compressed packages is refused too
    sneaky = tmp_path / "sneaky"
    shutil.copytree(out, sneaky)
    (sneaky / "compression.json").unlink()
    manifest = json.loads((sneaky / "manifest.json").read_text())
    manifest.pop("checksums"), manifest.pop("preset")
    (sneaky / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(QuantizeError, match="already holds compressed weights"):
        quantize_bundle(sneaky, tmp_path / "again", "q8", skip_gate=True)
    with pytest.raises(QuantizeError, match="not a bundle"):
        quantize_bundle(tmp_path, tmp_path / "x", "q8")
    with pytest.raises(QuantizeError, match="exists"):
        quantize_bundle(f16_bundle, out, "q8")


def test_reserved_output_folder_is_used_and_keeps_its_placeholder(f16_bundle, tmp_path):
    """The checkout reserves q8/ with only a .gitkeep: `make quantize` writes into it on a fresh checkout,
    the placeholder stays (hidden: not part of the bundle) and the bundle checks clean."""
    from cohere_coreml.integrity import check_bundle
    from cohere_coreml.quantize import quantize_bundle

    out = tmp_path / "q8"
    out.mkdir()
    (out / ".gitkeep").touch()
    quantize_bundle(f16_bundle, out, "q8", skip_gate=True)
    assert (out / ".gitkeep").is_file() and (out / "manifest.json").is_file()
    assert check_bundle(out)["files"] > 5


def test_int4_skips_are_visible(f16_bundle, tmp_path):
    """Width 144 is not a multiple of the int4 block (32): coremltools skips those weights with a
    log line only; the report names each one and the reason."""
    from cohere_coreml.quantize import Recipe, compress_package

    sec = compress_package(f16_bundle / "encoder.mlpackage", tmp_path / "e.mlpackage", Recipe("int4"))
    skipped = {u["name"]: u["reason"] for u in sec["uncompressed"]}
    name = "encoder_layers_0_self_attn_q_proj_weight_to_fp16"  # (144, 144)
    assert "not divisible by block size 32" in skipped[name]
    assert any(c["name"].endswith("k_proj_0_weight_to_fp16") for c in sec["compressed"])  # (128, 128) works


def test_broken_compression_fails_the_gate_and_leaves_nothing(f16_bundle, monkeypatch, tmp_path):
    """A 1-bit palette destroys the decoder: the gate refuses it and no bundle is left behind."""
    import coremltools.optimize.coreml as cto

    from cohere_coreml import quantize as Q

    real = Q.scheme_config

    def broken(scheme):
        if scheme == "int8":
            return cto.OpPalettizerConfig(nbits=1, mode="uniform", weight_threshold=Q.WEIGHT_THRESHOLD)
        return real(scheme)

    monkeypatch.setattr(Q, "scheme_config", broken)
    monkeypatch.setitem(Q.PRESETS, "q8", {"encoder": Q.Recipe(None), "decoder": Q.Recipe("pal1")})
    monkeypatch.setattr(Q.Recipe, "to_dict", lambda self: {"scheme": self.scheme})
    monkeypatch.setattr(Q, "compress_mlmodel", lambda m, r, w: (cto.palettize_weights(
        m, cto.OptimizationConfig(global_config=broken("int8"))), {}, {}))
    out = tmp_path / "broken"
    with pytest.raises(Q.QuantizeGateError, match="decoder PSNR") as err:
        Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]
    # the refused figures are kept beside (not inside) the would-be bundle, and the error names the file
    refused = json.loads(Q.refusal_path(out).read_text())
    assert str(Q.refusal_path(out)) in str(err.value)
    assert refused["passed"] is False and refused["preset"] == "q8"
    assert refused["gate"]["encoder"]["passed"] is True  # fp16 encoder: gated and passed first
    decoder = refused["gate"]["decoder"]
    assert decoder["passed"] is False and decoder["worst_psnr_db"] < decoder["min_psnr_db"]
    assert decoder["abs_error_nats"]["max"] > 0
    # an ungated build leaves the refusal (the gate's last word); a gated build that passes removes it
    monkeypatch.undo()
    Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None, skip_gate=True)
    assert out.is_dir() and Q.refusal_path(out).is_file()
    Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None, force=True)
    assert out.is_dir() and not Q.refusal_path(out).exists()


def test_sensitivity_and_target_psnr(f16_bundle, tmp_path):
    from cohere_coreml import quantize as Q

    data = Q.build_gate_data(f16_bundle, Q.gate_clips(HELDOUT, per_language=1)[:2], max_new_tokens=12)
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
    from cohere_coreml.convert import psnr

    assert min(psnr(r, o) for r, o in zip(data.decoder_ref, produced)) >= target - 0.5


def test_log_prob_error_measures_the_difference():
    from cohere_coreml.quantize import log_prob_error

    rng = np.random.default_rng(0)
    ref = [np.log(np.full((5, 8), 1 / 8))]
    out = [ref[0].copy()]
    out[0][:, 3] += 0.5  # eos id 3 raised by 0.5 nats at every step
    e = log_prob_error(ref, out, prompts=[[0, 1]], eos_ids=[3], top_k=8)
    assert e["eos_error_nats"]["max"] == pytest.approx(0.5) and e["eos_error_nats"]["mean_signed"] == pytest.approx(0.5)
    assert e["flip_bound_nats"]["max"] == pytest.approx(0.5)
    assert e["steps"] == 4  # from the last prompt token on
    same = log_prob_error(ref, ref, [[0, 1]], [3])
    assert same["abs_error_nats"]["max"] == 0.0
    # fp16 log-probs that do not sum to 1: identical outputs still have KL 0
    rows = [np.float16(rng.standard_normal((6, 50)) * 4).astype(np.float32)]
    rows[0] -= np.log(np.sum(np.exp(rows[0]), -1, keepdims=True))
    rows[0] = rows[0].astype(np.float16).astype(np.float32)
    assert log_prob_error(rows, rows, [[0]], [3])["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    del rng


def test_heldout_gate_bounds_every_language(monkeypatch, tmp_path):
    """One language made worse is refused even when the average over languages stays within 0.5 points;
    the same error spread thin passes. Per-language rates are the bench's (metrics.error_counts)."""
    from cohere_coreml import quantize as Q

    refs = [f"word{i} alpha beta gamma delta" for i in range(40)]  # 40 clips x 5 words per language
    base = {"files": [f"{l}{i}.wav" for l in "ab" for i in range(40)], "refs": refs * 2,
            "languages": ["en"] * 40 + ["de"] * 40, "ids": [[i, 1] for i in range(80)], "texts": refs * 2}

    def produced(wrong: list[int]) -> dict:
        texts = [t.replace("alpha", "alfa") if i in wrong else t for i, t in enumerate(base["texts"])]
        ids = [[i, 9] if i in wrong else ids for i, ids in enumerate(base["ids"])]
        return {**base, "texts": texts, "ids": ids}

    one_language = produced([40, 41])  # 2 de words of 200 wrong: de +1.0 point, overall +0.5, en unchanged
    cmp = Q.compare_transcripts(base, one_language)
    assert cmp["languages"]["de"]["increase"] == pytest.approx(0.01) and cmp["languages"]["en"]["increase"] == 0
    assert cmp["worst_increase"] == pytest.approx(0.01) and cmp["wer_increase"] == pytest.approx(0.005)
    assert cmp["languages"]["de"]["identical_clips"] == 38 and cmp["identical_clips"] == 78

    def gate(prod):
        monkeypatch.setattr(Q, "bundle_transcripts", lambda d, *a, **k: base if d == "f16" else prod)
        return Q.heldout_gate("f16", "q", tmp_path, Q.GATES["q8"], model=None, limit_per_language=None)

    refused = gate(one_language)
    assert not refused.passed and "worst language de" in refused.headline and "+1.00 points" in refused.headline
    assert gate(produced([0, 40])).passed  # +0.5 points in each language: at the bound
    assert not gate(produced([0, 1, 40])).passed  # en +1.0
    assert gate(base).passed


def test_palette_fallback_compresses_what_the_palettizer_skips(f16_bundle, tmp_path):
    """coremltools' per-grouped-channel palettizer silently skips the encoder's folded relative-position
    projections (1, H, D, 2T-1: a channel axis of 1, shorter than the group); without a fallback the
    report lists them as skipped without a reason; q4's recipe compresses them with int8 instead, says
    why, and the package still runs close to f16."""
    from cohere_coreml import quantize as Q
    from cohere_coreml.runtime import load_model

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
    data = Q.build_gate_data(f16_bundle, Q.gate_clips(HELDOUT, per_language=1)[:1], max_new_tokens=4)
    out = Q.encoder_outputs(load_model(str(tmp_path / "q4.mlpackage"), backend="mil"), data)
    assert Q.encoder_psnr(data.encoder_ref, out) >= Q.GATES["q4"]["encoder_psnr_db"]
