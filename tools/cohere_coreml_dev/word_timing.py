"""Word-timing sets: synthetic speech whose word start times are the synthesizer's own (`word_events`).

A word-timing set is a manifest folder (`datasets.load_folder`, the held-out sets' format) whose utterances
also carry
    "kind":  "single" | "padded" | "multi"
    "words": [{"word", "char_start", "start", "end"}, ...]   # seconds on the clip's timeline
`start` comes from libespeak-ng's word events (null for a word espeak-ng merged into a neighbour: no truth);
`end` is an estimate (the last voiced sample before the next word's start; null where unknown).

Two sets are made here:

* the held-out timing set (`make_timing_set`), for measuring an aligner: the robustness held-out set's recipe
  (`heldout`: held-out sentences of the grammar, voice variants never trained on, level, noise and edges drawn
  by `synth.plan_corpus`), in three kinds, each a folder: single/ (one sentence per clip), padded/ (the same
  with 0-2 s more silence each side, `heldout.derive_padded`) and multi/ (2-4 of them joined with 0.3-2 s
  pauses, `heldout.derive_multi`); padded/ and multi/ derive from single/, so single/ is always written;
* the calibration set (`make_calibration_set`), small and committed, for choosing alignment heads at export:
  a few clips in every language Cohere Transcribe declares, of short sentences written for it (not from a
  recogniser), each after 0.2-1.0 s of silence, the last clip of a language two sentences with a pause.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import soundfile as sf

from cohere_coreml.storage.files import write_text_atomic

from . import heldout, synth
from .synth import SAMPLE_RATE, SynthError
from .word_events import library_version, shift_words, speak_with_words

logger = logging.getLogger(__name__)

KINDS = ("single", "padded", "multi")
DEFAULT_LANGUAGES = ("en", "de", "es")

# ------------------------------------------------------------------------------------------------------
# The held-out timing set
# ------------------------------------------------------------------------------------------------------


def plan_single(languages: list[str], per_language: int, seed: int = 0) -> list[dict]:
    """The single clips' synthesis jobs: the robustness held-out set's plan (`heldout.make_single`'s), so the
    same seed and count give the same sentences, voices, levels and noise as that set."""
    for language in languages:
        if language not in synth.GRAMMAR:
            raise SynthError(f"no held-out sentences for language {language!r}; available: {', '.join(synth.GRAMMAR)}")
    if per_language < 1:
        raise SynthError(f"per-language must be at least 1, got {per_language}")
    return synth.plan_corpus(list(languages), per_language, split="heldout", seed=seed, recipe="varied", single=True)


def synth_single(job: dict, path: str | Path) -> dict:
    """Synthesise one planned clip (as `synth._synth_job` does, its audio sample for sample) to `path` (FLAC);
    its manifest row with "kind" and "words"."""
    speech, words, offset = [], [], 0
    for sentence, speed in zip(job["sentences"], job["speeds"]):
        wav, sentence_words = speak_with_words(sentence, job["voice"], speed, job["pitch"], variant=job["variant"])
        speech.append(wav)
        words.append((sentence_words, offset))
        offset += len(sentence) + 1
    clip, segments = synth.varied_clip(speech, job)
    sf.write(str(path), clip, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    timed = [w for (ws, chars), (a, _) in zip(words, segments) for w in shift_words(ws, a / SAMPLE_RATE, chars)]
    row = synth.Utterance(file=Path(path).name, language=job["language"], text=job["text"],
                          voice=job["voice"] + (f"+{job['variant']}" if job["variant"] else ""), speed=job["speed"],
                          pitch=job["pitch"], seconds=round(clip.size / SAMPLE_RATE, 3), sentences=job["sentences"],
                          segments=segments)
    return {**asdict(row), "kind": "single", "words": timed}


def _synth_to(args: tuple[dict, str]) -> dict:
    return synth_single(*args)


def _write_manifest(folder: Path, manifest: dict) -> None:
    write_text_atomic(folder / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")


def _read(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def make_single(out_dir: Path, languages: list[str], per_language: int, seed: int = 0, workers: int = 1) -> list[dict]:
    """single/: the planned clips synthesised with their words, and manifest.json."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = plan_single(languages, per_language, seed)  # a bad language or count before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(job, str(out_dir / f"{job['id']}.flac")) for job in jobs]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_synth_to, tasks, chunksize=4))
    else:
        rows = []
        for i, task in enumerate(tasks, 1):
            rows.append(_synth_to(task))
            if i % 20 == 0 or i == len(tasks):
                logger.info("single: %d/%d clips", i, len(tasks))
    manifest = {"split": "heldout", "seed": seed, "heldout_percent": 6, "recipe": "varied",
                "recipe_options": synth.varied_options(), "sample_rate": SAMPLE_RATE, "languages": list(languages),
                "subset": "single", "utterances": [{k: v for k, v in r.items() if v is not None} for r in rows]}
    _write_manifest(out_dir, manifest)
    return manifest["utterances"]


def derive_padded(single_dir: Path, out_dir: Path, seed: int = 0) -> list[dict]:
    """padded/: `heldout.derive_padded`, every word moved by the silence added before its clip."""
    heldout.derive_padded(Path(single_dir), Path(out_dir), seed=seed)
    manifest = _read(Path(out_dir))
    for row in manifest["utterances"]:
        row["kind"] = "padded"
        row["words"] = shift_words(row["words"], row["padding_samples"][0] / SAMPLE_RATE)
    _write_manifest(Path(out_dir), manifest)
    return manifest["utterances"]


def derive_multi(single_dir: Path, out_dir: Path, seed: int = 0) -> list[dict]:
    """multi/: `heldout.derive_multi`, each source clip's words moved to where that clip starts in the joined
    one (its sentence's segment there minus its segment in the source) and after the text before it."""
    heldout.derive_multi(Path(single_dir), Path(out_dir), seed=seed)
    sources = {u["file"]: u for u in _read(Path(single_dir))["utterances"]}
    manifest = _read(Path(out_dir))
    for row in manifest["utterances"]:
        words, chars, k = [], 0, 0
        for name in row["sources"]:
            source = sources[name]
            offset = row["segments"][k][0] - source["segments"][0][0]
            words += shift_words(source["words"], offset / SAMPLE_RATE, chars)
            chars += len(source["text"]) + 1
            k += len(source["segments"])
        row["kind"] = "multi"
        row["words"] = words
    _write_manifest(Path(out_dir), manifest)
    return manifest["utterances"]


def make_timing_set(out_dir: Path, languages: list[str] = DEFAULT_LANGUAGES, per_language: int = 20, seed: int = 0,
                    kinds: list[str] = KINDS, workers: int = 1, command: str | None = None) -> dict[str, Path]:
    """The held-out timing set under out_dir: single/ (always: the others derive from it) and the other `kinds`;
    a README.md saying how it was made (`command`) and that ends are estimates."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise SynthError(f"kinds must be some of {', '.join(KINDS)}, got {', '.join(kinds) or 'none'}")
    out_dir = Path(out_dir)
    make_single(out_dir / "single", list(languages), per_language, seed=seed, workers=workers)
    paths = {"single": out_dir / "single"}
    if "padded" in kinds:
        derive_padded(out_dir / "single", out_dir / "padded", seed=seed)
        paths["padded"] = out_dir / "padded"
    if "multi" in kinds:
        derive_multi(out_dir / "single", out_dir / "multi", seed=seed)
        paths["multi"] = out_dir / "multi"
    counts = {name: coverage(_read(path)["utterances"]) for name, path in paths.items()}
    write_text_atomic(out_dir / "README.md", _timing_readme(command, counts))
    for name, (timed, total) in counts.items():
        logger.info("%s: %d of %d words with a start time", name, timed, total)
    return paths


def coverage(utterances: list[dict]) -> tuple[int, int]:
    """(words with a start time, words) over `utterances`."""
    words = [w for u in utterances for w in u["words"]]
    return sum(w["start"] is not None for w in words), len(words)


ENDS_NOTE = ("`start` is libespeak-ng's word event (the synthesizer's own time, never a recogniser's); a word "
             "espeak-ng merged into a neighbour has no event and `start` null (no truth). `end` is an ESTIMATE: "
             "the last voiced sample (10 ms frames within 40 dB of the loudest) before the next word's start, the "
             "end of the speech for a sentence's last word, null after a word with no start and for such a word.")


def _timing_readme(command: str | None, counts: dict[str, tuple[int, int]]) -> str:
    lines = ["# A held-out word-timing set", "",
             "Made by (tools/data/make_word_timing_set.py; tools/cohere_coreml_dev/word_timing.py, libespeak-ng "
             f"{library_version()}):", "",
             f"    {command or 'uv run --frozen python tools/data/make_word_timing_set.py'}", "",
             "single/ (one held-out sentence per clip: the robustness held-out set's recipe), padded/ (the same with "
             "0-2 s more silence each side), multi/ (2-4 of them joined with 0.3-2 s pauses): manifest folders whose "
             "utterances carry `kind` and `words` ([{word, char_start, start, end}], seconds on the clip's timeline).",
             "", ENDS_NOTE, "", "Words with a start time / words:", ""]
    lines += [f"- {name}: {timed} / {total}" for name, (timed, total) in counts.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------
# The calibration set (committed: src/cohere_coreml/data/word_timing_calibration)
# ------------------------------------------------------------------------------------------------------

# Cohere Transcribe's 14 languages -> the espeak-ng voice that speaks them
CALIBRATION_VOICES = {"ar": "ar", "de": "de", "el": "el", "en": "en-us", "es": "es", "fr": "fr-fr", "it": "it",
                      "ja": "ja", "ko": "ko", "nl": "nl", "pl": "pl", "pt": "pt", "vi": "vi", "zh": "cmn"}
CALIBRATION_VARIANTS = (None, "m3", "f2", "m7", "f4")
CALIBRATION_LEAD_S = (0.2, 1.0)
CALIBRATION_TRAIL_S = (0.2, 0.5)
CALIBRATION_PAUSE_S = (0.5, 1.2)
CALIBRATION_PEAK = 0.5

# Short everyday sentences written for this set, five per language: clips 1-3 speak sentences 1-3, clip 4
# sentences 4 and 5 with a pause. Japanese is written in kana with a space between words: espeak-ng's
# Japanese voice reads kanji as character names and gives one word event per space-separated group only (none
# inside an unspaced run), so the spaces are what it speaks; the manifest's text drops them (`spoken_text`
# keeps them) and each space-separated group is one word of it.
CALIBRATION_SENTENCES: dict[str, list[str]] = {
    "ar": ["القطة نائمة على الكرسي.", "سنذهب إلى السوق غدا.", "من فضلك افتح النافذة.",
           "أخي يقرأ كتابا في الحديقة.", "الجو حار جدا اليوم."],
    "de": ["Der Hund schläft unter dem Tisch.", "Wir fahren morgen mit dem Zug nach Berlin.",
           "Bitte schließ die Tür hinter dir.", "Meine Schwester trinkt gern heißen Tee.", "Heute scheint die Sonne."],
    "el": ["Η γάτα κοιμάται στην καρέκλα.", "Αύριο θα πάμε στη θάλασσα.", "Παρακαλώ κλείσε το παράθυρο.",
           "Ο αδελφός μου διαβάζει ένα βιβλίο.", "Σήμερα κάνει πολύ κρύο."],
    "en": ["The cat sleeps on the warm chair.", "We will meet at the station tomorrow.",
           "Please open the window before dinner.", "My brother plays the guitar every evening.",
           "It was raining all day long."],
    "es": ["El gato duerme en la silla.", "Mañana vamos al mercado con mi madre.", "Por favor, cierra la ventana.",
           "Mi hermano juega al fútbol los domingos.", "Hoy hace mucho calor en la ciudad."],
    "fr": ["Le chat dort sur la chaise.", "Nous allons au marché demain matin.", "Ferme la porte, s'il te plaît.",
           "Mon frère lit un livre dans le jardin.", "Il fait très froid ce soir."],
    "it": ["Il gatto dorme sulla sedia.", "Domani andiamo al mare con gli amici.", "Per favore, chiudi la finestra.",
           "Mia sorella canta una bella canzone.", "Oggi il cielo è molto azzurro."],
    "ja": ["ねこ が いす の うえ で ねて います。", "あした わたしたち は うみ に いきます。", "まど を あけて ください。",
           "あに は まいばん ほん を よみます。", "きょう は とても あつい です。"],
    "ko": ["고양이가 의자 위에서 잔다.", "내일 우리는 시장에 간다.", "창문을 열어 주세요.",
           "내 동생은 매일 책을 읽는다.", "오늘은 날씨가 아주 좋다."],
    "nl": ["De kat slaapt op de stoel.", "Morgen gaan we met de trein naar Amsterdam.", "Doe alsjeblieft de deur dicht.",
           "Mijn zus drinkt graag warme thee.", "Vandaag schijnt de zon."],
    "pl": ["Kot śpi na krześle.", "Jutro jedziemy pociągiem do Krakowa.", "Proszę zamknąć okno.",
           "Mój brat gra na gitarze każdego wieczoru.", "Dzisiaj jest bardzo ciepło."],
    "pt": ["O gato dorme na cadeira.", "Amanhã vamos ao mercado com a minha mãe.", "Por favor, fecha a janela.",
           "O meu irmão joga futebol ao domingo.", "Hoje está muito calor na cidade."],
    "vi": ["Con mèo ngủ trên ghế.", "Ngày mai chúng tôi đi chợ.", "Làm ơn mở cửa sổ.",
           "Anh tôi đọc sách mỗi tối.", "Hôm nay trời rất nóng."],
    "zh": ["小猫在椅子上睡觉。", "明天我们去市场。", "请打开窗户。", "我哥哥每天晚上看书。", "今天天气很热。"],
}
CALIBRATION_LANGUAGES = tuple(CALIBRATION_VOICES)
UNSPACED = ("ja",)  # written without spaces: spoken with them (see above)


def _unspace(words: list[dict], spoken: str) -> list[dict]:
    """Words of a spaced text placed in the same text without its spaces."""
    return [{**w, "char_start": w["char_start"] - spoken[: w["char_start"]].count(" ")} for w in words]


def plan_calibration(languages: list[str] = CALIBRATION_LANGUAGES, per_language: int = 4, seed: int = 0) -> list[dict]:
    """Seeded calibration clips: per language `per_language` clips (at most 4), the last of 4 two sentences."""
    unknown = [x for x in languages if x not in CALIBRATION_VOICES]
    if unknown:
        raise SynthError(f"no calibration sentences for {', '.join(unknown)}; available: {', '.join(CALIBRATION_VOICES)}")
    if not 1 <= per_language <= 4:
        raise SynthError(f"calibration clips per language must be 1 to 4, got {per_language}")
    jobs = []
    for language in languages:
        rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 57])
        sentences = CALIBRATION_SENTENCES[language]
        groups = [[sentences[0]], [sentences[1]], [sentences[2]], [sentences[3], sentences[4]]][:per_language]
        for i, group in enumerate(groups):
            jobs.append({"id": f"{language}_calibration_{i:02d}", "language": language, "sentences": group,
                         "voice": CALIBRATION_VOICES[language],
                         "variant": CALIBRATION_VARIANTS[int(rng.integers(len(CALIBRATION_VARIANTS)))],
                         "speed": int(rng.integers(140, 176)), "pitch": int(rng.integers(35, 66)),
                         "lead_s": round(float(rng.uniform(*CALIBRATION_LEAD_S)), 3),
                         "trail_s": round(float(rng.uniform(*CALIBRATION_TRAIL_S)), 3),
                         "pauses_s": [round(float(rng.uniform(*CALIBRATION_PAUSE_S)), 3) for _ in group[1:]]})
    return jobs


# The default model's own domain (its training grammar, `synth.GRAMMAR`): a small model trained on a narrow
# grammar transcribes none of the everyday sentences above, so without these clips it gets no heads. Per grammar
# language, held-out sentences of the grammar (never trained on) drawn with their own seed, none of them a
# sentence of the held-out word-timing sets that measure the aligner (`measured_sentences`): three single
# sentences and one clip of two with a pause, as above.
DOMAIN_SEED_OFFSET = 5700  # the domain clips' seed: the set's seed + this (the held-out sets use small seeds)
DOMAIN_LANGUAGES = DEFAULT_LANGUAGES  # the grammar languages
DOMAIN_CLIPS = 4
MEASURED_PER_LANGUAGE = (20, 200)  # the held-out timing sets' sizes (make_word_timing_set's default; the
# robustness held-out set's, tests/data/heldout-varied, whose plan the timing sets share)


def measured_sentences(language: str, seeds=(0,)) -> set[str]:
    """The sentences of the held-out word-timing sets of `language` (seed 0, every size in MEASURED_PER_LANGUAGE):
    the domain calibration clips never use one."""
    out = set()
    for seed in seeds:
        for n in MEASURED_PER_LANGUAGE:
            for job in plan_single([language], n, seed):
                out.update(job["sentences"])
    return out


def plan_domain_calibration(languages: list[str] = DOMAIN_LANGUAGES, seed: int = 0) -> list[dict]:
    """The domain clips' jobs (`synth_calibration`'s form) for the grammar languages among `languages`."""
    jobs = []
    for language in (x for x in languages if x in synth.GRAMMAR and x in DOMAIN_LANGUAGES):
        domain_seed = seed + DOMAIN_SEED_OFFSET
        drawn = synth.plan_corpus([language], DOMAIN_CLIPS + 1, split="heldout", seed=domain_seed, recipe="commands",
                                  exclude=frozenset(measured_sentences(language)))
        rng = np.random.default_rng([domain_seed, zlib.crc32(language.encode()), 57])
        texts = [j["text"] for j in drawn]
        groups = [[t] for t in texts[: DOMAIN_CLIPS - 1]] + [texts[DOMAIN_CLIPS - 1:]]
        for i, (group, voice) in enumerate(zip(groups, drawn)):
            jobs.append({"id": f"{language}_domain_{i:02d}", "language": language, "sentences": group,
                         "voice": voice["voice"], "variant": voice["variant"], "speed": voice["speed"],
                         "pitch": voice["pitch"], "lead_s": round(float(rng.uniform(*CALIBRATION_LEAD_S)), 3),
                         "trail_s": round(float(rng.uniform(*CALIBRATION_TRAIL_S)), 3),
                         "pauses_s": [round(float(rng.uniform(*CALIBRATION_PAUSE_S)), 3) for _ in group[1:]]})
    return jobs


def synth_calibration(job: dict, path: Path) -> dict:
    """One calibration clip (digital silence around and between the sentences, peak CALIBRATION_PEAK) and its row."""
    rate = SAMPLE_RATE
    pieces = [np.zeros(int(round(job["lead_s"] * rate)), np.float32)]
    words, segments, pos, chars = [], [], pieces[0].size, 0
    for j, sentence in enumerate(job["sentences"]):
        if j:
            pieces.append(np.zeros(int(round(job["pauses_s"][j - 1] * rate)), np.float32))
            pos += pieces[-1].size
        wav, sentence_words = speak_with_words(sentence, job["voice"], job["speed"], job["pitch"],
                                               variant=job["variant"])
        if job["language"] in UNSPACED:
            sentence_words = _unspace(sentence_words, sentence)
        words += shift_words(sentence_words, pos / rate, chars)
        chars += len(sentence.replace(" ", "") if job["language"] in UNSPACED else sentence) + 1
        segments.append([pos, pos + wav.size])
        pieces.append(wav)
        pos += wav.size
    pieces.append(np.zeros(int(round(job["trail_s"] * rate)), np.float32))
    clip = synth._normalise_peak(np.concatenate(pieces), CALIBRATION_PEAK)
    sf.write(str(path), np.clip(clip, -1.0, 1.0), rate, format="FLAC", subtype="PCM_16")
    spoken = " ".join(job["sentences"])
    text = " ".join(s.replace(" ", "") for s in job["sentences"]) if job["language"] in UNSPACED else spoken
    row = {"file": path.name, "language": job["language"], "text": text,
           **({"spoken_text": spoken} if text != spoken else {}),
           "voice": job["voice"] + (f"+{job['variant']}" if job["variant"] else ""), "speed": job["speed"],
           "pitch": job["pitch"], "seconds": round(clip.size / rate, 3), "kind": "single" if len(segments) == 1
           else "multi", "sentences": job["sentences"], "segments": segments, "words": words,
           "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return row


def make_calibration_set(out_dir: Path, languages: list[str] = CALIBRATION_LANGUAGES, per_language: int = 4,
                         seed: int = 0, command: str | None = None) -> list[dict]:
    """The calibration set in out_dir: FLAC clips, manifest.json (with each file's sha256) and README.md."""
    out_dir = Path(out_dir)
    jobs = plan_calibration(list(languages), per_language, seed) + plan_domain_calibration(list(languages), seed)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows = []
    for job in jobs:
        rows.append({**synth_calibration(job, tmp / f"{job['id']}.flac"),
                     **({"domain": "grammar"} if "_domain_" in job["id"] else {})})
        logger.info("%s: %d of %d words with a start time", job["id"], *coverage(rows[-1:]))
    manifest = {"split": "calibration", "seed": seed, "domain_seed": seed + DOMAIN_SEED_OFFSET,
                "sample_rate": SAMPLE_RATE, "languages": list(languages), "per_language": per_language,
                "utterances": rows}
    _write_manifest(tmp, manifest)
    write_text_atomic(tmp / "README.md", _calibration_readme(command, rows, list(languages)))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return rows


def _calibration_readme(command: str | None, rows: list[dict], languages: list[str]) -> str:
    clips = len(rows)
    lines = [
        "# Word-timing calibration set",
        "",
        "Synthetic speech with the synthesizer's own word start times, for choosing the decoder's alignment heads "
        "at export (`--alignment-heads auto`): every language Cohere Transcribe declares, a few clips each. Made "
        f"by (tools/data/make_word_timing_set.py; tools/cohere_coreml_dev/word_timing.py, libespeak-ng {library_version()}):",
        "",
        f"    {command or 'uv run --frozen python tools/data/make_word_timing_set.py --calibration'}",
        "",
        f"{clips} clips, 16 kHz mono FLAC: per language three single sentences and one clip of two sentences with a "
        "0.5-1.2 s pause, each after 0.2-1.0 s and before 0.2-0.5 s of digital silence, peak 0.5, no noise; "
        "voices, variants, speeds and pitches drawn with the seed. The sentences are short everyday ones written for "
        "this set (`CALIBRATION_SENTENCES`), never a recogniser's output. `manifest.json` has per clip its text, "
        "voice, `sentences`, `segments` ([start, end) samples of each sentence), `kind` (single or multi), "
        "`words` and the file's `sha256` (tests/dev/test_word_timing_set.py checks them).",
        "",
        f"Plus {sum(1 for r in rows if r.get('domain'))} clips in the default model's own domain (`domain`: "
        f"\"grammar\", files `<language>_domain_NN`), for {', '.join(sorted({r['language'] for r in rows if r.get('domain')}))}: "
        "held-out sentences of the synthetic-speech grammar the default model (models/cohere-tiny-synth) was "
        f"trained on (never trained on), drawn with their own seed (the set's seed + {DOMAIN_SEED_OFFSET}) and none "
        "of them a sentence of the held-out word-timing sets that measure the aligner (seed 0; "
        "tests/dev/test_word_timing_set.py checks it); voices as the grammar's own, three single sentences and one "
        "clip of two with a pause, the same silences. The default model transcribes none of the everyday sentences "
        "above, so these are the clips its heads are chosen on; a checkpoint of the released model's languages "
        "transcribes (and is calibrated on) all of them.",
        "",
        ENDS_NOTE,
        "",
        "Per language: the espeak-ng voice, words with a start time / words, and what espeak-ng does there:",
        "",
    ]
    for language in languages:
        timed, total = coverage([r for r in rows if r["language"] == language])
        lines.append(f"- {language} (`{CALIBRATION_VOICES[language]}`): {timed} / {total}"
                     + (f"; {CALIBRATION_NOTES[language]}" if language in CALIBRATION_NOTES else ""))
    return "\n".join(lines) + "\n"


# what espeak-ng does in a language beyond one event per spoken word (seen when this set was made)
CALIBRATION_NOTES = {
    "ja": "written in kana with spaces between words (espeak-ng reads kanji as character names and gives one "
          "event per space-separated group, none inside an unspaced run); `text` drops the spaces, `spoken_text` "
          "keeps them, and each group is one word",
    "ko": "espeak-ng merges more words than elsewhere, a sentence's first word among them (no event for it, so the "
          "first timed word starts after the speech does)",
    "zh": "one word per character (espeak-ng speaks and reports each Han character on its own); punctuation "
          "belongs to the character before it",
}
