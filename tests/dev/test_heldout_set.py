"""The robustness held-out set (`cohere_coreml_dev.heldout`): padded and multi-utterance subsets derived
from the single clips, every sentence where the manifest says."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml.evaluation.datasets import load_folder
from cohere_coreml_dev import heldout
from cohere_coreml_dev.synth import SynthError

from ..helpers import load_tool

RATE = 16000


def _single(tmp_path, per_language: int = 6, digital_every: int = 2):
    """A single/ folder as `make_single` writes it: a tone burst between noise (or digital) edges."""
    d = tmp_path / "single"
    d.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for lang in ("en", "de"):
        for i in range(per_language):
            lead, speech, trail = 1600 + 160 * i, 8000 + 800 * i, 2400
            std = 0.0 if i % digital_every == 0 else 0.002
            wav = np.concatenate([rng.normal(0, std, lead), 0.3 * np.sin(np.arange(speech) * (0.05 + 0.01 * i)),
                                  rng.normal(0, std, trail)]).astype(np.float32)
            name = f"{lang}_heldout_single_{i:05d}.flac"
            sf.write(str(d / name), wav, RATE, format="FLAC", subtype="PCM_16")
            rows.append({"file": name, "language": lang, "text": f"{lang} sentence {i}.", "voice": "x+m8",
                         "speed": 150, "pitch": 50, "seconds": wav.size / RATE, "sentences": [f"{lang} sentence {i}."],
                         "segments": [[lead, lead + speech]]})
    (d / "manifest.json").write_text(json.dumps({"split": "heldout", "seed": 0, "recipe": "varied",
                                                 "sample_rate": RATE, "languages": ["en", "de"], "utterances": rows}))
    return d


def _speech(path, segment):
    wav, _ = sf.read(str(path), dtype="float32")
    return wav[segment[0]:segment[1]]


def test_padded_clips_hold_the_single_clip_unchanged_between_new_edges(tmp_path):
    single = _single(tmp_path)
    rows = heldout.derive_padded(single, tmp_path / "padded", seed=0)
    src = {u["file"]: u for u in json.loads((single / "manifest.json").read_text())["utterances"]}
    pads = []
    for row in rows:
        (s,) = row["sources"]
        original, _ = sf.read(str(single / s), dtype="float32")
        wav, _ = sf.read(str(tmp_path / "padded" / row["file"]), dtype="float32")
        lead, trail = row["padding_samples"]
        assert np.array_equal(wav[lead: lead + original.size], original)  # the clip itself, bit for bit
        assert np.array_equal(_speech(tmp_path / "padded" / row["file"], row["segments"][0]),
                              _speech(single / s, src[s]["segments"][0]))
        assert row["text"] == src[s]["text"] and wav.size == original.size + lead + trail
        if row["filler_std"] == 0:
            assert not wav[:lead].any()  # digital zeros
        else:
            assert 0.5 < wav[:lead].std() / row["filler_std"] < 1.5  # the clip's own noise floor
        pads += row["padding_s"]
    assert max(pads) > 1.0 and min(pads) < 0.5 and all(0 <= p <= 2.0 for p in pads)
    assert {r["filler_std"] == 0 for r in rows} == {True, False}
    assert len(load_folder(tmp_path / "padded").clips) == len(rows)  # a manifest folder the tools read
    assert rows == heldout.derive_padded(single, tmp_path / "again", seed=0)  # seeded
    assert rows != heldout.derive_padded(single, tmp_path / "other", seed=1)


def test_multi_clips_join_every_single_clip_once_with_pauses(tmp_path):
    single = _single(tmp_path, per_language=9)
    rows = heldout.derive_multi(single, tmp_path / "multi", seed=0)
    src = {u["file"]: u for u in json.loads((single / "manifest.json").read_text())["utterances"]}
    used = [s for r in rows for s in r["sources"]]
    assert sorted(used) == sorted(src)  # every single clip once
    for row in rows:
        assert 2 <= len(row["sources"]) <= 4 or row is rows[-1] or rows[rows.index(row) + 1]["language"] != row["language"]
        assert {src[s]["language"] for s in row["sources"]} == {row["language"]}
        assert row["text"] == " ".join(src[s]["text"] for s in row["sources"])
        assert len(row["segments"]) == len(row["sources"]) == len(row["sentences"])
        for s, seg in zip(row["sources"], row["segments"]):
            assert np.array_equal(_speech(tmp_path / "multi" / row["file"], seg), _speech(single / s, src[s]["segments"][0]))
        for (a, b), (c, d) in zip(row["segments"], row["segments"][1:]):
            assert c - b >= int(0.3 * RATE)  # at least the pause between two sentences
    assert any(len(r["sources"]) >= 3 for r in rows)


def test_the_segment_check_rejects_offsets_one_sample_off(tmp_path):
    """Negative control for the comparisons above: a segment one sample late, or missing the pause
    before it, no longer holds its sentence."""
    single = _single(tmp_path, per_language=4)
    rows = heldout.derive_multi(single, tmp_path / "multi", seed=0)
    src = {u["file"]: u for u in json.loads((single / "manifest.json").read_text())["utterances"]}
    row = rows[0]
    want = _speech(single / row["sources"][1], src[row["sources"][1]]["segments"][0])
    (a, b), (c, d) = row["segments"][:2]
    clip = tmp_path / "multi" / row["file"]
    assert np.array_equal(_speech(clip, [c, d]), want)
    assert not np.array_equal(_speech(clip, [c + 1, d + 1]), want)
    pause = c - b - (src[row["sources"][0]]["seconds"] * RATE - src[row["sources"][0]]["segments"][0][1])
    assert not np.array_equal(_speech(clip, [int(c - pause), int(d - pause)]), want)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_make_heldout_set_synthesises_single_clips_of_unheard_voices(tmp_path):
    from cohere_coreml_dev import synth

    paths = heldout.make_heldout_set(tmp_path, ["es"], 5, seed=0)
    single = json.loads((paths["single"] / "manifest.json").read_text())["utterances"]
    assert len(single) == 5 and all(len(u["sentences"]) == 1 for u in single)
    assert all(u["voice"].split("+")[1] in synth.VARIED_HELDOUT_VARIANTS for u in single)
    for u in single:
        wav, _ = sf.read(str(paths["single"] / u["file"]))
        assert u["segments"][0][0] <= 0.4 * RATE + 1 and wav.size - u["segments"][0][1] <= 0.4 * RATE + 1
    assert len(json.loads((paths["padded"] / "manifest.json").read_text())["utterances"]) == 5


COMMITTED = Path(__file__).resolve().parents[1] / "data" / "heldout-varied" / "single"


@functools.lru_cache(maxsize=1)
def _training_sentences() -> frozenset[str]:
    """Every sentence of the training corpora (planned, not synthesised): the earlier default model's (recipe
    "commands", 4000 per language) and the varied recipe's at the committed model's size (6000 per language;
    its sentences include those of the 3000-per-language candidates)."""
    from cohere_coreml_dev import synth

    languages = ["en", "de", "es"]
    jobs = (synth.plan_corpus(languages, 4000, split="train", seed=0, recipe="commands")
            + synth.plan_corpus(languages, 6000, split="train", seed=0, recipe="varied"))
    return frozenset(s for j in jobs for s in j.get("sentences") or [j["text"]])


def test_the_committed_set_is_held_out_complete_and_200_per_language():
    train = _training_sentences()
    assert heldout.check_single(COMMITTED, train) == []
    utts = json.loads((COMMITTED / "manifest.json").read_text())["utterances"]
    assert {lang: sum(u["language"] == lang for u in utts) for lang in ("en", "de", "es")} == {"en": 200, "de": 200, "es": 200}
    assert len(load_folder(COMMITTED).clips) == 600


def test_the_held_out_check_names_each_planted_defect(tmp_path):
    """Negative controls of the check above: a training sentence, a trained voice variant, a missing file,
    a clip at the wrong rate and too few clips each come back named."""
    copy = tmp_path / "single"
    shutil.copytree(COMMITTED, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    utts = manifest["utterances"]
    train = _training_sentences()
    planted = sorted(s for s in train if s.startswith("Set"))[0]
    utts[0]["sentences"] = [planted]
    utts[1]["voice"] = utts[1]["voice"].split("+")[0] + "+m3"
    (copy / utts[2]["file"]).unlink()
    wav, _ = sf.read(str(copy / utts[3]["file"]), dtype="float32")
    sf.write(str(copy / utts[3]["file"]), wav[::2], 8000, format="FLAC", subtype="PCM_16")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    problems = heldout.check_single(copy, train, min_per_language=201)
    assert f"{utts[0]['file']}: sentence {planted!r} occurs in training" in problems
    assert f"{utts[1]['file']}: voice variant 'm3' is trained on" in problems
    assert f"{utts[2]['file']}: missing" in problems
    assert any(p.startswith(f"{utts[3]['file']}: 8000 Hz") for p in problems)
    assert {p for p in problems if "fewer than" in p} == {f"{lang}: 200 clips, fewer than 201" for lang in ("de", "en", "es")}


def test_a_set_derived_from_another_single_folder_links_it(tmp_path):
    """`--single X --out Y`: Y/single leads to X, so Y is the whole set the evaluations and
    `train_tiny.py --robustness` read; a real folder in its place is refused, not mixed in."""
    (tmp_path / "source").mkdir()
    single = _single(tmp_path / "source")
    paths = heldout.make_heldout_set(tmp_path / "set", ["es"], 1, seed=0, single_dir=single)
    link = tmp_path / "set" / "single"
    assert link.is_symlink() and link.resolve() == single.resolve() and paths["single"] == single
    assert (link / "manifest.json").is_file() and (tmp_path / "set" / "multi" / "manifest.json").is_file()
    heldout.make_heldout_set(tmp_path / "set", ["es"], 1, seed=0, single_dir=single)  # again: the link stays
    assert link.resolve() == single.resolve()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "single").mkdir()
    with pytest.raises(SynthError, match="is not a link"):
        heldout.make_heldout_set(tmp_path / "other", ["es"], 1, seed=0, single_dir=single)


def test_a_validation_plan_keeps_apart_from_the_sentences_it_is_given():
    """`exclude`: the sentences a plan would otherwise draw are replaced by others of the same split; without
    it (the broken variant) the same seed draws them."""
    from cohere_coreml_dev import synth

    def sentences(**kw):
        jobs = synth.plan_corpus(["es", "de"], 20, split="heldout", seed=3, recipe="varied", single=True, **kw)
        return [s for j in jobs for s in j["sentences"]]

    base = sentences()
    taken = frozenset(base[::2])
    kept = sentences(exclude=taken)
    assert len(kept) == 40 and len(set(kept)) == 40
    assert not taken & set(kept)
    assert all(synth.is_heldout(s, lang) for s, lang in zip(kept, ["es"] * 20 + ["de"] * 20))
    assert set(base[1::2]) <= set(kept)  # the sentences not excluded are still drawn


def _fake_single(directory: Path, sentences: list[str], language: str = "es") -> Path:
    """A single/ manifest naming sentences (no audio: `sentences_of` reads the manifest only)."""
    directory.mkdir(parents=True)
    rows = [{"file": f"{language}_heldout_single_{i:05d}.flac", "language": language, "text": s, "sentences": [s]}
            for i, s in enumerate(sentences)]
    (directory / "manifest.json").write_text(json.dumps({"split": "heldout", "utterances": rows}))
    return directory


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_a_validation_set_synthesised_apart_from_the_test_set_shares_no_sentence(tmp_path):
    from cohere_coreml_dev import synth

    drawn = [j["sentences"][0] for j in synth.plan_corpus(["es"], 4, split="heldout", seed=0, recipe="varied",
                                                           single=True)]
    test_set = _fake_single(tmp_path / "test", drawn)  # what seed 0 would draw is the "test set"
    paths = heldout.make_heldout_set(tmp_path / "val", ["es"], 4, seed=0, apart_from=[test_set])
    manifest = json.loads((paths["single"] / "manifest.json").read_text())
    assert not heldout.sentences_of(paths["single"]) & set(drawn)
    assert len(manifest["utterances"]) == 4 and manifest["apart_from"] == [str(test_set)]
    assert heldout.check_single(paths["single"], frozenset(), min_per_language=4,
                                apart_from={"the test set": heldout.sentences_of(test_set)}) == []


def test_a_set_that_shares_a_sentence_with_the_one_it_must_be_apart_from_is_refused(tmp_path):
    single = _single(tmp_path)
    other = _fake_single(tmp_path / "test", ["unrelated.", "en sentence 3."], language="en")
    with pytest.raises(SynthError, match=r"shares 1 sentence\(s\) with .*test.*'en sentence 3\.'"):
        heldout.make_heldout_set(tmp_path / "set", ["en"], 1, seed=0, single_dir=single, apart_from=[other])
    assert not (tmp_path / "set").exists()  # refused before the link or a subset is written
    problems = heldout.check_single(single, frozenset(), min_per_language=1,
                                    apart_from={"the test set": heldout.sentences_of(other)})
    assert problems == ["en_heldout_single_00003.flac: sentence 'en sentence 3.' occurs in the test set"]
    fine = _fake_single(tmp_path / "fine", ["unrelated."], language="en")
    heldout.make_heldout_set(tmp_path / "set", ["en"], 1, seed=0, single_dir=single, apart_from=[fine])


def test_the_cli_names_a_set_to_keep_apart_from_that_is_not_a_single_folder(tmp_path, capsys):
    make_heldout_set = load_tool("data/make_heldout_set")

    rc = make_heldout_set.main(["--out", str(tmp_path / "val"), "--apart-from", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 1 and "no manifest.json in" in err and "nowhere" in err and "Traceback" not in err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text('{"utterances": [{"file": "a.flac"')
    rc = make_heldout_set.main(["--out", str(tmp_path / "val"), "--apart-from", str(tmp_path / "broken")])
    err = capsys.readouterr().err
    assert rc == 1 and "broken: not a single/ folder with a readable manifest.json" in err and "Traceback" not in err
    assert not (tmp_path / "val").exists()


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_a_set_of_several_seeds_holds_each_seeds_clips_under_its_own_name(tmp_path):
    """seeds: single/ is the seeds' own single/ sets one after the other (the same sentences and audio as each
    seed's set alone), their files prefixed s<seed>_ so that equal names do not overwrite each other; the
    derived subsets read it as any single/; no per-seed folder is left."""
    alone = {seed: heldout.make_heldout_set(tmp_path / f"alone{seed}", ["es"], 2, seed=seed)["single"]
             for seed in (0, 1)}
    paths = heldout.make_heldout_set(tmp_path / "both", ["es"], 2, seeds=[0, 1])
    manifest = json.loads((paths["single"] / "manifest.json").read_text())
    rows = manifest["utterances"]
    assert manifest["seeds"] == [0, 1] and "seed" not in manifest
    expected = [(seed, u) for seed in (0, 1) for u in json.loads((alone[seed] / "manifest.json").read_text())["utterances"]]
    assert [r["file"] for r in rows] == [f"s{seed}_{u['file']}" for seed, u in expected]
    assert [r["text"] for r in rows] == [u["text"] for _, u in expected]
    assert [r["text"] for r in rows[:2]] != [r["text"] for r in rows[2:]]  # the seeds drew other sentences
    for r, (seed, u) in zip(rows, expected):
        assert (paths["single"] / r["file"]).read_bytes() == (alone[seed] / u["file"]).read_bytes()
    assert sorted(p.name for p in paths["single"].iterdir()) == sorted([r["file"] for r in rows] + ["manifest.json"])
    assert len(load_folder(paths["padded"]).clips) == 4


@pytest.mark.parametrize("args, message", [
    (["--seeds", "3"], "--seeds takes two or more different seeds, got '3'"),
    (["--seeds", "3,3"], "--seeds takes two or more different seeds, got '3,3'"),
    (["--seeds", "3,x"], "--seeds takes whole numbers separated by commas, got '3,x'"),
    (["--seeds", "3,4", "--single", "somewhere"], "one or the other"),
])
def test_the_cli_refuses_seeds_it_cannot_use_before_writing(tmp_path, capsys, args, message):
    make_heldout_set = load_tool("data/make_heldout_set")

    with pytest.raises(SystemExit) as exc:
        make_heldout_set.main(["--out", str(tmp_path / "set"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "set").exists()
