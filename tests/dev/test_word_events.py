"""Word start times from libespeak-ng's word events (tools/cohere_coreml_dev/word_events.py): the truth of
the word-timing sets. The events must be the synthesizer's own (in seconds, on the audio that is written),
mapped to the text's words by character position, merged words left without a truth."""

import threading

import numpy as np
import pytest

from cohere_coreml_dev import espeak_events, synth, word_events
from cohere_coreml_dev.synth import SynthError
from cohere_coreml_dev.word_events import map_events, shift_words, speak_with_words, voiced_frames, word_spans

needs_libespeak = pytest.mark.skipif(
    not word_events.available(),
    reason="libespeak-ng not installed (Debian package espeak-ng: apt-get install espeak-ng; CI installs it)")
RATE = synth.SAMPLE_RATE
# no word of these is merged by espeak-ng's en-us voice; the second has a sentence pause in the middle
PLAIN = "Wake me up at seven thirty."
TWO_SENTENCES = "Water boils at one hundred degrees. Turn left at the second crossing."
MERGED = "Turn off the lights in the garage."  # "the" after "in": no event of its own


def voiced_regions(wav: np.ndarray, rate: int = RATE) -> list[tuple[float, float]]:
    """[start, end) seconds of the runs of voiced 10 ms frames (the module's energy rule)."""
    v = np.concatenate([[False], voiced_frames(wav, rate), [False]]).astype(int)
    edges = np.flatnonzero(np.diff(v))
    return [(a * word_events.FRAME_S, b * word_events.FRAME_S) for a, b in zip(edges[::2], edges[1::2])]


# ---------------------------------------------------------------------------------------------------
# The mapping alone (no synthesizer needed)
# ---------------------------------------------------------------------------------------------------


def test_words_are_whitespace_tokens_or_characters():
    assert word_spans("Set a  timer.") == [(0, 3), (4, 5), (7, 13)]
    assert word_spans("我们去，公园。", "characters") == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 7)]
    with pytest.raises(SynthError, match="split must be"):
        word_spans("x", "syllables")


def test_events_map_to_words_by_character_position_and_ends_are_the_last_voiced_sample():
    rate = 1000  # 10-sample frames
    wav = np.zeros(1000, np.int16)
    wav[100:300] = 5000  # "one": voiced, then silence until "two" starts at 400
    wav[400:600] = 5000  # "two three": "three" merged, no event
    wav[700:900] = 5000  # "four."
    text = "one two three four."
    # text positions are 1-based; an event inside a word counts for it; the zero-length event espeak-ng gives at
    # a clause's end and a second event of a word are ignored
    events = [(1, 3, 100), (5, 3, 400), (6, 2, 500), (15, 4, 700), (19, 0, 900)]
    words = map_events(text, events, wav, rate)
    assert [(w["word"], w["char_start"], w["start"], w["end"]) for w in words] == [
        ("one", 0, 100, 300),  # last voiced sample before the next start, not the next start
        ("two", 4, 400, None),  # followed by a merged word: its end is not its own
        ("three", 8, None, None),
        ("four.", 14, 700, 900),  # the last word: the end of the speech
    ]
    with pytest.raises(SynthError, match="out of order"):
        map_events(text, [(1, 3, 400), (5, 3, 100)], wav, rate)


def test_shifting_words_moves_times_and_characters_and_keeps_missing_ones():
    words = [{"word": "a", "char_start": 0, "start": 0.25, "end": None},
             {"word": "b", "char_start": 2, "start": None, "end": None}]
    assert shift_words(words, 1.5, 10) == [{"word": "a", "char_start": 10, "start": 1.75, "end": None},
                                           {"word": "b", "char_start": 12, "start": None, "end": None}]


def test_a_missing_library_and_a_failing_synthesis_are_one_line_errors(monkeypatch):
    class Done:
        def __init__(self, code, err=b""):
            self.returncode, self.stderr, self.stdout = code, err, b""

    monkeypatch.setattr(word_events.subprocess, "run", lambda *a, **k: Done(espeak_events.EXIT_NO_LIBRARY))
    with pytest.raises(SynthError, match="apt-get install espeak-ng") as err:
        speak_with_words("Hello.", "en-us")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(word_events.subprocess, "run", lambda *a, **k: Done(4, b"libespeak-ng has no voice 'xx'\n"))
    with pytest.raises(SynthError, match="no voice 'xx'") as err:
        speak_with_words("Hello.", "xx")
    assert "\n" not in str(err.value)
    with pytest.raises(SynthError, match="empty"):
        speak_with_words("  ", "en-us")


# ---------------------------------------------------------------------------------------------------
# The synthesizer's events
# ---------------------------------------------------------------------------------------------------


@needs_libespeak
def test_the_event_struct_is_read_as_the_library_writes_it():
    """Two fields written independently agree: each word event's sample index at the synthesis rate and its
    time in milliseconds; its text position is a word's first character (read with another layout, neither holds)."""
    raw, rate, events = word_events.synthesize(TWO_SENTENCES, "en-us", speed=150)
    assert rate == 22050 and len(events) >= len(TWO_SENTENCES.split()) - 1
    for position, length, sample, ms in events:
        assert 0 <= sample <= raw.size and abs(ms - sample * 1000 / rate) <= 1.0, (position, sample, ms)
        if length > 0:
            assert position == 1 or TWO_SENTENCES[position - 2] == " ", (position, TWO_SENTENCES[position - 1:])
            assert TWO_SENTENCES[position - 1: position - 1 + length].isalpha()


@needs_libespeak
def test_every_word_of_a_plain_sentence_starts_in_order_inside_the_voiced_audio():
    wav, words = speak_with_words(PLAIN, "en-us", speed=150, pitch=40)
    assert [w["word"] for w in words] == PLAIN.split()
    starts = [w["start"] for w in words]
    assert None not in starts and starts == sorted(starts) and len(set(starts)) == len(starts)
    regions = voiced_regions(wav)
    first_voiced, last_voiced = regions[0][0], regions[-1][1]
    duration = wav.size / RATE
    assert starts[0] <= first_voiced + 0.02 and words[-1]["end"] == pytest.approx(last_voiced, abs=0.011)
    voiced = voiced_frames(wav, RATE)
    for w in words:
        assert 0 <= w["start"] < w["end"] <= duration
        a, b = int(w["start"] / word_events.FRAME_S), int(np.ceil(w["end"] / word_events.FRAME_S))
        assert voiced[a:b].mean() > 0.5, f"{w} is mostly silent"  # each word's span is speech
    # the words fill the speech: every word ends where the next starts or in a silence before it
    for w, nxt in zip(words, words[1:]):
        assert w["end"] <= nxt["start"]


@needs_libespeak
@pytest.mark.parametrize("voice, speed", [("en-us", 120), ("en-gb+f5", 190)])
def test_the_word_after_a_sentence_pause_starts_where_the_speech_resumes(voice, speed):
    """Seconds, not milliseconds or samples at another rate: the sentence pause is found in the audio alone
    (its longest silence), and the events must put the second sentence's first word at its end and the first
    sentence's last word's end at its start."""
    wav, words = speak_with_words(TWO_SENTENCES, voice, speed=speed)
    regions = voiced_regions(wav)
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(regions, regions[1:])]
    pause = max(gaps, key=lambda g: g[1] - g[0])
    assert pause[1] - pause[0] > 0.15  # espeak-ng pauses between sentences
    second = next(w for w in words if w["word"] == "Turn")
    before = next(w for w in words if w["word"] == "degrees.")
    # at the pause's end, or a little before it: a plosive's closure ("T") is silent
    assert pause[0] < second["start"] <= pause[1] + 0.01 and pause[1] - second["start"] <= 0.08, (second, pause)
    assert abs(before["end"] - pause[0]) <= 0.011, (before, pause)
    assert words[-1]["end"] == pytest.approx(regions[-1][1], abs=0.011)


@needs_libespeak
def test_a_merged_word_has_no_start_and_its_neighbour_no_end():
    _, words = speak_with_words(MERGED, "en-us")
    by_word = {(w["word"], w["char_start"]): w for w in words}
    merged = by_word[("the", MERGED.index("the garage"))]
    assert merged["start"] is None and merged["end"] is None
    assert by_word[("in", MERGED.index("in "))]["end"] is None
    assert by_word[("in", MERGED.index("in "))]["start"] < by_word[("garage.", MERGED.index("garage"))]["start"]
    assert by_word[("the", MERGED.index("the lights"))]["start"] is not None  # the other "the" is spoken


@needs_libespeak
def test_audio_is_the_command_lines_and_does_not_depend_on_earlier_calls():
    """The same samples as synth.speak (the existing synthetic sets), whatever was spoken before, from
    several threads at once."""
    if synth.shutil.which(synth.ESPEAK_BINARY) is None:
        pytest.skip("the espeak-ng command line is not installed")
    jobs = [("Schalte das Licht im Büro aus.", "de", "f5", 190, 65), (PLAIN, "en-us", "m8", 140, 30)]
    results: dict[int, tuple] = {}

    def run(i, job):
        results[i] = speak_with_words(job[0], job[1], job[3], job[4], variant=job[2])

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (text, voice, variant, speed, pitch) in enumerate(jobs):
        reference = synth.speak(text, voice, speed=speed, pitch=pitch, variant=variant)
        assert np.array_equal(results[i][0], reference)
        assert np.array_equal(results[i + len(jobs)][0], reference) and results[i][1] == results[i + len(jobs)][1]


@needs_libespeak
def test_chinese_words_are_characters_each_with_its_event():
    text = "我们去公园，今天天气很好。"
    _, words = speak_with_words(text, "cmn")
    assert [w["word"] for w in words] == ["我", "们", "去", "公", "园，", "今", "天", "天", "气", "很", "好。"]
    starts = [w["start"] for w in words]
    assert None not in starts and starts == sorted(starts)


@needs_libespeak
def test_an_unknown_voice_is_a_one_line_error():
    with pytest.raises(SynthError, match="no voice 'xx-nowhere'") as err:
        speak_with_words("Hello.", "xx-nowhere")
    assert "\n" not in str(err.value)
