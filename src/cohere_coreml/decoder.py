"""Stateful decoder: the `transformers` Cohere ASR decoder with a static KV cache and its cross
memory kept in the state, as one multifunction Core ML package.

Functions of `decoder.mlpackage`, all on ONE state layout (a state object made once serves every
function of the package):

    bind_memory  once per window
        inputs : encoder_cross_k    (L, Hkv, Tp, Dh)  the encoder package's `cross_k`, unchanged
                 encoder_cross_v    (L, Hkv, Tp, Dh)  its `cross_v`
                 encoder_cross_mask (1, 1, 1, Tp)     its `cross_mask`: 0 valid frame, -1e4 padding
        effect : state cross_k / cross_v / cross_mask = the inputs (fp16); self_k / self_v *= 0
        output : memory_length int32 (1,)            valid (unmasked) frames just bound
    main (the step)
        inputs : input_ids int32 (1, 1), position int32 (1,)
        effect : self_k / self_v written at slot `position`; cross memory read from the state
        output : log_probs (1, V)                    log-softmax over the vocabulary
    prefill (optional)
        inputs : input_ids int32 (1, P)               the whole prompt, slots 0..P-1
        output : log_probs (1, V)                    after the last prompt token
    extend (optional)
        inputs : input_ids int32 (1, K)               the real tokens, then padding (any id)
                 position int32 (1,)                  slot of the first token (position + K <= C)
        effect : self_k / self_v written at slots position .. position+K-1 (the padded tail's slots
                 lie after the last real token: masked for it, overwritten before any later token sees them)
        output : log_probs (1, K, V)                 row i: after the token at slot position+i (the
                                                     caller reads the rows of its real tokens)
    states : self_k, self_v fp16 (L, Hkv, C, Dh); cross_k, cross_v fp16 (L, Hkv, Tp, Dh);
             cross_mask fp16 (1, 1, 1, Tp)

The modules reuse the `transformers` submodules (embeddings, layer norms, q/k/v/o projections,
MLP, final norm, `proj_out`) and `eager_attention_forward`; only the static-cache glue lives
here. No function projects the encoder memory: cross K/V come precomputed from the encoder.
`convert_decoder` writes the package through its teacher-forcing gate (`decoder_gate`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from transformers.models.cohere_asr.modeling_cohere_asr import eager_attention_forward

from .config import (
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
    FP16_MASK_VALUE,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    PREFILL_FUNCTION,
    PROMPT_LENGTH,
    STEP_FUNCTION,
)
from .convert import ExportSettings, convert_module, merge_functions, validated_per_pipeline
from .decoder_gate import COMPONENT, prepare_gate
from .decoder_runtime import extend_inputs, host_cache_mask, memory_frames
from .files import save_converted, skip_installed
from .gate import StagedPackage, stage_gated
from .shapes import DecoderShapes, cache_capacity

logger = logging.getLogger(__name__)

MASK_VALUE = FP16_MASK_VALUE
STATE_DTYPE = torch.float16  # Core ML states are fp16 only (even in an fp32 program)
COMPUTE_DTYPE = torch.float32  # of the traced graph; the program's precision is the converter's


class DecoderExportError(RuntimeError):
    """Raised when the decoder cannot be exported or fails its parity gate."""


def stable_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last axis as x - max - log(sum(exp(x - max))).

    Not `torch.log_softmax`: coremltools lowers that to log(softmax(x)), and in fp16 every
    probability below ~6e-8 (log-prob < -16.6) underflows there and comes out as log(1e-45) =
    -103.3 (measured on the trained small model: worst log-prob PSNR -9 dB). This form keeps
    the small log-probs (beam search needs them).
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


class StatefulDecoder(nn.Module):
    """`CohereAsrForConditionalGeneration`'s decoder over the package's state buffers.

    The five registered fp16 buffers are the Core ML states (same names). Each function of the
    package is a subclass whose `forward` calls one method here: `bind_memory` (DecoderBind),
    `run_tokens` (DecoderStep, DecoderPrefill). The PyTorch twin (`TorchDecoder`) calls the same
    methods, so a module's twin and its package compute the same thing.
    """

    def __init__(self, model, capacity: int, memory_len: int):
        super().__init__()
        self.shapes = DecoderShapes.from_config(model.config, capacity, memory_len)
        self.decoder = model.model.decoder  # CohereAsrDecoder (embed_tokens, pos_emb, layers, norm, ...)
        self.proj_out = model.proj_out  # LM head
        s = self.shapes
        self.register_buffer("self_k", torch.zeros(s.cache_shape, dtype=STATE_DTYPE))  # (L, Hkv, C, Dh)
        self.register_buffer("self_v", torch.zeros(s.cache_shape, dtype=STATE_DTYPE))
        self.register_buffer("cross_k", torch.zeros(s.memory_shape, dtype=STATE_DTYPE))  # (L, Hkv, Tp, Dh)
        self.register_buffer("cross_v", torch.zeros(s.memory_shape, dtype=STATE_DTYPE))
        self.register_buffer("cross_mask", torch.zeros((1, 1, 1, s.memory_len), dtype=STATE_DTYPE))  # (1, 1, 1, Tp)
        # slot index row used to build the causal mask: (1, 1, 1, C)
        self.register_buffer(
            "slots", torch.arange(s.capacity, dtype=torch.int32).view(1, 1, 1, s.capacity), persistent=False
        )

    def reset(self) -> None:
        for name in ("self_k", "self_v", "cross_k", "cross_v", "cross_mask"):
            getattr(self, name).zero_()

    def bind_memory(
        self,
        cross_k: torch.Tensor,  # (L, Hkv, Tp, Dh) the encoder's output
        cross_v: torch.Tensor,  # (L, Hkv, Tp, Dh)
        cross_mask: torch.Tensor,  # (1, 1, 1, Tp) additive
    ) -> torch.Tensor:
        """Write one window's cross memory into the state and clear the self-attention cache.

        Whole-buffer writes are slice assignments over the full range (`buf[:] = x`): the tracer
        keeps them as `slice_update` + `coreml_update_state` (`copy_` is refused by the converter,
        index assignment dropped). The cache is cleared by `* 0`, not by writing a zeros tensor:
        that would be a constant of the cache's size in the weight file (4.7 MB per buffer at full
        size). Returns memory_length int32 (1,): the valid frames of the bound mask.
        """
        self.cross_k[:] = cross_k.to(STATE_DTYPE)
        self.cross_v[:] = cross_v.to(STATE_DTYPE)
        self.cross_mask[:] = cross_mask.to(STATE_DTYPE)
        # every function of the package must use every state (coremltools refuses unused states)
        self.self_k[:] = self.self_k * 0
        self.self_v[:] = self.self_v * 0
        return (cross_mask > 0.5 * MASK_VALUE).to(torch.int32).sum(dim=-1).view(1)  # (1,)

    def _memory(self, i: int):
        """Cross K/V of layer i from the state, head layout (1, Hkv, Tp, Dh), compute dtype."""
        return self.cross_k[i : i + 1].to(COMPUTE_DTYPE), self.cross_v[i : i + 1].to(COMPUTE_DTYPE)

    def run_tokens(
        self,
        input_ids: torch.Tensor,  # (1, S) int32
        positions: torch.Tensor,  # (S,) int32, consecutive slots
        memory=None,  # i -> (k, v) (1, Hkv, Tp, Dh); default: the bound memory in the state
        cross_mask: torch.Tensor | None = None,  # (1, 1, 1, Tp) additive; default: the state's
        all_rows: bool = False,
        cache_mask: torch.Tensor | None = None,  # (1, 1, 1, C) additive: the host-state variant
    ):
        """Feed S consecutive tokens; returns the log-probs after the last one, (1, V), or with `all_rows`
        after each of them, (1, S, V).

        Without `cache_mask` (the "graph" variant) the new K/V rows are written into the state at
        `positions` and the causal mask is built from `positions`. With `cache_mask` (the "host" variant)
        the state is only read: the tokens attend over the cache slots `cache_mask` leaves open (0; the
        others FP16_MASK_VALUE) plus their own K/V (causal among themselves, a constant mask), and
        (log_probs, new_k, new_v) is returned, new rows (L, Hkv, S, Dh) fp16 for the host to write at
        `positions`. The new rows are rounded to fp16 before the tokens attend to them, as the graph
        variant's round trip through the fp16 cache does."""
        s = self.shapes
        dec = self.decoder
        memory = memory or self._memory
        if cross_mask is None:
            cross_mask = self.cross_mask.to(COMPUTE_DTYPE)  # (1, 1, 1, Tp)
        n = input_ids.shape[1]  # S (static under tracing)
        p = positions[0]
        host = cache_mask is not None

        # token + learned absolute position, then layer norm (as CohereAsrDecoder.forward)
        hidden = dec.embed_tokens(input_ids)  # (1, S, D)
        hidden = dec.embedding_layernorm(hidden + dec.pos_emb(positions).unsqueeze(0))  # (1, S, D)
        dtype = hidden.dtype

        if host:
            # the host's slots, then the new tokens' own: causal among themselves (a constant, no position)
            causal = torch.triu(torch.full((n, n), MASK_VALUE, dtype=dtype), diagonal=1).view(1, 1, n, n)
            self_mask = torch.cat([cache_mask.to(dtype).expand(1, 1, n, s.capacity), causal], dim=-1)  # (1, 1, S, C+S)
            new_rows = {"self_k": [], "self_v": []}
        else:
            # causal mask over the static cache: slot j is visible to the token at position q iff j <= q
            self_mask = torch.where(
                self.slots <= positions.view(1, 1, n, 1),
                torch.zeros((), dtype=dtype),
                torch.full((), MASK_VALUE, dtype=dtype),
            )  # (1, 1, S, C)

        for i, layer in enumerate(dec.layers):
            # --- self attention with the static cache ---
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(x).view(1, n, s.num_heads, s.head_dim).transpose(1, 2)  # (1, H, S, Dh)
            k = attn.k_proj(x).view(1, n, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (1, Hkv, S, Dh)
            v = attn.v_proj(x).view(1, n, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (1, Hkv, S, Dh)
            if host:  # read the cache, never write it: the new rows go out
                k16, v16 = k.to(STATE_DTYPE), v.to(STATE_DTYPE)
                new_rows["self_k"].append(k16)
                new_rows["self_v"].append(v16)
                keys = torch.cat([self.self_k[i : i + 1].to(dtype), k16.to(dtype)], dim=2)  # (1, Hkv, C+S, Dh)
                values = torch.cat([self.self_v[i : i + 1].to(dtype), v16.to(dtype)], dim=2)
            else:
                # slice update with a tensor start (index assignment would be dropped by the tracer)
                self.self_k[i : i + 1, :, p : p + n, :] = k.to(STATE_DTYPE)
                self.self_v[i : i + 1, :, p : p + n, :] = v.to(STATE_DTYPE)
                keys = self.self_k[i : i + 1].to(dtype)  # (1, Hkv, C, Dh)
                values = self.self_v[i : i + 1].to(dtype)  # (1, Hkv, C, Dh)
            out, _ = eager_attention_forward(attn, q, keys, values, self_mask, scaling=attn.scaling)
            out = attn.o_proj(out.reshape(1, n, s.num_heads * s.head_dim))  # (1, S, D)
            hidden = residual + out

            # --- cross attention over the precomputed encoder memory ---
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            attn = layer.encoder_attn
            q = attn.q_proj(x).view(1, n, s.num_heads, s.head_dim).transpose(1, 2)  # (1, H, S, Dh)
            ck, cv = memory(i)  # (1, Hkv, Tp, Dh)
            out, _ = eager_attention_forward(attn, q, ck, cv, cross_mask, scaling=attn.scaling)
            out = attn.o_proj(out.reshape(1, n, s.num_heads * s.head_dim))
            hidden = residual + out

            # --- MLP ---
            residual = hidden
            hidden = residual + layer.mlp(layer.final_layernorm(hidden))

        if all_rows:
            log_probs = stable_log_softmax(self.proj_out(dec.norm(hidden)))  # (1, S, V)
        else:
            hidden = dec.norm(hidden[:, -1:, :])  # (1, 1, D): only the last token's prediction is used
            log_probs = stable_log_softmax(self.proj_out(hidden[:, 0, :]))  # (1, V)
        if host:
            return log_probs, torch.cat(new_rows["self_k"], dim=0), torch.cat(new_rows["self_v"], dim=0)  # (L, Hkv, S, Dh)
        return log_probs


class DecoderBind(StatefulDecoder):
    """`bind_memory`: the encoder's cross memory into the state (once per window)."""

    def forward(self, cross_k, cross_v, cross_mask):  # (L, Hkv, Tp, Dh) x2, (1, 1, 1, Tp) -> (1,) int32
        return self.bind_memory(cross_k, cross_v, cross_mask)


class DecoderStep(StatefulDecoder):
    """`main`: one decode step over the state (self cache + bound cross memory)."""

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, 1) int32
        position: torch.Tensor,  # (1,) int32
    ) -> torch.Tensor:
        return self.run_tokens(input_ids, position)  # (1, V)


class DecoderPrefill(StatefulDecoder):
    """`prefill`: the whole prompt in one call: writes cache slots 0..P-1, returns the log-probs
    after the last prompt token. Same states as the step and bind functions."""

    def __init__(self, model, capacity: int, memory_len: int, prompt_len: int):
        super().__init__(model, capacity, memory_len)
        if not 1 <= prompt_len <= capacity:
            raise DecoderExportError(f"prompt length {prompt_len} does not fit a cache of {capacity} slots")
        self.prompt_len = int(prompt_len)
        self.register_buffer("prompt_positions", torch.arange(prompt_len, dtype=torch.int32), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (1, P) int32 -> (1, V)
        return self.run_tokens(input_ids, self.prompt_positions)


class DecoderExtend(StatefulDecoder):
    """`extend`: K token slots from `position` in one call (the caller's real tokens first, then
    padding): a forced prefix (the prompt and a streaming partial's confirmed tokens) and a draft to
    verify (the previous hypothesis); the log-probs after every slot. Same states as the other functions."""

    def __init__(self, model, capacity: int, memory_len: int, extend_len: int = EXTEND_LENGTH):
        super().__init__(model, capacity, memory_len)
        if not 1 <= extend_len <= capacity:
            raise DecoderExportError(f"extend length {extend_len} does not fit a cache of {capacity} slots")
        self.extend_len = int(extend_len)
        self.register_buffer("offsets", torch.arange(extend_len, dtype=torch.int32), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, K) int32
        position: torch.Tensor,  # (1,) int32: slot of the first token
    ) -> torch.Tensor:
        return self.run_tokens(input_ids, position + self.offsets, all_rows=True)  # (1, K, V)


class DecoderStepHost(StatefulDecoder):
    """`main` of the host-state variant: one decode step that only reads the state; returns the log-probs
    and the token's K/V rows, which the host writes at slot `position`."""

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, 1) int32
        position: torch.Tensor,  # (1,) int32: the position embedding's index (the graph's entry gather)
        cache_mask: torch.Tensor,  # (1, 1, 1, C) fp16: 0 for the filled slots (< position), -1e4 else
    ):  # -> log_probs (1, V), new_k, new_v (L, Hkv, 1, Dh) fp16
        return self.run_tokens(input_ids, position, cache_mask=cache_mask)


class DecoderPrefillHost(DecoderPrefill):
    """`prefill` of the host-state variant: the prompt from slot 0 over an empty cache (a constant mask:
    every cache slot closed); returns the log-probs after the last prompt token and the P new K/V rows."""

    def __init__(self, model, capacity: int, memory_len: int, prompt_len: int):
        super().__init__(model, capacity, memory_len, prompt_len)
        self.register_buffer("empty_mask", torch.full((1, 1, 1, capacity), MASK_VALUE, dtype=STATE_DTYPE),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor):  # (1, P) -> log_probs (1, V), new_k, new_v (L, Hkv, P, Dh)
        return self.run_tokens(input_ids, self.prompt_positions, cache_mask=self.empty_mask)


class DecoderExtendHost(DecoderExtend):
    """`extend` of the host-state variant: K tokens from slot `position` over the cache slots `cache_mask`
    leaves open; the log-probs after each and the K new K/V rows (the host writes slots position..+K-1)."""

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, cache_mask: torch.Tensor):
        return self.run_tokens(input_ids, position + self.offsets, all_rows=True, cache_mask=cache_mask)


class RecomputingStep(StatefulDecoder):
    """Only for the MAC-count comparison (tools/count_decoder_macs.py): the design published ports
    use, where the step takes the encoder memory (1, T, Ddec) and recomputes every layer's cross
    K/V from it at every step. Never exported as a product."""

    def forward(self, input_ids, position, encoder_memory, cross_mask):
        def memory(i):
            attn = self.decoder.layers[i].encoder_attn
            kv_shape = (1, encoder_memory.shape[1], -1, self.shapes.head_dim)
            return (attn.k_proj(encoder_memory).view(kv_shape).transpose(1, 2),
                    attn.v_proj(encoder_memory).view(kv_shape).transpose(1, 2))

        return self.run_tokens(input_ids, position, memory=memory, cross_mask=cross_mask)


def _trace(module: StatefulDecoder, example: tuple):
    module = module.eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, example, check_trace=False)
    module.reset()
    return traced


def trace_decoder_bind(bind: StatefulDecoder):
    s = bind.shapes
    return _trace(bind, (torch.zeros(s.memory_shape), torch.zeros(s.memory_shape),
                         torch.zeros((1, 1, 1, s.memory_len))))


def _host_mask_example(module: StatefulDecoder) -> tuple:
    """The cache_mask example input of a host-state function ((), for a graph-state one)."""
    if isinstance(module, (DecoderStepHost, DecoderExtendHost)):
        return (torch.zeros((1, 1, 1, module.shapes.capacity), dtype=STATE_DTYPE),)
    return ()


def trace_decoder_step(step: StatefulDecoder):
    return _trace(step, (torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1,), dtype=torch.int32),
                         *_host_mask_example(step)))


def trace_decoder_prefill(prefill: DecoderPrefill):
    return _trace(prefill, (torch.zeros((1, prefill.prompt_len), dtype=torch.int32),))


def trace_decoder_extend(extend: DecoderExtend):
    return _trace(extend, (torch.zeros((1, extend.extend_len), dtype=torch.int32), torch.zeros((1,), dtype=torch.int32),
                           *_host_mask_example(extend)))


def coreml_states(shapes: DecoderShapes, names=("self_k", "self_v", *MEMORY_NAMES)):
    """The package's state declarations (fp16, static shapes), shared by every function."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

    shape = {"self_k": shapes.cache_shape, "self_v": shapes.cache_shape, "cross_k": shapes.memory_shape,
             "cross_v": shapes.memory_shape, "cross_mask": (1, 1, 1, shapes.memory_len)}
    return [ct.StateType(wrapped_type=ct.TensorType(shape=shape[n], dtype=np.float16), name=n) for n in names]


def coreml_io(shapes: DecoderShapes, function: str = STEP_FUNCTION, prompt_len: int | None = None,
              extend_len: int = EXTEND_LENGTH, state_writes: str = DECODER_STATE_GRAPH):
    """coremltools (inputs, states, outputs) declarations of one function of the package. `state_writes`
    "host": the step and extend also take `cache_mask` (fp16 (1, 1, 1, C)) and every token function also
    returns `new_k` / `new_v` (fp16 (L, Hkv, S, Dh)); there is no bind function."""
    import coremltools as ct  # heavy: the PyTorch side (decoder_gate, tests) needs none

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
    with validated_per_pipeline():
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


def convert_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                    prompt: list[int] | None = None, backend: str = "mil", prefill: bool = False,
                    control_prompt: list[int] | None = None, extend: bool = False,
                    extend_len: int = EXTEND_LENGTH, state_writes: str = DECODER_STATE_DEFAULT) -> dict:
    """Export `decoder.mlpackage` into `settings.out_dir` with a teacher-forcing parity gate.

    Args:
        model: `CohereAsrForConditionalGeneration` (eval, float32).
        settings: `cohere_coreml.convert.ExportSettings` (precision, target, out_dir, force, ...).
        capacity: cache slots C (`shapes.cache_capacity`; default for 256 new tokens).
        memory_len: Tp, the padded encoder frames of the encoder package this decoder reads
            (`shapes.export_plan` computes it from the window).
        prompt: decoder prompt ids for the gate (default: 10 tokens from the config's start id).
        backend: runtime backend running the gate ("mil" interpreter on Linux, "auto" elsewhere).
        prefill: also add a `prefill` function (the whole prompt in one call, same states, weights
            shared) and make the package multifunction; `main` stays the step function.
        control_prompt: another prompt of the same length (other language / punctuation) for the
            gate's "wrong prompt" negative control (default: `prompt` reversed).
        extend: also add an `extend` function (`extend_len` tokens from a given slot in one call:
            forced prefixes), same states, weights shared.
        state_writes: "host" (the functions only read the state and return the new K/V rows, which the
            host writes; no bind function) or "graph" (the functions write the cache, bind_memory the
            memory). docs/decoder.md says which is the default and why.

    Returns a dict: package path, shapes, parity report (`GateReport.to_dict()`, also written to
    `decoder.parity.json`; None when skipped or unchecked), written (False: the package existed).
    Raises `ParityError` (package not written) when the gate fails.
    """
    staged, result = stage_decoder(model, settings, capacity, memory_len, prompt, backend, prefill, control_prompt,
                                   extend, extend_len, state_writes)
    if staged is None:
        return result
    report = staged.finish()
    result["written"] = True
    result["parity"] = None if report.skipped else report.to_dict()
    return result


def stage_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                  prompt: list[int] | None = None, backend: str = "mil", prefill: bool = False,
                  control_prompt: list[int] | None = None, extend: bool = False,
                  extend_len: int = EXTEND_LENGTH,
                  state_writes: str = DECODER_STATE_DEFAULT) -> tuple[StagedPackage | None, dict]:
    """`convert_decoder` up to the gate: the package at its temporary path (traced and converted
    inside the writer, so no program object outlives it), the teacher-forcing reference and the
    negative controls computed with PyTorch. Returns (staged package or None when skipped, the
    result dict `convert_decoder` returns before gating); `finish()` gates and installs it."""
    capacity = int(capacity) if capacity else cache_capacity()
    if state_writes not in DECODER_STATES:
        raise DecoderExportError(f"--decoder-state must be one of {', '.join(DECODER_STATES)}, got {state_writes!r}")
    host = state_writes == DECODER_STATE_HOST
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
    if skip_installed(settings, COMPONENT):
        return None, result
    meta = {
        "com.cohere_coreml.component": "decoder",
        "com.cohere_coreml.decoder_shapes": shapes.to_dict(),
        "com.cohere_coreml.cache_capacity": str(shapes.capacity),
        "com.cohere_coreml.memory_len": str(shapes.memory_len),
        "com.cohere_coreml.eos_token_id": str(model.config.eos_token_id),
        "com.cohere_coreml.decoder_state": state_writes,
    }

    def convert(function: str):
        """Trace and convert one function of the package (a single-function model named `main`)."""
        if function == BIND_FUNCTION:
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
            logger.info("decoder: tracing (L=%d Hkv=%d C=%d Tp=%d Dh=%d V=%d)", shapes.num_layers,
                        shapes.num_kv_heads, shapes.capacity, shapes.memory_len, shapes.head_dim, shapes.vocab_size)
            traced = trace_decoder_step((DecoderStepHost if host else DecoderStep)(model, capacity, memory_len))
            descriptions = HOST_DESCRIPTIONS if host else DECODER_DESCRIPTIONS
            summary = "Cohere Transcribe decoder step (stateful KV cache + bound cross memory, log-softmax output)"
        inputs, states, outputs = coreml_io(shapes, function, prompt_len=len(gate_prompt), extend_len=extend_len,
                                            state_writes=state_writes)
        if host:
            summary = summary.replace("stateful KV cache", "reads its state, returns new K/V rows for the host")
        return convert_module(traced, inputs, outputs, settings, states=states,
                              metadata={**meta, "com.cohere_coreml.function": function},
                              descriptions={k: v for k, v in descriptions.items()
                                            if k in {t.name for t in (*inputs, *states, *outputs)}},
                              short_description=summary)

    functions = ([STEP_FUNCTION] + ([] if host else [BIND_FUNCTION]) + ([PREFILL_FUNCTION] if prefill else [])
                 + ([EXTEND_FUNCTION] if extend else []))

    def write(tmp: Path) -> None:
        save_multifunction({fn: (lambda fn=fn: convert(fn)) for fn in functions}, tmp)

    def prepare():  # the gate's PyTorch side (reference, negative controls), once the package is written
        return prepare_gate(model, partial(TorchDecoder.of, model, state_writes=state_writes), shapes.memory_len,
                            shapes.capacity, gate_prompt, control_prompt, settings.precision, settings.min_psnr_db,
                            backend, prefill, extend_len if extend else None, state_writes=state_writes)

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
