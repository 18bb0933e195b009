"""What is compressed: the schemes, the per-component `Recipe`, the presets and their gates.

Schemes (iOS 18 / macOS 15 ops; activations stay fp16 in all of them):
    int8  linear, symmetric, per output channel, int8 weights (W8A16)
    int4  linear, symmetric, per block of 32 input elements, int4 weights
    pal4  4-bit k-means palette, one 16-entry table per group of 16 output channels
    pal6  6-bit k-means palette, one 64-entry table per group of 16 output channels

Presets: f16 (nothing), q8 (int8 encoder + decoder), q8-hybrid (int8 encoder, fp16 decoder),
q4 (4-bit encoder, int8 decoder). The stateful decoder is never below 8 bits: 4-bit palettized
stateful models built with coremltools 9.0 were reported to crash on device after 100-200
predictions (coremltools issue 2716).

coremltools is imported inside `scheme_config` only: it takes seconds to import and logs its
missing native runtime on Linux, and the CLI imports this package for `--help`.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

COMPONENTS = ("encoder", "decoder")


def bundle_components(bundle_dir: Path) -> list[str]:
    """The packages quantize compresses, in order: the encoder's parts (encoder, encoder_part2, ...: one
    for a whole encoder, from the manifest's encoder.parts), then the decoder."""
    manifest = json.loads((Path(bundle_dir) / "manifest.json").read_text())
    parts = (manifest.get("encoder") or {}).get("parts") or [{"file": "encoder"}]
    return [part["file"] for part in parts] + [c for c in COMPONENTS if c != "encoder"]


def recipe_component(comp: str) -> str:
    """The recipe (and gate kind) of a package: an encoder part is compressed and gated as the encoder."""
    return "encoder" if comp.startswith("encoder") else comp


# coremltools' default: tensors with at most this many elements are never compressed.
WEIGHT_THRESHOLD = 2048
PALETTE_GROUP = 16  # output channels sharing one palette (per_grouped_channel)
INT4_BLOCK = 32

SCHEMES = {
    "int8": "linear symmetric int8, per output channel (W8A16)",
    "int4": f"linear symmetric int4, per block of {INT4_BLOCK}",
    "pal4": f"4-bit k-means palette per {PALETTE_GROUP} output channels",
    "pal6": f"6-bit k-means palette per {PALETTE_GROUP} output channels",
    # mixed-bit (quantize.mixed): 2/3-bit palettes and one width per tensor
    "pal2": f"2-bit k-means palette per {PALETTE_GROUP} output channels",
    "pal3": f"3-bit k-means palette per {PALETTE_GROUP} output channels",
    "mixed": "per tensor: 2/3/4/6-bit palette, int8 or fp16, the least predicted error within a byte budget",
}
PALETTE_SCHEMES = ("pal2", "pal3", "pal4", "pal6")


class QuantizeError(ValueError):
    """The bundle cannot be quantized as asked (names the problem)."""


def scheme_config(scheme: str):
    """The coremltools op config of a scheme name."""
    import coremltools.optimize.coreml as cto  # heavy import (see the module docstring)

    if scheme == "int8":
        return cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                           weight_threshold=WEIGHT_THRESHOLD)
    if scheme == "int4":
        return cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                           block_size=INT4_BLOCK, weight_threshold=WEIGHT_THRESHOLD)
    if scheme in PALETTE_SCHEMES:
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
    activations: "int8" inserts coremltools' quantize / dequantize pairs (statistics from the interpreter
        on the gate audio) before the weights are compressed; None keeps activations fp16.
    """

    scheme: str | None
    skip_names: tuple[str, ...] = ()
    skip_op_types: tuple[str, ...] = ()
    keep_fp16: tuple[str, ...] = ()
    fallback: str | None = None
    activations: str | None = None  # "int8": activations quantized too (W8A8, `activations.py`); None: fp16
    # W8A8: activations kept fp16, most sensitive first, until the encoder reaches this PSNR vs f16
    # (`activations.choose_fp16_activations`); None: every activation coremltools' passes select is int8
    activation_target_psnr: float | None = None
    keep_fp16_activations: tuple[str, ...] = ()  # op names whose activations stay fp16 (the choice above)
    per_tensor: tuple[tuple[str, str], ...] = ()  # (weight name, scheme) of scheme "mixed"

    def scheme_of(self, name: str) -> str | None:
        """The scheme of one weight (a "mixed" recipe names one per tensor)."""
        return dict(self.per_tensor).get(name) if self.per_tensor else self.scheme

    def to_dict(self) -> dict:
        d = asdict(self)
        d["description"] = SCHEMES.get(self.scheme, "none (fp16)")
        if self.per_tensor:
            d["per_tensor"] = dict(self.per_tensor)
        else:
            d.pop("per_tensor")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def skip_reason(self, name: str, consumer_types: Iterable[str]) -> str | None:
        if name in self.keep_fp16:
            if self.scheme == "mixed":
                return "kept fp16 by the mixed assignment (worth its bytes within the budget)"
            return "kept fp16 by --target-psnr (among the most sensitive weights)"
        for pattern in self.skip_names:
            if fnmatch.fnmatchcase(name, pattern):
                return f"skipped by the recipe: name matches {pattern!r}"
        hit = sorted(set(consumer_types) & set(self.skip_op_types))
        if hit:
            return f"skipped by the recipe: consumed by {hit[0]!r} ops"
        return None


# The recipes follow the per-weight sensitivity (decoder output PSNR vs f16 with only that weight at int8;
# `quantize --sensitivity`; figures in docs/quantization.md): the LM head `proj_out` is among the decoder's
# most sensitive weights and costs only V x D extra bytes in fp16 (a small share of the full-size model),
# so it stays fp16 in every preset. The token embedding (a gather) is quantized; every encoder weight
# keeps a wide margin alone at int8.
DECODER_INT8 = Recipe("int8", skip_names=("*proj_out*",))
PRESETS: dict[str, dict[str, Recipe]] = {
    "f16": {"encoder": Recipe(None), "decoder": Recipe(None)},
    "q8": {"encoder": Recipe("int8"), "decoder": DECODER_INT8},
    "q8-hybrid": {"encoder": Recipe("int8"), "decoder": Recipe(None)},
    "q4": {"encoder": Recipe("pal4", fallback="int8"), "decoder": DECODER_INT8},
    # mixed: the encoder's per-tensor widths come from `quantize.mixed.plan` at run time (byte budget)
    "mixed": {"encoder": Recipe("mixed", fallback="int8"), "decoder": DECODER_INT8},
}
# W8A8 (docs/quantization.md, "W8A8"): the q8 encoder with int8 activations (coremltools' quantize /
# dequantize pairs, statistics from the interpreter on the gate audio); the decoder as q8. An int8-activation
# decoder passes its component gate but sits at the held-out gate's edge (whether the bundle passes turns on
# single clips), so the decoder keeps fp16 activations; docs/quantization.md has the measurements.
# The encoder's activations are kept fp16 until it reaches 45 dB, 10 dB above q8's fidelity gate: an encoder
# kept just above the gate moved held-out words measurably (the task verdict, not the PSNR, is what it is
# for), one kept to 45 dB did not (docs/quantization.md, "W8A8").
PRESETS["q8a8"] = {"encoder": Recipe("int8", activations="int8", activation_target_psnr=45.0),
                   "decoder": DECODER_INT8}
DEFAULT_PRESET = "q8"

# Gates vs the f16 packages (through the runtime) and the task verdict on the held-out sets, per preset
# (docs/quantization.md, "What a preset is gated on"). Two roles of the encoder PSNR (`PSNR_ROLE`):
# "fidelity" for the presets meant to reproduce f16 (q8, q8-hybrid, q8a8): it decides, at the f16 export
# gate's own thresholds (35 dB, mean KL 5e-3), here against the f16 package; "floor" for the presets whose
# point is to change the encoder (q4, mixed, lowrank, q8-lowrank): a guard against broken programs, far
# below what a working build gives, and the task verdict decides. q8-hybrid ships the f16 decoder unchanged
# (its outputs are identical: the tight thresholds). Held-out, every preset: the task verdict
# (`compression_gates.decide`): each language's error-rate increase over the baseline, its paired-bootstrap
# 95 % interval wholly within 0.5 points passes, wholly above refuses, otherwise the next larger set decides.
GATES: dict[str, dict[str, float]] = {
    "q8": {"encoder_psnr_db": 35.0, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3, "max_wer_increase": 0.005},
    "q8-hybrid": {"encoder_psnr_db": 35.0, "decoder_psnr_db": 60.0, "decoder_mean_kl": 1e-6,
                  "max_wer_increase": 0.005},
    "q4": {"encoder_psnr_db": 20.0, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3, "max_wer_increase": 0.005},
    # mixed: the q4 encoder threshold (a mixed bundle is meant to replace q4 at or below its bytes) and
    # the q8 decoder's (same decoder); the task verdict decides
    "mixed": {"encoder_psnr_db": 20.0, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3, "max_wer_increase": 0.005},
}
# q8a8: the q8 gates (the export's own 35 dB / 5e-3); its activations are kept fp16, most sensitive first,
# until the encoder reaches its recipe's target above that fidelity (Recipe.activation_target_psnr); see
# docs/quantization.md.
GATES["q8a8"] = dict(GATES["q8"])


def preset_recipes(preset: str) -> dict[str, Recipe]:
    if preset not in PRESETS:
        raise QuantizeError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return dict(PRESETS[preset])


# --- low-rank encoder (LiteASR, arXiv 2502.20583; quantize/lowrank.py) -----------------------------
# `lowrank`: the encoder's attention, feed-forward and pointwise-conv linears replaced by two smaller
# ones from a PCA of their outputs on calibration audio (needs --model: the checkpoint is rewritten and
# its encoder re-exported), fp16 weights; `q8-lowrank`: that encoder then int8 like q8. The decoder is
# the f16 one (lowrank) or q8's (q8-lowrank). Retained-energy thresholds per layer type, from the sweep in
# docs/quantization.md (held-out set, PyTorch): each type one or two steps above the threshold at which it
# alone moved a language's error rate. They are the base of the search (`lowrank_search.search_energy`:
# one scale on all four, the smallest encoder whose gate passes); `--energy` replaces them and the search.
LOWRANK_ENERGY: dict[str, dict[str, float]] = {
    "lowrank": {"attn_qk": 0.95, "attn_vo": 0.98, "ffn": 0.98, "conv_pw": 0.99},
    "q8-lowrank": {"attn_qk": 0.95, "attn_vo": 0.98, "ffn": 0.98, "conv_pw": 0.99},
}
PRESETS["lowrank"] = {"encoder": Recipe(None), "decoder": Recipe(None)}
PRESETS["q8-lowrank"] = {"encoder": Recipe("int8"), "decoder": DECODER_INT8}
# Encoder vs the f16 encoder: a low-rank encoder is a different function, so its PSNR is set by the ranks,
# not by rounding, and says little about the task (ranks that kept every held-out token identical measured
# below a fidelity threshold; docs/quantization.md). Its threshold is a floor against broken programs (ranks
# cut to a sliver of the energy, a lost mean term), far below what the search's candidates give; the task
# verdict (vs the unmodified PyTorch model) decides, and the search (`lowrank_search.search_energy`) chooses
# the smallest encoder it passes.
# Decoder: as q8-hybrid (f16, unchanged) and q8 (int8).
LOWRANK_FLOOR_DB = 15.0
GATES["lowrank"] = {"encoder_psnr_db": LOWRANK_FLOOR_DB, "decoder_psnr_db": 60.0, "decoder_mean_kl": 1e-6,
                    "max_wer_increase": 0.005}
GATES["q8-lowrank"] = {"encoder_psnr_db": LOWRANK_FLOOR_DB, "decoder_psnr_db": 35.0, "decoder_mean_kl": 5e-3,
                       "max_wer_increase": 0.005}
# What the encoder PSNR threshold of each preset is (docs/quantization.md, "What a preset is gated on").
PSNR_ROLE = {"q8": "fidelity", "q8-hybrid": "fidelity", "q8a8": "fidelity", "q4": "floor", "mixed": "floor",
             "lowrank": "floor", "q8-lowrank": "floor"}
