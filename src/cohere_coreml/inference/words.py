"""A window's words on the audio's timeline: the alignment settings, the rule on one window, the words of a clip.

Both engines (a bundle's `transcribe.Transcriber` and the PyTorch reference `engines.PyTorchEngine`) end a window
the same way when word timings are asked:

    attention (heads, positions, frames) of one teacher-forced pass over prompt + text tokens, valid frames only
      -> `alignment.alignment_rows` (lead rows, one per text token, the last one for the end)
      -> `alignment.align_words` (docs/word-timings.md), offset by the window's start
      -> each word's start and end clamped to the window [start_s, start_s + duration_s]

so a word never leaves its window and, windows following each other without overlap (long-form windows, stream
segments), the words of a clip are in time order. The bundle's attention comes from its decoder's `align`
function (`DecoderRuntime.align`), the reference's from `model.alignment_reference`; the settings (heads, rows
before the text, one encoder frame in seconds) from the manifest's `decoder.alignment` block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .alignment import DEFAULT_LEAD_ROWS, align_words, alignment_rows

WORD_KEYS = ("word", "start", "end", "probability")  # a word's dict: text, seconds, seconds, 0..1


class WordTimingError(ValueError):
    """Word timings asked where they cannot be given (no alignment in the bundle, bad heads)."""


@dataclass(frozen=True)
class AlignmentSettings:
    """What the rule needs besides a window's attention: the heads (manifest order; the reference selects them
    from every layer's weights, a bundle's function returns only them), rows before the text, one frame."""

    heads: tuple[tuple[int, int], ...]
    frame_seconds: float  # from the configs (the front end's hop x the encoder's subsampling), never a constant
    lead_rows: int = DEFAULT_LEAD_ROWS

    @classmethod
    def from_manifest(cls, block: dict) -> AlignmentSettings:
        """From a manifest's `decoder.alignment` block."""
        return cls(heads=tuple((int(layer), int(head)) for layer, head in block["heads"]),
                   lead_rows=int(block["lead_rows"]), frame_seconds=float(block["frame_seconds"]))


def no_alignment_message(manifest: dict) -> str:
    """Why a bundle gives no word timings, with the fix, in one line (the manifest's alignment_note)."""
    note = (manifest.get("decoder") or {}).get("alignment_note")
    return (f"this bundle has no word alignment ({note or 'its decoder has no align function'}): re-export it with "
            "`cohere-coreml export --alignment-heads auto` (or an explicit head list)")


def window_words(attention: np.ndarray, prompt_length: int, pieces: Sequence[str], probabilities: Sequence[float],
                 settings: AlignmentSettings, *, language: str | None, start_s: float, duration_s: float) -> list[dict]:
    """Words of one window: `attention` (heads, positions >= prompt_length + len(pieces), valid frames) of a
    teacher-forced pass over prompt + text tokens; `probabilities` each text token's probability. Returns
    [{"word", "start", "end", "probability"}] in seconds on the audio's timeline, inside the window."""
    if not pieces:
        return []
    rows = alignment_rows(np.asarray(attention), prompt_length, len(pieces), settings.lead_rows)
    words = align_words(rows, list(pieces), list(probabilities), frame_seconds=settings.frame_seconds,
                        offset_seconds=start_s, lead_rows=settings.lead_rows, language=language)
    end_s = start_s + duration_s
    out = []
    for w in words:
        start = min(max(w.start, start_s), end_s)
        out.append({"word": w.word, "start": start, "end": min(max(w.end, start), end_s),
                    "probability": w.probability})
    return out


def clip_words(windows: Sequence) -> list[dict] | None:
    """All windows' words in order (None when no window was asked for words)."""
    if not windows or all(getattr(w, "words", None) is None for w in windows):
        return None
    return [word for w in windows for word in (w.words or [])]


def rounded(words: Sequence[dict], digits: int = 3) -> list[dict]:
    """Words as printed: times and probabilities rounded to `digits` decimals."""
    return [{"word": w["word"], "start": round(w["start"], digits), "end": round(w["end"], digits),
             "probability": round(w["probability"], digits)} for w in words]


def word_line(word: dict) -> str:
    """A word as the CLI prints it: `[start-end] word (probability)`, seconds and probability to 3 decimals
    (`example_inference.py` and the Swift CLI print the same line)."""
    return f"[{word['start']:.3f}-{word['end']:.3f}] {word['word']} ({word['probability']:.3f})"
