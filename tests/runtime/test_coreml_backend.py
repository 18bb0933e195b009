"""The Core ML backend (runtime/coreml_backend.py, runtime/compiled_cache.py) run on Linux through the
tests' emulation of coremltools' native layer (tests/coreml_interpreter_shim.py): each package compiled
once per cache, every function loaded from the compiled model with the compute units asked for, the
decoder's state shared across its functions, token ids equal to the interpreter backend's."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

import cohere_coreml.runtime as runtime_module
from cohere_coreml.cli import main
from cohere_coreml.runtime import load_model
from cohere_coreml.runtime.compiled_cache import COMPLETE_MARKER, CompiledCache, package_digest
from cohere_coreml.runtime.coreml_backend import macos_for_specification
from cohere_coreml.runtime.package import read_package

from ..coreml_interpreter_shim import Interpreter, emulated
from ..fixture_data import HELDOUT_DIR

SERVE = [sys.executable, "-m", "cohere_coreml.cli", "serve-runtime", "--num-threads", "1"]


@pytest.fixture(scope="module")
def interpreter_child():
    """One `serve-runtime` child for the module's emulations (a fresh one per test cost ~8 s CPU each, mostly
    its imports). What the tests count (compiles, loads, their compute units) is the parent's per-test
    `Emulation`; the child only runs the models it is asked to load, under a new handle per load."""
    child = Interpreter(SERVE)
    yield child
    child.close()


@pytest.fixture
def emulation(tmp_path, monkeypatch, interpreter_child):
    monkeypatch.setenv("COHERE_COREML_CACHE", str(tmp_path / "cache"))  # never the user's Caches
    with emulated(SERVE) as emu:
        emu.interpreter = interpreter_child  # what `Emulation.child()` would start on the first load
        try:
            yield emu
        finally:
            emu.interpreter = None  # the module's child outlives this emulation (uninstall would quit it)


def packages(bundle) -> dict[str, list[str]]:
    """Package path -> its function names, for every package of `bundle`."""
    return {str(p): read_package(p).function_names for p in sorted(bundle.glob("*.mlpackage"))}


def test_each_package_compiles_once_and_every_function_loads_from_it(emulation, trained_bundle, tmp_path):
    cache = CompiledCache(tmp_path / "compiled")
    funcs = packages(trained_bundle)
    assert sum(len(f) for f in funcs.values()) > len(funcs)  # multifunction packages: what the cache is for
    from cohere_coreml.runtime.coreml_backend import CoreMLModel

    for path, names in funcs.items():
        for name in names:
            model = CoreMLModel(read_package(path, name), compute_units="cpu_and_ne", cache=cache)
            assert model.compiled_path == cache.location(path)
    assert cache.compiles == len(emulation.compiles) == len(funcs)  # once per package, not per function
    assert len(emulation.loads) == sum(len(f) for f in funcs.values())
    assert {load["compute_units"] for load in emulation.loads} == {"cpu_and_ne"}
    assert {load["path"] for load in emulation.loads} == {str(cache.location(p)) for p in funcs}
    # a later process (a new cache object on the same folder) compiles nothing
    again = CompiledCache(tmp_path / "compiled")
    for path, names in funcs.items():
        CoreMLModel(read_package(path, names[0]), cache=again)
    assert again.compiles == 0 and again.hits == len(funcs) and len(emulation.compiles) == len(funcs)
    assert {load["compute_units"] for load in emulation.loads[-len(funcs):]} == {"all"}


def test_the_emulation_compiles_a_package_on_every_mlmodel_load(emulation, trained_bundle):
    """The broken variant the cache replaces: coremltools' `MLModel(path.mlpackage, function_name=...)`
    compiles the whole package again for each function (as Core ML does): the count the test above rejects."""
    import coremltools as ct

    decoder = trained_bundle / "decoder.mlpackage"
    names = read_package(decoder).function_names
    for name in names:
        ct.models.MLModel(str(decoder), function_name=name)
    assert len(emulation.compiles) == len(names) > 1


def test_tokens_equal_the_interpreter_backend(emulation, trained_bundle):
    """Held-out clips through the whole bundle on both backends (the decoder's one state per window shared
    by its step and prefill functions): the same token ids."""
    from cohere_coreml.inference.transcribe import Transcriber

    from ..fixture_data import heldout_utterances

    coreml = Transcriber(trained_bundle, backend="coreml")
    assert coreml.decoder.backend == "coreml"
    mil = Transcriber(trained_bundle, backend="mil")
    for u in heldout_utterances(3):
        got, want = coreml.transcribe(u["path"], u["language"]), mil.transcribe(u["path"], u["language"])
        _COMPARED[u["file"]] = (got.token_ids, want.token_ids)
        assert got.token_ids == want.token_ids and got.text == want.text, u["file"]
        assert len(want.token_ids[0]) > 3, u["file"]
    loaded = {load["path"] for load in emulation.loads}  # the compiled models the functions came from
    assert sorted(emulation.compiles) == sorted(set(emulation.compiles))  # each package compiled once
    assert len(emulation.compiles) == len(loaded) >= 2 and len(emulation.loads) > len(loaded)


# held-out file -> (Core ML backend's token ids, interpreter backend's) of the same bundle, as the test above
# got them: the slow test below compares the clips it already decoded from these (the same comparison)
_COMPARED: dict[str, tuple[list, list]] = {}


@pytest.mark.slow
def test_tokens_equal_the_interpreter_backend_on_every_heldout_clip(emulation, trained_bundle):
    from cohere_coreml.inference.transcribe import Transcriber

    utterances = json.loads((HELDOUT_DIR / "manifest.json").read_text())["utterances"]
    coreml, mil = Transcriber(trained_bundle, backend="coreml"), Transcriber(trained_bundle, backend="mil")

    def compared(u):
        if u["file"] not in _COMPARED:
            _COMPARED[u["file"]] = (coreml.transcribe(HELDOUT_DIR / u["file"], u["language"]).token_ids,
                                    mil.transcribe(HELDOUT_DIR / u["file"], u["language"]).token_ids)
        return _COMPARED[u["file"]]

    differing = [u["file"] for u in utterances if compared(u)[0] != compared(u)[1]]
    assert len(utterances) == 90 and differing == []


def test_load_model_auto_picks_core_ml_under_the_emulation(emulation, trained_bundle):
    model = load_model(trained_bundle / "frontend.mlpackage")
    assert model.backend == "coreml"


# --------------------------------------------------------------------------------------------
# The macOS version: Core ML only where it runs the packages' programs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def older_macos(emulation, monkeypatch):
    """The emulation playing macOS 14.6, whose Core ML runs no program of the packages' target (macOS 15)."""
    monkeypatch.setattr(sys.modules["coremltools.libcoremlpython"], "MACOS_VERSION", (14, 6))
    monkeypatch.setattr(runtime_module, "_noticed", set())
    return emulation


def test_auto_picks_the_interpreter_on_an_older_macos_and_says_why_once(older_macos, trained_bundle, caplog):
    with caplog.at_level(logging.WARNING, logger="cohere_coreml.runtime"):
        models = [load_model(trained_bundle / f"{name}.mlpackage") for name in ("frontend", "encoder", "decoder")]
    assert [m.backend for m in models] == ["mil"] * 3 and older_macos.compiles == []
    notices = [r.getMessage() for r in caplog.records]
    assert notices == ["Core ML on macOS 14.6 is too old for these packages (macOS 15.0 or later needed): "
                       "using the interpreter"]


def test_auto_picks_core_ml_on_macos_15(emulation, trained_bundle, monkeypatch):
    monkeypatch.setattr(sys.modules["coremltools.libcoremlpython"], "MACOS_VERSION", (15, 0))
    assert load_model(trained_bundle / "frontend.mlpackage").backend == "coreml"


def test_core_ml_asked_for_on_an_older_macos_is_a_one_line_error(older_macos, trained_bundle, capsys):
    from cohere_coreml.runtime import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"^Core ML on macOS 14\.6 is too old for frontend\.mlpackage "
                                                      r"\(macOS 15\.0 or later needed\)$"):
        load_model(trained_bundle / "frontend.mlpackage", backend="coreml")
    clip = HELDOUT_DIR / "en_heldout_00000.flac"
    assert main(["transcribe", str(clip), "--bundle", str(trained_bundle), "--language", "en",
                 "--backend", "coreml"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("cohere-coreml transcribe: error: Core ML on macOS 14.6 is too old for ")
    assert lines[0].endswith(".mlpackage (macOS 15.0 or later needed)")


def test_the_first_macos_of_each_specification():
    assert [macos_for_specification(v) for v in (7, 8, 9, 10)] == [(13, 0), (14, 0), (15, 0), (16, 0)]


# --------------------------------------------------------------------------------------------
# Export gates leave the user's compiled-model cache as it was
# --------------------------------------------------------------------------------------------


def cache_listing(folder: Path) -> list[tuple[str, int, int]]:
    """Every file of `folder` with its size and modification time (ns)."""
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.rglob("*") if p.is_file())


def test_two_exports_leave_the_compiled_cache_as_it_was(emulation, trained_reference, trained_bundle, tmp_path):
    """Two exports in a row through the emulated Core ML backend (the gates run each staging package on Core
    ML's CPU, "auto"): the user's cache (COHERE_COREML_CACHE, with one entry of an earlier transcription in it)
    is exactly as before, nothing of the gates' private caches is left in the bundle folder. The broken
    variant: a staging package loaded as the gates loaded it before (backend "auto", the process's cache)
    adds an entry."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import MODEL_COMPONENTS, export_model
    from cohere_coreml.runtime.compiled_cache import default_cache_dir, entries

    from ..fixture_data import TRAINED_BUCKETS, TRAINED_MAX_NEW_TOKENS, TRAINED_WINDOW_S

    user_cache = default_cache_dir()
    assert str(user_cache).startswith(str(tmp_path))  # the emulation fixture's folder, never the user's
    load_model(trained_bundle / "frontend.mlpackage")  # an earlier transcription's entry
    before = cache_listing(user_cache)
    assert len(entries(user_cache)) == 1
    model, processor = trained_reference
    out = tmp_path / "bundle"
    compiles = len(emulation.compiles)
    for _ in range(2):
        settings = ExportSettings(out_dir=out, precision="fp16", model_id="cohere-tiny-synth",
                                  window_seconds=TRAINED_WINDOW_S, force=True)
        export_model(model, processor, settings, MODEL_COMPONENTS, max_new_tokens=TRAINED_MAX_NEW_TOKENS,
                     buckets=TRAINED_BUCKETS, prefill=True)
    assert cache_listing(user_cache) == before
    assert len(emulation.compiles) - compiles >= 2 * 3  # every gate ran on Core ML: each package compiled
    assert {load["compute_units"] for load in emulation.loads[1:]} == {"cpu_only"}
    reports = {c: json.loads((out / f"{c}.parity.json").read_text()) for c in ("frontend", "encoder", "decoder")}
    runs_on = {c: {r.get("runs_on") for r in [rep, *rep.get("functions", {}).values()] if r.get("runs_on")}
               for c, rep in reports.items()}
    assert runs_on == {c: {"Core ML cpu_only"} for c in reports}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no private cache left
    # the broken variant: the staging package through the shared cache leaves an entry behind
    staging = out / ".encoder.tmp-1.mlpackage"
    shutil.copytree(out / "encoder.mlpackage", staging)
    load_model(staging)
    assert len(entries(user_cache)) == 2


# --------------------------------------------------------------------------------------------
# The cache's naming rule and installation (no emulation needed)
# --------------------------------------------------------------------------------------------


def test_names_follow_the_manifest_checksums_else_the_file_table(trained_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(trained_bundle, bundle)
    enc = bundle / "encoder.mlpackage"
    files = {}
    for root, _, names in os.walk(enc):
        for n in names:
            rel = f"encoder.mlpackage/{os.path.relpath(os.path.join(root, n), enc)}"
            files[rel] = {"sha256": f"{len(files):064x}", "size": len(files)}
    manifest = {"checksums": {"algorithm": "sha256", "files": files}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    cache = CompiledCache(tmp_path / "c")
    name = cache.location(enc).name
    assert name == f"encoder-{package_digest(enc)[:24]}.mlmodelc"
    os.utime(enc / "Manifest.json", (1, 1))  # a touched file, same checksums: same name
    assert cache.location(enc).name == name
    files[next(iter(files))]["sha256"] = "f" * 64  # other content: another name
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert cache.location(enc).name != name
    (bundle / "manifest.json").unlink()  # no manifest: the file table, which a touch changes
    table = cache.location(enc).name
    os.utime(enc / "Manifest.json", (2, 2))
    assert cache.location(enc).name != table
    assert cache.location(bundle / "decoder.mlpackage").name.startswith("decoder-")


def test_a_failed_or_interrupted_compile_leaves_nothing_complete(trained_bundle, tmp_path):
    cache = CompiledCache(tmp_path / "c")
    pkg = trained_bundle / "frontend.mlpackage"

    def failing(path):
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        cache.compiled(pkg, failing)
    assert not cache.location(pkg).exists() and cache.compiles == 0
    leftover = cache.location(pkg)  # a killed process's half-moved folder, without the marker
    leftover.mkdir(parents=True)
    (leftover / "partial").write_text("x")

    def compile_copy(path):
        out = tmp_path / "tmp" / "frontend.mlmodelc"
        shutil.copytree(path, out / "model.mlpackage")
        return str(out)

    got = cache.compiled(pkg, compile_copy)
    assert got == leftover and (got / COMPLETE_MARKER).is_file() and not (got / "partial").exists()
    assert cache.compiles == 1 and cache.compiled(pkg, failing) == got and cache.hits == 1
    assert [p.name for p in cache.folder.iterdir()] == [got.name]  # no staging folder left behind
