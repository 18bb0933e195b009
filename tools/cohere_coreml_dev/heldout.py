"""The robustness held-out set (issue 30): single utterances, the same padded, the same joined.

Three subsets, each a manifest folder (`datasets.load_folder`, `bench --data`, `eval_tiny.py --data`):

    single/   held-out sentences, one per clip (synth recipe "varied" with `single`: voice variants
              never trained on, level -30..0 dBFS, 10-40 dB SNR, 0-0.4 s edges); synthesised
    padded/   each single clip with 0-2 s more silence before and after (PAD_S): digital zeros on half
              the clips, on the others noise at the clip's own noise floor (the std of its leading edge)
    multi/    the single clips of a language joined 2-4 at a time (MULTI_SIZES) with 0.3-2.0 s pauses
              (PAUSE_S) of the same filler; text: the sentences joined by a space

padded/ and multi/ are derived from single/ alone (`derive_padded`, `derive_multi`, seeded), so the three
hold the same utterances and only single/ need be stored; every clip's manifest row names its sources
and where each sentence is spoken (`segments`, [start, end) samples).

A validation set, for choosing among candidate models without choosing on the held-out (test) set, is
made the same way with another seed and `apart_from` the test set's single/ folder: its sentences are
held-out sentences too (never trained on), none of them the test set's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import soundfile as sf

from cohere_coreml.storage.files import write_text_atomic

from .synth import SAMPLE_RATE, VARIED_HELDOUT_VARIANTS, SynthError, make_corpus

SUBSETS = ("single", "padded", "multi")
PAD_S = (0.0, 2.0)
PAUSE_S = (0.3, 2.0)
MULTI_SIZES = (2, 3, 4)
DIGITAL_SHARE = 0.5


def missing_subsets(folder: str | Path) -> list[str]:
    """The SUBSETS a robustness set's folder lacks (no <subset>/manifest.json)."""
    return [name for name in SUBSETS if not (Path(folder) / name / "manifest.json").is_file()]


def sentences_of(single_dir: Path) -> frozenset[str]:
    """Every sentence of a single/ folder's manifest (SynthError naming the folder when it has none readable)."""
    try:
        _, utts = _read(Path(single_dir))
        return frozenset(s for u in utts for s in u.get("sentences") or [u["text"]])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SynthError(f"{single_dir}: not a single/ folder with a readable manifest.json ({exc!r})") from None


def make_single(out_dir: Path, languages: list[str], per_language: int, seed: int = 0, workers: int = 1,
                apart_from: list[Path] = ()) -> list:
    """single/: the synthesised base subset; none of its sentences is one of the `apart_from` folders'."""
    exclude = frozenset().union(*(sentences_of(d) for d in apart_from))
    extra = {"apart_from": [str(d) for d in apart_from]} if apart_from else None
    return make_corpus(out_dir, languages, per_language, split="heldout", seed=seed, recipe="varied", single=True,
                       workers=workers, exclude=exclude, manifest_extra=extra)


def make_single_seeds(out_dir: Path, languages: list[str], per_language: int, seeds: list[int], workers: int = 1,
                      apart_from: list[Path] = ()) -> list[dict]:
    """single/ as several seeds' single/ sets in one (a larger evaluation set than the grammar's held-out
    sentences allow distinct: a sentence may recur across seeds, each time with another voice, level and
    noise): each seed's set synthesised by `make_single` in a folder of its own under out_dir, its clips
    moved to out_dir as s<seed>_<file>, their rows in one manifest (`seeds`), written last."""
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise SynthError(f"several seeds, each once, make a set of several seeds (got {seeds})")
    out_dir = Path(out_dir)
    rows, first = [], None
    for seed in seeds:
        part = out_dir / f".seed-{seed}"
        if not (part / "manifest.json").is_file():  # a part already made by an interrupted run is kept
            make_single(part, languages, per_language, seed=seed, workers=workers, apart_from=list(apart_from))
        manifest, utts = _read(part)
        first = first or manifest
        for u in utts:
            name = f"s{seed}_{u['file']}"
            if (part / u["file"]).is_file():
                os.replace(part / u["file"], out_dir / name)
            elif not (out_dir / name).is_file():
                raise SynthError(f"{part / u['file']} is missing: remove {part} to synthesise that seed's set again")
            rows.append({**u, "file": name})
    manifest = {**{k: v for k, v in first.items() if k not in ("utterances", "seed")}, "seeds": list(seeds),
                "utterances": rows}
    write_text_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    for seed in seeds:
        part = out_dir / f".seed-{seed}"
        (part / "manifest.json").unlink()
        part.rmdir()
    return rows


def _read(directory: Path) -> tuple[dict, list[dict]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    return manifest, manifest["utterances"]


def _write_clip(path: Path, wav: np.ndarray) -> float:
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    sf.write(str(tmp), np.clip(wav, -1.0, 1.0), SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    os.replace(tmp, path)
    return round(wav.size / SAMPLE_RATE, 3)


def _write_manifest(out_dir: Path, source: dict, subset: str, rows: list[dict], seed: int) -> None:
    manifest = {**{k: v for k, v in source.items() if k != "utterances"}, "subset": subset, "derived_from": "single",
                "derive_seed": seed, "utterances": rows}
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out_dir / "manifest.json")


def noise_floor(wav: np.ndarray, segments: list[list[int]]) -> float:
    """The std of the clip before its first sentence (0.0 for digital zeros or no edge)."""
    lead = wav[: segments[0][0]]
    return float(np.std(lead)) if lead.size else 0.0


def _filler(n: int, std: float, rng: np.random.Generator) -> np.ndarray:
    return (rng.normal(0.0, std, n) if std > 0 else np.zeros(n)).astype(np.float32)


def derive_padded(single_dir: Path, out_dir: Path, seed: int = 0) -> list[dict]:
    """padded/: every single clip with uniform(PAD_S) seconds added before and after."""
    source, utts = _read(single_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 1])
    rows = []
    for u in utts:
        wav, _ = sf.read(str(single_dir / u["file"]), dtype="float32")
        lead, trail = (int(round(rng.uniform(*PAD_S) * SAMPLE_RATE)) for _ in range(2))
        std = 0.0 if rng.random() < DIGITAL_SHARE else noise_floor(wav, u["segments"])
        clip = np.concatenate([_filler(lead, std, rng), wav, _filler(trail, std, rng)])
        name = u["file"].replace("_single_", "_padded_")
        rows.append({**u, "file": name, "seconds": _write_clip(out_dir / name, clip), "sources": [u["file"]],
                     "segments": [[a + lead, b + lead] for a, b in u["segments"]],
                     "padding_s": [round(lead / SAMPLE_RATE, 3), round(trail / SAMPLE_RATE, 3)],
                     "padding_samples": [lead, trail],
                     "filler_std": round(std, 6)})
    _write_manifest(out_dir, source, "padded", rows, seed)
    return rows


def derive_multi(single_dir: Path, out_dir: Path, seed: int = 0) -> list[dict]:
    """multi/: per language, the single clips in a seeded order joined 2-4 at a time with pauses."""
    source, utts = _read(single_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 2])
    rows = []
    for language in sorted({u["language"] for u in utts}):
        pool = [u for u in utts if u["language"] == language]
        order = [pool[i] for i in rng.permutation(len(pool))]
        index = 0
        while order:
            k = int(rng.choice(MULTI_SIZES))
            group, order = order[:k], order[k:]
            std = 0.0 if rng.random() < DIGITAL_SHARE else None
            pieces, segments, pos = [], [], 0
            for j, u in enumerate(group):
                wav, _ = sf.read(str(single_dir / u["file"]), dtype="float32")
                if j:
                    floor = std if std is not None else noise_floor(wav, u["segments"])
                    pieces.append(_filler(int(round(rng.uniform(*PAUSE_S) * SAMPLE_RATE)), floor, rng))
                    pos += pieces[-1].size
                segments += [[a + pos, b + pos] for a, b in u["segments"]]
                pieces.append(wav)
                pos += wav.size
            name = f"{language}_heldout_multi_{index:05d}.flac"
            index += 1
            sentences = [s for u in group for s in u.get("sentences") or [u["text"]]]
            rows.append({"file": name, "language": language, "text": " ".join(u["text"] for u in group),
                         "voice": ",".join(u["voice"] for u in group), "speed": group[0]["speed"],
                         "pitch": group[0]["pitch"], "seconds": _write_clip(out_dir / name, np.concatenate(pieces)),
                         "sentences": sentences, "segments": segments, "sources": [u["file"] for u in group]})
    _write_manifest(out_dir, source, "multi", rows, seed)
    return rows


def check_single(single_dir: Path, train_sentences: set[str] | frozenset[str], min_per_language: int = 200,
                 apart_from: dict[str, frozenset[str]] | None = None) -> list[str]:
    """What is wrong with a single/ folder as a held-out set (empty when nothing): fewer than
    `min_per_language` clips of a language, a file missing or not 16 kHz mono of the manifest's length,
    a segment outside its clip, a duplicate sentence, a voice variant the training recipe uses, a
    sentence of `train_sentences` (the training corpus's, e.g. from `synth.plan_corpus`), or one of a
    set it must be apart from (`apart_from`: name -> its sentences, e.g. the test set for a validation set)."""
    single_dir = Path(single_dir)
    _, utts = _read(single_dir)
    problems = []
    counts: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for u in utts:
        counts[u["language"]] = counts.get(u["language"], 0) + 1
        path = single_dir / u["file"]
        if not path.is_file():
            problems.append(f"{u['file']}: missing")
            continue
        info = sf.info(str(path))
        if info.samplerate != SAMPLE_RATE or info.channels != 1 or abs(info.frames / SAMPLE_RATE - u["seconds"]) > 1e-3:
            problems.append(f"{u['file']}: {info.samplerate} Hz, {info.channels} channel(s), {info.frames} samples "
                            f"(manifest: {u['seconds']} s at {SAMPLE_RATE} Hz mono)")
        if any(not 0 <= a < b <= info.frames for a, b in u["segments"]):
            problems.append(f"{u['file']}: segment {u['segments']} outside its {info.frames} samples")
        variant = u["voice"].split("+")[-1]
        if variant not in VARIED_HELDOUT_VARIANTS:
            problems.append(f"{u['file']}: voice variant {variant!r} is trained on")
        for sentence in u.get("sentences") or [u["text"]]:
            if (u["language"], sentence) in seen:
                problems.append(f"{u['file']}: duplicate sentence {sentence!r}")
            seen.add((u["language"], sentence))
            if sentence in train_sentences:
                problems.append(f"{u['file']}: sentence {sentence!r} occurs in training")
            for name, other in (apart_from or {}).items():
                if sentence in other:
                    problems.append(f"{u['file']}: sentence {sentence!r} occurs in {name}")
    problems += [f"{lang}: {n} clips, fewer than {min_per_language}" for lang, n in sorted(counts.items())
                 if n < min_per_language]
    return problems


def make_heldout_set(out_dir: Path, languages: list[str], per_language: int, seed: int = 0, workers: int = 1,
                     single_dir: Path | None = None, apart_from: list[Path] = (),
                     seeds: list[int] | None = None) -> dict[str, Path]:
    """single/ (synthesised unless `single_dir` names an existing one; from several `seeds`' sets in one when
    given, `seed` then seeding the derivations alone), padded/, multi/ under out_dir. With
    `single_dir` elsewhere, out_dir/single is a link to it, so that out_dir holds the whole set (what
    `train_tiny.py --robustness` and the evaluations read). `apart_from`: single/ folders whose sentences a
    synthesised single/ must not use (a validation set apart from the test set); an existing single/
    (`single_dir`, or one already under out_dir) is checked against them before anything is written."""
    out_dir = Path(out_dir)
    others = {}
    for other in apart_from:
        if not (Path(other) / "manifest.json").is_file():
            raise SynthError(f"no manifest.json in {other} (the set to keep apart from must be a single/ folder)")
        others[other] = sentences_of(other)  # readable, before anything is written
    single = Path(single_dir) if single_dir else out_dir / "single"
    if others and (single / "manifest.json").is_file():  # an existing single/: checked before anything is written
        mine = sentences_of(single)
        for other, theirs in others.items():
            shared = sorted(mine & theirs)
            if shared:
                raise SynthError(f"{single} shares {len(shared)} sentence(s) with {other} (e.g. {shared[0]!r}): "
                                 "it is not apart from it")
    link = out_dir / "single"
    if single_dir and link.absolute() != single.absolute():
        if link.exists() and not link.is_symlink():
            raise SynthError(f"{link} exists and is not a link to {single}: remove it, or derive into another --out")
        out_dir.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(single.resolve(), target_is_directory=True)
    if not (single / "manifest.json").is_file() and seeds:
        make_single_seeds(single, languages, per_language, seeds, workers=workers, apart_from=list(apart_from))
    elif not (single / "manifest.json").is_file():
        make_single(single, languages, per_language, seed=seed, workers=workers, apart_from=list(apart_from))
    derive_padded(single, out_dir / "padded", seed=seed)
    derive_multi(single, out_dir / "multi", seed=seed)
    return {"single": single, "padded": out_dir / "padded", "multi": out_dir / "multi"}
