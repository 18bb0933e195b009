"""What a `.mlpackage` says about itself: its functions' inputs, outputs and states (`package_io`), its
metadata, and per component the facts the manifest records (encoder buckets, parts and length masks;
the front end's and the decoder's shapes), read from the package on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..config import (
    ALIGN_FUNCTION,
    ALIGN_METADATA_KEY,
    ALIGN_NOTE_METADATA_KEY,
    BIND_FUNCTION,
    BIND_INPUT_PREFIX,
    BUCKETS_METADATA_KEY,
    CACHE_MASK_INPUT,
    DECODER_STATE_GRAPH,
    DECODER_STATE_HOST,
    DECODER_STATES,
    EXTEND_FUNCTION,
    FRONTEND_FUNCTIONS_METADATA_KEY,
    LENGTH_MASKS_METADATA_KEY,
    MEMORY_NAMES,
    PART_METADATA_KEY,
    PREFILL_FUNCTION,
    STEP_BATCH_FUNCTION,
    STEP_FUNCTION,
    VAD_BLOCK_FUNCTION,
    VAD_CHUNK_FUNCTION,
    VAD_METADATA_KEY,
)
from ..model.shapes import LengthMasks
from .format import ENCODER_FILE, FORMAT_VERSION, BundleError


def package_io(path: str | os.PathLike, function_name: str | None = None) -> dict[str, dict[str, Any]]:
    """{"inputs"|"outputs"|"states": {name: {"shape": [...], "dtype": str}}} of a package's function
    (default: its default function), read from its spec (`cohere_coreml.runtime.package.describe`)."""
    from ..runtime.package import describe, read_package  # cohere_coreml.runtime imports torch; bundle loads without it

    described = describe(read_package(path, function_name=function_name))
    return {
        kind: {name: {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name}
               for name, (shape, dtype) in features.items()}
        for kind, features in zip(("inputs", "outputs", "states"), described)
    }


def package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The package's user-defined metadata (`com.cohere_coreml.*`, written by `convert_module`)."""
    from ..runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

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
    from ..runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

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
    from ..runtime.package import describe, read_package  # cohere_coreml.runtime imports torch; bundle loads without it

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
    if STEP_BATCH_FUNCTION in functions:  # optional, absent without it (as extend)
        batch_io = package_io(path, function_name=STEP_BATCH_FUNCTION)
        info["functions"]["step_batch"] = STEP_BATCH_FUNCTION
        info["batch"] = {"size": int(batch_io["inputs"]["input_ids"]["shape"][0]), "io": batch_io}
    info.update(alignment_info(path, meta, functions, shapes["capacity"]))
    return info


def alignment_info(path, meta: dict, functions, capacity: int) -> dict:
    """The manifest's `alignment` block (None without an align function) and `alignment_note` (why there is
    none, None when there is one) of a decoder package, from its metadata and its align function."""
    from ..runtime.package import describe, read_package  # as decoder_package_info

    raw = meta.get(ALIGN_METADATA_KEY)
    if ALIGN_FUNCTION not in functions:
        if raw:
            raise BundleError(f"{path}: its metadata names alignment heads but it has no {ALIGN_FUNCTION!r} function: "
                              "re-export it with `cohere-coreml export --force`")
        return {"alignment": None, "alignment_note": meta.get(ALIGN_NOTE_METADATA_KEY)
                or "exported before word timings (no align function): re-export for word timings"}
    try:
        block = json.loads(raw)
        heads = [[int(layer), int(head)] for layer, head in block["heads"]]
    except (TypeError, ValueError, KeyError) as err:
        raise BundleError(f"{path} has an {ALIGN_FUNCTION!r} function without readable alignment metadata "
                          f"({type(err).__name__}: {err}): re-export it") from None
    inputs, _, outputs = describe(read_package(path, function_name=ALIGN_FUNCTION))
    length = int(inputs["input_ids"][0][1])  # K: tokens a call
    if not 1 <= length <= int(capacity) or "position" not in inputs:
        raise BundleError(f"{path}: its {ALIGN_FUNCTION} function takes {length} tokens "
                          f"({'with' if 'position' in inputs else 'without'} a position) for a cache of {capacity}: "
                          "an align function of an older format; re-export it")
    return {"alignment": {"function": ALIGN_FUNCTION, "length": length, "heads": heads,
                          "lead_rows": int(block["lead_rows"]), "frame_seconds": float(block["frame_seconds"]),
                          "io": package_io(path, function_name=ALIGN_FUNCTION),
                          "calibration": block.get("calibration")},
            "alignment_note": None}


def vad_package_info(path: str | os.PathLike) -> dict:
    """The manifest's `vad` entry of an exported vad.mlpackage (model, source, sizes, precision, compute
    units, and per function its chunks and io), from its metadata and spec; the gate's figures are the
    caller's (`parity`)."""
    from ..runtime.package import read_package  # as frontend_package_info

    meta = package_metadata(path)
    try:
        record = json.loads(meta[VAD_METADATA_KEY])
        functions = {fn: {"chunks": int(record["functions"][fn]["chunks"])}
                     for fn in (VAD_BLOCK_FUNCTION, VAD_CHUNK_FUNCTION)}
        entry = {key: record[key] for key in ("model", "source", "sample_rate", "chunk_samples", "context_samples",
                                              "hidden", "precision", "compute_units")}
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise BundleError(f"{path} lacks the VAD metadata of cohere-coreml ({err}): re-export it") from err
    present = read_package(path).function_names
    if sorted(present) != sorted(functions):
        raise BundleError(f"{path} has functions {sorted(present)}, a VAD package has {sorted(functions)}: "
                          "re-export it with `cohere-coreml export --force`")
    for fn in functions:
        functions[fn]["io"] = package_io(path, function_name=fn)
    return {**entry, "functions": functions}
