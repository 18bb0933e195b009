"""The encoder's package(s), written, gated and installed: `convert_encoder` (one window),
`convert_encoder_buckets` (one function per length bucket, weights shared) and, for either, the
layers in parts (`plan_parts`: consecutive layers per program, chained through the hidden state, so
that every program stays within the platform's weight limit, docs/ane.md). The traced module, its
conversion and the gate's arithmetic are `cohere_coreml.export.encoder`'s.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from ..config import BUCKETS_METADATA_KEY, LENGTH_MASKS_METADATA_KEY, PART_METADATA_KEY
from ..model.shapes import ENCODER_MASK, EncoderShapes, bucket_shapes, encoder_shapes
from ..storage.files import save_converted, skip_installed, staging_path, temporary_dir
from .convert import ExportError, ExportSettings, merge_functions
from .encoder import (
    COMPONENT,
    HIDDEN_NAME,
    HIDDEN_OUTPUT,
    compare_gate_cases,
    convert_traced_encoder,
    gate_cases,
    gate_features,
    gate_inputs,
    trace_encoder,
)
from .gate import GateCase, GateLoader, GateReport, StagedPackage, stage_gated
from .memory import release_memory
from .parity import report_correctness

logger = logging.getLogger(__name__)

# The encoder in parts (`export --encoder-parts auto`): the platform whose per-program weight limit
# "auto" keeps every part under (ane_check.WEIGHT_LIMITS, docs/ane.md), and the share of that limit
# the estimated parameter bytes may take (constants the converter adds: positional tables per function)
DEFAULT_PART_PLATFORM = "ios"
PART_MARGIN = 0.95


def convert_encoder(
    model,
    settings: ExportSettings,
    processor=None,
    clips: list[np.ndarray] | None = None,
    extra_metadata: dict | None = None,
    _wrapper_hook=None,
    parts: int | str = 1,
    platform: str = DEFAULT_PART_PLATFORM,
) -> Path | None:
    """Export `encoder.mlpackage` (and, in parts, `encoder_part<k>.mlpackage`) into `settings.out_dir`,
    parity-gated.

    Returns the (first) package path, or None when it exists and `settings.force` is False.
    Raises ParityError (and writes nothing) when the program does not match PyTorch.
    `_wrapper_hook(model, shapes)` is for tests that deliberately break the export (one part).
    """
    staged = stage_encoder(model, settings, processor, clips, extra_metadata, _wrapper_hook, parts=parts,
                           platform=platform)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_encoder(model, settings: ExportSettings, processor=None, clips: list[np.ndarray] | None = None,
                  extra_metadata: dict | None = None, _wrapper_hook=None, parts: int | str = 1,
                  platform: str = DEFAULT_PART_PLATFORM):
    """`convert_encoder` up to the gate: the package(s) written to temporary paths (traced and
    converted inside the writer, so neither outlives it) and the gate's PyTorch references
    computed. `finish()` the result to gate and install it (the model is not needed any more)."""
    shapes = encoder_shapes(model, settings.window_seconds, processor)
    logger.debug("encoder shapes: %s", shapes)
    return _stage(model, settings, {"main": shapes}, {"main": clips}, extra_metadata, parts, platform, _wrapper_hook)


# --------------------------------------------------------------------------------------------
# Length buckets: one package, one function per window, weights shared
# --------------------------------------------------------------------------------------------


def convert_encoder_buckets(
    model,
    settings: ExportSettings,
    bucket_seconds,
    processor=None,
    gate_audio=None,
    extra_metadata: dict | None = None,
    parts: int | str = 1,
    platform: str = DEFAULT_PART_PLATFORM,
) -> Path | None:
    """Export `encoder.mlpackage` as a multifunction package with one function per window.

    The default function `main` is the full window (`settings.window_seconds`); each shorter
    bucket (e.g. 10 s, 20 s) is a function `window_<s>s` whose input has that bucket's frames but
    whose outputs are padded to the FULL window's memory length Tp, so the decoder (and the
    contract) are unchanged: a short clip only pays for its bucket's encoder compute. Identical
    weights are stored once (`convert.merge_functions`). Every function is gated. In parts, every
    part's package has the same functions.
    """
    staged = stage_encoder_buckets(model, settings, bucket_seconds, processor, gate_audio, extra_metadata,
                                   parts=parts, platform=platform)
    if staged is None:
        return None
    staged.finish()
    return settings.package_path(COMPONENT)


def stage_encoder_buckets(model, settings: ExportSettings, bucket_seconds, processor=None, gate_audio=None,
                          extra_metadata: dict | None = None, parts: int | str = 1,
                          platform: str = DEFAULT_PART_PLATFORM):
    """`convert_encoder_buckets` up to the gate (see `stage_encoder`)."""
    shapes_by_fn = bucket_shapes(model, settings.window_seconds, bucket_seconds, processor)
    clips = {fn: gate_features(processor, shapes, gate_audio) if processor else None
             for fn, shapes in shapes_by_fn.items()}
    return _stage(model, settings, shapes_by_fn, clips, extra_metadata, parts, platform)


# --------------------------------------------------------------------------------------------
# The encoder in parts: consecutive layers per program, chained through the hidden state
# --------------------------------------------------------------------------------------------


def part_component(index: int) -> str:
    """Component name (and package stem) of part `index` (0-based): `encoder`, `encoder_part2`, ..."""
    return COMPONENT if index == 0 else f"{COMPONENT}_part{index + 1}"


def part_ranges(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """`parts` ranges of consecutive layers [start, stop), as even as possible (earlier parts take the
    remainder: the first part also holds the subsampling, the last the memory projections)."""
    if not 1 <= parts <= num_layers:
        raise ExportError(f"--encoder-parts {parts}: the encoder has {num_layers} layers (1..{num_layers} parts)")
    base, extra = divmod(num_layers, parts)
    ranges, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def part_weight_bytes(model, ranges, precision: str) -> list[int]:
    """Estimated weight bytes of each part's program: its parameters at the program precision (the
    first part's subsampling, the last part's decoder.proj and cross K/V projections included)."""
    per = 2 if precision == "fp16" else 4
    enc = model.model.encoder

    def count(modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    tail = [model.model.decoder.proj] + [m for layer in model.model.decoder.layers
                                         for m in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)]
    sizes = []
    for i, (start, stop) in enumerate(ranges):
        n = count(enc.layers[start:stop])
        if i == 0:
            n += count([enc.subsampling])
        if i == len(ranges) - 1:
            n += count(tail)
        sizes.append(n * per)
    return sizes


def plan_parts(model, parts: int | str, precision: str, platform: str = DEFAULT_PART_PLATFORM) -> list[tuple[int, int]]:
    """Layer ranges of the encoder's programs: `parts` = N, or "auto": the fewest parts whose estimated
    weights (`part_weight_bytes`) stay within PART_MARGIN of the platform's per-program limit
    (`ane_check.WEIGHT_LIMITS`: iOS 1 GiB, macOS 2 GiB; docs/ane.md)."""
    from ..bundle.ane_check import WEIGHT_LIMITS  # the limits' one home (with their sources)

    n = len(model.model.encoder.layers)
    if parts != "auto":
        try:
            count = int(parts)
        except (TypeError, ValueError):
            raise ExportError(f"--encoder-parts must be 'auto' or a number of parts, got {parts!r}") from None
        return part_ranges(n, count)
    if platform not in WEIGHT_LIMITS:
        raise ExportError(f"unknown platform {platform!r}; choose from {sorted(WEIGHT_LIMITS)}")
    limit = WEIGHT_LIMITS[platform] * PART_MARGIN
    for count in range(1, n + 1):
        ranges = part_ranges(n, count)
        sizes = part_weight_bytes(model, ranges, precision)
        if max(sizes) <= limit:
            logger.debug("encoder parts (auto, %s, limit %.0f MB): %d, estimated %s MB", platform, limit / 1e6, count,
                        [round(b / 1e6, 1) for b in sizes])
            return ranges
    raise ExportError(f"one encoder layer's weights exceed the {platform} per-program limit "
                      f"({WEIGHT_LIMITS[platform]} bytes): the encoder cannot be split finely enough")


def _part_metadata(index: int, ranges, num_layers: int) -> str:
    start, stop = ranges[index]
    return json.dumps({"index": index, "count": len(ranges), "layers": [start, stop], "num_layers": num_layers},
                      sort_keys=True)


def _installed_extra_parts(settings: ExportSettings, count: int) -> list[Path]:
    """Part packages of index >= count in the output folder (left by an export in more parts)."""
    found = []
    for path in sorted(settings.out_dir.glob(f"{COMPONENT}_part*.mlpackage")):
        suffix = path.stem[len(COMPONENT) + len("_part"):]
        if suffix.isdigit() and int(suffix) > count:
            found.append(path)
    return found


def _parts_installed(settings: ExportSettings) -> bool:
    """The encoder's first package and its report are in place and every part the first names is there
    (`files.skip_installed` for a component in several packages)."""
    if not skip_installed(settings, COMPONENT):
        return False
    from ..runtime.package import read_spec  # (the bundle's readers are not the encoder's business)

    raw = dict(read_spec(settings.package_path(COMPONENT)).description.metadata.userDefined).get(PART_METADATA_KEY)
    count = int(json.loads(raw)["count"]) if raw else 1
    missing = [part_component(i) for i in range(1, count) if not settings.package_path(part_component(i)).exists()]
    if missing:
        logger.warning("%s names %d parts but %s are missing: exporting it again", COMPONENT, count, missing)
        return False
    return True


def _stage(model, settings: ExportSettings, shapes_by_fn: dict[str, EncoderShapes], clips_by_fn: dict,
           extra_metadata, parts, platform, _wrapper_hook=None) -> StagedPackage | None:
    """Write every part (one function per window in each) to its temporary path and prepare the gate."""
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    num_layers = len(model.model.encoder.layers)
    ranges = plan_parts(model, parts, settings.precision, platform)
    if _wrapper_hook is not None and len(ranges) != 1:
        raise ExportError("a wrapper hook (tests) replaces the whole encoder: one part only")
    buckets_meta = {fn: {"window_seconds": sh.window_seconds, "frames": sh.frames,
                         "encoder_frames": sh.encoder_frames, "padded_frames": sh.padded_frames}
                    for fn, sh in shapes_by_fn.items()}
    main = shapes_by_fn["main"]
    tmps = [staging_path(settings.package_path(part_component(i))) for i in range(len(ranges))]

    def write_part(index: int, tmp: Path) -> None:
        layers = ranges[index]
        first, last = index == 0, index == len(ranges) - 1
        meta = {**(extra_metadata or {}), PART_METADATA_KEY: _part_metadata(index, ranges, num_layers)}
        if len(shapes_by_fn) == 1:  # one window: the converted program as it is
            t0 = time.perf_counter()
            traced = (_wrapper_hook(model, main) if _wrapper_hook is not None else
                      trace_encoder(model, main, layers) if len(ranges) > 1 else trace_encoder(model, main))
            logger.debug("encoder part %d/%d (layers %d-%d): traced in %.1f s", index + 1, len(ranges), layers[0],
                        layers[1] - 1, time.perf_counter() - t0)
            save_converted(convert_traced_encoder(traced, main, settings, meta, first=first, last=last), tmp)
            del traced
            release_memory()  # the part's program and (streamed layers) its weights, before the next part's
            logger.debug("converted in %.1f s", time.perf_counter() - t0)
            return
        scratch = temporary_dir(settings.out_dir, "encoder-buckets")
        try:
            singles = {}
            for fn, shapes in shapes_by_fn.items():
                logger.debug("encoder part %d/%d, bucket %s: %s", index + 1, len(ranges), fn, shapes)
                single = scratch / f"{fn}.mlpackage"
                traced = trace_encoder(model, shapes, layers) if len(ranges) > 1 else trace_encoder(model, shapes)
                save_converted(convert_traced_encoder(traced, shapes, settings.replace(window_seconds=shapes.window_seconds),
                                                      meta, first=first, last=last), single)
                del traced
                release_memory()
                singles[fn] = single
            mlmodel = merge_functions(singles, "main", scratch)
            # the merged package keeps no function's metadata: what every function shares
            mlmodel.user_defined_metadata[BUCKETS_METADATA_KEY] = json.dumps(buckets_meta, sort_keys=True)
            mlmodel.user_defined_metadata[LENGTH_MASKS_METADATA_KEY] = json.dumps(main.masks.to_manifest(),
                                                                                  sort_keys=True)
            mlmodel.user_defined_metadata[PART_METADATA_KEY] = meta[PART_METADATA_KEY]
            mlmodel.save(str(tmp))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def write(tmp: Path) -> None:
        for index in range(len(ranges)):
            write_part(index, tmp if index == 0 else tmps[index])

    def prepare():
        cases = {fn: gate_cases(model, shapes, gate_inputs(shapes, clips_by_fn.get(fn)), settings.gate_psnr_db,
                                boundaries=[r[0] for r in ranges[1:]])
                 for fn, shapes in shapes_by_fn.items()}

        def gate(tmp: Path) -> GateReport:
            paths = [tmp, *tmps[1:]]  # the first part's staging path, then the companions'
            reports = {}
            for fn, shapes in shapes_by_fn.items():
                fn_settings = settings.replace(window_seconds=shapes.window_seconds)
                if len(paths) == 1:
                    report = compare_gate_cases(paths[0], cases[fn], fn_settings,
                                                function_name=None if len(shapes_by_fn) == 1 else fn)
                else:
                    report = compare_part_cases(paths, cases[fn], fn_settings, fn, ranges)
                report.details["shapes"] = shapes.to_dict()
                reports[fn] = report
            if len(shapes_by_fn) == 1:
                report = reports["main"]
            else:
                report = GateReport.of_functions(COMPONENT, reports, buckets=buckets_meta)
            if len(ranges) > 1:
                report.details["parts"] = [{"package": f"{part_component(i)}.mlpackage", "layers": list(r)}
                                           for i, r in enumerate(ranges)]
            return report

        return gate

    # the parts are gated together and installed together (gate.StagedPackage's companions), with one
    # encoder.parity.json; a re-export in fewer parts removes the packages of the parts beyond
    companions = [(tmps[i], settings.package_path(part_component(i))) for i in range(1, len(ranges))]
    return stage_gated(COMPONENT, settings, write, prepare, companions=companions,
                       replaces=_installed_extra_parts(settings, len(ranges)),
                       installed=lambda: _parts_installed(settings))


def compare_part_cases(paths: list[Path], cases: list[GateCase], settings: ExportSettings, function_name: str,
                       ranges) -> GateReport:
    """The gate of an encoder in parts: each part on the transformers hidden state at its first layer
    (valid frames compared with transformers' at its last; the last part's outputs in full), then the
    chain of parts end to end on the window (every output, as the whole encoder's gate)."""
    with GateLoader(settings.gate_units, Path(paths[0]).parent) as loader:
        return _compare_parts(loader, paths, cases, settings, function_name, ranges)


def _compare_parts(loader: GateLoader, paths, cases, settings, function_name, ranges) -> GateReport:
    min_db = settings.gate_psnr_db
    results, texts = [], []
    # the chain of parts end to end (what `PartChain.predict` calls), run with the parts: one part in memory at a time
    chained: list = [None] * len(cases)
    for i, path in enumerate(paths):
        loaded = loader.load(path, function_name)
        for k, case in enumerate(cases):
            t = case.info["encoder_length"]
            if i == 0:
                inputs = case.inputs
            else:
                inputs = {HIDDEN_NAME: case.parts[i - 1], ENCODER_MASK: case.inputs[ENCODER_MASK]}
            produced = loaded.predict(inputs)
            chained[k] = produced if i == 0 else loaded.predict(
                {HIDDEN_NAME: chained[k][HIDDEN_OUTPUT], ENCODER_MASK: case.inputs[ENCODER_MASK]})
            if i == len(paths) - 1:
                reference, got = case.reference, produced
            else:  # valid frames: padded rows are not transformers' (docs/contract.md)
                reference = {HIDDEN_OUTPUT: case.parts[i][:, :t]}
                got = {HIDDEN_OUTPUT: np.asarray(produced[HIDDEN_OUTPUT])[:, :t]}
            report = report_correctness(reference, got, min_db)
            report.extra.update({"case": k, "part": i + 1, "layers": list(ranges[i]), **case.info})
            texts.append(f"[{COMPONENT} gate] function {function_name} part {i + 1} ({ranges[i][0]}-{ranges[i][1] - 1}) "
                         f"case {k}\n{report.summary()}")
            results.append(report)
        del loaded
        release_memory()  # the part's program and weights, before the next part is loaded
    for k, case in enumerate(cases):
        report = report_correctness(case.reference, chained[k], min_db)
        report.extra.update({"case": k, "part": "chain", **case.info})
        texts.append(f"[{COMPONENT} gate] function {function_name} parts chained, case {k}\n{report.summary()}")
        results.append(report)
    for text in texts:  # also in encoder.parity.json ("cases")
        logger.debug("%s", text)
    worst = min(r.worst_psnr_db for r in results)
    return GateReport(component=COMPONENT, passed=all(r.passed for r in results),
                      headline=f"worst PSNR {worst:.1f} dB over {len(cases)} case(s) x {len(paths)} parts and the "
                               f"chain (need {min_db:g} dB)",
                      details={"function": function_name, "min_psnr_db": float(min_db),
                               "runs_on": loader.describe(paths[0]),
                               "worst_psnr_db": worst if np.isfinite(worst) else str(worst),
                               "precision": settings.precision},
                      cases=[r.to_dict() for r in results], text="\n".join(texts))
