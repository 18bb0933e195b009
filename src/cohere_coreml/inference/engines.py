"""One transcriber interface, two implementations: the PyTorch reference and an exported bundle.

    engine = PyTorchEngine("models/cohere-tiny-synth")          # transformers generate()
    engine = transcribe.Transcriber("out/f16", backend="mil")    # a bundle: interpreter or Core ML
    result = engine.transcribe("clip.flac", "en", beams=1, max_new_tokens=None, repetition_guard=None)

`Engine` is the interface; `PyTorchEngine` (here) and `transcribe.Transcriber` implement it. Both split audio at the reference extractor's points (`longform.iter_windows`, streamed from the
file), or with a voice-activity model (`vad="on"`, or "auto" with a bundle that has one) into windows of speech
only (`longform.plan_speech`, docs/vad.md), compute the same log-mel features (`audio.log_mel`), decode every window with the same
prompt, and return a `TranscriptionResult` whose windows carry token ids, stop reason (`decoding.StopReason`),
start/end times and stage timings (features, encoder, prompt, decode). `evaluate` and `bench`
use only this interface; `transcribe_files` is the batch runner of `cohere-coreml transcribe`.
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from ..bundle.manifest import checkpoint_eos_ids
from ..config import DEFAULT_MAX_NEW_TOKENS, LENGTH_PENALTY
from ..model.audio import AudioError, FrontEndConfig, log_mel
from ..model.checkpoint import load_reference
from ..model.tokens import decode_ids, join_windows, prompt_ids
from .alignment import DEFAULT_LEAD_ROWS, check_heads
from .decoding import StopReason
from .longform import check_audio, iter_ranges, iter_windows, plan_speech
from .speech_regions import VAD_MODES, VadOptions
from .words import AlignmentSettings, WordTimingError, clip_words, window_words

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class WindowResult:
    index: int
    start_s: float
    duration_s: float
    token_ids: list[int]  # generated ids (prompt excluded; the eos id included when reached)
    text: str
    truncated: bool  # True when the window stopped without eos
    stop_reason: StopReason  # a str: "eos" | "max_new_tokens" | "capacity" | "repetition" in JSON
    timings: dict = field(default_factory=dict)  # seconds, call counts, encoder function used
    decoding: dict = field(default_factory=dict)  # beams, repetition found by the guard
    words: list[dict] | None = None  # word timings ({"word", "start", "end", "probability"}); None: not asked

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.words is None:  # not asked: the JSON of a window stays as it was
            del out["words"]
        return out


@dataclass
class TranscriptionResult:
    text: str
    language: str
    punctuation: bool
    windows: list[WindowResult]
    silent: bool = False  # digital silence (`longform.check_audio`): empty text, no window, no model call
    word_timestamps: bool = False  # words were asked (a silent clip then has none: [])
    vad: dict | None = None  # with the VAD: windows, regions, audio_s, decoded_s, decoded_share, seconds; None: off

    @classmethod
    def of_silence(cls, language: str, punctuation: bool = True, word_timestamps: bool = False) -> TranscriptionResult:
        return cls(text="", language=language, punctuation=punctuation, windows=[], silent=True,
                   word_timestamps=word_timestamps)

    @property
    def token_ids(self) -> list[list[int]]:
        return [w.token_ids for w in self.windows]

    @property
    def truncated(self) -> bool:
        return any(w.truncated for w in self.windows)

    @property
    def words(self) -> list[dict] | None:
        """Every window's words in order, on the clip's timeline (None when word timings were not asked)."""
        words = clip_words(self.windows)
        return [] if words is None and self.word_timestamps else words

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "language": self.language,
            "punctuation": self.punctuation,
            "truncated": self.truncated,
            "silent": self.silent,
            "windows": [w.to_dict() for w in self.windows],
        }
        words = self.words
        if words is not None:
            out["words"] = words
        if self.vad is not None:
            out["vad"] = dict(self.vad)
        return out


def features_batch(features: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a list of (n_mels, t) features into torch (B, T, n_mels) + attention mask (B, T): the
    `transformers` model's input."""
    import torch  # the reference only (see PyTorchEngine.__init__)

    n_mels = features[0].shape[0]
    t_max = max(f.shape[1] for f in features)
    x = torch.zeros(len(features), t_max, n_mels, dtype=torch.float32)
    mask = torch.zeros(len(features), t_max, dtype=torch.long)
    for i, f in enumerate(features):
        x[i, : f.shape[1]] = torch.from_numpy(np.ascontiguousarray(f.T, dtype=np.float32))
        mask[i, : f.shape[1]] = 1
    return x, mask


class VadUnavailableError(ValueError):
    """`vad="on"` with an engine or bundle that has no voice-activity model (one line, names the fix)."""


def check_vad_mode(mode: str) -> str:
    if mode not in VAD_MODES:
        raise ValueError(f"vad must be one of {', '.join(VAD_MODES)}, got {mode!r}")
    return mode


class Engine(abc.ABC):
    """A transcriber. Attributes: kind ("pytorch" | "bundle"), name, load_s (construction time),
    front_end (`audio.FrontEndConfig`), eos_ids."""

    kind: str
    name: str
    load_s: float
    front_end: object
    eos_ids: set[int]

    @abc.abstractmethod
    def prompt(self, language: str, punctuation: bool = True) -> list[int]:
        """The decoder prompt ids (raises for an unsupported language)."""

    @abc.abstractmethod
    def transcribe_window(self, waveform: np.ndarray, prompt: Sequence[int], *, index: int, start_s: float,
                          max_new_tokens: int | None, beams: int, repetition_guard) -> WindowResult:
        """Decode one window (at most one `split_points` piece)."""

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "load_s": self.load_s}

    def speech_probabilities(self, vad: str = "auto"):
        """The voice-activity model (`inference.vad.SpeechProbabilities`) that `vad` asks for, or None (off).
        This base has none: "auto" and "off" give None, "on" raises `VadUnavailableError`."""
        if check_vad_mode(vad) == "on":
            raise VadUnavailableError(f"{self.name} has no voice-activity model: use --vad off or auto")
        return None

    def window_s(self) -> float:
        """The longest window this engine transcribes, seconds: what speech windows are packed up to."""
        return float(self.front_end.max_audio_clip_s)

    def transcribe(self, audio, language: str = "en", punctuation: bool = True, *, max_new_tokens: int | None = None,
                   beams: int = 1, repetition_guard=None, progress: bool = False,
                   word_timestamps: bool = False, vad: str = "auto",
                   vad_options: VadOptions | None = None) -> TranscriptionResult:
        """Transcribe a file (streamed window by window) or a float32 mono array at the model rate;
        `word_timestamps`: each window's words with start, end and probability (`words`).

        The audio is checked first (`longform.check_audio`, the one place that decides silence):
        digital silence gives an empty transcript marked `silent` with no model call; empty, NaN/inf
        or unreadable audio raises `AudioError`. `vad` ("auto": on when the engine has a voice-activity model,
        "on", "off") with `vad_options` (`speech_regions.VadOptions`): only the windows packed from the speech
        regions are transcribed (none: an empty transcript, no model call), their times on the clip's timeline;
        the result's `vad` holds the windows' count, the share of the audio they cover and the VAD pass's seconds.
        """
        prompt = self.prompt(language, punctuation)
        speech = self.speech_probabilities(vad)  # before the audio: `on` without a VAD fails first
        if vad_options is not None and not isinstance(vad_options, VadOptions):
            raise TypeError(f"vad_options must be a VadOptions, got {type(vad_options).__name__}")
        if check_audio(audio, self.front_end).status == "silent":
            logger.warning("%s is digitally silent: empty transcript, no model call",
                           audio if isinstance(audio, (str, os.PathLike)) else "audio array")
            return TranscriptionResult.of_silence(language, punctuation, word_timestamps)
        # word options only when asked: an engine without word timings keeps its transcribe_window signature
        word_options = {"word_timestamps": True, "language": language} if word_timestamps else {}
        summary = None
        if speech is None:
            pieces = iter_windows(audio, self.front_end)
        else:
            t0 = time.perf_counter()
            plan = plan_speech(audio, speech, vad_options, self.front_end, self.window_s())
            summary = {**plan.summary(), "seconds": time.perf_counter() - t0}  # the VAD pass over the whole file
            pieces = iter_ranges(audio, plan, self.front_end)
        if progress:
            pieces = tqdm(pieces, desc="windows", unit="window", leave=False)
        windows = self.transcribe_pieces(pieces, prompt, max_new_tokens=max_new_tokens, beams=beams,
                                         repetition_guard=repetition_guard, **word_options)
        text = join_windows([w.text for w in windows], language)
        return TranscriptionResult(text=text, language=language, punctuation=punctuation, windows=windows,
                                   word_timestamps=word_timestamps, vad=summary)


    def transcribe_pieces(self, pieces, prompt: Sequence[int], **options) -> list[WindowResult]:
        """The windows of one clip ((start, end, samples) pieces, read in order), one `transcribe_window` each;
        an engine that decodes several windows at once overrides it (`transcribe.Transcriber`)."""
        sr = self.front_end.sampling_rate
        return [self.transcribe_window(piece, prompt, index=i, start_s=start / sr, **options)
                for i, (start, _end, piece) in enumerate(pieces)]


class PyTorchEngine(Engine):
    """The `transformers` reference: the checkpoint's encoder, then `generate()` (greedy or beams).

    Features are the project's front end (equal to the reference extractor, docs/front-end.md), so
    the two engines see the same input. The encoder runs on its own so that its time is measured;
    `generate()` receives its output. With no `max_new_tokens`, a window stops after
    config.DEFAULT_MAX_NEW_TOKENS (upstream's default).

    Word timings (`transcribe(..., word_timestamps=True)`) need `alignment_heads` ((layer, head) pairs, e.g. a
    bundle's manifest heads, `alignment.parse_heads("1.0,1.2")`): the reference attention of one teacher-forced pass
    (`model.alignment_reference`) over each window's prompt + tokens, on those heads, through the same rule as
    the bundle (`words.window_words`): the bundle's words are checked against these. The tokens' probabilities
    are the same pass's (greedy decoding chose exactly those tokens there).

    Voice activity: the PyTorch module of the bundle's VAD (`inference.vad.TorchVad`, the same rule) with
    `vad="on"`; a checkpoint carries no VAD, so "auto" means off (pass "on" to compare with a bundle whose
    VAD is on).
    """

    kind = "pytorch"

    def __init__(self, model: str | os.PathLike, revision: str | None = None, margins: bool = False,
                 alignment_heads: Sequence[tuple[int, int]] | None = None, lead_rows: int = DEFAULT_LEAD_ROWS):
        t0 = time.perf_counter()
        self.model, self.processor = load_reference(model, revision=revision)
        self.load_s = time.perf_counter() - t0
        self.tokenizer = self.processor.tokenizer
        self.front_end = FrontEndConfig.from_processor(self.processor, dither=0.0)
        self.eos_ids = set(checkpoint_eos_ids(self.model))
        self.margins = margins  # keep top-1 minus top-2 log-prob per greedy token (evaluate)
        self.name = str(model)
        self.alignment = None  # AlignmentSettings when heads are given
        if alignment_heads:
            from ..model.alignment_reference import frame_seconds

            layers = len(self.model.model.decoder.layers)  # the decoder's (the encoder has its own config)
            heads = check_heads(alignment_heads, layers, int(self.model.config.num_attention_heads))
            self.alignment = AlignmentSettings(heads=heads, lead_rows=int(lead_rows),
                                               frame_seconds=frame_seconds(self.model, self.processor))

    def prompt(self, language: str, punctuation: bool = True) -> list[int]:
        return prompt_ids(self.tokenizer, language, punctuation)

    def speech_probabilities(self, vad: str = "auto"):
        if check_vad_mode(vad) != "on":
            return None
        if getattr(self, "_vad", None) is None:
            from .vad import TorchVad  # torch: the reference only

            self._vad = TorchVad()
        return self._vad

    def describe(self) -> dict:
        return {**super().describe(), "backend": "pytorch", "precision": str(self.model.dtype).replace("torch.", "")}

    def transcribe_window(self, waveform, prompt, *, index, start_s, max_new_tokens, beams, repetition_guard,
                          word_timestamps: bool = False, language: str | None = None):
        import torch  # the reference only (see __init__)
        from transformers import StoppingCriteria, StoppingCriteriaList  # the reference only (as torch)

        if beams < 1:
            raise ValueError(f"beams must be >= 1, got {beams}")
        if word_timestamps and self.alignment is None:
            raise WordTimingError("the PyTorch reference gives word timings only with alignment heads: pass "
                                  "alignment_heads (e.g. a bundle's manifest heads)")
        limit = int(max_new_tokens) if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        if limit < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {limit}")
        prompt = [int(t) for t in prompt]
        t0 = time.perf_counter()
        feats, n_valid = log_mel(waveform, self.front_end)
        x, mask = features_batch([feats[:, :n_valid]])  # (1, T, n_mels), (1, T)
        t1 = time.perf_counter()
        with torch.no_grad():  # generate() is no_grad itself; the caller's setting stays as it was
            enc = self.model.model.encoder(x, attention_mask=mask)
        t2 = time.perf_counter()

        class _Guard(StoppingCriteria):  # greedy only: stop when the generated tail loops
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([repetition_guard.find(row[len(prompt):].tolist()) is not None
                                     for row in input_ids], dtype=torch.bool)

        stopping = StoppingCriteriaList([_Guard()]) if repetition_guard is not None and beams == 1 else None
        want_margins = self.margins and beams == 1
        gen = self.model.generate(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=torch.tensor([prompt]),
                                  max_new_tokens=limit, do_sample=False, num_beams=beams,
                                  length_penalty=LENGTH_PENALTY, stopping_criteria=stopping,
                                  output_logits=want_margins, return_dict_in_generate=True)
        t3 = time.perf_counter()
        ids = [int(t) for t in gen.sequences[0, len(prompt):]]
        pad = int(self.model.generation_config.pad_token_id or -1)
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_ids), None)
        ids = ids[:end] if end is not None else [t for t in ids if t != pad]
        repetition = repetition_guard.find(ids) if repetition_guard is not None and end is None else None
        if end is not None:
            stop_reason = StopReason.EOS
        elif repetition is not None:
            ids, stop_reason = repetition_guard.trim(ids, repetition), StopReason.REPETITION
        else:
            stop_reason = StopReason.MAX_NEW_TOKENS
        decoding: dict = {"beams": beams, "repetition": repetition}
        if want_margins:
            logp = torch.log_softmax(torch.stack(gen.logits, dim=1)[0].float(), dim=-1)  # (steps, V)
            top2 = torch.topk(logp, 2, dim=-1).values
            decoding["margins"] = (top2[:, 0] - top2[:, 1])[: len(ids)].tolist()
        text = decode_ids(self.tokenizer, [t for t in ids if t not in self.eos_ids])
        steps = max(len(ids), 1)
        timings = {"features_s": t1 - t0, "encoder_s": t2 - t1, "encoder_function": "pytorch",
                   "prompt_s": 0.0, "decode_s": t3 - t2,  # generate(): prompt and steps together
                   "decoder_calls": steps, "ms_per_decoder_call": 1000.0 * (t3 - t2) / steps}
        duration_s = len(waveform) / self.front_end.sampling_rate
        words = None
        if word_timestamps:
            t4 = time.perf_counter()
            words = self.window_words(enc, prompt, [t for t in ids if t not in self.eos_ids], language=language,
                                      start_s=start_s, duration_s=duration_s)
            timings["align_s"] = time.perf_counter() - t4
        return WindowResult(index=index, start_s=start_s, duration_s=duration_s,
                            token_ids=ids, text=text, truncated=stop_reason.truncated, stop_reason=stop_reason,
                            timings=timings, decoding=decoding, words=words)

    def window_words(self, encoder_output, prompt: Sequence[int], tokens: Sequence[int], *, language: str | None,
                     start_s: float, duration_s: float) -> list[dict]:
        """One window's words from the reference attention (teacher-forced on prompt + tokens + eos)."""
        from ..model.alignment_reference import teacher_forced_attention

        if not tokens:
            return []
        tf = teacher_forced_attention(self.model, encoder_output, prompt, tokens, min(self.eos_ids))
        attention = np.stack([tf.attention[layer, head] for layer, head in self.alignment.heads])
        pieces = self.tokenizer.convert_ids_to_tokens([int(t) for t in tokens])
        return window_words(attention, len(prompt), pieces, tf.token_probabilities[: len(tokens)], self.alignment,
                            language=language, start_s=start_s, duration_s=duration_s)


# --------------------------------------------------------------------------------------------------
# Batch of files: check every file before any model loads; one bad file does not stop the others
# --------------------------------------------------------------------------------------------------


def transcribe_files(paths: Sequence[str | os.PathLike], make_engine, language: str, punctuation: bool = True,
                     progress: bool = False, **options) -> tuple[list[dict], bool]:
    """Check all files, load the engine (only if some file has speech), transcribe the good ones.

    Returns (one dict per path in order, any_failed). Each dict has "audio" and "status":
    "ok" (+ the result's fields), "silent" (text "", no model call) or "error" (+ "error").
    `make_engine()` is called at most once, after every file has been read and checked. A failed
    file is logged (error level, naming the file) here.
    """
    config = FrontEndConfig()  # checks only need the sample rate; every bundle and checkpoint here uses 16 kHz
    entries: list[dict] = []
    for path in paths:
        try:
            check = check_audio(path, config)
            entries.append({"audio": str(path), "status": check.status, "seconds": check.seconds})
        except AudioError as err:
            entries.append({"audio": str(path), "status": "error", "error": str(err)})
            logger.error("%s", err)
    engine = None
    for entry in entries:
        if entry["status"] == "silent":
            entry.update(TranscriptionResult.of_silence(language, punctuation,
                                                        bool(options.get("word_timestamps"))).to_dict())
            logger.warning("%s is digitally silent: empty transcript, no model call", entry["audio"])
            continue
        if entry["status"] != "ok":
            continue
        if engine is None:
            engine = make_engine()
        try:
            result = engine.transcribe(entry["audio"], language, punctuation, progress=progress, **options)
            entry.update(result.to_dict())
        except (AudioError, ValueError, RuntimeError) as err:
            if not type(err).__module__.startswith(__name__.split(".")[0]):  # the package's own errors
                raise
            entry.update(status="error", error=str(err))
            logger.error("%s: %s", entry["audio"], err)
    return entries, any(e["status"] == "error" for e in entries)

