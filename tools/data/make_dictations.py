#!/usr/bin/env python
"""Dictations for the streaming bench: held-out utterances joined with pauses, times known exactly.

Every held-out clip (tests/data/heldout, `tools/data/make_synthetic_speech.py --split heldout`) is
espeak-ng speech with leading and trailing silence and white noise (`cohere_coreml_dev.synth._augment`:
lead, trail = uniform(0.05, 0.4) s, the first two draws of the clip's seeded generator). Rebuilding
the clip's synthesis plan (`plan_corpus`, same seed and split) gives those two lengths exactly, so the
clip's speech is samples [lead, n - trail]. A dictation is the speech of `--per-dictation` utterances
of one language, in manifest order, with pauses of uniform(--min-pause, --max-pause) s between them
(1 s before the first, 1.5 s after the last). One background noise runs through the whole dictation:
white noise at the level of the group's noisiest clip (each clip's own noise measured on its lead and
trail), added to pauses and speech alike, so the noise floor is as stationary as in one recording
(a clip's own noise adds at most 3 dB to it) instead of jumping by the clips' 15-40 dB SNR spread.
`--match-levels` first scales each utterance (its speech and the noise in it) to the group's median
speech RMS: one speaker at one level, as in a real dictation. Needed when the held-out set varies the
level on purpose (the robustness set: -30..0 dBFS, 10-40 dB SNR): without it a -30 dBFS utterance
lies 20 dB or more under the background of a loud, noisy neighbour, far below its own clip's SNR.
The 75 s clip (tests/data/audio/en_long_75s.flac) is listed too, with its reference text and no
utterance times.

Writes <out>/<language>_dictation_<i>.flac and <out>/manifest.json:
  {"dictations": [{"file", "language", "seconds", "text", "utterances": [{"id", "file", "text", "start", "end",
   "start_sample", "end_sample", "gain_db", "clip_edges": [lead, trail] samples of its own clip}] | null}]}

Example:
  uv run --frozen python tools/data/make_dictations.py --out out/dictations
  uv run --frozen python tools/data/make_dictations.py --heldout tests/data/heldout-varied/single --match-levels \\
      --min-pause 0.8 --max-pause 1.6 --out out/dictations-varied
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from cohere_coreml.evaluation.datasets import load_folder
from cohere_coreml.model.audio import load_audio

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohere_coreml_dev.synth import SAMPLE_RATE, plan_corpus  # noqa: E402

logger = logging.getLogger("make_dictations")

ROOT = Path(__file__).resolve().parents[2]
HELDOUT_DIR = ROOT / "tests" / "data" / "heldout"
LONG_CLIP = ROOT / "tests" / "data" / "audio" / "en_long_75s.flac"
LEAD_PAUSE_S = 1.0
TRAIL_PAUSE_S = 1.5
# synth._augment: leading/trailing silence drawn as uniform(LEAD_RANGE) seconds (lead first, then trail)
LEAD_RANGE = (0.05, 0.4)


def speech_bounds(heldout_dir: Path = HELDOUT_DIR) -> dict[str, tuple[int, int]]:
    """{file name: (lead, trail) samples} of every held-out clip: from its manifest's `segments` (the
    robustness set, tools/data/make_heldout_set.py), else from its synthesis plan."""
    manifest = json.loads((heldout_dir / "manifest.json").read_text())
    if all("segments" in u for u in manifest["utterances"]):
        out = {}
        for u in manifest["utterances"]:
            n = sf.info(str(heldout_dir / u["file"])).frames
            out[u["file"]] = (u["segments"][0][0], n - u["segments"][-1][1])
        return out
    languages = manifest["languages"]
    counts = {lang: sum(u["language"] == lang for u in manifest["utterances"]) for lang in languages}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"held-out set is not balanced across languages ({counts}): cannot rebuild its plan")
    jobs = plan_corpus(languages, next(iter(counts.values())), split=manifest["split"], seed=manifest["seed"],
                       heldout_percent=manifest["heldout_percent"])
    by_id = {j["id"]: j for j in jobs}
    bounds = {}
    for u in manifest["utterances"]:
        job = by_id.get(Path(u["file"]).stem)
        if job is None or job["text"] != u["text"]:
            raise SystemExit(f"{u['file']}: its synthesis plan does not match the manifest (another seed or split?)")
        rng = np.random.default_rng(job["seed"])
        lead = int(SAMPLE_RATE * rng.uniform(*LEAD_RANGE))
        trail = int(SAMPLE_RATE * rng.uniform(*LEAD_RANGE))
        bounds[u["file"]] = (lead, trail)
    return bounds


def heldout_speech(heldout_dir: Path = HELDOUT_DIR) -> list[dict]:
    """Held-out clips with their speech: {"id", "language", "text", "speech", "noise_std", "wav", "lead", "trail"}."""
    bounds = speech_bounds(heldout_dir)
    out = []
    for clip in load_folder(heldout_dir).clips:
        wav = load_audio(clip.audio, target_rate=SAMPLE_RATE)
        lead, trail = bounds[clip.audio.name]
        noise = np.concatenate([wav[:lead], wav[wav.size - trail:]])
        out.append({"id": clip.id, "language": clip.language, "text": clip.text, "wav": wav, "wav_path": str(clip.audio),
                    "lead": lead, "trail": trail, "speech": wav[lead: wav.size - trail],
                    "noise_std": float(np.std(noise)) if noise.size else 0.0})
    return out


def level_gains(group: list[dict]) -> list[float]:
    """Per clip, the gain that brings its speech RMS to the group's median (`--match-levels`)."""
    rms = [float(np.sqrt(np.mean(np.square(c["speech"], dtype=np.float64)))) for c in group]
    if min(rms) <= 0.0:
        silent = next(c["id"] for c, r in zip(group, rms) if r <= 0.0)
        raise SystemExit(f"{silent}: its speech is digital silence, no level to match")
    target = float(np.median(rms))
    return [target / r for r in rms]


def make_dictations(out_dir: Path, per_dictation: int = 15, min_pause: float = 0.3, max_pause: float = 2.0,
                    seed: int = 0, heldout_dir: Path = HELDOUT_DIR, match_levels: bool = False) -> list[dict]:
    if not 10 <= per_dictation <= 20:
        raise SystemExit(f"--per-dictation must be 10-20 utterances, got {per_dictation}")
    if not 0 < min_pause <= max_pause:
        raise SystemExit(f"pauses must satisfy 0 < min <= max, got {min_pause}, {max_pause}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    clips = heldout_speech(heldout_dir)
    entries = []
    for language in sorted({c["language"] for c in clips}):
        mine = [c for c in clips if c["language"] == language]
        for d in range(len(mine) // per_dictation):
            group = mine[d * per_dictation: (d + 1) * per_dictation]
            pieces, utterances, pos = [], [], 0

            def pause(seconds: float) -> None:
                nonlocal pos
                n = int(round(seconds * SAMPLE_RATE))
                pieces.append(np.zeros(n, dtype=np.float32))
                pos += n

            gains = level_gains(group) if match_levels else [1.0] * len(group)
            pause(LEAD_PAUSE_S)
            for i, (clip, gain) in enumerate(zip(group, gains)):
                utterances.append({"id": clip["id"], "file": Path(clip["wav_path"]).name, "text": clip["text"],
                                   "start": pos / SAMPLE_RATE,
                                   "end": (pos + clip["speech"].size) / SAMPLE_RATE,
                                   "start_sample": pos, "end_sample": pos + clip["speech"].size,
                                   "gain_db": round(20 * float(np.log10(gain)), 3),
                                   # its own clip's silence before and after the speech (samples): the bench
                                   # cuts the utterance from the dictation with these edges to compare
                                   "clip_edges": [int(clip["lead"]), int(clip["trail"])]})
                pieces.append((clip["speech"] * gain).astype(np.float32))
                pos += clip["speech"].size
                pause(TRAIL_PAUSE_S if i == len(group) - 1 else float(rng.uniform(min_pause, max_pause)))
            wav = np.concatenate(pieces)
            if np.abs(wav).max() > 1.0:
                logger.warning("%s_dictation_%d: %d samples clipped after level matching", language, d,
                               int(np.sum(np.abs(wav) > 1.0)))
            background = max(c["noise_std"] * g for c, g in zip(group, gains))
            wav = np.clip(wav + rng.normal(0.0, background, wav.size).astype(np.float32), -1.0, 1.0)
            name = f"{language}_dictation_{d}.flac"
            sf.write(out_dir / name, wav, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
            entries.append({"file": name, "language": language, "seconds": wav.size / SAMPLE_RATE,
                            "text": " ".join(u["text"] for u in utterances), "utterances": utterances})
            logger.info("%s: %d utterances, %.1f s", name, len(utterances), wav.size / SAMPLE_RATE)
    long_text = next(e["text"] for e in json.loads((LONG_CLIP.parent / "manifest.json").read_text())["clips"]
                     if e["file"] == LONG_CLIP.name)
    long_wav = load_audio(LONG_CLIP, target_rate=SAMPLE_RATE)
    sf.write(out_dir / LONG_CLIP.name, long_wav, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    entries.append({"file": LONG_CLIP.name, "language": "en", "seconds": long_wav.size / SAMPLE_RATE,
                    "text": long_text, "utterances": None})
    manifest = {"sample_rate": SAMPLE_RATE, "seed": seed, "pauses_s": [min_pause, max_pause], "match_levels": match_levels,
                "heldout_dir": str(Path(heldout_dir).resolve()), "dictations": entries}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/dictations", help="output folder (default: %(default)s)")
    parser.add_argument("--per-dictation", type=int, default=15, help="utterances per dictation, 10-20")
    parser.add_argument("--min-pause", type=float, default=0.3)
    parser.add_argument("--max-pause", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", default=str(HELDOUT_DIR),
                        help="held-out folder whose utterances are joined (default: the 90-clip set; or a subset of "
                             "tools/data/make_heldout_set.py, e.g. tests/data/heldout-varied/single)")
    parser.add_argument("--match-levels", action="store_true",
                        help="scale each utterance to the dictation's median speech level (one speaker, one level; "
                             "for held-out sets that vary the level, as the robustness set does)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    entries = make_dictations(Path(args.out), args.per_dictation, args.min_pause, args.max_pause, args.seed,
                              heldout_dir=Path(args.heldout), match_levels=args.match_levels)
    print(f"{len(entries)} dictations -> {args.out}/manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
