"""Synthetic speech with espeak-ng: committed test audio and a small multilingual command corpus.

Two jobs live here:

* ``make_test_audio``: the small, deterministic set of clips in ``tests/data/audio/`` that the
  front-end, export and runtime tests run against (speech in several languages, silence,
  44.1 kHz stereo, a 0.05 s clip, a clip longer than 70 s for long-audio splitting).
* ``make_corpus``: utterances from a small generated grammar (numbers, dates, times, short
  commands) in several languages, spoken by several espeak-ng voices at several rates and
  pitches, with light noise and gain changes. Held-out sentences are word combinations that
  never occur in the training split (the split is decided by a hash of the sentence text).

espeak-ng is a Debian package (``apt-get install espeak-ng``); nothing here installs it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16000
ESPEAK_BINARY = "espeak-ng"
INSTALL_HINT = "install it with `apt-get install espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng` (macOS)"


class SynthError(RuntimeError):
    """espeak-ng is missing or failed, or a grammar/corpus request is invalid."""


# ----------------------------------------------------------------------------------------------
# espeak-ng
# ----------------------------------------------------------------------------------------------


def find_espeak() -> str:
    """Path of the espeak-ng binary, or a SynthError that says how to install it."""
    path = shutil.which(ESPEAK_BINARY)
    if path is None:
        raise SynthError(f"{ESPEAK_BINARY} was not found on PATH: {INSTALL_HINT}")
    return path


def speak(
    text: str,
    voice: str,
    *,
    speed: int = 160,
    pitch: int = 50,
    variant: str | None = None,
    sample_rate: int = SAMPLE_RATE,
) -> np.ndarray:
    """Speak `text` with espeak-ng and return float32 mono audio at `sample_rate`.

    voice: an espeak-ng voice name (``en-us``, ``de``, ``cmn``...); variant: an espeak-ng
    variant (``m3``, ``f2``, ``klatt``...) appended as ``voice+variant``.
    """
    if not text.strip():
        raise SynthError("cannot speak an empty text")
    binary = find_espeak()
    full_voice = f"{voice}+{variant}" if variant else voice
    with tempfile.TemporaryDirectory(prefix="espeak-") as tmp:
        out = os.path.join(tmp, "out.wav")
        cmd = [binary, "-v", full_voice, "-s", str(int(speed)), "-p", str(int(pitch)), "-w", out, "--", text]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SynthError(f"espeak-ng failed for voice {full_voice!r}: {proc.stderr.strip() or proc.returncode}")
        wav, sr = sf.read(out, dtype="float32", always_2d=False)
    if wav.ndim != 1:
        wav = wav.mean(axis=1)
    if wav.size == 0:
        raise SynthError(f"espeak-ng produced no audio for voice {full_voice!r} and text {text!r}")
    return resample(wav, sr, sample_rate)


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase resampling (deterministic) of a 1-D or (samples, channels) array."""
    if orig_sr == target_sr:
        return wav.astype(np.float32)
    g = np.gcd(int(orig_sr), int(target_sr))
    out = resample_poly(wav, target_sr // g, orig_sr // g, axis=0)
    return out.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Committed test audio
# ----------------------------------------------------------------------------------------------

# (file stem, language, espeak voice, variant, speed, text)
TEST_SPEECH: list[tuple[str, str, str, str | None, int, str]] = [
    ("en_short", "en", "en-us", None, 170, "Hello world."),
    ("en_medium", "en", "en-us", "f2", 160, "Set a timer for twenty minutes and turn off the kitchen lights."),
    (
        "en_long",
        "en",
        "en-gb",
        "m3",
        150,
        "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore, "
        "and the shells she sells are surely sea shells. Peter Piper picked a peck of pickled peppers.",
    ),
    ("de_short", "de", "de", None, 165, "Guten Morgen."),
    ("de_medium", "de", "de", "m2", 155, "Stelle einen Timer auf fünf Minuten und mach das Licht im Flur aus."),
    ("fr_short", "fr", "fr-fr", None, 165, "Bonjour tout le monde."),
    ("fr_medium", "fr", "fr-fr", "f3", 155, "Il fait beau aujourd'hui, allons nous promener dans le parc."),
    ("es_short", "es", "es", None, 165, "Buenos días."),
    ("es_medium", "es", "es", "m4", 155, "Pon un temporizador de diez minutos y apaga la luz de la cocina."),
    ("it_medium", "it", "it", None, 160, "Vorrei un caffè e un bicchiere d'acqua, per favore."),
    ("zh_medium", "zh", "cmn", None, 150, "今天天气很好，我们去公园散步吧。"),
]

LONG_SENTENCES = [
    "This is a long recording made for testing how long audio is split into pieces.",
    "Each sentence is followed by a short pause so that a quiet place can be found.",
    "The weather today is mild, with a light breeze coming from the west.",
    "Please remember to buy bread, milk, eggs and a bag of green apples.",
    "The train to the city leaves at seven forty five from platform three.",
    "Numbers such as twelve, twenty one and ninety nine are read out in full.",
    "A small model can still be useful for checking a conversion pipeline.",
    "The meeting has been moved from Tuesday morning to Thursday afternoon.",
    "Turn left at the second crossing and continue for about two hundred metres.",
    "Water boils at one hundred degrees at sea level and freezes at zero.",
    "The library opens at nine and closes at six on most working days.",
    "Thank you for listening to this long test recording until the very end.",
]


@dataclass
class ClipInfo:
    file: str
    language: str | None
    text: str
    sample_rate: int
    channels: int
    seconds: float
    purpose: str


def _write(path: Path, wav: np.ndarray, sr: int) -> None:
    subtype = "PCM_16"
    sf.write(str(path), np.clip(wav, -1.0, 1.0), sr, subtype=subtype)


def _normalise_peak(wav: np.ndarray, peak: float = 0.7) -> np.ndarray:
    m = float(np.max(np.abs(wav))) if wav.size else 0.0
    return (wav * (peak / m)).astype(np.float32) if m > 0 else wav


def make_test_audio(out_dir: str | Path, seed: int = 0) -> list[ClipInfo]:
    """Regenerate the committed test clips and `manifest.json` in `out_dir` (deterministic)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    clips: list[ClipInfo] = []

    def add(name: str, wav: np.ndarray, sr: int, language, text, purpose) -> None:
        _write(out_dir / name, wav, sr)
        channels = 1 if wav.ndim == 1 else wav.shape[1]
        clips.append(ClipInfo(name, language, text, sr, channels, round(wav.shape[0] / sr, 4), purpose))

    for stem, lang, voice, variant, speed, text in TEST_SPEECH:
        wav = _normalise_peak(speak(text, voice, speed=speed, variant=variant))
        add(f"{stem}.wav", wav, SAMPLE_RATE, lang, text, "speech")

    # Digital silence, 2 s.
    add("silence_2s.wav", np.zeros(2 * SAMPLE_RATE, np.float32), SAMPLE_RATE, None, "", "silence")

    # 44.1 kHz stereo speech: left and right differ in gain and by a 1 ms delay.
    text = "This clip is stereo, recorded at forty four point one kilohertz."
    mono = _normalise_peak(speak(text, "en-us", speed=160, variant="m1", sample_rate=44100))
    delay = 44
    right = np.concatenate([np.zeros(delay, np.float32), mono[:-delay]]) * 0.8
    stereo = np.stack([mono, right], axis=1)
    add("en_stereo_44k.flac", stereo, 44100, "en", text, "stereo 44.1 kHz resampling and channel averaging")

    # 0.05 s: the first 50 ms of speech (800 samples at 16 kHz).
    short = _normalise_peak(speak("Yes.", "en-us", speed=170))
    start = int(np.argmax(np.abs(short) > 0.05))
    add("tiny_0.05s.wav", short[start : start + 800], SAMPLE_RATE, "en", "", "very short clip (0.05 s)")

    # > 70 s: sentences with 0.6-1.2 s pauses and faint noise, so quiet windows are well defined.
    pieces = []
    voices = [("en-us", None), ("en-gb", "m2"), ("en-us", "f1")]
    for i, sentence in enumerate(LONG_SENTENCES):
        voice, variant = voices[i % len(voices)]
        pieces.append(_normalise_peak(speak(sentence, voice, speed=145, variant=variant), 0.6))
        pieces.append(np.zeros(int(SAMPLE_RATE * rng.uniform(0.6, 1.2)), np.float32))
    long = np.concatenate(pieces)
    while long.shape[0] < 72 * SAMPLE_RATE:  # pad with a pause if espeak spoke fast
        long = np.concatenate([long, np.zeros(SAMPLE_RATE, np.float32)])
    long = long + rng.normal(0.0, 3e-4, long.shape).astype(np.float32)
    add("en_long_75s.flac", long, SAMPLE_RATE, "en", " ".join(LONG_SENTENCES), "long audio (> 70 s) splitting")

    manifest = {"sample_rate_note": "sample_rate/channels are those of the file", "clips": [asdict(c) for c in clips]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return clips


# ----------------------------------------------------------------------------------------------
# Grammar for the synthetic command corpus
# ----------------------------------------------------------------------------------------------

_EN_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_EN_TENS = {20: "twenty", 30: "thirty", 40: "forty", 50: "fifty"}
_DE_ONES = (
    "null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn vierzehn "
    "fünfzehn sechzehn siebzehn achtzehn neunzehn"
).split()
_DE_TENS = {20: "zwanzig", 30: "dreißig", 40: "vierzig", 50: "fünfzig"}
_ES_ONES = (
    "cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece catorce quince "
    "dieciséis diecisiete dieciocho diecinueve veinte veintiuno veintidós veintitrés veinticuatro "
    "veinticinco veintiséis veintisiete veintiocho veintinueve"
).split()
_ES_TENS = {30: "treinta", 40: "cuarenta", 50: "cincuenta"}


def number_words(n: int, language: str) -> str:
    """Cardinal number 0..59 written out in `language` (en, de, es)."""
    if not 0 <= n <= 59:
        raise SynthError(f"number_words supports 0..59, got {n}")
    if language == "en":
        if n < 20:
            return _EN_ONES[n]
        tens, ones = divmod(n, 10)
        return _EN_TENS[tens * 10] + ("" if ones == 0 else f" {_EN_ONES[ones]}")
    if language == "de":
        if n < 20:
            return _DE_ONES[n]
        tens, ones = divmod(n, 10)
        if ones == 0:
            return _DE_TENS[tens * 10]
        unit = "ein" if ones == 1 else _DE_ONES[ones]
        return f"{unit}und{_DE_TENS[tens * 10]}"
    if language == "es":
        if n < 30:
            return _ES_ONES[n]
        tens, ones = divmod(n, 10)
        return _ES_TENS[tens * 10] + ("" if ones == 0 else f" y {_ES_ONES[ones]}")
    raise SynthError(f"number_words: unsupported language {language!r}")


# Slot vocabularies. Number slots: num (2..59), hour (2..12), min (10..59), digit (0..9).
GRAMMAR: dict[str, dict] = {
    "en": {
        "voices": ["en-us", "en-gb", "en-gb-x-rp", "en-029", "en-gb-scotland"],
        "templates": [
            "Set a timer for {num} minutes.",
            "Turn {onoff} the lights in the {room}.",
            "Wake me up at {hour} {min}.",
            "The meeting is on {weekday} at {hour}.",
            "Paint the {object} {color}.",
            "What is {num} plus {num}?",
            "Call {name} at {hour}.",
            "It costs {num} dollars.",
            "Play {genre} music in the {room}.",
            "Dial {digit} {digit} {digit} {digit}.",
            "My birthday is in {month}.",
        ],
        "onoff": ["on", "off"],
        "room": ["kitchen", "bedroom", "bathroom", "office", "hallway", "garage", "garden"],
        "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
        "object": ["wall", "door", "table", "chair", "box", "lamp", "fence"],
        "color": ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "grey"],
        "name": ["Anna", "David", "Emma", "James", "Lucy", "Peter", "Sarah", "Tom"],
        "genre": ["jazz", "rock", "classical", "pop", "folk"],
        "month": ["January", "February", "March", "April", "May", "June", "July", "August",
                  "September", "October", "November", "December"],
    },
    "de": {
        "voices": ["de"],
        "templates": [
            "Stelle einen Timer auf {num} Minuten.",
            "Schalte das Licht im {room} {onoff}.",
            "Weck mich um {hour} Uhr {min}.",
            "Der Termin ist am {weekday} um {hour} Uhr.",
            "Mach die {object} {color}.",
            "Was ist {num} plus {num}?",
            "Ruf {name} um {hour} Uhr an.",
            "Das kostet {num} Euro.",
            "Spiel {genre} im {room}.",
            "Wähle {digit} {digit} {digit} {digit}.",
            "Mein Geburtstag ist im {month}.",
        ],
        "onoff": ["an", "aus"],
        "room": ["Wohnzimmer", "Schlafzimmer", "Badezimmer", "Büro", "Flur", "Keller", "Garten"],
        "weekday": ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag", "Sonntag"],
        "object": ["Wand", "Tür", "Lampe", "Kiste", "Tasse", "Bank", "Decke"],
        "color": ["rot", "grün", "blau", "gelb", "schwarz", "weiß", "orange", "lila", "rosa", "grau"],
        "name": ["Anna", "Lukas", "Marie", "Jonas", "Lena", "Felix", "Sophie", "Paul"],
        "genre": ["Jazz", "Rock", "Klassik", "Popmusik", "Volksmusik"],
        "month": ["Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August",
                  "September", "Oktober", "November", "Dezember"],
    },
    "es": {
        "voices": ["es", "es-419"],
        "templates": [
            "Pon un temporizador de {num} minutos.",
            "{onoff} la luz {room_de}.",
            "Despiértame a las {hour} y {min}.",
            "La reunión es el {weekday} a las {hour}.",
            "Pinta la {object} de {color}.",
            "¿Cuánto es {num} más {num}?",
            "Llama a {name} a las {hour}.",
            "Cuesta {num} euros.",
            "Pon música {genre} {room_en}.",
            "Marca {digit} {digit} {digit} {digit}.",
            "Mi cumpleaños es en {month}.",
        ],
        "onoff": ["Enciende", "Apaga"],
        "room_de": ["de la cocina", "del baño", "del salón", "de la oficina", "del dormitorio", "del garaje",
                    "del jardín"],
        "room_en": ["en la cocina", "en el baño", "en el salón", "en la oficina", "en el dormitorio",
                    "en el garaje", "en el jardín"],
        "weekday": ["lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo"],
        "object": ["pared", "puerta", "mesa", "caja", "silla", "lámpara", "valla"],
        "color": ["rojo", "verde", "azul", "amarillo", "negro", "blanco", "naranja", "morado", "rosa", "gris"],
        "name": ["María", "Carlos", "Lucía", "Javier", "Elena", "Pablo", "Sofía", "Diego"],
        "genre": ["jazz", "rock", "clásica", "pop", "folk"],
        "month": ["enero", "febrero", "marzo", "abril", "mayo", "junio", "julio", "agosto",
                  "septiembre", "octubre", "noviembre", "diciembre"],
    },
}
CORPUS_LANGUAGES = tuple(GRAMMAR)
VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", None]
# recipe "varied": voice variants of held-out clips are never trained on (voices it never heard)
VARIED_HELDOUT_VARIANTS = ["m8", "f5", "klatt3"]
VARIED_TRAIN_VARIANTS = [v for v in VARIANTS if v not in VARIED_HELDOUT_VARIANTS]
_NUMBER_RANGES = {"num": (2, 59), "hour": (2, 12), "min": (10, 59), "digit": (0, 9)}


def _fill_slot(slot: str, language: str, rng: np.random.Generator) -> str:
    if slot in _NUMBER_RANGES:
        lo, hi = _NUMBER_RANGES[slot]
        return number_words(int(rng.integers(lo, hi + 1)), language)
    words = GRAMMAR[language].get(slot)
    if words is None:
        raise SynthError(f"grammar for {language!r} has no slot {slot!r}")
    return words[int(rng.integers(len(words)))]


def sample_sentence(language: str, rng: np.random.Generator, template: int | None = None) -> str:
    """One random sentence of `language` from the grammar (of its `template`-th template when given)."""
    if language not in GRAMMAR:
        raise SynthError(f"no grammar for language {language!r}; available: {', '.join(GRAMMAR)}")
    templates = GRAMMAR[language]["templates"]
    template = templates[int(rng.integers(len(templates))) if template is None else template]
    out, rest = [], template
    while "{" in rest:
        pre, _, after = rest.partition("{")
        slot, _, rest = after.partition("}")
        out.append(pre)
        out.append(_fill_slot(slot, language, rng))
    out.append(rest)
    return "".join(out)


@functools.cache
def _template_patterns(language: str) -> tuple[re.Pattern, ...]:
    patterns = []
    for template in GRAMMAR[language]["templates"]:
        parts = re.split(r"\{[a-z_]+\}", template)
        patterns.append(re.compile("(?:.+)".join(re.escape(part) for part in parts) + "$"))
    return tuple(patterns)


def template_of(text: str, language: str) -> int | None:
    """The index of the grammar template `text` (one sentence) was made from; None if it is none of them."""
    if language not in GRAMMAR:
        raise SynthError(f"no grammar for language {language!r}; available: {', '.join(GRAMMAR)}")
    for i, pattern in enumerate(_template_patterns(language)):
        if pattern.match(text):
            return i
    return None


def is_heldout(text: str, language: str, heldout_percent: int = 6) -> bool:
    """Deterministic split: a sentence is held out iff the hash of (language, text) falls in the bucket."""
    return zlib.crc32(f"{language}\t{text}".encode()) % 100 < heldout_percent


def sample_sentences(
    language: str, n: int, *, split: str, seed: int, heldout_percent: int = 6, unique: bool = False,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """`n` sentences of `split` ("train" or "heldout"); held-out texts never occur in the train split, nor
    any of `exclude` in the result (a validation set kept apart from a test set of the same split)."""
    if split not in ("train", "heldout"):
        raise SynthError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 0 if split == "train" else 1])
    want_heldout = split == "heldout"
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10000:
            raise SynthError(f"could not draw {n} {split} sentences for {language!r} (grammar too small?)")
        text = sample_sentence(language, rng)
        if is_heldout(text, language, heldout_percent) != want_heldout:
            continue
        if (unique and text in seen) or text in exclude:
            continue
        seen.add(text)
        out.append(text)
    return out


# ----------------------------------------------------------------------------------------------
# Corpus synthesis
# ----------------------------------------------------------------------------------------------


@dataclass
class Utterance:
    file: str
    language: str
    text: str
    voice: str
    speed: int
    pitch: int
    seconds: float
    # recipe "varied" only: the sentences of the clip and where each is spoken ([start, end) samples)
    sentences: list[str] | None = None
    segments: list[list[int]] | None = None


# Corpus recipes. "commands" (the committed model's and the 90-clip held-out set's): one sentence per
# clip, 0.05-0.4 s of silence each side, peak 0.2-0.9, white noise at 15-40 dB SNR over the whole clip.
# "varied" (issue 30): what real audio varies, per clip:
RECIPES = ("commands", "varied")
VARIED_SENTENCES = (1, 2, 3, 4)  # sentences per clip, joined with pauses
VARIED_SENTENCE_WEIGHTS = (0.45, 0.25, 0.17, 0.13)
VARIED_PAUSE_S = (0.3, 2.0)  # between sentences, uniform
VARIED_EDGE_S = (0.0, 2.0)  # leading and trailing silence, uniform, on VARIED_LONG_EDGES of the clips
VARIED_SHORT_EDGE_S = (0.0, 0.4)  # ... and this on the others
VARIED_LONG_EDGES = 0.5
VARIED_LEVEL_DBFS = (-30.0, 0.0)  # peak level of the speech, uniform in dB
VARIED_SNR_DB = (10.0, 40.0)  # white noise, uniform in dB, relative to the speech's mean power
VARIED_DIGITAL_EDGES = 0.3  # share of clips whose leading/trailing silence stays digital zeros (else noise)
VARIED_SPEED_JITTER = 15  # each sentence's espeak-ng speed: the clip's +- this (words per minute)
# share of the training clips of 2+ sentences whose sentences differ in voice, variant, pitch, level and
# noise (each drawn per sentence): a clip joined from separate recordings, as the held-out multi/ clips are
VARIED_MIXED_SHARE = 0.5
# the chance that a training clip's sentence after the first repeats the template of the one before it
# (two digit strings, two sums side by side), on top of the 1 in 11 of independent draws; off by default
VARIED_SAME_TEMPLATE = 0.0


def _augment(wav: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random gain, leading/trailing silence and white noise at 15-40 dB SNR."""
    lead = np.zeros(int(SAMPLE_RATE * rng.uniform(0.05, 0.4)), np.float32)
    trail = np.zeros(int(SAMPLE_RATE * rng.uniform(0.05, 0.4)), np.float32)
    wav = np.concatenate([lead, wav, trail])
    wav = _normalise_peak(wav, float(rng.uniform(0.2, 0.9)))
    power = float(np.mean(wav**2)) + 1e-12
    snr_db = float(rng.uniform(15.0, 40.0))
    noise = rng.normal(0.0, np.sqrt(power / 10 ** (snr_db / 10)), wav.shape).astype(np.float32)
    return np.clip(wav + noise, -1.0, 1.0).astype(np.float32)


def varied_clip(speech: list[np.ndarray], job: dict) -> tuple[np.ndarray, list[list[int]]]:
    """Recipe "varied": the sentences' speech joined with the job's pauses, its edges, level and noise
    (all drawn in `plan_corpus`, so a plan alone says where each sentence is); (clip, segments).
    A "mixed" job (`mix`, one entry per sentence) brings each sentence to its own level with its own noise;
    a pause has the noise of the sentence after it, the edges that of the sentence beside them."""
    rate = SAMPLE_RATE
    mix = job.get("mix")
    if mix:
        speech = [_normalise_peak(w.astype(np.float32), 10 ** (m["level_dbfs"] / 20)) for w, m in zip(speech, mix)]
    pieces = [np.zeros(int(round(job["lead_s"] * rate)), np.float32)]
    segments, pos = [], pieces[0].size
    for i, wav in enumerate(speech):
        if i:
            pieces.append(np.zeros(int(round(job["pauses_s"][i - 1] * rate)), np.float32))
            pos += pieces[-1].size
        segments.append([pos, pos + wav.size])
        pieces.append(wav.astype(np.float32))
        pos += wav.size
    pieces.append(np.zeros(int(round(job["trail_s"] * rate)), np.float32))
    clip = np.concatenate(pieces)
    rng = np.random.default_rng(job["seed"])
    if mix:
        std = np.empty(clip.shape, np.float32)
        start = 0
        for i, ((a, b), m) in enumerate(zip(segments, mix)):
            power = float(np.mean(clip[a:b] ** 2)) + 1e-12
            end = clip.size if i == len(segments) - 1 else b
            std[start:end] = np.sqrt(power / 10 ** (m["snr_db"] / 10))
            start = end
        noise = (rng.normal(0.0, 1.0, clip.shape) * std).astype(np.float32)
    else:
        clip = _normalise_peak(clip, 10 ** (job["level_dbfs"] / 20))
        voiced = np.concatenate([clip[a:b] for a, b in segments])
        power = float(np.mean(voiced**2)) + 1e-12
        noise = rng.normal(0.0, np.sqrt(power / 10 ** (job["snr_db"] / 10)), clip.shape).astype(np.float32)
    if job["digital_edges"]:  # noise from the first sentence's start to the last one's end only
        noise[: segments[0][0]] = 0.0
        noise[segments[-1][1]:] = 0.0
    return np.clip(clip + noise, -1.0, 1.0).astype(np.float32), segments


def _synth_job(job: dict) -> dict:
    if job.get("recipe", "commands") == "varied":
        voices = job.get("mix") or [{"voice": job["voice"], "variant": job["variant"], "pitch": job["pitch"]}] * len(
            job["sentences"])
        speech = [speak(t, m["voice"], speed=v, pitch=m["pitch"], variant=m["variant"])
                  for t, v, m in zip(job["sentences"], job["speeds"], voices)]
        wav, segments = varied_clip(speech, job)
        sf.write(job["path"], wav, SAMPLE_RATE, format=job["format"], subtype="PCM_16")
        return {"seconds": round(wav.shape[0] / SAMPLE_RATE, 3), "segments": segments}
    rng = np.random.default_rng(job["seed"])
    wav = speak(job["text"], job["voice"], speed=job["speed"], pitch=job["pitch"], variant=job["variant"])
    wav = _augment(wav, rng)
    sf.write(job["path"], wav, SAMPLE_RATE, format=job["format"], subtype="PCM_16")
    return {"seconds": round(wav.shape[0] / SAMPLE_RATE, 3)}


def varied_options(sentence_weights=None, snr_db=None, same_template=None) -> dict:
    """The adjustable draws of recipe "varied": {"sentence_weights": the probabilities of 1..4 sentences per
    clip, "snr_db": [low, high], "same_template": the chance that a training clip's next sentence repeats
    the template of the one before}, the module's defaults (VARIED_SENTENCE_WEIGHTS, VARIED_SNR_DB,
    VARIED_SAME_TEMPLATE) where not given; "same_template" only when above 0 (so the options of corpora made
    before it existed compare equal). SynthError naming a value that cannot be one."""
    weights = [float(w) for w in (VARIED_SENTENCE_WEIGHTS if sentence_weights is None else sentence_weights)]
    snr = [float(x) for x in (VARIED_SNR_DB if snr_db is None else snr_db)]
    same = float(VARIED_SAME_TEMPLATE if same_template is None else same_template)
    if len(weights) != len(VARIED_SENTENCES) or min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-6:
        raise SynthError(f"sentence weights must be {len(VARIED_SENTENCES)} probabilities of 1..{max(VARIED_SENTENCES)} "
                         f"sentences per clip summing to 1, got {weights}")
    if len(snr) != 2 or not snr[0] < snr[1]:
        raise SynthError(f"the SNR range must be two values in dB, low < high, got {snr}")
    if not 0.0 <= same <= 1.0:
        raise SynthError(f"the same-template share must be a probability in [0, 1], got {same:g}")
    return {"sentence_weights": weights, "snr_db": snr, **({"same_template": same} if same > 0 else {})}


def _same_template_sentence(previous: str, language: str, rng: np.random.Generator, *, heldout_percent: int,
                            exclude: frozenset[str] | set[str]) -> str:
    """A training sentence of `previous`'s template (never a held-out or an excluded one)."""
    template = template_of(previous, language)
    if template is None:
        raise SynthError(f"{previous!r} is no sentence of the {language!r} grammar")
    for _ in range(10000):
        text = sample_sentence(language, rng, template)
        if not is_heldout(text, language, heldout_percent) and text not in exclude:
            return text
    raise SynthError(f"no training sentence of the template of {previous!r} (grammar too small?)")


def _varied_fields(rng: np.random.Generator, speed: int, snr_db=VARIED_SNR_DB) -> dict:
    """The per-clip draws of recipe "varied" except its sentences (their count comes first)."""
    long_edges = rng.random() < VARIED_LONG_EDGES
    edge = VARIED_EDGE_S if long_edges else VARIED_SHORT_EDGE_S
    return {"lead_s": round(float(rng.uniform(*edge)), 3), "trail_s": round(float(rng.uniform(*edge)), 3),
            "level_dbfs": round(float(rng.uniform(*VARIED_LEVEL_DBFS)), 2),
            "snr_db": round(float(rng.uniform(*snr_db)), 2),
            "digital_edges": bool(rng.random() < VARIED_DIGITAL_EDGES), "speed": speed}


def plan_corpus(
    languages: list[str], per_language: int, *, split: str, seed: int, heldout_percent: int = 6,
    recipe: str = "commands", single: bool = False, options: dict | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[dict]:
    """Deterministic list of synthesis jobs (text, voice, variant, speed, pitch, seed; recipe "varied":
    also the clip's sentences, their speeds, the pauses, edges, level and noise; `options`: its
    `varied_options`, the defaults when None; `exclude`: sentences not to use)."""
    if recipe not in RECIPES:
        raise SynthError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if options is not None and recipe != "varied":
        raise SynthError(f"recipe {recipe!r} takes no options (sentence weights and SNR range are recipe \"varied\"'s)")
    if recipe == "varied":
        return _plan_varied(languages, per_language, split=split, seed=seed, heldout_percent=heldout_percent,
                            single=single, options=varied_options(**(options or {})), exclude=exclude)
    jobs = []
    for language in languages:
        if language not in GRAMMAR:
            raise SynthError(f"no grammar for language {language!r}; available: {', '.join(GRAMMAR)}")
        texts = sample_sentences(
            language, per_language, split=split, seed=seed, heldout_percent=heldout_percent,
            unique=(split == "heldout"), exclude=exclude,
        )
        rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 7 if split == "train" else 8])
        voices = GRAMMAR[language]["voices"]
        for i, text in enumerate(texts):
            jobs.append(
                {
                    "id": f"{language}_{split}_{i:05d}",
                    "language": language,
                    "text": text,
                    "voice": voices[int(rng.integers(len(voices)))],
                    "variant": VARIANTS[int(rng.integers(len(VARIANTS)))],
                    "speed": int(rng.integers(120, 201)),
                    "pitch": int(rng.integers(30, 71)),
                    "seed": int(rng.integers(2**31)),
                }
            )
    return jobs


def _plan_varied(languages: list[str], per_language: int, *, split: str, seed: int, heldout_percent: int,
                 single: bool = False, options: dict | None = None,
                 exclude: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    """Recipe "varied": per language, `per_language` clips of 1-4 sentences (`options`' sentence weights,
    `varied_options`); a held-out plan uses each sentence once (the sentences are unique within the split).
    `single`: one sentence per clip and short edges (VARIED_SHORT_EDGE_S), the rest as drawn (the held-out
    set's base). Options' `same_template` (training plans only): a clip's sentence after the first is replaced,
    with that chance, by a training sentence of its predecessor's template."""
    options = options or varied_options()
    if options.get("same_template") and (split != "train" or single):
        raise SynthError("same-template neighbours are an option of training corpora of several sentences per clip "
                         "(a held-out plan uses each of its sentences once)")
    jobs = []
    for language in languages:
        if language not in GRAMMAR:
            raise SynthError(f"no grammar for language {language!r}; available: {', '.join(GRAMMAR)}")
        rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 17 if split == "train" else 18])
        mix_rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 19])  # training clips only
        counts = rng.choice(VARIED_SENTENCES, size=per_language, p=options["sentence_weights"])
        if single:
            counts = np.ones(per_language, dtype=np.int64)
        texts = sample_sentences(language, int(counts.sum()), split=split, seed=seed + 1000,
                                 heldout_percent=heldout_percent, unique=(split == "heldout"), exclude=exclude)
        voices = GRAMMAR[language]["voices"]
        variants = VARIED_TRAIN_VARIANTS if split == "train" else VARIED_HELDOUT_VARIANTS
        same_template = options.get("same_template", 0.0)
        # its own stream: with same_template, the rest of the plan is the plan without it
        template_rng = np.random.default_rng([seed, zlib.crc32(language.encode()), 21])
        start = 0
        for i, k in enumerate(counts):
            sentences = texts[start: start + int(k)]
            start += int(k)
            for j in range(1, len(sentences) if same_template else 0):
                if template_rng.random() < same_template:
                    sentences[j] = _same_template_sentence(sentences[j - 1], language, template_rng,
                                                           heldout_percent=heldout_percent, exclude=exclude)
            speed = int(rng.integers(120, 201))
            job = {"id": f"{language}_{split}_varied_{i:05d}", "recipe": "varied", "language": language,
                   "text": " ".join(sentences), "sentences": sentences,
                   "voice": voices[int(rng.integers(len(voices)))],
                   "variant": variants[int(rng.integers(len(variants)))],
                   "pitch": int(rng.integers(30, 71)),
                   "speeds": [int(np.clip(speed + rng.integers(-VARIED_SPEED_JITTER, VARIED_SPEED_JITTER + 1), 110, 210))
                              for _ in sentences],
                   "pauses_s": [round(float(rng.uniform(*VARIED_PAUSE_S)), 3) for _ in sentences[1:]],
                   **_varied_fields(rng, speed, options["snr_db"]), "seed": int(rng.integers(2**31))}
            if split == "train" and len(sentences) > 1 and mix_rng.random() < VARIED_MIXED_SHARE:
                job["mix"] = [{"voice": voices[int(mix_rng.integers(len(voices)))],
                               "variant": variants[int(mix_rng.integers(len(variants)))],
                               "pitch": int(mix_rng.integers(30, 71)),
                               "level_dbfs": round(float(mix_rng.uniform(*VARIED_LEVEL_DBFS)), 2),
                               "snr_db": round(float(mix_rng.uniform(*options["snr_db"])), 2)} for _ in sentences]
            if single:
                job["id"] = f"{language}_{split}_single_{i:05d}"
                if job["lead_s"] > VARIED_SHORT_EDGE_S[1] or job["trail_s"] > VARIED_SHORT_EDGE_S[1]:
                    job["lead_s"], job["trail_s"] = (round(x * VARIED_SHORT_EDGE_S[1] / VARIED_EDGE_S[1], 3)
                                                     for x in (job["lead_s"], job["trail_s"]))
            jobs.append(job)
    return jobs


def make_corpus(
    out_dir: str | Path,
    languages: list[str],
    per_language: int,
    *,
    split: str = "train",
    seed: int = 0,
    heldout_percent: int = 6,
    audio_format: str = "flac",
    workers: int = 1,
    recipe: str = "commands",
    single: bool = False,
    options: dict | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
    manifest_extra: dict | None = None,
) -> list[Utterance]:
    """Synthesise a corpus into `out_dir` (audio files + `manifest.json`); returns the utterances.
    `options`: recipe "varied"'s `varied_options` (recorded in the manifest as `recipe_options`);
    `exclude`: sentences not to use; `manifest_extra`: more manifest fields (where the exclusions came from)."""
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    find_espeak()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = plan_corpus(languages, per_language, split=split, seed=seed, heldout_percent=heldout_percent, recipe=recipe,
                       single=single, options=options, exclude=exclude)
    ext = {"flac": "flac", "wav": "wav"}.get(audio_format)
    if ext is None:
        raise SynthError(f"audio_format must be 'flac' or 'wav', got {audio_format!r}")
    for job in jobs:
        job["path"] = str(out_dir / f"{job['id']}.{ext}")
        job["format"] = audio_format.upper()
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(tqdm(pool.map(_synth_job, jobs, chunksize=16), total=len(jobs), desc=f"synth {split}"))
    else:
        results = [_synth_job(j) for j in tqdm(jobs, desc=f"synth {split}")]
    utts = [
        Utterance(
            file=Path(j["path"]).name,
            language=j["language"],
            text=j["text"],
            voice=",".join(m["voice"] + (f"+{m['variant']}" if m["variant"] else "") for m in j.get("mix") or [j]),
            speed=j["speed"],
            pitch=j["pitch"],
            seconds=r["seconds"],
            sentences=j.get("sentences"),
            segments=r.get("segments"),
        )
        for j, r in zip(jobs, results)
    ]
    manifest = {
        "split": split,
        "seed": seed,
        "heldout_percent": heldout_percent,
        "recipe": recipe,
        **({"recipe_options": varied_options(**(options or {}))} if recipe == "varied" else {}),
        "sample_rate": SAMPLE_RATE,
        "languages": list(languages),
        **(manifest_extra or {}),
        "utterances": [{k: v for k, v in asdict(u).items() if v is not None} for u in utts],
    }
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out_dir / "manifest.json")
    logger.info("wrote %d %s utterances (%.1f min) to %s", len(utts), split, sum(u.seconds for u in utts) / 60, out_dir)
    return utts


def read_manifest(directory: str | Path) -> dict:
    """The manifest.json of a corpus or test-audio folder."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        raise SynthError(f"no manifest.json in {directory}")
    return json.loads(path.read_text())
