"""Words per window: the rule on one window, offset and clamped to it; a bundle's words against the PyTorch
reference's on the same audio; the clip's words in JSON; long-form clips on the reference engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cohere_coreml.inference.alignment import AlignmentError, parse_heads
from cohere_coreml.inference.engines import PyTorchEngine
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.inference.words import (
    AlignmentSettings,
    WordTimingError,
    clip_words,
    no_alignment_message,
    window_words,
)
from cohere_coreml.model.audio import load_audio

from ..fixture_data import AUDIO_DIR, TRAINED_MODEL, heldout_utterances
from ..helpers import transcriber_without_alignment, without_alignment

torch.set_num_threads(1)

FRAME = 0.08
PIECES = ["▁one", "▁two", "▁three", "."]


def diagonal(rows: int, frames: int, lead_rows: int = 1) -> np.ndarray:
    """(1 head, positions, frames) attention whose rows after the prompt walk along the frames."""
    prompt = 4
    att = np.full((1, prompt + rows, frames), 1e-4, dtype=np.float32)
    for r in range(prompt + rows):
        att[0, r, min(frames - 1, max(0, (r - prompt + lead_rows + 1) * frames // (rows + lead_rows + 1)))] = 1.0
    return att / att.sum(-1, keepdims=True)


def test_window_words_are_offset_and_clamped_to_the_window():
    settings = AlignmentSettings(heads=((0, 0),), frame_seconds=FRAME, lead_rows=1)
    att = diagonal(len(PIECES), 40)
    probs = [0.9, 0.8, 0.7, 0.6]
    at0 = window_words(att, 4, PIECES, probs, settings, language="en", start_s=0.0, duration_s=40 * FRAME)
    at10 = window_words(att, 4, PIECES, probs, settings, language="en", start_s=10.0, duration_s=40 * FRAME)
    assert [w["word"] for w in at0] == ["one", "two", "three."]
    assert [w["probability"] for w in at0] == pytest.approx([0.9, 0.8, 0.65])
    for a, b in zip(at0, at10):
        assert b["start"] == pytest.approx(a["start"] + 10.0) and b["end"] == pytest.approx(a["end"] + 10.0)
    starts = [w["start"] for w in at0]
    assert starts == sorted(starts) and len(set(starts)) == 3
    # a window shorter than its frames (the last frames are the encoder's rounding): times stay inside it
    short = window_words(att, 4, PIECES, probs, settings, language="en", start_s=10.0, duration_s=1.0)
    assert all(10.0 <= w["start"] <= w["end"] <= 11.0 for w in short)
    assert short[-1]["end"] == 11.0 and at10[-1]["end"] > 11.0
    assert window_words(att, 4, [], [], settings, language="en", start_s=0.0, duration_s=1.0) == []


class _Tokenizer:
    def convert_ids_to_tokens(self, ids):
        return [PIECES[i - 10] for i in ids]


class _Decoder:
    def __init__(self, attention):
        self.attention, self.calls = attention, []

    def align(self, state, ids, rows_from=0):
        """As `DecoderRuntime.align`: rows before `rows_from` are not computed (NaN)."""
        self.calls.append((list(ids), rows_from))
        rows = self.attention[:, : len(ids)].copy()
        rows[:, :rows_from] = np.nan
        return rows


def test_transcriber_window_words_read_the_valid_frames_and_the_decoding_probabilities():
    """`Transcriber.window_words` on a stand-in decoder: the align call gets prompt + text tokens (no eos), the
    frames past the encoder's valid ones are ignored (here they hold weight they must not get), the
    probabilities are decoding's; a window cut by the cache aligns the tokens that fit."""
    from cohere_coreml.inference.decoding import DecodeResult

    valid, padded = 30, 40
    att = diagonal(len(PIECES), valid)
    garbage = np.full(att.shape[:2] + (padded - valid,), 5.0, np.float32)
    garbage[:, -1] = 0.0  # the rows of the text would rather sit in the padding than the end row
    noisy = np.concatenate([att, garbage], axis=-1)
    tr = Transcriber.__new__(Transcriber)
    tr.decoder, tr.tokenizer, tr.eos_ids, tr.capacity = _Decoder(noisy), _Tokenizer(), {3}, 64
    tr.bundle = type("B", (), {"manifest": {"decoder": {"alignment": {
        "function": "align", "length": 64, "heads": [[0, 0]], "lead_rows": 1, "frame_seconds": FRAME}}}})()
    settings = tr.check_word_timestamps()
    lps = [-0.1, -0.2, -0.3, -0.4, -0.05]
    dec = DecodeResult(token_ids=[10, 11, 12, 13, 3], stop_reason="eos", bind_s=0, prompt_s=0, decode_s=0, steps=9,
                       calls=6, token_log_probs=lps, state="state")
    got = tr.window_words(dec, {"encoder_length": np.array([valid])}, [1, 2, 4, 5], settings, language="en",
                          start_s=2.0, duration_s=5.0)
    expected = window_words(att, 4, PIECES, np.exp(lps[:4]), settings, language="en", start_s=2.0, duration_s=5.0)
    # rows from the one predicting the prompt's last lead_rows tokens: the rule never reads the rows before
    assert got == expected and tr.decoder.calls == [([1, 2, 4, 5, 10, 11, 12, 13], 2)]
    tr.capacity = 7  # slots for the prompt and 3 of the 4 text tokens
    cut = tr.window_words(dec, {"encoder_length": np.array([valid])}, [1, 2, 4, 5], settings, language="en",
                          start_s=2.0, duration_s=5.0)
    assert [w["word"] for w in cut] == ["one", "two", "three"] and tr.decoder.calls[-1] == ([1, 2, 4, 5, 10, 11, 12], 2)


def test_heads_and_the_no_alignment_message():
    assert parse_heads("1.0, 1.2") == [(1, 0), (1, 2)]
    for bad in ("", "1", "a.b", "1.0,x"):
        with pytest.raises(AlignmentError, match="--alignment-heads: "):
            parse_heads(bad)
    manifest = {"decoder": {"alignment": None, "alignment_note": "exported with --alignment-heads none"}}
    message = no_alignment_message(manifest)
    assert "--alignment-heads none" in message and "--alignment-heads auto" in message and "\n" not in message
    assert clip_words([]) is None


class CountingAlign:
    """The decoder's align function, counted."""

    def __init__(self, decoder):
        self.align, self.calls = decoder.align, 0
        decoder.align = self

    def __call__(self, state, ids, **options):
        self.calls += 1
        return self.align(state, ids, **options)


@pytest.fixture(scope="module")
def aligned(trained_bundle):
    """The session bundle's Transcriber (its decoder has the align function: export --alignment-heads auto, the
    default) and the reference engine on the manifest's heads and rows before the text."""
    tr = Transcriber(trained_bundle, backend="mil")
    assert tr.alignment is not None, tr.bundle.manifest["decoder"].get("alignment_note")
    counter = CountingAlign(tr.decoder)
    reference = PyTorchEngine(TRAINED_MODEL, alignment_heads=[tuple(h) for h in tr.alignment["heads"]],
                              lead_rows=tr.alignment["lead_rows"])
    return tr, counter, reference


def test_bundle_words_match_the_reference_words(aligned):
    """Held-out clips, 2 per language: the bundle's words (its align function on the decoder state, probabilities
    from decoding) against the reference's (`transformers`' teacher-forced attention on the same heads): same
    words, boundaries within one encoder frame, probabilities close. The words are real: most of them are the
    manifest's text."""
    tr, counter, reference = aligned
    covered = total = 0
    calls = counter.calls
    for u in heldout_utterances(2):
        wav = load_audio(u["path"])
        got = tr.transcribe(wav, u["language"], word_timestamps=True, vad="off")  # the reference's window: the clip
        ref = reference.transcribe(wav, u["language"], word_timestamps=True)
        assert got.text == ref.text, u["file"]
        assert [w["word"] for w in got.words] == [w["word"] for w in ref.words], u["file"]
        for a, b in zip(got.words, ref.words):
            assert abs(a["start"] - b["start"]) <= tr.alignment["frame_seconds"] + 1e-6, (u["file"], a, b)
            assert abs(a["end"] - b["end"]) <= tr.alignment["frame_seconds"] + 1e-6, (u["file"], a, b)
            assert a["probability"] == pytest.approx(b["probability"], abs=0.05)
        seconds = len(wav) / 16000
        assert all(0 <= w["start"] <= w["end"] <= seconds for w in got.words)
        covered += sum(w["word"] in u["text"] for w in got.words)
        total += len(u["text"].split())
    assert counter.calls - calls == len(heldout_utterances(2)), "one align call per window"
    assert covered >= total // 2


def test_words_in_json_only_when_asked(aligned):
    tr, _, _ = aligned
    wav = load_audio(heldout_utterances(1)[1]["path"])
    plain = json.loads(json.dumps(tr.transcribe(wav, "en").to_dict()))
    assert "words" not in plain and "words" not in plain["windows"][0]
    timed = json.loads(json.dumps(tr.transcribe(wav, "en", word_timestamps=True).to_dict()))
    assert timed["text"] == plain["text"] and timed["words"] == timed["windows"][0]["words"]
    assert set(timed["words"][0]) == {"word", "start", "end", "probability"}
    assert " ".join(w["word"] for w in timed["words"]) == timed["text"]
    silent = tr.transcribe(np.zeros(16000, np.float32), "en", word_timestamps=True)
    assert silent.silent and silent.words == [] and silent.to_dict()["words"] == []


def test_beam_search_gives_words_too(aligned):
    tr, _, _ = aligned
    wav = load_audio(heldout_utterances(1)[1]["path"])
    greedy = tr.transcribe(wav, "en", word_timestamps=True)
    beamed = tr.transcribe(wav, "en", word_timestamps=True, beams=2)
    assert [w["word"] for w in beamed.words] == beamed.text.split()
    if beamed.text == greedy.text:
        assert [w["start"] for w in beamed.words] == [w["start"] for w in greedy.words]


def test_beam_search_keeps_the_best_hypothesis_state(aligned):
    """The align function reads the decoded self cache, and beams share and copy states: the state a beam search
    keeps must hold the BEST hypothesis's tokens. Its align rows equal those of a fresh state fed with exactly
    prompt + those tokens, on every clip (a kept state of another beam differs on some)."""
    tr, _, _ = aligned
    for u in heldout_utterances(2):
        features, n_valid, _ = tr.features(load_audio(u["path"]))
        enc = tr.encode(features, n_valid)
        prompt = tr.prompt(u["language"])
        dec = tr.decode(enc, prompt, beams=3, token_scores=True, keep_state=True)
        ids = list(prompt) + [t for t in dec.token_ids if t not in tr.eos_ids]
        fresh = tr.decoder.new_state(enc)
        tr.decoder.feed(fresh, ids)
        first = len(prompt) - 1 - tr.alignment["lead_rows"]
        got = tr.decoder.align(dec.state, ids, rows_from=first)[:, first:]
        want = tr.decoder.align(fresh, ids, rows_from=first)[:, first:]
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=u["file"])


def test_a_bundle_without_alignment_refuses_with_the_fix(trained_bundle):
    tr = without_alignment(Transcriber(trained_bundle, backend="mil"))
    with pytest.raises(WordTimingError, match="re-export it with `cohere-coreml export --alignment-heads auto`"):
        tr.transcribe(load_audio(heldout_utterances(1)[1]["path"]), "en", word_timestamps=True)


def long_clip(seconds: float, seed: int = 0) -> np.ndarray:
    """Held-out sentences (all languages' English clips) one after the other with 0.4-1.5 s pauses of noise."""
    rng = np.random.default_rng(seed)
    clips = [load_audio(u["path"]) for u in heldout_utterances(10) if u["language"] == "en"]
    pieces, total, k = [], 0, 0
    while total < seconds * 16000:
        pause = rng.normal(0, 2e-3, int(rng.uniform(0.4, 1.5) * 16000)).astype(np.float32)
        pieces += [clips[k % len(clips)], pause]
        total += len(pieces[-2]) + len(pause)
        k += 1
    return np.concatenate(pieces)[: int(seconds * 16000)]


@pytest.mark.parametrize("clip", ["en_long_75s", "three_minutes"])
def test_long_form_words_are_in_order_and_inside_their_windows(aligned, clip):
    """A 75 s clip and a 3-minute one, through the reference engine (its windows are the reference processor's,
    as every engine's): every window's words on the clip's timeline, inside that window, in time order across
    windows, and the clip's words are the windows' in order."""
    _, _, reference = aligned
    wav = load_audio(AUDIO_DIR / "en_long_75s.flac") if clip == "en_long_75s" else long_clip(180.0)
    result = reference.transcribe(wav, "en", word_timestamps=True, max_new_tokens=48)
    assert len(result.windows) >= (3 if clip == "en_long_75s" else 6)
    timed = 0
    for w in result.windows:
        for word in w.words:
            assert w.start_s <= word["start"] <= word["end"] <= w.start_s + w.duration_s + 1e-9, (w.index, word)
        if len(w.words) >= 3 and w.start_s > 0:  # spread over the window, not piled at a clamp
            timed += 1
            assert len({word["start"] for word in w.words}) >= len(w.words) // 2, (w.index, w.words)
    assert timed >= 2, "words in later windows: the offset is what this checks"
    starts = [word["start"] for word in result.words]
    ends = [word["end"] for word in result.words]
    assert starts == sorted(starts) and ends == sorted(ends)
    assert result.words == [word for w in result.windows for word in w.words]


# --------------------------------------------------------------------------------------------------
# `cohere-coreml transcribe --word-timestamps / --format`
# --------------------------------------------------------------------------------------------------


def run_cli(capsys, bundle, *args, clips=None):
    from cohere_coreml.cli import main

    clips = clips or [str(heldout_utterances(1)[1]["path"])]
    code = main(["transcribe", *clips, "--bundle", str(bundle), "--language", "en", "--backend", "mil", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_words_json_srt_vtt(aligned, trained_bundle, capsys):
    tr = aligned[0]
    wav = load_audio(heldout_utterances(1)[1]["path"])
    expected = tr.transcribe(wav, "en", word_timestamps=True)
    code, out, _ = run_cli(capsys, trained_bundle, "--word-timestamps", "--json")
    assert code == 0
    data = json.loads(out)
    assert [w["word"] for w in data["words"]] == [w["word"] for w in expected.words]
    for got, want in zip(data["words"], expected.words):  # printed to the millisecond
        assert got["start"] == round(want["start"], 3) and got["end"] == round(want["end"], 3)
        assert got["probability"] == round(want["probability"], 3)
    code, text_out, _ = run_cli(capsys, trained_bundle, "--word-timestamps")
    lines = text_out.splitlines()
    assert code == 0 and lines[0] == expected.text and len(lines) == 1 + len(expected.words)
    assert lines[1] == (f"[{expected.words[0]['start']:.3f}-{expected.words[0]['end']:.3f}] "
                        f"{expected.words[0]['word']} ({expected.words[0]['probability']:.3f})")
    code, srt, _ = run_cli(capsys, trained_bundle, "--format", "srt", "--max-words-per-cue", "2")
    assert code == 0 and srt.startswith("1\n00:00:0") and " --> " in srt
    blocks = [b for b in srt.split("\n\n") if b]
    assert len(blocks) == (len(expected.words) + 1) // 2
    assert " ".join(b.splitlines()[2] for b in blocks) == expected.text
    code, vtt, _ = run_cli(capsys, trained_bundle, "--format", "vtt")
    assert code == 0 and vtt.startswith("WEBVTT\n\n00:00:0") and "." in vtt.splitlines()[2]


def test_cli_bad_word_timing_requests_are_one_line_errors(trained_bundle, capsys, monkeypatch):
    from cohere_coreml.cli import main
    from cohere_coreml.inference import transcribe as module

    clip = str(heldout_utterances(1)[1]["path"])
    with monkeypatch.context() as patch:  # a bundle exported with --alignment-heads none
        patch.setattr(module, "Transcriber", transcriber_without_alignment(module.Transcriber))
        for args in (["--format", "srt"], ["--word-timestamps"], ["--stream", "--no-pace", "--word-timestamps"]):
            code, out, err = run_cli(capsys, trained_bundle, *args)
            assert code == 2 and out == "", args
            assert "exported with --alignment-heads none" in err and "--alignment-heads auto" in err, err
            assert len(err.strip().splitlines()) == 1, err
    for args, message in ((["--json", "--format", "srt"], "two formats"),
                          (["--format", "srt", "--max-words-per-cue", "0"], "--max-words-per-cue"),
                          (["--stream", "--format", "vtt"], "drop --stream")):
        code, out, err = run_cli(capsys, trained_bundle, *args)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (args, err)
    with pytest.raises(SystemExit):  # argparse's choices name the formats
        main(["transcribe", clip, "--bundle", str(trained_bundle), "--language", "en", "--format", "ass"])
    assert "invalid choice: 'ass'" in capsys.readouterr().err
