"""Manifest value checks (`Bundle.load`): every field the loop reads, typed, in range, and consistent
with the other fields and with the manifest's io blocks (which `cohere_coreml.bundle.package_checks`
compares with the packages themselves). Each failure is a `BundleError` naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from ..config import (
    ALIGN_FUNCTION,
    ALIGN_OUTPUT,
    BIND_INPUT_PREFIX,
    BIND_OUTPUT,
    CACHE_MASK_INPUT,
    DECODER_STATE_GRAPH,
    DECODER_STATE_HOST,
    DECODER_STATES,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    VAD_BLOCK_FUNCTION,
    VAD_CHUNK_FUNCTION,
)
from ..model.shapes import LengthMasks
from ..model.tokens import (
    BOS_TOKEN,
    EOS_TOKEN,
    LANGUAGES,
    NO_SPACE_LANGUAGES,
    PAD_TOKEN,
    UnknownLanguageError,
    prompt_tokens,
)
from .format import COMPUTE_UNITS, FORMAT_VERSION, IO_DTYPES, MAX_DIM, PRECISIONS, BundleError
from .packages import encoder_part_key

_MISSING = object()


class _Fields:
    """Typed reads of manifest fields by dotted path; every failure is a BundleError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str):
        raise BundleError(f"{self.where}: field '{field}' {problem}")

    def get(self, obj: dict, key: str, path: str, optional: bool = False):
        value = obj.get(key, _MISSING)
        if value is _MISSING or (optional and value is None):
            if optional:
                return None
            self.fail(path, "is missing")
        return value

    def obj(self, obj: dict, key: str, path: str, optional: bool = False) -> dict | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            self.fail(path, f"must be an object, got {show_value(value)}")
        return value

    def int(self, obj: dict, key: str, path: str, lo: int = 0, hi: int = MAX_DIM, optional: bool = False) -> int | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {show_value(value)}")
        if not lo <= value <= hi:
            self.fail(path, f"is {value}, outside [{lo}, {hi}]")
        return value

    def num(self, obj: dict, key: str, path: str, lo: float, hi: float, lo_open: bool = False,
            hi_open: bool = False, optional: bool = False) -> float | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(path, f"must be a finite number, got {show_value(value)}")
        if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
            self.fail(path, f"is {value}, outside {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")
        return float(value)

    def str(self, obj: dict, key: str, path: str, choices: Sequence[str] | None = None,
            optional: bool = False) -> str | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            self.fail(path, f"must be a non-empty string, got {show_value(value)}")
        if choices is not None and value not in choices:
            self.fail(path, f"is {value!r}, not one of {list(choices)}")
        return value

    def ints(self, obj: dict, key: str, path: str, lo: int = 0, hi: int = MAX_DIM, optional: bool = False):
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list):
            self.fail(path, f"must be a list of integers, got {show_value(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                self.fail(f"{path}[{i}]", f"must be an integer in [{lo}, {hi}], got {show_value(item)}")
        return value

    def io(self, obj: dict, key: str, path: str, optional: bool = False) -> dict | None:
        """An io block {"inputs"|"outputs"|"states": {name: {"shape": [int], "dtype": str}}}."""
        block = self.obj(obj, key, path, optional)
        if block is None:
            return None
        for kind in ("inputs", "outputs", "states"):
            arrays = self.obj(block, kind, f"{path}.{kind}")
            for name, desc in arrays.items():
                where = f"{path}.{kind}.{name}"
                if not isinstance(desc, dict):
                    self.fail(where, f"must be an object, got {show_value(desc)}")
                self.ints(desc, "shape", f"{where}.shape", lo=0)
                self.str(desc, "dtype", f"{where}.dtype", IO_DTYPES)
        return block

    def shape(self, block: dict, kind: str, name: str, path: str) -> list[int]:
        desc = block[kind].get(name)
        if desc is None:
            self.fail(f"{path}.{kind}", f"lists no {name!r} (has {sorted(block[kind])})")
        return desc["shape"]

    def equal(self, field: str, value, other_field: str, other) -> None:
        if value != other:
            self.fail(field, f"is {show_value(value)} but {other_field} is {show_value(other)}: they must agree")


def show_value(value) -> str:
    text = json.dumps(value, allow_nan=True) if isinstance(value, (dict, list, str, int, float, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# the processor config's feature extractor key -> the manifest's audio field
_PROCESSOR_AUDIO_KEYS = {"sampling_rate": "sampling_rate", "n_fft": "n_fft", "win_length": "win_length",
                         "hop_length": "hop_length", "feature_size": "n_mels", "preemphasis": "preemphasis",
                         "max_audio_clip_s": "max_audio_clip_s", "overlap_chunk_second": "overlap_chunk_second",
                         "min_energy_window_samples": "min_energy_window_samples"}


def check_manifest(manifest, where: str, vocab: dict | None = None, processor: dict | None = None) -> None:
    """Every field `Transcriber` and the Swift package read: present, of its type and range, and
    consistent with each other and with the manifest's `io` blocks (`check_packages` ties those to
    the packages). `vocab` (vocab.json) checks the prompts and eos ids; `processor` (processor_config.json)
    the audio settings. Raises BundleError naming the field."""
    f = _Fields(where)
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: the manifest must be a JSON object, got {show_value(manifest)}")
    precision = f.str(manifest, "precision", "precision", PRECISIONS, optional=True)

    # audio: the front end (cohere_coreml.model.audio.FrontEndConfig)
    audio = f.obj(manifest, "audio", "audio")
    f.int(audio, "sampling_rate", "audio.sampling_rate", lo=1000, hi=1_000_000)
    n_fft = f.int(audio, "n_fft", "audio.n_fft", lo=2, hi=1 << 16)
    f.int(audio, "win_length", "audio.win_length", lo=1, hi=n_fft)
    hop = f.int(audio, "hop_length", "audio.hop_length", lo=1, hi=n_fft)
    n_mels = f.int(audio, "n_mels", "audio.n_mels", lo=1, hi=4096)
    f.num(audio, "preemphasis", "audio.preemphasis", 0.0, 1.0, hi_open=True)
    f.num(audio, "dither", "audio.dither", 0.0, 1.0, optional=True)
    clip = f.num(audio, "max_audio_clip_s", "audio.max_audio_clip_s", 0.0, 3600.0, lo_open=True)
    f.num(audio, "overlap_chunk_second", "audio.overlap_chunk_second", 0.0, clip, hi_open=True)
    f.int(audio, "min_energy_window_samples", "audio.min_energy_window_samples", lo=1, hi=MAX_DIM)
    audio_window = f.int(audio, "window_frames", "audio.window_frames", lo=1, optional=True)
    if processor is not None:
        settings = processor.get("feature_extractor", processor) if isinstance(processor, dict) else None
        if not isinstance(settings, dict) or "sampling_rate" not in settings:
            raise BundleError(f"{where}: files.processor_config holds no feature-extractor settings")
        for key, field_name in _PROCESSOR_AUDIO_KEYS.items():
            if key in settings and settings[key] != audio[field_name]:
                f.fail(f"audio.{field_name}", f"is {show_value(audio[field_name])} but the checkpoint's processor config "
                       f"(files.processor_config) says {key} = {show_value(settings[key])}")

    # encoder: window, memory, one function per window (length buckets), each with its io
    enc = f.obj(manifest, "encoder", "encoder")
    window = f.int(enc, "window_frames", "encoder.window_frames", lo=2)
    if audio_window is not None:
        f.equal("audio.window_frames", audio_window, "encoder.window_frames", window)
    encoder_frames = f.int(enc, "encoder_frames", "encoder.encoder_frames", lo=1)
    memory_len = f.int(enc, "memory_len", "encoder.memory_len", lo=encoder_frames)
    f.equal("encoder.num_mel_bins", f.int(enc, "num_mel_bins", "encoder.num_mel_bins", lo=1), "audio.n_mels", n_mels)
    rule = f.obj(enc, "length_masks", "encoder.length_masks")
    kernel = f.int(rule, "kernel_size", "encoder.length_masks.kernel_size", lo=1, hi=1024)
    f.int(rule, "padding", "encoder.length_masks.padding", lo=0, hi=kernel - 1)
    f.int(rule, "stride", "encoder.length_masks.stride", lo=1, hi=1024)
    f.int(rule, "stages", "encoder.length_masks.stages", lo=1, hi=16)
    masks = LengthMasks.from_manifest(rule)
    if masks.frames(window)[-1] != encoder_frames:
        f.fail("encoder.length_masks", f"gives {masks.frames(window)[-1]} encoder frames for encoder.window_frames "
               f"{window}, but encoder.encoder_frames is {encoder_frames}")
    enc_functions = f.obj(enc, "functions", "encoder.functions")
    if "main" not in enc_functions:
        f.fail("encoder.functions", f"has no 'main' function (has {sorted(enc_functions)})")
    frames_of = {}
    for name, fn in enc_functions.items():
        path = f"encoder.functions.{name}"
        if not isinstance(fn, dict):
            f.fail(path, f"must be an object, got {show_value(fn)}")
        frames_of[name] = f.int(fn, "frames", f"{path}.frames", lo=2, hi=window)
        f.num(fn, "window_seconds", f"{path}.window_seconds", 0.0, 3600.0, lo_open=True, optional=True)
        f.io(fn, "io", f"{path}.io")
    f.equal("encoder.functions.main.frames", frames_of["main"], "encoder.window_frames", window)
    f.io(enc, "io", "encoder.io")
    f.equal("encoder.io", enc["io"], "encoder.functions.main.io", enc_functions["main"]["io"])
    _check_encoder_parts(f, manifest, enc, enc_functions, masks, frames_of)

    # decoder: cache, prompt, functions and io of the step (and prefill)
    dec = f.obj(manifest, "decoder", "decoder")
    capacity = f.int(dec, "capacity", "decoder.capacity", lo=2)
    prompt_len = f.int(dec, "prompt_length", "decoder.prompt_length", lo=1, hi=capacity - 1)
    f.equal("decoder.max_new_tokens", f.int(dec, "max_new_tokens", "decoder.max_new_tokens", lo=1),
            "decoder.capacity - decoder.prompt_length + 1", capacity - prompt_len + 1)
    layers = f.int(dec, "num_layers", "decoder.num_layers", lo=1)
    f.int(dec, "num_attention_heads", "decoder.num_attention_heads", lo=1)
    kv_heads = f.int(dec, "num_key_value_heads", "decoder.num_key_value_heads", lo=1)
    head_dim = f.int(dec, "head_dim", "decoder.head_dim", lo=1)
    f.int(dec, "hidden_size", "decoder.hidden_size", lo=1)
    vocab_size = f.int(dec, "vocab_size", "decoder.vocab_size", lo=1)
    f.equal("decoder.cache_shape", f.ints(dec, "cache_shape", "decoder.cache_shape"),
            "[num_layers, num_key_value_heads, capacity, head_dim]", [layers, kv_heads, capacity, head_dim])
    memory_shape = f.ints(dec, "memory_shape", "decoder.memory_shape")
    f.equal("decoder.memory_shape", memory_shape, "[num_layers, num_key_value_heads, encoder.memory_len, head_dim]",
            [layers, kv_heads, memory_len, head_dim])
    output = f.str(dec, "output", "decoder.output", ("log_probs",))
    # who writes the state (absent: "graph", the exports before --decoder-state)
    state_writes = f.str(dec, "state_writes", "decoder.state_writes", DECODER_STATES, optional=True) or DECODER_STATE_GRAPH
    host = state_writes == DECODER_STATE_HOST
    functions = f.obj(dec, "functions", "decoder.functions")
    f.str(functions, "step", "decoder.functions.step")
    prefill = f.str(functions, "prefill", "decoder.functions.prefill", optional=True)
    prefill_len = f.int(dec, "prefill_length", "decoder.prefill_length", lo=1, hi=capacity - 1, optional=True)
    if (prefill is None) != (prefill_len is None):
        f.fail("decoder.prefill_length", f"is {show_value(prefill_len)} but decoder.functions.prefill is {show_value(prefill)}: "
               "both are set (a prefill function) or both null")
    program_float = "float32" if precision == "fp32" else "float16"
    step_io = f.io(dec, "io", "decoder.io")
    prefill_io = f.io(dec, "prefill_io", "decoder.prefill_io", optional=True)
    if (prefill is None) != (prefill_io is None):
        f.fail("decoder.prefill_io", f"must be given exactly when decoder.functions.prefill is (it is {show_value(prefill)})")
    cache = [layers, kv_heads, capacity, head_dim]
    extend = f.str(functions, "extend", "decoder.functions.extend", optional=True)
    extend_len = f.int(dec, "extend_length", "decoder.extend_length", lo=1, hi=capacity - prompt_len, optional=True)
    if (extend is None) != (extend_len is None):
        f.fail("decoder.extend_length", f"is {show_value(extend_len)} but decoder.functions.extend is {show_value(extend)}: "
               "both are set (an extend function) or both null")
    extend_io = f.io(dec, "extend_io", "decoder.extend_io", optional=True)
    if (extend is None) != (extend_io is None):
        f.fail("decoder.extend_io", f"must be given exactly when decoder.functions.extend is (it is {show_value(extend)})")
    for path, io, ids_len in (("decoder.io", step_io, 1), ("decoder.prefill_io", prefill_io, prefill_len),
                              ("decoder.extend_io", extend_io, extend_len)):
        if io is None:
            continue
        expected = {("inputs", "input_ids"): ([1, ids_len], "int32"),
                    ("outputs", output): ([1, vocab_size], program_float),
                    ("states", "self_k"): (cache, "float16"), ("states", "self_v"): (cache, "float16")}
        if path in ("decoder.io", "decoder.extend_io"):
            expected[("inputs", "position")] = ([1], "int32")
            if host:  # the host's mask of the filled cache slots
                expected[("inputs", CACHE_MASK_INPUT)] = ([1, 1, 1, capacity], "float16")
        if path == "decoder.extend_io":  # the log-probs after each of the K slots
            expected[("outputs", output)] = ([1, ids_len, vocab_size], program_float)
        if host:  # the call's new K/V rows, which the host writes into self_k / self_v
            for out_name in NEW_ROWS_OUTPUTS.values():
                expected[("outputs", out_name)] = ([layers, kv_heads, ids_len, head_dim], "float16")
        # format 2: the cross memory is in the state (fp16), never an input of a step or prefill call
        expected.update({("states", "cross_k"): (memory_shape, "float16"), ("states", "cross_v"): (memory_shape, "float16"),
                         ("states", "cross_mask"): ([1, 1, 1, memory_len], "float16")})
        takes = sorted(n for kind, n in expected if kind == "inputs")
        if isinstance(io.get("inputs"), dict) and sorted(io["inputs"]) != takes:
            f.fail(f"{path}.inputs", f"are {sorted(io['inputs'])}; a format-{FORMAT_VERSION} {state_writes}-state "
                   f"decoder call takes {takes} (the cross memory is in the state, written by "
                   + ("the host once per window)" if host else "decoder.functions.bind)"))
        for (kind, name), (shape, dtype) in expected.items():
            got = f.shape(io, kind, name, path)
            what = {"self_k": "decoder.cache_shape", "self_v": "decoder.cache_shape", "input_ids":
                    {"decoder.io": "[1, 1]", "decoder.prefill_io": "decoder.prefill_length",
                     "decoder.extend_io": "decoder.extend_length"}[path], "position": "[1]",
                    output: "[1, decoder.extend_length, decoder.vocab_size]" if path == "decoder.extend_io"
                    else "[1, decoder.vocab_size]", "cross_mask": "[1, 1, 1, encoder.memory_len]",
                    CACHE_MASK_INPUT: "[1, 1, 1, decoder.capacity]",
                    **dict.fromkeys(NEW_ROWS_OUTPUTS.values(), "[num_layers, num_key_value_heads, tokens of the call, "
                                    "head_dim]")}.get(name, "decoder.memory_shape")
            f.equal(f"{path}.{kind}.{name}.shape", got, what, shape)
            f.equal(f"{path}.{kind}.{name}.dtype", io[kind][name]["dtype"],
                    "int32" if name in ("input_ids", "position") else "float16 (fp16 states, the host's arrays)"
                    if dtype == "float16" and name not in (output,) else "the dtype of precision " + repr(precision),
                    dtype)
    if host:  # the host writes the state: no bind function; what it writes, named
        for key in ("bind_inputs", "bind_io"):
            if dec.get(key) is not None:
                f.fail(f"decoder.{key}", f"is {show_value(dec.get(key))}; a host-state decoder has no bind function (null)")
        if functions.get("bind") is not None:
            f.fail("decoder.functions.bind", f"is {show_value(functions.get('bind'))}; a host-state decoder has none (null)")
        for key, want in (("memory_states", {name: name for name in MEMORY_NAMES}),
                          ("row_outputs", dict(NEW_ROWS_OUTPUTS)), ("cache_mask_input", CACHE_MASK_INPUT)):
            if dec.get(key) != want:
                f.fail(f"decoder.{key}", f"is {show_value(dec.get(key))}; a host-state decoder of this format writes "
                       f"{show_value(want)}")
    else:  # the bind function: the encoder's memory in (under decoder.bind_inputs' names), memory_length out
        bind = f.str(functions, "bind", "decoder.functions.bind")
        bind_inputs = f.obj(dec, "bind_inputs", "decoder.bind_inputs")
        want_inputs = {BIND_INPUT_PREFIX + name: name for name in MEMORY_NAMES}
        if bind_inputs != want_inputs:
            f.fail("decoder.bind_inputs", f"is {show_value(bind_inputs)}; the {bind!r} function takes {want_inputs}")
        bind_io = f.io(dec, "bind_io", "decoder.bind_io")
        memory_of = {"cross_k": (memory_shape, program_float), "cross_v": (memory_shape, program_float),
                     "cross_mask": ([1, 1, 1, memory_len], program_float)}
        expected = {("inputs", i): memory_of[o] for i, o in want_inputs.items()}
        expected.update({("outputs", BIND_OUTPUT): ([1], "int32"), ("states", "self_k"): (cache, "float16"),
                         ("states", "self_v"): (cache, "float16"),
                         **{("states", n): (shape, "float16") for n, (shape, _) in memory_of.items()}})
        for (kind, name), (shape, dtype) in expected.items():
            f.equal(f"decoder.bind_io.{kind}.{name}.shape", f.shape(bind_io, kind, name, "decoder.bind_io"),
                    "the shape of " + ("the encoder's " + want_inputs[name] if kind == "inputs" else name), shape)
            f.equal(f"decoder.bind_io.{kind}.{name}.dtype", bind_io[kind][name]["dtype"], "dtype", dtype)
    _check_batch(f, dec, functions, host, cache, vocab_size, output, program_float, memory_shape, memory_len)
    _check_alignment(f, dec, capacity, layers, memory_shape, memory_len)
    # every encoder function's io: features of its frames in, the decoder's memory out
    for name, fn in enc_functions.items():
        path = f"encoder.functions.{name}.io"
        io = fn["io"]
        if isinstance(io.get("inputs"), dict) and sorted(io["inputs"]) != sorted(("input_features", *masks.names)):
            f.fail(f"{path}.inputs", f"are {sorted(io['inputs'])}; a format-{FORMAT_VERSION} encoder takes "
                   f"{sorted(('input_features', *masks.names))} (the length masks of encoder.length_masks)")
        checks = {("inputs", "input_features"): ([1, n_mels, frames_of[name]], "float32",
                                                 f"[1, audio.n_mels, encoder.functions.{name}.frames]"),
                  **{("inputs", mask): ([1, n], "float16", f"[1, frames of {mask} by encoder.length_masks]")
                     for mask, n in zip(masks.names, masks.frames(frames_of[name]))},
                  ("outputs", "cross_k"): (memory_shape, program_float, "decoder.memory_shape"),
                  ("outputs", "cross_v"): (memory_shape, program_float, "decoder.memory_shape"),
                  ("outputs", "cross_mask"): ([1, 1, 1, memory_len], program_float, "[1, 1, 1, encoder.memory_len]")}
        for (kind, array), (shape, dtype, what) in checks.items():
            f.equal(f"{path}.{kind}.{array}.shape", f.shape(io, kind, array, path), what, shape)
            f.equal(f"{path}.{kind}.{array}.dtype", io[kind][array]["dtype"], "the program's dtype", dtype)

    # frontend (optional): one function per encoder window, same names and frames
    files = manifest["files"]
    front = f.obj(manifest, "frontend", "frontend", optional=True)
    if (front is None) != (files.get("frontend") is None):
        f.fail("frontend", "and files.frontend must be given together (a bundle with frontend.mlpackage has both)")
    if front is not None:
        f.str(front, "compute_units", "frontend.compute_units", COMPUTE_UNITS, optional=True)
        f.str(front, "precision", "frontend.precision", PRECISIONS, optional=True)
        fe_functions = f.obj(front, "functions", "frontend.functions")
        if sorted(fe_functions) != sorted(enc_functions):
            f.fail("frontend.functions", f"are {sorted(fe_functions)} but encoder.functions are {sorted(enc_functions)}: "
                   "one front-end function per encoder window, same names")
        for name, fn in fe_functions.items():
            path = f"frontend.functions.{name}"
            if not isinstance(fn, dict):
                f.fail(path, f"must be an object, got {show_value(fn)}")
            samples = f.int(fn, "samples", f"{path}.samples", lo=1)
            frames = f.int(fn, "frames", f"{path}.frames", lo=1)
            f.num(fn, "window_seconds", f"{path}.window_seconds", 0.0, 3600.0, lo_open=True, optional=True)
            f.equal(f"{path}.frames", frames, f"encoder.functions.{name}.frames", frames_of[name])
            f.equal(f"{path}.frames", frames, f"the frames of {path}.samples with audio.n_fft and audio.hop_length",
                    (samples + 2 * (n_fft // 2) - n_fft) // hop)
            io = f.io(fn, "io", f"{path}.io")
            for kind, array, shape, what in (("inputs", "audio", [1, samples], f"[1, {path}.samples]"),
                                             ("inputs", "audio_length", [1], "[1]"),
                                             ("outputs", "input_features", [1, n_mels, frames], f"[1, audio.n_mels, {path}.frames]"),
                                             ("outputs", "feature_length", [1], "[1]")):
                f.equal(f"{path}.io.{kind}.{array}.shape", f.shape(io, kind, array, f"{path}.io"), what, shape)
        f.io(front, "io", "frontend.io")
        f.equal("frontend.io", front["io"], "frontend.functions.main.io", fe_functions["main"]["io"])

    _check_vad(f, manifest, files)

    # tokens, generation, languages (the prompts): ids inside the vocabulary, pieces as the tokenizer's
    tokens = f.obj(manifest, "tokens", "tokens")
    f.equal("tokens.vocab_size", f.int(tokens, "vocab_size", "tokens.vocab_size", lo=1), "decoder.vocab_size", vocab_size)
    eos = f.ints(tokens, "eos_token_ids", "tokens.eos_token_ids", hi=vocab_size - 1)
    if not eos:
        f.fail("tokens.eos_token_ids", "is empty: a decoder needs an end token")
    f.equal("tokens.eos_token_id", f.int(tokens, "eos_token_id", "tokens.eos_token_id", hi=vocab_size - 1),
            "tokens.eos_token_ids[0]", eos[0])
    for key in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
        f.int(tokens, key, f"tokens.{key}", hi=vocab_size - 1, optional=True)
    gen = f.obj(manifest, "generation", "generation")
    f.str(gen, "strategy", "generation.strategy", ("greedy",))
    f.int(gen, "upstream_max_new_tokens", "generation.upstream_max_new_tokens", lo=1, optional=True)
    no_space = gen.get("no_space_languages", _MISSING)
    if no_space != sorted(NO_SPACE_LANGUAGES):
        f.fail("generation.no_space_languages", f"is {show_value(None if no_space is _MISSING else no_space)}, "
               f"expected {sorted(NO_SPACE_LANGUAGES)} (the languages whose windows are joined without a space)")
    languages = f.obj(manifest, "languages", "languages")
    if sorted(languages) != sorted(LANGUAGES):  # the writer lists every language the tokenizer has a prompt for
        f.fail("languages", f"has prompts for {sorted(languages)[:20]}, expected one per language of the model: "
               f"{', '.join(LANGUAGES)}")
    for lang, prompts in languages.items():
        if lang not in LANGUAGES:
            f.fail(f"languages.{lang}", f"is not a supported language ({', '.join(LANGUAGES)})")
        if not isinstance(prompts, dict):
            f.fail(f"languages.{lang}", f"must be an object, got {show_value(prompts)}")
        for kind in ("punctuation", "no_punctuation"):
            path = f"languages.{lang}.{kind}"
            ids = f.ints(prompts, kind, path, hi=vocab_size - 1)
            f.equal(f"{path} (length)", len(ids), "decoder.prompt_length", prompt_len)
            if vocab is not None:
                try:
                    want = prompt_tokens(lang, punctuation=kind == "punctuation")
                except UnknownLanguageError:  # pragma: no cover - LANGUAGES checked above
                    want = []
                got = [vocab.get(str(i)) for i in ids]
                if got != want:
                    f.fail(path, f"decodes to {got} in files.vocab, expected the prompt {want}")
    # the two prompts of each language (other keys are ignored, as everywhere in the manifest)
    starts = {prompts[kind][0] for prompts in languages.values() for kind in ("punctuation", "no_punctuation")}
    start = tokens.get("decoder_start_token_id")
    if start is not None and starts != {start}:
        f.fail("tokens.decoder_start_token_id", f"is {start} but the prompts in languages start with {sorted(starts)}")
    if vocab is not None:
        for key, piece in (("pad_token_id", PAD_TOKEN), ("bos_token_id", BOS_TOKEN)):
            if tokens.get(key) is not None and vocab.get(str(tokens[key])) != piece:
                f.fail(f"tokens.{key}", f"is {tokens[key]}, which files.vocab reads as {vocab.get(str(tokens[key]))!r}, "
                       f"not {piece!r}")
        missing = [i for i in eos if str(i) not in vocab]
        if missing:
            f.fail("tokens.eos_token_ids", f"has ids {missing} that files.vocab does not hold")
        if vocab.get(str(eos[0])) != EOS_TOKEN:
            f.fail("tokens.eos_token_id", f"is {eos[0]}, which files.vocab reads as {vocab.get(str(eos[0]))!r}, "
                   f"not {EOS_TOKEN!r}")


def _check_encoder_parts(f: _Fields, manifest: dict, enc: dict, enc_functions: dict, masks: LengthMasks,
                         frames_of: dict) -> None:
    """encoder.parts: programs of consecutive layers covering encoder.num_layers from layer 0, each in the
    file its `files` key names, each with every function of encoder.functions; the first takes the
    function's inputs, the last gives its outputs, each other hands its hidden state on."""
    num_layers = f.int(enc, "num_layers", "encoder.num_layers", lo=1, hi=100_000)
    parts = f.get(enc, "parts", "encoder.parts")
    if not isinstance(parts, list) or not parts:
        f.fail("encoder.parts", f"must be a non-empty list of the encoder's programs, got {show_value(parts)}")
    files = manifest["files"]
    start = 0
    for i, part in enumerate(parts):
        path = f"encoder.parts[{i}]"
        if not isinstance(part, dict):
            f.fail(path, f"must be an object, got {show_value(part)}")
        key = f.str(part, "file", f"{path}.file", (encoder_part_key(i),))
        if not isinstance(files.get(key), str):
            f.fail(f"{path}.file", f"names files.{key}, which the manifest does not give")
        layers = f.ints(part, "layers", f"{path}.layers", hi=num_layers)
        if len(layers) != 2 or layers[0] != start or layers[1] <= start:
            f.fail(f"{path}.layers", f"is {show_value(layers)}; part {i + 1} holds layers [{start}, stop) with stop > {start}")
        start = layers[1]
        functions = f.obj(part, "functions", f"{path}.functions")
        if sorted(functions) != sorted(enc_functions):
            f.fail(f"{path}.functions", f"are {sorted(functions)}, but the encoder functions (encoder.functions) are "
                   f"{sorted(enc_functions)}: every part has every window's function")
        for fn, entry in functions.items():
            if not isinstance(entry, dict):
                f.fail(f"{path}.functions.{fn}", f"must be an object, got {show_value(entry)}")
            f.io(entry, "io", f"{path}.functions.{fn}.io")
    if start != num_layers:
        f.fail("encoder.parts", f"end at layer {start}, the encoder has encoder.num_layers = {num_layers}")
    extra = sorted(k for k in files if k.startswith("encoder_part") and k not in {p["file"] for p in parts})
    if extra:
        f.fail("files", f"names {extra}, which encoder.parts does not list")
    for fn, entry in enc_functions.items():
        ios = [part["functions"][fn]["io"] for part in parts]
        chain = enc_functions[fn]["io"]
        f.equal(f"encoder.parts[0].functions.{fn}.io.inputs", ios[0]["inputs"], f"encoder.functions.{fn}.io.inputs",
                chain["inputs"])
        f.equal(f"encoder.parts[{len(parts) - 1}].functions.{fn}.io.outputs", ios[-1]["outputs"],
                f"encoder.functions.{fn}.io.outputs", chain["outputs"])
        t = masks.frames(frames_of[fn])[-1]
        for i in range(len(parts) - 1):  # hidden state (1, T, He) out, then in with the encoder mask
            hidden = f.shape(ios[i], "outputs", "hidden_states_out", f"encoder.parts[{i}].functions.{fn}.io")
            if len(hidden) != 3 or hidden[:2] != [1, t] or sorted(ios[i]["outputs"]) != ["hidden_states_out"]:
                f.fail(f"encoder.parts[{i}].functions.{fn}.io.outputs", f"are {show_value(ios[i]['outputs'])}; a part "
                       f"before the last gives only hidden_states_out [1, {t}, hidden size]")
            nxt = ios[i + 1]["inputs"]
            want = {"hidden_states": ios[i]["outputs"]["hidden_states_out"],
                    "encoder_mask": {"shape": [1, t], "dtype": "float16"}}
            if nxt != want:
                f.fail(f"encoder.parts[{i + 1}].functions.{fn}.io.inputs", f"are {show_value(nxt)}; the part after "
                       f"part {i + 1} takes {show_value(want)}")


def _check_batch(f: _Fields, dec: dict, functions: dict, host: bool, cache: list, vocab_size: int, output: str,
                 program_float: str, memory_shape: list, memory_len: int) -> None:
    """`decoder.batch` and `decoder.functions.step_batch` (docs/bundle.md, "Decoding several windows at once"): both
    or neither, a host-state decoder only, B = `size` >= 2 rows, and the function's io the step's with B rows: input_ids
    (B, 1), position (B,), cache_mask (B, 1, 1, C) in; log_probs (B, V) and the new K/V rows (L, B*Hkv, 1, Dh) out;
    states of B rows folded into the head axis (self_k (L, B*Hkv, C, Dh), cross_k (L, B*Hkv, Tp, Dh), cross_mask
    (B, 1, 1, Tp)). The Swift manifest check (ManifestCheck.checkBatch) is a port of this one."""
    name = f.str(functions, "step_batch", "decoder.functions.step_batch", optional=True)
    batch = f.obj(dec, "batch", "decoder.batch", optional=True)
    if (name is None) != (batch is None):
        f.fail("decoder.batch", f"must be given exactly when decoder.functions.step_batch is (it is {show_value(name)})")
    if batch is None:
        return
    if not host:
        f.fail("decoder.batch", "is set but the decoder is not a host-state one: the graph variant has no batched step")
    size = f.int(batch, "size", "decoder.batch.size", lo=2)
    io = f.io(batch, "io", "decoder.batch.io")
    ids = f.shape(io, "inputs", "input_ids", "decoder.batch.io")
    if ids != [size, 1]:
        f.fail("decoder.batch.size", f"is {size}; the batched step takes input_ids of shape [B, 1] with B >= 2 "
               f"(decoder.batch.io says {show_value(ids)})")
    layers, kv_heads, capacity, head_dim = cache
    rows = [layers, size * kv_heads]
    expected = {("inputs", "input_ids"): ([size, 1], "int32", "[decoder.batch.size, 1]"),
                ("inputs", "position"): ([size], "int32", "[decoder.batch.size]"),
                ("inputs", CACHE_MASK_INPUT): ([size, 1, 1, capacity], "float16", "[decoder.batch.size, 1, 1, decoder.capacity]"),
                ("outputs", output): ([size, vocab_size], program_float, "[decoder.batch.size, decoder.vocab_size]")}
    for out_name in NEW_ROWS_OUTPUTS.values():
        expected[("outputs", out_name)] = (rows + [1, head_dim], "float16",
                                           "[num_layers, decoder.batch.size * num_key_value_heads, 1, head_dim]")
    for state in NEW_ROWS_OUTPUTS:
        expected[("states", state)] = (rows + [capacity, head_dim], "float16",
                                       "[num_layers, decoder.batch.size * num_key_value_heads, capacity, head_dim]")
    for state in MEMORY_NAMES:
        expected[("states", state)] = (
            ([size, 1, 1, memory_len], "float16", "[decoder.batch.size, 1, 1, encoder.memory_len]") if state == "cross_mask"
            else (rows + memory_shape[2:], "float16", "[num_layers, decoder.batch.size * num_key_value_heads, "
                                                      "encoder.memory_len, head_dim]"))
    takes = sorted(n for kind, n in expected if kind == "inputs")
    if sorted(io["inputs"]) != takes:
        f.fail("decoder.batch.io.inputs", f"are {sorted(io['inputs'])}; the batched step takes {takes} (the cross "
               "memory is in the state, written by the host into each row)")
    for (kind, array), (shape, dtype, what) in expected.items():
        f.equal(f"decoder.batch.io.{kind}.{array}.shape", f.shape(io, kind, array, "decoder.batch.io"), what, shape)
        f.equal(f"decoder.batch.io.{kind}.{array}.dtype", io[kind][array]["dtype"], "dtype", dtype)


def _check_alignment(f, dec: dict, capacity: int, layers: int, memory_shape: list, memory_len: int) -> None:
    """decoder.alignment (word timings; absent in bundles exported before them): null with a reason in
    decoder.alignment_note, or the align function's heads, rows, frame length, io and calibration figures."""
    if "alignment" not in dec:
        return
    block = f.obj(dec, "alignment", "decoder.alignment", optional=True)
    note = f.str(dec, "alignment_note", "decoder.alignment_note", optional=True)
    if block is None:
        if note is None:
            f.fail("decoder.alignment_note", "is missing: a bundle without alignment says why (a non-empty string)")
        return
    if note is not None:
        f.fail("decoder.alignment_note", f"is {show_value(note)} but decoder.alignment is set: null when it is")
    f.str(block, "function", "decoder.alignment.function", (ALIGN_FUNCTION,))
    length = f.int(block, "length", "decoder.alignment.length", lo=1, hi=capacity)  # K: tokens a call
    heads_per_layer = f.int(dec, "num_attention_heads", "decoder.num_attention_heads", lo=1)
    heads = f.get(block, "heads", "decoder.alignment.heads")
    if not isinstance(heads, list) or not heads:
        f.fail("decoder.alignment.heads", f"must be a non-empty list of [layer, head], got {show_value(heads)}")
    for i, pair in enumerate(heads):
        if (not isinstance(pair, list) or len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                   for x in pair)
                or not (0 <= pair[0] < layers and 0 <= pair[1] < heads_per_layer)):
            f.fail(f"decoder.alignment.heads[{i}]", f"must be [layer, head] inside {layers} layers x {heads_per_layer} "
                   f"heads, got {show_value(pair)}")
    f.int(block, "lead_rows", "decoder.alignment.lead_rows", lo=0, hi=capacity - 1)
    f.num(block, "frame_seconds", "decoder.alignment.frame_seconds", 0.0, 10.0, lo_open=True)
    io = f.io(block, "io", "decoder.alignment.io")
    # the host-state extend's inputs (input_ids (1, K), position, cache_mask) in either state variant
    expected = {("inputs", "input_ids"): ([1, length], "int32", "[1, decoder.alignment.length]"),
                ("inputs", "position"): ([1], "int32", "[1]"),
                ("inputs", CACHE_MASK_INPUT): ([1, 1, 1, capacity], "float16", "[1, 1, 1, decoder.capacity]"),
                ("outputs", ALIGN_OUTPUT): ([1, len(heads), length, memory_len], "float16",
                                            "[1, heads, decoder.alignment.length, encoder.memory_len]"),
                ("states", "cross_k"): (memory_shape, "float16", "decoder.memory_shape"),
                ("states", "cross_v"): (memory_shape, "float16", "decoder.memory_shape")}
    for (kind, name), (shape, dtype, what) in expected.items():
        f.equal(f"decoder.alignment.io.{kind}.{name}.shape", f.shape(io, kind, name, "decoder.alignment.io"), what,
                shape)
        f.equal(f"decoder.alignment.io.{kind}.{name}.dtype", io[kind][name]["dtype"], "dtype", dtype)
    calibration = f.obj(block, "calibration", "decoder.alignment.calibration", optional=True)
    if calibration is not None:
        f.str(calibration, "set", "decoder.alignment.calibration.set")
        for key in ("clips", "words"):
            f.int(calibration, key, f"decoder.alignment.calibration.{key}", lo=1)
        for key in ("median_s", "p90_s", "baseline_median_s"):
            f.num(calibration, key, f"decoder.alignment.calibration.{key}", 0.0, 1e6)


# the VAD's fixed sizes (Silero VAD 16 kHz, cohere_coreml.model.silero): field -> value
VAD_SIZES = {"sample_rate": 16000, "chunk_samples": 512, "context_samples": 64, "hidden": 128}


def _check_vad(f: _Fields, manifest: dict, files: dict) -> None:
    """vad (optional, with files.vad): Silero VAD's sizes, its two functions' chunks, and io shapes that
    agree with them (docs/bundle.md). Swift's ManifestCheck checks the same."""
    vad = f.obj(manifest, "vad", "vad", optional=True)
    if (vad is None) != (files.get("vad") is None):
        f.fail("vad", "and files.vad must be given together (a bundle with vad.mlpackage has both)")
    if vad is None:
        return
    for key, value in VAD_SIZES.items():
        f.equal(f"vad.{key}", f.int(vad, key, f"vad.{key}", lo=1), "Silero VAD's", value)
    frame, hidden = VAD_SIZES["context_samples"] + VAD_SIZES["chunk_samples"], VAD_SIZES["hidden"]
    functions = f.obj(vad, "functions", "vad.functions")
    for name, fixed in ((VAD_BLOCK_FUNCTION, None), (VAD_CHUNK_FUNCTION, 1)):
        path = f"vad.functions.{name}"
        fn = f.obj(functions, name, path)
        chunks = f.int(fn, "chunks", f"{path}.chunks", lo=1)
        if fixed is not None:
            f.equal(f"{path}.chunks", chunks, "one chunk a call", fixed)
        io = f.io(fn, "io", f"{path}.io")
        for kind, array, shape, what in (("inputs", "frames", [chunks, frame], f"[{path}.chunks, 576]"),
                                         ("inputs", "h", [1, hidden], "[1, 128]"),
                                         ("inputs", "c", [1, hidden], "[1, 128]"),
                                         ("outputs", "probability", [1, chunks], f"[1, {path}.chunks]"),
                                         ("outputs", "h_out", [1, hidden], "[1, 128]"),
                                         ("outputs", "c_out", [1, hidden], "[1, 128]")):
            f.equal(f"{path}.io.{kind}.{array}.shape", f.shape(io, kind, array, f"{path}.io"), what, shape)
