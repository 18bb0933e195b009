"""The speech-region rule (docs/vad.md): inference.speech_regions against tests/data/vad_vectors.json (written
by tools/data/make_vad_vectors.py) and against its oracles, silero-vad's own get_speech_timestamps_from_probs
and VADIterator (model.silero), on seeded random sequences; broken variants of the rule fail the vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cohere_coreml.inference import speech_regions as sr
from cohere_coreml.inference.speech_regions import StreamVad, VadOptions, VadOptionsError, pack_windows, speech_regions
from cohere_coreml.model import silero

VECTORS = Path(__file__).resolve().parents[1] / "data" / "vad_vectors.json"
DATA = json.loads(VECTORS.read_text())


def regions_of(case, rule=speech_regions, **changes):
    options = VadOptions.from_dict({**case["options"], **changes})
    return [list(r) for r in rule(case["probs"], case["n_samples"], options, case["max_speech_s"])]


def events_of(case, vad_class=StreamVad, **changes):
    vad = vad_class(VadOptions.from_dict({**case["options"], **changes}))
    out = []
    for i, p in enumerate(case["probs"]):
        event = vad.push(p)
        if event is not None:
            out.append([i, event[0], event[1]])
    return out


def windows_of(case, rule=pack_windows):
    return [list(w) for w in rule(case["regions"], case["n_samples"], case["window_samples"],
                                  case["max_gap_samples"])]


def failures(check, section) -> list[str]:
    return [case["name"] for case in DATA[section] if check(case) != case["expected"]]


# --------------------------------------------------------------------------------------------------
# the vectors
# --------------------------------------------------------------------------------------------------


def test_vectors_cover_the_named_cases():
    names = {section: " / ".join(c["name"] for c in DATA[section]) for section in ("regions", "windows", "stream")}
    for words in ("random", "clip: en_long_75s", "longer than max_speech", "all speech", "no speech", "very start",
                  "very end", "exactly at the threshold", "exactly at the negative threshold", "floor"):
        assert words in names["regions"], words
    for words in ("gap just below max_gap", "gap just above max_gap", "exactly the window's length"):
        assert words in names["windows"], words
    for words in ("random", "clip: en_long_75s", "exactly at the threshold", "no floor"):
        assert words in names["stream"], words
    assert DATA["defaults"] == VadOptions().to_dict()
    assert all(any(c["expected"]) for c in DATA["regions"] if "clip" in c["name"])
    for case in DATA["regions"] + DATA["stream"]:  # float32 values, so a port may hold them as float32
        assert np.array_equal(np.asarray(case["probs"], np.float32).astype(np.float64), np.asarray(case["probs"]))


def test_regions_pass_every_vector():
    assert failures(regions_of, "regions") == []


def test_windows_pass_every_vector():
    assert failures(windows_of, "windows") == []


def test_stream_passes_every_vector():
    assert failures(events_of, "stream") == []


def test_vectors_are_the_oracles_answers():
    """The committed answers are silero-vad's own (a stale file, or one written by a broken rule, fails)."""
    for case in DATA["regions"]:
        options = VadOptions.from_dict(case["options"])
        limit = options.max_speech_s if options.max_speech_s is not None else case["max_speech_s"]
        expected = silero.reference_regions(
            case["probs"], case["n_samples"], threshold=options.threshold, neg_threshold=options.neg_threshold,
            min_speech_ms=options.min_speech_ms, min_silence_ms=options.min_silence_ms,
            speech_pad_ms=options.speech_pad_ms, max_speech_s=limit)
        assert [list(r) for r in expected] == case["expected"], case["name"]
    for case in DATA["stream"]:
        options = VadOptions.from_dict(case["options"])
        expected = silero.reference_stream_events(case["probs"], threshold=options.threshold,
                                                  min_silence_ms=options.min_silence_ms,
                                                  speech_pad_ms=options.speech_pad_ms)
        assert [list(e) for e in expected] == case["expected"], case["name"]


# --------------------------------------------------------------------------------------------------
# broken variants fail the vectors
# --------------------------------------------------------------------------------------------------


def test_vectors_reject_a_dropped_negative_threshold_floor():
    def no_floor(case):
        options = VadOptions.from_dict(case["options"])
        if options.neg_threshold is not None:
            return regions_of(case)
        return regions_of(case, neg_threshold=max(options.threshold - 0.15, 0.0))

    assert failures(no_floor, "regions")


def test_vectors_reject_a_missing_pad():
    assert failures(lambda case: regions_of(case, speech_pad_ms=0), "regions")
    assert failures(lambda case: events_of(case, speech_pad_ms=0), "stream")


def test_vectors_reject_an_off_by_one_chunk():
    def shifted(case):
        probs = [0.0] + case["probs"][:-1]  # every chunk's time one chunk late
        return regions_of({**case, "probs": probs})

    assert failures(shifted, "regions")

    class LateStream(StreamVad):
        def push(self, prob):
            event = super().push(prob)
            return None if event is None else (event[0], event[1] + sr.CHUNK_SAMPLES)

    assert failures(lambda case: events_of(case, LateStream), "stream")


def test_vectors_reject_a_floored_stream_threshold():
    class Floored(StreamVad):
        def push(self, prob):  # threshold - 0.15 floored at 0.01, as the offline rule has it
            return super().push(prob if prob >= 0.01 or self.threshold - 0.15 >= 0.01 else -1.0)

    assert failures(lambda case: events_of(case, Floored), "stream")


def test_vectors_reject_a_window_rule_that_ignores_the_gap_or_the_length():
    assert failures(lambda case: windows_of({**case, "max_gap_samples": 10**12}), "windows")
    assert failures(lambda case: windows_of({**case, "window_samples": case["window_samples"] + 1}), "windows")


# --------------------------------------------------------------------------------------------------
# the oracle on random sequences
# --------------------------------------------------------------------------------------------------


def random_sequences(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for k in range(count):
        n = int(rng.integers(0, 300))
        if k % 3 == 0:
            probs = rng.random(n)
        else:  # stretches of speech and silence with jitter
            probs = np.clip(np.repeat(rng.random(n // 6 + 1), 6)[:n] + rng.normal(0, 0.12, n), 0, 1)
        options = dict(threshold=float(rng.choice([0.5, 0.3, 0.65, 0.1])),
                       min_speech_ms=int(rng.choice([0, 100, 250])), min_silence_ms=int(rng.choice([0, 64, 100, 300])),
                       speech_pad_ms=int(rng.choice([0, 30, 100, 400])))
        n_samples = max(0, n * sr.CHUNK_SAMPLES - int(rng.integers(0, sr.CHUNK_SAMPLES)))
        yield np.asarray(probs, np.float32).tolist(), n_samples, options, float(rng.choice([1.0, 2.5, 35.0]))


def test_regions_equal_the_oracle_on_random_sequences():
    for probs, n_samples, options, max_speech_s in random_sequences(1, 250):
        ours = speech_regions(probs, n_samples, VadOptions(**options), max_speech_s)
        assert ours == silero.reference_regions(probs, n_samples, max_speech_s=max_speech_s, **options), options


def test_stream_equals_the_oracle_on_random_sequences():
    for probs, _, options, _ in random_sequences(2, 120):
        del options["min_speech_ms"]
        vad = StreamVad(VadOptions(**options))
        ours = [(i, *e) for i, e in ((i, vad.push(p)) for i, p in enumerate(probs)) if e is not None]
        assert ours == silero.reference_stream_events(probs, **options), options


def test_regions_fit_the_window_they_are_cut_for():
    """max_speech_s = the window: no region is longer than the window, whatever the pad (pack_windows relies
    on it)."""
    for probs, n_samples, options, _ in random_sequences(3, 150):
        for window_s in (1.0, 2.0):
            for start, end in speech_regions(probs, n_samples, VadOptions(**options), window_s):
                assert 0 <= start < end <= n_samples
                assert end - start <= window_s * sr.SAMPLE_RATE


# --------------------------------------------------------------------------------------------------
# windows by their definition
# --------------------------------------------------------------------------------------------------


def test_windows_keep_every_region_whole_and_bridge_only_short_gaps():
    rng = np.random.default_rng(4)
    for _ in range(300):
        window, gap = int(rng.integers(200, 2000)), int(rng.integers(0, 300))
        edges = np.cumsum(rng.integers(0, 400, size=2 * int(rng.integers(0, 12))))
        regions = [(int(s), int(min(e, s + window))) for s, e in zip(edges[::2], edges[1::2])]
        n = int(edges[-1]) + 5 if len(edges) else 0
        windows = pack_windows(regions, n, window, gap)
        owner = [next(i for i, (a, b) in enumerate(windows) if a <= s and e <= b) for s, e in regions]
        assert owner == sorted(owner) and len(set(owner)) == len(windows)
        for i, (a, b) in enumerate(windows):
            members = [r for r, o in zip(regions, owner) if o == i]
            assert (a, b) == (members[0][0], members[-1][1]) and b - a <= window
            assert all(nxt[0] - prev[1] <= gap for prev, nxt in zip(members, members[1:]))
            if i + 1 < len(windows):  # the next region could not join: too far or too long
                first = regions[owner.index(i + 1)]
                assert first[1] - a > window or first[0] - b > gap


def test_windows_refuse_regions_they_would_have_to_cut():
    with pytest.raises(ValueError, match="longer than the 100-sample window"):
        pack_windows([(0, 101)], 200, 100, 10)
    with pytest.raises(ValueError, match="overlap"):
        pack_windows([(0, 50), (40, 60)], 200, 100, 10)
    with pytest.raises(ValueError, match="outside the audio"):
        pack_windows([(0, 250)], 200, 1000, 10)


# --------------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, words", [
    ({"threshold": 1.0}, "threshold must be between 0 and 1"),
    ({"threshold": 0.0}, "threshold must be between 0 and 1"),
    ({"neg_threshold": 0.7}, "neg_threshold must be between 0 and the threshold"),
    ({"min_speech_ms": -1}, "min_speech_ms must be a whole number"),
    ({"speech_pad_ms": 2.5}, "speech_pad_ms must be a whole number"),
    ({"max_speech_s": 0}, "max_speech_s must be > 0"),
    ({"max_gap_s": -1.0}, "max_gap_s must be >= 0"),
])
def test_bad_options_are_one_line_errors(changes, words):
    with pytest.raises(VadOptionsError, match=words) as err:
        VadOptions(**changes)
    assert "\n" not in str(err.value)


def test_option_defaults_are_silero_vads():
    options = VadOptions()
    assert options.resolved_neg_threshold() == 0.5 - 0.15
    assert VadOptions(threshold=0.1).resolved_neg_threshold() == 0.01
    assert options.max_speech_for(35.0) == 35.0 and VadOptions(max_speech_s=60).max_speech_for(35.0) == 35.0
    assert VadOptions(max_speech_s=10).max_speech_for(35.0) == 10
    assert options.max_gap_samples() == 32000
