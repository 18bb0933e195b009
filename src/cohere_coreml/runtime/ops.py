"""MIL op implementations for the interpreter (torch kernels, CPU).

Every function takes an :class:`~cohere_coreml.runtime.interpreter.Args` (inputs by the names
of the MIL op definition: ``a.t(name)`` tensor, ``a.ts(name)`` tuple of tensors, ``a.v(name)``
Python value) and returns a tensor or a tuple of tensors, one per op output. The interpreter
casts each result to the declared output dtype (fp16 results are rounded to fp16 there), so
implementations compute in float32 / int32 and need not round themselves.

Semantics follow ``coremltools/converters/mil/mil/ops/defs/iOS15`` .. ``iOS18``. To add an op:
write ``def _my_op(a): ...`` and decorate it with ``@op("my_op")``; add an op-zoo case to
``tests/runtime/test_ops.py``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .dtypes import coerce
from .errors import RuntimeBackendError

OPS: dict = {}


def op(*names):
    def register(fn):
        for name in names:
            OPS[name] = fn
        return fn

    return register


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _axes(axes, rank: int):
    if axes is None:
        return list(range(rank))
    if isinstance(axes, int):
        axes = [axes]
    return [_axis(int(x), rank) for x in axes]


def _f(t: torch.Tensor) -> torch.Tensor:
    """Float32 view of a tensor for float arithmetic."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


# ---------------------------------------------------------------- elementwise binary
def _binary(fn):
    return lambda a: fn(a.t("x"), a.t("y"))


op("add")(_binary(torch.add))
op("sub")(_binary(torch.sub))
op("mul")(_binary(torch.mul))
op("maximum")(_binary(torch.maximum))
op("minimum")(_binary(torch.minimum))
op("equal")(_binary(torch.eq))
op("not_equal")(_binary(torch.ne))
op("less")(_binary(torch.lt))
op("less_equal")(_binary(torch.le))
op("greater")(_binary(torch.gt))
op("greater_equal")(_binary(torch.ge))
op("logical_and")(_binary(lambda x, y: torch.logical_and(x.bool(), y.bool())))
op("logical_or")(_binary(lambda x, y: torch.logical_or(x.bool(), y.bool())))
op("logical_xor")(_binary(lambda x, y: torch.logical_xor(x.bool(), y.bool())))


@op("real_div")
def _real_div(a):
    x, y = a.t("x"), a.t("y")
    if x.is_floating_point() or y.is_floating_point():
        return torch.div(x, y)
    return torch.div(x, y, rounding_mode="trunc")


@op("floor_div")
def _floor_div(a):
    x, y = a.t("x"), a.t("y")
    if x.is_floating_point() or y.is_floating_point():
        return torch.floor(torch.div(_f(x), _f(y)))
    return torch.div(x, y, rounding_mode="floor")


@op("mod")
def _mod(a):
    return torch.remainder(a.t("x"), a.t("y"))


@op("pow")
def _pow(a):
    return torch.pow(a.t("x"), a.t("y"))


# ---------------------------------------------------------------- elementwise unary
def _unary(fn):
    return lambda a: fn(a.t("x"))


for _name, _fn in {
    "abs": torch.abs,
    "acos": torch.acos,
    "asin": torch.asin,
    "atan": torch.atan,
    "atanh": torch.atanh,
    "ceil": torch.ceil,
    "cos": torch.cos,
    "cosh": torch.cosh,
    "erf": torch.erf,
    "exp": torch.exp,
    "exp2": lambda x: torch.exp2(_f(x)),
    "floor": torch.floor,
    "round": torch.round,  # half to even, like numpy
    "sign": torch.sign,
    "sin": torch.sin,
    "sinh": torch.sinh,
    "sqrt": torch.sqrt,
    "square": torch.square,
    "tan": torch.tan,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "softsign": F.softsign,
    "logical_not": lambda x: torch.logical_not(x.bool()),
    "identity": lambda x: x,
}.items():
    op(_name)(_unary(_fn))


@op("inverse")
def _inverse(a):
    return 1.0 / (a.t("x") + a.v("epsilon", 1e-4))


@op("log")
def _log(a):
    return torch.log(a.t("x") + a.v("epsilon", 1e-45))


@op("rsqrt")
def _rsqrt(a):
    return torch.rsqrt(a.t("x") + a.v("epsilon", 1e-12))


@op("threshold")
def _threshold(a):
    return torch.clamp(a.t("x"), min=a.v("alpha"))


@op("clip")
def _clip(a):
    return torch.clamp(a.t("x"), min=a.v("alpha"), max=a.v("beta"))


@op("cast")
def _cast(a):
    # The interpreter converts the result to the declared output dtype (fp16 rounding, float ->
    # int truncation toward zero like numpy's astype, nonzero -> True for bool).
    x = a.t("x")
    if a.v("dtype") == "bool":
        return x != 0
    return x


# ---------------------------------------------------------------- activations
@op("gelu")
def _gelu(a):
    x, mode = a.t("x"), a.v("mode", "EXACT")
    if mode == "EXACT":
        return F.gelu(x)
    if mode == "TANH_APPROXIMATION":
        return F.gelu(x, approximate="tanh")
    if mode == "SIGMOID_APPROXIMATION":
        return x * torch.sigmoid(1.702 * x)
    raise RuntimeBackendError(f"gelu: unknown mode {mode!r}")


@op("leaky_relu")
def _leaky_relu(a):
    x = a.t("x")
    return torch.where(x >= 0, x, x * a.v("alpha", 0.01))


@op("elu")
def _elu(a):
    x = a.t("x")
    return torch.where(x > 0, x, a.v("alpha", 1.0) * torch.expm1(x))


@op("thresholded_relu")
def _thresholded_relu(a):
    x = a.t("x")
    return torch.where(x >= a.v("alpha", 1.0), x, torch.zeros_like(x))


@op("linear_activation")
def _linear_activation(a):
    return a.v("alpha") * a.t("x") + a.v("beta", 0.0)


@op("scaled_tanh")
def _scaled_tanh(a):
    return a.v("alpha", 1.0) * torch.tanh(a.v("beta", 1.0) * a.t("x"))


@op("sigmoid_hard")
def _sigmoid_hard(a):
    return torch.clamp(a.v("alpha", 0.2) * a.t("x") + a.v("beta", 0.5), 0.0, 1.0)


@op("clamped_relu")
def _clamped_relu(a):
    x, alpha, beta = a.t("x"), a.v("alpha"), a.v("beta")
    return torch.clamp(torch.clamp(x, min=0), max=beta) + torch.clamp(
        torch.clamp(x, max=0) * alpha, max=beta
    )


def _channel(param: torch.Tensor, rank: int) -> torch.Tensor:
    """Per-channel (axis 1) parameter broadcast to rank ``rank``."""
    return param.reshape([1, -1] + [1] * (rank - 2))


@op("prelu")
def _prelu(a):
    x = a.t("x")
    alpha = _channel(_f(a.t("alpha")), x.dim())
    return torch.where(x > 0, x, x * alpha)


@op("softplus_parametric")
def _softplus_parametric(a):
    x = a.t("x")
    alpha = _channel(_f(a.t("alpha")), x.dim())
    beta = _channel(_f(a.t("beta")), x.dim())
    return alpha * F.softplus(beta * x)


@op("softmax")
def _softmax(a):
    return torch.softmax(a.t("x"), dim=a.v("axis", -1))


# ---------------------------------------------------------------- linear algebra
@op("linear")
def _linear(a):
    return F.linear(a.t("x"), a.t("weight"), a.t("bias"))


@op("matmul")
def _matmul(a):
    x, y = a.t("x"), a.t("y")
    if a.v("transpose_x", False) and x.dim() >= 2:
        x = x.transpose(-1, -2)
    if a.v("transpose_y", False) and y.dim() >= 2:
        y = y.transpose(-1, -2)
    if not x.is_floating_point():
        return torch.matmul(x.to(torch.int64), y.to(torch.int64))
    return torch.matmul(x, y)


@op("einsum")
def _einsum(a):
    return torch.einsum(a.v("equation"), *a.ts("values"))


# ---------------------------------------------------------------- convolution / pooling
def _spatial_pads(pad_type, pad, in_sizes, kernel, strides, dilations):
    """[(before, after)] per spatial dim, following MIL conv/pool ``pad_type`` semantics."""
    n = len(in_sizes)
    if pad_type == "valid":
        return [(0, 0)] * n
    if pad_type == "custom":
        pad = list(pad) if pad is not None else [0] * (2 * n)
        return [(int(pad[2 * i]), int(pad[2 * i + 1])) for i in range(n)]
    if pad_type in ("same", "same_lower"):
        pads = []
        for d, k, s, dil in zip(in_sizes, kernel, strides, dilations):
            out = math.ceil(d / s)
            total = max((out - 1) * s + (k - 1) * dil + 1 - d, 0)
            small, big = total // 2, total - total // 2
            pads.append((small, big) if pad_type == "same" else (big, small))
        return pads
    raise RuntimeBackendError(f"unknown pad_type {pad_type!r}")


def _pad_spatial(x, pads, value=0.0):
    flat = []
    for before, after in reversed(pads):
        flat += [before, after]
    if any(flat):
        x = F.pad(x, flat, value=value)
    return x


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@op("conv")
def _conv(a):
    x, w = a.t("x"), a.t("weight")
    n = x.dim() - 2
    strides = a.v("strides", None) or [1] * n
    dilations = a.v("dilations", None) or [1] * n
    pads = _spatial_pads(
        a.v("pad_type", "valid"), a.v("pad", None), x.shape[2:], w.shape[2:], strides, dilations
    )
    symmetric = all(b == e for b, e in pads)
    if not symmetric:
        x = _pad_spatial(x, pads)
    padding = [b for b, _ in pads] if symmetric else 0
    return _CONV[n](x, w, a.t("bias"), stride=strides, padding=padding, dilation=dilations, groups=a.v("groups", 1))


@op("conv_transpose")
def _conv_transpose(a):
    x, w = a.t("x"), a.t("weight")  # weight [C_in, C_out / groups, *K]
    n = x.dim() - 2
    strides = a.v("strides", None) or [1] * n
    dilations = a.v("dilations", None) or [1] * n
    pad_type = a.v("pad_type", "valid")
    kernel = w.shape[2:]
    full = _CONV_T[n](x, w, a.t("bias"), stride=strides, padding=0, dilation=dilations, groups=a.v("groups", 1))
    if pad_type == "custom":
        pad = a.v("pad", None) or [0] * (2 * n)
        pads = [(int(pad[2 * i]), int(pad[2 * i + 1])) for i in range(n)]
    elif pad_type == "valid":
        pads = [(0, 0)] * n
    else:  # same: output size = input * stride
        pads = []
        for i in range(n):
            total = full.shape[2 + i] - x.shape[2 + i] * strides[i]
            small, big = total // 2, total - total // 2
            pads.append((small, big) if pad_type == "same" else (big, small))
    output_shape = a.v("output_shape", None)
    idx = [slice(None), slice(None)]
    for i, (b, e) in enumerate(pads):
        stop = full.shape[2 + i] - e
        if output_shape is not None:
            stop = b + int(output_shape[2 + i])
        idx.append(slice(b, stop))
    del kernel
    return full[tuple(idx)]


def _pool(a, kind):
    x = a.t("x")
    n = len(a.v("kernel_sizes"))
    kernel = a.v("kernel_sizes")
    strides = a.v("strides", None) or [1] * n
    pads = _spatial_pads(a.v("pad_type", "valid"), a.v("pad", None), x.shape[2:], kernel, strides, [1] * n)
    ceil_mode = bool(a.v("ceil_mode", False))
    squeeze = False
    if x.dim() == n + 1:  # unbatched
        x, squeeze = x.unsqueeze(0), True
    if kind == "max":
        xp = _pad_spatial(x, pads, value=-math.inf)
        out = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n](xp, kernel, strides, ceil_mode=ceil_mode)
    elif kind == "avg":
        fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
        xp = _pad_spatial(x, pads)
        out = fn(xp, kernel, strides, ceil_mode=ceil_mode, count_include_pad=True)
        if a.v("exclude_padding_from_average", False):
            ones = _pad_spatial(torch.ones_like(x[:1, :1]), pads)
            out = out / fn(ones, kernel, strides, ceil_mode=ceil_mode, count_include_pad=True)
    else:  # l2
        fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
        xp = _pad_spatial(x * x, pads)
        out = torch.sqrt(fn(xp, kernel, strides, ceil_mode=ceil_mode) * float(np.prod(kernel)))
    return out[0] if squeeze else out


op("max_pool")(lambda a: _pool(a, "max"))
op("avg_pool")(lambda a: _pool(a, "avg"))
op("l2_pool")(lambda a: _pool(a, "l2"))


# ---------------------------------------------------------------- normalization
@op("layer_norm")
def _layer_norm(a):
    x = a.t("x")
    rank = x.dim()
    axes = sorted(_axes(a.v("axes", None), rank))
    gamma, beta, eps = a.t("gamma"), a.t("beta"), a.v("epsilon", 1e-5)
    if axes == list(range(rank - len(axes), rank)):
        return F.layer_norm(x, x.shape[rank - len(axes):], gamma, beta, eps)
    mean = x.mean(dim=axes, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    shape = [x.shape[i] if i in axes else 1 for i in range(rank)]
    if gamma is not None:
        y = y * gamma.reshape(shape)
    if beta is not None:
        y = y + beta.reshape(shape)
    return y


@op("batch_norm")
def _batch_norm(a):
    x = a.t("x")
    return F.batch_norm(
        x, a.t("mean"), a.t("variance"), a.t("gamma"), a.t("beta"), training=False, eps=a.v("epsilon", 1e-5)
    )


@op("instance_norm")
def _instance_norm(a):
    return F.instance_norm(a.t("x"), weight=a.t("gamma"), bias=a.t("beta"), eps=a.v("epsilon", 1e-5))


@op("l2_norm")
def _l2_norm(a):
    x = a.t("x")
    dims = list(range(max(x.dim() - 3, 0), x.dim()))
    norm = torch.sqrt(torch.sum(x * x, dim=dims, keepdim=True) + a.v("epsilon", 1e-6))
    return x / norm


# ---------------------------------------------------------------- reductions
def _reduce(fn):
    def impl(a):
        x = a.t("x")
        axes = _axes(a.v("axes", None), x.dim())
        keep = bool(a.v("keep_dims", False))
        if not axes:
            return x
        return fn(x, axes, keep)

    return impl


def _prod(x, axes, keep):
    for ax in sorted(axes, reverse=True):
        x = torch.prod(x, dim=ax, keepdim=keep)
    return x


op("reduce_sum")(_reduce(lambda x, d, k: torch.sum(x, dim=d, keepdim=k)))
op("reduce_mean")(_reduce(lambda x, d, k: torch.mean(_f(x), dim=d, keepdim=k)))
op("reduce_max")(_reduce(lambda x, d, k: torch.amax(x, dim=d, keepdim=k)))
op("reduce_min")(_reduce(lambda x, d, k: torch.amin(x, dim=d, keepdim=k)))
op("reduce_prod")(_reduce(_prod))
op("reduce_l1_norm")(_reduce(lambda x, d, k: torch.sum(torch.abs(x), dim=d, keepdim=k)))
op("reduce_l2_norm")(_reduce(lambda x, d, k: torch.sqrt(torch.sum(x * x, dim=d, keepdim=k))))
op("reduce_log_sum")(_reduce(lambda x, d, k: torch.log(torch.sum(x, dim=d, keepdim=k))))
op("reduce_log_sum_exp")(_reduce(lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k)))
op("reduce_sum_square")(_reduce(lambda x, d, k: torch.sum(x * x, dim=d, keepdim=k)))


def _reduce_arg(fn):
    def impl(a):
        x = a.t("x")
        return fn(x, dim=_axis(a.v("axis", -1), x.dim()), keepdim=bool(a.v("keep_dims", False)))

    return impl


op("reduce_argmax")(_reduce_arg(torch.argmax))
op("reduce_argmin")(_reduce_arg(torch.argmin))


# ---------------------------------------------------------------- shape manipulation
@op("reshape")
def _reshape(a):
    x = a.t("x")
    shape = [int(s) for s in a.v("shape")]
    # A 0 copies the input dimension aligned from the right (iOS17 rule; identical to the
    # iOS15 rule when len(shape) == rank); out of range -> 1.
    rank = x.dim()
    for i, s in enumerate(shape):
        if s == 0:
            j = rank - (len(shape) - i)
            shape[i] = x.shape[j] if 0 <= j < rank else 1
    return x.reshape(shape)


@op("reshape_like")
def _reshape_like(a):
    x = a.t("x")
    refs = a.ts("ref_tensors")
    begins, ends, end_masks = a.v("begins"), a.v("ends"), a.v("end_masks")
    shape = []
    for ref, b, e, m in zip(refs, begins, ends, end_masks):
        shape += list(ref.shape[b:] if m else ref.shape[b:e])
    return x.reshape(shape)


@op("expand_dims")
def _expand_dims(a):
    x = a.t("x")
    axes = a.v("axes")
    out_rank = x.dim() + len(axes)
    for ax in sorted(_axis(int(v), out_rank) for v in axes):
        x = x.unsqueeze(ax)
    return x


@op("squeeze")
def _squeeze(a):
    x = a.t("x")
    axes = a.v("axes", None)
    if axes is None:
        return x.reshape([d for d in x.shape if d != 1])
    axes = set(_axes(axes, x.dim()))
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


@op("transpose")
def _transpose(a):
    return a.t("x").permute([int(p) for p in a.v("perm")])


@op("flatten2d")
def _flatten2d(a):
    x = a.t("x")
    axis = _axis(a.v("axis", 1), x.dim())
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


@op("tile")
def _tile(a):
    return a.t("x").repeat([int(r) for r in a.v("reps")])


@op("concat")
def _concat(a):
    values = a.ts("values")
    if values[0].dim() == 0:  # rank-0 values concatenate to a vector (coremltools: np.stack)
        return torch.stack(values)
    axis = _axis(a.v("axis"), values[0].dim())
    if a.v("interleave", False):
        stacked = torch.stack(values, dim=axis + 1)
        shape = list(values[0].shape)
        shape[axis] *= len(values)
        return stacked.reshape(shape)
    return torch.cat(values, dim=axis)


@op("stack")
def _stack(a):
    values = a.ts("values")
    return torch.stack(values, dim=_axis(a.v("axis"), values[0].dim() + 1))


@op("split")
def _split(a):
    x = a.t("x")
    axis = _axis(a.v("axis"), x.dim())
    sizes = a.v("split_sizes", None)
    if sizes is None:
        n = int(a.v("num_splits"))
        sizes = [x.shape[axis] // n] * n
    return tuple(torch.split(x, [int(s) for s in sizes], dim=axis))


@op("shape")
def _shape(a):
    return torch.tensor(list(a.t("x").shape), dtype=torch.int32)


@op("reverse")
def _reverse(a):
    x = a.t("x")
    return torch.flip(x, _axes(a.v("axes", None), x.dim()))


@op("sliding_windows")
def _sliding_windows(a):
    x = a.t("x")
    axis = _axis(a.v("axis"), x.dim())
    out = x.unfold(axis, int(a.v("size")), int(a.v("stride", 1)))
    return out.movedim(-1, axis + 1)


@op("pixel_shuffle")
def _pixel_shuffle(a):
    return F.pixel_shuffle(a.t("x"), int(a.v("upscale_factor")))


@op("pixel_unshuffle")
def _pixel_unshuffle(a):
    return F.pixel_unshuffle(a.t("x"), int(a.v("downscale_factor")))


# ---------------------------------------------------------------- slicing
def _slices(shape, begin, end, stride, begin_mask, end_mask, squeeze_mask):
    """Python slices (numpy semantics) of slice_by_index / slice_update, and squeezed axes."""
    rank = len(shape)
    stride = stride if stride is not None else [1] * rank
    begin_mask = begin_mask if begin_mask is not None else [False] * rank
    end_mask = end_mask if end_mask is not None else [False] * rank
    squeeze_mask = squeeze_mask if squeeze_mask is not None else [False] * rank
    slices, squeezed = [], []
    for i in range(rank):
        b = None if begin_mask[i] else int(begin[i])
        e = None if end_mask[i] else int(end[i])
        s = int(stride[i])
        if squeeze_mask[i]:
            b = int(begin[i])
            b = b + shape[i] if b < 0 else b
            slices.append(slice(b, b + 1, 1))
            squeezed.append(i)
        else:
            slices.append(slice(b, e, s))
    return slices, squeezed


def _slice_args(a, x):
    return _slices(
        list(x.shape),
        a.v("begin"),
        a.v("end"),
        a.v("stride", None),
        a.v("begin_mask", None),
        a.v("end_mask", None),
        a.v("squeeze_mask", None),
    )


def _range_index(s: slice, n: int) -> torch.Tensor:
    return torch.tensor(range(*s.indices(n)), dtype=torch.int64)


@op("slice_by_index")
def _slice_by_index(a):
    x = a.t("x")
    slices, squeezed = _slice_args(a, x)
    if all(s.step > 0 for s in slices):
        out = x[tuple(slices)]  # a view, numpy semantics for positive strides
    else:
        out = _neg_slice(x, slices)
    if squeezed:
        out = out.reshape([d for i, d in enumerate(out.shape) if i not in set(squeezed)])
    return out


def _neg_slice(x, slices):
    """x[slices] with numpy semantics when some strides are negative (torch has no such views)."""
    for dim, s in enumerate(slices):
        x = x.index_select(dim, _range_index(s, x.shape[dim]))
    return x


@op("slice_by_size")
def _slice_by_size(a):
    x = a.t("x")
    begin, size = a.v("begin"), a.v("size")
    idx = []
    for d, (b, s) in enumerate(zip(begin, size)):
        b = int(b) + x.shape[d] if int(b) < 0 else int(b)
        idx.append(slice(b, x.shape[d] if int(s) == -1 else b + int(s)))
    return x[tuple(idx)]


@op("slice_update")
def _slice_update(a):
    x, update = a.t("x"), a.t("update")
    slices, _ = _slice_args(a, x)
    out = x.clone()
    if all(s.step > 0 for s in slices):
        view = out[tuple(slices)]
        view.copy_(update.reshape(view.shape).to(out.dtype))
    else:
        index = torch.meshgrid(*[_range_index(s, n) for s, n in zip(slices, x.shape)], indexing="ij")
        out[index] = update.reshape(index[0].shape).to(out.dtype)
    return out


# ---------------------------------------------------------------- gather / scatter
def _norm_index(idx: torch.Tensor, size: int) -> torch.Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


def _gather0(x, idx, axis):
    size = x.shape[axis]
    flat = _norm_index(idx, size).reshape(-1)
    out = x.index_select(axis, flat)
    return out.reshape(list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:]))


@op("gather")
def _gather(a):
    x, idx = a.t("x"), a.t("indices")
    axis = _axis(a.v("axis", 0), x.dim())
    batch_dims = int(a.v("batch_dims", 0))
    if batch_dims == 0:
        return _gather0(x, idx, axis)
    bshape = list(x.shape[:batch_dims])
    xb = x.reshape([-1] + list(x.shape[batch_dims:]))
    ib = idx.reshape([-1] + list(idx.shape[batch_dims:]))
    outs = [_gather0(xb[i], ib[i], axis - batch_dims) for i in range(xb.shape[0])]
    out = torch.stack(outs)
    return out.reshape(bshape + list(out.shape[1:]))


@op("gather_along_axis")
def _gather_along_axis(a):
    x, idx = a.t("x"), a.t("indices")
    axis = _axis(a.v("axis", 0), x.dim())
    return torch.gather(x, axis, _norm_index(idx, x.shape[axis]))


def _gather_nd0(x, idx):
    k = idx.shape[-1]
    lead = idx.reshape(-1, k)
    cols = tuple(_norm_index(lead[:, j], x.shape[j]) for j in range(k))
    out = x[cols]
    return out.reshape(list(idx.shape[:-1]) + list(x.shape[k:]))


@op("gather_nd")
def _gather_nd(a):
    x, idx = a.t("x"), a.t("indices")
    batch_dims = int(a.v("batch_dims", 0))
    if batch_dims == 0:
        return _gather_nd0(x, idx)
    bshape = list(x.shape[:batch_dims])
    xb = x.reshape([-1] + list(x.shape[batch_dims:]))
    ib = idx.reshape([-1] + list(idx.shape[batch_dims:]))
    out = torch.stack([_gather_nd0(xb[i], ib[i]) for i in range(xb.shape[0])])
    return out.reshape(bshape + list(out.shape[1:]))


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_core(data, axis, index, updates, mode):
    updates = updates.to(data.dtype)
    if mode == "update":
        return data.scatter(axis, index, updates)
    if mode == "sub":
        return data.scatter_reduce(axis, index, -updates, reduce="sum")
    if mode == "div":
        return data.scatter_reduce(axis, index, 1.0 / updates, reduce="prod")
    if mode not in _SCATTER_REDUCE:
        raise RuntimeBackendError(f"scatter: unknown mode {mode!r}")
    return data.scatter_reduce(axis, index, updates, reduce=_SCATTER_REDUCE[mode])


@op("scatter")
def _scatter(a):
    data, idx, updates = a.t("data"), a.t("indices"), a.t("updates")
    axis = _axis(a.v("axis", 0), data.dim())
    idx = _norm_index(idx, data.shape[axis]).reshape(-1)
    # updates: data.shape[:axis] + indices.shape + data.shape[axis+1:] (indices rank-0 or 1-D)
    updates = updates.reshape(list(data.shape[:axis]) + [idx.numel()] + list(data.shape[axis + 1:]))
    shape = [1] * updates.dim()
    shape[axis] = idx.numel()
    index = idx.reshape(shape).expand(updates.shape)
    return _scatter_core(data, axis, index, updates, a.v("mode", "add"))


@op("scatter_along_axis")
def _scatter_along_axis(a):
    data, idx, updates = a.t("data"), a.t("indices"), a.t("updates")
    axis = _axis(a.v("axis", 0), data.dim())
    return _scatter_core(data, axis, _norm_index(idx, data.shape[axis]), updates, a.v("mode", "add"))


@op("scatter_nd")
def _scatter_nd(a):
    data, idx, updates = a.t("data"), a.t("indices"), a.t("updates")
    mode = a.v("mode", "add")
    k = idx.shape[-1]
    lead = idx.reshape(-1, k)
    cols = tuple(_norm_index(lead[:, j], data.shape[j]) for j in range(k))
    upd = updates.reshape([lead.shape[0]] + list(data.shape[k:])).to(data.dtype)
    out = data.clone()
    if mode == "update":
        out[cols] = upd
    elif mode == "add":
        out.index_put_(cols, upd, accumulate=True)
    elif mode == "sub":
        out.index_put_(cols, -upd, accumulate=True)
    else:
        for i in range(lead.shape[0]):
            pos = tuple(c[i] for c in cols)
            cur = out[pos]
            out[pos] = {"mul": cur * upd[i], "div": cur / upd[i], "max": torch.maximum(cur, upd[i]),
                        "min": torch.minimum(cur, upd[i])}[mode]
    return out


# ---------------------------------------------------------------- tensor creation / misc
@op("select")
def _select(a):
    return torch.where(a.t("cond").bool(), a.t("a"), a.t("b"))


@op("fill")
def _fill(a):
    value = a.v("value", 0.0)
    return torch.full([int(s) for s in a.v("shape")], value)


@op("fill_like")
def _fill_like(a):
    return torch.full(list(a.t("ref_tensor").shape), a.v("value", 0.0))


@op("range_1d")
def _range_1d(a):
    start, end, step = a.t("start"), a.t("end"), a.t("step")
    if start.is_floating_point() or end.is_floating_point() or step.is_floating_point():
        return torch.arange(float(start), float(end), float(step), dtype=torch.float32)
    return torch.arange(int(start), int(end), int(step), dtype=torch.int32)


@op("one_hot")
def _one_hot(a):
    idx = a.t("indices").to(torch.int64)
    depth = int(a.v("one_hot_vector_size"))
    axis = a.v("axis", -1)
    on, off = a.v("on_value", 1), a.v("off_value", 0)
    hot = (idx.unsqueeze(-1) == torch.arange(depth)).to(torch.float32)
    out = hot * on + (1.0 - hot) * off
    return out.movedim(-1, _axis(axis, idx.dim() + 1))


@op("band_part")
def _band_part(a):
    x = a.t("x")
    lower, upper = int(a.v("lower", -1)), int(a.v("upper", -1))
    m = torch.arange(x.shape[-2]).unsqueeze(1)
    n = torch.arange(x.shape[-1]).unsqueeze(0)
    keep = torch.ones(x.shape[-2:], dtype=torch.bool)
    if lower >= 0:
        keep &= (m - n) <= lower
    if upper >= 0:
        keep &= (n - m) <= upper
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype))


@op("pad")
def _pad(a):
    x = a.t("x")
    pad = [int(p) for p in a.v("pad")]
    mode = a.v("mode", "constant")
    n = len(pad) // 2
    flat = []
    for i in reversed(range(n)):
        flat += [pad[2 * i], pad[2 * i + 1]]
    if mode == "constant":
        return F.pad(x, flat, value=float(a.v("constant_val", 0.0)))
    torch_mode = {"reflect": "reflect", "replicate": "replicate"}[mode]
    # torch reflect/replicate pad the last n dims of a (batch, channel, *n) tensor
    lead = list(x.shape[: x.dim() - n])
    y = x.reshape([1, max(int(np.prod(lead, dtype=np.int64)), 1)] + list(x.shape[x.dim() - n:]))
    y = F.pad(y, flat, mode=torch_mode)
    return y.reshape(lead + list(y.shape[2:]))


@op("cumsum")
def _cumsum(a):
    x = a.t("x")
    axis = _axis(a.v("axis", 0), x.dim())
    if a.v("reverse", False):
        x = torch.flip(x, [axis])
    out = torch.cumsum(x, dim=axis)
    if a.v("exclusive", False):
        out = out - x
    if a.v("reverse", False):
        out = torch.flip(out, [axis])
    return out


@op("topk")
def _topk(a):
    x = a.t("x")
    axis = _axis(a.v("axis", -1), x.dim())
    values, indices = torch.topk(x, int(a.v("k", 1)), dim=axis, largest=not a.v("ascending", False),
                                 sorted=True)
    if not a.v("return_indices", True):
        return values
    return values, indices


@op("argsort")
def _argsort(a):
    x = a.t("x")
    return torch.argsort(x, dim=_axis(a.v("axis", -1), x.dim()), descending=not a.v("ascending", False),
                         stable=True)


@op("scaled_dot_product_attention")
def _sdpa(a):
    q, k, v, mask = a.t("query"), a.t("key"), a.t("value"), a.t("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        mask = _f(mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---------------------------------------------------------------- activation quantization (iOS17)
# As coremltools defines them (iOS17 `quantize` / `dequantize` value inference,
# `coremltools.optimize._utils.quantize_by_scale_and_zp` / `dequantize_by_scale_and_zp`):
#   quantize:   clip(round_half_even(input / scale) + zero_point, dtype range), cast to int8 / uint8;
#               the division is in the input's dtype (SrcT: fp16 gives an fp16 quotient, so a quotient
#               within half an fp16 ulp of k + 0.5 becomes a tie), zero_point absent = 0.
#   dequantize: (float32(input) - float32(zero_point)) * scale, then the scale's dtype (DstT).
# scale / zero_point: scalars, or vectors along `axis` (broadcast to the input's rank).
QUANTIZED_RANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def _per_axis(param, x, axis):
    if param is None:
        return None
    if param.dim() == 0 or axis is None:
        return param
    shape = [1] * x.dim()
    shape[_axis(axis, x.dim())] = -1
    return param.reshape(shape)


@op("dequantize")
def _dequantize(a):
    x = _f(a.t("input"))
    axis = a.v("axis", None)
    zp = _per_axis(a.t("zero_point"), x, axis)
    if zp is not None:
        x = x - _f(zp)
    return x * _f(_per_axis(a.t("scale"), x, axis))  # rounded to the output dtype (the scale's) by the interpreter


@op("quantize")
def _quantize(a):
    x = _f(a.t("input"))
    axis = a.v("axis", None)
    out_dtype = a.v("output_dtype")
    if out_dtype not in QUANTIZED_RANGE:
        raise RuntimeBackendError(f"op {a.step.name} (quantize): output_dtype {out_dtype!r} is not int8 or uint8")
    y = x / _f(_per_axis(a.t("scale"), x, axis))
    if a.dtype("input") == "fp16":  # fp16 / fp16 is an fp16 quotient (fp32 then fp16: correctly rounded)
        y = coerce(y, "fp16")
    y = torch.round(y)  # round half to even, as np.around
    zp = _per_axis(a.t("zero_point"), x, axis)
    if zp is not None:
        y = y + _f(zp)
    lo, hi = QUANTIZED_RANGE[out_dtype]
    return torch.clamp(y, lo, hi)


# ---------------------------------------------------------------- states (iOS18)
@op("read_state")
def _read_state(a):
    return a.t("input")


@op("coreml_update_state", "write_state")
def _update_state(a):
    ref = a.step.ins["state"] if "state" in a.step.ins else a.step.ins["input"]
    value = a.t("value") if a.has("value") else a.t("data")

    state_dtype = a.dtype("state") if "state" in a.step.ins else a.dtype("input")
    value_dtype = a.dtype("value") if a.has("value") else a.dtype("data")
    # values of an fp16 var are already exact fp16: storing them needs no conversion
    stored = value if value_dtype == state_dtype else coerce(value, state_dtype)
    a.env[ref] = stored
    return stored
