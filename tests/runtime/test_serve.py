"""`cohere-coreml serve-runtime`: the stdin/stdout protocol the Swift package uses on Linux."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np

from cohere_coreml.runtime import load_model
from cohere_coreml.runtime.serve import PROTOCOL, Server, read_arrays, write_message

from .test_stateful import STEPS, D, toy  # noqa: F401  (the stateful toy package fixture)


def _request(header: dict, arrays: dict | None = None) -> bytes:
    buf = io.BytesIO()
    if arrays is None:
        buf.write(json.dumps(header).encode() + b"\n")
    else:
        # same framing as the server's responses: descriptors in the header, payloads after it
        tmp = io.BytesIO()
        write_message(tmp, {}, arrays)
        line, payload = tmp.getvalue().split(b"\n", 1)
        header = {**header, "arrays": json.loads(line)["arrays"]}
        buf.write(json.dumps(header).encode() + b"\n" + payload)
    return buf.getvalue()


def _responses(raw: bytes) -> list[tuple[dict, dict]]:
    stream = io.BytesIO(raw)
    out = []
    while True:
        line = stream.readline()
        if not line:
            return out
        header = json.loads(line)
        out.append((header, read_arrays(stream, header.get("arrays", []))))


def _serve(requests: bytes) -> list[tuple[dict, dict]]:
    out = io.BytesIO()
    assert Server(backend="mil").serve(io.BytesIO(requests), out) == 0
    return _responses(out.getvalue())


def test_stateful_sequence_equals_direct_runtime(toy):  # noqa: F811
    _, path = toy
    gen = np.random.default_rng(3)
    xs = [gen.standard_normal((1, 1, D)).astype(np.float16) for _ in range(STEPS)]
    req = _request({"id": 1, "op": "load", "path": str(path)})
    req += _request({"id": 2, "op": "make_state", "model": "m1"})
    for step, x in enumerate(xs):
        req += _request({"id": 10 + step, "op": "predict", "model": "m1", "state": "s2"},
                        {"x": x, "pos": np.array([step], np.int32)})
    req += _request({"id": 99, "op": "read_state", "state": "s2", "name": "k_cache"})
    req += _request({"op": "quit"})
    responses = _serve(req)

    hello, _ = responses[0]
    assert hello == {"ok": True, "protocol": PROTOCOL, "version": 1}
    load, _ = responses[1]
    assert load["ok"] and load["model"] == "m1" and load["id"] == 1
    assert load["states"]["k_cache"] == {"shape": [1, 8, D], "dtype": "float16"}
    assert load["inputs"]["pos"] == {"shape": [1], "dtype": "int32"}
    assert responses[2][0] == {"ok": True, "state": "s2", "id": 2}

    direct = load_model(path, backend="mil")
    state = direct.make_state()
    for step, x in enumerate(xs):
        header, arrays = responses[3 + step]
        assert header["ok"] and header["id"] == 10 + step
        want = direct.predict({"x": x, "pos": np.array([step], np.int32)}, state=state)
        assert set(arrays) == set(want)
        for name in want:
            assert arrays[name].dtype == want[name].dtype
            np.testing.assert_array_equal(arrays[name], want[name])
    header, arrays = responses[3 + STEPS]
    np.testing.assert_array_equal(arrays["k_cache"], state.read_state("k_cache"))
    assert arrays["k_cache"][:, :STEPS].any()  # the state really was carried across requests
    assert responses[-1][0] == {"ok": True, "id": None}


def test_errors_are_reported_and_the_server_keeps_serving(toy):  # noqa: F811
    _, path = toy
    req = b"this is not json\n"
    req += _request({"op": "frobnicate"})
    req += _request({"op": "load", "path": str(path.parent / "missing.mlpackage")})
    req += _request({"op": "load", "path": str(path)})  # m1
    req += _request({"op": "make_state", "model": "m7"})
    # wrong shape: the payload is consumed, the error names the input, the next request still works
    req += _request({"op": "predict", "model": "m1", "state": None},
                    {"x": np.zeros((1, 2, D), np.float16), "pos": np.array([0], np.int32)})
    req += _request({"op": "predict", "model": "m1", "state": None},
                    {"x": np.zeros((1, 1, D), np.float16), "pos": np.array([0], np.int32)})
    req += _request({"op": "make_state", "model": "m1"})
    req += _request({"op": "predict", "model": "m1", "state": "s2"},
                    {"x": np.zeros((1, 1, D), np.float16), "pos": np.array([0], np.int32)})
    responses = _serve(req)[1:]
    errors = [h for h, _ in responses if not h["ok"]]
    assert [e["type"] for e in errors] == ["JSONDecodeError", "ProtocolError", "PackageLoadError", "ProtocolError",
                                           "InputValidationError", "InputValidationError"]
    assert "unknown op 'frobnicate'" in errors[1]["error"]
    assert "missing.mlpackage" in errors[2]["error"]
    assert "'m7'" in errors[3]["error"]
    assert "'x'" in errors[4]["error"] and "shape" in errors[4]["error"]
    assert "stateful" in errors[5]["error"]  # a stateful function without a state
    assert responses[-1][0]["ok"] and set(responses[-1][1]) == {"y", "logp"}


def test_payload_size_mismatch_is_an_error():
    req = json.dumps({"op": "predict", "model": "m1",
                      "arrays": [{"name": "x", "dtype": "float32", "shape": [2, 2], "nbytes": 8}]}).encode()
    responses = _serve(req + b"\n" + bytes(8))[1:]
    assert not responses[0][0]["ok"] and "needs 16 bytes, got 8" in responses[0][0]["error"]


def test_cli_entry_point_speaks_the_protocol(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cohere_coreml.cli", "serve-runtime"],
        input=_request({"op": "load", "path": str(tmp_path / "none.mlpackage")}) + _request({"op": "quit", "id": 5}),
        capture_output=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert lines[0]["protocol"] == PROTOCOL
    assert not lines[1]["ok"] and "none.mlpackage" in lines[1]["error"]
    assert lines[2] == {"ok": True, "id": 5}
