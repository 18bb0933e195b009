"""One libespeak-ng synthesis with its word events, in a process of its own (run by `word_events.synthesize`).

libespeak-ng is one global synthesizer per process, and it carries state from one synthesis to the next:
the same text spoken twice in one process comes out a few samples apart (measured with espeak-ng 1.51), so
a set's audio would depend on what the process spoke before. Each synthesis therefore runs here, in a fresh
Python process (stdlib only, so it starts fast): its audio is then the espeak-ng command line's, sample
for sample, and calls from several threads or processes cannot disturb one another.

Protocol: argv voice speed pitch; the text on stdin (UTF-8); on stdout one JSON line {"rate", "events":
[[text_position, length, sample, audio_position], ...]} (word events only) and then the audio as int16 little-endian.
A failure is one line on stderr and exit status 3 (no library), 4 (no such voice) or 5 (no audio).

API: espeak-ng's `speak_lib.h` (https://github.com/espeak-ng/espeak-ng/blob/master/src/include/espeak-ng/
speak_lib.h): `espeak_Initialize`, `espeak_SetSynthCallback`, `espeak_SetVoiceByName`, `espeak_SetParameter`,
`espeak_Synth`, `espeak_Synchronize`, the `espeak_EVENT` struct below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys

LIBRARY = "libespeak-ng.so.1"

# speak_lib.h: espeak_AUDIO_OUTPUT, espeak_EVENT_TYPE, espeak_PARAMETER, espeak_POSITION_TYPE, synth flags
AUDIO_OUTPUT_SYNCHRONOUS = 2
EVENT_LIST_TERMINATED = 0
EVENT_WORD = 1
PARAM_RATE = 1
PARAM_PITCH = 3
POS_CHARACTER = 1
CHARS_UTF8 = 1
ENDPAUSE = 0x1000  # "a pause is added at the end of the text": the command line's default (its -z turns it off)

EXIT_NO_LIBRARY, EXIT_NO_VOICE, EXIT_NO_AUDIO = 3, 4, 5


class NoLibrary(Exception):
    """libespeak-ng cannot be loaded."""


class NoVoice(Exception):
    """libespeak-ng did not initialise or has no such voice."""


class EspeakEvent(ctypes.Structure):
    """`espeak_EVENT` of speak_lib.h, field by field (its `id` union is 8 bytes: int, const char *, char[8])."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),  # 1-based character index into the text (characters, not bytes)
        ("length", ctypes.c_int),  # the word's characters
        ("audio_position", ctypes.c_int),  # milliseconds
        ("sample", ctypes.c_int),  # sample index at the synthesis rate
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


class EspeakVoice(ctypes.Structure):
    """`espeak_VOICE` of speak_lib.h (a voice selected by its properties: here by language)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_char_p),
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(EspeakEvent))


def load_library() -> ctypes.CDLL:
    """libespeak-ng: LIBRARY (Debian's soname), else where the system's linker finds `espeak-ng` (macOS's
    Homebrew dylib); NoLibrary when neither loads."""
    try:
        return ctypes.CDLL(LIBRARY)
    except OSError:
        pass
    found = ctypes.util.find_library("espeak-ng")
    try:
        if found:
            return ctypes.CDLL(found)
    except OSError:
        pass
    raise NoLibrary(LIBRARY)


def set_voice(lib: ctypes.CDLL, voice: str) -> bool:
    """Select `voice` as the espeak-ng command line's `-v` does: by voice name or file ("gmw/en"), else as a
    language ("en-gb", "fr-fr", with any "+variant"): both name the same voices for both."""
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    if lib.espeak_SetVoiceByName(voice.encode()) == 0:
        return True
    lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(EspeakVoice)]
    wanted = EspeakVoice(languages=voice.encode())
    return lib.espeak_SetVoiceByProperties(ctypes.byref(wanted)) == 0


def synthesize_here(text: str, voice: str, speed: int, pitch: int) -> tuple[int, list[list[int]], bytes]:
    """(rate, word events, int16 audio bytes) of one synthesis in this process (a fresh one: see the module)."""
    lib = load_library()
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, None, 0)
    audio: list[bytes] = []
    events: list[list[int]] = []

    def on_audio(wav, numsamples, event_list) -> int:
        if numsamples > 0 and wav:
            audio.append(ctypes.string_at(wav, numsamples * ctypes.sizeof(ctypes.c_short)))
        i = 0
        while event_list[i].type != EVENT_LIST_TERMINATED:
            e = event_list[i]
            if e.type == EVENT_WORD:
                events.append([e.text_position, e.length, e.sample, e.audio_position])
            i += 1
        return 0  # go on synthesising

    callback = CALLBACK(on_audio)  # referenced until the synthesis is over
    lib.espeak_SetSynthCallback(callback)
    if rate <= 0 or not set_voice(lib, voice):
        raise NoVoice(voice)
    lib.espeak_SetParameter(PARAM_RATE, int(speed), 0)
    lib.espeak_SetParameter(PARAM_PITCH, int(pitch), 0)
    data = text.encode("utf-8")
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8 | ENDPAUSE, None, None)
    lib.espeak_Synchronize()
    return rate, events, b"".join(audio)


def main(argv: list[str]) -> int:
    voice, speed, pitch = argv[0], int(argv[1]), int(argv[2])
    text = sys.stdin.buffer.read().decode("utf-8")
    try:
        rate, events, audio = synthesize_here(text, voice, speed, pitch)
    except NoLibrary:
        print(f"{LIBRARY} (libespeak-ng) could not be loaded", file=sys.stderr)
        return EXIT_NO_LIBRARY
    except NoVoice:
        print(f"libespeak-ng has no voice {voice!r} (`espeak-ng --voices` lists them)", file=sys.stderr)
        return EXIT_NO_VOICE
    if not audio:
        print(f"libespeak-ng produced no audio for voice {voice!r}", file=sys.stderr)
        return EXIT_NO_AUDIO
    out = sys.stdout.buffer
    out.write(json.dumps({"rate": rate, "events": events}).encode() + b"\n")
    out.write(audio)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
