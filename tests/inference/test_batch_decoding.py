"""Several windows decoded at once (`inference.batch_decoding`, the decoder's `step_batch`): per window the
tokens of the batch-1 loop, on the trained model's session bundle (its decoder has step_batch by default) and
a clip of more windows than rows, so rows are refilled; hosts that forget to reset a refilled row are caught."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

from cohere_coreml.bundle.format import BundleError
from cohere_coreml.bundle.load import Bundle
from cohere_coreml.config import DECODER_BATCH_DEFAULT, EXTEND_PAD_ID
from cohere_coreml.inference import batch_decoding
from cohere_coreml.inference.batch_decoding import BatchDecoder, decode_windows, encoded_ahead
from cohere_coreml.inference.decoding import RepetitionGuard, StopReason
from cohere_coreml.inference.transcribe import Transcriber, TranscriptionError
from cohere_coreml.model.audio import load_audio
from cohere_coreml.runtime.interpreter import MilState

from ..fixture_data import DATA_DIR, heldout_utterances

VECTORS = DATA_DIR / "batch_decoding_vectors.json"


def several_windows(count: int = 9, seed: int = 0) -> np.ndarray:
    """Held-out sentences of several languages one after the other with pauses of noise: the VAD packs them into
    windows of at most the bundle's 4 s, of different lengths (and so different token counts)."""
    rng = np.random.default_rng(seed)
    clips = [load_audio(u["path"]) for u in heldout_utterances(3)][:count]
    pieces = []
    for clip in clips:
        pieces += [clip, rng.normal(0, 2e-3, int(rng.uniform(0.5, 1.2) * 16000)).astype(np.float32)]
    return np.concatenate(pieces)


@pytest.fixture(scope="module")
def clip():
    return several_windows()


@pytest.fixture(scope="module")
def transcribers(trained_bundle):
    return {b: Transcriber(trained_bundle, backend="mil", decoder_batch=b) for b in (1, DECODER_BATCH_DEFAULT)}


@pytest.fixture(scope="module")
def one_at_a_time(transcribers, clip):
    return transcribers[1].transcribe(clip, "en")


def tokens(result) -> list[list[int]]:
    return [w.token_ids for w in result.windows]


def test_the_session_bundle_has_the_batched_step_and_its_gate_passed(trained_bundle):
    manifest = Bundle.load(trained_bundle).manifest["decoder"]
    assert manifest["functions"]["step_batch"] == "step_batch" and manifest["batch"]["size"] == DECODER_BATCH_DEFAULT
    report = json.loads((trained_bundle / "decoder.parity.json").read_text())["batch"]
    assert report["passed"] and report["size"] == DECODER_BATCH_DEFAULT and report["cases"] == 2
    assert all(r["decisive_flips_vs_step"] == 0 for r in report["rows"])
    # the controls: rows reading another row's memory or mask are refused by the same check
    assert report["discriminates"] and all(c["discriminates"] for c in report["controls"].values())


def test_batched_windows_are_token_identical_to_one_at_a_time(transcribers, clip, one_at_a_time):
    batched = transcribers[DECODER_BATCH_DEFAULT].transcribe(clip, "en")
    assert len(one_at_a_time.windows) > DECODER_BATCH_DEFAULT + 1  # rows refilled, windows of several lengths
    assert len({len(t) for t in tokens(one_at_a_time)}) > 1
    assert tokens(batched) == tokens(one_at_a_time)
    assert [w.stop_reason for w in batched.windows] == [w.stop_reason for w in one_at_a_time.windows]
    assert [(w.start_s, w.duration_s) for w in batched.windows] == [(w.start_s, w.duration_s)
                                                                   for w in one_at_a_time.windows]
    assert batched.text == one_at_a_time.text
    assert all(w.timings["decoder_batch"] == DECODER_BATCH_DEFAULT for w in batched.windows)
    assert "decoder_batch" not in one_at_a_time.windows[0].timings  # the batch-1 loop ran there


def test_token_limits_and_the_guard_stop_windows_as_one_at_a_time(transcribers, clip):
    """A window stopped by max_new_tokens keeps its row only that long; a refill follows at once."""
    for options in ({"max_new_tokens": 4}, {"max_new_tokens": 9, "repetition_guard": RepetitionGuard()}):
        one, batched = (transcribers[b].transcribe(clip, "en", **options) for b in (1, DECODER_BATCH_DEFAULT))
        assert tokens(batched) == tokens(one)
        assert [w.stop_reason for w in batched.windows] == [w.stop_reason for w in one.windows]
    assert StopReason.MAX_NEW_TOKENS in [w.stop_reason for w in one.windows]


class StaleRows:
    """A broken host: a refilled row's first window's slots stay in use (`offset`: the new window continues at
    the slots after the previous one, its cache_mask opening the previous window's rows, its positions shifted)."""

    def __init__(self, step):
        self.step, self.offset, self.last = step, {}, {}

    def __call__(self, decoder, state, tokens, positions):
        moved = []
        for b, p in enumerate(positions):
            if p == 0 and self.last.get(b, 0) > 0 and b not in self.offset:
                self.offset[b] = self.last[b] + 1  # a refill: the host forgot to start it at slot 0
            if p is not None:
                self.last[b] = p
            moved.append(None if p is None else p + self.offset.get(b, 0))
        return self.step(decoder, state, tokens, moved)


class OpenMask:
    """A broken host: a refilled row's cache_mask is not reset (the previous window's slots stay open)."""

    def __init__(self, inputs):
        self.inputs, self.high = inputs, {}

    def __call__(self, decoder, tokens, positions):
        out = self.inputs(decoder, tokens, positions)
        for b, p in enumerate(positions):
            if p is not None:
                self.high[b] = max(self.high.get(b, 0), p)
                out["cache_mask"][b, ..., : self.high[b]] = 0
        return out


@pytest.mark.parametrize("broken", ["position_not_reset", "mask_not_reset"])
def test_a_refill_that_forgets_to_reset_its_row_is_caught(transcribers, clip, one_at_a_time, monkeypatch, broken):
    if broken == "position_not_reset":
        host = StaleRows(BatchDecoder.step)
        monkeypatch.setattr(BatchDecoder, "step", lambda self, *args: host(self, *args))
    else:
        host = OpenMask(BatchDecoder.inputs)
        monkeypatch.setattr(BatchDecoder, "inputs", lambda self, *args: host(self, *args))
    wrong = transcribers[DECODER_BATCH_DEFAULT].transcribe(clip, "en")
    assert tokens(wrong) != tokens(one_at_a_time)


class WholeBuffers(MilState):
    """The interpreter's state with coremltools' `MLState` API only (no in-place slice write), as Python on a Mac."""

    @property
    def write_state_slice(self):
        raise AttributeError("write_state_slice")


def whole_buffers(state):
    state.__class__ = WholeBuffers
    return state


def test_whole_buffer_writes_give_the_same_tokens(transcribers, clip, one_at_a_time, monkeypatch):
    """The host's writes through whole buffers (read once, every busy row changed, written once a call)."""
    make = BatchDecoder.make_state
    monkeypatch.setattr(BatchDecoder, "make_state", lambda self: whole_buffers(make(self)))
    tr = transcribers[DECODER_BATCH_DEFAULT]
    decoder = tr.batch_decoder()
    before = decoder.state_bytes_written
    assert tokens(tr.transcribe(clip, "en")) == tokens(one_at_a_time)
    calls = sum(w.timings["decoder_calls"] for w in one_at_a_time.windows)  # at least this many batched row-calls
    cache = int(np.prod(decoder.model.state_description["self_k"][0])) * 2
    assert decoder.state_bytes_written - before >= 2 * cache * calls / DECODER_BATCH_DEFAULT


def test_beams_and_word_timings_decode_one_window_at_a_time(transcribers, clip, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the batched loop ran")

    monkeypatch.setattr(Transcriber, "transcribe_batched", refuse)
    tr = transcribers[DECODER_BATCH_DEFAULT]
    assert tr.transcribe(clip[: 3 * 16000], "en").windows  # one window: the batch-1 loop
    words = tr.transcribe(clip, "en", word_timestamps=True, max_new_tokens=3)
    assert words.words is not None and len(words.windows) > 1


def test_decoder_batch_other_than_the_bundles_is_refused_in_one_line(trained_bundle, trained_bundle_without_vad):
    with pytest.raises(TranscriptionError, match=r"decodes 4 windows at once.*use --decoder-batch 4 or 1"):
        Transcriber(trained_bundle, backend="mil", decoder_batch=3)
    assert Transcriber(trained_bundle, backend="mil").decoder_batch == DECODER_BATCH_DEFAULT


class Scripted:
    """A stand-in for `BatchDecoder`: window w (its memory {"window": w}) predicts token 100 + k at its k-th
    prediction and eos after `lengths[w]` of them; every call's rows are recorded as (window, token, position)."""

    def __init__(self, batch, capacity, lengths, eos):
        self.batch, self.capacity, self.lengths, self.eos = batch, capacity, lengths, eos
        self.calls, self.window = [], {}

    def make_state(self):
        return None

    def bind_row(self, state, row, memory):
        self.window[row] = memory["window"]

    def step(self, state, tokens, positions):
        rows, out = [], np.zeros((self.batch, 200), np.float32)
        for b, (t, p) in enumerate(zip(tokens, positions)):
            if p is None:
                assert t == EXTEND_PAD_ID
                rows.append(None)
                continue
            w = self.window[b]
            rows.append([w, int(t), int(p)])
            k = p - (self.prompt_len - 1)  # predictions after the prompt's last token: 0, 1, ...
            out[b, self.eos if k >= self.lengths[w] else 100 + max(k, 0)] = 1.0
        self.calls.append(rows)
        return out


def test_the_schedule_follows_the_written_rule():
    """The shared vectors (tests/data/batch_decoding_vectors.json, the rule of docs/bundle.md for the Swift port):
    which window each row holds at each call, the token it feeds and its position, and the finishing order."""
    data = json.loads(VECTORS.read_text())
    for case in data["cases"]:
        fake = Scripted(case["batch"], case["capacity"], case["generated"], data["eos"])
        fake.prompt_len = len(data["prompt"])
        done = [(key, r.token_ids, StopReason(r.stop_reason).value) for key, r in decode_windows(
            fake, ((w, {"window": w}) for w in range(len(case["generated"]))), data["prompt"], [data["eos"]],
            max_new_tokens=case.get("max_new_tokens"))]
        assert fake.calls == case["calls"], case["name"]
        assert [[k, ids, reason] for k, ids, reason in done] == case["finished"], case["name"]


def run_vectors(case: dict, data: dict) -> Scripted:
    fake = Scripted(case["batch"], case["capacity"], case["generated"], data["eos"])
    fake.prompt_len = len(data["prompt"])
    list(decode_windows(fake, ((w, {"window": w}) for w in range(len(case["generated"]))), data["prompt"],
                        [data["eos"]], max_new_tokens=case.get("max_new_tokens")))
    return fake


def test_a_schedule_that_breaks_the_rule_is_caught(monkeypatch):
    """The vectors see a loop whose refilled rows do not start at slot 0."""
    data = json.loads(VECTORS.read_text())
    case = next(c for c in data["cases"] if len(c["generated"]) > c["batch"])
    assert run_vectors(case, data).calls == case["calls"]

    class Late(batch_decoding._Row):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.position = 1 if self.key else 0  # a window entering after the first starts at a stale slot

    monkeypatch.setattr(batch_decoding, "_Row", Late)
    assert run_vectors(case, data).calls != case["calls"]


def test_bundle_check_refuses_a_batch_block_of_other_shapes(trained_bundle, tmp_path):
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(trained_bundle, out)
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["decoder"]["batch"]["size"] = 3
    path.write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"decoder\.batch\.size"):
        Bundle.load(out)


# -- the encoder ahead of the decoder ----------------------------------------------------------------------------


class Counted:
    """An iterable of `n` items that records, as each is computed, how many were computed and not yet taken by
    the consumer (`taken` is advanced by the test), the thread computing it, and whether it was closed."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.taken, self.outstanding, self.threads, self.closed = n, fail_at, 0, [], set(), False
        self.computed = 0

    def __iter__(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise TranscriptionError(f"window {i} cannot be read")
                self.threads.add(threading.current_thread().name)
                self.computed = i + 1
                self.outstanding.append(self.computed - self.taken)
                yield i
        finally:
            self.closed = True


def wait_for(condition, seconds=10.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


@pytest.mark.parametrize("ahead", [1, 3])
def test_items_are_computed_ahead_in_a_worker_at_most_ahead_not_yet_taken(ahead):
    source = Counted(8)
    got = []
    for item in encoded_ahead(source, ahead):
        # the worker fills its `ahead` slots while the consumer holds this item (and no more)
        assert wait_for(lambda: source.computed == min(source.n, len(got) + 1 + ahead) or False)
        time.sleep(0.02)
        assert source.computed == min(source.n, len(got) + 1 + ahead)
        got.append(item)
        source.taken = len(got)
    assert got == list(range(8))
    assert max(source.outstanding) == ahead + 1  # `ahead` waiting + the one just computed before the take counted
    assert source.threads == {"encoder-ahead"} and source.closed


def test_ahead_zero_computes_each_item_when_taken_in_the_callers_thread():
    source = Counted(5)
    got = []
    for item in encoded_ahead(source, 0):
        assert source.computed == len(got) + 1  # nothing computed before it is asked for
        got.append(item)
    assert got == list(range(5)) and source.threads == {threading.current_thread().name}


def test_an_error_of_the_source_is_raised_to_the_consumer_in_its_place():
    source = Counted(6, fail_at=3)
    got = []
    with pytest.raises(TranscriptionError, match="window 3 cannot be read"):
        for item in encoded_ahead(source, 2):
            got.append(item)
    assert got == [0, 1, 2] and source.closed
    assert not [t for t in threading.enumerate() if t.name == "encoder-ahead"]


def test_a_consumer_that_stops_early_stops_the_worker_and_closes_the_source():
    source = Counted(50)
    items = encoded_ahead(source, 2)
    assert next(items) == 0
    items.close()
    assert source.closed and source.computed <= 3  # stopped after the slots it had, not run to the end
    assert not [t for t in threading.enumerate() if t.name == "encoder-ahead"]


def spans(transcriber, monkeypatch):
    """Wall-clock spans of the encoder's calls and of the batched decoder's calls, recorded."""
    encodes, steps = [], []
    encode, step = transcriber.encoders.encode, BatchDecoder.step

    def timed_encode(*args):
        t0 = time.perf_counter()
        try:
            return encode(*args)
        finally:
            encodes.append((t0, time.perf_counter(), threading.current_thread().name))

    def timed_step(self, *args):
        t0 = time.perf_counter()
        try:
            return step(self, *args)
        finally:
            steps.append((t0, time.perf_counter(), (list(args[1]), list(args[2]))))  # tokens, positions

    monkeypatch.setattr(transcriber.encoders, "encode", timed_encode)
    monkeypatch.setattr(BatchDecoder, "step", timed_step)
    return encodes, steps


def overlapping(encodes, steps) -> int:
    return sum(any(a < d and c < b for c, d, _ in steps) for a, b, _ in encodes)


def test_the_encoder_runs_ahead_while_the_rows_decode_with_the_same_calls_and_tokens(transcribers, clip,
                                                                                     one_at_a_time, monkeypatch):
    tr = transcribers[DECODER_BATCH_DEFAULT]
    assert tr.encoder_ahead == DECODER_BATCH_DEFAULT  # the default: B windows ahead
    ahead_spans = spans(tr, monkeypatch)
    ahead = tr.transcribe(clip, "en")
    monkeypatch.undo()
    monkeypatch.setattr(tr, "encoder_ahead", 0)
    plain_spans = spans(tr, monkeypatch)
    plain = tr.transcribe(clip, "en")
    assert tokens(ahead) == tokens(plain) == tokens(one_at_a_time)
    # the same calls: each row's token and position (the schedule does not depend on the worker)
    assert [s[2] for s in ahead_spans[1]] == [s[2] for s in plain_spans[1]]
    assert {name for *_, name in ahead_spans[0]} == {"encoder-ahead"}
    assert {name for *_, name in plain_spans[0]} == {threading.current_thread().name}
    # windows after the first B were encoded while rows decoded; without it, never
    assert overlapping(*ahead_spans) > 0 and overlapping(*plain_spans) == 0
    assert [w.timings["encoder_ahead"] for w in ahead.windows] == [DECODER_BATCH_DEFAULT] * len(ahead.windows)
    assert all(w.timings["encoder_wait_s"] >= 0 for w in ahead.windows + plain.windows)


def test_an_encoder_error_ahead_of_the_decoder_is_the_callers_one_line_error(transcribers, clip, monkeypatch):
    tr = transcribers[DECODER_BATCH_DEFAULT]
    encode, calls = tr.encoders.encode, []

    def fail_on_the_sixth(*args):
        calls.append(threading.current_thread().name)
        if len(calls) == 6:
            raise TranscriptionError("window 6 is unreadable")
        return encode(*args)

    monkeypatch.setattr(tr.encoders, "encode", fail_on_the_sixth)
    with pytest.raises(TranscriptionError, match="window 6 is unreadable"):
        tr.transcribe(clip, "en")
    assert set(calls) == {"encoder-ahead"}
    assert not [t for t in threading.enumerate() if t.name == "encoder-ahead"]
    monkeypatch.undo()
    assert tr.transcribe(clip[: 8 * 16000], "en").windows  # the transcriber is usable after it


def test_encoder_ahead_below_zero_is_refused_in_one_line(trained_bundle):
    with pytest.raises(TranscriptionError, match=r"--encoder-ahead must be >= 0, got -1"):
        Transcriber(trained_bundle, backend="mil", encoder_ahead=-1)


def _set(path: tuple, value):
    def edit(decoder: dict) -> None:
        node = decoder
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


_DELETE = object()


@pytest.mark.parametrize("edit, field", [
    (_set(("batch", "size"), 1), "decoder.batch.size"),
    (_set(("batch", "size"), "4"), "decoder.batch.size"),
    (_set(("batch",), _DELETE), "decoder.batch"),
    (_set(("functions", "step_batch"), None), "decoder.batch"),
    (_set(("functions", "step_batch"), 5), "decoder.functions.step_batch"),
    (_set(("batch", "io"), None), "decoder.batch.io"),
    (_set(("batch", "io", "inputs", "encoder_length"), {"shape": [4], "dtype": "int32"}), "decoder.batch.io.inputs"),
    (_set(("batch", "io", "states", "cross_mask", "shape"), [1, 1, 1, 1]), "decoder.batch.io.states.cross_mask.shape"),
    (_set(("batch", "io", "outputs", "new_k", "shape"), [1, 1, 1, 1]), "decoder.batch.io.outputs.new_k.shape"),
])
def test_a_malformed_batch_block_is_refused_when_the_manifest_is_read(trained_bundle, tmp_path, edit, field):
    """Before any package is opened (the Swift manifest check refuses the same, naming the same field: its fuzz test
    compares both loaders' verdicts on the corpus of tools/data/make_fuzz_manifests.py)."""
    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    edit(manifest["decoder"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"field '{re.escape(field)}'"):
        Bundle.load([tmp_path, trained_bundle], check_package_io=False)
