"""Live transcription: partial and final text while the audio arrives (docs/streaming.md).

Cohere Transcribe is not streaming-trained (its encoder attends over the whole window), so the
stream re-decodes a growing segment and confirms what consecutive hypotheses agree on:

    samples (any chunking) -> 10 ms frames (front end hop)
      -> Segmenter: frame energy vs a running noise floor, hangover   -> open / close / cut a segment
         (VadSegmenter instead when the bundle has a voice-activity model: its speech probability per
         32 ms chunk, segments opened and closed by the stream rule of docs/vad.md, the same cut)
      -> while a segment is open, at its hop schedule: features of the segment so far, the smallest
         encoder bucket holding them, ONE encoder call, a decode with the confirmed tokens forced
         after the prompt; LocalAgreement-n: the longest common prefix of the last n hypotheses is
         confirmed, the rest is partial                                -> Update(type="partial")
      -> at segment end: `Transcriber.transcribe_window` of the segment's samples (exactly the
         offline transcription of those samples)                       -> Update(type="final")

Every decision is taken at a frame boundary from the samples up to it, so the updates do not depend
on how the audio is chunked; `audio_time` is that boundary (the audio received when, with infinitely
fast compute, the update is emitted). Nothing here reads the wall clock except `run_file(pace=True)`.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..config import SILENCE_PEAK
from ..model.audio import AudioError, FrontEndConfig, check_waveform, load_audio, quietest_window, valid_frames
from ..model.tokens import decode_ids
from .engines import check_vad_mode
from .longform import check_audio
from .speech_regions import CHUNK_SAMPLES, SAMPLE_RATE, StreamVad, VadOptions
from .words import rounded, word_line

logger = logging.getLogger(__name__)

UPDATE_TYPES = ("partial", "final")
# power of a frame: mean(x^2) + ENERGY_EPSILON (float64, summed in sample order); its energy in dB
# relative to full scale is 10 log10(power)
ENERGY_EPSILON = 1e-10
# a frame of lower power is never speech: a segment always holds a frame whose RMS exceeds
# config.SILENCE_PEAK, so no segment is digital silence (which offline transcription skips)
SILENCE_POWER = SILENCE_PEAK**2
SILENCE_DB = 10.0 * math.log10(SILENCE_POWER)
# chunk size of `run_file` (the CLI's file source)
FILE_CHUNK_S = 0.1


class StreamingError(ValueError):
    """A streaming setting or call that cannot work (names the problem)."""


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamConfig:
    """Parameters of the segmenter and of the hop schedule (defaults measured: docs/streaming.md).

    Times are in seconds and are rounded to whole frames (`frame_samples` samples each).
    """

    # segmenter
    on_db: float = 6.0  # a frame is speech when its energy exceeds the noise floor by more than this
    floor_window_s: float = 3.0  # the noise floor: minimum frame energy over this trailing span
    hangover_s: float = 0.3  # a segment ends after this much non-speech (the hangover)
    preroll_s: float = 0.1  # a segment starts this long before its first speech frame
    # hop schedule: the next partial is max(hop_s, hop_growth * segment length) after the last one
    # (hop_s rounded to whole frames, the growth term rounded down to whole frames)
    hop_s: float = 0.5
    hop_growth: float = 0.5
    agreement: int = 2  # LocalAgreement-n

    def __post_init__(self):
        for name in ("floor_window_s", "hangover_s", "hop_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise StreamingError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("preroll_s", "hop_growth", "on_db"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise StreamingError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.agreement, int) or self.agreement < 1:
            raise StreamingError(f"agreement (LocalAgreement-n) must be an integer >= 1, got {self.agreement!r}")


def frames_of(seconds: float, frame_samples: int, sample_rate: int) -> int:
    """Whole frames in `seconds` (rounded to nearest; at least 1)."""
    return max(1, int(round(seconds * sample_rate / frame_samples)))


# --------------------------------------------------------------------------------------------------
# Segmenter: voice activity from frame energy, with hangover
# --------------------------------------------------------------------------------------------------


def frame_powers(frames: np.ndarray) -> np.ndarray:
    """(k, frame_samples) float32 samples -> (k,) float64 powers mean(x^2) + 1e-10.

    The squares are summed one after the other in sample order (a cumulative sum, not numpy's
    pairwise `mean`), so that another implementation with a plain loop gets the same bits.
    """
    x = frames.astype(np.float64)
    return np.cumsum(x * x, axis=1)[:, -1] / frames.shape[1] + ENERGY_EPSILON


def frame_energies_db(frames: np.ndarray) -> np.ndarray:
    """(k, frame_samples) samples -> (k,) energies in dB (10 log10 of `frame_powers`): for reports."""
    return 10.0 * np.log10(frame_powers(frames))


@dataclass(frozen=True)
class SegmentEvent:
    """What the segmenter decided at the end of one frame (sample indices are absolute)."""

    kind: str  # "open" | "close" | "cut"
    frame_end: int  # the sample at which the decision is taken (end of the frame)
    start: int  # the segment's first sample
    end: int | None = None  # close / cut: the segment's end (exclusive)


class Segmenter:
    """Frame-by-frame voice activity with a running noise floor and hangover; deterministic.

    Frame k holds samples [k F, (k + 1) F), F = the front end's hop (10 ms). Its power p_k
    (`frame_powers`) is speech when p_k > floor_k * 10 ** (on_db / 10) and p_k > SILENCE_POWER, where
    floor_k = min(p_j) over the frames j of the last floor_window_s (k included): in dB, the energy
    exceeds the running noise floor by more than on_db. Comparisons are in the power domain (no
    logarithm per frame). A segment opens at the first speech frame
    (its start preroll_s earlier, never before the previous segment's end) and closes when
    hangover_s of consecutive non-speech frames have passed (end = end of that frame). A segment
    that reaches `max_segment` samples is cut where `audio.split_points` would cut it (the quietest
    `min_energy_window_samples` window in the last `overlap_chunk_second` before the limit); the
    next segment starts at the cut, open.
    """

    def __init__(self, config: StreamConfig, front_end: FrontEndConfig, max_segment: int):
        self.config = config
        self.front_end = front_end
        self.frame = int(front_end.hop_length)
        sr = int(front_end.sampling_rate)
        self.floor_frames = frames_of(config.floor_window_s, self.frame, sr)
        self.hangover_frames = frames_of(config.hangover_s, self.frame, sr)
        self.preroll = int(round(config.preroll_s * sr / self.frame)) * self.frame
        self.on_factor = 10.0 ** (config.on_db / 10.0)
        self.max_segment = int(max_segment)
        self.context = max(1, int(round(front_end.overlap_chunk_second * sr)))
        if self.max_segment < 2 * self.frame:
            raise StreamingError(f"a segment of at most {self.max_segment} samples cannot hold two frames")
        self._floor: collections.deque = collections.deque()  # (frame index, energy), increasing energies
        self.k = 0  # frames seen
        self.start: int | None = None  # open segment's first sample
        self.prev_end = 0
        self.silent_run = 0

    @property
    def is_open(self) -> bool:
        return self.start is not None

    def push(self, power: float, audio: Callable[[int, int], np.ndarray]) -> SegmentEvent | None:
        """One frame's power (`frame_powers`) -> the event it causes, if any. `audio(a, b)` returns samples [a, b)
        (needed to find a cut point)."""
        k = self.k
        self.k += 1
        while self._floor and self._floor[-1][1] >= power:  # sliding minimum (monotonic deque)
            self._floor.pop()
        self._floor.append((k, power))
        while self._floor[0][0] <= k - self.floor_frames:
            self._floor.popleft()
        floor = self._floor[0][1]
        speech = power > floor * self.on_factor and power > SILENCE_POWER
        frame_end = (k + 1) * self.frame
        if self.start is None:
            if not speech:
                return None
            self.start = max(self.prev_end, k * self.frame - self.preroll)
            self.silent_run = 0
            return SegmentEvent("open", frame_end, self.start)
        self.silent_run = 0 if speech else self.silent_run + 1
        if self.silent_run >= self.hangover_frames:
            start, self.start, self.prev_end = self.start, None, frame_end
            return SegmentEvent("close", frame_end, start, frame_end)
        if frame_end - self.start >= self.max_segment:
            return self._cut(frame_end, audio)
        return None

    def _cut(self, frame_end: int, audio: Callable[[int, int], np.ndarray]) -> SegmentEvent:
        """The open segment has reached `max_segment`: cut it where split_points would (the quietest window
        in the last `context` samples before start + max_segment); the rest continues, open, from the cut."""
        start = self.start
        chunk = self.max_segment
        x = audio(start, start + chunk)
        cut = start + quietest_window(x, max(0, chunk - self.context), chunk, self.front_end.min_energy_window_samples)
        cut = max(start + 2 * self.frame, min(cut, start + chunk))
        self.start = cut
        self.prev_end = cut
        return SegmentEvent("cut", frame_end, start, cut)

    def finish(self, total: int) -> SegmentEvent | None:
        """End of the audio: the open segment (if any) closes at `total`."""
        if self.start is None:
            return None
        start, self.start, self.prev_end = self.start, None, total
        return SegmentEvent("close", total, start, total)


class VadSegmenter(Segmenter):
    """Segments from a voice-activity model: its speech probability per 512-sample chunk (`add(samples)`
    scores the chunks the samples complete, through the model's stream) and the stream rule
    (`speech_regions.StreamVad`: silero-vad's VADIterator). A "start" event (decided at its chunk's end)
    opens a segment at its sample (never before the previous segment's end); an "end" event closes it at its
    sample (at least two frames after the segment's start: after a cut the rest may be that short). Each
    event acts at the first frame boundary at or after the end of the chunk that decided it (chunks are
    longer than frames: at most one event per frame), so the segments do not depend on how the audio is
    chunked. The maximum and the cut are `Segmenter`'s; after a cut the segment continues open (the model
    still hears speech). At the end of the audio an open segment closes at the last sample (a pending "end"
    at its own sample; a "start" decided after the last whole frame is not opened)."""

    def __init__(self, probabilities, options: VadOptions, front_end: FrontEndConfig, max_segment: int):
        if int(front_end.sampling_rate) != SAMPLE_RATE:
            raise StreamingError(f"the VAD runs at {SAMPLE_RATE} Hz; this bundle's audio is "
                                 f"{front_end.sampling_rate} Hz")
        self.config = None
        self.front_end = front_end
        self.frame = int(front_end.hop_length)
        self.max_segment = int(max_segment)
        self.context = max(1, int(round(front_end.overlap_chunk_second * front_end.sampling_rate)))
        if self.max_segment < 2 * self.frame:
            raise StreamingError(f"a segment of at most {self.max_segment} samples cannot hold two frames")
        self.probabilities = probabilities  # the model's ProbabilityStream
        self.rule = StreamVad(options)
        # the furthest back a start reaches from the frame it acts at: its chunk, the pad, one frame
        self.preroll = CHUNK_SAMPLES + int(math.ceil(self.rule.speech_pad_samples)) + self.frame
        self._events: collections.deque = collections.deque()  # (decided at sample, kind, sample)
        self._chunks = 0
        self.k = 0
        self.start: int | None = None
        self.prev_end = 0

    def add(self, samples: np.ndarray) -> None:
        """Score the chunks these samples complete; queue the rule's events."""
        for prob in self.probabilities.push(samples):
            self._chunks += 1
            event = self.rule.push(float(prob))
            if event is not None:
                self._events.append((self._chunks * CHUNK_SAMPLES, *event))

    def push(self, power: float, audio: Callable[[int, int], np.ndarray]) -> SegmentEvent | None:
        """One frame (its power is not used) -> the event it causes, if any."""
        self.k += 1
        frame_end = self.k * self.frame
        if self._events and self._events[0][0] <= frame_end:
            _, kind, sample = self._events.popleft()
            if kind == "start" and self.start is None:
                self.start = max(self.prev_end, sample)
                return SegmentEvent("open", frame_end, self.start)
            if kind == "end" and self.start is not None:
                return self._close(frame_end, sample)
        if self.start is not None and frame_end - self.start >= self.max_segment:
            return self._cut(frame_end, audio)
        return None

    def _close(self, now: int, sample: int) -> SegmentEvent:
        start = self.start
        end = min(max(sample, start + 2 * self.frame), now)
        self.start, self.prev_end = None, end
        return SegmentEvent("close", now, start, end)

    def finish(self, total: int) -> SegmentEvent | None:
        if self.start is None:
            return None
        pending = next((sample for _, kind, sample in self._events if kind == "end"), None)
        self._events.clear()
        return self._close(total, total if pending is None else pending)


# --------------------------------------------------------------------------------------------------
# LocalAgreement
# --------------------------------------------------------------------------------------------------


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    """Longest common prefix of token sequences ([] for none)."""
    if not sequences:
        return []
    out: list[int] = []
    for column in zip(*sequences):
        if any(t != column[0] for t in column[1:]):
            break
        out.append(int(column[0]))
    return out


def local_agreement(hypotheses: Sequence[Sequence[int]], n: int, confirmed: Sequence[int] = ()) -> list[int]:
    """LocalAgreement-n: the longest common prefix of the last n hypotheses (the confirmed tokens so
    far while fewer than n exist). Every hypothesis starts with the confirmed tokens it was decoded
    with, so the result extends `confirmed`; a hypothesis that does not is a caller error."""
    if n < 1:
        raise StreamingError(f"LocalAgreement-n needs n >= 1, got {n}")
    confirmed = [int(t) for t in confirmed]
    if len(hypotheses) < n:
        return confirmed
    agreed = common_prefix(hypotheses[-n:])
    if agreed[: len(confirmed)] != confirmed:
        raise StreamingError("a hypothesis does not start with the confirmed tokens it was decoded with")
    return agreed


# --------------------------------------------------------------------------------------------------
# Updates and counters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """One update of the stream; `to_dict` is the JSON line of `transcribe --stream --json`.

    token_ids: the segment's tokens shown (eos excluded): confirmed + the partial tail, or the final
    transcription; confirmed_token_ids: a prefix of token_ids (all of them for a final).
    """

    type: str  # "partial" | "final"
    segment: int  # 0, 1, ... in order
    audio_time: float  # seconds of audio received when emitted (the decision's frame boundary)
    start: float  # the segment's first sample, seconds
    end: float  # the end of the audio it covers, seconds (final: the segment's end)
    text: str
    token_ids: list[int]
    confirmed_token_ids: list[int]
    # a final's words when the session was asked for word timings ({"word", "start", "end", "probability"},
    # seconds on the stream's timeline); None otherwise (partials never carry words)
    words: list[dict] | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.words is None:
            del out["words"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


# JSON schema of one update line (tests check the CLI output against it; docs/streaming.md)
UPDATE_SCHEMA = {
    "type": "object",
    "required": ["type", "segment", "audio_time", "start", "end", "text", "token_ids", "confirmed_token_ids"],
    "additionalProperties": False,
    "properties": {
        "type": {"enum": list(UPDATE_TYPES)},
        "segment": {"type": "integer", "minimum": 0},
        "audio_time": {"type": "number", "minimum": 0},
        "start": {"type": "number", "minimum": 0},
        "end": {"type": "number", "minimum": 0},
        "text": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "confirmed_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "words": {"type": "array", "items": {  # finals with word timings only
            "type": "object", "required": ["word", "start", "end", "probability"], "additionalProperties": False,
            "properties": {"word": {"type": "string"}, "start": {"type": "number", "minimum": 0},
                           "end": {"type": "number", "minimum": 0},
                           "probability": {"type": "number", "minimum": 0, "maximum": 1}}}},
        "audio": {"type": "string"},  # `transcribe --stream --json` with several files: the file's path
    },
}


@dataclass
class StreamStats:
    """Compute spent (counted, not timed): encoder calls and mel frames (the bucket's, i.e. what is
    computed, and the valid ones), decoder calls (prefill / extend / step predictions) and the token
    slots they computed (prefill P, extend K with its padding, step 1), over `audio_s` seconds.
    `to_dict` is the stats line of `transcribe --stream --stats` (fields in declaration order)."""

    audio_s: float = 0.0
    encoder_calls: int = 0
    encoder_frames: int = 0  # mel frames of the encoder functions called (bucket sizes)
    encoder_valid_frames: int = 0
    decoder_calls: int = 0
    decoder_tokens: int = 0  # token slots fed (the decoder's compute; padding included)
    partials: int = 0
    finals: int = 0
    final_encoder_frames: int = 0  # the finals' share (= the offline transcription of the segments)
    final_decoder_calls: int = 0
    final_decoder_tokens: int = 0
    frame_seconds: float = 0.01  # seconds per mel frame

    def per_audio_second(self) -> dict:
        s = max(self.audio_s, 1e-9)
        return {
            "encoder_calls": self.encoder_calls / s,
            "encoder_audio_s": self.encoder_frames * self.frame_seconds / s,
            "encoder_valid_audio_s": self.encoder_valid_frames * self.frame_seconds / s,
            "decoder_calls": self.decoder_calls / s,
            "decoder_tokens": self.decoder_tokens / s,
        }

    def to_dict(self) -> dict:
        return {**asdict(self), "per_audio_second": self.per_audio_second()}


# --------------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    index: int
    start: int
    opened_at: int  # sample at which it opened
    next_partial: int  # sample at which the next partial is due
    hypotheses: list[list[int]] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)


class StreamingSession:
    """Live transcription of one audio stream with a `Transcriber`.

        session = StreamingSession(transcriber, language="en")
        for chunk in chunks:             # float32 mono at the bundle's rate, any sizes
            for update in session.feed(chunk):
                ...
        updates = session.finish()       # the open segment's final

    `max_new_tokens` bounds every decode (partials and finals) as in `Transcriber.transcribe_window`.
    `word_timestamps`: each final carries its words (`Update.words`), timed by the offline rule on the
    segment's samples and offset by the segment's start, so on the stream's timeline and inside the segment
    (segments do not overlap: the words of successive finals are in time order). Partials carry none.
    `vad` ("auto": the bundle's voice-activity model when it has one, "on", "off") and `vad_options`: segments
    opened and closed by the model (`VadSegmenter`), else by frame energy (`Segmenter`).
    """

    def __init__(self, transcriber, language: str = "en", punctuation: bool = True,
                 config: StreamConfig | None = None, max_new_tokens: int | None = None,
                 word_timestamps: bool = False, vad: str = "auto", vad_options: VadOptions | None = None):
        check_vad_mode(vad)
        speech = transcriber.speech_probabilities(vad) if hasattr(transcriber, "speech_probabilities") else None
        if speech is None and vad == "on":
            raise StreamingError("vad='on' needs a transcriber with a voice-activity model")
        if word_timestamps:
            transcriber.check_word_timestamps()  # a bundle without alignment: refused before any audio
        self.word_timestamps = bool(word_timestamps)
        self.transcriber = transcriber
        self.config = config or StreamConfig()
        self.language = language
        self.prompt = list(transcriber.bundle.prompt(language, punctuation))
        self.max_new_tokens = max_new_tokens
        fe = transcriber.front_end
        self.sr = int(fe.sampling_rate)
        self.frame = int(fe.hop_length)
        window_samples = int(transcriber.window_frames) * self.frame  # valid_frames(n) = n // hop
        max_segment = min(int(round(fe.max_audio_clip_s * self.sr)), window_samples)
        if speech is None:
            self.segmenter = Segmenter(self.config, fe, max_segment)
        else:
            self.segmenter = VadSegmenter(speech.stream(), vad_options or VadOptions(), fe, max_segment)
        self.hop = frames_of(self.config.hop_s, self.frame, self.sr) * self.frame
        self.bucket_frames = dict(transcriber.encoder_buckets)  # {encoder function: frames}
        self.stats = StreamStats(frame_seconds=self.frame / self.sr)
        self._audio = np.zeros(0, dtype=np.float32)  # samples from absolute index self._offset
        self._offset = 0
        self._received = 0
        self._segment: _Segment | None = None
        self._count = 0
        self._finished = False

    # -- input ---------------------------------------------------------------------------------
    def feed(self, samples, sample_rate: int | None = None) -> list[Update]:
        """Append samples (float32 mono at the bundle's rate); the updates their frames caused."""
        if self._finished:
            raise StreamingError("the stream is finished: start a new session")
        if sample_rate is not None and int(sample_rate) != self.sr:
            raise AudioError(f"streamed audio must be at {self.sr} Hz, got {sample_rate} Hz: resample it first "
                             "(audio.load_audio)")
        x = np.asarray(samples)
        if x.ndim != 1:
            raise AudioError(f"streamed audio must be mono samples of shape (n,), got shape {x.shape}: mix the "
                             "channels down first")
        if not np.issubdtype(x.dtype, np.floating):
            raise AudioError(f"streamed audio must be float samples in [-1, 1], got dtype {x.dtype}")
        if x.size == 0:
            return []
        x = x.astype(np.float32)
        check_waveform(x, "streamed audio chunk")
        self._audio = np.concatenate([self._audio, x])
        self._received += x.size
        if isinstance(self.segmenter, VadSegmenter):
            self.segmenter.add(x)
        updates: list[Update] = []
        first = self.segmenter.k
        last = self._received // self.frame
        if last > first:
            frames = self._slice(first * self.frame, last * self.frame).reshape(-1, self.frame)
            for k, power in zip(range(first, last), frame_powers(frames)):
                updates.extend(self._frame(float(power), (k + 1) * self.frame))
        self._trim()
        return updates

    def finish(self) -> list[Update]:
        """End of the audio: the final of the open segment (the samples after the last whole frame
        included)."""
        if self._finished:
            return []
        self._finished = True
        self.stats.audio_s = self._received / self.sr
        event = self.segmenter.finish(self._received)
        if event is None:
            return []
        if self._segment is None:  # cannot happen: an open segmenter has a segment
            raise StreamingError("internal: open segment without a session segment")
        return [self._final(event.start, event.end, self._received)]

    # -- per frame -----------------------------------------------------------------------------
    def _frame(self, power: float, frame_end: int) -> list[Update]:
        self.stats.audio_s = frame_end / self.sr
        event = self.segmenter.push(power, self._slice)
        if event is None:
            seg = self._segment
            if seg is not None and frame_end >= seg.next_partial:
                return self._partial(frame_end)
            return []
        if event.kind == "open":
            self._open(event.start, frame_end)
            return []
        update = self._final(event.start, event.end, frame_end)
        if event.kind == "cut":  # the rest of the segment, already received, continues open
            self._open(event.end, frame_end)
        return [update]

    def _open(self, start: int, now: int) -> None:
        self._segment = _Segment(index=self._count, start=start, opened_at=now, next_partial=now + self.hop)
        self._count += 1

    def _partial(self, now: int) -> list[Update]:
        seg = self._segment
        length = now - seg.start
        # whole frames, rounded down (no tie rule to agree on between implementations)
        step = max(self.hop, math.floor(self.config.hop_growth * length / self.frame) * self.frame)
        seg.next_partial = now + step
        forced = self.prompt + seg.confirmed
        if len(forced) >= self.transcriber.capacity - 1:  # no room left to decode after the forced prefix
            return []
        t = self.transcriber
        samples = self._slice(seg.start, now)
        feats, n_valid, _function = t.features(samples)  # as `Transcriber.transcribe_window` computes them
        enc = t.encode(feats, n_valid)
        # the forced prefix by feed_plan (extend calls); the last hypothesis' unconfirmed tail as the
        # draft (verified, never forced: the tokens are greedy's)
        draft = seg.hypotheses[-1][len(seg.confirmed):] if seg.hypotheses else []
        result = t.decode(enc, forced, self.max_new_tokens, draft=draft)
        generated, calls = [int(tok) for tok in result.token_ids], int(result.calls)
        self.stats.encoder_calls += 1
        self.stats.encoder_frames += int(feats.shape[-1])
        self.stats.encoder_valid_frames += int(n_valid)
        self.stats.decoder_calls += calls
        self.stats.decoder_tokens += int(result.tokens_fed)
        self.stats.partials += 1
        hypothesis = seg.confirmed + [tok for tok in generated if tok not in t.eos_ids]
        seg.hypotheses.append(hypothesis)
        seg.confirmed = local_agreement(seg.hypotheses, self.config.agreement, seg.confirmed)
        del seg.hypotheses[: -self.config.agreement]
        return [Update("partial", seg.index, now / self.sr, seg.start / self.sr, now / self.sr,
                       decode_ids(t.tokenizer, hypothesis), hypothesis, list(seg.confirmed))]

    def _final(self, start: int, end: int, now: int) -> Update:
        seg = self._segment
        t = self.transcriber
        samples = self._slice(start, end)
        word_options = {"word_timestamps": True, "language": self.language} if self.word_timestamps else {}
        window = t.transcribe_window(samples, self.prompt, self.max_new_tokens, index=seg.index,
                                     start_s=start / self.sr, **word_options)
        timings = window.timings
        frames = int(self.bucket_frames.get(timings.get("encoder_function"), t.window_frames))
        calls = int(timings.get("decoder_calls", 0))
        tokens = int(timings.get("decoder_tokens_fed", 0))
        self.stats.encoder_calls += 1
        self.stats.encoder_frames += frames
        self.stats.final_encoder_frames += frames
        self.stats.encoder_valid_frames += valid_frames(samples.size, t.front_end)
        self.stats.decoder_calls += calls
        self.stats.final_decoder_calls += calls
        self.stats.decoder_tokens += tokens
        self.stats.final_decoder_tokens += tokens
        self.stats.finals += 1
        ids = [int(tok) for tok in window.token_ids if tok not in t.eos_ids]
        self._segment = None
        return Update("final", seg.index, now / self.sr, start / self.sr, end / self.sr, window.text, ids, list(ids),
                      words=window.words)

    # -- buffer --------------------------------------------------------------------------------
    def _slice(self, a: int, b: int) -> np.ndarray:
        if a < self._offset or b > self._offset + self._audio.size:
            raise StreamingError(f"internal: samples [{a}, {b}) are not buffered "
                                 f"([{self._offset}, {self._offset + self._audio.size}))")
        return self._audio[a - self._offset : b - self._offset]

    def _trim(self) -> None:
        """Keep the open segment (or the pre-roll before the next one) and the partial frame."""
        frames_end = self.segmenter.k * self.frame
        keep = self.segmenter.start if self.segmenter.start is not None else max(
            self.segmenter.prev_end, frames_end - self.segmenter.preroll)
        keep = min(keep, frames_end)
        if keep > self._offset:
            self._audio = self._audio[keep - self._offset :].copy()
            self._offset = keep


def stream_array(transcriber, samples: np.ndarray, chunk: int, language: str = "en", punctuation: bool = True,
                 config: StreamConfig | None = None, max_new_tokens: int | None = None, word_timestamps: bool = False,
                 vad: str = "auto", vad_options: VadOptions | None = None) -> tuple[list[Update], StreamStats]:
    """All updates of `samples` fed in chunks of `chunk` samples (the virtual clock), and the counters."""
    session = StreamingSession(transcriber, language, punctuation, config, max_new_tokens,
                               word_timestamps=word_timestamps, vad=vad, vad_options=vad_options)
    updates: list[Update] = []
    for i in range(0, samples.shape[0], chunk):
        updates.extend(session.feed(samples[i : i + chunk]))
    updates.extend(session.finish())
    return updates, session.stats


def iter_file(transcriber, path, language: str = "en", punctuation: bool = True, config: StreamConfig | None = None,
              pace: bool = True, chunk_s: float = FILE_CHUNK_S, max_new_tokens: int | None = None,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              stats_out: list | None = None, word_timestamps: bool = False, vad: str = "auto",
              vad_options: VadOptions | None = None) -> Iterator[Update]:
    """Updates of an audio file fed in chunks of `chunk_s`, paced at real time (`pace`: chunk i is fed
    no earlier than i * chunk_s after the first) or as fast as possible. The file is loaded and
    resampled to the bundle's rate first (`audio.load_audio`). `stats_out`: the session's
    `StreamStats` is appended to it (final once the iterator is exhausted)."""
    sr = int(transcriber.front_end.sampling_rate)
    wav = load_audio(path, target_rate=sr)
    session = StreamingSession(transcriber, language, punctuation, config, max_new_tokens,
                               word_timestamps=word_timestamps, vad=vad, vad_options=vad_options)
    if stats_out is not None:
        stats_out.append(session.stats)
    chunk = max(1, int(round(chunk_s * sr)))
    t0 = clock()
    for i in range(0, wav.shape[0], chunk):
        if pace:
            wait = t0 + i / sr - clock()
            if wait > 0:
                sleep(wait)
        yield from session.feed(wav[i : i + chunk])
    yield from session.finish()


def stats_line(stats: StreamStats, audio: str | None = None) -> str:
    """The `--stats` line (stderr, after a file's updates): {"type": "stats"[, "audio"], the counters of
    `StreamStats.to_dict`, "per_audio_second": {...}}; the Swift command prints the same keys."""
    line = {"type": "stats", **({"audio": str(audio)} if audio is not None else {}), **stats.to_dict()}
    return json.dumps(line, ensure_ascii=False)


def run_cli(args, make_transcriber: Callable[[], object]) -> int:
    """`cohere-coreml transcribe --stream`: one JSON line per update with --json, else final lines
    ("[start-end] text") on stdout and partial lines on stderr. With --stats, one JSON line of compute
    counters per file on stderr (`stats_line`): stdout keeps the per-update contract."""
    config = StreamConfig(hop_s=args.hop)
    paths = list(args.audio)
    # check every file before the bundle loads (the same named errors as offline transcription)
    for path in paths:
        check_audio(path)
    transcriber = make_transcriber()
    for path in paths:
        if len(paths) > 1 and not args.json:
            print(f"== {path}", flush=True)
        stats: list[StreamStats] = []
        for update in iter_file(transcriber, path, args.language, not args.no_punctuation, config,
                                pace=not args.no_pace, max_new_tokens=args.max_new_tokens, stats_out=stats,
                                word_timestamps=getattr(args, "word_timestamps", False),
                                vad=getattr(args, "vad", "auto"), vad_options=getattr(args, "vad_options", None)):
            if args.json:
                line = update.to_dict()
                if update.words is not None:  # printed to the millisecond (probabilities to 3 decimals)
                    line["words"] = rounded(update.words)
                if len(paths) > 1:
                    line = {"audio": str(path), **line}
                print(json.dumps(line, ensure_ascii=False), flush=True)
            elif update.type == "final":
                print(f"[{update.start:.2f}-{update.end:.2f}] {update.text}", flush=True)
                for w in update.words or ():
                    print(f"  {word_line(w)}", flush=True)
            else:
                print(f"~ [{update.start:.2f}-{update.end:.2f}] {update.text}", file=sys.stderr, flush=True)
        if args.stats:
            print(stats_line(stats[0], str(path) if len(paths) > 1 else None), file=sys.stderr, flush=True)
    return 0
