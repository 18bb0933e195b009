"""Stateful decoder: the `transformers` Cohere ASR decoder with a static KV cache and its cross
memory held in the Core ML state, as one multifunction Core ML package.

Every function of `decoder.mlpackage` but `step_batch` runs on ONE state layout (a state object made once
serves every one of them; `step_batch` has B rows of its own, below):

    states : self_k, self_v fp16 (L, Hkv, C, Dh); cross_k, cross_v fp16 (L, Hkv, Tp, Dh);
             cross_mask fp16 (1, 1, 1, Tp)

Who writes that state is the package's `state_writes` (`export --decoder-state`, manifest
`decoder.state_writes`, docs/decoder.md).

"host" (the default): the functions only read the state; the host writes it.
    once per window: the host writes the encoder's cross_k, cross_v, cross_mask into the state
                     (fp16) and zeroes self_k / self_v (`DecoderRuntime.bind`); there is no bind function
    main (the step)
        inputs : input_ids int32 (1, 1), position int32 (1,),
                 cache_mask fp16 (1, 1, 1, C)         0 for the slots already filled, -1e4 for the rest
        output : log_probs (1, V)                    log-softmax over the vocabulary
                 new_k, new_v fp16 (L, Hkv, 1, Dh)   the token's K/V rows: the host writes them at `position`
    prefill (optional)
        inputs : input_ids int32 (1, P)               the whole prompt, slots 0..P-1 (the cache is empty)
        output : log_probs (1, V)                    after the last prompt token; new_k / new_v (L, Hkv, P, Dh)
    extend (optional)
        inputs : input_ids int32 (1, K)               the real tokens, then padding (any id)
                 position int32 (1,)                  slot of the first token (position + K <= C)
                 cache_mask fp16 (1, 1, 1, C)
        output : log_probs (1, K, V)                 row i: after the token at slot position+i (the
                                                     caller reads the rows of its real tokens)
                 new_k, new_v fp16 (L, Hkv, K, Dh)   written by the host at slots position..position+K-1
    step_batch (optional, `export --decoder-batch B`, B >= 2): the step for B windows; a state of its own,
        B rows folded into the head axis: self_k, self_v (L, B*Hkv, C, Dh); cross_k, cross_v (L, B*Hkv, Tp, Dh);
        cross_mask (B, 1, 1, Tp) (row b: heads b*Hkv..(b+1)*Hkv-1, its mask row b)
        inputs : input_ids int32 (B, 1), position int32 (B,), cache_mask fp16 (B, 1, 1, C)   row b's
        output : log_probs (B, V); new_k, new_v fp16 (L, B*Hkv, 1, Dh)   row b's K/V: heads b*Hkv.. at its position
    No program writes a state at a runtime position: the ops that would (slice_update / scatter at a
    non-constant index) keep a program off the Neural Engine (docs/ane.md, `ane-check`).

"graph": the functions write the state themselves.
    bind_memory  once per window
        inputs : encoder_cross_k    (L, Hkv, Tp, Dh)  the encoder package's `cross_k`, unchanged
                 encoder_cross_v    (L, Hkv, Tp, Dh)  its `cross_v`
                 encoder_cross_mask (1, 1, 1, Tp)     its `cross_mask`: 0 valid frame, -1e4 padding
        effect : state cross_k / cross_v / cross_mask = the inputs (fp16); self_k / self_v *= 0
        output : memory_length int32 (1,)            valid (unmasked) frames just bound
    main, prefill, extend: the inputs and log_probs above without cache_mask, new_k and new_v; each writes
        its tokens' K/V rows into self_k / self_v at their slots (the padded tail of extend lies after the
        last real token: masked for it, overwritten before any later token sees it)

The modules reuse the `transformers` submodules (embeddings, layer norms, q/k/v/o projections,
MLP, final norm, `proj_out`) and `eager_attention_forward`; only the static-cache glue lives
here (`decoder_modules`). No function projects the encoder memory: cross K/V come precomputed from
the encoder. `convert_decoder` writes the package through its teacher-forcing gate (`decoder_gate`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..config import (
    ALIGN_FUNCTION,
    ALIGN_OUTPUT,
    ANE_MULTIPLE,
    BIND_FUNCTION,
    BIND_INPUT_PREFIX,
    BIND_OUTPUT,
    CACHE_MASK_INPUT,
    DECODER_STATE_DEFAULT,
    DECODER_STATE_GRAPH,
    DECODER_STATE_HOST,
    DECODER_STATES,
    EXTEND_FUNCTION,
    EXTEND_LENGTH,
    EXTEND_PAD_ID,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    PREFILL_FUNCTION,
    PROMPT_LENGTH,
    STEP_BATCH_FUNCTION,
    STEP_FUNCTION,
)
from ..inference.decoder_runtime import align_rows, extend_inputs, host_cache_mask, memory_frames
from ..model.shapes import DecoderShapes, cache_capacity
from ..storage.files import save_converted, skip_installed
from .convert import ExportSettings, convert_module, merge_functions, quiet_third_party, validated_per_pipeline
from .decoder_gate import COMPONENT, prepare_gate
from .decoder_modules import (
    STATE_DTYPE,
    DecoderAlign,
    DecoderBind,
    DecoderExportError,
    DecoderExtend,
    DecoderExtendHost,
    DecoderPrefill,
    DecoderPrefillHost,
    DecoderStep,
    DecoderStepBatch,
    DecoderStepHost,
    RecomputingStep,
    StatefulDecoder,
)
from .gate import StagedPackage, stage_gated

logger = logging.getLogger(__name__)


def _trace(module: StatefulDecoder, example: tuple):
    module = module.eval()
    with torch.no_grad(), quiet_third_party():
        traced = torch.jit.trace(module, example, check_trace=False)
    module.reset()
    return traced


def trace_decoder_bind(bind: StatefulDecoder):
    s = bind.shapes
    return _trace(bind, (torch.zeros(s.memory_shape), torch.zeros(s.memory_shape),
                         torch.zeros((1, 1, 1, s.memory_len))))


def _host_mask_example(module: StatefulDecoder) -> tuple:
    """The cache_mask example input of a host-state function ((), for a graph-state one)."""
    if isinstance(module, (DecoderStepHost, DecoderExtendHost, DecoderAlign)):
        return (torch.zeros((1, 1, 1, module.shapes.capacity), dtype=STATE_DTYPE),)
    return ()


def trace_decoder_step(step: StatefulDecoder):
    return _trace(step, (torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1,), dtype=torch.int32),
                         *_host_mask_example(step)))


def trace_decoder_step_batch(step: DecoderStepBatch):
    b = step.batch
    return _trace(step, (torch.zeros((b, 1), dtype=torch.int32), torch.zeros((b,), dtype=torch.int32),
                         torch.zeros((b, 1, 1, step.shapes.capacity), dtype=STATE_DTYPE)))


def trace_decoder_prefill(prefill: DecoderPrefill):
    return _trace(prefill, (torch.zeros((1, prefill.prompt_len), dtype=torch.int32),))


def trace_decoder_extend(extend: DecoderExtend):
    return _trace(extend, (torch.zeros((1, extend.extend_len), dtype=torch.int32), torch.zeros((1,), dtype=torch.int32),
                           *_host_mask_example(extend)))


def trace_decoder_align(align: DecoderAlign):
    return trace_decoder_extend(align)  # the host-state extend's inputs


def coreml_states(shapes: DecoderShapes, names=("self_k", "self_v", *MEMORY_NAMES), batch: int = 1):
    """The package's state declarations (fp16, static shapes), shared by every function of one batch size
    (`batch` > 1: the batched step's, `DecoderShapes.batch_state_shapes`)."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

    shape = {"self_k": shapes.cache_shape, "self_v": shapes.cache_shape, "cross_k": shapes.memory_shape,
             "cross_v": shapes.memory_shape, "cross_mask": (1, 1, 1, shapes.memory_len)}
    if batch > 1:
        shape = shapes.batch_state_shapes(batch)
    return [ct.StateType(wrapped_type=ct.TensorType(shape=shape[n], dtype=np.float16), name=n) for n in names]


def coreml_io(shapes: DecoderShapes, function: str = STEP_FUNCTION, prompt_len: int | None = None,
              extend_len: int = EXTEND_LENGTH, state_writes: str = DECODER_STATE_GRAPH, batch: int = 1):
    """coremltools (inputs, states, outputs) declarations of one function of the package. `state_writes`
    "host": the step and extend also take `cache_mask` (fp16 (1, 1, 1, C)) and every token function also
    returns `new_k` / `new_v` (fp16 (L, Hkv, S, Dh)); there is no bind function. `batch`: the rows of
    `step_batch` (host only)."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

    if function == STEP_BATCH_FUNCTION:
        if state_writes != DECODER_STATE_HOST or batch < 2:
            raise ValueError(f"{STEP_BATCH_FUNCTION} is a host-state function of at least 2 rows, got "
                             f"{state_writes!r} with {batch}")
        inputs = [ct.TensorType(name="input_ids", shape=(batch, 1), dtype=np.int32),
                  ct.TensorType(name="position", shape=(batch,), dtype=np.int32),
                  ct.TensorType(name=CACHE_MASK_INPUT, shape=(batch, 1, 1, shapes.capacity), dtype=np.float16)]
        outputs = [ct.TensorType(name="log_probs"),
                   *(ct.TensorType(name=NEW_ROWS_OUTPUTS[n], dtype=np.float16) for n in ("self_k", "self_v"))]
        return inputs, coreml_states(shapes, batch=batch), outputs

    if function == ALIGN_FUNCTION:  # the same in both variants: it only reads the state
        if state_writes not in DECODER_STATES:
            raise ValueError(f"state_writes must be one of {DECODER_STATES}, got {state_writes!r}")
        inputs = [ct.TensorType(name="input_ids", shape=(1, extend_len), dtype=np.int32),
                  ct.TensorType(name="position", shape=(1,), dtype=np.int32),
                  ct.TensorType(name=CACHE_MASK_INPUT, shape=(1, 1, 1, shapes.capacity), dtype=np.float16)]
        return inputs, coreml_states(shapes), [ct.TensorType(name=ALIGN_OUTPUT, dtype=np.float16)]
    if state_writes == DECODER_STATE_HOST:
        if function == BIND_FUNCTION:
            raise ValueError("the host-state decoder has no bind function (the host writes the cross memory)")
        inputs, states, outputs = coreml_io(shapes, function, prompt_len, extend_len)
        if function != PREFILL_FUNCTION:
            inputs.append(ct.TensorType(name=CACHE_MASK_INPUT, shape=(1, 1, 1, shapes.capacity), dtype=np.float16))
        outputs += [ct.TensorType(name=NEW_ROWS_OUTPUTS[n], dtype=np.float16) for n in ("self_k", "self_v")]
        return inputs, states, outputs
    if state_writes != DECODER_STATE_GRAPH:
        raise ValueError(f"state_writes must be one of {DECODER_STATES}, got {state_writes!r}")
    if function == BIND_FUNCTION:
        # no dtype: the program's precision, as the encoder's outputs (fp16 arrays in an fp16 bundle)
        inputs = [ct.TensorType(name=BIND_INPUT_PREFIX + "cross_k", shape=shapes.memory_shape),
                  ct.TensorType(name=BIND_INPUT_PREFIX + "cross_v", shape=shapes.memory_shape),
                  ct.TensorType(name=BIND_INPUT_PREFIX + "cross_mask", shape=(1, 1, 1, shapes.memory_len))]
        return inputs, coreml_states(shapes), [ct.TensorType(name=BIND_OUTPUT)]
    if function == STEP_FUNCTION:
        inputs = [ct.TensorType(name="input_ids", shape=(1, 1), dtype=np.int32),
                  ct.TensorType(name="position", shape=(1,), dtype=np.int32)]
    elif function == PREFILL_FUNCTION:
        inputs = [ct.TensorType(name="input_ids", shape=(1, prompt_len), dtype=np.int32)]
    elif function == EXTEND_FUNCTION:
        inputs = [ct.TensorType(name="input_ids", shape=(1, extend_len), dtype=np.int32),
                  ct.TensorType(name="position", shape=(1,), dtype=np.int32)]
    else:
        raise ValueError(f"unknown decoder function {function!r}")
    return inputs, coreml_states(shapes), [ct.TensorType(name="log_probs")]


def build_step_mlmodel(model, capacity: int, memory_len: int, precision: str = "fp16", recompute_cross_kv=False):
    """Trace the decode step and convert it to an (in-memory) Core ML ML program (for inspection:
    op counts, MACs). `recompute_cross_kv`: the comparison design (`RecomputingStep`)."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

    if recompute_cross_kv:
        step = RecomputingStep(model, capacity, memory_len)
        s = step.shapes
        traced = _trace(step, (torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1,), dtype=torch.int32),
                               torch.zeros((1, memory_len, s.hidden_size)), torch.zeros((1, 1, 1, memory_len))))
        inputs = [ct.TensorType(name="input_ids", shape=(1, 1), dtype=np.int32),
                  ct.TensorType(name="position", shape=(1,), dtype=np.int32),
                  ct.TensorType(name="encoder_memory", shape=(1, memory_len, s.hidden_size)),
                  ct.TensorType(name="cross_mask", shape=(1, 1, 1, memory_len))]
        states, outputs = coreml_states(s, ("self_k", "self_v")), [ct.TensorType(name="log_probs")]
    else:
        step = DecoderStep(model, capacity, memory_len)
        traced = trace_decoder_step(step)
        inputs, states, outputs = coreml_io(step.shapes)
    prec = {"fp16": ct.precision.FLOAT16, "fp32": ct.precision.FLOAT32}[precision]
    with validated_per_pipeline(), quiet_third_party():
        mlmodel = ct.convert(
            traced,
            inputs=inputs,
            states=states,
            outputs=outputs,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=prec,
            skip_model_load=True,
        )
    return mlmodel, step.shapes


# --------------------------------------------------------------------------------------------
# Export with a parity gate (the gate itself: `decoder_gate`)
# --------------------------------------------------------------------------------------------

DECODER_DESCRIPTIONS = {
    "input_ids": "int32 (1, 1): the token at `position` (prompt token, then the previous prediction)",
    "position": "int32 (1,): slot of this token in the self-attention cache, 0-based, < capacity",
    "log_probs": "(1, V) log-softmax over the vocabulary for the token after `position`",
    "self_k": "fp16 (L, Hkv, C, Dh) self-attention keys; cleared by bind_memory",
    "self_v": "fp16 (L, Hkv, C, Dh) self-attention values; cleared by bind_memory",
    "cross_k": "fp16 (L, Hkv, Tp, Dh) cross-attention keys of the window, written by bind_memory",
    "cross_v": "fp16 (L, Hkv, Tp, Dh) cross-attention values of the window, written by bind_memory",
    "cross_mask": "fp16 (1, 1, 1, Tp) additive cross mask of the window (0 valid, -1e4 padding), written by bind_memory",
}
EXTEND_DESCRIPTIONS = {
    **DECODER_DESCRIPTIONS,
    "input_ids": "int32 (1, K): tokens for slots position.., the real ones first, then padding",
    "position": "int32 (1,): cache slot of the first token, position + K <= capacity",
    "log_probs": "(1, K, V) log-softmax over the vocabulary after each of the K slots (rows of padding: unused)",
}
HOST_DESCRIPTIONS = {
    **DECODER_DESCRIPTIONS,
    CACHE_MASK_INPUT: "fp16 (1, 1, 1, C) additive, written by the host: 0 for the cache slots already filled "
                      "(< position), -1e4 for the others",
    "new_k": "fp16 (L, Hkv, S, Dh): the new tokens' self-attention keys; the host writes them into self_k at "
             "slots position..position+S-1",
    "new_v": "fp16 (L, Hkv, S, Dh): the new tokens' self-attention values, for self_v likewise",
    "self_k": "fp16 (L, Hkv, C, Dh) self-attention keys, read only (the host writes each call's new_k)",
    "self_v": "fp16 (L, Hkv, C, Dh) self-attention values, read only (the host writes each call's new_v)",
    "cross_k": "fp16 (L, Hkv, Tp, Dh) cross-attention keys of the window, written by the host once per window",
    "cross_v": "fp16 (L, Hkv, Tp, Dh) cross-attention values of the window, written by the host once per window",
    "cross_mask": "fp16 (1, 1, 1, Tp) additive cross mask of the window (0 valid, -1e4 padding), written by the host",
}
HOST_EXTEND_DESCRIPTIONS = {k: v for k, v in HOST_DESCRIPTIONS.items() if k not in ("input_ids", "position", "log_probs")}
ALIGN_DESCRIPTIONS = {
    "input_ids": "int32 (1, K): the window's tokens for slots position..position+K-1 (its prompt then its text "
                 "tokens, no eos), real first, then padding (any id); causal among themselves",
    "position": "int32 (1,): the slot of the first token (position + K <= C)",
    "cache_mask": "fp16 (1, 1, 1, C): 0 for the slots < position (the window's decoded tokens, already in the self "
                  "cache), -1e4 for the others",
    ALIGN_OUTPUT: "fp16 (1, S, K, Tp): softmax cross-attention weights of the S alignment heads (the manifest's "
                  "decoder.alignment.heads, in order) over the encoder frames; row i is the query at slot position+i",
    **{k: v for k, v in HOST_DESCRIPTIONS.items() if k in MEMORY_NAMES},
    "self_k": "fp16 (L, Hkv, C, Dh) self-attention keys of the window's decoded tokens (read, never written)",
    "self_v": "fp16 (L, Hkv, C, Dh) self-attention values of the window's decoded tokens (read, never written)",
}
BATCH_DESCRIPTIONS = {
    "input_ids": "int32 (B, 1): row b's token at its position (a prompt token, then its previous prediction)",
    "position": "int32 (B,): row b's cache slot for its token, < capacity",
    CACHE_MASK_INPUT: "fp16 (B, 1, 1, C) additive, written by the host: row b's slots already filled (< its position) "
                      "0, the others -1e4",
    "log_probs": "(B, V) row b's log-softmax over the vocabulary for its next token",
    "new_k": "fp16 (L, B*Hkv, 1, Dh): row b's new key rows are heads b*Hkv..(b+1)*Hkv-1; the host writes them into "
             "self_k at row b's position",
    "new_v": "fp16 (L, B*Hkv, 1, Dh): row b's new value rows, for self_v likewise",
    "self_k": "fp16 (L, B*Hkv, C, Dh) self-attention keys of B windows (row b: heads b*Hkv..), read only",
    "self_v": "fp16 (L, B*Hkv, C, Dh) self-attention values of B windows, read only",
    "cross_k": "fp16 (L, B*Hkv, Tp, Dh) cross-attention keys, row b's window's written by the host when it enters row b",
    "cross_v": "fp16 (L, B*Hkv, Tp, Dh) cross-attention values, likewise",
    "cross_mask": "fp16 (B, 1, 1, Tp) additive cross masks, row b's window's (0 valid, -1e4 padding), written by the host",
}
BIND_DESCRIPTIONS = {
    BIND_INPUT_PREFIX + "cross_k": "(L, Hkv, Tp, Dh) encoder.mlpackage's cross_k, unchanged",
    BIND_INPUT_PREFIX + "cross_v": "(L, Hkv, Tp, Dh) encoder.mlpackage's cross_v, unchanged",
    BIND_INPUT_PREFIX + "cross_mask": "(1, 1, 1, Tp) encoder.mlpackage's cross_mask, unchanged",
    BIND_OUTPUT: "int32 (1,): valid (unmasked) frames of the memory just bound (== the encoder's encoder_length)",
    **{k: v for k, v in DECODER_DESCRIPTIONS.items() if k not in ("input_ids", "position", "log_probs")},
}


class TorchDecoder:
    """A PyTorch `StatefulDecoder` behind the `DecoderRuntime` interface (new_state / bind / step /
    prefill / extend): the gate's negative controls run through it (`decoder_gate.negative_controls`), and
    tests use it as the PyTorch twin of a package. Its state is the module itself (one sequence at a time).

    `state_writes` as the package's: "graph" (the module writes its cache and memory, as the package's
    functions do) or "host" (the module only reads its buffers and returns the new K/V rows; this twin
    writes them, and the memory, as `DecoderRuntime` writes a host-state package's)."""

    backend = "torch"

    def __init__(self, module: StatefulDecoder, state_writes: str = DECODER_STATE_GRAPH):
        if state_writes not in DECODER_STATES:
            raise ValueError(f"state_writes must be one of {DECODER_STATES}, got {state_writes!r}")
        self.module = module.eval()
        self.state_writes = state_writes

    @classmethod
    def of(cls, model, capacity: int, memory_len: int, state_writes: str = DECODER_STATE_GRAPH) -> TorchDecoder:
        """The twin of a package with `capacity` cache slots over `memory_len` encoder frames."""
        return cls(StatefulDecoder(model, capacity, memory_len), state_writes)

    @property
    def host(self) -> bool:
        return self.state_writes == DECODER_STATE_HOST

    def new_state(self, memory: dict):
        self.module.reset()
        self.bind(self.module, memory)
        return self.module

    def bind(self, state, memory: dict) -> int:
        args = [torch.from_numpy(np.asarray(memory[k], dtype=np.float32)) for k in MEMORY_NAMES]
        with torch.no_grad():
            if not self.host:
                return int(state.bind_memory(*args)[0])
            for name, value in zip(MEMORY_NAMES, args):  # the host's writes (DecoderRuntime.bind)
                getattr(state, name)[:] = value.to(STATE_DTYPE)
            state.self_k.zero_()
            state.self_v.zero_()
            return memory_frames(memory["cross_mask"])

    def _run(self, state, ids, positions: torch.Tensor, all_rows: bool = False) -> np.ndarray:
        """The module on `ids` at `positions`; in the host variant the twin writes the new rows after."""
        ids = torch.tensor([[int(t) for t in ids]], dtype=torch.int32)
        with torch.no_grad():
            if not self.host:
                return state.run_tokens(ids, positions, all_rows=all_rows).numpy()
            start = int(positions[0])
            mask = torch.from_numpy(host_cache_mask(start, state.shapes.capacity))
            lp, new_k, new_v = state.run_tokens(ids, positions, all_rows=all_rows, cache_mask=mask)
            n = ids.shape[1]
            state.self_k[:, :, start : start + n] = new_k
            state.self_v[:, :, start : start + n] = new_v
            return lp.numpy()

    def step(self, state, token: int, position: int) -> np.ndarray:
        return self._run(state, [token], torch.tensor([int(position)], dtype=torch.int32)).reshape(-1)

    def prefill(self, state, ids) -> np.ndarray:
        return self._run(state, ids, torch.arange(len(ids), dtype=torch.int32)).reshape(-1)

    def extend(self, state, ids, start: int, extend_len: int = EXTEND_LENGTH) -> np.ndarray:
        """`extend` as the package computes it: `ids` padded to `extend_len` slots from `start`; the
        (len(ids), V) log-probs after each of them."""
        padded, position = extend_inputs(ids, start, extend_len, self.module.shapes.capacity)
        positions = torch.from_numpy(position + np.arange(extend_len, dtype=np.int32))
        rows = self._run(state, padded[0], positions, all_rows=True)[0]  # (K, V)
        return rows[: len(ids)]

    def align(self, state, ids, heads, rows_from: int = 0, pad_id: int = EXTEND_PAD_ID,
              align_len: int = EXTEND_LENGTH) -> np.ndarray:
        """The `align` function as the package computes it (`DecoderAlign`'s graph on this state, which it only
        reads), K = `align_len` rows a call (`align_rows`, as `DecoderRuntime.align`): (len(heads), len(ids), Tp)
        float32 cross-attention weights of `heads` for `ids` (prompt + text tokens), rows < rows_from NaN.
        Precondition: the state has been fed these ids (their K/V in its self cache), as after decoding."""
        heads = [(int(a), int(b)) for a, b in heads]

        def call(input_ids, position, cache_mask):
            positions = torch.from_numpy(position + np.arange(align_len, dtype=np.int32))
            with torch.no_grad():
                out = state.run_tokens(torch.from_numpy(input_ids), positions,
                                       cache_mask=torch.from_numpy(cache_mask), cross_heads=heads)
            return out[0].float().numpy()

        return align_rows(call, ids, rows_from, align_len, state.shapes.capacity, pad_id)


class TorchBatchStep:
    """The PyTorch `DecoderStepBatch` behind the loaded-function interface `inference.batch_decoding.BatchDecoder`
    takes (descriptions, `make_state`, `predict`): the batched step's twin, for the gate's controls and tests.
    Its states are interpreter state buffers (`MilState`), copied into the module for each call."""

    backend = "torch"
    function_name = STEP_BATCH_FUNCTION

    def __init__(self, module: DecoderStepBatch):
        self.module = module.eval()
        s, b = module.shapes, module.batch
        self.state_description = {n: (shape, np.float16) for n, shape in s.batch_state_shapes(b).items()}
        self.input_description = {"input_ids": ((b, 1), np.int32), "position": ((b,), np.int32),
                                  CACHE_MASK_INPUT: ((b, 1, 1, s.capacity), np.float16)}
        rows = (s.num_layers, b * s.num_kv_heads, 1, s.head_dim)
        self.output_description = {"log_probs": ((b, s.vocab_size), np.float32),
                                   **{o: (rows, np.float16) for o in NEW_ROWS_OUTPUTS.values()}}

    @classmethod
    def decoder(cls, model, capacity: int, memory_len: int, batch: int):
        """A `BatchDecoder` over the twin of a package's `step_batch` (B = `batch` rows)."""
        from ..inference.batch_decoding import BatchDecoder

        return BatchDecoder(cls(DecoderStepBatch(model, capacity, memory_len, batch)))

    def make_state(self):
        from ..runtime.interpreter import MilState

        return MilState(self.state_description)

    def predict(self, inputs: dict, state=None) -> dict[str, np.ndarray]:
        for name in self.state_description:
            getattr(self.module, name).copy_(torch.from_numpy(np.asarray(state.read_state(name), np.float16)))
        with torch.no_grad():
            lp, new_k, new_v = self.module(*(torch.from_numpy(np.asarray(inputs[k])) for k in self.input_description))
        return {"log_probs": lp.numpy(), NEW_ROWS_OUTPUTS["self_k"]: new_k.numpy(),
                NEW_ROWS_OUTPUTS["self_v"]: new_v.numpy()}


def convert_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                    prompt: list[int] | None = None, prefill: bool = False,
                    control_prompt: list[int] | None = None, extend: bool = False,
                    extend_len: int = EXTEND_LENGTH, state_writes: str = DECODER_STATE_DEFAULT,
                    alignment=None, batch: int = 1) -> dict:
    """Export `decoder.mlpackage` into `settings.out_dir` with a teacher-forcing parity gate.

    Args:
        model: `CohereAsrForConditionalGeneration` (eval, float32).
        settings: `cohere_coreml.export.convert.ExportSettings` (precision, target, out_dir, force, ...).
        capacity: cache slots C (`shapes.cache_capacity`; default for 256 new tokens).
        memory_len: Tp, the padded encoder frames of the encoder package this decoder reads
            (`shapes.export_plan` computes it from the window).
        prompt: decoder prompt ids for the gate (default: 10 tokens from the config's start id).
        prefill: also add a `prefill` function (the whole prompt in one call, same states, weights
            shared) and make the package multifunction; `main` stays the step function.
        control_prompt: another prompt of the same length (other language / punctuation) for the
            gate's "wrong prompt" negative control (default: `prompt` reversed).
        extend: also add an `extend` function (`extend_len` tokens from a given slot in one call:
            forced prefixes), same states, weights shared.
        state_writes: "host" (the functions only read the state and return the new K/V rows, which the
            host writes; no bind function) or "graph" (the functions write the cache, bind_memory the
            memory). docs/decoder.md says which is the default and why.
        alignment: `alignment_heads.AlignmentPlan` (`plan_alignment`): with heads, also an `align` function
            (their cross-attention weights for a window's decoded tokens, `extend_len` a call, docs/word-timings.md),
            checked against the reference on the calibration clips by the gate; the plan's heads / note go into
            the package metadata.
            None: no align function and no note.
        batch: B >= 2 adds `step_batch`, the step for B windows at once (host-state only; docs/decoder.md),
            gated token for token against the step; 1: none.

    Returns a dict: package path, shapes, parity report (`GateReport.to_dict()`, also written to
    `decoder.parity.json`; None when skipped or unchecked), written (False: the package existed).
    Raises `ParityError` (package not written) when the gate fails.
    """
    staged, result = stage_decoder(model, settings, capacity, memory_len, prompt, prefill, control_prompt,
                                   extend, extend_len, state_writes, alignment, batch)
    if staged is None:
        return result
    report = staged.finish()
    result["written"] = True
    result["parity"] = None if report.skipped else report.to_dict()
    return result


def stage_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                  prompt: list[int] | None = None, prefill: bool = False,
                  control_prompt: list[int] | None = None, extend: bool = False,
                  extend_len: int = EXTEND_LENGTH,
                  state_writes: str = DECODER_STATE_DEFAULT,
                  alignment=None, batch: int = 1) -> tuple[StagedPackage | None, dict]:
    """`convert_decoder` up to the gate: the package at its temporary path (traced and converted
    inside the writer, so no program object outlives it), the teacher-forcing reference and the
    negative controls computed with PyTorch. Returns (staged package or None when skipped, the
    result dict `convert_decoder` returns before gating); `finish()` gates and installs it."""
    capacity = int(capacity) if capacity else cache_capacity()
    if state_writes not in DECODER_STATES:
        raise DecoderExportError(f"--decoder-state must be one of {', '.join(DECODER_STATES)}, got {state_writes!r}")
    host = state_writes == DECODER_STATE_HOST
    batch = int(batch)
    if batch < 1:
        raise DecoderExportError(f"--decoder-batch must be >= 1, got {batch}")
    if batch > 1 and not host:
        raise DecoderExportError(f"--decoder-batch {batch} needs the host-state decoder (the graph variant decodes one "
                                 "window at a time): use --decoder-state host or --decoder-batch 1")
    if memory_len is None:
        raise DecoderExportError("give memory_len: the padded encoder frames of the encoder package")
    if capacity % ANE_MULTIPLE:
        logger.warning("capacity %d is not a multiple of %d (Neural Engine prefers multiples of 32)",
                       capacity, ANE_MULTIPLE)
    shapes = DecoderShapes.from_config(model.config, capacity, memory_len)
    path = settings.package_path(COMPONENT)
    if prompt is None:
        start = model.config.decoder_start_token_id
        gate_prompt = [int(start)] + [int(model.config.bos_token_id)] * (PROMPT_LENGTH - 1)
    else:
        gate_prompt = list(prompt)
    if control_prompt is None:
        control_prompt = gate_prompt[::-1]
    if extend and not 1 <= extend_len <= capacity - len(gate_prompt):
        # the gate extends from slot 0 and from slot P, and a forced prefix needs room after the prompt
        raise DecoderExportError(f"extend length {extend_len} does not fit after a {len(gate_prompt)}-token prompt "
                                 f"in a cache of {capacity} slots")
    result = {"path": str(path), "shapes": shapes.to_dict(), "parity": None, "written": False,
              "functions": {"step": STEP_FUNCTION, "bind": None if host else BIND_FUNCTION,
                            "prefill": PREFILL_FUNCTION if prefill else None},
              "prefill_length": len(gate_prompt) if prefill else None, "state_writes": state_writes}
    if extend:  # absent without it (as in the manifest)
        result["functions"]["extend"] = EXTEND_FUNCTION
        result["extend_length"] = int(extend_len)
    if batch > 1:  # absent without it (as in the manifest)
        result["functions"]["step_batch"] = STEP_BATCH_FUNCTION
        result["batch"] = batch
    align_heads = alignment.heads if alignment is not None else None
    if align_heads:
        result["functions"]["align"] = ALIGN_FUNCTION
    if skip_installed(settings, COMPONENT):
        return None, result
    meta = {
        "com.cohere_coreml.component": "decoder",
        "com.cohere_coreml.decoder_shapes": shapes.to_dict(),
        "com.cohere_coreml.cache_capacity": str(shapes.capacity),
        "com.cohere_coreml.memory_len": str(shapes.memory_len),
        "com.cohere_coreml.eos_token_id": str(model.config.eos_token_id),
        "com.cohere_coreml.decoder_state": state_writes,
        **(alignment.metadata() if alignment is not None else {}),
    }

    def convert(function: str):
        """Trace and convert one function of the package (a single-function model named `main`)."""
        if function == ALIGN_FUNCTION:
            traced = trace_decoder_align(DecoderAlign(model, capacity, memory_len, align_heads, extend_len))
            descriptions = ALIGN_DESCRIPTIONS
            summary = ("Cohere Transcribe decoder align: the alignment heads' cross-attention weights for a window's "
                       "decoded tokens, K a call (word timings; reads its state)")
        elif function == STEP_BATCH_FUNCTION:
            traced = trace_decoder_step_batch(DecoderStepBatch(model, capacity, memory_len, batch))
            descriptions = BATCH_DESCRIPTIONS
            summary = (f"Cohere Transcribe decoder step for {batch} windows at once (reads its state, returns each "
                       "row's new K/V rows for the host)")
        elif function == BIND_FUNCTION:
            traced, descriptions = trace_decoder_bind(DecoderBind(model, capacity, memory_len)), BIND_DESCRIPTIONS
            summary = "Cohere Transcribe decoder: bind one window's cross memory into the state"
        elif function == PREFILL_FUNCTION:
            traced = trace_decoder_prefill((DecoderPrefillHost if host else DecoderPrefill)(
                model, capacity, memory_len, prompt_len=len(gate_prompt)))
            descriptions = HOST_DESCRIPTIONS if host else DECODER_DESCRIPTIONS
            summary = "Cohere Transcribe decoder prompt prefill (stateful KV cache, bound cross memory)"
        elif function == EXTEND_FUNCTION:
            traced = trace_decoder_extend((DecoderExtendHost if host else DecoderExtend)(
                model, capacity, memory_len, extend_len))
            descriptions = {**EXTEND_DESCRIPTIONS, **HOST_EXTEND_DESCRIPTIONS} if host else EXTEND_DESCRIPTIONS
            summary = ("Cohere Transcribe decoder extend: up to K tokens from a given slot in one call "
                       "(stateful KV cache, bound cross memory)")
        else:
            logger.debug("decoder: tracing (L=%d Hkv=%d C=%d Tp=%d Dh=%d V=%d)", shapes.num_layers,
                        shapes.num_kv_heads, shapes.capacity, shapes.memory_len, shapes.head_dim, shapes.vocab_size)
            traced = trace_decoder_step((DecoderStepHost if host else DecoderStep)(model, capacity, memory_len))
            descriptions = HOST_DESCRIPTIONS if host else DECODER_DESCRIPTIONS
            summary = "Cohere Transcribe decoder step (stateful KV cache + bound cross memory, log-softmax output)"
        inputs, states, outputs = coreml_io(shapes, function, prompt_len=len(gate_prompt), extend_len=extend_len,
                                            state_writes=state_writes, batch=batch)
        if host and function not in (ALIGN_FUNCTION, STEP_BATCH_FUNCTION):
            summary = summary.replace("stateful KV cache", "reads its state, returns new K/V rows for the host")
        return convert_module(traced, inputs, outputs, settings, states=states,
                              metadata={**meta, "com.cohere_coreml.function": function},
                              descriptions={k: v for k, v in descriptions.items()
                                            if k in {t.name for t in (*inputs, *states, *outputs)}},
                              short_description=summary)

    functions = ([STEP_FUNCTION] + ([] if host else [BIND_FUNCTION]) + ([PREFILL_FUNCTION] if prefill else [])
                 + ([EXTEND_FUNCTION] if extend else []) + ([ALIGN_FUNCTION] if align_heads else [])
                 + ([STEP_BATCH_FUNCTION] if batch > 1 else []))  # last: the others' weight blobs keep their places

    def write(tmp: Path) -> None:
        save_multifunction({fn: (lambda fn=fn: convert(fn)) for fn in functions}, tmp)

    def prepare():  # the gate's PyTorch side (reference, negative controls), once the package is written
        return prepare_gate(model, partial(TorchDecoder.of, model, state_writes=state_writes), shapes.memory_len,
                            shapes.capacity, gate_prompt, control_prompt, settings.precision, settings.min_psnr_db,
                            settings.gate_units, prefill, extend_len if extend else None, state_writes=state_writes,
                            alignment=alignment if align_heads else None, batch=batch,
                            make_batch_twin=partial(TorchBatchStep.decoder, model))

    return stage_gated(COMPONENT, settings, write, prepare, installed=lambda: False), result  # checked above


def save_multifunction(converters: dict, tmp: Path) -> None:
    """Convert each function (name -> callable returning a single-function MLModel), then merge them
    into one package at `tmp` (`convert.merge_functions`: identical weights stored once;
    `main` is the default function). Each program is converted, saved and dropped in turn (only one
    converted program in memory)."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

    scratch = Path(tempfile.mkdtemp(prefix="decoder-mf-"))
    try:
        singles = {}
        for fn, convert in converters.items():
            singles[fn] = scratch / f"{fn}.mlpackage"
            save_converted(convert(), singles[fn])
        merged_model = merge_functions(singles, STEP_FUNCTION, scratch)
        step_meta = ct.models.MLModel(str(singles[STEP_FUNCTION]), skip_model_load=True).user_defined_metadata
        merged_model.user_defined_metadata.update(dict(step_meta))
        merged_model.user_defined_metadata.pop("com.cohere_coreml.function", None)
        merged_model.user_defined_metadata["com.cohere_coreml.functions"] = ", ".join(
            f"{fn} (step)" if fn == STEP_FUNCTION else fn for fn in converters)
        merged_model.save(str(tmp))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
