"""Op zoo: MIL builder programs covering every supported op, interpreter vs numpy definitions.

All cases are outputs of ONE program per precision (built with the MIL builder and saved with an
empty pass pipeline, so the package holds exactly the ops written here), so the suite converts
twice. FP32: max error relative to max |reference| <= 1e-4. FP16: inputs and constants are fp16,
the reference is computed in float64 from the same fp16 values, and the interpreter must agree
to fp16 rounding (<= 2**-10 of max |reference|); the PSNR of each case is printed
(``pytest -s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy import special as _special  # noqa: F401  (scipy ships with librosa)

from cohere_coreml.export.parity import psnr
from cohere_coreml.runtime import load_model, supported_op_types

from .helpers import max_rel_err

ERF = np.vectorize(__import__("math").erf)


@dataclass
class Case:
    name: str
    shapes: dict  # input name -> shape
    build: object  # (mb, c, **vars) -> var or tuple of vars
    ref: object  # (c, **arrays) -> array or tuple of arrays (float64 math)
    ops: tuple = ()  # op types this case covers (default: name)
    domain: tuple = (-2.0, 2.0)  # uniform input range
    fp16: bool = True
    exact: bool = False  # integer / index outputs: compare exactly
    extra: dict = field(default_factory=dict)


def _cases():
    import coremltools.converters.mil.mil.types as types  # noqa: F401

    S = (2, 3, 4)
    B = {"x": S, "y": (3, 1)}
    U = {"x": S}
    cases = []

    def binary(name, fn, domain=(-2.0, 2.0), ydomain=None, **kw):
        cases.append(Case(name, B, lambda mb, c, x, y: getattr(mb, name)(x=x, y=y), lambda c, x, y: fn(x, y),
                          domain=domain, extra={"ydomain": ydomain} if ydomain else {}, **kw))

    binary("add", np.add)
    binary("sub", np.subtract)
    binary("mul", np.multiply)
    binary("real_div", np.divide, ydomain=(0.5, 2.0))
    binary("maximum", np.maximum)
    binary("minimum", np.minimum)
    binary("pow", np.power, domain=(0.5, 2.0))
    binary("floor_div", lambda x, y: np.floor(x / y), ydomain=(0.7, 1.9))
    binary("mod", np.mod, ydomain=(0.7, 1.9))

    def compare(name, fn):
        cases.append(Case(name, B,
                          lambda mb, c, x, y: mb.cast(x=getattr(mb, name)(x=mb.round(x=x), y=mb.round(x=y)), dtype="int32"),
                          lambda c, x, y: fn(np.round(x), np.round(y)).astype(np.int32),
                          ops=(name, "round", "cast"), exact=True))

    for name, fn in [("equal", np.equal), ("not_equal", np.not_equal), ("less", np.less),
                     ("less_equal", np.less_equal), ("greater", np.greater), ("greater_equal", np.greater_equal)]:
        compare(name, fn)

    def logical(name, fn):
        cases.append(Case(name, B,
                          lambda mb, c, x, y: mb.cast(x=getattr(mb, name)(x=mb.less(x=x, y=c(0.0)), y=mb.greater(x=y, y=c(0.5))), dtype="int32"),
                          lambda c, x, y: fn(x < 0, y > 0.5).astype(np.int32), ops=(name,), exact=True))

    logical("logical_and", np.logical_and)
    logical("logical_or", np.logical_or)
    logical("logical_xor", np.logical_xor)
    cases.append(Case("logical_not", U, lambda mb, c, x: mb.cast(x=mb.logical_not(x=mb.less(x=x, y=c(0.0))), dtype="int32"),
                      lambda c, x: np.logical_not(x < 0).astype(np.int32), exact=True))

    def unary(name, fn, domain=(-2.0, 2.0), **kw):
        cases.append(Case(name, U, lambda mb, c, x: getattr(mb, name)(x=x, **{k: c(v) for k, v in kw.items()}),
                          lambda c, x: fn(x), domain=domain))

    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    unary("abs", np.abs)
    unary("acos", np.arccos, (-0.95, 0.95))
    unary("asin", np.arcsin, (-0.95, 0.95))
    unary("atan", np.arctan)
    unary("atanh", np.arctanh, (-0.9, 0.9))
    unary("ceil", np.ceil)
    unary("cos", np.cos)
    unary("cosh", np.cosh)
    unary("erf", ERF)
    unary("exp", np.exp)
    unary("exp2", np.exp2)
    unary("floor", np.floor)
    unary("round", np.round)
    unary("sign", np.sign)
    unary("sin", np.sin)
    unary("sinh", np.sinh)
    unary("sqrt", np.sqrt, (0.01, 4.0))
    unary("square", np.square)
    unary("tan", np.tan, (-1.2, 1.2))
    unary("tanh", np.tanh)
    unary("relu", lambda x: np.maximum(x, 0))
    unary("relu6", lambda x: np.clip(x, 0, 6), (-3.0, 9.0))
    unary("sigmoid", sig)
    unary("silu", lambda x: x * sig(x))
    unary("softplus", lambda x: np.log1p(np.exp(x)))
    unary("softsign", lambda x: x / (1 + np.abs(x)))
    unary("identity", lambda x: x)
    cases.append(Case("inverse", U, lambda mb, c, x: mb.inverse(x=x, epsilon=c(1e-3)), lambda c, x: 1 / (x + c(1e-3)), domain=(0.2, 3.0)))
    cases.append(Case("log", U, lambda mb, c, x: mb.log(x=x, epsilon=c(1e-3)), lambda c, x: np.log(x + c(1e-3)), domain=(0.2, 3.0)))
    cases.append(Case("rsqrt", U, lambda mb, c, x: mb.rsqrt(x=x, epsilon=c(1e-3)), lambda c, x: 1 / np.sqrt(x + c(1e-3)), domain=(0.2, 3.0)))
    cases.append(Case("threshold", U, lambda mb, c, x: mb.threshold(x=x, alpha=c(0.3)), lambda c, x: np.maximum(x, c(0.3))))
    cases.append(Case("clip", U, lambda mb, c, x: mb.clip(x=x, alpha=c(-0.5), beta=c(0.7)), lambda c, x: np.clip(x, c(-0.5), c(0.7))))
    cases.append(Case("cast_int32", U, lambda mb, c, x: mb.cast(x=mb.mul(x=x, y=c(3.0)), dtype="int32"),
                      lambda c, x: np.trunc(x * 3).astype(np.int32), ops=("cast", "mul"), exact=True, domain=(-2.1, 2.1)))
    cases.append(Case("cast_from_int", U, lambda mb, c, x: mb.mul(x=mb.cast(x=mb.cast(x=x, dtype="int32"), dtype="fp32" if c(0).dtype == np.float32 else "fp16"), y=c(0.5)),
                      lambda c, x: np.trunc(x) * 0.5, ops=("cast",)))

    # activations
    cases.append(Case("gelu_exact", U, lambda mb, c, x: mb.gelu(x=x, mode="EXACT"), lambda c, x: 0.5 * x * (1 + ERF(x / np.sqrt(2))), ops=("gelu",)))
    cases.append(Case("gelu_tanh", U, lambda mb, c, x: mb.gelu(x=x, mode="TANH_APPROXIMATION"),
                      lambda c, x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), ops=("gelu",)))
    cases.append(Case("gelu_sigmoid", U, lambda mb, c, x: mb.gelu(x=x, mode="SIGMOID_APPROXIMATION"), lambda c, x: x * sig(1.702 * x), ops=("gelu",)))
    cases.append(Case("leaky_relu", U, lambda mb, c, x: mb.leaky_relu(x=x, alpha=c(0.1)), lambda c, x: np.where(x >= 0, x, c(0.1) * x)))
    cases.append(Case("elu", U, lambda mb, c, x: mb.elu(x=x, alpha=c(0.7)), lambda c, x: np.where(x > 0, x, c(0.7) * np.expm1(x))))
    cases.append(Case("thresholded_relu", U, lambda mb, c, x: mb.thresholded_relu(x=x, alpha=c(0.4)), lambda c, x: np.where(x >= c(0.4), x, 0)))
    cases.append(Case("linear_activation", U, lambda mb, c, x: mb.linear_activation(x=x, alpha=c(1.5), beta=c(-0.25)), lambda c, x: c(1.5) * x + c(-0.25)))
    cases.append(Case("scaled_tanh", U, lambda mb, c, x: mb.scaled_tanh(x=x, alpha=c(1.5), beta=c(0.75)), lambda c, x: c(1.5) * np.tanh(c(0.75) * x)))
    cases.append(Case("sigmoid_hard", U, lambda mb, c, x: mb.sigmoid_hard(x=x, alpha=c(0.3), beta=c(0.4)), lambda c, x: np.clip(c(0.3) * x + c(0.4), 0, 1)))
    cases.append(Case("clamped_relu", U, lambda mb, c, x: mb.clamped_relu(x=x, alpha=c(0.2), beta=c(1.1)),
                      lambda c, x: np.minimum(np.where(x >= 0, x, c(0.2) * x), c(1.1))))
    alpha3 = np.array([0.1, 0.2, 0.3])
    U4 = {"x": (2, 3, 2, 2)}
    cases.append(Case("prelu", U4, lambda mb, c, x: mb.prelu(x=x, alpha=c(alpha3)), lambda c, x: np.where(x > 0, x, x * c(alpha3)[None, :, None, None])))
    cases.append(Case("softplus_parametric", U4, lambda mb, c, x: mb.softplus_parametric(x=x, alpha=c(alpha3 + 1), beta=c(alpha3 * 2)),
                      lambda c, x: c(alpha3 + 1)[None, :, None, None] * np.log1p(np.exp(c(alpha3 * 2)[None, :, None, None] * x))))

    def softmax_ref(x, axis):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)

    cases.append(Case("softmax", U, lambda mb, c, x: mb.softmax(x=x, axis=1), lambda c, x: softmax_ref(x, 1), domain=(-4, 4)))

    # linear algebra
    rng = np.random.RandomState(7)
    W, bias = rng.randn(5, 4) * 0.5, rng.randn(5) * 0.5
    cases.append(Case("linear", U, lambda mb, c, x: mb.linear(x=x, weight=c(W), bias=c(bias)), lambda c, x: x @ c(W).T + c(bias)))
    cases.append(Case("linear_nobias", U, lambda mb, c, x: mb.linear(x=x, weight=c(W)), lambda c, x: x @ c(W).T, ops=("linear",)))
    cases.append(Case("matmul", {"x": (2, 3, 4), "y": (2, 5, 4)}, lambda mb, c, x, y: mb.matmul(x=x, y=y, transpose_y=True),
                      lambda c, x, y: x @ np.swapaxes(y, 1, 2)))
    cases.append(Case("matmul_tx_bcast", {"x": (2, 4, 3), "y": (4, 5)}, lambda mb, c, x, y: mb.matmul(x=x, y=y, transpose_x=True),
                      lambda c, x, y: np.swapaxes(x, 1, 2) @ y, ops=("matmul",)))
    cases.append(Case("einsum", {"x": (1, 2, 3, 4), "y": (1, 4, 3, 5)}, lambda mb, c, x, y: mb.einsum(values=(x, y), equation="nchw,nwhu->nchu"),
                      lambda c, x, y: np.einsum("nchw,nwhu->nchu", x, y)))

    # convolution / pooling
    def conv_ref(x, w, b, stride, pads, dil, groups):
        import torch

        xt = torch.nn.functional.pad(torch.from_numpy(x), [p for pr in reversed(pads) for p in pr])
        fn = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d}[x.ndim]
        out = fn(xt.double(), torch.from_numpy(w).double(), None if b is None else torch.from_numpy(b).double(),
                 stride=stride, dilation=dil, groups=groups)
        return out.numpy()

    w1, b1 = rng.randn(6, 4, 3) * 0.3, rng.randn(6) * 0.1
    cases.append(Case("conv1d_strided", {"x": (1, 4, 11)},
                      lambda mb, c, x: mb.conv(x=x, weight=c(w1), bias=c(b1), strides=[2], pad_type="custom", pad=[1, 2]),
                      lambda c, x: conv_ref(x, c(w1), c(b1), [2], [(1, 2)], [1], 1), ops=("conv",)))
    w2 = rng.randn(6, 2, 3, 3) * 0.3
    cases.append(Case("conv2d_grouped_same_dilated", {"x": (1, 4, 7, 8)},
                      lambda mb, c, x: mb.conv(x=x, weight=c(w2), strides=[1, 2], pad_type="same", dilations=[2, 1], groups=2),
                      lambda c, x: conv_ref(x, c(w2), None, [1, 2], [(2, 2), (0, 1)], [2, 1], 2), ops=("conv",)))
    w3, b3 = rng.randn(4, 1, 9) * 0.3, rng.randn(4) * 0.1
    cases.append(Case("conv1d_depthwise_same", {"x": (1, 4, 12)},
                      lambda mb, c, x: mb.conv(x=x, weight=c(w3), bias=c(b3), pad_type="same", groups=4),
                      lambda c, x: conv_ref(x, c(w3), c(b3), [1], [(4, 4)], [1], 4), ops=("conv",)))
    w4 = rng.randn(3, 4, 3, 3) * 0.3
    cases.append(Case("conv2d_valid_stride2", {"x": (1, 4, 9, 9)},
                      lambda mb, c, x: mb.conv(x=x, weight=c(w4), strides=[2, 2], pad_type="valid"),
                      lambda c, x: conv_ref(x, c(w4), None, [2, 2], [(0, 0), (0, 0)], [1, 1], 1), ops=("conv",)))
    wt = rng.randn(4, 3, 4) * 0.3

    def convt_ref(c, x):
        import torch

        return torch.nn.functional.conv_transpose1d(torch.from_numpy(x).double(), torch.from_numpy(c(wt)).double(), stride=2).numpy()[..., 1:-1]

    cases.append(Case("conv_transpose", {"x": (1, 4, 6)},
                      lambda mb, c, x: mb.conv_transpose(x=x, weight=c(wt), strides=[2], pad_type="custom", pad=[1, 1]), convt_ref))

    def pool_ref(x, kind, k, s):
        import torch

        xt = torch.from_numpy(x).double()
        if kind == "max":
            return torch.nn.functional.max_pool2d(xt, k, s).numpy()
        if kind == "avg":
            return torch.nn.functional.avg_pool2d(xt, k, s, padding=1, count_include_pad=False).numpy()
        return torch.sqrt(torch.nn.functional.avg_pool2d(xt * xt, k, s) * (k * k)).numpy()

    cases.append(Case("max_pool", {"x": (1, 2, 6, 7)}, lambda mb, c, x: mb.max_pool(x=x, kernel_sizes=[2, 2], strides=[2, 2], pad_type="valid"),
                      lambda c, x: pool_ref(x, "max", 2, 2)))
    cases.append(Case("avg_pool", {"x": (1, 2, 6, 7)},
                      lambda mb, c, x: mb.avg_pool(x=x, kernel_sizes=[3, 3], strides=[2, 2], pad_type="custom", pad=[1, 1, 1, 1], exclude_padding_from_average=True),
                      lambda c, x: pool_ref(x, "avg", 3, 2)))
    cases.append(Case("l2_pool", {"x": (1, 2, 6, 6)}, lambda mb, c, x: mb.l2_pool(x=x, kernel_sizes=[2, 2], strides=[2, 2], pad_type="valid"),
                      lambda c, x: pool_ref(x, "l2", 2, 2)))

    # normalization
    g4, be4 = rng.rand(4) + 0.5, rng.randn(4) * 0.1
    cases.append(Case("layer_norm", U, lambda mb, c, x: mb.layer_norm(x=x, axes=[-1], gamma=c(g4), beta=c(be4), epsilon=c(1e-5)),
                      lambda c, x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + c(1e-5)) * c(g4) + c(be4)))
    g3 = rng.rand(3) + 0.5
    cases.append(Case("layer_norm_axis1", U, lambda mb, c, x: mb.layer_norm(x=x, axes=[1], gamma=c(g3), epsilon=c(1e-5)),
                      lambda c, x: (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + c(1e-5)) * c(g3)[None, :, None],
                      ops=("layer_norm",)))
    mean3, var3, gb3 = rng.randn(3) * 0.2, rng.rand(3) + 0.5, rng.randn(3) * 0.1
    cases.append(Case("batch_norm", U, lambda mb, c, x: mb.batch_norm(x=x, mean=c(mean3), variance=c(var3), gamma=c(g3), beta=c(gb3), epsilon=c(1e-3)),
                      lambda c, x: (x - c(mean3)[None, :, None]) / np.sqrt(c(var3)[None, :, None] + c(1e-3)) * c(g3)[None, :, None] + c(gb3)[None, :, None]))
    cases.append(Case("instance_norm", U, lambda mb, c, x: mb.instance_norm(x=x, gamma=c(g3), beta=c(gb3), epsilon=c(1e-5)),
                      lambda c, x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + c(1e-5)) * c(g3)[None, :, None] + c(gb3)[None, :, None]))
    cases.append(Case("l2_norm", U, lambda mb, c, x: mb.l2_norm(x=x, epsilon=c(1e-6)), lambda c, x: x / np.sqrt((x * x).sum() + c(1e-6))))

    # reductions
    def reduce(name, fn, domain=(-2.0, 2.0)):
        cases.append(Case(name, U, lambda mb, c, x: getattr(mb, name)(x=x, axes=[0, -1], keep_dims=True),
                          lambda c, x: fn(x, (0, 2)), domain=domain))

    reduce("reduce_sum", lambda x, a: x.sum(a, keepdims=True))
    reduce("reduce_mean", lambda x, a: x.mean(a, keepdims=True))
    reduce("reduce_max", lambda x, a: x.max(a, keepdims=True))
    reduce("reduce_min", lambda x, a: x.min(a, keepdims=True))
    reduce("reduce_prod", lambda x, a: x.prod(a, keepdims=True), domain=(0.5, 1.5))
    reduce("reduce_l1_norm", lambda x, a: np.abs(x).sum(a, keepdims=True))
    reduce("reduce_l2_norm", lambda x, a: np.sqrt((x * x).sum(a, keepdims=True)))
    reduce("reduce_log_sum", lambda x, a: np.log(x.sum(a, keepdims=True)), domain=(0.1, 2.0))
    reduce("reduce_log_sum_exp", lambda x, a: np.log(np.exp(x).sum(a, keepdims=True)))
    reduce("reduce_sum_square", lambda x, a: (x * x).sum(a, keepdims=True))
    cases.append(Case("reduce_sum_all", U, lambda mb, c, x: mb.reduce_sum(x=x), lambda c, x: x.sum(), ops=("reduce_sum",)))
    cases.append(Case("reduce_argmax", U, lambda mb, c, x: mb.reduce_argmax(x=x, axis=1), lambda c, x: x.argmax(1).astype(np.int32), exact=True))
    cases.append(Case("reduce_argmin", U, lambda mb, c, x: mb.reduce_argmin(x=x, axis=-1, keep_dims=True),
                      lambda c, x: x.argmin(-1)[..., None].astype(np.int32), exact=True))

    # shape manipulation (float data, exact copies)
    def shape_case(name, build, ref, shapes=U, ops=None):
        cases.append(Case(name, shapes, build, ref, ops=ops or (name,)))

    shape_case("reshape", lambda mb, c, x: mb.reshape(x=x, shape=[0, -1, 2]), lambda c, x: x.reshape(2, 6, 2))
    shape_case("expand_dims", lambda mb, c, x: mb.expand_dims(x=x, axes=[0, -1]), lambda c, x: x[None, ..., None])
    shape_case("squeeze", lambda mb, c, x: mb.squeeze(x=x, axes=[1]), lambda c, x: x[:, 0], shapes={"x": (2, 1, 4)})
    shape_case("squeeze_all", lambda mb, c, x: mb.squeeze(x=x), lambda c, x: x.reshape(2, 4), shapes={"x": (2, 1, 4, 1)}, ops=("squeeze",))
    shape_case("transpose", lambda mb, c, x: mb.transpose(x=x, perm=[2, 0, 1]), lambda c, x: x.transpose(2, 0, 1))
    shape_case("flatten2d", lambda mb, c, x: mb.flatten2d(x=x, axis=-1), lambda c, x: x.reshape(6, 4))
    shape_case("tile", lambda mb, c, x: mb.tile(x=x, reps=[1, 2, 3]), lambda c, x: np.tile(x, (1, 2, 3)))
    shape_case("concat", lambda mb, c, x, y: mb.concat(values=(x, y, x), axis=-1), lambda c, x, y: np.concatenate([x, y, x], -1),
               shapes={"x": (2, 3), "y": (2, 4)})
    shape_case("concat_interleave", lambda mb, c, x, y: mb.concat(values=(x, y), axis=1, interleave=True),
               lambda c, x, y: np.stack([x, y], 2).reshape(2, 6), shapes={"x": (2, 3), "y": (2, 3)}, ops=("concat",))
    shape_case("stack", lambda mb, c, x, y: mb.stack(values=(x, y), axis=1), lambda c, x, y: np.stack([x, y], 1), shapes={"x": (2, 3), "y": (2, 3)})
    shape_case("split_sizes", lambda mb, c, x: mb.split(x=x, split_sizes=[1, 3], axis=-1), lambda c, x: (x[..., :1], x[..., 1:]), ops=("split",))
    shape_case("split_num", lambda mb, c, x: mb.split(x=x, num_splits=3, axis=1), lambda c, x: (x[:, :1], x[:, 1:2], x[:, 2:]), ops=("split",))
    shape_case("reverse", lambda mb, c, x: mb.reverse(x=x, axes=[0, 2]), lambda c, x: x[::-1, :, ::-1])
    shape_case("sliding_windows", lambda mb, c, x: mb.sliding_windows(x=x, axis=1, size=3, stride=2),
               lambda c, x: np.stack([x[:, 0:3], x[:, 2:5]], 1), shapes={"x": (2, 6, 2)})
    shape_case("pixel_shuffle", lambda mb, c, x: mb.pixel_shuffle(x=x, upscale_factor=2),
               lambda c, x: x.reshape(1, 2, 2, 2, 3, 3).transpose(0, 1, 4, 2, 5, 3).reshape(1, 2, 6, 6), shapes={"x": (1, 8, 3, 3)})
    shape_case("slice_by_index", lambda mb, c, x: mb.slice_by_index(x=x, begin=[1, 0, 3], end=[2, 3, 0], stride=[1, 2, -1],
                                                                    begin_mask=[False, True, False], end_mask=[False, False, True],
                                                                    squeeze_mask=[True, False, False]),
               lambda c, x: x[1, 0:3:2, 3::-1])
    shape_case("slice_by_index_neg", lambda mb, c, x: mb.slice_by_index(x=x, begin=[0, -2, 1], end=[2, -1, 4], stride=[1, 1, 2]),
               lambda c, x: x[0:2, -2:-1, 1:4:2], ops=("slice_by_index",))
    shape_case("slice_by_size", lambda mb, c, x: mb.slice_by_size(x=x, begin=[1, 1, 0], size=[1, -1, 3]), lambda c, x: x[1:2, 1:, 0:3])

    def upd_ref(c, x, y):
        out = x.copy()
        out[:, 1:3, ::2] = y
        return out

    shape_case("slice_update", lambda mb, c, x, y: mb.slice_update(x=x, update=y, begin=[0, 1, 0], end=[2, 3, 4], stride=[1, 1, 2]),
               upd_ref, shapes={"x": (2, 3, 4), "y": (2, 2, 2)})

    def upd_sq_ref(c, x, y):
        out = x.copy()
        out[:, 2] = y
        return out

    shape_case("slice_update_squeeze", lambda mb, c, x, y: mb.slice_update(x=x, update=y, begin=[0, 2, 0], end=[0, 3, 0],
                                                                          begin_mask=[True, False, True], end_mask=[True, False, True],
                                                                          squeeze_mask=[False, True, False]),
               upd_sq_ref, shapes={"x": (2, 3, 4), "y": (2, 4)}, ops=("slice_update",))

    # gather / scatter (constant int32 indices)
    idx = np.array([[2, 0], [-1, 1]], dtype=np.int32)
    shape_case("gather", lambda mb, c, x: mb.gather(x=x, indices=idx, axis=1), lambda c, x: x[:, [[2, 0], [2, 1]]])
    idxb = np.array([[3, 0], [1, 1]], dtype=np.int32)
    shape_case("gather_batch_dims", lambda mb, c, x: mb.gather(x=x, indices=idxb, axis=1, batch_dims=1),
               lambda c, x: np.stack([x[0][:, [3, 0]].T if False else x[0, [3, 0]], x[1, [1, 1]]]), shapes={"x": (2, 4, 3)}, ops=("gather",))
    idxa = np.array([[[0, 1, 2, 0]], [[2, 2, 1, 0]]], dtype=np.int32)
    shape_case("gather_along_axis", lambda mb, c, x: mb.gather_along_axis(x=x, indices=idxa, axis=1),
               lambda c, x: np.take_along_axis(x, idxa.astype(np.int64), 1))
    idxn = np.array([[1, 2], [0, 0], [1, -1]], dtype=np.int32)
    shape_case("gather_nd", lambda mb, c, x: mb.gather_nd(x=x, indices=idxn), lambda c, x: x[[1, 0, 1], [2, 0, 2]])
    sidx = np.array([2, 0], dtype=np.int32)

    def scatter_ref(c, x, y, mode):
        out = x.copy()
        for i, j in enumerate(sidx):
            out[:, j] = y[:, i] if mode == "update" else out[:, j] + y[:, i]
        return out

    shape_case("scatter", lambda mb, c, x, y: mb.scatter(data=x, indices=sidx, updates=y, axis=1, mode="add"),
               lambda c, x, y: scatter_ref(c, x, y, "add"), shapes={"x": (2, 3, 4), "y": (2, 2, 4)})
    shape_case("scatter_update", lambda mb, c, x, y: mb.scatter(data=x, indices=sidx, updates=y, axis=1, mode="update"),
               lambda c, x, y: scatter_ref(c, x, y, "update"), shapes={"x": (2, 3, 4), "y": (2, 2, 4)}, ops=("scatter",))
    saidx = np.array([[[1, 0, 2, 1]], [[0, 0, 1, 2]]], dtype=np.int32)

    def scatter_axis_ref(c, x, y):
        out = x.copy()
        np.put_along_axis(out, saidx.astype(np.int64), y, 1)
        return out

    shape_case("scatter_along_axis", lambda mb, c, x, y: mb.scatter_along_axis(data=x, indices=saidx, updates=y, axis=1, mode="update"),
               scatter_axis_ref, shapes={"x": (2, 3, 4), "y": (2, 1, 4)})
    snd = np.array([[1, 2], [0, 1]], dtype=np.int32)

    def scatter_nd_ref(c, x, y):
        out = x.copy()
        out[1, 2] += y[0]
        out[0, 1] += y[1]
        return out

    shape_case("scatter_nd", lambda mb, c, x, y: mb.scatter_nd(data=x, indices=snd, updates=y, mode="add"), scatter_nd_ref,
               shapes={"x": (2, 3, 4), "y": (2, 4)})

    # creation / misc
    shape_case("select", lambda mb, c, x, y: mb.select(cond=mb.greater(x=x, y=c(0.0)), a=x, b=y),
               lambda c, x, y: np.where(x > 0, x, y), shapes=B)
    shape_case("fill", lambda mb, c, x: mb.add(x=x, y=mb.fill(shape=[2, 3, 4], value=c(1.5))), lambda c, x: x + 1.5, ops=("fill", "add"))
    shape_case("fill_like", lambda mb, c, x: mb.add(x=x, y=mb.fill_like(ref_tensor=x, value=c(0.25))), lambda c, x: x + 0.25, ops=("fill_like",))
    shape_case("shape", lambda mb, c, x: mb.mul(x=mb.shape(x=x), y=np.int32(2)), lambda c, x: np.array([4, 6, 8], dtype=np.int32),
               ops=("shape",))
    cases[-1].exact = True
    shape_case("range_1d_int", lambda mb, c, x: mb.range_1d(start=np.int32(1), end=mb.add(x=mb.cast(x=mb.mul(x=mb.reduce_max(x=x), y=c(0.0)), dtype="int32"), y=np.int32(9)),
                                                            step=np.int32(2)),
               lambda c, x: np.arange(1, 9, 2, dtype=np.int32), ops=("range_1d",))
    cases[-1].exact = True
    shape_case("range_1d_float", lambda mb, c, x: mb.add(x=x, y=mb.range_1d(start=c(0.5), end=c(2.5), step=c(0.5))),
               lambda c, x: x + np.arange(0.5, 2.5, 0.5), ops=("range_1d",))
    oh_idx = np.array([[0, 3], [2, 1]], dtype=np.int32)
    shape_case("one_hot", lambda mb, c, x: mb.add(x=x, y=mb.one_hot(indices=oh_idx, one_hot_vector_size=4, axis=1, on_value=c(2.0), off_value=c(-1.0))),
               lambda c, x: x + np.where(np.arange(4)[None, :, None] == oh_idx[:, None, :], 2.0, -1.0), shapes={"x": (2, 4, 2)})
    shape_case("band_part", lambda mb, c, x: mb.band_part(x=x, lower=1, upper=0),
               lambda c, x: np.where((np.arange(5)[:, None] - np.arange(5)[None, :] <= 1) & (np.arange(5)[None, :] - np.arange(5)[:, None] <= 0), x, 0),
               shapes={"x": (2, 5, 5)})
    shape_case("pad_constant", lambda mb, c, x: mb.pad(x=x, pad=[1, 0, 2, 1], mode="constant", constant_val=c(0.5)),
               lambda c, x: np.pad(x, [(0, 0), (1, 0), (2, 1)], constant_values=0.5), ops=("pad",))
    shape_case("pad_reflect", lambda mb, c, x: mb.pad(x=x, pad=[2, 1], mode="reflect", constant_val=c(0.0)),
               lambda c, x: np.pad(x, [(0, 0), (0, 0), (2, 1)], mode="reflect"), ops=("pad",))
    shape_case("pad_replicate", lambda mb, c, x: mb.pad(x=x, pad=[1, 2, 0, 3], mode="replicate", constant_val=c(0.0)),
               lambda c, x: np.pad(x, [(0, 0), (1, 2), (0, 3)], mode="edge"), ops=("pad",))
    shape_case("cumsum", lambda mb, c, x: mb.cumsum(x=x, axis=2, exclusive=True, reverse=True),
               lambda c, x: np.flip(np.cumsum(np.flip(x, 2), 2), 2) - x)
    shape_case("topk", lambda mb, c, x: mb.topk(x=x, k=2, axis=-1),
               lambda c, x: (-np.sort(-x, -1)[..., :2], np.argsort(-x, -1, kind="stable")[..., :2].astype(np.int32)))
    shape_case("argsort", lambda mb, c, x: mb.argsort(x=x, axis=1, ascending=True), lambda c, x: np.argsort(x, 1, kind="stable").astype(np.int32))

    shape_case("pixel_unshuffle", lambda mb, c, x: mb.pixel_unshuffle(x=x, downscale_factor=np.uint32(2)),
               lambda c, x: x.reshape(1, 2, 3, 2, 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(1, 8, 3, 2), shapes={"x": (1, 2, 6, 4)})
    shape_case("reshape_like", lambda mb, c, x, y: mb.reshape_like(x=x, ref_tensors=(y, x), begins=(0, 1), ends=(2, 2), end_masks=(False, True)),
               lambda c, x, y: x.reshape(2, 3, 4), shapes={"x": (6, 4), "y": (2, 3)})
    qscale, qzp = np.float32(0.05), np.int8(3)

    def quant_ref(c, x):
        s = c(qscale)
        q = np.clip(np.round(x / s) + 3, -128, 127)
        return (q - 3) * s

    shape_case("quantize_dequantize", lambda mb, c, x: mb.dequantize(input=mb.quantize(input=x, scale=c(qscale), zero_point=qzp, output_dtype="int8"),
                                                                     scale=c(qscale), zero_point=qzp),
               quant_ref, ops=("quantize", "dequantize"))
    cases[-1].domain = (-8.0, 8.0)

    def sdpa_ref(c, x, y, z):
        q, k, v = x, y, z
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        return softmax_ref(s, -1) @ v

    shape_case("scaled_dot_product_attention", lambda mb, c, x, y, z: mb.scaled_dot_product_attention(query=x, key=y, value=z),
               sdpa_ref, shapes={"x": (1, 2, 3, 4), "y": (1, 2, 5, 4), "z": (1, 2, 5, 4)})

    # rank-0 values (MIL scalars): scalar consts, reductions to a scalar, slices squeezed to a scalar.
    # reduce_max / reduce_min give exact fp16 scalars; every output's shape is also checked against
    # coremltools' type inference (see _check_shape).
    def width(mb, x):  # rank-0 int32 from a slice squeezed to a scalar (x.shape[2] = 4)
        return mb.slice_by_index(x=mb.shape(x=x), begin=[2], end=[3], squeeze_mask=[True])

    cases.append(Case("scalar_binary", U,
                      lambda mb, c, x: (mb.add(x=mb.reduce_max(x=x), y=c(1.5)), mb.mul(x=c(-2.0), y=mb.reduce_min(x=x)),
                                        mb.real_div(x=mb.reduce_max(x=x), y=c(3.0)), mb.maximum(x=mb.reduce_min(x=x), y=c(-0.5))),
                      lambda c, x: (x.max() + c(1.5), c(-2.0) * x.min(), x.max() / c(3.0), np.maximum(x.min(), c(-0.5))),
                      ops=("add", "mul", "real_div", "maximum")))
    cases.append(Case("scalar_unary_cast", U,
                      lambda mb, c, x: (mb.exp(x=mb.sub(x=mb.reduce_max(x=x), y=c(1.0))), mb.cast(x=mb.mul(x=mb.reduce_min(x=x), y=c(2.0)), dtype="int32"),
                                        mb.sqrt(x=c(2.25))),
                      lambda c, x: (np.exp(x.max() - c(1.0)), np.trunc(x.min() * 2).astype(np.int32), np.sqrt(c(2.25))),
                      ops=("exp", "cast", "sqrt", "sub")))
    cases.append(Case("gather_scalar_index", U,
                      lambda mb, c, x: (mb.gather(x=x, indices=np.int32(-1), axis=1),
                                        mb.gather(x=mb.reduce_max(x=x, axes=[0, 1]), indices=np.int32(2), axis=0)),
                      lambda c, x: (x[:, -1], x.max((0, 1))[2]), ops=("gather",)))
    cases.append(Case("concat_scalars", U,
                      lambda mb, c, x: (mb.concat(values=(mb.reduce_max(x=x), c(0.5), mb.reduce_min(x=x)), axis=0),
                                        mb.concat(values=(mb.reduce_min(x=x), mb.reduce_max(x=x)), axis=-1, interleave=True)),
                      lambda c, x: (np.array([x.max(), c(0.5), x.min()]), np.array([x.min(), x.max()])), ops=("concat",)))

    def dynamic_slice(mb, c, x):  # x[:, p:p + 1, 1:w] with rank-0 int32 arithmetic (w = 4, p = w - 3)
        w = width(mb, x)
        p = mb.sub(x=w, y=np.int32(3))
        begin = mb.concat(values=(np.int32(0), p, np.int32(1)), axis=0)
        end = mb.concat(values=(np.int32(2), mb.add(x=p, y=np.int32(1)), w), axis=0)
        return mb.slice_by_index(x=x, begin=begin, end=end)

    cases.append(Case("slice_scalar_bounds", U, dynamic_slice, lambda c, x: x[:, 1:2, 1:4], ops=("slice_by_index", "concat", "shape")))
    cases.append(Case("select_scalar", U,
                      lambda mb, c, x: tuple(mb.select(cond=mb.greater(x=mb.reduce_max(x=x), y=c(t)), a=mb.reduce_min(x=x), b=c(-3.0))
                                             for t in (1.0, 5.0)),
                      lambda c, x: tuple(np.where(x.max() > c(t), x.min(), c(-3.0)) for t in (1.0, 5.0)), ops=("select", "greater")))

    def scalar_shapes(mb, c, x):
        s = mb.add(x=mb.reduce_max(x=x), y=c(0.5))
        corner = mb.slice_by_size(x=x, begin=[0, 0, 0], size=[1, 1, 1])
        return (mb.expand_dims(x=s, axes=[0, -1]),  # (1, 1)
                mb.mul(x=mb.reshape(x=corner, shape=np.zeros(0, dtype=np.int32)), y=c(2.0)),  # ()
                mb.reshape(x=s, shape=[1, 1, 1]),
                mb.mul(x=mb.squeeze(x=corner), y=c(-1.0)),  # ()
                mb.concat(values=(mb.shape(x=s), mb.shape(x=x)), axis=0),  # shape of a scalar: an empty vector
                mb.fill(shape=mb.shape(x=s), value=c(1.5)),  # ()
                mb.one_hot(indices=mb.sub(x=width(mb, x), y=np.int32(2)), one_hot_vector_size=4, on_value=c(1.0), off_value=c(0.0)))

    cases.append(Case("scalar_shape_ops", U, scalar_shapes,
                      lambda c, x: (np.full((1, 1), x.max() + c(0.5)), x[0, 0, 0] * 2.0, np.full((1, 1, 1), x.max() + c(0.5)),
                                    -x[0, 0, 0], np.array([2, 3, 4], dtype=np.int32), np.float64(c(1.5)), np.eye(4)[2]),
                      ops=("expand_dims", "reshape", "squeeze", "shape", "fill", "one_hot")))

    def scatter_scalar_ref(c, x, y):
        out = x.copy()
        out[:, 1] = y
        return out

    shape_case("scatter_scalar_index", lambda mb, c, x, y: mb.scatter(data=x, indices=np.int32(1), updates=y, axis=1, mode="update"),
               scatter_scalar_ref, shapes={"x": (2, 3, 4), "y": (2, 4)}, ops=("scatter",))
    return cases


def _build_program(cases, float_dtype):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    mil_dtype = types.fp32 if float_dtype == np.float32 else types.fp16

    def c(v):
        return np.asarray(v, dtype=np.float64).astype(float_dtype)

    from coremltools.converters.mil.mil import Function, Program

    names, placeholders = [], {}
    for i, case in enumerate(cases):
        for k, shape in case.shapes.items():
            name = f"c{i}_{k}"
            names.append(name)
            placeholders[name] = mb.placeholder(shape=shape, dtype=mil_dtype)

    with Function(placeholders, opset_version=ct.target.iOS18) as func:
        outs = []
        for i, case in enumerate(cases):
            res = case.build(mb, c, **{k: func.inputs[f"c{i}_{k}"] for k in case.shapes})
            res = res if isinstance(res, (tuple, list)) else (res,)
            outs.extend(res)
        func.set_outputs(outs)
    prog = Program()
    prog.add_function("main", func)
    inferred = [tuple(v.shape) for v in func.outputs]  # coremltools' type inference, () for a scalar
    return prog, names, c, inferred


def _run_zoo(tmp_path, float_dtype):
    import coremltools as ct

    cases = [c for c in _cases() if float_dtype == np.float32 or c.fp16]
    prog, names, c, inferred = _build_program(cases, float_dtype)
    ml = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                    pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
    path = tmp_path / f"zoo_{np.dtype(float_dtype).name}.mlpackage"
    ml.save(str(path))
    model = load_model(path, backend="mil")
    rng = np.random.RandomState(0)
    feeds, arrays = {}, {}
    input_names = list(model.input_description)
    assert len(input_names) == len(names)
    k = 0
    for i, case in enumerate(cases):
        arrays[i] = {}
        for key, shape in case.shapes.items():
            lo, hi = case.extra.get("ydomain", case.domain) if key == "y" else case.domain
            arr = rng.uniform(lo, hi, size=shape).astype(float_dtype)
            feeds[input_names[k]] = arr
            arrays[i][key] = arr.astype(np.float64)
            k += 1
    out = model.predict(feeds)
    out_list = list(out.values())
    results, j = {}, 0
    for i, case in enumerate(cases):
        ref = case.ref(lambda v: c(v).astype(np.float64), **arrays[i])
        ref = ref if isinstance(ref, tuple) else (ref,)
        got = out_list[j : j + len(ref)]
        results[case.name] = (case, [np.asarray(r) for r in ref], got, inferred[j : j + len(ref)])
        j += len(ref)
    assert j == len(out_list)
    used = {s.op_type for s in model._steps}
    return results, used


@pytest.fixture(scope="module")
def zoo32(tmp_path_factory):
    return _run_zoo(tmp_path_factory.mktemp("zoo32"), np.float32)


@pytest.fixture(scope="module")
def zoo16(tmp_path_factory):
    return _run_zoo(tmp_path_factory.mktemp("zoo16"), np.float16)


CASE_NAMES = [c.name for c in _cases()]


def _check_shape(name, got, ref, inferred):
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    if all(isinstance(d, (int, np.integer)) for d in inferred):  # symbolic dims: not known before running
        assert got.shape == inferred, (name, got.shape, inferred)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_op_fp32(zoo32, name):
    results, _ = zoo32
    case, refs, gots, inferred = results[name]
    for ref, got, shape in zip(refs, gots, inferred):
        _check_shape(name, got, ref, shape)
        if case.exact or got.dtype.kind in "iu":
            np.testing.assert_array_equal(got, ref)
        else:
            err = max_rel_err(got, ref)
            print(f"fp32 {name}: max rel err {err:.2e}")
            assert err <= 1e-4, (name, err)


@pytest.mark.parametrize("name", [c.name for c in _cases() if c.fp16])
def test_op_fp16(zoo16, name):
    results, _ = zoo16
    case, refs, gots, inferred = results[name]
    for ref, got, shape in zip(refs, gots, inferred):
        _check_shape(name, got, ref, shape)
        if case.exact or got.dtype.kind in "iu":
            np.testing.assert_array_equal(got, ref)
            continue
        assert got.dtype == np.float16
        err = max_rel_err(got, ref)
        print(f"fp16 {name}: max rel err {err:.2e}, PSNR {psnr(ref, got):.1f} dB")
        assert err <= 2**-10, (name, err)


def test_zoo_covers_every_supported_op(zoo32):
    _, used = zoo32
    not_state_or_const = {
        t for t in supported_op_types()
        if not t.startswith("constexpr_")
        and t not in ("const", "read_state", "coreml_update_state", "write_state")  # states: test_stateful.py
    }
    missing = not_state_or_const - used
    assert not missing, f"ops without an op-zoo case: {sorted(missing)}"
