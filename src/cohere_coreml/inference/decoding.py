"""Decoding strategies over a stateful decoder step: beam search and the repetition guard.

The greedy loop lives in `Transcriber.decode`; this module adds what real audio needs on top:

* `beam_search`: N hypotheses, one decoder state each (each holding the window's bound cross
  memory and its own self-attention cache). A state is copied by reading its buffers and writing
  them into a fresh state (`make_state` + `read_state` / `write_state`), only when one hypothesis
  has several surviving children. Finished hypotheses are ranked by
  `sum(log p) / length ** length_penalty` (as `transformers` beam search). With one beam the
  search makes exactly the greedy decisions (first index on ties), token for token.
* `RepetitionGuard`: stops a window whose tail repeats an n-gram run (a decoder loop) and drops
  the repeated copies, keeping one. Off unless asked for; when nothing loops, it changes nothing.
* `StopReason` (why a window stopped; str-valued, so JSON carries "eos", "max_new_tokens",
  "capacity", "repetition" as the Swift package's `StopReason` spells them) and `DecodeResult`
  (what `Transcriber.decode` returns for one window).

Shapes: log_probs (V,) float per decoder call; token ids are Python ints.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from ..config import LENGTH_PENALTY, REPETITION_MAX_NGRAM, REPETITION_MIN_REPEATS, REPETITION_MIN_SPAN


class DecodingError(RuntimeError):
    """Decoding cannot go on (non-finite log-probs, bad options)."""


class StopReason(StrEnum):
    """Why a window's decoding stopped. The values are the strings JSON output carries (a member is
    a `str`: `json.dumps` writes "eos"; the Swift package's `StopReason` mirrors eos, max_new_tokens,
    capacity)."""

    EOS = "eos"  # the model emitted an end-of-sequence token: the window is complete
    MAX_NEW_TOKENS = "max_new_tokens"  # the caller's token limit was reached
    CAPACITY = "capacity"  # the decoder's self-attention cache is full
    REPETITION = "repetition"  # the repetition guard stopped a loop (kept once)

    @property
    def truncated(self) -> bool:
        """True unless the window ended at eos (its tokens are then a prefix of the greedy output)."""
        return self is not StopReason.EOS


TOKEN_LIMITS = (StopReason.CAPACITY, StopReason.MAX_NEW_TOKENS)  # the reasons of a window cut by a token limit


@dataclass
class DecodeResult:
    """One window decoded from its encoder outputs (`Transcriber.decode`).

    Timings are seconds; `calls` counts decoder predictions (the prompt's calls by
    `decoder_runtime.feed_plan`: 1 prefill, extend calls or one step per token; plus steps; bind_memory
    is timed in `bind_s` and not counted); `tokens_fed` the token slots those calls computed (a prefill
    P, an extend K with its padding, a step 1): the decoder's compute."""

    token_ids: list[int]  # generated ids (prompt excluded; the eos id included when reached)
    stop_reason: StopReason
    bind_s: float  # bind_memory: the window's cross memory into a fresh state, once
    prompt_s: float  # the prompt (one prefill call, or one step per token)
    decode_s: float  # the generated tokens' steps
    steps: int  # cache slots filled
    calls: int  # decoder predictions made
    tokens_fed: int = 0  # token slots the calls computed (padding of extend calls included)
    repetition: dict | None = None  # {"ngram", "repeats", "start"} when the guard stopped a loop
    log_probs: list[np.ndarray] | None = None  # with return_log_probs: one (V,) float32 array per call
    # with token_scores: per token of token_ids, its log-prob at the call that chose it (word confidences)
    token_log_probs: list[float] | None = None
    state: object = field(default=None, repr=False)  # with keep_state: the window's state (its cross memory)

    @property
    def truncated(self) -> bool:
        """True when the window stopped without eos."""
        return StopReason(self.stop_reason).truncated

    def __getitem__(self, key: str):
        """Deprecated: `result["token_ids"]`, the access of the dict `decode` returned before; use the
        attributes. Kept for one release for callers not yet moved."""
        warnings.warn(f"DecodeResult[{key!r}] is deprecated: use the attribute .{key}", DeprecationWarning,
                      stacklevel=2)
        if key not in ("truncated", *self.__dataclass_fields__):
            raise KeyError(key)
        return getattr(self, key)


# --------------------------------------------------------------------------------------------------
# Repetition guard
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepetitionGuard:
    """A tail of at least `min_repeats` back-to-back copies of an n-gram (n <= max_ngram) that
    together cover at least `min_span` tokens is a loop.

    With the defaults (config.py) a single token must repeat 12 times, a 4-gram 3 times, an
    8-gram 3 times (24 tokens): digit strings such as "eight eight eight eight" are never cut.
    """

    max_ngram: int = REPETITION_MAX_NGRAM
    min_repeats: int = REPETITION_MIN_REPEATS
    min_span: int = REPETITION_MIN_SPAN

    def __post_init__(self):
        if self.max_ngram < 1 or self.min_repeats < 2 or self.min_span < 2:
            raise DecodingError(f"repetition guard needs max_ngram >= 1, min_repeats >= 2, min_span >= 2: {self}")

    def find(self, tokens: Sequence[int]) -> dict | None:
        """The loop at the end of `tokens`: {"ngram", "repeats", "start"} (start of the run), or None.

        The smallest unit wins; `repeats` counts the whole back-to-back run.
        """
        tokens = list(tokens)
        total = len(tokens)
        for n in range(1, self.max_ngram + 1):
            need = max(self.min_repeats, math.ceil(self.min_span / n))
            if total < need * n:
                continue
            unit = tokens[total - n :]
            repeats = 1
            while (repeats + 1) * n <= total and tokens[total - (repeats + 1) * n : total - repeats * n] == unit:
                repeats += 1
            if repeats >= need:
                return {"ngram": n, "repeats": repeats, "start": total - repeats * n}
        return None

    def trim(self, tokens: Sequence[int], hit: dict) -> list[int]:
        """`tokens` with the loop reduced to one copy of its unit."""
        return list(tokens[: hit["start"] + hit["ngram"]])


def loop_in(tokens: Sequence[int], eos_ids=(), guard: RepetitionGuard | None = None) -> dict | None:
    """Post-hoc loop check of a finished window's tokens (eos dropped), with the default guard."""
    ids = [t for t in tokens if t not in set(eos_ids)]
    return (guard or RepetitionGuard()).find(ids)


# --------------------------------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------------------------------


def copy_state(model, state):
    """A new state of `model` holding the same buffers as `state` (read_state -> write_state).

    Every buffer is copied: for the decoder package the self-attention cache (2 x (L, Hkv, C, Dh))
    and the bound cross memory (2 x (L, Hkv, Tp, Dh) + the mask): the child hypothesis keeps the
    window's memory without binding it again. Full size: 9.4 MB cache + 14.7 MB memory
    per copy (fp16), host memory only, made only when a beam has several surviving children."""
    new = model.make_state()
    for name in model.state_description:
        new.write_state(name, np.array(state.read_state(name), copy=True))
    return new


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # sum of log-probs of every emitted token (before any trim)
    length: int  # tokens scored (normalisation length)
    stop_reason: StopReason
    repetition: dict | None = None
    token_log_probs: list[float] | None = None  # per token of `tokens` (with track_tokens)

    def normalised(self, length_penalty: float) -> float:
        return self.score / (max(self.length, 1) ** length_penalty)


@dataclass
class _Beam:
    tokens: list[int]
    score: float
    state: object
    log_probs: np.ndarray  # (V,) prediction for the next token
    token_log_probs: list[float] | None = None  # per token of `tokens` (with track_tokens)


def beam_search(
    step: Callable[[int, int, object], np.ndarray],
    model,
    state,
    log_probs: np.ndarray,
    position: int,
    limit: int,
    reason_at_limit: StopReason,
    eos_ids,
    beams: int,
    length_penalty: float = LENGTH_PENALTY,
    guard: RepetitionGuard | None = None,
    track_tokens: bool = False,
) -> dict:
    """Beam search from a state that has consumed the prompt.

    Args:
        step: step(token, position, state) -> (V,) log-probs after feeding `token` at `position`.
        model: the decoder (its make_state / state_description are used to copy states).
        state, log_probs: the state after the prompt and the prediction for the first new token.
        position: the cache slot the first new token goes to.
        limit: most new tokens per hypothesis (the last one is emitted without being fed).
        reason_at_limit: stop reason of a hypothesis that reaches `limit` (CAPACITY | MAX_NEW_TOKENS).
        eos_ids: ids that finish a hypothesis.
        beams: hypotheses kept per step (>= 1).
        track_tokens: also carry each hypothesis' per-token log-probs (the log-prob of each token at the
            step that chose it: what a word's confidence is made of); off, nothing extra is kept.
    Returns:
        {"token_ids", "stop_reason", "score", "normalised_score", "repetition", "calls", "steps",
         "hypotheses": [(tokens, normalised score, stop reason)] best first,
         "token_log_probs": the best hypothesis' per-token log-probs (None without track_tokens)}
    """
    if beams < 1:
        raise DecodingError(f"beams must be >= 1, got {beams}")
    eos = set(int(e) for e in eos_ids)
    live = [_Beam([], 0.0, state, np.asarray(log_probs, dtype=np.float64).reshape(-1), [] if track_tokens else None)]
    finished: list[Hypothesis] = []
    calls = 0
    width = 2 * beams  # candidates per beam: enough to keep `beams` live after eos ones leave
    while live:
        candidates = []  # (score, beam index, token)
        for bi, beam in enumerate(live):
            lp = beam.log_probs
            if not np.all(np.isfinite(lp)):
                raise DecodingError(f"decoder produced non-finite log-probs at position {position - 1}")
            top = np.argsort(-lp, kind="stable")[:width]  # first index on ties, as argmax
            candidates.extend((beam.score + float(lp[t]), bi, int(t)) for t in top)
        candidates.sort(key=lambda c: -c[0])  # stable: beam order, then token rank, on ties
        chosen = []  # (score, parent index, tokens, per-token log-probs or None)
        for rank, (score, bi, token) in enumerate(candidates):
            parent = live[bi]
            tokens = parent.tokens + [token]
            scores = parent.token_log_probs + [float(parent.log_probs[token])] if track_tokens else None
            if token in eos:
                if rank < beams:
                    finished.append(Hypothesis(tokens, score, len(tokens), StopReason.EOS, token_log_probs=scores))
                continue
            hit = guard.find(tokens) if guard is not None else None
            if hit is not None:
                kept = guard.trim(tokens, hit)
                finished.append(Hypothesis(kept, score, len(tokens), StopReason.REPETITION, hit,
                                           scores[: len(kept)] if track_tokens else None))
            elif len(tokens) >= limit:
                finished.append(Hypothesis(tokens, score, len(tokens), StopReason(reason_at_limit), token_log_probs=scores))
            else:
                chosen.append((score, bi, tokens, scores))
            if len(chosen) >= beams:
                break
        if not chosen:
            break
        if len(finished) >= beams:
            worst_kept = sorted(h.normalised(length_penalty) for h in finished)[-beams]
            best_live = chosen[0][0] / (len(chosen[0][2]) ** length_penalty)
            if worst_kept >= best_live:
                break
        # states: the first child of a beam takes its state; further children get copies, made
        # before any child feeds its token
        taken: set[int] = set()
        states = []
        for _, bi, _, _ in chosen:
            if bi in taken:
                states.append(copy_state(model, live[bi].state))
            else:
                taken.add(bi)
                states.append(live[bi].state)
        new_live = []
        for (score, _, tokens, scores), st in zip(chosen, states):
            lp = np.asarray(step(tokens[-1], position, st), dtype=np.float64).reshape(-1)
            calls += 1
            new_live.append(_Beam(tokens, score, st, lp, scores))
        position += 1
        live = new_live
    finished.sort(key=lambda h: -h.normalised(length_penalty))
    best = finished[0]
    return {
        "token_ids": best.tokens,
        "stop_reason": best.stop_reason,
        "score": best.score,
        "normalised_score": best.normalised(length_penalty),
        "repetition": best.repetition,
        "calls": calls,
        "steps": position,
        "hypotheses": [(h.tokens, h.normalised(length_penalty), h.stop_reason) for h in finished[:beams]],
        "token_log_probs": best.token_log_probs,
    }
