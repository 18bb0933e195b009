"""The manifest's `vad` entry (vad.mlpackage): written from the package and its gate, checked on load, and a
bundle without it loads as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cohere_coreml.bundle.format import VAD_FILE, BundleError
from cohere_coreml.bundle.load import Bundle
from cohere_coreml.bundle.manifest import refresh_manifest, vad_parity
from cohere_coreml.bundle.packages import vad_package_info
from cohere_coreml.export.vad_package import BLOCK_CHUNKS, MAX_ABS_DIFF
from cohere_coreml.model import silero
from cohere_coreml.storage.integrity import MANIFEST_NAME, check_bundle


def _copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        manifest = json.loads((dst / MANIFEST_NAME).read_text())
        edit(manifest)
        (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dst


def test_the_entry_is_read_from_the_package_and_its_gate(trained_bundle):
    m = json.loads((trained_bundle / MANIFEST_NAME).read_text())
    assert m["files"]["vad"] == VAD_FILE
    vad = m["vad"]
    assert vad == {**vad_package_info(trained_bundle / VAD_FILE), "parity": vad_parity(trained_bundle)}
    assert vad["model"] == "silero-vad" and vad["source"] == silero.source_record()
    assert (vad["sample_rate"], vad["chunk_samples"], vad["context_samples"], vad["hidden"]) == (16000, 512, 64, 128)
    assert (vad["precision"], m["precision"]) == ("fp32", "fp16")  # the VAD's program is fp32 in every bundle
    assert vad["functions"]["block"]["chunks"] == BLOCK_CHUNKS and vad["functions"]["chunk"]["chunks"] == 1
    assert vad["functions"]["block"]["io"]["inputs"]["frames"]["shape"] == [BLOCK_CHUNKS, 576]
    assert vad["functions"]["chunk"]["io"]["outputs"]["probability"]["shape"] == [1, 1]
    parity = vad["parity"]
    assert parity["segments_identical"] is True and 0 < parity["max_abs_diff"] <= MAX_ABS_DIFF["fp32"]
    assert parity["chunks"] > 100 and "digital_silence" in parity["clips"]
    assert any(f.startswith("vad.mlpackage/") for f in m["checksums"]["files"])  # covered like every package
    assert Bundle.load(trained_bundle).vad_chunks == BLOCK_CHUNKS


def _set_chunks(m, n):
    block = m["vad"]["functions"]["block"]
    block["chunks"] = n
    block["io"]["inputs"]["frames"]["shape"] = [n, 576]
    block["io"]["outputs"]["probability"]["shape"] = [1, n]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("vad"), r"field 'vad' and files\.vad must be given together"),
    (lambda m: m["files"].pop("vad"), r"field 'vad' and files\.vad must be given together"),
    (lambda m: m["vad"].update(sample_rate=8000), r"vad\.sample_rate"),
    (lambda m: m["vad"].update(chunk_samples=256), r"vad\.chunk_samples"),
    (lambda m: m["vad"].update(context_samples=32), r"vad\.context_samples"),
    (lambda m: m["vad"].update(hidden="128"), r"vad\.hidden"),
    (lambda m: m["vad"]["functions"]["block"].update(chunks=0), r"vad\.functions\.block\.chunks"),
    (lambda m: m["vad"]["functions"]["block"].update(chunks=BLOCK_CHUNKS + 1), r"vad\.functions\.block\.io"),
    (lambda m: m["vad"]["functions"]["chunk"].update(chunks=2), r"vad\.functions\.chunk\.chunks"),
    (lambda m: m["vad"]["functions"].pop("chunk"), r"vad\.functions\.chunk"),
    (lambda m: m["vad"]["functions"]["chunk"]["io"]["inputs"]["h"].update(shape=[1, 64]),
     r"vad\.functions\.chunk\.io\.inputs\.h"),
    (lambda m: m["vad"]["functions"]["block"]["io"]["outputs"].pop("c_out"), r"vad\.functions\.block\.io\.outputs"),
    (lambda m: m["files"].update(vad="vad.json"), r"files\.vad.*\.mlpackage"),
    # consistent numbers that are not the package's: the package check names it
    (lambda m: _set_chunks(m, 16), r"'vad\.functions\.block' io differs from function 'block' of vad\.mlpackage"),
])
def test_a_wrong_entry_is_refused_naming_the_field(trained_bundle, tmp_path, edit, message):
    bundle = _copy(trained_bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=message):
        Bundle.load(bundle)


def test_a_missing_or_altered_package_is_named(trained_bundle, tmp_path):
    missing = _copy(trained_bundle, tmp_path / "missing")
    shutil.rmtree(missing / VAD_FILE)
    with pytest.raises(BundleError, match="bundle is missing vad.mlpackage"):
        Bundle.load(missing)
    with pytest.raises(Exception, match=r"vad\.mlpackage/"):
        check_bundle(missing)  # `bundle check`: the files the checksums list
    altered = _copy(trained_bundle, tmp_path / "altered")
    weights = next((altered / VAD_FILE).rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"vad\.mlpackage/.*weight\.bin"):
        check_bundle(altered)  # what `bundle check` runs: the sha256 of every file


def test_a_bundle_without_vad_loads_as_before(trained_bundle, tmp_path):
    from cohere_coreml.inference.vad import vad_for

    def drop(m):
        m.pop("vad")
        m["files"].pop("vad")

    bundle_dir = _copy(trained_bundle, tmp_path / "b", drop)
    shutil.rmtree(bundle_dir / VAD_FILE)
    (bundle_dir / "vad.parity.json").unlink()
    refresh_manifest(bundle_dir)  # checksums of the files left
    bundle = Bundle.load(bundle_dir)
    assert "vad" not in bundle.paths and bundle.vad_chunks is None and vad_for(bundle) is None
    # a null entry is the same as none
    bundle_dir2 = _copy(bundle_dir, tmp_path / "null", lambda m: m.update(vad=None))
    assert Bundle.load(bundle_dir2).vad_chunks is None
