"""bench: per-clip problems reported while the rest is scored; rates, stage sums; JSON/Markdown/PNG outputs."""

from __future__ import annotations

import json

import pytest

from cohere_coreml.bench import format_markdown, run_engine, write_outputs
from cohere_coreml.datasets import load_folder
from cohere_coreml.engines import Engine
from cohere_coreml.transcribe import WindowResult

from .conftest import AUDIO_DIR

TEXTS = {"en_short.wav": "call tom now", "de_short.wav": "ruf anna an", "es_short.wav": "hola"}


class ScriptedEngine(Engine):
    """Answers from a table keyed by clip length; one clip loops until its token limit."""

    kind, name, load_s = "fake", "scripted", 0.0

    def __init__(self, answers):
        from cohere_coreml.audio import FrontEndConfig

        self.front_end, self.eos_ids, self.answers = FrontEndConfig(), {3}, answers

    def prompt(self, language, punctuation=True):
        return [1]

    def transcribe_window(self, waveform, prompt, *, index, start_s, max_new_tokens, beams, repetition_guard):
        text, tokens, reason = self.answers[len(waveform)]
        timings = {"features_s": 0.01, "encoder_s": 0.02, "prompt_s": 0.03, "decode_s": 0.04, "decoder_calls": 5}
        return WindowResult(index, start_s, len(waveform) / 16000, tokens, text, reason != "eos", reason, timings,
                            {"beams": beams, "repetition": None})


@pytest.fixture
def folder(tmp_path):
    import soundfile as sf

    from cohere_coreml.audio import load_audio

    for name in TEXTS:
        (tmp_path / name).write_bytes((AUDIO_DIR / name).read_bytes())
    (tmp_path / "silence.wav").write_bytes((AUDIO_DIR / "silence_2s.wav").read_bytes())
    (tmp_path / "broken.wav").write_bytes(b"RIFF" + b"z" * 100)
    entries = [{"audio": n, "text": t, "language": n[:2]} for n, t in TEXTS.items()]
    entries += [{"audio": "silence.wav", "text": "nothing", "language": "en"},
                {"audio": "gone.wav", "text": "x", "language": "en"},
                {"audio": "en_short.wav", "text": " ", "language": "en"},
                {"audio": "broken.wav", "text": "y", "language": "de"}]
    (tmp_path / "manifest.jsonl").write_text("\n".join(json.dumps(e) for e in entries))
    lengths = {n: load_audio(tmp_path / n).size for n in TEXTS}
    loop = [7, 8] * 10
    answers = {lengths["en_short.wav"]: ("Call Tom now.", [5, 6, 3], "eos"),
               lengths["de_short.wav"]: ("ruf emma an", [5, 6, 7, 3], "eos"),
               lengths["es_short.wav"]: ("hola hola", loop, "max_new_tokens")}
    return tmp_path, answers


def test_problem_clips_reported_rest_scored(folder):
    path, answers = folder
    dataset = load_folder(path)
    section = run_engine(lambda: ScriptedEngine(answers), dataset, warmup=True)
    assert section["clips_total"] == 7 and section["clips_scored"] == 4 and section["clips_silent"] == 1
    problems = {p["id"]: p["problem"] for p in section["problems"]}
    assert set(problems) == {"gone.wav", "en_short.wav", "broken.wav"}
    assert "not found" in problems["gone.wav"] and "cannot decode" in problems["broken.wav"]
    assert "empty reference" in problems["en_short.wav"]
    en, de, es = (section["languages"][l] for l in ("en", "de", "es"))
    assert en["rate"] == 0.25 and en["deletions"] == 1  # "Call Tom now." right; silence -> "" vs "nothing"
    assert de["substitutions"] == 1 and de["rate"] == pytest.approx(1 / 3)
    assert es["insertions"] == 1 and es["rate"] == 1.0
    assert section["windows"] == 3
    assert section["loop_rate"] == pytest.approx(1 / 3) and section["truncation_rate"] == pytest.approx(1 / 3)
    assert section["stages_s"]["encoder_s"] == pytest.approx(0.06)
    assert section["decode_tokens"] == 2 + 3 + 20
    assert section["first_run_s"] is not None and section["rtfx"] > 0
    clip = next(c for c in section["clips"] if c["id"] == "de_short.wav")
    assert clip["windows"][0]["start_s"] == 0.0 and clip["windows"][0]["end_s"] > 0.5


def test_outputs(folder, tmp_path):
    path, answers = folder
    section = run_engine(lambda: ScriptedEngine(answers), load_folder(path))
    report = {"tool_version": "0", "tool_git_hash": "abc", "machine": {"platform": "x", "cpus": 2},
              "dataset": {"name": str(path), "manifest_sha256": "f" * 64},
              "engines": [{"label": "ref", **section}, {"label": "f16", "bundle": {"size_mb": 5.0}, **section}]}
    md = format_markdown(report)
    assert "| ref | - | 33.33 | 25.00 | 100.00 |" in md
    paths = write_outputs(report, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["engines"][1]["bundle"]["size_mb"] == 5.0
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_agreement_with_the_reference(folder):
    """Token agreement counts identical clips and same-position tokens on the clips both engines
    transcribed; a changed token in one clip shows in both counts, and the Markdown table."""
    from cohere_coreml.bench import agreement_with

    path, answers = folder
    dataset = load_folder(path)
    ref = {"label": "pytorch", **run_engine(lambda: ScriptedEngine(answers), dataset)}
    same = {"label": "f16", **run_engine(lambda: ScriptedEngine(answers), dataset)}
    changed = dict(answers)
    de = next(k for k, v in answers.items() if v[0] == "ruf emma an")
    changed[de] = ("ruf anna an", [5, 9, 7, 3], "eos")
    other = {"label": "q4", **run_engine(lambda: ScriptedEngine(changed), dataset)}
    assert agreement_with(ref, same) == {"reference": "pytorch", "clips": 3, "identical_clips": 3,
                                         "baseline_tokens": 3 + 4 + 20, "agreeing_tokens": 27}
    a = agreement_with(ref, other)
    assert a["identical_clips"] == 2 and a["agreeing_tokens"] == 26 and a["baseline_tokens"] == 27
    other["agreement"] = a
    report = {"tool_version": "0", "tool_git_hash": "abc", "machine": {"platform": "x", "cpus": 2},
              "dataset": {"name": str(path), "manifest_sha256": "f" * 64}, "engines": [ref, other]}
    assert "| 2/3, 26/27 |" in format_markdown(report)


def test_pytorch_wer_equals_evaluate():
    """The bench's PyTorch rows and the dev evaluation (`evaluate_checkpoint`) score the same
    transcripts with the same metric: per-language WER identical, on the held-out set. Windows are
    cut at 4 tokens so that every language has errors to count (the full transcripts are near perfect)."""
    from cohere_coreml.bench import run_bench
    from cohere_coreml_dev.evaluate import evaluate_checkpoint

    from .conftest import HELDOUT_DIR, TRAINED_MODEL

    report = run_bench([], TRAINED_MODEL, HELDOUT_DIR, limit_per_language=2, max_new_tokens=4)
    languages = report["engines"][0]["languages"]
    evaluated = evaluate_checkpoint(TRAINED_MODEL, HELDOUT_DIR, limit_per_language=2, max_new_tokens=4)
    assert set(languages) == set(evaluated) and len(languages) >= 3
    assert all(languages[l]["clips"] == evaluated[l].clips == 2 for l in languages)
    assert {l: v["rate"] for l, v in languages.items()} == {l: r.wer for l, r in evaluated.items()}
    assert all(v["rate"] > 0 and v["deletions"] > 0 for v in languages.values())
