"""bench: per-clip problems reported while the rest is scored; rates, stage sums; JSON/Markdown/PNG outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cohere_coreml.evaluation.bench import format_markdown, run_engine, write_outputs
from cohere_coreml.evaluation.datasets import load_folder
from cohere_coreml.inference.engines import Engine
from cohere_coreml.inference.transcribe import WindowResult

from ..fixture_data import AUDIO_DIR

TEXTS = {"en_short.wav": "call tom now", "de_short.wav": "ruf anna an", "es_short.wav": "hola"}


class ScriptedEngine(Engine):
    """Answers from a table keyed by clip length; one clip loops until its token limit."""

    kind, name, load_s = "fake", "scripted", 0.0

    def __init__(self, answers):
        from cohere_coreml.model.audio import FrontEndConfig

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

    from cohere_coreml.model.audio import load_audio

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
    # each rate with its 95 % bootstrap interval over the clips: en pools a right clip (3 words) and a
    # silent one ("nothing" deleted): resampling gives 0 % (the right one twice) to 100 %
    assert "| ref | - | 33.33 [33.33-33.33] | 25.00 [0.00-100.00] | 100.00 [100.00-100.00] |" in md
    paths = write_outputs(report, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["engines"][1]["bundle"]["size_mb"] == 5.0
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_agreement_with_the_reference(folder):
    """Token agreement counts identical clips and same-position tokens on the clips both engines
    transcribed; a changed token in one clip shows in both counts, and the Markdown table."""
    from cohere_coreml.evaluation.bench import agreement_with

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
    from cohere_coreml.evaluation.bench import run_bench
    from cohere_coreml_dev.evaluate import evaluate_checkpoint

    from ..fixture_data import HELDOUT_DIR, TRAINED_MODEL

    report = run_bench([], TRAINED_MODEL, HELDOUT_DIR, limit_per_language=2, max_new_tokens=4)
    languages = report["engines"][0]["languages"]
    evaluated = evaluate_checkpoint(TRAINED_MODEL, HELDOUT_DIR, limit_per_language=2, max_new_tokens=4)
    assert set(languages) == set(evaluated) and len(languages) >= 3
    assert all(languages[l]["clips"] == evaluated[l].clips == 2 for l in languages)
    assert {l: v["rate"] for l, v in languages.items()} == {l: r.wer for l, r in evaluated.items()}
    assert all(v["rate"] > 0 and v["deletions"] > 0 for v in languages.values())


def swift_json(section: dict, dataset, *, eos=(3,), sha=None) -> dict:
    """The JSON `cohere-transcribe-swift bench` writes (docs/swift.md, "Measuring on a device"), built from
    the clip rows of a run: per clip its status, audio and processing seconds, hypothesis, and per window
    the token ids (eos included), stop reason and stage timings."""
    clips = []
    for index, c in enumerate(section["clips"]):
        row = {"index": index, "id": c["id"], "language": c["language"], "status": c["status"]}
        if c["status"] == "problem":
            row["problem"] = c["problem"]
        else:
            row.update(audio_s=c["audio_s"], processing_s=c.get("processing_s", 0.0), hypothesis=c["hypothesis"])
            row["windows"] = []
            flat = list(c.get("token_ids", []))
            for w in c["windows"]:
                n = w["tokens"] + (1 if w["stop_reason"] == "eos" else 0)
                ids, flat = flat[:n], flat[n:]
                row["windows"].append({"index": w["index"], "start_s": w["start_s"], "end_s": w["end_s"],
                                       "token_ids": ids, "stop_reason": w["stop_reason"],
                                       **{k: w[k] for k in ("features_s", "encoder_s", "prompt_s", "decode_s",
                                                            "decoder_calls")}})
            row["token_ids"] = [w["token_ids"] for w in row["windows"]]
            row["stop_reasons"] = [w["stop_reason"] for w in row["windows"]]
        clips.append(row)
    return {"tool": "cohere-transcribe-swift bench", "format_version": 1, "runtime": "coreml",
            "compute_units": {"flag": "cpu_and_ne", "front_end": "cpu_and_ne", "encoder": "cpu_and_ne",
                              "decoder": "cpu_and_ne"},
            "machine": {"platform": "macOS", "device": "Mac14,2", "chip": "Apple M2", "os": "macOS", "os_version": "15.1"},
            "dataset": {"name": str(dataset.name), "manifest": dataset.manifest_path,
                        "manifest_sha256": sha or dataset.manifest_sha256},
            "bundle": {"dir": "/x/f16", "manifest_sha256": "a" * 64, "precision": "fp16", "size_mb": 6.5,
                       "eos_token_ids": list(eos), "prefill": True, "capacity": 64},
            "options": {"max_new_tokens": None, "beams": 1, "repetition_guard": False, "max_clips": None},
            "load": {"cold_s": 12.5, "warm_s": 1.25}, "first_run_s": 0.5,
            "memory": {"measure": "phys_footprint", "before_load_mb": 10.0, "after_load_mb": 400.0, "peak_mb": 512.0},
            "placement": {"functions": [{"package": "encoder.mlpackage", "function": "main", "ops": 10,
                                         "cost_share": {"neural_engine": 0.9, "gpu": 0.0, "cpu": 0.1},
                                         "not_on_neural_engine": [{"operator": "ios18.gather", "outputs": ["g"],
                                                                   "cost": 0.1, "device": "cpu"}]}]},
            "placement_reason": None, "clips": clips}


def test_merge_engine_scores_a_device_run_like_the_others(folder, tmp_path):
    """A device run's JSON, built from a real run's clips, merges into a row whose error counts, rates, stage
    sums and token agreement are those of the same clips run in process; a changed hypothesis changes the
    row's WER to what metrics.error_counts computes for the device's hypotheses (not the JSON's own
    figures: it carries none); the row's load times, memory and placement reach the Markdown."""
    from cohere_coreml.evaluation.bench import merge_engine, run_bench
    from cohere_coreml.evaluation.metrics import error_counts

    path, answers = folder
    dataset = load_folder(path)
    ran = run_engine(lambda: ScriptedEngine(answers), dataset)
    data = swift_json(ran, dataset)
    row = merge_engine(_write(tmp_path / "device.json", data), dataset)
    assert row["languages"] == ran["languages"]
    for key in ("clips_total", "clips_scored", "clips_silent", "windows", "decode_tokens", "loop_rate",
                "truncation_rate", "stages_s", "audio_s", "decoder_calls"):
        assert row[key] == ran[key], key
    # the dataset's own problems as the dataset says them; the device's (unreadable audio) marked as the device's
    assert [p["id"] for p in row["problems"]] == [p["id"] for p in ran["problems"]]
    broken = {p["id"]: p["problem"] for p in row["problems"]}["broken.wav"]
    assert broken.startswith("device: cannot decode audio file")
    from cohere_coreml.evaluation.bench import agreement_with

    assert agreement_with({"label": "ref", **ran}, row) == {"reference": "ref", "clips": 3, "identical_clips": 3,
                                                             "baseline_tokens": 27, "agreeing_tokens": 27}
    assert row["load_s"] == 12.5 and row["warm_load_s"] == 1.25 and row["peak_rss_mb"] == 512.0
    assert row["label"] == "swift coreml Mac14,2 (f16, fp16, cpu_and_ne)"
    # the device got the German clip wrong in another way: scored here, by the dataset's references
    de = next(c for c in data["clips"] if c["id"] == "de_short.wav")
    de["hypothesis"] = "ruf bitte anna nicht an"
    row = merge_engine(_write(tmp_path / "device2.json", data), dataset)
    want = error_counts(["ruf anna an"], ["ruf bitte anna nicht an"], "de")
    assert row["languages"]["de"]["rate"] == want["rate"] == pytest.approx(2 / 3)
    assert row["languages"]["de"]["insertions"] == 2 and row["languages"]["en"] == ran["languages"]["en"]
    # in a report: next to an in-process engine, with agreement, the device table and the chart
    report = run_bench([], None, path, merge=[tmp_path / "device.json", tmp_path / "device2.json"])
    assert [e["kind"] for e in report["engines"]] == ["swift", "swift"]
    md = format_markdown(report)
    assert "| swift coreml Mac14,2 (f16, fp16, cpu_and_ne) | 6.50 | 33.33 [33.33-33.33] | 25.00 [0.00-100.00] | 100.00 [100.00-100.00] |" in md
    assert "| 12.50 | 1.25 | 0.50 | 512 (phys_footprint) |" in md
    assert "encoder.main: ANE 90.00 % of cost, 1 ops elsewhere" in md
    paths = write_outputs(report, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["engines"][1]["languages"]["de"]["insertions"] == 2
    # the device's voice activity reaches the row as an in-process engine's: the mode resolved on the device
    assert row["vad"] == {"mode": "auto", "on": False, "options": None}  # a run that did not say: off
    for asked, ran_vad in (("auto", True), ("auto", False), ("off", False), ("on", True)):
        data["options"].update(vad=asked, vad_on=ran_vad)
        row = merge_engine(_write(tmp_path / "device3.json", data), dataset)
        assert row["vad"]["mode"] == asked and row["vad"]["on"] is ran_vad
        assert (row["vad"]["options"] is not None) is ran_vad
        shown = format_markdown(run_bench([], None, path, merge=[tmp_path / "device3.json"]))
        assert (" (VAD)" in shown) is ran_vad


def test_merge_engine_refuses_another_dataset(folder, tmp_path, capsys):
    """Through the CLI: a device JSON whose dataset manifest sha256 is not --data's is refused on stderr with
    both hashes, exit status 2, and nothing is written; the matching JSON is merged (exit 0, bench.md row)."""
    from cohere_coreml.cli import main

    path, answers = folder
    dataset = load_folder(path)
    ran = run_engine(lambda: ScriptedEngine(answers), dataset)
    bad = _write(tmp_path / "other.json", swift_json(ran, dataset, sha="0" * 64))
    out = tmp_path / "out"
    assert main(["bench", "--data", str(path), "--merge-engine", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "dataset manifest sha256 mismatch" in err and "0" * 64 in err and dataset.manifest_sha256 in err
    assert not out.exists()
    good = _write(tmp_path / "device.json", swift_json(ran, dataset))
    assert main(["bench", "--data", str(path), "--merge-engine", str(good), "--out", str(out)]) == 0
    assert "| swift coreml Mac14,2 (f16, fp16, cpu_and_ne) |" in (out / "bench.md").read_text()
    wrong = swift_json(ran, dataset)
    wrong["clips"][0]["id"] = "not-in-the-manifest.wav"
    assert main(["bench", "--data", str(path), "--merge-engine", str(_write(tmp_path / "w.json", wrong)),
                 "--out", str(out)]) == 2
    assert "'not-in-the-manifest.wav' (entry 0) is not in" in capsys.readouterr().err


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def test_each_bundle_flag_is_one_bundle_even_over_several_folders(folder, tmp_path, monkeypatch):
    """`bench --bundle q8,f16 --bundle f16`: two rows; the first bundle's engine gets both folders (files
    searched in order) and its identity is read from the folder holding each file (manifest and decoder
    from q8, encoder from f16), not from the first folder alone."""
    import hashlib

    import cohere_coreml.evaluation.bench as bench

    path, answers = folder
    q8, f16 = tmp_path / "q8", tmp_path / "f16"
    for d, preset in ((q8, "q8"), (f16, None)):
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({"preset": preset} if preset else {}))
    (q8 / "compression.json").write_text(json.dumps({"gate": {"passed": True}}))
    for d, package, mib in ((f16, "encoder", 1.0), (f16, "decoder", 2.0), (q8, "decoder", 0.5)):
        (d / f"{package}.mlpackage").mkdir()
        (d / f"{package}.mlpackage" / "weight.bin").write_bytes(b"\0" * int(mib * 2**20))
    loaded = []

    def fake_transcriber(dirs, **kwargs):
        loaded.append([p.name for p in dirs])
        return ScriptedEngine(answers)

    monkeypatch.setattr(bench, "Transcriber", fake_transcriber)
    report = bench.run_bench([[str(q8), str(f16)], str(f16)], None, path)
    assert loaded == [["q8", "f16"], ["f16"]]
    first, second = (e["bundle"] for e in report["engines"])
    assert report["engines"][0]["label"].startswith("q8,f16 (") and report["engines"][1]["label"].startswith("f16 (")
    assert first["dir"] == f"{q8},{f16}" and first["preset"] == "q8" and first["gate"] == "passed"
    assert first["manifest_sha256"] == hashlib.sha256((q8 / "manifest.json").read_bytes()).hexdigest()
    assert first["size_mb"] == 1.5  # f16's encoder + q8's decoder
    assert second["size_mb"] == 3.0 and second["preset"] == "f16" and second["gate"] == "export"


def test_the_reference_runs_its_vad_when_every_bundle_has_one(folder, tmp_path, monkeypatch):
    """`bench --pytorch M --bundle B` with --vad auto: the reference decodes the windows the bundles decode (its
    VAD on) only when every bundle has a VAD; off or on as asked otherwise."""
    import cohere_coreml.evaluation.bench as bench

    path, answers = folder
    with_vad, without = tmp_path / "with", tmp_path / "without"
    for d, manifest in ((with_vad, {"files": {"vad": "vad.mlpackage"}, "vad": {"model": "silero-vad"}}),
                        (without, {"files": {}})):
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps(manifest))
    asked = []

    class Reference(ScriptedEngine):
        def speech_probabilities(self, vad="auto"):
            asked.append(vad)
            return None

    monkeypatch.setattr(bench, "PyTorchEngine", lambda *a, **k: Reference(answers))
    monkeypatch.setattr(bench, "Transcriber", lambda dirs, **kwargs: ScriptedEngine(answers))
    for bundles, vad, expected in (([str(with_vad)], "auto", "on"), ([str(with_vad), str(without)], "auto", "auto"),
                                   ([str(without)], "auto", "auto"), ([str(with_vad)], "off", "off"),
                                   ([[str(without), str(with_vad)]], "auto", "auto")):
        asked.clear()
        bench.run_bench(bundles, "model", path, vad=vad)
        assert asked and set(asked) == {expected}, (bundles, vad, asked)


# --------------------------------------------------------------------------------------------------
# Word-timing error on a dataset with word times
# --------------------------------------------------------------------------------------------------


class TimedEngine(ScriptedEngine):
    """ScriptedEngine that also times words: each clip's words from a table keyed by clip length."""

    alignment = {"heads": [[0, 0]]}

    def __init__(self, answers, words):
        super().__init__(answers)
        self.words, self.asked = words, []

    def transcribe_window(self, waveform, prompt, *, index, start_s, max_new_tokens, beams, repetition_guard,
                          word_timestamps=False, language=None):
        window = super().transcribe_window(waveform, prompt, index=index, start_s=start_s,
                                           max_new_tokens=max_new_tokens, beams=beams, repetition_guard=repetition_guard)
        self.asked.append(word_timestamps)
        window.words = self.words[len(waveform)] if word_timestamps else None
        return window


def test_word_timing_error_next_to_wer(tmp_path):
    """Hypothesis words matched to the truth by text (a wrong word has no truth, a truth word without a start
    counts for nothing): |start error| per matched word, median and p90 over the dataset, words timed / words
    with a truth; in the report's table next to WER. A dataset without word times reports none."""
    from cohere_coreml.model.audio import load_audio

    truth = {"en_short.wav": [{"word": "Call", "start": 0.10}, {"word": "Tom", "start": 0.50},
                              {"word": "now.", "start": 0.90}],
             "de_short.wav": [{"word": "ruf", "start": 0.20}, {"word": "anna", "start": None},
                              {"word": "an", "start": 1.00}]}
    entries = []
    for name, words in truth.items():
        (tmp_path / name).write_bytes((AUDIO_DIR / name).read_bytes())
        entries.append({"audio": name, "text": TEXTS[name], "language": name[:2], "words": words})
    (tmp_path / "manifest.json").write_text(json.dumps({"utterances": entries}))
    lengths = {n: load_audio(tmp_path / n).size for n in truth}
    answers = {lengths["en_short.wav"]: ("Call Tom now.", [5, 6, 3], "eos"),
               lengths["de_short.wav"]: ("ruf emma an", [5, 6, 7, 3], "eos")}
    hyp = {lengths["en_short.wav"]: [{"word": "Call", "start": 0.14, "end": 0.4, "probability": 0.9},
                                     {"word": "Tom", "start": 0.40, "end": 0.8, "probability": 0.9},
                                     {"word": "uh", "start": 0.95, "end": 1.1, "probability": 0.9},
                                     {"word": "now.", "start": 1.20, "end": 1.4, "probability": 0.9}],
           lengths["de_short.wav"]: [{"word": "ruf", "start": 0.22, "end": 0.5, "probability": 0.9},
                                     {"word": "emma", "start": 0.60, "end": 0.9, "probability": 0.9},
                                     {"word": "an", "start": 0.90, "end": 1.1, "probability": 0.9}]}
    dataset = load_folder(tmp_path)
    engine = TimedEngine(answers, hyp)
    section = run_engine(lambda: engine, dataset, warmup=False, word_timestamps=True)
    errors = sorted([0.04, 0.10, 0.30, 0.02, 0.10])  # uh and emma match nothing; anna has no start
    w = section["word_timing"]
    assert (w["words_timed"], w["truth_words"], w["clips"]) == (5, 5, 2)
    assert w["median_s"] == pytest.approx(float(np.median(errors)))
    assert w["p90_s"] == pytest.approx(float(np.percentile(errors, 90)))
    report = {"engines": [{"label": "timed", **section}], "tool_version": "x", "tool_git_hash": "0" * 12,
              "machine": {"platform": "p", "cpus": 1},
              "dataset": {"name": "d", "manifest_sha256": "0" * 12, "word_times": True}}
    header, _, row = format_markdown(report).splitlines()[:3]
    column = header.split(" | ").index("word start error ms: median / p90 (timed / with truth)")
    assert row.split(" | ")[column] == "100 / 220 (5/5)"
    plain = run_engine(lambda: TimedEngine(answers, hyp), dataset, warmup=False)
    assert plain["word_timing"] is None


def test_bench_times_words_of_the_bundle_and_the_reference(trained_bundle, tmp_path):
    """On a word-timing set (three single-sentence clips of the calibration set shipped with the package), the
    bundle (its align function) and the PyTorch reference (on the bundle's heads, read from its manifest) both
    report a word-timing error, on the same words, and within one encoder frame of each other."""
    from cohere_coreml.evaluation.bench import run_bench
    from cohere_coreml.export.alignment_heads import CALIBRATION_SET

    from ..fixture_data import TRAINED_MODEL

    manifest = json.loads((CALIBRATION_SET / "manifest.json").read_text())
    picked = [u for u in manifest["utterances"] if "domain_00" in u["file"]]
    assert len(picked) == 3
    for u in picked:
        (tmp_path / u["file"]).write_bytes((CALIBRATION_SET / u["file"]).read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps({"utterances": picked}))
    report = run_bench([str(trained_bundle)], TRAINED_MODEL, tmp_path, backend="mil")
    reference, bundle = (e["word_timing"] for e in report["engines"])
    assert report["dataset"]["word_times"]
    assert reference["truth_words"] == bundle["truth_words"] == sum(
        1 for u in picked for w in u["words"] if w.get("start") is not None)
    assert bundle["words_timed"] == reference["words_timed"] >= bundle["truth_words"] - 1
    assert abs(bundle["median_s"] - reference["median_s"]) <= 0.08 + 1e-9
    assert "word start error ms" in format_markdown(report)


def test_each_stage_has_its_real_time_factor_beside_the_whole_files_and_the_batch_is_named():
    """Per stage (the VAD pass, front end, encoder, decoder: bind + prompt + decode) its own RTFx, the whole file's
    from the processing time (with the encoder ahead of the decoder the stages overlap: less than their sum),
    tokens per second of the decoder's time and of the whole file's, the decoder's wait for encoder outputs; the
    stage table names the decoder batch and the encoder-ahead depth."""
    from cohere_coreml.evaluation.bench import summarise, window_row

    def window(i, tokens, wait):
        timings = {"features_s": 0.5, "encoder_s": 2.0, "bind_s": 0.1, "prompt_s": 0.4, "decode_s": 1.5,
                   "decoder_calls": tokens, "encoder_wait_s": wait}
        return window_row(i, 35.0 * i, 35.0 * (i + 1), list(range(1, tokens + 1)), "eos", timings, eos_ids={3})

    clips = [{"id": 0, "language": "en", "reference": "a b", "hypothesis": "a b", "status": "ok", "audio_s": 80.0,
              "processing_s": 6.0, "vad_s": 2.0, "windows": [window(0, 20, 2.5), window(1, 12, 0.0)]}]
    s = summarise(clips, "d")
    assert s["stage_rtfx"] == pytest.approx({"vad": 40.0, "front_end": 80.0, "encoder": 20.0, "decoder": 20.0})
    assert s["rtfx"] == pytest.approx(80.0 / 6.0)  # the whole file's time, not the stages' sum (11 s)
    assert s["encoder_wait_s"] == pytest.approx(2.5) and s["vad_s"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(30 / 3.8) and s["tokens_per_s_whole"] == pytest.approx(30 / 6.0)
    engines = [{"label": "pytorch", **s}, {"label": "batched", "decoder_batch": 4, "encoder_ahead": 4, **s},
               {"label": "sequential", "decoder_batch": 4, "encoder_ahead": 0, **s},
               {"label": "one", "decoder_batch": 1, "encoder_ahead": 1, **s}]
    for e in engines:
        e.update(load_s=1.0, first_run_s=None, peak_rss_mb=100.0, options={"beams": 1})
    report = {"engines": engines, "tool_version": "x", "tool_git_hash": "0" * 12, "machine": {"platform": "p", "cpus": 1},
              "dataset": {"name": "d", "manifest_sha256": "0" * 12}}
    lines = format_markdown(report).splitlines()
    head = next(line for line in lines if "encoder wait s" in line).split(" | ")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    col = head.index("decoder batch, encoder ahead")
    assert [rows[n][col] for n in ("pytorch", "batched", "sequential", "one")] == ["-", "B=4, ahead 4",
                                                                                   "B=4, ahead 0", "B=1"]
    rtfx = head.index("RTFx VAD / front end / encoder / decoder / whole")
    assert rows["batched"][rtfx] == "40.0 / 80.0 / 20.0 / 20.0 / 13.3"
    assert rows["batched"][head.index("encoder wait s")] == "2.50"
