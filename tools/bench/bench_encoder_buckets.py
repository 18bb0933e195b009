#!/usr/bin/env python
"""Benchmark: what length buckets save. Full-width random-weight encoders (CohereAsrConfig defaults,
with 1 and 2 encoder layers so conversion stays cheap), exported as one multifunction
encoder.mlpackage (`main` = full window, `window_<s>s` = shorter buckets). Prints per function:
multiply-adds (static count from the MIL program, extrapolated linearly to the config's layer
count), the MIL-interpreter predict time, and the weight file size vs a single-window package.

    uv run python tools/bench/bench_encoder_buckets.py --out /tmp/bench_buckets --buckets 10 20
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def macs_per_function(path: Path) -> dict[str, int]:
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto_load

    from cohere_coreml_dev.macs import count_macs

    mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
    spec = mlmodel.get_spec()
    prog = milproto_load.load(spec, specification_version=spec.specificationVersion, file_weights_dir=mlmodel.weights_dir)
    return {name: count_macs(prog, name)["total"] for name in prog.functions}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/bench_buckets")
    parser.add_argument("--buckets", type=float, nargs="+", default=[10.0, 20.0])
    parser.add_argument("--window-seconds", type=float, default=35.0)
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    parser.add_argument("--time-predict", action="store_true", help="also time one interpreter predict per function")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("coremltools").setLevel(logging.WARNING)

    import numpy as np
    import torch
    from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration

    from cohere_coreml.export import encoder as E
    from cohere_coreml.export import encoder_packages as EP
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.model.shapes import bucket_function_name, encoder_shapes
    from cohere_coreml.storage.files import weight_file_bytes

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    full_layers = CohereAsrConfig().encoder_config.num_hidden_layers
    figures: dict = {"window_seconds": args.window_seconds, "buckets": args.buckets, "precision": args.precision,
                     "config_encoder_layers": full_layers, "runs": {}}
    for layers in (1, 2):
        config = CohereAsrConfig()
        config.encoder_config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = CohereAsrForConditionalGeneration(config).eval()
        settings = ExportSettings(out_dir=out / f"L{layers}", precision=args.precision,
                                  window_seconds=args.window_seconds, force=True, skip_verify=True)
        t0 = time.perf_counter()
        path = EP.convert_encoder_buckets(model, settings, args.buckets)
        run = {"export_s": round(time.perf_counter() - t0, 1), "macs": macs_per_function(path),
               "weight_file_bytes": weight_file_bytes(path)}
        single = EP.convert_encoder(model, settings.replace(out_dir=out / f"L{layers}-single"))
        run["single_weight_file_bytes"] = weight_file_bytes(single)
        if args.time_predict:
            from cohere_coreml.runtime import load_model

            run["predict_s"] = {}
            seconds = {"main": args.window_seconds, **{bucket_function_name(b): b for b in args.buckets}}
            for fn in run["macs"]:
                rt = load_model(path, function_name=fn)
                shapes = encoder_shapes(model, seconds[fn])
                feats = np.random.default_rng(0).standard_normal((1, config.encoder_config.num_mel_bins, shapes.frames))
                inputs = E.encoder_inputs(shapes, feats, shapes.frames)
                t1 = time.perf_counter()
                rt.predict(inputs)
                run["predict_s"][fn] = round(time.perf_counter() - t1, 2)
        figures["runs"][layers] = run
        print(json.dumps({layers: run}, indent=2), flush=True)
        del model
        shutil.rmtree(out / f"L{layers}", ignore_errors=True)
        shutil.rmtree(out / f"L{layers}-single", ignore_errors=True)

    m1, m2 = figures["runs"][1]["macs"], figures["runs"][2]["macs"]
    full = {fn: m1[fn] + (full_layers - 1) * (m2[fn] - m1[fn]) for fn in m1}
    figures["extrapolated_macs_full_model"] = full
    figures["relative_to_main"] = {fn: round(v / full["main"], 3) for fn, v in full.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_encoder_buckets.json").write_text(json.dumps(figures, indent=2) + "\n")
    for fn, v in sorted(full.items(), key=lambda kv: kv[1]):
        print(f"{fn:<14} {v / 1e9:8.1f} GMAC per window (full {full_layers}-layer encoder, extrapolated)  "
              f"x{figures['relative_to_main'][fn]} of main")
    r2 = figures["runs"][2]
    print(f"weights (2 layers): multifunction {r2['weight_file_bytes'] / 1e6:.1f} MB vs single window "
          f"{r2['single_weight_file_bytes'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
