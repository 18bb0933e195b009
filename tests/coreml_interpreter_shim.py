"""Test emulation of Core ML for coremltools on Linux: the native layer coremltools calls on a Mac
(`coremltools.libcoremlpython._MLModelProxy`) emulated in Python, its predictions run by the project's MIL
interpreter in a child process (`cohere-coreml serve-runtime`, protocol in src/cohere_coreml/runtime/serve.py).

coremltools' own Python code (`MLModel`, `CompiledMLModel`, `MLState`, `utils.compile_model`, their input
checks and conversions) runs unchanged on top; only what Core ML itself provides is replaced, following
what coremltools 9.0 calls (read in coremltools/models/model.py, _compiled_model.py and utils.py):

* `_MLModelProxy(path, compute_units_name, function_name, optimization_hints, asset)`: loads a compiled
  model (`.mlmodelc`); given an `.mlpackage`, Core ML compiles it first into a temporary `.mlmodelc`
  (`get_compiled_model_path()`), as `MLModel(path.mlpackage)` does on every load;
* `_MLModelProxy.compileModel(path) -> str`: a new temporary `<name>.mlmodelc` folder (a copy of the
  package inside, plus `coreml-emulation.json`: the Swift emulation's layout, CoreMLEmulation.swift);
* `predict(data, state)`, `newState()` (an object with `read_state` / `write_state`, what `MLState` wraps),
  `maximum_supported_specification_version()`, `auto_set_specification_version(spec)`;
* the platform: `_is_macos()` / `_macos_version()` in the coremltools modules that check them answer
  macOS 15, so `make_state` and `CompiledMLModel` run; `libcoremlpython.MACOS_VERSION` says the same to
  `cohere_coreml.runtime` (a test sets another to play an older macOS).

`install(command)` applies all of it and returns an `Emulation` (counts of compiles and loads, the
loads' compute units; `uninstall()` restores coremltools); `emulated(command)` is the same as a context
manager. The backend's tests use it in-process; tests/publish/test_example.py copies this file, with a one-line
`.pth` that imports it, into a venv that holds only numpy, soundfile and coremltools, where it installs
itself when COHERE_COREML_SHIM_COMMAND names the interpreter command (a JSON list). An error of the
child (a wrong input name, shape or dtype, ...) is raised as `ShimError` naming it. Standard library and
numpy only: the example's venv has nothing of cohere_coreml.
"""

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import uuid

import numpy as np

ENV = "COHERE_COREML_SHIM_COMMAND"
PROTOCOL = "cohere-coreml-serve-runtime"
WIRE_DTYPES = ("float32", "float16", "int32")  # what the protocol carries


class ShimError(RuntimeError):
    """The interpreter child refused a request or died (its message and exception type)."""


class Interpreter:
    """One `serve-runtime` child for the process; requests one at a time."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # stderr: ours
        hello = self._read_header()
        if hello.get("protocol") != PROTOCOL:
            raise ShimError(f"{command} is not a {PROTOCOL} server: it said {hello}")
        atexit.register(self.close)

    def _read_header(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise ShimError(f"the interpreter child exited (status {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def request(self, header: dict, arrays: dict | None = None) -> tuple[dict, dict]:
        """Send one request (with its arrays), return (response header, response arrays)."""
        payloads = []
        if arrays is not None:
            header = {**header, "arrays": []}
            for name, value in arrays.items():
                data = wire_array(name, value)
                header["arrays"].append({"name": name, "dtype": data.dtype.name, "shape": list(data.shape),
                                         "nbytes": data.nbytes})
                payloads.append(data.tobytes())
        self.proc.stdin.write(json.dumps(header).encode() + b"\n" + b"".join(payloads))
        self.proc.stdin.flush()
        response = self._read_header()
        out = {}
        for d in response.get("arrays", []):
            raw = self.proc.stdout.read(d["nbytes"])
            out[d["name"]] = np.frombuffer(raw, dtype=np.dtype(d["dtype"]).newbyteorder("<")).reshape(d["shape"]).copy()
        if not response.get("ok"):
            raise ShimError(f"{response.get('type')}: {response.get('error')}")
        return response, out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"})
            except (ShimError, OSError, ValueError):
                pass
            self.proc.wait(timeout=30)


def wire_array(name: str, value) -> np.ndarray:
    """`value` as a little-endian C-order array of a protocol dtype (float64 -> float32, int64 -> int32,
    as Core ML converts them to the model's input types)."""
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif arr.dtype.kind in "iub" and arr.dtype != np.int32:
        if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            raise ShimError(f"input {name!r}: values beyond int32")
        arr = arr.astype(np.int32)
    if arr.dtype.name not in WIRE_DTYPES:
        raise ShimError(f"input {name!r}: dtype {arr.dtype} is not one of {WIRE_DTYPES}")
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))


class StateProxy:
    """What coremltools' MLState wraps: a state held by the child."""

    def __init__(self, interpreter: Interpreter, handle: str):
        self.interpreter, self.handle = interpreter, handle

    def read_state(self, name: str) -> np.ndarray:
        return self.interpreter.request({"op": "read_state", "state": self.handle, "name": name})[1][name]

    def write_state(self, name: str, value) -> None:  # a whole buffer, as coremltools' MLState.write_state
        self.interpreter.request({"op": "write_state", "state": self.handle, "name": name, "start": None},
                                 {name: value})


MARKER = "coreml-emulation.json"  # what makes a folder a compiled model here (the Swift emulation's name)
SPECIFICATION_VERSION = 9  # Core ML 8 (macOS 15 / iOS 18): what the packages' deployment target needs
MACOS_VERSION = (15, 0)


class Emulation:
    """One installed emulation: the interpreter child (started on first load), temporary compiled models,
    and what was done: `compiles` (packages compiled), `loads` (one dict per model load: path, function,
    compute units)."""

    def __init__(self, command: list[str]):
        self.command = command
        self.interpreter: Interpreter | None = None
        self.temporary = tempfile.mkdtemp(prefix="coreml-emulation-")
        self.compiles: list[str] = []
        self.loads: list[dict] = []
        self._undo: list[tuple[object, str, object]] = []
        atexit.register(self.close)

    def child(self) -> Interpreter:
        if self.interpreter is None:
            self.interpreter = Interpreter(self.command)
        return self.interpreter

    def compile(self, path: str) -> str:
        """Core ML's compile: a new temporary `<name>.mlmodelc` folder for an `.mlpackage`."""
        path = os.path.abspath(os.path.expanduser(path))
        if not (path.rstrip("/").endswith(".mlpackage") and os.path.isfile(os.path.join(path, "Manifest.json"))):
            raise RuntimeError(f"Error compiling model: {path} is not a model package (.mlpackage with Manifest.json)")
        name = os.path.basename(path.rstrip("/"))[: -len(".mlpackage")]
        compiled = os.path.join(self.temporary, uuid.uuid4().hex, name + ".mlmodelc")
        shutil.copytree(path, os.path.join(compiled, "model.mlpackage"))
        with open(os.path.join(compiled, MARKER), "w", encoding="utf-8") as f:
            json.dump({"package": "model.mlpackage", "source": os.path.basename(path)}, f)
        self.compiles.append(path)
        return compiled

    def close(self) -> None:
        if self.interpreter is not None:
            self.interpreter.close()
            self.interpreter = None
        shutil.rmtree(self.temporary, ignore_errors=True)  # Core ML's temporary models go with the process

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._undo):
            if value is _MISSING:
                if isinstance(owner, dict):
                    owner.pop(name, None)
                else:
                    delattr(owner, name)
            elif isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self._undo.clear()
        self.close()

    def _set(self, owner, name: str, value) -> None:
        old = owner.get(name, _MISSING) if isinstance(owner, dict) else getattr(owner, name, _MISSING)
        self._undo.append((owner, name, old))
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)


_MISSING = object()


def proxy_class(emulation: Emulation) -> type:
    """The `_MLModelProxy` of `emulation` (its methods as coremltools calls them)."""

    class EmulatedMLModelProxy:
        def __init__(self, path, compute_units, function_name, optimization_hints=None, asset=None):
            if asset is not None:
                raise RuntimeError("the Core ML emulation loads models from paths, not assets")
            path = os.path.abspath(os.path.expanduser(path))
            if path.rstrip("/").endswith(".mlpackage"):  # Core ML compiles a package on load
                path = emulation.compile(path)
            info = os.path.join(path, MARKER)
            if not (path.rstrip("/").endswith(".mlmodelc") and os.path.isfile(info)):
                raise RuntimeError(f"Error opening compiled model: {path} is not a compiled model (.mlmodelc)")
            with open(info, encoding="utf-8") as f:
                package = os.path.join(path, json.load(f)["package"])
            self.compiled_path = path
            units = str(compute_units).lower()
            emulation.loads.append({"path": path, "function": function_name or None, "compute_units": units})
            response, _ = emulation.child().request({"op": "load", "path": package, "function": function_name or None,
                                                     "compute_units": units})
            self.interpreter, self.handle = emulation.child(), response["model"]

        @staticmethod
        def compileModel(path):  # noqa: N802 - the native method's name
            return emulation.compile(path)

        @staticmethod
        def maximum_supported_specification_version():
            return SPECIFICATION_VERSION

        @staticmethod
        def auto_set_specification_version(spec):
            return spec

        def get_compiled_model_path(self):
            return self.compiled_path

        def predict(self, data: dict, state: StateProxy | None = None) -> dict:
            header = {"op": "predict", "model": self.handle, "state": None if state is None else state.handle}
            return self.interpreter.request(header, data)[1]

        def newState(self) -> StateProxy:  # noqa: N802 - the native method's name
            reply = self.interpreter.request({"op": "make_state", "model": self.handle})[0]
            return StateProxy(self.interpreter, reply["state"])

    return EmulatedMLModelProxy


def install(command: list[str]) -> Emulation:
    """Emulate Core ML under coremltools (see the module docstring); `Emulation.uninstall()` undoes it."""
    import coremltools.models._compiled_model as ct_compiled
    import coremltools.models.model as ct_model
    import coremltools.models.utils as ct_utils

    emulation = Emulation(command)
    proxy = proxy_class(emulation)
    native = types.ModuleType("coremltools.libcoremlpython")
    native._MLModelProxy = proxy
    native.EMULATION = True  # cohere_coreml.runtime.coreml_available() reads it
    native.MACOS_VERSION = MACOS_VERSION  # the macOS the emulation plays (a test may set another)
    emulation._set(sys.modules, "coremltools.libcoremlpython", native)
    for module in (ct_model, ct_compiled):
        emulation._set(module, "_MLModelProxy", proxy)
    for module in (ct_utils, ct_model, ct_compiled):
        if hasattr(module, "_macos_version"):
            emulation._set(module, "_macos_version", lambda: MACOS_VERSION)
        if hasattr(module, "_is_macos"):
            emulation._set(module, "_is_macos", lambda: True)
    return emulation


@contextlib.contextmanager
def emulated(command: list[str]):
    emulation = install(command)
    try:
        yield emulation
    finally:
        emulation.uninstall()


if os.environ.get(ENV):
    install(json.loads(os.environ[ENV]))
