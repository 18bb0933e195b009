"""Synthetic speech with word start times: espeak-ng through its library, with its word events.

The truth of a word-timing set is what the synthesizer says it did, never what a recogniser heard:
libespeak-ng reports an event for each word it starts speaking (`espeakEVENT_WORD`), with the word's
character position in the text and the sample at which it starts. This module drives the library with
`ctypes` (API: espeak-ng's `speak_lib.h`, https://github.com/espeak-ng/espeak-ng/blob/master/src/include/
espeak-ng/speak_lib.h) and maps those events to the text's words:

* words are the text's whitespace-separated tokens (punctuation stays on its word); for Chinese (voice
  `cmn`, `split="characters"`) every character is one word (espeak-ng speaks and reports each Han character
  on its own; punctuation stays on the character before it);
* an event belongs to the word whose characters contain its text position; a word's start is its first
  event's sample; a word without an event (espeak-ng merges some unstressed words into a neighbour: "in the
  garage" gives events for "in" and "garage" only) has start None: it carries no truth;
* ends are not reported by espeak-ng: a word's end is estimated as the last voiced sample before the next
  word's start (the end of the speech for the last word), None when the next word has no start (the merged
  word's sound follows, so the end is not the word's own) and for a word without a start.

The audio is the espeak-ng command line's exactly (`synth.speak`: the same flags, including the pause at the
end of the text, `espeakENDPAUSE`, which the command line adds unless `-z`), resampled the same way, so sets
made here sound like the project's other synthetic sets. libespeak-ng is one global synthesizer per process and
it carries state from one synthesis to the next (the same text comes out a few samples apart), so each
synthesis runs in a fresh process of its own (`espeak_events`): the audio is then the command line's, sample
for sample, and calls from several threads cannot disturb one another (no lock is needed).
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from . import espeak_events
from .synth import INSTALL_HINT, SAMPLE_RATE, SynthError, resample

logger = logging.getLogger(__name__)

# what counts as voiced when estimating ends: 10 ms frames whose RMS is within VOICED_DB of the loudest frame's
FRAME_S = 0.010
VOICED_DB = 40.0
SPLITS = ("words", "characters")
CHILD = Path(espeak_events.__file__)


def available() -> bool:
    """Whether libespeak-ng can be loaded (tests skip without it); loading it speaks nothing."""
    try:
        espeak_events.load_library()
        return True
    except espeak_events.NoLibrary:
        return False


def library_version() -> str:
    """libespeak-ng's version string (`espeak_Info`; loading the library speaks nothing)."""
    try:
        lib = espeak_events.load_library()
    except espeak_events.NoLibrary:
        raise SynthError(f"{espeak_events.LIBRARY} (libespeak-ng) was not found: {INSTALL_HINT}") from None
    lib.espeak_Info.restype = ctypes.c_char_p
    lib.espeak_Info.argtypes = [ctypes.c_void_p]
    return (lib.espeak_Info(None) or b"?").decode()


def synthesize(text: str, voice: str, *, speed: int = 160, pitch: int = 50,
               variant: str | None = None) -> tuple[np.ndarray, int, list[tuple[int, int, int, int]]]:
    """(int16 audio at the synthesis rate, that rate, word events as (text_position, length, sample, milliseconds)): the
    library's raw output for `text` spoken by `voice` (+`variant`) at `speed` words per minute and `pitch` 0-99,
    from a fresh process (`espeak_events`: the library carries state from one synthesis to the next)."""
    if not text.strip():
        raise SynthError("cannot speak an empty text")
    full_voice = f"{voice}+{variant}" if variant else voice
    proc = subprocess.run([sys.executable, "-I", str(CHILD), full_voice, str(int(speed)), str(int(pitch))],
                          input=text.encode("utf-8"), capture_output=True)
    message = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode == espeak_events.EXIT_NO_LIBRARY:
        raise SynthError(f"{espeak_events.LIBRARY} (libespeak-ng) was not found: {INSTALL_HINT}")
    if proc.returncode != 0:
        raise SynthError(f"libespeak-ng failed for voice {full_voice!r} and text {text!r}: "
                         f"{message[-1] if message else f'exit status {proc.returncode}'}")
    header, _, audio = proc.stdout.partition(b"\n")
    meta = json.loads(header)
    return np.frombuffer(audio, dtype=np.int16).copy(), int(meta["rate"]), [tuple(e) for e in meta["events"]]


def word_spans(text: str, split: str = "words") -> list[tuple[int, int]]:
    """[start, end) character spans of the words of `text`: whitespace-separated tokens ("words"), or each
    non-space, non-punctuation character with the punctuation after it ("characters", for Chinese)."""
    if split not in SPLITS:
        raise SynthError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "words":
        return [m.span() for m in re.finditer(r"\S+", text)]
    spans: list[list[int]] = []
    for i, ch in enumerate(text):
        if ch.isspace():
            continue
        if ch.isalnum() or not spans:
            spans.append([i, i + 1])
        else:  # punctuation: part of the character before it
            spans[-1][1] = i + 1
    return [(a, b) for a, b in spans]


def voiced_frames(wav: np.ndarray, rate: int) -> np.ndarray:
    """Per FRAME_S frame, whether its RMS is within VOICED_DB of the loudest frame's."""
    n = max(1, int(round(FRAME_S * rate)))
    frames = wav[: wav.size // n * n].astype(np.float64).reshape(-1, n)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    if rms.size == 0 or rms.max() <= 0:
        return np.zeros(rms.size, bool)
    return rms > rms.max() * 10 ** (-VOICED_DB / 20)


def map_events(text: str, events: list[tuple[int, int, int]], wav: np.ndarray, rate: int,
               split: str = "words") -> list[dict]:
    """The words of `text` with start/end in samples at `rate` (None where unknown): see the module's doc."""
    spans = word_spans(text, split)
    starts: list[int | None] = [None] * len(spans)
    for position, length, sample, *_ in events:
        index = position - 1
        owner = next((k for k, (a, b) in enumerate(spans) if a <= index < b), None)
        if owner is None or length <= 0:  # e.g. the zero-length word event espeak-ng gives at a clause's end
            logger.debug("word event at character %d (length %d) matches no word of %r", position, length, text)
            continue
        if starts[owner] is None:
            starts[owner] = sample
    timed = [s for s in starts if s is not None]
    if any(b < a for a, b in zip(timed, timed[1:])):
        raise SynthError(f"libespeak-ng's word events are out of order for {text!r}: {events}")
    voiced = voiced_frames(wav, rate)
    frame = max(1, int(round(FRAME_S * rate)))
    words = []
    for k, ((a, b), start) in enumerate(zip(spans, starts)):
        end = None
        if start is not None and (k + 1 == len(spans) or starts[k + 1] is not None):
            limit = wav.size if k + 1 == len(spans) else starts[k + 1]
            first, last = start // frame, min(voiced.size, -(-limit // frame))
            hits = np.flatnonzero(voiced[first:last])
            end = min(limit, (first + int(hits[-1]) + 1) * frame) if hits.size else limit
            end = max(end, start)
        words.append({"word": text[a:b], "char_start": a, "start": start, "end": end})
    return words


def speak_with_words(text: str, voice: str, speed: int = 160, pitch: int = 50, sample_rate: int = SAMPLE_RATE, *,
                     variant: str | None = None, split: str | None = None) -> tuple[np.ndarray, list[dict]]:
    """(float32 mono audio at `sample_rate`, words): `text` spoken by espeak-ng as `synth.speak` speaks it, and
    its words as {"word", "char_start", "start", "end"} with times in seconds on the audio's timeline (start None
    for a word espeak-ng merged into a neighbour; end an estimate, None where unknown). `split`: "words"
    (whitespace) or "characters"; by default characters for the Chinese voices (cmn, yue), else words."""
    if split is None:
        split = "characters" if voice.split("+")[0].split("-")[0] in ("cmn", "yue") else "words"
    raw, rate, events = synthesize(text, voice, speed=speed, pitch=pitch, variant=variant)
    words = map_events(text, events, raw, rate, split)
    for w in words:
        for key in ("start", "end"):
            if w[key] is not None:
                w[key] = round(w[key] / rate, 4)
    return resample(raw.astype(np.float32) / 32768.0, rate, sample_rate), words


def shift_words(words: list[dict], seconds: float, char_offset: int = 0) -> list[dict]:
    """`words` moved by `seconds` on the timeline (and by `char_offset` characters in the text): the words of a
    sentence placed in a longer clip."""
    return [{**w, "char_start": w["char_start"] + char_offset,
             **{k: None if w[k] is None else round(w[k] + seconds, 4) for k in ("start", "end")}} for w in words]
