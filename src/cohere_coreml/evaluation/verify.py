"""Stage-by-stage parity of an exported bundle against the `transformers` reference.

For every clip and every window of it (the same split points as the reference extractor):

1. mel      : our front end (cohere_coreml.model.audio) vs `CohereAsrFeatureExtractor` (dither 0), PSNR
              over the valid frames; when the bundle has frontend.mlpackage, its features too
              ("frontend": PSNR, max |diff|, valid frames, padding zero);
2. encoder  : encoder.mlpackage outputs (cross_k, cross_v, encoder_hidden_states) vs the PyTorch
              encoder + `decoder.proj` + each layer's cross k/v projections, PSNR over valid frames;
3. decoder  : decoder.mlpackage under teacher forcing (the PyTorch cross memory bound with its
              bind_memory function, then fed the reference greedy sequence, so this stage is
              measured alone): per-step log-prob PSNR and
              KL(PyTorch || package), argmax agreement;
4. end to end: the Transcriber's greedy tokens (encoder + decoder packages) vs
              `model.generate(...)` with the same prompt and `max_new_tokens`, and the texts. A
              window whose tokens differ gets a verdict (`judge_difference`): at the first differing
              step, the reference's margin between its token and the bundle's, against the error the
              bundle (its own encoder memory, teacher-forced on the common prefix) measures at that
              step: "near-tie" when the flip is one the measured error could cause (the gates' rule,
              `parity.flip_row`) and the bundle is within the export gate's PSNR/KL up to there;
              "DIFFERS" otherwise (a real difference: `cohere-coreml verify` exits 1).

`verify_bundle(...)` returns a JSON-ready dict; `format_table(...)` renders it for people.
The same code runs against Core ML on a Mac (`backend="coreml"`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..cli_options import HelpFormatter, add_bundle_arg
from ..config import NEAR_TIE_FACTOR
from ..export.parity import flip_row, psnr
from ..model.audio import load_audio, log_mel, pad_to_window, split_points
from ..model.checkpoint import load_reference
from ..model.tokens import decode_ids, join_windows, prompt_ids
from ..storage.files import write_json_atomic

logger = logging.getLogger(__name__)


class VerifyError(RuntimeError):
    """The bundle and the checkpoint do not belong together (shapes, vocabulary, prompts)."""


def _f(x: float):
    return x if math.isfinite(x) else str(x)


def _check_compatible(model, tokenizer, bundle) -> None:
    m = bundle.manifest
    dec = m["decoder"]
    cfg = model.config
    problems = []
    for key, value in (("vocab_size", cfg.vocab_size), ("num_layers", cfg.num_hidden_layers),
                       ("num_key_value_heads", cfg.num_key_value_heads), ("head_dim", cfg.head_dim),
                       ("hidden_size", cfg.hidden_size)):
        if int(dec[key]) != int(value):
            problems.append(f"decoder {key}: bundle {dec[key]} vs checkpoint {value}")

    if bundle.prompt("en") != prompt_ids(tokenizer, "en"):
        problems.append("the English prompt ids differ (different tokenizer)")
    if problems:
        raise VerifyError("bundle and checkpoint do not match: " + "; ".join(problems))


def verify_bundle(model, processor, bundle_dirs, audio: Sequence, language: str = "en", punctuation: bool = True,
                  backend: str = "auto", max_new_tokens: int | None = None, languages: Sequence[str] | None = None,
                  progress: bool = False, tags: Sequence[str] | None = None) -> dict:
    """Run every stage for every clip; returns {"clips": [...], "summary": {...}}.

    audio: file paths or float32 arrays at the bundle's sample rate; `languages` (same length)
    overrides `language` per clip; `tags` (same length) labels each clip (e.g. "in-domain",
    "out-of-domain"): the table shows it and the summary counts verdicts per tag.
    """
    import torch  # heavy: verify imports without torch

    with torch.no_grad():  # no autograd graph; the caller's setting is back afterwards
        return _verify_bundle(model, processor, bundle_dirs, audio, language=language, punctuation=punctuation,
                              backend=backend, max_new_tokens=max_new_tokens, languages=languages,
                              progress=progress, tags=tags)


def _verify_bundle(model, processor, bundle_dirs, audio: Sequence, language: str, punctuation: bool,
                   backend: str, max_new_tokens: int | None, languages: Sequence[str] | None,
                   progress: bool, tags: Sequence[str] | None) -> dict:
    import torch  # heavy (as verify_bundle)

    from ..export.decoder_gate import TeacherForcingCase, run_teacher_forcing, teacher_forcing_report
    from ..inference.transcribe import Transcriber  # loads torch via cohere_coreml.runtime (as above)
    from ..model.reference import cross_memory  # loads torch (as above)

    transcriber = Transcriber(bundle_dirs, backend=backend)
    bundle = transcriber.bundle
    tokenizer = processor.tokenizer
    _check_compatible(model, tokenizer, bundle)
    fe = processor.feature_extractor
    fe.dither = 0.0
    front_end = transcriber.front_end
    sr = front_end.sampling_rate
    memory_len = int(bundle.manifest["encoder"]["memory_len"])
    precision = bundle.manifest.get("precision", "fp16")
    if languages is not None and len(languages) != len(audio):
        raise VerifyError(f"{len(languages)} languages for {len(audio)} clips")
    if tags is not None and len(tags) != len(audio):
        raise VerifyError(f"{len(tags)} tags for {len(audio)} clips")

    clips = []
    items = list(enumerate(audio))
    if progress:
        items = tqdm(items, desc="verify", unit="clip")
    for ci, source in items:
        lang = languages[ci] if languages is not None else language
        name = str(source) if isinstance(source, (str, Path)) else f"array[{ci}]"
        wav = load_audio(source, target_rate=sr) if isinstance(source, (str, Path)) else np.asarray(source, np.float32)
        prompt = bundle.prompt(lang, punctuation)
        windows = []
        for wi, (start, end) in enumerate(split_points(wav, front_end)):
            piece = wav[start:end]
            w: dict = {"window": wi, "start_s": start / sr, "seconds": (end - start) / sr}
            # 1. mel
            ref = fe(piece, sampling_rate=sr, return_tensors="np", return_attention_mask=True)
            ref_feats = ref["input_features"][0].T  # (M, frames)
            n_ref = int(ref["attention_mask"].sum())
            ours, n_valid = log_mel(piece, front_end)
            w["mel"] = {"frames": n_valid, "reference_frames": n_ref,
                        "psnr_db": _f(psnr(ref_feats[:, :n_ref], ours[:, :n_ref])) if n_ref == n_valid else "-inf",
                        "max_abs_err": float(np.max(np.abs(ref_feats[:, :n_ref] - ours[:, :n_ref])))
                        if n_ref == n_valid else float("inf")}
            if "frontend" in bundle.paths:  # 1b. the bundle's front-end package vs the extractor
                pkg_feats, pkg_valid, _ = transcriber.package_features(piece)
                same = pkg_valid == n_ref
                w["frontend"] = {"frames": pkg_valid, "reference_frames": n_ref,
                                 "psnr_db": _f(psnr(ref_feats[:, :n_ref], pkg_feats[0, :, :n_ref])) if same else "-inf",
                                 "max_abs_err": float(np.max(np.abs(ref_feats[:, :n_ref] - pkg_feats[0, :, :n_ref])))
                                 if same else float("inf"),
                                 "padding_zero": not pkg_feats[0, :, pkg_valid:].any()}
            # 2. encoder
            feats_t = torch.from_numpy(ref["input_features"])
            mask_t = torch.from_numpy(ref["attention_mask"]).long()
            enc = model.model.encoder(feats_t, attention_mask=mask_t)
            enc_valid = int(enc.attention_mask.sum())
            ref_memory = cross_memory(model, enc.last_hidden_state, enc_valid, memory_len)
            ref_k, ref_v, ref_mask = ref_memory["cross_k"], ref_memory["cross_v"], ref_memory["cross_mask"]

            window, _ = pad_to_window(ours, n_valid, frames=transcriber.window_frames)
            t0 = time.perf_counter()
            enc_out = transcriber.encode(window, n_valid)
            enc_s = time.perf_counter() - t0
            pkg_len = int(np.asarray(enc_out.get("encoder_length", [enc_valid])).reshape(-1)[0])
            ref_hidden = ref_memory["encoder_hidden_states"][0, :enc_valid]
            w["encoder"] = {
                "seconds": enc_s,
                "encoder_length": pkg_len,
                "reference_length": enc_valid,
                "cross_k_psnr_db": _f(psnr(ref_k[:, :, :enc_valid],
                                           np.asarray(enc_out["cross_k"], np.float32)[:, :, :enc_valid])),
                "cross_v_psnr_db": _f(psnr(ref_v[:, :, :enc_valid],
                                           np.asarray(enc_out["cross_v"], np.float32)[:, :, :enc_valid])),
            }
            if "encoder_hidden_states" in enc_out:
                w["encoder"]["hidden_psnr_db"] = _f(psnr(
                    ref_hidden, np.asarray(enc_out["encoder_hidden_states"], np.float32)[0, :enc_valid]))
            # 4 (reference part). greedy tokens from generate()
            limit = bundle.capacity - len(prompt) + 1
            n_new = min(limit, max_new_tokens) if max_new_tokens else limit
            gen = model.generate(input_features=feats_t, attention_mask=mask_t,
                                 decoder_input_ids=torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
            ref_ids = [int(t) for t in gen[0, len(prompt):]]
            # 3. decoder under teacher forcing with the reference memory
            fed = list(prompt) + ref_ids[:-1]
            from transformers.models.parakeet.modeling_parakeet import (  # heavy; sentencepiece (see decoder_gate)
                ParakeetEncoderModelOutput,
            )

            enc_obj = ParakeetEncoderModelOutput(last_hidden_state=enc.last_hidden_state,
                                                 attention_mask=enc.attention_mask)
            logits = model(encoder_outputs=enc_obj, decoder_input_ids=torch.tensor([fed])).logits[0]
            ref_lp = torch.log_softmax(logits, dim=-1).numpy()
            case = TeacherForcingCase(cross_k=ref_k, cross_v=ref_v, cross_mask=ref_mask,
                                      ids=fed, log_probs=ref_lp, prompt_len=len(prompt))
            produced = run_teacher_forcing(transcriber.decoder, case)
            tf = teacher_forcing_report(case, produced, precision)
            w["decoder"] = {k: tf[k] for k in ("steps", "worst_psnr_db", "mean_kl", "max_kl", "argmax_agree",
                                               "argmax_steps", "passed")}
            w["decoder"]["per_step"] = [{k: s[k] for k in ("position", "psnr_db", "kl")} for s in tf["per_step"]]
            # 4. end to end through the packages
            dec = transcriber.decode(enc_out, prompt, max_new_tokens=n_new)

            eos = transcriber.eos_ids
            w["tokens"] = {
                "reference": ref_ids,
                "bundle": dec.token_ids,
                "identical": dec.token_ids == ref_ids,
                "common_prefix": _common_prefix(dec.token_ids, ref_ids),
                "truncated": dec.truncated,
                "reference_text": decode_ids(tokenizer, [t for t in ref_ids if t not in eos]),
                "bundle_text": decode_ids(tokenizer, [t for t in dec.token_ids if t not in eos]),
            }
            if dec.token_ids != ref_ids:
                diff = judge_difference(transcriber.decoder, enc_out, ref_ids, dec.token_ids, fed, ref_lp,
                                        len(prompt), precision)
                if "reference_token" in diff:
                    diff["reference_piece"] = decode_ids(tokenizer, [diff["reference_token"]])
                    diff["bundle_piece"] = decode_ids(tokenizer, [diff["bundle_token"]])
                w["tokens"]["difference"] = diff
            w["tokens"]["verdict"] = _verdict(w["tokens"])
            windows.append(w)

        clips.append({"clip": name, "language": lang, "tag": tags[ci] if tags is not None else None, "windows": windows,
                      "text": join_windows([w["tokens"]["bundle_text"] for w in windows], lang),
                      "reference_text": join_windows([w["tokens"]["reference_text"] for w in windows], lang)})
    return {"bundle": [str(d) for d in bundle.dirs], "backend": transcriber.decoder.backend,
            "precision": precision, "clips": clips, "summary": summarize(clips)}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


SAME, NEAR_TIE, DIFFERS = "same", "near-tie", "DIFFERS"  # a window's token verdict


def judge_difference(decoder, memory: dict, ref_ids: list[int], out_ids: list[int], fed: list[int],
                     ref_log_probs: np.ndarray, prompt_len: int, precision: str) -> dict:
    """Why the bundle's tokens `out_ids` differ from the reference's `ref_ids`: the first differing step,
    both tokens, the reference's margin between them and the bundle's measured error there.

    The bundle's decoder (a `DecoderRuntime`) is teacher-forced on `fed` (prompt + reference tokens) up to
    that step with the bundle's own encoder `memory`: its rows against `ref_log_probs` (the reference's
    rows after each fed token) give the error of the whole bundle at each step. The verdict is NEAR_TIE
    when the flip's margin is within `parity.flip_row`'s bound of the error measured at that step and the
    steps before it pass the export gate's PSNR/KL/flip rule for `precision` (`teacher_forcing_report`);
    else DIFFERS.
    """
    from ..export.decoder_gate import TeacherForcingCase, run_teacher_forcing, teacher_forcing_report  # loads torch

    k = _common_prefix(out_ids, ref_ids)
    if k >= min(len(ref_ids), len(out_ids)):  # one sequence is a prefix of the other
        return {"verdict": DIFFERS, "step": k, "reason": f"lengths differ ({len(out_ids)} vs {len(ref_ids)} tokens) "
                "with no differing token"}
    row = prompt_len - 1 + k  # the row after fed[row] predicts generated token k

    def case_of(n: int) -> TeacherForcingCase:
        return TeacherForcingCase(cross_k=np.asarray(memory["cross_k"], np.float32),
                                  cross_v=np.asarray(memory["cross_v"], np.float32),
                                  cross_mask=np.asarray(memory["cross_mask"], np.float32),
                                  ids=list(fed[:n]), log_probs=ref_log_probs[:n], prompt_len=prompt_len)

    rows = run_teacher_forcing(decoder, case_of(row + 1))
    flip = flip_row(ref_log_probs[row], rows[row], ref_ids[k], out_ids[k])
    # the steps before the flip, under the export gate (none when the prompt is a single token)
    report = teacher_forcing_report(case_of(row), rows[:row], precision) if row else None
    before_ok = report is None or report["passed"]
    near = bool(flip["near_tie"] and before_ok)
    reason = (f"margin {flip['ref_margin_nats']:.3g} nats {'<=' if flip['near_tie'] else '>'} {NEAR_TIE_FACTOR:g} x "
              f"the step's error {flip['step_error_nats']:.3g}")
    if flip["near_tie"] and not before_ok:
        reason += (f", but the bundle is outside the export gate before it (worst PSNR {report['worst_psnr_db']:.1f} "
                   f"dB, min {report['min_psnr_db_required']}; mean KL {report['mean_kl']:.2e}, max "
                   f"{report['max_kl_allowed']:.0e}; {report['decisive_flips']} decisive flips)")
    figures = ("worst_psnr_db", "mean_kl", "max_kl", "decisive_flips", "passed")
    return {"verdict": NEAR_TIE if near else DIFFERS, "step": k, "reference_token": int(ref_ids[k]),
            "bundle_token": int(out_ids[k]), "ref_margin_nats": flip["ref_margin_nats"],
            "step_error_nats": flip["step_error_nats"], "factor": NEAR_TIE_FACTOR,
            "before": None if report is None else {key: _f(report[key]) if isinstance(report[key], float)
                                                   else report[key] for key in figures},
            "reason": reason}


def _verdict(tokens: dict) -> str:
    return SAME if tokens["identical"] else tokens["difference"]["verdict"]


def _num(x) -> float:
    return float(x)  # also parses the "inf" / "-inf" strings JSON needs


def verdict_counts(windows: list[dict]) -> dict:
    """Windows by token verdict: {"windows", "same", "near-tie", "DIFFERS"}."""
    verdicts = [_verdict(w["tokens"]) for w in windows]
    return {"windows": len(windows), **{v: verdicts.count(v) for v in (SAME, NEAR_TIE, DIFFERS)}}


def summarize(clips: list[dict]) -> dict:
    windows = [w for c in clips for w in c["windows"]]
    if not windows:
        return {}
    frontend = [w["frontend"] for w in windows if "frontend" in w]
    fe_summary = {}
    if frontend:
        fe_summary = {"frontend_worst_psnr_db": min(_num(f["psnr_db"]) for f in frontend),
                      "frontend_max_abs_err": max(f["max_abs_err"] for f in frontend),
                      "frontend_frames_equal": all(f["frames"] == f["reference_frames"] for f in frontend),
                      "frontend_padding_zero": all(f["padding_zero"] for f in frontend)}
    return {
        **fe_summary,
        "clips": len(clips),
        "windows": len(windows),
        "mel_worst_psnr_db": min(_num(w["mel"]["psnr_db"]) for w in windows),
        "encoder_worst_psnr_db": min(min(_num(w["encoder"]["cross_k_psnr_db"]), _num(w["encoder"]["cross_v_psnr_db"]))
                                     for w in windows),
        "decoder_worst_psnr_db": min(w["decoder"]["worst_psnr_db"] for w in windows),
        "decoder_mean_kl": float(np.mean([w["decoder"]["mean_kl"] for w in windows])),
        "decoder_max_kl": max(w["decoder"]["max_kl"] for w in windows),
        "decoder_steps": sum(w["decoder"]["steps"] for w in windows),
        "tokens_identical_windows": sum(bool(w["tokens"]["identical"]) for w in windows),
        "tokens_near_tie_windows": sum(_verdict(w["tokens"]) == NEAR_TIE for w in windows),
        "tokens_differing_windows": sum(_verdict(w["tokens"]) == DIFFERS for w in windows),
        "by_tag": {tag: verdict_counts([w for c in clips if c.get("tag") == tag for w in c["windows"]])
                   for tag in dict.fromkeys(c.get("tag") for c in clips) if tag is not None},
        "tokens_compared": sum(len(w["tokens"]["reference"]) for w in windows),
        "tokens_matching_prefix": sum(w["tokens"]["common_prefix"] for w in windows),
    }


def _difference_line(w: dict) -> str:
    d = w["tokens"]["difference"]
    if "reference_token" not in d:
        return f"    window {w['window']}: {d['verdict']} at step {d['step']}: {d['reason']}"
    return (f"    window {w['window']}: {d['verdict']} at step {d['step']}: reference {d['reference_piece']!r} "
            f"({d['reference_token']}) vs bundle {d['bundle_piece']!r} ({d['bundle_token']}): {d['reason']}")


def _counts_text(counts: dict) -> str:
    return (f"identical token windows {counts[SAME]}/{counts['windows']}, near-tie {counts[NEAR_TIE]}, "
            f"DIFFERS {counts[DIFFERS]}")


def format_table(report: dict) -> str:
    tagged = any(c.get("tag") for c in report["clips"])
    tag_col = f"{'set':<14}" if tagged else ""
    lines = [f"bundle {', '.join(report['bundle'])}  backend {report['backend']}  precision {report['precision']}",
             f"{'clip':<28} {tag_col}{'win':>3} {'mel dB':>7} {'enc dB':>7} {'dec dB':>7} {'mean KL':>9} "
             f"{'argmax':>7} {'tokens':>13}  text"]
    for c in report["clips"]:
        for w in c["windows"]:
            enc_db = min(_num(w["encoder"]["cross_k_psnr_db"]), _num(w["encoder"]["cross_v_psnr_db"]))
            tok = w["tokens"]
            verdict = _verdict(tok)
            same = SAME if verdict == SAME else f"{verdict} {tok['common_prefix']}/{len(tok['reference'])}"
            d = w["decoder"]
            tag = f"{(c.get('tag') or '')[:13]:<14}" if tagged else ""
            lines.append(
                f"{Path(c['clip']).name[:28]:<28} {tag}{w['window']:>3} {_num(w['mel']['psnr_db']):>7.1f} "
                f"{enc_db:>7.1f} {d['worst_psnr_db']:>7.1f} {d['mean_kl']:>9.2e} "
                f"{d['argmax_agree']:>3}/{d['argmax_steps']:<3} {same:>13}  {tok['bundle_text'][:40]!r}"
            )
    differing = [(c, w) for c in report["clips"] for w in c["windows"] if not w["tokens"]["identical"]]
    if differing:
        lines.append(f"token differences (near-tie: the reference's margin is within {NEAR_TIE_FACTOR:g} x the "
                     "error the bundle measures at that step; DIFFERS: a real difference):")
        for c, w in differing:
            lines.append(f"  {Path(c['clip']).name}")
            lines.append(_difference_line(w))
    lines.append("transcripts (bundle, windows joined as the processor joins them):")
    for c in report["clips"]:
        lines.append(f"  {Path(c['clip']).name} [{c['language']}]: {c.get('text', '')}")
        if c.get("text") != c.get("reference_text"):
            lines.append(f"  {'':{len(Path(c['clip']).name)}}  reference: {c.get('reference_text', '')}")
    s = report["summary"]
    if s and "frontend_worst_psnr_db" in s:
        lines.append(f"front-end package: >= {s['frontend_worst_psnr_db']:.1f} dB, max |diff| "
                     f"{s['frontend_max_abs_err']:.2e} vs the extractor, valid frames equal "
                     f"{s['frontend_frames_equal']}, padding zero {s['frontend_padding_zero']}")
    if s:
        lines.append(
            f"summary: {s['windows']} windows, mel >= {s['mel_worst_psnr_db']:.1f} dB, encoder >= "
            f"{s['encoder_worst_psnr_db']:.1f} dB, decoder >= {s['decoder_worst_psnr_db']:.1f} dB, mean KL "
            f"{s['decoder_mean_kl']:.2e} (max {s['decoder_max_kl']:.2e}) over {s['decoder_steps']} steps, "
            f"identical token windows {s['tokens_identical_windows']}/{s['windows']} "
            f"({s['tokens_matching_prefix']}/{s['tokens_compared']} tokens), near-tie "
            f"{s['tokens_near_tie_windows']}, DIFFERS {s['tokens_differing_windows']}"
        )
        for tag, counts in s.get("by_tag", {}).items():
            lines.append(f"  {tag}: {_counts_text(counts)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# `cohere-coreml verify` (registered by cli.py)
# --------------------------------------------------------------------------------------------


def cmd_verify(args) -> int:
    model, processor = load_reference(args.model, revision=args.revision)
    languages = [s.strip() for s in args.languages.split(",")] if args.languages else None
    tags = [s.strip() for s in args.tags.split(",")] if args.tags else None
    report = verify_bundle(model, processor, args.bundle, args.audio, language=args.language,
                           punctuation=not args.no_punctuation, backend=args.backend,
                           max_new_tokens=args.max_new_tokens, languages=languages, progress=not args.json,
                           tags=tags)
    if args.out:
        write_json_atomic(report, args.out)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print(format_table(report))
    s = report["summary"]
    if s.get("tokens_differing_windows"):
        logger.error("%d of %d windows' tokens differ from the reference beyond a near-tie",
                     s["tokens_differing_windows"], s["windows"])
        return 1
    if args.strict and s.get("tokens_identical_windows") != s.get("windows"):
        logger.error("--strict: %d near-tie windows", s["tokens_near_tie_windows"])
        return 1
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="compare an exported bundle with the PyTorch checkpoint stage by stage",
        description="Stage-by-stage parity of a bundle against transformers: mel features (PSNR), encoder "
        "cross K/V (PSNR), every decoder step's log-probs under teacher forcing (PSNR, KL), and the final "
        "greedy tokens/text vs model.generate(). A window whose tokens differ is judged at its first differing "
        "step: 'near-tie' when the reference's margin between the two tokens is within 2 x the error the bundle "
        "measures there (and the bundle is within the export gate's PSNR/KL up to it), else 'DIFFERS' (exit "
        "status 1). Prints a table (or JSON). On a Mac, --backend coreml "
        "checks the Core ML runtime itself.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="checkpoint (Hub id or folder) the bundle was exported from")
    p.add_argument("--revision", default=None, help="Hub revision of --model")
    add_bundle_arg(p)
    p.add_argument("--audio", required=True, nargs="+", help="audio files to check")
    p.add_argument("--language", default="en", help="language of the clips (default: %(default)s)")
    p.add_argument("--languages", default=None, help="comma-separated language per clip (overrides --language)")
    p.add_argument("--no-punctuation", action="store_true", help="prompt with <|nopnc|>")
    p.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"), help="runtime backend")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens compared per window (default: the decoder capacity)")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--tags", default=None,
                   help="comma-separated label per clip (e.g. in-domain,out-of-domain): a table column, verdicts "
                   "counted per label")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless every window's tokens are identical (without it: exit 1 only when a "
                   "window DIFFERS, not for near-ties)")
    p.set_defaults(func=cmd_verify)
