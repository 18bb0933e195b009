"""Transcription loop: audio -> windows -> encoder package -> stateful decoder package -> text.

Per window (at most one `split_long_audio` piece, zero-padded to the encoder's window):

    features (cohere_coreml.model.audio.log_mel + pad_to_window, or the bundle's frontend.mlpackage)
      -> encoder.mlpackage : cross_k, cross_v, cross_mask, encoder_length
      -> a fresh decoder state holding that cross memory (once per window): the host writes it into the
         state (the default host-state decoder), or the package's bind_memory does (a graph-state one)
      -> the language prompt (and any forced prefix): `decoder_runtime.feed_plan` (one prefill call,
         extend calls of up to K tokens, or one step call per token)
      -> greedy: argmax(log_probs), feed it back (input_ids + position; the host-state decoder also gets
         its cache_mask and returns the token's K/V rows, written into the state), until eos or the capacity

A window that stops without eos (the cache is full, or `max_new_tokens` reached) is returned with
`truncated=True` (`decoding.StopReason`): the tokens are the exact prefix greedy decoding would
produce, never garbage. `Transcriber` is an `engines.Engine` (the interface `bench` and the CLI
run); `Transcriber.decode` returns a `decoding.DecodeResult`.
Window texts are joined as `CohereAsrProcessor.decode` joins chunks (no space for ja/zh).

Everything the loop needs (prompt ids, eos, capacity, window) is read from the bundle's
manifest; nothing comes from the Python-side checkpoint.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..bundle.format import BundleError
from ..bundle.load import Bundle
from ..cli_options import HelpFormatter, add_bundle_arg, add_decoder_batch_arg, add_decoding_args
from ..model.audio import AudioError, FrontEndConfig, check_waveform, log_mel, pad_to_window, valid_frames
from ..model.shapes import ShapeError, choose_bucket, choose_frontend_function
from ..model.tokens import check_language, decode_ids
from ..runtime import load_model
from . import streaming
from .batch_decoding import BatchDecoder, transcribe_batched
from .decoder_runtime import DecoderRuntime
from .decoding import DecodeResult, RepetitionGuard, StopReason, beam_search
from .encoder_runtime import EncoderRuntime
from .engines import Engine, TranscriptionResult, VadUnavailableError, WindowResult, check_vad_mode, transcribe_files
from .speech_regions import VadOptions, add_vad_args, vad_options_of
from .subtitles import DEFAULT_MAX_SECONDS, DEFAULT_MAX_WORDS, FORMATS, SUBTITLE_FORMATS, build_cues, write_subtitles
from .words import AlignmentSettings, WordTimingError, no_alignment_message, rounded, window_words, word_line

logger = logging.getLogger(__name__)

# Where a window's features come from: `audio.log_mel` ("python") or the bundle's frontend.mlpackage.
FRONT_ENDS = ("python", "package")
DEFAULT_FRONT_END = "python"


class TranscriptionError(RuntimeError):
    """The packages produced something the loop cannot use (missing outputs, bad shapes, NaN)."""


def no_vad_message(bundle: Bundle) -> str:
    return (f"bundle {','.join(str(d) for d in bundle.dirs)} has no vad.mlpackage: re-export with "
            "`cohere-coreml export --vad` (the default)")


def bundle_vad(bundle: Bundle, backend: str = "auto", compute_units: str = "all"):
    """The bundle's voice-activity model behind `inference.vad.SpeechProbabilities`, or None when its manifest
    has no `vad` entry: the one place a bundle's VAD is obtained (the Transcriber and the stream ask here)."""
    entry = bundle.manifest.get("vad")
    name = (bundle.manifest.get("files") or {}).get("vad")
    if not entry or not name:
        return None
    path = bundle.paths.get("vad") or next((d / name for d in bundle.dirs if (d / name).exists()), None)
    if path is None:
        raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, bundle.dirs))})")
    from .vad import vad_for

    # on the compute units its manifest entry names, as the front end (an fp32 program: CPU/GPU)
    return vad_for(bundle, backend=backend, compute_units=entry.get("compute_units", compute_units))


def _serialized(method):
    """Run a `Transcriber` method under the instance's lock (reentrant: transcribe -> transcribe_window)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        # setdefault (atomic) also covers instances built without __init__ (test doubles)
        with self.__dict__.setdefault("_lock", threading.RLock()):
            return method(self, *args, **kwargs)

    return run


class Transcriber(Engine):
    """Greedy transcription with a bundle's encoder + decoder packages, through the runtime interface:
    the bundle `engines.Engine` (Core ML on macOS, the MIL interpreter elsewhere).

    Args:
        bundle: bundle folder (or several folders searched in order) with manifest.json, or a `Bundle`.
        backend: runtime backend: "auto" (Core ML on macOS, the MIL interpreter elsewhere),
            "coreml" or "mil".
        use_prefill: feed the prompt in one call when the decoder package has a prefill function.
        use_extend: feed forced prefixes (a prompt other than prefill's, a streaming partial's confirmed
            tokens) K tokens per call when the decoder package has an extend function.
        front_end: "python" (`audio.log_mel`, the default) or "package" (the bundle's
            frontend.mlpackage turns each window's samples into features).
        compute_units: Core ML compute units of the encoder and decoder ("all", "cpu_only",
            "cpu_and_gpu", "cpu_and_ne"); the front end runs on the units its manifest entry names.
            Ignored by the interpreter.
        decoder_batch: windows decoded at once when a clip has several (greedy, without word timings): None
            (default) the bundle's batched step (`decoder.batch.size`; 1 when it has none), 1 one window at a
            time, or exactly the bundle's size (`batch_decoding.decode_windows`, docs/decoder.md).
        encoder_ahead: with a batched decode, windows a worker thread encodes while the rows decode
            (`batch_decoding.encoded_ahead`): None (default) `decoder_batch`, 0 none. The same tokens either way.
        load_encoder: load the encoder's programs now (default); False: on the first `encode` (a caller
            that encodes elsewhere, e.g. one encoder part at a time, and decodes here: `encoder` is None).

    Thread safety: one `Transcriber` may be shared by threads; its calls (`transcribe`,
    `transcribe_window`, `encode`, `decode`) run one at a time under an internal lock (each window has its
    own decoder state, but lazily loaded functions and a Core ML model's prediction queue are shared).
    For parallel transcription use one `Transcriber` per thread.
    """

    kind = "bundle"

    def __init__(self, bundle: str | os.PathLike | Sequence[str | os.PathLike] | Bundle, backend: str = "auto",
                 use_prefill: bool = True, front_end: str = DEFAULT_FRONT_END, compute_units: str = "all",
                 use_extend: bool = True, decoder_batch: int | None = None, load_encoder: bool = True,
                 encoder_ahead: int | None = None):
        # transformers is imported here, not at module level: it costs seconds, and the CLI imports
        # this module for every command
        from transformers import PreTrainedTokenizerFast  # heavy (see above)

        if front_end not in FRONT_ENDS:
            raise TranscriptionError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
        self.backend = backend
        self.compute_units = compute_units
        m = self.bundle.manifest
        self.front_end = FrontEndConfig.from_dict({**m["audio"], "dither": 0.0})
        try:
            self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.bundle.paths["tokenizer_dir"]))
        except (OSError, ValueError) as err:
            raise BundleError(f"cannot load the bundle's tokenizer: {err}") from err
        t0 = time.perf_counter()
        # length buckets (multifunction encoder): {function name: window frames}, smallest first
        self.encoders = EncoderRuntime.from_bundle(self.bundle, backend=backend, compute_units=compute_units)
        # load_encoder False: its programs load on first use (a caller that encodes elsewhere, one part at a time)
        self.encoder = self.encoders.model("main") if load_encoder else None
        self.encoder_buckets = self.encoders.buckets
        # the step (+ prefill, extend; bind_memory in a graph-state package) of decoder.mlpackage, one state per window
        self.decoder = DecoderRuntime.load(self.bundle.paths["decoder"], backend=backend, compute_units=compute_units,
                                           prefill=use_prefill, extend=use_extend)
        self.prefill = self.decoder.prefill_model  # None without a (used) prefill function
        self.prefill_length = self.decoder.prefill_length
        self.front_end_kind = front_end
        self._frontends: dict = {}  # front-end function name -> loaded model (loaded on first use)
        has_frontend = "frontend" in self.bundle.paths and bool(m.get("frontend"))
        self.frontend_functions = m["frontend"]["functions"] if has_frontend else None
        if front_end == "package":
            if not has_frontend:
                raise BundleError("the bundle has no frontend.mlpackage (re-export it: `cohere-coreml export` writes it "
                                  "by default) or use front_end='python'")
            self._frontends["main"] = self._load_frontend("main")
        self.load_s = time.perf_counter() - t0
        self.decoder_batch = self._check_batch(decoder_batch)
        if encoder_ahead is not None and int(encoder_ahead) < 0:
            raise TranscriptionError(f"--encoder-ahead must be >= 0, got {encoder_ahead}")
        self.encoder_ahead = self.decoder_batch if encoder_ahead is None else int(encoder_ahead)
        self._batch_decoder = None  # the batched step, loaded on the first clip of several windows
        self.capacity = self.bundle.capacity
        self.window_frames = self.bundle.window_frames
        self.eos_ids = self.bundle.eos_ids
        self.name = ",".join(str(d) for d in self.bundle.dirs)
        self._vad = None  # the bundle's VAD, loaded on first use (`speech_probabilities`)
        self._lock = threading.RLock()  # calls run one at a time (see the class docstring)

    def _check_batch(self, asked: int | None) -> int:
        """Windows a batched decode takes: the bundle's batched step's rows (`decoder.batch.size`), or 1."""
        present = int(((self.bundle.manifest.get("decoder") or {}).get("batch") or {}).get("size") or 1)
        if asked is None:
            return present
        if int(asked) == 1 or int(asked) == present:
            return int(asked)
        if present == 1:
            raise TranscriptionError(f"--decoder-batch {asked}: the bundle's decoder has no batched step; re-export it "
                                     f"with `cohere-coreml export --decoder-batch {asked}` or use --decoder-batch 1")
        raise TranscriptionError(f"--decoder-batch {asked}: the bundle's decoder decodes {present} windows at once "
                                 f"(decoder.batch.size); use --decoder-batch {present} or 1")

    def batch_decoder(self) -> BatchDecoder:
        """The decoder package's batched step (loaded on first use: a device compiles a function on its first load)."""
        if self.__dict__.get("_batch_decoder") is None:
            self._batch_decoder = BatchDecoder.load(self.bundle.paths["decoder"], backend=self.backend,
                                                    compute_units=self.compute_units)
        return self._batch_decoder

    # -- the Engine interface -------------------------------------------------------------------
    def prompt(self, language: str, punctuation: bool = True) -> list[int]:
        """The bundle's prompt ids for `language` (raises `UnknownLanguageError`)."""
        return self.bundle.prompt(language, punctuation)

    def speech_probabilities(self, vad: str = "auto"):
        """The bundle's VAD (`bundle_vad`) for `vad` "on" or "auto", None for "off" or ("auto") a bundle
        without one; "on" with a bundle without one raises `VadUnavailableError` naming the fix."""
        if check_vad_mode(vad) == "off":
            return None
        if self.__dict__.get("_vad") is None:
            self._vad = bundle_vad(self.bundle, self.backend, self.compute_units)
        if self._vad is None and vad == "on":
            raise VadUnavailableError(no_vad_message(self.bundle))
        return self._vad

    def window_s(self) -> float:
        """The encoder's window in seconds: audio.max_audio_clip_s, or less when the encoder's frames hold less
        (valid frames = samples // hop)."""
        fe = self.front_end
        return min(float(fe.max_audio_clip_s), int(self.window_frames) * fe.hop_length / fe.sampling_rate)

    @property
    def alignment(self) -> dict | None:
        """The manifest's `decoder.alignment` block (heads, lead_rows, frame_seconds, ...), None without one."""
        return (self.bundle.manifest.get("decoder") or {}).get("alignment")

    def check_word_timestamps(self) -> AlignmentSettings:
        """The alignment settings, or WordTimingError naming why this bundle has none and the fix."""
        if self.alignment is None:
            raise WordTimingError(no_alignment_message(self.bundle.manifest))
        return AlignmentSettings.from_manifest(self.alignment)

    def describe(self) -> dict:
        m = self.bundle.manifest
        backend = self.decoder.backend
        return {**super().describe(), "backend": backend,
                "compute_units": self.compute_units if backend == "coreml" else None,
                "precision": m.get("precision"), "model_id": m.get("model_id"), "capacity": self.capacity,
                "prefill": self.prefill is not None, "extend": self.decoder.extend_model is not None,
                "decoder_batch": self.decoder_batch, "encoder_ahead": self.__dict__.get("encoder_ahead", 0)}

    # -- one window -----------------------------------------------------------------------------
    def _load_frontend(self, function_name: str):
        """One function of frontend.mlpackage, on the compute units its manifest entry names."""
        units = self.bundle.manifest["frontend"].get("compute_units", "cpu_and_gpu")
        return load_model(str(self.bundle.paths["frontend"]), backend=self.backend, function_name=function_name,
                          compute_units=units)

    def package_features(self, waveform: np.ndarray) -> tuple[np.ndarray, int, str]:
        """(features (1, M, F), valid frames, encoder function) of one clip from frontend.mlpackage.

        The encoder function is chosen as with the Python front end (smallest window holding the valid
        frames); the front-end function is the smallest whose window holds the samples and those
        frames, its features cut to the encoder's F (frames beyond the valid ones are zero).
        """
        if not self.frontend_functions:
            raise BundleError("the bundle has no frontend.mlpackage")
        x = np.asarray(waveform, dtype=np.float32).reshape(-1)
        check_waveform(x)
        n_valid = valid_frames(x.shape[0], self.front_end)
        if n_valid < 2:  # the same refusal as log_mel
            raise AudioError(f"audio is too short: {x.shape[0]} samples give {max(n_valid, 0)} feature frame(s); "
                             f"at least {2 * self.front_end.hop_length} samples are needed")
        encoder_function = choose_bucket(self.encoder_buckets, n_valid)  # WindowTooLongError past every window
        frames = self.encoder_buckets[encoder_function]
        try:
            fn = choose_frontend_function(self.frontend_functions, x.shape[0], min_frames=frames)
        except ShapeError as err:
            raise AudioError(str(err)) from err
        if fn not in self._frontends:
            self._frontends[fn] = self._load_frontend(fn)
        samples = int(self.frontend_functions[fn]["samples"])
        audio = np.zeros((1, samples), dtype=np.float32)
        audio[0, : x.shape[0]] = x
        out = self._frontends[fn].predict({"audio": audio, "audio_length": np.array([x.shape[0]], dtype=np.int32)})
        feats = np.asarray(out["input_features"], dtype=np.float32)
        got = int(np.asarray(out["feature_length"]).reshape(-1)[0])
        if got != n_valid or feats.ndim != 3 or feats.shape[-1] < frames:
            raise TranscriptionError(f"front-end package returned {got} valid frames of shape {feats.shape}; "
                                     f"expected {n_valid} of (1, M, >= {frames})")
        return feats[:, :, :frames], n_valid, encoder_function

    @_serialized
    def encode(self, features: np.ndarray, n_valid: int) -> dict[str, np.ndarray]:
        """features (M, F) or (1, M, F) float32 window -> encoder outputs.

        F selects the encoder function (the full window, or a length bucket of exactly that many frames).
        """
        return self.encoders.encode(features, n_valid)

    @_serialized
    def decode(self, encoder_out: dict[str, np.ndarray], prompt: Sequence[int], max_new_tokens: int | None = None,
               return_log_probs: bool = False, beams: int = 1,
               repetition_guard: RepetitionGuard | None = None, draft: Sequence[int] = (),
               token_scores: bool = False, keep_state: bool = False) -> DecodeResult:
        """Greedy (or, with `beams` > 1, beam search) decode of one window from its encoder outputs.

        `repetition_guard` stops a looping window (StopReason.REPETITION, the loop kept once).
        `draft` (greedy, with the decoder's extend function): tokens the decode is expected to emit (a
        streaming partial's previous hypothesis after its confirmed tokens). They are fed with the
        prompt by extend calls and verified, never forced: a drafted token is kept only where the
        prediction before it is that token (so the tokens are greedy's); at the first prediction that
        differs, the rest of the draft (after the replaced token) is fed again with it in one extend call
        and verified the same way (once in a row: a re-draft refused at its first token ends the draft);
        without draft left, one step per token (the Swift package's
        `decode(cross:prompt:maxNewTokens:draft:)` does the same).
        Returns a `decoding.DecodeResult`: token_ids, stop_reason, truncated, bind_s, prompt_s,
        decode_s, steps, calls, repetition, and log_probs (one (V,) array per decoder call) when
        `return_log_probs` (greedy only). `token_scores`: also each generated token's log-prob at the call
        that chose it (greedy step, prefill / extend row, beam search's best hypothesis), what word
        confidences are made of (`token_log_probs`); `keep_state`: the window's state after decoding
        (`state`: its cross memory is still bound, what `DecoderRuntime.align` reads).
        """
        if beams < 1:
            raise TranscriptionError(f"beams must be >= 1, got {beams}")
        prompt = [int(t) for t in prompt]
        if len(prompt) >= self.capacity:
            raise TranscriptionError(f"prompt of {len(prompt)} tokens does not fit the cache ({self.capacity} slots)")
        # every fed token takes one slot; the last prediction is emitted without being fed
        limit = self.capacity - len(prompt) + 1
        reason_at_limit = StopReason.CAPACITY
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise TranscriptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
            if max_new_tokens < limit:
                limit, reason_at_limit = int(max_new_tokens), StopReason.MAX_NEW_TOKENS
        t_bind = time.perf_counter()
        state = self.decoder.new_state(encoder_out)  # the window's cross memory into a fresh state, once
        all_log_probs = []

        def step(token: int, position: int, beam_state=None) -> np.ndarray:
            lp = self.decoder.step(state if beam_state is None else beam_state, token, position)
            if return_log_probs:
                all_log_probs.append(lp.astype(np.float32))
            return lp

        extend_len = self.decoder.extend_length
        draft = [int(t) for t in draft][: max(0, limit - 1)] if beams == 1 and extend_len else []
        if draft and return_log_probs:
            raise TranscriptionError("return_log_probs gives one row per call: decode without a draft")
        t0 = time.perf_counter()
        # prefill, extend calls or steps (feed_plan); the rows after the prompt's last token on are read
        fed = self.decoder.feed(state, prompt + draft, rows_from=len(prompt) - 1)
        calls, tokens_fed = fed.calls, fed.tokens_fed
        pending = fed.after[len(prompt) - 1:]  # after the prompt's last token, then after each draft token
        log_probs = pending[0]
        if return_log_probs:
            all_log_probs.extend(row.astype(np.float32) for row in fed.rows)
        t1 = time.perf_counter()
        generated: list[int] = []
        scores: list[float] | None = [] if token_scores else None  # log-prob of each generated token
        position = len(prompt)
        redrafted = False  # the current draft was fed after a refused token and none of it is verified yet
        stop_reason = None
        repetition = None
        if beams > 1:
            searched = beam_search(step, self.decoder, state, log_probs, position, limit, reason_at_limit,
                                   self.eos_ids, beams, guard=repetition_guard, track_tokens=token_scores)
            generated, stop_reason, repetition = searched["token_ids"], searched["stop_reason"], searched["repetition"]
            scores = searched["token_log_probs"]
            position, calls = searched["steps"], calls + searched["calls"]
            tokens_fed += searched["calls"]
            if keep_state:
                # the beams share and copy states, so `state` holds some beam's tokens, not necessarily the
                # best's: the best's prompt + text tokens are fed into a fresh state (what the align function reads)
                text = [t for t in generated if t not in self.eos_ids][: self.capacity - len(prompt)]
                state = self.decoder.new_state(encoder_out)
                self.decoder.feed(state, list(prompt) + text)
        while beams == 1:
            if not np.all(np.isfinite(log_probs)):
                raise TranscriptionError(f"decoder produced non-finite log-probs at position {position - 1}")
            token = int(np.argmax(log_probs))
            generated.append(token)
            if scores is not None:
                scores.append(float(log_probs[token]))
            if token in self.eos_ids:
                stop_reason = StopReason.EOS
                break
            repetition = repetition_guard.find(generated) if repetition_guard is not None else None
            if repetition is not None:
                generated, stop_reason = repetition_guard.trim(generated, repetition), StopReason.REPETITION
                scores = scores[: len(generated)] if scores is not None else None
                break
            if len(generated) >= limit:
                stop_reason = reason_at_limit
                break
            if draft and token == draft[0]:  # drafted: already fed at `position`
                draft, pending, redrafted = draft[1:], pending[1:], False
                log_probs = pending[0]
                position += 1
                continue
            # the draft after the replaced token, unless a re-draft was refused at once (then it is off track)
            rest = draft[1:][: min(extend_len - 1, limit - len(generated) - 1)] if draft and not redrafted else []
            if rest and position + extend_len <= self.capacity:
                fed = self.decoder.feed(state, [token] + rest, start=position)  # one extend call
                calls, tokens_fed = calls + fed.calls, tokens_fed + fed.tokens_fed
                draft, pending, redrafted = rest, fed.after, True
                log_probs = pending[0]
                position += 1
                continue
            draft = []
            log_probs = step(token, position)
            position += 1
            calls += 1
            tokens_fed += 1
        t2 = time.perf_counter()
        return DecodeResult(token_ids=generated, stop_reason=StopReason(stop_reason), bind_s=t0 - t_bind,
                            prompt_s=t1 - t0, decode_s=t2 - t1, steps=position, calls=calls, tokens_fed=tokens_fed,
                            repetition=repetition, log_probs=all_log_probs if return_log_probs else None,
                            token_log_probs=scores, state=state if keep_state else None)

    @_serialized
    def features(self, waveform: np.ndarray) -> tuple[np.ndarray, int, str]:
        """(features (1, M, F) padded to the smallest encoder window holding them, valid frames, its function) of one
        window's samples, by the front end (Python or the bundle's package); `WindowTooLongError` past every window."""
        if self.front_end_kind == "package":
            return self.package_features(waveform)
        feats, n_valid = log_mel(waveform, self.front_end)
        encoder_function = choose_bucket(self.encoder_buckets, n_valid)
        feats, n_valid = pad_to_window(feats, n_valid, frames=self.encoder_buckets[encoder_function])
        return feats[None], n_valid, encoder_function

    def transcribe_window(self, waveform: np.ndarray, prompt: Sequence[int], max_new_tokens: int | None = None,
                          index: int = 0, start_s: float = 0.0, beams: int = 1,
                          repetition_guard: RepetitionGuard | None = None, word_timestamps: bool = False,
                          language: str | None = None) -> WindowResult:
        """One window (at most one `split_long_audio` piece): features -> encoder -> decode -> text; with
        `word_timestamps`, its words (`window_words`; `language`: ja / zh give a word per character)."""
        settings = self.check_word_timestamps() if word_timestamps else None
        t0 = time.perf_counter()
        feats, n_valid, encoder_function = self.features(waveform)
        t1 = time.perf_counter()
        enc = self.encode(feats, n_valid)
        t2 = time.perf_counter()
        dec = self.decode(enc, prompt, max_new_tokens, beams=beams, repetition_guard=repetition_guard,
                          token_scores=word_timestamps, keep_state=word_timestamps)
        text = decode_ids(self.tokenizer, [t for t in dec.token_ids if t not in self.eos_ids])
        timings = {
            "features_s": t1 - t0,
            "front_end": self.front_end_kind,
            "encoder_s": t2 - t1,
            "encoder_function": encoder_function,
            "bind_s": dec.bind_s,
            "prompt_s": dec.prompt_s,
            "decode_s": dec.decode_s,
            "decoder_calls": dec.calls,
            "decoder_tokens_fed": dec.tokens_fed,
            "ms_per_decoder_call": 1000.0 * (dec.prompt_s + dec.decode_s) / max(dec.calls, 1),
        }
        sr = self.front_end.sampling_rate
        if dec.truncated:
            logger.warning("window %d stopped without eos (%s) after %d tokens", index, dec.stop_reason,
                           len(dec.token_ids))
        words = None
        if settings is not None:
            t3 = time.perf_counter()
            words = self.window_words(dec, enc, prompt, settings, language=language, start_s=start_s,
                                      duration_s=len(waveform) / sr)
            timings["align_s"] = time.perf_counter() - t3
        return WindowResult(index=index, start_s=start_s, duration_s=len(waveform) / sr, token_ids=dec.token_ids,
                            text=text, truncated=dec.truncated, stop_reason=dec.stop_reason, timings=timings,
                            decoding={"beams": beams, "repetition": dec.repetition}, words=words)

    def window_words(self, dec: DecodeResult, encoder_out: dict, prompt: Sequence[int], settings: AlignmentSettings,
                     *, language: str | None, start_s: float, duration_s: float) -> list[dict]:
        """One decoded window's words (`words.window_words`): the decoder's align function on the window's
        state (`dec.state`, its cross memory still bound) over prompt + text tokens, cut to the valid encoder
        frames; each token's probability is the one decoding chose it with (`dec.token_log_probs`).

        The align function reads the window's decoded self cache (`DecoderRuntime.align`): the state must hold
        prompt + text tokens at their slots, so only the tokens that had a slot are aligned (a window cut by the
        cache, no eos and every slot used, leaves its last token and with it its word out)."""
        kept = [(int(t), lp) for t, lp in zip(dec.token_ids, dec.token_log_probs) if t not in self.eos_ids]
        room = self.capacity - len(prompt)
        if len(kept) > room:
            logger.warning("window stopped at the cache: its last %d token(s) get no word timing", len(kept) - room)
            kept = kept[: max(room, 0)]
        if not kept:
            return []
        ids = [t for t, _ in kept]
        lead_rows = settings.lead_rows
        weights = np.asarray(self.decoder.align(dec.state, list(prompt) + ids,
                                                 rows_from=len(prompt) - 1 - lead_rows), dtype=np.float32)
        frames = int(np.asarray(encoder_out["encoder_length"]).reshape(-1)[0])
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        return window_words(weights[..., :frames], len(prompt), pieces, [float(np.exp(lp)) for _, lp in kept],
                            settings, language=language, start_s=start_s, duration_s=duration_s)

    # -- several windows at once ----------------------------------------------------------------
    def transcribe_pieces(self, pieces, prompt: Sequence[int], **options) -> list[WindowResult]:
        """A clip's windows: decoded `decoder_batch` at a time (`decode_windows`) when the clip has more than one
        window, the bundle a batched step and the decode is greedy without word timings (beam search and word
        timings decode one window at a time); otherwise one `transcribe_window` each. Per window the same tokens."""
        batched = (self.__dict__.get("decoder_batch", 1) > 1 and options.get("beams", 1) == 1
                   and not options.get("word_timestamps"))
        if not batched:
            return super().transcribe_pieces(pieces, prompt, **options)
        pieces = iter(pieces)
        first = list(itertools.islice(pieces, 2))
        if len(first) < 2:
            return super().transcribe_pieces(first, prompt, **options)
        return self.transcribe_batched(itertools.chain(first, pieces), prompt, max_new_tokens=options.get(
            "max_new_tokens"), repetition_guard=options.get("repetition_guard"))

    @_serialized
    def transcribe_batched(self, pieces, prompt: Sequence[int], max_new_tokens: int | None = None,
                           repetition_guard: RepetitionGuard | None = None) -> list[WindowResult]:
        """Windows ((start, end, samples) pieces) decoded `decoder_batch` at a time (`batch_decoding.transcribe_batched`:
        their features and encoder `encoder_ahead` windows ahead in a worker), its results as `transcribe_window`'s."""
        if max_new_tokens is not None and max_new_tokens < 1:
            raise TranscriptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) >= self.capacity:
            raise TranscriptionError(f"prompt of {len(prompt)} tokens does not fit the cache ({self.capacity} slots)")
        unlocked = functools.partial(Transcriber.features.__wrapped__, self)  # the worker's: this call holds the lock
        return transcribe_batched(self, self.batch_decoder(), pieces, prompt, max_new_tokens, repetition_guard,
                                  self.__dict__.get("encoder_ahead", 0), unlocked, self.encoders.encode)

    # -- whole clips ----------------------------------------------------------------------------
    @_serialized
    def transcribe(self, audio, language: str = "en", punctuation: bool = True, *,
                   max_new_tokens: int | None = None, beams: int = 1, repetition_guard: RepetitionGuard | None = None,
                   progress: bool = False, word_timestamps: bool = False, vad: str = "auto",
                   vad_options: VadOptions | None = None) -> TranscriptionResult:
        """Transcribe a file path (streamed window by window) or a float32 mono array at the bundle's
        sample rate: `engines.Engine.transcribe` (shared with `cohere-coreml transcribe` and `bench`),
        here under the instance's lock. Digital silence gives an empty transcript marked `silent` (no
        model call); empty or NaN/inf audio raises `AudioError`. `word_timestamps`: each window's words
        (`TranscriptionResult.words`); a bundle without alignment raises `WordTimingError` (one line, the fix).
        `vad`: "auto" (the bundle's vad.mlpackage when it has one), "on" (a bundle without one: one line naming
        the fix) or "off"; `vad_options`: the speech-region rule's options (docs/vad.md)."""
        if word_timestamps:
            self.check_word_timestamps()
        return super().transcribe(audio, language, punctuation, max_new_tokens=max_new_tokens, beams=beams,
                                  repetition_guard=repetition_guard, progress=progress,
                                  word_timestamps=word_timestamps, vad=vad, vad_options=vad_options)

    def stream(self, language: str = "en", punctuation: bool = True, config: streaming.StreamConfig | None = None,
               max_new_tokens: int | None = None, word_timestamps: bool = False, vad: str = "auto",
               vad_options: VadOptions | None = None) -> streaming.StreamingSession:
        """A live-transcription session: `feed(samples) -> [Update]`, then `finish()` (docs/streaming.md);
        `word_timestamps`: the finals carry their words on the stream's timeline; `vad`: segments from the
        bundle's voice-activity model ("auto": when it has one) instead of frame energy (docs/vad.md)."""
        return streaming.StreamingSession(self, language, punctuation, config, max_new_tokens,
                                          word_timestamps=word_timestamps, vad=vad, vad_options=vad_options)


# --------------------------------------------------------------------------------------------
# `cohere-coreml transcribe` (registered by cli.py)
# --------------------------------------------------------------------------------------------


def cmd_transcribe(args) -> int:
    """Every file is read and checked before the bundle loads; silent files give an empty transcript
    (no model call); a bad file is reported on stderr (never on stdout) and the others are still
    transcribed; the exit status is 1 when any file failed.

    stdout holds results only: in text mode each transcript (after a `== FILE` line when several files
    are given; with --word-timestamps one `[start-end] word (probability)` line per word after it), with
    --json / --format json one object per transcribed file (an object for one input file, a list for
    several; a failed file has no entry), with --format srt / vtt the subtitles (after a `== FILE` line
    when several files are given)."""
    check_language(args.language)
    fmt = output_format(args)
    words = args.word_timestamps or fmt in SUBTITLE_FORMATS
    build_cues([], args.language, args.max_words_per_cue, args.max_cue_seconds)  # the cue limits, checked early
    args.vad_options = vad_options_of(args)  # bad --vad-* values: one line, before any audio

    def make_transcriber() -> Transcriber:
        tr = Transcriber(args.bundle, backend=args.backend, use_prefill=not args.no_prefill,
                         use_extend=not args.no_extend, front_end=args.front_end, compute_units=args.compute_units,
                         decoder_batch=args.decoder_batch, encoder_ahead=args.encoder_ahead)
        if words:
            tr.check_word_timestamps()  # a bundle without alignment: one line naming the fix, before any audio
        tr.speech_probabilities(args.vad)  # --vad on with a bundle without vad.mlpackage: one line, the fix
        return tr

    if args.stream:
        if args.beams != 1 or args.repetition_guard:
            raise TranscriptionError("--stream decodes greedily: --beams and --repetition-guard do not apply")
        if fmt in SUBTITLE_FORMATS:
            raise TranscriptionError(f"--format {fmt} writes a whole file's subtitles: drop --stream (its finals "
                                     "carry words with --stream --json --word-timestamps)")
        args.json, args.word_timestamps = fmt == "json", words
        return streaming.run_cli(args, make_transcriber)
    if args.beams < 1:
        raise TranscriptionError(f"--beams must be >= 1, got {args.beams}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise TranscriptionError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    entries, failed = transcribe_files(
        args.audio, make_transcriber, args.language, punctuation=not args.no_punctuation, progress=fmt == "text",
        max_new_tokens=args.max_new_tokens, beams=args.beams,
        repetition_guard=RepetitionGuard() if args.repetition_guard else None, word_timestamps=words,
        vad=args.vad, vad_options=args.vad_options)
    results = [e for e in entries if e["status"] != "error"]  # failures: logged on stderr by transcribe_files
    for entry in results:
        if "words" in entry:  # printed: seconds and probabilities to the millisecond / 3 decimals
            entry["words"] = rounded(entry["words"])
            for w in entry["windows"]:
                w["words"] = rounded(w["words"])
    if fmt == "json":
        if len(args.audio) > 1 or results:
            print(json.dumps(results if len(args.audio) > 1 else results[0], indent=2, ensure_ascii=False))
        return 1 if failed else 0
    if fmt in SUBTITLE_FORMATS:
        for entry in results:
            if len(args.audio) > 1:
                print(f"== {entry['audio']}")
            print(write_subtitles(fmt, entry["words"], args.language, args.max_words_per_cue, args.max_cue_seconds),
                  end="")
        return 1 if failed else 0
    for entry in results:
        if len(args.audio) > 1:
            print(f"== {entry['audio']}")
        if entry["status"] == "silent":
            print("(silent)")
            continue
        print(entry["text"])
        for w in entry.get("words") or ():
            print(word_line(w))
        if entry.get("vad"):
            v = entry["vad"]
            logger.info("vad: %d window(s), %.1f s of %.1f s decoded (%.0f %%)", v["windows"], v["decoded_s"],
                        v["audio_s"], 100 * v["decoded_share"])
        for w in entry["windows"]:
            t = w["timings"]
            flag = f"  STOPPED ({w['stop_reason']})" if w["truncated"] else ""
            logger.info("window %d (%.1f-%.1f s): %d tokens, encoder %.2f s, decoder %d calls %.1f ms/call%s",
                        w["index"], w["start_s"], w["start_s"] + w["duration_s"], len(w["token_ids"]),
                        t["encoder_s"], t["decoder_calls"], t["ms_per_decoder_call"], flag)
    if failed:
        logger.error("%d of %d file(s) failed (named above)", len(entries) - len(results), len(entries))
    return 1 if failed else 0


def output_format(args) -> str:
    """--format, with --json its alias (`--json --format srt` is refused: two formats)."""
    fmt = getattr(args, "format", None)
    if args.json and fmt not in (None, "json"):
        raise TranscriptionError(f"--json and --format {fmt} ask for two formats: keep one")
    return "json" if args.json else fmt or "text"


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "transcribe",
        help="transcribe audio with an exported bundle (encoder + decoder packages)",
        description="Transcription (greedy, or --beams N) with an export folder written by `cohere-coreml export` "
        "(encoder.mlpackage, decoder.mlpackage, manifest.json, tokenizer). Audio longer than 30 s is "
        "split into windows as the reference processor splits it, read from the file window by window. "
        "Every file is checked before the bundle loads: a digitally silent file gives an empty transcript "
        "(no model call), a bad file is named on stderr and the others are still transcribed (exit status 1). "
        "stdout holds the transcripts only. Runs Core ML on macOS and the project's MIL interpreter elsewhere "
        "(--backend).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("audio", nargs="+", help="audio file(s) (wav, flac, ...); resampled to 16 kHz mono")
    add_bundle_arg(p)
    p.add_argument("--language", required=True, help="language code: ar de el en es fr it ja ko nl pl pt vi zh")
    p.add_argument("--no-punctuation", action="store_true", help="prompt with <|nopnc|> (no punctuation/casing)")
    p.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"),
                   help="auto: Core ML when available, else the MIL interpreter (default: %(default)s)")
    p.add_argument("--no-prefill", action="store_true",
                   help="feed the prompt token by token even if the decoder package has a prefill function")
    p.add_argument("--no-extend", action="store_true",
                   help="feed forced prefixes token by token even if the decoder package has an extend function")
    p.add_argument("--front-end", default=DEFAULT_FRONT_END, choices=FRONT_ENDS,
                   help="python: features from cohere_coreml.model.audio.log_mel; package: from the bundle's "
                   "frontend.mlpackage (default: %(default)s)")
    add_decoding_args(p)
    add_vad_args(p)
    p.add_argument("--compute-units", default="all", choices=("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"),
                   help="Core ML compute units (macOS; ignored by the interpreter) (default: %(default)s)")
    add_decoder_batch_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON: text, token ids, timings, truncation per window "
                   "(with --stream: one JSON line per update); the same as --format json")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="text: the transcript; json: as --json; srt / vtt: subtitles from word timings (cues of "
                   "--max-words-per-cue words / --max-cue-seconds at most; needs a bundle with alignment) "
                   "(default: text)")
    p.add_argument("--word-timestamps", action="store_true",
                   help="each word's start, end (seconds on the audio's timeline) and probability (docs/word-timings.md): "
                   "in JSON a `words` list, in text one `[start-end] word (probability)` line per word; with --stream "
                   "the finals carry them. Needs a bundle exported with alignment heads")
    p.add_argument("--max-words-per-cue", type=int, default=DEFAULT_MAX_WORDS,
                   help="srt / vtt: at most N words per cue (default: %(default)s)")
    p.add_argument("--max-cue-seconds", type=float, default=DEFAULT_MAX_SECONDS,
                   help="srt / vtt: at most S seconds per cue, a longer word whole in its own cue (default: %(default)s)")
    p.add_argument("--stream", action="store_true",
                   help="live transcription (docs/streaming.md): the file fed in 0.1 s chunks, partial and final "
                   "updates while it arrives")
    p.add_argument("--no-pace", action="store_true",
                   help="with --stream: feed the file as fast as possible instead of at real time")
    p.add_argument("--stats", action="store_true",
                   help="with --stream: after each file, one JSON line of compute counters on stderr (encoder calls / "
                   "frames, decoder calls / tokens fed, per audio second); stdout is unchanged")
    p.add_argument("--hop", type=float, default=streaming.StreamConfig.hop_s,
                   help="with --stream: seconds of new audio between partial decodes (default: %(default)s)")
    p.set_defaults(func=cmd_transcribe)
