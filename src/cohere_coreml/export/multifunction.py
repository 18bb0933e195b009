"""Merge single-function ML program packages into one multifunction package, one tensor at a time.

`coremltools.utils.save_multifunction` loads every source package into a pyMIL program (all of
their weights in memory at once: six copies of the encoder's for five length buckets), deduplicates
the constants across functions, then writes the program back. This module writes the same package
from the protobufs alone: each source's `main` function is copied into the merged program as is,
and each weight blob it references is read (`coremltools.libmilstoragepython._BlobStorageReader`),
hashed, written once to the merged weight file (`_BlobStorageWriter`, the writer coremltools' own
exporter uses) and its `BlobFileValue` pointed at the new offset. Beyond the protobufs, one
tensor is in memory at a time (the blob read, and the reader's mapped pages of it: a reader is
opened per blob, since one keeps every page it has read resident).

What coremltools does and this module reproduces:

* model description: one `FunctionDescription` per function (the source's inputs, outputs, states,
  predicted feature names), `defaultFunctionName`; no metadata (the caller sets it);
* specification version: the largest of the sources', at least iOS 18 (multifunction); program
  version 1 and no program attributes (the sources' `buildInfo` is dropped);
* weights: `@model_path/weights/weight.bin`, blobs written in function order, then in the order
  of the source's weight file (the order coremltools' exporter wrote them in), identical blobs
  (same dtype, shape and values) stored once, across and within functions: on our packages the
  weight file is byte for byte the one save_multifunction writes (tests/export/test_multifunction.py).

Differences (the graphs compute the same functions): a blob is shared only when its bytes are equal
(coremltools also shares values within `atol` 6e-8 (fp16) / 1e-12 (fp32), e.g. -0.0 and 0.0), and
the ops are copied verbatim. coremltools re-exports them through pyMIL, which renames the
ops of a stateful program's state updates (the `write_state`/`read_state` pairs of
`coreml_update_state_<n>`, numbered across the functions it loads; the ops' outputs keep their
names) and would drop a const op duplicating another const of the same function (our
converter's pass pipeline has already dropped those). Blob dtypes coremltools' storage cannot read
or write (none in our packages) are left to `convert.merge_functions`' fallback.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import coremltools as ct
import numpy as np
from coremltools.libmilstoragepython import _BlobStorageReader as BlobReader
from coremltools.libmilstoragepython import _BlobStorageWriter as BlobWriter
from coremltools.proto import MIL_pb2, Model_pb2

logger = logging.getLogger(__name__)

# Multifunction models need Core ML 8 (iOS 18 / macOS 15): specification version 9.
MULTIFUNCTION_SPEC_VERSION = 9
SOURCE_FUNCTION = "main"
WEIGHTS_FILE = "weight.bin"
# the file name coremltools' exporter writes into every BlobFileValue
WEIGHTS_FILE_VALUE = "@model_path/weights/" + WEIGHTS_FILE

# MIL blob dtype -> (reader method, writer method) of coremltools' blob storage: every dtype the
# storage reads and writes (fp16 travels as its uint16 bit pattern; sub-byte types one value per byte).
BLOB_IO = {
    MIL_pb2.FLOAT16: ("read_fp16_data", "write_fp16_data"),
    MIL_pb2.FLOAT32: ("read_float_data", "write_float_data"),
    MIL_pb2.INT8: ("read_int8_data", "write_int8_data"),
    MIL_pb2.UINT8: ("read_uint8_data", "write_uint8_data"),
    MIL_pb2.INT16: ("read_int16_data", "write_int16_data"),
    MIL_pb2.UINT16: ("read_uint16_data", "write_uint16_data"),
    MIL_pb2.INT32: ("read_int32_data", "write_int32_data"),
    MIL_pb2.UINT32: ("read_uint32_data", "write_uint32_data"),
    MIL_pb2.INT4: ("read_int4_data", "write_int4_data"),
    MIL_pb2.UINT1: ("read_uint1_data", "write_uint1_data"),
    MIL_pb2.UINT2: ("read_uint2_data", "write_uint2_data"),
    MIL_pb2.UINT3: ("read_uint3_data", "write_uint3_data"),
    MIL_pb2.UINT4: ("read_uint4_data", "write_uint4_data"),
    MIL_pb2.UINT6: ("read_uint6_data", "write_uint6_data"),
}


def _values(block: MIL_pb2.Block) -> Iterator[MIL_pb2.Value]:
    """Every Value of a block's ops, nested blocks included, in op order (attributes, then inputs)."""
    for op in block.operations:
        for name in op.attributes:
            yield op.attributes[name]
        for name in op.inputs:
            for arg in op.inputs[name].arguments:
                if arg.WhichOneof("binding") == "value":
                    yield arg.value
        for inner in op.blocks:
            yield from _values(inner)


def blob_values(function: MIL_pb2.Function) -> Iterator[MIL_pb2.Value]:
    """The BlobFileValues (weights kept in the weight file) of a function, in op order."""
    for opset in function.block_specializations:
        for value in _values(function.block_specializations[opset]):
            if value.WhichOneof("value") == "blobFileValue":
                yield value


def unsupported_blob_dtypes(spec: Model_pb2.Model) -> set[str]:
    """Names of the blob dtypes in `spec`'s ML program that the lean merge cannot copy."""
    found = set()
    for function in spec.mlProgram.functions.values():
        for value in blob_values(function):
            dtype = value.type.tensorType.dataType
            if dtype not in BLOB_IO:
                found.add(MIL_pb2.DataType.Name(dtype))
    return found


def _function_description(spec: Model_pb2.Model, name: str) -> Model_pb2.FunctionDescription:
    """The source's description of its function `main` under the merged name (as save_multifunction)."""
    desc = spec.description
    if not desc.functions:
        return Model_pb2.FunctionDescription(
            name=name, input=desc.input, output=desc.output, state=desc.state,
            predictedFeatureName=desc.predictedFeatureName,
            predictedProbabilitiesName=desc.predictedProbabilitiesName)
    for func in desc.functions:
        if func.name == SOURCE_FUNCTION:
            res = Model_pb2.FunctionDescription()
            res.CopyFrom(func)
            res.name = name
            return res
    raise ValueError(f"the package has no function {SOURCE_FUNCTION!r}")


def blob_key(tensor: MIL_pb2.TensorType, data: np.ndarray) -> tuple:
    """What makes two blobs the same weight: dtype, shape and the values' bytes."""
    shape = tuple(d.constant.size for d in tensor.dimensions)
    return tensor.dataType, shape, hashlib.sha256(np.ascontiguousarray(data).view(np.uint8)).hexdigest()


class _BlobCopier:
    """Copies blobs into one weight file, each distinct (dtype, shape, bytes) once."""

    def __init__(self, path: Path):
        self.writer = BlobWriter(str(path))
        self.offsets: dict[tuple, int] = {}  # (dtype, shape, sha256) -> offset in the merged file
        self.written = 0
        self.shared = 0

    def copy(self, reader: BlobReader, value: MIL_pb2.Value) -> None:
        """Copy the blob `value` points at (read through `reader`), and point `value` at the copy."""
        tensor = value.type.tensorType
        read, write = BLOB_IO[tensor.dataType]
        data = getattr(reader, read)(value.blobFileValue.offset)  # 1-D, one element per value
        key = blob_key(tensor, data)
        offset = self.offsets.get(key)
        if offset is None:
            offset = getattr(self.writer, write)(np.ascontiguousarray(data))
            self.offsets[key] = offset
            self.written += 1
        else:
            self.shared += 1
        value.blobFileValue.fileName = WEIGHTS_FILE_VALUE
        value.blobFileValue.offset = offset


def _weights_file(package: Path, file_value: str) -> Path:
    # a BlobFileValue names "@model_path/weights/<file>"; the package keeps it in its weights folder
    return Path(package) / "Data" / "com.apple.CoreML" / "weights" / file_value.split("/")[-1]


def write_multifunction(singles: Mapping[str, Path], default: str, destination: Path) -> None:
    """Write the multifunction package `destination` from single-function packages.

    Each package's `main` becomes the function named by its key (in the mapping's order), `default`
    the default function. The packages' metadata is dropped (as save_multifunction does).
    """
    if default not in singles:
        raise ValueError(f"default function {default!r} is not one of the functions {list(singles)}")
    merged = Model_pb2.Model()
    spec_version = MULTIFUNCTION_SPEC_VERSION
    with tempfile.TemporaryDirectory(dir=Path(destination).parent, prefix="weights-") as tmp:
        copier = _BlobCopier(Path(tmp) / WEIGHTS_FILE)
        functions = []
        for name, package in singles.items():
            spec = ct.utils.load_spec(str(package))  # the protobuf only: weights stay on disk
            if spec.WhichOneof("Type") != "mlProgram":
                raise ValueError(f"{package} is not an ML program")
            spec_version = max(spec_version, spec.specificationVersion)
            function = spec.mlProgram.functions[SOURCE_FUNCTION]
            # in the order the source's blobs were written (coremltools' exporter's order, which its
            # re-export in save_multifunction repeats; not always the op order: a constexpr's data
            # goes before its scales)
            values = sorted(blob_values(function), key=lambda v: (v.blobFileValue.fileName, v.blobFileValue.offset))
            for value in values:
                # a reader per blob: a reader maps its file and keeps every page it read resident
                # (the whole weight file by the end), a new one holds only this blob's
                copier.copy(BlobReader(str(_weights_file(package, value.blobFileValue.fileName))), value)
            merged.mlProgram.functions[name].CopyFrom(function)
            functions.append(_function_description(spec, name))
            del spec, function
        logger.debug("merged %d functions: %d weight blobs written, %d shared", len(functions),
                    copier.written, copier.shared)
        del copier  # the writer flushes and closes the file when destroyed
        merged.specificationVersion = spec_version
        merged.mlProgram.version = 1  # what coremltools' exporter writes
        merged.description.functions.extend(functions)
        merged.description.defaultFunctionName = default
        ct.utils.save_spec(merged, str(destination), weights_dir=tmp)


__all__ = ["write_multifunction", "unsupported_blob_dtypes", "blob_values", "blob_key", "BLOB_IO",
           "MULTIFUNCTION_SPEC_VERSION"]
