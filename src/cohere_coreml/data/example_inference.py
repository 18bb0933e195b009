#!/usr/bin/env python
"""Transcribe an audio file with this bundle's Core ML packages (numpy, soundfile, coremltools only).

    pip install numpy soundfile coremltools
    python example_inference.py audio.wav --language en [--no-punctuation] [--json]

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
                         a window's memory into a fresh state (once per window), the functions the cache

Every name and size below comes from manifest.json. The steps are those of "Decoding loop" in
docs/bundle.md (cohere-transcribe-coreml): greedy decoding, audio longer than 30 s cut into
windows at its quietest points as the model's processor cuts it.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
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


def decode(bundle: Bundle, memory: dict, prompt: list[int], max_new_tokens: int | None) -> list[int]:
    """Greedy token ids of one window (the eos id included when reached, as generate() returns them)."""
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
    tokens, position = [], len(prompt)
    while True:
        token = int(np.argmax(log_probs))
        tokens.append(token)
        if token in eos or len(tokens) >= limit:  # the last prediction is emitted without being fed
            return tokens
        log_probs = feed(token, position)
        position += 1


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("audio", help="audio file (wav, flac, ...) at the model's sampling rate (16 kHz)")
    p.add_argument("--language", default="en", help="language code (manifest.json: languages)")
    p.add_argument("--no-punctuation", action="store_true", help="the prompt without punctuation and casing")
    p.add_argument("--max-new-tokens", type=int, default=None, help="stop a window after N tokens")
    p.add_argument("--json", action="store_true", help="print text and token ids per window as JSON")
    p.add_argument("--bundle", default=str(BUNDLE), help="bundle folder (default: this file's folder)")
    p.add_argument("--compiled-cache", default=None,
                   help="keep the compiled models in this folder, so later runs skip Core ML's compile "
                   "(default: a temporary folder; never a folder inside an app bundle)")
    args = p.parse_args()
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        sys.exit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")

    bundle = Bundle(Path(args.bundle), cache=args.compiled_cache)
    m = bundle.manifest
    if args.language not in m["languages"]:
        sys.exit(f"language {args.language!r} is not in this bundle: {' '.join(sorted(m['languages']))}")
    prompt = m["languages"][args.language]["no_punctuation" if args.no_punctuation else "punctuation"]
    eos = set(m["tokens"]["eos_token_ids"])
    samples = read_audio(args.audio, m["audio"]["sampling_rate"])
    windows = []
    for start, end in split_points(samples, m["audio"]):
        ids = decode(bundle, encode(bundle, samples[start:end]), prompt, args.max_new_tokens)
        windows.append({"start_s": start / m["audio"]["sampling_rate"], "token_ids": ids,
                        "text": detokenize(bundle.vocab, [i for i in ids if i not in eos])})
    separator = "" if args.language in m["generation"]["no_space_languages"] else " "
    text = separator.join(w["text"] for w in windows if w["text"])
    print(json.dumps({"text": text, "windows": windows}, ensure_ascii=False) if args.json else text)


if __name__ == "__main__":
    main()
