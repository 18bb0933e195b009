"""Stateful decoder step: the `transformers` Cohere ASR decoder with a static KV cache.

One call of the exported program decodes ONE token:

    inputs : input_ids  int32 (1, 1)           the token at `position`
             position   int32 (1,)             its slot in the self-attention cache (0-based)
             cross_k    (L, Hkv, Tp, Dh)       precomputed by the encoder package
             cross_v    (L, Hkv, Tp, Dh)
             cross_mask (1, 1, 1, Tp)          additive: 0 valid frame, -1e4 padding
    states : self_k, self_v  fp16 (L, Hkv, C, Dh)   written at slot `position`
    outputs: log_probs  (1, V)                 log-softmax over the vocabulary

The module reuses the `transformers` submodules (embeddings, layer norms, q/k/v/o projections,
MLP, final norm, `proj_out`) and `eager_attention_forward`; only the static-cache glue lives
here. The step contains no projection of the encoder memory: cross K/V come precomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from transformers.models.cohere_asr.modeling_cohere_asr import eager_attention_forward

from .config import ANE_MULTIPLE, FP16_MASK_VALUE, PREFILL_FUNCTION, PROMPT_LENGTH, round_up
from .convert import MIN_PSNR_DB, ExportSettings, convert_module, psnr, skip_installed
from .gate import GateReport, StagedPackage, stage_gated
from .reference import cross_memory
from .shapes import DecoderShapes, cache_capacity

logger = logging.getLogger(__name__)

COMPONENT = "decoder"
MASK_VALUE = FP16_MASK_VALUE


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


class DecoderStep(nn.Module):
    """One decode step of `CohereAsrForConditionalGeneration` with a static fp16 KV cache.

    `self_k` / `self_v` are registered buffers; under `coremltools` they become Core ML states.
    """

    def __init__(self, model, capacity: int, memory_len: int, recompute_cross_kv: bool = False):
        super().__init__()
        config = model.config
        self.shapes = DecoderShapes.from_config(config, capacity, memory_len)
        self.decoder = model.model.decoder  # CohereAsrDecoder (embed_tokens, pos_emb, layers, norm, ...)
        self.proj_out = model.proj_out  # LM head
        # Only for the MAC-count comparison (tools/count_decoder_macs.py): the design published
        # ports use, where cross K/V are recomputed from the encoder memory at every step.
        self.recompute_cross_kv = recompute_cross_kv
        s = self.shapes
        self.register_buffer("self_k", torch.zeros(s.cache_shape, dtype=torch.float16))
        self.register_buffer("self_v", torch.zeros(s.cache_shape, dtype=torch.float16))
        # slot index row used to build the causal mask: (1, 1, 1, C)
        self.register_buffer(
            "slots", torch.arange(s.capacity, dtype=torch.int32).view(1, 1, 1, s.capacity), persistent=False
        )

    def reset(self) -> None:
        self.self_k.zero_()
        self.self_v.zero_()

    def _cross_kv(self, i: int, cross_k: torch.Tensor, cross_v: torch.Tensor):
        """Cross K/V of layer i in head layout (1, Hkv, Tp, Dh)."""
        if not self.recompute_cross_kv:
            return cross_k[i : i + 1], cross_v[i : i + 1]
        # cross_k holds the encoder memory (1, Tp, Ddec) in this (comparison-only) mode
        attn = self.decoder.layers[i].encoder_attn
        memory = cross_k
        kv_shape = (1, memory.shape[1], -1, self.shapes.head_dim)
        k = attn.k_proj(memory).view(kv_shape).transpose(1, 2)
        v = attn.v_proj(memory).view(kv_shape).transpose(1, 2)
        return k, v

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, 1) int32
        position: torch.Tensor,  # (1,) int32
        cross_k: torch.Tensor,  # (L, Hkv, Tp, Dh)
        cross_v: torch.Tensor,  # (L, Hkv, Tp, Dh)
        cross_mask: torch.Tensor,  # (1, 1, 1, Tp) additive
    ) -> torch.Tensor:
        return self.run_tokens(input_ids, position, cross_k, cross_v, cross_mask)

    def run_tokens(
        self,
        input_ids: torch.Tensor,  # (1, S) int32
        positions: torch.Tensor,  # (S,) int32, consecutive slots
        cross_k: torch.Tensor,  # (L, Hkv, Tp, Dh)
        cross_v: torch.Tensor,  # (L, Hkv, Tp, Dh)
        cross_mask: torch.Tensor,  # (1, 1, 1, Tp) additive
    ) -> torch.Tensor:
        """Feed S consecutive tokens; returns the log-probs after the last one, (1, V)."""
        s = self.shapes
        dec = self.decoder
        dtype = cross_mask.dtype
        n = input_ids.shape[1]  # S (static under tracing)
        p = positions[0]

        # token + learned absolute position, then layer norm (as CohereAsrDecoder.forward)
        hidden = dec.embed_tokens(input_ids)  # (1, S, D)
        hidden = dec.embedding_layernorm(hidden + dec.pos_emb(positions).unsqueeze(0))  # (1, S, D)

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
            # slice update with a tensor start (index assignment would be dropped by the tracer)
            self.self_k[i : i + 1, :, p : p + n, :] = k.to(self.self_k.dtype)
            self.self_v[i : i + 1, :, p : p + n, :] = v.to(self.self_v.dtype)
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
            ck, cv = self._cross_kv(i, cross_k, cross_v)  # (1, Hkv, Tp, Dh)
            out, _ = eager_attention_forward(attn, q, ck, cv, cross_mask, scaling=attn.scaling)
            out = attn.o_proj(out.reshape(1, n, s.num_heads * s.head_dim))
            hidden = residual + out

            # --- MLP ---
            residual = hidden
            hidden = residual + layer.mlp(layer.final_layernorm(hidden))

        hidden = dec.norm(hidden[:, -1:, :])  # (1, 1, D): only the last token's prediction is used
        logits = self.proj_out(hidden[:, 0, :])  # (1, V)
        return stable_log_softmax(logits)  # (1, V)


class DecoderPrefill(DecoderStep):
    """The whole prompt in one call: writes cache slots 0..P-1, returns the log-probs after the last
    prompt token. Same states as `DecoderStep`, so both can live in one multifunction package and
    share weights and the state object."""

    def __init__(self, model, capacity: int, memory_len: int, prompt_len: int):
        super().__init__(model, capacity, memory_len)
        if not 1 <= prompt_len <= capacity:
            raise DecoderExportError(f"prompt length {prompt_len} does not fit a cache of {capacity} slots")
        self.prompt_len = int(prompt_len)
        self.register_buffer("prompt_positions", torch.arange(prompt_len, dtype=torch.int32), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, P) int32
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        cross_mask: torch.Tensor,
    ) -> torch.Tensor:
        return self.run_tokens(input_ids, self.prompt_positions, cross_k, cross_v, cross_mask)


def example_inputs(shapes: DecoderShapes, dtype=torch.float32):
    return (
        torch.zeros((1, 1), dtype=torch.int32),
        torch.zeros((1,), dtype=torch.int32),
        torch.zeros(shapes.memory_shape, dtype=dtype),
        torch.zeros(shapes.memory_shape, dtype=dtype),
        torch.zeros((1, 1, 1, shapes.memory_len), dtype=dtype),
    )


def trace_decoder_step(step: DecoderStep):
    step = step.eval()
    with torch.no_grad():
        traced = torch.jit.trace(step, example_inputs(step.shapes), check_trace=False)
    step.reset()
    return traced




def trace_decoder_prefill(prefill: "DecoderPrefill"):
    prefill = prefill.eval()
    ex = example_inputs(prefill.shapes)
    ids = torch.zeros((1, prefill.prompt_len), dtype=torch.int32)
    with torch.no_grad():
        traced = torch.jit.trace(prefill, (ids, ex[2], ex[3], ex[4]), check_trace=False)
    prefill.reset()
    return traced


def coreml_prefill_io(shapes: DecoderShapes, prompt_len: int):
    """Declarations of the prefill function: the step's minus `position`, `input_ids` (1, P)."""
    import coremltools as ct

    inputs, states, outputs = coreml_io(shapes)
    inputs = [ct.TensorType(name="input_ids", shape=(1, prompt_len), dtype=np.int32)] + [
        t for t in inputs if t.name not in ("input_ids", "position")
    ]
    return inputs, states, outputs


def coreml_io(shapes: DecoderShapes, recompute_cross_kv: bool = False):
    """coremltools input/state/output declarations of the decode-step program."""
    import coremltools as ct

    if recompute_cross_kv:
        mem = ct.TensorType(name="encoder_memory", shape=(1, shapes.memory_len, shapes.hidden_size))
        cross = [mem, ct.TensorType(name="unused_v", shape=(1,))]
    else:
        cross = [
            ct.TensorType(name="cross_k", shape=shapes.memory_shape),
            ct.TensorType(name="cross_v", shape=shapes.memory_shape),
        ]
    inputs = [
        ct.TensorType(name="input_ids", shape=(1, 1), dtype=np.int32),
        ct.TensorType(name="position", shape=(1,), dtype=np.int32),
        *cross,
        ct.TensorType(name="cross_mask", shape=(1, 1, 1, shapes.memory_len)),
    ]
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=shapes.cache_shape, dtype=np.float16), name="self_k"),
        ct.StateType(wrapped_type=ct.TensorType(shape=shapes.cache_shape, dtype=np.float16), name="self_v"),
    ]
    outputs = [ct.TensorType(name="log_probs")]
    return inputs, states, outputs


def build_step_mlmodel(model, capacity: int, memory_len: int, precision: str = "fp16", recompute_cross_kv=False):
    """Trace the decode step and convert it to an (in-memory) Core ML ML program."""
    import coremltools as ct

    step = DecoderStep(model, capacity, memory_len, recompute_cross_kv=recompute_cross_kv).eval()
    if recompute_cross_kv:
        ex = list(example_inputs(step.shapes))
        ex[2] = torch.zeros((1, memory_len, step.shapes.hidden_size))
        ex[3] = torch.zeros((1,))
        with torch.no_grad():
            traced = torch.jit.trace(step, tuple(ex), check_trace=False)
        step.reset()
    else:
        traced = trace_decoder_step(step)
    inputs, states, outputs = coreml_io(step.shapes, recompute_cross_kv)
    prec = {"fp16": ct.precision.FLOAT16, "fp32": ct.precision.FLOAT32}[precision]
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
# Export with a parity gate
# --------------------------------------------------------------------------------------------

# Per-step KL(PyTorch || package) each program precision must stay under (mean over steps).
MAX_KL = {"fp32": 1e-4, "fp16": 5e-3}  # fp32 programs still keep an fp16 KV cache

DECODER_DESCRIPTIONS = {
    "input_ids": "int32 (1, 1): the token at `position` (prompt token, then the previous prediction)",
    "position": "int32 (1,): slot of this token in the self-attention cache, 0-based, < capacity",
    "cross_k": "(L, Hkv, Tp, Dh) cross-attention keys from encoder.mlpackage",
    "cross_v": "(L, Hkv, Tp, Dh) cross-attention values from encoder.mlpackage",
    "cross_mask": "(1, 1, 1, Tp) additive mask from encoder.mlpackage: 0 valid frame, -1e4 padding",
    "log_probs": "(1, V) log-softmax over the vocabulary for the token after `position`",
    "self_k": "fp16 (L, Hkv, C, Dh) self-attention keys; zero-initialised per window",
    "self_v": "fp16 (L, Hkv, C, Dh) self-attention values; zero-initialised per window",
}


@dataclass
class TeacherForcingCase:
    """PyTorch reference for one teacher-forced decode: cross memory, token sequence, log-probs."""

    cross_k: np.ndarray  # (L, Hkv, Tp, Dh) float32
    cross_v: np.ndarray
    cross_mask: np.ndarray  # (1, 1, 1, Tp) float32
    ids: list[int]  # prompt + generated tokens fed one per step
    log_probs: np.ndarray  # (len(ids), V) reference log-probs after each fed token
    prompt_len: int


def teacher_forcing_case(model, memory_len: int, prompt: list[int], encoder_hidden=None, encoder_mask=None,
                         new_tokens: int = 16, seed: int = 0, tail_garbage: float = 30.0) -> TeacherForcingCase:
    """Reference log-probs of `CohereAsrForConditionalGeneration` under teacher forcing.

    The sequence is `prompt` + the model's own greedy continuation, so the steps are the ones a
    real decode visits. Without `encoder_hidden`, a random feature window whose valid length
    leaves a padded tail is encoded first. The padded tail of the cross memory the package sees is
    then filled with random values of scale `tail_garbage` (the reference never sees them): a
    program that does not apply the cross mask fails loudly, even with random weights whose
    cross-attention contributes little.
    """
    from transformers.models.parakeet.modeling_parakeet import ParakeetEncoderModelOutput

    enc_cfg = model.config.encoder_config
    with torch.no_grad():
        if encoder_hidden is None:
            g = torch.Generator().manual_seed(seed)
            frames = 8 * memory_len  # any length; only the encoder frames matter here
            feats = torch.randn(1, frames, enc_cfg.num_mel_bins, generator=g)
            mask = torch.zeros(1, frames, dtype=torch.long)
            mask[:, : frames * 3 // 4] = 1
            out = model.model.encoder(feats, attention_mask=mask)
            encoder_hidden, encoder_mask = out.last_hidden_state, out.attention_mask
        t = encoder_hidden.shape[1]
        if t > memory_len:
            encoder_hidden = encoder_hidden[:, :memory_len]
            encoder_mask = None if encoder_mask is None else encoder_mask[:, :memory_len]
            t = memory_len
        n_valid = t if encoder_mask is None else int(encoder_mask.sum())
        enc_out = ParakeetEncoderModelOutput(last_hidden_state=encoder_hidden, attention_mask=encoder_mask)
        # plain teacher-forcing loop (full forward each step): the reference is the model itself
        ids = list(prompt)
        logits = None
        for _ in range(new_tokens):
            logits = model(encoder_outputs=enc_out, decoder_input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] == model.config.eos_token_id:
                break
        ids = ids[:-1]  # the last prediction is not fed
        logits = model(encoder_outputs=enc_out, decoder_input_ids=torch.tensor([ids])).logits
        log_probs = torch.log_softmax(logits[0], dim=-1).numpy()  # (S, V)
        memory = cross_memory(model, encoder_hidden, n_valid, memory_len)
        cross_k, cross_v, cross_mask = (torch.from_numpy(memory[k]) for k in ("cross_k", "cross_v", "cross_mask"))
        if tail_garbage and n_valid < memory_len:
            g = torch.Generator().manual_seed(seed + 1)
            for mem in (cross_k, cross_v):
                tail = mem[:, :, n_valid:]
                mem[:, :, n_valid:] = torch.randn(tail.shape, generator=g) * tail_garbage
    return TeacherForcingCase(
        cross_k=cross_k.numpy(), cross_v=cross_v.numpy(), cross_mask=cross_mask.numpy(),
        ids=ids, log_probs=log_probs, prompt_len=len(prompt),
    )


def kl_rows(ref_log_probs: np.ndarray, out_log_probs: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_out) per row of log-prob matrices (S, V) -> (S,)."""
    lp = np.asarray(ref_log_probs, np.float64)
    lq = np.asarray(out_log_probs, np.float64)
    lq = lq - lq.max(-1, keepdims=True)
    lq = lq - np.log(np.sum(np.exp(lq), -1, keepdims=True))  # renormalise (fp16 rounding)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def run_teacher_forcing(runtime_model, case: TeacherForcingCase) -> np.ndarray:
    """Feed `case.ids` one per step through a loaded decoder package; returns (S, V) log-probs."""
    state = runtime_model.make_state()
    rows = []
    for pos, token in enumerate(case.ids):
        out = runtime_model.predict(
            {
                "input_ids": np.array([[token]], dtype=np.int32),
                "position": np.array([pos], dtype=np.int32),
                "cross_k": case.cross_k,
                "cross_v": case.cross_v,
                "cross_mask": case.cross_mask,
            },
            state=state,
        )
        rows.append(np.asarray(out["log_probs"], dtype=np.float32).reshape(-1))
    return np.stack(rows)


def teacher_forcing_report(case: TeacherForcingCase, produced: np.ndarray, precision: str,
                           min_psnr_db: float | None = None) -> dict:
    """Per-step PSNR / KL figures and the argmax agreement of a teacher-forced run."""
    min_psnr = MIN_PSNR_DB[precision] if min_psnr_db is None else float(min_psnr_db)
    kls = kl_rows(case.log_probs, produced)
    psnrs = [psnr(case.log_probs[i], produced[i]) for i in range(len(case.ids))]
    argmax_ref = case.log_probs.argmax(-1)
    argmax_out = produced.argmax(-1)
    # steps whose prediction greedy decoding uses: from the last prompt token on (predictions
    # after earlier prompt tokens are never read, and are often near-ties in random models)
    decoding = slice(max(case.prompt_len - 1, 0), len(case.ids))
    finite = bool(np.all(np.isfinite(produced)))
    report = {
        "precision": precision,
        "steps": len(case.ids),
        "prompt_len": case.prompt_len,
        "min_psnr_db_required": min_psnr,
        "max_kl_allowed": MAX_KL[precision],
        "worst_psnr_db": float(min(psnrs)),
        "mean_kl": float(np.mean(kls)),
        "max_kl": float(np.max(kls)),
        "argmax_agree": int(np.sum(argmax_ref[decoding] == argmax_out[decoding])),
        "argmax_steps": len(case.ids) - decoding.start,
        "argmax_agree_all_steps": int(np.sum(argmax_ref == argmax_out)),
        "per_step": [
            {"position": i, "token": int(case.ids[i]), "psnr_db": float(psnrs[i]), "kl": float(kls[i]),
             "argmax_ref": int(argmax_ref[i]), "argmax_out": int(argmax_out[i])}
            for i in range(len(case.ids))
        ],
    }
    report["passed"] = bool(
        finite and report["worst_psnr_db"] >= min_psnr and report["mean_kl"] <= MAX_KL[precision]
        and report["argmax_agree"] == report["argmax_steps"]
    )
    return report


class TorchStepRuntime:
    """A PyTorch `DecoderStep` behind the runtime interface (make_state / predict): the gate's
    negative controls run through it, and tests use it as the PyTorch twin of a package."""

    backend = "torch"

    def __init__(self, step: DecoderStep):
        self.step = step.eval()

    def make_state(self):
        self.step.reset()
        return self.step

    def predict(self, inputs: dict, state=None) -> dict:
        args = [torch.from_numpy(np.asarray(inputs[k])) for k in ("input_ids", "position", "cross_k", "cross_v",
                                                                   "cross_mask")]
        with torch.no_grad():
            return {"log_probs": self.step(*args).numpy()}


# Deliberately wrong inputs the gate must be able to refuse. Each is a package defect class: the
# cross memory not reaching the step (zeros), cross K and V swapped, the layers' K/V in another
# order, and the prompt ids of another language / punctuation mode.
NEGATIVE_CONTROLS = ("zero_memory", "swapped_kv", "permuted_layers", "wrong_prompt")


def control_case(case: TeacherForcingCase, name: str, control_prompt: list[int] | None = None):
    """`case` with the inputs a broken package would see (None when the break changes nothing)."""
    ck, cv, ids = case.cross_k, case.cross_v, list(case.ids)
    if name == "zero_memory":
        ck, cv = np.zeros_like(ck), np.zeros_like(cv)
    elif name == "swapped_kv":
        ck, cv = cv, ck
    elif name == "permuted_layers":
        if ck.shape[0] < 2:
            return None  # one layer: nothing to permute
        ck, cv = ck[::-1].copy(), cv[::-1].copy()
    elif name == "wrong_prompt":
        if control_prompt is None or len(control_prompt) != case.prompt_len:
            return None
        if list(control_prompt) == ids[: case.prompt_len]:
            return None
        ids[: case.prompt_len] = [int(t) for t in control_prompt]
    else:
        raise ValueError(f"unknown negative control {name!r}; choose from {NEGATIVE_CONTROLS}")
    return TeacherForcingCase(cross_k=ck, cross_v=cv, cross_mask=case.cross_mask, ids=ids,
                              log_probs=case.log_probs, prompt_len=case.prompt_len)


def negative_controls(model, case: TeacherForcingCase, precision: str, min_psnr_db: float | None = None,
                      control_prompt: list[int] | None = None) -> dict:
    """Can this gate case tell a right package from a broken one?

    Each control runs the PyTorch step on the broken inputs (`control_case`) and scores it against
    the case's reference exactly as the gate scores a package. `discriminates` is True when the
    gate would refuse it. On random weights the output barely depends on the cross memory (the
    tiny test checkpoints: zero memory moves log-probs by ~2e-3, PSNR 81 dB, argmax unchanged), so
    the gate passes broken packages; this records that instead of leaving it unnoticed.
    """
    capacity = round_up(len(case.ids), ANE_MULTIPLE)
    runtime = TorchStepRuntime(DecoderStep(model, capacity, case.cross_k.shape[2]))
    results = {}
    for name in NEGATIVE_CONTROLS:
        broken = control_case(case, name, control_prompt)
        if broken is None:
            results[name] = {"applicable": False, "discriminates": None}
            continue
        rep = teacher_forcing_report(case, run_teacher_forcing(runtime, broken), precision, min_psnr_db)
        results[name] = {"applicable": True, "discriminates": not rep["passed"],
                         **{k: rep[k] for k in ("worst_psnr_db", "mean_kl", "argmax_agree", "argmax_steps")}}
        if rep["passed"]:
            logger.warning("decoder gate: a package with %s would pass (worst PSNR %.1f dB, mean KL %.2g, argmax "
                           "%d/%d): this gate case cannot detect that defect (weights whose output barely "
                           "depends on it, e.g. random ones)", name.replace("_", " "), rep["worst_psnr_db"],
                           rep["mean_kl"], rep["argmax_agree"], rep["argmax_steps"])
    return results


def teacher_forcing_gate(report: dict) -> GateReport:
    """The decoder's `GateReport` from a `teacher_forcing_report` dict (figures kept as they are)."""
    headline = (f"worst PSNR {report['worst_psnr_db']:.1f} dB, mean KL {report['mean_kl']:.3g}, "
                f"argmax {report['argmax_agree']}/{report['argmax_steps']} decoding steps")
    text = "" if report["passed"] else (
        f"decoder.mlpackage does not match PyTorch under teacher forcing: worst PSNR "
        f"{report['worst_psnr_db']:.1f} dB (need {report['min_psnr_db_required']}), mean KL "
        f"{report['mean_kl']:.3g} (max {report['max_kl_allowed']}), argmax "
        f"{report['argmax_agree']}/{report['argmax_steps']} decoding steps")
    details = {k: v for k, v in report.items() if k != "passed"}
    return GateReport(component=COMPONENT, passed=bool(report["passed"]), headline=headline, details=details, text=text)


def convert_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                    prompt: list[int] | None = None, backend: str = "mil", prefill: bool = False,
                    control_prompt: list[int] | None = None) -> dict:
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

    Returns a dict: package path, shapes, parity report (`GateReport.to_dict()`, also written to
    `decoder.parity.json`; None when skipped or unchecked), written (False: the package existed).
    Raises `ParityError` (package not written) when the gate fails.
    """
    staged, result = stage_decoder(model, settings, capacity, memory_len, prompt, backend, prefill, control_prompt)
    if staged is None:
        return result
    report = staged.finish()
    result["written"] = True
    result["parity"] = None if report.skipped else report.to_dict()
    return result


def stage_decoder(model, settings: ExportSettings, capacity: int | None = None, memory_len: int | None = None,
                  prompt: list[int] | None = None, backend: str = "mil", prefill: bool = False,
                  control_prompt: list[int] | None = None) -> tuple[StagedPackage | None, dict]:
    """`convert_decoder` up to the gate: the package at its temporary path (traced and converted
    inside the writer, so no program object outlives it), the teacher-forcing reference and the
    negative controls computed with PyTorch. Returns (staged package or None when skipped, the
    result dict `convert_decoder` returns before gating); `finish()` gates and installs it."""
    capacity = int(capacity) if capacity else cache_capacity()
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
    result = {"path": str(path), "shapes": shapes.to_dict(), "parity": None, "written": False,
              "functions": {"step": "main", "prefill": PREFILL_FUNCTION if prefill else None},
              "prefill_length": len(gate_prompt) if prefill else None}
    if skip_installed(settings, COMPONENT):
        return None, result
    meta = {
        "com.cohere_coreml.component": "decoder",
        "com.cohere_coreml.decoder_shapes": shapes.to_dict(),
        "com.cohere_coreml.cache_capacity": str(shapes.capacity),
        "com.cohere_coreml.memory_len": str(shapes.memory_len),
        "com.cohere_coreml.eos_token_id": str(model.config.eos_token_id),
    }

    def convert_step():
        logger.info("decoder: tracing (L=%d Hkv=%d C=%d Tp=%d Dh=%d V=%d)", shapes.num_layers,
                    shapes.num_kv_heads, shapes.capacity, shapes.memory_len, shapes.head_dim, shapes.vocab_size)
        traced = trace_decoder_step(DecoderStep(model, capacity, memory_len).eval())
        inputs, states, outputs = coreml_io(shapes)
        return convert_module(
            traced, inputs, outputs, settings, states=states, metadata=meta, descriptions=DECODER_DESCRIPTIONS,
            short_description="Cohere Transcribe decoder step (stateful KV cache, log-softmax output)",
        )

    def convert_prefill():
        pre = DecoderPrefill(model, capacity, memory_len, prompt_len=len(gate_prompt)).eval()
        p_inputs, p_states, p_outputs = coreml_prefill_io(shapes, len(gate_prompt))
        return convert_module(
            trace_decoder_prefill(pre), p_inputs, p_outputs, settings, states=p_states,
            metadata={**meta, "com.cohere_coreml.component": "decoder_prefill"},
            short_description="Cohere Transcribe decoder prompt prefill (stateful KV cache)",
        )

    def write(tmp: Path) -> None:
        if prefill:
            _save_with_prefill(convert_step, convert_prefill, tmp)
        else:
            convert_step().save(str(tmp))

    def prepare():
        # the PyTorch side of the gate, before the package is loaded: the reference and the controls
        case = teacher_forcing_case(model, shapes.memory_len, gate_prompt,
                                    new_tokens=min(16, shapes.capacity - len(gate_prompt)))
        # negative controls: would this case refuse a broken package? (warns when it cannot)
        controls = negative_controls(model, case, settings.precision, settings.min_psnr_db,
                                     control_prompt=control_prompt)

        def gate(tmp_path: Path) -> GateReport:
            from .runtime import load_model

            step_model = load_model(str(tmp_path), backend=backend)
            produced = run_teacher_forcing(step_model, case)
            report = teacher_forcing_report(case, produced, settings.precision, settings.min_psnr_db)
            if prefill:
                pre_model = load_model(str(tmp_path), backend=backend, function_name=PREFILL_FUNCTION)
                trimmed, rows = run_prefill_teacher_forcing(step_model, pre_model, case)
                pre_report = teacher_forcing_report(trimmed, rows, settings.precision, settings.min_psnr_db)
                report["prefill"] = {k: v for k, v in pre_report.items() if k != "per_step"}
                for key in ("worst_psnr_db", "mean_kl"):
                    report[key] = min(report[key], pre_report[key]) if key == "worst_psnr_db" else max(
                        report[key], pre_report[key])
                report["passed"] = bool(report["passed"] and pre_report["passed"])
            report["controls"] = controls
            report["discriminates"] = all(c["discriminates"] for c in controls.values() if c["applicable"])
            return teacher_forcing_gate(report)

        return gate

    return stage_gated(COMPONENT, settings, write, prepare), result


def _save_with_prefill(convert_step, convert_prefill, tmp: Path) -> None:
    """Merge step (`main`) and prefill into one multifunction package at `tmp` (weights stored once).

    Each program is converted, saved and dropped in turn (only one converted program in memory)."""
    import shutil
    import tempfile

    import coremltools as ct

    scratch = Path(tempfile.mkdtemp(prefix="decoder-mf-"))
    try:
        step_path, pre_path = scratch / "step.mlpackage", scratch / "prefill.mlpackage"
        convert_step().save(str(step_path))
        convert_prefill().save(str(pre_path))
        descriptor = ct.utils.MultiFunctionDescriptor()
        descriptor.add_function(str(step_path), src_function_name="main", target_function_name="main")
        descriptor.add_function(str(pre_path), src_function_name="main", target_function_name=PREFILL_FUNCTION)
        descriptor.default_function_name = "main"
        merged = scratch / "merged.mlpackage"
        ct.utils.save_multifunction(descriptor, str(merged))
        merged_model = ct.models.MLModel(str(merged), skip_model_load=True)
        step_meta = ct.models.MLModel(str(step_path), skip_model_load=True).user_defined_metadata
        merged_model.user_defined_metadata.update(dict(step_meta))
        merged_model.user_defined_metadata["com.cohere_coreml.functions"] = f"main (step), {PREFILL_FUNCTION}"
        merged_model.save(str(tmp))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_prefill_teacher_forcing(step_model, prefill_model, case: TeacherForcingCase):
    """Prompt through `prefill_model` in one call, then the rest step by step with the SAME state.

    Returns (trimmed case, rows): rows are the log-probs after positions P-1 .. S-1, the trimmed
    case holds the matching reference rows (its prompt_len is 1: every row is a decoding row).
    """
    p = case.prompt_len
    cross = {"cross_k": case.cross_k, "cross_v": case.cross_v, "cross_mask": case.cross_mask}
    state = step_model.make_state()
    out = prefill_model.predict({"input_ids": np.array([case.ids[:p]], dtype=np.int32), **cross}, state=state)
    rows = [np.asarray(out["log_probs"], dtype=np.float32).reshape(-1)]
    for pos in range(p, len(case.ids)):
        out = step_model.predict({"input_ids": np.array([[case.ids[pos]]], dtype=np.int32),
                                  "position": np.array([pos], dtype=np.int32), **cross}, state=state)
        rows.append(np.asarray(out["log_probs"], dtype=np.float32).reshape(-1))
    trimmed = TeacherForcingCase(cross_k=case.cross_k, cross_v=case.cross_v, cross_mask=case.cross_mask,
                                 ids=case.ids[p - 1:], log_probs=case.log_probs[p - 1:], prompt_len=1)
    return trimmed, np.stack(rows)


# --------------------------------------------------------------------------------------------
# Static cost of a program
# --------------------------------------------------------------------------------------------


def count_macs(mil_program, function_name: str = "main") -> dict:
    """Multiply-adds of one call of a MIL program, from its static shapes.

    Counted: `linear` (rows x in x out), `matmul` (batch x M x K x N), `conv` (output elements x
    in-channels/groups x kernel). Element-wise ops, softmax and norms are not multiply-adds of
    weights and are left out (they are O(width) per token). Returns totals by op type and the
    largest ops.
    """
    fn = mil_program.functions[function_name]
    by_type: dict[str, int] = {}
    ops = []

    def shape(var):
        return tuple(int(d) for d in var.shape)

    def walk(block):
        for op in block.operations:
            for inner in getattr(op, "blocks", []):
                walk(inner)
            macs = 0
            if op.op_type == "linear":
                x, w = shape(op.x), shape(op.weight)
                macs = int(np.prod(x[:-1])) * w[0] * w[1]
            elif op.op_type == "matmul":
                x, y = list(shape(op.x)), list(shape(op.y))
                if op.transpose_x is not None and bool(op.transpose_x.val):
                    x[-1], x[-2] = x[-2], x[-1]
                if op.transpose_y is not None and bool(op.transpose_y.val):
                    y[-1], y[-2] = y[-2], y[-1]
                out = shape(op.outputs[0])
                macs = int(np.prod(out)) * x[-1]
            elif op.op_type == "conv":
                w = shape(op.weight)  # (Cout, Cin/groups, k...)
                macs = int(np.prod(shape(op.outputs[0]))) * int(np.prod(w[1:]))
            if macs:
                by_type[op.op_type] = by_type.get(op.op_type, 0) + macs
                ops.append((macs, op.op_type, op.name))

    walk(fn)
    ops.sort(reverse=True)
    return {"total": int(sum(by_type.values())), "by_type": by_type, "largest": ops[:8]}
