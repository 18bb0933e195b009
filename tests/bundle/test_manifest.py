"""The bundle's own contract (`cohere_coreml.bundle`: manifest, checks, load): `write_bundle` then `Bundle.load`
round-trips every value the loop reads from the checkpoint and the packages, `Bundle.load` over
several folders (first folder wins), the package readers, `checkpoint_eos_ids`, and refusals that
name the field or file. (Field-by-field manifest fuzzing: test_fuzz_manifest.py; checksums and
unsafe paths: test_integrity.py; split bundles with a missing package: test_verify.py.)"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from cohere_coreml.bundle.format import (
    DECODER_FILE,
    ENCODER_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    FRONTEND_FILE,
    VAD_FILE,
    VOCAB_FILE,
    BundleError,
)
from cohere_coreml.bundle.load import Bundle
from cohere_coreml.bundle.manifest import build_manifest, checkpoint_eos_ids, refresh_manifest, write_bundle
from cohere_coreml.bundle.packages import decoder_package_info, encoder_package_info, frontend_package_info, package_io
from cohere_coreml.config import (
    BIND_FUNCTION,
    DECODER_BATCH_DEFAULT,
    MEMORY_NAMES,
    PREFILL_FUNCTION,
    STEP_BATCH_FUNCTION,
    STEP_FUNCTION,
)
from cohere_coreml.export.pipeline import ModelInfo
from cohere_coreml.model.audio import FrontEndConfig
from cohere_coreml.model.tokens import EOS_TOKEN, LANGUAGES, PAD_TOKEN, UnknownLanguageError, prompt_ids
from cohere_coreml.storage.integrity import MANIFEST_NAME

from ..fixture_data import TRAINED_MAX_NEW_TOKENS, TRAINED_WINDOW_S

# --------------------------------------------------------------------------------------------
# checkpoint_eos_ids
# --------------------------------------------------------------------------------------------


def _model(gen_eos, config_eos):
    gen = None if gen_eos == "absent" else SimpleNamespace(eos_token_id=gen_eos)
    return SimpleNamespace(generation_config=gen, config=SimpleNamespace(eos_token_id=config_eos))


@pytest.mark.parametrize("gen_eos, config_eos, want", [
    (3, 7, [3]),  # the generation config wins over the model config
    ([3, 4], 7, [3, 4]),
    ((5,), None, [5]),
    (None, 7, [7]),  # falls back to the model config
    ("absent", 7, [7]),  # a model without a generation config
    (None, [8, 9], [8, 9]),
])
def test_checkpoint_eos_ids(gen_eos, config_eos, want):
    got = checkpoint_eos_ids(_model(gen_eos, config_eos))
    assert got == want and all(type(i) is int for i in got)


def test_checkpoint_without_eos_is_refused():
    with pytest.raises(BundleError, match="defines no eos_token_id"):
        checkpoint_eos_ids(_model(None, None))
    with pytest.raises(BundleError, match="defines no eos_token_id"):
        checkpoint_eos_ids(_model("absent", None))
    with pytest.raises(BundleError, match="empty list"):  # was [] here and an IndexError in build_manifest
        checkpoint_eos_ids(_model([], None))


# --------------------------------------------------------------------------------------------
# Bundle.load refusals on tiny folders (before any package is read)
# --------------------------------------------------------------------------------------------

FILES = {"encoder": ENCODER_FILE, "decoder": DECODER_FILE, "vocab": VOCAB_FILE, "tokenizer": "tokenizer.json",
         "tokenizer_config": "tokenizer_config.json", "processor_config": "processor_config.json"}


def tiny_folder(path: Path, manifest, files: dict | None = None) -> Path:
    """A folder with placeholder files for FILES (empty package folders, small JSON files) and `manifest`
    (a dict, or text written as is)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in (files or FILES).values():
        if name.endswith(".mlpackage"):
            (path / name).mkdir(exist_ok=True)
        else:
            (path / name).write_text(json.dumps({"0": "<unk>"} if name == VOCAB_FILE else {"sampling_rate": 16000}))
    if manifest is not None:
        (path / MANIFEST_NAME).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return path


def head(**changes) -> dict:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "files": dict(FILES), **changes}


@pytest.mark.parametrize("manifest, message", [
    ("{not json", r"manifest.json is not readable JSON"),
    ("[1, 2]", r"is not a cohere-coreml-bundle manifest \(not a JSON object\)"),
    (head(format="some-other-bundle"), r"manifest.json is not a cohere-coreml-bundle manifest"),
    (head(format_version=True), r"field 'format_version' must be a positive integer, got true"),
    (head(format_version="2"), r"field 'format_version' must be a positive integer, got \"2\""),
    (head(format_version=0), r"field 'format_version' must be a positive integer, got 0"),
    (head(files=["encoder.mlpackage"]), r"field 'files' must be an object"),
    (head(files={**FILES, "vocab": "vocab.txt"}), r"field 'files.vocab' is 'vocab.txt'; it names a .json file"),
    (head(files={**FILES, "encoder": "encoder.bin"}), r"field 'files.encoder' is 'encoder.bin'; it names a .mlpackage"),
    (head(files={k: v for k, v in FILES.items() if k != "decoder"}), r"describes no decoder"),
    (head(files={**FILES, "tokenizer": None}), r"describes no tokenizer"),
    (head(files={**FILES, "encoder": "other.mlpackage"}), r"bundle is missing other.mlpackage \(looked in "),
    (head(files={**FILES, "frontend": FRONTEND_FILE}), r"bundle is missing frontend.mlpackage"),  # optional, but named
    (head(), r"field 'audio' is missing"),  # past the files: check_manifest names the first field it lacks
])
def test_load_refusals_name_the_field(tmp_path, manifest, message):
    folder = tiny_folder(tmp_path / "b", manifest)
    with pytest.raises(BundleError, match=message) as info:
        Bundle.load(folder)
    assert str(folder) in str(info.value)


def test_load_refusals_of_folders_and_side_files(tmp_path):
    with pytest.raises(BundleError, match="no bundle folder given"):
        Bundle.load([])
    with pytest.raises(BundleError, match=r"bundle folder .*nowhere does not exist"):
        Bundle.load([tiny_folder(tmp_path / "ok", head()), tmp_path / "nowhere"])
    empty = tiny_folder(tmp_path / "empty", None)
    with pytest.raises(BundleError, match=r"no manifest.json in .*empty: export the bundle"):
        Bundle.load(empty)
    folder = tiny_folder(tmp_path / "side", head())
    (folder / VOCAB_FILE).write_text(json.dumps(["<unk>"]))
    with pytest.raises(BundleError, match=r"vocab.json \(files.vocab\) is not an \{id: piece\} table"):
        Bundle.load(folder)
    (folder / VOCAB_FILE).write_text(json.dumps({"0": 0}))  # ids to non-strings
    with pytest.raises(BundleError, match=r"\(files.vocab\) is not an \{id: piece\} table"):
        Bundle.load(folder)
    (folder / VOCAB_FILE).write_text(json.dumps({"0": "<unk>"}))
    (folder / "processor_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(BundleError, match=r"processor_config.json \(files.processor_config\) is not readable JSON"):
        Bundle.load(folder)


def test_refresh_manifest_needs_a_manifest(tmp_path):
    with pytest.raises(BundleError, match="has no manifest.json: export the bundle first"):
        refresh_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{oops")
    with pytest.raises(BundleError, match="manifest.json is not readable JSON"):
        refresh_manifest(tmp_path)


# --------------------------------------------------------------------------------------------
# write_bundle -> Bundle.load on the trained model's bundle
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(trained_bundle, trained_reference, tmp_path_factory):
    """A copy of the session bundle whose manifest, vocab and tokenizer files `write_bundle` wrote again
    (from the packages on disk and the checkpoint), and the bundle as exported."""
    model, processor = trained_reference
    out = tmp_path_factory.mktemp("bundle") / "rewritten"
    shutil.copytree(trained_bundle, out, ignore=shutil.ignore_patterns(MANIFEST_NAME, VOCAB_FILE, "tokenizer*.json",
                                                                       "processor_config.json"))
    assert not (out / MANIFEST_NAME).exists() and not (out / VOCAB_FILE).exists()
    path = write_bundle(out, model, processor)
    assert path == out / MANIFEST_NAME
    return out


def test_write_then_load_round_trips_what_the_loop_reads(written, trained_bundle, trained_reference):
    """Every value the transcription loop reads after Bundle.load comes from the checkpoint and the packages."""
    model, processor = trained_reference
    tokenizer = processor.tokenizer
    bundle = Bundle.load(written)
    m = bundle.manifest
    assert bundle.dirs == [written]
    assert bundle.paths == {"encoder": written / ENCODER_FILE, "decoder": written / DECODER_FILE,
                            "frontend": written / FRONTEND_FILE, "vad": written / VAD_FILE, "vocab": written / VOCAB_FILE,
                            "tokenizer": written / "tokenizer.json", "tokenizer_dir": written,
                            "processor_config": written / "processor_config.json"}
    assert bundle.eos_ids == set(checkpoint_eos_ids(model))
    assert json.loads((written / VOCAB_FILE).read_text())[str(m["tokens"]["eos_token_id"])] == EOS_TOKEN
    assert bundle.languages == sorted(LANGUAGES)
    for lang in LANGUAGES:
        assert bundle.prompt(lang) == prompt_ids(tokenizer, lang, punctuation=True)
        assert bundle.prompt(lang, punctuation=False) == prompt_ids(tokenizer, lang, punctuation=False)
    prompt_len = len(bundle.prompt("en"))
    # capacity: the prompt plus the export's max_new_tokens, rounded up to 32
    assert bundle.capacity == -(-(prompt_len + TRAINED_MAX_NEW_TOKENS) // 32) * 32
    assert m["decoder"]["max_new_tokens"] == bundle.capacity - prompt_len + 1 >= TRAINED_MAX_NEW_TOKENS
    front_end = FrontEndConfig.from_processor(processor, dither=0.0).to_dict()
    assert bundle.window_frames == round(TRAINED_WINDOW_S * front_end["sampling_rate"] / front_end["hop_length"])
    assert m["audio"] == {**front_end, "window_frames": bundle.window_frames}
    assert m["tokens"]["vocab_size"] == model.config.vocab_size == m["decoder"]["vocab_size"]
    assert m["decoder"]["memory_shape"][2] == m["encoder"]["memory_len"]
    assert m["encoder"]["num_mel_bins"] == model.config.encoder_config.num_mel_bins == front_end["n_mels"]
    # the packages' sections are what the readers say of the packages on disk
    assert {k: m["encoder"][k] for k in ("window_frames", "encoder_frames", "memory_len", "length_masks", "num_layers",
                                         "parts", "functions", "io")} == {
        k: v for k, v in encoder_package_info(written / ENCODER_FILE).items() if k != "precision"}
    fe = frontend_package_info(written / FRONTEND_FILE)
    assert m["frontend"] == {k: fe[k] for k in ("compute_units", "precision", "functions", "io")}
    # the rewritten manifest is the exported one (same packages, same checkpoint) but for its time stamp
    exported = json.loads((trained_bundle / MANIFEST_NAME).read_text())
    assert {k: v for k, v in m.items() if k != "created_utc"} == {k: v for k, v in exported.items() if k != "created_utc"}
    assert (written / VOCAB_FILE).read_bytes() == (trained_bundle / VOCAB_FILE).read_bytes()


def test_rewrite_keeps_unchanged_files_and_restores_changed_ones(written, trained_reference):
    """A rerun on a complete bundle replaces no file whose content is unchanged; a file that differs
    from the checkpoint's is written again from the checkpoint."""
    model, processor = trained_reference
    side = ["tokenizer.json", "tokenizer_config.json", "processor_config.json", VOCAB_FILE]
    before = {name: (written / name).stat().st_mtime_ns for name in side}
    vocab = (written / VOCAB_FILE).read_bytes()
    write_bundle(written, model, processor)
    assert {name: (written / name).stat().st_mtime_ns for name in side} == before
    (written / VOCAB_FILE).write_text(json.dumps({"0": "tampered"}))
    write_bundle(written, model, processor)
    assert (written / VOCAB_FILE).read_bytes() == vocab
    Bundle.load(written)  # and the manifest describes the restored file (checksums, vocab checks)


def test_manifest_eos_comes_from_the_checkpoint(written, trained_reference, tmp_path):
    """Broken variant of the round trip: a checkpoint whose generation config names another eos id gives a
    manifest with that id, which the loader refuses (vocab.json reads it as another piece)."""
    model, processor = trained_reference
    gen = copy.deepcopy(model.generation_config)
    other = int(model.config.pad_token_id)
    assert other not in checkpoint_eos_ids(model)
    gen.eos_token_id = other
    out = tmp_path / "b"
    shutil.copytree(written, out)
    write_bundle(out, ModelInfo(config=model.config, generation_config=gen, source=model.source), processor)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["tokens"]["eos_token_ids"] == [other] and manifest["tokens"]["eos_token_id"] == other
    with pytest.raises(BundleError, match=rf"field 'tokens.eos_token_id' is {other}, which files.vocab reads as "
                                          rf"'{re.escape(PAD_TOKEN)}', not '{re.escape(EOS_TOKEN)}'"):
        Bundle.load(out)


def test_prompt_of_an_unknown_language(written):
    bundle = Bundle.load(written, check_package_io=False)
    with pytest.raises(UnknownLanguageError):
        bundle.prompt("xx")
    assert bundle.prompt("de") != bundle.prompt("en") and bundle.prompt("en") != bundle.prompt("en", False)


# --------------------------------------------------------------------------------------------
# Several folders: the first folder that has a file wins
# --------------------------------------------------------------------------------------------


def test_first_folder_wins(written, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(written, first)
    shutil.copytree(written, second)
    manifest = json.loads((second / MANIFEST_NAME).read_text())
    manifest["model_id"] = "second-folder"  # a field the loader reads but does not check against the files
    (second / MANIFEST_NAME).write_text(json.dumps(manifest))

    def folders(bundle: Bundle) -> set[Path]:
        return {p.parent for k, p in bundle.paths.items() if k != "tokenizer_dir"}

    a = Bundle.load([first, second])
    assert a.manifest["model_id"] != "second-folder" and a.dirs == [first, second]
    assert folders(a) == {first} and "frontend" in a.paths
    b = Bundle.load([second, first])  # the other order: the other folder's manifest and files
    assert b.manifest["model_id"] == "second-folder" and folders(b) == {second}

    # a file the first folder lacks comes from the next one; the manifest from the first that has one
    (first / VOCAB_FILE).unlink()
    (first / MANIFEST_NAME).unlink()
    c = Bundle.load([first, second])
    assert c.manifest["model_id"] == "second-folder"
    assert c.paths["vocab"] == second / VOCAB_FILE and c.paths["encoder"] == first / ENCODER_FILE
    assert c.paths["tokenizer_dir"] == first

    # a file in the first folder of another size than the manifest says is refused, not skipped over
    (first / VOCAB_FILE).write_text("{}")
    with pytest.raises(BundleError, match="vocab.json: size"):
        Bundle.load([first, second])


# --------------------------------------------------------------------------------------------
# Package readers
# --------------------------------------------------------------------------------------------


def test_decoder_package_info_reads_the_package(written):
    from cohere_coreml.runtime import read_package

    bundle = Bundle.load(written)
    dec, enc = bundle.manifest["decoder"], bundle.manifest["encoder"]
    info = decoder_package_info(written / DECODER_FILE)
    # the export's default decoder: host-state (no bind function; the host writes the memory)
    assert info["state_writes"] == dec["state_writes"] == "host"
    # and its batched step (export --decoder-batch, default DECODER_BATCH_DEFAULT), listed with its B rows
    assert info["functions"] == {"step": STEP_FUNCTION, "bind": None, "prefill": PREFILL_FUNCTION,
                                 "step_batch": STEP_BATCH_FUNCTION}
    assert info["batch"] == dec["batch"] and info["batch"]["size"] == DECODER_BATCH_DEFAULT
    assert info["batch"]["io"] == package_io(written / DECODER_FILE, STEP_BATCH_FUNCTION)
    assert info["bind_inputs"] is None and info["bind_io"] is None
    assert dec["memory_states"] == {name: name for name in MEMORY_NAMES}
    assert dec["row_outputs"] == {"self_k": "new_k", "self_v": "new_v"} and dec["cache_mask_input"] == "cache_mask"
    assert BIND_FUNCTION not in read_package(written / DECODER_FILE).function_names
    assert info["shapes"]["capacity"] == bundle.capacity and info["shapes"]["memory_len"] == enc["memory_len"]
    assert info["prefill_length"] == len(bundle.prompt("en"))  # the whole prompt in one call
    assert info["io"] == package_io(written / DECODER_FILE, STEP_FUNCTION)
    assert info["io"]["inputs"]["input_ids"]["shape"] == [1, 1]
    assert info["prefill_io"]["inputs"]["input_ids"]["shape"] == [1, info["prefill_length"]]
    s = info["shapes"]
    assert info["io"]["outputs"]["new_k"]["shape"] == [s["num_layers"], s["num_kv_heads"], 1, s["head_dim"]]
    assert info["precision"] == bundle.manifest["precision"] == "fp16"
    # the manifest's decoder section is this, as written
    assert {k: dec[k] for k in ("functions", "bind_inputs", "prefill_length", "io", "bind_io", "prefill_io")} == {
        k: info[k] for k in ("functions", "bind_inputs", "prefill_length", "io", "bind_io", "prefill_io")}


def test_package_readers_refuse_the_wrong_package(written):
    with pytest.raises(BundleError, match=r"encoder.mlpackage lacks the decoder metadata of cohere-coreml .*re-export"):
        decoder_package_info(written / ENCODER_FILE)
    with pytest.raises(BundleError, match=r"decoder.mlpackage lacks the encoder metadata of cohere-coreml"):
        encoder_package_info(written / DECODER_FILE)
    with pytest.raises(BundleError, match=r"decoder.mlpackage lacks the front-end metadata"):
        frontend_package_info(written / DECODER_FILE)


def test_build_manifest_refuses_packages_that_do_not_fit(written, trained_reference):
    """The package sections must agree: one precision, the decoder's memory = the encoder's, the front
    end's frames = the encoder's window. Control: the infos read from the bundle build fine."""
    model, processor = trained_reference
    front_end = FrontEndConfig.from_processor(processor, dither=0.0).to_dict()
    enc = encoder_package_info(written / ENCODER_FILE)
    dec = decoder_package_info(written / DECODER_FILE)
    fe = frontend_package_info(written / FRONTEND_FILE)

    def build(encoder=enc, decoder=dec, frontend=fe):
        return build_manifest(model, processor.tokenizer, front_end, encoder, decoder, frontend=frontend)

    manifest = build()
    assert manifest["precision"] == "fp16" and set(manifest["files"]) >= {"encoder", "decoder", "frontend"}
    only_encoder = build(decoder=None)
    assert "decoder" not in only_encoder and "decoder" not in only_encoder["files"]
    # (the length-bucketed encoder records no precision of its own: the decoder's is the bundle's)
    assert enc["precision"] is None and dec["precision"] == "fp16"
    assert build(encoder={**enc, "precision": "fp16"})["precision"] == "fp16"
    with pytest.raises(BundleError, match=r"different precisions \['fp16', 'fp32'\]"):
        build(encoder={**enc, "precision": "fp32"})
    other_memory = {**dec, "shapes": {**dec["shapes"], "memory_len": enc["memory_len"] + 8}}
    with pytest.raises(BundleError, match=rf"reads a memory of {enc['memory_len'] + 8} frames .* gives {enc['memory_len']}"):
        build(decoder=other_memory)
    other_window = {**fe, "functions": {**fe["functions"], "main": {**fe["functions"]["main"],
                                                                     "frames": enc["window_frames"] * 2}}}
    with pytest.raises(BundleError, match=r"frontend.mlpackage gives .* mel frames but encoder.mlpackage reads"):
        build(frontend=other_window)


# --------------------------------------------------------------------------------------------
# An encoder in parts: encoder.parts and its files
# --------------------------------------------------------------------------------------------


def _edited_parts_bundle(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    edit(manifest)
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dst


def test_parts_bundle_lists_its_programs(trained_parts_bundle):
    bundle = Bundle.load(trained_parts_bundle)
    m = bundle.manifest
    assert m["files"]["encoder_part2"] == "encoder_part2.mlpackage"
    assert bundle.paths["encoder_part2"] == trained_parts_bundle / "encoder_part2.mlpackage"
    assert [(p["file"], p["layers"]) for p in m["encoder"]["parts"]] == [("encoder", [0, 2]), ("encoder_part2", [2, 4])]
    assert m["encoder"]["num_layers"] == 4
    # the chain's io: the first part's inputs, the last part's outputs
    chain = m["encoder"]["functions"]["main"]["io"]
    assert chain["inputs"] == m["encoder"]["parts"][0]["functions"]["main"]["io"]["inputs"]
    assert chain["outputs"] == m["encoder"]["parts"][1]["functions"]["main"]["io"]["outputs"]
    assert "input_features" in chain["inputs"] and "cross_k" in chain["outputs"]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["encoder"]["parts"][1].update(layers=[3, 4]), r"encoder\.parts\[1\]\.layers"),
    (lambda m: m["encoder"]["parts"][1].update(layers=[2, 3]), r"'encoder\.parts' .*end at layer 3"),
    (lambda m: m["encoder"].update(num_layers=5), r"encoder\.parts\[1\]\.layers|end at layer 4"),
    (lambda m: m["encoder"]["parts"].pop(), r"end at layer 2"),
    (lambda m: m["files"].update(encoder_part3="encoder_part2.mlpackage"), r"'files' names \['encoder_part3'\]"),
    (lambda m: m["encoder"]["parts"][1].update(file="encoder_part3"), r"encoder\.parts\[1\]\.file"),
    (lambda m: m["files"].update(encoder_part2="encoder_part2.json"), r"files\.encoder_part2.*\.mlpackage"),
    (lambda m: m["encoder"]["parts"][1]["functions"].pop("window_2s"), r"encoder\.parts\[1\]\.functions"),
    (lambda m: m["encoder"]["parts"][1]["functions"]["main"]["io"]["inputs"]["hidden_states"].update(shape=[1, 3, 144]),
     r"encoder\.parts\[1\]\.functions\.main\.io\.inputs"),
    (lambda m: m["encoder"]["parts"][0]["functions"]["main"]["io"]["outputs"].update(
        cross_k={"shape": [1], "dtype": "float16"}), r"encoder\.parts\[0\]\.functions\.main\.io\.outputs"),
])
def test_inconsistent_parts_are_refused(trained_parts_bundle, tmp_path, edit, message):
    bundle = _edited_parts_bundle(trained_parts_bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=message):
        Bundle.load(bundle)


def test_a_missing_part_package_is_refused(trained_parts_bundle, tmp_path):
    bundle = _edited_parts_bundle(trained_parts_bundle, tmp_path / "b", lambda m: None)
    shutil.rmtree(bundle / "encoder_part2.mlpackage")
    with pytest.raises(BundleError, match="encoder_part2.mlpackage"):
        Bundle.load(bundle)


def test_alignment_block_takes_k_tokens_a_call(written):
    """decoder.alignment (word timings): the align function takes the host-state extend's inputs, K = `length`
    tokens a call (the extend length, not the cache capacity) over the decoded cache; check_manifest refuses a
    length that disagrees with its io, one past the cache, and an io without position or cache_mask."""
    from cohere_coreml.bundle.checks import check_manifest
    from cohere_coreml.config import EXTEND_LENGTH

    manifest = json.loads((written / MANIFEST_NAME).read_text())
    dec = manifest["decoder"]
    block, capacity = dec["alignment"], dec["capacity"]
    assert block["length"] == EXTEND_LENGTH < capacity
    assert block["io"]["inputs"]["input_ids"]["shape"] == [1, EXTEND_LENGTH]
    assert block["io"]["inputs"]["cache_mask"]["shape"] == [1, 1, 1, capacity]
    assert block["io"]["outputs"]["cross_attention"]["shape"][2] == EXTEND_LENGTH
    check_manifest(manifest, "bundle")  # the control: as written

    def refused(edit, message):
        bad = copy.deepcopy(manifest)
        edit(bad["decoder"]["alignment"])
        with pytest.raises(BundleError, match=message):
            check_manifest(bad, "bundle")

    refused(lambda b: b.update(length=capacity), r"decoder.alignment.io.inputs.input_ids.shape")
    refused(lambda b: b.update(length=capacity + 1), r"decoder.alignment.length.*outside")
    refused(lambda b: b["io"]["inputs"].pop("position"), r"decoder.alignment.io.inputs.*position")
    refused(lambda b: b["io"]["inputs"].pop("cache_mask"), r"decoder.alignment.io.inputs.*cache_mask")
