"""Weight compression of an exported bundle: `f16/` -> `q8/` (or q8-hybrid, q4), gated.

Everything that compresses is `coremltools.optimize.coreml` (`linear_quantize_weights`,
`palettize_weights`); this module decides *what* (presets, per-component recipes, skip lists),
runs it per function of multifunction packages (coremltools refuses those: each function is
compressed alone and the results merged with `save_multifunction`, which stores identical
weights once), reports every weight tensor (`compression.json`), measures sensitivity, and gates
the result against the f16 packages (through `cohere_coreml.runtime`) and, given the checkpoint,
against PyTorch on a held-out set. Nothing is written in place: the new bundle is built in a
temporary folder next to `--out` and renamed only after every gate passed.

Gates follow the export's one interface (`cohere_coreml.gate`): each package is written by
`gate.export_gated` (compressed into a temporary package, gated, renamed) and its `GateReport`
goes next to it as `<component>.parity.json`; the held-out gate of the whole bundle is a
`GateReport` too (`heldout.parity.json`). References are computed before any quantized package is
loaded, and a PyTorch model (held-out gate) is freed before the bundle runs.

Schemes (iOS 18 / macOS 15 ops; activations stay fp16 in all of them):
    int8  linear, symmetric, per output channel, int8 weights (W8A16)
    int4  linear, symmetric, per block of 32 input elements, int4 weights
    pal4  4-bit k-means palette, one 16-entry table per group of 16 output channels
    pal6  6-bit k-means palette, one 64-entry table per group of 16 output channels

Presets: f16 (nothing), q8 (int8 encoder + decoder), q8-hybrid (int8 encoder, fp16 decoder),
q4 (4-bit encoder, int8 decoder). The stateful decoder is never below 8 bits: 4-bit palettized
stateful models built with coremltools 9.0 were reported to crash on device after 100-200
predictions (coremltools issue 2716).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .gate import HELDOUT_COMPONENT, GateReport
from .integrity import COMPRESSION_FILE

logger = logging.getLogger(__name__)

COMPONENTS = ("encoder", "decoder")
# coremltools' default: tensors with at most this many elements are never compressed.
WEIGHT_THRESHOLD = 2048
PALETTE_GROUP = 16  # output channels sharing one palette (per_grouped_channel)
INT4_BLOCK = 32
GATE_CLIPS_PER_LANGUAGE = 2
SENSITIVITY_WINDOWS = (0, -1)  # encoder sensitivity: the first clip and the full window of speech
# constexpr ops that mean "this package already holds compressed weights"
COMPRESSED_OPS = ("constexpr_blockwise_shift_scale", "constexpr_lut_to_dense", "constexpr_affine_dequantize",
                  "constexpr_sparse_to_dense", "constexpr_lut_to_sparse", "constexpr_sparse_blockwise_shift_scale")
# suffixes coremltools gives the op replacing const `<name>`
_COMPRESSED_SUFFIXES = ("_quantized", "_palettized", "_sparsified")

SCHEMES = {
    "int8": "linear symmetric int8, per output channel (W8A16)",
    "int4": f"linear symmetric int4, per block of {INT4_BLOCK}",
    "pal4": f"4-bit k-means palette per {PALETTE_GROUP} output channels",
    "pal6": f"6-bit k-means palette per {PALETTE_GROUP} output channels",
}


class QuantizeError(ValueError):
    """The bundle cannot be quantized as asked (names the problem)."""


class QuantizeGateError(RuntimeError):
    """A quantized bundle failed its gate; nothing was written (`report`: the refusing GateReport's dict)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def _holds_files(folder: Path) -> bool:
    """A folder with anything but hidden files (a reserved, empty `q8/` with its `.gitkeep` is free)."""
    return folder.exists() and (not folder.is_dir() or any(not p.name.startswith(".") for p in folder.iterdir()))


def refusal_path(out: Path) -> Path:
    """Where a refused build's gate figures go: beside the bundle it would have been (`q4.parity-failed.json`),
    never inside a folder that could pass for a bundle."""
    return out.with_name(f"{out.name}.parity-failed.json")


def _write_refusal(out: Path, preset: str, reports: dict) -> Path:
    from .convert import write_json_atomic

    path = refusal_path(out)
    write_json_atomic({"preset": preset, "bundle": str(out), "passed": False, "gate": reports}, path)
    return path


def scheme_config(scheme: str):
    """The coremltools op config of a scheme name."""
    import coremltools.optimize.coreml as cto

    if scheme == "int8":
        return cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                           weight_threshold=WEIGHT_THRESHOLD)
    if scheme == "int4":
        return cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                           block_size=INT4_BLOCK, weight_threshold=WEIGHT_THRESHOLD)
    if scheme in ("pal4", "pal6"):
        return cto.OpPalettizerConfig(nbits=int(scheme[3:]), mode="kmeans", granularity="per_grouped_channel",
                                      group_size=PALETTE_GROUP, weight_threshold=WEIGHT_THRESHOLD)
    raise QuantizeError(f"unknown scheme {scheme!r}; choose from {sorted(SCHEMES)}")


@dataclass(frozen=True)
class Recipe:
    """How one component is compressed.

    scheme: a key of SCHEMES, or None (stays fp16).
    skip_names: fnmatch patterns on weight names (the const op names in the MIL program) kept fp16.
    skip_op_types: op types whose weights are kept fp16 (e.g. "gather": embedding tables).
    keep_fp16: exact weight names kept fp16 by `--target-psnr` (most sensitive first).
    fallback: a linear scheme for the weights `scheme` leaves uncompressed although the recipe does
        not skip them (coremltools' palettizer silently skips a tensor whose channel axis is shorter
        than its group, e.g. the encoder's folded relative-position projections (1, H, D, 2T-1)).
    """

    scheme: str | None
    skip_names: tuple[str, ...] = ()
    skip_op_types: tuple[str, ...] = ()
    keep_fp16: tuple[str, ...] = ()
    fallback: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["description"] = SCHEMES.get(self.scheme, "none (fp16)")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def skip_reason(self, name: str, consumer_types: Iterable[str]) -> str | None:
        if name in self.keep_fp16:
            return "kept fp16 by --target-psnr (among the most sensitive weights)"
        for pattern in self.skip_names:
            if fnmatch.fnmatchcase(name, pattern):
                return f"skipped by the recipe: name matches {pattern!r}"
        hit = sorted(set(consumer_types) & set(self.skip_op_types))
        if hit:
            return f"skipped by the recipe: consumed by {hit[0]!r} ops"
        return None


# The recipes, decided from measurement on the default model (docs/quantization.md, sensitivity =
# decoder output PSNR vs f16 with only that weight at int8): the LM head `proj_out` is the decoder's
# most sensitive weight (62.7 dB alone; every other weight >= 63.3 dB) and costs only V x D extra
# bytes in fp16 (16.8 MB, 0.008 B/param at full size), so it stays fp16 in every preset. The token
# embedding (a gather, 63.3 dB) is quantized. Encoder weights are all >= 60 dB alone at int8.
DECODER_INT8 = Recipe("int8", skip_names=("*proj_out*",))
PRESETS: dict[str, dict[str, Recipe]] = {
    "f16": {"encoder": Recipe(None), "decoder": Recipe(None)},
    "q8": {"encoder": Recipe("int8"), "decoder": DECODER_INT8},
    "q8-hybrid": {"encoder": Recipe("int8"), "decoder": Recipe(None)},
    "q4": {"encoder": Recipe("pal4", fallback="int8"), "decoder": DECODER_INT8},
}
DEFAULT_PRESET = "q8"

# Gates vs the f16 packages (through the runtime) and vs PyTorch on the held-out set, per preset
# (docs/quantization.md). q8 must meet the f16 export gate's own thresholds (35 dB, mean KL 5e-3),
# now measured against the f16 package: on the default model q8 reaches 56.4 dB (encoder) and
# 59.9 dB / KL 2.9e-6 (decoder), a 21-25 dB margin left for the full-size model's deeper encoder.
# q8-hybrid ships the f16 decoder unchanged (measured: identical outputs). q4's encoder threshold
# is the measured default-model figure minus the same margin. Held-out: greedy tokens identical
# on every clip, or WER at most 0.5 points above the baseline.
GATES: dict[str, dict[str, float]] = {
    "q8": {"encoder_psnr_db": 35.0, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3, "max_wer_increase": 0.005},
    "q8-hybrid": {"encoder_psnr_db": 35.0, "decoder_psnr_db": 60.0, "decoder_mean_kl": 1e-6,
                  "max_wer_increase": 0.005},
    "q4": {"encoder_psnr_db": 20.0, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3, "max_wer_increase": 0.005},
}


def preset_recipes(preset: str) -> dict[str, Recipe]:
    if preset not in PRESETS:
        raise QuantizeError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return dict(PRESETS[preset])


# --------------------------------------------------------------------------------------------
# Reading packages
# --------------------------------------------------------------------------------------------


def package_functions(path: Path) -> list[str]:
    from .runtime import read_package

    return list(read_package(path).function_names)


def load_function(path: Path, function_name: str | None = None):
    """The PyMIL function of a package (weights loaded), for inspection."""
    from .runtime.package import load_mil_function, read_package

    return load_mil_function(read_package(path, function_name))


def compressed_ops(path: Path) -> list[str]:
    """Names of the ops of a package that hold compressed weights (empty for an fp16 package)."""
    from coremltools.proto import MIL_pb2  # noqa: F401 (ensures the proto module is importable)

    from .runtime import read_package

    spec = read_package(path).spec
    found = []
    for fn in spec.mlProgram.functions.values():
        for block in fn.block_specializations.values():
            found += [op.type + ":" + (op.outputs[0].name if op.outputs else "") for op in block.operations
                      if op.type in COMPRESSED_OPS]
    return found


def _is_weight(val) -> bool:
    """A float tensor stored in the weight file (coremltools' own rule)."""
    from coremltools.converters.mil.backend.mil.load import should_use_weight_file

    return isinstance(val, np.ndarray) and val.dtype.kind == "f" and bool(should_use_weight_file(val))


def weight_tensors(function) -> dict[str, dict]:
    """{const name: {"shape", "dtype", "bytes", "consumers"}} of the float weights of a PyMIL function."""
    out = {}
    for op in function.operations:
        if op.op_type != "const":
            continue
        val = op.outputs[0].val
        if not _is_weight(val):
            continue
        out[op.name] = {"shape": list(val.shape), "dtype": str(val.dtype), "bytes": int(val.nbytes),
                        "var": op.outputs[0].name, "consumers": sorted({c.op_type for c in op.outputs[0].child_ops})}
    return out


def _bits(var) -> int:
    dt = var.dtype
    try:
        return int(dt.get_bitwidth())
    except (AttributeError, TypeError):
        return int(np.dtype(var.val.dtype).itemsize * 8)


def compressed_tensors(function) -> dict[str, dict]:
    """{original const name: {"op", "bytes"}} for each compressed weight of a PyMIL function.

    bytes = the stored size of the constexpr op's constant inputs (packed bit width x elements).
    """
    out = {}
    for op in function.operations:
        if op.op_type not in COMPRESSED_OPS:
            continue
        if all(c.op_type in COMPRESSED_OPS for o in op.outputs for c in o.child_ops):
            continue  # an inner link of a joint chain
        name = op.name
        for suffix in _COMPRESSED_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        stored = 0
        for var in op.inputs.values():
            if isinstance(var, (list, tuple)) or var.val is None or not isinstance(var.val, np.ndarray):
                continue
            stored += int(math.ceil(var.val.size * _bits(var) / 8))
        out[name] = {"op": op.op_type, "bytes": stored, "var": op.outputs[0].name}
    return out


# --------------------------------------------------------------------------------------------
# Compression of one package
# --------------------------------------------------------------------------------------------


class _CoremltoolsSkips(logging.Handler):
    """Collects coremltools' skip messages during compression: {weight name: reason}.

    coremltools logs "Invalid block_sizes; ... not divisible ..." (no name) and then "Cannot
    perform quantization on <name>. Skipped this op."; the unnamed message is the reason.
    """

    _NAMED = re.compile(r"(?:Cannot perform quantization on|op named) (\S+?)[.]? ")

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.reasons: dict[str, str] = {}
        self._pending: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        m = self._NAMED.search(msg + " ")
        if m:
            reason = "; ".join(self._pending) or msg
            self.reasons[m.group(1)] = f"coremltools skipped it: {reason}"
            self._pending = []
        elif record.levelno >= logging.WARNING:
            self._pending.append(msg)


@contextlib.contextmanager
def _capture_coremltools_skips():
    """coremltools logs skips on its own logger and (block-size messages) on the root logger."""
    ct_logger, root = logging.getLogger("coremltools"), logging.getLogger()
    handler = _CoremltoolsSkips()
    level, propagate = ct_logger.level, ct_logger.propagate
    ct_logger.addHandler(handler)
    root.addHandler(handler)
    ct_logger.setLevel(logging.WARNING)
    ct_logger.propagate = False
    try:
        yield handler
    finally:
        ct_logger.removeHandler(handler)
        root.removeHandler(handler)
        ct_logger.setLevel(level)
        ct_logger.propagate = propagate


def optimization_config(recipe: Recipe, weights: dict[str, dict]):
    """`OptimizationConfig` of a recipe for a function whose weights are `weights`."""
    import coremltools.optimize.coreml as cto

    names = {name: None for name, info in weights.items() if recipe.skip_reason(name, info["consumers"])}
    return cto.OptimizationConfig(global_config=scheme_config(recipe.scheme), op_name_configs=names)


def _compress(mlmodel, scheme: str, config):
    import coremltools.optimize.coreml as cto

    if scheme in ("int8", "int4"):
        return cto.linear_quantize_weights(mlmodel, config)
    return cto.palettize_weights(mlmodel, config)


def compress_mlmodel(mlmodel, recipe: Recipe, weights: dict[str, dict]):
    """Compress a single-function MLModel with coremltools; returns (model, coremltools skip reasons,
    {weight name: why the recipe's fallback scheme compressed it})."""
    import coremltools.optimize.coreml as cto

    with _capture_coremltools_skips() as skips:
        out = _compress(mlmodel, recipe.scheme, optimization_config(recipe, weights))
    fallen: dict[str, str] = {}
    if recipe.fallback:
        done = compressed_tensors(out._mil_program.functions["main"])
        left = [n for n, info in weights.items() if n not in done and not recipe.skip_reason(n, info["consumers"])
                and int(np.prod(info["shape"])) > WEIGHT_THRESHOLD and len(info["shape"]) > 1]
        if left:
            logger.info("%d weights left by %s: %s", len(left), recipe.scheme, recipe.fallback)
            fallen = {n: skips.reasons.get(n, f"coremltools' {recipe.scheme} skipped it without a reason") for n in left}
            config = cto.OptimizationConfig(global_config=None,
                                            op_name_configs={n: scheme_config(recipe.fallback) for n in left})
            with _capture_coremltools_skips() as more:
                out = _compress(out, recipe.fallback, config)
            skips.reasons.update(more.reasons)
    return out, skips.reasons, fallen


def extract_function(path: Path, function_name: str):
    """A single-function MLModel (function renamed `main`) of one function of a package.

    coremltools' compression refuses multifunction models; the weights file is shared, so nothing
    is copied until the model is saved.
    """
    import coremltools as ct

    from .runtime.package import package_files, read_spec

    # read only: coremltools' own loader rewrites the f16 package's Manifest.json (a kill then would
    # leave a stray file in the source bundle)
    spec, weights_dir = read_spec(path), package_files(path)[1]
    functions = spec.mlProgram.functions
    if function_name not in functions:
        raise QuantizeError(f"{path} has no function {function_name!r} (has {sorted(functions)})")
    if len(functions) == 1 and function_name == "main":
        return ct.models.MLModel(spec, weights_dir=weights_dir, skip_model_load=True)
    kept = type(functions[function_name])()
    kept.CopyFrom(functions[function_name])
    for name in list(functions.keys()):
        del functions[name]
    functions["main"].CopyFrom(kept)
    desc = spec.description
    fdesc = next(f for f in desc.functions if f.name == function_name)
    for part in ("input", "output", "state"):
        del getattr(desc, part)[:]
        getattr(desc, part).extend(getattr(fdesc, part))
    del desc.functions[:]
    desc.defaultFunctionName = ""
    return ct.models.MLModel(spec, weights_dir=weights_dir, skip_model_load=True)


def compress_package(src: Path, dst: Path, recipe: Recipe) -> dict:
    """Write the compressed copy of package `src` to `dst`; returns its report section.

    Multifunction packages: every function is compressed alone and the results are merged
    (`coremltools.utils.save_multifunction`: identical weights stored once); the report says
    whether the merged weight file stays the size of one function's (weights shared).
    """
    import coremltools as ct

    from .convert import temporary_dir, weight_file_bytes
    from .runtime.package import read_spec

    functions = package_functions(src)
    default = functions[0] if "main" not in functions else "main"
    weights = weight_tensors(load_function(src, default))
    section: dict[str, Any] = {"package": src.name, "recipe": recipe.to_dict(), "functions": functions}
    t0 = time.perf_counter()
    if recipe.scheme is None:
        shutil.copytree(src, dst)
        skips: dict[str, str] = {}
        fallen: dict[str, str] = {}
    else:
        skips, fallen = {}, {}
        scratch = temporary_dir(dst.parent, "compress")
        try:
            singles = {}
            for fn in functions:
                logger.info("compressing %s function %s (%s)", src.name, fn, recipe.scheme)
                model = extract_function(src, fn)
                fn_weights = weight_tensors(load_function(src, fn)) if fn != default else weights
                if fn_weights:
                    compressed, fn_skips, fn_fallen = compress_mlmodel(model, recipe, fn_weights)
                    skips.update(fn_skips)
                    fallen.update(fn_fallen)
                else:  # nothing to compress (the decoder's bind_memory): merged as it is
                    compressed = model
                singles[fn] = scratch / f"{fn}.mlpackage"
                compressed.save(str(singles[fn]))
                del compressed, model
            if len(functions) == 1:
                os.rename(singles[default], dst)
            else:
                descriptor = ct.utils.MultiFunctionDescriptor()
                for fn, single in singles.items():
                    descriptor.add_function(str(single), src_function_name="main", target_function_name=fn)
                descriptor.default_function_name = default
                merged = scratch / "merged.mlpackage"
                ct.utils.save_multifunction(descriptor, str(merged))
                merged_model = ct.models.MLModel(str(merged), skip_model_load=True)
                source_meta = read_spec(src).description.metadata.userDefined
                merged_model.user_defined_metadata.update(dict(source_meta))
                merged_model.save(str(dst))
                one = weight_file_bytes(singles[default])
                merged_bytes = weight_file_bytes(dst)
                section["multifunction"] = {
                    "single_function_weight_bytes": one, "merged_weight_bytes": merged_bytes,
                    # shared when the merged file is at most the single one plus the weights that
                    # differ between functions (e.g. per-window position tables of encoder buckets)
                    "merged_over_single": round(merged_bytes / max(one, 1), 4),
                }
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    section["compress_seconds"] = round(time.perf_counter() - t0, 2)
    section.update(tensor_report(weights, load_function(dst, default), recipe, skips, fallen))
    section["package_bytes"] = {"before": _tree_bytes(src), "after": _tree_bytes(dst)}
    section["weight_file_bytes"] = {"before": weight_file_bytes(src), "after": weight_file_bytes(dst)}
    return section


def _tree_bytes(path: Path) -> int:
    from .convert import package_size_bytes

    return package_size_bytes(path)


def tensor_report(weights: dict[str, dict], compressed_function, recipe: Recipe, skips: dict[str, str],
                  fallen: dict[str, str] | None = None) -> dict:
    """Every weight tensor: compressed (scheme, bytes before/after; a fallback says why) or left fp16
    (with the reason)."""
    done = compressed_tensors(compressed_function)
    fallen = fallen or {}
    compressed, uncompressed = [], []
    for name, info in weights.items():
        if name in done:
            entry = {"name": name, "shape": info["shape"], "scheme": recipe.scheme, "op": done[name]["op"],
                     "bytes_before": info["bytes"], "bytes_after": done[name]["bytes"]}
            if name in fallen:
                entry.update(scheme=recipe.fallback, fallback_for=f"{recipe.scheme}: {fallen[name]}")
            compressed.append(entry)
            continue
        n = int(np.prod(info["shape"]))
        if recipe.scheme is None:
            reason = "the preset keeps this component fp16"
        else:
            reason = recipe.skip_reason(name, info["consumers"]) or skips.get(name)
        if reason is None and n <= WEIGHT_THRESHOLD:
            reason = f"below coremltools' weight_threshold ({n} <= {WEIGHT_THRESHOLD} elements)"
        if reason is None and len(info["shape"]) <= 1:
            reason = "1-D tensor (coremltools never compresses rank-1 constants)"
        if reason is None:
            reason = "coremltools did not compress it and logged no reason"
        uncompressed.append({"name": name, "shape": info["shape"], "bytes": info["bytes"], "reason": reason})
    before = sum(w["bytes"] for w in weights.values())
    after = sum(c["bytes_after"] for c in compressed) + sum(u["bytes"] for u in uncompressed)
    return {
        "tensors": {"total": len(weights), "compressed": len(compressed), "uncompressed": len(uncompressed)},
        "weight_bytes": {"before": before, "after": after, "ratio": round(after / max(before, 1), 4)},
        "compressed": compressed,
        "uncompressed": uncompressed,
    }


# --------------------------------------------------------------------------------------------
# Gate data: audio cases, the f16 reference through the runtime
# --------------------------------------------------------------------------------------------


@dataclass
class GateData:
    """Encoder windows and decoder sequences the gates and the sensitivity run on."""

    windows: list[tuple[np.ndarray, int]]  # (features (1, M, F) float32, valid frames)
    languages: list[str]
    prompts: list[list[int]]
    encoder_ref: list[dict[str, np.ndarray]] = field(default_factory=list)  # f16 encoder outputs
    sequences: list[list[int]] = field(default_factory=list)  # fed ids (prompt + greedy - last)
    decoder_ref: list[np.ndarray] = field(default_factory=list)  # (S, V) f16 decoder log-probs
    eos_ids: tuple[int, ...] = ()

    def subset(self, indices: Sequence[int]) -> "GateData":
        """The same data restricted to some windows (sensitivity runs use few)."""
        pick = [list(range(len(self.windows)))[i] for i in indices]
        return GateData(windows=[self.windows[i] for i in pick], languages=[self.languages[i] for i in pick],
                        prompts=[self.prompts[i] for i in pick], encoder_ref=[self.encoder_ref[i] for i in pick],
                        sequences=[self.sequences[i] for i in pick], decoder_ref=[self.decoder_ref[i] for i in pick],
                        eos_ids=self.eos_ids)


def load_eval_manifest(eval_dir: Path) -> list[dict]:
    path = Path(eval_dir) / "manifest.json"
    if not path.is_file():
        raise QuantizeError(f"{eval_dir} has no manifest.json (an evaluation folder: utterances with file, "
                            "language, text)")
    data = json.loads(path.read_text())
    utts = data.get("utterances") if isinstance(data, dict) else None
    if not utts:
        raise QuantizeError(f"{path} lists no utterances")
    return utts


def gate_clips(eval_dir: Path, per_language: int = GATE_CLIPS_PER_LANGUAGE) -> list[tuple[Path, str]]:
    """The first `per_language` clips of each language of an evaluation folder."""
    counts: dict[str, int] = {}
    clips = []
    for u in load_eval_manifest(eval_dir):
        if counts.get(u["language"], 0) < per_language:
            counts[u["language"]] = counts.get(u["language"], 0) + 1
            clips.append((Path(eval_dir) / u["file"], u["language"]))
    return clips


def build_gate_data(bundle_dir: Path, clips: Sequence[tuple[Path, str]], max_new_tokens: int = 48) -> GateData:
    """Windows of real speech (each clip, plus one full window of them back to back) and the f16
    bundle's own greedy decode of each (the teacher-forcing sequences), all through the runtime."""
    from .audio import FrontEndConfig, load_audio, log_mel, pad_to_window
    from .bundle import Bundle
    from .convert import release_memory
    from .transcribe import Transcriber

    bundle = Bundle.load(bundle_dir)
    m = bundle.manifest
    config = FrontEndConfig.from_dict({**m["audio"], "dither": 0.0})
    frames = bundle.window_frames
    windows, languages, feats = [], [], []
    for path, lang in clips:
        mel, n = log_mel(load_audio(path, target_rate=config.sampling_rate), config)
        n = min(n, frames)
        feats.append(mel[:, :n])
        window, n = pad_to_window(mel[:, :n], n, frames=frames)
        windows.append((window[None].astype(np.float32), n))
        languages.append(lang)
    if clips:  # one full window of speech
        joined = np.concatenate(feats, axis=1)
        full = np.tile(joined, (1, -(-frames // joined.shape[1])))[:, :frames]
        windows.append((full[None].astype(np.float32), frames))
        languages.append(languages[0])
    data = GateData(windows=windows, languages=languages,
                    prompts=[bundle.prompt(lang) for lang in languages], eos_ids=tuple(sorted(bundle.eos_ids)))
    tr = Transcriber(bundle, backend="mil", use_prefill=False)
    for (window, n), prompt in zip(windows, data.prompts):
        enc = tr.encode(window, n)
        data.encoder_ref.append(enc)
        dec = tr.decode(enc, prompt, max_new_tokens=max_new_tokens, return_log_probs=True)
        fed = list(prompt) + dec["token_ids"][:-1]
        data.sequences.append(fed)
        data.decoder_ref.append(np.stack(dec["log_probs"]))
    del tr, bundle
    release_memory()  # the f16 packages are not needed again: give their memory back before compressing
    return data


def encoder_outputs(model, data: GateData) -> list[dict[str, np.ndarray]]:
    return [model.predict({"input_features": w, "feature_length": np.array([n], dtype=np.int32)})
            for w, n in data.windows]


def decoder_runtime(package: Path, step=None):
    """The decoder package's functions on one state (`DecoderRuntime`); `step`: an already loaded
    step function of it (e.g. one whose constants the sensitivity run replaces)."""
    from .config import BIND_FUNCTION
    from .decoder_runtime import DecoderRuntime
    from .runtime import load_model

    if step is None:
        return DecoderRuntime.load(package, backend="mil", prefill=False)
    return DecoderRuntime(step, load_model(str(package), backend="mil", function_name=BIND_FUNCTION))


def decoder_outputs(decoder, data: GateData) -> list[np.ndarray]:
    """Teacher-forced log-probs (S, V) of each gate sequence, on the f16 encoder's memory bound
    through bind_memory. `decoder`: a `DecoderRuntime` (`decoder_runtime`)."""
    from .decoder import TeacherForcingCase, run_teacher_forcing

    rows = []
    for enc, ids, prompt in zip(data.encoder_ref, data.sequences, data.prompts):
        case = TeacherForcingCase(cross_k=enc["cross_k"], cross_v=enc["cross_v"], cross_mask=enc["cross_mask"],
                                  ids=ids, log_probs=None, prompt_len=len(prompt))
        rows.append(run_teacher_forcing(decoder, case))
    return rows


def encoder_psnr(reference: list[dict], produced: list[dict]) -> float:
    """Worst PSNR (dB) over the float outputs of every window (valid and padded rows alike)."""
    from .convert import psnr

    worst = float("inf")
    for ref, out in zip(reference, produced):
        for name, r in ref.items():
            if np.asarray(r).dtype.kind == "f":
                worst = min(worst, psnr(r, out[name]))
    return worst


def log_prob_error(reference: list[np.ndarray], produced: list[np.ndarray], prompts: list[list[int]],
                   eos_ids: Sequence[int], top_k: int = 16) -> dict:
    """Per-step log-prob error (nats) of decoder outputs vs the f16 decoder, on decoding steps.

    For each step that greedy decoding reads (from the last prompt token on), the signed error
    d = lp_quantized - lp_f16 over the reference's top-`top_k` tokens: `abs_error` are the |d|
    values, `flip_bound` = max(d) - min(d) per step (a near-tie between two of those tokens with
    a smaller margin can flip), `eos` the signed error of the eos id at every step.
    """
    from .convert import psnr
    from .decoder import argmax_flips, kl_rows

    abs_err, flip, eos_err, kls, psnrs = [], [], [], [], []
    agree = total = 0
    flips = {"flips": 0, "near_tie_flips": 0, "decisive_flips": 0, "rows": []}
    for ref, out, prompt in zip(reference, produced, prompts):
        s = slice(len(prompt) - 1, len(ref))
        r, o = np.asarray(ref[s], np.float64), np.asarray(out[s], np.float64)
        top = np.argsort(-r, axis=-1)[:, :top_k]
        d = np.take_along_axis(o, top, -1) - np.take_along_axis(r, top, -1)
        abs_err.append(np.abs(d).reshape(-1))
        flip.append(d.max(-1) - d.min(-1))
        for e in eos_ids:
            eos_err.append(o[:, e] - r[:, e])
        # both sides renormalised: fp16 log-probs do not sum to exactly 1, and kl_rows renormalises
        # only its second argument (identical fp16 rows would otherwise give KL ~6e-5, not 0)
        kls.append(kl_rows(r - np.log(np.sum(np.exp(r - r.max(-1, keepdims=True)), -1, keepdims=True))
                           - r.max(-1, keepdims=True), o))
        psnrs.append(psnr(ref, out))
        agree += int(np.sum(r.argmax(-1) == o.argmax(-1)))
        total += r.shape[0]
        f = argmax_flips(r, o, positions=range(s.start, len(ref)))  # the export gate's near-tie rule
        for key in ("flips", "near_tie_flips", "decisive_flips"):
            flips[key] += f[key]
        flips["rows"] += [{"case": len(psnrs) - 1, **row} for row in f["rows"]]

    def stats(x):
        x = np.concatenate(x) if x else np.zeros(0)
        if not x.size:
            return {}
        return {"median": float(np.median(np.abs(x))), "p99": float(np.percentile(np.abs(x), 99)),
                "max": float(np.max(np.abs(x))), "mean_signed": float(np.mean(x)), "n": int(x.size)}

    kl = np.concatenate(kls)
    return {
        "steps": int(total), "argmax_agree": int(agree), "top_k": top_k,
        "worst_psnr_db": float(min(psnrs)), "mean_kl": float(np.mean(kl)), "max_kl": float(np.max(kl)),
        "abs_error_nats": stats(abs_err), "flip_bound_nats": stats(flip), "eos_error_nats": stats(eos_err),
        "near_tie_flips": flips["near_tie_flips"], "decisive_flips": flips["decisive_flips"], "flips": flips["rows"],
    }


# --------------------------------------------------------------------------------------------
# Sensitivity: each weight quantized alone, through the interpreter
# --------------------------------------------------------------------------------------------


def _component_score(component: str, model, data: GateData, reference) -> float:
    """`model`: the encoder's loaded function, or the decoder's `DecoderRuntime`."""
    if component == "encoder":
        return encoder_psnr(reference, encoder_outputs(model, data))
    from .convert import psnr

    produced = decoder_outputs(model, data)
    return min(psnr(r, o) for r, o in zip(reference, produced))


def sensitivity(component: str, f16_package: Path, quantized_package: Path, data: GateData,
                names: Sequence[str] | None = None) -> dict:
    """Output PSNR (dB, vs the f16 package) of the component with ONE weight quantized, per weight.

    The quantized values are the quantized package's own (decompressed by the runtime exactly as
    coremltools does); they replace the fp16 constant in the loaded f16 program, so one load of
    each package serves every weight. Returns {"all": PSNR with every weight quantized,
    "per_weight": {name: PSNR}}.
    """
    from tqdm import tqdm

    from .runtime import load_model

    f16 = load_model(str(f16_package), backend="mil")
    quant = load_model(str(quantized_package), backend="mil")
    reference = data.encoder_ref if component == "encoder" else data.decoder_ref
    swaps = _swaps(f16_package, quantized_package, quant)
    names = [n for n in (names or swaps) if n in swaps]
    if component == "decoder":  # the step's constants are swapped; bind_memory has none
        scored_quant, scored_f16 = decoder_runtime(quantized_package, quant), decoder_runtime(f16_package, f16)
    else:
        scored_quant, scored_f16 = quant, f16
    result = {"all": _component_score(component, scored_quant, data, reference), "per_weight": {},
              "windows": len(data.windows)}
    for name in tqdm(names, desc=f"{component} sensitivity", unit="weight", leave=False):
        with f16.replaced_constants(dict([swaps[name]])):
            result["per_weight"][name] = _component_score(component, scored_f16, data, reference)
    return result


def _swaps(f16_package: Path, quantized_package: Path, quant_model) -> dict[str, tuple[str, Any]]:
    """{weight name: (f16 var name, quantized value as loaded by the runtime)}."""
    weights = weight_tensors(load_function(f16_package))
    done = compressed_tensors(load_function(quantized_package))
    return {n: (weights[n]["var"], quant_model.constant(d["var"])) for n, d in done.items() if n in weights}


def choose_fp16(component: str, f16_package: Path, quantized_package: Path, data: GateData,
                per_weight: dict[str, float], bytes_saved: dict[str, int], target_psnr: float,
                max_kept: int | None = None) -> dict:
    """Keep the most sensitive weights fp16 (lowest single-weight PSNR first) until the component's
    output PSNR with everything else quantized reaches `target_psnr` (or `max_kept` are kept).
    Returns the kept names, the PSNR after each step (for the decoder also the log-prob error
    bound, median / p99 / max nats over the top tokens and the eos id's max: what each extra byte
    buys) and the extra bytes."""
    from .convert import psnr
    from .runtime import load_model

    f16 = load_model(str(f16_package), backend="mil")
    quant = load_model(str(quantized_package), backend="mil")
    reference = data.encoder_ref if component == "encoder" else data.decoder_ref
    swaps = _swaps(f16_package, quantized_package, quant)
    scored = decoder_runtime(f16_package, f16) if component == "decoder" else f16  # constants swapped in f16
    order = sorted(per_weight, key=lambda n: per_weight[n])
    kept: list[str] = []
    steps = []
    while True:
        swap = dict(swaps[n] for n in order if n not in kept)
        step: dict[str, Any] = {"kept_fp16": len(kept), "extra_bytes": int(sum(bytes_saved.get(n, 0) for n in kept))}
        with f16.replaced_constants(swap):
            if component == "encoder":
                score = encoder_psnr(reference, encoder_outputs(f16, data))
            else:
                produced = decoder_outputs(scored, data)
                score = min(psnr(r, o) for r, o in zip(reference, produced))
                lp = log_prob_error(reference, produced, data.prompts, data.eos_ids)
                step["log_prob_error_nats"] = {k: lp["abs_error_nats"].get(k) for k in ("median", "p99", "max")}
                step["eos_error_max_nats"] = lp["eos_error_nats"].get("max")
        steps.append({**step, "psnr_db": score})
        if score >= target_psnr or len(kept) == len(order) or (max_kept is not None and len(kept) >= max_kept):
            break
        kept.append(order[len(kept)])
    return {"target_psnr_db": target_psnr, "met": steps[-1]["psnr_db"] >= target_psnr, "kept_fp16": kept,
            "steps": steps, "extra_bytes": steps[-1]["extra_bytes"]}


# --------------------------------------------------------------------------------------------
# Held-out set: greedy tokens and WER vs PyTorch (or vs the f16 bundle without a checkpoint)
# --------------------------------------------------------------------------------------------


def bundle_transcripts(bundle_dir: Path, eval_dir: Path, limit_per_language: int | None = None,
                       max_new_tokens: int = 96) -> dict:
    """Greedy token ids and texts of every clip of an evaluation folder through a bundle (runtime)."""
    from tqdm import tqdm

    from .transcribe import Transcriber

    tr = Transcriber(bundle_dir, backend="mil")
    utts = _limit(load_eval_manifest(eval_dir), limit_per_language)
    ids, texts = [], []
    for u in tqdm(utts, desc=f"held-out through {Path(bundle_dir).name}", unit="clip", leave=False):
        res = tr.transcribe(Path(eval_dir) / u["file"], language=u["language"], max_new_tokens=max_new_tokens)
        ids.append([t for w in res.windows for t in w.token_ids])
        texts.append(res.text)
    return {"files": [u["file"] for u in utts], "refs": [u["text"] for u in utts],
            "languages": [u["language"] for u in utts], "ids": ids, "texts": texts}


def _limit(utts: list[dict], per_language: int | None) -> list[dict]:
    if per_language is None:
        return utts
    counts: dict[str, int] = {}
    out = []
    for u in utts:
        if counts.get(u["language"], 0) < per_language:
            counts[u["language"]] = counts.get(u["language"], 0) + 1
            out.append(u)
    return out


def pytorch_transcripts(model_ref: str, eval_dir: Path, limit_per_language: int | None = None,
                        max_new_tokens: int = 96) -> dict:
    """The same with `transformers` greedy generation; the model is freed before returning."""
    from .audio import FrontEndConfig, load_audio, log_mel
    from .checkpoint import load_reference
    from .convert import release_memory
    from .scoring import greedy_decode

    model, processor = load_reference(model_ref)
    config = FrontEndConfig.from_processor(processor, dither=0.0)
    utts = _limit(load_eval_manifest(eval_dir), limit_per_language)
    feats = []
    for u in utts:
        f, n = log_mel(load_audio(Path(eval_dir) / u["file"]), config)
        feats.append(f[:, :n])
    decoded = greedy_decode(model, processor.tokenizer, feats, [u["language"] for u in utts],
                            max_new_tokens=max_new_tokens)
    del model, processor
    release_memory()
    return {"files": [u["file"] for u in utts], "refs": [u["text"] for u in utts],
            "languages": [u["language"] for u in utts], "ids": [d.ids for d in decoded],
            "texts": [d.text for d in decoded]}


def compare_transcripts(baseline: dict, produced: dict) -> dict:
    """Token agreement, overall WER, and per language the error rate (`metrics.error_counts`: WER, or
    CER for ja/zh/ko, the bench's measure) of both sides and its increase; `worst_increase` is the
    largest per-language increase (what the held-out gate bounds: an average over languages would
    hide one language made worse)."""
    from .metrics import error_counts, token_agreement
    from .scoring import word_error_rate

    wer_base = word_error_rate(baseline["refs"], baseline["texts"])
    wer = word_error_rate(produced["refs"], produced["texts"])
    languages = {}
    for lang in sorted(set(baseline["languages"])):
        pick = [i for i, x in enumerate(baseline["languages"]) if x == lang]
        refs = [baseline["refs"][i] for i in pick]
        base = error_counts(refs, [baseline["texts"][i] for i in pick], lang)
        mine = error_counts(refs, [produced["texts"][i] for i in pick], lang)
        languages[lang] = {"clips": len(pick), "metric": base["metric"], "baseline": base["rate"],
                           "rate": mine["rate"], "increase": mine["rate"] - base["rate"],
                           "identical_clips": sum(baseline["ids"][i] == produced["ids"][i] for i in pick)}
    return {**token_agreement(baseline["ids"], produced["ids"]), "wer_baseline": wer_base, "wer": wer,
            "wer_increase": wer - wer_base, "languages": languages,
            "worst_increase": max((v["increase"] for v in languages.values()), default=0.0),
            "differing_files": [f for f, a, b in zip(produced["files"], baseline["ids"], produced["ids"]) if a != b]}


# --------------------------------------------------------------------------------------------
# The whole command
# --------------------------------------------------------------------------------------------


def source_preset(bundle_dir: Path) -> str:
    """Preset of an existing bundle ("f16" for a bundle without a compression report)."""
    report = Path(bundle_dir) / COMPRESSION_FILE
    if report.is_file():
        return str(json.loads(report.read_text()).get("preset", "unknown"))
    return "f16"


def check_source(bundle_dir: Path) -> None:
    """Refuse anything but a complete, uncompressed f16 bundle."""
    from .bundle import MANIFEST_NAME

    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / MANIFEST_NAME).is_file():
        raise QuantizeError(f"{bundle_dir} is not a bundle (no {MANIFEST_NAME}): export one with "
                            "`cohere-coreml export` first")
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_text())
    if manifest.get("checksums"):
        from .integrity import check_bundle

        check_bundle(bundle_dir, hashes=True)  # names any file that changed since export
    preset = source_preset(bundle_dir)
    if manifest.get("preset", preset) != "f16" or preset != "f16":
        preset = manifest.get("preset") if manifest.get("preset", "f16") != "f16" else preset
        raise QuantizeError(f"{bundle_dir} is already a {preset!r} bundle: quantize the f16 bundle it was "
                            "made from, not a quantized one (weights are compressed once)")
    for comp in COMPONENTS:
        pkg = bundle_dir / f"{comp}.mlpackage"
        if not pkg.is_dir():
            raise QuantizeError(f"{bundle_dir} has no {pkg.name}")
        found = compressed_ops(pkg)
        if found:
            raise QuantizeError(f"{pkg} already holds compressed weights ({len(found)} ops, e.g. {found[0]}): "
                                "quantize the f16 bundle, not a quantized one")


def quantize_bundle(src: str | Path, out: str | Path, preset: str = DEFAULT_PRESET, *, model: str | None = None,
                    eval_dir: str | Path | None = None, target_psnr: float | None = None,
                    with_sensitivity: bool = False, limit_per_language: int | None = None,
                    force: bool = False, skip_gate: bool = False) -> dict:
    """Build bundle `out` from f16 bundle `src` with `preset`, gated; returns compression.json's content.

    The PyTorch checkpoint (`model`) is only used by the held-out gate (tokens / WER vs PyTorch);
    without it that gate compares with the f16 bundle through the runtime.
    """
    from . import faults
    from .convert import ExportSettings, ParityError, release_memory, sweep_stale_temporaries, write_json_atomic
    from .gate import export_gated
    from .publish import finalize_bundle

    src, out = Path(src), Path(out)
    recipes = preset_recipes(preset)
    if preset == "f16":
        raise QuantizeError("preset f16 is the exported bundle itself: choose q8, q8-hybrid or q4")
    check_source(src)
    if out.resolve() == src.resolve():
        raise QuantizeError("--out must differ from --bundle (the f16 bundle is never modified)")
    if _holds_files(out) and not force:
        raise QuantizeError(f"{out} exists; use --force to replace it")
    gates = GATES[preset]
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(out.parent, prefix=f"{out.name}.")  # `.q8.tmp-<pid>` of a killed build
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    report: dict[str, Any] = {"preset": preset, "source": str(src), "source_preset": "f16",
                              "schemes": SCHEMES, "components": {}}
    # the packages are written and gated like an export's (gate.export_gated), into the temporary bundle
    settings = ExportSettings(out_dir=tmp, skip_verify=skip_gate)
    gate_reports: dict[str, GateReport] = {}
    try:
        t0 = time.perf_counter()
        data = None
        if not skip_gate or with_sensitivity or target_psnr is not None:
            # the f16 references first (through the runtime); no quantized package is loaded yet
            clips = gate_clips(Path(eval_dir)) if eval_dir else packaged_gate_clips()
            logger.info("gate data: %d clips through the f16 bundle", len(clips))
            data = build_gate_data(src, clips)
        for comp in COMPONENTS:
            section: dict[str, Any] = {}

            def write(path: Path, comp=comp, section=section) -> None:
                section.update(build_component(comp, src / f"{comp}.mlpackage", path, recipes[comp], data,
                                               with_sensitivity=with_sensitivity, target_psnr=target_psnr))

            def gate(path: Path, comp=comp) -> GateReport:
                return component_gate(comp, path, data, preset, gates)

            gate_reports[comp] = export_gated(comp, settings, write, gate)
            report["components"][comp] = section
            release_memory()  # the gated package's interpreter copy, before the next component
        report["compress_seconds"] = round(time.perf_counter() - t0, 1)
        faults.point(f"copy/{out.name}", tmp)
        _copy_bundle_files(src, tmp)
        _write_manifest(src, tmp)  # provisional (the held-out gate loads the bundle)
        if not skip_gate:
            if eval_dir is not None:
                held = heldout_gate(src, tmp, Path(eval_dir), gates, model=model,
                                    limit_per_language=limit_per_language)
                write_json_atomic(held.to_dict(), settings.report_path(HELDOUT_COMPONENT))
                gate_reports[HELDOUT_COMPONENT] = held
                if not held.passed:
                    raise QuantizeGateError(f"the {preset} bundle failed its gate: {held.headline}", held.to_dict())
            else:
                logger.warning("no evaluation folder: the held-out token/WER gate did not run")
            report["gate"] = {name: r.to_dict() for name, r in gate_reports.items()}
            report["gate"].update(failures=[], passed=True)
        else:
            logger.warning("quantization gate skipped (--skip-gate)")
            report["gate"] = {"skipped": True}
        report["total_bytes"] = {"before": _bundle_bytes(src), "after": _bundle_bytes(tmp)}
        write_json_atomic(report, tmp / COMPRESSION_FILE)
        _write_manifest(src, tmp)
        finalize_bundle(tmp)  # README.md, example_inference.py, then the manifest's checksums (last)
        _install_bundle(tmp, out)
        if not skip_gate:  # a gated build replaces an earlier refusal; an ungated one says nothing new
            refusal_path(out).unlink(missing_ok=True)
    except ParityError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = err.report.to_dict() if isinstance(err.report, GateReport) else None
        path = _write_refusal(out, preset, {**{n: r.to_dict() for n, r in gate_reports.items()},
                                            **({err.report.component: refused} if refused else {})})
        raise QuantizeGateError(f"the {preset} bundle failed its gate: {refused['headline'] if refused else err} "
                                f"(figures: {path})", refused) from err
    except QuantizeGateError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        path = _write_refusal(out, preset, {n: r.to_dict() for n, r in gate_reports.items()})
        raise QuantizeGateError(f"{err} (figures: {path})", err.report) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%s)", out, preset)
    return report


def _install_bundle(tmp: Path, out: Path) -> None:
    """Rename the complete bundle `tmp` to `out`. An older `out` is renamed aside first (hidden
    `.<out>.old-<pid>`, removed once the new one is in place; put back if the rename fails), so at
    every instant `out` is the old bundle, the new one, or (between two renames) absent."""
    from . import faults
    from .convert import TEMPORARY_NAME

    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    faults.point(f"install/{out.name}", out)
    try:
        if out.exists():
            for hidden in out.glob(".*"):  # the checkout's q8/.gitkeep stays (hidden: not part of the bundle)
                if hidden.is_file() and not TEMPORARY_NAME.match(hidden.name):
                    shutil.copy2(hidden, tmp / hidden.name)
            os.rename(out, old)
            faults.point(f"swap/{out.name}", out)
        os.rename(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def build_component(comp: str, f16_package: Path, dst: Path, recipe: Recipe, data: GateData | None, *,
                    with_sensitivity: bool = False, target_psnr: float | None = None) -> dict:
    """Compress one package into `dst` (with sensitivity, and `--target-psnr` keeping the most
    sensitive weights fp16: the package is then rebuilt); returns its compression.json section."""
    section = compress_package(f16_package, dst, recipe)
    if recipe.scheme is None or data is None or not (with_sensitivity or target_psnr is not None):
        return section
    # encoder: one clip + the full window (each window is a full encoder run); decoder: all
    sens_data = data.subset(SENSITIVITY_WINDOWS) if comp == "encoder" else data
    sens = sensitivity(comp, f16_package, dst, sens_data)
    section["sensitivity"] = {"metric": "component output PSNR (dB) vs f16 with only this weight quantized", **sens}
    if target_psnr is not None and sens["all"] < target_psnr:
        saved = {c["name"]: c["bytes_before"] - c["bytes_after"] for c in section["compressed"]}
        choice = choose_fp16(comp, f16_package, dst, sens_data, sens["per_weight"], saved, target_psnr)
        section["target_psnr"] = choice
        if choice["kept_fp16"]:
            recipe = Recipe(recipe.scheme, recipe.skip_names, recipe.skip_op_types, tuple(choice["kept_fp16"]))
            shutil.rmtree(dst)
            rebuilt = compress_package(f16_package, dst, recipe)
            rebuilt["sensitivity"], rebuilt["target_psnr"] = section["sensitivity"], choice
            section = rebuilt
    return section


def packaged_gate_clips() -> list[tuple[Path, str]]:
    """The export gates' speech (shipped with the package), language from the file name (en_medium.flac)."""
    from .gate import default_gate_audio

    return [(path, path.name.split("_", 1)[0]) for path in default_gate_audio()]


def _bundle_bytes(bundle_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(bundle_dir).rglob("*") if f.is_file())


def _copy_bundle_files(src: Path, dst: Path) -> None:
    """Everything of the f16 bundle but the packages compressed here, their gate reports and generated
    docs. A package not compressed (frontend.mlpackage, fp32) is copied as is, with its gate report."""
    from .bundle import MANIFEST_NAME

    skip = {f"{c}.mlpackage" for c in COMPONENTS} | {COMPRESSION_FILE, "README.md", "example_inference.py",
                                                       MANIFEST_NAME}
    skip |= {f"{c}.parity.json" for c in (*COMPONENTS, HELDOUT_COMPONENT)}
    for f in src.iterdir():
        if f.name in skip or f.name.endswith(".parity-failed.json") or f.name.startswith("."):
            continue
        if f.is_dir():
            shutil.copytree(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)


def _write_manifest(src: Path, dst: Path) -> None:
    """The f16 bundle's manifest (ids, prompts, shapes: the quantized packages have the same I/O) with
    the sections `bundle.write_manifest` computes from `dst` (preset and recipe from compression.json,
    min_os, checksums)."""
    from .bundle import MANIFEST_NAME, write_manifest

    write_manifest(json.loads((src / MANIFEST_NAME).read_text()), dst)


def component_gate(comp: str, package: Path, data: GateData, preset: str, gates: dict) -> GateReport:
    """A quantized package vs the f16 one, through the runtime, on the f16 references of `data`.

    encoder: worst PSNR over the float outputs of every window. decoder: teacher forcing on the f16
    bundle's greedy tokens and the f16 encoder's memory: PSNR, KL and the log-prob error figures.
    """
    from .runtime import load_model

    if comp == "encoder":
        loaded = load_model(str(package), backend="mil")
        worst = encoder_psnr(data.encoder_ref, encoder_outputs(loaded, data))
        need = gates["encoder_psnr_db"]
        passed = bool(worst >= need)
        return GateReport(
            component=comp, passed=passed,
            headline=f"encoder PSNR {worst:.1f} dB {'>=' if passed else '<'} {need} dB vs the f16 encoder "
            f"({len(data.windows)} windows)",
            details={"reference": "f16 encoder.mlpackage (runtime)", "preset": preset, "worst_psnr_db": worst,
                     "min_psnr_db": need, "windows": len(data.windows)})
    lp = log_prob_error(data.decoder_ref, decoder_outputs(decoder_runtime(package), data), data.prompts, data.eos_ids)
    passed = bool(lp["worst_psnr_db"] >= gates["decoder_psnr_db"] and lp["mean_kl"] <= gates["decoder_mean_kl"]
                  and lp["decisive_flips"] == 0)  # argmax flips refuse unless near-ties the measured error explains
    return GateReport(
        component=comp, passed=passed,
        headline=f"decoder PSNR {lp['worst_psnr_db']:.1f} dB (min {gates['decoder_psnr_db']}), mean KL "
        f"{lp['mean_kl']:.3g} (max {gates['decoder_mean_kl']}), argmax {lp['argmax_agree']}/{lp['steps']} vs the "
        f"f16 decoder ({lp['near_tie_flips']} near-tie, {lp['decisive_flips']} decisive flips)",
        details={"reference": "f16 decoder.mlpackage, teacher forcing on the f16 bundle's greedy tokens and the "
                 "f16 encoder's memory", "preset": preset, **lp, "min_psnr_db": gates["decoder_psnr_db"],
                 "max_mean_kl": gates["decoder_mean_kl"]})


def heldout_gate(f16_dir: Path, q_dir: Path, eval_dir: Path, gates: dict, *, model: str | None,
                 limit_per_language: int | None) -> GateReport:
    """Greedy tokens / WER of the quantized bundle on `eval_dir` vs PyTorch (`model`; computed first,
    the model freed before the bundle is loaded), or vs the f16 bundle without a checkpoint."""
    if model:
        baseline = pytorch_transcripts(model, eval_dir, limit_per_language)
        base_name = "pytorch"
    else:
        baseline = bundle_transcripts(f16_dir, eval_dir, limit_per_language)
        base_name = "f16 bundle"
    produced = bundle_transcripts(q_dir, eval_dir, limit_per_language)
    cmp = compare_transcripts(baseline, produced)
    cmp["baseline"] = base_name
    cmp["eval_set"] = eval_dir.name
    cmp["max_wer_increase"] = gates["max_wer_increase"]
    passed = bool(cmp["identical_clips"] == cmp["clips"] or cmp["worst_increase"] <= gates["max_wer_increase"])
    worst = max(cmp["languages"], key=lambda lang: cmp["languages"][lang]["increase"])
    w = cmp["languages"][worst]
    return GateReport(
        component=HELDOUT_COMPONENT, passed=passed,
        headline=f"held-out: {cmp['identical_clips']}/{cmp['clips']} clips identical to {base_name}, "
        f"WER {100 * cmp['wer']:.2f} % vs {100 * cmp['wer_baseline']:.2f} %; worst language {worst}: "
        f"{w['metric'].upper()} {100 * w['rate']:.2f} % vs {100 * w['baseline']:.2f} % "
        f"({100 * w['increase']:+.2f} points, max +{100 * gates['max_wer_increase']:.2f})",
        details=cmp)


def format_summary(report: dict) -> str:
    lines = [f"preset {report['preset']}: bundle {report['total_bytes']['before']:,} -> "
             f"{report['total_bytes']['after']:,} bytes"]
    for comp, sec in report["components"].items():
        wb = sec["weight_bytes"]
        lines.append(f"  {comp:8s} {sec['recipe']['scheme'] or 'fp16':5s} weights {wb['before']:,} -> {wb['after']:,} "
                     f"bytes ({sec['tensors']['compressed']}/{sec['tensors']['total']} tensors compressed)")
        if "target_psnr" in sec:
            t = sec["target_psnr"]
            lines.append(f"           --target-psnr {t['target_psnr_db']}: {len(t['kept_fp16'])} weights kept fp16 "
                         f"(+{t['extra_bytes']:,} bytes), PSNR {t['steps'][-1]['psnr_db']:.1f} dB")
    gate = report.get("gate", {})
    if "encoder" in gate:
        d = gate["decoder"]
        lines.append(f"  gate: encoder PSNR {gate['encoder']['worst_psnr_db']:.1f} dB; decoder PSNR "
                     f"{d['worst_psnr_db']:.1f} dB, mean KL {d['mean_kl']:.3g}, argmax {d['argmax_agree']}/{d['steps']}, "
                     f"log-prob error median/p99/max {d['abs_error_nats'].get('median', 0):.3g}/"
                     f"{d['abs_error_nats'].get('p99', 0):.3g}/{d['abs_error_nats'].get('max', 0):.3g} nats")
    if "heldout" in gate:
        h = gate["heldout"]
        lines.append(f"  held-out: {h['identical_clips']}/{h['clips']} clips identical to {h['baseline']}, "
                     f"WER {100 * h['wer']:.2f} % ({h['baseline']} {100 * h['wer_baseline']:.2f} %)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# `cohere-coreml quantize`
# --------------------------------------------------------------------------------------------


def add_quantize_arguments(p) -> None:
    p.add_argument("--bundle", default="f16", help="exported f16 bundle (default: %(default)s, as `make export` writes it)")
    p.add_argument("--out", default="q8", help="new bundle folder (default: %(default)s)")
    p.add_argument("--preset", choices=[k for k in PRESETS if k != "f16"], default=DEFAULT_PRESET,
                   help="q8: int8 encoder + decoder; q8-hybrid: int8 encoder, fp16 decoder; q4: 4-bit palette "
                   "encoder, int8 decoder (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="PyTorch checkpoint for the held-out gate (tokens/WER vs PyTorch), e.g. the checkpoint the "
                   "bundle was exported from; without it the gate compares with the f16 bundle")
    p.add_argument("--eval-set", default="none",
                   help="evaluation folder (manifest.json with utterances: file, language, text) for the held-out "
                   "gate and the gate clips, e.g. tests/data/heldout of the checkout (`make quantize` passes it); "
                   "'none' (default): no held-out gate, the gates run on the speech clips shipped with the package")
    p.add_argument("--limit-per-language", type=int, default=None, help="use only the first N clips per language")
    p.add_argument("--sensitivity", action="store_true",
                   help="measure each weight's sensitivity (output PSNR with only it quantized) into compression.json")
    p.add_argument("--target-psnr", type=float, default=None,
                   help="keep the most sensitive weights fp16 until each component's output PSNR vs f16 reaches "
                   "this (dB); implies --sensitivity")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--skip-gate", action="store_true", help="no gate (the bundle is written unchecked)")


def cmd_quantize(args) -> int:
    eval_dir = None if str(args.eval_set).lower() == "none" else args.eval_set
    report = quantize_bundle(args.bundle, args.out, args.preset, model=args.model, eval_dir=eval_dir,
                             target_psnr=args.target_psnr, with_sensitivity=args.sensitivity,
                             limit_per_language=args.limit_per_language, force=args.force,
                             skip_gate=args.skip_gate)
    print(format_summary(report))
    print(f"wrote {args.out}")
    return 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml quantize`."""
    p = subparsers.add_parser(
        "quantize", help="compress an exported f16 bundle's weights (q8, q8-hybrid, q4), gated",
        description="Compress the weights of an exported f16 bundle with coremltools.optimize.coreml and write a "
        "new bundle (packages, compression.json, gate reports, manifest with checksums). Each package is "
        "gated against the f16 one (encoder PSNR; decoder PSNR, KL and log-prob error; <component>.parity.json) "
        "and, with --eval-set, the bundle on a held-out set (greedy tokens identical, or WER within 0.5 points "
        "of PyTorch; heldout.parity.json); a failing bundle is not written.",
    )
    add_quantize_arguments(p)
    p.set_defaults(func=cmd_quantize)
