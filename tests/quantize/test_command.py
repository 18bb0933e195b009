"""`cohere-coreml quantize` end to end: the gated q8 bundle, refusals, the output folder, the flags
(`cohere_coreml.quantize.command`)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from cohere_coreml import cli
from cohere_coreml import quantize as Q
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.quantize import command, compress
from cohere_coreml.storage.integrity import check_bundle

from ..fixture_data import HELDOUT_DIR


@pytest.mark.slow
def test_q8_gate_figures_and_bundle(f16_bundle, q8_bundle):
    out, report = q8_bundle
    gate = report["gate"]
    assert gate["passed"] and gate["heldout"]["baseline"] == "pytorch"
    d = gate["decoder"]
    assert d["argmax_agree"] == d["steps"] and 0 < d["abs_error_nats"]["max"] < 1.0
    assert set(d["eos_error_nats"]) >= {"median", "p99", "max"}
    for name in ("encoder.parity.json", "decoder.parity.json", "heldout.parity.json", "README.md",
                 "example_inference.py", "compression.json"):
        assert (out / name).is_file(), name
    # the gates' reports follow the export's convention: GateReport dicts in <component>.parity.json
    for name in ("encoder", "decoder", "heldout"):
        written = json.loads((out / f"{name}.parity.json").read_text())
        assert written["component"] == name and written["passed"] is True and written["headline"]
        assert written == json.loads(json.dumps(gate[name])), name
    assert not list(out.glob("*.parity-failed.json"))
    # the held-out gate bounds every language; the card lists them
    held, card = gate["heldout"], (out / "README.md").read_text()
    assert set(held["languages"]) == {"de", "en", "es"} and held["worst_increase"] <= 0.005
    assert all(f", {lang} (WER) | 1 |" in card for lang in held["languages"])
    # one clip per language is too few words to decide (rule of three): built undecided, and says so
    assert held["verdict"] == "undecided" and held["accepted_undecided"] is True
    assert "accepted undecided (--accept-undecided)" in held["headline"] and "rule of three" in held["headline"]
    assert "Task verdict: undecided, built with `--accept-undecided`" in card
    assert check_bundle(out)["files"] > 10
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["preset"] == "q8" and manifest["recipe"]["decoder"]["scheme"] == "int8"
    assert manifest["min_os"]["iOS"] == "18.0"
    # the front end is not compressed: the f16 package and its gate report, byte for byte
    f16 = json.loads((f16_bundle / "manifest.json").read_text())
    fe_files = {k: v for k, v in manifest["checksums"]["files"].items() if k.startswith("frontend.")}
    assert "frontend.parity.json" in fe_files and any(k.startswith("frontend.mlpackage/") for k in fe_files)
    assert fe_files == {k: v for k, v in f16["checksums"]["files"].items() if k.startswith("frontend.")}
    assert manifest["frontend"] == f16["frontend"] and "front-end features" in (out / "README.md").read_text()
    # the quantized bundle transcribes like the reference on a held-out clip, with either front end
    ref = json.loads((HELDOUT_DIR / "manifest.json").read_text())["utterances"][0]["text"]
    for front_end in ("python", "package"):
        res = Transcriber(out, backend="mil", front_end=front_end).transcribe(HELDOUT_DIR / "en_heldout_00000.flac",
                                                                              language="en")
        assert res.text.strip(" .?").lower() == ref.strip(" .?").lower(), front_end


@pytest.mark.slow
def test_quantizing_twice_is_refused(f16_bundle, q8_bundle, tmp_path):
    out, _ = q8_bundle
    with pytest.raises(Q.QuantizeError, match="already a 'q8' bundle"):
        Q.quantize_bundle(out, tmp_path / "again", "q8", skip_verify=True)
    # a bundle without its compression report but with compressed packages is refused too
    sneaky = tmp_path / "sneaky"
    shutil.copytree(out, sneaky)
    (sneaky / "compression.json").unlink()
    manifest = json.loads((sneaky / "manifest.json").read_text())
    manifest.pop("checksums"), manifest.pop("preset")
    (sneaky / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Q.QuantizeError, match="already holds compressed weights"):
        Q.quantize_bundle(sneaky, tmp_path / "again", "q8", skip_verify=True)
    with pytest.raises(Q.QuantizeError, match="not a bundle"):
        Q.quantize_bundle(tmp_path, tmp_path / "x", "q8")
    with pytest.raises(Q.QuantizeError, match="exists"):
        Q.quantize_bundle(f16_bundle, out, "q8")


@pytest.mark.slow
def test_reserved_output_folder_is_used_and_keeps_its_placeholder(f16_bundle, tmp_path):
    """The checkout reserves q8/ with only a .gitkeep: `make quantize` writes into it on a fresh checkout,
    the placeholder stays (hidden: not part of the bundle) and the bundle checks clean."""
    out = tmp_path / "q8"
    out.mkdir()
    (out / ".gitkeep").touch()
    Q.quantize_bundle(f16_bundle, out, "q8", skip_verify=True)
    assert (out / ".gitkeep").is_file() and (out / "manifest.json").is_file()
    assert check_bundle(out)["files"] > 5


@pytest.mark.slow
def test_broken_compression_fails_the_gate_and_leaves_nothing(f16_bundle, f16_gate_data, shared_gate_data,
                                                              monkeypatch, tmp_path):
    """A 1-bit palette destroys the decoder: the gate refuses it and no bundle is left behind."""
    import coremltools.optimize.coreml as cto  # heavy import, only this test needs it

    real = Q.scheme_config

    def broken(scheme):
        if scheme == "int8":
            return cto.OpPalettizerConfig(nbits=1, mode="uniform", weight_threshold=Q.WEIGHT_THRESHOLD)
        return real(scheme)

    monkeypatch.setattr(compress, "scheme_config", broken)
    monkeypatch.setitem(Q.PRESETS, "q8", {"encoder": Q.Recipe(None), "decoder": Q.Recipe("pal1")})
    monkeypatch.setattr(Q.Recipe, "to_dict", lambda self: {"scheme": self.scheme})
    monkeypatch.setattr(compress, "compress_mlmodel", lambda m, r, w: (cto.palettize_weights(
        m, cto.OptimizationConfig(global_config=broken("int8"))), {}, {}))
    out = tmp_path / "broken"
    with pytest.raises(Q.QuantizeGateError, match="decoder PSNR") as err:
        Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]
    # the refused figures are kept beside (not inside) the would-be bundle, and the error names the file
    refused = json.loads(Q.refusal_path(out).read_text())
    assert str(Q.refusal_path(out)) in str(err.value)
    assert refused["passed"] is False and refused["preset"] == "q8"
    assert refused["gate"]["encoder"]["passed"] is True  # fp16 encoder: gated and passed first
    decoder = refused["gate"]["decoder"]
    assert decoder["passed"] is False and decoder["worst_psnr_db"] < decoder["min_psnr_db"]
    assert decoder["abs_error_nats"]["max"] > 0
    # an ungated build leaves the refusal (the gate's last word); a gated build that passes removes it
    monkeypatch.undo()
    monkeypatch.setattr(command, "build_gate_data", f16_gate_data)  # the refused build's f16 references again
    Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None, skip_verify=True)
    assert out.is_dir() and Q.refusal_path(out).is_file()
    Q.quantize_bundle(f16_bundle, out, "q8", eval_dir=None, force=True)
    assert out.is_dir() and not Q.refusal_path(out).exists()


def test_flags_are_spelled_as_bench_and_export_and_old_spellings_are_hidden(capsys):
    """--data (bench's spelling) and --skip-verify (export's); the old --eval-set / --skip-gate set the
    same options, are absent from --help, and are recorded as deprecated; the new spellings are not."""
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["quantize", "--help"])
    help_text = capsys.readouterr().out
    assert "--data" in help_text and "--skip-verify" in help_text
    assert "--eval-set" not in help_text and "--skip-gate" not in help_text
    new = parser.parse_args(["quantize", "--data", "d", "--skip-verify"])
    old = parser.parse_args(["quantize", "--eval-set", "d", "--skip-gate"])
    assert (new.data, new.skip_verify, tuple(new.deprecated_flags)) == ("d", True, ())
    assert (old.data, old.skip_verify) == ("d", True)
    assert list(old.deprecated_flags) == [("--eval-set", "--data"), ("--skip-gate", "--skip-verify")]
    default = parser.parse_args(["quantize"])
    assert (default.data, default.skip_verify, tuple(default.deprecated_flags)) == ("none", False, ())


@pytest.mark.slow
def test_deprecated_flags_still_work_and_warn_once(f16_bundle, tmp_path, caplog, capsys):
    """An ungated build through the old spellings: built like --skip-verify, one warning line per old flag."""
    out = tmp_path / "q8"
    with caplog.at_level(logging.WARNING, logger="cohere_coreml"):
        rc = cli.main(["quantize", "--bundle", str(f16_bundle), "--out", str(out), "--eval-set", "none", "--skip-gate"])
    assert rc == 0 and f"wrote {out}" in capsys.readouterr().out
    assert json.loads((out / "compression.json").read_text())["gate"] == {"skipped": True}
    deprecated = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert deprecated == ["--eval-set is deprecated: use --data (the old spelling will be removed in the next release)",
                          "--skip-gate is deprecated: use --skip-verify (the old spelling will be removed in the next "
                          "release)"]


@pytest.mark.slow
def test_q8_batched_step_is_gated_against_its_own_step(f16_bundle, q8_bundle, eval_dir, f16_gate_data):
    """The q8 decoder's `step_batch` (weights shared with the step, compressed with it) is gated: each row on
    the gate sequences against the same package's batch-1 step. Broken variant: rows given the next row's
    memory are refused."""
    from cohere_coreml.export.decoder_gate import TeacherForcingCase, batch_memories
    from cohere_coreml.quantize.measure import batch_agreement, clips_of, decoder_outputs, decoder_runtime

    out, report = q8_bundle
    size = json.loads((out / "manifest.json").read_text())["decoder"]["batch"]["size"]
    batch = report["gate"]["decoder"]["batch"]
    assert batch["passed"] and batch["size"] == size >= 2 and batch["decisive_flips"] == 0
    assert "step_batch: " in report["gate"]["decoder"]["headline"]
    data = f16_gate_data(f16_bundle, clips_of(eval_dir))
    package = out / "decoder.mlpackage"
    single = decoder_outputs(decoder_runtime(package), data)
    again = batch_agreement(package, data, single, 35.0)
    assert again["worst_psnr_db"] == pytest.approx(batch["worst_psnr_db"]) and again["passed"]
    cases = [TeacherForcingCase(cross_k=e["cross_k"], cross_v=e["cross_v"], cross_mask=e["cross_mask"], ids=ids,
                                log_probs=None, prompt_len=len(p))
             for e, ids, p in zip(data.encoder_ref, data.sequences, data.prompts)]
    assert len({tuple(c.ids) for c in cases}) > 1  # rows of different sequences: a mixed memory shows
    mixed = batch_agreement(package, data, single, 35.0, memories=batch_memories(cases, size, "mixed_memory"))
    assert not mixed["passed"] and mixed["worst_psnr_db"] < 35.0
