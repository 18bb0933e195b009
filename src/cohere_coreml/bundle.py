"""Bundle: everything a client needs next to the two `.mlpackage`s, without our Python checkpoint.

An export folder ("bundle") holds

    encoder.mlpackage        features -> cross-attention memory (see docs/contract.md)
    decoder.mlpackage        stateful decode step (see docs/decoder.md)
    manifest.json            this module: ids, prompts, shapes, capacities, file names
    vocab.json               id -> SentencePiece piece (cohere_coreml.tokens.export_vocab)
    tokenizer.json, tokenizer_config.json, processor_config.json
                             the checkpoint's tokenizer and feature-extractor settings

The manifest format is documented for Swift developers in docs/bundle.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "cohere-coreml-bundle"
FORMAT_VERSION = 1
ENCODER_FILE = "encoder.mlpackage"
DECODER_FILE = "decoder.mlpackage"
VOCAB_FILE = "vocab.json"


class BundleError(ValueError):
    """A bundle folder is missing files or carries an unreadable / inconsistent manifest."""


def _eos_ids(model) -> list[int]:
    """eos ids from the generation config (falls back to the model config), as a list."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise BundleError("the checkpoint defines no eos_token_id (config or generation config)")
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def language_prompts(tokenizer) -> dict[str, dict[str, list[int]]]:
    """{language: {"punctuation": ids, "no_punctuation": ids}} for the 14 languages."""
    from .tokens import LANGUAGES, prompt_ids

    return {
        lang: {
            "punctuation": prompt_ids(tokenizer, lang, punctuation=True),
            "no_punctuation": prompt_ids(tokenizer, lang, punctuation=False),
        }
        for lang in LANGUAGES
    }


def package_io(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """{"inputs"|"outputs"|"states": {name: {"shape": [...], "dtype": str}}} read from a package spec."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(path))
    dtypes = {65568: "float32", 65552: "float16", 131104: "int32", 65600: "float64"}

    def arr(t):
        return {"shape": [int(d) for d in t.shape], "dtype": dtypes.get(int(t.dataType), str(t.dataType))}

    desc = spec.description
    io: dict[str, dict[str, Any]] = {"inputs": {}, "outputs": {}, "states": {}}
    for f in desc.input:
        io["inputs"][f.name] = arr(f.type.multiArrayType)
    for f in desc.output:
        io["outputs"][f.name] = arr(f.type.multiArrayType)
    for f in getattr(desc, "state", []):
        io["states"][f.name] = arr(f.type.stateType.arrayType)
    return io


def encoder_buckets(path: str | os.PathLike) -> dict | None:
    """{function: {"frames", "window_seconds"}} of a length-bucketed encoder package, else None."""
    import coremltools as ct

    raw = ct.utils.load_spec(str(path)).description.metadata.userDefined.get("com.cohere_coreml.buckets")
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return {fn: {"frames": int(v["frames"]), "window_seconds": float(v["window_seconds"])} for fn, v in data.items()}
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: unreadable bucket metadata: {err}") from err


def build_manifest(
    model,
    tokenizer,
    front_end: dict,
    decoder_info: dict,
    encoder_io: dict | None = None,
    decoder_io: dict | None = None,
    model_id: str = "unknown",
    revision: str | None = None,
    precision: str = "fp16",
    window_frames: int | None = None,
    extra: dict | None = None,
    encoder_functions: dict | None = None,
) -> dict:
    """The manifest dict (see docs/bundle.md). Every id and size is read from `model`/`tokenizer`."""
    from . import __version__
    from .convert import git_hash
    from .tokens import NO_SPACE_LANGUAGES

    config = model.config
    shapes = decoder_info["shapes"]
    prompts = language_prompts(tokenizer)
    prompt_len = len(next(iter(prompts.values()))["punctuation"])
    gen = getattr(model, "generation_config", None)
    upstream_max_new = int(getattr(gen, "max_new_tokens", None) or 256)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model_id": model_id,
        "revision": revision,
        "tool_version": __version__,
        "tool_git_hash": git_hash(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "precision": precision,
        "files": {
            "encoder": ENCODER_FILE,
            "decoder": DECODER_FILE,
            "vocab": VOCAB_FILE,
            "tokenizer": "tokenizer.json",
            "tokenizer_config": "tokenizer_config.json",
            "processor_config": "processor_config.json",
        },
        "audio": {**front_end, "window_frames": window_frames},
        "encoder": {
            "window_frames": window_frames,
            "encoder_frames": decoder_info.get("encoder_frames"),
            "memory_len": shapes["memory_len"],
            "num_mel_bins": int(config.encoder_config.num_mel_bins),
            # length buckets of a multifunction encoder: function -> {"frames", "window_seconds"}
            # (outputs of every function are padded to the full window's memory_len)
            "functions": encoder_functions or {"main": {"frames": window_frames}},
            "io": encoder_io,
        },
        "decoder": {
            "capacity": shapes["capacity"],
            "prompt_length": prompt_len,
            # most tokens one window can emit: every cache slot holds a fed token, the last
            # prediction is emitted without being fed
            "max_new_tokens": shapes["capacity"] - prompt_len + 1,
            "num_layers": shapes["num_layers"],
            "num_attention_heads": shapes["num_heads"],
            "num_key_value_heads": shapes["num_kv_heads"],
            "head_dim": shapes["head_dim"],
            "hidden_size": shapes["hidden_size"],
            "vocab_size": shapes["vocab_size"],
            "cache_shape": [shapes["num_layers"], shapes["num_kv_heads"], shapes["capacity"], shapes["head_dim"]],
            "memory_shape": [shapes["num_layers"], shapes["num_kv_heads"], shapes["memory_len"], shapes["head_dim"]],
            "output": "log_probs",
            # functions of decoder.mlpackage: "step" is the default function; "prefill" (optional)
            # takes the whole prompt (1, prefill_length) in one call and shares the step's state
            "functions": decoder_info.get("functions") or {"step": "main", "prefill": None},
            "prefill_length": decoder_info.get("prefill_length"),
            "io": decoder_io,
        },
        "tokens": {
            "eos_token_ids": _eos_ids(model),
            "eos_token_id": _eos_ids(model)[0],
            "pad_token_id": config.pad_token_id,
            "bos_token_id": config.bos_token_id,
            "decoder_start_token_id": config.decoder_start_token_id,
            "vocab_size": int(config.vocab_size),
        },
        "generation": {
            "strategy": "greedy",
            "upstream_max_new_tokens": upstream_max_new,
            "no_space_languages": sorted(NO_SPACE_LANGUAGES),
        },
        "languages": prompts,
    }
    if extra:
        manifest.update(extra)
    return manifest


def write_bundle_files(out_dir: str | os.PathLike, model, processor, decoder_info: dict,
                       model_id: str = "unknown", revision: str | None = None, precision: str = "fp16",
                       window_frames: int | None = None) -> Path:
    """Write tokenizer files, vocab.json and manifest.json into `out_dir` (each atomically).

    The packages are expected in `out_dir` already (their I/O is read into the manifest).
    """
    from .audio import FrontEndConfig
    from .tokens import export_vocab

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = processor.tokenizer
    # processor files (tokenizer + feature extractor settings) via a temp folder, then moved in
    tmp = Path(tempfile.mkdtemp(prefix=".processor.", dir=out_dir))
    try:
        processor.save_pretrained(tmp)
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    export_vocab(tokenizer, out_dir / VOCAB_FILE)
    front_end = FrontEndConfig.from_processor(processor, dither=0.0).to_dict()
    enc_pkg, dec_pkg = out_dir / ENCODER_FILE, out_dir / DECODER_FILE
    manifest = build_manifest(
        model, tokenizer, front_end, decoder_info,
        encoder_functions=encoder_buckets(enc_pkg) if enc_pkg.exists() else None,
        encoder_io=package_io(enc_pkg) if enc_pkg.exists() else None,
        decoder_io=package_io(dec_pkg) if dec_pkg.exists() else None,
        model_id=model_id, revision=revision, precision=precision, window_frames=window_frames,
    )
    from .convert import write_json_atomic

    write_json_atomic(manifest, out_dir / MANIFEST_NAME)
    logger.info("wrote %s", out_dir / MANIFEST_NAME)
    return out_dir / MANIFEST_NAME


@dataclass
class Bundle:
    """A loaded bundle: the manifest plus resolved file paths (searched over one or more folders)."""

    dirs: list[Path]
    manifest: dict
    paths: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, dirs: str | os.PathLike | Sequence[str | os.PathLike]) -> "Bundle":
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = [Path(d) for d in dirs]
        if not dirs:
            raise BundleError("no bundle folder given")
        for d in dirs:
            if not d.is_dir():
                raise BundleError(f"bundle folder {d} does not exist")
        manifest_path = next((d / MANIFEST_NAME for d in dirs if (d / MANIFEST_NAME).is_file()), None)
        if manifest_path is None:
            raise BundleError(
                f"no {MANIFEST_NAME} in {', '.join(map(str, dirs))}: export the bundle with `cohere-coreml export`"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise BundleError(f"{manifest_path} is not readable JSON: {err}") from err
        if manifest.get("format") != FORMAT_NAME:
            raise BundleError(f"{manifest_path} is not a {FORMAT_NAME} manifest")
        if int(manifest.get("format_version", -1)) > FORMAT_VERSION:
            raise BundleError(
                f"{manifest_path} has format_version {manifest['format_version']}; this tool reads up to {FORMAT_VERSION}"
            )
        bundle = cls(dirs=dirs, manifest=manifest)
        for key in ("encoder", "decoder", "vocab", "tokenizer"):
            name = manifest["files"][key]
            found = next((d / name for d in dirs if (d / name).exists()), None)
            if found is None:
                raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
            bundle.paths[key] = found
        bundle.paths["tokenizer_dir"] = bundle.paths["tokenizer"].parent
        return bundle

    # convenience accessors ------------------------------------------------------------------
    @property
    def eos_ids(self) -> set[int]:
        return {int(i) for i in self.manifest["tokens"]["eos_token_ids"]}

    @property
    def capacity(self) -> int:
        return int(self.manifest["decoder"]["capacity"])

    @property
    def window_frames(self) -> int:
        return int(self.manifest["encoder"]["window_frames"])

    @property
    def languages(self) -> list[str]:
        return sorted(self.manifest["languages"])

    def prompt(self, language: str, punctuation: bool = True) -> list[int]:
        from .tokens import UnknownLanguageError

        if language not in self.manifest["languages"]:
            raise UnknownLanguageError(language)
        return [int(i) for i in self.manifest["languages"][language]["punctuation" if punctuation else "no_punctuation"]]


def export_decoder_bundle(model, processor, settings, max_new_tokens: int = 256, capacity: int | None = None,
                          backend: str = "mil", prefill: bool = False) -> dict:
    """Export decoder.mlpackage (parity-gated) and write manifest.json, vocab.json and tokenizer files.

    The encoder side (`cohere_coreml.encoder.convert_encoder`) decides the window; its shapes
    (window frames F, encoder frames T, padded Tp) are recomputed here the same way so the two
    packages fit each other. `prefill` adds the one-call prompt function (multifunction package).
    Returns the `convert_decoder` result (path, shapes, parity, written)
    plus "manifest" (its path).
    """
    from .decoder import convert_decoder, default_capacity
    from .encoder import encoder_shapes
    from .tokens import prompt_ids

    from .config import CONTROL_LANGUAGE, GATE_LANGUAGE

    enc_shapes = encoder_shapes(model, settings.window_seconds, processor)
    prompt = prompt_ids(processor.tokenizer, GATE_LANGUAGE)
    control_prompt = prompt_ids(processor.tokenizer, CONTROL_LANGUAGE, punctuation=False)
    capacity = int(capacity) if capacity else default_capacity(max_new_tokens, prompt_len=len(prompt))
    dec_path = settings.package_path("decoder")
    from .convert import skip_existing

    if skip_existing(dec_path, settings.force):
        from .decoder import DecoderShapes

        shapes = DecoderShapes.from_config(model.config, capacity, enc_shapes.padded_frames).to_dict()
        io = package_io(dec_path)
        if io["states"]["self_k"]["shape"][2] != capacity or io["inputs"]["cross_k"]["shape"][2] != enc_shapes.padded_frames:
            raise BundleError(f"{dec_path} has other shapes than requested; use --force to re-export")
        from .runtime import read_package

        from .decoder import PREFILL_FUNCTION

        has_prefill = PREFILL_FUNCTION in read_package(dec_path).function_names
        result = {"path": str(dec_path), "shapes": shapes, "parity": None, "written": False,
                  "functions": {"step": "main", "prefill": PREFILL_FUNCTION if has_prefill else None},
                  "prefill_length": len(prompt) if has_prefill else None}
    else:
        result = convert_decoder(model, settings, capacity=capacity, memory_len=enc_shapes.padded_frames,
                                 prompt=prompt, backend=backend, prefill=prefill, control_prompt=control_prompt)
    decoder_info = {"shapes": result["shapes"], "encoder_frames": enc_shapes.encoder_frames,
                    "functions": result.get("functions"), "prefill_length": result.get("prefill_length")}
    source = getattr(model, "source", None)
    manifest = write_bundle_files(
        settings.out_dir, model, processor, decoder_info,
        model_id=settings.model_id if settings.model_id != "unknown" else str(getattr(source, "model_id", "unknown")),
        revision=settings.revision or getattr(source, "revision", None), precision=settings.precision,
        window_frames=enc_shapes.frames,
    )
    return {**result, "manifest": str(manifest)}
