"""Streaming with a voice-activity model (docs/vad.md): segments opened and closed by the stream rule
(`StreamVad`, silero-vad's VADIterator) over the model's probability per 32 ms chunk, the energy segmenter's
maximum and cut, finals equal to the offline transcription of their segments, updates independent of the
chunking."""

from __future__ import annotations

import numpy as np
import pytest

from cohere_coreml.inference.engines import VadUnavailableError
from cohere_coreml.inference.speech_regions import StreamVad, VadOptions
from cohere_coreml.inference.streaming import StreamingError, VadSegmenter, stream_array
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.inference.vad import TorchVad
from cohere_coreml.model.audio import FrontEndConfig, load_audio, split_points

from ..fixture_data import heldout_utterances
from ..helpers import EnergyVad, tones

SR = 16000
FRAME = 160


def vad_segments(x, vad, options=VadOptions(), max_segment=35 * SR, fe=None, block=1600):
    """(kind, start, end, decided at) of every segment the VAD segmenter closes or cuts, the audio added in
    blocks of `block` samples and the frames pushed as they complete."""
    fe = fe or FrontEndConfig()
    seg = VadSegmenter(vad.stream(), options, fe, max_segment)
    out, frames = [], 0
    for i in range(0, x.size, block):
        seg.add(x[i : i + block])
        while (frames + 1) * FRAME <= min(i + block, x.size):
            frames += 1
            event = seg.push(0.0, lambda a, b: x[a:b])
            if event is not None and event.kind != "open":
                out.append((event.kind, event.start, event.end, event.frame_end))
    last = seg.finish(x.size)
    if last is not None:
        out.append((last.kind, last.start, last.end, last.frame_end))
    return out


def rule_segments(probs, options=VadOptions()):
    """The stream rule's (start, end) pairs over whole probabilities."""
    rule, out, start = StreamVad(options), [], None
    for p in probs:
        event = rule.push(p)
        if event and event[0] == "start":
            start = event[1]
        elif event:
            out.append((start, event[1]))
    return out


SPANS = [(0.5, 1.5), (1.6, 2.4), (3.5, 4.0), (6.0, 7.2)]


def test_segments_are_the_stream_rules_events_at_frame_boundaries():
    x = tones(SPANS, 8.0)
    found = vad_segments(x, EnergyVad())
    assert [(s, e) for _, s, e, _ in found] == rule_segments(EnergyVad().probabilities(x))
    assert [k for k, *_ in found] == ["close"] * 3, "the 0.1 s gap inside the first span is bridged"
    for (_, s, e, decided), (a, b) in zip(found, [(0.5, 2.4), (3.5, 4.0), (6.0, 7.2)]):
        assert s <= a * SR < b * SR <= e and decided % FRAME == 0 and e <= decided
    for block in (1, 333, 7777):  # the chunking never moves a decision
        assert vad_segments(x, EnergyVad(), block=block) == found


def test_a_long_segment_is_cut_where_the_energy_segmenter_cuts():
    x = tones([(0.5, 9.0)], 10.0, seed=1)
    x[int(2.0 * SR) : int(2.05 * SR)] *= 0.01  # a dip: shorter than min_silence, the VAD stays in speech
    fe = FrontEndConfig(max_audio_clip_s=3.0, overlap_chunk_second=1.0)
    found = vad_segments(x, EnergyVad(), max_segment=3 * SR, fe=fe)
    assert [k for k, *_ in found[:-1]] == ["cut"] * (len(found) - 1) and found[-1][0] == "close"
    start, cut = found[0][1], found[0][2]
    assert cut == start + split_points(x[start:], fe)[0][1]
    assert all(nxt[1] == prev[2] for prev, nxt in zip(found, found[1:]))  # continues at the cut
    assert all(e - s <= 3 * SR for _, s, e, _ in found)


def test_a_segment_without_a_closing_event_ends_with_the_audio():
    x = tones([(0.5, 3.0)], 3.0)
    found = vad_segments(x, EnergyVad())
    assert found == [("close", found[0][1], x.size, x.size)]


def test_an_end_decided_after_the_last_whole_frame_closes_at_its_own_sample():
    x = tones([(0.5, 1.5)], 3.0)
    probs = EnergyVad().probabilities(x)
    rule = StreamVad(VadOptions())
    decided, end = next((i + 1, e[1]) for i, p in enumerate(probs) if (e := rule.push(p)) and e[0] == "end")
    total = decided * 512  # the audio stops at the chunk that decides the end
    assert total % FRAME, "the decision must fall after the last whole frame"
    found = vad_segments(x[:total], EnergyVad())
    assert [(k, e, at) for k, _, e, at in found] == [("close", end, total)]


@pytest.fixture(scope="module")
def vad_transcriber(trained_bundle):
    """The session bundle's Transcriber with the PyTorch VAD as its VAD (the rule's oracle scores with it)."""
    tr = Transcriber(trained_bundle, backend="mil")
    tr._vad = TorchVad()
    return tr


@pytest.fixture(scope="module")
def dictation():
    """Three held-out English utterances with 1.2 s pauses of noise between them."""
    rng = np.random.default_rng(7)
    pieces = [rng.normal(0.0, 2e-3, int(0.8 * SR)).astype(np.float32)]
    for u in heldout_utterances(3)[3:6]:
        assert u["language"] == "en"
        pieces += [load_audio(u["path"]), rng.normal(0.0, 2e-3, int(1.2 * SR)).astype(np.float32)]
    return np.concatenate(pieces)


def test_stream_with_the_vad(vad_transcriber, dictation):
    tr = vad_transcriber
    updates, stats = stream_array(tr, dictation, 1600, "en", vad="on")
    finals = [u for u in updates if u.type == "final"]
    probs = TorchVad().probabilities(dictation)
    expected = rule_segments(probs)
    assert len(finals) == len(expected) >= 3
    for f, (s, e) in zip(finals, expected):
        assert (round(f.start * SR), round(f.end * SR)) == (s, e)
        samples = dictation[s:e]
        assert f.token_ids == [t for w in tr.transcribe(samples, "en", vad="off").windows for t in w.token_ids
                               if t not in tr.eos_ids]
    assert stats.finals == len(finals) and stats.encoder_calls == stats.partials + stats.finals
    other, _ = stream_array(tr, dictation, 7777, "en", vad="on")
    assert [u.to_dict() for u in other] == [u.to_dict() for u in updates]


def test_vad_modes_of_the_stream(vad_transcriber, trained_bundle_without_vad, dictation):
    plain = Transcriber(trained_bundle_without_vad, backend="mil")  # no VAD: auto is the energy segmenter
    piece = dictation[: 3 * SR]
    auto, _ = stream_array(plain, piece, 1600, "en")
    off, _ = stream_array(vad_transcriber, piece, 1600, "en", vad="off")
    assert [u.to_dict() for u in auto] == [u.to_dict() for u in off]
    with pytest.raises(VadUnavailableError, match="has no vad.mlpackage"):
        plain.stream("en", vad="on")
    with pytest.raises(ValueError, match="vad must be one of"):
        plain.stream("en", vad="maybe")
    with pytest.raises(StreamingError, match="at 16000 Hz"):
        VadSegmenter(EnergyVad().stream(), VadOptions(), FrontEndConfig(sampling_rate=8000), 35 * SR)
