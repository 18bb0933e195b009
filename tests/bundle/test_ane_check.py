"""bundle/ane_check.py: the static Neural Engine census (`cohere-coreml ane-check`, docs/ane.md).

Fixtures are small programs written with coremltools' MIL builder and converted with `ct.convert`
(iOS 18), each breaking one rule or none; then the trained default model's fp16 bundle, whose
`ane_check.json` the export writes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cohere_coreml.bundle import ane_check
from cohere_coreml.bundle.ane_check import DEFAULT_RULES, REPORT_FILE, census, program_census

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import get_new_symbol, types  # noqa: E402

T = ct.target.iOS18
FP16, FP32 = ct.precision.FLOAT16, ct.precision.FLOAT32


def _convert(build, path, precision=FP16, **kw):
    """`build()` returns a fresh Program (ct.convert rewrites the one it is given)."""
    ct.convert(build(), convert_to="mlprogram", minimum_deployment_target=T, compute_precision=precision,
               **kw).save(str(path))
    return path


def _mlp(io_dtype):
    def build():
        w1 = np.random.RandomState(0).randn(64, 32).astype(np.float32)
        w2 = np.random.RandomState(1).randn(32, 64).astype(np.float32)

        @mb.program(input_specs=[mb.TensorSpec((1, 8, 16, 32), dtype=io_dtype)], opset_version=T)
        def prog(x):
            y = mb.linear(x=x, weight=w1)
            y = mb.gelu(x=y)
            y = mb.linear(x=y, weight=w2)
            y = mb.layer_norm(x=mb.add(x=y, y=x), axes=[-1])
            return mb.softmax(x=y, axis=-1)
        return prog
    return build


def _gather():
    @mb.program(input_specs=[mb.TensorSpec((1, 4), dtype=types.int32)], opset_version=T)
    def prog(ids):
        table = np.random.RandomState(0).randn(100, 32).astype(np.float16)
        return mb.relu(x=mb.gather(x=table, indices=ids, axis=0))
    return prog


def _rank5():
    @mb.program(input_specs=[mb.TensorSpec((2, 3, 4, 5), dtype=types.fp16)], opset_version=T)
    def prog(x):
        y = mb.relu(x=mb.reshape(x=x, shape=[1, 2, 3, 4, 5]))
        return mb.reshape(x=y, shape=[2, 3, 4, 5])
    return prog


def _wide():
    @mb.program(input_specs=[mb.TensorSpec((1, 2, 1, 10000), dtype=types.fp16)], opset_version=T)
    def prog(x):
        return mb.relu(x=mb.concat(values=[x, x], axis=-1))  # W = 20000 > 16384
    return prog


def _dynamic():
    @mb.program(input_specs=[mb.TensorSpec((1, get_new_symbol(), 8), dtype=types.fp16)], opset_version=T)
    def prog(x):
        return mb.relu(x=x)
    return prog


def _stateful(runtime_position: bool, width: int = 32):
    """A cache state updated by slice_update + coreml_update_state at `position` (an input) or at slot 5."""
    def build():
        specs = [mb.StateTensorSpec((1, 2, 64, width), dtype=types.fp16),
                 mb.TensorSpec((1, 2, 1, width), dtype=types.fp16)]

        def body(cache, new, begin, end):
            x = mb.slice_update(x=mb.read_state(input=cache), update=new, begin=begin, end=end)
            mb.coreml_update_state(state=cache, value=x)
            return mb.reduce_sum(x=x, axes=[2])

        if runtime_position:
            @mb.program(input_specs=[*specs, mb.TensorSpec((1,), dtype=types.int32)], opset_version=T)
            def prog(cache, new, position):
                begin = mb.concat(values=[np.array([0, 0], np.int32), position, np.array([0], np.int32)], axis=0)
                return body(cache, new, begin, mb.add(x=begin, y=np.array([1, 2, 1, width], np.int32)))
        else:
            @mb.program(input_specs=specs, opset_version=T)
            def prog(cache, new):
                return body(cache, new, np.array([0, 0, 5, 0], np.int32), np.array([1, 2, 6, width], np.int32))
        return prog
    return build


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    d = tmp_path_factory.mktemp("ane")
    return {
        "f16": _convert(_mlp(types.fp16), d / "f16.mlpackage"),
        "f32": _convert(_mlp(types.fp32), d / "f32.mlpackage", FP32),
        "gather": _convert(_gather, d / "gather.mlpackage"),
        "rank5": _convert(_rank5, d / "rank5.mlpackage"),
        "wide": _convert(_wide, d / "wide.mlpackage"),
        "dynamic": _convert(_dynamic, d / "dynamic.mlpackage",
                            inputs=[ct.TensorType(name="x", shape=ct.Shape((1, ct.RangeDim(1, 64), 8)),
                                                  dtype=np.float16)]),
        "state_runtime": _convert(_stateful(True), d / "state_runtime.mlpackage"),
        "state_const": _convert(_stateful(False), d / "state_const.mlpackage"),
        "state_30": _convert(_stateful(False, width=30), d / "state_30.mlpackage"),
    }


def _main(path, **kw):
    return program_census(path, **kw)["functions"]["main"]


def _rules(fn, severity=None):
    return [f["rule"] for f in fn["findings"] if severity is None or f["severity"] == severity]


def check_fp32_all_off_ane(path, rules=DEFAULT_RULES):
    """The fp32 program's every compute op is predicted off the ANE (what a dtype-aware census must say)."""
    fn = _main(path, rules=rules)
    assert fn["ops"]["compute"] >= 5 and fn["fp16_compute"] == 0
    assert fn["off_ane_ops"] == fn["ops"]["compute"], fn
    assert fn["partitions"] == 0


def test_fp16_program_is_all_on_the_ane(packages):
    fn = _main(packages["f16"])
    assert fn["ops"]["compute"] == fn["fp16_compute"] >= 5
    assert fn["ops"]["by_dtype"] == {"float16": fn["ops"]["compute"]} and fn["ops"]["const"] > 0
    assert fn["off_ane_ops"] == 0 and fn["partitions"] == 1 and fn["findings"] == []
    assert program_census(packages["f16"])["errors"] == 0


def test_fp32_program_is_all_off_the_ane(packages):
    check_fp32_all_off_ane(packages["f32"])
    fn = _main(packages["f32"])
    assert set(_rules(fn)) == {"non-fp16-compute"}
    assert all(f["dtype"] == "float32" and f["shape"] for f in fn["findings"])


def test_a_dtype_blind_census_is_rejected(packages):
    """The broken variant (the census without its dtype rule) misses the fp32 ops: the same check fails."""
    blind = DEFAULT_RULES - {"non-fp16-compute"}
    with pytest.raises(AssertionError):
        check_fp32_all_off_ane(packages["f32"], rules=blind)
    assert _main(packages["f32"], rules=blind)["off_ane_ops"] == 0


def test_gather_is_off_the_ane_with_its_source(packages):
    fn = _main(packages["gather"])
    gathers = [f for f in fn["findings"] if f["rule"] == "gather-scatter"]
    assert [g["op_type"] for g in gathers] == ["gather"]
    assert gathers[0]["shape"] == [1, 4, 32] and gathers[0]["dtype"] == "float16"
    assert "coremltools issue 1103" in gathers[0]["source"]
    assert fn["off_ane_by_type"]["gather"] == 1 and fn["errors"] == 0


def test_rank_over_4_is_an_error(packages):
    report = program_census(packages["rank5"])
    fn = report["functions"]["main"]
    ranks = [f for f in fn["findings"] if f["rule"] == "rank-over-4"]
    assert ranks and all(f["shape"] == [1, 2, 3, 4, 5] for f in ranks)
    # two rank-5 tensors (the reshape's and the relu's outputs), each reported once though two ops read/write it
    assert [f["op_type"] for f in ranks] == ["reshape", "relu"] and len({f["detail"] for f in ranks}) == 2
    assert report["errors"] == 2 and fn["off_ane_ops"] == 0


def test_width_over_16384_is_an_error(packages):
    fn = _main(packages["wide"])
    dims = [f for f in fn["findings"] if f["rule"] == "dim-over-limit"]
    assert dims and dims[0]["shape"] == [1, 2, 1, 20000] and "(W) = 20000 > 16384" in dims[0]["detail"]
    assert fn["errors"] == len(dims)
    assert _main(packages["f16"])["errors"] == 0  # (1, 8, 16, 32): within every limit


def test_dynamic_shape_is_an_error(packages):
    fn = _main(packages["dynamic"])
    dyn = [f for f in fn["findings"] if f["rule"] == "dynamic-shape"]
    assert [f["op"] for f in dyn] == ["x"] and dyn[0]["shape"] == [1, "?", 8]  # the input, once
    assert fn["errors"] == 1


def test_state_written_at_a_runtime_position_is_off_the_ane(packages):
    runtime, const = _main(packages["state_runtime"]), _main(packages["state_const"])
    writes = [f for f in runtime["findings"] if f["rule"] == "state-write-runtime-position"]
    assert sorted(f["op_type"] for f in writes) == ["slice_update", "write_state"]
    assert runtime["state_writes_at_runtime_position"] == 1
    assert runtime["off_ane_by_type"]["slice_update"] == 1 and runtime["off_ane_by_type"]["write_state"] == 1
    assert "mobius PR 77" in writes[0]["source"] and "ANEMLL" in writes[0]["source"]  # counter-evidence named
    # the same write at a constant position: listed (info), not counted off the ANE
    assert const["state_writes_at_runtime_position"] == 0 and "state-write-runtime-position" not in _rules(const)
    assert _rules(const, "info") == ["state-write-in-graph"]
    assert const["off_ane_ops"] == 0 and const["partitions"] == 1
    assert runtime["partitions"] >= 1 and runtime["errors"] == const["errors"] == 0


def test_state_width_not_multiple_of_32_is_a_warning(packages):
    fn = _main(packages["state_30"])
    warned = [f for f in fn["findings"] if f["rule"] == "state-dim-not-multiple-of-32"]
    assert [f["op"] for f in warned] == ["cache"] and warned[0]["shape"] == [1, 2, 64, 30]
    assert fn["warnings"] == 1 and fn["errors"] == 0
    assert _main(packages["state_const"])["warnings"] == 0  # width 32


def test_weights_over_the_limit_are_an_error(packages):
    report = program_census(packages["f16"])
    size = report["weights"]["bytes"]
    assert size > 4096 and report["weights"]["limit_bytes"] == 1 << 30 and report["errors"] == 0
    assert program_census(packages["f16"], platform="macos")["weights"]["limit_bytes"] == 2 << 30
    over = program_census(packages["f16"], weight_limit=size - 1)
    assert over["errors"] == 1 and over["weights"]["errors"][0]["rule"] == "weights-over-limit"
    assert program_census(packages["f16"], weight_limit=size)["errors"] == 0  # at the limit: accepted


def test_partitions_split_at_each_off_ane_op(packages):
    """gather program: casts/compare (int) | gather | relu (fp16): ANE runs only between off-ANE ops."""
    fn = _main(packages["gather"])
    assert fn["partition_sizes"] == [1] and fn["off_ane_ops"] == fn["ops"]["compute"] - 1


def test_bundle_folder_and_summary(packages, tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    for name in ("f16", "gather", "state_runtime"):
        shutil.copytree(packages[name], bundle / f"{name}.mlpackage")
    report = census(bundle)
    assert list(report["programs"]) == ["f16", "gather", "state_runtime"]
    line = report["summary"]
    assert line.startswith("ane-check (ios): 0 errors; ") and "f16 main 0 off-ANE ops / 1 partition " in line
    assert json.loads(json.dumps(report)) == report and str(tmp_path) not in json.dumps(report)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cohere_coreml.cli", "ane-check", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _cli_in_process(capsys, *args):
    """`cohere-coreml ane-check ARGS` through the console script's `main` in this process: (the exit status
    `sys.exit(main())` gives, stdout, stderr). A fresh process costs ~10 s CPU importing coremltools; the real
    process is run where the claim is about it (stdout holding only the JSON; status 2 in test_cli_bad_path)."""
    from cohere_coreml.cli import main

    capsys.readouterr()
    code = main(["ane-check", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_and_exit_codes(packages, capsys):
    ok = _cli(packages["f16"], "--json")  # a real process: its stdout is the JSON alone, status 0
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["programs"]["f16"]["functions"]["main"]["off_ane_ops"] == 0
    code, out, err = _cli_in_process(capsys, packages["rank5"])
    assert code == 1 and "rank-over-4" in out and "(ios): 2 errors" in out, err
    code, out, err = _cli_in_process(capsys, packages["gather"], "--summary")
    assert code == 0 and out.count("\n") == 1 and "gather main" in out, err


def test_cli_bad_path(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        r = _cli(path)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
        assert r.stderr.startswith("cohere-coreml ane-check: error: ")


@pytest.mark.skipif(sys.platform == "darwin", reason="Core ML's compute plan exists on macOS")
def test_cli_device_needs_macos(packages):
    r = _cli(packages["f16"], "--device")
    assert r.returncode == 2 and "--device needs macOS" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# The trained default model's fp16 bundle (exported once per session: tests/conftest.py)
# --------------------------------------------------------------------------------------------


def _pymil_non_fp16_compute(path, function):
    """An independent count: the function loaded by coremltools' own milproto loader (PyMIL), every op
    but consts whose output is not fp16."""
    from cohere_coreml.runtime.package import load_mil_function, read_package

    fn = load_mil_function(read_package(path, function))
    count = 0

    def visit(block):
        nonlocal count
        for op in block.operations:
            if op.op_type == "const" or op.op_type.startswith("constexpr_"):
                continue
            dtypes = {o.dtype for o in op.outputs if types.is_tensor(o.sym_type) or types.is_scalar(o.sym_type)}
            dtypes = {types.builtin_to_string(d if not types.is_tensor(d) else d.get_primitive()) for d in dtypes}
            if dtypes and dtypes != {"fp16"}:
                count += 1
            for inner in op.blocks:
                visit(inner)

    visit(fn)
    return count


def test_trained_bundle_census(trained_bundle, capsys):
    """The export wrote ane_check.json (listed in the manifest's checksums, equal to a census run now):
    no hard violation; the decoder's embedding gathers are listed with their source; the non-fp16 count
    agrees with coremltools' own loader of every function."""
    from cohere_coreml.storage.integrity import check_bundle

    stored = json.loads((trained_bundle / REPORT_FILE).read_text())
    manifest = json.loads((trained_bundle / "manifest.json").read_text())
    assert REPORT_FILE in manifest["checksums"]["files"]
    check_bundle(trained_bundle, hashes=True)
    report = census(trained_bundle)
    assert stored == report
    assert report["errors"] == 0
    assert set(report["programs"]) >= {"encoder", "decoder", "frontend"}
    assert not report["programs"]["frontend"]["fp16_program"]
    dec = report["programs"]["decoder"]["functions"]["main"]
    gathers = [f for f in dec["findings"] if f["rule"] == "gather-scatter"]
    assert len(gathers) == 2 and all(g["op_type"] == "gather" for g in gathers)
    for label, prog in report["programs"].items():
        for name, fn in prog["functions"].items():
            assert fn["off_ane_by_rule"].get("non-fp16-compute", 0) == _pymil_non_fp16_compute(
                trained_bundle / f"{label}.mlpackage", name), (label, name)
            assert fn["off_ane_ops"] == sum(fn["off_ane_by_type"].values())
            assert sum(fn["partition_sizes"]) == fn["ops"]["compute"] - fn["off_ane_ops"]
    with capsys.disabled():
        print("\n" + ane_check.format_table(report))


def test_finalize_writes_the_report_and_the_card_line(trained_bundle, tmp_path):
    from cohere_coreml.publish.card import README
    from cohere_coreml.publish.hub import finalize_bundle
    from cohere_coreml.storage.integrity import check_bundle

    bundle = tmp_path / "f16"
    shutil.copytree(trained_bundle, bundle)
    (bundle / REPORT_FILE).unlink()
    finalize_bundle(bundle)
    summary = json.loads((bundle / REPORT_FILE).read_text())["summary"]
    assert summary.startswith("ane-check (ios): 0 errors")
    assert f"`{summary}`" in (bundle / README).read_text()
    check_bundle(bundle, hashes=True)


def test_module_imports_no_torch_or_coremltools():
    """The census module is light: torch, transformers and coremltools load only when a package is read."""
    code = ("import sys, cohere_coreml.bundle.ane_check; "
            "print(sorted(m for m in ('torch', 'transformers', 'coremltools') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
