"""serve-runtime protocol fuzzing: malformed requests through `Server.serve` in-process, a few through the
real `cohere-coreml serve-runtime` child.

Each case is a valid session prefix (load the stateful toy package, make a state, one good predict),
then one fuzzed request (wrong dtype / shape / length / nbytes, truncated payloads, huge, deep or
non-object JSON headers, NaN, unknown ops and handles, arrays on ops that take none, random bytes),
then a valid probe request and quit. Property: every response is a protocol message; a failed request
gets {"ok": false, "error", "type"} with a message and a protocol error type (never a raw
KeyError/TypeError/...), and the server answers the probe; or, when the stream cannot be
resynchronised (input ended inside a payload, a payload of unknown length), the last response is that
error, the server returns 1 and logs one line. Never an exception out of `serve`, never a hang.
Settings: tests/fuzz.py; results: docs/reliability.md.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cohere_coreml.runtime.serve import MAX_HEADER_BYTES, PROTOCOL, Server, read_arrays

from ..fuzz import Outcomes, fuzz_settings
from .test_serve import _request
from .test_stateful import D, toy  # noqa: F401  (the stateful toy package fixture)

# exception types that mean a request reached code that did not check it
RAW_TYPES = {"KeyError", "TypeError", "AttributeError", "IndexError", "RecursionError", "OverflowError",
             "MemoryError", "UnboundLocalError", "NameError", "ZeroDivisionError", "AssertionError", "StopIteration"}
LOST_STREAM = {"EOFError", "StreamError"}

GOOD = {"x": np.ones((1, 1, D), np.float16), "pos": np.array([0], np.int32)}


def _session_prefix(path) -> bytes:
    return (_request({"id": "load", "op": "load", "path": str(path)})
            + _request({"id": "state", "op": "make_state", "model": "m1"})
            + _request({"id": "good", "op": "predict", "model": "m1", "state": "s2"}, GOOD))


def _probe(path) -> bytes:
    return _request({"id": "probe", "op": "load", "path": str(path)}) + _request({"id": "bye", "op": "quit"})


def _read_responses(raw: bytes) -> list[dict]:
    stream, out = io.BytesIO(raw), []
    while line := stream.readline():
        header = json.loads(line)  # every response line is JSON (a failure here fails the case)
        if header.get("arrays"):
            header["_arrays"] = read_arrays(stream, header["arrays"])
        out.append(header)
    return out


def check_stream(path, fuzzed: bytes, outcomes: Outcomes, caplog, truncated: bool = False) -> None:
    """`truncated`: the fuzzed request declares more payload than it carries, so the probe may be read as
    its payload (the server cannot tell): then the probe need not be answered, the rest still holds."""
    caplog.clear()
    out = io.BytesIO()
    stream = _session_prefix(path) + fuzzed + b"\n" + _probe(path)  # the probe starts on a line of its own
    with caplog.at_level(logging.ERROR, logger="cohere_coreml.runtime.serve"):
        status = Server(backend="mil").serve(io.BytesIO(stream), out)
    responses = _read_responses(out.getvalue())
    assert responses[0]["protocol"] == PROTOCOL
    assert [r.get("id") for r in responses[1:4]] == ["load", "state", "good"] and all(r["ok"] for r in responses[1:4])
    assert set(responses[3]["_arrays"]) == {"y", "logp"}
    rest = responses[4:]
    for r in rest:
        assert isinstance(r.get("ok"), bool), r
        if not r["ok"]:
            assert isinstance(r.get("error"), str) and r["error"], r
            assert r.get("type") not in RAW_TYPES, f"unchecked input reached {r['type']}: {r['error']}"
    if status == 0 and truncated and [r.get("id") for r in rest[-2:]] != ["probe", "bye"]:
        assert rest[-1] == {"ok": True, "id": "bye"}, rest[-3:]  # the probe went into the payload; quit still read
        outcomes["truncated_probe_eaten_then_served"] += 1
    elif status == 0:
        assert [r.get("id") for r in rest[-2:]] == ["probe", "bye"] and rest[-2]["ok"], rest[-3:]
        outcomes["errors_then_served" if any(not r["ok"] for r in rest) else "accepted_then_served"] += 1
    else:
        assert status == 1, status
        assert rest and not rest[-1]["ok"] and rest[-1]["type"] in LOST_STREAM, rest[-1:]
        assert any("exiting" in m for m in caplog.messages), caplog.messages  # one line on stderr
        outcomes["stream_lost_exit_1"] += 1


def _descriptor_strategy():
    name = st.sampled_from(["x", "pos", "", "y", None, 5, ["x"]])
    dtype = st.sampled_from(["float16", "int32", "float32", "float64", "int8", None, 3, "FLOAT16"])
    dim = st.one_of(st.integers(-3, 4), st.sampled_from([D, 2**31, 2**40, -(2**63), True, 1.5, "1", None]))
    shape = st.one_of(st.lists(dim, max_size=4), st.sampled_from([None, 5, "1,1", {"0": 1}, [[1]], [1] * 40]))
    nbytes_kind = st.sampled_from(["exact", "plus", "minus", "zero", "negative", "huge", "string", "float", "none",
                                   "bool", "missing"])
    return st.tuples(name, dtype, shape, nbytes_kind, st.booleans())


def _payload_nbytes(shape, dtype, kind):
    size = {"float16": 2, "int32": 4, "float32": 4}.get(dtype, 1)
    try:
        exact = int(np.prod([int(s) for s in shape])) * size if isinstance(shape, list) else 4
    except (TypeError, ValueError, OverflowError):
        exact = 4
    exact = exact if 0 <= exact <= 4096 else 8
    return exact, {"exact": exact, "plus": exact + 1, "minus": max(exact - 1, 0), "zero": 0, "negative": -1,
                   "huge": 2**62, "string": str(exact), "float": float(exact), "none": None, "bool": True}.get(kind, exact)


@st.composite
def fuzzed_request(draw, path) -> tuple[bytes, bool]:
    """(request bytes, whether they were cut short)."""
    kind = draw(st.integers(0, 9), label="kind")
    if kind == 0:  # raw bytes, not a request
        return draw(st.binary(max_size=200), label="bytes") + b"\n", False
    if kind == 1:  # JSON that is not a request object, or that Python reads but the protocol refuses
        return draw(st.sampled_from([b"[1, 2]\n", b"42\n", b"null\n", b'"predict"\n', b"{\n", b"{}\n",
                                     b'{"op": "load", "path": NaN}\n', b'{"op": "predict", "id": Infinity}\n',
                                     b"[" * 100000 + b"\n", b'{"op": "\xff\xfe"}\n', b"\xef\xbb\xbf{}\n",
                                     b" " * (MAX_HEADER_BYTES + 10) + b"\n"]), label="json"), False
    header = {"op": draw(st.sampled_from(["predict", "load", "make_state", "read_state", "free", "frobnicate", "",
                                          None, 5, ["predict"], {"op": "load"}]), label="op")}
    for key, values in (("model", ["m1", "m9", "s2", None, 5, [], {}, "m1" * 100]),
                        ("state", ["s2", "s9", "m1", None, 1.5, [1]]),
                        ("name", ["k_cache", "v_cache", "zz", None, 3, ["k_cache"]]),
                        ("path", [str(path), "", "/nonexistent.mlpackage", 5, None, str(path.parent), "\x00"]),
                        ("function", [None, "main", "nope", 3, [], ""]),
                        ("compute_units", ["all", "cpu_only", "gpu", None, 7]),
                        ("id", [1, "x", None, [1], {"a": 1}, 1e308, -1])):
        if draw(st.booleans(), label=f"has {key}"):
            header[key] = draw(st.sampled_from(values), label=key)
    payloads = b""
    if draw(st.booleans(), label="has arrays"):
        if draw(st.integers(0, 9), label="arrays form") == 0:
            header["arrays"] = draw(st.sampled_from([None, 5, "x", {"name": "x"}, [None], [5], [[]]]), label="arrays")
        else:
            descriptors = []
            for name, dtype, shape, nbytes_kind, corrupt in draw(st.lists(_descriptor_strategy(), max_size=3),
                                                                 label="descriptors"):
                exact, nbytes = _payload_nbytes(shape, dtype, nbytes_kind)
                d = {"name": name, "dtype": dtype, "shape": shape}
                if nbytes_kind != "missing":
                    d["nbytes"] = nbytes
                descriptors.append(d)
                # the client sends what its descriptor declares (a valid nbytes), else the array's true size
                size = nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 <= nbytes <= 8192 else exact
                payloads += draw(st.binary(min_size=size, max_size=size), label="payload") if corrupt else bytes(size)
            header["arrays"] = descriptors
    line = json.dumps(header).encode() + b"\n"
    if draw(st.integers(0, 9), label="truncate") == 0:  # the request cut short: the probe follows mid-payload
        return (line + payloads)[: draw(st.integers(0, len(line) + len(payloads)), label="cut")], True
    return line + payloads, False


OUTCOMES = Outcomes("serve_runtime")


@fuzz_settings(default=80, long=3000)
@given(data=st.data())
def test_fuzzed_request_is_answered_or_ends_the_stream_cleanly(toy, caplog, data):  # noqa: F811
    _, path = toy
    try:
        request, truncated = data.draw(fuzzed_request(path), label="request")
        check_stream(path, request, OUTCOMES, caplog, truncated)
    finally:
        OUTCOMES.write()


def test_stream_cases_that_broke_the_server(toy, caplog):  # noqa: F811
    """Fixed by the fuzzing (runtime/serve.py): each was a traceback out of serve, a raw exception type,
    an unbounded read or a desynchronised stream before."""
    _, path = toy
    outcomes = Outcomes("serve_runtime_cases")
    desc = {"name": "x", "dtype": "float16", "shape": [1, 1, D]}
    cases = {
        "deep JSON (RecursionError escaped serve)": b"[" * 100000 + b"\n",
        "negative nbytes (read to EOF, ate the probe)": json.dumps(
            {"op": "predict", "model": "m1", "arrays": [{**desc, "nbytes": -1}]}).encode() + b"\n",
        "huge nbytes (one read of that size)": json.dumps(
            {"op": "predict", "model": "m1", "arrays": [{**desc, "nbytes": 2**62}]}).encode() + b"\n",
        "float nbytes (silently truncated)": json.dumps(
            {"op": "predict", "model": "m1", "arrays": [{**desc, "nbytes": 32.9}]}).encode() + b"\n" + bytes(32),
        "arrays on load (payload read as headers)": json.dumps(
            {"op": "load", "path": str(path), "arrays": [{**desc, "nbytes": 32}]}).encode() + b"\n" + b"\n{}" * 10 + b"\n" * 2,
        "list as model handle (TypeError: unhashable)": json.dumps({"op": "make_state", "model": ["m1"]}).encode() + b"\n",
        "list as state name (TypeError: unhashable)": json.dumps(
            {"op": "read_state", "state": "s2", "name": ["k_cache"]}).encode() + b"\n",
        "duplicate array names (the second silently won)": json.dumps(
            {"op": "predict", "model": "m1", "state": "s2", "arrays": [{**desc, "nbytes": 32}, {**desc, "nbytes": 32}]}
        ).encode() + b"\n" + bytes(64),
        "NaN id (answered with non-JSON)": b'{"op": "frobnicate", "id": NaN}\n',
        "over-long header (read whole into memory)": b" " * (MAX_HEADER_BYTES + 10) + b"x\n",
    }
    for name, fuzzed in cases.items():
        check_stream(path, fuzzed, outcomes, caplog)
    outcomes.write()
    assert outcomes["stream_lost_exit_1"] == 3  # negative, huge and float nbytes: the payload length is unknown


def test_real_child_answers_bad_requests_and_exits_cleanly(toy):  # noqa: F811
    """The `cohere-coreml serve-runtime` process: bad requests answered, a payload cut by the end of
    input ends it with status 1 and one line on stderr, never a traceback."""
    _, path = toy
    stream = (b"\xff\xfe garbage\n" + b"[" * 50000 + b"\n" + b'{"op": 5, "id": NaN}\n'
              + _request({"op": "make_state", "model": {"m": 1}, "id": 1})
              + _request({"op": "load", "path": str(path), "id": 2})
              + _request({"op": "make_state", "model": "m1", "id": 3})
              + _request({"op": "predict", "model": "m1", "state": "s2", "id": 4}, GOOD)
              + json.dumps({"op": "predict", "model": "m1", "id": 5,
                            "arrays": [{"name": "x", "dtype": "float16", "shape": [1, 1, D], "nbytes": 2 * D}]}).encode()
              + b"\n" + bytes(D))  # half the payload, then end of input
    proc = subprocess.run([sys.executable, "-m", "cohere_coreml.cli", "serve-runtime"], input=stream,
                          capture_output=True, timeout=300)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    assert "input ended inside array 'x'" in stderr and "exiting" in stderr, stderr
    responses = _read_responses(proc.stdout)
    assert [r.get("ok") for r in responses[1:]] == [False, False, False, False, True, True, True, False]
    assert [r.get("type") for r in responses[2:5]] == ["ProtocolError"] * 3  # deep, NaN, a dict as handle
    assert responses[-1]["type"] == "EOFError" and responses[-1]["id"] == 5
