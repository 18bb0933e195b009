"""frontend.mlpackage: samples -> the encoder's input_features, against `audio.log_mel` (MIL interpreter)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cohere_coreml.export.convert import ExportSettings, ParityError
from cohere_coreml.export.frontend import (
    GATE_BUDGETS,
    FrontEndForCoreML,
    check_case,
    convert_frontend,
    dft_basis,
    reference_outputs,
    window_input,
)
from cohere_coreml.model.audio import AudioError, FrontEndConfig, load_audio, log_mel
from cohere_coreml.model.shapes import ShapeError, bucket_function_name, choose_frontend_function, frontend_shapes

from ..fixture_data import AUDIO_DIR, TRAINED_BUCKETS, TRAINED_WINDOW_S, audio_manifest, heldout_utterances

torch.set_num_threads(1)

CONFIG = FrontEndConfig()
# small windows keep the tests fast; the 35 s window is measured by tools/parity/frontend_package_parity.py
WINDOW_S = 3.0
BUCKET_S = 1.5
BUCKET_FN = bucket_function_name(BUCKET_S)  # window_1_5s


def plan_shapes(*seconds):
    """{function: FrontEndShapes} as `shapes.export_plan` gives them: `main` first, then buckets."""
    return {"main" if i == 0 else bucket_function_name(s): frontend_shapes(CONFIG, s) for i, s in enumerate(seconds)}


def run_module(module, waveform, shapes):
    inputs = window_input(waveform, shapes)
    with torch.no_grad():
        feats, length = module(torch.from_numpy(inputs["audio"]), torch.from_numpy(inputs["audio_length"]))
    return {"input_features": feats.numpy(), "feature_length": length.numpy()}


class PeriodicWindowFrontEnd(FrontEndForCoreML):
    """A plausible bug: the periodic Hann window (torch's default) instead of the reference's symmetric one."""

    def __init__(self, config, shapes):
        super().__init__(config, shapes)
        symmetric = torch.hann_window(config.win_length, periodic=False)
        periodic = torch.hann_window(config.win_length, periodic=True)
        scale = periodic / torch.where(symmetric == 0, torch.ones(1), symmetric)
        self.basis = self.basis * scale[None, None, :]


def short_clips():
    return [c for c in audio_manifest() if c["path"].is_file() and c["seconds"] <= BUCKET_S]


# ------------------------------------------------------------------------------- the torch module


def test_dft_basis_gives_the_reference_power_spectrum():
    from cohere_coreml.model.audio import power_spectrum

    x = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    padded = torch.from_numpy(np.pad(x, (CONFIG.win_length // 2, CONFIG.win_length // 2)))[None, None]
    spectrum = torch.nn.functional.conv1d(padded, torch.from_numpy(dft_basis(CONFIG)), stride=CONFIG.hop_length)[0]
    bins = CONFIG.n_fft // 2 + 1
    power = (spectrum[:bins] ** 2 + spectrum[bins:] ** 2).numpy()
    ref = power_spectrum(x, CONFIG)[:, : power.shape[1]]
    assert power.shape == (bins, 4000 // CONFIG.hop_length + 1) == ref.shape
    np.testing.assert_allclose(power, ref, rtol=1e-4, atol=1e-6 * ref.max())


@pytest.mark.parametrize("clip", [c["file"] for c in audio_manifest() if c["seconds"] <= WINDOW_S]
                         + ["odd_length", "window_full"])
def test_module_matches_log_mel(clip):
    shapes = frontend_shapes(CONFIG, WINDOW_S)
    rng = np.random.default_rng(1)
    if clip == "odd_length":
        wav = (0.1 * rng.standard_normal(12345)).astype(np.float32)
    elif clip == "window_full":
        wav = np.resize(load_audio(AUDIO_DIR / "en_medium.wav"), shapes.samples)
    else:
        wav = load_audio(AUDIO_DIR / clip)
    ref = reference_outputs(wav, CONFIG, shapes)
    kind = "ill_conditioned" if not np.any(wav) else "signal"
    report = check_case(ref, run_module(FrontEndForCoreML(CONFIG, shapes), wav, shapes), kind)
    assert report.passed, report.summary()


def test_samples_beyond_audio_length_are_ignored():
    shapes = frontend_shapes(CONFIG, WINDOW_S)
    wav = load_audio(AUDIO_DIR / "en_short.wav")
    inputs = window_input(wav, shapes)
    inputs["audio"][0, wav.shape[0]:] = np.random.default_rng(2).standard_normal(shapes.samples - wav.shape[0])
    with torch.no_grad():
        feats, length = FrontEndForCoreML(CONFIG, shapes)(torch.from_numpy(inputs["audio"]),
                                                          torch.from_numpy(inputs["audio_length"]))
    report = check_case(reference_outputs(wav, CONFIG, shapes), {"input_features": feats.numpy(),
                                                                  "feature_length": length.numpy()})
    assert report.passed, report.summary()


def test_gate_rejects_wrong_features_lengths_and_padding():
    shapes = frontend_shapes(CONFIG, WINDOW_S)
    wav = load_audio(AUDIO_DIR / "en_short.wav")
    ref = reference_outputs(wav, CONFIG, shapes)
    n = int(ref["feature_length"][0])
    assert check_case(ref, ref).passed
    wrong_window = run_module(PeriodicWindowFrontEnd(CONFIG, shapes), wav, shapes)
    assert not check_case(ref, wrong_window).passed
    off_by_one = {**ref, "feature_length": np.array([n + 1], dtype=np.int32)}
    assert not check_case(ref, off_by_one).passed
    dirty = ref["input_features"].copy()
    dirty[..., n] = 1e-3
    assert not check_case(ref, {**ref, "input_features": dirty}).passed
    small = ref["input_features"].copy()
    small[0, 5, 3] += 2 * GATE_BUDGETS["signal"]["max_abs_diff"]  # PSNR stays high: only max |diff| catches it
    report = check_case(ref, {**ref, "input_features": small})
    assert not report.passed and "max |diff|" in report.summary()
    assert check_case(ref, {**ref, "input_features": small}, "ill_conditioned").passed


def test_bad_windows_and_clips():
    with pytest.raises(ShapeError, match="at least 2"):
        frontend_shapes(CONFIG, 0.01)
    shapes = frontend_shapes(CONFIG, 1.0)
    assert (shapes.samples, shapes.frames) == (16000, 100)
    with pytest.raises(AudioError, match="split"):
        window_input(np.zeros(shapes.samples + 1, np.float32), shapes)
    functions = {"main": {"samples": 48000, "frames": 300}, "window_1s": {"samples": 16000, "frames": 100}}
    assert choose_frontend_function(functions, 16000) == "window_1s"
    assert choose_frontend_function(functions, 16001) == "main"
    assert choose_frontend_function(functions, 100, min_frames=101) == "main"
    with pytest.raises(ShapeError, match="split"):
        choose_frontend_function(functions, 48001)
    with pytest.raises(ValueError, match="kind"):
        check_case({}, {}, "loud")


def test_export_plan_gives_the_front_end_the_encoder_windows(trained_reference):
    """One front-end function per encoder function, same name and window; F = the encoder's frames."""
    from cohere_coreml.model.shapes import export_plan

    model, processor = trained_reference
    plan = export_plan(model, processor, TRAINED_WINDOW_S, bucket_seconds=TRAINED_BUCKETS)
    assert list(plan.frontend) == list(plan.encoder) == ["main", "window_2s"]
    for fn, enc in plan.encoder.items():
        fe = plan.frontend[fn]
        assert (fe.window_seconds, fe.frames, fe.n_mels) == (enc.window_seconds, enc.frames, enc.n_mels)
    assert (plan.frontend["main"].samples, plan.frontend["window_2s"].samples) == (64000, 32000)


# ------------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontend")
    settings = ExportSettings(out_dir=out, window_seconds=WINDOW_S, model_id="frontend-test")
    path = convert_frontend(CONFIG, settings, plan_shapes(WINDOW_S, BUCKET_S), gate_audio=[AUDIO_DIR / "en_short.wav"])
    return path, settings


def test_package_io_metadata_and_gate_report(package):
    import coremltools as ct

    from cohere_coreml.bundle.packages import frontend_package_info

    path, settings = package
    spec = ct.utils.load_spec(str(path))
    meta = dict(spec.description.metadata.userDefined)
    assert meta["com.cohere_coreml.component"] == "frontend"
    assert meta["com.cohere_coreml.precision"] == "fp32"
    assert meta["com.cohere_coreml.compute_units"] == "cpu_and_gpu"
    assert json.loads(meta["com.cohere_coreml.front_end"])["n_fft"] == CONFIG.n_fft
    section = frontend_package_info(path)
    assert (section["compute_units"], section["precision"]) == ("cpu_and_gpu", "fp32")
    assert {fn: (v["samples"], v["frames"]) for fn, v in section["functions"].items()} == {
        "main": (48000, 300), "window_1_5s": (24000, 150)}
    assert section["io"]["inputs"]["audio"]["shape"] == [1, 48000]  # the default function is main
    io = section["functions"]["window_1_5s"]["io"]
    assert io["inputs"] == {"audio": {"shape": [1, 24000], "dtype": "float32"},
                            "audio_length": {"shape": [1], "dtype": "int32"}}
    assert io["outputs"] == {"input_features": {"shape": [1, 128, 150], "dtype": "float32"},
                             "feature_length": {"shape": [1], "dtype": "int32"}}
    gate = json.loads(settings.report_path("frontend").read_text())
    assert gate["passed"] and set(gate["functions"]) == {"main", "window_1_5s"}
    assert gate["windows"]["window_1_5s"]["samples"] == 24000 and "signal: max |diff|" in gate["headline"]
    cases = {c["case"]: c for c in gate["functions"]["main"]["cases"]}
    assert set(cases) == {"en_short.wav", "near_silence", "digital_silence", "clip_0.05s", "full_window"}
    assert cases["full_window"]["feature_length"] == 300 and cases["clip_0.05s"]["feature_length"] == 5
    assert cases["near_silence"]["kind"] == "ill_conditioned"


@pytest.mark.parametrize("function", ["main", "window_1_5s"])
def test_package_matches_log_mel_on_committed_clips(package, function):
    from cohere_coreml.runtime import load_model

    path, _ = package
    seconds = WINDOW_S if function == "main" else BUCKET_S
    shapes = frontend_shapes(CONFIG, seconds)
    model = load_model(str(path), backend="mil", function_name=function)
    clips = [c for c in audio_manifest() if c["path"].is_file() and c["seconds"] <= seconds]
    assert len(clips) >= 5
    for clip in clips:
        wav = load_audio(clip["path"])
        kind = "ill_conditioned" if clip.get("purpose") == "silence" else "signal"
        report = check_case(reference_outputs(wav, CONFIG, shapes), model.predict(window_input(wav, shapes)), kind)
        assert report.passed, f"{clip['file']}\n{report.summary()}"


def test_broken_front_end_is_refused_and_leaves_nothing(tmp_path):
    settings = ExportSettings(out_dir=tmp_path, window_seconds=BUCKET_S)
    with pytest.raises(ParityError, match="frontend parity gate refused"):
        convert_frontend(CONFIG, settings, plan_shapes(BUCKET_S), gate_audio=[AUDIO_DIR / "en_short.wav"],
                         _module_cls=PeriodicWindowFrontEnd)
    assert not settings.package_path("frontend").exists()
    assert not any(p.name.endswith(".mlpackage") for p in tmp_path.iterdir())
    assert not settings.report_path("frontend").exists()
    failed = json.loads(settings.failed_report_path("frontend").read_text())
    refused = {c["case"]: c["kind"] for c in failed["cases"] if not c["passed"]}
    assert failed["passed"] is False and refused and set(refused.values()) == {"signal"}, failed["headline"]
    assert "refused" in failed["headline"]


def test_existing_package_is_skipped(package):
    path, settings = package
    before = path.stat().st_mtime_ns
    assert convert_frontend(CONFIG, settings, plan_shapes(WINDOW_S, BUCKET_S)) is None
    assert path.stat().st_mtime_ns == before


# ------------------------------------------------------------------------------- transcription


class FlippedMelBins:
    """A broken front end at run time: the package's mel bins in reverse order (a filter bank built
    high-to-low), everything else (lengths, padding) intact."""

    def __init__(self, inner):
        self.inner = inner

    def predict(self, inputs, state=None):
        out = dict(self.inner.predict(inputs))
        out["input_features"] = np.ascontiguousarray(np.flip(np.asarray(out["input_features"]), axis=1))
        return out


def test_trained_bundle_carries_the_gated_front_end(trained_bundle):
    """The default export (conftest.trained_bundle: no --components) writes frontend.mlpackage, gated,
    one function per encoder window, and the manifest section read from the package."""
    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    assert manifest["files"]["frontend"] == "frontend.mlpackage"
    section = manifest["frontend"]
    assert (section["compute_units"], section["precision"]) == ("cpu_and_gpu", "fp32")
    assert {fn: (v["samples"], v["frames"]) for fn, v in section["functions"].items()} == {
        "main": (64000, 400), "window_2s": (32000, 200)}
    assert {fn: v["frames"] for fn, v in manifest["encoder"]["functions"].items()} == {"main": 400, "window_2s": 200}
    io = section["functions"]["window_2s"]["io"]
    assert io["inputs"] == {"audio": {"shape": [1, 32000], "dtype": "float32"},
                            "audio_length": {"shape": [1], "dtype": "int32"}}
    assert io["outputs"] == {"input_features": {"shape": [1, 128, 200], "dtype": "float32"},
                             "feature_length": {"shape": [1], "dtype": "int32"}}
    assert section["io"]["outputs"]["input_features"]["shape"] == [1, 128, manifest["encoder"]["window_frames"]]
    gate = json.loads((trained_bundle / "frontend.parity.json").read_text())
    assert gate["passed"] and set(gate["functions"]) == {"main", "window_2s"}
    cases = {c["case"] for c in gate["functions"]["main"]["cases"]}
    assert {"near_silence", "digital_silence", "clip_0.05s", "full_window"} < cases and len(cases) >= 5


def test_transcriber_front_end_package_gives_the_python_tokens(trained_reference, trained_bundle, tmp_path):
    """The trained fp16 bundle (4 s window + 2 s bucket): the same tokens with either front end on
    held-out clips of every language; a package with its mel bins reversed changes them."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.inference.transcribe import Transcriber, TranscriptionError

    python = Transcriber(trained_bundle, backend="mil")
    package = Transcriber(trained_bundle, backend="mil", front_end="package")
    broken = Transcriber(trained_bundle, backend="mil", front_end="package")
    functions, changed = set(), 0
    utterances = heldout_utterances(per_language=2)
    for u in utterances:
        wav = load_audio(u["path"])
        a = python.transcribe(wav, u["language"]).windows[0]
        b = package.transcribe(wav, u["language"]).windows[0]
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason == "eos", u["file"]
        assert a.timings["encoder_function"] == b.timings["encoder_function"]
        assert (a.timings["front_end"], b.timings["front_end"]) == ("python", "package")
        functions.add(b.timings["encoder_function"])
        feats, n, _ = package.package_features(wav)
        ref, n_ref = log_mel(wav, python.front_end)
        assert n == n_ref and not feats[0, :, n:].any()
        assert np.abs(feats[0, :, :n] - ref[:, :n]).max() <= GATE_BUDGETS["signal"]["max_abs_diff"]
        broken._frontends = {fn: FlippedMelBins(m) for fn, m in package._frontends.items()}
        changed += broken.transcribe(wav, u["language"]).windows[0].token_ids != a.token_ids
    assert functions == {"main", "window_2s"}
    assert changed == len(utterances), changed  # the token comparison sees a broken front end
    with pytest.raises(AudioError, match="too short"):
        package.package_features(np.ones(100, np.float32))
    with pytest.raises(TranscriptionError, match="front_end"):
        Transcriber(trained_bundle, backend="mil", front_end="swift")

    # a bundle whose manifest names no front end: python still works, package names the problem
    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    del manifest["files"]["frontend"], manifest["frontend"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert "frontend" not in Transcriber([tmp_path, trained_bundle], backend="mil").bundle.paths
    with pytest.raises(BundleError, match="no frontend.mlpackage"):
        Transcriber([tmp_path, trained_bundle], backend="mil", front_end="package")


def test_verify_reports_the_front_end_package_stage(trained_reference, trained_bundle):
    from cohere_coreml.evaluation.verify import format_table, verify_bundle

    model, processor = trained_reference
    u = heldout_utterances(per_language=1)[0]
    report = verify_bundle(model, processor, trained_bundle, [u["path"]], language=u["language"], backend="mil",
                           max_new_tokens=3)
    stage = report["clips"][0]["windows"][0]["frontend"]
    n = log_mel(load_audio(u["path"]), FrontEndConfig.from_processor(processor, dither=0.0))[1]
    assert stage["frames"] == stage["reference_frames"] == n and stage["padding_zero"]
    assert float(stage["psnr_db"]) > 100 and stage["max_abs_err"] <= GATE_BUDGETS["signal"]["max_abs_diff"]
    assert report["summary"]["frontend_frames_equal"] and "front-end package" in format_table(report)
