import json
import subprocess
import sys

from cohere_coreml.cli import main


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    for command in ("prepare-default", "info", "vocab", "mel", "export", "transcribe", "verify", "quantize", "bundle",
                    "upload", "bench"):
        assert command in out


def test_info_json(tiny_checkpoint, capsys):
    assert main(["info", "--model", str(tiny_checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["decoder"]["hidden_size"] == 64
    assert len(info["tokens"]["prompt_en"]) == 10


def test_bad_model_is_one_line_error(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_vocab_command(tiny_checkpoint, tmp_path):
    assert main(["vocab", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "vocab.json")]) == 0
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert vocab["3"] == "<|endoftext|>"


def test_console_script_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "cohere_coreml.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert "cohere-coreml" in out.stdout
