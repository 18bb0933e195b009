"""Print how far `cohere_coreml.model.audio.log_mel` is from `CohereAsrFeatureExtractor` on audio files.

    uv run python tools/parity/frontend_parity.py [AUDIO ...]      # default: every clip in tests/data/audio

For each clip (long clips: each piece of `split_long_audio`): valid frames of both, max absolute
difference on valid frames, and whether padding frames are zero in both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cohere_coreml.model.audio import AudioError, FrontEndConfig, load_audio, log_mel, split_long_audio


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("audio", nargs="*", help="audio files (default: tests/data/audio/*)")
    parser.add_argument("--dither", type=float, default=0.0, help="dither of both front ends (default 0)")
    args = parser.parse_args(argv)
    from transformers import CohereAsrFeatureExtractor

    audio_dir = Path(__file__).resolve().parents[2] / "tests" / "data" / "audio"
    files = [Path(a) for a in args.audio] or sorted(p for p in audio_dir.iterdir() if p.suffix in {".wav", ".flac", ".mp3"})
    fe = CohereAsrFeatureExtractor(dither=args.dither)
    config = FrontEndConfig.from_feature_extractor(fe)
    worst = 0.0
    print(f"{'clip':<28} {'piece':>5} {'frames':>7} {'valid':>6} {'ref valid':>9} {'max |diff|':>11} {'pad zero':>8}")
    for path in files:
        try:
            wav = load_audio(path)
        except AudioError as e:  # a missing or unreadable file: one line, no traceback
            print(f"frontend_parity: {e}", file=sys.stderr)
            return 1
        pieces = split_long_audio(wav, config)
        ref = fe(wav, sampling_rate=config.sampling_rate, return_tensors="np", return_attention_mask=True)
        for i, piece in enumerate(pieces):
            ours, n_valid = log_mel(piece, config)
            ref_feats = ref["input_features"][i].T
            ref_valid = int(ref["attention_mask"][i].sum())
            diff = float(np.abs(ours[:, :n_valid] - ref_feats[:, :n_valid]).max())
            pad_zero = not ours[:, n_valid:].any() and not ref_feats[:, ref_valid:].any()
            worst = max(worst, diff)
            print(f"{path.name:<28} {i:>5} {ours.shape[1]:>7} {n_valid:>6} {ref_valid:>9} {diff:>11.2e} {str(pad_zero):>8}")
    print(f"worst max |diff| on valid frames: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
