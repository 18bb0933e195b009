"""manifest.json, written last (`write_bundle`) from the packages on disk (their specs and metadata,
`cohere_coreml.bundle.packages`) and the checkpoint's tokenizer and config: exporting any one component
refreshes it, and it never describes a package that is not there.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
from pathlib import Path

from .. import __version__, git_hash
from ..config import CACHE_MASK_INPUT, DECODER_STATE_GRAPH, DECODER_STATE_HOST, MEMORY_NAMES, NEW_ROWS_OUTPUTS
from ..model.audio import FrontEndConfig
from ..model.tokens import LANGUAGES, NO_SPACE_LANGUAGES, export_vocab, prompt_ids
from ..storage import faults
from ..storage.files import temporary_dir, write_json_atomic
from ..storage.integrity import MANIFEST_NAME, invalidate_manifest, manifest_sections
from .format import (
    DECODER_FILE,
    ENCODER_FILE,
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    FRONTEND_FILE,
    VAD_FILE,
    VOCAB_FILE,
    BundleError,
)
from .packages import (
    decoder_package_info,
    encoder_package_info,
    encoder_part_file,
    frontend_package_info,
    vad_package_info,
)

logger = logging.getLogger(__name__)


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


def build_manifest(model, tokenizer, front_end: dict, encoder: dict | None, decoder: dict | None,
                   model_id: str = "unknown", revision: str | None = None, frontend: dict | None = None,
                   base_model: str | None = None, vad: dict | None = None) -> dict:
    """The manifest dict (see docs/bundle.md) of the packages described by `encoder`/`decoder`/
    `frontend`/`vad` (`encoder_package_info` / `decoder_package_info` / `frontend_package_info` /
    `vad_package_info` with its gate's `parity`, None when absent). Every id and size is read from the
    packages, `model` and `tokenizer`."""
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
    if vad is not None:
        files["vad"] = VAD_FILE
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
            # null without it) up to extend_length tokens from a given slot in one call; "step_batch" (optional,
            # host state, absent without it) one token for each of decoder.batch.size windows, on a state of its own
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
        if decoder.get("batch") is not None:  # the batched step (functions.step_batch): B rows and I/O (absent without)
            manifest["decoder"]["batch"] = decoder["batch"]
        # word timings (docs/word-timings.md): the align function's heads, rows and calibration figures, or null
        # and the reason in alignment_note
        manifest["decoder"]["alignment"] = decoder.get("alignment")
        manifest["decoder"]["alignment_note"] = decoder.get("alignment_note")
    if vad is not None:
        # vad.mlpackage (optional): Silero VAD, speech probability per 512-sample chunk; functions "block"
        # (functions.block.chunks chunks a call) and "chunk" (1), the LSTM state as explicit inputs and outputs;
        # parity: its gate's figures against the silero-vad package's own model (null: gate skipped)
        manifest["vad"] = {**vad, "parity": vad.get("parity")}
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
    vad_pkg = out_dir / VAD_FILE
    source = getattr(model, "source", None)
    try:
        manifest = build_manifest(
            model, tokenizer, front_end,
            encoder=encoder_package_info(enc_pkg) if enc_pkg.exists() else None,
            decoder=decoder_package_info(dec_pkg) if dec_pkg.exists() else None,
            frontend=frontend_package_info(fe_pkg) if fe_pkg.exists() else None,
            vad={**vad_package_info(vad_pkg), "parity": vad_parity(out_dir)} if vad_pkg.exists() else None,
            model_id=str(getattr(source, "model_id", "unknown")), revision=getattr(source, "revision", None),
            base_model=getattr(source, "base_model", None),
        )
    except BundleError:
        # packages that do not fit each other: no manifest at all rather than one describing other packages
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        raise
    return write_manifest(manifest, out_dir)


def vad_parity(out_dir: Path) -> dict | None:
    """The figures of the gate that passed the VAD package in `out_dir` (`vad.parity.json`), None when its
    gate was skipped or its report is absent."""
    try:
        report = json.loads((out_dir / "vad.parity.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("passed") is not True or not isinstance(report.get("parity"), dict):
        return None
    return {**report["parity"], "runs_on": report.get("runs_on")}


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
    logger.debug("wrote %s", out_dir / MANIFEST_NAME)
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
