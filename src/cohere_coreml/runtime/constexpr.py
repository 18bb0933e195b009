"""Decompression of ``constexpr_*`` ops (compressed weights), done once at load time.

Each function takes the op's inputs (numpy arrays / Python values, by the input names of the
MIL op definition) and returns the decompressed numpy value(s). The arithmetic follows the
op definitions in ``coremltools/converters/mil/mil/ops/defs/iOS16/constexpr_ops.py`` and
``iOS18/compression.py`` step by step (same dtypes, same order of rounding), so results are
bit-identical to coremltools' own ``materialized_val_inference`` (tested in
``tests/runtime/test_quantized.py``).
"""

from __future__ import annotations

import numpy as np


def _block_view(data_shape, param_shape):
    """Interleaved (groups, block) shapes to broadcast a per-block param over data."""
    data_view, param_view = [], []
    for d, p in zip(data_shape, param_shape):
        if d % p != 0:
            raise ValueError(f"dimension {d} is not a multiple of the parameter dimension {p}")
        data_view += [p, d // p]
        param_view += [p, 1]
    return data_view, param_view


def _promote_rank(param: np.ndarray, data: np.ndarray, axis) -> np.ndarray:
    """Broadcast a per-axis (or scalar) parameter against ``data`` (iOS16 constexpr ops)."""
    param = np.asarray(param)
    if param.ndim == data.ndim:
        return param
    if param.ndim == 0:
        return param.reshape([1] * data.ndim)
    axis = int(axis) + data.ndim if int(axis) < 0 else int(axis)
    shape = [1] * data.ndim
    shape[axis] = param.size
    return param.reshape(shape)


def _unpack_bits(packed: np.ndarray, nbits: int, count: int) -> np.ndarray:
    """Little-endian bit unpacking of ``count`` unsigned ``nbits``-bit values (iOS16 format)."""
    bits = np.unpackbits(np.asarray(packed).astype(np.uint8).reshape(-1), bitorder="little")
    bits = bits[: count * nbits].reshape(count, nbits).astype(np.uint16)
    weights = (1 << np.arange(nbits, dtype=np.uint16)).astype(np.uint16)
    return (bits * weights).sum(axis=1).astype(np.uint8)


def affine_dequantize(quantized_data, zero_point, scale, axis):
    """iOS16: output = scale * (quantized_data - zero_point), broadcast along ``axis``.

    fp32 arithmetic, result cast to the dtype of ``scale``.
    """
    data = np.asarray(quantized_data)
    scale = np.asarray(scale)
    out = data.astype(np.float32)
    zp = _promote_rank(zero_point, data, axis)
    out = out - zp.astype(np.float32)
    out = out * _promote_rank(scale, data, axis)
    return out.astype(scale.dtype)


def blockwise_shift_scale(data, scale, offset=None):
    """iOS18: output = scale * (data - offset), one (scale, offset) per block.

    Arithmetic in the dtype of ``scale`` (fp16 numpy arithmetic for fp16 scales).
    """
    data = np.asarray(data)
    scale = np.asarray(scale)
    data_view, param_view = _block_view(data.shape, scale.shape)
    x = data.astype(scale.dtype).reshape(data_view)
    if offset is not None:
        x = x - np.asarray(offset).reshape(param_view)
    x = scale.reshape(param_view) * x
    return x.reshape(data.shape)


def lut_to_dense_ios16(lut, indices, shape):
    """iOS16: ``indices`` are packed ``log2(len(lut))``-bit keys into the 1-D ``lut``."""
    lut = np.asarray(lut)
    shape = [int(s) for s in np.asarray(shape).reshape(-1)]
    nbits = int(np.log2(lut.size))
    keys = _unpack_bits(indices, nbits, int(np.prod(shape)))
    return lut[keys.astype(np.int64)].reshape(shape)


def lut_to_dense_ios18(indices, lut, vector_axis=None):
    """iOS18: per-block LUTs ``lut[*groups, NUM_PALETTES, VECTOR_SIZE]`` indexed by ``indices``."""
    indices = np.asarray(indices)
    lut = np.asarray(lut)
    rank = indices.ndim
    group_shape = lut.shape[:rank]
    palettes, vector_size = lut.shape[-2], lut.shape[-1]
    data_view, _ = _block_view(indices.shape, group_shape)
    n_groups = int(np.prod(group_shape))
    group_id = np.arange(n_groups).reshape(group_shape)
    group_id = group_id.reshape([d for g in group_shape for d in (g, 1)])
    keys = indices.astype(np.int64).reshape(data_view)
    out = lut.reshape(n_groups, palettes, vector_size)[group_id, keys]  # (*data_view, V)
    if vector_size == 1:
        return out[..., 0].reshape(indices.shape)
    axis = int(vector_axis)
    axis = axis + rank if axis < 0 else axis
    out = np.moveaxis(out, -1, 2 * axis + 2)
    shape = list(indices.shape)
    shape[axis] *= vector_size
    return out.reshape(shape)


def sparse_to_dense_ios16(nonzero_data, mask, shape):
    shape = [int(s) for s in np.asarray(shape).reshape(-1)]
    flat = np.zeros(int(np.prod(shape)), dtype=np.asarray(nonzero_data).dtype)
    bits = np.unpackbits(np.asarray(mask).astype(np.uint8).reshape(-1), bitorder="little")
    flat[np.nonzero(bits[: flat.size])[0]] = nonzero_data
    return flat.reshape(shape)


def sparse_to_dense_ios18(nonzero_data, mask):
    mask = np.asarray(mask)
    out = np.zeros(mask.shape, dtype=np.asarray(nonzero_data).dtype)
    out[mask != 0] = nonzero_data
    return out


def lut_to_sparse(indices_mask, indices_nonzero_data, lut, vector_axis=None):
    indices = sparse_to_dense_ios18(indices_nonzero_data, indices_mask)
    dense = lut_to_dense_ios18(indices, lut, vector_axis)
    mask = np.asarray(indices_mask)
    if vector_axis is not None and np.asarray(lut).shape[-1] > 1:
        mask = np.repeat(mask, np.asarray(lut).shape[-1], axis=int(vector_axis))
    return mask, dense[mask != 0].reshape(-1)


def sparse_blockwise_shift_scale(data_mask, nonzero_data, scale, offset=None):
    data = sparse_to_dense_ios18(nonzero_data, data_mask)
    dense = blockwise_shift_scale(data, scale, offset)
    mask = np.asarray(data_mask)
    return mask, dense[mask != 0].reshape(-1)


def _cast(source_val, output_dtype):
    if output_dtype != "fp32":
        raise ValueError(f"constexpr_cast to {output_dtype!r} is not defined (only fp32)")
    return np.asarray(source_val).astype(np.float32)


def _lut_to_dense(indices, lut, shape=None, vector_axis=None):
    if shape is not None:
        return lut_to_dense_ios16(lut, indices, shape)
    return lut_to_dense_ios18(indices, lut, vector_axis)


def _sparse_to_dense(nonzero_data, mask, shape=None):
    if shape is not None:
        return sparse_to_dense_ios16(nonzero_data, mask, shape)
    return sparse_to_dense_ios18(nonzero_data, mask)


# op type -> function(**inputs) -> value or tuple of values (one per output)
CONSTEXPR_OPS = {
    "constexpr_affine_dequantize": affine_dequantize,
    "constexpr_blockwise_shift_scale": blockwise_shift_scale,
    "constexpr_lut_to_dense": _lut_to_dense,
    "constexpr_sparse_to_dense": _sparse_to_dense,
    "constexpr_lut_to_sparse": lut_to_sparse,
    "constexpr_sparse_blockwise_shift_scale": sparse_blockwise_shift_scale,
    "constexpr_cast": _cast,
}
