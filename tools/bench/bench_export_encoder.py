#!/usr/bin/env python
"""Benchmark: export a FULL-SIZE random-weight Cohere Transcribe encoder (CohereAsrConfig defaults).

Prints and writes (JSON) wall times (build, trace, convert, save), peak RSS, package size and the
FP16 weight file's bytes per exported parameter (target <= 2.02). Takes minutes and ~14 GB RAM:
run it alone on the machine.

    uv run python tools/bench/bench_export_encoder.py --out /tmp/bench_encoder [--precision fp16] [--window-seconds 35]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import time
from pathlib import Path

TARGET_BYTES_PER_PARAM = {"fp16": 2.02, "fp32": 4.04}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB on Linux


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/bench_encoder", help="scratch folder (package is deleted after)")
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--keep", action="store_true", help="keep the package")
    parser.add_argument("--gate", action="store_true",
                        help="run the parity gate (MIL interpreter, committed speech clips) instead of a bare "
                        "export; needs the PyTorch model in memory too (use with --encoder-layers on this machine)")
    parser.add_argument("--encoder-layers", type=int, default=None,
                        help="override encoder num_hidden_layers (smoke runs only; default: the config's 48)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("coremltools").setLevel(logging.WARNING)

    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml.export import encoder as E
    from cohere_coreml.export import encoder_packages as EP
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.model.shapes import encoder_shapes
    from cohere_coreml.storage.files import package_size_bytes, save_package_atomic, weight_file_bytes

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"precision": args.precision, "window_seconds": args.window_seconds}

    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = CohereAsrConfig()
    if args.encoder_layers:
        config.encoder_config.num_hidden_layers = args.encoder_layers
    figures["encoder_layers"] = config.encoder_config.num_hidden_layers
    model = CohereAsrForConditionalGeneration(config).eval()
    figures["build_s"] = round(time.perf_counter() - t0, 1)
    shapes = encoder_shapes(model, args.window_seconds)
    wrapper = E.EncoderForCoreML(model, shapes)
    exported_params = sum(p.numel() for p in wrapper.parameters())
    figures["shapes"] = shapes.to_dict()
    figures["exported_parameters"] = exported_params
    print(f"model built in {figures['build_s']} s; exported parameters {exported_params:,}; shapes {shapes}",
          flush=True)

    if args.gate:
        settings = ExportSettings(out_dir=out, precision=args.precision, window_seconds=args.window_seconds,
                                  force=True, model_id="random-weights:CohereAsrConfig()")
        t1 = time.perf_counter()
        clips = E.gate_features(None, shapes)
        path = EP.convert_encoder(model, settings, None, clips=clips)  # raises ParityError if the gate fails
        figures["export_and_gate_s"] = round(time.perf_counter() - t1, 1)
        gate = json.loads(settings.report_path("encoder").read_text())
        figures["gate_passed"] = gate["passed"]
        figures["gate_worst_psnr_db"] = gate["worst_psnr_db"]
        figures["gate_psnr_db"] = {
            f"case{c['case']}:{o['name']}": o["psnr_db"] for c in gate["cases"] for o in c["outputs"]
            if o["name"] != "cross_mask"
        }
        figures["peak_rss_gb"] = round(peak_rss_gb(), 2)
        print(json.dumps(figures, indent=2))
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
        return 0

    t1 = time.perf_counter()
    traced = E.trace_encoder(model, shapes)
    figures["trace_s"] = round(time.perf_counter() - t1, 1)
    # the traced graph holds the weights; drop the decoder-side rest of the model
    del model, wrapper

    settings = ExportSettings(out_dir=out, precision=args.precision, window_seconds=args.window_seconds,
                              force=True, skip_verify=True, model_id="random-weights:CohereAsrConfig()")
    t2 = time.perf_counter()
    mlmodel = E.convert_traced_encoder(traced, shapes, settings)
    figures["convert_s"] = round(time.perf_counter() - t2, 1)
    del traced
    t3 = time.perf_counter()
    path = settings.package_path("encoder")
    save_package_atomic(mlmodel, path, force=True)
    figures["save_s"] = round(time.perf_counter() - t3, 1)
    figures["export_wall_s"] = round(time.perf_counter() - t1, 1)
    figures["total_wall_s"] = round(time.perf_counter() - t0, 1)
    figures["peak_rss_gb"] = round(peak_rss_gb(), 2)
    figures["package_bytes"] = package_size_bytes(path)
    figures["weight_file_bytes"] = weight_file_bytes(path)
    figures["bytes_per_parameter"] = round(figures["weight_file_bytes"] / exported_params, 4)
    target = TARGET_BYTES_PER_PARAM[args.precision]
    figures["bytes_per_parameter_target"] = target
    figures["bytes_per_parameter_ok"] = figures["bytes_per_parameter"] <= target

    (out / "bench_export_encoder.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"export {figures['export_wall_s']} s (trace {figures['trace_s']}, convert {figures['convert_s']}, "
          f"save {figures['save_s']}), peak RSS {figures['peak_rss_gb']} GB, package "
          f"{figures['package_bytes'] / 1e9:.2f} GB, {figures['bytes_per_parameter']} bytes/param "
          f"(target <= {target}: {'OK' if figures['bytes_per_parameter_ok'] else 'OVER'})")
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return 0 if figures["bytes_per_parameter_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
