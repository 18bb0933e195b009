"""Bundle: everything a client needs next to the `.mlpackage`s, without our Python checkpoint.

The manifest is written last, by `write_bundle`, from the packages on disk (their specs and
metadata) and the checkpoint's tokenizer and config: exporting any one component refreshes it,
and it never describes a package that is not there. An export folder ("bundle") holds

    frontend.mlpackage       16 kHz samples -> the encoder's input_features (cohere_coreml.frontend)
    encoder.mlpackage        features -> cross-attention memory (see docs/contract.md)
    decoder.mlpackage        stateful decode step (see docs/decoder.md)
    manifest.json            this module: ids, prompts, shapes, capacities, file names; and, from
                             cohere_coreml.integrity, preset, recipe, min_os and the sha256 + size
                             of every other file (`write_manifest`)
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import BUCKETS_METADATA_KEY, FRONTEND_FUNCTIONS_METADATA_KEY, PREFILL_FUNCTION
from .integrity import MANIFEST_NAME

logger = logging.getLogger(__name__)

FORMAT_NAME = "cohere-coreml-bundle"
FORMAT_VERSION = 1
ENCODER_FILE = "encoder.mlpackage"
DECODER_FILE = "decoder.mlpackage"
FRONTEND_FILE = "frontend.mlpackage"
VOCAB_FILE = "vocab.json"
FILES = {"encoder": ENCODER_FILE, "frontend": FRONTEND_FILE, "decoder": DECODER_FILE}


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


def package_io(path: str | os.PathLike, function_name: str | None = None) -> dict[str, dict[str, Any]]:
    """{"inputs"|"outputs"|"states": {name: {"shape": [...], "dtype": str}}} of a package's function
    (default: its default function), read from its spec (`cohere_coreml.runtime.package.describe`)."""
    import numpy as np

    from .runtime.package import describe, read_package

    described = describe(read_package(path, function_name=function_name))
    return {
        kind: {name: {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name}
               for name, (shape, dtype) in features.items()}
        for kind, features in zip(("inputs", "outputs", "states"), described)
    }


def package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The package's user-defined metadata (`com.cohere_coreml.*`, written by `convert_module`)."""
    from .runtime.package import read_package

    return dict(read_package(path).spec.description.metadata.userDefined)


def encoder_buckets(path: str | os.PathLike) -> dict | None:
    """{function: {"frames", "window_seconds"}} of a length-bucketed encoder package, else None."""
    raw = package_metadata(path).get(BUCKETS_METADATA_KEY)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return {fn: {"frames": int(v["frames"]), "window_seconds": float(v["window_seconds"])} for fn, v in data.items()}
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: unreadable bucket metadata: {err}") from err


def encoder_package_info(path: str | os.PathLike) -> dict:
    """Window, encoder frames, memory length, functions and I/O of an exported encoder package."""
    meta = package_metadata(path)
    buckets = encoder_buckets(path)
    try:
        if buckets is not None:
            main = json.loads(meta[BUCKETS_METADATA_KEY])["main"]
            frames, t, tp = int(main["frames"]), int(main["encoder_frames"]), int(main["padded_frames"])
        else:
            frames = int(meta["com.cohere_coreml.window_frames"])
            t = int(meta["com.cohere_coreml.encoder_frames"])
            tp = int(meta["com.cohere_coreml.padded_encoder_frames"])
    except (KeyError, ValueError, TypeError) as err:
        raise BundleError(f"{path} lacks the encoder metadata of cohere-coreml ({err}): re-export it") from err
    functions = buckets or {"main": {"frames": frames}}
    for fn in functions:  # every function's I/O (a length bucket takes fewer frames than "main")
        functions[fn]["io"] = package_io(path, function_name=fn)
    return {"window_frames": frames, "encoder_frames": t, "memory_len": tp,
            "functions": functions, "precision": meta.get("com.cohere_coreml.precision"),
            "io": functions["main"]["io"]}


def frontend_package_info(path: str | os.PathLike) -> dict:
    """Functions (window seconds, samples, frames, I/O of each), I/O, compute units and precision of
    an exported front-end package (the manifest's "frontend" section)."""
    from .runtime.package import read_package

    meta = package_metadata(path)
    try:
        raw = json.loads(meta[FRONTEND_FUNCTIONS_METADATA_KEY])
        functions = {fn: {"window_seconds": float(v["window_seconds"]), "samples": int(v["samples"]),
                          "frames": int(v["frames"])} for fn, v in raw.items()}
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise BundleError(f"{path} lacks the front-end metadata of cohere-coreml ({err}): re-export it") from err
    present = read_package(path).function_names
    missing = sorted(set(functions) - set(present)) + ([] if "main" in functions else ["main"])
    if missing:
        raise BundleError(f"{path}: function(s) {missing} described in its metadata are not in the package "
                          f"(it has {sorted(present)}): re-export it")
    for fn in functions:
        functions[fn]["io"] = package_io(path, function_name=fn)
    return {"functions": functions, "io": package_io(path), "compute_units": meta.get("com.cohere_coreml.compute_units"),
            "precision": meta.get("com.cohere_coreml.precision")}


def decoder_package_info(path: str | os.PathLike) -> dict:
    """Shapes, functions and I/O of an exported decoder package."""
    from .runtime.package import describe, read_package

    meta = package_metadata(path)
    try:
        shapes = json.loads(meta["com.cohere_coreml.decoder_shapes"])
    except (KeyError, ValueError) as err:
        raise BundleError(f"{path} lacks the decoder metadata of cohere-coreml ({err}): re-export it") from err
    functions = read_package(path).function_names
    prefill = PREFILL_FUNCTION if PREFILL_FUNCTION in functions else None
    prefill_length = None
    if prefill:
        inputs, _, _ = describe(read_package(path, function_name=PREFILL_FUNCTION))
        prefill_length = int(inputs["input_ids"][0][1])
    return {"shapes": shapes, "functions": {"step": "main", "prefill": prefill}, "prefill_length": prefill_length,
            "precision": meta.get("com.cohere_coreml.precision"), "io": package_io(path),
            "prefill_io": package_io(path, function_name=prefill) if prefill else None}


def build_manifest(model, tokenizer, front_end: dict, encoder: dict | None, decoder: dict | None,
                   model_id: str = "unknown", revision: str | None = None, frontend: dict | None = None) -> dict:
    """The manifest dict (see docs/bundle.md) of the packages described by `encoder`/`decoder`/
    `frontend` (`encoder_package_info` / `decoder_package_info` / `frontend_package_info`, None when
    absent). Every id and size is read from the packages, `model` and `tokenizer`."""
    from . import __version__
    from .convert import git_hash
    from .tokens import NO_SPACE_LANGUAGES

    config = model.config
    packages = {name: info for name, info in (("encoder", encoder), ("decoder", decoder)) if info is not None}
    # (a length-bucketed encoder records no precision of its own: its functions' metadata is per function)
    precisions = {info["precision"] for info in packages.values() if info["precision"] is not None}
    if len(precisions) > 1:
        raise BundleError(f"the packages have different precisions {sorted(map(str, precisions))}: re-export one")
    if encoder is not None and decoder is not None and encoder["memory_len"] != decoder["shapes"]["memory_len"]:
        raise BundleError(
            f"decoder.mlpackage reads a memory of {decoder['shapes']['memory_len']} frames but encoder.mlpackage "
            f"gives {encoder['memory_len']}: export both with the same window (use --force)"
        )
    if encoder is not None and frontend is not None and frontend["functions"]["main"]["frames"] != encoder["window_frames"]:
        raise BundleError(
            f"frontend.mlpackage gives {frontend['functions']['main']['frames']} mel frames but encoder.mlpackage "
            f"reads {encoder['window_frames']}: export both with the same window (use --force)"
        )
    prompts = language_prompts(tokenizer)
    prompt_len = len(next(iter(prompts.values()))["punctuation"])
    gen = getattr(model, "generation_config", None)
    upstream_max_new = int(getattr(gen, "max_new_tokens", None) or 256)
    window_frames = encoder["window_frames"] if encoder is not None else None
    files = {name: FILES[name] for name in packages}
    if frontend is not None:
        files["frontend"] = FRONTEND_FILE
    files.update({"vocab": VOCAB_FILE, "tokenizer": "tokenizer.json", "tokenizer_config": "tokenizer_config.json",
                  "processor_config": "processor_config.json"})
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model_id": model_id,
        "revision": revision,
        "tool_version": __version__,
        "tool_git_hash": git_hash(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "precision": next(iter(precisions), None),
        "files": files,
        "audio": {**front_end, "window_frames": window_frames},
    }
    if frontend is not None:
        # frontend.mlpackage: one window of samples -> the encoder's input_features + feature_length;
        # an fp32 program meant for CPU/GPU; one function per encoder window (the encoder's names)
        manifest["frontend"] = {
            "compute_units": frontend["compute_units"],
            "precision": frontend["precision"],
            "functions": frontend["functions"],  # function -> {"window_seconds", "samples", "frames", "io"}
            "io": frontend["io"],
        }
    if encoder is not None:
        manifest["encoder"] = {
            "window_frames": window_frames,
            "encoder_frames": encoder["encoder_frames"],
            "memory_len": encoder["memory_len"],
            "num_mel_bins": int(config.encoder_config.num_mel_bins),
            # functions of encoder.mlpackage: function -> {"frames", "window_seconds" (buckets), "io"}
            # (outputs of every function are padded to the full window's memory_len)
            "functions": encoder["functions"],
            "io": encoder["io"],  # the "main" function's (the full window)
        }
    if decoder is not None:
        shapes = decoder["shapes"]
        manifest["decoder"] = {
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
            "functions": decoder["functions"],
            "prefill_length": decoder["prefill_length"],
            "io": decoder["io"],  # the step function's
            "prefill_io": decoder.get("prefill_io"),  # the prefill function's (None without prefill)
        }
    manifest["tokens"] = {
        "eos_token_ids": _eos_ids(model),
        "eos_token_id": _eos_ids(model)[0],
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "decoder_start_token_id": config.decoder_start_token_id,
        "vocab_size": int(config.vocab_size),
    }
    manifest["generation"] = {
        "strategy": "greedy",
        "upstream_max_new_tokens": upstream_max_new,
        "no_space_languages": sorted(NO_SPACE_LANGUAGES),
    }
    manifest["languages"] = prompts
    return manifest


def write_bundle(out_dir: str | os.PathLike, model, processor) -> Path:
    """Write tokenizer files, vocab.json and, last, manifest.json into `out_dir` (each atomically).

    The manifest describes the packages found in `out_dir` (read from their specs and metadata)
    and the checkpoint `model`/`processor` they were exported from.
    """
    from .audio import FrontEndConfig
    from .tokens import export_vocab

    from . import faults
    from .convert import temporary_dir
    from .integrity import invalidate_manifest

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = processor.tokenizer
    # processor files (tokenizer + feature extractor settings) via a hidden temp folder, then moved in;
    # a file that changes makes the manifest stale: it goes first (a rerun of a complete export that
    # changes nothing keeps the bundle valid at every instant)
    tmp = temporary_dir(out_dir, "processor")
    try:
        faults.point("write/processor", tmp)
        processor.save_pretrained(tmp)
        for f in sorted(tmp.iterdir()):
            dst = out_dir / f.name
            if dst.is_file() and f.is_file() and dst.read_bytes() == f.read_bytes():
                continue
            invalidate_manifest(out_dir)
            faults.point(f"replace/{f.name}", dst)
            os.replace(f, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    export_vocab(tokenizer, out_dir / VOCAB_FILE, if_changed=True, before_change=lambda: invalidate_manifest(out_dir))
    front_end = FrontEndConfig.from_processor(processor, dither=0.0).to_dict()
    enc_pkg, dec_pkg, fe_pkg = out_dir / ENCODER_FILE, out_dir / DECODER_FILE, out_dir / FRONTEND_FILE
    source = getattr(model, "source", None)
    try:
        manifest = build_manifest(
            model, tokenizer, front_end,
            encoder=encoder_package_info(enc_pkg) if enc_pkg.exists() else None,
            decoder=decoder_package_info(dec_pkg) if dec_pkg.exists() else None,
            frontend=frontend_package_info(fe_pkg) if fe_pkg.exists() else None,
            model_id=str(getattr(source, "model_id", "unknown")), revision=getattr(source, "revision", None),
        )
    except BundleError:
        # packages that do not fit each other: no manifest at all rather than one describing other packages
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        raise
    return write_manifest(manifest, out_dir)


def write_manifest(manifest: dict, out_dir: str | os.PathLike) -> Path:
    """Write `manifest` as `out_dir/manifest.json` (atomically, last) with what
    `integrity.manifest_sections` computes from the files on disk: preset, recipe, min_os and
    `checksums` (sha256 + size of every other file of the bundle, package contents included).

    The one writer of manifests: `write_bundle` (export), `cohere-coreml quantize` (the f16
    manifest with the quantized bundle's sections) and `refresh_manifest` (after README.md ...).
    """
    from .convert import write_json_atomic
    from .integrity import manifest_sections

    out_dir = Path(out_dir)
    manifest = {**manifest, **manifest_sections(out_dir)}
    write_json_atomic(manifest, out_dir / MANIFEST_NAME, if_changed=True)
    logger.info("wrote %s", out_dir / MANIFEST_NAME)
    return out_dir / MANIFEST_NAME


def refresh_manifest(out_dir: str | os.PathLike) -> Path:
    """Re-compute the file-derived sections of an existing manifest (after files were added)."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"{out_dir} has no {MANIFEST_NAME}: export the bundle first (`cohere-coreml export`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise BundleError(f"{path} is not readable JSON: {err}") from err
    return write_manifest(manifest, out_dir)


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
        from .integrity import IntegrityError, check_sizes, safe_path

        try:  # every file the manifest names stays inside the bundle
            for key, name in (manifest.get("files") or {}).items():
                if name is not None:
                    safe_path(name, f"{manifest_path}: files.{key}")
        except IntegrityError as err:
            raise BundleError(str(err)) from err
        for key in ("encoder", "decoder", "vocab", "tokenizer"):
            name = manifest["files"].get(key)
            if name is None:
                raise BundleError(f"{manifest_path} describes no {key}: export it (`cohere-coreml export`)")
            found = next((d / name for d in dirs if (d / name).exists()), None)
            if found is None:
                raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
            bundle.paths[key] = found
        bundle.paths["tokenizer_dir"] = bundle.paths["tokenizer"].parent
        frontend = manifest["files"].get("frontend")  # optional: frontend.mlpackage
        if frontend is not None:
            found = next((d / frontend for d in dirs if (d / frontend).exists()), None)
            if found is None:
                raise BundleError(f"bundle is missing {frontend} (looked in {', '.join(map(str, dirs))})")
            bundle.paths["frontend"] = found
        try:
            check_sizes(dirs, manifest)  # presence and size of every file the manifest lists
        except IntegrityError as err:
            raise BundleError(str(err)) from err
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
