"""Bundle integrity (checksums from disk, `bundle check`), the manifest's JSON Schema, upload dry run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..fixture_data import AUDIO_DIR

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, trained_bundle):
    """A copy of the session's fp16 bundle of the trained model (export writes the checksums),
    finalized: README.md, example_inference.py, checksums refreshed."""
    from cohere_coreml.publish.hub import finalize_bundle

    out = tmp_path_factory.mktemp("integrity") / "f16"
    shutil.copytree(trained_bundle, out)
    finalize_bundle(out)
    return out


def _validate(manifest: dict) -> None:
    import jsonschema

    jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))


def test_export_manifest_carries_checksums(trained_bundle):
    """`cohere-coreml export` (bundle.write_bundle) writes the integrity sections itself."""
    from cohere_coreml.storage.integrity import bundle_files, check_bundle

    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    _validate(manifest)
    # a bundle exported without prefill / extend writes null / no key (the schema once refused the null:
    # `oneOf` with an io definition that also allows null)
    bare = json.loads(json.dumps(manifest))
    bare["decoder"].update(prefill_io=None, prefill_length=None)
    bare["decoder"]["functions"]["prefill"] = None
    for key in ("extend_io", "extend_length"):
        bare["decoder"].pop(key, None)
    _validate(bare)
    bare.pop("vad")  # a bundle without a VAD (exported before it, or --no-vad) ...
    bare["files"].pop("vad")
    _validate(bare)
    _validate({**bare, "vad": None})  # ... or with a null entry
    assert manifest["preset"] == "f16" and manifest["recipe"] == {"encoder": None, "decoder": None}
    assert set(manifest["checksums"]["files"]) == {p.as_posix() for p in bundle_files(trained_bundle)}
    assert {"encoder.parity.json", "frontend.parity.json", "decoder.parity.json", "vad.parity.json"} <= set(
        manifest["checksums"]["files"])
    assert any(f.startswith("frontend.mlpackage/") for f in manifest["checksums"]["files"])
    assert check_bundle(trained_bundle)["files"] == len(manifest["checksums"]["files"])


def test_manifest_lists_every_file_with_hash_and_validates(bundle):
    from cohere_coreml.storage.integrity import bundle_files, check_bundle, sha256_file

    manifest = json.loads((bundle / "manifest.json").read_text())
    _validate(manifest)
    files = manifest["checksums"]["files"]
    on_disk = {p.as_posix() for p in bundle_files(bundle)}
    assert set(files) == on_disk and "manifest.json" not in files
    assert any(f.startswith("encoder.mlpackage/Data/com.apple.CoreML/weights/") for f in files)  # package contents
    assert {"README.md", "example_inference.py", "vocab.json"} <= set(files)
    rel = "decoder.mlpackage/Manifest.json"
    assert files[rel] == {"sha256": sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}
    assert manifest["preset"] == "f16" and manifest["min_os"]["macOS"] == "15.0"
    assert check_bundle(bundle)["files"] == len(files)
    # finalize keeps the VAD as exported and takes it into the Neural Engine census
    assert manifest["vad"]["functions"]["block"]["io"]["inputs"]["frames"]["shape"][1] == 576
    ane = json.loads((bundle / "ane_check.json").read_text())
    assert ane["programs"]["vad"]["functions"]["block"]["errors"] == 0


def test_schema_rejects_broken_manifests(bundle):
    import jsonschema

    manifest = json.loads((bundle / "manifest.json").read_text())
    for breaking in (lambda m: m.pop("checksums"),
                     lambda m: m["checksums"]["files"].update({"x": {"sha256": "zz", "size": 1}}),
                     lambda m: m.update(preset="q3"),
                     lambda m: m["tokens"].update(eos_token_ids=[]),
                     lambda m: m["frontend"].update(compute_units="neural_engine"),
                     lambda m: m["frontend"]["functions"].pop("main"),
                     lambda m: m.update(format_version=1),
                     lambda m: m["decoder"].pop("cache_mask_input"),  # a host-state decoder (the default)
                     lambda m: m["decoder"].update(state_writes="graph"),  # ... is no graph one (no bind_io)
                     lambda m: m["encoder"].pop("length_masks"),
                     lambda m: m["encoder"].pop("parts"),
                     lambda m: m["decoder"]["io"]["inputs"].update(cross_k={"shape": [1], "dtype": "float16"}),
                     lambda m: m["decoder"]["io"]["states"].pop("cross_mask"),
                     lambda m: m["files"].pop("vad"),  # files.vad and vad come together
                     lambda m: m.pop("vad"),
                     lambda m: m["vad"].update(sample_rate=8000),
                     lambda m: m["vad"]["functions"]["chunk"].update(chunks=2),
                     lambda m: m["vad"]["functions"]["block"].update(chunks=0),
                     lambda m: m["vad"]["source"].update(sha256="abc"),
                     lambda m: m["vad"]["functions"]["block"]["io"]["outputs"].pop("h_out")):
        broken = json.loads(json.dumps(manifest))
        breaking(broken)
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)


def test_flipped_byte_in_any_file_is_named(bundle, tmp_path):
    from cohere_coreml.storage.integrity import IntegrityError, check_bundle

    files = sorted(json.loads((bundle / "manifest.json").read_text())["checksums"]["files"])
    for rel in files:
        copy = tmp_path / "b"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(bundle, copy)
        path = copy / rel
        data = bytearray(path.read_bytes())
        if not data:
            continue
        data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError) as info:
            check_bundle(copy)
        assert info.value.problems == [f"{rel}: sha256 differs from the manifest"], rel


def test_missing_resized_and_unlisted_files_are_named(bundle, tmp_path):
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.storage.integrity import IntegrityError, check_bundle

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    (copy / "vocab.json").unlink()
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    (copy / "notes.txt").write_text("x")
    with pytest.raises(IntegrityError) as info:
        check_bundle(copy)
    assert "vocab.json: missing" in info.value.problems
    assert any(p.startswith("tokenizer.json: size") for p in info.value.problems)
    assert "notes.txt: not listed in the manifest" in info.value.problems
    shutil.copy(bundle / "vocab.json", copy / "vocab.json")
    with pytest.raises(BundleError, match="tokenizer.json: size"):  # loading checks presence and sizes
        Bundle.load(copy)


@pytest.mark.parametrize("where", ["notes.txt", ".hidden-notes", "encoder.mlpackage/Data/extra", "linked-dir"])
def test_symbolic_links_are_refused_by_finalize_check_upload_and_load(bundle, tmp_path, where):
    """A link inside a bundle (to a file outside it, as a stray link to a credentials file would be) is
    named and refused by finalize, check, upload (dry run too: nothing is listed) and the loader."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.cli import main
    from cohere_coreml.publish.hub import finalize_bundle, upload_bundle
    from cohere_coreml.storage.integrity import IntegrityError, check_bundle

    secret = tmp_path / "secret.txt"
    secret.write_text("token=hf_not_a_real_one")
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    link = copy / where
    if where == "linked-dir":
        (tmp_path / "outside").mkdir()
        link.symlink_to(tmp_path / "outside", target_is_directory=True)
    else:
        link.symlink_to(secret)
    for call in (lambda: check_bundle(copy), lambda: check_bundle(copy, hashes=False),
                 lambda: finalize_bundle(copy), lambda: upload_bundle(copy, "org/name", dry_run=True)):
        with pytest.raises(IntegrityError, match="symbolic link") as info:
            call()
        assert where in str(info.value)
    assert main(["upload", "--bundle", str(copy), "--repo-id", "org/name", "--dry-run"]) != 0
    assert main(["bundle", "check", str(copy)]) != 0
    link.unlink()
    check_bundle(copy)  # the same bundle without the link is fine: the refusal was the link
    # a listed file reached through a linked folder: the loader refuses it too
    moved = tmp_path / "elsewhere.mlpackage"
    shutil.move(str(copy / "decoder.mlpackage"), moved)
    (copy / "decoder.mlpackage").symlink_to(moved, target_is_directory=True)
    with pytest.raises(BundleError, match="symbolic link"):
        Bundle.load(copy)


@pytest.mark.parametrize("bad", ["../outside.txt", "/etc/passwd", "a/../../b", "./vocab.json", "a//b", "C:/x",
                                 "dir\\file", "tab\tname"])
def test_manifest_paths_outside_the_bundle_are_refused(bundle, tmp_path, bad):
    """A checksum table or files entry naming a path that leaves the bundle is refused before anything
    is read through it (check, upload, the loader), and the error names the path."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.publish.hub import upload_bundle
    from cohere_coreml.storage.integrity import IntegrityError, check_bundle

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edited = json.loads(json.dumps(manifest))
    edited["checksums"]["files"][bad] = {"sha256": "0" * 64, "size": 1}
    (copy / "manifest.json").write_text(json.dumps(edited))
    for call in (lambda: check_bundle(copy), lambda: upload_bundle(copy, "org/name", dry_run=True)):
        with pytest.raises(IntegrityError, match="refused") as info:
            call()
        assert repr(bad) in str(info.value)
    with pytest.raises(BundleError, match="refused"):
        Bundle.load(copy)
    edited = json.loads(json.dumps(manifest))
    edited["files"]["vocab"] = bad
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(BundleError, match="files.vocab"):
        Bundle.load(copy)


def test_safe_path_accepts_the_paths_bundles_use(bundle):
    from cohere_coreml.storage.integrity import bundle_files, safe_path

    for rel in bundle_files(bundle):
        assert safe_path(rel.as_posix()) == rel.as_posix()


def test_bundle_check_command(bundle, tmp_path, capsys):
    from cohere_coreml.cli import main

    assert main(["bundle", "check", str(bundle)]) == 0
    assert "every sha256 matches" in capsys.readouterr().out
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    weights = next((copy / "encoder.mlpackage").rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["bundle", "check", str(copy)]) == 1
    assert "encoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin: sha256 differs" in capsys.readouterr().out


def test_upload_dry_run_lists_exactly_the_bundle(bundle, capsys):
    from cohere_coreml.cli import main
    from cohere_coreml.storage.integrity import bundle_files

    assert main(["upload", "--bundle", str(bundle), "--repo-id", "org/name", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[-1] for line in out.splitlines()[1:]]
    want = sorted(["f16/" + p.as_posix() for p in bundle_files(bundle)] + ["f16/manifest.json"])
    assert sorted(listed) == want
    assert "f16/vad.parity.json" in listed and any(p.startswith("f16/vad.mlpackage/") for p in listed)
    total = sum((bundle / p).stat().st_size for p in bundle_files(bundle)) + (bundle / "manifest.json").stat().st_size
    assert f"({total:,} bytes) to org/name/f16/" in out


def test_upload_refuses_a_tampered_bundle_before_any_network(bundle, tmp_path):
    from cohere_coreml.publish.hub import upload_bundle
    from cohere_coreml.storage.integrity import IntegrityError

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    (copy / "vocab.json").write_text((copy / "vocab.json").read_text().replace("a", "b", 1))
    with pytest.raises(IntegrityError, match="vocab.json"):
        upload_bundle(copy, "org/name")


def test_upload_unreachable_hub_is_a_clear_error_and_token_never_printed(bundle, tmp_path):
    """HF_HUB_OFFLINE (as in the test environment) and an unroutable endpoint: one-line error, fast."""
    env = dict(os.environ, HF_TOKEN="hf_secret_token_value_123", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cohere_coreml.cli", "upload", "--bundle", str(bundle),
                           "--repo-id", "org/name", "--timeout", "3"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot upload" in proc.stderr or "cannot reach" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "hf_secret_token_value_123" not in proc.stdout + proc.stderr
    env = dict(env, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://10.255.255.1:9")  # unroutable: connect times out
    proc = subprocess.run([sys.executable, "-m", "cohere_coreml.cli", "upload", "--bundle", str(bundle),
                           "--repo-id", "org/name", "--timeout", "3"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot reach the Hugging Face Hub" in proc.stderr or "refused" in proc.stderr, proc.stderr[-2000:]
    assert "hf_secret_token_value_123" not in proc.stdout + proc.stderr
    assert time.perf_counter() - t0 < 110


def test_model_card_and_example(bundle):
    text = (bundle / "README.md").read_text()
    header = text.split("---")[1]
    assert "pipeline_tag: automatic-speech-recognition" in header and "library_name: coreml" in header
    assert "license: apache-2.0" in header and "- en" in header
    assert "encoder.mlpackage" in text and "Parity" in text
    # the shipped example is run in its own venv (numpy, soundfile, coremltools only): tests/publish/test_example.py
    assert (bundle / "example_inference.py").is_file()


def test_model_card_shows_the_swift_package(bundle):
    """The card's Swift section uses the package (download, transcribe, stream), and every call it shows
    exists in the package's sources with those labels, so the card cannot drift from the API."""
    import re

    text = (bundle / "README.md").read_text()
    manifest = json.loads((bundle / "manifest.json").read_text())
    swift = text[text.index("```swift"):]
    swift = swift[: swift.index("```", 3)]
    assert f'download(folder: "{manifest.get("preset") or bundle.name}")' in swift
    package = Path(__file__).resolve().parents[2] / "swift" / "Sources"
    sources = "\n".join(p.read_text() for p in package.rglob("*.swift"))
    calls = {"BundleDownloader(repoId:": r"public init\(repoId: String",
             "download(folder:": r"public func download\(folder: String",
             "CohereTranscriber(bundle:": r"public init\(bundle: URL",
             "prewarm()": r"public func prewarm\(\)",
             "transcribe(contentsOf:": r"public func transcribe\(contentsOf url: URL, language: String",
             "windows(contentsOf:": r"public nonisolated func windows\(contentsOf url: URL, language: String"}
    for call, declaration in calls.items():
        assert call in swift, call
        assert re.search(declaration, sources), f"the card shows {call} but the Swift package declares no {declaration}"
    assert "MLModel" not in swift  # no hand-written loop for a Swift developer


def test_model_card_names_the_hub_id_never_a_path(bundle, tmp_path, capsys):
    """Without a known Hub id the card has no base_model and no "revision None"; `finalize --base-model`
    records the id in the manifest and the card's metadata; a path or a bad id is refused."""
    from cohere_coreml.cli import main
    from cohere_coreml.storage.integrity import check_bundle

    text = (bundle / "README.md").read_text()
    header = text.split("---")[1]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest.get("base_model") is None
    assert "base_model:" not in header and "revision `None`" not in text
    assert not manifest["model_id"].startswith(("/", "~", "."))
    copy = tmp_path / "f16"
    shutil.copytree(bundle, copy)
    assert main(["bundle", "finalize", str(copy), "--base-model", "CohereLabs/cohere-transcribe-03-2026"]) == 0
    capsys.readouterr()
    header = (copy / "README.md").read_text().split("---")[1]
    assert "base_model: CohereLabs/cohere-transcribe-03-2026" in header.splitlines()
    assert json.loads((copy / "manifest.json").read_text())["base_model"] == "CohereLabs/cohere-transcribe-03-2026"
    check_bundle(copy)  # the manifest was rewritten by the one writer: checksums still match
    _validate(json.loads((copy / "manifest.json").read_text()))
    for bad in ("/home/me/models/ckpt", "ckpt"):
        assert main(["bundle", "finalize", str(copy), "--base-model", bad]) != 0
        assert "Hub id" in capsys.readouterr().err
    assert json.loads((copy / "manifest.json").read_text())["base_model"] == "CohereLabs/cohere-transcribe-03-2026"


def test_model_card_shows_a_bench_report(bundle, tmp_path):
    """`bundle finalize --bench bench.json`: the card gets the presets table (WER per language, tokens
    identical to PyTorch), the checksums still match; a file that is not a bench report is refused."""
    from cohere_coreml.publish.hub import PublishError, finalize_bundle
    from cohere_coreml.storage.integrity import check_bundle

    out = tmp_path / "q8"
    shutil.copytree(bundle, out)
    engines = [{"label": "pytorch m", "languages": {"en": {"rate": 0.015, "metric": "wer"},
                                                    "ja": {"rate": 0.1, "metric": "cer"}}},
               {"label": "q8 (fp16, mil)", "languages": {"en": {"rate": 0.02, "metric": "wer"}},
                "bundle": {"preset": "q8", "gate": "passed", "size_mb": 3.5},
                "agreement": {"clips": 30, "identical_clips": 29, "baseline_tokens": 391, "agreeing_tokens": 388}}]
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"engines": engines, "dataset": {"name": "/x/heldout", "clips": 30},
                                  "tool_version": "0.1", "tool_git_hash": "abcdef", "created_utc": "now"}))
    finalize_bundle(out, bench=report)
    text = (out / "README.md").read_text()
    assert "dataset `heldout`, 30 clips" in text and "| en WER % | ja CER % |" in text
    assert "| pytorch m | - | - | - | 1.50 | 10.00 | reference |" in text
    assert "| q8 (fp16, mil) | q8 | passed | 3.50 | 2.00 | - | 29/30, 388/391 |" in text
    assert check_bundle(out)["files"] > 5  # README.md changed: its checksum was refreshed last
    assert "Gate `skipped`" not in text  # said only when a row was built with --skip-gate
    (tmp_path / "bad.json").write_text(json.dumps({"engines": []}))
    with pytest.raises(PublishError, match="not a `cohere-coreml bench` report"):
        finalize_bundle(out, bench=tmp_path / "bad.json")


def test_format_1_manifest_is_refused(bundle, tmp_path, capsys):
    """A format-1 bundle (the decoder took the cross memory at every step) is refused by the loader and
    the CLI with one clear line saying to re-export, not a traceback."""
    from cohere_coreml.bundle.format import FORMAT_VERSION, BundleError
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.cli import main

    assert FORMAT_VERSION == 3
    copy = tmp_path / "old"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format_version 1.*re-export"):
        Bundle.load(copy)
    code = main(["transcribe", str(AUDIO_DIR / "en_short.wav"), "--bundle", str(copy), "--backend", "mil",
                 "--language", "en"])
    err = capsys.readouterr().err
    assert code != 0 and "format_version 1" in err and "re-export" in err and "Traceback" not in err
    manifest["format_version"] = FORMAT_VERSION + 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=f"format_version {FORMAT_VERSION + 1}.*update"):
        Bundle.load(copy)
