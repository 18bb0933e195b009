"""Figures of frontend.mlpackage (issue 11): features vs `audio.log_mel`, transcripts, size and time.

    uv run python tools/parity/frontend_package_parity.py --bundle out/synth-fp16            # everything
    uv run python tools/parity/frontend_package_parity.py --bundle DIR --skip-transcripts     # features only

1. every committed clip in tests/data/audio (long clips: each `split_long_audio` piece): valid frames of
   both, max |diff| and PSNR on the valid frames, padding frames zero;
2. near-silence levels (a speech clip and white noise scaled to peaks 1e-1 .. 1e-6, and digital
   silence): package vs log_mel, and both vs an all-float64 front end (how far float32 rounding alone
   moves the reference there);
3. held-out transcripts (tests/data/heldout, interpreter): token ids with --front-end package vs python;
4. size of the package and interpreter time of one 35 s window (median of --repeat runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from cohere_coreml.export.frontend import check_case, reference_outputs, window_input
from cohere_coreml.export.parity import psnr
from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel, mel_filters, split_long_audio
from cohere_coreml.model.shapes import frontend_shapes
from cohere_coreml.runtime import load_model
from cohere_coreml.storage.files import package_size_bytes

ROOT = Path(__file__).resolve().parents[2]


def float64_log_mel(waveform: np.ndarray, config: FrontEndConfig) -> np.ndarray:
    """The front end in float64 throughout (valid frames only): what exact arithmetic gives."""
    x = waveform.astype(np.float64)
    x = np.concatenate([x[:1], x[1:] - config.preemphasis * x[:-1]])
    half = config.n_fft // 2
    padded = np.pad(x, half)
    window = np.zeros(config.n_fft)
    offset = (config.n_fft - config.win_length) // 2
    import torch

    window[offset: offset + config.win_length] = torch.hann_window(config.win_length, periodic=False,
                                                                   dtype=torch.float64).numpy()
    n = (x.shape[0] + 2 * half - config.n_fft) // config.hop_length
    frames = np.stack([padded[t * config.hop_length: t * config.hop_length + config.n_fft] * window for t in range(n)])
    power = (np.abs(np.fft.rfft(frames, axis=1)) ** 2).T
    logmel = np.log(mel_filters(config).astype(np.float64) @ power + 2.0**-24)
    return (logmel - logmel.mean(1, keepdims=True)) / (logmel.std(1, ddof=1, keepdims=True) + 1e-5)


def feature_rows(model, config, shapes, named_waveforms):
    print(f"{'clip':<30} {'frames':>6} {'ref':>6} {'max |diff|':>10} {'PSNR dB':>8} {'pad 0':>5}")
    worst_diff, worst_psnr = 0.0, float("inf")
    for name, wav in named_waveforms:
        ref = reference_outputs(wav, config, shapes)
        out = model.predict(window_input(wav, shapes))
        report = check_case(ref, out)
        n = int(ref["feature_length"][0])
        got = int(np.asarray(out["feature_length"]).reshape(-1)[0])
        feats = {o.name: o for o in report.outputs}["input_features"]
        pad_zero = {o.name: o for o in report.outputs}["padding_frames"].passed
        worst_diff, worst_psnr = max(worst_diff, feats.max_abs_err), min(worst_psnr, feats.psnr_db)
        print(f"{name:<30} {got:>6} {n:>6} {feats.max_abs_err:>10.2e} {feats.psnr_db:>8.1f} {str(pad_zero):>5}")
    print(f"worst: max |diff| {worst_diff:.2e}, PSNR {worst_psnr:.1f} dB")


def near_silence_rows(model, config, shapes):
    speech = load_audio(ROOT / "tests/data/audio/en_medium.wav")
    noise = np.random.default_rng(0).standard_normal(2 * config.sampling_rate).astype(np.float32)
    print(f"{'signal':<8} {'peak':>7} {'|pkg-ref|':>10} {'PSNR dB':>8} {'|ref-f64|':>10} {'|pkg-f64|':>10}")
    for name, base in (("speech", speech), ("noise", noise)):
        for peak in (1e-1, 1e-2, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 1e-6):
            wav = (base * (peak / np.abs(base).max())).astype(np.float32)
            ref, n = log_mel(wav, config)
            out = np.asarray(model.predict(window_input(wav, shapes))["input_features"])[0, :, :n]
            exact = float64_log_mel(wav, config)
            print(f"{name:<8} {peak:>7.0e} {np.abs(out - ref[:, :n]).max():>10.2e} {psnr(ref[:, :n], out):>8.1f} "
                  f"{np.abs(ref[:, :n] - exact).max():>10.2e} {np.abs(out - exact).max():>10.2e}")
    wav = np.zeros(2 * config.sampling_rate, dtype=np.float32)
    ref, n = log_mel(wav, config)
    out = np.asarray(model.predict(window_input(wav, shapes))["input_features"])[0, :, :n]
    print(f"digital silence: package {np.unique(out).round(4).tolist()}, log_mel {np.unique(ref[:, :n]).round(4).tolist()}")


def transcript_rows(bundle, limit=None):
    from cohere_coreml.inference.transcribe import Transcriber

    heldout = ROOT / "tests/data/heldout"
    entries = json.loads((heldout / "manifest.json").read_text())["utterances"][:limit]
    python = Transcriber(bundle, backend="mil", front_end="python")
    package = Transcriber(bundle, backend="mil", front_end="package")
    same = 0
    features_s = {"python": [], "package": []}
    for e in entries:
        wav = load_audio(heldout / e["file"])
        a = python.transcribe(wav, language=e["language"])
        b = package.transcribe(wav, language=e["language"])
        features_s["python"] += [w.timings["features_s"] for w in a.windows]
        features_s["package"] += [w.timings["features_s"] for w in b.windows]
        if a.token_ids == b.token_ids:
            same += 1
        else:
            print(f"  DIFFERENT {e['file']}: python {a.text!r} / package {b.text!r}")
    print(f"held-out transcripts token-identical (package vs python front end): {same}/{len(entries)}")
    print("features per window (median s): python {:.3f}, package {:.3f}".format(
        statistics.median(features_s["python"]), statistics.median(features_s["package"])))
    committed = [c for c in json.loads((ROOT / "tests/data/audio/manifest.json").read_text())["clips"]
                 if c.get("language")]
    same = 0
    for c in committed:
        wav = load_audio(ROOT / "tests/data/audio" / c["file"])
        if np.abs(wav).max() < 1e-4:
            continue
        a = python.transcribe(wav, language=c["language"], max_new_tokens=96)
        b = package.transcribe(wav, language=c["language"], max_new_tokens=96)
        same += a.token_ids == b.token_ids
        if a.token_ids != b.token_ids:
            print(f"  DIFFERENT {c['file']}: python {a.text!r} / package {b.text!r}")
    print(f"committed clips token-identical: {same}/{len(committed)} (max 96 new tokens per window)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="bundle folder with frontend.mlpackage and manifest.json")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of the 35 s window (default 5)")
    parser.add_argument("--skip-transcripts", action="store_true", help="features, size and time only")
    parser.add_argument("--limit", type=int, default=None, help="only the first N held-out utterances")
    args = parser.parse_args(argv)
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    config = FrontEndConfig.from_dict({**manifest["audio"], "dither": 0.0})
    package = bundle / manifest["files"]["frontend"]
    main_fn = manifest["frontend"]["functions"]["main"]
    shapes = frontend_shapes(config, main_fn["window_seconds"])
    model = load_model(str(package), backend="mil")

    print("== 1. committed clips (long clips: split_long_audio pieces) vs audio.log_mel")
    clips = []
    for path in sorted((ROOT / "tests/data/audio").iterdir()):
        if path.suffix not in {".wav", ".flac"}:
            continue
        pieces = split_long_audio(load_audio(path), config)
        clips += [(path.name if len(pieces) == 1 else f"{path.name}[{i}]", p) for i, p in enumerate(pieces)]
    clips.append(("full 35 s window (tiled speech)",
                  np.resize(np.concatenate([w for _, w in clips]), shapes.samples).astype(np.float32)))
    feature_rows(model, config, shapes, clips)

    print("\n== 2. near-silence: package vs log_mel vs float64 (max |diff| on valid frames)")
    near_silence_rows(model, config, shapes)

    print("\n== 4. size and interpreter time (35 s window)")
    print(f"package {package_size_bytes(package) / 1e6:.2f} MB ({len(manifest['frontend']['functions'])} function(s))")
    inputs = window_input(clips[-1][1], shapes)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        model.predict(inputs)
        times.append(time.perf_counter() - t0)
    python_times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        log_mel(clips[-1][1], config)
        python_times.append(time.perf_counter() - t0)
    print(f"interpreter: median {statistics.median(times) * 1000:.0f} ms per 35 s window over {args.repeat} runs "
          f"(audio.log_mel: median {statistics.median(python_times) * 1000:.0f} ms)")

    if not args.skip_transcripts:
        print("\n== 3. transcripts, --front-end package vs python (interpreter)")
        transcript_rows(bundle, args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
