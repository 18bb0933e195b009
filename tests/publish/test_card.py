"""publish/card.py and hub.py: the model card's content, the example every bundle ships, `bundle finalize`.

The card's Hub metadata, its Swift section, base_model and bench rules are tested with the integrity
checks (tests/storage/test_integrity.py); running the example itself is tests/publish/test_example.py.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from cohere_coreml.publish.card import EXAMPLE, README, activations_note, example_source, low_rank_note, model_card
from cohere_coreml.publish.hub import PublishError, finalize_bundle
from cohere_coreml.storage.integrity import check_bundle


@pytest.fixture(scope="module")
def finalized(trained_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("publish") / "f16"
    shutil.copytree(trained_bundle, out)
    finalize_bundle(out)
    return out


def test_card_points_at_the_example_file(finalized):
    """The card links the bundle's example_inference.py and names what it needs; it embeds no program
    (no function of the example, no Core ML calls), so the card cannot drift from the file."""
    card = (finalized / README).read_text()
    use = card[card.index("## Use it"):]
    assert f"[`{EXAMPLE}`]({EXAMPLE})" in use
    assert "pip install numpy soundfile coremltools" in use and f"python {EXAMPLE} audio.wav --language en" in use
    source = example_source()
    for name in re.findall(r"^def (\w+)", source, flags=re.M):
        assert f"def {name}" not in card
    assert "MLModel" in source and "MLModel" not in card
    assert "cohere_coreml" not in use.split("```swift")[0]  # the Python path needs no project install


def test_card_names_no_local_path(finalized):
    """Nothing in the card points into this machine: not the bundle folder, not a home or temp path."""
    card = (finalized / README).read_text()
    assert str(finalized) not in card and str(finalized.parent) not in card
    assert not re.search(r"(?<![\w.])(/home/|/tmp/|/root/|/Users/|[A-Z]:\\\\)", card), card


def test_finalize_writes_the_package_file_and_lists_it(finalized):
    """The bundle's example is the package data file byte for byte; the manifest lists it; finalizing
    again changes nothing; a stale example (an older copy) is replaced and the checksums follow."""
    assert (finalized / EXAMPLE).read_text() == example_source()
    manifest = json.loads((finalized / "manifest.json").read_text())
    assert EXAMPLE in manifest["checksums"]["files"] and README in manifest["checksums"]["files"]
    before = {p.name: p.stat().st_mtime_ns for p in finalized.iterdir() if p.is_file()}
    finalize_bundle(finalized)
    assert {p.name: p.stat().st_mtime_ns for p in finalized.iterdir() if p.is_file()} == before


def test_finalize_replaces_a_stale_example(finalized, tmp_path):
    copy = tmp_path / "f16"
    shutil.copytree(finalized, copy)
    (copy / EXAMPLE).write_text("print('an older example')\n")
    with pytest.raises(Exception, match="example_inference.py"):
        check_bundle(copy, hashes=True)  # the manifest no longer matches the file
    finalize_bundle(copy)
    assert (copy / EXAMPLE).read_text() == example_source()
    check_bundle(copy, hashes=True)


def test_model_card_depends_only_on_the_other_files(finalized):
    """The card does not list itself: computed again from the finalized bundle it is the same text."""
    assert model_card(finalized) == (finalized / README).read_text()


def test_finalize_refuses_a_folder_without_manifest(tmp_path):
    with pytest.raises(PublishError, match="no manifest.json"):
        finalize_bundle(tmp_path)
    assert not (tmp_path / EXAMPLE).exists()


def test_card_says_what_changes_the_computation(tmp_path):
    """A low-rank encoder (itself or as the source of a weight preset) and int8 activations are named
    in the card: they change what the model computes, not only how its weights are stored."""
    lowrank = {"encoder_parameters": {"before": 2091216, "after": 866496}}
    cases = {
        "q8": ({"preset": "q8", "components": {"encoder": {}, "decoder": {}}}, "", "fp16 activations"),
        "lowrank": ({"preset": "lowrank", "components": {"encoder": {"lowrank": lowrank}}},
                    "; the encoder's linears are low-rank", "fp16 activations"),
        "chained": ({"preset": "q4", "components": {"encoder": {}},
                     "source_compression": {"preset": "lowrank", "components": {"encoder": {"lowrank": lowrank}}}},
                    ", after a low-rank encoder (preset `lowrank`); the encoder's linears", "fp16 activations"),
        "w8a8": ({"preset": "q8a8", "components": {"encoder": {"activations": {"dtype": "int8"}}, "decoder": {}}}, "",
                 "int8 activations in the encoder (W8A8), fp16 elsewhere"),
    }
    for name, (report, low, act) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "compression.json").write_text(json.dumps(report))
        note = low_rank_note(d)
        assert note.startswith(low) if low else note == "", (name, note)
        if low:
            assert "2,091,216 -> 866,496 encoder parameters" in note
        assert activations_note(d) == act, name
    assert low_rank_note(tmp_path) == "" and activations_note(tmp_path) == "fp16 activations"  # an f16 export


def test_card_states_the_bundles_word_timing_figures(finalized):
    """With alignment in the manifest the card names its heads and the calibration figures recorded at export;
    without, it says why there are none (the manifest's note), never figures of another bundle."""
    from cohere_coreml.publish.card import word_timings_section

    manifest = json.loads((finalized / "manifest.json").read_text())
    decoder = dict(manifest["decoder"])
    decoder["alignment"] = {"function": "align", "heads": [[1, 0], [1, 3]], "lead_rows": 2,
                            "calibration": {"set": "word_timing_calibration", "clips": 12, "words": 97,
                                            "median_s": 0.0612, "p90_s": 0.2409, "baseline_median_s": 0.2}}
    card = model_card(finalized, manifest={**manifest, "decoder": decoder})
    section = card[card.index("## Word timings"):].split("\n## ")[0]
    assert "heads 1.0, 1.3" in section and "2 row(s)" in section
    assert "| `word_timing_calibration` | 12 | 97 | 61 ms | 241 ms | 200 ms |" in section
    decoder.update(alignment=None, alignment_note="exported with --alignment-heads none")
    section = word_timings_section({**manifest, "decoder": decoder})
    assert "Not available: exported with --alignment-heads none." in section[2] and "ms" not in "".join(section)


def test_card_states_the_vads_gate_figures(finalized):
    """A bundle with vad.mlpackage: the card says so and shows its gate's figures; one without it says nothing."""
    card = (finalized / README).read_text()
    parity = json.loads((finalized / "manifest.json").read_text())["vad"]["parity"]
    assert "+ Silero VAD (speech probability per 32 ms chunk)" in card
    row = next(line for line in card.splitlines() if line.startswith("| VAD speech probability"))
    assert f"{parity['max_abs_diff']:.2e}; identical" in row and row.endswith("| True |")
    manifest = json.loads((finalized / "manifest.json").read_text())
    manifest.pop("vad")
    assert "Silero VAD" not in model_card(finalized, None, manifest=manifest)
