"""Package io checks (`Bundle.load`): every function the manifest names exists in its package, no
package has a function the manifest omits, and each function's inputs, outputs and states equal the
manifest's `io` block (read once per package contents: size and mtime of every file).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from .format import BundleError
from .packages import package_io

if TYPE_CHECKING:  # Bundle.load calls check_packages
    from .load import Bundle


def _package_stamp(path: Path) -> tuple:
    """What identifies a package's contents cheaply (every file's size and mtime)."""
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in path.rglob("*") if p.is_file()))


@functools.lru_cache(maxsize=64)
def _cached_package_io(path: str, function_name: str | None, stamp: tuple) -> tuple[dict, str, tuple[str, ...]]:
    from ..runtime.package import read_package  # cohere_coreml.runtime imports torch; bundle loads without it

    spec = read_package(path, function_name=function_name)
    return package_io(path, spec.function_name), spec.function_name, tuple(sorted(spec.function_names))


def check_packages(bundle: Bundle, where: str) -> None:
    """Every function the manifest names exists in its package, the package has no function the
    manifest omits, and each function's inputs/outputs/states equal the manifest's `io` block."""
    from ..runtime.errors import RuntimeBackendError  # cohere_coreml.runtime imports torch; bundle loads without it

    m = bundle.manifest
    dec = m["decoder"]
    listed = {part["file"]: {name: (fn["io"], f"encoder.parts[{i}].functions.{name}")
                             for name, fn in part["functions"].items()}
              for i, part in enumerate(m["encoder"]["parts"])}
    listed["decoder"] = {dec["functions"]["step"]: (dec["io"], "decoder.functions.step")}
    if dec["functions"].get("bind") is not None:  # null in a host-state decoder
        listed["decoder"][dec["functions"]["bind"]] = (dec["bind_io"], "decoder.functions.bind")
    if dec["functions"].get("prefill") is not None:
        listed["decoder"][dec["functions"]["prefill"]] = (dec["prefill_io"], "decoder.functions.prefill")
    if dec["functions"].get("extend") is not None:
        listed["decoder"][dec["functions"]["extend"]] = (dec["extend_io"], "decoder.functions.extend")
    if dec["functions"].get("step_batch") is not None:  # the batched step (absent without it; checks._check_batch)
        listed["decoder"][dec["functions"]["step_batch"]] = (dec["batch"]["io"], "decoder.functions.step_batch")
    if dec.get("alignment") is not None:  # word timings' align function (null / absent without it)
        listed["decoder"][dec["alignment"]["function"]] = (dec["alignment"]["io"], "decoder.alignment.function")
    if m.get("frontend") is not None:
        listed["frontend"] = {name: (fn["io"], f"frontend.functions.{name}")
                              for name, fn in m["frontend"]["functions"].items()}
    if m.get("vad") is not None:
        listed["vad"] = {name: (fn["io"], f"vad.functions.{name}") for name, fn in m["vad"]["functions"].items()}
    for component, functions in listed.items():
        path = bundle.paths[component]
        stamp = _package_stamp(path)
        try:
            _, default, present = _cached_package_io(str(path), None, stamp)
        except RuntimeBackendError as err:
            raise BundleError(f"{where}: files.{component} ({path.name}) is not a readable package: {err}") from err
        if component == "decoder" and dec["functions"]["step"] != default:
            raise BundleError(f"{where}: field 'decoder.functions.step' is {dec['functions']['step']!r} but "
                              f"{path.name}'s default function is {default!r}")
        if sorted(functions) != list(present):
            raise BundleError(f"{where}: {component} functions {sorted(functions)} (manifest) differ from the "
                              f"functions of {path.name} {list(present)}")
        for name, (io, field_name) in functions.items():
            actual, _, _ = _cached_package_io(str(path), name, stamp)
            if actual != io:
                diff = next((f"{kind}.{array}: package {actual[kind].get(array)}, manifest {io[kind].get(array)}"
                             for kind in ("inputs", "outputs", "states")
                             for array in sorted(set(actual[kind]) | set(io[kind]))
                             if actual[kind].get(array) != io[kind].get(array)), "extra keys")
                raise BundleError(f"{where}: field '{field_name}' io differs from function {name!r} of {path.name} "
                                  f"({diff})")
