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
import functools
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__, faults
from .audio import FrontEndConfig
from .config import (
    BIND_FUNCTION,
    BIND_INPUT_PREFIX,
    BIND_OUTPUT,
    BUCKETS_METADATA_KEY,
    CACHE_MASK_INPUT,
    DECODER_STATE_GRAPH,
    DECODER_STATE_HOST,
    DECODER_STATES,
    EXTEND_FUNCTION,
    FRONTEND_FUNCTIONS_METADATA_KEY,
    LENGTH_MASKS_METADATA_KEY,
    MEMORY_NAMES,
    NEW_ROWS_OUTPUTS,
    PART_METADATA_KEY,
    PREFILL_FUNCTION,
    STEP_FUNCTION,
)
from .convert import git_hash
from .files import temporary_dir, write_json_atomic
from .integrity import MANIFEST_NAME, IntegrityError, check_sizes, invalidate_manifest, manifest_sections, safe_path
from .shapes import LengthMasks
from .tokens import (
    BOS_TOKEN,
    EOS_TOKEN,
    LANGUAGES,
    NO_SPACE_LANGUAGES,
    PAD_TOKEN,
    UnknownLanguageError,
    export_vocab,
    prompt_ids,
    prompt_tokens,
)

logger = logging.getLogger(__name__)

FORMAT_NAME = "cohere-coreml-bundle"
# 3: the encoder's length masks are host inputs. 2: the decoder keeps the cross memory in its state
# (bind_memory once per window; the step takes only input_ids and position). 1: the step took
# cross_k / cross_v / cross_mask at every call.
FORMAT_VERSION = 3
# what each format changed (the refusal of an older bundle says why it cannot be read)
FORMAT_CHANGES = {
    2: f"the decoder keeps the cross memory in its state, bound once per window by its {BIND_FUNCTION!r} function",
    3: "the encoder takes its length masks from the host as fp16 inputs (encoder.length_masks) instead of a "
       "feature_length input, so its program holds no integer or fp32 length arithmetic",
}
ENCODER_FILE = "encoder.mlpackage"
DECODER_FILE = "decoder.mlpackage"
FRONTEND_FILE = "frontend.mlpackage"
VOCAB_FILE = "vocab.json"
FILES = {"encoder": ENCODER_FILE, "frontend": FRONTEND_FILE, "decoder": DECODER_FILE}


class BundleError(ValueError):
    """A bundle folder is missing files or carries an unreadable / inconsistent manifest."""


def checkpoint_eos_ids(model) -> list[int]:
    """eos ids from the generation config (falls back to the model config), as a list."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise BundleError("the checkpoint defines no eos_token_id (config or generation config)")
    ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    if not ids:
        raise BundleError("the checkpoint's eos_token_id is an empty list (config or generation config)")
    return ids


def language_prompts(tokenizer) -> dict[str, dict[str, list[int]]]:
    """{language: {"punctuation": ids, "no_punctuation": ids}} for the 14 languages."""
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
    from .runtime.package import describe, read_package  # cohere_coreml.runtime imports torch; bundle loads without it

    described = describe(read_package(path, function_name=function_name))
    return {
        kind: {name: {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name}
               for name, (shape, dtype) in features.items()}
        for kind, features in zip(("inputs", "outputs", "states"), described)
    }


def package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The package's user-defined metadata (`com.cohere_coreml.*`, written by `convert_module`)."""
    from .runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

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
    parts = encoder_parts(path)
    for fn in functions:  # every function's I/O (a length bucket takes fewer frames than "main"); in parts,
        # the chain's: the first part's inputs, the last part's outputs
        ios = [part["functions"][fn]["io"] for part in parts]
        functions[fn]["io"] = {"inputs": ios[0]["inputs"], "outputs": ios[-1]["outputs"], "states": {}}
    return {"window_frames": frames, "encoder_frames": t, "memory_len": tp,
            "length_masks": package_length_masks(path).to_manifest(),
            "num_layers": parts[-1]["layers"][1],
            "parts": parts,
            "functions": functions, "precision": meta.get("com.cohere_coreml.precision"),
            "io": functions["main"]["io"]}


def package_length_masks(path: str | os.PathLike) -> LengthMasks:
    """The length-mask rule an encoder package was exported with (its metadata)."""
    raw = package_metadata(path).get(LENGTH_MASKS_METADATA_KEY)
    if not raw:
        raise BundleError(f"{path} has no length-mask metadata: it is an encoder of an older bundle format that "
                          "computed its masks from a feature_length input; re-export it with `cohere-coreml export`")
    try:
        return LengthMasks.from_manifest(json.loads(raw))
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: unreadable length-mask metadata: {err}") from err


def encoder_part_file(index: int) -> str:
    """File of part `index` (0-based) of an encoder in parts: encoder.mlpackage, encoder_part2.mlpackage, ..."""
    return ENCODER_FILE if index == 0 else f"encoder_part{index + 1}.mlpackage"


def encoder_part_key(index: int) -> str:
    """`files` key of part `index`: encoder, encoder_part2, ..."""
    return "encoder" if index == 0 else f"encoder_part{index + 1}"


def encoder_parts(path: str | os.PathLike) -> list[dict]:
    """[{"file": files key, "layers": [start, stop], "functions": {fn: {"io"}}}] of the encoder whose first
    package is `path` (one entry for a whole encoder): its parts are the sibling packages its metadata counts."""
    path = Path(path)
    meta = package_metadata(path)
    raw = meta.get(PART_METADATA_KEY)
    function_names = list(encoder_buckets(path) or {"main": None})
    if not raw:
        raise BundleError(f"{path} lacks the encoder part metadata of cohere-coreml (an export before bundle format "
                          f"{FORMAT_VERSION}): re-export it with `cohere-coreml export --force`")
    try:
        count = int(json.loads(raw)["count"])
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: unreadable encoder part metadata: {err}") from err
    parts, expected_start = [], 0
    for index in range(count):
        part_path = path.with_name(encoder_part_file(index))
        if not part_path.exists():
            raise BundleError(f"{path} is part 1 of an encoder in {count} parts but {part_path.name} is missing: "
                              "re-export it (`cohere-coreml export --force`)")
        try:
            info = json.loads(package_metadata(part_path)[PART_METADATA_KEY])
            start, stop = (int(x) for x in info["layers"])
            same = int(info["index"]) == index and int(info["count"]) == count
        except (KeyError, ValueError, TypeError) as err:
            raise BundleError(f"{part_path}: unreadable encoder part metadata: {err}") from err
        if not same or start != expected_start or stop <= start:
            raise BundleError(f"{part_path} is not part {index + 1} of {count} following layer {expected_start} "
                              f"(it says {info}): the parts come from different exports; re-export with --force")
        expected_start = stop
        parts.append({"file": encoder_part_key(index), "layers": [start, stop],
                      "functions": {fn: {"io": package_io(part_path, function_name=fn)} for fn in function_names}})
    return parts


def frontend_package_info(path: str | os.PathLike) -> dict:
    """Functions (window seconds, samples, frames, I/O of each), I/O, compute units and precision of
    an exported front-end package (the manifest's "frontend" section)."""
    from .runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

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
    from .runtime.package import describe, read_package  # cohere_coreml.runtime imports torch; bundle loads without it

    meta = package_metadata(path)
    try:
        shapes = json.loads(meta["com.cohere_coreml.decoder_shapes"])
    except (KeyError, ValueError) as err:
        raise BundleError(f"{path} lacks the decoder metadata of cohere-coreml ({err}): re-export it") from err
    functions = read_package(path).function_names
    step_io = package_io(path, function_name=STEP_FUNCTION)
    # who writes the state: the package's metadata (exports before --decoder-state: graph, with bind_memory)
    state_writes = meta.get("com.cohere_coreml.decoder_state") or (
        DECODER_STATE_HOST if CACHE_MASK_INPUT in step_io["inputs"] else DECODER_STATE_GRAPH)
    if state_writes not in DECODER_STATES:
        raise BundleError(f"{path}: decoder state {state_writes!r} is none of {DECODER_STATES}: re-export it")
    host = state_writes == DECODER_STATE_HOST
    if host and (BIND_FUNCTION in functions or CACHE_MASK_INPUT not in step_io["inputs"]):
        raise BundleError(f"{path} says it is a host-state decoder but its step takes {sorted(step_io['inputs'])} "
                          f"and its functions are {sorted(functions)}: re-export it with `cohere-coreml export --force`")
    if not host and BIND_FUNCTION not in functions:
        raise BundleError(f"{path} has no {BIND_FUNCTION!r} function (it has {sorted(functions)}): a decoder of "
                          f"bundle format 1, which took the cross memory at every step; re-export it with "
                          f"`cohere-coreml export --force`")
    prefill = PREFILL_FUNCTION if PREFILL_FUNCTION in functions else None
    prefill_length = None
    if prefill:
        inputs, _, _ = describe(read_package(path, function_name=PREFILL_FUNCTION))
        prefill_length = int(inputs["input_ids"][0][1])
    extend = EXTEND_FUNCTION if EXTEND_FUNCTION in functions else None
    extend_length = None
    if extend:
        inputs, _, _ = describe(read_package(path, function_name=EXTEND_FUNCTION))
        extend_length = int(inputs["input_ids"][0][1])
    bind_io = bind_inputs = None
    if not host:
        bind_io = package_io(path, function_name=BIND_FUNCTION)
        bind_inputs = {BIND_INPUT_PREFIX + name: name for name in MEMORY_NAMES}  # bind input -> encoder output
        if set(bind_io["inputs"]) != set(bind_inputs):
            raise BundleError(f"{path}: {BIND_FUNCTION} takes {sorted(bind_io['inputs'])}, this tool expects "
                              f"{sorted(bind_inputs)}: re-export it with `cohere-coreml export --force`")
    info = {"shapes": shapes, "state_writes": state_writes,
            "functions": {"step": STEP_FUNCTION, "bind": None if host else BIND_FUNCTION, "prefill": prefill},
            "prefill_length": prefill_length, "precision": meta.get("com.cohere_coreml.precision"),
            "io": step_io, "bind_io": bind_io, "bind_inputs": bind_inputs,
            "prefill_io": package_io(path, function_name=prefill) if prefill else None}
    if extend:  # optional, and absent (not null) without it: manifests of older exports stay as they were
        info["functions"]["extend"] = extend
        info.update(extend_length=extend_length, extend_io=package_io(path, function_name=extend))
    return info


def build_manifest(model, tokenizer, front_end: dict, encoder: dict | None, decoder: dict | None,
                   model_id: str = "unknown", revision: str | None = None, frontend: dict | None = None,
                   base_model: str | None = None) -> dict:
    """The manifest dict (see docs/bundle.md) of the packages described by `encoder`/`decoder`/
    `frontend` (`encoder_package_info` / `decoder_package_info` / `frontend_package_info`, None when
    absent). Every id and size is read from the packages, `model` and `tokenizer`."""
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
    if encoder is not None:
        files.update({part["file"]: encoder_part_file(i) for i, part in enumerate(encoder["parts"])})
    if frontend is not None:
        files["frontend"] = FRONTEND_FILE
    files.update({"vocab": VOCAB_FILE, "tokenizer": "tokenizer.json", "tokenizer_config": "tokenizer_config.json",
                  "processor_config": "processor_config.json"})
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model_id": model_id,
        "base_model": base_model,  # the Hub id of the checkpoint, or None (never a local path)
        "revision": revision,
        "tool_version": __version__,
        "tool_git_hash": git_hash(),
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
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
            # the host's length-mask rule (shapes.LengthMasks): the masks every encoder call takes
            "length_masks": encoder["length_masks"],
            "num_layers": encoder["num_layers"],
            # the programs, in order: each consecutive layers [start, stop) (the subsampling in the first,
            # the memory projections in the last), chained through their hidden state; one part: the whole
            # encoder. Each part's package has every function of encoder.functions (with its own io).
            "parts": encoder["parts"],
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
            # functions of decoder.mlpackage, one state layout (self_k, self_v, cross_k, cross_v,
            # cross_mask) shared by all: "bind" writes a window's cross memory into the state (once per
            # window), "step" (the default function) takes only input_ids + position, "prefill"
            # (optional) the whole prompt (1, prefill_length) in one call, "extend" (optional, absent or
            # null without it) up to extend_length tokens from a given slot in one call
            "functions": decoder["functions"],
            # bind function input -> the encoder output it takes, unchanged (None: host-state decoder)
            "bind_inputs": decoder["bind_inputs"],
            "prefill_length": decoder["prefill_length"],
            "io": decoder["io"],  # the step function's
            "bind_io": decoder["bind_io"],  # the bind function's (None: host-state decoder)
            "prefill_io": decoder.get("prefill_io"),  # the prefill function's (None without prefill)
            # who writes the state (docs/decoder.md): "graph" (the functions; bind_memory the memory) or
            # "host" (the functions only read it; the app writes the memory once per window and each
            # call's new K/V rows, below)
            "state_writes": decoder.get("state_writes", DECODER_STATE_GRAPH),
        }
        if manifest["decoder"]["state_writes"] == DECODER_STATE_HOST:
            manifest["decoder"].update(
                memory_states={name: name for name in MEMORY_NAMES},  # state -> the encoder output written into it
                row_outputs=dict(NEW_ROWS_OUTPUTS),  # state -> the output of each call's new rows (L, Hkv, S, Dh)
                cache_mask_input=CACHE_MASK_INPUT)  # fp16 (1, 1, 1, C): 0 for slots < position, -1e4 else
        if decoder.get("extend_io") is not None:  # the extend function's: K and I/O (absent without it)
            manifest["decoder"].update(extend_length=decoder["extend_length"], extend_io=decoder["extend_io"])
    manifest["tokens"] = {
        "eos_token_ids": checkpoint_eos_ids(model),
        "eos_token_id": checkpoint_eos_ids(model)[0],
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
            base_model=getattr(source, "base_model", None),
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
    def load(cls, dirs: str | os.PathLike | Sequence[str | os.PathLike], check_package_io: bool = True) -> Bundle:
        """Read and check the manifest (`check_manifest`: every field the loop reads, its type, range and
        consistency), the presence and size of every listed file, and (`check_package_io`) that every
        package function has the io the manifest lists (`check_packages`). Any problem: BundleError
        naming the field or file."""
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
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise BundleError(f"{manifest_path} is not readable JSON: {err}") from err
        if not isinstance(manifest, dict):
            raise BundleError(f"{manifest_path} is not a {FORMAT_NAME} manifest (not a JSON object)")
        if manifest.get("format") != FORMAT_NAME:
            raise BundleError(f"{manifest_path} is not a {FORMAT_NAME} manifest")
        version = manifest.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise BundleError(f"{manifest_path}: field 'format_version' must be a positive integer, got {_show(version)}")
        if version > FORMAT_VERSION:
            raise BundleError(
                f"{manifest_path} has format_version {version}; this tool reads format {FORMAT_VERSION}: update cohere-coreml"
            )
        if version < FORMAT_VERSION:
            raise BundleError(
                f"{manifest_path} has format_version {version}, an older bundle format this tool no longer reads "
                f"(format {FORMAT_VERSION}: {FORMAT_CHANGES[FORMAT_VERSION]}); re-export the bundle with "
                "`cohere-coreml export --force`"
            )
        bundle = cls(dirs=dirs, manifest=manifest)

        files = manifest.get("files")
        if not isinstance(files, dict):
            raise BundleError(f"{manifest_path}: field 'files' must be an object naming the bundle's files, "
                              f"got {_show(files)}")
        try:  # every file the manifest names stays inside the bundle
            for key, name in files.items():
                if name is not None:
                    safe_path(name, f"{manifest_path}: files.{key}")
        except IntegrityError as err:
            raise BundleError(str(err)) from err
        suffixes = {"encoder": ".mlpackage", "decoder": ".mlpackage", "frontend": ".mlpackage", "vocab": ".json",
                    "tokenizer": "tokenizer.json", "processor_config": ".json", "tokenizer_config": ".json"}
        for key, suffix in suffixes.items():
            name = files.get(key)
            if name is not None and not name.endswith(suffix):
                raise BundleError(f"{manifest_path}: field 'files.{key}' is {name!r}; it names a {suffix} file")
        for key in ("encoder", "decoder", "vocab", "tokenizer", "processor_config"):
            name = files.get(key)
            if name is None:
                raise BundleError(f"{manifest_path} describes no {key}: export it (`cohere-coreml export`)")
            found = next((d / name for d in dirs if (d / name).exists()), None)
            if found is None:
                raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
            bundle.paths[key] = found
        bundle.paths["tokenizer_dir"] = bundle.paths["tokenizer"].parent
        part_keys = [k for k in files if k.startswith("encoder_part")]  # an encoder in parts: its later programs
        for key in ("frontend", *part_keys):  # optional: frontend.mlpackage, encoder_part<k>.mlpackage
            name = files.get(key)
            if key in part_keys and (not isinstance(name, str) or not name.endswith(".mlpackage")):
                raise BundleError(f"{manifest_path}: field 'files.{key}' is {name!r}; it names a .mlpackage file")
            if name is not None:
                found = next((d / name for d in dirs if (d / name).exists()), None)
                if found is None:
                    raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
                bundle.paths[key] = found
        try:
            check_sizes(dirs, manifest)  # presence and size of every file the manifest lists
        except IntegrityError as err:
            raise BundleError(str(err) if MANIFEST_NAME in str(err) else f"{manifest_path}: {err}") from err
        vocab = _read_json(bundle.paths["vocab"], "files.vocab")
        if not isinstance(vocab, dict) or not all(isinstance(v, str) for v in vocab.values()):
            raise BundleError(f"{bundle.paths['vocab']} (files.vocab) is not an {{id: piece}} table")
        processor = _read_json(bundle.paths["processor_config"], "files.processor_config")
        check_manifest(manifest, str(manifest_path), vocab=vocab, processor=processor)
        if check_package_io:
            check_packages(bundle, str(manifest_path))
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
        if language not in self.manifest["languages"]:
            raise UnknownLanguageError(language)
        return [int(i) for i in self.manifest["languages"][language]["punctuation" if punctuation else "no_punctuation"]]


# --------------------------------------------------------------------------------------------------
# Manifest checks (Bundle.load): every field the loop reads, typed, in range, and consistent with the
# manifest's io blocks, which are compared with the packages themselves
# --------------------------------------------------------------------------------------------------

MAX_DIM = 2**31 - 1  # Core ML shapes and int32 ids
COMPUTE_UNITS = ("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne")
IO_DTYPES = ("float16", "float32", "int32")
PRECISIONS = ("fp16", "fp32")
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
            self.fail(path, f"must be an object, got {_show(value)}")
        return value

    def int(self, obj: dict, key: str, path: str, lo: int = 0, hi: int = MAX_DIM, optional: bool = False) -> int | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {_show(value)}")
        if not lo <= value <= hi:
            self.fail(path, f"is {value}, outside [{lo}, {hi}]")
        return value

    def num(self, obj: dict, key: str, path: str, lo: float, hi: float, lo_open: bool = False,
            hi_open: bool = False, optional: bool = False) -> float | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(path, f"must be a finite number, got {_show(value)}")
        if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
            self.fail(path, f"is {value}, outside {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")
        return float(value)

    def str(self, obj: dict, key: str, path: str, choices: Sequence[str] | None = None,
            optional: bool = False) -> str | None:
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            self.fail(path, f"must be a non-empty string, got {_show(value)}")
        if choices is not None and value not in choices:
            self.fail(path, f"is {value!r}, not one of {list(choices)}")
        return value

    def ints(self, obj: dict, key: str, path: str, lo: int = 0, hi: int = MAX_DIM, optional: bool = False):
        value = self.get(obj, key, path, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list):
            self.fail(path, f"must be a list of integers, got {_show(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                self.fail(f"{path}[{i}]", f"must be an integer in [{lo}, {hi}], got {_show(item)}")
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
                    self.fail(where, f"must be an object, got {_show(desc)}")
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
            self.fail(field, f"is {_show(value)} but {other_field} is {_show(other)}: they must agree")


def _show(value) -> str:
    text = json.dumps(value, allow_nan=True) if isinstance(value, (dict, list, str, int, float, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BundleError(f"{path} ({what}) is not readable JSON: {err}") from err


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
        raise BundleError(f"{where}: the manifest must be a JSON object, got {_show(manifest)}")
    precision = f.str(manifest, "precision", "precision", PRECISIONS, optional=True)

    # audio: the front end (cohere_coreml.audio.FrontEndConfig)
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
                f.fail(f"audio.{field_name}", f"is {_show(audio[field_name])} but the checkpoint's processor config "
                       f"(files.processor_config) says {key} = {_show(settings[key])}")

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
            f.fail(path, f"must be an object, got {_show(fn)}")
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
        f.fail("decoder.prefill_length", f"is {_show(prefill_len)} but decoder.functions.prefill is {_show(prefill)}: "
               "both are set (a prefill function) or both null")
    program_float = "float32" if precision == "fp32" else "float16"
    step_io = f.io(dec, "io", "decoder.io")
    prefill_io = f.io(dec, "prefill_io", "decoder.prefill_io", optional=True)
    if (prefill is None) != (prefill_io is None):
        f.fail("decoder.prefill_io", f"must be given exactly when decoder.functions.prefill is (it is {_show(prefill)})")
    cache = [layers, kv_heads, capacity, head_dim]
    extend = f.str(functions, "extend", "decoder.functions.extend", optional=True)
    extend_len = f.int(dec, "extend_length", "decoder.extend_length", lo=1, hi=capacity - prompt_len, optional=True)
    if (extend is None) != (extend_len is None):
        f.fail("decoder.extend_length", f"is {_show(extend_len)} but decoder.functions.extend is {_show(extend)}: "
               "both are set (an extend function) or both null")
    extend_io = f.io(dec, "extend_io", "decoder.extend_io", optional=True)
    if (extend is None) != (extend_io is None):
        f.fail("decoder.extend_io", f"must be given exactly when decoder.functions.extend is (it is {_show(extend)})")
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
                f.fail(f"decoder.{key}", f"is {_show(dec.get(key))}; a host-state decoder has no bind function (null)")
        if functions.get("bind") is not None:
            f.fail("decoder.functions.bind", f"is {_show(functions.get('bind'))}; a host-state decoder has none (null)")
        for key, want in (("memory_states", {name: name for name in MEMORY_NAMES}),
                          ("row_outputs", dict(NEW_ROWS_OUTPUTS)), ("cache_mask_input", CACHE_MASK_INPUT)):
            if dec.get(key) != want:
                f.fail(f"decoder.{key}", f"is {_show(dec.get(key))}; a host-state decoder of this format writes "
                       f"{_show(want)}")
    else:  # the bind function: the encoder's memory in (under decoder.bind_inputs' names), memory_length out
        bind = f.str(functions, "bind", "decoder.functions.bind")
        bind_inputs = f.obj(dec, "bind_inputs", "decoder.bind_inputs")
        want_inputs = {BIND_INPUT_PREFIX + name: name for name in MEMORY_NAMES}
        if bind_inputs != want_inputs:
            f.fail("decoder.bind_inputs", f"is {_show(bind_inputs)}; the {bind!r} function takes {want_inputs}")
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
                f.fail(path, f"must be an object, got {_show(fn)}")
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
        f.fail("generation.no_space_languages", f"is {_show(None if no_space is _MISSING else no_space)}, "
               f"expected {sorted(NO_SPACE_LANGUAGES)} (the languages whose windows are joined without a space)")
    languages = f.obj(manifest, "languages", "languages")
    if sorted(languages) != sorted(LANGUAGES):  # the writer lists every language the tokenizer has a prompt for
        f.fail("languages", f"has prompts for {sorted(languages)[:20]}, expected one per language of the model: "
               f"{', '.join(LANGUAGES)}")
    for lang, prompts in languages.items():
        if lang not in LANGUAGES:
            f.fail(f"languages.{lang}", f"is not a supported language ({', '.join(LANGUAGES)})")
        if not isinstance(prompts, dict):
            f.fail(f"languages.{lang}", f"must be an object, got {_show(prompts)}")
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
        f.fail("encoder.parts", f"must be a non-empty list of the encoder's programs, got {_show(parts)}")
    files = manifest["files"]
    start = 0
    for i, part in enumerate(parts):
        path = f"encoder.parts[{i}]"
        if not isinstance(part, dict):
            f.fail(path, f"must be an object, got {_show(part)}")
        key = f.str(part, "file", f"{path}.file", (encoder_part_key(i),))
        if not isinstance(files.get(key), str):
            f.fail(f"{path}.file", f"names files.{key}, which the manifest does not give")
        layers = f.ints(part, "layers", f"{path}.layers", hi=num_layers)
        if len(layers) != 2 or layers[0] != start or layers[1] <= start:
            f.fail(f"{path}.layers", f"is {_show(layers)}; part {i + 1} holds layers [{start}, stop) with stop > {start}")
        start = layers[1]
        functions = f.obj(part, "functions", f"{path}.functions")
        if sorted(functions) != sorted(enc_functions):
            f.fail(f"{path}.functions", f"are {sorted(functions)}, but the encoder functions (encoder.functions) are "
                   f"{sorted(enc_functions)}: every part has every window's function")
        for fn, entry in functions.items():
            if not isinstance(entry, dict):
                f.fail(f"{path}.functions.{fn}", f"must be an object, got {_show(entry)}")
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
                f.fail(f"encoder.parts[{i}].functions.{fn}.io.outputs", f"are {_show(ios[i]['outputs'])}; a part "
                       f"before the last gives only hidden_states_out [1, {t}, hidden size]")
            nxt = ios[i + 1]["inputs"]
            want = {"hidden_states": ios[i]["outputs"]["hidden_states_out"],
                    "encoder_mask": {"shape": [1, t], "dtype": "float16"}}
            if nxt != want:
                f.fail(f"encoder.parts[{i + 1}].functions.{fn}.io.inputs", f"are {_show(nxt)}; the part after "
                       f"part {i + 1} takes {_show(want)}")


def _package_stamp(path: Path) -> tuple:
    """What identifies a package's contents cheaply (every file's size and mtime)."""
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in path.rglob("*") if p.is_file()))


@functools.lru_cache(maxsize=64)
def _cached_package_io(path: str, function_name: str | None, stamp: tuple) -> tuple[dict, str, tuple[str, ...]]:
    from .runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

    spec = read_package(path, function_name=function_name)
    return package_io(path, spec.function_name), spec.function_name, tuple(sorted(spec.function_names))


def check_packages(bundle: Bundle, where: str) -> None:
    """Every function the manifest names exists in its package, the package has no function the
    manifest omits, and each function's inputs/outputs/states equal the manifest's `io` block."""
    from .runtime.errors import RuntimeBackendError  # cohere_coreml.runtime imports torch; bundle loads without it

    m = bundle.manifest
    dec = m["decoder"]
    listed = {part["file"]: {name: (fn["io"], f"encoder.parts[{i}].functions.{name}")
                             for name, fn in part["functions"].items()}
              for i, part in enumerate(m["encoder"]["parts"])}
    listed["decoder"] = {dec["functions"]["step"]: (dec["io"], "decoder.functions.step")}
    if dec["functions"].get("bind") is not None:  # null in a host-state decoder
        listed["decoder"][dec["functions"]["bind"]] = (dec["bind_io"], "decoder.functions.bind")
    if dec["functions"].get("prefill") is not None:
        listed["decoder"][dec["functions"]["prefill"]] = (dec["prefill_io"], "decoder.functions.prefill")
    if dec["functions"].get("extend") is not None:
        listed["decoder"][dec["functions"]["extend"]] = (dec["extend_io"], "decoder.functions.extend")
    if m.get("frontend") is not None:
        listed["frontend"] = {name: (fn["io"], f"frontend.functions.{name}")
                              for name, fn in m["frontend"]["functions"].items()}
    for component, functions in listed.items():
        path = bundle.paths[component]
        stamp = _package_stamp(path)
        try:
            _, default, present = _cached_package_io(str(path), None, stamp)
        except RuntimeBackendError as err:
            raise BundleError(f"{where}: files.{component} ({path.name}) is not a readable package: {err}") from err
        if component == "decoder" and dec["functions"]["step"] != default:
            raise BundleError(f"{where}: field 'decoder.functions.step' is {dec['functions']['step']!r} but "
                              f"{path.name}'s default function is {default!r}")
        if sorted(functions) != list(present):
            raise BundleError(f"{where}: {component} functions {sorted(functions)} (manifest) differ from the "
                              f"functions of {path.name} {list(present)}")
        for name, (io, field_name) in functions.items():
            actual, _, _ = _cached_package_io(str(path), name, stamp)
            if actual != io:
                diff = next((f"{kind}.{array}: package {actual[kind].get(array)}, manifest {io[kind].get(array)}"
                             for kind in ("inputs", "outputs", "states")
                             for array in sorted(set(actual[kind]) | set(io[kind]))
                             if actual[kind].get(array) != io[kind].get(array)), "extra keys")
                raise BundleError(f"{where}: field '{field_name}' io differs from function {name!r} of {path.name} "
                                  f"({diff})")
