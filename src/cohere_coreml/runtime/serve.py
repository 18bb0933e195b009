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
    {"op": "write_state", "state": "s1", "name": N, "start": [i, ...]|null, "arrays": [descriptor]} + payload
                                                     -> {"ok": true}: the array replaces the whole buffer
                                                        (start null) or the region at `start` (one offset
                                                        per axis): what a host writes into a state
    {"op": "free", "model": "m1"} / {"op": "free", "state": "s1"}   -> {"ok": true}
    {"op": "quit"}                                   -> {"ok": true}, then the server exits 0

A failed request gets {"ok": false, "error": message, "type": exception class name} and the server
keeps serving (its payload bytes, if any, have been consumed: every request that lists "arrays" has
them read first, whatever its op). Limits: a header line holds at most MAX_HEADER_BYTES (a longer one
is skipped and refused), an array at most MAX_ARRAY_BYTES, a shape at most MAX_RANK dimensions; NaN
and Infinity are not JSON. Two things end the server with status 1 and a one-line message on stderr
(after an error response): input that ends inside a payload, and a descriptor whose "nbytes" is not a
non-negative integer within the limit (the server cannot tell where the next header starts, a
`StreamError`). End of input between messages ends the server with status 0.
Logging goes to stderr, never a traceback; nothing but protocol messages is written to stdout.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import BinaryIO

import numpy as np

from . import load_model
from .errors import InputValidationError, RuntimeBackendError

logger = logging.getLogger(__name__)

PROTOCOL = "cohere-coreml-serve-runtime"
PROTOCOL_VERSION = 1
DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}


MAX_HEADER_BYTES = 1 << 20  # one JSON header line
MAX_ARRAY_BYTES = 1 << 32  # one array payload
MAX_RANK = 16
MAX_DIM = 2**31 - 1
READ_CHUNK = 1 << 24  # payloads are read in pieces: a declared size is never allocated up front


class ProtocolError(ValueError):
    """A request that does not follow the protocol (bad JSON, unknown op or id, bad array)."""


class StreamError(ProtocolError):
    """A payload of unknown length: the stream cannot be resynchronised (the server reports it and exits 1)."""


def _describe(description) -> dict:
    return {k: {"shape": [int(d) for d in shape], "dtype": np.dtype(dt).name} for k, (shape, dt) in description.items()}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_exact(stream: BinaryIO, nbytes: int, name) -> bytes:
    parts, got = [], 0
    while got < nbytes:
        data = stream.read(min(READ_CHUNK, nbytes - got))
        if not data:
            raise EOFError(f"input ended inside array {name!r} ({got} of {nbytes} bytes)")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def read_arrays(stream: BinaryIO, descriptors: list) -> dict[str, np.ndarray]:
    """Read the payloads listed by `descriptors` from `stream` (all of them, even after an error).

    Raises StreamError when a payload's size is unknown or beyond MAX_ARRAY_BYTES (the stream is lost),
    EOFError when the input ends inside a payload, ProtocolError for a bad name, dtype or shape."""
    if not isinstance(descriptors, list):
        raise ProtocolError(f"'arrays' must be a list of array descriptors, got {type(descriptors).__name__}")
    raw = []
    for i, d in enumerate(descriptors):
        nbytes = d.get("nbytes") if isinstance(d, dict) else None
        if not _is_int(nbytes) or not 0 <= nbytes <= MAX_ARRAY_BYTES:
            raise StreamError(f"array descriptor {i} has no valid 'nbytes' (an integer in [0, {MAX_ARRAY_BYTES}]): "
                              f"{str(d)[:200]}; the payload length is unknown, the stream cannot be resynchronised")
        raw.append((d, _read_exact(stream, nbytes, d.get("name"))))
    arrays = {}
    for d, data in raw:
        name, dtype, shape = d.get("name"), d.get("dtype"), d.get("shape")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"array name must be a non-empty string, got {str(name)[:100]!r}")
        if name in arrays:
            raise ProtocolError(f"array {name!r} is listed twice")
        if dtype not in DTYPES:
            raise ProtocolError(f"array {name!r}: dtype must be one of {sorted(DTYPES)}, got {str(dtype)[:100]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK \
                or not all(_is_int(s) and 0 <= s <= MAX_DIM for s in shape):
            raise ProtocolError(f"array {name!r}: shape must be a list of at most {MAX_RANK} integers in "
                                f"[0, {MAX_DIM}], got {str(shape)[:100]}")
        expected = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        if expected != len(data):
            raise ProtocolError(f"array {name!r}: {dtype} {shape} needs {expected} bytes, got {len(data)}")
        arrays[name] = np.frombuffer(data, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(shape).astype(DTYPES[dtype])
    return arrays


def _no_constants(name: str):
    raise ProtocolError(f"{name} is not JSON (the protocol carries finite numbers only)")


def parse_header(line: bytes) -> dict:
    """One request header: a JSON object (ProtocolError otherwise, naming the problem)."""
    try:
        request = json.loads(line, parse_constant=_no_constants)
    except RecursionError:
        raise ProtocolError("request header is nested too deeply") from None
    except UnicodeDecodeError as err:
        raise ProtocolError(f"request header is not UTF-8 ({err})") from None
    # (a json.JSONDecodeError goes to the client as is: type "JSONDecodeError", the position in the line)
    if not isinstance(request, dict):
        raise ProtocolError(f"a request must be a JSON object, got {type(request).__name__}")
    return request


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
        if not isinstance(handle, str) or handle not in self.models:
            raise ProtocolError(f"unknown model handle {str(handle)[:100]!r}")
        return self.models[handle]

    def _state(self, handle):
        if not isinstance(handle, str) or handle not in self.states:
            raise ProtocolError(f"unknown state handle {str(handle)[:100]!r}")
        return self.states[handle][1]

    def handle(self, request: dict, stream_in: BinaryIO) -> tuple[dict, dict | None]:
        """(response header, arrays or None) for one request; payloads are read from `stream_in`."""
        op = request.get("op")
        if "arrays" in request or op in ("predict", "write_state"):
            inputs = read_arrays(stream_in, request.get("arrays", []))  # consume payloads first, whatever the op
            if op not in ("predict", "write_state"):
                raise ProtocolError(f"op {str(op)[:100]!r} takes no arrays (only predict and write_state do)")
        if op == "predict":
            model = self._model(request.get("model"))
            state = None if request.get("state") is None else self._state(request["state"])
            return {"ok": True}, model.predict(inputs, state=state)
        if op == "load":
            path, function = request.get("path"), request.get("function")
            units = request.get("compute_units") or "all"
            if not isinstance(path, str) or not path:
                raise ProtocolError("'load' needs a 'path' (string)")
            if function is not None and not isinstance(function, str):
                raise ProtocolError(f"'function' must be a string or null, got {str(function)[:100]}")
            if units not in ("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"):
                raise ProtocolError(f"'compute_units' must be all, cpu_only, cpu_and_gpu or cpu_and_ne, got {str(units)[:100]!r}")
            model = load_model(path, backend=self.backend, function_name=function, compute_units=units,
                               num_threads=self.num_threads)
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
            state = self._state(request.get("state"))
            if not isinstance(name, str):
                raise ProtocolError(f"'read_state' needs a state 'name' (string), got {str(name)[:100]}")
            return {"ok": True}, {name: state.read_state(name)}
        if op == "write_state":
            name, start = request.get("name"), request.get("start")
            state = self._state(request.get("state"))
            if not isinstance(name, str) or set(inputs) != {name}:
                raise ProtocolError(f"'write_state' needs a state 'name' (string) and one array of that name, got "
                                    f"{str(name)[:100]} and {sorted(inputs)[:4]}")
            if start is None:
                state.write_state(name, inputs[name])
            elif isinstance(start, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in start):
                value = inputs[name]
                if hasattr(state, "write_state_slice"):  # the interpreter's state: in place
                    state.write_state_slice(name, value, start)
                else:  # coremltools' MLState: whole buffers only
                    buffer = np.array(state.read_state(name), copy=True)
                    if len(start) != buffer.ndim or value.ndim != buffer.ndim:
                        raise ProtocolError(f"'write_state' of {name!r}: start {start} and array {value.shape} "
                                            f"do not fit the state {buffer.shape}")
                    buffer[tuple(slice(i, i + n) for i, n in zip(start, value.shape))] = value
                    state.write_state(name, buffer)
            else:
                raise ProtocolError(f"'write_state' start must be null or a list of integers, got {str(start)[:100]}")
            return {"ok": True}, None
        if op == "free":
            if "model" in request:
                self._model(request["model"])
            if "state" in request:
                self._state(request["state"])
            self.models.pop(request.get("model"), None) if isinstance(request.get("model"), str) else None
            self.states.pop(request.get("state"), None) if isinstance(request.get("state"), str) else None
            return {"ok": True}, None
        raise ProtocolError(f"unknown op {str(op)[:100]!r}; ops: load, make_state, predict, read_state, write_state, "
                            "free, quit")

    def _read_header(self, stream_in: BinaryIO) -> bytes | None:
        """The next header line (None at end of input); a line over MAX_HEADER_BYTES is skipped and refused."""
        line = stream_in.readline(MAX_HEADER_BYTES + 1)
        if len(line) > MAX_HEADER_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of the line, a bounded piece at a time
                rest = stream_in.readline(MAX_HEADER_BYTES)
                if not rest or rest.endswith(b"\n"):
                    break
            raise ProtocolError(f"request header longer than {MAX_HEADER_BYTES} bytes, skipped")
        return line or None

    def serve(self, stream_in: BinaryIO, stream_out: BinaryIO) -> int:
        write_message(stream_out, {"ok": True, "protocol": PROTOCOL, "version": PROTOCOL_VERSION})
        while True:
            request: dict = {}
            exit_status = None
            try:
                line = self._read_header(stream_in)
                if line is None:
                    return 0  # end of input
                if not line.strip():
                    continue
                request = parse_header(line)
                if request.get("op") == "quit":
                    write_message(stream_out, {"ok": True, "id": request.get("id")})
                    return 0
                header, arrays = self.handle(request, stream_in)
            except (EOFError, StreamError) as err:
                # the stream is lost (input ended inside a payload, or a payload of unknown length)
                logger.error("serve-runtime: %s; exiting", err)
                header, arrays, exit_status = {"ok": False, "error": str(err), "type": type(err).__name__}, None, 1
            except (ValueError, RuntimeBackendError, InputValidationError, KeyError, TypeError) as err:
                # protocol errors, package / input errors: reported, the server keeps serving
                header, arrays = {"ok": False, "error": str(err), "type": type(err).__name__}, None
            except Exception as err:  # noqa: BLE001 - anything else a package run raises: reported, never a traceback
                logger.error("serve-runtime: request failed: %s: %s", type(err).__name__, err)
                header, arrays = {"ok": False, "error": f"{type(err).__name__}: {err}", "type": type(err).__name__}, None
            header["id"] = request.get("id")
            try:
                write_message(stream_out, header, arrays)
            except (TypeError, ValueError) as err:  # an output the protocol cannot carry
                write_message(stream_out, {"ok": False, "error": f"cannot send the response: {err}",
                                           "type": type(err).__name__, "id": request.get("id")})
            if exit_status is not None:
                return exit_status


def cmd_serve_runtime(args) -> int:
    protocol_out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol stream
    try:
        return Server(backend=args.backend, num_threads=args.num_threads).serve(sys.stdin.buffer, protocol_out)
    except (BrokenPipeError, ConnectionResetError):
        print("cohere-coreml serve-runtime: the client closed the output stream; exiting", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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
