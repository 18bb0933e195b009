import json
import os
import subprocess
import sys

import pytest

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


def test_verbose_flag_turns_on_the_package_debug_lines(capsys):
    """Default: the package logs at the root's level (INFO: progress, one verdict per package); -v: its DEBUG
    lines too (every step, the gates' per-case tables), documented in --help."""
    import logging

    package = logging.getLogger("cohere_coreml")
    try:
        assert main(["-v", "prepare-default"]) == 0
        assert package.level == logging.DEBUG and package.isEnabledFor(logging.DEBUG)
        assert main(["prepare-default"]) == 0
        assert package.level == logging.NOTSET  # back to the root's level: no per-case tables
    finally:
        package.setLevel(logging.NOTSET)
    capsys.readouterr()
    try:
        main(["--help"])
    except SystemExit:
        pass
    assert "per-case tables" in " ".join(capsys.readouterr().out.split())


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


# --- --bundle: one bundle per occurrence, in every command -------------------------------------------


def test_bundle_flag_names_one_bundle_in_every_command(capsys):
    from cohere_coreml.cli import build_parser

    parser = build_parser()
    one = parser.parse_args(["transcribe", "a.wav", "--bundle", "q8,f16", "--language", "en"])
    assert one.bundle == ["q8", "f16"] and not getattr(one, "deprecations", None)  # one bundle, two folders
    verify = parser.parse_args(["verify", "--model", "m", "--bundle", "q8,f16", "--audio", "a.wav"])
    assert verify.bundle == ["q8", "f16"]
    bench = parser.parse_args(["bench", "--bundle", "q8,f16", "--bundle", "f16", "--data", "d"])
    assert bench.bundle == [["q8", "f16"], ["f16"]]  # two bundles, the first over two folders
    assert parser.parse_args(["bench", "--data", "d"]).bundle == []
    for command in (["transcribe", "a.wav", "--language", "en"], ["verify", "--model", "m", "--audio", "a.wav"]):
        try:  # transcribe and verify take ONE bundle: a second --bundle is refused, not merged or dropped
            parser.parse_args([*command, "--bundle", "f16", "--bundle", "q8"])
            raise AssertionError("a second --bundle was accepted")
        except SystemExit as exit_:
            assert exit_.code == 2
        assert "names one bundle: give it once" in capsys.readouterr().err
    help_text = parser._subparsers._group_actions[0].choices["transcribe"].format_help()
    assert "--bundle DIR[,DIR...]" in help_text and "[DIR[,DIR...] ...]" not in help_text


def test_old_space_separated_bundle_folders_still_read_with_a_deprecation_line(caplog):
    from cohere_coreml.cli import build_parser

    old = build_parser().parse_args(["transcribe", "a.wav", "--bundle", "q8", "f16", "--language", "en"])
    assert old.bundle == ["q8", "f16"]
    assert old.deprecations == ["`--bundle q8 f16` is deprecated (space-separated folders of one bundle): write "
                                "`--bundle q8,f16`; the old spelling goes in the next release"]
    # through main: the line is logged once logging is set up (silence: no bundle is loaded)
    from .fixture_data import AUDIO_DIR

    with caplog.at_level("WARNING"):
        assert main(["transcribe", str(AUDIO_DIR / "silence_2s.wav"), "--bundle", "q8", "f16", "--language", "en"]) == 0
    assert any("`--bundle q8 f16` is deprecated" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_transcribe_bad_file_among_good_ones_stdout_holds_only_results(trained_bundle, tmp_path, capsys, caplog):
    """A real `cohere-coreml transcribe` process (the trained fp16 bundle, interpreter) over good files with a
    corrupt one between them: stdout holds exactly the good transcripts (each as the file gets alone), stderr
    names the bad file, exit status 1; the same with --json (no entry for the bad file), run through the
    console script's `main` in this process (the real process above shows what reaches stdout and stderr and
    that main's status is the exit status; a second fresh process cost ~10 s CPU of imports)."""
    from cohere_coreml.inference.transcribe import Transcriber

    from .fixture_data import heldout_utterances

    good = [str(u["path"]) for u in heldout_utterances(per_language=2) if u["language"] == "en"]  # < 4 s windows
    bad = tmp_path / "corrupt.wav"
    bad.write_bytes(b"RIFF" + b"x" * 64)
    tr = Transcriber(trained_bundle, backend="mil")
    alone = [tr.transcribe(g, "en").text for g in good]
    assert alone[0] != alone[1] and all(alone)  # the files' transcripts differ: a mix-up would show
    files = [good[0], str(bad), good[1]]
    base = [sys.executable, "-m", "cohere_coreml.cli", "transcribe", *files, "--bundle", str(trained_bundle),
            "--language", "en", "--backend", "mil"]
    text = subprocess.run(base, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert text.returncode == 1, text.stderr
    assert text.stdout == f"== {good[0]}\n{alone[0]}\n== {good[1]}\n{alone[1]}\n"
    assert "ERROR" in text.stderr and "corrupt.wav" in text.stderr and "Traceback" not in text.stderr
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level("WARNING"):
        status = main([*base[3:], "--json"])
    stdout, stderr = capsys.readouterr()
    assert status == 1, stderr
    data = json.loads(stdout)
    assert [(d["audio"], d["status"], d["text"]) for d in data] == [(good[0], "ok", alone[0]), (good[1], "ok", alone[1])]
    assert "corrupt.wav" in caplog.text and "corrupt.wav" not in stdout  # logged (to stderr in a process)
