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

from .conftest import AUDIO_DIR

SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "manifest.schema.json"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, trained_bundle):
    """A copy of the session's fp16 bundle of the trained model (export writes the checksums),
    finalized: README.md, example_inference.py, checksums refreshed."""
    from cohere_coreml.publish import finalize_bundle

    out = tmp_path_factory.mktemp("integrity") / "f16"
    shutil.copytree(trained_bundle, out)
    finalize_bundle(out)
    return out


def _validate(manifest: dict) -> None:
    import jsonschema

    jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))


def test_export_manifest_carries_checksums(trained_bundle):
    """`cohere-coreml export` (bundle.write_bundle) writes the integrity sections itself."""
    from cohere_coreml.integrity import bundle_files, check_bundle

    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    _validate(manifest)
    assert manifest["preset"] == "f16" and manifest["recipe"] == {"encoder": None, "decoder": None}
    assert set(manifest["checksums"]["files"]) == {p.as_posix() for p in bundle_files(trained_bundle)}
    assert {"encoder.parity.json", "frontend.parity.json", "decoder.parity.json"} <= set(manifest["checksums"]["files"])
    assert any(f.startswith("frontend.mlpackage/") for f in manifest["checksums"]["files"])
    assert check_bundle(trained_bundle)["files"] == len(manifest["checksums"]["files"])


def test_manifest_lists_every_file_with_hash_and_validates(bundle):
    from cohere_coreml.integrity import bundle_files, check_bundle, sha256_file

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
                     lambda m: m["decoder"].pop("bind_io"),
                     lambda m: m["decoder"]["functions"].pop("bind"),
                     lambda m: m["decoder"]["io"]["inputs"].update(cross_k={"shape": [1], "dtype": "float16"}),
                     lambda m: m["decoder"]["io"]["states"].pop("cross_mask")):
        broken = json.loads(json.dumps(manifest))
        breaking(broken)
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)


def test_flipped_byte_in_any_file_is_named(bundle, tmp_path):
    from cohere_coreml.integrity import IntegrityError, check_bundle

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
    from cohere_coreml.bundle import Bundle, BundleError
    from cohere_coreml.integrity import IntegrityError, check_bundle

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
    from cohere_coreml.integrity import bundle_files

    assert main(["upload", "--bundle", str(bundle), "--repo-id", "org/name", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[-1] for line in out.splitlines()[1:]]
    want = sorted(["f16/" + p.as_posix() for p in bundle_files(bundle)] + ["f16/manifest.json"])
    assert sorted(listed) == want
    total = sum((bundle / p).stat().st_size for p in bundle_files(bundle)) + (bundle / "manifest.json").stat().st_size
    assert f"({total:,} bytes) to org/name/f16/" in out


def test_upload_refuses_a_tampered_bundle_before_any_network(bundle, tmp_path):
    from cohere_coreml.integrity import IntegrityError
    from cohere_coreml.publish import upload_bundle

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
    proc = subprocess.run([sys.executable, str(bundle / "example_inference.py"), str(AUDIO_DIR / "en_short.wav"),
                           "--language", "en", "--max-new-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the shipped example's loop (bind once, then steps of input_ids + position) transcribes as the Transcriber
    from cohere_coreml.transcribe import Transcriber

    expected = Transcriber(bundle, backend="mil", use_prefill=False).transcribe(
        AUDIO_DIR / "en_short.wav", "en", max_new_tokens=5).text
    assert expected and proc.stdout.strip() == expected


def test_model_card_shows_a_bench_report(bundle, tmp_path):
    """`bundle finalize --bench bench.json`: the card gets the presets table (WER per language, tokens
    identical to PyTorch), the checksums still match; a file that is not a bench report is refused."""
    from cohere_coreml.integrity import check_bundle
    from cohere_coreml.publish import PublishError, finalize_bundle

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
    from cohere_coreml.bundle import FORMAT_VERSION, Bundle, BundleError
    from cohere_coreml.cli import main

    assert FORMAT_VERSION == 2
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
    manifest["format_version"] = 3
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format_version 3.*update"):
        Bundle.load(copy)
