"""Beam search and the repetition guard, on a stateful toy decoder whose log-probs depend on the
whole fed prefix (through its state), through the real `Transcriber.decode` loop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cohere_coreml.inference.decoder_runtime import DecoderRuntime
from cohere_coreml.inference.decoding import RepetitionGuard, beam_search, copy_state
from cohere_coreml.inference.transcribe import Transcriber

PRIME = 1_000_003


class ToyState:
    def __init__(self):
        self.buffers = {"h": np.zeros((1,), np.float32)}

    def read_state(self, name):
        return self.buffers[name]

    def write_state(self, name, value):
        self.buffers[name] = np.array(value, np.float32)


class ToyDecoder:
    """log_probs = log_softmax(table[hash(prefix) % rows]); the prefix hash lives in the state only."""

    backend = "toy"
    state_description = {"h": ((1,), np.float32)}
    # a package without prefill or extend: the prompt by steps, through the runtime's own feed logic
    prefill_length = extend_length = None
    capacity = 4096
    plan = DecoderRuntime.plan
    feed = DecoderRuntime.feed

    def __init__(self, vocab=6, seed=0, eos=0, eos_bias=0.0, loop=None):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((4096, vocab)) * 2.0
        self.table[:, eos] += eos_bias
        self.loop = loop  # token sequence to force (a decoder loop) after the prompt
        self.calls = 0
        self.binds = 0

    def make_state(self):
        return ToyState()

    # the `DecoderRuntime` interface the Transcriber uses: bind (a no-op here), then steps
    def new_state(self, memory):
        self.binds += 1
        return self.make_state()

    def step(self, state, token, position):
        return self.predict({"input_ids": np.array([[token]]), "position": np.array([position])}, state)["log_probs"][0]

    @staticmethod
    def fold(h, token):
        return float((int(h) * 31 + int(token) + 7) % 4096)

    def log_probs_for(self, h, position):
        row = self.table[int(h)]
        if self.loop is not None and position >= 9:  # from the first generated token
            row = np.full_like(row, -5.0)
            row[self.loop[(position - 9) % len(self.loop)]] = 5.0
        return (row - np.log(np.exp(row - row.max()).sum()) - row.max()).astype(np.float32)

    def predict(self, inputs, state=None):
        self.calls += 1
        token, position = int(inputs["input_ids"][0, 0]), int(inputs["position"][0])
        h = self.fold(state.read_state("h")[0], token)
        state.write_state("h", [h])
        return {"log_probs": self.log_probs_for(h, position)[None]}


def toy_transcriber(decoder, capacity=32, eos=0):
    tr = Transcriber.__new__(Transcriber)  # the decode loop alone: no packages, no tokenizer
    tr.decoder, tr.prefill, tr.prefill_length = decoder, None, None
    tr.capacity, tr.eos_ids = capacity, {eos}
    return tr


ENC = {"cross_k": np.zeros(1), "cross_v": np.zeros(1), "cross_mask": np.zeros(1)}
PROMPT = [5, 4, 3, 2, 1, 5, 4, 3, 2, 1]


def sequence_score(decoder, tokens):
    """Sum of log-probs of `tokens` after PROMPT, recomputed without any state object."""
    h, score = 0.0, 0.0
    for p, t in enumerate(PROMPT):
        h = decoder.fold(h, t)
    lp = decoder.log_probs_for(h, len(PROMPT) - 1)
    for i, t in enumerate(tokens):
        score += float(lp[t])
        h = decoder.fold(h, t)
        lp = decoder.log_probs_for(h, len(PROMPT) + i)
    return score


def run_beam(tr, beams, max_new_tokens=None, length_penalty=1.0, guard=None):
    """beam_search through the same step function the Transcriber uses."""
    limit = tr.capacity - len(PROMPT) + 1
    reason = "capacity"
    if max_new_tokens is not None and max_new_tokens < limit:
        limit, reason = max_new_tokens, "max_new_tokens"
    state = tr.decoder.make_state()

    def step(token, position, st):
        return tr.decoder.predict({"input_ids": np.array([[token]]), "position": np.array([position])}, st)["log_probs"][0]

    for p, t in enumerate(PROMPT):
        lp = step(t, p, state)
    return beam_search(step, tr.decoder, state, lp, len(PROMPT), limit, reason, tr.eos_ids, beams,
                       length_penalty=length_penalty, guard=guard)


@pytest.mark.parametrize("seed", range(12))
def test_one_beam_is_greedy_token_for_token(seed):
    """beams=1 through the beam search makes the greedy loop's decisions (eos and capacity ends)."""
    decoder = ToyDecoder(seed=seed, eos_bias=[-1.0, 0.5, 1.5][seed % 3])
    tr = toy_transcriber(decoder)
    greedy = tr.decode(ENC, PROMPT)
    beam = run_beam(tr, 1)
    assert beam["token_ids"] == greedy.token_ids
    assert beam["stop_reason"] == greedy.stop_reason
    assert beam["steps"] == greedy.steps
    limited = tr.decode(ENC, PROMPT, max_new_tokens=3)
    assert run_beam(tr, 1, max_new_tokens=3)["token_ids"] == limited.token_ids


def test_greedy_decisions_cover_both_endings():
    reasons = {toy_transcriber(ToyDecoder(seed=s, eos_bias=b)).decode(ENC, PROMPT).stop_reason
               for s in range(12) for b in (-1.0, 0.5, 1.5)}
    assert reasons == {"eos", "capacity"}


def exhaustive_best(decoder, vocab, limit, eos=0):
    best, best_tokens = -np.inf, None
    for n in range(1, limit + 1):
        for seq in itertools.product(range(vocab), repeat=n):
            if eos in seq[:-1] or (seq[-1] != eos and n < limit):  # only eos or the limit end a sequence
                continue
            score = sequence_score(decoder, list(seq))
            if score > best:
                best, best_tokens = score, list(seq)
    return best_tokens, best


@pytest.mark.parametrize("seed", range(4))
def test_wide_beam_finds_the_best_sequence(seed):
    """With every prefix kept (4 tokens, 4 steps, 64 beams, no length normalisation) the search is
    exhaustive: its answer is the best-scoring sequence. Scores are recomputed without states, so
    beams that shared or lost a state would fail."""
    decoder = ToyDecoder(vocab=4, seed=seed, eos_bias=0.3)
    tr = toy_transcriber(decoder)
    got = run_beam(tr, 64, max_new_tokens=4, length_penalty=0.0)
    tokens, score = exhaustive_best(decoder, 4, 4)
    assert got["token_ids"] == tokens
    assert got["score"] == pytest.approx(score, abs=1e-4)


def test_beam_scores_match_stateless_recomputation_and_beat_greedy():
    found_better = 0
    for seed in range(10):
        decoder = ToyDecoder(seed=seed, eos_bias=1.0)
        tr = toy_transcriber(decoder)
        greedy = tr.decode(ENC, PROMPT).token_ids
        out = tr.decode(ENC, PROMPT, beams=4)
        searched = run_beam(tr, 4)
        assert out.token_ids == searched["token_ids"]
        assert searched["score"] == pytest.approx(sequence_score(decoder, searched["token_ids"]), abs=1e-3)
        norm = lambda toks: sequence_score(decoder, toks) / len(toks)  # noqa: E731
        assert norm(searched["token_ids"]) >= norm(greedy) - 1e-6
        found_better += norm(searched["token_ids"]) > norm(greedy) + 1e-6
    assert found_better >= 1, "beam search never beat greedy on the toy decoders: the test is too easy"


def test_copy_state_is_independent():
    decoder = ToyDecoder()
    a = decoder.make_state()
    a.write_state("h", [3.0])
    b = copy_state(decoder, a)
    a.write_state("h", [9.0])
    assert b.read_state("h")[0] == 3.0


def test_guard_finds_loops_only():
    guard = RepetitionGuard()
    assert guard.find([1, 2, 3] + [7] * 12) == {"ngram": 1, "repeats": 12, "start": 3}
    assert guard.find([1, 2] + [4, 5, 6, 8] * 3) == {"ngram": 4, "repeats": 3, "start": 2}
    assert guard.find([1] + [4, 5] * 6)["ngram"] == 2
    assert guard.find([7] * 11) is None  # short of the span
    assert guard.find([3, 8, 8, 8, 8, 2]) is None  # "eight eight eight eight" is speech, not a loop
    assert guard.find([4, 5, 6, 8] * 3 + [1]) is None  # the tail moved on
    assert guard.trim([1, 2] + [4, 5, 6, 8] * 3, guard.find([1, 2] + [4, 5, 6, 8] * 3)) == [1, 2, 4, 5, 6, 8]


def test_guard_stops_a_loop_and_reports_it():
    decoder = ToyDecoder(loop=[3, 4, 5])
    tr = toy_transcriber(decoder, capacity=64)
    free = tr.decode(ENC, PROMPT)
    assert free.stop_reason == "capacity" and len(free.token_ids) == 55
    guarded = tr.decode(ENC, PROMPT, repetition_guard=RepetitionGuard())
    assert guarded.stop_reason == "repetition" and guarded.truncated
    assert guarded.repetition == {"ngram": 3, "repeats": 4, "start": 0}
    assert guarded.token_ids == [3, 4, 5]
    beamed = tr.decode(ENC, PROMPT, beams=3, repetition_guard=RepetitionGuard())
    assert beamed.stop_reason == "repetition" and beamed.token_ids == [3, 4, 5]


@pytest.mark.parametrize("seed", range(8))
def test_guard_changes_nothing_without_a_loop(seed):
    decoder = ToyDecoder(seed=seed, eos_bias=0.5)
    tr = toy_transcriber(decoder)
    plain = tr.decode(ENC, PROMPT)
    guarded = tr.decode(ENC, PROMPT, repetition_guard=RepetitionGuard())
    assert RepetitionGuard().find(plain.token_ids) is None
    assert guarded.token_ids == plain.token_ids and guarded.stop_reason == plain.stop_reason
    assert guarded.repetition is None


def test_dict_access_of_a_decode_result_still_works_and_warns():
    """The dict `decode` returned before `DecodeResult`: kept for one release, with a warning."""
    result = toy_transcriber(ToyDecoder(loop=[3, 4, 5]), capacity=64).decode(
        ENC, PROMPT, repetition_guard=RepetitionGuard())
    for key in ("token_ids", "stop_reason", "truncated", "repetition", "steps"):
        with pytest.warns(DeprecationWarning, match=rf"DecodeResult\['{key}'\] is deprecated: use the attribute \.{key}"):
            assert result[key] == getattr(result, key)
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        result["text"]


def test_bad_beams():
    tr = toy_transcriber(ToyDecoder())
    from cohere_coreml.inference.transcribe import TranscriptionError

    with pytest.raises(TranscriptionError, match="beams"):
        tr.decode(ENC, PROMPT, beams=0)


class _PrefixModel:
    """A decoder whose log-probs are a table of the generated prefix (kept in its state, so copies matter)."""

    state_description = {"p": ((8,), np.float32)}

    def make_state(self):
        s = ToyState()
        s.buffers = {"p": np.full((8,), -1.0, np.float32)}
        return s


def test_beam_candidates_per_beam_leave_room_for_eos_ones():
    """Each beam offers 2 x beams candidates: with only `beams`, a beam whose top tokens include eos
    offers too few live ones, and a better continuation of it is never explored. Here (beams 2, eos 0,
    tokens a=1, b=2, c=3) the best hypothesis, a b eos, needs beam `a`'s third token b: beam `a`'s top two
    are eos and a, beam `b`'s top two eos and c, and a+b (-0.8) outranks b+c (-1.1)."""
    eos, a, b, c = 0, 1, 2, 3

    def row(**lp):
        out = np.full(4, -3.0)
        for name, v in lp.items():
            out[{"eos": eos, "a": a, "b": b, "c": c}[name]] = v
        return out

    table = {
        (a,): row(eos=-0.5, a=-0.6, b=-0.7, c=-5.0),
        (b,): row(eos=-0.55, c=-0.9),
        (a, b): row(eos=-0.01, a=-5.0, b=-5.0, c=-5.0),
        (a, a): row(eos=-2.0),
    }

    def step(token, position, state):
        p = state.read_state("p").copy()
        p[position] = token
        state.write_state("p", p)
        return table.get(tuple(int(t) for t in p if t >= 0), row())

    model = _PrefixModel()
    first = row(a=-0.1, b=-0.2, eos=-5.0, c=-9.0)
    got = beam_search(step, model, model.make_state(), first, 0, 6, "max_new_tokens", [eos], beams=2,
                      length_penalty=1.0)
    assert got["token_ids"] == [a, b, eos]
    assert got["normalised_score"] == pytest.approx((-0.1 - 0.7 - 0.01) / 3)


def token_scores(decoder, tokens):
    """Each token's log-prob after PROMPT and the tokens before it, recomputed without any state object."""
    h = 0.0
    for t in PROMPT:
        h = decoder.fold(h, t)
    lp = decoder.log_probs_for(h, len(PROMPT) - 1)
    out = []
    for i, t in enumerate(tokens):
        out.append(float(lp[t]))
        h = decoder.fold(h, t)
        lp = decoder.log_probs_for(h, len(PROMPT) + i)
    return out


@pytest.mark.parametrize("beams", [1, 3])
def test_token_log_probs_are_each_tokens_log_prob_where_it_was_chosen(beams):
    """Word confidences are made of these: per generated token (eos included), its log-prob at the call that
    chose it (the prompt's last call for the first token, then steps; for beams the best hypothesis'
    own path), recomputed without states. Not asked, nothing is kept."""
    checked = 0
    for seed in range(6):
        decoder = ToyDecoder(seed=seed, eos_bias=1.0)
        tr = toy_transcriber(decoder)
        out = tr.decode(ENC, PROMPT, beams=beams, token_scores=True)
        assert len(out.token_log_probs) == len(out.token_ids)
        assert out.token_log_probs == pytest.approx(token_scores(decoder, out.token_ids), abs=1e-5)
        checked += len(set(out.token_log_probs)) > 1
        assert tr.decode(ENC, PROMPT, beams=beams).token_log_probs is None
    assert checked, "every token had the same log-prob: the check cannot tell tokens apart"


@pytest.mark.parametrize("beams", [1, 3])
def test_token_log_probs_follow_a_repetition_trim(beams):
    tr = toy_transcriber(ToyDecoder(loop=[3, 4, 5]), capacity=64)
    out = tr.decode(ENC, PROMPT, beams=beams, repetition_guard=RepetitionGuard(), token_scores=True)
    assert out.token_ids == [3, 4, 5] and len(out.token_log_probs) == 3


def test_keep_state_returns_the_windows_state():
    tr = toy_transcriber(ToyDecoder())
    assert tr.decode(ENC, PROMPT).state is None
    state = tr.decode(ENC, PROMPT, keep_state=True).state
    assert isinstance(state, ToyState) and state.read_state("h")[0] != 0.0
