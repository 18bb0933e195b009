"""MIL-program interpreter backend: runs the MIL function of an ``.mlpackage`` op by op.

Load time: the selected function is loaded with coremltools' milproto loader, every op type is
checked against the op registry (:class:`UnsupportedOpError` before anything runs), ``const``
values are converted once to torch tensors and ``constexpr_*`` ops are decompressed once.
The result is a flat list of steps; ``predict`` walks it, freeing each intermediate after its
last use.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from . import dtypes
from .base import RuntimeModel, validate_inputs
from .constexpr import CONSTEXPR_OPS
from .errors import InputValidationError, PackageLoadError, RuntimeBackendError, UnsupportedOpError
from .ops import OPS
from .package import PackageSpec, describe, load_mil_function

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class Step:
    op_type: str
    name: str
    fn: object
    ins: dict  # input name -> var name (str) or list of var names (tuple inputs)
    in_dtypes: dict  # input name -> MIL dtype name (or list)
    outs: list  # [(var name, MIL dtype name or None: already exact, no conversion)]
    free: list = field(default_factory=list)  # var names dead after this step
    heavy: bool = False  # runs on the caller's torch threads (see _HEAVY_OPS), else on one


# Threading: only compute-bound ops (matrix products, convolutions) with large outputs use the
# caller's torch threads; everything else (elementwise, copies, reductions, the fp16 rounding)
# runs on one thread: when another process keeps the other cores busy, small ops on two threads wait
# for a busy core, so elementwise ops and depthwise convs run several times slower than on one and a
# full-size decoder step many times slower (docs/runtime.md has the figures).
_HEAVY_OPS = {"linear", "matmul", "conv", "conv_transpose", "einsum", "scaled_dot_product_attention"}
_SMALL_OP = 1 << 17  # outputs up to this many elements are not worth a thread hand-off


# Ops whose fp16 results are, value for value, fp16 inputs (or fp16 constants): when every
# float input is fp16 the result needs no rounding (it would be the identity).
_VALUE_PRESERVING = {
    "reshape", "transpose", "expand_dims", "squeeze", "flatten2d", "slice_by_index", "slice_by_size",
    "concat", "split", "stack", "tile", "gather", "gather_along_axis", "gather_nd", "pad", "relu",
    "relu6", "maximum", "minimum", "abs", "select", "identity", "read_state", "slice_update", "reverse",
    "sliding_windows", "pixel_shuffle", "pixel_unshuffle", "band_part", "clip", "threshold",
    "reduce_max", "reduce_min", "reshape_like", "coreml_update_state", "write_state",
}


def _all_float_inputs_fp16(in_dtypes: dict) -> bool:
    for dt in in_dtypes.values():
        for d in dt if isinstance(dt, list) else [dt]:
            if d in ("fp32", "fp64"):
                return False
    return True


class Args:
    """What an op implementation sees: its inputs, by the names of the MIL op definition."""

    __slots__ = ("step", "env", "pycache")

    def __init__(self, step: Step, env: dict, pycache: dict):
        self.step = step
        self.env = env
        self.pycache = pycache

    def has(self, name: str) -> bool:
        return name in self.step.ins

    def t(self, name: str):
        """Input ``name`` as a torch tensor (None when the optional input is absent)."""
        ref = self.step.ins.get(name)
        if ref is None:
            return None
        return self.env[ref]

    def ts(self, name: str) -> list:
        """A tuple input (e.g. ``values`` of concat) as a list of tensors."""
        ref = self.step.ins[name]
        if isinstance(ref, str):
            return [self.env[ref]]
        return [self.env[r] for r in ref]

    def v(self, name: str, default=_MISSING):
        """Input ``name`` as a Python value (list / scalar / str)."""
        ref = self.step.ins.get(name)
        if ref is None:
            if default is _MISSING:
                raise RuntimeBackendError(f"op {self.step.name} ({self.step.op_type}): missing input {name!r}")
            return default
        if isinstance(ref, list):  # tuple input of scalars (e.g. reshape_like's begins)
            return [self._py(r) for r in ref]
        return self._py(ref)

    def _py(self, ref: str):
        if ref in self.pycache:
            return self.pycache[ref]
        value = self.env[ref]
        return value.tolist() if isinstance(value, torch.Tensor) else value

    def dtype(self, name: str) -> str:
        return self.step.in_dtypes[name]

    def out_dtype(self, i: int = 0) -> str:
        return self.step.outs[i][1]


class MilState:
    """State buffers of one stateful sequence (same API as ``coremltools.models.model.MLState``).

    Buffers start at zero; ``predict(..., state=...)`` reads and updates them in place.
    """

    def __init__(self, description: dict):
        self._description = description
        self.buffers: dict[str, torch.Tensor] = {}
        for name, (shape, np_dtype) in description.items():
            if any(d < 0 for d in shape):
                raise RuntimeBackendError(f"state {name!r} has a flexible shape {shape}")
            self.buffers[name] = torch.zeros(shape, dtype=dtypes.torch_dtype(_np_to_mil(np_dtype)))

    def read_state(self, name: str) -> np.ndarray:
        if name not in self.buffers:
            raise InputValidationError(f"unknown state {name!r}; states: {sorted(self.buffers)}")
        return dtypes.to_numpy(self.buffers[name], self._description[name][1])

    def write_state(self, name: str, value) -> None:
        if name not in self.buffers:
            raise InputValidationError(f"unknown state {name!r}; states: {sorted(self.buffers)}")
        shape, np_dtype = self._description[name]
        arr = np.asarray(value)
        if tuple(arr.shape) != tuple(shape):
            raise InputValidationError(f"state {name!r}: expected shape {shape}, got {arr.shape}")
        self.buffers[name] = dtypes.from_numpy(arr.astype(np_dtype), _np_to_mil(np_dtype))

    def write_state_slice(self, name: str, value, start) -> None:
        """Write `value` into the buffer `name` in place, its element [0, ..., 0] at index `start` (one
        offset per axis). Not in coremltools' `MLState` (its `write_state` replaces a whole buffer): the
        interpreter's counterpart of Swift's `MLState.withMultiArray(for:)`, through which a host writes
        only the rows it changes (the host-state decoder's new K/V rows)."""
        if name not in self.buffers:
            raise InputValidationError(f"unknown state {name!r}; states: {sorted(self.buffers)}")
        shape, np_dtype = self._description[name]
        arr = np.asarray(value)
        start = tuple(int(s) for s in start)
        if arr.ndim != len(shape) or len(start) != len(shape) or any(
                s < 0 or s + n > d for s, n, d in zip(start, arr.shape, shape)):
            raise InputValidationError(f"state {name!r} {tuple(shape)}: cannot write a {tuple(arr.shape)} slice "
                                       f"at {start}")
        region = tuple(slice(s, s + n) for s, n in zip(start, arr.shape))
        self.buffers[name][region] = dtypes.from_numpy(arr.astype(np_dtype), _np_to_mil(np_dtype))


def _np_to_mil(np_dtype) -> str:
    return {
        np.dtype(np.float16): "fp16",
        np.dtype(np.float32): "fp32",
        np.dtype(np.float64): "fp64",
        np.dtype(np.int32): "int32",
        np.dtype(np.int8): "int8",
    }[np.dtype(np_dtype)]


def _const_value(var):
    """Numpy / Python value of a const var."""
    val = var.val
    if isinstance(val, np.generic):
        val = np.asarray(val)
    return val


def _feeds_constexpr(var) -> bool:
    return any(op.op_type.startswith("constexpr_") for op in var.child_ops)


def _only_feeds_constexpr(var, outputs) -> bool:
    """A var read only by constexpr ops (compressed weight data), not a function output."""
    return bool(var.child_ops) and var.name not in outputs and all(
        op.op_type.startswith("constexpr_") for op in var.child_ops)


def _release_const(op) -> None:
    """Drop PyMIL's numpy copy of a (large) const once converted (best effort)."""
    try:
        op.outputs[0]._sym_val = None
        inner = getattr(op, "val", None)  # the const's internal input var holds a 2nd reference
        if inner is not None and hasattr(inner, "_sym_val"):
            inner._sym_val = None
    except Exception:  # noqa: BLE001 - PyMIL internals; only memory is at stake
        pass


def supported_op_types() -> list[str]:
    """Every op type the interpreter can run (``const`` and ``constexpr_*`` included)."""
    return sorted(set(OPS) | set(CONSTEXPR_OPS) | {"const"})


def _collect_op_types(block, acc: set) -> None:
    for op in block.operations:
        acc.add(op.op_type)
        for b in op.blocks:
            _collect_op_types(b, acc)


class MilModel(RuntimeModel):
    """Runs one function of an ML program package with the MIL interpreter."""

    backend = "mil"

    def __init__(self, pkg: PackageSpec, num_threads: int | None = None):
        if num_threads is not None and int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = None if num_threads is None else int(num_threads)
        self.path = pkg.path
        self.function_name = pkg.function_name
        self.input_description, self.output_description, self.state_description = describe(pkg)
        function = load_mil_function(pkg)

        # 1. Every op type must be supported, before anything runs.
        used: set[str] = set()
        _collect_op_types(function, used)
        unsupported = [t for t in used if t not in OPS and t not in CONSTEXPR_OPS and t != "const"]
        if unsupported:
            raise UnsupportedOpError(self.function_name, unsupported)

        # 2. Function inputs / states.
        self._state_names = []
        self._input_dtypes = {}
        from coremltools.converters.mil.mil import types  # heavy: importing the runtime loads no coremltools

        for name, var in function.inputs.items():
            if types.is_state(var.sym_type):
                self._state_names.append(name)
            else:
                self._input_dtypes[name] = dtypes.mil_dtype_name(var.dtype)
        if set(self._input_dtypes) != set(self.input_description):
            raise PackageLoadError(
                f"MIL inputs {sorted(self._input_dtypes)} differ from the description "
                f"{sorted(self.input_description)}"
            )
        self._output_names = [v.name for v in function.outputs]
        missing = set(self.output_description) - set(self._output_names)
        if missing:
            raise PackageLoadError(f"outputs {sorted(missing)} are not produced by the MIL function")

        # 3. Constants (const once, constexpr decompressed once) and the step list.
        self._consts: dict[str, object] = {}
        self._pycache: dict[str, object] = {}
        self._var_dtypes: dict[str, str | None] = {}  # op output var -> MIL dtype name
        const_np: dict[str, np.ndarray] = {}
        remaining: dict[str, int] = {}  # compressed-data const -> constexpr consumers not yet run
        steps: list[Step] = []
        n_default = 0
        for op in function.operations:
            if op.op_type == "const":
                var = op.outputs[0]
                val = _const_value(var)
                if _only_feeds_constexpr(var, self._output_names):
                    # compressed data (indices, scales, LUTs): read once by its constexpr ops, never by a
                    # step, so no torch copy (4-bit indices would become int32: ~8x their packed size)
                    const_np[var.name] = val
                    remaining[var.name] = len(var.child_ops)
                    continue
                self._add_const(var.name, val, dtypes.mil_dtype_name(var.sym_type) if not isinstance(val, str) else "str")
                const_np[var.name] = val
                if isinstance(val, np.ndarray) and val.size > 4096 and not _feeds_constexpr(var):
                    del const_np[var.name]
                    _release_const(op)  # the torch copy is all we keep: halve the peak at load
                continue
            if op.op_type in CONSTEXPR_OPS:
                in_vals = {}
                for k, v in op.inputs.items():
                    if isinstance(v, (list, tuple)):
                        raise PackageLoadError(f"{op.op_type} {op.name}: tuple input {k}")
                    in_vals[k] = const_np[v.name] if v.name in const_np else _const_value(v)
                results = CONSTEXPR_OPS[op.op_type](**in_vals)
                del in_vals
                if not isinstance(results, tuple):
                    results = (results,)
                for var, val in zip(op.outputs, results):
                    if _only_feeds_constexpr(var, self._output_names):  # an inner link of a joint chain
                        const_np[var.name] = val
                        remaining[var.name] = len(var.child_ops)
                        continue
                    self._add_const(var.name, val, dtypes.mil_dtype_name(var.sym_type))
                    if _feeds_constexpr(var):
                        const_np[var.name] = val
                del results
                # drop each compressed input once its last constexpr consumer has run
                for v in op.inputs.values():
                    if v.name in remaining:
                        remaining[v.name] -= 1
                        if remaining[v.name] == 0:
                            del remaining[v.name]
                            const_np.pop(v.name, None)
                            if v.op is not None and v.op.op_type == "const":
                                _release_const(v.op)
                continue

            ins, in_dtypes = {}, {}
            for k, v in op.inputs.items():
                if isinstance(v, (list, tuple)):
                    ins[k] = [x.name for x in v]
                    in_dtypes[k] = [self._var_dtype(x) for x in v]
                else:
                    ins[k] = v.name
                    in_dtypes[k] = self._var_dtype(v)
            for k, dv in op.default_inputs().items():
                if k in ins or dv is None:
                    continue
                cname = f"__default_{n_default}"
                n_default += 1
                self._consts[cname] = torch.as_tensor(dv) if not isinstance(dv, str) else dv
                self._pycache[cname] = dv.tolist() if isinstance(dv, np.ndarray) else dv
                ins[k] = cname
                in_dtypes[k] = None
            outs = [(o.name, self._var_dtype(o)) for o in op.outputs]
            for o_name, o_dtype in outs:
                self._var_dtypes[o_name] = o_dtype
            if op.op_type in _VALUE_PRESERVING and _all_float_inputs_fp16(in_dtypes):
                outs = [(n, None if dt == "fp16" else dt) for n, dt in outs]
            small = all(
                all(isinstance(d, (int, np.integer)) for d in o.shape) and int(np.prod(o.shape)) <= _SMALL_OP
                for o in op.outputs
                if hasattr(o, "shape") and o.shape is not None
            )
            heavy = op.op_type in _HEAVY_OPS and not small
            steps.append(Step(op.op_type, op.name, OPS[op.op_type], ins, in_dtypes, outs, heavy=heavy))
        del const_np

        # 4. Liveness: free every intermediate after its last use.
        keep = set(self._output_names) | set(self._state_names)
        last_use: dict[str, int] = {}
        for i, s in enumerate(steps):
            for ref in s.ins.values():
                for r in [ref] if isinstance(ref, str) else ref:
                    last_use[r] = i
        for i, s in enumerate(steps):
            for o, _ in s.outs:  # outputs nobody reads die at once
                last_use.setdefault(o, i)
        for name, i in last_use.items():
            if name not in keep and name not in self._consts:
                steps[i].free.append(name)
        self._steps = steps
        self._observer = None  # see `observed`
        self.num_ops = len(steps)
        logger.debug(
            "loaded %s function %r: %d ops, %d constants", self.path, self.function_name,
            len(steps), len(self._consts),
        )

    @staticmethod
    def _var_dtype(var) -> str | None:
        from coremltools.converters.mil.mil import types  # heavy (see __init__)

        st = var.sym_type
        if types.is_tensor(st) or types.is_scalar(st) or types.is_state(st):
            try:
                return dtypes.mil_dtype_name(st)
            except KeyError:
                return None
        return None

    def _add_const(self, name: str, val, mil_dtype: str) -> None:
        if isinstance(val, str) or mil_dtype == "str":
            self._consts[name] = val
            self._pycache[name] = val
            return
        arr = np.asarray(val)
        if arr.size <= 64:
            self._pycache[name] = arr.tolist()
        if not dtypes.is_known(mil_dtype):  # sub-byte ints etc. (inputs of constexpr ops)
            self._consts[name] = torch.from_numpy(arr.astype(np.int32))
            return
        self._consts[name] = dtypes.from_numpy(arr, mil_dtype)

    # ------------------------------------------------------------------ constants (sensitivity runs)
    def constant(self, name: str) -> torch.Tensor:
        """The loaded (decompressed) value of a constant / constexpr output by its MIL var name."""
        if name not in self._consts:
            raise KeyError(f"{name!r} is not a constant of function {self.function_name!r}")
        return self._consts[name]

    @contextlib.contextmanager
    def replaced_constants(self, values: dict):
        """Run with some constants replaced (same shapes), e.g. one weight quantized; restored after."""
        saved = {}
        try:
            for name, val in values.items():
                old = self.constant(name)
                if tuple(val.shape) != tuple(old.shape):
                    raise ValueError(f"constant {name}: shape {tuple(val.shape)} != {tuple(old.shape)}")
                saved[name] = old
                self._consts[name] = val
            yield self
        finally:
            self._consts.update(saved)

    # ------------------------------------------------------------------ interface
    def make_state(self) -> MilState:
        if not self.state_description:
            raise InputValidationError(f"function {self.function_name!r} has no state")
        return MilState(self.state_description)

    def predict(self, inputs: dict, state: MilState | None = None) -> dict[str, np.ndarray]:
        env = self._run(inputs, state, keep_all=False)
        return {
            name: dtypes.to_numpy(env[name], np_dtype)
            for name, (_, np_dtype) in self.output_description.items()
        }

    def intermediates(self, inputs: dict, state: MilState | None = None) -> dict[str, np.ndarray]:
        """Run and return every op output (MIL var name -> numpy array), for debugging parity."""
        env = self._run(inputs, state, keep_all=True)
        out = {}
        for step in self._steps:
            for name, _ in step.outs:
                value = env.get(name)
                mil_dtype = self._var_dtypes.get(name)
                if isinstance(value, torch.Tensor):
                    np_dtype = dtypes.numpy_dtype(mil_dtype) if mil_dtype else None
                    out[name] = dtypes.to_numpy(value, np_dtype) if np_dtype else value.numpy()
        return out

    @contextlib.contextmanager
    def observed(self, observer):
        """Call `observer(var name, torch value)` for every function input and every op output of the
        `predict` calls inside (e.g. activation statistics, `quantize.activations`); restored after. A
        tensor the observer returns for an op output replaces that output for the ops after it (e.g.
        a dequantize made an identity: `quantize.activations.pair_sensitivity`); None keeps it."""
        saved, self._observer = self._observer, observer
        try:
            yield self
        finally:
            self._observer = saved

    def _run(self, inputs: dict, state, keep_all: bool) -> dict:
        arrays = validate_inputs(inputs, self.input_description)
        env = dict(self._consts)
        observer = self._observer
        for name, arr in arrays.items():
            env[name] = dtypes.from_numpy(arr, self._input_dtypes[name])
            if observer is not None:
                observer(name, env[name])
        if self._state_names:
            if state is None:
                raise InputValidationError(
                    f"function {self.function_name!r} is stateful ({sorted(self._state_names)}); "
                    "pass state=model.make_state()"
                )
            if not isinstance(state, MilState) or set(state.buffers) != set(self._state_names):
                raise InputValidationError(
                    f"state does not belong to this model (expected states {sorted(self._state_names)})"
                )
            for name in self._state_names:
                env[name] = state.buffers[name]
        elif state is not None:
            raise InputValidationError(f"function {self.function_name!r} has no state")

        caller_threads = torch.get_num_threads()
        threads = self.num_threads or caller_threads
        current = caller_threads
        try:
            with torch.inference_mode():
                self._walk(env, threads, current, keep_all)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

        if self._state_names:
            for name in self._state_names:
                state.buffers[name] = env[name]
        return env

    def _walk(self, env: dict, threads: int, current: int, keep_all: bool) -> None:
        """Execute the steps in order (torch threads: ``threads`` for heavy steps, else 1)."""
        observer = self._observer
        for step in self._steps:
            want = threads if step.heavy else 1
            if want != current:
                torch.set_num_threads(want)
                current = want
            try:
                result = step.fn(Args(step, env, self._pycache))
            except RuntimeBackendError:
                raise
            except Exception as exc:
                raise RuntimeBackendError(
                    f"op {step.name!r} ({step.op_type}) failed: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(result, (tuple, list)):
                result = (result,)
            for (name, mil_dtype), value in zip(step.outs, result):
                if mil_dtype is not None and isinstance(value, torch.Tensor):
                    if current != 1:  # the rounding is memory-bound: one thread
                        torch.set_num_threads(1)
                        current = 1
                    value = dtypes.coerce(value, mil_dtype)
                if observer is not None:  # a value it returns replaces the op's output (what-if runs)
                    replaced = observer(name, value)
                    value = value if replaced is None else replaced
                env[name] = value
            if not keep_all:
                for name in step.free:
                    env.pop(name, None)
