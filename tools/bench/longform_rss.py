#!/usr/bin/env python
"""Long-form memory: peak RSS of transcribing a 1-minute and a 10-minute clip (same speech, repeated).

Builds the clips by concatenating the committed held-out clips (0.5 s of silence between them),
then transcribes each in a fresh process (`cohere-coreml transcribe --json`, or the PyTorch
engine with --pytorch) and reads that process's peak RSS from the OS. Windows are read from the
file one at a time (cohere_coreml.inference.longform), so the 10-minute clip should cost about the same.

Example:
  uv run python tools/bench/longform_rss.py --bundle out/demo/cohere-tiny-synth-fp16 --backend mil
  uv run python tools/bench/longform_rss.py --pytorch models/cohere-tiny-synth
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN_PYTORCH = """
import json, sys
from cohere_coreml.inference.engines import PyTorchEngine
r = PyTorchEngine(sys.argv[1]).transcribe(sys.argv[2], "en")
print(json.dumps(r.to_dict()))
"""


def build_clip(minutes: float, out: Path, data: Path) -> Path:
    import numpy as np
    import soundfile as sf

    from cohere_coreml.model.audio import load_audio

    if out.is_file():
        return out
    clips = sorted(data.glob("en_*.flac"))
    gap = np.zeros(8000, np.float32)
    pieces, total, i = [], 0, 0
    target = int(minutes * 60 * 16000)
    while total < target:
        wav = load_audio(clips[i % len(clips)])
        pieces += [wav, gap]
        total += wav.size + gap.size
        i += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp" + out.suffix)
    sf.write(tmp, np.concatenate(pieces)[:target], 16000)
    os.replace(tmp, out)
    return out


def run(cmd: list[str]) -> tuple[float, dict]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}")
    peak_mb = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    return peak_mb, json.loads(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", default=None, help="bundle folder (cohere-coreml transcribe)")
    parser.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"))
    parser.add_argument("--pytorch", default=None, help="checkpoint folder: measure the PyTorch engine instead")
    parser.add_argument("--data", default=str(ROOT / "tests" / "data" / "heldout"), help="folder of en_*.flac clips")
    parser.add_argument("--minutes", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument("--work", default=str(ROOT / "out" / "longform"), help="where the long clips are written")
    args = parser.parse_args(argv)
    if not args.bundle and not args.pytorch:
        parser.error("give --bundle DIR or --pytorch MODEL")
    rows = []
    for minutes in args.minutes:
        clip = build_clip(minutes, Path(args.work) / f"en_{minutes:g}min.flac", Path(args.data))
        if args.pytorch:
            cmd = [sys.executable, "-c", RUN_PYTORCH, args.pytorch, str(clip)]
        else:
            cmd = [sys.executable, "-m", "cohere_coreml.cli", "transcribe", str(clip), "--bundle", args.bundle,
                   "--language", "en", "--backend", args.backend, "--json"]
        peak, result = run(cmd)
        windows = result["windows"]
        rows.append({"minutes": minutes, "peak_rss_mb": round(peak, 1), "windows": len(windows),
                     "last_window": [windows[-1]["start_s"], windows[-1]["start_s"] + windows[-1]["duration_s"]],
                     "words": len(result["text"].split())})
        print(json.dumps(rows[-1]), flush=True)
    if len(rows) >= 2:
        print(f"peak RSS {rows[-1]['minutes']:g} min / {rows[0]['minutes']:g} min = "
              f"{rows[-1]['peak_rss_mb'] / rows[0]['peak_rss_mb']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
