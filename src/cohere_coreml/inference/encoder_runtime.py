"""The functions of an encoder (its length buckets), called with the host's length masks, through its
parts in order (an encoder exported in parts: `export --encoder-parts`).

    encoder = EncoderRuntime.load(path)                   # or .from_bundle(bundle)
    memory  = encoder.encode(features, n_valid)           # cross_k, cross_v, cross_mask, ... + encoder_length

The encoder program computes no length arithmetic (docs/ane.md): `encode` turns the window's valid
mel frames into the fp16 masks of `shapes.LengthMasks` (from the manifest's `encoder.length_masks`,
or the package's own metadata) and adds the window's `encoder_length` (the host's figure) to the
outputs, which is what `DecoderRuntime.bind` checks the bound memory against.
`Transcriber`, `verify`, the gates of `quantize` and the tools run the encoder through this class.
"""

from __future__ import annotations

import os

import numpy as np

from ..bundle.packages import encoder_package_info, encoder_part_file, package_length_masks
from ..config import MEMORY_NAMES
from ..model.shapes import LengthMasks, ShapeError

FEATURES_INPUT = "input_features"
HIDDEN_NAME = "hidden_states"  # what one part hands the next (with the encoder mask): its input name ...
HIDDEN_OUTPUT = "hidden_states_out"  # ... and the previous part's output name
ENCODER_MASK = "encoder_mask"


class EncoderRuntimeError(RuntimeError):
    """The encoder package cannot be used as the bundle format says (wrong function, missing outputs)."""


class PartChain:
    """One encoder function through its parts: the first on the features and masks, each next one on
    the previous part's hidden state and the encoder mask. One part: the whole encoder."""

    def __init__(self, models):
        self.models = list(models)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.models[0].predict(inputs)
        for model in self.models[1:]:
            out = model.predict({HIDDEN_NAME: out[HIDDEN_OUTPUT], ENCODER_MASK: inputs[ENCODER_MASK]})
        return out

    @property
    def input_description(self):
        return self.models[0].input_description


class EncoderRuntime:
    """An encoder's functions ({name: window mel frames}), each through the encoder's parts, loaded on
    first use.

    Args:
        path: the encoder's packages in order (encoder.mlpackage, encoder_part2.mlpackage, ...), or the one
        package of a whole encoder; masks: its `LengthMasks`; buckets: {function: window frames}.
        backend, compute_units, num_threads: as `runtime.load_model`.
    """

    def __init__(self, path, masks: LengthMasks, buckets: dict[str, int], backend: str = "auto",
                 compute_units: str = "all", num_threads: int | None = None):
        self.paths = [str(p) for p in path] if isinstance(path, (list, tuple)) else [str(path)]
        if not buckets:
            raise EncoderRuntimeError(f"{self.paths[0]}: the encoder lists no function")
        self.path = self.paths[0]
        self.masks = masks
        self.buckets = {fn: int(frames) for frames, fn in sorted((int(f), fn) for fn, f in buckets.items())}
        self.backend_name, self.compute_units, self.num_threads = backend, compute_units, num_threads
        self._models: dict = {}

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto", compute_units: str = "all",
             num_threads: int | None = None) -> EncoderRuntime:
        """From the package alone (its metadata: buckets and length-mask rule)."""
        info = encoder_package_info(path)
        buckets = {fn: int(v["frames"]) for fn, v in info["functions"].items()}
        paths = [os.path.join(os.path.dirname(os.fspath(path)), encoder_part_file(i)) if i else os.fspath(path)
                 for i in range(len(info["parts"]))]
        return cls(paths, package_length_masks(path), buckets, backend, compute_units, num_threads)

    @classmethod
    def from_bundle(cls, bundle, backend: str = "auto", compute_units: str = "all",
                    num_threads: int | None = None) -> EncoderRuntime:
        """From a loaded `bundle.Bundle` (its manifest's `encoder` entry)."""
        entry = bundle.manifest["encoder"]
        functions = entry.get("functions") or {"main": {"frames": entry["window_frames"]}}
        return cls([bundle.paths[part["file"]] for part in entry["parts"]], LengthMasks.from_manifest(entry["length_masks"]),
                   {fn: int(v["frames"]) for fn, v in functions.items()}, backend, compute_units, num_threads)

    @property
    def parts(self) -> int:
        return len(self.paths)

    def model(self, function_name: str = "main") -> PartChain:
        """The function through every part (loaded on first use)."""
        if function_name not in self._models:
            from ..runtime import load_model  # cohere_coreml.runtime imports torch; this module loads without it

            if function_name not in self.buckets:
                raise EncoderRuntimeError(f"{self.path} has no encoder function {function_name!r} "
                                          f"(functions: {sorted(self.buckets)})")
            self._models[function_name] = PartChain(
                load_model(p, backend=self.backend_name, compute_units=self.compute_units, function_name=function_name,
                           num_threads=self.num_threads) for p in self.paths)
        return self._models[function_name]

    def function_for(self, frames: int) -> str:
        """The function whose window has exactly `frames` mel frames."""
        fn = next((f for f, n in self.buckets.items() if n == int(frames)), None)
        if fn is None:
            raise ShapeError(f"features of {frames} frames match no encoder function {self.buckets}: pad them to one "
                             "(audio.pad_to_window)")
        return fn

    def inputs(self, features: np.ndarray, n_valid: int) -> dict[str, np.ndarray]:
        """The program's inputs: features (1, M, F) float32 and the fp16 length masks of `n_valid` frames."""
        features = np.asarray(features, dtype=np.float32)
        if features.ndim == 2:
            features = features[None]
        frames = int(features.shape[-1])
        return {FEATURES_INPUT: features, **self.masks.inputs(n_valid, frames)}

    def encode_windows(self, windows, function_name: str | None = None) -> list[dict[str, np.ndarray]]:
        """`encode` of each (features, n_valid) window (one function: the first window's), with one part of the
        encoder in memory at a time (loaded for these windows, freed before the next part; nothing kept), so
        that an encoder in parts never has all its programs loaded together. The same calls, hence outputs,
        as `encode` window by window."""
        from ..runtime import load_model  # as `model`

        inputs = [self.inputs(features, n_valid) for features, n_valid in windows]
        if not inputs:
            return []
        fn = function_name or self.function_for(inputs[0][FEATURES_INPUT].shape[-1])
        if fn not in self.buckets:
            raise EncoderRuntimeError(f"{self.path} has no encoder function {fn!r} (functions: {sorted(self.buckets)})")
        outs: list = [None] * len(inputs)
        for i, path in enumerate(self.paths):
            part = load_model(path, backend=self.backend_name, compute_units=self.compute_units, function_name=fn,
                              num_threads=self.num_threads)
            for k, x in enumerate(inputs):  # as PartChain.predict
                outs[k] = dict(part.predict(x if i == 0 else {HIDDEN_NAME: outs[k][HIDDEN_OUTPUT],
                                                              ENCODER_MASK: x[ENCODER_MASK]}))
            del part
        for out, (_, n_valid) in zip(outs, windows, strict=True):
            missing = [k for k in MEMORY_NAMES if k not in out]
            if missing:
                raise EncoderRuntimeError(f"the encoder package returned no {missing}")
            out["encoder_length"] = np.array([self.masks.encoder_length(n_valid)], dtype=np.int32)
        return outs

    def encode(self, features: np.ndarray, n_valid: int, function_name: str | None = None) -> dict[str, np.ndarray]:
        """features (M, F) or (1, M, F) float32 window -> the program's outputs + `encoder_length` (int32 (1,)).
        F selects the function (the full window, or a length bucket of exactly that many frames)."""
        inputs = self.inputs(features, n_valid)
        fn = function_name or self.function_for(inputs[FEATURES_INPUT].shape[-1])
        out = dict(self.model(fn).predict(inputs))
        missing = [k for k in MEMORY_NAMES if k not in out]
        if missing:
            raise EncoderRuntimeError(f"the encoder package returned no {missing}")
        out["encoder_length"] = np.array([self.masks.encoder_length(n_valid)], dtype=np.int32)
        return out
