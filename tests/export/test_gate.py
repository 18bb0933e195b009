"""The gate module's own contract (`cohere_coreml.export.gate`): `GateReport` as written to
`<component>.parity.json`, `stage_gated` / `StagedPackage.finish` / `discard` / `export_gated`
installing a package only when its gate passes, `compare_cases` on a tiny real package, the
shipped gate audio. (The one-call pass/refuse round trip of `export_gated` is in test_export.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from cohere_coreml.export.convert import ExportSettings
from cohere_coreml.export.gate import GateCase, GateReport, compare_cases, default_gate_audio, export_gated, stage_gated
from cohere_coreml.export_errors import ParityError
from cohere_coreml.storage.integrity import MANIFEST_NAME

from ..runtime.helpers import save_mil_program

# --------------------------------------------------------------------------------------------
# Cheap fixtures: a writer that makes a small "package" folder, gates that pass or refuse
# --------------------------------------------------------------------------------------------


def writer(marker: str = "new"):
    """write(tmp) -> a folder package holding `marker` (so an installed package shows which write it was)."""
    calls: list[Path] = []

    def write(tmp: Path) -> None:
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "Manifest.json").write_text(json.dumps({"marker": marker}))

    write.calls = calls
    return write


def marker_of(package: Path) -> str:
    return json.loads((package / "Manifest.json").read_text())["marker"]


def gate_of(passed: bool, component: str = "thing", figure: float = 1.0):
    """gate(tmp) -> a report with `passed`; records the paths it gated and checks it sees the written package."""
    seen: list[Path] = []

    def gate(tmp: Path) -> GateReport:
        seen.append(tmp)
        assert (tmp / "Manifest.json").is_file()
        return GateReport(component=component, passed=passed, headline=f"figure {figure}",
                          details={"figure": figure}, text="per-output table")

    gate.seen = seen
    return gate


def hidden_entries(folder: Path) -> list[str]:
    """Staging / old-package leftovers (`.<name>.tmp-<pid>.mlpackage`, `.<name>.old-...`)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------------------------
# GateReport
# --------------------------------------------------------------------------------------------


def test_report_dict_flattens_details_and_lists_only_what_it_has():
    plain = GateReport(component="encoder", passed=True, headline="worst PSNR 80 dB", details={"min_psnr_db": 60.0})
    assert plain.to_dict() == {"component": "encoder", "passed": True, "headline": "worst PSNR 80 dB",
                               "min_psnr_db": 60.0}
    full = GateReport(component="encoder", passed=False, headline="h", details={"x": 1}, cases=[{"case": 0}],
                      skipped=True)
    assert full.to_dict() == {"component": "encoder", "passed": False, "headline": "h", "x": 1, "skipped": True,
                              "cases": [{"case": 0}]}
    assert json.loads(json.dumps(full.to_dict())) == full.to_dict()  # plain JSON


def test_report_of_functions_passes_only_when_every_function_passes():
    ok = GateReport(component="encoder", passed=True, headline="a 90 dB", text="table a")
    bad = GateReport(component="encoder", passed=False, headline="b 20 dB", text="")
    both = GateReport.of_functions("encoder", {"main": ok, "window_2s": ok}, buckets={"window_2s": 200})
    assert both.passed and both.headline == "main: a 90 dB; window_2s: a 90 dB"
    assert both.to_dict()["buckets"] == {"window_2s": 200}
    assert both.to_dict()["functions"] == {"main": ok.to_dict(), "window_2s": ok.to_dict()}
    assert both.text == "[main]\ntable a\n[window_2s]\ntable a"
    one_bad = GateReport.of_functions("encoder", {"main": ok, "window_2s": bad})
    assert not one_bad.passed and "window_2s: b 20 dB" in one_bad.headline
    assert one_bad.text == "[main]\ntable a"  # a function without text adds nothing
    assert not GateReport.of_functions("encoder", {}).passed  # no function gated: no pass


def test_report_summary_and_refusal():
    ok = GateReport(component="decoder", passed=True, headline="flips 0")
    failed = GateReport(component="decoder", passed=False, headline="flips 3", text="row 1\nrow 2")
    skipped = GateReport.skipped_gate("decoder")
    assert ok.summary() == "decoder parity: PASS - flips 0"
    assert failed.summary() == "decoder parity: FAIL - flips 3"
    assert skipped.summary().startswith("decoder parity: SKIPPED - ") and not skipped.passed
    assert skipped.to_dict()["skipped"] is True
    ok.raise_if_failed("decoder.mlpackage")  # a pass raises nothing
    with pytest.raises(ParityError) as info:
        failed.raise_if_failed("out/decoder.mlpackage")
    assert info.value.report is failed
    assert str(info.value) == "decoder parity gate refused out/decoder.mlpackage: flips 3\nrow 1\nrow 2"
    with pytest.raises(ParityError):
        skipped.raise_if_failed("decoder.mlpackage")  # a skipped gate is no pass either


# --------------------------------------------------------------------------------------------
# stage_gated / StagedPackage.finish / discard
# --------------------------------------------------------------------------------------------


def test_stage_then_finish_installs_a_passing_package(tmp_path, caplog):
    """write, then prepare (its gate sees the staged package), then finish: the package is in place with
    its report, the staging path is gone, an older manifest and refusal report are removed."""
    settings = ExportSettings(out_dir=tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{}")  # describes the folder before this package changes
    settings.failed_report_path("thing").write_text("{}")  # an earlier refusal
    write, gate, order = writer("v1"), gate_of(True), []

    def prepare():
        order.append("prepare")
        assert len(write.calls) == 1 and write.calls[0].is_dir()  # references computed after the write
        return gate

    staged = stage_gated("thing", settings, write, prepare)
    assert order == ["prepare"] and staged.tmp == write.calls[0] and staged.tmp.is_dir()
    assert staged.tmp.name.startswith(".thing.tmp-") and staged.tmp.parent == tmp_path
    assert not settings.package_path("thing").exists()  # nothing installed before the gate
    staged.convert_seconds = 1.5
    with caplog.at_level(logging.INFO, logger="cohere_coreml"):
        report = staged.finish()
    assert report.passed and gate.seen == [staged.tmp] and staged.gate is None
    # the one INFO line per package: its verdict, with the conversion's and the gate's time
    verdicts = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "cohere_coreml.export.gate"]
    assert len(verdicts) == 1 and verdicts[0].startswith(report.summary() + " (converted in 1.5 s, gated in ")
    assert marker_of(settings.package_path("thing")) == "v1"
    assert json.loads(settings.report_path("thing").read_text()) == report.to_dict()
    assert names(tmp_path) == ["thing.mlpackage", "thing.parity.json"]  # no manifest, no failed report, no staging


def test_refused_gate_installs_nothing_and_writes_the_failed_report(tmp_path):
    settings = ExportSettings(out_dir=tmp_path)
    staged = stage_gated("thing", settings, writer(), lambda: gate_of(False, figure=2.5))
    with pytest.raises(ParityError, match="thing parity gate refused .*thing.mlpackage: figure 2.5"):
        staged.finish()
    assert names(tmp_path) == ["thing.parity-failed.json"]
    failed = json.loads(settings.failed_report_path("thing").read_text())
    assert failed["passed"] is False and failed["figure"] == 2.5 and failed["headline"] == "figure 2.5"
    assert failed["error"].startswith("thing parity gate refused") and "per-output table" in failed["error"]


def test_refused_forced_reexport_leaves_the_older_package_and_report(tmp_path):
    settings = ExportSettings(out_dir=tmp_path)
    export_gated("thing", settings, writer("old"), gate_of(True, figure=1.0))
    old_report = settings.report_path("thing").read_bytes()
    (tmp_path / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ParityError):
        export_gated("thing", settings.replace(force=True), writer("new"), gate_of(False, figure=9.0))
    assert marker_of(settings.package_path("thing")) == "old"
    assert settings.report_path("thing").read_bytes() == old_report
    assert json.loads(settings.failed_report_path("thing").read_text())["figure"] == 9.0
    assert (tmp_path / MANIFEST_NAME).is_file()  # a refusal changes no file the manifest describes
    assert hidden_entries(tmp_path) == []
    # control: the same forced re-export with a passing gate replaces the package and the report
    export_gated("thing", settings.replace(force=True), writer("new"), gate_of(True, figure=3.0))
    assert marker_of(settings.package_path("thing")) == "new"
    assert json.loads(settings.report_path("thing").read_text())["figure"] == 3.0
    assert names(tmp_path) == ["thing.mlpackage", "thing.parity.json"]


def test_gate_raising_parity_error_without_a_report(tmp_path):
    """A gate that raises ParityError itself (no GateReport attached) still leaves a failed report."""
    settings = ExportSettings(out_dir=tmp_path)

    def gate(tmp: Path) -> GateReport:
        raise ParityError("decoder diverged at step 3")

    with pytest.raises(ParityError, match="diverged"):
        export_gated("thing", settings, writer(), gate)
    assert names(tmp_path) == ["thing.parity-failed.json"]
    assert json.loads(settings.failed_report_path("thing").read_text()) == {
        "component": "thing", "passed": False, "error": "decoder diverged at step 3"}


@pytest.mark.parametrize("where", ["write", "prepare", "gate"])
def test_other_errors_leave_nothing_behind(tmp_path, where):
    """An error that is not a refusal (a writer, a reference or a gate that crashes) propagates, leaves no
    staging folder, no package and no report of either kind."""
    settings = ExportSettings(out_dir=tmp_path)
    base = writer()

    def write(tmp: Path) -> None:
        base(tmp)  # the staging folder exists when it fails
        if where == "write":
            raise OSError("disk full")

    def gate(tmp: Path) -> GateReport:
        raise RuntimeError("interpreter crashed")

    def prepare():
        if where == "prepare":
            raise MemoryError("reference run")
        return gate

    with pytest.raises((OSError, MemoryError, RuntimeError)):
        staged = stage_gated("thing", settings, write, prepare)
        assert where == "gate"
        staged.finish()
    assert names(tmp_path) == []


def test_skip_verify_installs_without_preparing_the_gate(tmp_path):
    """--skip-verify: the gate is never prepared; the package goes in with a report saying so, and that
    report counts as installed (the next run without --force skips the component)."""
    settings = ExportSettings(out_dir=tmp_path, skip_verify=True)

    def prepare():
        raise AssertionError("the gate is not prepared under skip_verify")

    staged = stage_gated("thing", settings, writer("unverified"), prepare)
    assert staged.gate is None
    report = staged.finish()
    assert report.skipped and not report.passed
    assert json.loads(settings.report_path("thing").read_text()) == {
        "component": "thing", "passed": False, "headline": "gate skipped (--skip-verify)", "skipped": True}
    assert marker_of(settings.package_path("thing")) == "unverified"
    assert stage_gated("thing", settings.replace(skip_verify=False), writer(), prepare) is None


def test_installed_component_is_skipped_unless_forced_or_interrupted(tmp_path):
    settings = ExportSettings(out_dir=tmp_path)
    export_gated("thing", settings, writer("first"), gate_of(True))
    again, gate = writer("second"), gate_of(True)
    assert export_gated("thing", settings, again, gate) is None  # package + report present: skipped
    assert again.calls == [] and gate.seen == [] and marker_of(settings.package_path("thing")) == "first"
    # a package without its report (an export interrupted between the two) is exported again
    settings.report_path("thing").unlink()
    assert export_gated("thing", settings, again, gate).passed
    assert len(again.calls) == 1 and marker_of(settings.package_path("thing")) == "second"
    # --force re-exports an installed component
    forced = writer("third")
    assert export_gated("thing", settings.replace(force=True), forced, gate_of(True)).passed
    assert marker_of(settings.package_path("thing")) == "third"


def test_discard_removes_the_staged_package(tmp_path):
    settings = ExportSettings(out_dir=tmp_path)
    gate = gate_of(True)
    staged = stage_gated("thing", settings, writer(), lambda: gate)
    assert staged.tmp.is_dir()
    staged.discard()
    assert names(tmp_path) == [] and staged.gate is None and gate.seen == []
    # a leftover staging folder of this process is replaced, not written into
    stale = stage_gated("thing", settings, writer(), lambda: gate).tmp
    (stale / "stale.bin").write_bytes(b"x")
    fresh = stage_gated("thing", settings, writer("fresh"), lambda: gate)
    assert fresh.tmp == stale and not (fresh.tmp / "stale.bin").exists()
    fresh.finish()
    assert marker_of(settings.package_path("thing")) == "fresh" and hidden_entries(tmp_path) == []


# --------------------------------------------------------------------------------------------
# compare_cases on a tiny real package
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def double_package(tmp_path_factory) -> Path:
    """y = 2 x (float) and n = n_in + 1 (int32): one float and one exact output."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8)), mb.TensorSpec(shape=(1,), dtype=types.int32)],
                opset_version=ct.target.iOS18)
    def prog(x, n):
        y = mb.mul(x=x, y=np.float32(2.0), name="y")
        m = mb.add(x=n, y=np.int32(1), name="m")
        return y, m

    return save_mil_program(prog, tmp_path_factory.mktemp("gate") / "double.mlpackage")


def _cases(scale: float, length_offset: int = 1) -> list[GateCase]:
    rng = np.random.default_rng(0)
    cases = []
    for i in range(2):
        x = rng.standard_normal((1, 8)).astype(np.float32)
        n = np.array([5 + i], np.int32)
        cases.append(GateCase(inputs={"x": x, "n": n}, reference={"y": scale * x, "m": n + length_offset},
                              info={"clip": f"c{i}.wav"}))
    return cases


def test_compare_cases_passes_a_matching_package(double_package):
    # a reference 1e-5 off (PSNR ~100 dB, finite) passes a 60 dB threshold
    report = compare_cases("double", double_package, _cases(2.00002), min_psnr_db=60.0, exact=("m",), units="interpreter",
                           details={"precision": "fp32"})
    assert report.passed and report.component == "double"
    data = report.to_dict()
    assert data["package"] == "double.mlpackage" and data["function"] == "main" and data["precision"] == "fp32"
    assert data["min_psnr_db"] == 60.0 and 90.0 < data["worst_psnr_db"] < 130.0 and data["backend"] == "MilModel"
    assert [c["case"] for c in data["cases"]] == [0, 1] and [c["clip"] for c in data["cases"]] == ["c0.wav", "c1.wav"]
    assert all(c["passed"] and c["predict_seconds"] >= 0 for c in data["cases"])
    assert report.headline.startswith("worst PSNR ") and "over 2 case(s) (need 60 dB)" in report.headline
    assert "clip=c0.wav" in report.text


def test_compare_cases_logs_its_cases_at_debug_only(double_package, caplog):
    """The default verbosity (INFO) shows no per-case table; DEBUG (`cohere-coreml -v`) shows each case,
    and the report keeps them either way (what `<component>.parity.json` holds)."""
    with caplog.at_level(logging.INFO, logger="cohere_coreml"):
        report = compare_cases("double", double_package, _cases(2.00002), min_psnr_db=60.0, units="interpreter")
    assert report.passed and len(report.cases) == 2 and "[double gate] case 1" in report.text
    assert not [r for r in caplog.records if "[double gate]" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="cohere_coreml"):
        compare_cases("double", double_package, _cases(2.00002), min_psnr_db=60.0, units="interpreter")
    cases = [r for r in caplog.records if r.getMessage().startswith("[double gate]")]
    assert [r.levelno for r in cases] == [logging.DEBUG, logging.DEBUG] and "clip=c1.wav" in cases[1].getMessage()


def test_compare_cases_refuses_wrong_floats_and_inexact_integers(double_package):
    """The same package against a reference it does not match: a scaled float output fails on PSNR, an
    integer output one off fails though its PSNR would be high."""
    floats = compare_cases("double", double_package, _cases(2.1), min_psnr_db=60.0, exact=("m",), units="interpreter")
    assert not floats.passed and floats.to_dict()["worst_psnr_db"] < 60.0
    with pytest.raises(ParityError, match="double parity gate refused"):
        floats.raise_if_failed(double_package)
    ints = compare_cases("double", double_package, _cases(2.0, length_offset=2), min_psnr_db=60.0, exact=("m",),
                         units="interpreter")
    assert not ints.passed
    assert [o["problem"] for o in ints.cases[0]["outputs"] if o["name"] == "m"] == ["must match exactly"]
    with pytest.raises(ValueError, match="double gate has no cases"):
        compare_cases("double", double_package, [], min_psnr_db=60.0, units="interpreter")


# --------------------------------------------------------------------------------------------
# Gate audio
# --------------------------------------------------------------------------------------------


def test_default_gate_audio_is_sorted_and_limited():
    clips = default_gate_audio()
    assert [c.name for c in clips] == sorted(c.name for c in clips) and len(clips) >= 2
    assert all(c.suffix in (".flac", ".wav") and c.is_file() for c in clips)
    assert default_gate_audio(max_clips=1) == clips[:1]
    assert default_gate_audio(max_clips=len(clips) + 5) == clips
