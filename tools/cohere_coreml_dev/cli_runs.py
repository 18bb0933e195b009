"""`cohere-coreml` commands run by the benchmark scripts (tools/bench/bench_quantize.py,
tools/bench/bench_compression.py): each in a child process, so its peak RSS is its own, with the gate
figures read back from the bundle it wrote (or from its refusal file)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_CHILD = ("import resource, sys; from cohere_coreml.cli import main; rc = main(sys.argv[1:]); "
          "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True); sys.exit(rc)")


def run_cli(args: list[str], check: bool = True, log: Path | None = None) -> dict:
    """`cohere-coreml ARGS` in a child process: wall time, peak RSS, output (and the exit code); its
    log (stderr, with each stage's timings) is kept in `log`."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if log is not None:
        log.write_text(proc.stderr)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss = next((int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_KB")), 0)
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(rss / 1024**2, 2), "stdout": proc.stdout,
            "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}


def gate_figures(gate: dict) -> dict:
    """The gate figures of a quantized bundle (compression.json's `gate`, or a refusal file's)."""
    enc, dec = gate.get("encoder", {}), gate.get("decoder", {})
    out = {"encoder_passed": enc.get("passed"), "encoder_psnr_db": enc.get("worst_psnr_db")}
    if dec:
        out.update(decoder_passed=dec.get("passed"), decoder_psnr_db=dec.get("worst_psnr_db"),
                   decoder_mean_kl=dec.get("mean_kl"), argmax=f"{dec.get('argmax_agree')}/{dec.get('steps')}",
                   log_prob_error_nats=dec.get("abs_error_nats"), flip_bound_nats=dec.get("flip_bound_nats"),
                   eos_error_nats=dec.get("eos_error_nats"))
    return out


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def checkpoint_parameters(folder: Path) -> int:
    """Parameters of a Hugging Face checkpoint folder, from its safetensors headers (no weights read):
    the denominator of every bytes-per-parameter figure (`quantize.mixed.count_parameters`, the one
    counter; its error as a clear exit)."""
    from cohere_coreml.quantize import QuantizeError  # the product package: only the benches need it here
    from cohere_coreml.quantize.mixed import count_parameters

    try:
        return count_parameters(folder)
    except QuantizeError as err:
        raise SystemExit(str(err)) from err


_TIMED = ("import sys; from cohere_coreml.cli import main; sys.exit(main(sys.argv[1:]))")
_TIME_FIELDS = {"Maximum resident set size (kbytes)": "peak_rss_kb", "Elapsed (wall clock) time (h:mm:ss or m:ss)":
                "wall", "User time (seconds)": "user", "System time (seconds)": "system"}


def timed_cli(args: list[str], log: Path | None = None) -> dict:
    """`cohere-coreml ARGS` in a child process under `/usr/bin/time -v` (GNU time): its peak resident set
    (`Maximum resident set size`), wall time and CPU time (user + system: steadier than wall time on a shared
    machine) as time reports them, and the exit code; the child's log
    (stderr, time's report at its end) is kept in `log`. SystemExit when GNU time is missing."""
    if not Path("/usr/bin/time").is_file():
        raise SystemExit("/usr/bin/time (GNU time, for `-v`) is missing: install it (apt-get install time)")
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", _TIMED, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if log is not None:
        log.write_text(proc.stderr)
    found = {}
    for line in proc.stderr.splitlines():
        name, _, value = line.strip().rpartition(": ")
        if name in _TIME_FIELDS:
            found[_TIME_FIELDS[name]] = value
    if "peak_rss_kb" not in found:
        raise SystemExit(f"no report of /usr/bin/time -v in the output of {' '.join(args[:1])}:\n{proc.stderr[-2000:]}")
    wall = 0.0
    for part in found["wall"].split(":"):  # h:mm:ss or m:ss.ss
        wall = wall * 60 + float(part)
    rss_kb = int(found["peak_rss_kb"])
    return {"returncode": proc.returncode, "peak_rss_kb": rss_kb, "peak_rss_gb": round(rss_kb * 1024 / 1e9, 2),
            "peak_rss_gib": round(rss_kb / 1024**2, 2),
            "wall_seconds": round(wall, 1), "cpu_seconds": round(float(found.get("user", 0)) + float(found.get("system", 0)), 1),
            "seconds": round(seconds, 1), "stderr_tail": proc.stderr[-2000:]}


def weight_digests(bundle: Path) -> dict[str, str]:
    """sha256 of every weight file of a bundle's packages (`<package>/Data/com.apple.CoreML/weights/*`), by its
    path in the bundle: what tells two exports' weights apart byte for byte (the specs differ anyway: they
    record the export's time)."""
    import hashlib

    digests = {}
    for path in sorted(Path(bundle).glob("*.mlpackage/Data/com.apple.CoreML/weights/*")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 23), b""):
                digest.update(block)
        digests[str(path.relative_to(bundle))] = digest.hexdigest()
    return digests
