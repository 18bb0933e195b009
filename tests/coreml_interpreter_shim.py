"""Test shim: coremltools' MLModel predicts through the project's MIL interpreter (Linux has no Core ML).

tests/test_example.py copies this file, with a one-line `.pth` that imports it, into the
site-packages of a venv that holds only numpy, soundfile and coremltools, and runs the bundle's
example_inference.py there with `python -I`. The shim does nothing unless COHERE_COREML_SHIM_COMMAND
names the interpreter command (a JSON list, e.g. [".venv/bin/python", "-m", "cohere_coreml.cli",
"serve-runtime"]). Then it replaces only what Core ML itself provides on a Mac:

* `MLModel._get_proxy_and_spec`: where coremltools makes its native Core ML proxy for a package,
  the shim returns an `InterpreterProxy` that loads the same package function in the child
  (`cohere-coreml serve-runtime`, protocol in src/cohere_coreml/runtime/serve.py). So
  `MLModel.predict` still runs coremltools' own input checks and conversions, and only the
  prediction is the interpreter's;
* `MLModel.make_state`, which refuses to run off macOS: an `MLState` over a state in the child.

An error of the child (a wrong input name, shape or dtype, ...) is raised as `ShimError` naming it.
Standard library and numpy only: the venv has nothing of cohere_coreml.
"""

import atexit
import json
import os
import subprocess

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


class InterpreterProxy:
    """What MLModel.__proxy__ is on a Mac (predict, newState), for one function of a package."""

    def __init__(self, interpreter: Interpreter, path: str, function_name: str | None, compute_units: str):
        self.interpreter = interpreter
        response, _ = interpreter.request({"op": "load", "path": path, "function": function_name,
                                           "compute_units": compute_units})
        self.handle = response["model"]

    def predict(self, data: dict, state: StateProxy | None = None) -> dict:
        header = {"op": "predict", "model": self.handle, "state": None if state is None else state.handle}
        return self.interpreter.request(header, data)[1]

    def newState(self) -> StateProxy:  # noqa: N802 - the name of the native proxy's method
        return StateProxy(self.interpreter, self.interpreter.request({"op": "make_state", "model": self.handle})[0]["state"])


def install(command: list[str]) -> None:
    from coremltools.models import model as ct_model

    interpreter = []  # started when the first package loads

    original_proxy = ct_model.MLModel._get_proxy_and_spec
    original_make_state = ct_model.MLModel.make_state

    def get_proxy_and_spec(self, filename, compute_units, skip_model_load=False, optimization_hints=None):
        proxy, spec, error = original_proxy(self, filename, compute_units, skip_model_load=skip_model_load,
                                            optimization_hints=optimization_hints)
        if proxy is None and not skip_model_load and os.path.isdir(filename):
            if not interpreter:
                interpreter.append(Interpreter(command))
            proxy = InterpreterProxy(interpreter[0], filename, self.function_name, compute_units.name.lower())
        return proxy, spec, error

    def make_state(self):
        if isinstance(self.__proxy__, InterpreterProxy):
            return ct_model.MLState(self.__proxy__.newState())
        return original_make_state(self)

    ct_model.MLModel._get_proxy_and_spec = get_proxy_and_spec
    ct_model.MLModel.make_state = make_state


if os.environ.get(ENV):
    install(json.loads(os.environ[ENV]))
