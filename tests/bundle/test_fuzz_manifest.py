"""Manifest fuzzing through the Python loader (`Bundle.load`), on a copy of the exported trained bundle.

Every field of a real manifest is mutated (deleted, wrong type, negative, huge, NaN/inf, odd strings,
renamed function names, containers swapped for lists ...; 1-3 mutations per case, or the JSON text
corrupted). Property: either a `BundleError` whose message names the manifest and a mutated section,
or a bundle whose every value the transcription loop reads (`consumed`) equals the original's: a
mutation the loader accepts changed nothing the loop uses. Never another exception type.
Settings: tests/fuzz.py (COHERE_FUZZ=long for the long run); results: docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cohere_coreml_dev.fuzz import (
    ODD_VALUES,
    OPERATORS,
    apply,
    changed_keys,
    corpus,
    corrupt_text,
    field_mutations,
    named_field,
    paired_mutations,
    paths,
    targeted,
    verdicts,
)

from ..fuzz import Outcomes, fuzz_settings


@pytest.fixture(scope="module")
def fuzz_bundle(tmp_path_factory, trained_bundle):
    """(copy of the trained bundle, its manifest text, what the loop reads from it)."""
    from cohere_coreml.bundle.load import Bundle

    out = tmp_path_factory.mktemp("fuzz") / "bundle"
    shutil.copytree(trained_bundle, out)
    text = (out / "manifest.json").read_text()
    return out, text, consumed(Bundle.load(out))


def consumed(bundle) -> dict:
    """Every manifest value `Transcriber`, `verify` and the CLI read (after Bundle.load), as plain data."""
    from cohere_coreml.model.audio import FrontEndConfig

    m = bundle.manifest
    dec, enc, front = m["decoder"], m["encoder"], m.get("frontend")
    return {
        "paths": {k: str(v) for k, v in bundle.paths.items() if k != "tokenizer"},
        "capacity": bundle.capacity, "window_frames": bundle.window_frames, "eos": sorted(bundle.eos_ids),
        "vad_chunks": bundle.vad_chunks,
        "prompts": {lang: (bundle.prompt(lang, True), bundle.prompt(lang, False)) for lang in bundle.languages},
        "front_end": FrontEndConfig.from_dict({**m["audio"], "dither": 0.0}),
        "encoder": {fn: int(v["frames"]) for fn, v in enc["functions"].items()}, "memory_len": enc["memory_len"],
        "prefill": (dec["functions"].get("prefill"), dec.get("prefill_length")), "step": dec["functions"]["step"],
        "max_new_tokens": dec["max_new_tokens"], "precision": m.get("precision"),
        "frontend": None if front is None else (front.get("compute_units", "cpu_and_gpu"),
                                                {fn: (v["samples"], v["frames"]) for fn, v in front["functions"].items()}),
        "no_space": m["generation"]["no_space_languages"],
    }


def check_case(bundle_dir, original, text: str, sections: set[str], outcomes: Outcomes) -> None:
    """Write `text` as the manifest, load, and check the property."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle

    (bundle_dir / "manifest.json").write_text(text)
    try:
        loaded = Bundle.load(bundle_dir)
    except BundleError as err:
        message = str(err)
        assert "manifest.json" in message or any(s in message for s in ("vocab.json", "processor_config", ".mlpackage")), \
            f"error names no file: {message}"
        assert not sections or "not readable JSON" in message or "not a cohere-coreml-bundle" in message \
            or any(s in message for s in sections), f"error names none of the mutated fields {sorted(sections)}: {message}"
        outcomes["named_error"] += 1
        return
    # any other exception type escapes and fails the test (with the case, shrunk, in the report)
    assert consumed(loaded) == original, "the loader accepted a manifest whose values differ from the packages'"
    outcomes["loaded_unchanged"] += 1


OUTCOMES = Outcomes("manifest_python")


@fuzz_settings(default=60, long=2500)
@given(data=st.data())
def test_mutated_manifest_loads_unchanged_or_names_the_field(fuzz_bundle, data):
    bundle_dir, text, original = fuzz_bundle
    manifest = json.loads(text)
    try:
        if data.draw(st.integers(0, 7), label="corrupt text?") == 7:
            rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
            check_case(bundle_dir, original, corrupt_text(text, rng), set(), OUTCOMES)
            return
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            path = data.draw(st.sampled_from(paths(manifest)), label="path")
            operator = data.draw(st.sampled_from(OPERATORS), label="operator")
            value = data.draw(st.sampled_from(ODD_VALUES), label="value")
            manifest = apply(manifest, path, operator, value)
        sections = changed_keys(json.loads(text), manifest)  # the error must name one of them
        check_case(bundle_dir, original, json.dumps(manifest, allow_nan=True), sections, OUTCOMES)
    finally:
        (bundle_dir / "manifest.json").write_text(text)
        OUTCOMES.write()


def test_the_corpus_of_the_swift_test_through_the_python_loader(fuzz_bundle):
    """The seeded corpus tools/data/make_fuzz_manifests.py writes for the Swift test (same generator), here."""
    bundle_dir, text, original = fuzz_bundle
    outcomes = Outcomes("manifest_python_corpus")
    try:
        for _, mutated in corpus(json.loads(text), count=40, seed=22):
            try:
                sections = changed_keys(json.loads(text), json.loads(mutated))
            except ValueError:  # a corrupted text
                sections = set()
            check_case(bundle_dir, original, mutated, sections, outcomes)
    finally:
        (bundle_dir / "manifest.json").write_text(text)
        outcomes.write()
    assert outcomes["named_error"] >= 30  # most mutations break something the loader must refuse


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["decoder"].update(capacity=m["decoder"]["capacity"] + 32), "decoder.capacity"),
    (lambda m: m["decoder"].update(capacity="64"), "decoder.capacity"),
    (lambda m: m["languages"]["en"]["punctuation"].__setitem__(4, m["languages"]["de"]["punctuation"][4]),
     "languages.en.punctuation"),
    (lambda m: m["languages"]["en"].pop("no_punctuation"), "languages.en.no_punctuation"),
    (lambda m: m["encoder"]["functions"].pop("window_2s") and m["frontend"]["functions"].pop("window_2s"),
     "encoder functions"),
    (lambda m: m["decoder"]["io"]["states"]["self_k"].update(shape=[1, 2, 3, 4]), "decoder.io.states.self_k"),
    (lambda m: m["decoder"]["functions"].update(prefill="prefill2"), "decoder"),
    (lambda m: m["audio"].update(hop_length=161), "audio.hop_length"),
    (lambda m: m["audio"].update(preemphasis=float("nan")), "audio.preemphasis"),
    (lambda m: m["tokens"].update(eos_token_ids=[5]), "tokens.eos_token_id"),
    (lambda m: m.update(decoder=[m["decoder"]]), "'decoder'"),
    (lambda m: m["checksums"]["files"].update({"vocab.json": ["size", 1]}), "checksums.files.vocab.json"),
    (lambda m: m.update(format_version="1"), "format_version"),
])
def test_fields_the_loop_reads_are_checked_against_the_packages(fuzz_bundle, edit, field):
    """Hand-picked cases of the fuzzed classes, each a silent wrong value or a raw exception before the
    checks: a larger capacity than the cache, a prompt with another language's token, a dropped length
    bucket, a state shape, a renamed function, front-end settings, an eos id, a section as a list."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle

    bundle_dir, text, _ = fuzz_bundle
    manifest = json.loads(text)
    edit(manifest)
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest, allow_nan=True))
    try:
        with pytest.raises(BundleError) as info:
            Bundle.load(bundle_dir)
    finally:
        (bundle_dir / "manifest.json").write_text(text)
    assert field in str(info.value) and "manifest.json" in str(info.value), str(info.value)


def test_targeted_mutates_every_path_by_every_value_class(fuzz_bundle):
    """The targeted part of the Swift corpus: each path of the manifest, each TARGETED class, no no-ops."""
    _, text, _ = fuzz_bundle
    manifest = json.loads(text)
    files = targeted(manifest)
    assert len({name for name, _ in files}) == len(files)
    every = sum(len(field_mutations(manifest, p)) for p in paths(manifest)) + len(paired_mutations(manifest))
    assert every * 0.9 < len(files) <= every  # only no-ops (a value replaced by itself ...) are left out
    assert all(json.loads(mutated) != manifest for _, mutated in files)
    # a field the loop reads, by every class: deleted, null, negative, zero, huge, NaN, fractional, a string
    def capacity_only(mutated: dict) -> list[str]:
        """[decoder.capacity of `mutated`, shown] when nothing else differs from the manifest, else []."""
        dec = mutated.get("decoder")
        if not isinstance(dec, dict):
            return []
        rest = {**mutated, "decoder": {k: v for k, v in dec.items() if k != "capacity"}}
        if rest != {**manifest, "decoder": {k: v for k, v in manifest["decoder"].items() if k != "capacity"}}:
            return []
        return [repr(dec["capacity"]) if "capacity" in dec else "deleted"]

    shown = {c for _, t in files for c in capacity_only(json.loads(t))}
    assert shown == {"deleted", "None", "-1", "0", str(2**40), "nan", "1.5", "'x'", "[]",
                     str(manifest["decoder"]["capacity"] + 1)}

@pytest.mark.parametrize("message, field", [
    ("m.json: field 'decoder.capacity' is 289 but ...", "decoder.capacity"),
    ("m.json: files.vocab '../v.json' is refused: not normalised; bundle paths ...", "files.vocab"),
    ("m.json describes no tokenizer: export it (`cohere-coreml export`)", "files.tokenizer"),
    ("m.json is not readable JSON: Expecting value: line 1 column 1 (char 0)", None),
    ("bundle is missing vocab2.json (looked in /b)", None),
    ("/b: 1 file(s) do not match manifest.json:\n  vocab.json: size 1 != 2 in the manifest", None),
])
def test_named_field_reads_the_field_a_loader_error_names(message, field):
    assert named_field(message) == field


def test_verdicts_are_the_python_loaders_with_the_stage(fuzz_bundle):
    """Accepted; refused before the packages (naming the field); refused only by the package io; unreadable."""
    bundle_dir, text, _ = fuzz_bundle
    manifest = json.loads(text)
    capacity = apply(manifest, ("decoder", "capacity"), "replace", 1)  # below its range [2, ...]
    step = apply(manifest, ("decoder", "functions", "step"), "replace", "x")
    judged = verdicts(bundle_dir, [("same", text), ("capacity", json.dumps(capacity)), ("step", json.dumps(step)),
                                   ("cut", text[:100])])
    assert judged["same"] == {"accepted": True, "stage": None, "field": None, "error": None}
    assert (judged["capacity"]["accepted"], judged["capacity"]["stage"], judged["capacity"]["field"]) == \
        (False, "manifest", "decoder.capacity")
    assert (judged["step"]["accepted"], judged["step"]["stage"], judged["step"]["field"]) == \
        (False, "packages", "decoder.functions.step")
    assert (judged["cut"]["accepted"], judged["cut"]["field"]) == (False, None)
    assert "not readable JSON" in judged["cut"]["error"]
    assert (bundle_dir / "manifest.json").read_text() == text  # the bundle itself is never written


@pytest.mark.parametrize("extra", [5, [], {"a": 1}, "x"])
def test_unknown_key_in_a_language_entry_is_ignored_as_elsewhere(fuzz_bundle, tmp_path, extra):
    """Found by the Swift port (issue 22): an extra key in `languages.<lang>` made `check_manifest`
    raise TypeError / IndexError / KeyError (the prompts' first ids were read from every value).
    Unknown keys are ignored, as Swift does and as everywhere else in the manifest; a broken prompt
    next to it is still refused by name."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle

    bundle_dir, text, original = fuzz_bundle
    manifest = json.loads(text)
    manifest["languages"]["en"]["extra"] = extra
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    try:
        assert consumed(Bundle.load(bundle_dir)) == original
        manifest["languages"]["en"]["punctuation"] = []
        (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(BundleError, match=r"languages\.en\.punctuation"):
            Bundle.load(bundle_dir)
    finally:
        (bundle_dir / "manifest.json").write_text(text)
