"""The PyTorch modules traced for each function of `decoder.mlpackage`: `StatefulDecoder` (the
`transformers` Cohere ASR decoder layers with a static KV cache and the cross memory in the state;
none of the layers re-implemented) and one wrapper per function.

The default "host" state: `DecoderStepHost`, `DecoderPrefillHost`, `DecoderExtendHost` only read the
state and return their tokens' new K/V rows (the host writes them, and the cross memory once per window);
`DecoderStepBatch` is the host step for B windows at once, on a state of B rows.
The "graph" state: `DecoderBind` (bind_memory), `DecoderStep`, `DecoderPrefill`, `DecoderExtend` write
the state themselves. Tracing, conversion and the gate: `cohere_coreml.export.decoder`, whose docstring
gives each function's inputs, outputs and effect.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers.models.cohere_asr.modeling_cohere_asr import eager_attention_forward

from ..config import EXTEND_LENGTH, FP16_MASK_VALUE
from ..model.shapes import DecoderShapes

MASK_VALUE = FP16_MASK_VALUE
STATE_DTYPE = torch.float16  # Core ML states are fp16 only (even in an fp32 program)
COMPUTE_DTYPE = torch.float32  # of the traced graph; the program's precision is the converter's


class DecoderExportError(RuntimeError):
    """Raised when the decoder cannot be exported or fails its parity gate."""


def stable_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last axis as x - max - log(sum(exp(x - max))).

    Not `torch.log_softmax`: coremltools lowers that to log(softmax(x)), and in fp16 every
    probability below ~6e-8 (log-prob < -16.6) underflows there and comes out as log(1e-45) =
    -103.3 (on the trained small model that ruins the log-prob parity: docs/decoder.md). This form
    keeps the small log-probs (beam search needs them).
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


class StatefulDecoder(nn.Module):
    """`CohereAsrForConditionalGeneration`'s decoder over the package's state buffers.

    The five registered fp16 buffers are the Core ML states (same names). Each function of the
    package is a subclass whose `forward` calls one method here: `run_tokens` (the step, prefill and
    extend of both variants: with a `cache_mask` it only reads the state, the default "host" design)
    and `bind_memory` (DecoderBind, the "graph" design's bind function). The PyTorch twin
    (`TorchDecoder`) calls the same methods, so a module's twin and its package compute the same thing.
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
        cross_heads: list[tuple[int, int]] | None = None,  # the alignment function's (layer, head)s
    ):
        """Feed S consecutive tokens; returns the log-probs after the last one, (1, V), or with `all_rows`
        after each of them, (1, S, V).

        With `cross_heads` (the `align` function) it returns instead the softmax cross-attention weights of
        those heads, in that order, (1, len(cross_heads), S, Tp) fp16, and stops after the cross attention of
        the last layer holding one of them (no later layer, no LM head).

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

        weights = {}  # layer -> (1, H, S, Tp) cross-attention weights (the align function's)
        last = max(layer for layer, _ in cross_heads) if cross_heads else len(dec.layers) - 1
        for i, layer in enumerate(dec.layers[: last + 1]):
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
            out, attn_weights = eager_attention_forward(attn, q, ck, cv, cross_mask, scaling=attn.scaling)
            if cross_heads:
                weights[i] = attn_weights
                if i == last:
                    # the values are not needed past this point; one of them, times 0, keeps the cross_v state
                    # read when every selected head lies in the first layer (coremltools refuses unused states)
                    anchor = cv[0, 0, 0, 0] * 0
                    break
            out = attn.o_proj(out.reshape(1, n, s.num_heads * s.head_dim))
            hidden = residual + out

            # --- MLP ---
            residual = hidden
            hidden = residual + layer.mlp(layer.final_layernorm(hidden))

        if cross_heads:  # (1, S_heads, S, Tp): head h of layer l is attention head h (query heads)
            chosen = torch.stack([weights[li][0, h] for li, h in cross_heads], dim=0).unsqueeze(0)
            return (chosen + anchor).to(STATE_DTYPE)
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


class DecoderStepBatch(StatefulDecoder):
    """`step_batch` (host-state only): one decode step for each of B windows in one call, so a step reads the
    weights once for B tokens. Row b has its own token, position, cache mask and cross memory; the states hold B
    rows folded into the head axis (`DecoderShapes.batch_state_shapes`: row b is heads b*Hkv..(b+1)*Hkv-1 of
    every layer), viewed as batch (B, Hkv, ., Dh) for attention, so every tensor stays rank 4. Rows never mix:
    the projections, norms and MLP act per row, and each row attends over its own cache slots, its own new K/V
    and its own memory under its own masks. It only reads the state; the host writes each row's new K/V at that
    row's position and each row's memory when a window enters the row (docs/decoder.md)."""

    def __init__(self, model, capacity: int, memory_len: int, batch: int):
        super().__init__(model, capacity, memory_len)
        if batch < 2:
            raise DecoderExportError(f"a batched step needs at least 2 rows, got {batch}")
        self.batch = int(batch)
        for name, shape in self.shapes.batch_state_shapes(batch).items():  # re-registered with B rows
            self.register_buffer(name, torch.zeros(shape, dtype=STATE_DTYPE))

    def rows(self, name: str, i: int) -> torch.Tensor:
        """Layer i of the state `name` as (B, Hkv, T, Dh), compute dtype (T = C for the cache, Tp for the memory)."""
        s = self.shapes
        buf = getattr(self, name)
        return buf[i : i + 1].view(self.batch, s.num_kv_heads, buf.shape[2], s.head_dim).to(COMPUTE_DTYPE)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, 1) int32: each row's token
        position: torch.Tensor,  # (B,) int32: each row's slot (the position embedding's index)
        cache_mask: torch.Tensor,  # (B, 1, 1, C) fp16: row b's filled slots 0, the others -1e4
    ):  # -> log_probs (B, V), new_k, new_v (L, B*Hkv, 1, Dh) fp16
        s = self.shapes
        dec = self.decoder
        b, hkv, h, dh = self.batch, s.num_kv_heads, s.num_heads, s.head_dim
        hidden = dec.embed_tokens(input_ids)  # (B, 1, D)
        hidden = dec.embedding_layernorm(hidden + dec.pos_emb(position).unsqueeze(1))  # (B, 1, D)
        dtype = hidden.dtype
        # each row: its cache slots, then its own new token (always visible to itself: a constant 0)
        self_mask = torch.cat([cache_mask.to(dtype), torch.zeros((b, 1, 1, 1), dtype=dtype)], dim=-1)  # (B, 1, 1, C+1)
        cross_mask = self.cross_mask.to(dtype)  # (B, 1, 1, Tp): row b's valid frames
        new_k, new_v = [], []
        for i, layer in enumerate(dec.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(x).view(b, 1, h, dh).transpose(1, 2)  # (B, H, 1, Dh)
            k16 = attn.k_proj(x).view(b, 1, hkv, dh).transpose(1, 2).to(STATE_DTYPE)  # (B, Hkv, 1, Dh)
            v16 = attn.v_proj(x).view(b, 1, hkv, dh).transpose(1, 2).to(STATE_DTYPE)
            new_k.append(k16.reshape(1, b * hkv, 1, dh))
            new_v.append(v16.reshape(1, b * hkv, 1, dh))
            keys = torch.cat([self.rows("self_k", i), k16.to(dtype)], dim=2)  # (B, Hkv, C+1, Dh)
            values = torch.cat([self.rows("self_v", i), v16.to(dtype)], dim=2)
            out, _ = eager_attention_forward(attn, q, keys, values, self_mask, scaling=attn.scaling)  # (B, 1, H, Dh)
            hidden = residual + attn.o_proj(out.reshape(b, 1, h * dh))

            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            attn = layer.encoder_attn
            q = attn.q_proj(x).view(b, 1, h, dh).transpose(1, 2)  # (B, H, 1, Dh)
            out, _ = eager_attention_forward(attn, q, self.rows("cross_k", i), self.rows("cross_v", i), cross_mask,
                                             scaling=attn.scaling)
            hidden = residual + attn.o_proj(out.reshape(b, 1, h * dh))

            residual = hidden
            hidden = residual + layer.mlp(layer.final_layernorm(hidden))
        log_probs = stable_log_softmax(self.proj_out(dec.norm(hidden[:, 0, :])))  # (B, V)
        return log_probs, torch.cat(new_k, dim=0), torch.cat(new_v, dim=0)  # (L, B*Hkv, 1, Dh)


class DecoderAlign(DecoderExtend):
    """`align` (both state variants): the host-state extend returning the alignment heads' cross-attention weights
    instead of log-probs (word timings, docs/word-timings.md). K token slots from `position` over the cache slots
    `cache_mask` leaves open, causal among themselves; it stops after the last layer holding a selected head. It
    only reads the state, in either variant: the window's decoded self cache (the K/V of its tokens at slots <
    position: the precondition, true once the host has decoded or fed them) and its bound cross memory."""

    def __init__(self, model, capacity: int, memory_len: int, heads, align_len: int = EXTEND_LENGTH):
        super().__init__(model, capacity, memory_len, align_len)
        self.heads = [(int(layer), int(head)) for layer, head in heads]
        if not self.heads:
            raise DecoderExportError("the align function needs at least one alignment head")
        s = self.shapes
        bad = [h for h in self.heads if not (0 <= h[0] < s.num_layers and 0 <= h[1] < s.num_heads)]
        if bad:
            raise DecoderExportError(f"alignment heads {bad} lie outside the decoder's {s.num_layers} layers x "
                                     f"{s.num_heads} heads")

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, cache_mask: torch.Tensor) -> torch.Tensor:
        # (1, K) int32, (1,) int32, (1, 1, 1, C) fp16 -> (1, S_heads, K, Tp) fp16
        return self.run_tokens(input_ids, position + self.offsets, cache_mask=cache_mask, cross_heads=self.heads)


class RecomputingStep(StatefulDecoder):
    """Only for the MAC-count comparison (tools/bench/count_decoder_macs.py): the design published ports
    use, where the step takes the encoder memory (1, T, Ddec) and recomputes every layer's cross
    K/V from it at every step. Never exported as a product."""

    def forward(self, input_ids, position, encoder_memory, cross_mask):
        def memory(i):
            attn = self.decoder.layers[i].encoder_attn
            kv_shape = (1, encoder_memory.shape[1], -1, self.shapes.head_dim)
            return (attn.k_proj(encoder_memory).view(kv_shape).transpose(1, 2),
                    attn.v_proj(encoder_memory).view(kv_shape).transpose(1, 2))

        return self.run_tokens(input_ids, position, memory=memory, cross_mask=cross_mask)
