"""`cohere-coreml quantize`: f16 bundle in, quantized bundle out, gated; nothing written in place.

    check the source (a complete f16 bundle) -> the f16 references (`measure.build_gate_data`) ->
    per component: compress (`compress`, with `sensitivity` / `--target-psnr` when asked) into a
    temporary package, gate it (`gate.component_gate`, through `cohere_coreml.export.gate.export_gated`) ->
    copy the rest of the bundle -> held-out gate (`gate.heldout_gate`) -> compression.json, manifest,
    README / example (`publish.finalize_bundle`) -> preset mixed: the finished bundle measured as
    `du -sb` counts it (`files.tree_bytes`), over its budget: re-planned and built again, or refused
    (`mixed.replan_overhead`) -> rename into `--out`

The new bundle is built in a temporary folder next to `--out` and renamed only after every gate
passed; a refused build leaves its figures beside the would-be bundle (`refusal_path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..bundle.manifest import MANIFEST_NAME, write_manifest
from ..export.convert import ExportSettings, ParityError
from ..export.gate import HELDOUT_COMPONENT, GateReport, export_gated
from ..export.memory import release_memory
from ..publish.hub import finalize_bundle
from ..storage import faults
from ..storage.files import TEMPORARY_NAME, sweep_stale_temporaries, temporary_dir, tree_bytes, write_json_atomic
from ..storage.integrity import COMPRESSION_FILE, check_bundle
from .compress import compress_package
from .compression_gates import QuantizeGateError, component_gate, encoder_parts_gate, heldout_gate
from .inventory import compressed_ops
from .measure import GateData, build_gate_data, clips_of
from .mixed import Budget, analyse, assignment, attach_measured, count_parameters, mixed_recipe, plan, replan_overhead
from .recipes import (
    COMPONENTS,
    DEFAULT_PRESET,
    GATES,
    LOWRANK_ENERGY,
    PRESETS,
    SCHEMES,
    QuantizeError,
    Recipe,
    bundle_components,
    preset_recipes,
    recipe_component,
)
from .sensitivity import SENSITIVITY_WINDOWS, choose_fp16, sensitivity

logger = logging.getLogger(__name__)


def holds_files(folder: Path) -> bool:
    """A folder with anything but hidden files (a reserved, empty `q8/` with its `.gitkeep` is free)."""
    return folder.exists() and (not folder.is_dir() or any(not p.name.startswith(".") for p in folder.iterdir()))


def refusal_path(out: Path) -> Path:
    """Where a refused build's gate figures go: beside the bundle it would have been (`q4.parity-failed.json`),
    never inside a folder that could pass for a bundle."""
    return out.with_name(f"{out.name}.parity-failed.json")


def write_refusal(out: Path, preset: str, reports: dict) -> Path:
    path = refusal_path(out)
    write_json_atomic({"preset": preset, "bundle": str(out), "passed": False, "gate": reports}, path)
    return path


def source_preset(bundle_dir: Path) -> str:
    """Preset of an existing bundle ("f16" for a bundle without a compression report)."""
    report = Path(bundle_dir) / COMPRESSION_FILE
    if report.is_file():
        return str(json.loads(report.read_text()).get("preset", "unknown"))
    return "f16"


# Bundles whose weights are still fp16, so weight compression may start from them: the export, and
# the low-rank encoder (`lowrank`: a smaller fp16 encoder, compressed further by q8 / q4 / mixed).
UNCOMPRESSED_PRESETS = ("f16", "lowrank")


def check_source(bundle_dir: Path, preset: str | None = None) -> str:
    """Refuse anything but a complete bundle with uncompressed (fp16) weights: the f16 export, or a
    `lowrank` bundle for a weight-compression preset. Returns the source's preset."""
    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / MANIFEST_NAME).is_file():
        raise QuantizeError(f"{bundle_dir} is not a bundle (no {MANIFEST_NAME}): export one with "
                            "`cohere-coreml export` first")
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_text())
    if manifest.get("checksums"):
        check_bundle(bundle_dir, hashes=True)  # names any file that changed since export
    found_preset = source_preset(bundle_dir)
    said = {found_preset, manifest.get("preset", found_preset)}  # compression.json's and the manifest's
    compressed = sorted(said - set(UNCOMPRESSED_PRESETS))
    if compressed:
        raise QuantizeError(f"{bundle_dir} is already a {compressed[0]!r} bundle: quantize the f16 bundle it was "
                            "made from, not a quantized one (weights are compressed once)")
    if len(said) > 1:
        raise QuantizeError(f"{bundle_dir}: its manifest says preset {manifest.get('preset')!r}, its "
                            f"{COMPRESSION_FILE} {found_preset!r}: rebuild the bundle")
    if found_preset != "f16" and preset in LOWRANK_ENERGY:
        raise QuantizeError(f"{bundle_dir} is a {found_preset!r} bundle: preset {preset} rewrites the encoder of the "
                            "f16 export; pass the f16 bundle")
    for comp in bundle_components(bundle_dir):
        pkg = bundle_dir / f"{comp}.mlpackage"
        if not pkg.is_dir():
            raise QuantizeError(f"{bundle_dir} has no {pkg.name}")
        found = compressed_ops(pkg)
        if found:
            raise QuantizeError(f"{pkg} already holds compressed weights ({len(found)} ops, e.g. {found[0]}): "
                                "quantize the f16 bundle, not a quantized one")
    return found_preset


def build_component(comp: str, f16_package: Path, dst: Path, recipe: Recipe, data: GateData | None, *,
                    with_sensitivity: bool = False, target_psnr: float | None = None) -> dict:
    """Compress one package into `dst` (with sensitivity, and `--target-psnr` keeping the most
    sensitive weights fp16: the package is then rebuilt); returns its compression.json section."""
    section = compress_package(f16_package, dst, recipe, calibration=data, component=comp)
    if recipe.activation_target_psnr is not None and data is not None and comp == "encoder":
        section = keep_sensitive_activations(f16_package, dst, recipe, data, section)
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
            recipe = dataclasses.replace(recipe, keep_fp16=tuple(choice["kept_fp16"]))
            shutil.rmtree(dst)
            rebuilt = compress_package(f16_package, dst, recipe, calibration=data, component=comp)
            rebuilt["sensitivity"], rebuilt["target_psnr"] = section["sensitivity"], choice
            section = rebuilt
    return section


def keep_sensitive_activations(f16_package: Path, dst: Path, recipe: Recipe, data: GateData, section: dict) -> dict:
    """W8A8 encoder: each activation's sensitivity in the built program (`activations.pair_sensitivity`: PSNR
    with only it int8, on the sensitivity windows), then the fewest most sensitive kept fp16 for the encoder to
    reach `recipe.activation_target_psnr` on every gate window (`choose_fp16_activations`); the package is
    rebuilt with their ops left fp16 when any are. Returns the section (its `activation_sensitivity`)."""
    from .activations import choose_fp16_activations, pair_sensitivity

    sens = pair_sensitivity(dst, data.subset(SENSITIVITY_WINDOWS))
    choice = choose_fp16_activations(dst, data, sens, recipe.activation_target_psnr)
    report = {"metric": "encoder PSNR (dB) vs f16 with only this activation int8 (quantize op of the built program)",
              "all_int8_psnr_db": sens["all"], "windows": sens["windows"],
              "per_activation": {p["input"]: round(sens["per_pair"][p["quantize"]], 2) for p in sens["pairs"]},
              **choice}
    logger.info("W8A8: %d of %d activations kept fp16 (%d ops) for %.1f dB (all int8: %.1f dB)",
                len(choice["pairs_kept_fp16"]), len(sens["pairs"]), len(choice["keep_ops"]),
                choice["predicted_psnr_db"], sens["all"])
    if choice["keep_ops"]:
        shutil.rmtree(dst)
        recipe = dataclasses.replace(recipe, keep_fp16_activations=tuple(choice["keep_ops"]))
        section = compress_package(f16_package, dst, recipe, calibration=data, component="encoder")
    section["activation_sensitivity"] = report
    return section


def bundle_bytes(bundle_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(bundle_dir).rglob("*") if f.is_file())


def copy_bundle_files(src: Path, dst: Path) -> None:
    """Everything of the f16 bundle but the packages compressed here, their gate reports and generated
    docs. A package not compressed (frontend.mlpackage, fp32) is copied as is, with its gate report."""
    comps = bundle_components(src)
    skip = {f"{c}.mlpackage" for c in comps} | {COMPRESSION_FILE, "README.md", "example_inference.py",
                                                  MANIFEST_NAME}
    skip |= {f"{c}.parity.json" for c in (*comps, *COMPONENTS, HELDOUT_COMPONENT)}
    for f in src.iterdir():
        if f.name in skip or f.name.endswith(".parity-failed.json") or f.name.startswith("."):
            continue
        if f.is_dir():
            shutil.copytree(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)


def write_bundle_manifest(src: Path, dst: Path) -> None:
    """The f16 bundle's manifest (ids, prompts, shapes: the quantized packages have the same I/O) with
    the sections `bundle.write_manifest` computes from `dst` (preset and recipe from compression.json,
    min_os, checksums)."""
    write_manifest(json.loads((src / MANIFEST_NAME).read_text()), dst)


def install_bundle(tmp: Path, out: Path) -> None:
    """Rename the complete bundle `tmp` to `out`. An older `out` is renamed aside first (hidden
    `.<out>.old-<pid>`, removed once the new one is in place; put back if the rename fails), so at
    every instant `out` is the old bundle, the new one, or (between two renames) absent."""
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


def quantize_bundle(src: str | Path, out: str | Path, preset: str = DEFAULT_PRESET, *, model: str | None = None,
                    eval_dir: str | Path | None = None, target_psnr: float | None = None,
                    with_sensitivity: bool = False, limit_per_language: int | None = None,
                    force: bool = False, skip_verify: bool = False, calibration: str | Path | None = None,
                    budget: Budget | None = None, proxy: bool = False,
                    sensitivity_file: str | Path | None = None, energy: dict[str, float] | None = None,
                    more_data: list[str | Path] | tuple = (), accept_undecided: bool = False) -> dict:
    """Build bundle `out` from f16 bundle `src` with `preset`, gated; returns compression.json's content.

    The PyTorch checkpoint (`model`) is only used by the held-out gate (tokens / error rates vs
    PyTorch); without it that gate compares with the f16 bundle through the runtime. `eval_dir`: the
    held-out folder (`--data`); `skip_verify`: no gate at all (`--skip-verify`).
    Low-rank presets (`lowrank`, `q8-lowrank`) rewrite and re-export the encoder of `model` (required),
    calibrated on `calibration` (a folder like `--data`; default: `eval_dir`), their thresholds searched to
    the gate (`lowrank_search.search_energy`) unless `energy` ({layer type: threshold}, `--energy`) gives them.
    `more_data`: larger held-out folders, smallest first, evaluated while the task verdict is undecided
    (`compression_gates.decide`); `accept_undecided`: a verdict still undecided on the last of them passes,
    marked as such in compression.json and the card (`--accept-undecided`).
    `budget`: the byte budget of preset mixed (`mixed.Budget`): of the finished bundle as `du -sb`
    counts it, refused (QuantizeError, nothing written) when no build meets it; `proxy`: its
    sensitivity from the weights alone.
    """
    src, out = Path(src), Path(out)
    recipes = preset_recipes(preset)
    check_budget(preset, budget)
    if preset == "f16":
        raise QuantizeError("preset f16 is the exported bundle itself: choose q8, q8-hybrid or q4")
    # --- low-rank presets: the checkpoint and calibration audio are inputs (quantize/lowrank.py)
    if preset in LOWRANK_ENERGY:
        if not model:
            raise QuantizeError(f"preset {preset} rewrites the PyTorch checkpoint's encoder: pass --model (the "
                                "checkpoint the f16 bundle was exported from)")
        calibration = calibration or eval_dir
        if calibration is None:
            raise QuantizeError(f"preset {preset} needs calibration audio: pass --calibration DIR (or --data DIR, "
                                "used by default)")
        if not Path(calibration).is_dir():
            raise QuantizeError(f"--calibration {calibration}: no such folder")
        if energy is None and not skip_verify and eval_dir is None:
            raise QuantizeError(f"preset {preset} searches its ranks to the held-out verdict: pass --data DIR "
                                "(or choose the thresholds yourself with --energy)")
        if eval_dir is not None and not skip_verify and Path(calibration).resolve() == Path(eval_dir).resolve():
            # ranks calibrated on the held-out clips themselves flatter the gate: thresholds that keep every
            # held-out clip identical that way raised the error rate when calibrated on other audio
            # (docs/quantization.md)
            logger.warning("%s: the ranks are calibrated on the held-out clips the gate measures, so the gate "
                           "measures the calibration audio itself; pass --calibration with other in-domain audio "
                           "for an unbiased figure", preset)
    elif energy is not None:
        raise QuantizeError(f"--energy applies to the low-rank presets (lowrank, q8-lowrank), not {preset}")
    for folder in more_data:
        if not Path(folder).is_dir():
            raise QuantizeError(f"--more-data {folder}: no such folder")
    source = check_source(src, preset)
    comps = bundle_components(src)
    parts = [c for c in comps if recipe_component(c) == "encoder"]
    if len(parts) > 1 and (preset in ("mixed", "q8a8") or with_sensitivity or target_psnr is not None):
        raise QuantizeError(f"{src}: its encoder is in {len(parts)} parts; preset {preset}"
                            f"{' with sensitivity / --target-psnr' if preset not in ('mixed', 'q8a8') else ''} "
                            "plans over one encoder package (not over parts): quantize an export "
                            "with --encoder-parts 1, or use q8, q8-hybrid, q4, lowrank or q8-lowrank")
    if out.resolve() == src.resolve():
        raise QuantizeError("--out must differ from --bundle (the f16 bundle is never modified)")
    if holds_files(out) and not force:
        raise QuantizeError(f"{out} exists; use --force to replace it")
    gates = GATES[preset]
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(out.parent, prefix=f"{out.name}.")  # `.q8.tmp-<pid>` of a killed build
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    report: dict[str, Any] = {"preset": preset, "source": str(src), "source_preset": source,
                              "schemes": SCHEMES, "components": {}}
    if source != "f16":  # what the source did first (its ranks), so the bundle's report names every step
        earlier = json.loads((src / COMPRESSION_FILE).read_text())
        report["source_compression"] = {"preset": earlier["preset"], "components": {
            comp: {k: sec[k] for k in ("lowrank", "recipe") if k in sec} for comp, sec in earlier["components"].items()}}
    # the packages are written and gated like an export's (gate.export_gated), into the temporary bundle
    settings = ExportSettings(out_dir=tmp, skip_verify=skip_verify)
    gate_reports: dict[str, GateReport] = {}
    try:
        t0 = time.perf_counter()
        data = None
        calibrate = any(r.activations for r in recipes.values())  # W8A8: statistics from the gate audio
        if (not skip_verify or with_sensitivity or target_psnr is not None or calibrate
                or (preset == "mixed" and not proxy)):
            # the f16 references first (through the runtime); no quantized package is loaded yet
            clips = clips_of(eval_dir)
            logger.info("gate data: %d clips through the f16 bundle", len(clips))
            data = build_gate_data(src, clips)
        analysis = None
        if preset == "mixed":  # the encoder's tensors, bytes and sensitivities, measured once (quantize.mixed)
            sens_data = None if proxy else data.subset(SENSITIVITY_WINDOWS)
            analysis = analyse(src, budget, sens_data, proxy=proxy, scratch_parent=out.parent,
                               sensitivity_file=sensitivity_file)
        builds: list[dict] = []  # mixed: the earlier builds, over the budget (compression.json records them)
        search = None  # low-rank presets: the thresholds searched to the gate (lowrank_search.search_energy)
        if preset in LOWRANK_ENERGY and energy is None and not skip_verify:
            from .lowrank_search import SearchSettings  # imports torch

            search = SearchSettings(windows=data.windows, heldout=[Path(eval_dir), *map(Path, more_data)],
                                    gates=gates, limit_per_language=limit_per_language,
                                    accept_undecided=accept_undecided)

        def build(mixed_section: dict | None) -> None:
            """The whole bundle into `tmp`: packages gated, the rest copied, reports, finalized."""
            lowrank_dir = None  # the rewritten encoder's fp16 parts, exported once (low-rank presets)
            for comp in comps:
                section: dict[str, Any] = {}
                kind = recipe_component(comp)

                def write(path: Path, comp=comp, kind=kind, section=section) -> None:
                    nonlocal lowrank_dir
                    if kind == "encoder" and preset in LOWRANK_ENERGY:  # re-exported from the rewritten checkpoint
                        if lowrank_dir is None:
                            from .lowrank import build_lowrank_encoder  # imports torch (the checkpoint is rewritten)

                            lowrank_dir = temporary_dir(out.parent, "lowrank")
                            section.update(build_lowrank_encoder(
                                src, path, recipes[kind], model, Path(calibration),
                                energy if energy is not None else LOWRANK_ENERGY[preset], skip_verify=skip_verify,
                                keep_parts=lowrank_dir, search=search))
                        else:
                            section.update(compress_package(lowrank_dir / f"{comp}.mlpackage", path, recipes[kind]))
                        return
                    section.update(build_component(kind, src / f"{comp}.mlpackage", path, recipes[kind], data,
                                                   with_sensitivity=with_sensitivity, target_psnr=target_psnr))

                def gate(path: Path, comp=comp, kind=kind) -> GateReport:
                    if kind == "encoder" and len(parts) > 1:  # the parts so far, chained (the last: the whole encoder)
                        done = [tmp / f"{c}.mlpackage" for c in parts[: parts.index(comp)]]
                        return encoder_parts_gate(comp, [*done, path], src, data, preset, gates)
                    return component_gate(kind, path, data, preset, gates)

                try:
                    gate_reports[comp] = export_gated(comp, settings, write, gate)
                except BaseException:
                    if lowrank_dir is not None:
                        shutil.rmtree(lowrank_dir, ignore_errors=True)
                    raise
                if lowrank_dir is not None and comp == parts[-1]:  # every part compressed from it
                    shutil.rmtree(lowrank_dir, ignore_errors=True)
                report["components"][comp] = section
                if mixed_section is not None and comp == "encoder":
                    section["mixed"] = attach_measured(mixed_section, section["compressed"])
                release_memory()  # the gated package's interpreter copy, before the next component
            report["compress_seconds"] = round(time.perf_counter() - t0, 1)
            faults.point(f"copy/{out.name}", tmp)
            copy_bundle_files(src, tmp)
            write_bundle_manifest(src, tmp)  # provisional (the held-out gate loads the bundle)
            if not skip_verify:
                if eval_dir is not None:
                    held = heldout_gate(src, tmp, Path(eval_dir), gates, model=model,
                                        limit_per_language=limit_per_language, more=more_data,
                                        baselines=search.baselines if search is not None else None,
                                        accept_undecided=accept_undecided)
                    write_json_atomic(held.to_dict(), settings.report_path(HELDOUT_COMPONENT))
                    gate_reports[HELDOUT_COMPONENT] = held
                    if not held.passed:
                        raise QuantizeGateError(f"the {preset} bundle failed its gate: {held.headline}", held.to_dict())
                else:
                    logger.warning("no evaluation folder: the held-out token/WER gate did not run")
                report["gate"] = {name: r.to_dict() for name, r in gate_reports.items()}
                report["gate"].update(failures=[], passed=True)
            else:
                logger.warning("quantization gate skipped (--skip-verify)")
                report["gate"] = {"skipped": True}
            report["total_bytes"] = {"before": bundle_bytes(src), "after": bundle_bytes(tmp)}
            if mixed_section is not None:  # the finished bundle is measured after finalize: earlier builds only
                report["mixed"] = {"budget_bytes": mixed_section["budget_bytes"],
                                   "bytes_counted": mixed_section["bytes_counted"],
                                   "predicted_bundle_bytes": mixed_section["predicted_bundle_bytes"],
                                   "earlier_builds": builds, "bits_histogram": mixed_section["bits_histogram"]}
            write_json_atomic(report, tmp / COMPRESSION_FILE)
            write_bundle_manifest(src, tmp)
            finalize_bundle(tmp)  # README.md, example_inference.py, then the manifest's checksums (last)

        # preset mixed: the budget bounds the finished bundle as `du -sb` counts it; a build over it is
        # re-planned with the overhead it measured and built again (mixed.replan_overhead: bounded, or refused)
        overhead = 0
        while True:
            mixed_section = None
            if analysis is not None:
                mixed_section = assignment(analysis, budget, overhead)
                recipes["encoder"] = mixed_recipe(mixed_section)
            build(mixed_section)
            if mixed_section is None:
                break
            delivered = tree_bytes(tmp)
            logger.info("mixed: the bundle is %s bytes as du -sb counts it (budget %s, predicted %s)", f"{delivered:,}",
                        f"{mixed_section['budget_bytes']:,}", f"{mixed_section['predicted_bundle_bytes']:,}")
            if delivered <= mixed_section["budget_bytes"]:
                break
            builds.append({"predicted_bundle_bytes": mixed_section["predicted_bundle_bytes"],
                           "delivered_bytes": delivered, "overhead": overhead})
            overhead = replan_overhead(analysis, budget, builds)  # raises when the budget cannot be met
            logger.warning("mixed: %s bytes over the budget: re-planned with %s bytes of measured overhead, "
                           "building again", f"{delivered - mixed_section['budget_bytes']:,}", f"{overhead:,}")
            shutil.rmtree(tmp)
            tmp.mkdir()
            gate_reports.clear()
            report["components"] = {}
        install_bundle(tmp, out)
        if not skip_verify:  # a gated build replaces an earlier refusal; an ungated one says nothing new
            refusal_path(out).unlink(missing_ok=True)
    except ParityError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = err.report.to_dict() if isinstance(err.report, GateReport) else None
        path = write_refusal(out, preset, {**{n: r.to_dict() for n, r in gate_reports.items()},
                                           **({err.report.component: refused} if refused else {})})
        raise QuantizeGateError(f"the {preset} bundle failed its gate: {refused['headline'] if refused else err} "
                                f"(figures: {path})", refused) from err
    except QuantizeGateError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reports = {n: r.to_dict() for n, r in gate_reports.items()}
        if err.report and err.report.get("component") not in reports:  # e.g. the low-rank search's candidates
            reports[err.report["component"]] = err.report
        path = write_refusal(out, preset, reports)
        raise QuantizeGateError(f"{err} (figures: {path})", err.report) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%s)", out, preset)
    return report


def check_budget(preset: str, budget: Budget | None) -> None:
    """A byte budget belongs to preset mixed, which needs one (a clear error otherwise)."""
    given = budget is not None and (budget.target_bytes is not None or budget.bytes_per_param is not None)
    if preset == "mixed":
        (budget or Budget()).bytes()  # raises naming the missing or bad flag
    elif given:
        raise QuantizeError(f"--target-bytes / --target-bytes-per-param only apply to --preset mixed, not {preset}")


def mixed_budget(args) -> Budget:
    """The `Budget` of the command line (the parameter count from --parameters or --model's safetensors)."""
    params = args.parameters
    if params is None and args.target_bytes_per_param is not None and args.model and Path(args.model).is_dir():
        params = count_parameters(args.model)
    return Budget(target_bytes=args.target_bytes, bytes_per_param=args.target_bytes_per_param, parameters=params)


def parse_energy(text: str) -> dict[str, float]:
    """`--energy attn_qk=0.95,ffn=0.98`: {layer type: threshold in (0, 1]} (argparse names a bad value)."""
    names = tuple(LOWRANK_ENERGY["lowrank"])  # the layer types (lowrank.LAYER_TYPES; lowrank imports torch)
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            threshold = float(value)
        except ValueError:
            threshold = float("nan")
        if not sep or name not in names or not 0.0 < threshold <= 1.0:
            raise argparse.ArgumentTypeError(f"{item!r}: give TYPE=E with TYPE one of {', '.join(names)} "
                                             "and E in (0, 1], e.g. ffn=0.98")
        out[name] = threshold
    if not out:
        raise argparse.ArgumentTypeError("no thresholds given, e.g. attn_qk=0.95,ffn=0.98")
    return out


def data_folder(args) -> str | None:
    """`--data`: the evaluation folder, or None for 'none'."""
    return None if str(args.data).lower() == "none" else args.data


def dry_run_plan(args, budget: Budget) -> dict:
    """`--dry-run`: the mixed assignment and its predicted bytes only (nothing compressed or written)."""
    if args.preset != "mixed":
        raise QuantizeError("--dry-run applies to --preset mixed only")
    check_budget(args.preset, budget)
    check_source(Path(args.bundle))
    data = None
    if not args.proxy and not (args.sensitivity_file and Path(args.sensitivity_file).is_file()):
        data = build_gate_data(Path(args.bundle), clips_of(data_folder(args))).subset(SENSITIVITY_WINDOWS)
    return plan(Path(args.bundle), budget, data, proxy=args.proxy, sensitivity_file=args.sensitivity_file)


def format_summary(report: dict) -> str:
    lines = [f"preset {report['preset']}: bundle {report['total_bytes']['before']:,} -> "
             f"{report['total_bytes']['after']:,} bytes"]
    for comp, sec in report["components"].items():
        wb = sec["weight_bytes"]
        lines.append(f"  {comp:8s} {sec['recipe']['scheme'] or 'fp16':5s} weights {wb['before']:,} -> {wb['after']:,} "
                     f"bytes ({sec['tensors']['compressed']}/{sec['tensors']['total']} tensors compressed)")
        if "lowrank" in sec:
            lr = sec["lowrank"]["encoder_parameters"]
            wf = sec["lowrank"]["weight_file_bytes"]
            lines.append(f"           low-rank: encoder parameters {lr['before']:,} -> {lr['after']:,} "
                         f"(-{100 * lr['reduction']:.1f} %); weight file f16 {wf['f16']:,} -> {wf['after']:,} bytes")
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
    for sec in report["components"].values():
        for c in sec.get("lowrank", {}).get("search", {}).get("candidates", []):
            lines.append(f"  low-rank search: scale {c['scale']:g}: encoder -{100 * c['reduction']:.1f} %, "
                         f"{c['encoder_psnr_db']:.1f} dB, {'pass' if c['passed'] else 'refused'} ({c['decided_by']})")
    if "heldout" in gate:
        h = gate["heldout"]
        lines.append(f"  held-out: {h['identical_clips']}/{h['clips']} clips identical to {h['baseline']}, "
                     f"WER {100 * h['wer']:.2f} % ({h['baseline']} {100 * h['wer_baseline']:.2f} %); "
                     f"{h.get('verdict', 'pass')} on {h.get('deciding_figure', '-')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option (hidden from --help): sets the new option's value and records
    the rename in `deprecated_flags`, which `cmd_quantize` logs as one warning line each."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        namespace.deprecated_flags = [*getattr(namespace, "deprecated_flags", ()), (option_string, self.new)]


def add_quantize_arguments(p) -> None:
    p.add_argument("--bundle", default="f16", help="exported f16 bundle (default: %(default)s, as `make export` writes it)")
    p.add_argument("--out", default="q8", help="new bundle folder (default: %(default)s)")
    p.add_argument("--preset", choices=[k for k in PRESETS if k != "f16"], default=DEFAULT_PRESET,
                   help="q8: int8 encoder + decoder; q8-hybrid: int8 encoder, fp16 decoder; q4: 4-bit palette "
                   "encoder, int8 decoder; mixed: per-tensor 2-8 bit encoder to --target-bytes[-per-param], int8 decoder; "
                   "q8a8: q8 with int8 encoder activations (W8A8); lowrank: low-rank encoder (needs --model), fp16; "
                   "q8-lowrank: low-rank encoder then int8, int8 decoder. --bundle may also be a lowrank bundle "
                   "(its fp16 low-rank encoder is then compressed) (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="PyTorch checkpoint for the held-out gate (tokens/WER vs PyTorch), e.g. the checkpoint the "
                   "bundle was exported from; without it the gate compares with the f16 bundle")
    p.add_argument("--data", default="none",
                   help="evaluation folder (manifest.json / manifest.jsonl: file, language, text; as `bench --data`) "
                   "for the held-out gate and the gate clips, e.g. tests/data/heldout of the checkout (`make quantize` "
                   "passes it); 'none' (default): no held-out gate, the gates run on the speech clips shipped with "
                   "the package")
    p.add_argument("--calibration", default=None, metavar="DIR",
                   help="lowrank presets: calibration audio folder (the --data format; default: the --data folder)")
    p.add_argument("--energy", default=None, type=parse_energy, metavar="TYPE=E[,TYPE=E...]",
                   help="lowrank presets: these retained-energy thresholds per layer type (attn_qk, attn_vo, ffn, "
                   "conv_pw; a type not named stays full) instead of searching them to the gate")
    p.add_argument("--more-data", action="append", default=[], metavar="DIR",
                   help="a larger held-out folder (repeatable, smallest first), evaluated while the held-out "
                   "verdict is undecided (its bootstrap interval holds the bound), e.g. "
                   "tests/data/heldout-varied/single")
    p.add_argument("--accept-undecided", action="store_true",
                   help="build even when the held-out verdict is still undecided on the largest set given (a set too "
                   "small to show the bound kept or exceeded); the verdict is recorded as undecided in "
                   "compression.json and the model card. A refusal (bound exceeded, PSNR floor) still refuses")
    p.add_argument("--limit-per-language", type=int, default=None, help="use only the first N clips per language")
    p.add_argument("--sensitivity", action="store_true",
                   help="measure each weight's sensitivity (output PSNR with only it quantized) into compression.json")
    p.add_argument("--target-psnr", type=float, default=None,
                   help="keep the most sensitive weights fp16 until each component's output PSNR vs f16 reaches "
                   "this (dB); implies --sensitivity")
    # preset mixed (quantize.mixed)
    p.add_argument("--target-bytes", type=int, default=None,
                   help="mixed: the most bytes the finished --out folder may hold, as `du -sb` counts it: every file "
                   "(packages, gate reports, compression.json, README.md, example_inference.py, manifest with its "
                   "checksums) and every directory's own entry (4096 bytes each on ext4). A build over it is "
                   "re-planned with what it measured and built again; a budget no build can meet is refused, naming "
                   "the bytes delivered and the smallest achievable")
    p.add_argument("--target-bytes-per-param", type=float, default=None,
                   help="mixed: the same budget as bytes per model parameter, floor(X * parameters) (needs --model "
                   "CHECKPOINT or --parameters)")
    p.add_argument("--parameters", type=int, default=None, help="mixed: the model's parameter count")
    p.add_argument("--proxy", action="store_true",
                   help="mixed: sensitivity from the weights alone (relative quantization error), no interpreter")
    p.add_argument("--dry-run", action="store_true",
                   help="mixed: print the assignment and predicted bytes as JSON (nothing compressed or written)")
    p.add_argument("--sensitivity-file", default=None,
                   help="mixed: read the measured sensitivity from this JSON if it exists, else write it there")
    p.add_argument("--plan-out", default=None, help="mixed --dry-run: also write the plan JSON to this file")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--skip-verify", action="store_true", help="no gate (the bundle is written unchecked)")
    # old spellings (one release): --eval-set was --data, --skip-gate was --skip-verify
    p.add_argument("--eval-set", dest="data", action=DeprecatedAlias, new="--data")
    p.add_argument("--skip-gate", dest="skip_verify", action=DeprecatedAlias, new="--skip-verify", nargs=0)


def cmd_quantize(args) -> int:
    for old, new in getattr(args, "deprecated_flags", ()):
        logger.warning("%s is deprecated: use %s (the old spelling will be removed in the next release)", old, new)
    budget = mixed_budget(args)
    if args.dry_run:
        section = dry_run_plan(args, budget)
        if args.plan_out:
            write_json_atomic(section, Path(args.plan_out))
        print(json.dumps({k: v for k, v in section.items() if k != "tensors"}, indent=1))
        return 0
    eval_dir = data_folder(args)
    report = quantize_bundle(args.bundle, args.out, args.preset, model=args.model, eval_dir=eval_dir,
                             target_psnr=args.target_psnr, with_sensitivity=args.sensitivity,
                             limit_per_language=args.limit_per_language, force=args.force,
                             skip_verify=args.skip_verify, calibration=args.calibration, budget=budget,
                             proxy=args.proxy, sensitivity_file=args.sensitivity_file, energy=args.energy,
                             more_data=args.more_data, accept_undecided=args.accept_undecided)
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
        "and, with --data, the bundle on a held-out set (the task verdict: every language's WER/CER increase over "
        "PyTorch within 0.5 points by its 95 % bootstrap interval; undecided, the next --more-data set decides; "
        "heldout.parity.json); a failing bundle is not written.",
    )
    add_quantize_arguments(p)
    p.set_defaults(func=cmd_quantize, deprecated_flags=())
