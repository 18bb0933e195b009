"""Benchmark: a random-weight Cohere Transcribe encoder through the MIL interpreter vs eager torch.

Entry point: ``tools/bench/bench_runtime.py``. Two phases, each in its own process so each reports
its own peak RSS:

1. reference: build the encoder from ``CohereAsrConfig`` defaults (optionally fewer layers),
   time eager torch fp32 on one window of random features, trace it and convert it to an ML
   program (fp16 by default), save the package, the input and the reference output;
2. interpreter: ``load_model(package, backend="mil")``, time ``predict`` on the same input,
   compare with the reference (PSNR, max relative error).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import load_model

logger = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    out_dir: str
    layers: int | None = None  # encoder layers (None: the config default)
    frames: int = 3500  # mel frames of the window (35 s at hop 160)
    precision: str = "fp16"
    threads: int | None = None  # torch threads for both phases (None: torch default)
    warmup: int = 1
    repeats: int = 1
    seed: int = 0
    reuse_package: bool = False  # skip phase 1 if its outputs exist


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def _encoder_config(layers):
    from transformers import CohereAsrConfig  # heavy: the interpreter phase (its peak RSS measured) loads none

    config = CohereAsrConfig()
    enc = config.encoder_config
    if layers is not None:
        enc.num_hidden_layers = int(layers)
    return enc


def _time(fn, warmup: int, repeats: int) -> tuple[float, object]:
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def _build_reference(cfg: BenchConfig):
    """(wrapper module, features, n_params, build seconds): the same weights for a given seed."""
    from transformers import AutoModel  # heavy (as in _encoder_config)

    torch.manual_seed(cfg.seed)
    enc_cfg = _encoder_config(cfg.layers)
    t0 = time.perf_counter()
    encoder = AutoModel.from_config(enc_cfg).eval()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in encoder.parameters())

    class Wrapper(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, features):  # (1, F, n_mels) -> (1, T, hidden)
            return self.encoder(features).last_hidden_state

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    features = torch.randn(1, cfg.frames, enc_cfg.num_mel_bins, generator=gen)
    if cfg.precision == "fp16":
        features = features.half().float()  # the same values reach both runtimes
    return Wrapper(encoder).eval(), features, n_params, build_s


def _phase_torch(cfg: BenchConfig) -> dict:
    """Re-time eager torch on the reference weights (checks they are the same weights)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    wrapper, features, _, _ = _build_reference(cfg)
    with torch.inference_mode():
        torch_s, ref = _time(lambda: wrapper(features), cfg.warmup, cfg.repeats)
    stored = np.load(Path(cfg.out_dir) / "reference.npy")
    if not np.allclose(ref.numpy(), stored, rtol=1e-4, atol=1e-5):
        raise RuntimeError("rebuilt reference differs from the stored one: different weights?")
    return {"torch_s": torch_s, "torch_threads": torch.get_num_threads()}


def _phase_reference(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapper, features, n_params, build_s = _build_reference(cfg)
    with torch.inference_mode():  # partial, not a lambda: `wrapper` is deleted below (no closure cell)
        torch_s, ref = _time(functools.partial(wrapper, features), cfg.warmup, cfg.repeats)
    np.save(out / "features.npy", features.numpy())
    np.save(out / "reference.npy", ref.numpy())
    logger.info("torch eager fp32: %.2f s", torch_s)

    import coremltools as ct  # heavy (as transformers in _encoder_config)

    t0 = time.perf_counter()
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, (features,), check_trace=False)
    mlmodel = ct.convert(
        traced,
        inputs=[ct.TensorType(name="features", shape=tuple(features.shape), dtype=np.float32)],
        outputs=[ct.TensorType(name="hidden", dtype=np.float32)],
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT16 if cfg.precision == "fp16" else ct.precision.FLOAT32,
        skip_model_load=True,
    )
    del traced, wrapper
    package = out / "encoder.mlpackage"
    tmp = out / "encoder.tmp.mlpackage"
    if tmp.exists():
        shutil.rmtree(tmp)
    mlmodel.save(str(tmp))
    if package.exists():
        shutil.rmtree(package)
    os.replace(tmp, package)
    convert_s = time.perf_counter() - t0
    return {
        "params": n_params,
        "torch_build_s": build_s,
        "torch_s": torch_s,
        "convert_s": convert_s,
        "torch_threads": torch.get_num_threads(),
        "reference_peak_rss_gb": _peak_rss_gb(),
    }


def _phase_interpreter(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    features = np.load(out / "features.npy")
    ref = np.load(out / "reference.npy")
    t0 = time.perf_counter()
    model = load_model(out / "encoder.mlpackage", backend="mil")
    load_s = time.perf_counter() - t0
    rss_after_load = _peak_rss_gb()
    interp_s, result = _time(lambda: model.predict({"features": features}), cfg.warmup, cfg.repeats)
    (y,) = result.values()
    y = y.astype(np.float64)
    refd = ref.astype(np.float64)
    mse = float(np.mean((y - refd) ** 2))
    peak = float(np.abs(refd).max())
    return {
        "interp_load_s": load_s,
        "interp_s": interp_s,
        "interp_ops": model.num_ops,
        "interp_peak_rss_gb": _peak_rss_gb(),
        "interp_rss_after_load_gb": rss_after_load,
        "psnr_db": float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse),
        "max_rel_err": float(np.abs(y - refd).max() / peak),
        "finite": bool(np.isfinite(y).all()),
    }


def _run_child(fn, cfg: BenchConfig) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, (cfg,))


def run_benchmark(cfg: BenchConfig) -> dict:
    out = Path(cfg.out_dir)
    results = {"config": asdict(cfg)}
    have = (out / "encoder.mlpackage").exists() and (out / "reference.npy").exists()
    if cfg.reuse_package and have:
        meta = json.loads((out / "reference.json").read_text())
        meta.update(_run_child(_phase_torch, cfg))  # fresh torch time, same machine state
    else:
        meta = _run_child(_phase_reference, cfg)
        (out / "reference.json").write_text(json.dumps(meta, indent=2))
    results.update(meta)
    results.update(_run_child(_phase_interpreter, cfg))
    results["ratio"] = results["interp_s"] / results["torch_s"]
    return results


def format_results(r: dict) -> str:
    c = r["config"]
    layers = c["layers"] if c["layers"] is not None else "default"
    return "\n".join(
        [
            f"encoder: {r['params'] / 1e6:.1f} M parameters, layers={layers}, frames={c['frames']}, "
            f"package precision {c['precision']}, torch threads {r['torch_threads']}",
            f"torch eager fp32      : {r['torch_s']:.2f} s   (peak RSS of that process incl. conversion "
            f"{r['reference_peak_rss_gb']:.2f} GB, conversion {r['convert_s']:.1f} s)",
            f"MIL interpreter       : {r['interp_s']:.2f} s   (load {r['interp_load_s']:.1f} s, {r['interp_ops']} ops, "
            f"peak RSS {r['interp_peak_rss_gb']:.2f} GB)",
            f"ratio interpreter/torch: {r['ratio']:.2f}  (target <= 3)",
            f"parity vs torch fp32  : PSNR {r['psnr_db']:.1f} dB, max rel err {r['max_rel_err']:.2e}, "
            f"finite={r['finite']}",
        ]
    )
