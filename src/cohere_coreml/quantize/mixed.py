"""Mixed-bit encoder to a byte budget (the analysis step of `--preset mixed`).

    per encoder weight and bit width (2/3/4/6-bit k-means palettes per 16 output channels, 8 = int8
    per channel): its sensitivity (`sensitivity.sensitivity` on a package compressed at that width)
    or a weights-only proxy (`weight_proxy`) -> its exact stored bytes (`stored_bytes`, the
    constexpr inputs coremltools writes) and weight-file bytes (`file_bytes`, 64-byte blob headers
    and alignment) -> the assignment with the least predicted error meeting the budget (`assign`)
    -> a `Recipe` with one scheme per tensor, applied by `compress` (coremltools)

Error model: the output noise of the encoder with several weights quantized is the sum of the
noise each adds alone (first order: independent rounding errors, small against the signal), in
units of the output's peak^2: noise_i(b) = 10^(-PSNR_i(b)/10), PSNR(assignment) = -10 log10(sum).
Checked on the default model: `predicted_psnr` of every uniform width against its measured
PSNR (`check` in the report) and of the chosen assignment against the gate.

8 bits = int8 linear per output channel, not an 8-bit palette: same index bytes, but int8 stores
one fp16 scale per channel (2 bytes a row) where pal8 stores a 256-entry table per 16 rows (32
bytes a row), it is the q8 scheme whose gate figures are known, and k-means with 256 clusters on
the 1.9 B-parameter encoder is the slowest option for the smallest gain.

Bytes of the bundle = what `du -sb` counts of the finished folder (`files.tree_bytes`: every file
and every directory's own entry) = the fixed parts (front end, tokenizer and metadata files, each
package's program text and directories, the decoder at q8, the encoder's non-float and
below-threshold constants, measured on the f16 bundle; the example, exact; the reports, estimated)
+ the encoder assignment's weight-file bytes. The build measures the finished bundle and re-plans
with what the estimate missed (`replan_overhead`). coremltools is imported inside `channel_axis`
only (heavy import, see `recipes`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..publish.card import EXAMPLE, README, example_source
from ..storage.files import temporary_dir, tree_bytes, write_json_atomic
from ..storage.integrity import COMPRESSION_FILE
from .compress import compress_package
from .inventory import is_weight, load_function, package_functions
from .measure import GateData
from .recipes import DECODER_INT8, PALETTE_GROUP, WEIGHT_THRESHOLD, QuantizeError, Recipe
from .sensitivity import sensitivity

logger = logging.getLogger(__name__)

BITS = (2, 3, 4, 6, 8)  # candidate widths of a weight; 16 (fp16) is always allowed too
FP16 = 16
BLOB_HEADER = 64  # weight.bin: a 64-byte file header, then per blob 64 bytes of metadata + data
BLOB_ALIGN = 64  # each blob's data starts 64-byte aligned
INLINE_BELOW = 10  # constants with fewer elements are written into the program, not weight.bin
PROXY_GROUPS = 8  # palette groups sampled per tensor by the weights-only proxy
KMEANS_ITERATIONS = 25
# Not exact (the rest is): each compressed tensor adds a constexpr op to the program text of every
# function using it, and the quantized bundle's own reports add to the f16 bundle's (compression.json
# with rows per encoder and decoder weight tensor, model card, gate reports, manifest rows). The
# constants are set a little above what the default model's exports show (docs/quantization.md): high
# on purpose, since a bundle over its budget is built a second time.
PROGRAM_BYTES_PER_OP = 150
REPORT_BYTES = 32 * 1024
REPORT_BYTES_PER_TENSOR = 350
# Re-planning after a bundle came out over its budget: the measured excess plus this (the reports'
# figures and program text differ a little between assignments), at most this many builds.
REPLAN_MARGIN = 4096
MAX_BUILDS = 3
# The f16 bundle's files a quantized bundle does not copy and writes anew (the reports estimate
# and the example cover them); its gate reports and manifest are replaced by ones of about the same size.
REGENERATED = (README, EXAMPLE, COMPRESSION_FILE)


def bits_scheme(bits: int) -> str | None:
    """The `recipes.SCHEMES` name of a bit width (None: fp16)."""
    return None if bits == FP16 else "int8" if bits == 8 else f"pal{bits}"


@dataclass(frozen=True)
class Tensor:
    """A float weight of the encoder: shape, coremltools' output-channel axis (None: unknown, it
    compresses nothing), whether coremltools would compress it at all (threshold, rank)."""

    name: str
    shape: tuple[int, ...]
    axis: int | None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def compressible(self) -> bool:
        return self.size > WEIGHT_THRESHOLD and len(self.shape) > 1 and self.axis is not None

    def widths(self) -> tuple[int, ...]:
        """Bit widths coremltools can store this tensor at (the palettizer needs the channel axis
        divisible by its group: e.g. the folded position tables (1, H, D, 2T-1) only take int8)."""
        if not self.compressible:
            return (FP16,)
        pal = self.shape[self.axis] % PALETTE_GROUP == 0
        return tuple(b for b in BITS if b == 8 or pal) + (FP16,)


def channel_axis(op) -> int | None:
    """coremltools' own output-channel axis of a const op (linear/conv: 0; matmul's y: -1 or -2)."""
    from coremltools.optimize._utils import select_input_output_channel_axis  # heavy import

    return select_input_output_channel_axis(op)[1]


def encoder_tensors(function) -> tuple[dict[str, Tensor], dict[str, np.ndarray]]:
    """({name: Tensor}, {name: fp16 value}) of the float weights of a PyMIL function."""
    tensors, values = {}, {}
    for op in function.operations:
        if op.op_type == "const" and is_weight(op.outputs[0].val):
            val = op.outputs[0].val
            tensors[op.name] = Tensor(op.name, tuple(val.shape), channel_axis(op))
            values[op.name] = val
    return tensors, values


def tied_tensors(package: Path, values: dict[str, np.ndarray]) -> tuple[dict[str, list[Tensor]], list[Tensor]]:
    """The weights of a multifunction package's other functions that the merge stores apart
    (`save_multifunction` keeps identical values once): ({main name: [its differing copies]} (e.g.
    the per-window position tables of encoder buckets: compressed with the same scheme, the recipe
    names tensors), [weights whose name the default function lacks: kept as they are])."""
    names = package_functions(package)
    tied: dict[str, list[Tensor]] = {}
    alone: list[Tensor] = []
    for fn in names[1:] if names[0] == "main" or "main" not in names else [n for n in names if n != "main"]:
        other, other_values = encoder_tensors(load_function(package, fn))
        for name, t in other.items():
            if name not in values:
                alone.append(t)
            elif other_values[name].shape != values[name].shape or not np.array_equal(other_values[name], values[name]):
                tied.setdefault(name, []).append(t)
    return tied, alone


def input_sizes(t: Tensor, bits: int) -> list[tuple[int, int]]:
    """(elements, stored bytes) of each constant a compressed tensor is stored as: fp16 the value;
    palette: the packed indices (bits per element) and the fp16 table (groups, 1.., 2^bits, 1);
    int8: the int8 data and one fp16 scale per output channel (symmetric: no offset)."""
    n = t.size
    if bits == FP16:
        return [(n, 2 * n)]
    if bits == 8:
        channels = t.shape[t.axis]
        return [(n, n), (channels, 2 * channels)]
    groups = t.shape[t.axis] // PALETTE_GROUP
    return [(n, math.ceil(n * bits / 8)), (groups * 2**bits, 2 * groups * 2**bits)]


def stored_bytes(t: Tensor, bits: int) -> int:
    """Bytes of the constants as compression.json counts them (`inventory.compressed_tensors`)."""
    return sum(b for _, b in input_sizes(t, bits))


def file_bytes(t: Tensor, bits: int) -> int:
    """Bytes the tensor takes in weight.bin: per constant 64 bytes of metadata + its data padded
    to 64 (constants of fewer than 10 elements go into the program text instead)."""
    return sum(BLOB_HEADER + -(-b // BLOB_ALIGN) * BLOB_ALIGN for n, b in input_sizes(t, bits) if n >= INLINE_BELOW)


def package_bytes(t: Tensor, bits: int) -> int:
    """`file_bytes` plus the estimated program text of its constexpr op (`PROGRAM_BYTES_PER_OP`)."""
    return file_bytes(t, bits) + (0 if bits == FP16 else PROGRAM_BYTES_PER_OP)


def read_blobs(package: Path) -> list[tuple[int, int]]:
    """(data type, bytes) of every blob of a package's weight.bin (MIL blob storage, version 2)."""
    path = next(Path(package).glob("Data/com.apple.CoreML/weights/weight.bin"))
    data = path.read_bytes()
    off, out = BLOB_HEADER, []
    while off < len(data):
        sentinel, dtype, size, start = struct.unpack_from("<IIQQ", data, off)
        if sentinel != 0xDEADBEEF:
            raise QuantizeError(f"{path}: not a MIL blob file (bad sentinel at {off})")
        out.append((dtype, size))
        off = -(-(start + size) // BLOB_ALIGN) * BLOB_ALIGN
    return out


# --------------------------------------------------------------------------------------------
# Sensitivity: measured (interpreter) or the weights-only proxy
# --------------------------------------------------------------------------------------------


def noise(psnr_db: float) -> float:
    """Output noise power in units of the output's peak^2 (inverse of PSNR)."""
    return 0.0 if psnr_db == float("inf") else 10.0 ** (-psnr_db / 10.0)


def predicted_psnr(total_noise: float) -> float:
    return float("inf") if total_noise <= 0 else -10.0 * math.log10(total_noise)


def measured_sensitivity(f16_package: Path, data: GateData, scratch: Path, bits=BITS) -> dict:
    """{"per_weight": {name: {bits: PSNR dB}}, "all": {bits: PSNR with every weight at bits}}: the
    encoder output PSNR vs f16 with only that weight at that width (`sensitivity.sensitivity`, the
    interpreter with the f16 constant replaced by the compressed one, no re-save per weight)."""
    per_weight: dict[str, dict[int, float]] = {}
    every: dict[int, float] = {}
    for b in bits:
        pkg = scratch / f"encoder-{bits_scheme(b)}.mlpackage"
        compress_package(f16_package, pkg, Recipe(bits_scheme(b)))
        result = sensitivity("encoder", f16_package, pkg, data)
        every[b] = result["all"]
        for name, score in result["per_weight"].items():
            per_weight.setdefault(name, {})[b] = score
        shutil.rmtree(pkg)
        logger.info("sensitivity at %d bits: %d weights, all together %.1f dB", b, len(result["per_weight"]),
                    result["all"])
    return {"per_weight": per_weight, "all": every}


def kmeans_1d(x: np.ndarray, k: int) -> np.ndarray:
    """Lloyd's k-means on 1-D data (quantile start); returns x's quantized values."""
    x = np.sort(x.astype(np.float64))
    centres = np.unique(np.quantile(x, (np.arange(k) + 0.5) / k))
    for _ in range(KMEANS_ITERATIONS):
        edges = (centres[1:] + centres[:-1]) / 2
        idx = np.searchsorted(edges, x)
        sums, counts = np.bincount(idx, x, len(centres)), np.bincount(idx, minlength=len(centres))
        keep = counts > 0
        new = sums[keep] / counts[keep]
        if new.shape == centres.shape and np.allclose(new, centres):
            break
        centres = new
    edges = (centres[1:] + centres[:-1]) / 2
    return centres[np.searchsorted(edges, x)]


def weight_proxy(value: np.ndarray, t: Tensor, bits: int, groups: int = PROXY_GROUPS) -> float:
    """Relative weight error ||W - Q_b(W)||^2 / ||W||^2 of a width, from the weights alone: int8 per
    channel exactly; palettes by 1-D k-means on `groups` evenly spaced groups of 16 channels."""
    w = np.moveaxis(np.asarray(value, np.float64), t.axis, 0)
    if bits == 8:
        w = w.reshape(w.shape[0], -1)
        scale = np.abs(w).max(1, keepdims=True) / 127.0
        scale[scale == 0] = 1.0
        err = w - np.clip(np.round(w / scale), -127, 127) * scale
        return float(np.sum(err**2) / max(np.sum(w**2), 1e-30))
    g = w.reshape(w.shape[0] // PALETTE_GROUP, -1)
    pick = np.unique(np.linspace(0, len(g) - 1, min(groups, len(g))).round().astype(int))
    num = sum(float(np.sum((np.sort(g[i]) - kmeans_1d(g[i], 2**bits)) ** 2)) for i in pick)
    den = sum(float(np.sum(g[i] ** 2)) for i in pick)
    return num / max(den, 1e-30)


def proxy_sensitivity(tensors: dict[str, Tensor], values: dict[str, np.ndarray]) -> dict:
    """{"per_weight": {name: {bits: pseudo-PSNR dB}}} from `weight_proxy` (-10 log10 of the relative
    weight error), the same shape as `measured_sensitivity`'s."""
    per_weight = {}
    for name, t in tensors.items():
        if t.compressible:
            per_weight[name] = {b: predicted_psnr(weight_proxy(values[name], t, b)) for b in t.widths() if b != FP16}
    return {"per_weight": per_weight, "all": {}}


def load_sensitivity(path: Path, tensors: dict[str, Tensor]) -> dict:
    """A `measured_sensitivity` written by an earlier run (JSON keys are strings: widths back to int)."""
    data = json.loads(path.read_text())
    if sorted(data.get("tensors", ())) != sorted(tensors):
        raise QuantizeError(f"{path}: its sensitivity is of another encoder (different weight tensors)")
    return {"per_weight": {n: {int(b): float(v) for b, v in d.items()} for n, d in data["per_weight"].items()},
            "all": {int(b): float(v) for b, v in data["all"].items()}}


def spearman(a, b) -> float:
    """Rank correlation (no ties expected in float data)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else float("nan")


def proxy_agreement(measured: dict, proxy: dict) -> dict:
    """How well the proxy ranks (tensor, width) pairs and tensors within each width vs measured noise."""
    pairs = [(measured[n][b], proxy[n][b]) for n in measured for b in measured[n] if b in proxy.get(n, {})]
    out: dict[str, Any] = {"pairs": len(pairs), "spearman_all": spearman(*zip(*pairs)) if pairs else None}
    for b in BITS:
        sub = [(measured[n][b], proxy[n][b]) for n in measured if b in measured[n] and b in proxy.get(n, {})]
        out[f"spearman_{b}bit"] = spearman(*zip(*sub)) if len(sub) > 1 else None
    return out


# --------------------------------------------------------------------------------------------
# The assignment
# --------------------------------------------------------------------------------------------


def options(tensors: dict[str, Tensor], per_weight: dict[str, dict[int, float]],
            tied: dict[str, list[Tensor]] | None = None) -> dict[str, dict[int, tuple]]:
    """{name: {bits: (bytes, noise)}} of each compressible tensor: the widths it (and its copies in
    other functions, `tied`) can take and has a sensitivity for, and fp16 (no noise); bytes include
    the copies. Tensors coremltools cannot compress are not choices."""
    out = {}
    tied = tied or {}
    for name, t in tensors.items():
        if not t.compressible:
            continue
        scores = per_weight.get(name, {})
        copies = tied.get(name, [])
        widths = [b for b in t.widths() if all(b in c.widths() for c in copies)] or [FP16]
        out[name] = {b: (package_bytes(t, b) + sum(package_bytes(c, b) for c in copies),
                         noise(scores[b]) if b != FP16 else 0.0)
                     for b in widths if b == FP16 or b in scores}
    return out


def assign(opts: dict[str, dict[int, tuple]], budget: int) -> dict[str, int]:
    """The widths with the least total noise whose bytes are at most `budget` (bytes of the
    tensors in `opts`): from fp16 everywhere, repeatedly take the step (one tensor to any narrower
    width) with the least noise added per byte saved until the budget is met, then spend what is
    left on the widening steps with the most noise removed per byte. Raises QuantizeError when
    even the narrowest widths exceed the budget."""
    choice = {n: max(o) for n, o in opts.items()}
    least = sum(min(b for b, _ in o.values()) for o in opts.values())
    if least > budget:
        raise QuantizeError(f"budget {budget:,} bytes is below the narrowest assignment ({least:,} bytes)")
    used = sum(opts[n][b][0] for n, b in choice.items())
    while used > budget:
        best = None
        for n, b in choice.items():
            size, err = opts[n][b]
            for nb, (nsize, nerr) in opts[n].items():
                if nsize < size:
                    ratio = (nerr - err) / (size - nsize)
                    if best is None or ratio < best[0]:
                        best = (ratio, n, nb)
        _, n, nb = best
        used += opts[n][nb][0] - opts[n][choice[n]][0]
        choice[n] = nb
    while True:  # widen with the bytes left
        best = None
        for n, b in choice.items():
            size, err = opts[n][b]
            for nb, (nsize, nerr) in opts[n].items():
                if size < nsize <= size + budget - used and nerr < err:
                    gain = (err - nerr) / (nsize - size)
                    if best is None or gain > best[0]:
                        best = (gain, n, nb)
        if best is None:
            return choice
        _, n, nb = best
        used += opts[n][nb][0] - opts[n][choice[n]][0]
        choice[n] = nb


# --------------------------------------------------------------------------------------------
# Bytes of the bundle and the plan
# --------------------------------------------------------------------------------------------


def other_bytes(bundle_dir: Path) -> int:
    """Bytes of the f16 bundle, as `du -sb` counts them, outside the encoder and decoder packages and
    the files a quantized bundle writes anew (`REGENERATED`): front end, tokenizer, manifest, gate
    reports, ane_check.json, the folder's own entry."""
    skip = [bundle_dir / "encoder.mlpackage", bundle_dir / "decoder.mlpackage", *(bundle_dir / n for n in REGENERATED)]
    return tree_bytes(bundle_dir) - sum(tree_bytes(p) for p in skip if p.exists())


def decoder_q8_file_bytes(package: Path) -> int:
    """Weight-file bytes of the decoder's weights at the q8 recipe (int8; LM head and below-threshold
    tensors fp16), function `main` (other functions share its weights)."""
    function = load_function(package, "main")
    tensors, _ = encoder_tensors(function)
    consumers = {op.name: [c.op_type for c in op.outputs[0].child_ops] for op in function.operations}
    total = 0
    for name, t in tensors.items():
        q8 = t.compressible and DECODER_INT8.skip_reason(name, consumers.get(name, ())) is None
        total += package_bytes(t, 8 if q8 else FP16)
    return total


def count_parameters(model: str | Path) -> int:
    """Parameters of a checkpoint folder from its safetensors headers (shapes only, nothing loaded;
    tied tensors stored once count once)."""
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"{model}: no *.safetensors file to count parameters from: pass --parameters N")
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return total


@dataclass
class Budget:
    """`--target-bytes` or `--target-bytes-per-param` (with the parameter count)."""

    target_bytes: int | None = None
    bytes_per_param: float | None = None
    parameters: int | None = None

    def bytes(self) -> int:
        if (self.target_bytes is None) == (self.bytes_per_param is None):
            raise QuantizeError("--preset mixed needs exactly one of --target-bytes N or --target-bytes-per-param X")
        if self.target_bytes is not None:
            if self.target_bytes <= 0:
                raise QuantizeError(f"--target-bytes must be positive, got {self.target_bytes}")
            return int(self.target_bytes)
        if self.bytes_per_param <= 0:
            raise QuantizeError(f"--target-bytes-per-param must be positive, got {self.bytes_per_param}")
        if not self.parameters:
            raise QuantizeError("--target-bytes-per-param needs the parameter count: pass --model CHECKPOINT "
                                "(counted from its safetensors) or --parameters N")
        return int(math.floor(self.bytes_per_param * self.parameters))


@dataclass
class Analysis:
    """What the assignment needs of an f16 bundle, measured once (`analyse`): the encoder's weight
    tensors and their copies in other functions, the fixed bytes, the sensitivities. `assignment`
    plans a budget from it; a re-plan after a build came out over its budget measures nothing again."""

    tensors: dict[str, Tensor]
    tied: dict[str, list[Tensor]]
    fixed: dict[str, int]
    proxy: bool = False
    sens: dict = field(default_factory=dict)
    proxy_sens: dict | None = None

    def range(self, overhead: int = 0) -> tuple[int, int]:
        """(narrowest, fp16-encoder) bundle bytes, from the widths alone (no sensitivity), with
        `overhead` bytes on top of the fixed parts."""
        every = options(self.tensors, {n: {b: 0.0 for b in t.widths() if b != FP16} for n, t in self.tensors.items()},
                        self.tied)
        fixed = sum(self.fixed.values()) + overhead
        return (fixed + sum(min(s for s, _ in o.values()) for o in every.values()),
                fixed + sum(o[FP16][0] for o in every.values()))


def check_range(analysis: Analysis, target: int) -> None:
    """Refuse a budget outside the bundles the widths allow, naming both ends (before any measurement)."""
    lo, hi = analysis.range()
    if target < lo:
        raise QuantizeError(f"budget {target:,} bytes is below the smallest mixed bundle ({lo:,} bytes as `du -sb` "
                            "counts it: 2-bit palettes wherever coremltools allows them, int8 elsewhere, q8 decoder)")
    if target > hi:
        raise QuantizeError(f"budget {target:,} bytes is above the bundle with an fp16 encoder ({hi:,} bytes): "
                            "use q8-hybrid or f16")


def analyse(bundle_dir: Path, budget: Budget, data: GateData | None = None, *, proxy: bool = False,
            scratch_parent: Path | None = None, sensitivity_file: Path | None = None) -> Analysis:
    """The f16 bundle's tensors and fixed bytes, the budget's range checked (before anything is
    measured), then the sensitivities: measured through the interpreter on `data` (the gate
    windows), or with `proxy` the weights-only proxy (no interpreter: usable at full size); the
    packages compressed for it go to a temporary folder in `scratch_parent` (default: beside the
    bundle). `sensitivity_file`: the measured sensitivity is read from it when it exists (same
    encoder tensors), else written to it."""
    bundle_dir = Path(bundle_dir)
    target = budget.bytes()
    enc_pkg, dec_pkg = bundle_dir / "encoder.mlpackage", bundle_dir / "decoder.mlpackage"
    tensors, values = encoder_tensors(load_function(enc_pkg, package_functions(enc_pkg)[0]
                                                    if "main" not in package_functions(enc_pkg) else "main"))
    tied, alone = tied_tensors(enc_pkg, values)
    copies = [c for cs in tied.values() for c in cs]
    enc_fixed = tree_bytes(enc_pkg) - sum(file_bytes(t, FP16) for t in [*tensors.values(), *copies])
    enc_fixed += sum(file_bytes(t, FP16) for t in tensors.values() if not t.compressible)
    enc_fixed += sum(file_bytes(c, FP16) for n, cs in tied.items() for c in cs if not tensors[n].compressible)
    dec_tensors, _ = encoder_tensors(load_function(dec_pkg, "main"))  # prefill shares main's weights
    dec_fixed = tree_bytes(dec_pkg) - sum(file_bytes(t, FP16) for t in dec_tensors.values())
    dec_fixed += decoder_q8_file_bytes(dec_pkg)
    reports = REPORT_BYTES + REPORT_BYTES_PER_TENSOR * (len(tensors) + len(dec_tensors))
    fixed = {"other_files": other_bytes(bundle_dir), "example": len(example_source().encode()),
             "reports_estimate": reports, "decoder_q8": dec_fixed, "encoder_fixed": enc_fixed}
    analysis = Analysis(tensors, tied, fixed, proxy=proxy)
    check_range(analysis, target)
    if proxy:
        analysis.sens = proxy_sensitivity(tensors, values)
    elif sensitivity_file is not None and Path(sensitivity_file).is_file():
        analysis.sens = load_sensitivity(Path(sensitivity_file), tensors)
    else:
        if data is None:
            raise QuantizeError("the measured sensitivity needs gate data (or use the weights-only proxy)")
        scratch = temporary_dir(Path(scratch_parent or bundle_dir.parent), "mixed")
        try:
            analysis.sens = measured_sensitivity(enc_pkg, data, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if sensitivity_file is not None:
            write_json_atomic({"source": str(enc_pkg), "tensors": sorted(tensors), **analysis.sens},
                              Path(sensitivity_file))
    if not proxy:  # how the full-size proxy would have done here
        analysis.proxy_sens = proxy_sensitivity(tensors, values)
    return analysis


def assignment(analysis: Analysis, budget: Budget, overhead: int = 0) -> dict:
    """The encoder assignment for a bundle budget, with its predicted bytes (as `du -sb` counts the
    finished bundle); `overhead`: bytes a build measured beyond the estimate (`replan_overhead`).
    Returns the report section (`compression.json`'s `mixed`): per tensor its width, predicted
    stored / file bytes and sensitivity; the fixed parts; the predicted bundle bytes and PSNR."""
    target = budget.bytes()
    tensors, tied, sens, proxy = analysis.tensors, analysis.tied, analysis.sens, analysis.proxy
    fixed = {**analysis.fixed, **({"measured_overhead": overhead} if overhead else {})}
    fixed_total = sum(fixed.values())
    lo, hi = analysis.range(overhead)
    opts = options(tensors, sens["per_weight"], tied)
    choice = assign(opts, target - fixed_total)
    total_noise = sum(opts[n][b][1] for n, b in choice.items())
    rows = []
    for name, b in choice.items():
        t = tensors[name]
        rows.append({"name": name, "shape": list(t.shape), "bits": b, "scheme": bits_scheme(b) or "fp16",
                     "predicted_stored_bytes": stored_bytes(t, b), "predicted_file_bytes": file_bytes(t, b),
                     "copies_in_other_functions": len(tied.get(name, [])),
                     "sensitivity_db": {str(k): v for k, v in sorted(sens["per_weight"].get(name, {}).items())}})
    histogram: dict[str, int] = {}
    params: dict[str, int] = {}
    for r in rows:
        histogram[str(r["bits"])] = histogram.get(str(r["bits"]), 0) + 1
        params[str(r["bits"])] = params.get(str(r["bits"]), 0) + int(np.prod(r["shape"]))
    predicted_bundle = fixed_total + sum(opts[n][b][0] for n, b in choice.items())
    section = {
        "budget_bytes": target, "bytes_per_param_target": budget.bytes_per_param, "parameters": budget.parameters,
        "bytes_counted": "du -sb of the finished bundle folder: every file and every directory's own entry",
        "sensitivity_source": "weights-only proxy (relative k-means / int8 weight error)" if proxy
        else "measured: encoder output PSNR vs f16 with only this weight at this width",
        "error_model": "sum over tensors of 10^(-PSNR/10) (output noise in units of peak^2)",
        "fixed_bytes": fixed, "range_bytes": {"narrowest": lo, "fp16_encoder": hi},
        "predicted_bundle_bytes": predicted_bundle,
        "predicted_bytes_per_param": round(predicted_bundle / budget.parameters, 4) if budget.parameters else None,
        "predicted_psnr_db": None if proxy else predicted_psnr(total_noise),
        "bits_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "params_per_bits": dict(sorted(params.items(), key=lambda kv: int(kv[0]))),
        "tensors": rows,
    }
    if analysis.proxy_sens is not None:  # how the full-size proxy would have done here
        agreement = proxy_agreement(sens["per_weight"], analysis.proxy_sens["per_weight"])
        proxy_choice = assign(options(tensors, analysis.proxy_sens["per_weight"], tied), target - fixed_total)
        agreement["proxy_assignment_predicted_psnr_db"] = predicted_psnr(
            sum(opts[n][b][1] for n, b in proxy_choice.items()))
        agreement["proxy_assignment_same_bits"] = sum(proxy_choice[n] == b for n, b in choice.items())
        section["proxy_agreement"] = agreement
    if not proxy:
        section["uniform"] = {str(b): {"measured_psnr_db": s, "predicted_psnr_db": predicted_psnr(
            sum(noise(v[b]) for v in sens["per_weight"].values() if b in v))} for b, s in sens["all"].items()}
    return section


def plan(bundle_dir: Path, budget: Budget, data: GateData | None = None, *, proxy: bool = False,
         scratch_parent: Path | None = None, sensitivity_file: Path | None = None) -> dict:
    """`assignment(analyse(...))`: the encoder assignment of an f16 bundle for a bundle budget (`--dry-run`)."""
    return assignment(analyse(bundle_dir, budget, data, proxy=proxy, scratch_parent=scratch_parent,
                              sensitivity_file=sensitivity_file), budget)


def replan_overhead(analysis: Analysis, budget: Budget, builds: list[dict]) -> int:
    """The overhead to plan the next build with, after `builds` ({"predicted_bundle_bytes",
    "delivered_bytes", "overhead"} each, the last one over the budget): the last overhead plus what
    its prediction missed plus `REPLAN_MARGIN`. Raises QuantizeError naming the budget, the
    delivered bytes and the smallest bundle achievable when no build can meet the budget (even the
    narrowest widths with the measured overhead exceed it) or `MAX_BUILDS` did not."""
    target, last = budget.bytes(), builds[-1]
    overhead = last["overhead"] + last["delivered_bytes"] - last["predicted_bundle_bytes"] + REPLAN_MARGIN
    smallest = analysis.range(overhead)[0]
    said = (f"the mixed bundle built for it is {last['delivered_bytes']:,} bytes as `du -sb` counts it (predicted "
            f"{last['predicted_bundle_bytes']:,}), the smallest achievable about {smallest:,} bytes (2-bit palettes "
            "wherever coremltools allows them, int8 elsewhere, q8 decoder, with the overhead that build measured)")
    if smallest > target:
        raise QuantizeError(f"budget {target:,} bytes cannot be met: {said}")
    if len(builds) >= MAX_BUILDS:
        raise QuantizeError(f"budget {target:,} bytes not met in {len(builds)} builds: {said}")
    return overhead

def mixed_recipe(section: dict) -> Recipe:
    """The encoder `Recipe` of a plan: one scheme per tensor (fp16 tensors skipped), int8 fallback."""
    per_tensor = tuple((r["name"], r["scheme"]) for r in section["tensors"] if r["bits"] != FP16)
    keep = tuple(r["name"] for r in section["tensors"] if r["bits"] == FP16)
    return Recipe("mixed", keep_fp16=keep, per_tensor=per_tensor, fallback="int8")


def attach_measured(section: dict, compressed: list[dict]) -> dict:
    """Add each tensor's measured stored bytes (compression.json's `compressed`) next to its prediction."""
    measured = {c["name"]: c for c in compressed}
    for r in section["tensors"]:
        m = measured.get(r["name"])
        r["measured_stored_bytes"] = m["bytes_after"] if m else 2 * int(np.prod(r["shape"]))
        if m and m.get("fallback_for"):
            r["fallback"] = m["fallback_for"]
    section["predicted_equals_measured"] = sum(r["predicted_stored_bytes"] == r["measured_stored_bytes"]
                                               for r in section["tensors"])
    return section
