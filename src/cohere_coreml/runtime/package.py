"""Reading ``.mlpackage`` files: spec, function selection, I/O descriptions, MIL program.

Shared by both backends. Descriptions are ``dict name -> (shape tuple, numpy dtype)``; a
flexible (symbolic) dimension is ``-1``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from .errors import PackageLoadError

logger = logging.getLogger(__name__)

# Core ML multiArray data types (FeatureTypes.proto ArrayDataType) -> numpy.
_ARRAY_DTYPES = {
    65552: np.float16,  # FLOAT16
    65568: np.float32,  # FLOAT32
    65600: np.float64,  # DOUBLE
    131104: np.int32,  # INT32
    131080: np.int8,  # INT8
}

Description = dict[str, tuple[tuple[int, ...], type]]


@dataclass
class PackageSpec:
    path: str
    spec: object  # coremltools.proto.Model_pb2.Model
    weights_dir: str | None
    function_name: str  # the selected function of the ML program
    function_names: list[str]


def package_files(path: str | os.PathLike) -> tuple[str, str | None]:
    """(spec file, weights folder or None) of an `.mlpackage`, from its Manifest.json, read only.

    coremltools' ModelPackage (behind `MLModel(path)` and `utils.load_spec`) rewrites Manifest.json on
    every open, through a visible `Manifest.<uuid>` temporary inside the package: a process killed
    then leaves that file in the bundle (and a read-only bundle cannot be opened). Reading the JSON
    here writes nothing."""
    path = os.fspath(path)
    try:
        with open(os.path.join(path, "Manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        entries = manifest["itemInfoEntries"]
        root = entries[manifest["rootModelIdentifier"]]["path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackageLoadError(f"cannot read model package {path}: its Manifest.json is unreadable ({exc})") from exc
    data = os.path.join(path, "Data")
    weights = next((e["path"] for e in entries.values()
                    if e.get("name") == "weights" and e.get("author") == "com.apple.CoreML"), None)
    return os.path.join(data, root), (os.path.join(data, weights) if weights is not None else None)


def read_spec(path: str | os.PathLike):
    """The `Model_pb2.Model` spec of an `.mlpackage` folder or `.mlmodel` file, without writing to it."""
    from coremltools.proto import Model_pb2  # heavy: importing the runtime (every cli command) loads no coremltools

    path = os.fspath(path)
    spec_file = package_files(path)[0] if os.path.isdir(path) else path
    spec = Model_pb2.Model()
    try:
        with open(spec_file, "rb") as f:
            spec.ParseFromString(f.read())
    except Exception as exc:  # OSError, protobuf DecodeError
        raise PackageLoadError(f"cannot read model package {path}: {exc}") from exc
    return spec


def _load_spec(path: str):
    if not os.path.exists(path):
        raise PackageLoadError(f"model package not found: {path}")
    weights_dir = package_files(path)[1] if os.path.isdir(path) else None
    return read_spec(path), weights_dir


def read_package(path: str | os.PathLike, function_name: str | None = None) -> PackageSpec:
    """Read the spec of an ML program package and resolve which function to use."""
    path = os.fspath(path)
    spec, weights_dir = _load_spec(path)
    if spec.WhichOneof("Type") != "mlProgram":
        raise PackageLoadError(
            f"{path} is a {spec.WhichOneof('Type')!r} model; only ML programs are supported"
        )
    names = list(spec.mlProgram.functions.keys())
    if function_name is None:
        function_name = spec.description.defaultFunctionName or "main"
        if function_name not in names and len(names) == 1:
            function_name = names[0]
    if function_name not in names:
        raise PackageLoadError(
            f"function {function_name!r} not in {path}; available functions: {sorted(names)}"
        )
    return PackageSpec(path, spec, weights_dir, function_name, names)


def _feature_shape_dtype(feature_type) -> tuple[tuple[int, ...], type]:
    kind = feature_type.WhichOneof("Type")
    if kind == "stateType":
        array = feature_type.stateType.arrayType
    elif kind == "multiArrayType":
        array = feature_type.multiArrayType
    else:
        raise PackageLoadError(f"unsupported feature type {kind!r} (only multi-arrays and states)")
    dtype = _ARRAY_DTYPES.get(array.dataType)
    if dtype is None:
        raise PackageLoadError(f"unsupported multi-array data type {array.dataType}")
    shape = tuple(int(d) for d in array.shape)
    flexible = array.WhichOneof("ShapeFlexibility") if kind == "multiArrayType" else None
    if flexible == "shapeRange":
        ranges = array.shapeRange.sizeRanges
        shape = tuple(
            int(r.lowerBound) if r.lowerBound == r.upperBound else -1 for r in ranges
        )
    elif flexible == "enumeratedShapes":
        shapes = [tuple(s.shape) for s in array.enumeratedShapes.shapes]
        shape = tuple(
            int(dims[0]) if len(set(dims)) == 1 else -1 for dims in zip(*shapes)
        )
    return shape, dtype


def describe(pkg: PackageSpec) -> tuple[Description, Description, Description]:
    """(inputs, outputs, states) descriptions of the selected function, from the spec."""
    desc = pkg.spec.description
    if len(desc.functions) > 0:
        fdesc = next((f for f in desc.functions if f.name == pkg.function_name), None)
        if fdesc is None:
            raise PackageLoadError(f"no description for function {pkg.function_name!r}")
    else:
        fdesc = desc
    inputs = {f.name: _feature_shape_dtype(f.type) for f in fdesc.input}
    outputs = {f.name: _feature_shape_dtype(f.type) for f in fdesc.output}
    states = {f.name: _feature_shape_dtype(f.type) for f in fdesc.state}
    return inputs, outputs, states


def load_mil_function(pkg: PackageSpec):
    """Load the selected function of the package as a PyMIL ``Function``.

    Uses coremltools' own milproto loader on a copy of the program that holds only the
    selected function, so the weights of other functions are never read.
    """
    from coremltools import proto  # heavy (see read_spec)
    from coremltools.converters.mil.frontend.milproto.load import load_mil_proto  # heavy (see read_spec)

    program = proto.MIL_pb2.Program()
    program.CopyFrom(pkg.spec.mlProgram)
    for name in list(program.functions.keys()):
        if name != pkg.function_name:
            del program.functions[name]
    if pkg.weights_dir is None and _uses_blob_file(program):
        raise PackageLoadError(f"{pkg.path}: the program references a weight file but none found")
    try:
        prog = load_mil_proto(
            program, pkg.spec.specificationVersion, file_weights_dir=pkg.weights_dir or ""
        )
    except Exception as exc:
        raise PackageLoadError(
            f"cannot load MIL function {pkg.function_name!r} of {pkg.path}: {exc}"
        ) from exc
    return prog.functions[pkg.function_name]


def _uses_blob_file(program) -> bool:
    return b"weight.bin" in program.SerializeToString()
