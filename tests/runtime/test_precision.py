"""Precision policy: fp16 values are rounded to fp16 at every op boundary, arithmetic inside an
op runs in fp32 (docs/runtime.md)."""

from __future__ import annotations

import numpy as np
import pytest

from cohere_coreml.runtime import load_model

from .test_interface import _program, _save


@pytest.fixture(scope="module")
def fp16_chain(tmp_path_factory):
    def body(mb, x):
        a = mb.add(x=x, y=np.float16(1e-4), name="a")  # 1 + 1e-4 is not an fp16 value
        b = mb.sub(x=a, y=np.float16(1.0), name="b")  # exposes what `a` held
        c = mb.mul(x=x, y=np.float16(30000.0), name="c")  # overflow -> inf for |x| >= 2.2
        d = mb.mul(x=x, y=np.float16(2.0**-20), name="d")  # fp16 subnormals are kept
        # one op, fp32 inside: 4096 ones sum to 4096 in fp32; accumulated in fp16 the partial
        # sums would stall at 2048 (2049 is not an fp16 value)
        e = mb.reduce_sum(x=mb.add(x=mb.fill(shape=[4096], value=np.float16(0.0)), y=mb.slice_by_index(x=x, begin=[0], end=[1])), axes=[0], name="e")
        return a, b, c, d, e

    path = _save(_program(body, {"x": ((4,), "fp16")}), tmp_path_factory.mktemp("prec") / "chain.mlpackage")
    return load_model(path, backend="mil")


def test_fp16_rounded_at_op_boundaries(fp16_chain):
    x = np.array([1.0, 2.5, -3.0, 1.5], dtype=np.float16)
    out = fp16_chain.predict({"x": x})
    assert all(v.dtype == np.float16 for v in out.values())
    want_a = (x.astype(np.float32) + np.float32(np.float16(1e-4))).astype(np.float16)
    np.testing.assert_array_equal(out["a"], want_a)
    assert out["a"][0] == np.float16(1.0)  # the 1e-4 was rounded away at the op boundary...
    np.testing.assert_array_equal(out["b"], (want_a.astype(np.float32) - 1).astype(np.float16))
    assert out["b"][0] == 0.0  # ...so the next op sees exactly 1.0
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out["c"], (x.astype(np.float32) * 30000).astype(np.float16))
    assert np.isinf(out["c"][1]) and np.isinf(out["c"][2]) and out["c"][2] < 0
    np.testing.assert_array_equal(out["d"], (x.astype(np.float32) * 2.0**-20).astype(np.float16))
    assert 0 < abs(float(out["d"][0])) < 2.0**-14  # subnormal
    assert float(out["e"]) == 4096.0


def test_intermediates_expose_every_op_output(fp16_chain):
    x = np.array([1.0, 2.5, -3.0, 1.5], dtype=np.float16)
    inter = fp16_chain.intermediates({"x": x})
    for name in ("a", "b", "c", "d", "e"):
        assert name in inter and inter[name].dtype == np.float16
    np.testing.assert_array_equal(inter["a"], fp16_chain.predict({"x": x})["a"])
