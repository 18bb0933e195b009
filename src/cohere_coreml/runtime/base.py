"""The backend-independent model interface and input validation."""

from __future__ import annotations

import abc

import numpy as np

from .errors import InputValidationError
from .package import Description


def format_description(desc: Description) -> str:
    return ", ".join(f"{k}: {tuple(s)} {np.dtype(d).name}" for k, (s, d) in desc.items())


def validate_inputs(inputs: dict, description: Description) -> dict[str, np.ndarray]:
    """Check names / shapes of ``inputs`` and cast them to the declared dtypes.

    Raises :class:`InputValidationError` naming the problem (missing or unexpected input,
    wrong rank or shape, non-integral values for an integer input).
    """
    if not isinstance(inputs, dict):
        raise InputValidationError(f"inputs must be a dict name -> array, got {type(inputs).__name__}")
    missing = [k for k in description if k not in inputs]
    if missing:
        raise InputValidationError(
            f"missing input(s) {missing}; the model expects {format_description(description)}"
        )
    unexpected = [k for k in inputs if k not in description]
    if unexpected:
        raise InputValidationError(
            f"unexpected input(s) {unexpected}; the model expects {format_description(description)}"
        )
    out = {}
    for name, (shape, dtype) in description.items():
        value = inputs[name]
        if hasattr(value, "detach"):  # torch tensor
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        if arr.dtype == object or not (
            np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
        ):
            raise InputValidationError(f"input {name!r}: expected a numeric array, got dtype {arr.dtype}")
        if arr.ndim != len(shape) or any(d != -1 and d != a for d, a in zip(shape, arr.shape)):
            raise InputValidationError(
                f"input {name!r}: expected shape {tuple(shape)} (-1 = any), got {tuple(arr.shape)}"
            )
        if np.issubdtype(dtype, np.integer) and not np.issubdtype(arr.dtype, np.integer):
            if arr.dtype == np.bool_:
                pass
            elif not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise InputValidationError(
                    f"input {name!r}: declared {np.dtype(dtype).name} but holds non-integral values"
                )
        if np.issubdtype(dtype, np.integer) and arr.size:
            info = np.iinfo(dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise InputValidationError(
                    f"input {name!r}: values outside the {np.dtype(dtype).name} range"
                )
        out[name] = np.ascontiguousarray(arr.astype(dtype, copy=False))
    return out


class RuntimeModel(abc.ABC):
    """A loaded model. Same interface for the MIL interpreter and Core ML.

    Attributes:
        input_description / output_description / state_description:
            dict name -> (shape tuple, numpy dtype); -1 marks a flexible dimension.
        function_name: the function of the package being run.
        backend: "mil" or "coreml".
    """

    backend: str
    function_name: str
    input_description: Description
    output_description: Description
    state_description: Description

    @abc.abstractmethod
    def make_state(self):
        """A new state (zeroed buffers of the declared shapes) with ``read_state(name)`` /
        ``write_state(name, value)``; pass it to every ``predict`` call of one sequence."""

    @abc.abstractmethod
    def predict(self, inputs: dict, state=None) -> dict[str, np.ndarray]:
        """Run the function; returns dict output name -> numpy array of the declared dtype."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(function={self.function_name!r}, "
            f"inputs=[{format_description(self.input_description)}], "
            f"outputs=[{format_description(self.output_description)}], "
            f"states=[{format_description(self.state_description)}])"
        )
