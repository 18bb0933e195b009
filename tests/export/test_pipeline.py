"""The export pipeline's layout: components apart (the package's layout: tests/test_layout.py), no dev code
in the product, the manifest written last from the packages on disk, one gate interface (`gate.export_gated`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cohere_coreml

from ..test_layout import import_graph

PACKAGE_DIR = Path(cohere_coreml.__file__).parent


# the export's components: their modules, and what none of them imports
ENCODER, DECODER = ("encoder", "encoder_packages"), ("decoder", "decoder_modules")
COMPONENTS = {ENCODER: (*DECODER, "frontend"),
              DECODER: (*ENCODER, "frontend"),
              ("frontend",): (*ENCODER, *DECODER),
              # the decoder's gate is handed the PyTorch twin: data flows decoder -> decoder_gate only
              ("decoder_gate",): (*DECODER, *ENCODER, "frontend")}


def test_components_know_nothing_of_each_other_or_the_bundle():
    """No component imports another, the orchestrator (`pipeline`), or the bundle's manifest and loading (the
    pipeline writes the bundle from the installed packages; `bundle.ane_check` is the static check)."""
    graph = import_graph()
    for own, others in COMPONENTS.items():
        forbidden = {f"cohere_coreml.export.{m}" for m in (*others, "pipeline")}
        for module in own:
            imported = graph[f"cohere_coreml.export.{module}"]
            assert not imported & forbidden, (module, sorted(imported & forbidden))
            bundle = {m for m in imported if m.startswith("cohere_coreml.bundle.") and m != "cohere_coreml.bundle.ane_check"}
            assert not bundle, (module, sorted(bundle))


# --------------------------------------------------------------------------------------------
# No demo-model / fixture code in the product
# --------------------------------------------------------------------------------------------


def test_product_imports_no_training_or_synthesis_code():
    code = (
        "import importlib, pkgutil, sys, cohere_coreml\n"
        "for m in pkgutil.walk_packages(cohere_coreml.__path__, 'cohere_coreml.'):\n"
        "    importlib.import_module(m.name)\n"
        "import cohere_coreml.cli\n"
        "print(sorted(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE_DIR.parent.parent)  # not tools/: the dev package is not on the path
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')))
    assert "cohere_coreml.export.pipeline" in loaded  # the check sees the package's modules
    dev = sorted(m for m in loaded if m.split(".")[0] in {"cohere_coreml_dev", "sentencepiece", "jiwer"})
    assert not dev, dev
    for name in ("train", "synth", "evaluate"):
        assert not [m for m in loaded if m.startswith("cohere_coreml") and m.rsplit(".", 1)[-1] == name]
        assert not list(PACKAGE_DIR.rglob(f"{name}.py"))


def test_product_source_never_imports_the_dev_package():
    offenders = []
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in {"cohere_coreml_dev", "sentencepiece"}]
    assert not offenders


def test_gate_audio_ships_with_the_package():
    from cohere_coreml.export.gate import default_gate_audio
    from cohere_coreml.model.audio import load_audio

    clips = default_gate_audio()
    assert len(clips) >= 2
    for clip in clips:
        assert PACKAGE_DIR in clip.resolve().parents  # package data, not the source checkout's tests/
        wav = load_audio(clip)
        assert wav.size > 16000 and float(abs(wav).max()) > 0.05  # seconds of speech, not silence


# --------------------------------------------------------------------------------------------
# One gate interface
# --------------------------------------------------------------------------------------------


def _fake_writer(tmp: Path) -> None:
    tmp.mkdir()
    (tmp / "Manifest.json").write_text("{}")


@pytest.mark.parametrize("passes", [True, False])
def test_export_gated_writes_only_a_passing_package(tmp_path, passes):
    from cohere_coreml.export.convert import ExportSettings, ParityError
    from cohere_coreml.export.gate import GateReport, export_gated

    seen = []

    def gate(tmp: Path) -> GateReport:
        seen.append(tmp)
        assert (tmp / "Manifest.json").is_file()  # the gate runs on the written temporary package
        return GateReport(component="thing", passed=passes, headline="figure 1.0", details={"figure": 1.0})

    settings = ExportSettings(out_dir=tmp_path)
    if passes:
        report = export_gated("thing", settings, _fake_writer, gate)
        assert report.passed and (tmp_path / "thing.mlpackage").is_dir()
        data = json.loads((tmp_path / "thing.parity.json").read_text())
        assert data == {"component": "thing", "passed": True, "headline": "figure 1.0", "figure": 1.0}
        assert export_gated("thing", settings, _fake_writer, gate) is None  # present: skipped
        assert len(seen) == 1
    else:
        with pytest.raises(ParityError, match="thing parity gate refused"):
            export_gated("thing", settings, _fake_writer, gate)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["thing.parity-failed.json"]


def test_a_package_of_another_checkpoint_is_exported_again(tmp_path, caplog):
    """The skip rule of a resumed export holds for packages of the same checkpoint only: a retrained
    model exported into the folder of its predecessor replaces its packages (else, e.g., `make demo`
    verified new weights against an old out/demo)."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.gate import GateReport, export_gated
    from cohere_coreml.model.checkpoint import checkpoint_digest

    def gate(tmp: Path) -> GateReport:
        seen.append(tmp)
        return GateReport(component="thing", passed=True, headline="ok", details={})

    seen = []
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights one")
    (ckpt / "README.md").write_text("card")
    first = checkpoint_digest(ckpt)
    out = tmp_path / "out"
    export_gated("thing", ExportSettings(out_dir=out, checkpoint_digest=first), _fake_writer, gate)
    assert json.loads((out / "thing.parity.json").read_text())["checkpoint_digest"] == first
    (ckpt / "README.md").write_text("another card")  # the card is not the checkpoint
    assert checkpoint_digest(ckpt) == first
    assert export_gated("thing", ExportSettings(out_dir=out, checkpoint_digest=first), _fake_writer, gate) is None
    assert len(seen) == 1
    (ckpt / "model.safetensors").write_bytes(b"weights two")  # retrained: same files, other bytes
    second = checkpoint_digest(ckpt)
    assert second != first
    report = export_gated("thing", ExportSettings(out_dir=out, checkpoint_digest=second), _fake_writer, gate)
    assert report is not None and len(seen) == 2 and f"checkpoint {first}" in caplog.text
    assert json.loads((out / "thing.parity.json").read_text())["checkpoint_digest"] == second
    # a report written before digests were recorded: unknown checkpoint, exported again
    (out / "thing.parity.json").write_text(json.dumps({"component": "thing", "passed": True}))
    assert export_gated("thing", ExportSettings(out_dir=out, checkpoint_digest=second), _fake_writer, gate) is not None
    assert len(seen) == 3


# --------------------------------------------------------------------------------------------
# The manifest describes the packages on disk
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_manifest_follows_the_packages_on_disk(tiny_reference, tmp_path):
    """Exporting one component refreshes the manifest; it never names a package that is not there,
    and refuses packages that do not fit each other."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model

    model, processor = tiny_reference
    settings = ExportSettings(out_dir=tmp_path, precision="fp32", window_seconds=2.0, skip_verify=True)
    result = export_model(model, processor, settings, components=("encoder",), max_new_tokens=22)
    manifest = json.loads(result.manifest.read_text())
    assert "decoder" not in manifest["files"] and "decoder" not in manifest
    assert manifest["encoder"]["window_frames"] == 200 and manifest["encoder"]["memory_len"] == 32
    with pytest.raises(BundleError, match="decoder"):
        Bundle.load(tmp_path)

    export_model(model, processor, settings, components=("decoder",), max_new_tokens=22)
    manifest = Bundle.load(tmp_path).manifest
    assert manifest["decoder"]["capacity"] == 32 and manifest["decoder"]["memory_shape"][2] == 32
    assert manifest["encoder"]["io"]["outputs"]["cross_k"]["shape"] == manifest["decoder"]["memory_shape"]

    # a 3 s encoder has a 64-frame memory: the 32-frame decoder on disk no longer fits it
    with pytest.raises(BundleError, match="memory"):
        export_model(model, processor, settings.replace(window_seconds=3.0, force=True), components=("encoder",),
                     max_new_tokens=22)
    assert not (tmp_path / "manifest.json").exists()  # no manifest rather than a stale one


@pytest.mark.slow
def test_front_end_is_a_default_component_described_from_disk(tiny_reference, tmp_path):
    """`frontend` is exported by default; the manifest's section comes from the package on disk
    (one function per encoder window); a front end of another window than the encoder's is refused."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import COMPONENTS, export_model

    assert tuple(COMPONENTS) == ("encoder", "frontend", "decoder", "vad")
    model, processor = tiny_reference
    settings = ExportSettings(out_dir=tmp_path, precision="fp32", window_seconds=2.0, skip_verify=True)
    result = export_model(model, processor, settings, components=("encoder", "frontend"), buckets=(1.0,))
    manifest = json.loads(result.manifest.read_text())
    assert manifest["files"]["frontend"] == "frontend.mlpackage"
    assert {fn: (v["samples"], v["frames"]) for fn, v in manifest["frontend"]["functions"].items()} == {
        "main": (32000, 200), "window_1s": (16000, 100)}
    assert {fn: v["frames"] for fn, v in manifest["encoder"]["functions"].items()} == {"main": 200, "window_1s": 100}
    assert manifest["frontend"]["compute_units"] == "cpu_and_gpu" and manifest["frontend"]["precision"] == "fp32"

    # the front end re-exported for a 3 s window no longer feeds the 2 s encoder on disk
    with pytest.raises(BundleError, match="mel frames"):
        export_model(model, processor, settings.replace(window_seconds=3.0, force=True), components=("frontend",))
    assert not (tmp_path / "manifest.json").exists()


# --------------------------------------------------------------------------------------------
# Memory: the PyTorch model and the converted programs are gone before a package is gated
# --------------------------------------------------------------------------------------------


class _AliveProbe:
    """Weak references to the loaded PyTorch model and every converted coremltools program; a
    patched `runtime.load_model` records which of them are still alive when a gate loads a package."""

    def __init__(self, monkeypatch):
        import gc
        import weakref

        import cohere_coreml.runtime as runtime
        from cohere_coreml.export import decoder, encoder, frontend
        from cohere_coreml.model import checkpoint, layer_stream

        self.models, self.programs, self.loads = [], [], []
        real_load_model = runtime.load_model

        def tracked(real):
            def load_reference(*args, **kwargs):
                model, processor = real(*args, **kwargs)
                self.models.append(weakref.ref(model))
                return model, processor
            return load_reference

        def load_model(path, *args, **kwargs):
            gc.collect()
            self.loads.append({"package": Path(path).name.split(".tmp-")[0].lstrip("."),
                               "models": sum(r() is not None for r in self.models),
                               "programs": sum(r() is not None for r in self.programs)})
            return real_load_model(path, *args, **kwargs)

        monkeypatch.setattr(checkpoint, "load_reference", tracked(checkpoint.load_reference))
        monkeypatch.setattr(layer_stream, "load_streamed_reference", tracked(layer_stream.load_streamed_reference))
        monkeypatch.setattr(runtime, "load_model", load_model)
        for module in (encoder, decoder, frontend):
            real_convert = module.convert_module

            def convert_module(*args, _real=real_convert, **kwargs):
                program = _real(*args, **kwargs)
                self.programs.append(weakref.ref(program))
                return program

            monkeypatch.setattr(module, "convert_module", convert_module)

    def track(self, model) -> None:
        import weakref

        self.models.append(weakref.ref(model))


@pytest.mark.slow
def test_gates_run_after_the_model_and_programs_are_freed(tiny_checkpoint, tmp_path, monkeypatch):
    """`export_checkpoint` converts every component and computes the gates' PyTorch references
    first, then frees the model; no gate loads a package while the PyTorch model or a converted
    coremltools program is alive (so the peak is the larger of the two, not their sum)."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import MODEL_COMPONENTS, export_checkpoint, export_model
    from cohere_coreml.model.checkpoint import load_reference

    probe = _AliveProbe(monkeypatch)
    # control: `export_model` with a model its caller holds -> the probe sees it alive at the gate
    model, processor = load_reference(tiny_checkpoint)
    probe.track(model)
    settings = ExportSettings(out_dir=tmp_path / "held", precision="fp32", window_seconds=2.0)
    export_model(model, processor, settings, components=("encoder",), max_new_tokens=22)
    assert probe.loads and all(load["models"] == 1 for load in probe.loads), probe.loads
    assert all(load["programs"] == 0 for load in probe.loads), probe.loads
    del model
    probe.models.clear()
    probe.programs.clear()
    probe.loads.clear()

    settings = ExportSettings(out_dir=tmp_path / "ckpt", precision="fp32", window_seconds=2.0)
    result = export_checkpoint(str(tiny_checkpoint), settings, max_new_tokens=22, components=MODEL_COMPONENTS)
    assert len(probe.models) == 1 and len(probe.programs) >= 3  # the probe saw the load and the conversions
    assert {load["package"] for load in probe.loads} == {"encoder", "frontend", "decoder"}
    assert all(load["models"] == 0 and load["programs"] == 0 for load in probe.loads), probe.loads
    assert all(p["written"] and p["report"]["passed"] for p in result.packages.values())
    assert result.manifest.is_file()


@pytest.fixture(scope="module")
def one_layer_checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint with one encoder and one decoder layer: the same components, functions and
    code paths as `tiny_checkpoint` (two of each), for tests whose claims do not depend on depth."""
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt1") / "tiny1", seed=0, encoder_num_hidden_layers=1,
                                num_hidden_layers=1)


@pytest.mark.slow
def test_bucket_export_leaves_no_converted_copy_in_the_temp_folder(one_layer_checkpoint, tmp_path, monkeypatch):
    """coremltools writes every converted model to a temporary package and deletes it only at exit;
    the function loops (encoder buckets, decoder functions, front end) delete each copy once saved
    (`files.save_converted`): at full size each is 3.5 GB, and a 6-function export filled the disk."""
    import tempfile

    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import MODEL_COMPONENTS, export_model
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.storage import files

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    model, processor = load_reference(one_layer_checkpoint)

    def leftovers():
        return sorted(p.name for p in temp.iterdir() if p.name.endswith(".mlpackage"))

    settings = ExportSettings(out_dir=tmp_path / "b", precision="fp32", window_seconds=3.0, skip_verify=True)
    export_model(model, processor, settings, MODEL_COMPONENTS, buckets=(1.0, 2.0), prefill=True, max_new_tokens=22)
    # one single-function conversion per component may stay until exit; none of the loops' copies
    before = len(leftovers())
    assert before <= 1, leftovers()
    # control: saving without deleting keeps every function's copy
    monkeypatch.setattr(files, "save_converted", lambda mlmodel, path: mlmodel.save(str(path)))
    for module in ("encoder_packages", "decoder", "frontend"):
        monkeypatch.setattr(f"cohere_coreml.export.{module}.save_converted", files.save_converted)
    export_model(model, processor, settings.replace(out_dir=tmp_path / "c"), MODEL_COMPONENTS, buckets=(1.0, 2.0), prefill=True,
                 max_new_tokens=22)
    assert len(leftovers()) - before >= 3 + 2 + 3, leftovers()  # buckets + decoder functions + front ends


def test_manifest_io_of_every_function(trained_bundle):
    """A multifunction bundle (length bucket + prefill) lists the I/O of every function, read from the
    package: each encoder function takes its own frame count, the prefill function the whole prompt
    and no position, and shares the step function's state."""
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.runtime import load_model

    manifest = Bundle.load(trained_bundle).manifest
    enc, dec = manifest["encoder"], manifest["decoder"]
    assert len(enc["functions"]) == 2  # "main" + the 2 s bucket
    for fn, info in enc["functions"].items():
        io = info["io"]
        assert io["inputs"]["input_features"]["shape"] == [1, enc["num_mel_bins"], info["frames"]], fn
        assert io["outputs"]["cross_k"]["shape"] == dec["memory_shape"], fn
        loaded = load_model(str(trained_bundle / "encoder.mlpackage"), backend="mil", function_name=fn)
        assert tuple(io["inputs"]["input_features"]["shape"]) == tuple(loaded.input_description["input_features"][0])
    frames = sorted(info["frames"] for info in enc["functions"].values())
    assert frames[0] < frames[1] == enc["window_frames"]
    assert enc["io"] == enc["functions"]["main"]["io"]

    assert manifest["format_version"] == 3
    # the default decoder: host-state (no bind function: the host writes the memory and each call's rows)
    assert dec["state_writes"] == "host"
    assert dec["functions"] == {"step": "main", "bind": None, "prefill": "prefill", "step_batch": "step_batch"}
    assert dec["bind_io"] is None and dec["bind_inputs"] is None
    prefill = dec["prefill_io"]
    assert prefill is not None
    assert prefill["inputs"] == {"input_ids": {"shape": [1, dec["prefill_length"]], "dtype": "int32"}}
    assert dec["io"]["inputs"] == {"input_ids": {"shape": [1, 1], "dtype": "int32"},
                                   "position": {"shape": [1], "dtype": "int32"},
                                   "cache_mask": {"shape": [1, 1, 1, dec["capacity"]], "dtype": "float16"}}
    rows = dec["cache_shape"][:2] + [1, dec["cache_shape"][3]]
    assert dec["io"]["outputs"]["new_k"] == dec["io"]["outputs"]["new_v"] == {"shape": rows, "dtype": "float16"}
    assert prefill["outputs"]["new_k"]["shape"] == rows[:2] + [dec["prefill_length"], rows[3]]
    # one state layout for every function: the self cache and the window's cross memory
    assert prefill["states"] == dec["io"]["states"]
    assert set(dec["io"]["states"]) == {"self_k", "self_v", "cross_k", "cross_v", "cross_mask"}
    assert dec["io"]["states"]["self_k"]["shape"] == dec["cache_shape"]
    assert dec["io"]["states"]["cross_k"]["shape"] == dec["memory_shape"]
    # the host writes the encoder's outputs into the memory states: same shapes
    for name, source in dec["memory_states"].items():
        assert dec["io"]["states"][name]["shape"] == enc["io"]["outputs"][source]["shape"], name


@pytest.mark.slow
def test_a_decoder_exported_for_another_alignment_request_is_exported_again(tiny_reference, tmp_path, caplog):
    """The decoder package records what the export asked of its alignment (`alignment_request`): a resumed export
    skips it only for the same request. Another --alignment-heads, another calibration set or a package that
    predates the align function is exported again (else `make demo` after an upgrade kept a decoder without word
    timings and said nothing); the same request is skipped."""
    import shutil

    from cohere_coreml.bundle.packages import package_metadata
    from cohere_coreml.config import ALIGN_REQUEST_METADATA_KEY
    from cohere_coreml.export.alignment_heads import CALIBRATION_SET, alignment_request
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model

    # a two-clip calibration set: what is recorded is its content, so a copy with one clip less is another set
    small = tmp_path / "cal"
    small.mkdir()
    manifest = json.loads((CALIBRATION_SET / "manifest.json").read_text())
    manifest["utterances"] = manifest["utterances"][:2]
    for u in manifest["utterances"]:
        shutil.copy(CALIBRATION_SET / u["file"], small / u["file"])
    (small / "manifest.json").write_text(json.dumps(manifest))
    model, processor = tiny_reference
    settings = ExportSettings(out_dir=tmp_path / "out", precision="fp32", window_seconds=2.0)
    package = settings.package_path("decoder")

    def export(heads: str, batch: int | None = None):
        caplog.clear()
        export_model(model, processor, settings, components=("decoder",), max_new_tokens=22, alignment_heads=heads,
                     alignment_calibration=small, decoder_batch=batch)
        return package_metadata(package).get(ALIGN_REQUEST_METADATA_KEY), package.stat().st_mtime_ns

    assert export("none")[0] == "none"
    request, first = export("auto")  # the random model transcribes no clip: no heads, but the request is recorded
    assert request == alignment_request("auto", 1, small) != "none" and "exporting it again" in caplog.text
    assert export("auto") == (request, first) and "exporting it again" not in caplog.text  # same request: skipped
    manifest["utterances"] = manifest["utterances"][:1]
    (small / "manifest.json").write_text(json.dumps(manifest))
    request2, second = export("auto")
    assert request2 != request and second != first and "exporting it again" in caplog.text
    # a decoder without the batched step (another --decoder-batch, or one from before it): exported again, not an
    # error (`make demo` after an upgrade), and then skipped for the same batch
    from cohere_coreml.bundle.packages import decoder_package_info

    _, third = export("auto", batch=1)
    assert third != second and "exporting it again" in caplog.text
    assert (decoder_package_info(package).get("batch") or {}).get("size", 1) == 1
    _, fourth = export("auto")  # the default batch
    assert fourth != third and "batched step has 1 window(s), this export asks for" in caplog.text
    assert decoder_package_info(package)["batch"]["size"] > 1
    assert export("auto")[1] == fourth and "exporting it again" not in caplog.text
