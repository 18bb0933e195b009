"""Word timings from cross-attention: the one written rule (Python is its reference implementation).

Cohere Transcribe has no trained timestamp tokens, but its decoder's cross-attention says where in the audio
each token looked. As whisper-style aligners do (openai/whisper `whisper/timing.py`, `find_alignment`), the
rule turns the attention of a few selected heads, from one teacher-forced pass over a window's final tokens,
into a monotonic token -> frame path by dynamic time warping (DTW), then groups tokens into words.
docs/word-timings.md spells out the same steps for the Swift and example-script ports; the test vectors in
tests/data/alignment_vectors.json pin them.

Inputs (one window):

    attention       (heads, rows, frames) float: softmax weights of the selected heads over the window's
                    VALID encoder frames, for these rows of the teacher-forced sequence (prompt, text, eos),
                    each row labelled by the token it PREDICTS (the query at position p predicts token p+1):
                      `lead_rows` rows predicting the prompt's last `lead_rows` tokens (they absorb the
                                  audio before the first word; without them the first word is pulled to frame 0),
                      one row per text token (the row that predicts it),
                      one row predicting eos (it absorbs the audio after the last word).
                    `alignment_rows` cuts these rows out of a full teacher-forced pass.
    pieces          the text tokens' SentencePiece pieces ("▁" opens a word; `<0xNN>` is one byte of UTF-8)
    probabilities   each text token's probability under the same teacher-forced pass (softmax of its logits)
    frame_seconds   one encoder frame: the front end's hop times the encoder's subsampling (10 ms x 8 = 80 ms)
    offset_seconds  where the window starts on the original audio's timeline

The rule, step by step:

1. Check: 3 dimensions, at least one head, rows = lead_rows + len(pieces) + 1, at least one frame, finite
   non-negative weights, one probability per piece. Anything else raises `AlignmentError` (one line).
2. Normalise: natural log of each weight, floored at `LOG_FLOOR` (a weight of 0 would be -inf). The log keeps
   each row a log-distribution over frames, the emission score of a hidden-Markov alignment. Per-frame
   standardisation (whisper's choice) and a median filter along time are available (`standardise`,
   `median_width`) but off: on the default model both made the start error worse (BENCHMARKS.md).
3. Optional median filter along frames, width `median_width` (odd; 1 = off), edges repeated.
4. Mean over heads: matrix M (rows, frames), float64.
5. DTW on the cost C = -M from cell (0, 0) to (rows-1, frames-1); each step moves to the next frame and/or the
   next row: D[i, j] = C[i, j] + min(D[i-1, j-1], D[i-1, j], D[i, j-1]), ties broken in that order (diagonal,
   then next row on the same frame, then next frame on the same row). Backtracking from the last cell gives a
   monotonic path on which every row holds at least one cell (several rows may share a frame).
6. Token boundaries: a row's start frame is the first frame of its cells on the path, its end frame the last
   frame of its cells plus one.
7. Words: a piece starting with "▁" opens a word (SentencePiece word starts); a word whose text has no letter
   or digit (punctuation) is merged into the word before it (into the next one when it comes first). For ja and
   zh (no spaces) every character is a word: pieces are grouped until they decode to whole characters.
8. Times: a boundary at frame b (a token's start frame, or its end frame) is the centre of that frame, capped
   at the end of the last frame: time(b) = min(b + 1/2, frames) x frame_seconds + offset_seconds. An encoder
   frame summarises the frame_seconds of audio it covers, so a token entering at frame b began somewhere in
   it: its centre is the unbiased guess (on the default model's calibration clips the left edge was early).
   Word start =
   time(start frame of its first token); word end = time(end frame of its last token), which is the next
   word's start when no row lies between them.
9. Pauses: the row after a pause tends to take the pause's frames, so a word that comes first or follows a
   sentence end (its last character one of `SENTENCE_ENDS`) and lasts longer than `PAUSE_FACTOR` x the
   window's median word duration (that median capped at `MAX_MEDIAN_WORD_S`) starts that long before its
   end; a word ending a sentence that long ends that long after its start. This is whisper's own
   post-processing (`add_word_timestamps`: "truncate long words at sentence boundaries"), with its numbers.
10. Confidence: the mean of the word's tokens' probabilities, as whisper's word `probability` (so a consumer of
   that field reads ours the same way); the minimum would let one uncertain piece of a long word sink it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..model.tokens import NO_SPACE_LANGUAGES, WORD_BOUNDARY

SENTENCE_ENDS = frozenset(".!?\u3002\uff01\uff1f")  # . ! ? and the full-width 。！？ of ja/zh
PAUSE_FACTOR = 2.0  # step 9: a word longer than this many median word durations, at a pause, is clipped
MAX_MEDIAN_WORD_S = 0.7  # step 9: the median word duration counted at most this (seconds)
LOG_FLOOR = 1e-10  # weights below this count as this before the log: a zero weight would give -inf
DEFAULT_LEAD_ROWS = 1  # rows before the text: the one predicting the prompt's last token
_BYTE_PIECE_LEN = len("<0x00>")


class AlignmentError(ValueError):
    """Attention, pieces or probabilities that the rule cannot align (shapes that do not match)."""


@dataclass(frozen=True)
class WordTiming:
    """One word: its text, start and end in seconds on the audio's timeline, its confidence (0..1), and
    the indices of its text tokens in the window's token list."""

    word: str
    start: float
    end: float
    probability: float
    tokens: tuple[int, ...]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tokens"] = list(self.tokens)
        return out


# --------------------------------------------------------------------------------------------------
# Rows of a teacher-forced pass
# --------------------------------------------------------------------------------------------------


def alignment_rows(weights: np.ndarray, prompt_length: int, n_tokens: int,
                   lead_rows: int = DEFAULT_LEAD_ROWS) -> np.ndarray:
    """The rows the rule aligns, from the weights (..., positions, frames) of a teacher-forced pass over
    prompt + text tokens (+ eos): positions prompt_length-1-lead_rows .. prompt_length+n_tokens-1, i.e. the
    rows predicting the prompt's last `lead_rows` tokens, each text token, and eos."""
    first = int(prompt_length) - 1 - int(lead_rows)
    last = int(prompt_length) + int(n_tokens)  # exclusive: the row predicting eos is prompt_length+n_tokens-1
    if lead_rows < 0 or first < 0:
        raise AlignmentError(f"lead_rows must be 0..{int(prompt_length) - 1} for a prompt of {prompt_length} tokens")
    if weights.ndim < 2 or weights.shape[-2] < last:
        raise AlignmentError(f"attention has {weights.shape[-2] if weights.ndim >= 2 else 0} positions, fewer than "
                             f"the {last} of a {prompt_length}-token prompt and {n_tokens} text tokens")
    return weights[..., first:last, :]


# --------------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------------


def normalise(attention: np.ndarray, standardise: bool = False, median_width: int = 1) -> np.ndarray:
    """Steps 2-4: (heads, rows, frames) weights -> (rows, frames) float64 score matrix."""
    scores = np.log(np.maximum(np.asarray(attention, dtype=np.float64), LOG_FLOOR))
    if standardise:  # whisper's per-frame standardisation over the rows (off by default)
        mean = scores.mean(axis=1, keepdims=True)
        std = scores.std(axis=1, keepdims=True)
        scores = (scores - mean) / np.where(std > 0, std, 1.0)
    if median_width > 1:
        scores = median_filter_frames(scores, median_width)
    return scores.mean(axis=0)


def median_filter_frames(x: np.ndarray, width: int) -> np.ndarray:
    """Median over a window of `width` (odd) frames along the last axis, edges repeated."""
    if width % 2 != 1:
        raise AlignmentError(f"median_width must be odd, got {width}")
    half = width // 2
    padded = np.concatenate([np.repeat(x[..., :1], half, axis=-1), x, np.repeat(x[..., -1:], half, axis=-1)], axis=-1)
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1), axis=-1)


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 5: the minimum-cost monotonic path through `cost` (rows, frames) from (0, 0) to the last cell.

    Returns (row indices, frame indices) of the path's cells in order. Computed by anti-diagonals (every cell
    of a diagonal depends only on the two before it); ties go to the diagonal move, then the row move, then
    the frame move.
    """
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    move = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 diagonal, 1 next row (same frame), 2 next frame
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        candidates = np.stack([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        best = np.argmin(candidates, axis=0)  # first minimum: the tie order above
        acc[i, j] = cost[i - 1, j - 1] + candidates[best, np.arange(len(i))]
        move[i, j] = best
    rows, frames = [], []
    i, j = n, m
    while i > 0 and j > 0:
        rows.append(i - 1)
        frames.append(j - 1)
        step = move[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1], dtype=np.int64), np.array(frames[::-1], dtype=np.int64)


def row_spans(rows: np.ndarray, frames: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 6: each row's first frame and last frame + 1 on the path."""
    starts = np.full(n_rows, -1, dtype=np.int64)
    ends = np.zeros(n_rows, dtype=np.int64)
    for r, f in zip(rows.tolist(), frames.tolist()):
        if starts[r] < 0:
            starts[r] = f
        ends[r] = f + 1
    return starts, ends


def piece_bytes(piece: str) -> bytes:
    """The UTF-8 bytes a piece stands for: `<0xNN>` is one raw byte, "▁" a space."""
    if len(piece) == _BYTE_PIECE_LEN and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(WORD_BOUNDARY, " ").encode("utf-8")


def _has_word_character(text: str) -> bool:
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)


def word_groups(pieces: Sequence[str], language: str | None = None) -> list[list[int]]:
    """Step 7: the token indices of each word, in order (every index in exactly one word)."""
    groups: list[list[int]] = []
    if language in NO_SPACE_LANGUAGES:  # a word per character: pieces until they decode to whole characters
        pending: list[int] = []
        buffer = b""
        for k, piece in enumerate(pieces):
            pending.append(k)
            buffer += piece_bytes(piece)
            try:
                text = buffer.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a character's first bytes: wait for the rest
            if text.strip():
                groups.append(pending)
            elif groups:  # a bare space belongs to the character before it
                groups[-1].extend(pending)
            else:
                groups.append(pending)
            pending, buffer = [], b""
        if pending:
            groups.append(pending)
    else:
        for k, piece in enumerate(pieces):
            if piece.startswith(WORD_BOUNDARY) or not groups:
                groups.append([k])
            else:
                groups[-1].append(k)
    merged: list[list[int]] = []
    carry: list[int] = []  # punctuation before the first word waits for it
    for group in groups:
        if not _has_word_character(group_text(pieces, group)):
            if merged:
                merged[-1].extend(group)
            else:
                carry.extend(group)
            continue
        merged.append(carry + group)
        carry = []
    if carry:  # nothing but punctuation: one word
        merged.append(carry)
    return merged


def group_text(pieces: Sequence[str], group: Sequence[int]) -> str:
    """The text of a group of pieces (byte pieces decoded, "▁" a space), stripped."""
    return b"".join(piece_bytes(pieces[k]) for k in group).decode("utf-8", errors="replace").strip()


def check_inputs(attention: np.ndarray, pieces: Sequence[str], probabilities: Sequence[float],
                 lead_rows: int) -> np.ndarray:
    """Step 1: the attention as float64 (heads, rows, frames), or AlignmentError naming what is wrong."""
    att = np.asarray(attention)
    if att.ndim != 3:
        raise AlignmentError(f"attention must be (heads, rows, frames), got {att.ndim} dimension(s)")
    heads, rows, frames = att.shape
    if heads < 1:
        raise AlignmentError("attention has no heads: select at least one alignment head")
    if lead_rows < 0:
        raise AlignmentError(f"lead_rows must be >= 0, got {lead_rows}")
    if rows != lead_rows + len(pieces) + 1:
        raise AlignmentError(f"attention has {rows} rows, expected {lead_rows + len(pieces) + 1} "
                             f"({lead_rows} before the text + {len(pieces)} tokens + 1 for eos)")
    if frames < 1:
        raise AlignmentError("attention covers no encoder frame")
    if len(probabilities) != len(pieces):
        raise AlignmentError(f"{len(probabilities)} token probabilities for {len(pieces)} tokens")
    att = att.astype(np.float64)
    if not np.all(np.isfinite(att)) or np.any(att < 0):
        raise AlignmentError("attention weights must be finite and non-negative")
    return att


def align_words(attention: np.ndarray, pieces: Sequence[str], probabilities: Sequence[float], *,
                frame_seconds: float, offset_seconds: float = 0.0, lead_rows: int = DEFAULT_LEAD_ROWS,
                language: str | None = None, standardise: bool = False, median_width: int = 1,
                pause_factor: float = PAUSE_FACTOR) -> list[WordTiming]:
    """Word timings of one window (the module docstring's rule, steps 1-10; `pause_factor` 0 skips step 9)."""
    att = check_inputs(attention, pieces, probabilities, lead_rows)
    if frame_seconds <= 0:
        raise AlignmentError(f"frame_seconds must be > 0, got {frame_seconds}")
    if not pieces:
        return []
    matrix = normalise(att, standardise=standardise, median_width=median_width)
    rows, frames = dtw_path(-matrix)
    starts, ends = row_spans(rows, frames, matrix.shape[0])
    probs = np.asarray(probabilities, dtype=np.float64)
    n_frames = matrix.shape[1]

    def time(boundary: int) -> float:
        return float(offset_seconds + min(boundary + 0.5, n_frames) * frame_seconds)

    groups = word_groups(pieces, language)
    texts = [group_text(pieces, g) for g in groups]
    spans = [(time(starts[lead_rows + g[0]]), time(ends[lead_rows + g[-1]])) for g in groups]
    if pause_factor > 0:
        spans = clip_pauses(texts, spans, pause_factor)
    return [WordTiming(word=text, start=start, end=end, probability=float(probs[group].mean()), tokens=tuple(group))
            for text, group, (start, end) in zip(texts, groups, spans)]


def clip_pauses(texts: Sequence[str], spans: Sequence[tuple[float, float]],
                pause_factor: float = PAUSE_FACTOR) -> list[tuple[float, float]]:
    """Step 9: (start, end) of each word with the long words at pauses clipped (whisper's rule)."""
    if not spans:
        return []
    longest = pause_factor * min(MAX_MEDIAN_WORD_S, float(np.median([end - start for start, end in spans])))
    out = []
    for k, (text, (start, end)) in enumerate(zip(texts, spans)):
        if end - start > longest:
            if k == 0 or texts[k - 1][-1:] in SENTENCE_ENDS:
                start = end - longest
            elif text[-1:] in SENTENCE_ENDS:
                end = start + longest
        out.append((start, end))
    return out


def naive_word_starts(words: Sequence[str], first_start: float, last_end: float) -> list[float]:
    """The naive baseline: words spread by characters (spaces not counted) from the first word's start to the
    last word's end; what an aligner must beat where there are pauses."""
    lengths = np.array([len(w) for w in words], dtype=np.float64)
    total = lengths.sum()
    if total <= 0:
        return [float(first_start)] * len(words)
    before = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    return [float(first_start + (last_end - first_start) * b / total) for b in before]


# --------------------------------------------------------------------------------------------------
# Head lists (`--alignment-heads L.H,...` of export, transcribe and bench)
# --------------------------------------------------------------------------------------------------


def format_heads(heads: Sequence[tuple[int, int]]) -> str:
    """[(1, 0), (1, 2)] -> "1.0,1.2" (what `parse_heads` reads)."""
    return ",".join(f"{layer}.{head}" for layer, head in heads)



def check_heads(heads: Sequence[tuple[int, int]], layers: int, heads_per_layer: int) -> list[tuple[int, int]]:
    """Heads as (layer, head) pairs inside the model, or AlignmentError."""
    out = []
    for layer, head in heads:
        if not (0 <= layer < layers and 0 <= head < heads_per_layer):
            raise AlignmentError(f"alignment head {layer}.{head} is outside the model's {layers} layers x "
                                 f"{heads_per_layer} heads")
        out.append((int(layer), int(head)))
    return out


def parse_heads(text: str) -> list[tuple[int, int]]:
    """`--alignment-heads` "L.H,L.H,..." -> [(L, H), ...], or AlignmentError naming the form."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        layer, _, head = item.partition(".")
        if not (layer.isdigit() and head.isdigit()):
            raise AlignmentError(f"--alignment-heads: {item!r} is not LAYER.HEAD (e.g. 3.1); give auto, none or a "
                                 "comma-separated list like 2.0,3.1")
        out.append((int(layer), int(head)))
    if not out:
        raise AlignmentError("--alignment-heads: empty list; give auto, none or a list like 2.0,3.1")
    return out
