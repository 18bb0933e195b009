#!/usr/bin/env python
"""Transcribe an audio file with this bundle's Core ML packages (numpy, soundfile, coremltools only).

    pip install numpy soundfile coremltools
    python example_inference.py audio.wav --language en [--no-punctuation] [--json] [--word-timestamps] [--vad on]
                                [--decoder-batch 1]

Runs on macOS 15+ (Core ML with model state). The bundle's packages do all the work:

    frontend.mlpackage   16 kHz samples of one window -> log-mel input_features + feature_length
    encoder.mlpackage    features + the host's length masks -> the decoder's cross-attention memory
                         (cross_k, cross_v, cross_mask); an encoder in parts: encoder.mlpackage, then
                         encoder_part2.mlpackage ... on the previous part's hidden state
    decoder.mlpackage    main (the step): one token + its position -> log_probs, KV cache in the state;
                         prefill (optional): the whole prompt in one call; manifest decoder.state_writes
                         "host": the functions only read the state, this program writes the window's
                         memory into it once and each call's new K/V rows (new_k, new_v) at their slots,
                         and passes the mask of the filled slots (cache_mask); "graph": bind_memory writes
                         a window's memory into a fresh state (once per window), the functions the cache;
                         align (manifest decoder.alignment, optional): after a window's decoding, on the
                         same state, K of its tokens a call -> the cross-attention of the alignment heads,
                         turned into word timings (--word-timestamps); step_batch (manifest decoder.batch,
                         optional, host state): one token for each of B windows in one call, its state B
                         rows, one window each (a clip of several windows, greedy, without word timings, is
                         decoded B windows at a time; --decoder-batch 1: one at a time, as above)
    vad.mlpackage        (optional) Silero VAD: 32 ms chunks of samples + its recurrent state -> each chunk's
                         speech probability; with it (--vad auto, the default) only windows of speech are
                         transcribed (the rule of docs/vad.md), times still on the file's timeline

Every name and size below comes from manifest.json. The steps are those of "Decoding loop" in
docs/bundle.md (cohere-transcribe-coreml): greedy decoding, audio longer than 30 s cut into
windows at its quietest points as the model's processor cuts it, or, with the bundle's VAD, windows
packed from its speech regions; several windows B at a time by "Decoding several windows at once
(`decoder.batch`)" there, each window's tokens those of the one-window loop.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import unicodedata
import uuid
from pathlib import Path

import coremltools as ct
import numpy as np
import soundfile as sf

BUNDLE = Path(__file__).resolve().parent
UNITS = {"all": ct.ComputeUnit.ALL, "cpu_only": ct.ComputeUnit.CPU_ONLY,
         "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU, "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE}


class Bundle:
    """manifest.json, vocab.json and the packages' functions (each loaded once, when first used).

    Each package is compiled once (`compile_model`: Core ML's compiler) and every function loaded from
    that compiled model (`CompiledMLModel`); loading `MLModel(package, function_name=...)` instead would
    compile the whole package again for each function (minutes at full size). The compiled models go to
    a temporary folder, or with `cache` to that folder, named after the manifest's checksums of the
    package's files (`<name>-<digest>.mlmodelc`, the Swift package's rule), so a later run loads them."""

    def __init__(self, folder: Path, cache: Path | None = None):
        self.folder = folder
        if not (folder / "manifest.json").is_file():
            sys.exit(f"{folder} has no manifest.json: pass the bundle folder with --bundle")
        self.manifest = json.loads((folder / "manifest.json").read_text())
        if self.manifest.get("format_version") != 3:
            sys.exit(f"{folder}: bundle format {self.manifest.get('format_version')}, this example reads format 3")
        if "frontend" not in self.manifest["files"]:
            sys.exit(f"{folder} has no frontend.mlpackage: re-export it with `cohere-coreml export`")
        self.vocab = json.loads((folder / self.manifest["files"]["vocab"]).read_text())  # {"id": piece}
        self.loaded = {}
        self.compiled = {}
        self._temporary = None if cache is not None else tempfile.TemporaryDirectory(prefix="cohere-compiled-")
        self.cache = Path(cache) if cache is not None else Path(self._temporary.name)

    def compiled_model(self, component: str) -> Path:
        """The compiled model of one package: from the cache, else compiled now."""
        if component not in self.compiled:
            package = self.folder / self.manifest["files"][component]
            prefix = package.name + "/"
            files = self.manifest.get("checksums", {}).get("files", {})
            lines = sorted(f"{k}\t{v['sha256']}\t{v['size']}" for k, v in files.items() if k.startswith(prefix))
            if not lines:  # no checksums to name the content by: compiled for this run only
                self.compiled[component] = Path(ct.models.utils.compile_model(str(package)))
                return self.compiled[component]
            digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]
            target = self.cache / f"{package.name[: -len('.mlpackage')]}-{digest}.mlmodelc"
            if (target / ".complete").is_file():
                os.utime(target / ".complete")  # the entry's last use
            else:
                self.cache.mkdir(parents=True, exist_ok=True)
                # compiled inside a temporary of the cache's naming (Core ML wants a .mlmodelc destination)
                scratch = self.cache / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
                staging = scratch / target.name
                try:
                    ct.models.utils.compile_model(str(package), str(staging))
                    (staging / ".complete").write_text(json.dumps({"source": os.path.abspath(package)}))
                    install(staging, target)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
            self.compiled[component] = target
        return self.compiled[component]

    def function(self, component: str, name: str, units: str = "all") -> ct.models.CompiledMLModel:
        if (component, name) not in self.loaded:
            self.loaded[component, name] = ct.models.CompiledMLModel(
                str(self.compiled_model(component)), compute_units=UNITS[units], function_name=name)
        return self.loaded[component, name]


def install(staging: Path, target: Path) -> bool:
    """Rename a compiled model, marked complete, to its cache name: the rule of "Compiled-model cache" in
    docs/runtime.md. A complete target is kept (its name says its content is the same) and `staging`
    dropped; only a target without the marker is moved aside and removed. False when one was kept."""
    for _ in range(3):
        try:
            os.rename(staging, target)  # fails while `target` is a non-empty folder
            return True
        except OSError:
            if not target.exists():
                continue
            if (target / ".complete").is_file():  # another process installed the same content: use it
                shutil.rmtree(staging, ignore_errors=True)
                return False
            trash = target.with_name(f".{target.name}.trash-{os.getpid()}-{uuid.uuid4().hex}")
            try:
                os.rename(target, trash)  # an incomplete leftover: aside, then removed
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    raise OSError(f"cannot install the compiled model at {target}")


def read_audio(path: str, sampling_rate: int) -> np.ndarray:
    """float32 mono samples (channels averaged); the file must already be at the model's rate."""
    samples, rate = sf.read(path, dtype="float32", always_2d=True)  # (samples, channels)
    if rate != sampling_rate:
        sys.exit(f"{path} is {rate} Hz: resample it to {sampling_rate} Hz first (e.g. ffmpeg -i IN -ar {sampling_rate} OUT.wav)")
    if samples.shape[0] == 0:
        sys.exit(f"{path} holds no samples")
    return samples.mean(axis=1)


def split_points(samples: np.ndarray, audio: dict) -> list[tuple[int, int]]:
    """(start, end) of each window: the clip whole up to max_audio_clip_s - overlap_chunk_second
    (30 s), else pieces of at most max_audio_clip_s (35 s), each cut at the start of the quietest
    min_energy_window_samples window (RMS) in its last overlap_chunk_second (5 s)."""
    sr, total = audio["sampling_rate"], len(samples)
    chunk = round(audio["max_audio_clip_s"] * sr)
    context = round(audio["overlap_chunk_second"] * sr)
    window = audio["min_energy_window_samples"]
    if total <= max(0.0, audio["max_audio_clip_s"] - audio["overlap_chunk_second"]) * sr or total <= chunk:
        return [(0, total)]
    ranges, start = [], 0
    while start + chunk < total:
        lo, hi = start + max(0, chunk - context), start + chunk
        if hi - lo <= window:
            cut = (lo + hi) // 2
        else:
            rms = [np.sqrt(np.mean(samples[i:i + window] ** 2)) for i in range(lo, hi - window, window)]
            cut = lo + window * int(np.argmin(rms))  # the first quietest window
        cut = max(start + 1, cut)
        ranges.append((start, cut))
        start = cut
    ranges.append((start, total))
    return ranges


# --- voice activity (docs/vad.md): a copy of cohere-coreml's inference/speech_regions.py, which ports silero-vad
# 6.2.3's get_speech_timestamps_from_probs (MIT, https://github.com/snakers4/silero-vad); the same test vectors
# (tests/data/vad_vectors.json) check both
VAD_CHUNK, VAD_CONTEXT, VAD_RATE = 512, 64, 16000
VAD_DEFAULTS = {"threshold": 0.5, "neg_threshold": None, "min_speech_ms": 250, "min_silence_ms": 100,
                "speech_pad_ms": 30, "max_speech_s": None, "max_gap_s": 2.0}


def vad_probabilities(bundle: Bundle, samples: np.ndarray) -> np.ndarray:
    """Speech probability of each 512-sample chunk (the last zero-padded) from vad.mlpackage's `block` function:
    N chunks a call (manifest vad.functions.block.chunks), each row the 64 samples before the chunk and the
    chunk, the recurrent state (h, c) carried from call to call from zeros; a last call's missing rows are zero
    frames whose outputs are dropped."""
    v = bundle.manifest["vad"]
    n_rows = int(v["functions"]["block"]["chunks"])
    block = bundle.function("vad", "block", v.get("compute_units", "all"))
    chunks = -(-len(samples) // VAD_CHUNK)
    padded = np.zeros(VAD_CONTEXT + chunks * VAD_CHUNK, np.float32)
    padded[VAD_CONTEXT:VAD_CONTEXT + len(samples)] = samples
    h = np.zeros((1, v["hidden"]), np.float32)
    c = np.zeros((1, v["hidden"]), np.float32)
    out = []
    for first in range(0, chunks, n_rows):
        frames = np.zeros((n_rows, VAD_CONTEXT + VAD_CHUNK), np.float32)
        rows = min(n_rows, chunks - first)
        for i in range(rows):
            start = (first + i) * VAD_CHUNK
            frames[i] = padded[start:start + VAD_CONTEXT + VAD_CHUNK]
        result = block.predict({"frames": frames, "h": h, "c": c})
        out.append(np.asarray(result["probability"], np.float32).reshape(-1)[:rows])
        h = np.asarray(result["h_out"], np.float32).reshape(1, -1)
        c = np.asarray(result["c_out"], np.float32).reshape(1, -1)
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def speech_regions(probs, n_samples: int, options: dict, max_speech_s: float | None) -> list[tuple[int, int]]:
    """[(start, end)] samples of speech: silero-vad's get_speech_timestamps_from_probs at 16 kHz (the longest
    silence cuts speech longer than max_speech_s, 98 ms the shortest such silence), its arithmetic kept."""
    o = {**VAD_DEFAULTS, **options}
    limit = o["max_speech_s"] if o["max_speech_s"] is not None else max_speech_s
    limit = float("inf") if limit is None else limit
    threshold = float(o["threshold"])
    neg = max(threshold - 0.15, 0.01) if o["neg_threshold"] is None else float(o["neg_threshold"])
    min_speech = VAD_RATE * o["min_speech_ms"] / 1000
    pad = VAD_RATE * o["speech_pad_ms"] / 1000
    max_speech = VAD_RATE * limit - VAD_CHUNK - 2 * pad
    min_silence = VAD_RATE * o["min_silence_ms"] / 1000
    min_silence_at_max = VAD_RATE * 98 / 1000
    triggered, speeches, current = False, [], None
    temp_end = prev_end = next_start = 0
    possible_ends = []
    for i, p in enumerate(probs):
        p, cur = float(p), VAD_CHUNK * i
        if p >= threshold and temp_end:
            if cur - temp_end > min_silence_at_max:
                possible_ends.append((temp_end, cur - temp_end))
            temp_end = 0
            if next_start < prev_end:
                next_start = cur
        if p >= threshold and not triggered:
            triggered, current = True, [cur, None]
            continue
        if triggered and cur - current[0] > max_speech:
            if possible_ends:  # cut at the longest silence (the first of equals)
                prev_end, dur = max(possible_ends, key=lambda x: x[1])
                current[1] = prev_end
                speeches.append(current)
                next_start = prev_end + dur
                if next_start < prev_end + cur:
                    current = [next_start, None]
                else:
                    triggered, current = False, None
                prev_end = next_start = temp_end = 0
                possible_ends = []
            else:  # no silence to cut at: cut here
                current[1] = cur
                speeches.append(current)
                triggered, current = False, None
                prev_end = next_start = temp_end = 0
                possible_ends = []
                continue
        if p < neg and triggered:
            if not temp_end:
                temp_end = cur
            if cur - temp_end < min_silence:
                continue
            current[1] = temp_end
            if current[1] - current[0] > min_speech:
                speeches.append(current)
            triggered, current = False, None
            prev_end = next_start = temp_end = 0
            possible_ends = []
    if current is not None and n_samples - current[0] > min_speech:
        current[1] = n_samples
        speeches.append(current)
    for i, speech in enumerate(speeches):  # the pad, split in two where it would overlap the next region
        if i == 0:
            speech[0] = int(max(0, speech[0] - pad))
        if i != len(speeches) - 1:
            gap = speeches[i + 1][0] - speech[1]
            if gap < 2 * pad:
                speech[1] += int(gap // 2)
                speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - gap // 2))
            else:
                speech[1] = int(min(n_samples, speech[1] + pad))
                speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - pad))
        else:
            speech[1] = int(min(n_samples, speech[1] + pad))
    return [(int(a), int(b)) for a, b in speeches]


def pack_windows(regions, n_samples: int, window_samples: int, max_gap_samples: int) -> list[tuple[int, int]]:
    """Windows over the regions, greedy in time order: the next region joins the window while the window stays
    within window_samples and the pause before it is at most max_gap_samples; regions are never cut."""
    windows, start, prev_end = [], None, None
    for a, b in regions:
        if b - a > window_samples or not 0 <= a <= b <= n_samples:
            sys.exit(f"speech region [{a}, {b}) does not fit a window of {window_samples} samples")
        if start is not None and b - start <= window_samples and a - prev_end <= max_gap_samples:
            prev_end = b
            continue
        if start is not None:
            windows.append((start, prev_end))
        start, prev_end = a, b
    if start is not None:
        windows.append((start, prev_end))
    return windows


def speech_windows(bundle: Bundle, samples: np.ndarray) -> list[tuple[int, int]]:
    """The windows to transcribe: speech regions of at most the encoder's window, packed with pauses of at most
    2 s inside a window (the rule's defaults), each at least two mel frames long."""
    audio = bundle.manifest["audio"]
    window_s = min(audio["max_audio_clip_s"], bundle.manifest["encoder"]["window_frames"] * audio["hop_length"] / VAD_RATE)
    regions = speech_regions(vad_probabilities(bundle, samples), len(samples), {}, window_s)
    windows = pack_windows(regions, len(samples), round(window_s * VAD_RATE), round(VAD_DEFAULTS["max_gap_s"] * VAD_RATE))
    shortest = 2 * audio["hop_length"]
    return [(max(0, b - shortest), min(len(samples), max(0, b - shortest) + shortest)) if b - a < shortest else (a, b)
            for a, b in windows]


def length_masks(rule: dict, n: int, frames: int) -> dict:
    """The encoder's fp16 length masks for n valid mel frames of a window of `frames`: one per time
    resolution, L_0 = n, L_k = (L_k-1 + 2 * padding - kernel_size) // stride + 1 (docs/contract.md).
    Returns them and the window's encoder length L_S."""
    # Copied from shapes.LengthMasks of cohere-coreml (names, lengths, inputs): this file runs without the toolkit
    names = ["feature_mask"] + [f"subsampling_mask_{k}" for k in range(1, rule["stages"])] + ["encoder_mask"]
    lengths, sizes = [n], [frames]
    for _ in range(rule["stages"]):
        lengths.append((lengths[-1] + 2 * rule["padding"] - rule["kernel_size"]) // rule["stride"] + 1)
        sizes.append((sizes[-1] + 2 * rule["padding"] - rule["kernel_size"]) // rule["stride"] + 1)
    masks = {}
    for name, size, valid in zip(names, sizes, lengths):
        masks[name] = np.zeros((1, size), np.float16)
        masks[name][0, : max(0, min(valid, size))] = 1.0
    return masks, lengths[-1]


def encode(bundle: Bundle, samples: np.ndarray) -> dict:
    """One window's samples -> the encoder's outputs (front end, then encoder, both Core ML)."""
    m = bundle.manifest
    audio, n = m["audio"], len(samples)
    valid = (n + 2 * (audio["n_fft"] // 2) - audio["n_fft"]) // audio["hop_length"]  # mel frames of the clip
    if valid < 2:
        sys.exit(f"audio of {n} samples is too short (at least {2 * audio['hop_length']} are needed)")
    # the smallest encoder window that holds the clip ("main" unless the bundle has length buckets)
    fitting = sorted((f["frames"], name) for name, f in m["encoder"]["functions"].items() if f["frames"] >= valid)
    if not fitting:
        sys.exit(f"a window of {n} samples does not fit the encoder ({m['encoder']['window_frames']} frames)")
    frames, encoder_function = fitting[0]
    # the smallest front-end window that holds the samples and gives those frames
    frontend_function = min((f["samples"], name) for name, f in m["frontend"]["functions"].items()
                            if f["samples"] >= n and f["frames"] >= frames)[1]
    padded = np.zeros((1, m["frontend"]["functions"][frontend_function]["samples"]), np.float32)  # (1, S)
    padded[0, :n] = samples
    frontend = bundle.function("frontend", frontend_function, m["frontend"]["compute_units"])
    fe = frontend.predict({"audio": padded, "audio_length": np.array([n], np.int32)})
    features = np.ascontiguousarray(fe["input_features"][:, :, :frames])  # (1, n_mels, frames); 0 beyond `valid`
    if int(fe["feature_length"][0]) != valid:
        sys.exit("the front end gives another number of mel frames than the audio holds: broken bundle")
    # the encoder computes no lengths: the host passes its length masks (fp16 0/1, encoder.length_masks)
    masks, encoder_length = length_masks(m["encoder"]["length_masks"], valid, frames)
    # the encoder's programs in order (one, or its parts): each next part takes the hidden state
    parts = m["encoder"]["parts"]
    memory = bundle.function(parts[0]["file"], encoder_function).predict({"input_features": features, **masks})
    for part in parts[1:]:
        memory = bundle.function(part["file"], encoder_function).predict(
            {"hidden_states": memory["hidden_states_out"], "encoder_mask": masks["encoder_mask"]})
    memory = dict(memory)
    memory["encoder_length"] = np.array([encoder_length], np.int32)
    return memory


def decode(bundle: Bundle, memory: dict, prompt: list[int], max_new_tokens: int | None):
    """Greedy token ids of one window (the eos id included when reached, as generate() returns them), each
    token's probability (from the log_probs that chose it) and the decoder state (for the align function)."""
    d = bundle.manifest["decoder"]
    host = d.get("state_writes", "graph") == "host"  # who writes the decoder's state (docs/bundle.md)
    step = bundle.function("decoder", d["functions"]["step"])
    state = step.make_state()  # one state per window, used with every decoder function
    if host:  # the window's cross memory written into the state by this program, once
        for name, output in d["memory_states"].items():  # state -> the encoder output it holds (fp16)
            state.write_state(name, np.asarray(memory[output], np.float16))
        if int((memory["cross_mask"] > -5e3).sum()) != int(memory["encoder_length"][0]):
            sys.exit("the encoder's cross_mask and encoder_length disagree: broken bundle")
    else:  # by the bind function, once: bind input name -> the encoder output it takes
        bind = bundle.function("decoder", d["functions"]["bind"])
        bound = bind.predict({name: memory[output] for name, output in d["bind_inputs"].items()}, state=state)
        if int(bound["memory_length"][0]) != int(memory["encoder_length"][0]):
            sys.exit("bind_memory bound another number of frames than the encoder reports: broken bundle")

    def call(model, inputs: dict, start: int) -> np.ndarray:
        """One decoder call whose first token goes to cache slot `start`; its log_probs."""
        if host and "position" in inputs:  # the step: the host's mask of the filled slots
            mask = np.full((1, 1, 1, d["capacity"]), -1e4, np.float16)
            mask[..., :start] = 0
            inputs = {**inputs, d["cache_mask_input"]: mask}
        out = model.predict(inputs, state=state)
        if host:  # the call's new K/V rows (L, Hkv, S, Dh) into the cache at slots start..
            for name, output in d["row_outputs"].items():
                rows = np.asarray(out[output], np.float16)
                cache = np.array(state.read_state(name), np.float16)  # coremltools' MLState: whole buffers
                cache[:, :, start:start + rows.shape[2]] = rows
                state.write_state(name, cache)
        return out["log_probs"]  # (1, vocab)

    def feed(token: int, position: int) -> np.ndarray:  # a step takes only the token and its cache slot
        return call(step, {"input_ids": np.array([[token]], np.int32), "position": np.array([position], np.int32)},
                    position)

    if d["functions"].get("prefill") and len(prompt) == d["prefill_length"]:
        prefill = bundle.function("decoder", d["functions"]["prefill"])
        log_probs = call(prefill, {"input_ids": np.array([prompt], np.int32)}, 0)
    else:
        for position, token in enumerate(prompt):
            log_probs = feed(token, position)
    eos = set(bundle.manifest["tokens"]["eos_token_ids"])
    limit = min(max_new_tokens or d["max_new_tokens"], d["max_new_tokens"])  # what the cache holds, + 1
    tokens, probabilities, position = [], [], len(prompt)
    while True:
        token = int(np.argmax(log_probs))
        tokens.append(token)
        probabilities.append(float(np.exp(np.float64(log_probs.reshape(-1)[token]))))
        if token in eos or len(tokens) >= limit:  # the last prediction is emitted without being fed
            return tokens, probabilities, state
        log_probs = feed(token, position)
        position += 1


# ------------------------------------------------------------------------------------------------------
# Several windows at once (manifest decoder.batch): the rule of "Decoding several windows at once" in
# docs/bundle.md (cohere-transcribe-coreml), as the toolkit's `cohere_coreml.inference.batch_decoding`;
# its test vectors (tests/data/batch_decoding_vectors.json) check this copy too.
# ------------------------------------------------------------------------------------------------------
PAD_ID = 0  # the token a free row feeds (at slot 0, every slot closed: its output is not read)


class BatchStep:
    """The decoder's step_batch function and this program's writes into its state of B rows (docs/contract.md):
    row b is heads b*Hkv .. (b+1)*Hkv - 1 of self_k, self_v, cross_k, cross_v (every layer) and row b of
    cross_mask. The function only reads the state; coremltools' MLState reads and writes whole buffers, so each
    write reads a buffer, changes the row's part and writes it back (the new K/V rows: once a call for all rows)."""

    def __init__(self, bundle: Bundle):
        d = bundle.manifest["decoder"]
        if d.get("state_writes") != "host" or not d.get("functions", {}).get("step_batch"):
            sys.exit("manifest decoder.batch without a host-state step_batch function: broken bundle, re-export it "
                     "with `cohere-coreml export` (or run with --decoder-batch 1)")
        self.batch, self.capacity = int(d["batch"]["size"]), int(d["capacity"])
        self.kv_heads = int(d["num_key_value_heads"])
        self.memory_states, self.row_outputs = d["memory_states"], d["row_outputs"]
        self.mask_input = d["cache_mask_input"]
        self.model = bundle.function("decoder", d["functions"]["step_batch"])

    def make_state(self):
        """One state of B rows for the whole clip (step_batch's own layout, not the step's)."""
        return self.model.make_state()

    def bind_row(self, state, row: int, memory: dict) -> None:
        """A window's encoder outputs into row `row`; the row's self_k / self_v are left as they are (its
        cache_mask opens only slots its own window wrote)."""
        if int((memory["cross_mask"] > -5e3).sum()) != int(memory["encoder_length"][0]):
            sys.exit("the encoder's cross_mask and encoder_length disagree: broken bundle")
        h = self.kv_heads
        for name, output in self.memory_states.items():  # state -> the encoder output it holds (fp16)
            value = np.asarray(memory[output], np.float16)
            buffer = np.array(state.read_state(name), np.float16)
            part = (slice(row, row + 1),) if name == "cross_mask" else (slice(None), slice(row * h, (row + 1) * h))
            if buffer[part].shape != value.shape:
                sys.exit(f"the encoder's {name} is {value.shape}, a row of the decoder's batched state "
                         f"{buffer[part].shape}: encoder and decoder of different exports")
            buffer[part] = value
            state.write_state(name, buffer)

    def step(self, state, tokens: list[int], positions: list) -> np.ndarray:
        """One call: row b feeds tokens[b] at slot positions[b] (None: a free row); each busy row's new K/V rows
        are written at its slot. Returns the (B, vocab) log_probs (a free row's: not meaningful)."""
        ids = np.full((self.batch, 1), PAD_ID, np.int32)
        pos = np.zeros((self.batch,), np.int32)
        mask = np.full((self.batch, 1, 1, self.capacity), -1e4, np.float16)  # every slot closed
        for b, (token, position) in enumerate(zip(tokens, positions)):
            if position is not None:
                ids[b, 0], pos[b] = token, position
                mask[b, ..., :position] = 0  # the row's slots below its position: its own window's tokens
        out = self.model.predict({"input_ids": ids, "position": pos, self.mask_input: mask}, state=state)
        h = self.kv_heads
        for name, output in self.row_outputs.items():  # (L, B*Hkv, 1, Dh) -> self_k / self_v
            rows = np.asarray(out[output], np.float16)
            buffer = np.array(state.read_state(name), np.float16)
            for b, position in enumerate(positions):
                if position is not None:
                    buffer[:, b * h:(b + 1) * h, position:position + 1] = rows[:, b * h:(b + 1) * h]
            state.write_state(name, buffer)
        return np.asarray(out["log_probs"]).reshape(self.batch, -1)


def decode_windows(decoder, windows, prompt: list[int], eos_ids, max_new_tokens: int | None = None):
    """Greedy token ids of several windows, B (decoder.batch) at a time: `windows` yields (key, encoder outputs)
    pairs, read only when a row is free (at most B memories held). Yields (key, token ids with the eos reached,
    stop reason: "eos", "capacity" or "max_new_tokens") as windows finish, not in input order."""
    limit, at_limit = decoder.capacity - len(prompt) + 1, "capacity"  # every fed token takes a slot, the last not
    if max_new_tokens is not None and max_new_tokens < limit:
        limit, at_limit = max_new_tokens, "max_new_tokens"
    eos_ids = set(eos_ids)
    waiting = iter(windows)
    state = decoder.make_state()
    rows = [None] * decoder.batch  # a busy row: {"key", "pending" (prompt tokens to feed), "tokens"}
    positions = [0] * decoder.batch  # each row's next slot

    def refill() -> None:  # free rows take the waiting windows, in order
        for b in range(decoder.batch):
            if rows[b] is None:
                nxt = next(waiting, None)
                if nxt is None:
                    return
                key, memory = nxt
                decoder.bind_row(state, b, memory)  # the row's memory: this window's
                positions[b] = 0  # and its slots from 0 again (the previous window's rows then stay closed)
                rows[b] = {"key": key, "pending": list(prompt), "tokens": []}

    refill()
    while any(row is not None for row in rows):
        tokens = [PAD_ID if row is None else row["pending"][0] if row["pending"] else row["tokens"][-1] for row in rows]
        log_probs = decoder.step(state, tokens, [None if row is None else positions[b] for b, row in enumerate(rows)])
        for b, row in enumerate(rows):
            if row is None:
                continue
            positions[b] += 1
            if row["pending"]:
                row["pending"].pop(0)
                if row["pending"]:  # a prediction inside the prompt: not read
                    continue
            token = int(np.argmax(log_probs[b]))  # the first index on ties
            row["tokens"].append(token)
            stop = "eos" if token in eos_ids else at_limit if len(row["tokens"]) >= limit else None
            if stop is not None:
                rows[b] = None
                yield row["key"], row["tokens"], stop
        refill()  # finished windows leave, waiting ones take their rows before the next call


def decoder_batch(manifest: dict, asked: int | None) -> int:
    """Windows decoded at once: the bundle's decoder.batch.size (1 without one), or --decoder-batch (1 or that)."""
    present = int((manifest["decoder"].get("batch") or {}).get("size") or 1)
    if asked is None or asked == present:
        return present
    if asked == 1:
        return 1
    if asked < 1:
        sys.exit(f"--decoder-batch must be at least 1, got {asked}")
    if present == 1:
        sys.exit(f"--decoder-batch {asked}: this bundle's decoder has no batched step (no decoder.batch); re-export "
                 f"it with `cohere-coreml export --decoder-batch {asked}` or use --decoder-batch 1")
    sys.exit(f"--decoder-batch {asked}: this bundle's decoder decodes {present} windows at once (decoder.batch.size); "
             f"use --decoder-batch {present} or 1")


def detokenize(vocab: dict, ids: list[int]) -> str:
    """Pieces joined, special tokens (<|...|>, <unk>, <pad>) dropped, byte pieces <0xNN> as UTF-8."""
    data = bytearray()
    for i in ids:
        piece = vocab[str(i)]
        if piece.startswith("<0x") and piece.endswith(">"):
            data.append(int(piece[3:-1], 16))
        elif not (piece.startswith("<") and piece.endswith(">")):
            data += piece.encode("utf-8")
    return data.decode("utf-8", errors="replace").replace("\u2581", " ").strip()


# ------------------------------------------------------------------------------------------------------
# Word timings (--word-timestamps): the rule of docs/word-timings.md (cohere-transcribe-coreml), the same
# as the toolkit's `cohere_coreml.inference.alignment.align_words`; its test vectors check this copy too.
# ------------------------------------------------------------------------------------------------------
SENTENCE_ENDS = frozenset(".!?\u3002\uff01\uff1f")  # . ! ? and the full-width ones of ja/zh


def align_words(attention, pieces, probabilities, frame_seconds, offset_seconds=0.0, lead_rows=1, language=None,
                standardise=False, median_width=1, pause_factor=2.0) -> list[dict]:
    """Words of one window from `attention` (heads, rows, frames): the alignment heads' weights over the
    window's valid encoder frames for `lead_rows` rows before the text, one row per text token (the row
    predicting it) and the row predicting eos. Returns {"word", "start", "end", "probability", "tokens"}."""
    att = np.asarray(attention, dtype=np.float64)
    if att.ndim != 3 or att.shape[0] < 1 or att.shape[1] != lead_rows + len(pieces) + 1 or att.shape[2] < 1:
        sys.exit(f"attention of shape {att.shape} does not fit {len(pieces)} tokens and {lead_rows} lead rows")
    if not pieces:
        return []
    # log-weights (floored), optionally standardised per frame and median-filtered, then the mean over heads
    scores = np.log(np.maximum(att, 1e-10))
    if standardise:
        std = scores.std(axis=1, keepdims=True)
        scores = (scores - scores.mean(axis=1, keepdims=True)) / np.where(std > 0, std, 1.0)
    if median_width > 1:
        half = median_width // 2
        padded = np.concatenate([np.repeat(scores[..., :1], half, -1), scores, np.repeat(scores[..., -1:], half, -1)], -1)
        scores = np.median(np.lib.stride_tricks.sliding_window_view(padded, median_width, axis=-1), axis=-1)
    cost = (-scores.mean(axis=0)).tolist()
    # DTW from the first cell to the last; ties go to the diagonal, then the next row, then the next frame
    n, m = len(cost), len(cost[0])
    acc = [[0.0] + [np.inf] * m] + [[np.inf] * (m + 1) for _ in range(n)]
    move = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = (acc[i - 1][j - 1], acc[i - 1][j], acc[i][j - 1])
            move[i][j] = options.index(min(options))
            acc[i][j] = cost[i - 1][j - 1] + options[move[i][j]]
    starts, ends, i, j = [-1] * n, [0] * n, n, m
    while i > 0 and j > 0:  # back from the last cell: each row's first frame and last frame + 1
        starts[i - 1] = j - 1
        ends[i - 1] = max(ends[i - 1], j)
        i, j = (i - 1, j - 1) if move[i][j] == 0 else (i - 1, j) if move[i][j] == 1 else (i, j - 1)

    def time(boundary):  # the centre of the frame, at most the end of the last frame
        return offset_seconds + min(boundary + 0.5, m) * frame_seconds

    words = []
    for group in word_groups(pieces, language):
        words.append({"word": group_text(pieces, group), "start": time(starts[lead_rows + group[0]]),
                      "end": time(ends[lead_rows + group[-1]]), "tokens": group,
                      "probability": float(np.mean([probabilities[k] for k in group]))})
    if pause_factor > 0 and words:  # whisper's rule: long words at sentence boundaries are cut
        longest = pause_factor * min(0.7, float(np.median([w["end"] - w["start"] for w in words])))
        for k, w in enumerate(words):
            if w["end"] - w["start"] > longest:
                if k == 0 or words[k - 1]["word"][-1:] in SENTENCE_ENDS:
                    w["start"] = w["end"] - longest
                elif w["word"][-1:] in SENTENCE_ENDS:
                    w["end"] = w["start"] + longest
    return words


def piece_bytes(piece: str) -> bytes:
    """The UTF-8 bytes of a piece: <0xNN> is one byte, "\u2581" a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def group_text(pieces: list[str], group: list[int]) -> str:
    return b"".join(piece_bytes(pieces[k]) for k in group).decode("utf-8", errors="replace").strip()


def word_groups(pieces: list[str], language: str | None) -> list[list[int]]:
    """Token indices of each word: "\u2581" opens a word (ja, zh: each character is one); a word without a
    letter or digit (punctuation) joins the word before it, or the next one when it comes first."""
    groups, pending, buffer = [], [], b""
    for k, piece in enumerate(pieces):
        if language not in ("ja", "zh"):
            if piece.startswith("\u2581") or not groups:
                groups.append([k])
            else:
                groups[-1].append(k)
            continue
        pending, buffer = pending + [k], buffer + piece_bytes(piece)
        try:
            text = buffer.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the first bytes of a character: wait for the rest
        if text.strip() or not groups:
            groups.append(pending)
        else:  # a bare space belongs to the character before it
            groups[-1].extend(pending)
        pending, buffer = [], b""
    if pending:
        groups.append(pending)
    merged, carry = [], []
    for group in groups:
        if not any(unicodedata.category(ch)[0] in "LN" for ch in group_text(pieces, group)):
            if merged:
                merged[-1].extend(group)
            else:
                carry.extend(group)
        else:
            merged.append(carry + group)
            carry = []
    return merged + [carry] if carry else merged


def window_words(bundle: Bundle, state, prompt: list[int], text_ids: list[int], probabilities: list[float],
                 encoder_length: int, start_s: float, end_s: float, language: str) -> list[dict]:
    """One window's words: the decoder's align function after the window's decoding, on the same state (its
    self cache holds the window's tokens, its cross memory is the window's), K tokens a call from the first
    row the rule reads; those rows and the valid frames cut, the rule above, times clamped to the window."""
    d, a = bundle.manifest["decoder"], bundle.manifest["decoder"]["alignment"]
    capacity, k = d["capacity"], a["length"]
    fit = capacity - len(prompt)  # a window that filled the cache: its last token has no slot to be timed by
    text_ids, probabilities = text_ids[:fit], probabilities[:fit]
    if not text_ids:
        return []
    ids = prompt + text_ids
    first = len(prompt) - 1 - a["lead_rows"]  # the first row the rule reads (row p predicts token p + 1)
    rows = None
    align = bundle.function("decoder", a["function"])
    start = first
    while start < len(ids):
        start = min(start, capacity - k)  # a call never passes the cache
        padded = np.zeros((1, k), np.int32)  # the call's tokens, then padding (slots causal among themselves)
        part = ids[start:start + k]
        padded[0, :len(part)] = part
        mask = np.full((1, 1, 1, capacity), -1e4, np.float16)  # the decoded tokens' slots before the call: open
        mask[..., :start] = 0
        out = align.predict({"input_ids": padded, "position": np.array([start], np.int32), "cache_mask": mask},
                            state=state)
        weights = np.asarray(out["cross_attention"], np.float32)[0]  # (heads, K, frames): row i is slot start + i
        if rows is None:
            rows = np.zeros((weights.shape[0], len(ids) - first, encoder_length), np.float32)
        lo = max(start, first)
        hi = min(start + k, len(ids))
        rows[:, lo - first:hi - first] = weights[:, lo - start:hi - start, :encoder_length]
        start += k
    words = align_words(rows, [bundle.vocab[str(i)] for i in text_ids], probabilities, a["frame_seconds"],
                        offset_seconds=start_s, lead_rows=a["lead_rows"], language=language)
    for w in words:
        del w["tokens"]
        w["start"], w["end"] = (round(min(max(w[key], start_s), end_s), 3) for key in ("start", "end"))
        w["probability"] = round(w["probability"], 3)
    return words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("audio", help="audio file (wav, flac, ...) at the model's sampling rate (16 kHz)")
    p.add_argument("--language", default="en", help="language code (manifest.json: languages)")
    p.add_argument("--no-punctuation", action="store_true", help="the prompt without punctuation and casing")
    p.add_argument("--max-new-tokens", type=int, default=None, help="stop a window after N tokens")
    p.add_argument("--json", action="store_true", help="print text and token ids per window as JSON")
    p.add_argument("--word-timestamps", action="store_true",
                   help="each word's start and end (seconds) and probability (the bundle's decoder.alignment)")
    p.add_argument("--vad", default="auto", choices=("auto", "on", "off"),
                   help="transcribe only the windows of speech the bundle's vad.mlpackage finds; auto: when the "
                   "bundle has one (default: auto)")
    p.add_argument("--decoder-batch", type=int, default=None, metavar="B",
                   help="a clip of several windows: decode B windows at once through the decoder's step_batch "
                   "(greedy, without --word-timestamps; the same tokens per window); 1 = one window at a time. "
                   "Default: the bundle's (manifest decoder.batch.size, 1 without one)")
    p.add_argument("--bundle", default=str(BUNDLE), help="bundle folder (default: this file's folder)")
    p.add_argument("--compiled-cache", default=None,
                   help="keep the compiled models in this folder, so later runs skip Core ML's compile "
                   "(default: a temporary folder; never a folder inside an app bundle)")
    args = p.parse_args()
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        sys.exit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")

    bundle = Bundle(Path(args.bundle), cache=args.compiled_cache)
    m = bundle.manifest
    batch = decoder_batch(m, args.decoder_batch)
    if args.language not in m["languages"]:
        sys.exit(f"language {args.language!r} is not in this bundle: {' '.join(sorted(m['languages']))}")
    prompt = m["languages"][args.language]["no_punctuation" if args.no_punctuation else "punctuation"]
    if args.word_timestamps and not m["decoder"].get("alignment"):
        sys.exit(f"this bundle has no word alignment ({m['decoder'].get('alignment_note') or 'no decoder.alignment'}): "
                 "export it with `cohere-coreml export --alignment-heads auto`")
    has_vad = bool(m.get("vad")) and "vad" in m["files"]
    if args.vad == "on" and not has_vad:
        sys.exit(f"bundle {args.bundle} has no vad.mlpackage: re-export with `cohere-coreml export --vad` (the default)")
    eos = set(m["tokens"]["eos_token_ids"])
    rate = m["audio"]["sampling_rate"]
    samples = read_audio(args.audio, rate)
    use_vad = has_vad and args.vad != "off"
    ranges = speech_windows(bundle, samples) if use_vad else split_points(samples, m["audio"])
    windows = []
    if batch > 1 and len(ranges) > 1 and not args.word_timestamps:  # B windows at a time (decoder.batch)
        memories = ((i, encode(bundle, samples[start:end])) for i, (start, end) in enumerate(ranges))  # as rows free
        done = {i: ids for i, ids, _ in decode_windows(BatchStep(bundle), memories, prompt, eos, args.max_new_tokens)}
        for i, (start, _) in enumerate(ranges):  # in the clip's order (windows finish out of order)
            text_ids = [t for t in done[i] if t not in eos]
            windows.append({"start_s": start / rate, "token_ids": done[i], "text": detokenize(bundle.vocab, text_ids)})
    else:  # one window at a time
        for start, end in ranges:
            memory = encode(bundle, samples[start:end])
            ids, probabilities, state = decode(bundle, memory, prompt, args.max_new_tokens)
            text_ids = [i for i in ids if i not in eos]
            windows.append({"start_s": start / rate, "token_ids": ids, "text": detokenize(bundle.vocab, text_ids)})
            if args.word_timestamps:
                windows[-1]["words"] = window_words(bundle, state, prompt, text_ids, probabilities[:len(text_ids)],
                                                    int(memory["encoder_length"][0]), start / rate, end / rate,
                                                    args.language)
    separator = "" if args.language in m["generation"]["no_space_languages"] else " "
    text = separator.join(w["text"] for w in windows if w["text"])
    words = [w for window in windows for w in window.get("words", [])]
    if args.json:
        print(json.dumps({"text": text, "windows": windows, **({"words": words} if args.word_timestamps else {})},
                         ensure_ascii=False))
    else:
        print(text)
        for w in words:
            print(f"[{w['start']:.3f}-{w['end']:.3f}] {w['word']} ({w['probability']:.3f})")  # as cohere-coreml


if __name__ == "__main__":
    main()
