"""The re-measurement queue (tools/cohere_coreml_dev/figures.py, tools/bench/remeasure.py): the table of
BENCHMARKS.md ("How to regenerate") read as jobs, run one at a time with their logs and times."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from cohere_coreml_dev.figures import RemeasureError, read_jobs, run_jobs, select, summary  # noqa: E402

from ..helpers import load_tool  # noqa: E402


def _doc(tmp_path: Path, rows: list[str]) -> Path:
    doc = tmp_path / "remeasure.md"
    doc.write_text("# Re-measuring\n\nText with a `command` in it | and a bar.\n\n"
                   "| job | command | seconds | feeds |\n|---|---|---|---|\n" + "\n".join(rows) + "\n\nAfter.\n")
    return doc


def test_the_docs_table_reads_as_the_jobs_its_prose_counts():
    """Every row of BENCHMARKS.md ("How to regenerate") is a job, as many as the doc says it holds; a command holding `||`
    (q8a8-skip) is read whole, and the long-form row runs three times."""
    doc = ROOT / "BENCHMARKS.md"
    jobs = read_jobs(doc)
    rows = int(re.search(r"the (\d+) rows below", doc.read_text()).group(1))
    assert len(jobs) == rows
    by_name = {j.name: j for j in jobs}
    assert by_name["q8a8-skip"].command.startswith("[ -f out/q8a8/manifest.json ] || uv run cohere-coreml quantize")
    assert by_name["q8a8-skip"].command.endswith("--skip-verify --force")
    assert by_name["longform-pt"].runs == 3
    assert by_name["longform-pt"].log_names() == ["longform-pt1.log", "longform-pt2.log", "longform-pt3.log"]
    assert jobs[0].name == "export" and jobs[0].command == "make export"
    assert all(j.seconds > 0 and j.feeds for j in jobs)


def test_a_table_with_a_repeated_job_or_no_rows_is_refused(tmp_path):
    with pytest.raises(RemeasureError, match="'a' appears twice"):
        read_jobs(_doc(tmp_path, ["| a | `true` | 1 | x |", "| a | `false` | 1 | y |"]))
    with pytest.raises(RemeasureError, match="no table rows"):
        read_jobs(_doc(tmp_path, []))
    with pytest.raises(RemeasureError, match="no such doc"):
        read_jobs(tmp_path / "missing.md")


def test_selection_keeps_the_tables_order_and_names_unknown_jobs(tmp_path):
    jobs = read_jobs(_doc(tmp_path, [f"| {n} | `true` | 1 | x |" for n in "abcd"]))
    assert [j.name for j in select(jobs, start="c")] == ["c", "d"]
    assert [j.name for j in select(jobs, only=["d", "b"])] == ["b", "d"]
    assert [j.name for j in select(jobs, only=["a", "d"], start="b")] == ["d"]
    with pytest.raises(RemeasureError, match=r"not a job of the table: e \(jobs: a, b, c, d\)"):
        select(jobs, only=["e"])


def test_jobs_run_in_order_with_their_logs_and_a_refused_gate_does_not_stop_the_queue(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    doc = _doc(tmp_path, [
        "| first | `echo one >> order.txt; echo to-stdout; echo to-stderr >&2` | 3 | a.md |",
        "| refused | `echo two >> order.txt; exit 2` | 4 | b.md |",
        "| twice (x2) | `echo three >> order.txt` | 5 | c.md |",
        "| broken | `echo four >> order.txt; exit 1` | 6 | d.md |",
        "| last | `echo five >> order.txt` | 7 | e.md |",
    ])
    logs = tmp_path / "logs"
    records = run_jobs(read_jobs(doc), logs, cwd=work)
    assert (work / "order.txt").read_text().split() == ["one", "two", "three", "three", "four"]  # stopped at broken
    assert [(r["log"], r["returncode"], r["doc_seconds"]) for r in records] == [
        ("first.log", 0, 3), ("refused.log", 2, 4), ("twice1.log", 0, 5), ("twice2.log", 0, 5), ("broken.log", 1, 6)]
    assert (logs / "first.log").read_text().split() == ["to-stdout", "to-stderr"]
    assert [json.loads(line) for line in (logs / "times.jsonl").read_text().splitlines()] == records
    table = summary(records)
    assert "| twice2 | 0 |" in table and table.endswith("5 runs, 0 min; 1 failed")

    (work / "order.txt").unlink()
    records = run_jobs(read_jobs(doc), tmp_path / "logs2", cwd=work, keep_going=True)
    assert (work / "order.txt").read_text().split() == ["one", "two", "three", "three", "four", "five"]
    assert records[-1]["job"] == "last"


def test_the_script_lists_runs_and_reports_a_failed_queue(tmp_path, capsys):
    script = load_tool("bench/remeasure")
    doc = _doc(tmp_path, ["| ok | `true` | 60 | a.md |", "| bad | `exit 3` | 120 | b.md |", "| after | `true` | 1 | c |"])
    assert script.main(["--doc", str(doc), "--list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "ok\t1 x 60 s\ttrue" and out.splitlines()[-1] == "3 jobs, 3 runs, 3 min by the doc's seconds"

    assert script.main(["--doc", str(doc), "--logs", str(tmp_path / "logs")]) == 1
    captured = capsys.readouterr()
    assert "| bad | 3 |" in captured.out and "| after |" not in captured.out
    assert "remeasure: 1 failed, 1 not run" in captured.err

    assert script.main(["--doc", str(doc), "--logs", str(tmp_path / "logs3"), "--only", "ok", "after"]) == 0
    assert script.main(["--doc", str(doc), "--from", "nope"]) == 2
    assert "remeasure: not a job of the table: nope" in capsys.readouterr().err
