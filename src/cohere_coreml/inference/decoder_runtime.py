"""The functions of one decoder.mlpackage used together on one state, through the runtime interface.

    memory  = encoder.predict(...)                      # cross_k, cross_v, cross_mask (+ encoder_length)
    state   = decoder.new_state(memory)                 # make_state, then the memory into it, once per window:
                                                        # written by this class (the default host-state package)
                                                        # or by the package's bind_memory (a graph-state one)
    lp      = decoder.prefill(state, prompt)            # or decoder.step(state, id, p) per prompt token
    lp      = decoder.extend(state, ids, start)         # up to K tokens from slot `start` in one call
    lp      = decoder.step(state, token, position)      # (V,) log-probs; binds only input_ids, position
    fed     = decoder.feed(state, ids, start)           # a forced prefix by `feed_plan`: prefill, extend, steps
    w       = decoder.align(state, ids, rows_from)      # word timings, after decoding `ids` on this state: the
                                                        # alignment heads' cross-attention, K rows a call

In the default host-state package the token functions only read the state: each call also gets its
`cache_mask` and returns its tokens' K/V rows (`new_k`, `new_v`), which this class writes at their slots
(`write_rows`). A graph-state package's functions write the state themselves.

`DecoderRuntime` is what the `Transcriber`, `verify`, the export gate and `quantize` run; the
PyTorch twin of the same interface is `decoder.TorchDecoder`. Beam search copies states with
`decoding.copy_state` (every buffer: the self-attention cache and the bound cross memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..config import (
    ALIGN_FUNCTION,
    ALIGN_OUTPUT,
    BIND_FUNCTION,
    BIND_INPUT_PREFIX,
    BIND_OUTPUT,
    CACHE_MASK_INPUT,
    DECODER_STATE_GRAPH,
    DECODER_STATE_HOST,
    EXTEND_FUNCTION,
    EXTEND_PAD_ID,
    FP16_MASK_VALUE,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    PREFILL_FUNCTION,
    STEP_FUNCTION,
)


class DecoderRuntimeError(RuntimeError):
    """The decoder package cannot be used as the bundle format says (missing function, bad memory)."""


def bind_inputs(memory: dict) -> dict[str, np.ndarray]:
    """bind_memory's inputs from the encoder's outputs: `cross_k` -> `encoder_cross_k`, ..."""
    missing = [k for k in MEMORY_NAMES if k not in memory]
    if missing:
        raise DecoderRuntimeError(f"the encoder outputs lack {missing}: bind_memory needs {list(MEMORY_NAMES)}")
    return {BIND_INPUT_PREFIX + k: memory[k] for k in MEMORY_NAMES}


def host_cache_mask(position: int, capacity: int) -> np.ndarray:
    """The host-state decoder's `cache_mask` for a call whose first token goes to slot `position`: fp16
    (1, 1, 1, C), 0 for the slots already filled (0..position-1), FP16_MASK_VALUE for the rest (the call's
    own tokens are not in the cache yet: the program attends to their K/V directly)."""
    mask = np.full((1, 1, 1, int(capacity)), FP16_MASK_VALUE, dtype=np.float16)
    mask[..., : int(position)] = 0
    return mask


def memory_frames(cross_mask) -> int:
    """Valid (unmasked) frames of an additive cross mask: what bind_memory returns as memory_length."""
    return int(np.sum(np.asarray(cross_mask, dtype=np.float32) > 0.5 * FP16_MASK_VALUE))


def write_rows(state, name: str, rows: np.ndarray, start: int) -> int:
    """Write `rows` (L, Hkv, S, Dh) into the state buffer `name` (L, Hkv, C, Dh) at slots start..start+S-1;
    returns the bytes written into the state.

    The interpreter's state (`MilState.write_state_slice`) writes those rows in place: one K/V row per
    layer and token, as Swift's `MLState.withMultiArray(for:)` does on a device. coremltools 9's `MLState`
    (Core ML on a Mac) has only whole-buffer `read_state` / `write_state`: the buffer is read, the rows
    replaced and the whole buffer written back."""
    rows = np.asarray(rows, dtype=np.float16)
    n = rows.shape[2]
    in_place = getattr(state, "write_state_slice", None)
    if in_place is not None:
        in_place(name, rows, (0, 0, int(start), 0))
        return rows.nbytes
    buffer = np.array(state.read_state(name), dtype=np.float16, copy=True)
    buffer[:, :, start : start + n] = rows
    state.write_state(name, buffer)
    return buffer.nbytes


def extend_inputs(ids, start: int, extend_len: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The extend function's inputs: input_ids (1, K) int32 (`ids`, then EXTEND_PAD_ID), position (1,).
    Refuses what the function cannot take (no token, more than K, past the cache)."""
    ids = [int(t) for t in ids]
    if not 1 <= len(ids) <= extend_len:
        raise DecoderRuntimeError(f"extend takes 1..{extend_len} tokens, got {len(ids)}")
    if start < 0 or start + extend_len > capacity:
        raise DecoderRuntimeError(f"extend writes slots {start}..{start + extend_len - 1}: past the cache "
                                  f"({capacity} slots)")
    padded = np.full((1, extend_len), EXTEND_PAD_ID, dtype=np.int32)
    padded[0, : len(ids)] = ids
    return padded, np.array([start], dtype=np.int32)


def align_starts(count: int, rows_from: int, length: int, capacity: int) -> list[int]:
    """The first slots of the align calls covering rows rows_from..count-1 of a window's `count` ids, `length`
    (K) rows a call; a call that would pass the cache starts at capacity - K instead (it recomputes rows)."""
    if not 1 <= count <= capacity:
        raise DecoderRuntimeError(f"align takes 1..{capacity} tokens (the cache capacity), got {count}")
    if not 0 <= rows_from < count:
        raise DecoderRuntimeError(f"align's rows_from must be 0..{count - 1} for {count} tokens, got {rows_from}")
    starts, start = [], int(rows_from)
    while start < count:
        start = min(start, int(capacity) - int(length))
        starts.append(start)
        start += int(length)
    return starts


def align_inputs(ids, start: int, length: int, capacity: int,
                 pad_id: int = EXTEND_PAD_ID) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One align call's inputs, the host-state extend's: input_ids (1, K) int32 (`ids`, the tokens for slots
    start.., then `pad_id`: any id, the slots are causal among themselves), position (1,) and cache_mask
    (`host_cache_mask(start, C)`: the decoded tokens' K/V at slots < start, read from the state)."""
    ids = [int(t) for t in ids]
    if not 1 <= len(ids) <= length or start < 0 or start + length > capacity:
        raise DecoderRuntimeError(f"align takes 1..{length} tokens at slots start..start+{length - 1} inside the "
                                  f"cache ({capacity} slots), got {len(ids)} from slot {start}")
    padded = np.full((1, int(length)), int(pad_id), dtype=np.int32)
    padded[0, : len(ids)] = ids
    return padded, np.array([start], dtype=np.int32), host_cache_mask(start, capacity)


def align_rows(call, ids, rows_from: int, length: int, capacity: int, pad_id: int = EXTEND_PAD_ID) -> np.ndarray:
    """The align function over a window's `ids`, K = `length` rows a call (`align_starts`): `call(input_ids,
    position, cache_mask)` -> (S, K, Tp) weights of one call. Returns (S, len(ids), Tp) float32, rows < rows_from
    NaN (not computed). Precondition: the state's self cache holds the K/V of ids[p] at every slot p below a
    call's start (the window decoded, or fed, first); each call computes its own tokens' K/V."""
    ids = [int(t) for t in ids]
    out = None
    for start in align_starts(len(ids), rows_from, length, capacity):
        weights = np.asarray(call(*align_inputs(ids[start : start + length], start, length, capacity, pad_id)),
                             dtype=np.float32)  # (S, K, Tp)
        if out is None:
            out = np.full((weights.shape[0], len(ids), weights.shape[-1]), np.nan, dtype=np.float32)
        lo, hi = max(start, int(rows_from)), min(start + length, len(ids))
        out[:, lo:hi] = weights[:, lo - start : hi - start]
    return out


@dataclass(frozen=True)
class FeedCall:
    """One decoder call of a `feed_plan`: `function` ("prefill" | "extend" | "step") feeding ids
    [offset, offset + count) of the prefix at cache slot start + offset; `fed` token slots computed
    (prefill P, extend K including its padding, step 1)."""

    function: str
    offset: int
    count: int
    fed: int


def feed_plan(count: int, start: int, capacity: int, prefill_length: int | None = None,
              extend_length: int | None = None, rows_from: int | None = None) -> list[FeedCall]:
    """How a prefix of `count` tokens from slot `start` is fed (the Swift package plans the same);
    `rows_from`: the first token whose log-probs the caller reads (default: the last one):

    * the bare prompt (start 0, exactly prefill_length tokens) with a prefill function, when only the
      log-probs after its last token are read (a prefill call returns no others): one prefill call;
    * else, with an extend function: extend calls of up to K tokens while at least 2 remain and the
      call's K slots fit the cache (a single token is cheaper as a step);
    * the rest: one step call per token (a bundle without prefill / extend: steps only).
    """
    last_row_only = rows_from is None or rows_from >= count - 1
    if start == 0 and prefill_length is not None and count == prefill_length and last_row_only:
        return [FeedCall(PREFILL_FUNCTION, 0, count, count)]
    calls, done = [], 0
    while extend_length is not None and count - done >= 2 and start + done + extend_length <= capacity:
        n = min(extend_length, count - done)
        calls.append(FeedCall(EXTEND_FUNCTION, done, n, extend_length))
        done += n
    calls.extend(FeedCall(STEP_FUNCTION, i, 1, 1) for i in range(done, count))
    return calls


@dataclass
class Fed:
    """What `DecoderRuntime.feed` did: `after[i]` the (V,) log-probs after token i (None where a prefill
    call gives only its last row), `rows` each call's row after its last token, the calls and the token
    slots they computed (padding included)."""

    after: list[np.ndarray | None]
    rows: list[np.ndarray]
    calls: int
    tokens_fed: int

    @property
    def log_probs(self) -> np.ndarray:
        """(V,) after the last token."""
        return self.after[-1]


class DecoderRuntime:
    """The step (`main`), optionally prefill and extend, and in a graph-state package bind_memory, of one
    decoder package, sharing one state.

    Two variants (`state_writes`, read from the package): "host", the default (the functions only read the
    state and return the new K/V rows, `new_k` / `new_v`; this class writes them at their slots
    (`write_rows`), builds each call's `cache_mask` (`host_cache_mask`) and writes the cross memory itself,
    once per window), and "graph" (the functions write the state; `bind_memory` writes the cross memory).

    Args:
        step, bind, prefill, extend: loaded functions (`runtime.load_model`), prefill and extend optional;
            `bind` None for a host-state package.
    """

    def __init__(self, step, bind=None, prefill=None, extend=None, align=None):
        """`align`: the align function's model, or a callable that loads it (`load` defers it to the first
        `align` call: on a device the first load of a function compiles it, which a transcription without word
        timings should not pay)."""
        self.step_model, self.bind_model, self.prefill_model, self.extend_model = step, bind, prefill, extend
        self._align = align
        self.state_writes = (DECODER_STATE_HOST if CACHE_MASK_INPUT in step.input_description
                             else DECODER_STATE_GRAPH)
        if self.host:
            missing = [o for o in NEW_ROWS_OUTPUTS.values() if o not in step.output_description]
            if missing or bind is not None:
                raise DecoderRuntimeError(f"the step takes {CACHE_MASK_INPUT} (a host-state decoder) but "
                                          + (f"returns no {missing}" if missing else f"has a {BIND_FUNCTION} function"))
        elif bind is None:
            raise DecoderRuntimeError(f"a graph-state decoder needs its {BIND_FUNCTION} function")
        elif set(bind.state_description) != set(step.state_description):
            raise DecoderRuntimeError(f"{BIND_FUNCTION} has states {sorted(bind.state_description)}, the step "
                                      f"{sorted(step.state_description)}: one state layout is required")
        self.prefill_length = None
        if prefill is not None:
            self.prefill_length = int(prefill.input_description["input_ids"][0][1])  # (1, P)
        self.extend_length = None
        if extend is not None:
            self.extend_length = int(extend.input_description["input_ids"][0][1])  # (1, K)
        self.capacity = int(step.state_description["self_k"][0][2])  # self_k (L, Hkv, C, Dh)
        self.state_bytes_written = 0  # by the host (host variant): rows, memory; a benchmark's counter

    @property
    def host(self) -> bool:
        """True for a host-state package (the host writes the state)."""
        return self.state_writes == DECODER_STATE_HOST

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto", compute_units: str = "all",
             prefill: bool = True, num_threads: int | None = None, extend: bool = True,
             cache=None, align: bool = True) -> DecoderRuntime:
        """Load a decoder package's functions; `prefill` / `extend` / `align`: also its prefill / extend / align
        function when it has one; `cache`: Core ML's compiled-model cache (`runtime.load_model`)."""
        from ..runtime import load_model, read_package

        functions = read_package(path).function_names

        def load(fn):
            return load_model(str(path), backend=backend, function_name=fn, compute_units=compute_units,
                              num_threads=num_threads, cache=cache)

        step = load(STEP_FUNCTION)
        if BIND_FUNCTION not in functions and CACHE_MASK_INPUT not in step.input_description:
            raise DecoderRuntimeError(
                f"{path} has no {BIND_FUNCTION!r} function (functions: {sorted(functions)}) and its step takes no "
                f"{CACHE_MASK_INPUT!r}: it is a decoder of an older bundle format that took the cross memory at every "
                "step; re-export it with `cohere-coreml export`")
        bind = load(BIND_FUNCTION) if BIND_FUNCTION in functions else None
        pre = load(PREFILL_FUNCTION) if prefill and PREFILL_FUNCTION in functions else None
        ext = load(EXTEND_FUNCTION) if extend and EXTEND_FUNCTION in functions else None
        ali = partial(load, ALIGN_FUNCTION) if align and ALIGN_FUNCTION in functions else None
        return cls(step, bind, pre, ext, ali)

    @property
    def align_model(self):
        """The align function's model (loaded on first use), or None when the package has none."""
        if callable(self._align) and not hasattr(self._align, "predict"):
            self._align = self._align()
        return self._align

    @property
    def align_length(self) -> int | None:
        """K: tokens per align call (None without an align function)."""
        model = self.align_model
        return None if model is None else int(model.input_description["input_ids"][0][1])  # (1, K)

    @property
    def backend(self) -> str:
        return self.step_model.backend

    @property
    def state_description(self):
        return self.step_model.state_description

    def make_state(self):
        """A zeroed state of the package's layout (bind it before any step)."""
        return self.step_model.make_state()

    def bind(self, state, memory: dict, clear_cache: bool = True) -> int:
        """Write one window's cross memory (the encoder's outputs) into `state`; clears its self cache
        (host variant: unless `clear_cache` is False, for a fresh state, already zero).
        Returns the valid frames bound; checked against `memory["encoder_length"]` when present."""
        if self.host:
            missing = [k for k in MEMORY_NAMES if k not in memory]
            if missing:
                raise DecoderRuntimeError(f"the encoder outputs lack {missing}: the decoder state needs "
                                          f"{list(MEMORY_NAMES)}")
            for name in MEMORY_NAMES:  # the encoder's outputs, rounded to the state's fp16 once
                shape = self.state_description[name][0]
                value = np.asarray(memory[name], dtype=np.float16)
                if tuple(value.shape) != tuple(shape):
                    raise DecoderRuntimeError(f"the encoder's {name} is {tuple(value.shape)}, the decoder state "
                                              f"{name} {tuple(shape)}: encoder and decoder of different exports")
                state.write_state(name, value)
                self.state_bytes_written += value.nbytes
            if clear_cache:
                for name in NEW_ROWS_OUTPUTS:
                    shape, dtype = self.state_description[name]
                    state.write_state(name, np.zeros(shape, dtype=dtype))
            bound = memory_frames(memory["cross_mask"])
        else:
            out = self.bind_model.predict(bind_inputs(memory), state=state)
            bound = int(np.asarray(out[BIND_OUTPUT]).reshape(-1)[0])
        if "encoder_length" in memory:
            expected = int(np.asarray(memory["encoder_length"]).reshape(-1)[0])
            if bound != expected:
                raise DecoderRuntimeError(f"{BIND_FUNCTION if not self.host else 'the cross memory'} bound "
                                          f"{bound} valid frames but the encoder reports encoder_length {expected}: "
                                          "cross_mask and encoder_length disagree")
        return bound

    def new_state(self, memory: dict):
        """A fresh state with `memory` bound: what every window starts from."""
        state = self.make_state()
        self.bind(state, memory, clear_cache=False)
        return state

    def _call(self, model, inputs: dict, state, start: int) -> np.ndarray:
        """One prediction of a token function whose first token goes to slot `start`; in the host variant
        with the call's cache_mask, its new K/V rows written at their slots. Returns its log_probs."""
        if self.host and CACHE_MASK_INPUT in model.input_description:
            inputs = {**inputs, CACHE_MASK_INPUT: host_cache_mask(start, self.capacity)}
        out = model.predict(inputs, state=state)
        if self.host:
            for name, output in NEW_ROWS_OUTPUTS.items():
                self.state_bytes_written += write_rows(state, name, out[output], start)
        return np.asarray(out["log_probs"])

    def step(self, state, token: int, position: int) -> np.ndarray:
        """Feed `token` at cache slot `position`; returns the (V,) log-probs of the next token."""
        return self._call(self.step_model, {"input_ids": np.array([[int(token)]], dtype=np.int32),
                                            "position": np.array([int(position)], dtype=np.int32)},
                          state, int(position)).reshape(-1)

    def prefill(self, state, ids) -> np.ndarray:
        """Feed the whole prompt (slots 0..P-1) in one call; (V,) log-probs after its last token."""
        if self.prefill_model is None:
            raise DecoderRuntimeError("the decoder package has no prefill function (or it was not loaded)")
        ids = [int(t) for t in ids]
        if len(ids) != self.prefill_length:
            raise DecoderRuntimeError(f"prefill takes {self.prefill_length} prompt tokens, got {len(ids)}")
        return self._call(self.prefill_model, {"input_ids": np.array([ids], dtype=np.int32)}, state, 0).reshape(-1)

    def extend(self, state, ids, start: int) -> np.ndarray:
        """Feed 1..K tokens at slots start.. in one call (padded to K); (len(ids), V) log-probs after each."""
        if self.extend_model is None:
            raise DecoderRuntimeError("the decoder package has no extend function (or it was not loaded)")
        padded, position = extend_inputs(ids, start, self.extend_length, self.capacity)
        rows = self._call(self.extend_model, {"input_ids": padded, "position": position}, state, int(start))
        return rows.reshape(self.extend_length, -1)[: len(ids)]  # (1, K, V) -> the real tokens' rows

    def align(self, state, ids, rows_from: int = 0, pad_id: int = EXTEND_PAD_ID) -> np.ndarray:
        """The alignment heads' cross-attention weights for `ids` (the window's prompt + text tokens, no eos):
        (heads, len(ids), Tp) float32, row p the query at slot p (predicting token p+1; `alignment.alignment_rows`
        cuts the rule's), rows < `rows_from` NaN (not computed). K rows a call (`align_rows`); it only reads the
        state. Precondition: `state` has DECODED (or been fed, `feed`) these ids, so its self cache holds their K/V
        at their slots (the last token may be missing: a call computes its own tokens' K/V), and it still holds
        the window's cross memory."""
        if self.align_model is None:
            raise DecoderRuntimeError(f"the decoder package has no {ALIGN_FUNCTION!r} function (exported with "
                                      "--alignment-heads none, or its head choice was refused: see the manifest's "
                                      "decoder.alignment_note); re-export with --alignment-heads auto or a head list")

        def call(input_ids, position, cache_mask):
            out = self.align_model.predict({"input_ids": input_ids, "position": position,
                                            CACHE_MASK_INPUT: cache_mask}, state=state)
            return out[ALIGN_OUTPUT][0]  # (1, S, K, Tp) -> (S, K, Tp)

        return align_rows(call, ids, rows_from, self.align_length, self.capacity, pad_id)

    def plan(self, count: int, start: int = 0, rows_from: int | None = None) -> list[FeedCall]:
        """`feed_plan` with this package's functions."""
        return feed_plan(count, start, self.capacity, self.prefill_length, self.extend_length, rows_from)

    def feed(self, state, ids, start: int = 0, rows_from: int | None = None) -> Fed:
        """Feed a prefix `ids` at slots start.. by `plan`; the log-probs after each token from `rows_from`
        (default: the last) on are in `Fed.after`."""
        ids = [int(t) for t in ids]
        if not ids:
            raise DecoderRuntimeError("feed needs at least one token")
        after: list[np.ndarray | None] = []
        fed = 0
        calls = self.plan(len(ids), start, rows_from)
        for call in calls:
            part = ids[call.offset : call.offset + call.count]
            if call.function == PREFILL_FUNCTION:
                after.extend([None] * (len(part) - 1) + [self.prefill(state, part)])
            elif call.function == EXTEND_FUNCTION:
                after.extend(self.extend(state, part, start + call.offset))
            else:
                after.append(self.step(state, part[0], start + call.offset))
            fed += call.fed
        rows = [after[c.offset + c.count - 1] for c in calls]
        return Fed(after=after, rows=rows, calls=len(calls), tokens_fed=fed)
