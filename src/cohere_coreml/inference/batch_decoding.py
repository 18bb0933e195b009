"""Greedy decoding of several windows at once through the decoder's batched step (`step_batch`).

A step reads every decoder weight to produce one token; `step_batch` produces one token for each of B windows
in one call (docs/decoder.md, "Batched windows"). Its state holds B rows (`DecoderShapes.batch_state_shapes`),
each row one window: its cross memory, its cache, its position. `BatchDecoder` is the function and the host's
writes into its rows; `decode_windows` is the loop, the rule docs/bundle.md writes out for the Swift port:

    rows start free; while a row is free and a window waits: the window enters the row (its memory written into
        the row, its position 0, its prompt queued);
    every call: a busy row feeds its next prompt token, else its last prediction, at its position, its cache_mask
        opening slots < position; a free row feeds EXTEND_PAD_ID at slot 0 with every slot closed (output unused);
    after the call, each busy row: its new K/V rows written at its position, position + 1; once its prompt is
        fed, argmax of its log-probs is its next token; eos, the guard or the token limit end the window, which
        leaves the row (refilled before the next call: finished windows leave, waiting ones take their place).

A row is refilled, not dropped: the batch keeps its static size B (the function has one shape), and a free
row costs little (a step is bound by the weights it reads, which B rows share). The refilled row's cache is not
cleared: its `cache_mask` opens only slots below its position, each written by its own window before any token
reads it, so the previous window's rows are never attended to (their softmax weight is exactly 0).
Each window's tokens are the ones the batch-1 loop (`Transcriber.decode`, greedy) gives it.

The encoder runs ahead of the decoder (`encoded_ahead`): while the rows decode, a worker thread computes the next
windows' features and encoder outputs, at most `ahead` windows not yet taken by a row, so at most B + `ahead`
memories are held. A row is still refilled from the waiting windows in clip order, waiting for the next one when
it is not ready yet, so the calls (which window, which row, which position) are the ones without it, and so are
the tokens. The two stages run different programs (the front end and encoder; the decoder's batched step and its
state), each loaded and called from one thread only: no model or state is shared between the threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..config import (
    CACHE_MASK_INPUT,
    EXTEND_PAD_ID,
    FP16_MASK_VALUE,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    STEP_BATCH_FUNCTION,
)
from .decoder_runtime import DecoderRuntimeError, memory_frames
from .decoding import DecodeResult, RepetitionGuard, StopReason

logger = logging.getLogger(__name__)


class BatchDecoder:
    """The batched step of one host-state decoder package and the host's writes into its rows.

    `model`: the loaded `step_batch` function (`runtime.load_model`), or any object with its descriptions,
    `make_state` and `predict` (the PyTorch twin in `export.decoder`)."""

    def __init__(self, model):
        self.model = model
        states = model.state_description
        missing = [n for n in ("self_k", *MEMORY_NAMES) if n not in states]
        if missing or CACHE_MASK_INPUT not in model.input_description:
            raise DecoderRuntimeError(f"{STEP_BATCH_FUNCTION} lacks the states {missing} or its {CACHE_MASK_INPUT} "
                                      "input: re-export the decoder")
        self.batch = int(model.input_description["input_ids"][0][0])  # (B, 1)
        cache = states["self_k"][0]  # (L, B*Hkv, C, Dh)
        self.kv_heads = int(cache[1]) // self.batch
        self.capacity = int(cache[2])
        self.state_bytes_written = 0  # rows and memories the host wrote (a benchmark's counter)

    @classmethod
    def load(cls, path, backend: str = "auto", compute_units: str = "all", num_threads: int | None = None,
             cache=None) -> BatchDecoder:
        from ..runtime import load_model

        return cls(load_model(str(path), backend=backend, function_name=STEP_BATCH_FUNCTION,
                              compute_units=compute_units, num_threads=num_threads, cache=cache))

    @property
    def backend(self) -> str:
        return self.model.backend

    def make_state(self):
        """A zeroed state of B rows."""
        return self.model.make_state()

    def _write(self, state, name: str, value: np.ndarray, start: tuple) -> None:
        """`value` into the state buffer `name` at `start` (one offset per axis): in place where the state can
        (the interpreter; Swift's `MLState.withMultiArray(for:)`), else the whole buffer read, changed, written."""
        value = np.asarray(value, dtype=np.float16)
        in_place = getattr(state, "write_state_slice", None)
        if in_place is not None:
            in_place(name, value, start)
            self.state_bytes_written += value.nbytes
            return
        buffer = np.array(state.read_state(name), dtype=np.float16, copy=True)
        buffer[tuple(slice(s, s + n) for s, n in zip(start, value.shape))] = value
        state.write_state(name, buffer)
        self.state_bytes_written += buffer.nbytes

    def bind_row(self, state, row: int, memory: dict) -> int:
        """Write one window's cross memory (the encoder's outputs) into row `row`: cross_k / cross_v heads
        row*Hkv..(row+1)*Hkv-1 of every layer, cross_mask row `row`. Returns the valid frames (checked against
        `memory["encoder_length"]` when present). The row's cache is left as it is (`cache_mask` hides it)."""
        if not 0 <= row < self.batch:
            raise DecoderRuntimeError(f"row {row} is outside the batch of {self.batch}")
        missing = [k for k in MEMORY_NAMES if k not in memory]
        if missing:
            raise DecoderRuntimeError(f"the encoder outputs lack {missing}: the decoder state needs {list(MEMORY_NAMES)}")
        states = self.model.state_description
        for name in MEMORY_NAMES:
            value = np.asarray(memory[name], dtype=np.float16)
            shape = list(states[name][0])
            if name == "cross_mask":
                shape[0], start = 1, (row, 0, 0, 0)
            else:
                shape[1], start = self.kv_heads, (0, row * self.kv_heads, 0, 0)
            if tuple(value.shape) != tuple(shape):
                raise DecoderRuntimeError(f"the encoder's {name} is {tuple(value.shape)}, a row of the batched decoder "
                                          f"state {tuple(shape)}: encoder and decoder of different exports")
            self._write(state, name, value, start)
        bound = memory_frames(memory["cross_mask"])
        if "encoder_length" in memory:
            expected = int(np.asarray(memory["encoder_length"]).reshape(-1)[0])
            if bound != expected:
                raise DecoderRuntimeError(f"the cross memory has {bound} valid frames but the encoder reports "
                                          f"encoder_length {expected}: cross_mask and encoder_length disagree")
        return bound

    def inputs(self, tokens, positions) -> dict[str, np.ndarray]:
        """The call's inputs: `tokens[b]` at slot `positions[b]` for each busy row; a free row (position None)
        feeds EXTEND_PAD_ID at slot 0 with every cache slot closed."""
        if len(tokens) != self.batch or len(positions) != self.batch:
            raise DecoderRuntimeError(f"the batched step takes {self.batch} rows, got {len(tokens)} tokens and "
                                      f"{len(positions)} positions")
        ids = np.full((self.batch, 1), EXTEND_PAD_ID, dtype=np.int32)
        pos = np.zeros((self.batch,), dtype=np.int32)
        mask = np.full((self.batch, 1, 1, self.capacity), FP16_MASK_VALUE, dtype=np.float16)
        for b, (token, position) in enumerate(zip(tokens, positions)):
            if position is None:
                continue
            if not 0 <= position < self.capacity:
                raise DecoderRuntimeError(f"row {b}: position {position} is outside the cache ({self.capacity} slots)")
            ids[b, 0], pos[b] = int(token), int(position)
            mask[b, ..., : int(position)] = 0
        return {"input_ids": ids, "position": pos, CACHE_MASK_INPUT: mask}

    def step(self, state, tokens, positions) -> np.ndarray:
        """One call: each busy row's token at its position (free rows: position None); writes each busy row's new
        K/V rows at its position. Returns the (B, V) log-probs (a free row's row: not meaningful)."""
        out = self.model.predict(self.inputs(tokens, positions), state=state)
        hkv = self.kv_heads
        busy = [(b, int(p)) for b, p in enumerate(positions) if p is not None]
        for name, output in NEW_ROWS_OUTPUTS.items():
            rows = np.asarray(out[output], dtype=np.float16)  # (L, B*Hkv, 1, Dh)
            if getattr(state, "write_state_slice", None) is not None:  # in place, row by row
                for b, position in busy:
                    self._write(state, name, rows[:, b * hkv : (b + 1) * hkv], (0, b * hkv, position, 0))
                continue
            # coremltools' MLState: the whole buffer read and written once for every row of the call
            buffer = np.array(state.read_state(name), dtype=np.float16, copy=True)
            for b, position in busy:
                buffer[:, b * hkv : (b + 1) * hkv, position : position + 1] = rows[:, b * hkv : (b + 1) * hkv]
            state.write_state(name, buffer)
            self.state_bytes_written += buffer.nbytes
        return np.asarray(out["log_probs"]).reshape(self.batch, -1)


@dataclass
class _Row:
    """One window in a row of the batch."""

    key: object
    pending: list[int]  # prompt tokens still to feed
    limit: int
    reason_at_limit: StopReason
    position: int = 0
    last: int | None = None  # the last prediction, fed at the next call
    generated: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    bind_s: float = 0.0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    calls: int = 0

    def token(self) -> int:
        return self.pending[0] if self.pending else int(self.last)


def token_limit(prompt_len: int, capacity: int, max_new_tokens: int | None) -> tuple[int, StopReason]:
    """New tokens a window may take and the stop reason when it takes them all (as `Transcriber.decode`): every
    fed token takes a slot and the last prediction is not fed, so capacity - prompt + 1, or `max_new_tokens`."""
    limit, reason = int(capacity) - int(prompt_len) + 1, StopReason.CAPACITY
    if max_new_tokens is not None and max_new_tokens < limit:
        limit, reason = int(max_new_tokens), StopReason.MAX_NEW_TOKENS
    return limit, reason


def decode_windows(decoder: BatchDecoder, windows: Iterable[tuple[object, dict]], prompt, eos_ids,
                   max_new_tokens: int | None = None, repetition_guard: RepetitionGuard | None = None,
                   token_scores: bool = False) -> Iterator[tuple[object, DecodeResult]]:
    """Greedy decoding of `windows` ((key, encoder outputs) pairs, read one at a time as rows free up: at most B
    memories are held) B at a time, by the rule of this module's docstring. Yields (key, `DecodeResult`) as
    windows finish (not in input order). A result's `calls` counts the batched calls the window took part in,
    its times are its share of them (a call's time split over its busy rows)."""
    prompt = [int(t) for t in prompt]
    if len(prompt) >= decoder.capacity:
        raise DecoderRuntimeError(f"prompt of {len(prompt)} tokens does not fit the cache ({decoder.capacity} slots)")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise DecoderRuntimeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos_ids = {int(t) for t in eos_ids}
    limit, reason_at_limit = token_limit(len(prompt), decoder.capacity, max_new_tokens)
    waiting = iter(windows)
    state = decoder.make_state()
    rows: list[_Row | None] = [None] * decoder.batch

    def refill() -> None:
        for b in range(decoder.batch):
            if rows[b] is None:
                nxt = next(waiting, None)
                if nxt is None:
                    return
                key, memory = nxt
                t0 = time.perf_counter()
                decoder.bind_row(state, b, memory)
                rows[b] = _Row(key=key, pending=list(prompt), limit=limit, reason_at_limit=reason_at_limit,
                               bind_s=time.perf_counter() - t0)

    refill()
    while any(r is not None for r in rows):
        busy = [r for r in rows if r is not None]
        t0 = time.perf_counter()
        log_probs = decoder.step(state, [r.token() if r else EXTEND_PAD_ID for r in rows],
                                 [r.position if r else None for r in rows])
        share = (time.perf_counter() - t0) / len(busy)
        for b, row in enumerate(rows):
            if row is None:
                continue
            row.calls += 1
            row.position += 1
            if row.pending:
                row.pending.pop(0)
                if row.pending:  # a prediction inside the prompt: never read
                    row.prompt_s += share
                    continue
                row.prompt_s += share
            else:
                row.decode_s += share
            lp = log_probs[b]
            if not np.all(np.isfinite(lp)):
                raise DecoderRuntimeError(f"decoder produced non-finite log-probs at position {row.position - 1} "
                                          f"(batch row {b})")
            token = int(np.argmax(lp))
            row.generated.append(token)
            if token_scores:
                row.scores.append(float(lp[token]))
            stop, repetition = None, None
            if token in eos_ids:
                stop = StopReason.EOS
            elif repetition_guard is not None and (repetition := repetition_guard.find(row.generated)) is not None:
                row.generated = repetition_guard.trim(row.generated, repetition)
                row.scores = row.scores[: len(row.generated)]
                stop = StopReason.REPETITION
            elif len(row.generated) >= row.limit:
                stop = row.reason_at_limit
            if stop is None:
                row.last = token
                continue
            rows[b] = None
            yield row.key, DecodeResult(
                token_ids=row.generated, stop_reason=stop, bind_s=row.bind_s, prompt_s=row.prompt_s,
                decode_s=row.decode_s, steps=row.position, calls=row.calls, tokens_fed=row.calls,
                repetition=repetition, token_log_probs=row.scores if token_scores else None)
        refill()


def encoded_ahead(items: Iterable, ahead: int) -> Iterator:
    """`items` in order, computed by a worker thread at most `ahead` items before the consumer takes them (an item
    computed, or being computed, and not yet taken counts); `ahead` 0: computed here, when taken. The iterable is
    advanced in the worker only (a file's reader and the encoder run there). An exception it raises is raised here,
    in its place; closing this generator (the consumer stopped) stops the worker after the item it is computing."""
    if ahead <= 0:
        yield from items
        return
    slots = threading.Semaphore(ahead)  # items the worker may compute before the consumer takes one
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    done = object()

    def work() -> None:
        source = iter(items)
        try:
            while True:
                slots.acquire()
                if stop.is_set():
                    return
                try:
                    item = next(source)
                except StopIteration:
                    results.put((done, None))
                    return
                except BaseException as err:  # noqa: BLE001 - any error belongs to the consumer, raised there
                    results.put((None, err))
                    return
                results.put((item, None))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=work, name="encoder-ahead", daemon=True)
    worker.start()
    try:
        while True:
            item, err = results.get()
            if err is not None:
                raise err
            if item is done:
                return
            slots.release()
            yield item
    finally:
        stop.set()
        slots.release()  # a worker waiting for a slot wakes, sees `stop` and returns
        worker.join()


def transcribe_batched(engine, decoder: BatchDecoder, pieces, prompt, max_new_tokens: int | None = None,
                       repetition_guard: RepetitionGuard | None = None, ahead: int = 0, features=None,
                       encode=None) -> list:
    """A clip's windows ((start, end, samples) pieces) through `decode_windows`: each window's features and encoder
    (`features`, `encode`: by default `engine.features`, `engine.encode` of a `transcribe.Transcriber`) computed
    `ahead` windows before a row takes them (`encoded_ahead`; 0: when a row is free for it), so at most B + `ahead`
    memories are held; returns its `engines.WindowResult`s in clip order, as `Transcriber.transcribe_window`
    gives them (timings: the window's features and encoder, `encoder_wait_s` the decoder's wait for its memory,
    its share of the batched calls, `decoder_batch`, `encoder_ahead`)."""
    from ..model.tokens import decode_ids
    from .engines import WindowResult

    features = engine.features if features is None else features
    encode = engine.encode if encode is None else encode
    sr = engine.front_end.sampling_rate
    seen: dict[int, tuple[float, float, dict]] = {}

    def memories():
        for i, (start, _end, piece) in enumerate(pieces):
            t0 = time.perf_counter()
            feats, n_valid, encoder_function = features(piece)
            t1 = time.perf_counter()
            enc = encode(feats, n_valid)
            seen[i] = (start / sr, len(piece) / sr, {"features_s": t1 - t0, "front_end": engine.front_end_kind,
                                                     "encoder_s": time.perf_counter() - t1,
                                                     "encoder_function": encoder_function})
            yield i, enc

    waits: dict[int, float] = {}

    def taken(source):  # the decoder's wait for each memory (the whole encoder's time without `ahead`)
        source = iter(source)
        try:
            while True:
                t0 = time.perf_counter()
                item = next(source, None)
                if item is None:
                    return
                waits[item[0]] = time.perf_counter() - t0
                yield item
        finally:
            source.close()

    windows = {}
    source = taken(encoded_ahead(memories(), ahead))
    try:
        results = list(decode_windows(decoder, source, prompt, engine.eos_ids, max_new_tokens, repetition_guard))
    finally:
        source.close()  # a decode that failed: the worker stops (and the file's reader closes) before this returns
    for i, dec in results:
        start_s, duration_s, timings = seen.pop(i)
        timings.update(encoder_wait_s=waits.pop(i), bind_s=dec.bind_s, prompt_s=dec.prompt_s, decode_s=dec.decode_s,
                       decoder_calls=dec.calls, decoder_tokens_fed=dec.tokens_fed, decoder_batch=decoder.batch,
                       encoder_ahead=int(ahead),
                       ms_per_decoder_call=1000.0 * (dec.prompt_s + dec.decode_s) / max(dec.calls, 1))
        if dec.truncated:
            logger.warning("window %d stopped without eos (%s) after %d tokens", i, dec.stop_reason, len(dec.token_ids))
        text = decode_ids(engine.tokenizer, [t for t in dec.token_ids if t not in engine.eos_ids])
        windows[i] = WindowResult(index=i, start_s=start_s, duration_s=duration_s, token_ids=dec.token_ids, text=text,
                                  truncated=dec.truncated, stop_reason=dec.stop_reason, timings=timings,
                                  decoding={"beams": 1, "repetition": dec.repetition})
    return [windows[i] for i in sorted(windows)]


__all__ = ["BatchDecoder", "decode_windows", "encoded_ahead", "token_limit", "transcribe_batched"]
