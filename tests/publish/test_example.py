"""The shipped example_inference.py, run as a user runs it: `python -I` in a venv that holds only
numpy, soundfile and coremltools (at uv.lock's versions), on the trained model's finalized bundle.

There is no Core ML on Linux, so the venv also holds tests/coreml_interpreter_shim.py (loaded by a
`.pth` file, active only when COHERE_COREML_SHIM_COMMAND is set): coremltools' MLModel predictions
go to the project's MIL interpreter (`cohere-coreml serve-runtime`). The example's token ids must
equal the project's own `Transcriber` on the same clips and bundle; a bundle whose front-end package
computes other features must change them (the example uses the bundle's front end, not its own).

The venv is built once per set of pins and cached under out/example-venv/ (a fresh machine builds
it from the package registry with uv; no Hugging Face access is needed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from cohere_coreml.export.convert import ExportSettings
from cohere_coreml.export.frontend import FrontEndForCoreML, convert_frontend
from cohere_coreml.inference.transcribe import Transcriber
from cohere_coreml.model.audio import FrontEndConfig, load_audio, split_points
from cohere_coreml.model.shapes import frontend_shapes
from cohere_coreml.publish.card import EXAMPLE, example_source
from cohere_coreml.publish.hub import finalize_bundle

from ..inference.test_batch_decoding import VECTORS as BATCH_VECTORS
from ..inference.test_batch_decoding import Scripted, several_windows

ROOT = Path(__file__).resolve().parents[2]
AUDIO_DIR = ROOT / "tests" / "data" / "audio"
HELDOUT_DIR = ROOT / "tests" / "data" / "heldout"
SHIM = Path(__file__).resolve().parents[1] / "coreml_interpreter_shim.py"
SHIM_ENV = "COHERE_COREML_SHIM_COMMAND"
VENV_CACHE = ROOT / "out" / "example-venv"
EXAMPLE_PACKAGES = ("numpy", "soundfile", "coremltools")  # what the model card tells users to install
SERVE = [sys.executable, "-m", "cohere_coreml.cli", "serve-runtime", "--num-threads", "1"]
SERVE_ARGV = SERVE[SERVE.index("serve-runtime"):]  # what `cli.main` gets: the command's own arguments

# The interpreter children: each example run starts its own `serve-runtime` child (the shim does, on its
# first model load), which imports torch and coremltools afresh (~6 s CPU of its ~10). To keep a run cheap
# the children are forked from one server that imported them once (as tests/storage/test_faults.py's zygote):
# the shim's command is SERVE_CLIENT, a stdlib-only process that hands its own stdin, stdout and stderr
# (the shim's pipes, the example's stderr) to the server over a Unix socket (SCM_RIGHTS); the server
# forks a child that runs `cli.main(SERVE_ARGV)` (what `cohere-coreml serve-runtime` runs) on those very
# file descriptors and, when it ends, sends its exit status back, which the client exits with. Each run
# still gets a fresh interpreter process of its own (no model or state is shared between runs).
SERVE_ZYGOTE = r"""
import ctypes, json, os, signal, socket, sys, traceback
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with the test process, whatever happens
import torch
torch.set_num_threads(1)
import coremltools, coremltools.proto, coremltools.converters.mil.frontend.milproto.load
import coremltools.converters.mil.mil
from cohere_coreml import cli
from cohere_coreml.runtime import interpreter, package, serve
import gc
gc.collect()
gc.freeze()  # the imported objects: no collection walks them (nor copies their pages) in a child
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(16)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    msg, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    if msg == b"quit":
        break
    if os.fork() == 0:
        rc = 1
        try:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            # as in a fresh process, sys.__stdout__ & co. keep the streams (serve-runtime rebinds sys.stdout)
            sys.stdin = sys.__stdin__ = os.fdopen(0, "r")
            sys.stdout = sys.__stdout__ = os.fdopen(1, "w")
            sys.stderr = sys.__stderr__ = os.fdopen(2, "w", buffering=1)
            rc = cli.main(json.loads(msg))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            try:
                conn.sendall(json.dumps({"status": rc}).encode())
            finally:
                os._exit(rc if isinstance(rc, int) else 1)
    for fd in fds:
        os.close(fd)
    conn.close()
"""
SERVE_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
socket.send_fds(s, [sys.argv[2].encode()], [0, 1, 2])
answer = b""
while chunk := s.recv(4096):
    answer += chunk
sys.exit(json.loads(answer)["status"] if answer else 1)
"""


@pytest.fixture(scope="module")
def serve_command(tmp_path_factory):
    """The shim's command (a JSON list): a fresh `serve-runtime` child per run, forked (see SERVE_ZYGOTE)."""
    import socket
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="serve-", dir="/tmp"))  # a socket path must be short
    path = folder / "s"
    log = tmp_path_factory.mktemp("serve") / "zygote.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_ZYGOTE, str(path)], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the serve-runtime zygote did not start: {log.read_text()[-2000:]}")
    yield json.dumps([sys.executable, "-I", "-S", "-c", SERVE_CLIENT, str(path), json.dumps(SERVE_ARGV)])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(b"quit")
    proc.wait(timeout=60)
    shutil.rmtree(folder, ignore_errors=True)


def locked_requirements(lock: Path = ROOT / "uv.lock") -> list[str]:
    """`name==version[; marker]` of EXAMPLE_PACKAGES and everything they need, as uv.lock pins them."""
    packages: dict[str, list[dict]] = {}
    for p in tomllib.loads(lock.read_text())["package"]:
        packages.setdefault(p["name"], []).append(p)
    pins, todo = {}, [(name, None) for name in EXAMPLE_PACKAGES]
    while todo:
        name, marker = todo.pop()
        if name in pins:
            continue
        entries = packages.get(name, [])
        if len(entries) != 1:
            raise AssertionError(f"uv.lock holds {len(entries)} versions of {name}: cannot pin it for the example venv")
        pins[name] = f"{name}=={entries[0]['version']}" + (f" ; {marker}" if marker else "")
        todo += [(d["name"], d.get("marker")) for d in entries[0].get("dependencies", [])]
    return sorted(pins.values())


def uv_command() -> list[str]:
    """uv as `make` finds it: $UV (set by `uv run`), `uv` on PATH, else `python3 -m uv`."""
    if os.environ.get("UV"):
        return [os.environ["UV"]]
    if shutil.which("uv"):
        return [shutil.which("uv")]
    return [shutil.which("python3") or "python3", "-m", "uv"]


def build_venv(requirements: list[str], cache: Path = VENV_CACHE) -> Path:
    """The python of a venv holding exactly `requirements` and the shim; cached by the pins."""
    python_tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha256("\n".join([python_tag, "bytecode", *requirements]).encode()).hexdigest()[:16]
    venv = cache / f"{python_tag}-{key}"
    done = venv / ".complete"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    if not done.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        uv = uv_command()
        subprocess.run([*uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env)
        req = venv / "requirements.txt"
        req.write_text("\n".join(requirements) + "\n")
        # --compile-bytecode: the example's processes import coremltools and torch in a fresh interpreter
        # each; where PYTHONDONTWRITEBYTECODE is set nothing else compiles them (26 s per import, not 11)
        subprocess.run([*uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(venv / "bin" / "python"),
                        "-r", str(req)], check=True, env=env)
        done.write_text("\n".join(requirements) + "\n")
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shutil.copyfile(SHIM, site / SHIM.name)  # every run: the shim of this checkout
    (site / "coreml_interpreter_shim.pth").write_text("import coreml_interpreter_shim\n")
    return python


@pytest.fixture(scope="session")
def example_python() -> Path:
    return build_venv(locked_requirements())


@pytest.fixture(scope="session")
def finalized_bundle(trained_bundle, tmp_path_factory) -> Path:
    """The trained model's bundle, finalized (model card, example_inference.py, checksums)."""
    out = tmp_path_factory.mktemp("example") / "bundle"
    shutil.copytree(trained_bundle, out)
    finalize_bundle(out)
    return out


def run_example(python: Path, bundle: Path, audio: Path, language: str, *args: str, script: Path | None = None,
                serve: str = json.dumps(SERVE)) -> subprocess.CompletedProcess:
    env = {**os.environ, SHIM_ENV: serve}
    return subprocess.run([str(python), "-I", str(script or bundle / EXAMPLE), str(audio), "--language", language,
                           "--bundle", str(bundle), "--json", *args],
                          env=env, capture_output=True, text=True, timeout=900, cwd=bundle)


# --------------------------------------------------------------------------------------------
# Fast: the file, its copy into bundles, its long-audio split
# --------------------------------------------------------------------------------------------


def test_example_is_package_data():
    """The example is a file of the installed package (wheel package data), read by publish."""
    packaged = resources.files("cohere_coreml").joinpath("data", EXAMPLE).read_text()
    assert packaged == example_source()
    assert "import cohere_coreml" not in packaged and "from cohere_coreml" not in packaged
    imports = {line.split()[1].split(".")[0] for line in packaged.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports == {"argparse", "hashlib", "json", "os", "shutil", "sys", "tempfile", "unicodedata", "uuid",
                       "pathlib", "coremltools", "numpy", "soundfile"}


def test_locked_requirements_pin_the_example_packages():
    """Every pin is exact and comes from uv.lock; coremltools' own dependencies are in, torch is not."""
    reqs = locked_requirements()
    names = {r.split("==")[0] for r in reqs}
    assert set(EXAMPLE_PACKAGES) <= names and "protobuf" in names and "cffi" in names
    assert not names & {"torch", "transformers", "cohere-transcribe-coreml"}
    lock = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    for r in reqs:
        name, version = r.split(" ;")[0].split("==")
        assert lock[name] == version


def load_example_module():
    """The example as a module (its functions only: main() is not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_inference", resources.files("cohere_coreml") / "data" / EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example_variant(source: str):
    """A changed copy of the example's source as a module (a broken variant a test must reject)."""
    import types

    module = types.ModuleType("example_inference_variant")
    module.__file__ = str(resources.files("cohere_coreml") / "data" / EXAMPLE)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def test_example_installs_by_the_caches_rule(tmp_path):
    """The example's install (docs/runtime.md, "Compiled-model cache"): a complete target is kept and the
    fresh copy dropped, a target without the marker replaced; the rule it replaces deleted the target first."""
    example = load_example_module()

    def staged(text):
        folder = tmp_path / f".x.mlmodelc.tmp-1-{text}"
        folder.mkdir()
        (folder / "weights").write_text(text)
        (folder / ".complete").write_text("{}")
        return folder

    target = tmp_path / "encoder-0.mlmodelc"
    assert example.install(staged("first"), target) is True
    second = staged("second")
    assert example.install(second, target) is False
    assert (target / "weights").read_text() == "first" and not second.exists()
    (target / ".complete").unlink()  # a leftover without the marker
    assert example.install(staged("third"), target) is True and (target / "weights").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_example_splits_long_audio_as_the_reference():
    """The example's numpy split = audio.split_points (the reference extractor's), on the 75 s clip and
    on clips whose quietest window sits elsewhere; a split that ignores the energies is rejected."""
    example = load_example_module()
    config = FrontEndConfig()
    settings = config.to_dict()
    wave = load_audio(AUDIO_DIR / "en_long_75s.flac")
    expected = split_points(wave, config)
    assert len(expected) == 3 and example.split_points(wave, settings) == expected
    rng = np.random.default_rng(0)
    for seconds in (20.0, 31.0, 36.0, 70.0, 101.0):
        x = rng.standard_normal(int(seconds * 16000)).astype(np.float32) * 0.1
        for k in range(0, x.size, 16000 * 7):
            x[k:k + 1600] *= 0.01  # quiet spots every 7 s
        assert example.split_points(x, settings) == split_points(x, config), seconds
    fixed = [(s, min(s + 560000, wave.size)) for s in range(0, wave.size, 560000)]
    assert fixed != expected  # the control: cutting at 35 s would not pass


def test_example_word_timings_match_every_vector_case():
    """The example's copy of the word-timing rule gives the words, token groups, times and probabilities of
    every case of tests/data/alignment_vectors.json (the rule's Python reference wrote them; Swift reads the
    same file)."""
    example = load_example_module()
    cases = json.loads((ROOT / "tests" / "data" / "alignment_vectors.json").read_text())["cases"]
    assert len(cases) >= 15
    for case in cases:
        got = example.align_words(np.array(case["attention"]), case["pieces"], case["probabilities"],
                                  case["frame_seconds"], offset_seconds=case["offset_seconds"],
                                  lead_rows=case["lead_rows"], language=case["language"],
                                  standardise=case["standardise"], median_width=case["median_width"])
        want = case["words"]
        assert [(w["word"], w["tokens"]) for w in got] == [(w["word"], w["tokens"]) for w in want], case["name"]
        for key in ("start", "end", "probability"):
            assert [w[key] for w in got] == pytest.approx([w[key] for w in want], abs=1e-9), case["name"]


def test_example_vad_rule_matches_every_vector_case():
    """The example's copy of the speech-region rule gives silero-vad's regions and the windows of every case of
    tests/data/vad_vectors.json (Python's inference.speech_regions and Swift read the same file)."""
    example = load_example_module()
    vectors = json.loads((ROOT / "tests" / "data" / "vad_vectors.json").read_text())
    assert len(vectors["regions"]) >= 20 and len(vectors["windows"]) >= 10
    assert example.VAD_DEFAULTS == vectors["defaults"]
    for case in vectors["regions"]:
        got = example.speech_regions(case["probs"], case["n_samples"], case["options"], case["max_speech_s"])
        assert [list(r) for r in got] == case["expected"], case["name"]
    for case in vectors["windows"]:
        got = example.pack_windows(case["regions"], case["n_samples"], case["window_samples"], case["max_gap_samples"])
        assert [list(w) for w in got] == case["expected"], case["name"]


def test_example_vad_probabilities_call_the_block_function():
    """The example scores a file with vad.mlpackage's `block` function as docs/vad.md says (N rows a call from the
    manifest, each the 64 samples before its chunk and the chunk, the state carried, the last call padded with
    zero rows whose outputs are dropped): with the PyTorch module behind a stand-in function, the probabilities
    of the module on the whole signal."""
    from cohere_coreml.inference.vad import TorchVad

    example = load_example_module()
    vad = TorchVad()
    calls = []

    class Block:
        def predict(self, inputs):
            calls.append(inputs)
            assert inputs["frames"].shape == (7, 576) and inputs["h"].shape == inputs["c"].shape == (1, 128)
            probs, h, c = vad._score(inputs["frames"], inputs["h"], inputs["c"])
            return {"probability": probs[None], "h_out": h, "c_out": c}

    class Stub:
        manifest = {"vad": {"functions": {"block": {"chunks": 7}}, "hidden": 128, "compute_units": "cpu_only"}}

        def function(self, component, name, units="all"):
            assert (component, name, units) == ("vad", "block", "cpu_only")
            return Block()

    wav = load_audio(AUDIO_DIR / "en_long_75s.flac")[: 3 * 16000 + 100]
    got = example.vad_probabilities(Stub(), wav)
    want = vad.probabilities(wav)
    assert len(calls) == -(-want.size // 7) and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not calls[-1]["frames"][want.size % 7:].any(), "the last call's missing rows are zero frames"
    assert np.abs(calls[1]["h"]).sum() > 0, "the state is carried from call to call"


def test_example_window_words_cut_the_align_rows_and_frames():
    """The example's `window_words` with a stand-in align function (docs/decoder.md): K tokens a call from the first
    row the rule reads (the call's ids padded with 0, its position, the mask of the slots before it), the rows and
    valid frames it keeps, the window offset, the clamp to the window and the 3-decimal rounding, against the
    toolkit's `alignment_rows` and `align_words` on the same weights. Frames after the valid ones pull the early
    rows (uncut, the words would move)."""
    from cohere_coreml.inference.alignment import align_words, alignment_rows

    example = load_example_module()
    prompt, text, capacity, k, frames, valid = [5, 6, 7, 8], [20, 21, 22, 23, 24], 16, 3, 30, 20
    ids = prompt + text
    rng = np.random.default_rng(5)
    full = rng.uniform(0.001, 0.02, (2, capacity, frames))  # (heads, slots, frames): row p is the query at slot p
    for p in range(capacity):
        full[:, p, min(2 * p - 4, valid - 1) if p >= 2 else 0] = 0.9  # a diagonal over the valid frames
    full[:, :6, valid:] = 5.0  # what the cut must drop
    full = full.astype(np.float16)
    calls = []

    class Align:
        def predict(self, inputs, state):
            start = int(inputs["position"][0])
            calls.append((inputs["input_ids"].tolist(), start, state))
            assert inputs["input_ids"].shape == (1, k) and start + k <= capacity
            assert inputs["cache_mask"].shape == (1, 1, 1, capacity)
            assert (inputs["cache_mask"][0, 0, 0] == np.where(np.arange(capacity) < start, 0, -1e4)).all()
            return {"cross_attention": full[None, :, start:start + k]}

    class StandIn:
        manifest = {"decoder": {"capacity": capacity, "alignment": {"function": "align", "length": k,
                                                                     "heads": [[0, 0], [0, 1]], "lead_rows": 1,
                                                                     "frame_seconds": 0.08}}}
        vocab = {"20": "\u2581One", "21": "\u2581tw", "22": "o", "23": "\u2581three", "24": ".",
                 **{str(i): f"\u2581w{i}" for i in range(25, 32)}}

        def function(self, component, name):
            assert (component, name) == ("decoder", "align")
            return Align()

    probs = [0.9, 0.8, 0.7, 0.6, 0.5]
    start, end = 35.0, 36.0
    got = example.window_words(StandIn(), "state", prompt, text, probs, valid, start, end, "en")
    # rows from P - 2 = 2 on: calls at slots 2, 5, 8 (ids 2..8), each K ids padded with 0
    assert calls == [([ids[2:5]], 2, "state"), ([ids[5:8]], 5, "state"), ([ids[8:9] + [0, 0]], 8, "state")]
    rows = alignment_rows(full[:, :len(ids)].astype(np.float32), len(prompt), len(text), lead_rows=1)[..., :valid]
    want = align_words(rows, [StandIn.vocab[str(i)] for i in text], probs, frame_seconds=0.08, offset_seconds=start)
    assert [w["word"] for w in got] == [w.word for w in want] == ["One", "two", "three."]
    assert [(w["start"], w["end"], w["probability"]) for w in got] == [
        (round(min(max(w.start, start), end), 3), round(min(max(w.end, start), end), 3), round(w.probability, 3))
        for w in want]
    uncut = align_words(alignment_rows(full[:, :len(ids)].astype(np.float32), len(prompt), len(text)),
                        [StandIn.vocab[str(i)] for i in text], probs, frame_seconds=0.08, offset_seconds=start)
    assert [w.start for w in uncut] != [w.start for w in want]  # the control: the cut matters here
    short = example.window_words(StandIn(), "state", prompt, text, probs, valid, start, start + 0.5, "en")
    assert max(w["end"] for w in short) == start + 0.5 and max(w["end"] for w in got) > start + 0.5
    # a window whose rows reach the cache's end: the last call starts at C - K (it recomputes rows)
    calls.clear()
    example.window_words(StandIn(), "state", prompt, list(range(20, 32)), [0.5] * 12, valid, start, end, "en")
    assert [c[1] for c in calls] == [2, 5, 8, 11, 13]


def replay_batch_vectors(example) -> list[tuple[dict, list, list]]:
    """Each case of tests/data/batch_decoding_vectors.json through the example's `decode_windows` on the scripted
    decoder of the toolkit's test (window w's memory is {"window": w}): (case, the calls' rows, the finished)."""
    data = json.loads(BATCH_VECTORS.read_text())
    replayed = []
    for case in data["cases"]:
        fake = Scripted(case["batch"], case["capacity"], case["generated"], data["eos"])
        fake.prompt_len = len(data["prompt"])
        finished = [[key, list(ids), reason] for key, ids, reason in example.decode_windows(
            fake, ((w, {"window": w}) for w in range(len(case["generated"]))), data["prompt"], [data["eos"]],
            max_new_tokens=case.get("max_new_tokens"))]
        replayed.append((case, fake.calls, finished))
    return replayed


# a refilled row that keeps the previous window's position (its slots), or its memory
BROKEN_REFILLS = {"old position": ("positions[b] = 0  #", "pass  #"),
                  "old memory": ("decoder.bind_row(state, b, memory)",
                                 "decoder.bind_row(state, b, memory) if key < decoder.batch else None")}


def test_example_decodes_windows_at_once_by_the_shared_vectors():
    """The example's batched loop (docs/bundle.md, "Decoding several windows at once") gives every call's rows
    (window, token fed, position) and the finished windows (order, ids, stop reason) of the shared vectors, which
    the toolkit's `decode_windows` replays too; a loop whose refilled row keeps its old position or memory fails."""
    replayed = replay_batch_vectors(load_example_module())
    assert any(len(case["generated"]) > case["batch"] for case, _, _ in replayed)  # rows are refilled
    for case, calls, finished in replayed:
        assert calls == case["calls"], case["name"]
        assert finished == case["finished"], case["name"]
    source = example_source()
    for broken, (old, new) in BROKEN_REFILLS.items():
        assert source.count(old) == 1, broken
        replayed = replay_batch_vectors(load_example_variant(source.replace(old, new)))
        assert any(calls != case["calls"] for case, calls, _ in replayed), broken


def test_example_decoder_batch_is_the_bundles_or_one():
    """--decoder-batch: the bundle's decoder.batch.size by default (1 without it), 1 or that size when asked;
    another size, or a batch without a batched step, is one line naming the fix."""
    example = load_example_module()
    with_batch, without = {"decoder": {"batch": {"size": 4}}}, {"decoder": {}}
    assert [example.decoder_batch(with_batch, asked) for asked in (None, 1, 4)] == [4, 1, 4]
    assert [example.decoder_batch(without, asked) for asked in (None, 1)] == [1, 1]
    for manifest, asked, message in ((with_batch, 3, "use --decoder-batch 4 or 1"),
                                     (without, 4, "no batched step (no decoder.batch); re-export it with "
                                                  "`cohere-coreml export --decoder-batch 4` or use --decoder-batch 1"),
                                     (with_batch, 0, "--decoder-batch must be at least 1")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            example.decoder_batch(manifest, asked)


def test_finalize_copies_the_example(finalized_bundle):
    """`bundle finalize` (also run by `make export` and `quantize`) copies the package file, byte for
    byte, and the manifest's checksums list it."""
    manifest = json.loads((finalized_bundle / "manifest.json").read_text())
    data = (finalized_bundle / EXAMPLE).read_bytes()
    assert data == example_source().encode()
    entry = manifest["checksums"]["files"][EXAMPLE]
    assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


# --------------------------------------------------------------------------------------------
# Slow: the example in its own venv, through the interpreter shim
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_venv_holds_only_the_example_packages(example_python):
    probe = ("import importlib.util as u, json; print(json.dumps({n: u.find_spec(n) is not None for n in "
             "('numpy', 'soundfile', 'coremltools', 'cohere_coreml', 'torch', 'transformers')}))")
    proc = subprocess.run([str(example_python), "-I", "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "numpy": True, "soundfile": True, "coremltools": True, "cohere_coreml": False, "torch": False,
        "transformers": False}


def clips() -> list[dict]:
    """Two held-out clips of the trained model (tests/data/heldout): the first that fits the 2 s
    bucket, the first that needs the 4 s window."""
    picked = {}
    for u in json.loads((HELDOUT_DIR / "manifest.json").read_text())["utterances"]:
        seconds = load_audio(HELDOUT_DIR / u["file"]).size / 16000
        picked.setdefault("bucket" if seconds <= 2.0 else "main" if seconds <= 4.0 else "longer",
                          dict(u, path=HELDOUT_DIR / u["file"]))
        if "bucket" in picked and "main" in picked:
            return [picked["bucket"], picked["main"]]
    raise AssertionError(f"tests/data/heldout has no clip for each window: {sorted(picked)}")


@pytest.mark.slow
def test_example_transcribes_as_the_transcriber(example_python, serve_command, finalized_bundle):
    """Token ids and text per window equal `Transcriber` (front end = the bundle's package, prefill as
    the bundle has it) on the same clip and bundle: a clip in the 2 s bucket and one in the main window."""
    transcriber = Transcriber(finalized_bundle, backend="mil", front_end="package")
    # with alignment in the bundle, the same run times the words (--word-timestamps): as the Transcriber's
    aligned = json.loads((finalized_bundle / "manifest.json").read_text())["decoder"].get("alignment") is not None
    for clip in clips():
        expected = transcriber.transcribe(clip["path"], clip["language"], word_timestamps=aligned)
        proc = run_example(example_python, finalized_bundle, clip["path"], clip["language"],
                           *(["--word-timestamps"] if aligned else []), serve=serve_command)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout)
        assert [w["token_ids"] for w in got["windows"]] == expected.token_ids, clip["file"]
        assert got["text"] == expected.text and expected.text, clip["file"]
        assert len(expected.token_ids[0]) > 3  # a transcript, not an immediate eos
        if aligned:  # words and times to the millisecond, as both print them
            assert [(w["word"], w["start"], w["end"]) for w in got["words"]] == [
                (w["word"], round(w["start"], 3), round(w["end"], 3)) for w in expected.words], clip["file"]
            assert got["words"], clip["file"]


@pytest.mark.slow
def test_example_compiles_each_package_once_into_its_cache(example_python, serve_command, finalized_bundle, tmp_path):
    """--compiled-cache: the first run compiles each package once (named by the manifest's checksums,
    the Swift package's rule: the same names as cohere_coreml's CompiledCache), a second run loads them
    (the same folders, not recompiled) and gives the same ids."""
    from cohere_coreml.runtime.compiled_cache import COMPLETE_MARKER, CompiledCache

    cache = tmp_path / "compiled"
    clip = clips()[0]
    first = run_example(example_python, finalized_bundle, clip["path"], clip["language"], "--compiled-cache", str(cache),
                        serve=serve_command)
    assert first.returncode == 0, first.stderr[-3000:]
    packages = ("frontend", "encoder", "decoder", "vad")  # the bundle's VAD too (--vad auto)
    assert (finalized_bundle / "vad.mlpackage").is_dir()
    names = {CompiledCache(cache).location(finalized_bundle / f"{c}.mlpackage").name for c in packages}
    assert {p.name for p in cache.iterdir()} == names  # nothing else left (no staging folder)
    assert all((cache / n / COMPLETE_MARKER).is_file() for n in names)
    sources = {json.loads((cache / n / COMPLETE_MARKER).read_text())["source"] for n in names}
    assert sources == {str(finalized_bundle / f"{c}.mlpackage") for c in packages}
    inodes = {n: (cache / n).stat().st_ino for n in names}
    second = run_example(example_python, finalized_bundle, clip["path"], clip["language"], "--compiled-cache", str(cache),
                         serve=serve_command)
    assert second.returncode == 0, second.stderr[-3000:]
    assert {n: (cache / n).stat().st_ino for n in names} == inodes
    assert json.loads(second.stdout)["windows"] == json.loads(first.stdout)["windows"]


def test_example_chains_an_encoder_in_parts(example_python, serve_command, trained_parts_bundle, tmp_path):
    """A bundle whose encoder is in 2 parts: the example chains them and gives the Transcriber's ids."""
    bundle = tmp_path / "bundle"
    shutil.copytree(trained_parts_bundle, bundle)
    finalize_bundle(bundle)
    transcriber = Transcriber(bundle, backend="mil", front_end="package")
    for clip in clips():
        expected = transcriber.transcribe(clip["path"], clip["language"])
        proc = run_example(example_python, bundle, clip["path"], clip["language"], serve=serve_command)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [w["token_ids"] for w in json.loads(proc.stdout)["windows"]] == expected.token_ids, clip["file"]


# The example run through a launcher that counts its batched calls (each call's busy rows, on stderr) and then
# runs its main(): the very script, its arguments as a user gives them
COUNTING_LAUNCHER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("example_inference", {example!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
calls, step = [], example.BatchStep.step
def counted(self, state, tokens, positions):
    calls.append(sum(p is not None for p in positions))
    return step(self, state, tokens, positions)
example.BatchStep.step = counted
try:
    example.main()
finally:
    print("batched calls: " + json.dumps(calls), file=sys.stderr)
"""


def run_counted(python: Path, bundle: Path, audio: Path, *args: str, serve: str) -> tuple[dict, list[int]]:
    """The example's JSON output on `audio` (English) and its batched calls' busy rows."""
    launcher = bundle.parent / f"{bundle.name}-launcher.py"
    launcher.write_text(COUNTING_LAUNCHER.format(example=str(bundle / EXAMPLE)))
    proc = run_example(python, bundle, audio, "en", *args, script=launcher, serve=serve)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = [line for line in proc.stderr.splitlines() if line.startswith("batched calls: ")]
    return json.loads(proc.stdout), json.loads(counted[-1].split(": ", 1)[1])


@pytest.fixture(scope="module")
def several_windows_runs(example_python, serve_command, finalized_bundle, tmp_path_factory):
    """A clip of more windows than the decoder's batch (held-out sentences and pauses: windows of several
    lengths, VAD-packed), the `Transcriber`'s result on it, and the example's runs: by default (the bundle's
    batch) and with --decoder-batch 1, each with its batched calls."""
    import soundfile as sf

    folder = tmp_path_factory.mktemp("several")
    clip = folder / "several_windows.wav"
    sf.write(clip, several_windows(count=6), 16000, subtype="FLOAT")
    expected = Transcriber(finalized_bundle, backend="mil", front_end="package").transcribe(clip, "en")
    runs = {flag: run_counted(example_python, finalized_bundle, clip, *flag, serve=serve_command)
            for flag in ((), ("--decoder-batch", "1"))}
    return clip, expected, runs


@pytest.mark.slow
def test_example_decodes_several_windows_at_once_as_the_transcriber(finalized_bundle, several_windows_runs):
    """With the bundle's decoder.batch the example decodes the clip's windows B at a time (every call's busy rows:
    each window's prompt and fed tokens, P + n - 1 row-calls, in fewer calls); per window the token ids equal
    --decoder-batch 1's (no batched call) and the `Transcriber`'s."""
    manifest = json.loads((finalized_bundle / "manifest.json").read_text())
    batch, prompt = manifest["decoder"]["batch"]["size"], manifest["languages"]["en"]["punctuation"]
    _, expected, runs = several_windows_runs
    assert batch > 1 and len(expected.windows) > batch  # rows are refilled
    assert len({len(ids) for ids in expected.token_ids}) > 1  # windows finish at different calls
    got, calls = runs[()]
    assert [w["token_ids"] for w in got["windows"]] == expected.token_ids
    assert got["text"] == expected.text and expected.text
    assert [w["start_s"] for w in got["windows"]] == [w.start_s for w in expected.windows]
    assert max(calls) == batch and sum(calls) == sum(len(prompt) + len(ids) - 1 for ids in expected.token_ids)
    assert len(calls) < sum(calls)
    one, one_calls = runs[("--decoder-batch", "1")]
    assert one_calls == [] and one["windows"] == got["windows"] and one["text"] == got["text"]


@pytest.mark.slow
def test_example_decodes_one_window_at_a_time_without_decoder_batch(example_python, serve_command, finalized_bundle,
                                                                    several_windows_runs, tmp_path):
    """A bundle whose manifest has no decoder.batch (exported with --decoder-batch 1, or before it): the example
    decodes the clip one window at a time (no batched call), the same ids; --decoder-batch 4 there is one line."""
    clip, expected, _ = several_windows_runs
    old = tmp_path / "no-batch"
    old.mkdir()
    for item in finalized_bundle.iterdir():
        if item.name != "manifest.json":
            (old / item.name).symlink_to(item)
    manifest = json.loads((finalized_bundle / "manifest.json").read_text())
    del manifest["decoder"]["batch"], manifest["decoder"]["functions"]["step_batch"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    got, calls = run_counted(example_python, old, clip, serve=serve_command)
    assert calls == [] and [w["token_ids"] for w in got["windows"]] == expected.token_ids
    proc = run_example(example_python, old, clip, "en", "--decoder-batch", "4", serve=serve_command)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert "no batched step (no decoder.batch)" in proc.stderr.strip().splitlines()[-1]


class MirroredMelFrontEnd(FrontEndForCoreML):
    """A front end whose mel bands run from high to low frequencies (the filterbank's rows reversed)."""

    def __init__(self, config, shapes):
        super().__init__(config, shapes)
        self.mel = torch.flip(self.mel, [0])  # (M, K)


@pytest.mark.slow
def test_example_uses_the_bundles_front_end(example_python, serve_command, finalized_bundle, tmp_path):
    """A bundle whose frontend.mlpackage computes other features (mel bands mirrored; the manifest
    untouched) gives other token ids: the example's features come from the package, not its own log-mel.
    (Milder changes, such as pre-emphasis 0 or another STFT window, leave the trained model's ids as
    they are, so they could not tell.)"""
    broken = tmp_path / "bundle"
    shutil.copytree(finalized_bundle, broken)
    manifest_text = (broken / "manifest.json").read_text()
    m = json.loads(manifest_text)
    config = FrontEndConfig.from_dict(m["audio"])
    shapes = {fn: frontend_shapes(config, f["window_seconds"]) for fn, f in m["frontend"]["functions"].items()}
    settings = ExportSettings(out_dir=broken, force=True, skip_verify=True,
                              window_seconds=m["frontend"]["functions"]["main"]["window_seconds"])
    convert_frontend(config, settings, shapes, _module_cls=MirroredMelFrontEnd)
    (broken / "manifest.json").write_text(manifest_text)  # installing a package invalidates it: put it back
    clip = clips()[1]
    expected = Transcriber(finalized_bundle, backend="mil", front_end="package").transcribe(clip["path"], clip["language"])
    proc = run_example(example_python, broken, clip["path"], clip["language"], serve=serve_command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [w["token_ids"] for w in json.loads(proc.stdout)["windows"]] != expected.token_ids


@pytest.mark.slow
def test_example_errors_are_named(example_python, serve_command, finalized_bundle, tmp_path):
    """An example that feeds the front end a wrong input name fails naming it (coremltools' check, as on a
    Mac); one that feeds a wrong shape fails with the interpreter's error naming the input (the shim
    forwards it); bad arguments are one line on stderr, nothing on stdout."""
    source = (finalized_bundle / EXAMPLE).read_text()
    clip = clips()[0]
    wrong_name = tmp_path / "wrong_name.py"
    wrong_name.write_text(source.replace('"audio_length": np.array([n]', '"audio_len": np.array([n]'))
    proc = run_example(example_python, finalized_bundle, clip["path"], clip["language"], script=wrong_name,
                       serve=serve_command)
    assert proc.returncode != 0 and "audio_len" in proc.stderr and proc.stdout == "", proc.stderr[-3000:]
    wrong_shape = tmp_path / "wrong_shape.py"
    wrong_shape.write_text(source.replace('"audio_length": np.array([n], np.int32)',
                                          '"audio_length": np.array([[n]], np.int32)'))
    proc = run_example(example_python, finalized_bundle, clip["path"], clip["language"], script=wrong_shape,
                       serve=serve_command)
    assert proc.returncode != 0 and "ShimError" in proc.stderr and "audio_length" in proc.stderr, proc.stderr[-3000:]
    proc = run_example(example_python, finalized_bundle, clip["path"], "xx", serve=serve_command)
    assert proc.returncode == 1 and "language 'xx' is not in this bundle" in proc.stderr and proc.stdout == ""
    # word timings from a bundle exported without alignment heads: one line naming the export option
    bare = tmp_path / "no-alignment"
    bare.mkdir()
    for item in finalized_bundle.iterdir():
        if item.name != "manifest.json":
            (bare / item.name).symlink_to(item)
    manifest = json.loads((finalized_bundle / "manifest.json").read_text())
    manifest["decoder"].update(alignment=None, alignment_note="exported with --alignment-heads none")
    (bare / "manifest.json").write_text(json.dumps(manifest))
    proc = run_example(example_python, bare, clip["path"], clip["language"], "--word-timestamps", serve=serve_command)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after coremltools' own import notices on Linux
    assert "no word alignment (exported with --alignment-heads none)" in last and "--alignment-heads auto" in last
