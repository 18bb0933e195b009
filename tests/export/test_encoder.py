"""Encoder export on tiny checkpoints, run through the project's runtime (MIL interpreter on Linux).

Small windows (2 s = 200 mel frames) keep this fast; the 35 s default is for real exports.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cohere_coreml.bundle.packages import encoder_package_info
from cohere_coreml.export import encoder as E
from cohere_coreml.export import encoder_packages as EP
from cohere_coreml.export.convert import ExportSettings, ParityError
from cohere_coreml.export.parity import psnr
from cohere_coreml.model.shapes import ShapeError, choose_bucket, encoder_frames, encoder_shapes

from ..helpers import broken_encoder_trace

WINDOW_S = 2.0

# name -> make_tiny_checkpoint overrides
CONFIGS = {
    # default tiny shape: encoder width == decoder width, Hkv == H
    "same_width": {},
    # encoder width != decoder width, GQA decoder (2 kv heads for 4 heads), 3 decoder layers, 80 mels
    "gqa_wide_encoder": dict(
        encoder_hidden_size=96,
        encoder_num_attention_heads=3,
        encoder_intermediate_size=160,
        encoder_num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        num_mel_bins=80,
    ),
    # x4 subsampling, kernel 5, 6-head decoder with 3 kv heads and head_dim 8, one layer each
    "subsample4": dict(
        encoder_subsampling_factor=4,
        encoder_conv_kernel_size=5,
        encoder_num_hidden_layers=1,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=1,
    ),
}
# encoder frames for the 200-frame test window: ceil(200 / subsampling factor)
EXPECTED_T = {"same_width": 25, "gqa_wide_encoder": 25, "subsample4": 50}


def _speech_features(n_mels: int, frames: int, processor) -> np.ndarray:
    """Real speech log-mel (n_mels, >= frames) from the committed clips (dither 0)."""
    from cohere_coreml.export.gate import default_gate_audio
    from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel

    clips = default_gate_audio()
    assert clips, "the package ships no gate audio"
    config = FrontEndConfig.from_processor(processor, dither=0.0)
    assert config.n_mels == n_mels
    feats = [log_mel(load_audio(p), config) for p in clips]
    joined = np.concatenate([m[:, :n] for m, n in feats], axis=1).astype(np.float32)
    return np.tile(joined, (1, -(-frames // joined.shape[1])))[:, :frames]


def _window(feats: np.ndarray, n: int, frames: int, fill: float = 0.0) -> np.ndarray:
    w = np.full((1, feats.shape[0], frames), fill, dtype=np.float32)
    w[0, :, :n] = feats[:, :n]
    return w


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    """(model, processor, shapes, runtime model, package path) of an FP32 export of each config."""
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.runtime import load_model
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", seed=3, **CONFIGS[request.param])
    model, processor = load_reference(ckpt)
    settings = ExportSettings(out_dir=root / "out", precision="fp32", window_seconds=WINDOW_S)
    shapes = encoder_shapes(model, WINDOW_S, processor)
    clips = E.gate_features(processor, shapes)
    path = EP.convert_encoder(model, settings, processor, clips=clips)
    assert path == settings.package_path("encoder") and path.exists()
    report = json.loads(settings.report_path("encoder").read_text())
    assert report["passed"] is True and report["min_psnr_db"] == 60.0
    assert len(report["cases"]) >= 2
    # a partial-window case whose right answer is far from the "padding as speech" answer
    partial = [c for c in report["cases"] if c["feature_length"] < shapes.frames]
    assert partial and all(c["discriminates_masking"] for c in partial)
    model.test_config_name = request.param
    return model, processor, shapes, load_model(path, backend="auto"), path


def _run(rt, window: np.ndarray, n: int) -> dict:
    """The package on a window with `n` valid mel frames: the host's length masks (the rule in the
    package's metadata) and the host's encoder_length added to the outputs, as every caller runs it."""
    from cohere_coreml.bundle.packages import package_length_masks

    masks = package_length_masks(rt.path)
    out = dict(rt.predict({"input_features": window, **masks.inputs(n, window.shape[-1])}))
    out["encoder_length"] = np.array([masks.encoder_length(n)], dtype=np.int32)
    return out


def test_shapes_follow_the_config(exported):
    model, _, s, _, path = exported
    cfg = model.config
    assert s.frames == 200 and s.n_mels == cfg.encoder_config.num_mel_bins
    t = EXPECTED_T[model.test_config_name]
    assert s.encoder_frames == t and s.padded_frames == -(-t // 32) * 32  # padded to a multiple of 32
    tp = s.padded_frames
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                           cfg.head_dim)
    import coremltools as ct

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    ins = {i.name: tuple(i.type.multiArrayType.shape) for i in spec.description.input}
    outs = {o.name: tuple(o.type.multiArrayType.shape) for o in spec.description.output}
    stages = cfg.encoder_config.subsampling_factor.bit_length() - 1
    mask_frames = [200]
    for _ in range(stages):  # transformers' conv arithmetic, frame by frame
        mask_frames.append((mask_frames[-1] + 2 * ((cfg.encoder_config.subsampling_conv_kernel_size - 1) // 2)
                            - cfg.encoder_config.subsampling_conv_kernel_size) // 2 + 1)
    assert mask_frames[-1] == t
    names = ["feature_mask", *(f"subsampling_mask_{k}" for k in range(1, stages)), "encoder_mask"]
    assert ins == {"input_features": (1, s.n_mels, 200), **{n: (1, f) for n, f in zip(names, mask_frames)}}
    assert outs == {
        "encoder_hidden_states": (1, tp, cfg.hidden_size),
        "cross_k": (cfg.num_hidden_layers, cfg.num_key_value_heads, tp, cfg.head_dim),
        "cross_v": (cfg.num_hidden_layers, cfg.num_key_value_heads, tp, cfg.head_dim),
        "cross_mask": (1, 1, 1, tp),
    }
    dtypes = {i.name: i.type.multiArrayType.dataType for i in spec.description.input}
    assert {n: dtypes[n] for n in names} == {n: ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16 for n in names}
    meta = dict(spec.description.metadata.userDefined)
    assert meta["com.cohere_coreml.component"] == "encoder"
    assert json.loads(meta["com.cohere_coreml.shapes"])["padded_frames"] == tp
    assert meta["com.cohere_coreml.window_frames"] == "200"
    assert all(f.shortDescription for f in list(spec.description.input) + list(spec.description.output))


@pytest.mark.parametrize("n", [37, 121, 200])
def test_padded_window_equals_unpadded_transformers(exported, n):
    model, processor, s, rt, _ = exported
    feats = _speech_features(s.n_mels, s.frames, processor)
    out = _run(rt, _window(feats, n, s.frames), n)
    ref = E.unpadded_reference(model, feats[None, :, :n])  # (1, t, Ddec), no padding, no mask
    t = ref.shape[1]
    assert int(out["encoder_length"][0]) == t
    got = np.asarray(out["encoder_hidden_states"], dtype=np.float32)
    assert psnr(ref, got[:, :t]) >= 60.0
    assert np.all(got[:, t:] == 0.0)
    mask = np.asarray(out["cross_mask"]).reshape(-1)
    assert np.all(mask[:t] == 0.0) and np.all(mask[t:] == E.MASK_VALUE)


def test_feature_length_is_not_ignored(exported):
    model, processor, s, rt, _ = exported
    feats = _speech_features(s.n_mels, s.frames, processor)
    full = _window(feats, s.frames, s.frames)
    a = _run(rt, full, s.frames)
    b = _run(rt, full, 120)
    ta, tb = int(a["encoder_length"][0]), int(b["encoder_length"][0])
    assert ta == s.encoder_frames and tb < ta
    # the frames both runs call valid differ by far more than the FP32 parity level (>= 60 dB):
    # the frames beyond feature_length were really masked away
    ha = np.asarray(a["encoder_hidden_states"])[:, :tb]
    hb = np.asarray(b["encoder_hidden_states"])[:, :tb]
    assert psnr(ha, hb) < 60.0
    ref_b = E.reference_outputs(model, s, full, 120)["encoder_hidden_states"][:, :tb]
    assert psnr(ref_b, hb) >= 60.0 and psnr(ref_b, ha) < 60.0
    # ... and whatever lies beyond feature_length does not matter
    noisy = _window(feats, 120, s.frames, fill=0.0)
    noisy[0, :, 120:] = np.random.default_rng(0).standard_normal((s.n_mels, s.frames - 120))
    c = _run(rt, noisy, 120)
    for name in ("encoder_hidden_states", "cross_k", "cross_v"):
        assert psnr(np.asarray(b[name]), np.asarray(c[name])) >= 60.0
    assert int(c["encoder_length"][0]) == tb


def test_cross_kv_equal_decoder_own_projections(exported):
    """cross_k/v == what CohereAsrCrossAttention caches when transformers' decoder runs."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    model, processor, s, rt, _ = exported
    n = 150
    feats = _speech_features(s.n_mels, s.frames, processor)
    out = _run(rt, _window(feats, n, s.frames), n)
    t = int(out["encoder_length"][0])
    x = torch.from_numpy(feats[None, :, :n]).transpose(1, 2)
    with torch.no_grad():
        enc = model.model.encoder(input_features=x).last_hidden_state  # (1, t, He), before proj
        cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        start = torch.tensor([[model.config.decoder_start_token_id]])
        model.model.decoder(input_ids=start, encoder_hidden_states=enc, cache=cache, use_cache=True)
    for i in range(s.num_layers):
        keys = cache.cross_attention_cache.layers[i].keys[0].numpy()  # (Hkv, t, Dh)
        values = cache.cross_attention_cache.layers[i].values[0].numpy()
        assert keys.shape == (s.num_kv_heads, t, s.head_dim)
        assert psnr(keys, np.asarray(out["cross_k"])[i, :, :t]) >= 60.0
        assert psnr(values, np.asarray(out["cross_v"])[i, :, :t]) >= 60.0
    # and from the package's own memory output, layer by layer
    memory = torch.from_numpy(np.asarray(out["encoder_hidden_states"], dtype=np.float32))
    for i, layer in enumerate(model.model.decoder.layers):
        with torch.no_grad():
            k = layer.encoder_attn.k_proj(memory).view(1, s.padded_frames, -1, s.head_dim).transpose(1, 2)[0]
        assert psnr(k.numpy(), np.asarray(out["cross_k"])[i]) >= 60.0


class _IgnoresLength(E.EncoderForCoreML):
    """Deliberately broken: the length masks are wired to nothing (the published port's bug)."""

    def forward(self, input_features, *masks):
        return super().forward(input_features, *(torch.ones_like(m) for m in masks))


class _NoAttentionMask(E.EncoderForCoreML):
    """Deliberately broken: right subsampling masks and cross mask, but the conformer layers run
    without the encoder mask (padded frames attended to and convolved)."""

    def forward(self, *inputs):
        real = E.host_length_masks

        def subsampling_only(encoder, stage_masks, encoder_mask, layers=None):
            return real(encoder, stage_masks, encoder_mask, layers=())

        E.host_length_masks = subsampling_only
        try:
            return super().forward(*inputs)
        finally:
            E.host_length_masks = real


@pytest.mark.parametrize("broken", [_IgnoresLength, _NoAttentionMask])
def test_broken_export_is_refused(exported, broken, tmp_path):
    model, processor, shapes, _, _ = exported

    settings = ExportSettings(out_dir=tmp_path, precision="fp32", window_seconds=WINDOW_S)
    with pytest.raises(ParityError, match="refused"):
        EP.convert_encoder(model, settings, processor, clips=E.gate_features(processor, shapes),
                          _wrapper_hook=broken_encoder_trace(broken))
    assert not settings.package_path("encoder").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["encoder.parity-failed.json"]
    assert json.loads(settings.failed_report_path("encoder").read_text())["passed"] is False


def test_existing_package_is_skipped_unless_forced(exported):
    model, processor, _, _, path = exported
    settings = ExportSettings(out_dir=path.parent, precision="fp32", window_seconds=WINDOW_S)
    stamp = (path / "Manifest.json").stat().st_mtime_ns
    assert EP.convert_encoder(model, settings, processor) is None
    assert (path / "Manifest.json").stat().st_mtime_ns == stamp


def test_fp16_export_passes_gate_and_masks_finitely(tmp_path):
    """fp16 program: the finfo.min attention mask must not become -inf/NaN on padded rows."""
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.runtime import load_model
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=5, **CONFIGS["gqa_wide_encoder"])
    model, processor = load_reference(ckpt)
    settings = ExportSettings(out_dir=tmp_path / "out", precision="fp16", window_seconds=WINDOW_S)
    shapes = encoder_shapes(model, WINDOW_S, processor)
    path = EP.convert_encoder(model, settings, processor, clips=E.gate_features(processor, shapes))
    report = json.loads(settings.report_path("encoder").read_text())
    assert report["passed"] and report["min_psnr_db"] == 35.0
    rt = load_model(path)
    feats = _speech_features(shapes.n_mels, shapes.frames, processor)
    out = _run(rt, _window(feats, 9, shapes.frames), 9)  # mostly padding
    for name in ("encoder_hidden_states", "cross_k", "cross_v"):
        assert np.all(np.isfinite(np.asarray(out[name], dtype=np.float32)))
    assert out["encoder_length"].dtype == np.int32


def test_fp16_program_has_no_length_arithmetic(exported, tmp_path):
    """The fp16 program computes in fp16 end to end: its only non-fp16 op is the cast of the fp32
    features at its entry (the masks are host inputs); the fp32 export of the same model is all fp32."""
    from coremltools.proto import MIL_pb2

    from cohere_coreml.runtime.package import read_spec

    model, processor, shapes, _, fp32_path = exported
    settings = ExportSettings(out_dir=tmp_path, precision="fp16", window_seconds=WINDOW_S, skip_verify=True)
    fp16_path = EP.convert_encoder(model, settings, processor)
    names = {v: k for k, v in MIL_pb2.DataType.items()}

    def compute_dtypes(path):
        fn = read_spec(path).mlProgram.functions["main"]
        found = {}
        for op in fn.block_specializations[fn.opset].operations:
            if op.type == "const":
                continue
            for out in op.outputs:
                found.setdefault(names[out.type.tensorType.dataType], []).append(op.type)
        return found

    fp16 = compute_dtypes(fp16_path)
    assert {k: v for k, v in fp16.items() if k != "FLOAT16"} == {}, fp16.keys()
    assert compute_dtypes(fp32_path).keys() == {"FLOAT32"}


def test_fp16_length_arithmetic_is_exact_above_2048(tmp_path):
    """Odd lengths > 2048 are not representable in fp16; the host's encoder_length is exact (transformers'
    own arithmetic) and the fp16 program's cross mask has exactly that many valid frames."""
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.runtime import load_model
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=1, encoder_num_hidden_layers=1, num_hidden_layers=1)
    model, processor = load_reference(ckpt)
    window = 21.0  # 2100 frames
    settings = ExportSettings(out_dir=tmp_path / "out", precision="fp16", window_seconds=window, skip_verify=True)
    path = EP.convert_encoder(model, settings, processor)
    rt = load_model(path)
    shapes = encoder_shapes(model, window, processor)
    feats = np.random.default_rng(0).standard_normal((1, shapes.n_mels, shapes.frames)).astype(np.float32)
    for n in (2049, 2051, 2097, 2100):
        expected = encoder_frames(model, n)
        out = _run(rt, feats, n)
        assert int(out["encoder_length"][0]) == expected, n
        mask = np.asarray(out["cross_mask"]).reshape(-1)
        assert int(np.sum(mask == 0)) == expected


def test_bad_window_is_refused(tiny_reference):
    model, processor = tiny_reference
    with pytest.raises(ValueError):
        encoder_shapes(model, 0.001, processor)
    with pytest.raises(E.EncoderInputError):
        E.gate_inputs(encoder_shapes(model, WINDOW_S, processor), clips=[np.zeros((7, 10), np.float32)])


def test_cli_export_writes_gated_package_and_skips_existing(tiny_checkpoint, tmp_path, capsys):
    from cohere_coreml import cli

    out = tmp_path / "out"
    argv = ["export", "--model", str(tiny_checkpoint), "--out", str(out), "--components", "encoder",
            "--window-seconds", str(WINDOW_S), "--precision", "fp32"]
    assert cli.main(argv) == 0
    assert (out / "encoder.mlpackage" / "Manifest.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())  # a folder checkpoint: its name, never its path
    assert manifest["model_id"] == Path(tiny_checkpoint).resolve().name and manifest["base_model"] is None
    assert str(Path(tiny_checkpoint).resolve()) not in (out / "manifest.json").read_text()
    report = json.loads((out / "encoder.parity.json").read_text())
    assert report["passed"] and report["worst_psnr_db"] >= 60.0
    assert "PASS" in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert "skipped" in capsys.readouterr().out


def test_cli_failing_gate_exits_nonzero_and_writes_no_package(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from cohere_coreml import cli

    monkeypatch.setattr(EP, "trace_encoder", broken_encoder_trace(_IgnoresLength))
    out = tmp_path / "out"
    code = cli.main(["export", "--model", str(tiny_checkpoint), "--out", str(out), "--components", "encoder",
                     "--window-seconds", str(WINDOW_S), "--precision", "fp32"])
    assert code != 0
    assert "parity gate refused" in capsys.readouterr().err
    assert not (out / "encoder.mlpackage").exists()
    assert sorted(p.name for p in out.iterdir()) == ["encoder.parity-failed.json"]


def test_length_buckets_share_weights_and_keep_the_contract(parts_export, tmp_path):
    """Multifunction encoder: `main` = 3 s window, `window_2s` = 2 s bucket padded to main's memory.
    (The one-program export of `parts_export`: `convert_encoder_buckets`, fp32, 3 s window, [2.0], gated.)"""
    from cohere_coreml.runtime import load_model
    from cohere_coreml.storage.files import weight_file_bytes

    model, processor, path, parts = parts_export
    settings = parts.replace(out_dir=path.parent)
    assert (settings.precision, settings.window_seconds, settings.skip_verify) == ("fp32", 3.0, False)
    report = json.loads(settings.report_path("encoder").read_text())
    assert report["passed"] and set(report["functions"]) == {"main", "window_2s"}
    assert report["buckets"]["window_2s"]["frames"] == 200 and report["buckets"]["main"]["frames"] == 300
    full = encoder_shapes(model, 3.0, processor)
    small = encoder_shapes(model, 2.0, processor, memory_frames=full.padded_frames)

    single = EP.convert_encoder(model, settings.replace(out_dir=tmp_path / "s", skip_verify=True), processor)
    # weights are stored once: two functions cost far less than two packages
    assert weight_file_bytes(path) < 1.25 * weight_file_bytes(single)

    feats = _speech_features(small.n_mels, full.frames, processor)
    n = 150
    # the default function is `main` (the 3 s window): it takes 300 frames and gives the reference
    main_out = _run(load_model(path), _window(feats, n, full.frames), n)
    ref_main = E.unpadded_reference(model, feats[None, :, :n])
    assert psnr(ref_main, np.asarray(main_out["encoder_hidden_states"])[:, :ref_main.shape[1]]) >= 60.0
    rt = load_model(path, function_name="window_2s")
    out = _run(rt, _window(feats, n, small.frames), n)
    assert out["encoder_hidden_states"].shape == (1, full.padded_frames, model.config.hidden_size)
    assert out["cross_k"].shape[2] == full.padded_frames
    ref = E.unpadded_reference(model, feats[None, :, :n])
    t = ref.shape[1]
    assert int(out["encoder_length"][0]) == t
    assert psnr(ref, np.asarray(out["encoder_hidden_states"])[:, :t]) >= 60.0
    mask = np.asarray(out["cross_mask"]).reshape(-1)
    assert np.all(mask[:t] == 0) and np.all(mask[t:] == E.MASK_VALUE)
    with pytest.raises(ShapeError):
        EP.convert_encoder_buckets(model, settings.replace(out_dir=tmp_path / "c"), [5.0], processor)

    def package_buckets(package):
        return {fn: v["frames"] for fn, v in encoder_package_info(package)["functions"].items()}

    buckets = package_buckets(path)
    assert buckets == {"main": 300, "window_2s": 200}
    assert package_buckets(single) == {"main": 300}
    assert choose_bucket(buckets, 1) == "window_2s" and choose_bucket(buckets, 200) == "window_2s"
    assert choose_bucket(buckets, 201) == "main" and choose_bucket(buckets, 300) == "main"
    with pytest.raises(ShapeError):
        choose_bucket(buckets, 301)


def test_fp16_needs_a_finite_mask_value(tiny_reference, tmp_path, monkeypatch):
    """The key mask is built in the fp16 program as (1 - encoder_mask) * MASK_VALUE: with transformers'
    finfo(float32).min (-inf in fp16) the valid frames get 0 * -inf = NaN; -1e4 stays finite."""
    from cohere_coreml.runtime import load_model

    model, processor = tiny_reference
    s = encoder_shapes(model, WINDOW_S, processor)
    settings = ExportSettings(out_dir=tmp_path, precision="fp16", window_seconds=WINDOW_S)
    feats = np.random.default_rng(0).standard_normal((1, s.n_mels, s.frames)).astype(np.float32)
    results = {}
    for name, value in (("unsafe", float(torch.finfo(torch.float32).min)), ("safe", E.MASK_VALUE)):
        monkeypatch.setattr(E, "MASK_VALUE", value)
        path = tmp_path / f"{name}.mlpackage"
        E.convert_traced_encoder(E.trace_encoder(model, s), s, settings).save(str(path))
        out = _run(load_model(path), feats, 60)
        results[name] = np.asarray(out["encoder_hidden_states"], dtype=np.float32)[:, : int(out["encoder_length"][0])]
    assert not np.all(np.isfinite(results["unsafe"]))
    assert np.all(np.isfinite(results["safe"]))


def test_refused_forced_reexport_keeps_the_old_package_and_report(exported, tmp_path):
    import shutil

    model, processor, shapes, _, path = exported
    out = tmp_path / "copy"
    shutil.copytree(path.parent, out)
    manifest = (out / "encoder.mlpackage" / "Manifest.json").read_bytes()
    report = (out / "encoder.parity.json").read_bytes()

    settings = ExportSettings(out_dir=out, precision="fp32", window_seconds=WINDOW_S, force=True)
    with pytest.raises(ParityError):
        EP.convert_encoder(model, settings, processor, clips=E.gate_features(processor, shapes),
                          _wrapper_hook=broken_encoder_trace(_IgnoresLength))
    assert (out / "encoder.mlpackage" / "Manifest.json").read_bytes() == manifest
    assert (out / "encoder.parity.json").read_bytes() == report
    assert json.loads((out / "encoder.parity-failed.json").read_text())["passed"] is False
    assert sorted(p.name for p in out.iterdir()) == ["encoder.mlpackage", "encoder.parity-failed.json",
                                                      "encoder.parity.json"]


# --------------------------------------------------------------------------------------------
# The encoder in parts (export --encoder-parts)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parts_export(tmp_path_factory):
    """(model, processor, whole path, parts paths, settings) of a 3-layer tiny encoder exported fp32 as
    one program and in 2 parts, both with a 2 s bucket of a 3 s window."""
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("parts")
    model, processor = load_reference(make_tiny_checkpoint(root / "ckpt", seed=4, encoder_num_hidden_layers=3))
    whole = ExportSettings(out_dir=root / "whole", precision="fp32", window_seconds=3.0)
    EP.convert_encoder_buckets(model, whole, [2.0], processor)
    parts = whole.replace(out_dir=root / "parts")
    EP.convert_encoder_buckets(model, parts, [2.0], processor, parts=2)
    return model, processor, whole.package_path("encoder"), parts


def test_parts_hold_consecutive_layers_and_chain_to_the_whole_encoder(parts_export):
    from cohere_coreml.bundle.packages import encoder_package_info
    from cohere_coreml.inference.encoder_runtime import EncoderRuntime

    model, processor, whole_path, settings = parts_export
    out = settings.out_dir
    assert sorted(p.name for p in out.glob("*.mlpackage")) == ["encoder.mlpackage", "encoder_part2.mlpackage"]
    info = encoder_package_info(out / "encoder.mlpackage")
    assert [p["layers"] for p in info["parts"]] == [[0, 2], [2, 3]] and info["num_layers"] == 3
    assert sorted(info["parts"][0]["functions"]) == sorted(info["parts"][1]["functions"]) == ["main", "window_2s"]
    first, second = (info["parts"][i]["functions"]["main"]["io"] for i in (0, 1))
    assert list(first["outputs"]) == ["hidden_states_out"] and sorted(second["inputs"]) == ["encoder_mask", "hidden_states"]
    # the chain's io is the whole encoder's: the same inputs and outputs as the one-program export
    assert info["functions"]["main"]["io"] == encoder_package_info(whole_path)["functions"]["main"]["io"]
    report = json.loads(settings.report_path("encoder").read_text())
    assert report["passed"] and [p["layers"] for p in report["parts"]] == [[0, 2], [2, 3]]
    gated = {(c["part"], c["case"]) for c in report["functions"]["main"]["cases"]}
    assert {part for part, _ in gated} == {1, 2, "chain"}
    # chained through the runtime, the parts give the whole program's outputs (fp32: the same arithmetic)
    feats = _speech_features(model.config.encoder_config.num_mel_bins, 300, processor)
    for fn, frames, n in (("main", 300, 211), ("window_2s", 200, 77)):
        window = _window(feats, n, frames)
        chained = EncoderRuntime.load(out / "encoder.mlpackage").encode(window, n)
        one = EncoderRuntime.load(whole_path).encode(window, n)
        assert EncoderRuntime.load(out / "encoder.mlpackage").parts == 2
        for name in ("encoder_hidden_states", "cross_k", "cross_v", "cross_mask"):
            assert psnr(np.asarray(one[name]), np.asarray(chained[name])) >= 120.0, (fn, name)
        assert int(chained["encoder_length"][0]) == int(one["encoder_length"][0])
    # windows through one part at a time (the quantize gate's references): encode's outputs, bit for bit
    runtime = EncoderRuntime.load(out / "encoder.mlpackage")
    windows = [(_window(feats, n, 300), n) for n in (211, 300, 40)]
    each = runtime.encode_windows(windows)
    assert runtime._models == {}  # nothing kept loaded
    for (window, n), got in zip(windows, each, strict=True):
        expected = runtime.encode(window, n)
        assert sorted(got) == sorted(expected)
        assert all(np.array_equal(np.asarray(got[k]), np.asarray(expected[k])) for k in expected)
    assert runtime.encode_windows([]) == []


def test_auto_parts_are_the_fewest_under_the_platform_limit(parts_export, monkeypatch):
    from cohere_coreml.bundle import ane_check

    model = parts_export[0]
    assert EP.plan_parts(model, "auto", "fp16") == [(0, 3)]  # a tiny encoder: one program
    sizes = {n: EP.part_weight_bytes(model, EP.part_ranges(3, n), "fp16") for n in (1, 2, 3)}
    # a limit that two parts meet and one does not
    limit = int(max(sizes[2]) / EP.PART_MARGIN) + 1
    assert max(sizes[1]) > limit * EP.PART_MARGIN
    monkeypatch.setitem(ane_check.WEIGHT_LIMITS, "ios", limit)
    assert EP.plan_parts(model, "auto", "fp16") == [(0, 2), (2, 3)]
    assert EP.plan_parts(model, "auto", "fp16", platform="macos") == [(0, 3)]  # 2 GiB
    assert EP.part_weight_bytes(model, [(0, 2), (2, 3)], "fp32") == [2 * b for b in sizes[2]]  # 4 bytes per weight
    monkeypatch.setitem(ane_check.WEIGHT_LIMITS, "ios", 1000)
    with pytest.raises(E.ExportError, match="one encoder layer"):
        EP.plan_parts(model, "auto", "fp16")
    assert EP.part_ranges(5, 2) == [(0, 3), (3, 5)] and EP.part_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for bad in (0, 4):
        with pytest.raises(E.ExportError, match="encoder-parts"):
            EP.plan_parts(model, bad, "fp16")


def test_the_estimate_bounds_the_written_weight_files(parts_export):
    """The estimate `auto` plans with is at least each part's weight file minus the converter's constants
    (the per-window positional tables), and within a few percent of it."""
    from cohere_coreml.storage.files import weight_file_bytes

    model, _, _, settings = parts_export
    estimated = EP.part_weight_bytes(model, [(0, 2), (2, 3)], "fp32")
    written = [weight_file_bytes(settings.package_path(EP.part_component(i))) for i in (0, 1)]
    for est, got in zip(estimated, written):
        assert est <= got <= est * 1.25 + 200_000, (estimated, written)


def test_a_broken_part_is_refused_and_nothing_is_installed(parts_export, tmp_path, monkeypatch):
    """A part that skips its first layer (a wrong boundary) fails its own gate: no part is installed."""
    model, processor, _, _ = parts_export
    real = E.EncoderForCoreML._layers

    def skip_first_layer_of_later_parts(self, hidden, layers):
        return real(self, hidden, layers[1:] if self.start > 0 else layers)

    monkeypatch.setattr(E.EncoderForCoreML, "_layers", skip_first_layer_of_later_parts)
    settings = ExportSettings(out_dir=tmp_path, precision="fp32", window_seconds=3.0)
    with pytest.raises(ParityError, match="refused"):
        EP.convert_encoder(model, settings, processor, clips=E.gate_features(processor, encoder_shapes(model, 3.0, processor)),
                          parts=2)
    failed = json.loads(settings.failed_report_path("encoder").read_text())
    refused = [c for c in failed["cases"] if not c["passed"]]
    assert refused and {c["part"] for c in refused} >= {2}
    assert all(c["passed"] for c in failed["cases"] if c["part"] == 1)
    assert [p.name for p in tmp_path.iterdir()] == ["encoder.parity-failed.json"]


def test_a_reexport_in_fewer_parts_removes_the_extra_part(parts_export, tmp_path):
    import shutil

    model, processor, _, settings = parts_export
    out = tmp_path / "copy"
    shutil.copytree(settings.out_dir, out)
    EP.convert_encoder_buckets(model, settings.replace(out_dir=out, force=True, skip_verify=True), [2.0], processor,
                              parts=1)
    assert sorted(p.name for p in out.glob("*.mlpackage")) == ["encoder.mlpackage"]


def test_a_middle_part_takes_and_gives_the_hidden_state(parts_export, tmp_path):
    """3 parts of a 3-layer encoder (one layer each): the middle program has no features and no memory, only
    the hidden state in (hidden_states) and out (hidden_states_out); gated, and chained it is the whole encoder."""
    from cohere_coreml.bundle.packages import encoder_package_info
    from cohere_coreml.inference.encoder_runtime import EncoderRuntime

    model, processor, whole_path, _ = parts_export
    settings = ExportSettings(out_dir=tmp_path, precision="fp32", window_seconds=3.0)
    path = EP.convert_encoder(model, settings, processor, parts=3)
    info = encoder_package_info(path)
    assert [p["layers"] for p in info["parts"]] == [[0, 1], [1, 2], [2, 3]]
    middle = info["parts"][1]["functions"]["main"]["io"]
    assert sorted(middle["inputs"]) == ["encoder_mask", "hidden_states"] and list(middle["outputs"]) == ["hidden_states_out"]
    assert json.loads(settings.report_path("encoder").read_text())["passed"]
    feats = _speech_features(model.config.encoder_config.num_mel_bins, 300, processor)
    chained = EncoderRuntime.load(path).encode(_window(feats, 250, 300), 250)
    one = EncoderRuntime.load(whole_path).encode(_window(feats, 250, 300), 250)
    assert psnr(np.asarray(one["cross_k"]), np.asarray(chained["cross_k"])) >= 120.0
