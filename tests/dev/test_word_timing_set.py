"""Word-timing sets (tools/cohere_coreml_dev/word_timing.py, tools/data/make_word_timing_set.py): the held-out
timing set's three kinds and its reproducibility, and the committed calibration set
(src/cohere_coreml/data/word_timing_calibration) against its manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cohere_coreml.export.alignment_heads import CALIBRATION_SET
from cohere_coreml.model.tokens import LANGUAGES
from cohere_coreml_dev import synth, word_events, word_timing
from cohere_coreml_dev.synth import SynthError

from ..helpers import load_tool

DATA = Path(__file__).resolve().parents[1] / "data"
CALIBRATION = CALIBRATION_SET
HELDOUT_SINGLE = DATA / "heldout-varied" / "single"
RATE = 16000
needs_libespeak = pytest.mark.skipif(
    not word_events.available(),
    reason="libespeak-ng not installed (Debian package espeak-ng: apt-get install espeak-ng; CI installs it)")


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def audio(path: Path) -> np.ndarray:
    wav, rate = sf.read(str(path), dtype="int16")
    assert rate == RATE and wav.ndim == 1
    return wav


def word_problems(u: dict, frames: int) -> list[str]:
    """What is wrong with an utterance's words against its text and audio (empty when nothing)."""
    problems = []
    text = u["text"]
    starts = [w["start"] for w in u["words"] if w["start"] is not None]
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        problems.append(f"{u['file']}: starts not increasing: {starts}")
    for w in u["words"]:
        if text[w["char_start"]: w["char_start"] + len(w["word"])] != w["word"]:
            problems.append(f"{u['file']}: {w['word']!r} is not at character {w['char_start']} of {text!r}")
        if w["start"] is not None and not any(a / RATE - 0.001 <= w["start"] < b / RATE for a, b in u["segments"]):
            problems.append(f"{u['file']}: {w['word']!r} starts at {w['start']} s, in no sentence's segment")
        if w["end"] is not None and not (w["start"] is not None and w["start"] < w["end"] <= frames / RATE):
            problems.append(f"{u['file']}: {w['word']!r} ends at {w['end']} s (start {w['start']})")
    return problems


# ---------------------------------------------------------------------------------------------------
# The committed calibration set
# ---------------------------------------------------------------------------------------------------


def test_the_calibration_set_matches_its_files_and_covers_every_declared_language():
    m = manifest(CALIBRATION)
    rows = m["utterances"]
    assert set(m["languages"]) == set(LANGUAGES) == {u["language"] for u in rows}  # the checkpoint's 14
    files = sorted(p.name for p in CALIBRATION.glob("*.flac"))
    assert files == sorted(u["file"] for u in rows)  # no file without a row, no row without a file
    total = 0
    for u in rows:
        path = CALIBRATION / u["file"]
        data = path.read_bytes()
        total += len(data)
        assert hashlib.sha256(data).hexdigest() == u["sha256"], f"{u['file']} is not the file the manifest names"
        wav = audio(path)
        assert abs(wav.size / RATE - u["seconds"]) < 1e-3
        assert all(0 <= a < b <= wav.size for a, b in u["segments"]) and len(u["segments"]) == len(u["sentences"])
        assert u["kind"] == ("single" if len(u["sentences"]) == 1 else "multi")
        assert word_problems(u, wav.size) == []
        # every clip starts with 0.2 s or more of digital silence
        lead = u["segments"][0][0]
        assert lead >= 0.2 * RATE and not wav[:lead].any()
    # committed and shipped in the wheel: kept small (the everyday clips under 3 MB, the domain clips under 1.5 MB)
    domain = sum((CALIBRATION / u["file"]).stat().st_size for u in rows if u.get("domain"))
    assert total - domain < 3_000_000 and domain < 1_500_000
    for language in LANGUAGES:
        mine = [u for u in rows if u["language"] == language]
        timed, words = word_timing.coverage(mine)
        assert len(mine) >= 3 and any(u["kind"] == "multi" for u in mine), language
        assert timed >= 0.75 * words and words >= 15, f"{language}: {timed} of {words} words timed"
    readme = (CALIBRATION / "README.md").read_text()
    assert "make_word_timing_set.py --calibration" in readme and "ESTIMATE" in readme


def test_the_calibration_text_is_what_was_spoken():
    """Japanese is spoken with spaces and written without; elsewhere the text is the sentences joined."""
    for u in manifest(CALIBRATION)["utterances"]:
        spoken = " ".join(u["sentences"])
        if u["language"] in word_timing.UNSPACED:
            assert u["spoken_text"] == spoken and u["text"] == " ".join(s.replace(" ", "") for s in u["sentences"])
        else:
            assert u["text"] == spoken and "spoken_text" not in u


@needs_libespeak
def test_the_calibration_set_is_what_its_command_makes(tmp_path):
    """Two languages made again (the plan is per language): the same rows and the same samples."""
    languages = ["de", "ja", "zh"]
    rows = word_timing.make_calibration_set(tmp_path / "cal", languages, per_language=4, seed=0)
    committed = {u["file"]: u for u in manifest(CALIBRATION)["utterances"]}
    assert len(rows) == 16 and sum(1 for u in rows if u.get("domain")) == 4  # de's grammar clips too
    for u in rows:
        mine = committed[u["file"]]
        assert {k: v for k, v in u.items() if k != "sha256"} == {k: v for k, v in mine.items() if k != "sha256"}
        assert np.array_equal(audio(tmp_path / "cal" / u["file"]), audio(CALIBRATION / u["file"]))


def test_the_default_models_domain_clips_are_apart_from_the_measured_sets():
    """en, de, es have clips of the default model's grammar (so it gets heads), one of them of two sentences; none of
    their sentences is one of the held-out word-timing sets' (made with seed 0: the first 20 per language, and the
    committed robustness held-out set they share a plan with, tests/data/heldout-varied/single)."""
    rows = [u for u in manifest(CALIBRATION)["utterances"] if u.get("domain")]
    assert {u["language"] for u in rows} == {"en", "de", "es"}
    committed = {s for u in manifest(HELDOUT_SINGLE)["utterances"] for s in u["sentences"]}
    for language in ("en", "de", "es"):
        mine = [s for u in rows if u["language"] == language for s in u["sentences"]]
        assert any(len(u["sentences"]) > 1 for u in rows if u["language"] == language)
        measured = {s for job in word_timing.plan_single([language], 20, seed=0) for s in job["sentences"]}
        assert len(set(mine)) == len(mine) >= 4
        assert not set(mine) & (measured | committed), language
        # of the grammar's held-out split: sentences the default model never trained on
        assert all(synth.is_heldout(s, language, 6) for s in mine)


def test_calibration_plans_refuse_what_they_cannot_make():
    with pytest.raises(SynthError, match="no calibration sentences for xx"):
        word_timing.plan_calibration(["en", "xx"])
    with pytest.raises(SynthError, match="1 to 4"):
        word_timing.plan_calibration(["en"], per_language=5)
    assert word_timing.plan_calibration(["en"], seed=1) != word_timing.plan_calibration(["en"], seed=2)


# ---------------------------------------------------------------------------------------------------
# The held-out timing set
# ---------------------------------------------------------------------------------------------------


@needs_libespeak
def test_a_single_clip_is_the_robustness_sets_clip_with_words(tmp_path):
    """The same plan (seed 0, 200 per language) gives the committed held-out clip, sample for sample."""
    job = word_timing.plan_single(["en", "de", "es"], 200, seed=0)[0]
    row = word_timing.synth_single(job, tmp_path / f"{job['id']}.flac")
    committed = next(u for u in manifest(HELDOUT_SINGLE)["utterances"] if u["file"] == row["file"])
    assert {k: row[k] for k in committed} == committed
    wav = audio(tmp_path / row["file"])
    assert np.array_equal(wav, audio(HELDOUT_SINGLE / row["file"]))
    assert word_problems(row, wav.size) == [] and row["kind"] == "single"
    assert [w["word"] for w in row["words"]] == row["text"].split()


@pytest.fixture(scope="module")
def timing_set(tmp_path_factory):
    if not word_events.available():
        pytest.skip("libespeak-ng not installed (Debian package espeak-ng: apt-get install espeak-ng; CI installs it)")
    root = tmp_path_factory.mktemp("timing")
    word_timing.make_timing_set(root / "a", ["en", "es"], per_language=3, seed=5)
    return root


def test_the_set_is_reproducible_and_seeded(timing_set, tmp_path):
    word_timing.make_timing_set(tmp_path / "b", ["en", "es"], per_language=3, seed=5, kinds=["single", "padded"])
    for kind in ("single", "padded"):
        assert manifest(timing_set / "a" / kind) == manifest(tmp_path / "b" / kind)
        for u in manifest(tmp_path / "b" / kind)["utterances"]:
            assert np.array_equal(audio(tmp_path / "b" / kind / u["file"]), audio(timing_set / "a" / kind / u["file"]))
    assert not (tmp_path / "b" / "multi").exists()  # only the kinds asked for (single/ is their base)
    other = word_timing.plan_single(["en", "es"], 3, seed=6)
    assert [j["text"] for j in other] != [u["text"] for u in manifest(timing_set / "a" / "single")["utterances"]]


def test_single_clips_are_one_heldout_sentence_with_every_word_listed(timing_set):
    rows = manifest(timing_set / "a" / "single")["utterances"]
    assert [u["language"] for u in rows] == ["en"] * 3 + ["es"] * 3
    for u in rows:
        wav = audio(timing_set / "a" / "single" / u["file"])
        assert u["kind"] == "single" and len(u["sentences"]) == 1 and u["voice"].split("+")[-1] in ("m8", "f5", "klatt3")
        assert [w["word"] for w in u["words"]] == u["text"].split()
        assert word_problems(u, wav.size) == []
        assert sum(w["start"] is not None for w in u["words"]) >= len(u["words"]) - 2


def test_padding_moves_every_word_by_exactly_the_silence_added(timing_set):
    single = {u["file"]: u for u in manifest(timing_set / "a" / "single")["utterances"]}
    for u in manifest(timing_set / "a" / "padded")["utterances"]:
        source = single[u["sources"][0]]
        lead = u["padding_samples"][0]
        assert u["kind"] == "padded" and u["padding_s"][0] == round(lead / RATE, 3)
        padded, original = audio(timing_set / "a" / "padded" / u["file"]), audio(timing_set / "a" / "single" / source["file"])
        assert np.array_equal(padded[lead: lead + original.size], original)  # the clip sits `lead` samples later
        for w, s in zip(u["words"], source["words"], strict=True):
            assert (w["start"] is None) == (s["start"] is None) and w["char_start"] == s["char_start"]
            if s["start"] is not None:
                assert w["start"] == pytest.approx(s["start"] + lead / RATE, abs=1e-4)
        assert word_problems(u, padded.size) == []


def test_multi_clips_join_sources_with_their_words_where_each_source_lies(timing_set):
    single = {u["file"]: u for u in manifest(timing_set / "a" / "single")["utterances"]}
    rows = manifest(timing_set / "a" / "multi")["utterances"]
    assert sum(len(u["sources"]) for u in rows) == len(single)  # every single clip joined once
    for u in rows:
        assert u["kind"] == "multi" and 1 <= len(u["sources"]) <= 4  # 2-4, a language's last group what is left
        wav = audio(timing_set / "a" / "multi" / u["file"])
        assert word_problems(u, wav.size) == []
        assert [w["word"] for w in u["words"]] == u["text"].split()
        segment, word, chars = 0, 0, 0
        for name in u["sources"]:
            source = single[name]
            src_wav = audio(timing_set / "a" / "single" / name)
            offset = u["segments"][segment][0] - source["segments"][0][0]
            assert np.array_equal(wav[offset: offset + src_wav.size], src_wav)  # the source is there, whole
            for w, s in zip(u["words"][word: word + len(source["words"])], source["words"], strict=True):
                assert w["char_start"] == s["char_start"] + chars and (w["start"] is None) == (s["start"] is None)
                if s["start"] is not None:
                    assert w["start"] == pytest.approx(s["start"] + offset / RATE, abs=1e-4)
            segment, word, chars = segment + len(source["segments"]), word + len(source["words"]), \
                chars + len(source["text"]) + 1


# ---------------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------------


def test_the_script_says_what_it_does_and_refuses_bad_options_in_one_line(capsys):
    tool = load_tool("data/make_word_timing_set")
    with pytest.raises(SystemExit) as done:
        tool.main(["--help"])
    assert done.value.code == 0 and "--calibration" in capsys.readouterr().out
    for argv, message in ((["--per-language", "0"], "--per-language must be at least 1"),
                          (["--calibration", "--kinds", "single"], "--kinds is for the held-out set")):
        with pytest.raises(SystemExit) as done:
            tool.main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and message in err and "Traceback" not in err


@needs_libespeak
def test_the_script_names_a_bad_language_or_kind_in_one_line(capsys, tmp_path):
    tool = load_tool("data/make_word_timing_set")
    for argv, message in ((["--languages", "en,xx"], "no held-out sentences for language 'xx'"),
                          (["--kinds", "single,triple"], "kinds must be some of single, padded, multi"),
                          (["--calibration", "--languages", "tlh"], "no calibration sentences for tlh")):
        assert tool.main(["--out", str(tmp_path / "x"), *argv]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
