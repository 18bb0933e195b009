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
