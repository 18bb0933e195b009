"""Speech regions, windows and stream events from speech probabilities: the rule of docs/vad.md.

Three pieces, each an exact port so that Python, Swift and example_inference.py agree on integers:
- `speech_regions`: silero-vad 6.2.3's `get_speech_timestamps_from_probs` (16 kHz, 512-sample chunks,
  `min_silence_at_max_speech` 98 ms, `use_max_poss_sil_at_max_speech` True), its float arithmetic kept
  as the package writes it (thresholds and durations compared as doubles, padding floored to ints);
- `pack_windows`: regions packed greedily, in time order, into windows of at most the model's window
  that never cut a region and never bridge a gap longer than `max_gap_samples`;
- `StreamVad`: silero-vad 6.2.3's `VADIterator.__call__` over probabilities (its negative threshold is
  `threshold - 0.15` with no floor, as the package has it).
The oracles are the package's own functions (`model.silero.reference_regions`,
`model.silero.reference_stream_events`); tests/data/vad_vectors.json holds their answers.
Source: https://github.com/snakers4/silero-vad (src/silero_vad/utils_vad.py, MIT).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

SAMPLE_RATE = 16000
CHUNK_SAMPLES = 512
# get_speech_timestamps_from_probs's defaults for cutting speech longer than max_speech_s
MIN_SILENCE_AT_MAX_SPEECH_MS = 98


class VadOptionsError(ValueError):
    """An option outside its range (one line, names the option and the allowed values)."""


@dataclass(frozen=True)
class VadOptions:
    """The rule's options, silero-vad's defaults. `neg_threshold` None: max(threshold - 0.15, 0.01);
    `max_speech_s` None: the bundle's window (a region never exceeds a window); `max_gap_s`: the longest
    pause kept inside one window (longer pauses are never encoded)."""

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_ms: int = 250
    min_silence_ms: int = 100
    speech_pad_ms: int = 30
    max_speech_s: float | None = None
    max_gap_s: float = 2.0

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0:
            raise VadOptionsError(f"VAD threshold must be between 0 and 1 (exclusive), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            raise VadOptionsError(f"VAD neg_threshold must be between 0 and the threshold {self.threshold}, "
                                  f"got {self.neg_threshold}")
        for name in ("min_speech_ms", "min_silence_ms", "speech_pad_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise VadOptionsError(f"VAD {name} must be a whole number of milliseconds >= 0, got {value}")
        if self.max_speech_s is not None and not self.max_speech_s > 0:
            raise VadOptionsError(f"VAD max_speech_s must be > 0 seconds, got {self.max_speech_s}")
        if not (self.max_gap_s >= 0 and math.isfinite(self.max_gap_s)):
            raise VadOptionsError(f"VAD max_gap_s must be >= 0 seconds, got {self.max_gap_s}")

    def resolved_neg_threshold(self) -> float:
        return max(self.threshold - 0.15, 0.01) if self.neg_threshold is None else self.neg_threshold

    def max_speech_for(self, window_s: float) -> float:
        """Longest region, seconds: `max_speech_s` when set and shorter than the window, else the window."""
        return window_s if self.max_speech_s is None else min(self.max_speech_s, window_s)

    def max_gap_samples(self) -> int:
        return int(round(self.max_gap_s * SAMPLE_RATE))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> VadOptions:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def with_(self, **changes) -> VadOptions:
        return replace(self, **changes)


def speech_regions(probs, n_samples: int, options: VadOptions | None = None,
                   max_speech_s: float | None = None) -> list[tuple[int, int]]:
    """[(start, end)] in samples of the 16 kHz signal whose 512-sample chunks have these probabilities.

    `max_speech_s`: the longest region in seconds when `options.max_speech_s` is None (the caller passes
    the bundle's window); both None: no limit. The steps and their float arithmetic are
    get_speech_timestamps_from_probs's, line for line."""
    options = options or VadOptions()
    limit = options.max_speech_s if options.max_speech_s is not None else max_speech_s
    if limit is None:
        limit = math.inf
    sr = SAMPLE_RATE
    window = CHUNK_SAMPLES
    threshold = float(options.threshold)
    neg_threshold = float(options.resolved_neg_threshold())
    min_speech_samples = sr * options.min_speech_ms / 1000
    speech_pad_samples = sr * options.speech_pad_ms / 1000
    max_speech_samples = sr * limit - window - 2 * speech_pad_samples
    min_silence_samples = sr * options.min_silence_ms / 1000
    min_silence_samples_at_max_speech = sr * MIN_SILENCE_AT_MAX_SPEECH_MS / 1000

    triggered = False
    speeches: list[list[int]] = []  # [start, end]; end None while open
    current: list | None = None  # [start, end] of the open region, or None
    temp_end = 0
    prev_end = next_start = 0
    possible_ends: list[tuple[int, int]] = []

    for i, p in enumerate(probs):
        p = float(p)
        cur = window * i
        if p >= threshold and temp_end:
            sil_dur = cur - temp_end
            if sil_dur > min_silence_samples_at_max_speech:
                possible_ends.append((temp_end, sil_dur))
            temp_end = 0
            if next_start < prev_end:
                next_start = cur

        if p >= threshold and not triggered:
            triggered = True
            current = [cur, None]
            continue

        if triggered and cur - current[0] > max_speech_samples:
            if possible_ends:
                # the longest silence inside the region; the first of equals, as Python's max() picks
                prev_end, dur = max(possible_ends, key=lambda x: x[1])
                current[1] = prev_end
                speeches.append(current)
                current = None
                next_start = prev_end + dur
                if next_start < prev_end + cur:
                    current = [next_start, None]
                else:
                    triggered = False
                prev_end = next_start = temp_end = 0
                possible_ends = []
            else:
                # no silence recorded: prev_end is always 0 here when the longest silence is used
                if prev_end:  # pragma: no cover - unreachable with use_max_poss_sil_at_max_speech
                    current[1] = prev_end
                    speeches.append(current)
                    current = None
                    if next_start < prev_end:
                        triggered = False
                    else:
                        current = [next_start, None]
                    prev_end = next_start = temp_end = 0
                    possible_ends = []
                else:
                    current[1] = cur
                    speeches.append(current)
                    current = None
                    prev_end = next_start = temp_end = 0
                    triggered = False
                    possible_ends = []
                    continue

        if p < neg_threshold and triggered:
            if not temp_end:
                temp_end = cur
            if cur - temp_end < min_silence_samples:
                continue
            current[1] = temp_end
            if current[1] - current[0] > min_speech_samples:
                speeches.append(current)
            current = None
            prev_end = next_start = temp_end = 0
            triggered = False
            possible_ends = []
            continue

    if current is not None and n_samples - current[0] > min_speech_samples:
        current[1] = n_samples
        speeches.append(current)

    last = len(speeches) - 1
    for i, speech in enumerate(speeches):
        if i == 0:
            speech[0] = int(max(0, speech[0] - speech_pad_samples))
        if i != last:
            gap = speeches[i + 1][0] - speech[1]
            if gap < 2 * speech_pad_samples:
                speech[1] += int(gap // 2)
                speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - gap // 2))
            else:
                speech[1] = int(min(n_samples, speech[1] + speech_pad_samples))
                speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - speech_pad_samples))
        else:
            speech[1] = int(min(n_samples, speech[1] + speech_pad_samples))
    return [(int(s), int(e)) for s, e in speeches]


def pack_windows(regions, n_samples: int, window_samples: int, max_gap_samples: int) -> list[tuple[int, int]]:
    """Windows [(start, end)] over the regions, greedy in time order: a window starts at a region's start;
    the next region joins it while the window would stay within `window_samples` and the pause before the
    region is at most `max_gap_samples`; otherwise the window ends at the previous region's end. Regions
    are never cut: one longer than `window_samples` is an error (speech_regions with max_speech_s at most
    the window never makes one)."""
    windows: list[tuple[int, int]] = []
    start = prev_end = None
    for region_start, region_end in regions:
        region_start, region_end = int(region_start), int(region_end)
        if not 0 <= region_start <= region_end <= n_samples:
            raise ValueError(f"speech region [{region_start}, {region_end}) outside the audio [0, {n_samples})")
        if prev_end is not None and region_start < prev_end:
            raise ValueError(f"speech regions overlap or are out of order at sample {region_start}")
        if region_end - region_start > window_samples:
            raise ValueError(f"speech region [{region_start}, {region_end}) is longer than the "
                             f"{window_samples}-sample window")
        if start is not None and region_end - start <= window_samples and region_start - prev_end <= max_gap_samples:
            prev_end = region_end
            continue
        if start is not None:
            windows.append((start, prev_end))
        start, prev_end = region_start, region_end
    if start is not None:
        windows.append((start, prev_end))
    return windows


class StreamVad:
    """Speech start and end events from one probability per 512-sample chunk, as silero-vad's VADIterator
    emits them: `push(prob)` -> None, ("start", sample) or ("end", sample), samples of the stream's
    timeline (start: the chunk's start minus the pad; end: the first silent chunk's end plus the pad,
    minus one chunk, after `min_silence_ms` of probabilities below threshold - 0.15)."""

    def __init__(self, options: VadOptions | None = None):
        options = options or VadOptions()
        self.threshold = float(options.threshold)
        self.min_silence_samples = SAMPLE_RATE * options.min_silence_ms / 1000
        self.speech_pad_samples = SAMPLE_RATE * options.speech_pad_ms / 1000
        self.reset()

    def reset(self) -> None:
        self.triggered = False
        self.temp_end = 0
        self.current_sample = 0

    def push(self, prob: float):
        p = float(prob)
        self.current_sample += CHUNK_SAMPLES
        if p >= self.threshold and self.temp_end:
            self.temp_end = 0
        if p >= self.threshold and not self.triggered:
            self.triggered = True
            return ("start", int(max(0, self.current_sample - self.speech_pad_samples - CHUNK_SAMPLES)))
        if p < self.threshold - 0.15 and self.triggered:
            if not self.temp_end:
                self.temp_end = self.current_sample
            if self.current_sample - self.temp_end < self.min_silence_samples:
                return None
            end = self.temp_end + self.speech_pad_samples - CHUNK_SAMPLES
            self.temp_end = 0
            self.triggered = False
            return ("end", int(end))
        return None


# --------------------------------------------------------------------------------------------------
# The options as command-line flags (transcribe, its --stream, bench)
# --------------------------------------------------------------------------------------------------

VAD_MODES = ("auto", "on", "off")


def add_vad_args(p) -> None:
    """--vad and the rule's options on an argparse parser (docs/vad.md), silero-vad's defaults."""
    d = VadOptions()
    p.add_argument("--vad", default="auto", choices=VAD_MODES,
                   help="voice activity (docs/vad.md): transcribe only the windows of speech the bundle's vad.mlpackage "
                   "finds (with --stream: segments opened and closed by it); auto = on when the bundle has one "
                   "(default: %(default)s)")
    p.add_argument("--vad-threshold", type=float, default=d.threshold,
                   help="speech probability at which speech starts (0-1) (default: %(default)s)")
    p.add_argument("--vad-min-speech-ms", type=int, default=d.min_speech_ms,
                   help="drop regions of speech shorter than this (default: %(default)s)")
    p.add_argument("--vad-min-silence-ms", type=int, default=d.min_silence_ms,
                   help="silence that ends a region of speech (default: %(default)s)")
    p.add_argument("--vad-speech-pad-ms", type=int, default=d.speech_pad_ms,
                   help="audio kept on each side of a region (default: %(default)s)")
    p.add_argument("--vad-max-gap-s", type=float, default=d.max_gap_s,
                   help="longest pause kept inside one window; longer pauses are never decoded (default: %(default)s)")


def vad_options_of(args) -> VadOptions:
    """The `VadOptions` of the parsed --vad-* flags (a bad value: `VadOptionsError`, one line)."""
    return VadOptions(threshold=args.vad_threshold, min_speech_ms=args.vad_min_speech_ms,
                      min_silence_ms=args.vad_min_silence_ms, speech_pad_ms=args.vad_speech_pad_ms,
                      max_gap_s=args.vad_max_gap_s)
