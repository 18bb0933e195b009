"""Dictations from held-out utterances (tools/data/make_dictations.py) and the streaming bench's per-utterance
comparison of a final with the offline transcript of the utterance's own clip (tools/bench/bench_streaming.py)."""

from __future__ import annotations

import json

import numpy as np
import soundfile as sf

from ..helpers import load_tool
from .test_heldout_set import _single


def test_dictations_of_a_segmented_heldout_folder_hold_each_utterance_at_its_times(tmp_path):
    dictations = load_tool("data/make_dictations")
    single = _single(tmp_path, per_language=10, digital_every=1)  # digital edges: the speech alone is exact
    out = tmp_path / "dictations"
    entries = [e for e in dictations.make_dictations(out, per_dictation=10, min_pause=0.8, max_pause=1.6,
                                                     heldout_dir=single) if e["utterances"]]
    assert len(entries) == 2 and json.loads((out / "manifest.json").read_text())["heldout_dir"] == str(single.resolve())
    rows = {u["file"]: u for u in json.loads((single / "manifest.json").read_text())["utterances"]}
    for e in entries:
        wav, _ = sf.read(str(out / e["file"]), dtype="float32")
        for u, v in zip(e["utterances"], e["utterances"][1:]):
            assert 0.8 * 16000 - 1 <= v["start_sample"] - u["end_sample"] <= 1.6 * 16000 + 1
        for u in e["utterances"]:
            src, _ = sf.read(str(single / u["file"]), dtype="float32")
            a, b = rows[u["file"]]["segments"][0]
            got = wav[u["start_sample"]: u["end_sample"]]
            assert got.size == b - a
            # the clip's speech plus the dictation's one background noise (the loudest clip's floor: 0 here)
            assert np.abs(got - src[a:b]).max() < 2e-4


def test_match_levels_brings_every_utterance_to_the_dictations_median_level(tmp_path):
    dictations = load_tool("data/make_dictations")
    single = _single(tmp_path, per_language=10, digital_every=1)
    rows = json.loads((single / "manifest.json").read_text())["utterances"]
    for i, row in enumerate(rows):  # every other clip 20 dB quieter: the robustness set's level spread
        if i % 2:
            wav, rate = sf.read(str(single / row["file"]), dtype="float32")
            sf.write(str(single / row["file"]), 0.1 * wav, rate, format="FLAC", subtype="PCM_16")

    def speech_rms(out, **kw):
        entries = [e for e in dictations.make_dictations(out, per_dictation=10, heldout_dir=single, **kw)
                   if e["utterances"]]
        levels = []
        for e in entries:
            wav, _ = sf.read(str(out / e["file"]), dtype="float32")
            levels += [float(np.sqrt(np.mean(np.square(wav[u["start_sample"]:u["end_sample"]])))) for u in e["utterances"]]
        return np.array(levels), entries

    plain, _ = speech_rms(tmp_path / "plain")
    matched, entries = speech_rms(tmp_path / "matched", match_levels=True)
    assert plain.max() / plain.min() > 8  # as given: 20 dB apart
    assert matched.max() / matched.min() < 1.05  # one level per dictation
    gains = [u["gain_db"] for e in entries for u in e["utterances"]]
    assert min(gains) < -5 and max(gains) > 5  # loud clips down, quiet clips up, to the median between them
    assert json.loads((tmp_path / "matched" / "manifest.json").read_text())["match_levels"] is True


def _final(start, end, text):
    return {"type": "final", "start": start, "end": end, "text": text}


def test_final_equals_own_clip_needs_one_final_per_utterance_with_its_own_clips_text():
    bench = load_tool("bench/bench_streaming")
    d = {"utterances": [{"id": "a", "start": 1.0, "end": 2.0}, {"id": "b", "start": 3.0, "end": 4.0},
                        {"id": "c", "start": 5.0, "end": 6.0}]}
    own = {"a": "Call Emma.", "b": "Lights on.", "c": "Ten past two."}
    good = {"updates": [{"type": "partial", "start": 0.9, "end": 1.5, "text": "Call"}, _final(0.9, 2.3, "Call Emma."),
                        _final(2.9, 4.3, "Lights on."), _final(4.9, 6.3, "Ten past two.")]}
    assert bench.final_equals_own_clip(d, good, own) == {"a": True, "b": True, "c": True}
    wrong_text = {"updates": [*good["updates"][:3], _final(4.9, 6.3, "Ten past three.")]}
    assert bench.final_equals_own_clip(d, wrong_text, own)["c"] is False
    merged = {"updates": [_final(0.9, 4.3, "Call Emma. Lights on."), _final(4.9, 6.3, "Ten past two.")]}
    assert bench.final_equals_own_clip(d, merged, own) == {"a": False, "b": False, "c": True}
    split = {"updates": [_final(0.9, 1.5, "Call"), _final(1.5, 2.3, "Emma."), *good["updates"][2:]]}
    assert bench.final_equals_own_clip(d, split, own)["a"] is False
    missing = {"updates": good["updates"][:3]}
    assert bench.final_equals_own_clip(d, missing, own)["c"] is False
    # what each failure is, for the report's "differing" rows
    assert bench.own_clip_verdicts(d, wrong_text, own)["c"] == "text"
    assert bench.own_clip_verdicts(d, merged, own) == {"a": "merged", "b": "merged", "c": "equal"}
    assert bench.own_clip_verdicts(d, split, own)["a"] == "split"
    assert bench.own_clip_verdicts(d, missing, own)["c"] == "missing"


def test_an_utterance_cut_in_place_with_its_clip_edges_is_its_own_clip(tmp_path):
    dictations, bench = load_tool("data/make_dictations"), load_tool("bench/bench_streaming")
    single = _single(tmp_path, per_language=10, digital_every=1)  # digital edges, no background: exact
    out = tmp_path / "dictations"
    entries = [e for e in dictations.make_dictations(out, per_dictation=10, min_pause=0.8, max_pause=1.6,
                                                     heldout_dir=single) if e["utterances"]]
    rows = {u["file"]: u for u in json.loads((single / "manifest.json").read_text())["utterances"]}
    uneven = 0
    for e in entries:
        d = dict(e, wav=sf.read(str(out / e["file"]), dtype="float32")[0])
        for u in e["utterances"]:
            src, _ = sf.read(str(single / u["file"]), dtype="float32")
            a, b = rows[u["file"]]["segments"][0]
            assert u["clip_edges"] == [a, src.size - b]
            uneven += a != src.size - b
            cut = bench.in_place_clip(d, u)
            assert cut.size == src.size and np.abs(cut - src).max() < 2e-4
    assert uneven  # lead and trail differ on some clips: swapping them would be caught
    assert bench.in_place_clip(dict(entries[0], wav=np.zeros(10)), {"start_sample": 0, "end_sample": 5}) is None


def test_own_clip_decomposition_tells_the_segmentation_from_the_dictations_audio():
    bench = load_tool("bench/bench_streaming")
    d = {"utterances": [{"id": "a", "start": 1.0, "end": 2.0}, {"id": "b", "start": 3.0, "end": 4.0},
                        {"id": "c", "start": 5.0, "end": 6.0}]}
    own = {"a": "Call Emma.", "b": "Lights on.", "c": "Ten past two."}
    # a: all agree; b: the dictation's audio changed it (the cut reads as the final does); c: the
    # segmentation changed it (the cut reads as its own clip, the final does not)
    in_place = {"a": "Call Emma.", "b": "Lights of.", "c": "Ten past two."}
    run = {"updates": [_final(0.9, 2.3, "Call Emma."), _final(2.9, 4.3, "Lights of."), _final(4.9, 6.3, "Ten past.")]}
    verdicts = [(d, run, bench.own_clip_verdicts(d, run, own))]
    assert bench.own_clip_decomposition(verdicts, own, in_place) == {
        "utterances": 3, "final_equals_in_place": 2, "in_place_equals_own_clip": 2, "final_equals_own_clip": 1}
    # a final merged over two utterances equals no single cut
    merged = {"updates": [_final(0.9, 4.3, "Call Emma."), _final(4.9, 6.3, "Ten past two.")]}
    got = bench.own_clip_decomposition([(d, merged, bench.own_clip_verdicts(d, merged, own))], own, in_place)
    assert got["final_equals_in_place"] == 1 and got["final_equals_own_clip"] == 1
