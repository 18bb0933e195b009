"""tools/bench/bench_compression.py's table (cohere_coreml_dev.compression_table) and parameter count."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from cohere_coreml_dev.cli_runs import checkpoint_parameters
from cohere_coreml_dev.compression_table import markdown, pareto_front, parse_row, split_folder


def row(label, size, rates, passed=True):
    return {"label": label, "passed": passed, "bytes": size, "bytes_per_parameter": size / 1000,
            "languages": {lang: {"metric": "wer", "rate": r, "baseline": 0.02, "clips": 2, "identical_clips": 1}
                          for lang, r in zip(("de", "en"), rates)},
            "identical_clips": 1, "clips": 4, "agreeing_tokens": 9, "baseline_tokens": 10}


def test_parse_row():
    assert parse_row("q8") == ("q8", "q8", [])
    assert parse_row("mixed-0.45=mixed --target-bytes-per-param 0.45") == (
        "mixed-0.45", "mixed", ["--target-bytes-per-param", "0.45"])
    with pytest.raises(SystemExit, match="label=preset"):
        parse_row("x=--preset q8")


def test_pareto_front_keeps_only_rows_nothing_beats_on_both():
    rows = [row("f16", 100, (0.02, 0.02)),  # most accurate: on the front
            row("q8", 50, (0.03, 0.03)),  # smaller: on the front
            row("q4", 80, (0.04, 0.03)),  # beaten by q8 (smaller and better)
            row("tie", 50, (0.03, 0.03)),  # equal to q8: neither beats the other
            row("tiny", 20, (0.30, 0.30)),  # smallest: on the front however bad
            row("refused", 10, (0.01, 0.01), passed=False),  # beats all, but its gate refused it: never on it
            {"label": "broken", "passed": False, "error": "crashed"}]  # no figures: never on the front
    assert pareto_front(rows) == ["f16", "q8", "tie", "tiny"]
    # without q8, q4 is on it (nothing left is both smaller and better); accuracy alone would keep
    # only f16, size alone only tiny
    assert pareto_front([rows[0], rows[2], rows[4]]) == ["f16", "q4", "tiny"]


def test_markdown_marks_refusals_and_the_front():
    report = {"model": "m", "data": "heldout", "parameters": 1000,
              "rows": [row("f16", 100, (0.02, 0.02)), row("q4", 40, (0.05, 0.06), passed=False),
                       {"label": "broken", "passed": False, "error": "crashed"}]}
    report["pareto_front"] = pareto_front(report["rows"])
    text = markdown(report)
    lines = text.splitlines()
    f16 = next(x for x in lines if x.startswith("| f16 "))
    q4 = next(x for x in lines if x.startswith("| q4 "))
    assert "| ref * |" in f16 and "| REFUSED |" in q4
    assert "| 5.00 (2.00) | 6.00 (2.00) |" in q4  # per language: produced (PyTorch), in %
    assert "broken: no figures, crashed" in text


def test_checkpoint_parameters_from_the_safetensors_headers(tmp_path):
    save_file({"a": np.zeros((3, 4), np.float32), "b": np.zeros((5,), np.float16)}, str(tmp_path / "model.safetensors"))
    save_file({"c": np.zeros((2, 2, 2), np.int64)}, str(tmp_path / "model-2.safetensors"))
    assert checkpoint_parameters(tmp_path) == 12 + 5 + 8
    with pytest.raises(SystemExit, match=r"no \*.safetensors"):
        checkpoint_parameters(tmp_path / "missing")


def test_split_folder_keeps_calibration_clips_out_of_the_evaluation(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    utts = [{"file": f"{lang}_{i}.flac", "language": lang, "text": f"{lang} {i}"} for lang in ("en", "de") for i in range(3)]
    for u in utts:
        (data / u["file"]).write_bytes(u["file"].encode())
    (data / "manifest.json").write_text(json.dumps({"sample_rate": 16000, "utterances": utts}))
    cal, ev = split_folder(data, tmp_path / "out", 2)
    read = {p: json.loads((p / "manifest.json").read_text()) for p in (cal, ev)}
    assert [u["file"] for u in read[cal]["utterances"]] == ["en_0.flac", "en_1.flac", "de_0.flac", "de_1.flac"]
    assert [u["file"] for u in read[ev]["utterances"]] == ["en_2.flac", "de_2.flac"]
    assert read[ev]["sample_rate"] == 16000 and (ev / "de_2.flac").read_bytes() == b"de_2.flac"
    assert not (ev / "en_0.flac").exists()  # a calibration clip is never in the evaluation folder
    with pytest.raises(SystemExit, match=r"no clip left to evaluate in \['de', 'en'\]"):
        split_folder(data, tmp_path / "out2", 3)
