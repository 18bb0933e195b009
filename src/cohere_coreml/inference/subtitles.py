"""Subtitles from word timings: cues of a few words, written as SubRip (SRT) or WebVTT.

    cues = build_cues(words, language, max_words=7, max_seconds=5.0)   # words: [{"word", "start", "end", ...}]
    text = write_srt(cues)   # or write_vtt(cues)

A cue holds consecutive words and closes before the word that would make it longer than `max_words` words or
`max_seconds` seconds (first word's start to last word's end); a word is never split, so a single word longer
than `max_seconds` is a cue of its own. Cue text joins the words as the language writes them: with spaces,
without for ja and zh (`model.tokens.NO_SPACE_LANGUAGES`, as window texts are joined).

Formats: SubRip, numbered cues with `HH:MM:SS,mmm --> HH:MM:SS,mmm`; WebVTT (W3C WebVTT, section 4), a
`WEBVTT` header line, then cues with `HH:MM:SS.mmm --> HH:MM:SS.mmm`. Each cue ends with a blank line. Times
are rounded to the millisecond; a cue's end is never before its start (a word of zero length keeps its time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model.tokens import join_windows

DEFAULT_MAX_WORDS = 7  # words per cue: about one subtitle line
DEFAULT_MAX_SECONDS = 5.0  # seconds per cue (first word's start to last word's end)
FORMATS = ("text", "json", "srt", "vtt")  # `transcribe --format`
SUBTITLE_FORMATS = ("srt", "vtt")


class SubtitleError(ValueError):
    """Cue limits that cannot work (no word per cue, a non-positive length)."""


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str


def join_words(words: Sequence[str], language: str | None) -> str:
    """Words as the language writes them (`tokens.join_windows`' rule: no space between them for ja and zh)."""
    return join_windows([w.strip() for w in words], language)


def build_cues(words: Sequence[dict], language: str | None = None, max_words: int = DEFAULT_MAX_WORDS,
               max_seconds: float = DEFAULT_MAX_SECONDS) -> list[Cue]:
    """Cues of consecutive `words` (dicts with "word", "start", "end"), at most `max_words` words and
    `max_seconds` seconds each (a longer single word stays whole)."""
    if int(max_words) != max_words or max_words < 1:
        raise SubtitleError(f"--max-words-per-cue must be a whole number >= 1, got {max_words}")
    if not max_seconds > 0:
        raise SubtitleError(f"--max-cue-seconds must be > 0, got {max_seconds}")
    cues: list[Cue] = []
    group: list[dict] = []

    def close():
        if group:
            cues.append(Cue(start=group[0]["start"], end=max(group[-1]["end"], group[0]["start"]),
                            text=join_words([w["word"] for w in group], language)))

    for word in words:
        if group and (len(group) >= max_words or word["end"] - group[0]["start"] > max_seconds):
            close()
            group = []
        group.append(word)
    close()
    return cues


def timestamp(seconds: float, separator: str) -> str:
    """HH:MM:SS<separator>mmm of `seconds` (>= 0), rounded to the millisecond."""
    ms = max(0, int(round(float(seconds) * 1000)))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def write_srt(cues: Sequence[Cue]) -> str:
    """SubRip: "1\\nHH:MM:SS,mmm --> HH:MM:SS,mmm\\ntext\\n\\n" per cue, numbered from 1."""
    return "".join(f"{k}\n{timestamp(c.start, ',')} --> {timestamp(c.end, ',')}\n{c.text}\n\n"
                   for k, c in enumerate(cues, start=1))


def write_vtt(cues: Sequence[Cue]) -> str:
    """WebVTT: the "WEBVTT" header and a blank line, then "HH:MM:SS.mmm --> HH:MM:SS.mmm\\ntext\\n\\n" per cue."""
    return "WEBVTT\n\n" + "".join(f"{timestamp(c.start, '.')} --> {timestamp(c.end, '.')}\n{c.text}\n\n"
                                  for c in cues)


def write_subtitles(fmt: str, words: Sequence[dict], language: str | None = None,
                    max_words: int = DEFAULT_MAX_WORDS, max_seconds: float = DEFAULT_MAX_SECONDS) -> str:
    """`fmt` ("srt" | "vtt") of the words' cues."""
    if fmt not in SUBTITLE_FORMATS:
        raise SubtitleError(f"subtitle format must be one of {', '.join(SUBTITLE_FORMATS)}, got {fmt!r}")
    cues = build_cues(words, language, max_words, max_seconds)
    return write_srt(cues) if fmt == "srt" else write_vtt(cues)
