#!/usr/bin/env python
"""A long file, one window at a time vs B windows at once vs B at once with the encoder ahead: side by side.

Builds a 10-minute clip from the committed held-out clips (`longform_rss.build_clip`: English clips with 0.5 s
of silence between them, cycled), then transcribes it with each configuration in a fresh process (so each one's
peak RSS is its own), the configurations alternated over `--repeats` runs:

    B=1            `Transcriber(decoder_batch=1)`: each window features -> encoder -> decode, one after another
    B=4, ahead 0   `decoder_batch=4, encoder_ahead=0`: windows decoded 4 at once, each encoded when a row frees
    B=4, ahead 4   `decoder_batch=4, encoder_ahead=4`: the same, a worker thread encoding the next 4 windows
                   while the rows decode (the default)

Per run: whole-file wall time (the `transcribe` call, after a warm-up call on the first minute that loads and
compiles every function), real-time factor, each stage's seconds (the VAD pass over the file, front end, encoder,
decoder: bind + prompt + decode) and real-time factor, the decoder's wait for encoder outputs, tokens per second
(of the decoder's time, of the whole file's), peak RSS of the process; and whether each window's tokens equal the
B=1 run's, a window that differs judged at its first differing token by the export gate's near-tie rule (`JUDGE`).
The bundle's VAD decides the windows as `transcribe` does by default (`--vad`).

    uv run python tools/bench/bench_longform_batch.py --bundle out/demo/cohere-tiny-synth-fp16 [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # longform_rss, beside this script

from longform_rss import build_clip  # noqa: E402

RUN = """
import json, sys, time
from cohere_coreml.inference.transcribe import Transcriber
bundle, clip, batch, ahead, backend, vad = sys.argv[1:7]
tr = Transcriber(bundle, backend=backend, decoder_batch=int(batch), encoder_ahead=int(ahead))
import soundfile as sf
audio, sr = sf.read(clip, dtype="float32")
tr.transcribe(audio[: 60 * sr], "en", vad=vad)  # warm-up: every function loaded (and, on a device, compiled)
t = time.perf_counter()
r = tr.transcribe(audio, "en", vad=vad)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "audio_s": len(audio) / sr, "vad_s": (r.vad or {}).get("seconds", 0.0),
                  "windows": [{"tokens": w.token_ids, "timings": w.timings} for w in r.windows]}))
"""

# A window whose tokens differ from B=1's: both decoders teacher-forced on the common prefix, their log-probs at
# the first differing token judged by the export gate's near-tie rule (`parity.flip_row`): a near-tie is what the
# two programs' measured error at that step could flip (the batched step computes the same function in another
# op order), a decisive flip would be a fault.
JUDGE = """
import json, sys
import numpy as np
import soundfile as sf
from cohere_coreml.export.parity import flip_row
from cohere_coreml.inference.batch_decoding import BatchDecoder
from cohere_coreml.inference.longform import iter_ranges, iter_windows, plan_speech
from cohere_coreml.inference.transcribe import Transcriber
bundle, clip, backend, vad, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
tr = Transcriber(bundle, backend=backend, decoder_batch=1)
audio, sr = sf.read(clip, dtype="float32")
speech = tr.speech_probabilities(vad)
pieces = list(iter_windows(audio, tr.front_end) if speech is None else
              iter_ranges(audio, plan_speech(audio, speech, None, tr.front_end, tr.window_s()), tr.front_end))
batch = BatchDecoder.load(tr.bundle.paths["decoder"], backend=backend)
prompt = tr.prompt("en")
out = []
for case in cases:
    one, many = case["one"], case["many"]
    k = next(j for j in range(len(one) + 1) if j == min(len(one), len(many)) or one[j] != many[j])
    enc = tr.encode(*tr.features(pieces[case["window"]][2])[:2])
    ref = np.asarray(tr.decode(enc, prompt + one[:k], max_new_tokens=1, return_log_probs=True).log_probs[-1])
    state = batch.make_state()
    batch.bind_row(state, 0, enc)
    for position, token in enumerate(prompt + one[:k]):
        row = batch.step(state, [token] + [0] * (batch.batch - 1), [position] + [None] * (batch.batch - 1))[0]
    a, b = (one[k] if k < len(one) else None), (many[k] if k < len(many) else None)
    judged = flip_row(ref, row, a, b) if a is not None and b is not None else {"near_tie": False}
    out.append({"window": case["window"], "token": k, **judged})
print(json.dumps(out))
"""

CONFIGS = {"B=1": (1, 0), "B=4, ahead 0": (4, 0), "B=4, ahead 4": (4, 4)}
STAGES = {"front end": ("features_s",), "encoder": ("encoder_s",), "decoder": ("bind_s", "prompt_s", "decode_s")}


def run_one(bundle: str, clip: Path, batch: int, ahead: int, backend: str, vad: str) -> dict:
    """One configuration in a fresh process: its JSON, with the process's own peak RSS (wait4's rusage)."""
    import tempfile

    cmd = [sys.executable, "-c", RUN, bundle, str(clip), str(batch), str(ahead), backend, vad]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            err.seek(0)
            lines = err.read().strip().splitlines()
            raise SystemExit(f"B={batch} ahead {ahead} failed: {lines[-1] if lines else status}")
    result = json.loads(out)
    result["peak_rss_mb"] = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    return result


def judge(bundle: str, clip: Path, backend: str, vad: str, cases: list[dict]) -> list[dict]:
    """Each differing window's first differing token judged by the near-tie rule (`JUDGE`), in a fresh process."""
    if not cases:
        return []
    cmd = [sys.executable, "-c", JUDGE, bundle, str(clip), backend, vad, json.dumps(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise SystemExit(f"judging the differing windows failed: {lines[-1] if lines else proc.returncode}")
    return json.loads(proc.stdout)


def differing(runs: list[dict], reference_tokens: list[list[int]]) -> list[dict]:
    """The windows whose tokens differ from B=1's in any run (first run that differs), as judge cases."""
    cases = {}
    for r in runs:
        for i, (w, ref) in enumerate(zip(r["windows"], reference_tokens)):
            if w["tokens"] != ref and i not in cases:
                cases[i] = {"window": i, "one": ref, "many": w["tokens"]}
    return list(cases.values())


def summary(runs: list[dict], reference_tokens: list[list[int]]) -> dict:
    walls = [r["wall_s"] for r in runs]
    audio_s = runs[0]["audio_s"]
    windows = runs[-1]["windows"]
    stage_s = {"VAD": statistics.median(r["vad_s"] for r in runs),
               **{name: statistics.median(sum(w["timings"].get(k, 0.0) for w in r["windows"] for k in keys)
                                          for r in runs) for name, keys in STAGES.items()}}
    tokens = sum(len(w["tokens"]) for w in windows)
    wait = [sum(w["timings"].get("encoder_wait_s", 0.0) for w in r["windows"]) for r in runs]
    same = [all(w["tokens"] == ref for w, ref in zip(r["windows"], reference_tokens))
            and len(r["windows"]) == len(reference_tokens) for r in runs]
    return {"wall_s": walls, "rtfx": audio_s / statistics.median(walls), "stage_s": stage_s,
            "stage_rtfx": {k: audio_s / v if v else None for k, v in stage_s.items()},
            "encoder_wait_s": statistics.median(wait) if "encoder_wait_s" in windows[0]["timings"] else None,
            "tokens_per_s_decoder": tokens / stage_s["decoder"] if stage_s["decoder"] else None,
            "tokens_per_s_whole": tokens / statistics.median(walls), "windows": len(windows), "tokens": tokens,
            "tokens_identical_to_B1": all(same), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def identical_cell(row: dict) -> str:
    """"yes", or the windows that differ from B=1's with how many of their first differences are near-ties."""
    if row["tokens_identical_to_B1"]:
        return "yes"
    flips = row["differing_windows"]
    return (f"{row['windows'] - len(flips)}/{row['windows']} windows; {len(flips) - row['decisive_flips']} near-tie, "
            f"{row['decisive_flips']} decisive")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", default=str(ROOT / "out" / "demo" / "cohere-tiny-synth-fp16"),
                        help="bundle folder with a batched decoder step (decoder.batch.size 4)")
    parser.add_argument("--backend", default="auto", choices=("auto", "coreml", "mil"))
    parser.add_argument("--data", default=str(ROOT / "tests" / "data" / "heldout"), help="folder of en_*.flac clips")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, alternated")
    parser.add_argument("--vad", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--work", default=str(ROOT / "out" / "longform"), help="where the long clip is written")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    manifest = json.loads((Path(args.bundle) / "manifest.json").read_text())
    if int(((manifest.get("decoder") or {}).get("batch") or {}).get("size") or 1) != 4:
        parser.error(f"{args.bundle}: its decoder has no batched step of 4 rows (re-export: make demo)")
    clip = build_clip(args.minutes, Path(args.work) / f"en_{args.minutes:g}min.flac", Path(args.data))
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name, (batch, ahead) in CONFIGS.items():
            r = run_one(args.bundle, clip, batch, ahead, args.backend, args.vad)
            runs[name].append(r)
            print(f"run {repeat + 1}/{args.repeats} {name}: {r['wall_s']:.2f} s", file=sys.stderr, flush=True)
    reference = [w["tokens"] for w in runs["B=1"][0]["windows"]]
    rows = {name: summary(r, reference) for name, r in runs.items()}
    for name, r in runs.items():
        flips = judge(args.bundle, clip, args.backend, args.vad, differing(r, reference))
        rows[name]["differing_windows"] = flips
        rows[name]["decisive_flips"] = sum(not f["near_tie"] for f in flips)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    audio_s = runs["B=1"][0]["audio_s"]
    print(f"{audio_s / 60:.1f}-minute clip, {rows['B=1']['windows']} windows, {rows['B=1']['tokens']} tokens; "
          f"median of {args.repeats} run(s) per row, rows alternated")
    print("| decoding | whole file s (runs) | RTFx whole | RTFx VAD / front end / encoder / decoder | encoder wait s | "
          "tokens/s decoder / whole | peak RSS MB | tokens = B=1's |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        st = r["stage_rtfx"]
        wait = "-" if r["encoder_wait_s"] is None else f"{r['encoder_wait_s']:.2f}"
        print(f"| {name} | {statistics.median(r['wall_s']):.2f} ({', '.join(f'{w:.2f}' for w in r['wall_s'])}) | "
              f"{r['rtfx']:.1f} | {' / '.join(f'{st[k]:.0f}' if st[k] else '-' for k in st)} | {wait} | "
              f"{r['tokens_per_s_decoder']:.0f} / {r['tokens_per_s_whole']:.0f} | {r['peak_rss_mb']:.0f} | "
              f"{identical_cell(r)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
