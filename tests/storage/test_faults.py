"""Fault injection: what a killed (SIGKILL) or disk-full (ENOSPC) export, quantize or `bundle finalize`
leaves, and that running the same command again succeeds; a dry-run upload writes nothing.

The commands run in child processes with `COHERE_COREML_FAULT=<point>:<k>:kill|enospc`
(`cohere_coreml.storage.faults`): `kill` SIGKILLs the child at that point (no `finally`, no cleanup), `enospc`
raises OSError(ENOSPC) there. To keep a case cheap the children are forked from one "zygote" process
that imported torch, coremltools and the package once (`_Zygote`); each child runs `cli.main(argv)`,
what the `cohere-coreml` script runs, with the variable in its environment. Two tests run the real
console script as a fresh subprocess instead (finalize killed, dry-run upload), and one fills a real
size-limited tmpfs in a private mount namespace (a zygote child that unshares its mounts, as `unshare -m`;
root only; skipped otherwise).

After every fault the folder must be the previous bundle, unchanged (every file's sha256, and `bundle
check` passes), or hold nothing that looks complete: `bundle check` refuses it and, if `Bundle.load`
accepts it, every file its manifest lists still has the recorded sha256 (what loads is what the manifest
describes). No visible name may be a temporary. The same command run again must succeed, leave no
temporary behind and give the bundle a clean run gives (weights byte-identical; the manifest's checksum
table equal once package timestamps and identifiers are set aside).

The default cases are the points that matter (docs/reliability.md, "Faults"); COHERE_COREML_FAULTS_FULL=1
runs every point of every command, killed and (write points) disk-full. COHERE_COREML_FAULTS_REPORT=<file>
appends one JSON line per case (the table of docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FULL = os.environ.get("COHERE_COREML_FAULTS_FULL") == "1"
REPORT = os.environ.get("COHERE_COREML_FAULTS_REPORT")
SCRIPT = Path(sys.executable).with_name("cohere-coreml")  # the console script of this environment
EXPORT_ARGS = ("--precision", "fp32", "--window-seconds", "2", "--max-tokens", "22", "--skip-verify", "--no-vad")
QUANTIZE_ARGS = ("--preset", "q8", "--skip-verify")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_OFFLINE": "1"}

# The zygote: imports once, then forks one child per request; the child runs `cli.main(argv)` with the
# request's environment (COHERE_COREML_FAULT...) and its output in a log file; the zygote waits for it
# (no zombie: a dead child's pid is gone, as after a real kill) and answers its exit status.
ZYGOTE = r"""
import json, os, sys, time, traceback
import torch
torch.set_num_threads(1)
import coremltools, coremltools.converters.mil.frontend.torch, coremltools.optimize.coreml
from transformers import AutoProcessor, AutoTokenizer, CohereAsrForConditionalGeneration, CohereAsrProcessor
from cohere_coreml import bundle, cli, export, publish, quantize, runtime
from cohere_coreml.export import decoder, encoder, frontend
from cohere_coreml.model import checkpoint, reference, shapes
from cohere_coreml.storage import faults
from cohere_coreml.runtime import package
import gc
gc.collect()
gc.freeze()  # the imported objects: no collection in a child walks them (nor copies their pages)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            os.environ.update(req["env"])
            faults.reset()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            if req.get("setup"):
                exec(req["setup"], {})
            if req.get("script"):  # a program of its own, as `python -c script *args` would run it
                sys.argv = ["-c", *req["argv"]]
                exec(req["script"], {"__name__": "__main__"})
                rc = 0
            else:
                rc = cli.main(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps({"status": code, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
"""


@dataclass
class Run:
    status: int  # exit code, or -signal
    log: str
    seconds: float
    trace: list[str]  # fault points reached, in order (with tracing on)


class _Zygote:
    def __init__(self, folder: Path):
        self.folder = folder
        self.n = 0
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(folder / "zygote.err", "w"), text=True,
                                     env={**os.environ, **CHILD_ENV}, preexec_fn=lambda: os.nice(10))
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fault zygote did not start: {(folder / 'zygote.err').read_text()[-2000:]}")

    def run(self, argv, fault: str | None = None, setup: str | None = None, script: str | None = None,
            tracing: bool = True) -> Run:
        self.n += 1
        log, trace = self.folder / f"run{self.n}.log", self.folder / f"run{self.n}.trace"
        env = {"COHERE_COREML_FAULT_TRACE": str(trace)} if tracing else {}
        if fault:
            env["COHERE_COREML_FAULT"] = fault
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "env": env, "log": str(log),
                                          "setup": setup, "script": script}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        points = [line.split("\t")[0] for line in trace.read_text().splitlines()] if trace.exists() else []
        return Run(answer["status"], log.read_text(), answer["seconds"], points)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = _Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


# --------------------------------------------------------------------------------------------
# What a folder holds
# --------------------------------------------------------------------------------------------


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def visible_files(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file not under a hidden name (what a bundle consists of)."""
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): _sha(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}


def temporaries(folder: Path, prefix: str = "") -> list[str]:
    """Hidden temporaries of this package (`.<name>.tmp-<pid>...`, `.<name>.old-<pid>...`) in `folder`."""
    from cohere_coreml.storage.files import TEMPORARY_NAME

    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if TEMPORARY_NAME.match(p.name) and p.name.startswith(f".{prefix}"))


def check_passes(folder: Path) -> bool:
    from cohere_coreml.storage.integrity import IntegrityError, check_bundle

    try:
        check_bundle(folder)
    except (IntegrityError, OSError):
        return False
    return True


def loads(folder: Path) -> dict | None:
    """The manifest when `Bundle.load` accepts the folder, else None."""
    from cohere_coreml.bundle.format import BundleError
    from cohere_coreml.bundle.load import Bundle

    try:
        return Bundle.load(folder).manifest if folder.is_dir() else None
    except BundleError:
        return None


def assert_after_fault(out: Path, previous: dict[str, str] | None, allowed: set[str]) -> str:
    """The outcome of a fault at `out` (previous: `visible_files` before the command, None: no bundle)."""
    names = {rel.split("/", 1)[0] for rel in visible_files(out)}
    assert names <= allowed, f"{out} shows names no bundle has (a temporary?): {sorted(names - allowed)}"
    if check_passes(out):
        assert previous is not None and visible_files(out) == previous, (
            f"`bundle check` accepts {out}, which is not the previous bundle")
        return "previous state kept"
    manifest = loads(out)
    if manifest is not None:
        listed = manifest["checksums"]["files"]
        wrong = sorted(rel for rel, want in listed.items() if _sha(out / rel) != want["sha256"])
        assert not wrong, f"Bundle.load accepts {out} but its manifest does not describe {wrong}"
        if previous is not None:
            assert all(previous.get(rel) == want["sha256"] for rel, want in listed.items())
        return "previous files kept, a new file not listed yet (check refuses)"
    return "nothing complete left"


# --------------------------------------------------------------------------------------------
# Comparing a bundle with a clean run's
# --------------------------------------------------------------------------------------------


def _without_seconds(data):
    if isinstance(data, dict):
        return {k: _without_seconds(v) for k, v in data.items() if not k.endswith("_seconds")}
    if isinstance(data, list):
        return [_without_seconds(v) for v in data]
    return data


def _normalized(folder: Path, rel: str) -> str:
    """A digest of one bundle file with what legitimately differs between two runs set aside: the
    creation time in a package's spec, the item identifiers (UUIDs) of a package's Manifest.json,
    timings in compression.json."""
    path = folder / rel
    if rel.endswith(".mlpackage/Manifest.json"):
        data = json.loads(path.read_text())
        entries = sorted(json.dumps(v, sort_keys=True) for v in data["itemInfoEntries"].values())
        root = data["itemInfoEntries"][data["rootModelIdentifier"]]["path"]
        return hashlib.sha256(json.dumps([entries, root]).encode()).hexdigest()
    if rel.endswith("/model.mlmodel"):
        from coremltools.proto import Model_pb2

        spec = Model_pb2.Model()
        spec.ParseFromString(path.read_bytes())
        spec.description.metadata.userDefined.pop("com.cohere_coreml.created_utc", None)
        return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()
    if rel == "compression.json":
        return hashlib.sha256(json.dumps(_without_seconds(json.loads(path.read_text())), sort_keys=True).encode()
                              ).hexdigest()
    return _sha(path)


def bundle_digest(folder: Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    files = manifest.pop("checksums")["files"]
    manifest.pop("created_utc", None)
    return {"manifest": manifest, "files": {rel: _normalized(folder, rel) for rel in files}}


def assert_same_bundle(out: Path, clean: Path) -> None:
    assert check_passes(out), f"{out} does not pass `bundle check`"
    got, want = bundle_digest(out), bundle_digest(clean)
    assert sorted(got["files"]) == sorted(want["files"]), "the rerun's files differ from a clean run's"
    differ = sorted(rel for rel in want["files"] if got["files"][rel] != want["files"][rel])
    assert not differ, f"these files differ from a clean run's: {differ}"
    assert got["manifest"] == want["manifest"]
    weights = [rel for rel in want["files"] if rel.endswith("weight.bin")]
    assert weights and all(_sha(out / rel) == _sha(clean / rel) for rel in weights)  # byte-identical


# --------------------------------------------------------------------------------------------
# Clean runs (references) and the fault points they reach
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


def export_argv(ckpt: Path, out: Path, *extra) -> list:
    return ["export", "--model", ckpt, "--out", out, *EXPORT_ARGS, *extra]


def quantize_argv(src: Path, out: Path, *extra) -> list:
    return ["quantize", "--bundle", src, "--out", out, *QUANTIZE_ARGS, *extra]


@pytest.fixture(scope="module")
def clean_export(zygote, work, tiny_checkpoint):
    out = work / "clean-export"
    run = zygote.run(export_argv(tiny_checkpoint, out))
    assert run.status == 0, run.log[-3000:]
    assert check_passes(out) and not temporaries(out)
    return out, run.trace


@pytest.fixture(scope="module")
def other_export(zygote, work, tiny_checkpoint, tmp_path_factory):
    """The same architecture from another seed: same file sizes, other weights (a previous bundle that a
    half-installed export would turn into a wrong one that `Bundle.load`'s size check cannot tell)."""
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / tiny_checkpoint.name, seed=1)
    # the packages record the checkpoint's path: the same length keeps every file's size
    assert len(str(ckpt)) == len(str(tiny_checkpoint))
    out = work / "other-export"
    run = zygote.run(export_argv(ckpt, out))
    assert run.status == 0, run.log[-3000:]
    return out


@pytest.fixture(scope="module")
def clean_q8(zygote, work, clean_export):
    (work / "clean").mkdir()
    out = work / "clean" / "q8"
    stamps = _stamps(clean_export[0])
    run = zygote.run(quantize_argv(clean_export[0], out))
    assert run.status == 0, run.log[-3000:]
    assert check_passes(out)
    # the f16 bundle is only read: not even a package's Manifest.json is rewritten (coremltools' loader
    # does that, through a visible temporary a kill would leave in the source bundle)
    assert _stamps(clean_export[0]) == stamps
    return out, run.trace


def _stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """(mtime, size) of every entry, hidden ones included: any write shows."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def clean_final(zygote, work, clean_export):
    out = work / "clean-final"
    shutil.copytree(clean_export[0], out)
    run = zygote.run(["bundle", "finalize", out])
    assert run.status == 0, run.log[-3000:]
    assert check_passes(out)
    return out, run.trace


def _record(case: dict) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(case) + "\n")


def _reached(trace: list[str], point: str) -> None:
    """A named case must name a point the clean run reaches (a renamed point fails here, not silently)."""
    name = point.split(":")[0]
    assert name in trace, f"fault point {name} is not reached by the clean run (points: {trace})"


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------

# (operation, scenario, point, action). Scenarios: fresh (no bundle at --out), force (--force over a
# different previous bundle), again (the same command over its own complete bundle).
EXPORT_CASES = [
    ("fresh", "staged/frontend", "kill"),  # staging packages written, hidden; nothing installed
    ("fresh", "write/encoder.parity.json", "kill"),  # a package installed, its gate report not written
    ("fresh", "replace/manifest.json", "kill"),  # everything but the manifest
    ("force", "install/frontend", "kill"),  # another checkpoint's encoder installed over the bundle
    # ("force", "swap/decoder", "kill"): the old decoder moved aside, the new one not yet in place (FULL)
    ("again", "replace/manifest.json", "kill"),  # rerun of a complete export: only the manifest changes
    ("fresh", "stage/decoder", "enospc"),
    ("fresh", "write/manifest.json", "enospc"),
]
QUANTIZE_CASES = [
    ("fresh", "staged/decoder", "kill"),
    ("fresh", "install/q8", "kill"),  # the complete bundle in its hidden folder, not renamed
    ("force", "swap/q8", "kill"),  # the previous q8 moved aside, the new one not renamed yet
    ("force", "write/compression.json", "enospc"),
]
FINALIZE_CASES = [
    ("fresh", "replace/example_inference.py", "kill"),
    ("fresh", "replace/README.md", "kill"),
    ("fresh", "replace/manifest.json", "kill"),
    ("fresh", "write/README.md", "enospc"),
]


def _full(traces: dict[str, list[str]]) -> list[tuple]:
    """Every point of each scenario's clean run, killed; the write points also disk-full."""
    cases = []
    for scenario, trace in traces.items():
        for k, point in enumerate(trace):
            nth = trace[: k + 1].count(point)
            name = point if nth == 1 else f"{point}:{nth}"
            cases.append((scenario, name, "kill"))
            if point.split("/")[0] in ("stage", "write", "install", "copy"):
                cases.append((scenario, name, "enospc"))
    return cases


def _trace_of(zygote, argv_for, out: Path, previous: Path) -> list[str]:
    """The points a clean run of the command reaches over a copy of `previous`."""
    shutil.copytree(previous, out)
    run = zygote.run(argv_for(out))
    assert run.status == 0, run.log[-3000:]
    return run.trace


def _fault_case(zygote, argv_for, out: Path, scenario: str, point: str, action: str, *, previous_dir: Path | None,
                clean: Path, op: str, prefix_dir: Path | None = None, prefix: str = "") -> dict:
    """Run `argv_for(out)` with the fault, check what it leaves, run it again, compare with `clean`."""
    if previous_dir is not None:
        shutil.copytree(previous_dir, out)
    previous = visible_files(out) if previous_dir is not None else None
    allowed = {rel.split("/", 1)[0] for rel in visible_files(clean)} | {"manifest.json"}
    allowed |= {rel.split("/", 1)[0] for rel in (previous or {})}
    spec = point if ":" in point else f"{point}:1"
    fault = zygote.run(argv_for(out), fault=f"{spec}:{action}")
    if action == "kill":
        assert fault.status == -9, f"the fault point {point} was never reached (exit {fault.status}):\n{fault.log[-2000:]}"
    else:
        assert fault.status == 2, f"exit {fault.status} after ENOSPC at {point}:\n{fault.log[-3000:]}"
        assert "No space left on device" in fault.log and "error:" in fault.log
        assert "Traceback" not in fault.log
        where = prefix_dir if prefix_dir is not None else out
        assert not temporaries(where, prefix), f"a failed write left temporaries: {temporaries(where, prefix)}"
    outcome = assert_after_fault(out, previous, allowed)
    rerun = zygote.run(argv_for(out))
    assert rerun.status == 0, f"the rerun after {action} at {point} failed:\n{rerun.log[-3000:]}"
    assert_same_bundle(out, clean)
    where = prefix_dir if prefix_dir is not None else out
    assert not temporaries(where, prefix), f"the rerun left temporaries: {temporaries(where, prefix)}"
    case = {"operation": op, "scenario": scenario, "point": point, "action": action, "outcome": outcome,
            "rerun": "ok, equal to a clean run", "seconds": round(fault.seconds + rerun.seconds, 1)}
    _record(case)
    return case


@pytest.mark.parametrize("scenario,point,action", EXPORT_CASES if not FULL else [("full", "*", "*")])
def test_export_fault(zygote, work, tiny_checkpoint, clean_export, other_export, scenario, point, action):
    clean, trace = clean_export
    previous_of = {"fresh": None, "force": other_export, "again": clean}

    def argv_for(scenario):
        return lambda o: export_argv(tiny_checkpoint, o, *(("--force",) if scenario == "force" else ()))

    if FULL:
        cases = _full({"fresh": trace, "force": _trace_of(zygote, argv_for("force"), work / "export-force-trace",
                                                           other_export)})
    else:
        cases = [(scenario, point, action)]
        if scenario == "fresh":
            _reached(trace, point)
    for scenario, point, action in cases:
        out = work / f"export-{len(list(work.iterdir()))}"
        _fault_case(zygote, argv_for(scenario), out, scenario, point, action, previous_dir=previous_of[scenario],
                    clean=clean, op="export")


@pytest.mark.parametrize("scenario,point,action", QUANTIZE_CASES if not FULL else [("full", "*", "*")])
def test_quantize_fault(zygote, work, clean_export, clean_q8, scenario, point, action):
    clean, trace = clean_q8

    def argv_for(o):
        return quantize_argv(clean_export[0], o, "--force")

    if FULL:
        (work / "q-force-trace").mkdir()
        cases = _full({"fresh": trace, "force": _trace_of(zygote, argv_for, work / "q-force-trace" / clean.name,
                                                           clean)})
    else:
        cases = [(scenario, point, action)]
        if scenario == "fresh":
            _reached(trace, point)
    for scenario, point, action in cases:
        # --out keeps the clean bundle's name (point names carry it): one folder per case
        parent = work / f"q-{len(list(work.iterdir()))}"
        parent.mkdir()
        _fault_case(zygote, argv_for, parent / clean.name, scenario, point, action,
                    previous_dir=clean if scenario == "force" else None, clean=clean, op="quantize",
                    prefix_dir=parent, prefix=f"{clean.name}.")


@pytest.mark.parametrize("scenario,point,action", FINALIZE_CASES if not FULL else [("full", "*", "*")])
def test_finalize_fault(zygote, work, clean_export, clean_final, scenario, point, action):
    clean, trace = clean_final
    cases = [(scenario, point, action)] if not FULL else _full({"fresh": trace})
    if not FULL:
        _reached(trace, point)
    for scenario, point, action in cases:
        out = work / f"final-{len(list(work.iterdir()))}"
        _fault_case(zygote, lambda o: ["bundle", "finalize", o], out, scenario, point, action,
                    previous_dir=clean_export[0], clean=clean, op="finalize")


def test_fault_points_of_each_command(clean_export, clean_q8, clean_final):
    """Every write of each command passes a fault point, in an order that commits last: the manifest
    after everything it describes, a package before its report, a quantized bundle renamed last."""
    export, quantize, finalize = clean_export[1], clean_q8[1], clean_final[1]
    for comp in ("encoder", "frontend", "decoder"):
        assert export.index(f"stage/{comp}") < export.index(f"install/{comp}") < export.index(
            f"replace/{comp}.parity.json")
    assert export[-1] == "replace/manifest.json" and export.count("replace/manifest.json") == 1
    assert {"replace/vocab.json", "replace/tokenizer.json", "replace/processor_config.json"} <= set(export)
    name = clean_q8[0].name
    assert quantize[-1] == f"install/{name}" and "replace/compression.json" in quantize
    assert quantize.index("replace/compression.json") < quantize.index("replace/README.md") < len(quantize) - 1
    assert finalize == ["write/example_inference.py", "replace/example_inference.py", "write/README.md",
                        "replace/README.md", "write/manifest.json", "replace/manifest.json"]
    _record({"operation": "points", "export": len(export), "quantize": len(quantize), "finalize": len(finalize)})


def test_finalize_again_changes_nothing(zygote, work, clean_final):
    """Finalizing a finalized bundle reaches no write point: nothing is rewritten, so nothing can be
    interrupted (the card does not list itself, every file is written only when it changes)."""
    out = work / "final-again"
    shutil.copytree(clean_final[0], out)
    before = _stamps(out)
    run = zygote.run(["bundle", "finalize", out], fault="*:1:kill")
    assert run.status == 0 and run.trace == [], run.trace
    assert _stamps(out) == before and check_passes(out)


def test_killed_finalize_in_a_fresh_process(zygote, work, clean_export, clean_final):
    """The hook in a fresh `cohere-coreml` process (no zygote): SIGKILL at the model card's rename."""
    out = work / "final-script"
    shutil.copytree(clean_export[0], out)
    previous = visible_files(out)
    env = {**os.environ, **CHILD_ENV, "COHERE_COREML_FAULT": "replace/README.md:1:kill"}
    proc = subprocess.run([str(SCRIPT), "bundle", "finalize", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = temporaries(out)
    assert len(left) == 1 and left[0].startswith(".README.md.tmp-")  # the card's temporary, hidden
    allowed = {rel.split("/", 1)[0] for rel in previous} | {"example_inference.py", "README.md"}
    outcome = assert_after_fault(out, previous, allowed)
    assert outcome.startswith("previous files kept")  # example_inference.py is in place, not listed yet
    rerun = zygote.run(["bundle", "finalize", out])
    assert rerun.status == 0, rerun.log[-2000:]
    assert_same_bundle(out, clean_final[0])
    assert not temporaries(out)  # the dead process's temporary was swept
    _record({"operation": "finalize (fresh process)", "scenario": "fresh", "point": "replace/README.md",
             "action": "kill", "outcome": outcome, "rerun": "ok, equal to a clean run"})


def test_dry_run_upload_writes_nothing(work, clean_final):
    """`upload --dry-run` only reads: with a kill armed at every fault point it completes, reaches no
    point, and no file or folder of the bundle (hidden ones included) is created, changed or touched."""
    out = work / "upload"
    shutil.copytree(clean_final[0], out)
    before = _stamps(out)
    trace = work / "upload.trace"
    env = {**os.environ, **CHILD_ENV, "COHERE_COREML_FAULT": "*:1:kill", "COHERE_COREML_FAULT_TRACE": str(trace)}
    proc = subprocess.run([str(SCRIPT), "upload", "--bundle", str(out), "--repo-id", "org/name", "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "would upload" in proc.stdout
    assert not trace.exists()
    assert _stamps(out) == before
    _record({"operation": "upload --dry-run", "scenario": "finalized bundle", "point": "* (every point armed)",
             "action": "kill", "outcome": "no point reached, nothing written", "rerun": "-"})


def test_fault_spec_is_checked():
    from cohere_coreml.storage import faults

    assert faults.parse("install/*") == ("install/*", 1, "kill")
    assert faults.parse("write/manifest.json:2:enospc") == ("write/manifest.json", 2, "enospc")
    for bad in ("", "x:0", "x:one", "x:1:explode", "a:1:kill:extra"):
        with pytest.raises(faults.FaultSpecError):
            faults.parse(bad)


def test_enospc_point_raises_the_errno(monkeypatch, tmp_path):
    """In process: the k-th matching point raises OSError(ENOSPC); a write that fails removes its temporary."""
    import errno

    from cohere_coreml.storage import faults
    from cohere_coreml.storage.files import write_text_atomic

    monkeypatch.setenv(faults.ENV, "replace/*:2:enospc")
    faults.reset()
    write_text_atomic(tmp_path / "a.txt", "one")
    with pytest.raises(OSError) as err:
        write_text_atomic(tmp_path / "b.txt", "two")
    assert err.value.errno == errno.ENOSPC and str(tmp_path / "b.txt") == err.value.filename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no b.txt, no hidden temporary
    monkeypatch.delenv(faults.ENV)
    faults.reset()
    assert write_text_atomic(tmp_path / "b.txt", "two") and not write_text_atomic(tmp_path / "b.txt", "two",
                                                                                    if_changed=True)


# --------------------------------------------------------------------------------------------
# A real full disk: a size-limited tmpfs in a private mount namespace
# --------------------------------------------------------------------------------------------

ENOSPC_DRIVER = r"""
import json, os, shutil, subprocess, sys
mnt, ckpt, clean, result = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", mnt], check=True)
import io, contextlib
from cohere_coreml import cli
from cohere_coreml.storage.integrity import check_bundle
def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    return rc, err.getvalue()
def listing(d):
    return sorted(str(p.relative_to(d)) for p in __import__("pathlib").Path(d).rglob("*")) if os.path.isdir(d) else []
out = os.path.join(mnt, "bundle")
args = ["export", "--model", ckpt, "--out", out, "--precision", "fp32", "--window-seconds", "2", "--max-tokens", "22",
        "--skip-verify", "--no-vad"]
res = {}
res["export_rc"], res["export_err"] = run(args)
res["export_left"] = listing(out)
subprocess.run(["umount", mnt], check=True)  # more space, as a user frees it
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], check=True)
os.makedirs(out)
shutil.copytree(clean, out, dirs_exist_ok=True)  # an exported bundle, then a disk with ~2 KB free
free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
with open(os.path.join(mnt, "filler"), "wb") as f:
    f.write(b"\0" * (free - 2048))
before = {str(p): open(p, "rb").read() for p in __import__("pathlib").Path(out).rglob("*") if p.is_file()}
res["finalize_rc"], res["finalize_err"] = run(["bundle", "finalize", out])
after = {str(p): open(p, "rb").read() for p in __import__("pathlib").Path(out).rglob("*") if p.is_file()}
res["finalize_unchanged"] = before == after
res["finalize_left"] = listing(out)
os.remove(os.path.join(mnt, "filler"))
res["rerun_rc"], res["rerun_err"] = run(["bundle", "finalize", out])
check_bundle(out)
res["rerun_files"] = listing(out)
json.dump(res, open(result, "w"))
"""


# The driver runs in a child of the zygote (its imports done once) that first enters a mount namespace
# of its own, what `unshare -m --propagation private` gives a command: mounts made there are its own.
PRIVATE_MOUNTS = r"""
import ctypes, subprocess
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
"""


def test_real_full_disk(zygote, work, tiny_checkpoint, clean_export):
    """ENOSPC from a real file system: export into a 1.2 MB tmpfs (the packages do not fit), finalize a
    bundle on a disk with 2 KB left. Each fails with one line naming the problem, leaves nothing (export)
    or the bundle unchanged (finalize), and succeeds once there is space."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a size-limited tmpfs needs root and unshare (private mount namespace)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    mnt, result = work / "tmpfs", work / "enospc.json"
    mnt.mkdir()
    run = zygote.run([mnt, tiny_checkpoint, clean_export[0], result], setup=PRIVATE_MOUNTS, script=ENOSPC_DRIVER,
                     tracing=False)
    assert run.status == 0, run.log[-3000:]
    res = json.loads(result.read_text())
    assert res["export_rc"] == 2 and "No space left on device" in res["export_err"], res["export_err"][-2000:]
    assert "Traceback" not in res["export_err"]
    assert res["export_left"] == [], res["export_left"]  # not even a hidden staging package
    assert res["finalize_rc"] == 2 and "No space left on device" in res["finalize_err"], res["finalize_err"]
    assert res["finalize_unchanged"] and not any("tmp-" in n for n in res["finalize_left"])
    assert res["rerun_rc"] == 0 and {"README.md", "example_inference.py"} <= set(res["rerun_files"])
    _record({"operation": "export, finalize", "scenario": "real tmpfs (1.2 MB; 2 KB free)", "point": "-",
             "action": "real ENOSPC", "outcome": "export: nothing left; finalize: previous state kept",
             "rerun": "ok once space is freed"})
