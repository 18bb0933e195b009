"""The f16 references and the measurements of a package against them (the analysis step's data).

`build_gate_data` runs the f16 bundle once, through the runtime, on windows of real speech: the
encoder outputs of each window and the f16 bundle's own greedy decode (the teacher-forcing
sequences and their log-probs). `sensitivity` and the component gates (`gate`) then measure a
compressed package against those references: encoder PSNR, decoder teacher-forced log-probs,
their PSNR, KL (`parity.kl_rows`) and the per-step log-prob error in nats.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..bundle.load import Bundle
from ..config import BIND_FUNCTION, STEP_BATCH_FUNCTION
from ..evaluation.datasets import load_folder
from ..export.decoder_gate import TeacherForcingCase, run_teacher_forcing
from ..export.gate import default_gate_audio
from ..export.memory import release_memory
from ..export.parity import argmax_flips, kl_rows, psnr
from ..inference.decoder_runtime import DecoderRuntime
from ..inference.encoder_runtime import EncoderRuntime
from ..inference.transcribe import Transcriber
from ..model.audio import FrontEndConfig, load_audio, log_mel, pad_to_window
from ..model.shapes import LengthMasks
from ..runtime import load_model
from .recipes import QuantizeError

GATE_CLIPS_PER_LANGUAGE = 2


@dataclass
class GateData:
    """Encoder windows and decoder sequences the gates and the sensitivity run on."""

    windows: list[tuple[np.ndarray, int]]  # (features (1, M, F) float32, valid frames)
    languages: list[str]
    prompts: list[list[int]]
    encoder_ref: list[dict[str, np.ndarray]] = field(default_factory=list)  # f16 encoder outputs
    sequences: list[list[int]] = field(default_factory=list)  # fed ids (prompt + greedy - last)
    decoder_ref: list[np.ndarray] = field(default_factory=list)  # (S, V) f16 decoder log-probs
    eos_ids: tuple[int, ...] = ()
    length_masks: LengthMasks | None = None  # the encoder's length-mask rule (the f16 bundle's manifest)

    def encoder_inputs(self, frames: int | None = None) -> list[dict[str, np.ndarray]]:
        """Every window as an encoder function's inputs (features and the host's length masks); a
        function of `frames` mel frames (a length bucket) takes the first frames of each window."""
        if self.length_masks is None:
            raise QuantizeError("the gate data has no length-mask rule (build it with build_gate_data)")
        out = []
        for window, n in self.windows:
            f = window.shape[-1] if frames is None else int(frames)
            out.append({"input_features": np.ascontiguousarray(window[..., :f]),
                        **self.length_masks.inputs(min(n, f), f)})
        return out

    def subset(self, indices: Sequence[int]) -> GateData:
        """The same data restricted to some windows (sensitivity runs use few)."""
        pick = [list(range(len(self.windows)))[i] for i in indices]
        return GateData(windows=[self.windows[i] for i in pick], languages=[self.languages[i] for i in pick],
                        prompts=[self.prompts[i] for i in pick], encoder_ref=[self.encoder_ref[i] for i in pick],
                        sequences=[self.sequences[i] for i in pick], decoder_ref=[self.decoder_ref[i] for i in pick],
                        eos_ids=self.eos_ids, length_masks=self.length_masks)


def gate_clips(eval_dir: str | os.PathLike, per_language: int = GATE_CLIPS_PER_LANGUAGE) -> list[tuple[Path, str]]:
    """The first `per_language` clips of each language of an evaluation folder (`datasets.load_folder`)."""
    dataset = load_folder(eval_dir, per_language)
    bad = [f"{c.id}: {c.problem}" for c in dataset.clips if c.problem]
    if bad:
        raise QuantizeError(f"{eval_dir}: clips the gates cannot use: " + "; ".join(bad))
    return [(c.audio, c.language) for c in dataset.clips]


def packaged_gate_clips() -> list[tuple[Path, str]]:
    """The export gates' speech (shipped with the package), language from the file name (en_medium.flac)."""
    return [(path, path.name.split("_", 1)[0]) for path in default_gate_audio()]


def clips_of(eval_dir: str | os.PathLike | None) -> list[tuple[Path, str]]:
    """The gates' clips: an evaluation folder's (`gate_clips`), or the packaged speech without one."""
    return gate_clips(Path(eval_dir)) if eval_dir else packaged_gate_clips()


def build_gate_data(bundle_dir: Path, clips: Sequence[tuple[Path, str]], max_new_tokens: int = 48) -> GateData:
    """Windows of real speech (each clip, plus one full window of them back to back) and the f16
    bundle's own greedy decode of each (the teacher-forcing sequences), all through the runtime."""
    bundle = Bundle.load(bundle_dir)
    m = bundle.manifest
    config = FrontEndConfig.from_dict({**m["audio"], "dither": 0.0})
    frames = bundle.window_frames
    windows, languages, feats = [], [], []
    for path, lang in clips:
        mel, n = log_mel(load_audio(path, target_rate=config.sampling_rate), config)
        n = min(n, frames)
        feats.append(mel[:, :n])
        window, n = pad_to_window(mel[:, :n], n, frames=frames)
        windows.append((window[None].astype(np.float32), n))
        languages.append(lang)
    if clips:  # one full window of speech
        joined = np.concatenate(feats, axis=1)
        full = np.tile(joined, (1, -(-frames // joined.shape[1])))[:, :frames]
        windows.append((full[None].astype(np.float32), frames))
        languages.append(languages[0])
    data = GateData(windows=windows, languages=languages,
                    prompts=[bundle.prompt(lang) for lang in languages], eos_ids=tuple(sorted(bundle.eos_ids)),
                    length_masks=LengthMasks.from_manifest(m["encoder"]["length_masks"]))
    # the encoder first, one of its parts in memory at a time (the same outputs as `Transcriber.encode`), then
    # the decoder alone: a full-size f16 encoder's parts are never loaded together
    encoders = EncoderRuntime.from_bundle(bundle, backend="mil")
    data.encoder_ref.extend(encoders.encode_windows(windows))
    del encoders
    release_memory()
    tr = Transcriber(bundle, backend="mil", use_prefill=False, use_extend=False,  # one log-prob row per fed token
                     load_encoder=False)
    for enc, prompt in zip(data.encoder_ref, data.prompts, strict=True):
        dec = tr.decode(enc, prompt, max_new_tokens=max_new_tokens, return_log_probs=True)
        fed = list(prompt) + dec.token_ids[:-1]
        data.sequences.append(fed)
        data.decoder_ref.append(np.stack(dec.log_probs))
    del tr, bundle
    release_memory()  # the f16 packages are not needed again: give their memory back before compressing
    return data


def encoder_outputs(model, data: GateData) -> list[dict[str, np.ndarray]]:
    return [model.predict(inputs) for inputs in data.encoder_inputs()]


def decoder_runtime(package: Path, step=None) -> DecoderRuntime:
    """The decoder package's functions on one state (`DecoderRuntime`); `step`: an already loaded
    step function of it (e.g. one whose constants the sensitivity run replaces)."""
    if step is None:
        return DecoderRuntime.load(package, backend="mil", prefill=False, extend=False)
    return DecoderRuntime(step, bind_function(package))


def bind_function(package: Path):
    """The package's bind_memory function, None for a host-state decoder (the host writes its memory)."""
    from ..runtime import read_package

    if BIND_FUNCTION not in read_package(package).function_names:
        return None
    return load_model(str(package), backend="mil", function_name=BIND_FUNCTION)


def decoder_outputs(decoder, data: GateData) -> list[np.ndarray]:
    """Teacher-forced log-probs (S, V) of each gate sequence, on the f16 encoder's memory bound
    (bind_memory, or the host's writes). `decoder`: a `DecoderRuntime` (`decoder_runtime`)."""
    rows = []
    for enc, ids, prompt in zip(data.encoder_ref, data.sequences, data.prompts):
        case = TeacherForcingCase(cross_k=enc["cross_k"], cross_v=enc["cross_v"], cross_mask=enc["cross_mask"],
                                  ids=ids, log_probs=None, prompt_len=len(prompt))
        rows.append(run_teacher_forcing(decoder, case))
    return rows


def batch_agreement(package: Path, data: GateData, single: list[np.ndarray], min_psnr_db: float,
                    memories=None) -> dict | None:
    """The package's batched step (`step_batch`) on the gate sequences against its own batch-1 step: rows
    staggered as the export's gate runs them (`decoder_gate.run_batch_teacher_forcing`: row r is sequence
    r mod n, fed from call r on), each row's log-probs vs `single` (`decoder_outputs` of the same package):
    PSNR and argmax flips by the near-tie rule (`parity.argmax_flips`) on its decoding steps. Passes when every
    row is at least `min_psnr_db` with no decisive flip. None when the package has no batched step.
    `memories`: each row's memory instead of its own sequence's (a test's broken variant)."""
    from ..export.decoder_gate import run_batch_teacher_forcing
    from ..inference.batch_decoding import BatchDecoder
    from ..runtime import read_package

    if STEP_BATCH_FUNCTION not in read_package(package).function_names:
        return None
    cases = [TeacherForcingCase(cross_k=enc["cross_k"], cross_v=enc["cross_v"], cross_mask=enc["cross_mask"],
                                ids=ids, log_probs=None, prompt_len=len(prompt))
             for enc, ids, prompt in zip(data.encoder_ref, data.sequences, data.prompts)]
    produced = run_batch_teacher_forcing(BatchDecoder.load(package, backend="mil"), cases, memories)
    rows = []
    for r, out in enumerate(produced):
        case, ref = cases[r % len(cases)], single[r % len(cases)]
        decoding = slice(max(case.prompt_len - 1, 0), len(case.ids))
        flips = argmax_flips(ref[decoding], out[decoding])
        rows.append({"row": r, "sequence": r % len(cases), "psnr_db": float(psnr(ref, out)),
                     "near_tie_flips": flips["near_tie_flips"], "decisive_flips": flips["decisive_flips"]})
    worst = min(r["psnr_db"] for r in rows)
    return {"reference": "the same package's batch-1 step", "size": len(rows), "rows": rows, "worst_psnr_db": worst,
            "decisive_flips": sum(r["decisive_flips"] for r in rows), "min_psnr_db": min_psnr_db,
            "passed": bool(worst >= min_psnr_db and all(r["decisive_flips"] == 0 for r in rows))}


def encoder_psnr(reference: list[dict], produced: list[dict]) -> float:
    """Worst PSNR (dB) over the float outputs of every window (valid and padded rows alike)."""
    worst = float("inf")
    for ref, out in zip(reference, produced):
        for name, r in ref.items():
            if np.asarray(r).dtype.kind == "f":
                worst = min(worst, psnr(r, out[name]))
    return worst


def decoder_psnr(reference: list[np.ndarray], produced: list[np.ndarray]) -> float:
    """Worst PSNR (dB) of teacher-forced log-probs over the gate sequences."""
    return min(psnr(r, o) for r, o in zip(reference, produced))


def log_prob_error(reference: list[np.ndarray], produced: list[np.ndarray], prompts: list[list[int]],
                   eos_ids: Sequence[int], top_k: int = 16) -> dict:
    """Per-step log-prob error (nats) of decoder outputs vs the f16 decoder, on decoding steps.

    For each step that greedy decoding reads (from the last prompt token on), the signed error
    d = lp_quantized - lp_f16 over the reference's top-`top_k` tokens: `abs_error` are the |d|
    values, `flip_bound` = max(d) - min(d) per step (a near-tie between two of those tokens with
    a smaller margin can flip), `eos` the signed error of the eos id at every step.
    """
    abs_err, flip, eos_err, kls, psnrs = [], [], [], [], []
    agree = total = 0
    flips = {"flips": 0, "near_tie_flips": 0, "decisive_flips": 0, "rows": []}
    for ref, out, prompt in zip(reference, produced, prompts):
        s = slice(len(prompt) - 1, len(ref))
        r, o = np.asarray(ref[s], np.float64), np.asarray(out[s], np.float64)  # (steps, V)
        top = np.argsort(-r, axis=-1)[:, :top_k]
        d = np.take_along_axis(o, top, -1) - np.take_along_axis(r, top, -1)
        abs_err.append(np.abs(d).reshape(-1))
        flip.append(d.max(-1) - d.min(-1))
        for e in eos_ids:
            eos_err.append(o[:, e] - r[:, e])
        kls.append(kl_rows(r, o))  # both rows renormalised (fp16 log-probs do not sum to exactly 1)
        psnrs.append(psnr(ref, out))
        agree += int(np.sum(r.argmax(-1) == o.argmax(-1)))
        total += r.shape[0]
        f = argmax_flips(r, o, positions=range(s.start, len(ref)))  # the export gate's near-tie rule
        for key in ("flips", "near_tie_flips", "decisive_flips"):
            flips[key] += f[key]
        flips["rows"] += [{"case": len(psnrs) - 1, **row} for row in f["rows"]]

    def stats(x):
        x = np.concatenate(x) if x else np.zeros(0)
        if not x.size:
            return {}
        return {"median": float(np.median(np.abs(x))), "p99": float(np.percentile(np.abs(x), 99)),
                "max": float(np.max(np.abs(x))), "mean_signed": float(np.mean(x)), "n": int(x.size)}

    kl = np.concatenate(kls)
    return {
        "steps": int(total), "argmax_agree": int(agree), "top_k": top_k,
        "worst_psnr_db": float(min(psnrs)), "mean_kl": float(np.mean(kl)), "max_kl": float(np.max(kl)),
        "abs_error_nats": stats(abs_err), "flip_bound_nats": stats(flip), "eos_error_nats": stats(eos_err),
        "near_tie_flips": flips["near_tie_flips"], "decisive_flips": flips["decisive_flips"], "flips": flips["rows"],
    }
