"""Alignment heads: which decoder cross-attention heads the word-timing rule reads, chosen on a calibration set
with known word start times, and the gate that refuses a choice no better than a naive baseline.

The calibration set is a word-timing set (a folder with 16 kHz audio and `manifest.json`, the held-out sets'
format with per utterance `words`: [{"word", "char_start", "start", "end"}], `start` in seconds from the speech
synthesizer's own word events, null where it reported none). For each clip, the reference model is run
teacher-forced on the manifest's text (`model.alignment_reference`), so the choice needs no decoding and
depends on no transcription error.

The method (nothing in it depends on one model's shape):

0. Only the clips the model transcribes are evidence: a clip counts when every token of its text (and eos) is
   the model's first choice in the teacher-forced pass, i.e. greedy decoding would give exactly that text.
   Where the model cannot recognise the words, its attention says nothing about where they are (a small
   model trained on a narrow grammar fails on other sentences); without any such clip nothing is chosen.
1. Per head (every layer x head of the checkpoint): the rule (`inference.alignment`) on that head alone; its
   error is the median |start error| over every calibration word with a truth.
2. Rank the heads by that median (ties: the 90th percentile, then layer and head order).
3. For k = 1 .. all heads and each candidate number of rows before the text (`LEAD_ROW_CHOICES`): the rule
   on the mean of the top-k heads. Keep the (k, lead rows) of the lowest median error (ties: lower 90th
   percentile, then fewer heads, then fewer lead rows).
4. Gate: the chosen set's median error must be strictly below the naive baseline's on the same words (words
   spread by characters from the first word's start to the last word's end), on the clips of several sentences
   (pauses between them; all clips when the set has none). The baseline is given the true first start and last
   end, so on a single sentence it is hard to beat and says little; across pauses it cannot know where they
   are, which is what an aligner is for. A set that is no better is refused: no head set (None) and the
   reason, so a bundle carries no alignment rather than a wrong one.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..inference.alignment import (
    AlignmentError,
    align_words,
    alignment_rows,
    check_heads,
    format_heads,
    group_text,
    naive_word_starts,
    parse_heads,
    word_groups,
)
from ..model.layer_stream import run_together

logger = logging.getLogger(__name__)

# the calibration set shipped with the package (data/word_timing_calibration, its README says how it is made):
# what `export --alignment-heads auto` chooses on unless --alignment-calibration names another
CALIBRATION_SET = Path(__file__).resolve().parents[1] / "data" / "word_timing_calibration"
LEAD_ROW_CHOICES = (1, 2, 3)  # rows before the text the choice may use (the prompt's last tokens)
Head = tuple[int, int]  # (layer, head)


class CalibrationError(ValueError):
    """A calibration set that cannot be read or holds no word with a truth."""


@dataclass
class AlignmentRecord:
    """One clip: the teacher-forced attention of every head and the truth of its words.

    attention     (layers, heads, positions, frames): prompt + tokens + eos over the valid encoder frames
    pieces        the text tokens' pieces; probabilities: their probabilities (same pass)
    truth         per word of `word_groups(pieces)`: the truth word it matches ({"word", "start", "end"}: seconds,
                  None where the synthesizer gave none), or None (no match: a word recognised wrongly)
    span          (first word's start, last word's end) of the truth: the naive baseline's ends
    """

    attention: np.ndarray
    prompt_length: int
    pieces: list[str]
    probabilities: np.ndarray
    language: str
    truth: list[dict | None]
    span: tuple[float, float]
    frame_seconds: float
    offset_seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def words(self, heads: Sequence[Head], lead_rows: int, row_shift: int = 0, time_shift: float = 0.0, **options):
        """The rule's words for the mean of `heads` (`options`: `align_words`'s; `row_shift` 1 labels each row by
        its input token instead of the token it predicts, `time_shift` moves every time: variants to measure)."""
        rows = alignment_rows(self.attention, self.prompt_length + row_shift, len(self.pieces), lead_rows)
        att = np.stack([rows[layer, head] for layer, head in heads]) if heads else rows[:0, 0]
        return align_words(att, self.pieces, self.probabilities, frame_seconds=self.frame_seconds,
                           offset_seconds=self.offset_seconds + time_shift, lead_rows=lead_rows,
                           language=self.language, **options)

    def start_errors(self, heads: Sequence[Head], lead_rows: int, key: str = "start", **options) -> np.ndarray:
        """|predicted - true start| in seconds for every word with a truth (`key="end"`: the ends)."""
        words = self.words(heads, lead_rows, **options)
        return _errors([getattr(w, key) for w in words], self.truth, key)

    def baseline_errors(self) -> np.ndarray:
        texts = [group_text(self.pieces, g) for g in word_groups(self.pieces, self.language)]
        return _errors(naive_word_starts(texts, self.span[0], self.span[1]), self.truth, "start")

    @property
    def words_with_truth(self) -> int:
        """Words of the truth this record's words matched that carry a start."""
        return sum(1 for t in self.truth if t is not None and t.get("start") is not None)


def _errors(predicted: Sequence[float], truth: Sequence[dict | None], key: str) -> np.ndarray:
    return np.array([abs(p - t[key]) for p, t in zip(predicted, truth) if t is not None and t.get(key) is not None],
                    dtype=np.float64)


@dataclass
class HeadChoice:
    """The chosen heads and what they measured on the calibration set (seconds)."""

    heads: list[Head]
    lead_rows: int
    median: float
    p90: float
    baseline_median: float  # the naive baseline's, on the gate's clips
    words: int
    per_head: dict[Head, float]  # single-head median error, every head

    def to_dict(self) -> dict:
        return {"heads": [list(h) for h in self.heads], "lead_rows": self.lead_rows, "median_s": self.median,
                "p90_s": self.p90, "baseline_median_s": self.baseline_median, "words": self.words}


def _summary(errors: Iterable[np.ndarray]) -> tuple[float, float, int]:
    values = np.concatenate([np.asarray(e, dtype=np.float64) for e in errors] or [np.zeros(0)])
    if values.size == 0:
        return float("inf"), float("inf"), 0
    return float(np.median(values)), float(np.percentile(values, 90)), int(values.size)


def evaluate_heads(records: Sequence[AlignmentRecord], heads: Sequence[Head], lead_rows: int) -> tuple[float, float, int]:
    """(median, 90th percentile, words) of |start error| of the rule on the mean of `heads`."""
    return _summary(r.start_errors(heads, lead_rows) for r in records)


def baseline(records: Sequence[AlignmentRecord]) -> tuple[float, float, int]:
    """(median, 90th percentile, words) of the naive baseline's |start error|."""
    return _summary(r.baseline_errors() for r in records)


def gate_records(records: Sequence[AlignmentRecord]) -> list[AlignmentRecord]:
    """The records the gate compares on: the clips of several sentences, else all."""
    return [r for r in records if len(r.meta.get("sentences") or ()) > 1] or list(records)


def gate(records: Sequence[AlignmentRecord], heads: Sequence[Head], lead_rows: int) -> tuple[bool, str]:
    """Step 4: (accepted, the reason in one line) for a head set on the calibration records."""
    if not heads:
        return False, "no alignment head given"
    compared = gate_records(records)
    median, p90, n = evaluate_heads(compared, heads, lead_rows)
    base, _, _ = baseline(compared)
    if n == 0:
        return False, "the calibration set has no word with a true start time"
    where = "clips of several sentences" if len(compared) < len(records) or all(
        len(r.meta.get("sentences") or ()) > 1 for r in compared) else "clips"
    figures = (f"median |start error| {1000 * median:.0f} ms (p90 {1000 * p90:.0f} ms) on {n} words of "
               f"{len(compared)} {where} vs the naive baseline's {1000 * base:.0f} ms")
    if median < base:
        return True, f"heads {format_heads(heads)}: {figures}"
    return False, f"heads {format_heads(heads)} refused: {figures} (no better than spreading words by characters)"


def select_heads(records: Sequence[AlignmentRecord], lead_row_choices: Sequence[int] = LEAD_ROW_CHOICES,
                 max_heads: int | None = None) -> tuple[HeadChoice | None, str]:
    """Steps 1-4: (the chosen heads, the reason) or (None, why none is good enough)."""
    if not records:
        return None, "no calibration clip the model transcribes: its attention cannot be calibrated"
    layers, heads_per_layer = records[0].attention.shape[:2]
    every = [(layer, head) for layer in range(layers) for head in range(heads_per_layer)]
    if not every:
        return None, "the model has no cross-attention head"
    best = None
    per_head_best: dict[Head, float] = {}
    for lead in lead_row_choices:
        single = {h: evaluate_heads(records, [h], lead) for h in every}
        if lead == lead_row_choices[0]:
            per_head_best = {h: v[0] for h, v in single.items()}
        ranked = sorted(every, key=lambda h: (single[h][0], single[h][1], h))
        for k in range(1, min(len(ranked), max_heads or len(ranked)) + 1):
            median, p90, n = evaluate_heads(records, ranked[:k], lead)
            key = (median, p90, k, lead)
            if n and (best is None or key < best[0]):
                best = (key, ranked[:k], lead, n)
    if best is None:
        return None, "the calibration set has no word with a true start time"
    (median, p90, _, _), heads, lead, n = best
    accepted, reason = gate(records, heads, lead)
    if not accepted:
        return None, reason
    base = baseline(gate_records(records))[0]
    return HeadChoice(heads=sorted(heads), lead_rows=lead, median=median, p90=p90, baseline_median=base, words=n,
                      per_head=per_head_best), reason


# --------------------------------------------------------------------------------------------------
# Records from a word-timing set and the reference model
# --------------------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+", re.UNICODE)


def normalised_word(text: str) -> str:
    """A word for matching hypothesis to truth: lower case, letters and digits only."""
    return "".join(_WORD.findall(text.lower()))


def match_words(hypothesis: Sequence[str], truth_words: Sequence[dict]) -> list[dict | None]:
    """Per hypothesis word, the truth word it matches (difflib on normalised words), else None (a word the
    recogniser got wrong)."""
    a = [normalised_word(w) for w in hypothesis]
    b = [normalised_word(w["word"]) for w in truth_words]
    out: list[dict | None] = [None] * len(a)
    for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            out[block.a + k] = truth_words[block.b + k]
    return out


def truth_span(truth_words: Sequence[dict], seconds: float) -> tuple[float, float]:
    """(first word's start, last word's end) of a clip's truth: the naive baseline's ends. A missing end is the
    next known value: the last word's start, else the clip's length."""
    starts = [w["start"] for w in truth_words if w.get("start") is not None]
    if not starts:
        return 0.0, float(seconds)
    last = truth_words[-1]
    end = last.get("end") if last.get("end") is not None else seconds
    return float(starts[0]), float(max(end, starts[-1]))


def read_word_timing_set(folder: str | Path, languages: Sequence[str] | None = None,
                         kinds: Sequence[str] | None = None, limit: int | None = None) -> tuple[Path, list[dict]]:
    """(folder, utterances) of a word-timing set's manifest.json, filtered by language and kind, at most `limit`
    per (kind, language) in manifest order."""
    folder = Path(folder)
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        utterances = manifest["utterances"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CalibrationError(f"{path}: not a word-timing set ({type(err).__name__}: {err})") from None
    out, seen = [], {}
    for u in utterances:
        if "words" not in u:
            raise CalibrationError(f"{path}: utterance {u.get('file')!r} has no 'words' (not a word-timing set)")
        if languages and u["language"] not in languages or kinds and u.get("kind") not in kinds:
            continue
        key = (u.get("kind"), u["language"])
        if limit is not None and seen.get(key, 0) >= limit:
            continue
        seen[key] = seen.get(key, 0) + 1
        out.append(u)
    return folder, out


def calibration_records(model, processor, folder: str | Path, languages: Sequence[str] | None = None,
                        limit: int | None = None, progress: Callable[[str], None] | None = None,
                        require_transcribed: bool = True) -> list[AlignmentRecord]:
    """Records of a word-timing set: the reference model teacher-forced on each clip's text; with
    `require_transcribed` only the clips it would transcribe exactly (step 0)."""
    from ..model.alignment_reference import encode, frame_seconds, teacher_forced_attention
    from ..model.audio import FrontEndConfig, load_audio, log_mel
    from ..model.tokens import TokenizerError, UnknownLanguageError, eos_id, prompt_ids

    folder, utterances = read_word_timing_set(folder, languages, limit=limit)
    front_end = FrontEndConfig.from_processor(processor, dither=0.0)
    tokenizer = processor.tokenizer
    frame = frame_seconds(model, processor)
    prompts = {}
    for language in dict.fromkeys(u["language"] for u in utterances):
        try:
            prompts[language] = prompt_ids(tokenizer, language)
        except (TokenizerError, UnknownLanguageError):  # a language this checkpoint does not declare
            logger.info("calibration: %s skipped (the checkpoint has no prompt for it)", language)
    if not prompts:
        raise CalibrationError(f"{folder}: no clip in a language of this checkpoint")
    records, skipped = [], 0
    kept = [u for u in utterances if u["language"] in prompts]
    features, seconds = [], []
    for u in kept:
        audio = load_audio(folder / u["file"], target_rate=front_end.sampling_rate)
        mel, n_valid = log_mel(audio, front_end)
        features.append(mel[:, :n_valid])
        seconds.append(len(audio) / front_end.sampling_rate)
    # every clip's encoder pass at once: a streamed model reads each encoder layer once for all of them
    encodings = run_together(model, [functools.partial(encode, model, f) for f in features])
    for u, (encoded, _), clip_seconds in zip(kept, encodings, seconds, strict=True):
        tokens = tokenizer(u["text"], add_special_tokens=False).input_ids
        tf = teacher_forced_attention(model, encoded, prompts[u["language"]], tokens, eos_id(tokenizer))
        transcribed = bool(tf.top1.all())
        if require_transcribed and not transcribed:
            skipped += 1
            continue
        pieces = tokenizer.convert_ids_to_tokens(tokens)
        groups = word_groups(pieces, u["language"])
        words = [group_text(pieces, g) for g in groups]
        if len(words) != len(u["words"]):  # a word split differently than by whitespace: match by text
            logger.debug("%s: %d tokenizer words for %d truth words, matched by text", u["file"], len(words),
                         len(u["words"]))
        records.append(AlignmentRecord(
            attention=tf.attention, prompt_length=tf.prompt_length, pieces=pieces,
            probabilities=tf.token_probabilities[:-1], language=u["language"], truth=match_words(words, u["words"]),
            span=truth_span(u["words"], clip_seconds), frame_seconds=frame,
            meta={"file": u["file"], "kind": u.get("kind"), "text": u["text"],
                  "sentences": list(u.get("sentences") or [u["text"]]), "transcribed": transcribed,
                  # what the bundle-vs-reference check feeds the package (`alignment_cases`)
                  "encoded": encoded.last_hidden_state, "ids": list(prompts[u["language"]]) + list(tokens)}))
        if progress:
            progress(u["file"])
    if skipped:
        logger.info("calibration: %d of %d clips skipped (the model would not transcribe them exactly)", skipped,
                    skipped + len(records))
    return records


# --------------------------------------------------------------------------------------------------
# The export's choice (`export --alignment-heads`) and the bundle-vs-reference check
# --------------------------------------------------------------------------------------------------

AGREEMENT_REQUIRED = 0.99  # share of words whose package and reference boundaries agree within one encoder frame


@dataclass
class AlignmentPlan:
    """What the decoder export does about alignment.

    heads / lead_rows   the align function's heads (None: no align function) and the rows before the text
    note                why there is none (None when there are heads): the manifest's `alignment_note`
    calibration         the manifest's `calibration` block (None: the heads were not measured)
    records             the calibration clips the bundle-vs-reference check runs (`alignment_check`)
    frame_seconds       one encoder frame (the configs')
    """

    heads: list[Head] | None
    lead_rows: int
    note: str | None
    calibration: dict | None
    records: list[AlignmentRecord]
    frame_seconds: float
    request: str | None = None  # `alignment_request`: what the export asked, recorded beside the outcome

    def metadata(self) -> dict:
        """The decoder package's metadata entries (`bundle.packages.decoder_package_info` reads them back)."""
        from ..config import ALIGN_METADATA_KEY, ALIGN_NOTE_METADATA_KEY, ALIGN_REQUEST_METADATA_KEY

        asked = {ALIGN_REQUEST_METADATA_KEY: self.request} if self.request else {}
        if self.heads is None:
            return {ALIGN_NOTE_METADATA_KEY: self.note, **asked}
        return {**asked, ALIGN_METADATA_KEY: {"heads": [list(h) for h in self.heads], "lead_rows": self.lead_rows,
                                     "frame_seconds": self.frame_seconds, "calibration": self.calibration}}


def _calibration_block(name: str, records: Sequence[AlignmentRecord], heads: Sequence[Head], lead_rows: int) -> dict:
    median, p90, words = evaluate_heads(records, heads, lead_rows)
    return {"set": name, "clips": len(records), "words": words, "median_s": round(median, 4), "p90_s": round(p90, 4),
            "baseline_median_s": round(baseline(gate_records(records))[0], 4)}


def alignment_request(heads: str = "auto", lead_rows: int = 1, calibration: str | Path | None = None) -> str:
    """What an export asks of the decoder's alignment, in one line recorded in the decoder package's metadata:
    "none", "auto on <set>" or "L.H,... lead N on <set>", the set named by the sha256 of its manifest (its
    content, never a local path: the package is published). A present package that records another request, or
    none (exported before the align function existed), is exported again rather than skipped."""
    if heads == "none":
        return "none"
    manifest = (Path(calibration) if calibration is not None else CALIBRATION_SET) / "manifest.json"
    try:
        digest = hashlib.sha256(manifest.read_bytes()).hexdigest()[:12]
    except OSError as err:
        raise CalibrationError(f"calibration set {manifest.parent.name}: cannot read its manifest.json "
                               f"({err.strerror or err})") from None
    return f"auto on {digest}" if heads == "auto" else f"{heads} lead {int(lead_rows)} on {digest}"


def plan_alignment(model, processor, heads: str = "auto", lead_rows: int = 1,
                   calibration: str | Path | None = None) -> AlignmentPlan:
    """`export --alignment-heads`: "none" (no align function), "auto" (`select_heads` on the calibration set
    with the reference model; a refusal gives no align function and says why in one warning line) or an explicit
    "L.H,..." list (checked against the model; measured on the calibration set and recorded, kept even when the
    gate would refuse it: the user asked for these heads, and the warning line and the manifest's figures say how
    they fare). Raises AlignmentError / CalibrationError (one line) on a bad list or an unreadable set."""
    from ..config import PROMPT_LENGTH
    from ..model.alignment_reference import frame_seconds

    frame = frame_seconds(model, processor)
    if heads == "none":
        return AlignmentPlan(None, lead_rows, "exported with --alignment-heads none", None, [], frame)
    folder = Path(calibration) if calibration is not None else CALIBRATION_SET
    config = model.config
    explicit = None if heads == "auto" else check_heads(parse_heads(heads), config.num_hidden_layers,
                                                        config.num_attention_heads)
    if not 0 <= lead_rows < PROMPT_LENGTH:
        raise AlignmentError(f"--alignment-lead-rows must be 0..{PROMPT_LENGTH - 1} (rows before the text within the "
                             f"prompt), got {lead_rows}")
    every = calibration_records(model, processor, folder, require_transcribed=False)
    counted = [r for r in every if r.meta.get("transcribed")]
    name = folder.name
    if explicit is None:
        choice, reason = select_heads(counted)
        if choice is None:
            logger.warning("alignment heads: none chosen on %s (%d of %d clips transcribed): %s; the bundle has no "
                           "word timings", name, len(counted), len(every), reason)
            return AlignmentPlan(None, lead_rows, reason, None, [], frame)
        logger.info("alignment heads: %s", reason)
        return AlignmentPlan(choice.heads, choice.lead_rows, None,
                             _calibration_block(name, counted, choice.heads, choice.lead_rows), counted, frame)
    if not counted:
        logger.warning("alignment heads %s: not measured (the model transcribes none of the %d clips of %s)",
                       format_heads(explicit), len(every), name)
        return AlignmentPlan(explicit, lead_rows, None, None, every, frame)
    accepted, reason = gate(counted, explicit, lead_rows)
    (logger.info if accepted else logger.warning)("alignment heads (as given): %s", reason)
    return AlignmentPlan(explicit, lead_rows, None, _calibration_block(name, counted, explicit, lead_rows), counted,
                         frame)


@dataclass
class AlignmentCase:
    """One calibration clip as the package's align function sees it: the cross memory, the ids (prompt + text)
    and the reference's weights (every layer and head)."""

    record: AlignmentRecord
    memory: dict
    ids: list[int]
    frames: int


def alignment_cases(model, records: Sequence[AlignmentRecord], memory_len: int, capacity: int) -> list[AlignmentCase]:
    """The records whose clip fits the package (encoder frames <= memory_len, prompt + text <= capacity), with their
    cross memory computed by the reference (`model.reference.cross_memory`)."""
    import torch

    from ..model.reference import cross_memory

    cases = []
    with torch.no_grad():
        for r in records:
            hidden, ids = r.meta.get("encoded"), r.meta.get("ids")
            if hidden is None or ids is None:
                continue
            frames = int(hidden.shape[1])
            if frames > memory_len or len(ids) > capacity:
                continue
            memory = cross_memory(model, hidden, frames, memory_len)
            cases.append(AlignmentCase(r, {k: memory[k] for k in ("cross_k", "cross_v", "cross_mask")}, list(ids),
                                       frames))
    return cases


def boundary_agreement(cases: Sequence[AlignmentCase], weights: Sequence[np.ndarray], heads: Sequence[Head],
                       lead_rows: int, row_shift: int = 0,
                       reference_heads: Sequence[Head] | None = None) -> tuple[int, int]:
    """(words whose start and end agree within one encoder frame, words) between the rule on the package's
    `weights` (per case (len(heads), len(ids), frames)) and on the reference's weights of the same heads and rows.
    `row_shift` / `reference_heads`: the negative controls (the package's rows cut one slot early, -1: each row
    labelled by its input token; the reference read on other heads)."""
    agree = total = 0
    reference_heads = list(heads if reference_heads is None else reference_heads)
    for case, w in zip(cases, weights):
        r = case.record
        mine = alignment_rows(np.asarray(w)[..., : case.frames], r.prompt_length + row_shift, len(r.pieces), lead_rows)
        ref_rows = alignment_rows(r.attention, r.prompt_length, len(r.pieces), lead_rows)
        ref = np.stack([ref_rows[layer, head] for layer, head in reference_heads])
        options = dict(frame_seconds=r.frame_seconds, lead_rows=lead_rows, language=r.language)
        got = align_words(mine, r.pieces, r.probabilities, **options)
        want = align_words(ref, r.pieces, r.probabilities, **options)
        tolerance = r.frame_seconds * (1 + 1e-6)
        agree += sum(abs(a.start - b.start) <= tolerance and abs(a.end - b.end) <= tolerance for a, b in zip(got, want))
        total += len(want)
    return agree, total


def alignment_check(cases: Sequence[AlignmentCase], weights: Sequence[np.ndarray], heads: Sequence[Head],
                    lead_rows: int) -> dict:
    """The bundle-vs-reference check: word boundaries identical within one encoder frame on at least
    AGREEMENT_REQUIRED of the words, with its negative controls (the package's rows shifted by one slot; the
    reference read on other heads, when the model has any) and whether they would fail it."""
    agree, words = boundary_agreement(cases, weights, heads, lead_rows)
    fraction = agree / words if words else None
    controls = {}
    if words:
        if all(c.record.prompt_length - 2 - lead_rows >= 0 for c in cases):  # room for one row earlier
            a, n = boundary_agreement(cases, weights, heads, lead_rows, row_shift=-1)
            controls["shifted_rows"] = a / n
        layers, per_layer = cases[0].record.attention.shape[:2]
        others = [(layer, head) for layer in range(layers) for head in range(per_layer) if (layer, head) not in heads]
        if others:  # the heads ranked farthest from the chosen ones: the last ones of another layer if any
            wrong = [others[-1 - k % len(others)] for k in range(len(heads))]
            a, n = boundary_agreement(cases, weights, heads, lead_rows, reference_heads=wrong)
            controls["other_heads"] = a / n
    passed = fraction is not None and fraction >= AGREEMENT_REQUIRED
    return {"clips": len(cases), "words": words, "agree": agree, "fraction": fraction,
            "required": AGREEMENT_REQUIRED, "passed": passed if words else None,
            "controls": controls,
            "discriminates": all(v is not None and v < AGREEMENT_REQUIRED for v in controls.values()) if controls
            else None}
