#!/usr/bin/env python
"""A large batch with a few bad files through `cohere-coreml transcribe`: every good clip transcribed,
every bad one named, exit status 1, no traceback.

Builds a folder of N clips (copies of the held-out clips, cycled) plus bad files (empty, random bytes,
a truncated FLAC, a WAV of NaN samples, a missing path), runs one `cohere-coreml transcribe --json`
over all of them in a fresh process and checks its output: stdout (results only) holds one JSON entry
per good file, status "ok" and the text the same clip gets on its own (the first copy of each clip), and
no entry for a bad file; stderr names every bad file.

Example:
  uv run python tools/train/batch_robustness.py --bundle out/demo/cohere-tiny-synth-fp16 --clips 1000
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(folder: Path, clips: int, data: Path) -> tuple[list[Path], list[Path]]:
    import numpy as np
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    sources = sorted(data.glob("en_*.flac"))
    good = []
    for i in range(clips):
        path = folder / f"good_{i:05d}.flac"
        if not path.exists():
            shutil.copyfile(sources[i % len(sources)], path)
        good.append(path)
    bad = {"empty.wav": b"", "random.flac": np.random.default_rng(0).bytes(5000)}
    for name, data_bytes in bad.items():
        (folder / name).write_bytes(data_bytes)
    flac = sources[0].read_bytes()
    (folder / "truncated.flac").write_bytes(flac[: len(flac) // 3])
    sf.write(folder / "nan.wav", np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT")
    bad_paths = [folder / n for n in ("empty.wav", "random.flac", "truncated.flac", "nan.wav")]
    bad_paths.append(folder / "missing.wav")
    return good, bad_paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="bundle folder")
    parser.add_argument("--backend", default="mil", choices=("auto", "coreml", "mil"))
    parser.add_argument("--clips", type=int, default=1000, help="good clips in the batch")
    parser.add_argument("--data", default=str(ROOT / "tests" / "data" / "heldout"), help="folder of en_*.flac clips")
    parser.add_argument("--work", default=str(ROOT / "out" / "batch"), help="where the batch folder is written")
    args = parser.parse_args(argv)
    good, bad = build(Path(args.work), args.clips, Path(args.data))
    files = good[: len(good) // 2] + bad + good[len(good) // 2:]  # bad files in the middle of the batch
    cmd = [sys.executable, "-m", "cohere_coreml.cli", "transcribe", *map(str, files), "--bundle", args.bundle,
           "--language", "en", "--backend", args.backend, "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    entries = {e["audio"]: e for e in json.loads(out)}  # results only: a failed file has no entry
    by_source: dict[int, str] = {}
    sources = len(sorted(Path(args.data).glob("en_*.flac")))
    ok = named = wrong = 0
    for i, path in enumerate(good):
        e = entries.get(str(path), {"status": "missing"})
        source = i % sources
        first = by_source.setdefault(source, e.get("text"))
        ok += e["status"] == "ok" and e.get("text") == first and bool(e.get("text"))
        wrong += e["status"] != "ok" or e.get("text") != first
    error_lines = [line for line in err.splitlines() if line.startswith("ERROR")]
    for path in bad:
        named += str(path) not in entries and any(path.name in line for line in error_lines)
    summary = {"good_clips": len(good), "good_transcribed_as_alone": ok, "good_wrong_or_failed": wrong,
               "bad_files": len(bad), "bad_named": named, "exit_status": proc.returncode, "seconds": round(seconds, 1),
               "traceback_on_stderr": "Traceback" in err}
    print(json.dumps(summary))
    passed = ok == len(good) and named == len(bad) and proc.returncode == 1 and "Traceback" not in err
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
