"""Reference data for the Swift package's tests (swift/Tests), computed by the Python pipeline.

Run by `make swift-fixtures` (and so by `make swift-test` / `make test`) through
tools/data/make_swift_fixtures.py. Writes into one folder (default out/swift-fixtures):

    bundle/                  `cohere-coreml export` of the default model (--prefill --extend --buckets 10, the
                             default components: front end, encoder, decoder, VAD). Packages already there
                             are kept (the export skips them) unless the bundle is of an older format
                             (then all are re-exported); the manifest is rewritten from disk.
    bundle-<state>/          the same bundle with the other decoder state variant (--decoder-state; the
                             encoder, front end and VAD are bundle/'s, hard-linked)
    bundle-parts/            the same bundle with its encoder in 2 parts (--encoder-parts 2; the decoder,
                             front end and VAD are bundle/'s, hard-linked); transcripts_parts.json: what the CLI
                             prints for it (Python front end, as transcripts_python.json)
    tokens_bundle.json       token lists -> Python's `decode_ids` text (every list the Python tests
    tokens_tiny.json         decode, the trained model's transcripts, CJK byte fallback, random ids) for
                             the bundle's vocab.json and the tiny test checkpoint's (tiny_vocab.json)
    joins.json               window texts -> `join_windows`
    wav/, audio.json         16 kHz WAVs of the demo and held-out clips (FLAC converted losslessly), WAV
                             format variants with their `load_audio` samples, `split_points` per clip
    transcripts_<fe>.json    per clip and window, what `cohere-coreml transcribe --json --front-end <fe>`
                             prints for the WAV (fe = package: frontend.mlpackage; python: audio.log_mel);
                             the python file also holds each window's log-mel features (features/*.f32,
                             float32 (n_mels, frames) C order) for the Swift loop given Python's features
    stream/, streaming.json  a short dictation (STREAM_UTTERANCES held-out utterances joined with pauses
                             and background noise, as tools/data/make_dictations.py makes them; float32 WAV)
                             and the updates of `cohere-coreml transcribe --stream --no-pace --json --stats`
                             (0.1 s chunks, package front end, interpreter) for it, with its stats line
                             (the compute counters, stderr) and the counters without extend (--no-extend)
    words_package.json       when the bundle has alignment (manifest decoder.alignment): per demo clip and the
                             first held-out clip of each language, the words of `cohere-coreml transcribe --json
                             --word-timestamps --front-end package` (the Swift words must be the same)
    vad/, vad_regions.json   when the bundle has a VAD (manifest vad): per demo clip shorter than the window and a
                             sparse clip made of two of them with VAD_PAUSE_S of quiet between (vad/sparse.wav,
                             float32), the probabilities of vad.mlpackage's block function on the MIL interpreter
                             (`inference.vad.PackageVad`) and the speech regions silero-vad's own rule gives for
                             them (the Swift transcriber's must be the same); the sparse clip's windows as
                             `cohere-coreml transcribe --json --vad on --front-end package` prints them. The
                             other transcript references are made with --vad off (the energy windows)
    compiled_names.json      per package of bundle/, the name the Python Core ML backend's compiled-model
                             cache gives it (`CompiledCache.location`): the Swift `CoreMLRuntime` must agree
    READY                    written last

Each file is written to a temporary name and renamed. Transcripts made from the same packages (the
manifest's checksums) by the same product code are kept, so re-runs cost about a minute.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf

logger = logging.getLogger(__name__)

FRONT_ENDS = ("package", "python")
# what an app ships: a short-clip bucket, prompt prefill, extend (forced prefixes in one call)
EXPORT_ARGS = ("--prefill", "--extend", "--buckets", "10")
# the VAD fixture's sparse clip: two demo clips with this much quiet noise between (longer than the 2 s gap a
# speech window bridges), and its seed
VAD_PAUSE_S = 3.0
VAD_SEED = 0
# the streaming fixture: a dictation of this many held-out utterances of STREAM_LANGUAGE (~8-10 s)
STREAM_LANGUAGE = "en"
STREAM_UTTERANCES = 3
STREAM_SEED = 0
# the test bundle's encoder in this many programs (bundle-parts/)
PARTS = 2


class FixtureError(RuntimeError):
    """The Python side produced something the Swift tests cannot use."""


def _tmp_name(path: Path) -> Path:
    # one temporary name per writer: the fixture jobs run on two threads and two of them write the same
    # feature files (the test bundle's and bundle-parts' Python front end give the same features)
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def _write_json(path: Path, data) -> None:
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cohere_coreml.cli", *args]


def _env(threads: int) -> dict:
    # one or two torch threads: the box (and a CI runner) is shared with the Swift build
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def model_digest(model: Path) -> str:
    """The checkpoint's digest (`checkpoint.checkpoint_digest`): part of the test bundle's stamp, so that
    the fixtures of a retrained model are not made from packages of the old one."""
    from cohere_coreml.model.checkpoint import checkpoint_digest

    return checkpoint_digest(model)


def export_bundle(out: Path, model: Path, threads: int) -> Path:
    """The test bundle: exported once, then only missing components are added (the export skips the
    packages present that the same checkpoint made) and the manifest is rewritten from the packages on disk."""
    from cohere_coreml.bundle.format import FORMAT_VERSION

    bundle = out / "bundle"
    manifest = bundle / "manifest.json"
    # the export arguments and the checkpoint the packages were made from, beside the bundle (not a bundle file)
    stamp = out / "bundle.export-args.json"
    want = {"args": list(EXPORT_ARGS), "model": model_digest(model)}
    # packages of an older bundle format (e.g. format 1's decoder without bind_memory), exported with other
    # arguments (e.g. a decoder from before --extend: the export keeps packages present) or from other
    # weights (a retrained default model) are re-exported
    stale = manifest.is_file() and (json.loads(manifest.read_text()).get("format_version") != FORMAT_VERSION
                                    or not stamp.is_file() or json.loads(stamp.read_text()) != want)
    cmd = _cli("export", "--model", str(model), "--out", str(bundle), *EXPORT_ARGS, *(["--force"] if stale else []))
    logger.info("test bundle%s: %s", " (re-exported: other format, arguments or weights)" if stale else "", " ".join(cmd))
    subprocess.run(cmd, check=True, env=_env(threads), stdout=subprocess.DEVNULL)
    if not (bundle / "manifest.json").is_file():
        raise FixtureError(f"the export wrote no manifest in {bundle}")
    stamp.write_text(json.dumps(want))
    return bundle


def export_variant_bundle(out: Path, bundle: Path, model: Path, threads: int, name: str, args: list[str],
                          kept: tuple[str, ...]) -> Path:
    """out/<name>/: the test bundle exported with more `args`, the packages (components) `kept` being the
    test bundle's (hard links, with their gate reports: the export skips them). Re-exported when the
    args, the kept packages' checksums or the bundle format changed."""
    import shutil

    from cohere_coreml.bundle.format import FORMAT_VERSION

    variant = out / name
    manifest = variant / "manifest.json"
    stamp = out / f"{name}.export-args.json"
    main_stamp = json.loads((bundle / "manifest.json").read_text()).get("checksums", {}).get("files", {})
    want = {"args": args, "packages": {k: v for k, v in sorted(main_stamp.items())
                                       if k.startswith(tuple(f"{c}.mlpackage/" for c in kept))}}
    fresh = (manifest.is_file() and json.loads(manifest.read_text()).get("format_version") == FORMAT_VERSION
             and stamp.is_file() and json.loads(stamp.read_text()) == want)
    if not fresh:
        shutil.rmtree(variant, ignore_errors=True)
        variant.mkdir(parents=True)
        for component in kept:
            shutil.copytree(bundle / f"{component}.mlpackage", variant / f"{component}.mlpackage",
                            copy_function=os.link)
            if (bundle / f"{component}.parity.json").is_file():
                os.link(bundle / f"{component}.parity.json", variant / f"{component}.parity.json")
        cmd = _cli("export", "--model", str(model), "--out", str(variant), *args)
        logger.info("test bundle %s: %s", name, " ".join(cmd))
        subprocess.run(cmd, check=True, env=_env(threads), stdout=subprocess.DEVNULL)
        stamp.write_text(json.dumps(want))
    return variant


def export_other_decoder_bundle(out: Path, bundle: Path, model: Path, threads: int) -> Path:
    """bundle-<state>/: the test bundle with the other decoder state variant (`--decoder-state`; the test
    bundle has the default one): its front end and encoder are the test bundle's (hard links), its decoder
    is exported with the other variant, so both decoders decode the same encoder outputs."""
    from cohere_coreml.config import DECODER_STATE_DEFAULT, DECODER_STATE_GRAPH, DECODER_STATE_HOST

    state = DECODER_STATE_GRAPH if DECODER_STATE_DEFAULT == DECODER_STATE_HOST else DECODER_STATE_HOST
    other = export_variant_bundle(out, bundle, model, threads, f"bundle-{state}",
                                  [*EXPORT_ARGS, "--decoder-state", state], kept=("encoder", "frontend", "vad"))
    got = json.loads((other / "manifest.json").read_text())["decoder"].get("state_writes")
    if got != state:
        raise FixtureError(f"{other}: the decoder's state_writes is {got!r}, not {state!r}")
    return other


def export_parts_bundle(out: Path, bundle: Path, model: Path, threads: int) -> Path:
    """bundle-parts/: the test bundle with its encoder in PARTS programs (`--encoder-parts`): the front end
    and decoder are the test bundle's (hard links), the encoder exported in parts."""
    parts = export_variant_bundle(out, bundle, model, threads, "bundle-parts",
                                  [*EXPORT_ARGS, "--encoder-parts", str(PARTS)],
                                  kept=("decoder", "frontend", "vad"))
    got = len(json.loads((parts / "manifest.json").read_text())["encoder"]["parts"])
    if got != PARTS:
        raise FixtureError(f"{parts}: its encoder has {got} parts, not {PARTS}")
    return parts


def reference_key(bundle: Path) -> str:
    """sha256 over the manifest's package checksums and the product's Python sources: changes whenever
    a package or the code that transcribes with it changes (then the references are recomputed)."""
    import cohere_coreml

    manifest = json.loads((bundle / "manifest.json").read_text())
    files = (manifest.get("checksums") or {}).get("files")
    if not files:
        raise FixtureError(f"{bundle}/manifest.json has no checksums: re-export it")
    digest = hashlib.sha256()
    packages = {k: v for k, v in sorted(files.items()) if ".mlpackage/" in k}
    digest.update(json.dumps(packages, sort_keys=True).encode())
    source = Path(cohere_coreml.__file__).parent
    for path in sorted(source.rglob("*.py")):
        digest.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def token_cases(bundle: Path, out: Path, root: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from cohere_coreml.model.tokens import LANGUAGES, decode_ids, export_vocab, join_windows, prompt_ids

    from .checkpoints import make_tiny_checkpoint

    texts = ["set a timer for ten minutes", "Grüße aus Köln, 12:30!", "日本語のテキストです", "你好，世界", "안녕하세요",
             "Xin chào", "turn on the lights", "  leading and trailing  ", "emoji 🎙️ and ½", "Ελληνικά και русский"]
    clips = json.loads((root / "tests/data/audio/manifest.json").read_text())["clips"]
    heldout = json.loads((root / "tests/data/heldout/manifest.json").read_text())["utterances"]
    texts += [c["text"] for c in clips if c.get("text")] + [u["text"] for u in heldout]

    tiny_dir = out / "tiny-checkpoint"
    if not (tiny_dir / "config.json").is_file():
        make_tiny_checkpoint(tiny_dir, seed=0)  # the tests' tiny_checkpoint (tests/conftest.py)
    for name, tok_dir, vocab in (("bundle", bundle, bundle / "vocab.json"),
                                 ("tiny", tiny_dir, out / "tiny_vocab.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        if name == "tiny" and not vocab.is_file():
            export_vocab(tok, vocab)
        cases = []
        for text in texts:
            body = tok.encode(text, add_special_tokens=False)
            cases.append(body)
            cases.append(prompt_ids(tok, "en") + body + [tok.eos_token_id])  # prompt and eos are skipped
        for lang in LANGUAGES:
            cases.append(prompt_ids(tok, lang, punctuation=False))  # only specials: empty text
        rng = np.random.default_rng(0)
        for _ in range(200):  # random ids, including lone or broken UTF-8 byte runs
            cases.append([int(i) for i in rng.integers(0, len(tok), size=int(rng.integers(1, 24)))])
        _write_json(out / f"tokens_{name}.json",
                    {"vocab": str(vocab), "cases": [{"ids": ids, "text": decode_ids(tok, ids)} for ids in cases]})
    joins = [(["hello there ", " world"], "en"), (["こんにちは", "世界"], "ja"), (["", "  ", "a"], "en"),
             (["你好 ", " 世界"], "zh"), (["a", "", "b "], "de"), ([], "en"), (["  "], "en")]
    _write_json(out / "joins.json", [{"texts": t, "language": lang, "text": join_windows(t, lang)} for t, lang in joins])


def audio_cases(out: Path, root: Path, demo_clips: list[tuple[str, str]]) -> list[dict]:
    """WAV copies of the demo clips (the Makefile's DEMO_CLIPS) and the held-out set, format variants."""
    import soundfile as sf

    from cohere_coreml.model.audio import FrontEndConfig, load_audio, split_points

    wav_dir = out / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    heldout = json.loads((root / "tests/data/heldout/manifest.json").read_text())["utterances"]
    clips = [(root / "tests/data/audio" / f, lang, "demo") for f, lang in demo_clips]
    clips += [(root / "tests/data/heldout" / u["file"], u["language"], "heldout") for u in heldout]
    cases = []
    config = FrontEndConfig()
    for src, lang, group in clips:
        wav = wav_dir / (src.stem + ".wav")
        if not wav.is_file():
            data, rate = sf.read(str(src), dtype="int16", always_2d=True)
            tmp = wav.with_name(wav.stem + ".tmp.wav")
            sf.write(str(tmp), data, rate, subtype="PCM_16")
            os.replace(tmp, wav)
        x = load_audio(src)
        if not np.array_equal(x, load_audio(wav)):
            raise FixtureError(f"{wav}: not a lossless copy of {src}")
        cases.append({"wav": str(wav), "source": str(src), "language": lang, "group": group, "samples": int(x.shape[0]),
                      "split_points": [list(p) for p in split_points(x, config)]})
    # format variants of one clip: Swift's WAV reader must give Python's load_audio samples
    x, rate = sf.read(str(root / "tests/data/audio/de_medium.wav"), dtype="float32")
    stereo = np.stack([x, 0.5 * x[::-1]], axis=1)
    variants = []
    for subtype, data in (("PCM_16", x), ("PCM_24", x), ("PCM_32", x), ("FLOAT", x), ("PCM_16", stereo), ("PCM_U8", x)):
        ch = 1 if data.ndim == 1 else data.shape[1]
        path = wav_dir / f"variant_{subtype.lower()}_{ch}ch.wav"
        if not path.is_file():
            tmp = path.with_name(path.stem + ".tmp.wav")
            sf.write(str(tmp), data, rate, subtype=subtype)
            os.replace(tmp, path)
        ref = path.with_suffix(".f32")
        if not ref.is_file():
            _write_bytes(ref, load_audio(path).astype("<f4").tobytes())
        variants.append({"wav": str(path), "samples_f32": str(ref), "subtype": subtype, "channels": ch})
    # unsupported: an IMA ADPCM WAV (format tag 0x11)
    adpcm = wav_dir / "unsupported_ima_adpcm.wav"
    if not adpcm.is_file():
        tmp = adpcm.with_name(adpcm.stem + ".tmp.wav")
        sf.write(str(tmp), x, rate, subtype="IMA_ADPCM")
        os.replace(tmp, adpcm)
    _write_json(out / "audio.json", {"clips": cases, "variants": variants, "unsupported": [str(adpcm)]})
    return cases


def cli_transcripts(bundle: Path, cases: list[dict], front_end: str, threads: int) -> dict[str, dict]:
    """wav -> what `cohere-coreml transcribe --json` prints for it (one process per language)."""
    # --front-end exists where front-end packages do (a bundle without one is always transcribed
    # with audio.log_mel)
    has_front_end = "frontend" in json.loads((bundle / "manifest.json").read_text())["files"]
    if front_end != "python" and not has_front_end:
        raise FixtureError(f"{bundle} has no front-end package")
    by_language: dict[str, list[str]] = {}
    for case in cases:
        by_language.setdefault(case["language"], []).append(case["wav"])
    results = {}
    for language, wavs in sorted(by_language.items()):
        cmd = _cli("transcribe", "--json", "--backend", "mil", "--vad", "off", "--bundle", str(bundle),
                   "--language", language, *(["--front-end", front_end] if has_front_end else []), *wavs)
        logger.info("python reference: cohere-coreml transcribe --front-end %s --language %s (%d files)",
                    front_end, language, len(wavs))
        proc = subprocess.run(cmd, env=_env(threads), stdout=subprocess.PIPE)
        data = json.loads(proc.stdout) if proc.stdout.strip() else []
        for item in data if isinstance(data, list) else [data]:
            if item.get("status") != "ok":  # every reference clip holds speech and must transcribe
                raise FixtureError(f"cohere-coreml transcribe: {item['audio']}: {item.get('status')} {item.get('error', '')}")
            results[item["audio"]] = item
        if proc.returncode != 0 or not all(w in results for w in wavs):
            raise FixtureError(f"cohere-coreml transcribe --language {language} failed (exit {proc.returncode})")
    return results


def transcripts(bundle: Path, out: Path, cases: list[dict], front_end: str, threads: int,
                name: str | None = None) -> dict | None:
    """transcripts_<name or front_end>.json (skipped when made from the same bundle); None without a
    front-end package for front_end="package"."""
    from cohere_coreml.model.audio import FrontEndConfig, load_audio, log_mel, pad_to_window
    from cohere_coreml.model.shapes import choose_bucket

    manifest = json.loads((bundle / "manifest.json").read_text())
    path = out / f"transcripts_{name or front_end}.json"
    if front_end == "package" and "frontend" not in manifest["files"]:
        path.unlink(missing_ok=True)
        logger.warning("the bundle has no frontend.mlpackage: no package front-end reference")
        return None
    key = reference_key(bundle)
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("reference_key") == key and len(old["clips"]) == len(cases):
            return old
    results = cli_transcripts(bundle, cases, front_end, threads)
    config = FrontEndConfig.from_dict({**manifest["audio"], "dither": 0.0})
    buckets = {fn: int(v["frames"]) for fn, v in manifest["encoder"]["functions"].items()}
    feat_dir = out / "features"
    feat_dir.mkdir(exist_ok=True)
    clips = []
    for case in cases:
        result = results[case["wav"]]
        if len(result["windows"]) != len(case["split_points"]):
            raise FixtureError(f"{case['wav']}: {len(result['windows'])} windows, split_points gives "
                               f"{len(case['split_points'])}")
        x = load_audio(case["wav"]) if front_end == "python" else None
        windows = []
        for w, (start, end) in zip(result["windows"], case["split_points"]):
            window = {"index": w["index"], "token_ids": w["token_ids"], "text": w["text"], "truncated": w["truncated"],
                      "stop_reason": w["stop_reason"], "encoder_function": w["timings"]["encoder_function"]}
            if x is not None:  # the window's features as the CLI computed them (audio.log_mel)
                feats, n_valid = log_mel(x[start:end], config)
                fn = choose_bucket(buckets, n_valid)
                if fn != window["encoder_function"]:
                    raise FixtureError(f"{case['wav']} window {w['index']}: bucket {fn}, the CLI used "
                                       f"{window['encoder_function']}")
                feats, n_valid = pad_to_window(feats, n_valid, frames=buckets[fn])
                fpath = feat_dir / f"{Path(case['wav']).stem}_{w['index']}.f32"
                _write_bytes(fpath, np.ascontiguousarray(feats, dtype="<f4").tobytes())
                window.update(features=str(fpath), frames=buckets[fn], valid_frames=int(n_valid))
            windows.append(window)
        clips.append({**case, "text": result["text"], "windows": windows})
    data = {"bundle": str(bundle), "reference_key": key, "front_end": front_end,
            "command": "cohere-coreml transcribe --json --backend mil --vad off --front-end " + front_end,
            "clips": clips}
    _write_json(path, data)
    return data


def word_timings(bundle: Path, out: Path, cases: list[dict], threads: int) -> dict | None:
    """words_package.json (skipped when made from the same bundle): the Python CLI's words per clip and window;
    None, and no file, when the bundle has no alignment or no front-end package."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    path = out / "words_package.json"
    if not manifest["decoder"].get("alignment") or "frontend" not in manifest["files"]:
        path.unlink(missing_ok=True)
        logger.warning("the bundle has no alignment (decoder.alignment) or no front end: no word-timing reference")
        return None
    key = reference_key(bundle)
    if path.is_file() and json.loads(path.read_text()).get("reference_key") == key:
        return json.loads(path.read_text())
    picked = [c for c in cases if c["group"] == "demo"]
    for language in sorted({c["language"] for c in cases}):
        picked += [next(c for c in cases if c["group"] == "heldout" and c["language"] == language)]
    clips = []
    for language in sorted({c["language"] for c in picked}):
        wavs = [c["wav"] for c in picked if c["language"] == language]
        cmd = _cli("transcribe", "--json", "--word-timestamps", "--backend", "mil", "--vad", "off",
                   "--front-end", "package", "--bundle", str(bundle), "--language", language, *wavs)
        logger.info("python words: cohere-coreml transcribe --word-timestamps --language %s (%d files)", language,
                    len(wavs))
        proc = subprocess.run(cmd, env=_env(threads), stdout=subprocess.PIPE)
        data = json.loads(proc.stdout) if proc.stdout.strip() else []
        items = {item["audio"]: item for item in (data if isinstance(data, list) else [data])}
        if proc.returncode != 0 or not all(items.get(w, {}).get("status") == "ok" for w in wavs):
            raise FixtureError(f"cohere-coreml transcribe --word-timestamps --language {language} failed "
                               f"(exit {proc.returncode})")
        clips += [{"wav": w, "language": language, "words": items[w]["words"],
                   "windows": [{"index": x["index"], "token_ids": x["token_ids"], "words": x["words"]}
                               for x in items[w]["windows"]]} for w in wavs]
    data = {"bundle": str(bundle), "reference_key": key, "clips": clips,
            "command": "cohere-coreml transcribe --json --word-timestamps --backend mil --vad off --front-end package"}
    _write_json(path, data)
    return data


def vad_regions(bundle: Path, out: Path, cases: list[dict], threads: int) -> dict | None:
    """vad_regions.json (kept when made from the same packages and code): per clip, the bundle's VAD probabilities
    and silero-vad's regions for them, and the sparse clip as `cohere-coreml transcribe --vad on` transcribes it;
    None, and no file, when the bundle has no VAD."""
    import torch

    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.inference.vad import vad_for
    from cohere_coreml.model import silero
    from cohere_coreml.model.audio import load_audio

    path = out / "vad_regions.json"
    loaded = Bundle.load(bundle)
    if loaded.vad_chunks is None:
        path.unlink(missing_ok=True)
        logger.warning("the bundle has no VAD (manifest vad): no speech-region reference")
        return None
    key = reference_key(bundle)
    if path.is_file() and json.loads(path.read_text()).get("reference_key") == key:
        return json.loads(path.read_text())
    audio = loaded.manifest["audio"]
    # the transcriber's window (Transcriber.window_s): the longest region the rule gives it
    window_s = min(float(audio["max_audio_clip_s"]),
                   int(loaded.manifest["encoder"]["window_frames"]) * int(audio["hop_length"]) / silero.SAMPLE_RATE)
    demo = [c for c in cases if c["group"] == "demo" and c["samples"] < (window_s - 1) * silero.SAMPLE_RATE]
    clips = [(c["wav"], load_audio(c["wav"])) for c in demo]
    rng = np.random.default_rng(VAD_SEED)
    quiet = (rng.uniform(-1, 1, int(VAD_PAUSE_S * silero.SAMPLE_RATE)) * 1e-3).astype(np.float32)
    sparse = np.concatenate([clips[0][1], quiet, clips[1][1]]).astype(np.float32)
    sparse_path = out / "vad" / "sparse.wav"
    sparse_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sparse_path.with_name(sparse_path.stem + ".tmp.wav")
    sf.write(str(tmp), sparse, silero.SAMPLE_RATE, subtype="FLOAT")  # float32 samples, exactly
    os.replace(tmp, sparse_path)
    clips.append((str(sparse_path), sparse))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        vad = vad_for(loaded, backend="mil")
        entries = []
        for wav, x in clips:
            probs = vad.probabilities(x)
            regions = silero.reference_regions(probs, x.size, max_speech_s=window_s)
            entries.append({"wav": wav, "samples": int(x.size), "probabilities": [float(p) for p in probs],
                            "regions": [list(r) for r in regions]})
    finally:
        torch.set_num_threads(threads_before)
    # the sparse clip with the VAD on, as the Python CLI transcribes it: its windows and the VAD's summary
    cmd = _cli("transcribe", "--json", "--backend", "mil", "--vad", "on", "--front-end", "package",
               "--bundle", str(bundle), "--language", "en", str(sparse_path))
    logger.info("python VAD reference: cohere-coreml transcribe --vad on %s", sparse_path.name)
    proc = subprocess.run(cmd, env=_env(threads), stdout=subprocess.PIPE)
    item = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}
    item = item[0] if isinstance(item, list) else item
    if item.get("status") != "ok" or not item.get("vad"):
        raise FixtureError(f"cohere-coreml transcribe --vad on {sparse_path} failed (exit {proc.returncode})")
    transcript = {"text": item["text"], "vad": item["vad"],
                  "windows": [{"index": w["index"], "start_s": w["start_s"], "duration_s": w["duration_s"],
                               "token_ids": w["token_ids"]} for w in item["windows"]]}
    data = {"bundle": str(bundle), "reference_key": key, "chunks": loaded.vad_chunks, "window_s": window_s,
            "clips": entries, "sparse_transcript": transcript,
            "command": "inference.vad.vad_for(backend='mil').probabilities; model.silero.reference_regions; "
                       "cohere-coreml transcribe --json --backend mil --vad on --front-end package (sparse clip)"}
    _write_json(path, data)
    return data


def compare_front_ends(package: dict | None, python: dict) -> dict | None:
    """Windows whose token ids are equal with the package and the Python front end (the figure the
    issue reports; the Swift tests assert equality with the package front end)."""
    if package is None:
        return None
    total = same = 0
    differing = []
    for a, b in zip(package["clips"], python["clips"]):
        for wa, wb in zip(a["windows"], b["windows"]):
            total += 1
            if wa["token_ids"] == wb["token_ids"]:
                same += 1
            else:
                differing.append(f"{Path(a['wav']).name} window {wa['index']}")
    return {"windows": total, "identical": same, "differing": differing}


def stream_dictation(root: Path, language: str = STREAM_LANGUAGE, count: int = STREAM_UTTERANCES,
                     seed: int = STREAM_SEED) -> tuple[np.ndarray, list[dict]]:
    """(float32 samples at 16 kHz, utterances) of one dictation made as tools/data/make_dictations.py makes
    them (its lead pause, pauses uniform(0.3, 2.0) s, trail pause, one background noise at the level of
    the noisiest clip), from the first `count` held-out utterances of `language`."""
    dictations = load_make_dictations(root)
    rng = np.random.default_rng(seed)
    clips = [c for c in dictations.heldout_speech() if c["language"] == language][:count]
    if len(clips) < count:
        raise FixtureError(f"the held-out set has {len(clips)} {language} utterances, the stream fixture needs {count}")
    rate = dictations.SAMPLE_RATE
    pieces = [np.zeros(int(round(dictations.LEAD_PAUSE_S * rate)), dtype=np.float32)]
    utterances, pos = [], pieces[0].size
    for i, clip in enumerate(clips):
        utterances.append({"id": clip["id"], "text": clip["text"], "start_sample": pos, "end_sample": pos + clip["speech"].size})
        pieces.append(clip["speech"])
        pos += clip["speech"].size
        pause = dictations.TRAIL_PAUSE_S if i == len(clips) - 1 else float(rng.uniform(0.3, 2.0))
        pieces.append(np.zeros(int(round(pause * rate)), dtype=np.float32))
        pos += pieces[-1].size
    wav = np.concatenate(pieces)
    background = max(c["noise_std"] for c in clips)
    wav = np.clip(wav + rng.normal(0.0, background, wav.size).astype(np.float32), -1.0, 1.0).astype(np.float32)
    return wav, utterances


def load_make_dictations(root: Path):
    """tools/data/make_dictations.py as a module (a script beside this package, not part of it: loaded by path
    so the dictation recipe stays in one place)."""
    spec = importlib.util.spec_from_file_location("make_dictations", root / "tools" / "data" / "make_dictations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def streaming_cases(bundle: Path, out: Path, root: Path, threads: int) -> dict:
    """stream/dictation.wav and streaming.json: the Python stream's updates for it (kept when made from
    the same packages and code)."""
    path = out / "streaming.json"
    key = reference_key(bundle)
    wav_path = out / "stream" / "dictation.wav"
    if path.is_file() and wav_path.is_file():
        old = json.loads(path.read_text())
        if old.get("reference_key") == key:
            return old
    wav, utterances = stream_dictation(root)
    wav_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = wav_path.with_name(wav_path.stem + ".tmp.wav")
    sf.write(str(tmp), wav, 16000, subtype="FLOAT")  # float32 samples, exactly
    os.replace(tmp, wav_path)
    cmd = _cli("transcribe", "--stream", "--no-pace", "--json", "--stats", "--backend", "mil", "--vad", "off",
               "--front-end", "package", "--bundle", str(bundle), "--language", STREAM_LANGUAGE, str(wav_path))

    def run(cmd):
        logger.info("python stream reference: %s", " ".join(cmd))
        proc = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise FixtureError(f"cohere-coreml transcribe --stream failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        stats = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith('{"type": "stats"')]
        if len(stats) != 1:
            raise FixtureError(f"cohere-coreml transcribe --stream --stats printed {len(stats)} stats lines, not 1")
        return proc, stats[0]

    proc, stats = run(cmd)
    _, stats_without_extend = run([*cmd[:-1], "--no-extend", cmd[-1]])
    if stats_without_extend["decoder_calls"] == stats["decoder_calls"]:
        raise FixtureError("the stream fixture's decoder calls are the same with and without extend: "
                           "the counter comparison would have no teeth")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    updates = [json.loads(line) for line in lines]
    finals = [u for u in updates if u["type"] == "final"]
    partials = [u for u in updates if u["type"] == "partial"]
    if len(finals) != len(utterances) or not partials:
        raise FixtureError(f"the stream fixture gave {len(finals)} finals and {len(partials)} partials for "
                           f"{len(utterances)} utterances: a comparison needs one segment per utterance and partials")
    data = {"reference_key": key, "wav": str(wav_path), "samples": int(wav.size), "language": STREAM_LANGUAGE,
            "punctuation": True, "chunk_samples": 1600, "command": " ".join(cmd[2:]), "utterances": utterances,
            "updates": updates, "lines": lines, "stats": stats, "stats_without_extend": stats_without_extend}
    _write_json(path, data)
    return data


def compiled_names(bundle: Path) -> dict[str, str]:
    """Package file name -> its compiled model's name in the Python backend's cache (the naming rule both
    languages share: runtime/compiled_cache.py, CoreMLRuntime.cachedLocation(for:))."""
    from cohere_coreml.runtime.compiled_cache import CompiledCache

    cache = CompiledCache(bundle.parent / "unused")
    return {p.name: cache.location(p).name for p in sorted(bundle.glob("*.mlpackage"))}


def make_fixtures(out: Path, root: Path, model: Path, demo_clips: list[tuple[str, str]], threads: int = 2,
                  jobs: int = 2) -> Path:
    """Everything above, READY last. After the test bundle, its variants and the references (each a
    chain of child processes) run `jobs` at a time; the references' children keep `threads` torch
    threads (the Swift tests' interpreter child has as many: near-tie tokens depend on the count), the
    variant exports one (their packages do not depend on it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "READY").unlink(missing_ok=True)
    bundle = export_bundle(out, model, threads)
    token_cases(bundle, out, root)
    cases = audio_cases(out, root, demo_clips)

    def parts_references() -> None:
        parts_bundle = export_parts_bundle(out, bundle, model, 1)
        transcripts(parts_bundle, out, cases, "python", threads, name="parts")

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="fixtures") as pool:
        running = [pool.submit(export_other_decoder_bundle, out, bundle, model, 1),
                   pool.submit(parts_references),
                   pool.submit(transcripts, bundle, out, cases, "package", threads),
                   pool.submit(transcripts, bundle, out, cases, "python", threads),
                   pool.submit(streaming_cases, bundle, out, root, threads),
                   pool.submit(word_timings, bundle, out, cases, threads),
                   pool.submit(vad_regions, bundle, out, cases, threads)]
        try:
            _, _, package, python, stream, _, _ = [job.result() for job in running]
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the jobs not started are dropped; the running ones end first
            raise
    summary = compare_front_ends(package, python)
    if summary is not None:
        logger.info("package vs python front end: %d of %d windows with identical token ids", summary["identical"],
                    summary["windows"])
    _write_json(out / "front_ends.json", summary)
    _write_json(out / "compiled_names.json", compiled_names(bundle))
    logger.info("stream reference: %d updates over %d samples", len(stream["updates"]), stream["samples"])
    (out / "READY").write_text("ok\n")
    return out
