"""The functions of one decoder.mlpackage used together on one state, through the runtime interface.

    memory  = encoder.predict(...)                      # cross_k, cross_v, cross_mask (+ encoder_length)
    state   = decoder.new_state(memory)                 # make_state + bind_memory: once per window
    lp      = decoder.prefill(state, prompt)            # or decoder.step(state, id, p) per prompt token
    lp      = decoder.step(state, token, position)      # (V,) log-probs; binds only input_ids, position

`DecoderRuntime` is what the `Transcriber`, `verify`, the export gate and `quantize` run; the
PyTorch twin of the same interface is `decoder.TorchDecoder`. Beam search copies states with
`decoding.copy_state` (every buffer: the self-attention cache and the bound cross memory).
"""

from __future__ import annotations

import os

import numpy as np

from .config import BIND_FUNCTION, BIND_INPUT_PREFIX, BIND_OUTPUT, MEMORY_NAMES, PREFILL_FUNCTION, STEP_FUNCTION


class DecoderRuntimeError(RuntimeError):
    """The decoder package cannot be used as the bundle format says (missing function, bad memory)."""


def bind_inputs(memory: dict) -> dict[str, np.ndarray]:
    """bind_memory's inputs from the encoder's outputs: `cross_k` -> `encoder_cross_k`, ..."""
    missing = [k for k in MEMORY_NAMES if k not in memory]
    if missing:
        raise DecoderRuntimeError(f"the encoder outputs lack {missing}: bind_memory needs {list(MEMORY_NAMES)}")
    return {BIND_INPUT_PREFIX + k: memory[k] for k in MEMORY_NAMES}


class DecoderRuntime:
    """bind_memory, the step (`main`) and optionally prefill of one decoder package, sharing one state.

    Args:
        step, bind, prefill: loaded functions (`runtime.load_model`), prefill optional.
    """

    def __init__(self, step, bind, prefill=None):
        self.step_model, self.bind_model, self.prefill_model = step, bind, prefill
        if set(bind.state_description) != set(step.state_description):
            raise DecoderRuntimeError(f"{BIND_FUNCTION} has states {sorted(bind.state_description)}, the step "
                                      f"{sorted(step.state_description)}: one state layout is required")
        self.prefill_length = None
        if prefill is not None:
            self.prefill_length = int(prefill.input_description["input_ids"][0][1])  # (1, P)

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto", compute_units: str = "all",
             prefill: bool = True, num_threads: int | None = None) -> DecoderRuntime:
        """Load a decoder package's functions; `prefill`: also its prefill function when it has one."""
        from .runtime import (  # cohere_coreml.runtime imports torch; this module loads without it
            load_model,
            read_package,
        )

        functions = read_package(path).function_names
        if BIND_FUNCTION not in functions:
            raise DecoderRuntimeError(
                f"{path} has no {BIND_FUNCTION!r} function (functions: {sorted(functions)}): it is a decoder of "
                "an older bundle format that took the cross memory at every step; re-export it with "
                "`cohere-coreml export`")

        def load(fn):
            return load_model(str(path), backend=backend, function_name=fn, compute_units=compute_units,
                              num_threads=num_threads)

        pre = load(PREFILL_FUNCTION) if prefill and PREFILL_FUNCTION in functions else None
        return cls(load(STEP_FUNCTION), load(BIND_FUNCTION), pre)

    @property
    def backend(self) -> str:
        return self.step_model.backend

    @property
    def state_description(self):
        return self.step_model.state_description

    def make_state(self):
        """A zeroed state of the package's layout (bind it before any step)."""
        return self.step_model.make_state()

    def bind(self, state, memory: dict) -> int:
        """Write one window's cross memory (the encoder's outputs) into `state`; clears its self cache.
        Returns the valid frames bound; checked against `memory["encoder_length"]` when present."""
        out = self.bind_model.predict(bind_inputs(memory), state=state)
        bound = int(np.asarray(out[BIND_OUTPUT]).reshape(-1)[0])
        if "encoder_length" in memory:
            expected = int(np.asarray(memory["encoder_length"]).reshape(-1)[0])
            if bound != expected:
                raise DecoderRuntimeError(f"{BIND_FUNCTION} bound a memory of {bound} valid frames but the encoder "
                                          f"reports encoder_length {expected}: cross_mask and encoder_length disagree")
        return bound

    def new_state(self, memory: dict):
        """A fresh state with `memory` bound: what every window starts from."""
        state = self.make_state()
        self.bind(state, memory)
        return state

    def step(self, state, token: int, position: int) -> np.ndarray:
        """Feed `token` at cache slot `position`; returns the (V,) log-probs of the next token."""
        out = self.step_model.predict({"input_ids": np.array([[int(token)]], dtype=np.int32),
                                       "position": np.array([int(position)], dtype=np.int32)}, state=state)
        return np.asarray(out["log_probs"]).reshape(-1)

    def prefill(self, state, ids) -> np.ndarray:
        """Feed the whole prompt (slots 0..P-1) in one call; (V,) log-probs after its last token."""
        if self.prefill_model is None:
            raise DecoderRuntimeError("the decoder package has no prefill function (or it was not loaded)")
        ids = [int(t) for t in ids]
        if len(ids) != self.prefill_length:
            raise DecoderRuntimeError(f"prefill takes {self.prefill_length} prompt tokens, got {len(ids)}")
        out = self.prefill_model.predict({"input_ids": np.array([ids], dtype=np.int32)}, state=state)
        return np.asarray(out["log_probs"]).reshape(-1)
