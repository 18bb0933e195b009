"""The decoder's export gate: teacher forcing against `transformers`, with negative controls.

    case    = teacher_forcing_case(model, Tp, prompt)   # PyTorch reference: memory, ids, log-probs (S, V)
    rows    = run_teacher_forcing(decoder, case)        # a package (`DecoderRuntime`) or its PyTorch twin
    report  = teacher_forcing_report(case, rows, "fp16")  # per-step PSNR / KL, argmax (near-tie rule)
    gate    = prepare_gate(model, make_twin, ...)       # the reference + the negative controls, then
    gate(package_path) -> GateReport                    # the package scored (step, prefill, extend; bind_memory
                                                        # in a graph-state package)

The negative controls (`NEGATIVE_CONTROLS`) feed the PyTorch twin the inputs a broken package would see
(zero memory, swapped K/V, permuted layers, another prompt) and record whether the gate would refuse
it. The twin and the package's modules live in `cohere_coreml.export.decoder` (which runs this gate when it
exports); the arithmetic (PSNR, KL, argmax flips) in `cohere_coreml.export.parity`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ANE_MULTIPLE, BIND_FUNCTION, DECODER_STATE_GRAPH, DECODER_STATE_HOST, FP16_MASK_VALUE, round_up
from ..inference.decoder_runtime import DecoderRuntime
from .convert import MIN_PSNR_DB
from .gate import GateLoader, GateReport
from .parity import argmax_flips, kl_rows, psnr

logger = logging.getLogger(__name__)

COMPONENT = "decoder"  # the package this gate judges: decoder.mlpackage
# (capacity, memory_len) -> a PyTorch twin of the package behind the `DecoderRuntime` interface
# (new_state / bind / step / prefill): `decoder.TorchDecoder.of` bound to the model
TwinFactory = Callable[[int, int], Any]

class DecoderGateError(RuntimeError):
    """The package does not have what the gate was asked to check."""


# Per-step KL(PyTorch || package) each program precision must stay under (mean over steps).
MAX_KL = {"fp32": 1e-4, "fp16": 5e-3}  # fp32 programs still keep an fp16 KV cache


@dataclass
class TeacherForcingCase:
    """PyTorch reference for one teacher-forced decode: cross memory, token sequence, log-probs."""

    cross_k: np.ndarray  # (L, Hkv, Tp, Dh) float32
    cross_v: np.ndarray
    cross_mask: np.ndarray  # (1, 1, 1, Tp) float32
    ids: list[int]  # prompt + generated tokens fed one per step
    log_probs: np.ndarray  # (len(ids), V) reference log-probs after each fed token
    prompt_len: int

    @property
    def memory(self) -> dict[str, np.ndarray]:
        """The cross memory as the encoder package outputs it (what bind_memory takes)."""
        return {"cross_k": self.cross_k, "cross_v": self.cross_v, "cross_mask": self.cross_mask}


def teacher_forcing_case(model, memory_len: int, prompt: list[int], encoder_hidden=None, encoder_mask=None,
                         new_tokens: int = 16, seed: int = 0, tail_garbage: float = 30.0,
                         valid_share: float = 0.75) -> TeacherForcingCase:
    """Reference log-probs of `CohereAsrForConditionalGeneration` under teacher forcing.

    The sequence is `prompt` + the model's own greedy continuation, so the steps are the ones a
    real decode visits. Without `encoder_hidden`, a random feature window whose valid length
    leaves a padded tail is encoded first. The padded tail of the cross memory the package sees is
    then filled with random values of scale `tail_garbage` (the reference never sees them): a
    program that does not apply the cross mask fails loudly, even with random weights whose
    cross-attention contributes little. `valid_share`: the valid part of the random feature window.
    """
    import torch  # heavy: the reference side only; the package side of the gate runs without it

    # imported here: `transformers.models.parakeet` loads sentencepiece, which the product must not import
    # on its own (tests/export/test_pipeline.py::test_product_imports_no_training_or_synthesis_code)
    from transformers.models.parakeet.modeling_parakeet import ParakeetEncoderModelOutput  # see the comment above

    from ..model.reference import cross_memory  # imports torch (as torch above)

    enc_cfg = model.config.encoder_config
    with torch.no_grad():
        if encoder_hidden is None:
            g = torch.Generator().manual_seed(seed)
            frames = 8 * memory_len  # any length; only the encoder frames matter here
            feats = torch.randn(1, frames, enc_cfg.num_mel_bins, generator=g)
            mask = torch.zeros(1, frames, dtype=torch.long)
            mask[:, : int(frames * valid_share)] = 1
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


def run_teacher_forcing(decoder, case: TeacherForcingCase) -> np.ndarray:
    """Bind `case`'s memory, then feed `case.ids` one per step; returns (S, V) log-probs.

    `decoder`: a `decoder_runtime.DecoderRuntime` (a package) or its PyTorch twin `TorchDecoder`."""
    state = decoder.new_state(case.memory)
    rows = [np.asarray(decoder.step(state, token, pos), dtype=np.float32).reshape(-1)
            for pos, token in enumerate(case.ids)]
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
    flips = (argmax_flips(case.log_probs[decoding], produced[decoding], positions=range(decoding.start, len(case.ids)))
             if decoding.start < len(case.ids) else {"near_tie_flips": 0, "decisive_flips": 0, "rows": []})
    report["near_tie_flips"] = flips["near_tie_flips"]
    report["decisive_flips"] = flips["decisive_flips"]
    report["flips"] = flips["rows"]
    # an argmax disagreement refuses only when it is not a near-tie the measured error could flip
    report["passed"] = bool(
        finite and report["worst_psnr_db"] >= min_psnr and report["mean_kl"] <= MAX_KL[precision]
        and flips["decisive_flips"] == 0
    )
    return report


def run_prefill_teacher_forcing(decoder, case: TeacherForcingCase):
    """Bind, the prompt through prefill in one call, then the rest step by step with the SAME state.

    Returns (trimmed case, rows): rows are the log-probs after positions P-1 .. S-1, the trimmed
    case holds the matching reference rows (its prompt_len is 1: every row is a decoding row).
    """
    p = case.prompt_len
    state = decoder.new_state(case.memory)
    rows = [np.asarray(decoder.prefill(state, case.ids[:p]), dtype=np.float32).reshape(-1)]
    for pos in range(p, len(case.ids)):
        rows.append(np.asarray(decoder.step(state, case.ids[pos], pos), dtype=np.float32).reshape(-1))
    trimmed = TeacherForcingCase(cross_k=case.cross_k, cross_v=case.cross_v, cross_mask=case.cross_mask,
                                 ids=case.ids[p - 1:], log_probs=case.log_probs[p - 1:], prompt_len=1)
    return trimmed, np.stack(rows)


def run_extend_teacher_forcing(decoder, case: TeacherForcingCase, extend_len: int):
    """Bind, then two extend calls and the rest step by step with the SAME state: the prompt from slot 0,
    then about half of the generated tokens from slot P (a nonzero start; both calls padded to K), then
    steps reading the cache the extend calls wrote (their padded tails' slots included, overwritten).

    Returns (trimmed case, rows): the rows of the second call's real tokens (every one: a streaming
    partial reads them to verify its draft) and the first call's last, then one per step; the trimmed
    case holds the matching reference rows (prompt_len 1: every row is decoding)."""
    p, total = case.prompt_len, len(case.ids)
    second = min(extend_len, max(2, (total - p) // 2), total - p)  # tokens of the second call
    state = decoder.new_state(case.memory)
    rows = [np.asarray(decoder.extend(state, case.ids[:p], 0)[-1], dtype=np.float32)]
    positions = [p - 1]
    if second >= 1:
        rows.extend(np.asarray(decoder.extend(state, case.ids[p:p + second], p), dtype=np.float32))
        positions.extend(range(p, p + second))
    for pos in range(p + max(second, 0), total):
        rows.append(np.asarray(decoder.step(state, case.ids[pos], pos), dtype=np.float32).reshape(-1))
        positions.append(pos)
    trimmed = TeacherForcingCase(cross_k=case.cross_k, cross_v=case.cross_v, cross_mask=case.cross_mask,
                                 ids=[case.ids[i] for i in positions], log_probs=case.log_probs[positions],
                                 prompt_len=1)
    return trimmed, np.stack(rows)


def bound_memory_check(decoder, case: TeacherForcingCase) -> dict:
    """The memory bind (the host's writes for the default host-state decoder, bind_memory for a graph-state
    one) writes exactly the memory it was given: the state's cross_k / cross_v / cross_mask
    read back equal the case's memory rounded to fp16, the self cache is zero, and memory_length
    counts the valid frames."""
    state = decoder.make_state()
    for name in ("self_k", "self_v"):  # a dirty cache, which the bind must clear
        shape, dtype = decoder.state_description[name]
        state.write_state(name, np.ones(shape, dtype=dtype))
    bound = decoder.bind(state, case.memory)
    mismatched = [k for k, v in case.memory.items()
                  if not np.array_equal(state.read_state(k), np.asarray(v, np.float32).astype(np.float16))]
    dirty = [k for k in ("self_k", "self_v") if np.any(state.read_state(k))]
    valid = int(np.sum(case.cross_mask > 0.5 * FP16_MASK_VALUE))
    return {"memory_length": bound, "valid_frames": valid, "mismatched_states": mismatched, "uncleared": dirty,
            "passed": bool(bound == valid and not mismatched and not dirty)}


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


def negative_controls(make_twin: TwinFactory, case: TeacherForcingCase, precision: str,
                      min_psnr_db: float | None = None, control_prompt: list[int] | None = None) -> dict:
    """Can this gate case tell a right package from a broken one?

    Each control runs the PyTorch twin (`make_twin(capacity, memory_len)`, e.g. `decoder.TorchDecoder.of`
    bound to the model: the memory bound, then the steps, as the gate runs the package) on the broken inputs
    (`control_case`: the broken memory is what gets bound) and scores it against the case's reference exactly
    as the gate scores a package. `discriminates` is True when the gate would refuse it. On random weights
    the output barely depends on the cross memory (on the tiny test checkpoints zero memory hardly moves the
    log-probs and changes no argmax), so the gate passes broken packages; this records that instead of
    leaving it unnoticed.
    """
    capacity = round_up(len(case.ids), ANE_MULTIPLE)
    runtime = make_twin(capacity, case.cross_k.shape[2])
    results = {}
    for name in NEGATIVE_CONTROLS:
        broken = control_case(case, name, control_prompt)
        if broken is None:
            results[name] = {"applicable": False, "discriminates": None}
            continue
        rep = teacher_forcing_report(case, run_teacher_forcing(runtime, broken), precision, min_psnr_db)
        results[name] = {"applicable": True, "discriminates": not rep["passed"],
                         **{k: rep[k] for k in ("worst_psnr_db", "mean_kl", "argmax_agree", "argmax_steps",
                                                "near_tie_flips", "decisive_flips")}}
        if rep["passed"]:
            logger.warning("decoder gate: a package with %s would pass (worst PSNR %.1f dB, mean KL %.2g, argmax "
                           "%d/%d): this gate case cannot detect that defect (weights whose output barely "
                           "depends on it, e.g. random ones)", name.replace("_", " "), rep["worst_psnr_db"],
                           rep["mean_kl"], rep["argmax_agree"], rep["argmax_steps"])
    return results


# The batched step (`step_batch`): B rows, each a window of its own. A second gate case differs from the first in
# prompt, length and valid frames (so a row reading another row's memory or mask opens padded frames filled with
# large random values); rows alternate between the cases and row r starts at call r (every call mixes positions).
BATCH_CONTROLS = ("mixed_memory", "mixed_mask")  # a row gets the next row's K/V (its own mask), or its mask
BATCH_SECOND_VALID_SHARE = 0.5
BATCH_SECOND_TOKENS = 8


def batch_second_case(model, memory_len: int, capacity: int, prompt: list[int],
                      control_prompt: list[int] | None) -> TeacherForcingCase:
    """The batched step's second gate case: another prompt, fewer tokens, fewer valid frames, another memory."""
    other = list(control_prompt) if control_prompt and len(control_prompt) == len(prompt) else list(prompt)[::-1]
    return teacher_forcing_case(model, memory_len, other, new_tokens=min(BATCH_SECOND_TOKENS, capacity - len(other)),
                                seed=1, valid_share=BATCH_SECOND_VALID_SHARE)


def batch_memories(cases: list[TeacherForcingCase], batch: int, control: str | None = None) -> list[dict]:
    """Row r's memory: its case's (case r mod len(cases)); a control mixes rows (the next row's K/V or mask)."""
    own = [cases[r % len(cases)].memory for r in range(batch)]
    if control is None:
        return own
    if control not in BATCH_CONTROLS:
        raise ValueError(f"unknown batch control {control!r}; choose from {BATCH_CONTROLS}")
    mixed = []
    for r in range(batch):
        other = own[(r + 1) % batch]
        if control == "mixed_memory":
            mixed.append({**own[r], "cross_k": other["cross_k"], "cross_v": other["cross_v"]})
        else:
            mixed.append({**own[r], "cross_mask": other["cross_mask"]})
    return mixed


def run_batch_teacher_forcing(decoder, cases: list[TeacherForcingCase], memories: list[dict] | None = None):
    """Teacher forcing through a batched step (`inference.batch_decoding.BatchDecoder` of a package or its
    PyTorch twin): row r is case r mod len(cases), its memory written into row r, its ids fed one per call from
    call r on (staggered: rows at different positions in every call). Returns per row its (S, V) log-probs."""
    batch = decoder.batch
    assign = [r % len(cases) for r in range(batch)]
    memories = memories or batch_memories(cases, batch)
    state = decoder.make_state()
    for r in range(batch):
        decoder.bind_row(state, r, memories[r])
    produced = [[] for _ in range(batch)]
    for call in range(max(r + len(cases[assign[r]].ids) for r in range(batch))):
        tokens, positions = [], []
        for r in range(batch):
            k, ids = call - r, cases[assign[r]].ids
            live = 0 <= k < len(ids)
            tokens.append(ids[k] if live else 0)
            positions.append(k if live else None)
        log_probs = decoder.step(state, tokens, positions)
        for r, position in enumerate(positions):
            if position is not None:
                produced[r].append(np.asarray(log_probs[r], dtype=np.float32))
    return [np.stack(rows) for rows in produced]


def batch_report(cases: list[TeacherForcingCase], produced: list[np.ndarray], single: list[np.ndarray] | None,
                 precision: str, min_psnr_db: float | None = None) -> dict:
    """Each row scored as the step is (`teacher_forcing_report` against PyTorch) and, with `single` (the
    batch-1 step's rows of each case), its argmax at every decoding step against the step's (a disagreement
    refuses unless it is a near-tie by the gate's rule). Passes when every row does."""
    rows = []
    for r, out in enumerate(produced):
        case = cases[r % len(cases)]
        rep = teacher_forcing_report(case, out, precision, min_psnr_db)
        row = {"row": r, "case": r % len(cases), "start_call": r, "steps": len(case.ids),
               **{k: rep[k] for k in ("worst_psnr_db", "mean_kl", "argmax_agree", "argmax_steps", "decisive_flips")},
               "passed": rep["passed"]}
        if single is not None:
            decoding = slice(max(case.prompt_len - 1, 0), len(case.ids))
            ref = single[r % len(cases)]
            flips = argmax_flips(ref[decoding], out[decoding])
            row["same_argmax_as_step"] = int(np.sum(ref[decoding].argmax(-1) == out[decoding].argmax(-1)))
            row["decisive_flips_vs_step"] = flips["decisive_flips"]
            row["passed"] = bool(row["passed"] and flips["decisive_flips"] == 0)
        rows.append(row)
    return {"size": len(produced), "cases": len(cases), "rows": rows, "passed": all(r["passed"] for r in rows),
            "worst_psnr_db": float(min(r["worst_psnr_db"] for r in rows)),
            "mean_kl": float(max(r["mean_kl"] for r in rows))}


def batch_controls(twin, cases: list[TeacherForcingCase], precision: str, min_psnr_db: float | None = None) -> dict:
    """Would the batched check refuse a program that mixes rows? The twin (`BatchDecoder` of the PyTorch batched
    step) run with each row's memory or mask taken from the next row (`batch_memories`), scored as the package."""
    results = {}
    for name in BATCH_CONTROLS:
        rep = batch_report(cases, run_batch_teacher_forcing(twin, cases, batch_memories(cases, twin.batch, name)),
                           None, precision, min_psnr_db)
        results[name] = {"discriminates": not rep["passed"], "worst_psnr_db": rep["worst_psnr_db"],
                         "mean_kl": rep["mean_kl"]}
        if rep["passed"]:
            logger.warning("decoder gate: a batched step with %s would pass (worst PSNR %.1f dB): this gate case cannot "
                           "detect it", name.replace("_", " "), rep["worst_psnr_db"])
    return results


STATE_WRITE_OPS = ("coreml_update_state", "write_state")  # MIL ops that write a state (write_state: older name)


def state_write_ops(path) -> dict[str, dict[str, int]]:
    """Per function of a package: its state-writing ops (`coreml_update_state`) and the `slice_update`s
    whose tensor is a state read (`read_state`): what a host-state decoder must have none of. Read from
    the program (no weights loaded)."""
    from ..runtime.package import read_package  # imports torch-free protobuf code only

    def names(op, arg):
        return [b.name for b in op.inputs[arg].arguments if b.name] if arg in op.inputs else []

    spec = read_package(path).spec
    counts = {}
    for name, fn in spec.mlProgram.functions.items():
        producer, n_update, state_slices = {}, 0, set()
        ops = [op for block in fn.block_specializations.values() for op in block.operations]
        for op in ops:
            for o in op.outputs:
                producer[o.name] = op

        def origin(value):  # the op a value comes from, through value-preserving casts
            op = producer.get(value)
            while op is not None and op.type in ("cast", "identity"):
                op = producer.get(next(iter(names(op, "x")), None))
            return op

        for op in ops:
            if op.type in STATE_WRITE_OPS:
                n_update += 1
                src = next((origin(v) for v in names(op, "value")), None)
                if src is not None and src.type == "slice_update":  # a slice written back into a state
                    state_slices.add(src.outputs[0].name)
            elif op.type == "slice_update":
                src = next((origin(v) for v in names(op, "x")), None)
                if src is not None and src.type == "read_state":  # a slice of a state's value replaced
                    state_slices.add(op.outputs[0].name)
        counts[name] = {"coreml_update_state": n_update, "state_slice_update": len(state_slices)}
    return counts


def teacher_forcing_gate(report: dict) -> GateReport:
    """The decoder's `GateReport` from a `teacher_forcing_report` dict (figures kept as they are)."""
    near = report.get("near_tie_flips", 0)
    headline = (f"worst PSNR {report['worst_psnr_db']:.1f} dB, mean KL {report['mean_kl']:.3g}, "
                f"argmax {report['argmax_agree']}/{report['argmax_steps']} decoding steps"
                + (f" ({near} near-tie flip{'s' * (near != 1)}, tolerated)" if near else ""))
    align = report.get("alignment")
    if align is not None and align["words"]:
        headline += f"; align: {align['agree']}/{align['words']} words within one frame of the reference"
    text = "" if report["passed"] else (
        f"decoder.mlpackage does not match PyTorch under teacher forcing: worst PSNR "
        f"{report['worst_psnr_db']:.1f} dB (need {report['min_psnr_db_required']}), mean KL "
        f"{report['mean_kl']:.3g} (max {report['max_kl_allowed']}), argmax "
        f"{report['argmax_agree']}/{report['argmax_steps']} decoding steps, "
        f"{report.get('decisive_flips', 0)} flip(s) beyond what the measured error explains")
    writes = report.get("state_writes_in_graph")
    if report.get("state_writes") == DECODER_STATE_HOST and writes:
        text += (f"; the host-state decoder's programs write their state ({writes}): its functions must only "
                 "read it")
    if align is not None and align["passed"] is False:
        text += (f"{'; ' if text else ''}the align function's word boundaries agree with the reference's within one "
                 f"encoder frame on {align['agree']}/{align['words']} words of {align['clips']} calibration clips "
                 f"(need {100 * align['required']:.0f} %)")
    batch = report.get("batch")
    if batch is not None:
        agree = sum(r["passed"] for r in batch["rows"])
        headline += f"; step_batch: {agree}/{batch['size']} rows as the step"
        bad = [r for r in batch["rows"] if not r["passed"]]
        if bad:
            text += (f"{'; ' if text else ''}step_batch of {batch['size']} rows differs from the step: rows "
                     + ", ".join(f"{r['row']} (worst PSNR {r['worst_psnr_db']:.1f} dB, "
                                 f"{r.get('decisive_flips_vs_step', 0)} decisive flip(s) vs the step)" for r in bad)
                     + ": its rows mix or ignore their own memory, mask or position")
    memory = report.get("memory")
    if memory is not None and not memory["passed"]:
        text += (f"; {BIND_FUNCTION} did not bind the memory it was given (states differing from it: "
                 f"{memory['mismatched_states'] or 'none'}, self cache not cleared: {memory['uncleared'] or 'no'}, "
                 f"memory_length {memory['memory_length']} for {memory['valid_frames']} valid frames)")
    details = {k: v for k, v in report.items() if k != "passed"}
    return GateReport(component=COMPONENT, passed=bool(report["passed"]), headline=headline, details=details, text=text)


def prepare_gate(model, make_twin: TwinFactory, memory_len: int, capacity: int, prompt: list[int],
                 control_prompt: list[int] | None, precision: str, min_psnr_db: float | None = None,
                 units: str = "auto", prefill: bool = False,
                 extend_len: int | None = None,
                 state_writes: str = DECODER_STATE_GRAPH, alignment=None, batch: int = 1,
                 make_batch_twin: Callable[[int, int, int], Any] | None = None) -> Callable[[Path], GateReport]:
    """The PyTorch side of the decoder gate, computed before the package is loaded: the teacher-forcing
    reference (`prompt` + up to 16 greedy tokens, within `capacity`) and the negative controls. Returns
    `gate(package_path) -> GateReport`, which loads the package (`DecoderRuntime` on `units`: `gate.GateLoader`) and scores
    the step, the bound memory and (with `prefill`) the prefill function and (with `extend_len`) the
    extend function (`run_extend_teacher_forcing`) against that reference. `state_writes` "host": the
    package must be a host-state one (its step takes cache_mask) whose programs write no state
    (`state_write_ops`); the bound-memory check then checks the host's writes. `alignment` (an
    `batch` > 1: the package's `step_batch` on two cases (`run_batch_teacher_forcing`), each row against PyTorch and
    token for token against the step (`batch_report`), with rows mixing memories or masks as controls on
    `make_batch_twin(capacity, memory_len, batch)` (a `BatchDecoder` of the PyTorch batched step).
    `alignment` (an
    `alignment_heads.AlignmentPlan` with heads): the package's `align` function on the plan's calibration clips
    that fit it, each on a state fed the clip's prompt + tokens first (`DecoderRuntime.feed`: align reads their K/V
    from the self cache, as after decoding), against the reference's weights of the same heads
    (`alignment_heads.alignment_check`)."""
    align_cases = None
    if alignment is not None:
        from .alignment_heads import alignment_cases  # the word-timing rule's side: only when aligning

        align_cases = alignment_cases(model, alignment.records, memory_len, capacity)
    case = teacher_forcing_case(model, memory_len, prompt, new_tokens=min(16, capacity - len(prompt)))
    # negative controls: would this case refuse a broken package? (warns when it cannot)
    controls = negative_controls(make_twin, case, precision, min_psnr_db, control_prompt=control_prompt)
    batch_cases = batch_twin_controls = None
    if batch > 1:
        batch_cases = [case, batch_second_case(model, memory_len, capacity, prompt, control_prompt)]
        twin_capacity = round_up(max(len(c.ids) for c in batch_cases), ANE_MULTIPLE)
        batch_twin_controls = batch_controls(make_batch_twin(twin_capacity, memory_len, batch), batch_cases, precision,
                                             min_psnr_db)

    def gate(tmp_path: Path) -> GateReport:
        with GateLoader(units, tmp_path.parent) as loader:
            decoder = DecoderRuntime.load(tmp_path, prefill=prefill, extend=extend_len is not None,
                                          align=alignment is not None, **loader.runtime_options(tmp_path))
            batched = None
            if batch > 1:
                from ..inference.batch_decoding import BatchDecoder

                batched = BatchDecoder.load(tmp_path, **loader.runtime_options(tmp_path))
            report = score(tmp_path, decoder, batched)
            report.details["runs_on"] = loader.describe(tmp_path)
            return report

    def score(tmp_path: Path, decoder: DecoderRuntime, batched=None) -> GateReport:
        single = run_teacher_forcing(decoder, case)
        report = teacher_forcing_report(case, single, precision, min_psnr_db)
        report["memory"] = bound_memory_check(decoder, case)
        if prefill:
            trimmed, rows = run_prefill_teacher_forcing(decoder, case)
            pre_report = teacher_forcing_report(trimmed, rows, precision, min_psnr_db)
            report["prefill"] = {k: v for k, v in pre_report.items() if k != "per_step"}
            report["worst_psnr_db"] = min(report["worst_psnr_db"], pre_report["worst_psnr_db"])
            report["mean_kl"] = max(report["mean_kl"], pre_report["mean_kl"])
            report["passed"] = bool(report["passed"] and pre_report["passed"])
        if extend_len is not None:
            if decoder.extend_length != extend_len:
                raise DecoderGateError(f"the package's extend function takes {decoder.extend_length} tokens, "
                                       f"the export asked for {extend_len}")
            trimmed, rows = run_extend_teacher_forcing(decoder, case, extend_len)
            ext_report = teacher_forcing_report(trimmed, rows, precision, min_psnr_db)
            report["extend"] = {k: v for k, v in ext_report.items() if k != "per_step"}
            report["worst_psnr_db"] = min(report["worst_psnr_db"], ext_report["worst_psnr_db"])
            report["mean_kl"] = max(report["mean_kl"], ext_report["mean_kl"])
            report["passed"] = bool(report["passed"] and ext_report["passed"])
        report["passed"] = bool(report["passed"] and report["memory"]["passed"])
        report["state_writes"] = decoder.state_writes
        if decoder.state_writes != state_writes:
            raise DecoderGateError(f"the package is a {decoder.state_writes}-state decoder, the export asked for "
                                   f"{state_writes}")
        if state_writes == DECODER_STATE_HOST:
            census = state_write_ops(tmp_path)
            writes = {fn: c for fn, c in census.items() if any(c.values())}
            report["state_writes_in_graph"] = writes
            report["passed"] = bool(report["passed"] and not writes)
        if batched is not None:
            if batched.batch != batch:
                raise DecoderGateError(f"the package's step_batch takes {batched.batch} rows, the export asked for "
                                       f"{batch}")
            singles = [single] + [run_teacher_forcing(decoder, c) for c in batch_cases[1:]]
            report["batch"] = batch_report(batch_cases, run_batch_teacher_forcing(batched, batch_cases), singles,
                                           precision, min_psnr_db)
            report["batch"]["controls"] = batch_twin_controls
            report["batch"]["discriminates"] = all(c["discriminates"] for c in batch_twin_controls.values())
            report["worst_psnr_db"] = min(report["worst_psnr_db"], report["batch"]["worst_psnr_db"])
            report["mean_kl"] = max(report["mean_kl"], report["batch"]["mean_kl"])
            report["passed"] = bool(report["passed"] and report["batch"]["passed"])
        report["controls"] = controls
        report["discriminates"] = all(c["discriminates"] for c in controls.values() if c["applicable"])
        if alignment is not None:
            report["alignment"] = align_report(decoder)
            report["passed"] = bool(report["passed"] and report["alignment"]["passed"] is not False)
        return teacher_forcing_gate(report)

    def align_report(decoder: DecoderRuntime) -> dict:
        from .alignment_heads import alignment_check

        if decoder.align_model is None:
            raise DecoderGateError("the package has no align function, the export asked for one")
        weights = []
        for c in align_cases:  # the precondition: the state has been fed the clip's prompt + tokens (as decoded)
            state = decoder.new_state(c.memory)
            decoder.feed(state, c.ids)
            # from the first row the checks read (the shifted control's, one before the rule's): as a host calls
            # it, the rows before it are read from the cache, not computed
            first = max(0, c.record.prompt_length - 2 - alignment.lead_rows)
            weights.append(decoder.align(state, c.ids, rows_from=first))
        check = alignment_check(align_cases, weights, alignment.heads, alignment.lead_rows)
        if check["words"] == 0:
            logger.warning("decoder gate: the align function was not checked against the reference (no calibration "
                           "clip fits the package's window and cache)")
        elif check["discriminates"] is False:
            logger.warning("decoder gate: the alignment check's negative controls %s would pass it: these clips "
                           "cannot tell a broken align function from a right one", check["controls"])
        return check

    return gate
