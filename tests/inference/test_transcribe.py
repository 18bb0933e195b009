"""Transcriber: encoder + stateful decoder packages (FP32 programs, MIL interpreter) vs generate()."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ..fixture_data import AUDIO_DIR, TRAINED_MAX_NEW_TOKENS, audio_manifest, heldout_utterances
from ..helpers import GQA, assert_audio_sensitive, record_decoder_inputs, reference_ids, sensitivity_clips, tiny_model

torch.set_num_threads(1)

MAX_NEW = 22  # -> cache capacity round_up(10 + 22, 32) = 32: a window emits at most 23 tokens
N_COMPARE = 8  # new tokens compared with generate() per window (random weights never emit eos)

SHAPES = {
    # grouped kv heads, encoder width != decoder width
    "gqa": GQA,
    # one kv head, 3 layers, narrow decoder, wide encoder
    "mqa3": dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                 intermediate_size=64, encoder_hidden_size=80, encoder_num_attention_heads=4),
}


def export_bundle(model, processor, out_dir, max_new_tokens=MAX_NEW, prefill=False):
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import MODEL_COMPONENTS, export_model

    settings = ExportSettings(out_dir=out_dir, precision="fp32", model_id="tiny-test")
    export_model(model, processor, settings, MODEL_COMPONENTS, max_new_tokens=max_new_tokens, prefill=prefill)
    return out_dir


@pytest.fixture(scope="module", params=list(SHAPES))
def setup(request, tmp_path_factory):
    """A sensitised random tiny checkpoint of each shape (checked: its tokens depend on the audio)
    and a Transcriber over its FP32 bundle."""
    from cohere_coreml.inference.transcribe import Transcriber

    root = tmp_path_factory.mktemp(f"tr_{request.param}")
    model, processor = tiny_model(root / "ckpt", seed=3, sensitive=True, **SHAPES[request.param])
    assert_audio_sensitive(model, processor, sensitivity_clips())
    bundle = export_bundle(model, processor, root / "bundle")
    return request.param, model, processor, Transcriber(bundle, backend="mil")


def speech_clips():
    """Committed clips with something to transcribe (silence gives an empty transcript, see
    test_silence_is_an_empty_transcript_marked_silent)."""
    return [c for c in audio_manifest() if c["path"].is_file() and c.get("purpose") != "silence"]


def test_tokens_identical_to_generate(setup):
    """Every window of every committed clip: ids identical to generate() (same prompt, max_new_tokens)."""
    from cohere_coreml.model.audio import load_audio, split_points

    name, model, processor, tr = setup
    clips = speech_clips()
    if name != "gqa":
        clips = [c for c in clips if c["file"] in ("en_short.wav", "de_medium.wav", "zh_medium.wav", "tiny_0.05s.wav")]
    else:
        assert len(clips) >= 10 and len({c["language"] for c in clips if c.get("language")}) >= 3
    checked, languages, lengths = 0, set(), set()
    for clip in clips:
        lang = clip.get("language") or "en"
        wav = load_audio(clip["path"])
        punctuation = checked % 2 == 0
        result = tr.transcribe(wav, lang, punctuation=punctuation, max_new_tokens=N_COMPARE)
        prompt = tr.bundle.prompt(lang, punctuation)
        ranges = split_points(wav, tr.front_end)
        assert len(result.windows) == len(ranges)
        for window, (start, end) in zip(result.windows, ranges):
            ref = reference_ids(model, processor, wav[start:end], prompt, N_COMPARE)
            assert window.token_ids == ref, f"{name}: {clip['file']} window {window.index}"
            assert window.stop_reason in ("eos", "max_new_tokens")
            assert window.truncated == (window.stop_reason != "eos")
            checked += 1
        languages.add(lang)
        lengths.add(round(len(wav) / 16000, 1))
    assert checked >= (10 if name == "gqa" else 4)
    if name == "gqa":
        assert len(languages) >= 3 and len(lengths) >= 10


@pytest.mark.parametrize("setup", [pytest.param("gqa")], indirect=True)  # one shape is enough
def test_long_audio_windows_and_join(setup):
    """> 30 s audio: windows at the reference split points, in order (each window's ids are
    generate()'s on that piece, and the pieces give different ids); texts joined like
    CohereAsrProcessor.decode."""
    from cohere_coreml.model.audio import load_audio, split_points

    name, model, processor, tr = setup
    # en_long_75s repeats its speech (two windows give the same ids); the mixed clip has other
    # speech in each window, so a swapped window order shows
    mixed = np.concatenate([np.tile(load_audio(AUDIO_DIR / name), reps)
                            for name, reps in (("en_long.wav", 3), ("fr_medium.wav", 6))])  # 2 windows
    for lang, wav in (("en", load_audio(AUDIO_DIR / "en_long_75s.flac")), ("fr", mixed),
                      ("zh", np.tile(load_audio(AUDIO_DIR / "zh_medium.wav"), 10))):
        result = tr.transcribe(wav, lang, max_new_tokens=N_COMPARE)
        inputs = processor(wav, sampling_rate=16000, language=lang, return_tensors="pt")
        chunk_index = inputs["audio_chunk_index"]
        assert len(result.windows) == len(chunk_index) > 1
        ids = [w.token_ids for w in result.windows]
        if lang == "fr":
            prompt = tr.bundle.prompt(lang)
            pieces = [wav[a:b] for a, b in split_points(wav, tr.front_end)]
            assert ids == [reference_ids(model, processor, p, prompt, N_COMPARE) for p in pieces]
            assert len({tuple(i) for i in ids}) == len(ids), "windows must differ to show their order"
        expected = processor.decode(ids, skip_special_tokens=True, audio_chunk_index=chunk_index, language=lang)[0]
        assert result.text == expected.strip()
        if lang == "zh":
            parts = [w.text for w in result.windows if w.text.strip()]
            assert result.text == "".join([parts[0].rstrip()] + [p.strip() for p in parts[1:]])


def test_cross_memory_masking(setup):
    """Garbage in the padded tail of the cross memory: no effect with the mask, a change without it."""
    from cohere_coreml.model.audio import load_audio, log_mel, pad_to_window

    name, model, processor, tr = setup
    wav = load_audio(AUDIO_DIR / "en_medium.wav")
    feats, n_valid = log_mel(wav, tr.front_end)
    window, n_valid = pad_to_window(feats, n_valid, tr.window_frames)
    enc = tr.encode(window, n_valid)
    prompt = tr.bundle.prompt("en")
    clean = tr.decode(enc, prompt, max_new_tokens=N_COMPARE).token_ids

    mask = np.asarray(enc["cross_mask"]).reshape(-1)
    n_enc = int(np.asarray(enc["encoder_length"]).reshape(-1)[0])
    assert np.all(mask[:n_enc] == 0) and np.all(mask[n_enc:] < 0) and n_enc < mask.size
    rng = np.random.default_rng(0)
    garbage = dict(enc)
    for key in ("cross_k", "cross_v"):
        arr = np.array(enc[key], dtype=np.float32, copy=True)
        arr[:, :, n_enc:, :] = rng.uniform(-1, 1, arr[:, :, n_enc:, :].shape) * 300.0
        garbage[key] = arr
    masked = tr.decode(garbage, prompt, max_new_tokens=N_COMPARE).token_ids
    assert masked == clean
    unmasked = dict(garbage, cross_mask=np.zeros_like(np.asarray(enc["cross_mask"])))
    # bind_memory counts the mask's valid frames: a mask that disagrees with encoder_length is refused
    from cohere_coreml.inference.decoder_runtime import DecoderRuntimeError

    with pytest.raises(DecoderRuntimeError, match="encoder_length"):
        tr.decode(unmasked, prompt, max_new_tokens=N_COMPARE)
    del unmasked["encoder_length"]  # the control: the same broken mask without the length to check it by
    control = tr.decode(unmasked, prompt, max_new_tokens=N_COMPARE, return_log_probs=True)
    ref = tr.decode(garbage, prompt, max_new_tokens=N_COMPARE, return_log_probs=True)
    assert control.token_ids != clean, "the unmasked garbage should change the greedy tokens"
    assert not np.allclose(control.log_probs[0], ref.log_probs[0], atol=1e-2)


def test_capacity_truncates_to_reference_prefix(setup):
    from cohere_coreml.model.audio import load_audio

    name, model, processor, tr = setup
    wav = load_audio(AUDIO_DIR / "fr_medium.wav")
    result = tr.transcribe(wav, "fr")  # no max_new_tokens: decode until eos or the cache is full
    window = result.windows[0]
    assert tr.capacity == 32
    assert window.truncated and result.truncated and window.stop_reason == "capacity"
    assert len(window.token_ids) == tr.capacity - 10 + 1
    ref = reference_ids(model, processor, wav, tr.bundle.prompt("fr"), 40)
    assert len(ref) > len(window.token_ids)
    assert window.token_ids == ref[: len(window.token_ids)]
    # a larger max_new_tokens than the capacity allows still ends at the capacity, without error
    again = tr.transcribe(wav, "fr", max_new_tokens=500).windows[0]
    assert again.token_ids == window.token_ids and again.stop_reason == "capacity"


def test_result_json_and_timings(setup):
    from cohere_coreml.model.audio import load_audio

    name, model, processor, tr = setup
    result = tr.transcribe(load_audio(AUDIO_DIR / "es_short.wav"), "es", max_new_tokens=3)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["language"] == "es" and len(data["windows"]) == 1
    w = data["windows"][0]
    assert len(w["token_ids"]) == 3 and w["truncated"] is True and w["stop_reason"] == "max_new_tokens"
    assert w["timings"]["encoder_s"] > 0 and w["timings"]["decoder_calls"] == 10 + 2


def test_bad_inputs(setup, tmp_path):
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.inference.transcribe import Transcriber, TranscriptionError

    name, model, processor, tr = setup
    with pytest.raises(ValueError, match="Unsupported language"):
        tr.transcribe(np.zeros(16000, np.float32), "xx")
    speech_like = (0.1 * np.sin(np.arange(16000) * 0.07)).astype(np.float32)
    with pytest.raises(TranscriptionError, match="max_new_tokens"):
        tr.transcribe(speech_like, "en", max_new_tokens=0)
    from cohere_coreml.model.audio import AudioError

    with pytest.raises(AudioError, match="NaN"):
        tr.transcribe(np.full(16000, np.nan, np.float32), "en")
    with pytest.raises(AudioError, match="empty"):
        tr.transcribe(np.zeros(0, np.float32), "en")
    with pytest.raises(BundleError, match="manifest.json"):
        Transcriber(tmp_path)
    with pytest.raises(BundleError, match="does not exist"):
        Transcriber(tmp_path / "nope")


def test_silence_is_an_empty_transcript_marked_silent(setup, monkeypatch):
    """The Python API does what `cohere-coreml transcribe` does: digital silence (a file or an
    array) gives an empty transcript marked silent, and no package is called."""
    name, model, processor, tr = setup
    speech = tr.transcribe(AUDIO_DIR / "en_short.wav", "en", max_new_tokens=2)
    assert not speech.silent and speech.windows and not speech.to_dict()["silent"]

    def no_model_call(*args, **kwargs):
        pytest.fail("a package was called on digital silence")

    monkeypatch.setattr(tr, "encode", no_model_call)
    monkeypatch.setattr(tr, "decode", no_model_call)
    for audio in (AUDIO_DIR / "silence_2s.wav", np.zeros(16000, np.float32)):
        result = tr.transcribe(audio, "de", punctuation=False)
        assert result.silent and result.text == "" and result.windows == [] and not result.truncated
        assert result.to_dict() == {"text": "", "language": "de", "punctuation": False, "truncated": False,
                                    "silent": True, "windows": []}


@pytest.fixture(scope="module")
def eos_setup(tmp_path_factory):
    """A tiny checkpoint whose eos logit is raised until greedy decoding ends with eos after a few tokens."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio
    from cohere_coreml.model.checkpoint import load_reference
    from cohere_coreml.model.tokens import prompt_ids
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint, save_checkpoint

    root = tmp_path_factory.mktemp("eos")
    model, processor = load_reference(make_tiny_checkpoint(root / "base", seed=5))
    processor.feature_extractor.dither = 0.0
    wav = load_audio(AUDIO_DIR / "en_medium.wav")
    prompt = prompt_ids(processor.tokenizer, "en")
    eos = model.config.eos_token_id
    base = model.proj_out.bias.detach().clone()
    found = None
    for extra in np.arange(0.0, 3.0, 0.02):
        with torch.no_grad():
            model.proj_out.bias.copy_(base)
            model.proj_out.bias[eos] += float(extra)
        ref = reference_ids(model, processor, wav, prompt, 20)
        if ref and ref[-1] == eos:
            found = ref
            break
    assert found is not None and len(found) >= 2, "could not make an eos-ending checkpoint"
    ckpt = save_checkpoint(model, processor.tokenizer, root / "eos", feature_extractor=processor.feature_extractor)
    model, processor = load_reference(ckpt)
    processor.feature_extractor.dither = 0.0
    bundle = export_bundle(model, processor, root / "bundle")
    return model, processor, Transcriber(bundle, backend="mil"), wav, found


def test_window_stops_at_eos(eos_setup):
    model, processor, tr, wav, ref = eos_setup
    result = tr.transcribe(wav, "en")
    window = result.windows[0]
    assert window.token_ids == ref
    assert window.stop_reason == "eos" and window.truncated is False and not result.truncated
    from cohere_coreml.model.tokens import decode_ids

    assert window.text == decode_ids(processor.tokenizer, ref[:-1])


@pytest.fixture(scope="module")
def prefill_bucket_setup(tmp_path_factory):
    """A sensitised random tiny checkpoint (GQA) and its FP32 bundle with the prompt prefill function AND a
    5 s encoder bucket (35 s + 5 s windows): the prefill test and the bucket test each check their own
    part of it (the decoder's functions, the encoder's), one export instead of two."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import MODEL_COMPONENTS, export_model

    root = tmp_path_factory.mktemp("prefill_bucket")
    model, processor = tiny_model(root / "ckpt", seed=4, sensitive=True, **GQA)
    settings = ExportSettings(out_dir=root / "bundle", precision="fp32", model_id="tiny-test")
    export_model(model, processor, settings, MODEL_COMPONENTS, max_new_tokens=MAX_NEW, prefill=True, buckets=[5.0])
    return model, processor, root / "bundle"


def test_prefill_function_gives_the_same_tokens(prefill_bucket_setup):
    """A bundle with the prompt prefill function: 1 call instead of 10 for the prompt, same tokens."""
    from cohere_coreml.bundle.load import Bundle
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio
    from cohere_coreml.runtime import read_package

    model, processor, bundle = prefill_bucket_setup
    # host-state, with the default export's batched step (here on grouped-query heads, gated in fp32)
    assert set(read_package(bundle / "decoder.mlpackage").function_names) == {"main", "prefill", "step_batch"}
    parity = json.loads((bundle / "decoder.parity.json").read_text())
    assert parity["passed"] and parity["prefill"]["passed"] and parity["prefill"]["argmax_agree"] >= 2
    assert parity["batch"]["passed"]
    manifest = Bundle.load(bundle).manifest["decoder"]
    assert manifest["functions"] == {"step": "main", "bind": None, "prefill": "prefill", "step_batch": "step_batch"}
    assert manifest["prefill_length"] == 10
    assert manifest["prefill_io"]["inputs"] == {"input_ids": {"shape": [1, 10], "dtype": "int32"}}
    with_prefill = Transcriber(bundle, backend="mil")
    without = Transcriber(bundle, backend="mil", use_prefill=False)
    assert with_prefill.prefill is not None and without.prefill is None
    refs = set()
    for clip, lang in (("en_medium.wav", "en"), ("de_short.wav", "de"), ("zh_medium.wav", "zh")):
        wav = load_audio(AUDIO_DIR / clip)
        a = with_prefill.transcribe(wav, lang, max_new_tokens=N_COMPARE).windows[0]
        b = without.transcribe(wav, lang, max_new_tokens=N_COMPARE).windows[0]
        ref = reference_ids(model, processor, wav, with_prefill.bundle.prompt(lang), N_COMPARE)
        assert a.token_ids == b.token_ids == ref, clip
        assert a.timings["decoder_calls"] == 1 + (N_COMPARE - 1)
        assert b.timings["decoder_calls"] == 10 + (N_COMPARE - 1)
        refs.add(tuple(ref))
    assert len(refs) == 3, "the fixture's tokens must depend on the clip"


def test_length_bucketed_encoder(prefill_bucket_setup):
    """A multifunction encoder (35 s + 5 s windows): short clips use the 5 s function, same tokens."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio

    model, processor, bundle = prefill_bucket_setup
    tr = Transcriber(bundle, backend="mil")
    assert list(tr.encoder_buckets.items()) == [("window_5s", 500), ("main", 3500)]  # smallest first
    refs = set()
    for clip, lang, expected_fn in (("en_short.wav", "en", "window_5s"), ("es_medium.wav", "es", "window_5s"),
                                    ("en_long.wav", "en", "main")):
        wav = load_audio(AUDIO_DIR / clip)
        window = tr.transcribe(wav, lang, max_new_tokens=N_COMPARE).windows[0]
        assert window.timings["encoder_function"] == expected_fn, clip
        ref = reference_ids(model, processor, wav, tr.bundle.prompt(lang), N_COMPARE)
        assert window.token_ids == ref, clip
        refs.add(tuple(ref))
    assert len(refs) == 3, "the fixture's tokens must depend on the clip"


# --- the trained default model, exported fp16 once per run (conftest.trained_bundle) ------------


@pytest.fixture(scope="module")
def trained(trained_reference, trained_bundle):
    from cohere_coreml.inference.transcribe import Transcriber

    model, processor = trained_reference
    return model, processor, Transcriber(trained_bundle, backend="mil")


# Held-out file -> generate()'s ids (the processor's prompt with punctuation, TRAINED_MAX_NEW_TOKENS + 1), and
# -> the session bundle's ids (the module's `trained` Transcriber): the tests below compare other variants with
# the same two, which each clip then costs once per module, not once per test.
_TRAINED_REFS: dict[str, list[int]] = {}
_TRAINED_IDS: dict[str, list[int]] = {}


def trained_ref(model, processor, u, wav) -> list[int]:
    if u["file"] not in _TRAINED_REFS:
        prompt = processor.get_decoder_prompt_ids(language=u["language"], punctuation=True)
        _TRAINED_REFS[u["file"]] = reference_ids(model, processor, wav, prompt, TRAINED_MAX_NEW_TOKENS + 1)
    return _TRAINED_REFS[u["file"]]


def trained_ids(tr, u, wav) -> list[int]:
    """The session bundle's ids (`tr`: the `trained` fixture's Transcriber)."""
    if u["file"] not in _TRAINED_IDS:
        _TRAINED_IDS[u["file"]] = tr.transcribe(wav, u["language"]).windows[0].token_ids
    return _TRAINED_IDS[u["file"]]


def test_trained_heldout_tokens_identical_to_generate(trained):
    """Held-out clips (3 per language) through the fp16 bundle with buckets and prefill, as users run
    it: ids identical to generate() with the processor's own prompt. Sensitivity first: the
    transcripts differ from clip to clip and from a zero-memory run."""
    from cohere_coreml.model.audio import load_audio

    model, processor, tr = trained
    utterances = heldout_utterances(per_language=3)
    waves = [load_audio(u["path"]) for u in utterances]
    assert_audio_sensitive(model, processor, waves[:3], language="en")
    parity = json.loads((tr.bundle.paths["decoder"].parent / "decoder.parity.json").read_text())
    assert parity["passed"] and parity["discriminates"], parity["controls"]
    assert tr.prefill is not None and list(tr.encoder_buckets) == ["window_2s", "main"]
    functions, matched = set(), 0
    for u, wav in zip(utterances, waves):
        window = tr.transcribe(wav, u["language"]).windows[0]
        _TRAINED_IDS[u["file"]] = window.token_ids
        ref = trained_ref(model, processor, u, wav)
        assert window.token_ids == ref, u["file"]
        assert window.stop_reason == "eos" and window.timings["decoder_calls"] == len(ref)  # 1 prefill + fed
        functions.add(window.timings["encoder_function"])
        matched += window.text == u["text"]
    assert functions == {"window_2s", "main"}
    assert matched >= len(utterances) // 2  # real transcripts, not just agreeing noise


@pytest.fixture(scope="module")
def trained_graph_bundle(trained_reference, trained_bundle, tmp_path_factory):
    """The session bundle (host-state decoder, the default) with a graph-state decoder instead: its
    encoder and front end are the session bundle's (copied), its decoder exported with
    --decoder-state graph."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.pipeline import export_model

    from ..fixture_data import TRAINED_BUCKETS, TRAINED_WINDOW_S
    from ..helpers import copy_packages

    model, processor = trained_reference
    out = copy_packages(trained_bundle, tmp_path_factory.mktemp("trained-graph") / "bundle",
                         ("encoder", "frontend", "vad"))
    settings = ExportSettings(out_dir=out, precision="fp16", model_id="cohere-tiny-synth", window_seconds=TRAINED_WINDOW_S)
    export_model(model, processor, settings, max_new_tokens=TRAINED_MAX_NEW_TOKENS, buckets=TRAINED_BUCKETS,
                 prefill=True, decoder_state="graph")
    return out


def test_both_decoder_state_variants_give_generates_tokens(trained, trained_graph_bundle):
    """The host-state decoder (the session bundle) and the graph-state one (same encoder): on held-out
    clips (3 per language, beam search on one of them too) both give generate()'s ids; the manifests say
    which variant each is, and only the graph one has bind_memory."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio
    from cohere_coreml.runtime import read_package

    model, processor, host = trained
    graph = Transcriber(trained_graph_bundle, backend="mil")
    assert host.bundle.manifest["decoder"]["state_writes"] == "host" and host.decoder.host
    assert graph.bundle.manifest["decoder"]["state_writes"] == "graph" and not graph.decoder.host
    assert "bind_memory" in read_package(graph.bundle.paths["decoder"]).function_names
    assert "bind_memory" not in read_package(host.bundle.paths["decoder"]).function_names
    for u in heldout_utterances(per_language=3):
        wav = load_audio(u["path"])
        ref = trained_ref(model, processor, u, wav)
        assert trained_ids(host, u, wav) == ref, (u["file"], host.decoder.state_writes)
        assert graph.transcribe(wav, u["language"]).windows[0].token_ids == ref, (u["file"], graph.decoder.state_writes)
    wav = load_audio(heldout_utterances(per_language=1)[0]["path"])
    beams = [tr.transcribe(wav, "en", beams=3).windows[0].token_ids for tr in (host, graph)]
    assert beams[0] == beams[1]


def test_encoder_in_parts_gives_generates_tokens(trained, trained_parts_bundle):
    """The encoder as 2 programs (encoder.mlpackage: subsampling + layers 0-1, encoder_part2.mlpackage: layers
    2-3 + the memory projections), chained by the transcriber: on held-out clips (3 per language, both
    buckets) the ids equal generate()'s and the whole-encoder bundle's, and the encoder memory too."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio

    model, processor, whole = trained
    parts = Transcriber(trained_parts_bundle, backend="mil")
    assert [p["layers"] for p in parts.bundle.manifest["encoder"]["parts"]] == [[0, 2], [2, 4]]
    assert parts.encoders.parts == 2 and whole.encoders.parts == 1
    functions = set()
    for u in heldout_utterances(per_language=3):
        wav = load_audio(u["path"])
        ref = trained_ref(model, processor, u, wav)
        window = parts.transcribe(wav, u["language"]).windows[0]
        assert window.token_ids == ref == trained_ids(whole, u, wav), u["file"]
        functions.add(window.timings["encoder_function"])
        feats, n, _ = parts.features(wav)
        a, b = parts.encode(feats, n), whole.encode(feats, n)
        assert all(np.array_equal(a[k], b[k]) for k in ("cross_k", "cross_v", "cross_mask", "encoder_length"))
    assert functions == {"window_2s", "main"}


@pytest.mark.parametrize("front_end", ["python", "package"])
def test_a_window_no_encoder_function_holds_is_refused(trained, trained_bundle, front_end):
    """The bucket is `shapes.choose_bucket`'s: a window one hop longer than the full window raises
    WindowTooLongError (it used to fall back to "main" silently), one exactly as long runs on "main"."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.shapes import WindowTooLongError

    _, _, python = trained
    tr = python if front_end == "python" else Transcriber(trained_bundle, backend="mil", front_end="package")
    prompt = tr.prompt("en")
    hop = tr.front_end.hop_length
    rng = np.random.default_rng(0)
    full = (0.1 * rng.standard_normal(tr.window_frames * hop)).astype(np.float32)  # exactly the full window
    window = tr.transcribe_window(full, prompt, max_new_tokens=2)
    assert window.timings["encoder_function"] == "main" and len(window.token_ids) <= 2
    longer = np.concatenate([full, full[:hop]])  # one mel frame more than any function holds
    with pytest.raises(WindowTooLongError, match=f"{tr.window_frames + 1} mel frames do not fit"):
        tr.transcribe_window(longer, prompt, max_new_tokens=2)


def test_transcriber_is_an_engine_and_decode_returns_a_result(trained):
    """One face: the Transcriber is the bundle Engine (bench and the CLI run it as is); `decode` returns a
    DecodeResult whose stop reason is a StopReason that JSON writes as its string."""
    from cohere_coreml.inference.decoding import DecodeResult, StopReason
    from cohere_coreml.inference.engines import Engine
    from cohere_coreml.model.audio import load_audio, log_mel, pad_to_window
    from cohere_coreml.model.shapes import ShapeError

    _, _, tr = trained
    assert isinstance(tr, Engine) and tr.kind == "bundle" and tr.name == str(tr.bundle.dirs[0])
    described = tr.describe()
    assert described["backend"] == "mil" and described["compute_units"] is None and described["prefill"] is True
    feats, n = log_mel(load_audio(heldout_utterances(per_language=1)[0]["path"]), tr.front_end)
    fn = "window_2s" if n <= tr.encoder_buckets["window_2s"] else "main"
    enc = tr.encode(*pad_to_window(feats, n, tr.encoder_buckets[fn]))
    full = tr.decode(enc, tr.prompt("en"))
    cut = tr.decode(enc, tr.prompt("en"), max_new_tokens=2)
    assert isinstance(full, DecodeResult) and full.stop_reason is StopReason.EOS and not full.truncated
    assert cut.stop_reason is StopReason.MAX_NEW_TOKENS and cut.truncated and cut.token_ids == full.token_ids[:2]
    assert json.dumps([cut.stop_reason, full.stop_reason]) == '["max_new_tokens", "eos"]'
    assert cut.calls == 1 + 1 and cut.steps == len(tr.prompt("en")) + 1 and cut.log_probs is None
    with pytest.deprecated_call():  # the old dict access, kept for one release
        assert cut["token_ids"] == cut.token_ids and cut["truncated"] is True
    with pytest.raises(ShapeError, match="match no encoder function"):
        tr.encode(feats[:, :123], 100)  # 123 frames: no function has that window


@pytest.mark.parametrize("use_prefill", [True, False])
def test_decoder_receives_the_processor_prompt(trained_bundle, trained_reference, use_prefill):
    """The ids the decoder package is fed equal CohereAsrProcessor.get_decoder_prompt_ids for the
    requested language and punctuation mode (the reference is transformers', not our prompt code),
    and the prompt changes the output."""
    from cohere_coreml.inference.transcribe import Transcriber
    from cohere_coreml.model.audio import load_audio

    _, processor = trained_reference
    tr = Transcriber(trained_bundle, backend="mil", use_prefill=use_prefill)
    step, prefill, bind = record_decoder_inputs(tr)
    binds = []  # windows whose memory was written: through bind_memory (graph) or by the host (host)
    real_bind = tr.decoder.bind

    def counted_bind(state, memory, *args, **kwargs):
        binds.append(sorted(k for k in memory if k.startswith("cross")))
        return real_bind(state, memory, *args, **kwargs)

    tr.decoder.bind = counted_bind
    wav = load_audio(heldout_utterances(per_language=1)[0]["path"])
    outputs = set()
    for lang in ("en", "de", "es", "fr", "ja", "zh"):
        for punctuation in (True, False):
            step.calls.clear()
            bind.inputs.clear()
            binds.clear()
            if prefill is not None:
                prefill.calls.clear()
            result = tr.transcribe(wav, lang, punctuation=punctuation, max_new_tokens=4)
            # one window: the cross memory bound once; every step bound only the token and its position (and,
            # host-state decoder, the cache mask); bind_memory only in a graph-state decoder
            assert binds == [["cross_k", "cross_mask", "cross_v"]]
            if tr.decoder.host:
                assert bind.inputs == [] and set(map(tuple, step.inputs)) == {("cache_mask", "input_ids", "position")}
            else:
                assert bind.inputs == [["encoder_cross_k", "encoder_cross_mask", "encoder_cross_v"]]
                assert set(map(tuple, step.inputs)) == {("input_ids", "position")}
            expected = processor.get_decoder_prompt_ids(language=lang, punctuation=punctuation)
            if use_prefill:
                assert prefill.calls == [expected], (lang, punctuation)
                fed = step.calls
            else:
                assert [c for c in step.calls[:len(expected)]] == [[t] for t in expected], (lang, punctuation)
                fed = step.calls[len(expected):]
            assert [c[0] for c in fed] == result.windows[0].token_ids[:len(fed)]  # then its own predictions
            outputs.add(tuple(result.windows[0].token_ids))
    assert len(outputs) >= 3, "the prompt must change the transcript for this check to mean anything"


def test_one_transcriber_shared_by_threads_gives_the_sequential_results(trained):
    """Threads sharing one Transcriber get exactly the sequential transcripts, and its calls never
    overlap (the documented lock): the probe counts decode calls running at once."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from cohere_coreml.model.audio import load_audio

    _, _, tr = trained
    utterances = heldout_utterances(per_language=2)
    waves = [load_audio(u["path"]) for u in utterances]
    sequential = [tr.transcribe(w, u["language"]).windows[0].token_ids for w, u in zip(waves, utterances)]
    assert len({tuple(t) for t in sequential}) == len(sequential)  # the clips differ: a mix-up would show
    inside, most, guard = [0], [0], threading.Lock()
    original = type(tr).decode.__wrapped__  # the method without the lock: the probe sits inside it

    def probe(self, *args, **kwargs):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            return original(self, *args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    tr.decode = probe.__get__(tr)  # instance attribute: transcribe_window's self.decode, still under the lock
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda i: tr.transcribe(waves[i], utterances[i]["language"]).windows[0].token_ids,
                                    list(range(len(waves))) * 2))
    finally:
        del tr.decode
    assert results == sequential * 2
    assert most[0] == 1
