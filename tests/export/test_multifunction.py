"""The lean multifunction merge (`cohere_coreml.export.multifunction`, behind `convert.merge_functions`)
against `coremltools.utils.save_multifunction` on the same single-function packages: the packages
our exporters really merge (an fp16 bucketed encoder, the stateful decoder with its prefill and
bind functions, int8 and 4-bit palettized compressions of the encoder), captured on their way into
`merge_functions`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.proto import MIL_pb2

from cohere_coreml import quantize as Q
from cohere_coreml.export import convert, multifunction
from cohere_coreml.export import decoder as D
from cohere_coreml.export import encoder_packages as EP
from cohere_coreml.export.convert import ExportSettings
from cohere_coreml.model.tokens import prompt_ids
from cohere_coreml.quantize import compress as C
from cohere_coreml.runtime import load_model
from cohere_coreml.storage.files import weight_file_bytes


def _capture(monkeypatch, module, into: Path) -> list[tuple[dict, str]]:
    """Patch `module.merge_functions` to copy the singles it is given into `into` first."""
    captured = []
    real = module.merge_functions

    def capturing(singles, default, scratch):
        folder = into / f"merge{len(captured)}"
        folder.mkdir(parents=True)
        copies = {}
        for fn, single in singles.items():
            copies[fn] = folder / f"{fn}.mlpackage"
            shutil.copytree(single, copies[fn])
        captured.append((copies, default))
        return real(singles, default, scratch)

    monkeypatch.setattr(module, "merge_functions", capturing)
    return captured


# compressions of the encoder and the blob dtype each must bring into the merge
COMPRESSIONS = {"int8": "INT8", "int4": "INT4", "pal4": "UINT4", "pal6": "UINT6"}


@pytest.fixture(scope="module")
def merges(tiny_reference, tmp_path_factory):
    """name -> (singles, default) of the merges an fp16 export and its compressions make."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("merges")
    model, processor = tiny_reference
    settings = ExportSettings(out_dir=root / "bundle", precision="fp16", window_seconds=3.0, skip_verify=True)
    try:
        enc_cap = _capture(mp, EP, root / "enc")
        encoder = EP.convert_encoder_buckets(model, settings, [1.0, 2.0], processor)
        dec_cap = _capture(mp, D, root / "dec")
        D.convert_decoder(model, settings, capacity=32, memory_len=64,
                          prompt=prompt_ids(processor.tokenizer, "en", True), prefill=True, state_writes="graph")
        q_cap = _capture(mp, C, root / "q")
        compressed = {}
        for scheme in COMPRESSIONS:
            C.compress_package(encoder, root / f"{scheme}.mlpackage", Q.Recipe(scheme))
            compressed[scheme] = q_cap[-1]  # its last merge: the package it writes
    finally:
        mp.undo()
    assert len(enc_cap) == len(dec_cap) == 1
    return {"encoder": enc_cap[0], "decoder": dec_cap[0], **compressed}


def _blob_dtypes(package: Path) -> set[str]:
    spec = ct.utils.load_spec(str(package))
    return {MIL_pb2.DataType.Name(v.type.tensorType.dataType)
            for f in spec.mlProgram.functions.values() for v in multifunction.blob_values(f)}


def _reference(singles, default, out: Path) -> Path:
    desc = ct.utils.MultiFunctionDescriptor()
    for fn, single in singles.items():
        desc.add_function(str(single), src_function_name="main", target_function_name=fn)
    desc.default_function_name = default
    ct.utils.save_multifunction(desc, str(out))
    return out


def _inputs(rt, seed: int) -> dict:
    """Random inputs of a function's declared shapes (small integers for integer inputs: ids,
    lengths and positions stay in range)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in sorted(rt.input_description.items()):
        shape = tuple(4 if d == -1 else d for d in shape)
        if np.issubdtype(dtype, np.integer):
            out[name] = rng.integers(1, 3, size=shape).astype(dtype)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def _run(package: Path, fn: str, seed: int) -> dict:
    """Outputs (and the states after the call) of `fn` on random inputs, through the interpreter."""
    rt = load_model(package, backend="mil", function_name=fn)
    state = rt.make_state() if rt.state_description else None
    if state is not None:  # a non-zero state: reading it is part of what is compared
        rng = np.random.default_rng(seed + 1)
        for name, (shape, dtype) in rt.state_description.items():
            state.write_state(name, (0.1 * rng.standard_normal(shape)).astype(dtype))
    out = dict(rt.predict(_inputs(rt, seed), state=state))
    if state is not None:
        out.update({f"state:{n}": state.read_state(n) for n in rt.state_description})
    return {k: np.asarray(v) for k, v in out.items()}


def _same_outputs(a: Path, b: Path, functions) -> bool:
    for i, fn in enumerate(functions):
        ra, rb = _run(a, fn, seed=i), _run(b, fn, seed=i)
        assert ra.keys() == rb.keys()
        if not all(np.array_equal(ra[k], rb[k], equal_nan=True) for k in ra):
            return False
    return True


def _state_op_names(spec) -> bool:
    """Blank the op names of `spec`'s write_state and read_state ops (in place); whether it had any."""
    found = False
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                if op.type in ("write_state", "read_state"):
                    op.attributes["name"].immediateValue.tensor.strings.values[0] = ""
                    found = True
    return found


EXPECTED_DTYPES = {"encoder": {"FLOAT16"}, "decoder": {"FLOAT16"}, **{k: {v} for k, v in COMPRESSIONS.items()}}


@pytest.mark.parametrize("name", list(EXPECTED_DTYPES))
def test_lean_merge_matches_save_multifunction(merges, name, tmp_path):
    singles, default = merges[name]
    assert len(singles) >= 3
    # the fixture holds the dtypes the merge must copy (else the comparison proves nothing)
    dtypes = set().union(*(_blob_dtypes(p) for p in singles.values()))
    assert EXPECTED_DTYPES[name] <= dtypes
    assert not multifunction.unsupported_blob_dtypes(ct.utils.load_spec(str(singles[default])))

    ref = _reference(singles, default, tmp_path / "ref.mlpackage")
    lean = tmp_path / "lean.mlpackage"
    multifunction.write_multifunction(singles, default, lean)

    ref_spec, lean_spec = ct.utils.load_spec(str(ref)), ct.utils.load_spec(str(lean))
    assert lean_spec.description == ref_spec.description  # functions, default, I/O, states, no metadata
    assert sorted(lean_spec.mlProgram.functions) == sorted(singles)
    # the same spec, but for the op names pyMIL gives the state updates it re-creates
    assert _state_op_names(lean_spec) == _state_op_names(ref_spec) == (name == "decoder")
    assert lean_spec == ref_spec
    # the same weight file, byte for byte: identical weights stored once, in coremltools' order
    weights = "Data/com.apple.CoreML/weights/weight.bin"
    assert (lean / weights).read_bytes() == (ref / weights).read_bytes()
    assert weight_file_bytes(lean) < sum(weight_file_bytes(p) for p in singles.values())
    assert _same_outputs(lean, ref, list(singles))


def test_merge_functions_takes_the_lean_path(merges, tmp_path, caplog):
    singles, default = merges["decoder"]
    with caplog.at_level("DEBUG"):
        mlmodel = convert.merge_functions(singles, default, tmp_path)
    assert "weight blobs written" in caplog.text and "save_multifunction" not in caplog.text
    spec = mlmodel.get_spec()
    assert spec.description.defaultFunctionName == default
    assert [f.name for f in spec.description.functions] == list(singles)
    ref = _reference(singles, default, tmp_path / "ref.mlpackage")
    assert weight_file_bytes(tmp_path / "merged.mlpackage") == weight_file_bytes(ref)


def test_a_dtype_without_a_lean_copy_goes_through_save_multifunction(merges, tmp_path, monkeypatch, caplog):
    """With fp16 taken out of the lean path's dtypes, merge_functions says so and falls back to
    coremltools (all weights in memory), whose package the lean path would have written."""
    singles, default = merges["decoder"]
    monkeypatch.delitem(multifunction.BLOB_IO, MIL_pb2.FLOAT16)
    assert multifunction.unsupported_blob_dtypes(ct.utils.load_spec(str(singles[default]))) == {"FLOAT16"}
    with caplog.at_level("WARNING", logger="cohere_coreml.export.convert"):
        mlmodel = convert.merge_functions(singles, default, tmp_path)
    assert "save_multifunction" in caplog.text and "FLOAT16" in caplog.text
    assert [f.name for f in mlmodel.get_spec().description.functions] == list(singles)
    monkeypatch.undo()
    lean = tmp_path / "lean.mlpackage"
    multifunction.write_multifunction(singles, default, lean)
    weights = "Data/com.apple.CoreML/weights/weight.bin"
    assert (lean / weights).read_bytes() == (tmp_path / "merged.mlpackage" / weights).read_bytes()


def test_a_wrong_offset_mapping_changes_the_outputs(merges, tmp_path, monkeypatch):
    """Sharing blobs by dtype and shape alone (not their values) points consts at the wrong weights:
    the comparison above must see it."""
    singles, default = merges["encoder"]
    ref = _reference(singles, default, tmp_path / "ref.mlpackage")
    monkeypatch.setattr(multifunction, "blob_key", lambda tensor, data: (tensor.dataType, len(data)))
    broken = tmp_path / "broken.mlpackage"
    multifunction.write_multifunction(singles, default, broken)
    assert weight_file_bytes(broken) < weight_file_bytes(ref)
    assert not _same_outputs(broken, ref, list(singles))


def test_unknown_default_is_refused(merges, tmp_path):
    singles, _ = merges["decoder"]
    with pytest.raises(ValueError, match="default function 'nope'"):
        multifunction.write_multifunction(singles, "nope", tmp_path / "x.mlpackage")


# Prints the peak RSS a merge adds, in a fresh interpreter: argv = mode ("lean" | "coremltools"),
# destination, then the single packages (function = file stem, the first one the default). The peak
# is VmHWM (this process image's high-water mark; ru_maxrss would include the forking parent's).
_MERGE_RSS = """
import sys
from pathlib import Path
sys.modules["torch"] = None  # neither merge uses torch: its import (half the child's CPU) is left out
import coremltools as ct
from cohere_coreml.export import multifunction
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
mode, out, *packages = sys.argv[1:]
singles = {Path(p).stem: Path(p) for p in packages}
before = status("VmRSS")
assert status("VmHWM") - before < 2**26, "imports peaked above the steady state: the peak would hide the merge"
if mode == "lean":
    multifunction.write_multifunction(singles, next(iter(singles)), Path(out))
else:
    desc = ct.utils.MultiFunctionDescriptor()
    for fn, p in singles.items():
        desc.add_function(str(p), src_function_name="main", target_function_name=fn)
    desc.default_function_name = next(iter(singles))
    ct.utils.save_multifunction(desc, out)
print(status("VmHWM") - before)
"""


def test_the_lean_merge_holds_about_one_tensor(tmp_path):
    """Four functions sharing one 64 MiB weight: coremltools holds every function's copy at once,
    the lean merge one (the blob it read, plus the reader's mapped pages of it while it copies)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types

    weight = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
    singles = []
    for i in range(4):
        with Function({"x": mb.placeholder(shape=(1, 4096), dtype=types.fp32)}, opset_version=ct.target.iOS18) as f:
            f.set_outputs([mb.mul(x=mb.linear(x=f.inputs["x"], weight=weight), y=np.float32(i + 1), name="y")])
        prog = Program()
        prog.add_function("main", f)
        path = tmp_path / f"f{i}.mlpackage"
        ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                   pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True).save(str(path))
        singles.append(str(path))
    del weight

    def growth(mode: str) -> int:
        out = tmp_path / f"{mode}.mlpackage"
        run = subprocess.run([sys.executable, "-c", _MERGE_RSS, mode, str(out), *singles],
                             capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    tensor = 4096 * 4096 * 4
    lean, reference = growth("lean"), growth("coremltools")
    assert reference > 3 * tensor  # the fixture shows the difference
    assert lean < 2.5 * tensor
    weights = "Data/com.apple.CoreML/weights/weight.bin"
    assert (tmp_path / "lean.mlpackage" / weights).read_bytes() == (tmp_path / "coremltools.mlpackage" / weights).read_bytes()
