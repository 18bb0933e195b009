"""What a decoder step costs per generated token, one window a call (`main`) or B (`step_batch`).

A decode step is bound by the weights it reads, not by its arithmetic: every call reads every decoder weight
once, the embedding tables excepted (a lookup reads one row per token). A batched call reads them once for B
tokens. The figures (`tools/bench/bench_decoder_batch.py` prints them):

* weight bytes read per generated token, by batch size: from the parameters of a config (no export: the full
  size from the released config) or from a package's step program (each weight blob its function reads, a
  table read by a `gather` counted as one row per token);
* the state a batched decode holds (B rows of the self cache and the cross memory) and the bytes of one call's
  inputs, outputs and largest intermediates, by batch size (what an app budgets to pick B);
* interpreter wall time per generated token (`time_per_token`): the step and the batched step on the same
  memory, calls alternated.
"""

from __future__ import annotations

import time

import numpy as np

from ..config import STEP_FUNCTION
from ..model.shapes import DecoderShapes

FP16 = 2  # bytes per element of the fp16 programs, states and host arrays


def decoder_step_parameters(model) -> dict[str, int]:
    """Parameters one decode step reads, by kind, of a `CohereAsrForConditionalGeneration` (may live on the meta
    device: only shapes are read): "read" every weight the step reads whole (its layers, final norm, LM head),
    "per_token" the embedding rows a token reads (token and position tables: one row each), "tables" those
    tables' full size. The cross-attention K/V projections run in the encoder package (never in the step)."""
    dec = model.model.decoder
    skipped = {id(p) for layer in dec.layers for p in (*layer.encoder_attn.k_proj.parameters(),
                                                      *layer.encoder_attn.v_proj.parameters())}
    tables = [dec.embed_tokens.weight, dec.pos_emb.weight]
    table_ids = {id(t) for t in tables}
    seen, read = set(), 0
    for p in (*dec.parameters(), *model.proj_out.parameters()):
        if id(p) in seen or id(p) in skipped or id(p) in table_ids:
            continue
        seen.add(id(p))
        read += p.numel()
    if model.proj_out.weight is dec.embed_tokens.weight:  # a tied LM head reads the whole table
        read += dec.embed_tokens.weight.numel()
    return {"read": int(read), "per_token": int(sum(t.shape[1] for t in tables)),
            "tables": int(sum(t.numel() for t in tables))}


def full_size_model():
    """The released decoder's shapes (transformers' `CohereAsrConfig` defaults, one encoder layer: the decoder is
    what is counted) on the meta device: no weights allocated."""
    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    config = CohereAsrConfig(encoder_config={"num_hidden_layers": 1})
    with torch.device("meta"):
        return CohereAsrForConditionalGeneration(config)


def weight_bytes_per_token(parameters: dict[str, int], batch: int, bytes_per_weight: float = FP16) -> float:
    """Weight bytes a call reads divided by the tokens it makes (B): whole weights once, embedding rows per token."""
    return (parameters["read"] * bytes_per_weight + batch * parameters["per_token"] * bytes_per_weight) / batch


def program_step_weights(package, function: str = STEP_FUNCTION) -> dict[str, int]:
    """Weight bytes of one function of a decoder package from its program: "read" the blobs it reads whole,
    "per_token" the bytes of one row of each table a `gather` reads (one row per token), "tables" those tables."""
    from ..runtime.package import read_package

    spec = read_package(package).spec
    fn = spec.mlProgram.functions[function]
    ops = [op for block in fn.block_specializations.values() for op in block.operations]
    const_blob = {}  # const output name -> (bytes, shape) of the weight blob it holds
    for op in ops:
        value = op.attributes.get("val") if op.type == "const" else None
        if value is not None and value.WhichOneof("value") == "blobFileValue":
            tensor = value.type.tensorType
            shape = [int(d.constant.size) for d in tensor.dimensions]
            const_blob[op.outputs[0].name] = (int(np.prod(shape) * _dtype_bytes(tensor.dataType)), shape)
    gathered = set()
    for op in ops:
        if op.type == "gather" and "x" in op.inputs:
            gathered.update(a.name for a in op.inputs["x"].arguments if a.name in const_blob)
    per_token = sum(const_blob[n][0] // const_blob[n][1][0] for n in gathered)
    return {"read": int(sum(b for n, (b, _) in const_blob.items() if n not in gathered)), "per_token": int(per_token),
            "tables": int(sum(const_blob[n][0] for n in gathered))}


def _dtype_bytes(dtype) -> float:
    from coremltools.proto import MIL_pb2

    return {MIL_pb2.FLOAT16: 2, MIL_pb2.FLOAT32: 4, MIL_pb2.INT8: 1, MIL_pb2.UINT8: 1, MIL_pb2.INT32: 4,
            MIL_pb2.INT4: 0.5, MIL_pb2.UINT4: 0.5}.get(dtype, 2)


def memory_figures(shapes: DecoderShapes, batch: int, log_probs_bytes: int = FP16) -> dict[str, int]:
    """Bytes a decode of `batch` windows at once holds and moves (B = 1: the step's own state):

    * state: B rows of self_k + self_v (L, Hkv, C, Dh) and cross_k + cross_v (L, Hkv, Tp, Dh), cross_mask Tp, fp16;
    * call_io: one call's inputs (ids, positions, cache_mask) and outputs (log-probs, the new K/V rows);
    * activations: the largest intermediates of one call, alive together in a layer: its keys and values
      concatenated with the new rows (B, Hkv, C + 1, Dh) each, the self-attention and cross-attention weights
      (B, H, 1, C + 1) and (B, H, 1, Tp), the MLP's hidden (B, 4 D), and the logits (B, V) in fp32.
    """
    s, b = shapes, int(batch)
    per_row_state = FP16 * (2 * s.num_layers * s.num_kv_heads * s.head_dim * (s.capacity + s.memory_len)
                            + s.memory_len)
    call_io = (b * (4 + 4 + FP16 * s.capacity) + b * s.vocab_size * log_probs_bytes
               + 2 * FP16 * s.num_layers * b * s.num_kv_heads * s.head_dim)
    activations = (2 * FP16 * b * s.num_kv_heads * (s.capacity + 1) * s.head_dim
                   + FP16 * b * s.num_heads * (s.capacity + 1 + s.memory_len)
                   + FP16 * b * 4 * s.hidden_size + 4 * b * s.vocab_size)
    return {"batch": b, "state": b * per_row_state, "state_per_row": per_row_state, "call_io": call_io,
            "activations": activations, "total": b * per_row_state + call_io + activations}


def random_memory(shapes: DecoderShapes, valid: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A cross memory of the package's shapes (fp16 values of scale 1, `valid` frames unmasked)."""
    from ..config import FP16_MASK_VALUE

    rng = np.random.default_rng(seed)
    mask = np.full((1, 1, 1, shapes.memory_len), FP16_MASK_VALUE, np.float16)
    mask[..., :valid] = 0
    return {"cross_k": rng.standard_normal(shapes.memory_shape).astype(np.float16),
            "cross_v": rng.standard_normal(shapes.memory_shape).astype(np.float16), "cross_mask": mask}


def time_per_token(step, batched: dict, memory: dict, steps: int, repeats: int = 3) -> dict[int, dict]:
    """Interpreter (or Core ML) wall time per generated token: `step` (a `DecoderRuntime`) one token a call and
    each `batched[B]` (a `BatchDecoder`) B tokens a call, every row busy, all on `memory`, `steps` calls from slot
    0 a run; the runs of each size alternated `repeats` times (so a noisy machine slows them alike). Returns per
    B (1: the step) the median and min ms per call and per token."""
    runs: dict[int, list[float]] = {1: [], **{b: [] for b in batched}}
    for _ in range(repeats):
        state = step.new_state(memory)
        t0 = time.perf_counter()
        for p in range(steps):
            step.step(state, 1, p)
        runs[1].append((time.perf_counter() - t0) / steps)
        for b, dec in batched.items():
            state = dec.make_state()
            for row in range(b):
                dec.bind_row(state, row, memory)
            t0 = time.perf_counter()
            for p in range(steps):
                dec.step(state, [1] * b, [p] * b)
            runs[b].append((time.perf_counter() - t0) / steps)
    out = {}
    for b, times in runs.items():
        med, best = float(np.median(times)), float(min(times))
        out[b] = {"ms_per_call": 1000 * med, "ms_per_call_min": 1000 * best, "ms_per_token": 1000 * med / b,
                  "ms_per_token_min": 1000 * best / b}
    return out


__all__ = ["decoder_step_parameters", "full_size_model", "weight_bytes_per_token", "program_step_weights",
           "memory_figures", "random_memory", "time_per_token"]
