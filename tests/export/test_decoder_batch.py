"""The decoder's batched step (`step_batch`, `export --decoder-batch B`): B windows a call on a state of B rows.

Exported with the batch-1 functions (which stay byte for byte what they are without it, their weights shared),
gated row by row against PyTorch and token for token against the step on two different cases
(`decoder_gate.run_batch_teacher_forcing`); a program whose rows read each other's memory is refused. The
graph-state decoder has no batched step: asking for one is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from cohere_coreml import cli
from cohere_coreml.export.convert import ExportError, ExportSettings
from cohere_coreml.export.decoder import convert_decoder
from cohere_coreml.export.decoder_modules import DecoderExportError, DecoderStepBatch
from cohere_coreml.export.pipeline import resolve_decoder_batch
from cohere_coreml.export_errors import ParityError
from cohere_coreml.model.tokens import prompt_ids

CAPACITY, MEMORY = 32, 64


def export(trained_reference, out, batch: int, gated: bool = True) -> dict:
    model, processor = trained_reference
    settings = ExportSettings(out_dir=out, precision="fp16", skip_verify=not gated)
    return convert_decoder(model, settings, capacity=CAPACITY, memory_len=MEMORY,
                           prompt=prompt_ids(processor.tokenizer, "en"),
                           control_prompt=prompt_ids(processor.tokenizer, "fr", punctuation=False), batch=batch)


@pytest.fixture(scope="module")
def packages(trained_reference, tmp_path_factory):
    # the batch-1 package only to compare programs with (its gate is the session bundle's, unchanged)
    return {b: export(trained_reference, tmp_path_factory.mktemp(f"batch{b}"), b, gated=b > 1) for b in (1, 3)}


def test_batched_step_passes_and_leaves_the_batch_1_functions_byte_for_byte(packages):
    import coremltools as ct

    with_batch, without = packages[3], packages[1]
    report = with_batch["parity"]["batch"]
    assert with_batch["parity"]["passed"] and report["passed"] and report["size"] == 3
    assert [r["case"] for r in report["rows"]] == [0, 1, 0] and all(r["decisive_flips_vs_step"] == 0
                                                                    for r in report["rows"])
    assert report["discriminates"]  # the twin with rows' memories or masks mixed is refused
    assert with_batch["functions"]["step_batch"] == "step_batch" and "step_batch" not in without["functions"]
    a, b = (ct.utils.load_spec(p["path"]) for p in (without, with_batch))
    assert sorted(b.mlProgram.functions) == sorted([*a.mlProgram.functions, "step_batch"])
    for name, function in a.mlProgram.functions.items():
        assert function.SerializeToString(deterministic=True) == b.mlProgram.functions[name].SerializeToString(
            deterministic=True), name
    weights = [p["path"] + "/Data/com.apple.CoreML/weights/weight.bin" for p in (without, with_batch)]
    assert open(weights[0], "rb").read() == open(weights[1], "rb").read()  # step_batch adds no weight


class MixedMemory(DecoderStepBatch):
    """Broken: row b attends to the next row's cross memory (under its own mask)."""

    def rows(self, name, i):
        out = super().rows(name, i)
        return torch.roll(out, 1, dims=0) if name.startswith("cross") else out


def test_a_batched_step_mixing_rows_is_refused(trained_reference, tmp_path, monkeypatch):
    monkeypatch.setattr("cohere_coreml.export.decoder.DecoderStepBatch", MixedMemory)
    with pytest.raises(ParityError, match="step_batch of 2 rows differs from the step"):
        export(trained_reference, tmp_path, 2)
    assert not (tmp_path / "decoder.mlpackage").exists()


def test_the_graph_state_decoder_has_no_batched_step(trained_reference, tmp_path, capsys):
    assert resolve_decoder_batch(None, "graph") == 1 and resolve_decoder_batch(None, "host") > 1
    assert resolve_decoder_batch(1, "graph") == 1
    with pytest.raises(ExportError, match="needs --decoder-state host"):
        resolve_decoder_batch(2, "graph")
    with pytest.raises(ExportError, match="must be >= 1"):
        resolve_decoder_batch(0, "host")
    model, _ = trained_reference
    with pytest.raises(DecoderExportError, match="needs the host-state decoder"):
        convert_decoder(model, ExportSettings(out_dir=tmp_path), capacity=CAPACITY, memory_len=MEMORY,
                        state_writes="graph", batch=2)
    code = cli.main(["export", "--model", "no-such-model", "--out", str(tmp_path / "x"), "--decoder-state", "graph",
                     "--decoder-batch", "4"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "--decoder-batch 4 needs --decoder-state host" in err
