"""The re-measurement queue of BENCHMARKS.md ("How to regenerate"): the rows of its table (job, command, seconds, feeds)
read from the doc and run one at a time, each job's output in its own log, each finished job's exit
code and wall time appended to `times.jsonl` as it ends (a queue stopped half-way keeps what ran).

The doc stays the one place the commands live; this module only reads and runs them. An exit code of 2
is a result, not a failure: a quantize job whose gate refuses its bundle exits 2 with its figures in
`out/<name>.parity-failed.json` (the doc's "Before" paragraph)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RESULT_CODES = (0, 2)  # 2: a gate refused its bundle (its figures are the result)

# | job | `command` | seconds | feeds |   (a command may hold `|`, as in `[ -f x ] || uv run ...`: the
# command is everything between the first backtick and the backtick before "| <seconds> |")
_ROW = re.compile(r"^\|\s*(?P<name>[^|`]+?)\s*\|\s*`(?P<command>.+?)`\s*\|\s*(?P<seconds>\d+)\s*\|(?P<feeds>.*)\|\s*$")
_RUNS = re.compile(r"^(?P<name>.+?)\s*\(x(?P<runs>\d+)\)$")  # "longform-pt (x3)": run three times


class RemeasureError(ValueError):
    """The doc's table cannot be read, or a job named on the command line is not in it."""


@dataclass(frozen=True)
class Job:
    name: str
    command: str
    seconds: int  # the wall time the doc's last re-measurement took (per run)
    feeds: str  # the docs the job's figures go to
    runs: int = 1

    def log_names(self) -> list[str]:
        """One log per run: `name.log`, or `name1.log`, `name2.log`... for a job run several times."""
        return [f"{self.name}.log"] if self.runs == 1 else [f"{self.name}{i}.log" for i in range(1, self.runs + 1)]


def read_jobs(doc: Path) -> list[Job]:
    """The table's rows in the doc's order."""
    if not doc.is_file():
        raise RemeasureError(f"no such doc: {doc}")
    jobs: list[Job] = []
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, runs = m["name"], 1
        if r := _RUNS.match(name):
            name, runs = r["name"], int(r["runs"])
        if any(j.name == name for j in jobs):
            raise RemeasureError(f"{doc}: job {name!r} appears twice in the table")
        jobs.append(Job(name, m["command"], int(m["seconds"]), m["feeds"].strip(), runs))
    if not jobs:
        raise RemeasureError(f"{doc}: no table rows of the form | job | `command` | seconds | feeds |")
    return jobs


def select(jobs: list[Job], only: list[str] | None = None, start: str | None = None) -> list[Job]:
    """`only`: these jobs (in the doc's order); `start`: from this job to the end."""
    names = [j.name for j in jobs]
    unknown = [n for n in [*(only or []), *([start] if start else [])] if n not in names]
    if unknown:
        raise RemeasureError(f"not a job of the table: {', '.join(unknown)} (jobs: {', '.join(names)})")
    if start:
        jobs = jobs[names.index(start):]
    if only:
        jobs = [j for j in jobs if j.name in only]
    return jobs


def run_jobs(jobs: list[Job], logs: Path, cwd: Path, keep_going: bool = False) -> list[dict]:
    """Run each job's command with bash in `cwd`, one at a time, its stdout and stderr in `logs/<log>`.
    Stops after the first exit code other than 0 or 2 unless `keep_going`. Returns one record per run
    (also appended to `logs/times.jsonl` as each run ends)."""
    logs.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    total = sum(j.runs for j in jobs)
    for job in jobs:
        for log_name in job.log_names():
            logger.info("[%d/%d] %s (the doc's run: %d s): %s", len(records) + 1, total, job.name, job.seconds,
                        job.command)
            t0 = time.perf_counter()
            with open(logs / log_name, "w", encoding="utf-8") as log:
                rc = subprocess.run(["bash", "-c", job.command], cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
            record = {"job": job.name, "log": log_name, "returncode": rc,
                      "seconds": round(time.perf_counter() - t0, 1), "doc_seconds": job.seconds}
            records.append(record)
            with open(logs / "times.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if rc in RESULT_CODES:
                logger.info("%s: exit %d in %.0f s%s", job.name, rc, record["seconds"],
                            " (a gate refused its bundle: a result)" if rc == 2 else "")
            else:
                logger.error("%s failed: exit %d in %.0f s; its output: %s", job.name, rc, record["seconds"],
                             logs / log_name)
                if not keep_going:
                    return records
    return records


def summary(records: list[dict]) -> str:
    """A markdown table of the runs (the doc's seconds beside the measured ones) and the total."""
    lines = ["| job | exit | seconds | doc's seconds |", "|---|---|---|---|"]
    lines += [f"| {r['log'].removesuffix('.log')} | {r['returncode']} | {r['seconds']:.0f} | {r['doc_seconds']} |"
              for r in records]
    minutes = sum(r["seconds"] for r in records) / 60
    failed = sum(r["returncode"] not in RESULT_CODES for r in records)
    lines.append(f"\n{len(records)} runs, {minutes:.0f} min; {failed} failed")
    return "\n".join(lines)
