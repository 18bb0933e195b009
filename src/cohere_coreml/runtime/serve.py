"""`cohere-coreml serve-runtime`: the runtime interface over stdin/stdout for a non-Python client.

The Swift package (`swift/`) runs the same transcription loop on Linux and in CI by starting this
command as a child process and talking to it through the protocol below. Each message is one JSON
header line (UTF-8, terminated by "\\n"), followed by the raw bytes of the arrays it lists, in the
listed order, with no separator:

    array descriptor  {"name": str, "dtype": "float32"|"float16"|"int32", "shape": [int], "nbytes": int}
                      payload: nbytes bytes, little-endian, C (row-major) order

On start the server writes one line:
    {"ok": true, "protocol": "cohere-coreml-serve-runtime", "version": 1}

Requests (every request may carry an "id", echoed in its response):
    {"op": "load", "path": P, "function": F|null, "compute_units": "all"}
        -> {"ok": true, "model": "m1", "function": F, "inputs": {name: {"shape", "dtype"}},
            "outputs": {...}, "states": {...}}
    {"op": "make_state", "model": "m1"}              -> {"ok": true, "state": "s1"}
    {"op": "predict", "model": "m1", "state": "s1"|null, "arrays": [descriptor, ...]} + payloads
        -> {"ok": true, "arrays": [descriptor, ...]} + payloads       (the function's outputs)
    {"op": "read_state", "state": "s1", "name": N}   -> {"ok": true, "arrays": [descriptor]} + payload
    {"op": "free", "model": "m1"} / {"op": "free", "state": "s1"}   -> {"ok": true}
    {"op": "quit"}                                   -> {"ok": true}, then the server exits 0

A failed request gets {"ok": false, "error": message, "type": exception class name} and the server
keeps serving (its payload bytes, if any, have been consumed). End of input ends the server.
Logging goes to stderr; nothing but protocol messages is written to stdout.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import BinaryIO

import numpy as np

from .errors import InputValidationError, RuntimeBackendError

logger = logging.getLogger(__name__)

PROTOCOL = "cohere-coreml-serve-runtime"
PROTOCOL_VERSION = 1
DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}


class ProtocolError(ValueError):
    """A request that does not follow the protocol (bad JSON, unknown op or id, bad array)."""


def _describe(description) -> dict:
    return {k: {"shape": [int(d) for d in shape], "dtype": np.dtype(dt).name} for k, (shape, dt) in description.items()}


def read_arrays(stream: BinaryIO, descriptors: list) -> dict[str, np.ndarray]:
    """Read the payloads listed by `descriptors` from `stream` (all of them, even after an error)."""
    if not isinstance(descriptors, list):
        raise ProtocolError("'arrays' must be a list of array descriptors")
    raw = []
    for d in descriptors:
        try:
            nbytes = int(d["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"array descriptor without a valid 'nbytes': {d!r}") from None
        data = stream.read(nbytes)
        if len(data) != nbytes:
            raise EOFError(f"input ended inside array {d.get('name')!r} ({len(data)} of {nbytes} bytes)")
        raw.append((d, data))
    arrays = {}
    for d, data in raw:
        name, dtype, shape = d.get("name"), d.get("dtype"), d.get("shape")
        if dtype not in DTYPES:
            raise ProtocolError(f"array {name!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ProtocolError(f"array {name!r}: shape must be a list of non-negative ints, got {shape!r}")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if expected != len(data):
            raise ProtocolError(f"array {name!r}: {dtype} {shape} needs {expected} bytes, got {len(data)}")
        arrays[name] = np.frombuffer(data, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(shape).astype(DTYPES[dtype])
    return arrays


def write_message(stream: BinaryIO, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    payloads = []
    if arrays is not None:
        descriptors = []
        for name, value in arrays.items():
            arr = np.asarray(value)
            dtype = np.dtype(arr.dtype).name
            if dtype not in DTYPES:
                arr = arr.astype(np.float32)
                dtype = "float32"
            data = np.ascontiguousarray(arr, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()
            descriptors.append({"name": name, "dtype": dtype, "shape": [int(s) for s in arr.shape], "nbytes": len(data)})
            payloads.append(data)
        header = {**header, "arrays": descriptors}
    stream.write(json.dumps(header).encode("utf-8") + b"\n")
    for data in payloads:
        stream.write(data)
    stream.flush()


class Server:
    """Models and states by handle; one request at a time."""

    def __init__(self, backend: str = "mil", num_threads: int | None = None):
        self.backend = backend
        self.num_threads = num_threads
        self.models: dict[str, object] = {}
        self.states: dict[str, object] = {}
        self._next = 0

    def _handle(self, prefix: str) -> str:
        self._next += 1
        return f"{prefix}{self._next}"

    def _model(self, handle):
        if handle not in self.models:
            raise ProtocolError(f"unknown model handle {handle!r}")
        return self.models[handle]

    def _state(self, handle):
        if handle not in self.states:
            raise ProtocolError(f"unknown state handle {handle!r}")
        return self.states[handle][1]

    def handle(self, request: dict, stream_in: BinaryIO) -> tuple[dict, dict | None]:
        """(response header, arrays or None) for one request; payloads are read from `stream_in`."""
        from . import load_model

        op = request.get("op")
        if op == "predict":
            inputs = read_arrays(stream_in, request.get("arrays", []))  # consume payloads first
            model = self._model(request.get("model"))
            state = None if request.get("state") is None else self._state(request["state"])
            return {"ok": True}, model.predict(inputs, state=state)
        if op == "load":
            path = request.get("path")
            if not isinstance(path, str):
                raise ProtocolError("'load' needs a 'path' (string)")
            model = load_model(path, backend=self.backend, function_name=request.get("function"),
                               compute_units=request.get("compute_units") or "all", num_threads=self.num_threads)
            handle = self._handle("m")
            self.models[handle] = model
            return {"ok": True, "model": handle, "function": model.function_name, "backend": model.backend,
                    "inputs": _describe(model.input_description), "outputs": _describe(model.output_description),
                    "states": _describe(model.state_description)}, None
        if op == "make_state":
            model_handle = request.get("model")
            state = self._model(model_handle).make_state()
            handle = self._handle("s")
            self.states[handle] = (model_handle, state)
            return {"ok": True, "state": handle}, None
        if op == "read_state":
            name = request.get("name")
            return {"ok": True}, {name: self._state(request.get("state")).read_state(name)}
        if op == "free":
            if "model" in request:
                self._model(request["model"])
                del self.models[request["model"]]
            if "state" in request:
                self._state(request["state"])
                del self.states[request["state"]]
            return {"ok": True}, None
        raise ProtocolError(f"unknown op {op!r}; ops: load, make_state, predict, read_state, free, quit")

    def serve(self, stream_in: BinaryIO, stream_out: BinaryIO) -> int:
        write_message(stream_out, {"ok": True, "protocol": PROTOCOL, "version": PROTOCOL_VERSION})
        while True:
            line = stream_in.readline()
            if not line:
                return 0  # end of input
            if not line.strip():
                continue
            request: dict = {}
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ProtocolError("a request must be a JSON object")
                if request.get("op") == "quit":
                    write_message(stream_out, {"ok": True, "id": request.get("id")})
                    return 0
                header, arrays = self.handle(request, stream_in)
            except EOFError as err:
                logger.error("%s", err)
                return 1
            except (ValueError, RuntimeBackendError, InputValidationError, KeyError, TypeError) as err:
                # bad JSON, protocol errors, package / input errors: reported, the server keeps serving
                header, arrays = {"ok": False, "error": str(err), "type": type(err).__name__}, None
            header["id"] = request.get("id") if isinstance(request, dict) else None
            write_message(stream_out, header, arrays)


def cmd_serve_runtime(args) -> int:
    protocol_out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol stream
    return Server(backend=args.backend, num_threads=args.num_threads).serve(sys.stdin.buffer, protocol_out)


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-runtime",
        help="serve the runtime interface (load / make_state / predict) over stdin/stdout for other languages",
        description="Run packages for a client in another language (the Swift package uses it on Linux): "
        "one JSON header line per message, followed by raw little-endian array bytes. The protocol is "
        "documented in src/cohere_coreml/runtime/serve.py and docs/swift.md.",
    )
    p.add_argument("--backend", default="mil", choices=("auto", "coreml", "mil"),
                   help="runtime backend (default: %(default)s, the MIL interpreter)")
    p.add_argument("--num-threads", type=int, default=None, help="interpreter torch threads for large ops")
    p.set_defaults(func=cmd_serve_runtime)
