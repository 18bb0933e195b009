"""Subtitle cues and their SRT / WebVTT text, on hand-built words."""

from __future__ import annotations

import re

import pytest

from cohere_coreml.inference.subtitles import (
    Cue,
    SubtitleError,
    build_cues,
    timestamp,
    write_srt,
    write_subtitles,
    write_vtt,
)


def words(*spans, texts=None):
    """Words w0, w1, ... (or `texts`) with the given (start, end) spans."""
    texts = texts or [f"w{k}" for k in range(len(spans))]
    return [{"word": t, "start": s, "end": e, "probability": 0.9} for t, (s, e) in zip(texts, spans)]


def test_cues_close_at_the_word_limit():
    ws = words(*[(k * 0.5, k * 0.5 + 0.4) for k in range(7)])
    cues = build_cues(ws, "en", max_words=3, max_seconds=60)
    assert [c.text for c in cues] == ["w0 w1 w2", "w3 w4 w5", "w6"]
    assert (cues[0].start, cues[0].end) == (0.0, 1.4) and (cues[2].start, cues[2].end) == (3.0, 3.4)


def test_cues_close_at_the_second_limit_and_never_split_a_word():
    ws = words((0.0, 0.5), (0.6, 1.9), (2.0, 2.4), (2.5, 8.0), (8.1, 8.5))
    cues = build_cues(ws, "en", max_words=10, max_seconds=2.0)
    # w2 would end the first cue at 2.4 s (> 2 s from its start); w3 alone is longer than 2 s: a cue of its own
    assert [c.text for c in cues] == ["w0 w1", "w2", "w3", "w4"]
    assert all(c.end - c.start <= 2.0 for c in cues if " " in c.text)


def test_every_word_in_exactly_one_cue_in_order():
    ws = words(*[(k * 0.3, k * 0.3 + 0.25) for k in range(23)])
    for max_words, max_seconds in ((1, 10), (4, 10), (7, 1.0), (30, 0.5)):
        cues = build_cues(ws, "en", max_words, max_seconds)
        assert " ".join(c.text for c in cues).split() == [w["word"] for w in ws]
        assert all(len(c.text.split()) <= max_words for c in cues)
        assert all(a.end <= b.start for a, b in zip(cues, cues[1:]))


def test_cue_text_joins_words_as_the_language_writes_them():
    ws = words((0, 0.2), (0.2, 0.4), (0.4, 0.6), texts=["今", "日", "は。"])
    assert build_cues(ws, "ja")[0].text == "今日は。"
    assert build_cues(ws, "zh")[0].text == "今日は。"
    ws = words((0, 0.2), (0.2, 0.4), texts=["Hola,", "mundo."])
    assert build_cues(ws, "es")[0].text == "Hola, mundo."


def test_timestamps():
    assert timestamp(0, ",") == "00:00:00,000"
    assert timestamp(3.2004, ",") == "00:00:03,200"
    assert timestamp(3.2006, ".") == "00:00:03.201"
    assert timestamp(3723.5, ",") == "01:02:03,500"
    assert timestamp(59.9996, ".") == "00:01:00.000"  # the rounding carries into the minutes


def test_srt_and_vtt_text():
    cues = [Cue(0.5, 1.25, "Hello there."), Cue(61.0, 62.5, "Bye.")]
    assert write_srt(cues) == ("1\n00:00:00,500 --> 00:00:01,250\nHello there.\n\n"
                               "2\n00:01:01,000 --> 00:01:02,500\nBye.\n\n")
    assert write_vtt(cues) == ("WEBVTT\n\n00:00:00.500 --> 00:00:01.250\nHello there.\n\n"
                               "00:01:01.000 --> 00:01:02.500\nBye.\n\n")
    assert write_srt([]) == "" and write_vtt([]) == "WEBVTT\n\n"


def test_written_files_parse_back_to_the_cues():
    ws = words(*[(k * 0.7 + 0.013, k * 0.7 + 0.6) for k in range(15)])
    for fmt, sep in (("srt", ","), ("vtt", ".")):
        text = write_subtitles(fmt, ws, "en", max_words=4, max_seconds=3.0)
        stamp = rf"(\d\d):(\d\d):(\d\d){re.escape(sep)}(\d\d\d)"
        found = re.findall(rf"^{stamp} --> {stamp}\n(.+)$", text, re.M)
        cues = build_cues(ws, "en", 4, 3.0)
        assert len(found) == len(cues)
        for groups, cue in zip(found, cues):
            h1, m1, s1, ms1, h2, m2, s2, ms2, body = groups
            assert int(h1) * 3600 + int(m1) * 60 + int(s1) + int(ms1) / 1000 == pytest.approx(cue.start, abs=5e-4)
            assert int(h2) * 3600 + int(m2) * 60 + int(s2) + int(ms2) / 1000 == pytest.approx(cue.end, abs=5e-4)
            assert body == cue.text


@pytest.mark.parametrize("kwargs, match", [
    ({"max_words": 0}, "max-words-per-cue"),
    ({"max_words": 2.5}, "max-words-per-cue"),
    ({"max_seconds": 0}, "max-cue-seconds"),
    ({"max_seconds": float("nan")}, "max-cue-seconds"),
])
def test_bad_limits(kwargs, match):
    with pytest.raises(SubtitleError, match=match):
        build_cues(words((0, 1)), "en", **kwargs)
    with pytest.raises(SubtitleError, match="srt, vtt"):
        write_subtitles("ass", words((0, 1)))
