"""`cohere-coreml ane-check`: a static census of every program of a bundle against the published
Neural Engine rules (docs/ane.md lists each rule, its source and what the exporter does about it).

Reads only each package's protobuf (`runtime.package.read_spec`) and the size of its weight file:
no weight is loaded, no model is compiled. For each function of each program (nested blocks of
control-flow ops included), in program order:

    * op counts by output dtype (consts and constexpr weights apart from the "compute" counts);
    * ops predicted off the Neural Engine, each with its rule and source: non-fp16 compute,
      gathers / scatters, control flow, recurrent ops, wide conv kernels, state writes at a
      runtime position;
    * hard violations (errors): weights over the platform's per-file limit, dynamic (symbolic /
      flexible) shapes, rank > 4 or a dimension over the Neural Engine's limits on an op that is
      otherwise eligible;
    * warnings: state dimensions that are not multiples of 32;
    * partitions: runs of consecutive ANE-eligible ops between predicted off-ANE ops.

`census(path)` returns a JSON-ready dict; `summary_line(report)` its one-line summary;
`write_report(bundle_dir)` writes `ane_check.json` into a bundle (export, quantize, finalize).
`device_placement(package)` (macOS only) is Core ML's own `MLComputePlan` placement per op.
Nothing here imports torch or transformers; coremltools' protobuf module is imported lazily.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

REPORT_FILE = "ane_check.json"
REPORT_VERSION = 1

GIB = 1 << 30
# bytes per weight file (one program) the Neural Engine accepts, by platform
WEIGHT_LIMITS = {"ios": GIB, "macos": 2 * GIB}
MAX_RANK = 4
MAX_HW = 16384  # height / width (the last two axes)
MAX_NC = 65536  # batch / channel (the axes before them)
MAX_CONV_KERNEL_WIDTH = 13
STATE_MULTIPLE = 32


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # "error" (hard violation), "off-ane" (predicted off the Neural Engine), "warning", "info"
    what: str
    source: str


RULES = {r.id: r for r in (
    Rule("weights-over-limit", "error",
         "a program's weight file is over the platform's limit (iOS 1 GiB, macOS 2 GiB per file)",
         "coremltools PR 2593 ('ane: Weight file size (2525476480 bytes) exceeds the maximum (2147483648 bytes)'); "
         "coremltools issue 2554 and Anemll issue 28 (iOS 18 refuses weight files over 1 GB)"),
    Rule("dynamic-shape", "error",
         "a symbolic (flexible) dimension in a function input, state or op output",
         "coremltools issues 1764 (flexible input shapes: CPU only), 1909 (EnumeratedShapes + layer_norm off the "
         "ANE), 2370 (RangeDim runs on the ANE only at its default shape)"),
    Rule("rank-over-4", "error", "a tensor of rank > 4 on an otherwise ANE-eligible op",
         "ANEMLL conversion rules (rank <= 4 on the ANE); ane-guide ch. 17 'Model-design rules'"),
    Rule("dim-over-limit", "error",
         f"a dimension over the ANE's limits on an otherwise ANE-eligible op: H/W (last two axes) > {MAX_HW}, "
         f"N/C (axes before) > {MAX_NC}",
         "ANEMLL conversion rules; ane-guide ch. 17 'Model-design rules' (W, H <= 16384, C <= 65536: one past "
         "rejects at compile time)"),
    Rule("non-fp16-compute", "off-ane", "an op computing in fp32 / int / bool (its output is not fp16)",
         "coremltools docs 'Typed Execution' (fp32 programs run on GPU/CPU; fp16 is what the ANE executes)"),
    Rule("gather-scatter", "off-ane", "gather / gather_nd / gather_along_axis / scatter* (index-driven reads/writes)",
         "coremltools issue 1103 ('gather operation only runs on CPU')"),
    Rule("control-flow", "off-ane", "cond / while_loop / list ops (no feed-forward form)",
         "aneforge capabilities ('not-authorable: control-flow / list / state ops'); the runtime docs list them "
         "as unsupported here too"),
    Rule("recurrent", "off-ane", "lstm / gru / rnn", "coremltools issue 1780 ('RNN or LSTM are not supported on the neural engine')"),
    Rule("conv-kernel-width", "off-ane", f"a conv whose kernel width is over {MAX_CONV_KERNEL_WIDTH}",
         "ane-guide ch. 17 'Model-design rules' ('Convolution kernel width is capped at 13')"),
    Rule("state-write-runtime-position", "off-ane",
         "a state written in the graph at a runtime position: write_state / coreml_update_state whose value comes "
         "from a slice_update / scatter with non-constant begin / end / indices (both ops are counted)",
         "FluidInference/mobius PR 77 ('ANECCompile -14'), coremltools issue 2553 (stateful KV-cache model cannot run "
         "on the ANE); mobius PR 78 (host-owned cache 'ANE-safe'). Counter-evidence: ANEMLL writes its KV state in "
         "the graph on the ANE"),
    Rule("state-write-in-graph", "info", "a state written in the graph at constant positions (not counted off the ANE)",
         "counter-evidence to mobius PR 77: ANEMLL writes state in the graph on the ANE"),
    Rule("state-dim-not-multiple-of-32", "warning",
         f"a state whose width (last axis, the one the report varied) is not a multiple of {STATE_MULTIPLE}",
         "coremltools issue 2631 (stateful model fails on the ANE when a state dimension is not a multiple of 32)"),
)}
DEFAULT_RULES = frozenset(RULES)

GATHER_SCATTER = {"gather", "gather_nd", "gather_along_axis", "scatter", "scatter_nd", "scatter_along_axis"}
CONTROL_FLOW = {"cond", "while_loop", "make_list", "list_length", "list_write", "list_read", "list_gather",
                "list_scatter"}
RECURRENT = {"lstm", "gru", "rnn"}
STATE_WRITES = {"write_state", "coreml_update_state"}
CONST_OPS_PREFIX = "constexpr_"
# ops through which a state write's value is traced back to the op that placed the update
_PASS_THROUGH = {"cast", "identity", "reshape", "transpose", "expand_dims", "squeeze"}
_POSITION_ARGS = {"slice_update": ("begin", "end"), "scatter": ("indices",), "scatter_nd": ("indices",),
                  "scatter_along_axis": ("indices",)}


class AneCheckError(ValueError):
    """A path that is not a bundle or package, or --device off macOS (one line, exit status 2)."""


# --------------------------------------------------------------------------------------------
# Reading the protobuf
# --------------------------------------------------------------------------------------------


def _dtype_names() -> dict[int, str]:
    from coremltools.proto import MIL_pb2  # heavy (coremltools): only when a package is read

    return {v: k.lower() for k, v in MIL_pb2.DataType.items()}


@dataclass
class _Tensor:
    dtype: str | None  # "float16"..., None for a non-tensor value
    shape: tuple  # ints, None for a symbolic dimension
    kind: str  # "tensor", "state", "list", ...


def _value_type(vt, dtypes) -> _Tensor:
    kind = vt.WhichOneof("type")
    if kind == "stateType":
        inner = _value_type(vt.stateType.wrappedType, dtypes)
        return _Tensor(inner.dtype, inner.shape, "state")
    if kind != "tensorType":
        return _Tensor(None, (), kind or "none")
    t = vt.tensorType
    shape = tuple(int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None for d in t.dimensions)
    return _Tensor(dtypes.get(t.dataType, str(t.dataType)), shape, "tensor")


def _op_name(op) -> str:
    attr = op.attributes.get("name") if "name" in op.attributes else None
    if attr is not None and attr.immediateValue.tensor.strings.values:
        return str(attr.immediateValue.tensor.strings.values[0])
    return op.outputs[0].name if op.outputs else op.type


def _walk(block, depth: int = 0):
    """Every op of `block` in program order, each followed by the ops of its nested blocks."""
    for op in block.operations:
        yield op, depth
        for inner in op.blocks:
            yield from _walk(inner, depth + 1)


def _tensor_args(op) -> list[str]:
    """Names of the variables an op reads (every input, in order, without repeats)."""
    names = []
    for key in op.inputs:
        for b in op.inputs[key].arguments:
            if b.WhichOneof("binding") == "name" and b.name not in names:
                names.append(b.name)
    return names


def _is_const(op) -> bool:
    return op.type == "const" or op.type.startswith(CONST_OPS_PREFIX)


def _shape_text(shape) -> list:
    return [d if d is not None else "?" for d in shape]


def _finding(fn: str, op_name: str, op_type: str, tensor: _Tensor | None, rule: str, detail: str = "") -> dict:
    r = RULES[rule]
    out = {"function": fn, "op": op_name, "op_type": op_type, "rule": rule, "severity": r.severity,
           "source": r.source}
    if tensor is not None:
        out.update(shape=_shape_text(tensor.shape), dtype=tensor.dtype)
    if detail:
        out["detail"] = detail
    return out


def _dim_problem(shape) -> str | None:
    """Why a rank <= 4 static shape breaks the ANE's dimension limits, or None."""
    n = len(shape)
    for i, d in enumerate(shape):
        if d is None:
            continue
        name = "NCHW"[MAX_RANK - n + i]  # axes aligned right: the last is W
        limit = MAX_HW if name in "HW" else MAX_NC
        if d > limit:
            return f"axis {i} ({name}) = {d} > {limit}"
    return None


def _function_census(fn_name: str, function, spec_function_description, rules: frozenset, dtypes) -> dict:
    block = function.block_specializations[function.opset]
    types: dict[str, _Tensor] = {}
    producers: dict[str, object] = {}
    const_names: set[str] = set()
    findings: list[dict] = []
    reported: set[tuple[str, str]] = set()  # (rule, tensor) already reported

    for inp in function.inputs:
        t = _value_type(inp.type, dtypes)
        types[inp.name] = t
        if "dynamic-shape" in rules and any(d is None for d in t.shape):
            findings.append(_finding(fn_name, inp.name, f"{t.kind} input", t, "dynamic-shape"))
            reported.add(("dynamic-shape", inp.name))
        if t.kind == "state" and "state-dim-not-multiple-of-32" in rules:
            width = t.shape[-1] if t.shape else None
            if width is not None and width % STATE_MULTIPLE:
                findings.append(_finding(fn_name, inp.name, "state", t, "state-dim-not-multiple-of-32",
                                         f"width (last axis) {width} is not a multiple of {STATE_MULTIPLE}"))
    if spec_function_description is not None and "dynamic-shape" in rules:
        for feature in spec_function_description.input:
            if feature.type.WhichOneof("Type") == "multiArrayType":
                flexible = feature.type.multiArrayType.WhichOneof("ShapeFlexibility")
                if flexible and ("dynamic-shape", feature.name) not in reported:
                    findings.append(_finding(fn_name, feature.name, "input", None, "dynamic-shape",
                                             f"{flexible} in the model description"))

    ops = list(_walk(block))
    for op, _ in ops:
        for out in op.outputs:
            types[out.name] = _value_type(out.type, dtypes)
            producers[out.name] = op
            if _is_const(op):
                const_names.add(out.name)

    def arg_names(op, key):
        return [b.name for b in op.inputs[key].arguments if b.WhichOneof("binding") == "name"] if key in op.inputs else []

    def constant(op, key) -> bool:
        return all(name in const_names for name in arg_names(op, key))

    def placing_op(name, seen=0):
        """The slice_update / scatter that produced a state write's value (through casts, reshapes...)."""
        op = producers.get(name)
        while op is not None and op.type in _PASS_THROUGH and seen < 16:
            names = arg_names(op, "x")
            op = producers.get(names[0]) if names else None
            seen += 1
        return op

    runtime_writes: set[int] = set()  # id() of the placing ops and of the writes (rule state-write-runtime-position)
    for op, _ in ops:
        if op.type not in STATE_WRITES:
            continue
        value_key = "data" if op.type == "write_state" else "value"
        names = arg_names(op, value_key)
        placer = placing_op(names[0]) if names else None
        at_runtime = (placer is not None and placer.type in _POSITION_ARGS
                      and not all(constant(placer, k) for k in _POSITION_ARGS[placer.type]))
        state = (arg_names(op, "input" if op.type == "write_state" else "state") or ["?"])[0]
        if at_runtime and "state-write-runtime-position" in rules:
            runtime_writes.update({id(op), id(placer)})
            keys = "/".join(_POSITION_ARGS[placer.type])
            findings.append(_finding(fn_name, _op_name(placer), placer.type, types.get(placer.outputs[0].name),
                                     "state-write-runtime-position", f"{keys} computed at run time; writes {state}"))
            findings.append(_finding(fn_name, _op_name(op), op.type, types.get(state), "state-write-runtime-position",
                                     f"writes state {state} from {placer.type} {_op_name(placer)}"))
        elif "state-write-in-graph" in rules:
            findings.append(_finding(fn_name, _op_name(op), op.type, types.get(state), "state-write-in-graph",
                                     f"writes state {state} at constant positions"))

    by_dtype: Counter = Counter()
    consts = 0
    sequence: list[bool] = []  # per compute op in program order: predicted off the ANE
    compute_types: list[str] = []
    off_ane: list[dict] = []
    for op, depth in ops:
        if _is_const(op):
            consts += 1
            continue
        out_types = [types[o.name] for o in op.outputs]
        dtype_set = {t.dtype for t in out_types if t.kind == "tensor"}
        label = ("state" if not out_types else "+".join(sorted(d for d in dtype_set if d)) or out_types[0].kind)
        by_dtype[label] += 1
        first = out_types[0] if out_types else None
        name = _op_name(op)
        reasons = []
        if op.type in GATHER_SCATTER and "gather-scatter" in rules:
            reasons.append(("gather-scatter", ""))
        if op.type in CONTROL_FLOW and "control-flow" in rules:
            reasons.append(("control-flow", ""))
        if op.type in RECURRENT and "recurrent" in rules:
            reasons.append(("recurrent", ""))
        if id(op) in runtime_writes:
            reasons.append(("state-write-runtime-position", ""))
        if "non-fp16-compute" in rules and dtype_set and dtype_set != {"float16"}:
            reasons.append(("non-fp16-compute", f"output dtype {label}"))
        if op.type == "conv" and "conv-kernel-width" in rules:
            weight = arg_names(op, "weight")
            kw = types[weight[0]].shape[-1] if weight and weight[0] in types and types[weight[0]].shape else None
            if kw is not None and kw > MAX_CONV_KERNEL_WIDTH:
                reasons.append(("conv-kernel-width", f"kernel width {kw}"))
        is_off = bool(reasons)
        sequence.append(is_off)
        compute_types.append(op.type)
        for rule, detail in reasons:
            if rule != "state-write-runtime-position":  # already listed with its placing op
                off_ane.append(_finding(fn_name, name, op.type, first, rule, detail))
        # shapes: a dynamic one anywhere (reported once, at the op that produces it); rank / dimension limits
        # on every tensor an otherwise ANE-eligible op reads or writes (each tensor reported once per rule)
        for o, t in zip(op.outputs, out_types):
            if "dynamic-shape" in rules and t.kind == "tensor" and any(d is None for d in t.shape) \
                    and not any(d is None for a in _tensor_args(op) if a in types for d in types[a].shape):
                findings.append(_finding(fn_name, name, op.type, t, "dynamic-shape", f"output {o.name}"))
        if is_off:
            continue
        vars_ = [o.name for o in op.outputs] + [a for a in _tensor_args(op) if a not in const_names and a in types]
        for var in vars_:
            t = types[var]
            if t.kind not in ("tensor", "state"):
                continue
            rule, problem = None, None
            if len(t.shape) > MAX_RANK:
                rule, problem = "rank-over-4", f"rank {len(t.shape)}"
            elif (problem := _dim_problem(t.shape)) is not None:
                rule = "dim-over-limit"
            if rule in rules and (rule, var) not in reported:
                reported.add((rule, var))
                findings.append(_finding(fn_name, name, op.type, t, rule, f"{problem} (tensor {var})"))

    findings = off_ane + findings
    runtime_count = sum(1 for f in findings if f["rule"] == "state-write-runtime-position")
    partitions = []
    run = 0
    for off in sequence:
        if off:
            if run:
                partitions.append(run)
            run = 0
        else:
            run += 1
    if run:
        partitions.append(run)
    compute = len(sequence)
    return {
        "ops": {"compute": compute, "const": consts, "by_dtype": dict(sorted(by_dtype.items()))},
        "fp16_compute": by_dtype.get("float16", 0),
        "off_ane_ops": sum(sequence),
        "off_ane_by_rule": dict(sorted(Counter(f["rule"] for f in findings if f["severity"] == "off-ane").items())),
        "off_ane_by_type": dict(sorted(Counter(t for t, off in zip(compute_types, sequence) if off).items())),
        "state_writes_at_runtime_position": runtime_count // 2,
        "partitions": len(partitions),
        "partition_sizes": partitions,
        "errors": sum(1 for f in findings if f["severity"] == "error"),
        "warnings": sum(1 for f in findings if f["severity"] == "warning"),
        "findings": findings,
    }


def _weight_bytes(package: Path) -> dict[str, int]:
    """{weight file (relative to the package): bytes} of a package, from its Manifest.json; nothing read."""
    from ..runtime.package import package_files

    weights_dir = package_files(package)[1]
    if weights_dir is None or not os.path.isdir(weights_dir):
        return {}
    out = {}
    for folder, _, names in os.walk(weights_dir):
        for name in sorted(names):
            path = Path(folder) / name
            out[path.relative_to(package).as_posix()] = path.stat().st_size
    return out


def program_census(package: str | os.PathLike, platform: str = "ios", rules: frozenset = DEFAULT_RULES,
                   weight_limit: int | None = None) -> dict:
    """The census of one `.mlpackage`: weights, and each function's op counts, findings and partitions."""
    from ..runtime.errors import PackageLoadError
    from ..runtime.package import read_spec

    package = Path(package)
    limit = WEIGHT_LIMITS[platform] if weight_limit is None else int(weight_limit)
    try:
        spec = read_spec(package)
    except PackageLoadError as err:
        raise AneCheckError(str(err)) from None
    if spec.WhichOneof("Type") != "mlProgram":
        raise AneCheckError(f"{package} is a {spec.WhichOneof('Type')!r} model, not an ML program")
    dtypes = _dtype_names()
    weights = _weight_bytes(package) if package.is_dir() else {}
    errors = []
    for rel, size in weights.items():
        if size > limit and "weights-over-limit" in rules:
            errors.append({"function": "*", "op": rel, "op_type": "weight file", "rule": "weights-over-limit",
                           "severity": "error", "source": RULES["weights-over-limit"].source,
                           "detail": f"{size:,} bytes > {limit:,} ({platform})"})
    described = {f.name: f for f in spec.description.functions}
    functions = {}
    for name in sorted(spec.mlProgram.functions.keys(), key=lambda n: (n != "main", n)):
        functions[name] = _function_census(name, spec.mlProgram.functions[name],
                                           described.get(name, spec.description if not described else None),
                                           rules, dtypes)
    compute = sum(f["ops"]["compute"] for f in functions.values())
    fp16 = sum(f["fp16_compute"] for f in functions.values())
    return {
        "weights": {"files": weights, "bytes": sum(weights.values()), "limit_bytes": limit,
                    "shared_by_functions": len(functions) > 1, "errors": errors},
        "spec_version": int(spec.specificationVersion),
        "fp16_program": fp16 > 0,  # False: an fp32 / int program (the front end: CPU/GPU by design)
        "compute_ops": compute,
        "errors": len(errors) + sum(f["errors"] for f in functions.values()),
        "functions": functions,
    }


def _is_package(path: Path) -> bool:
    return path.is_dir() and (path / "Manifest.json").is_file()


def programs_of(path: str | os.PathLike) -> dict[str, Path]:
    """{program label: package path} of a bundle folder (every `*.mlpackage` in it) or one package."""
    path = Path(path)
    if not path.exists():
        raise AneCheckError(f"{path}: no such file or folder (give a bundle folder or an .mlpackage)")
    if _is_package(path):
        return {path.name.removesuffix(".mlpackage"): path}
    if path.is_dir():
        found = {p.name.removesuffix(".mlpackage"): p for p in sorted(path.glob("*.mlpackage")) if _is_package(p)}
        if found:
            return found
    raise AneCheckError(f"{path} is neither a bundle folder holding .mlpackage files nor an .mlpackage "
                        "(a package folder has a Manifest.json)")


def census(path: str | os.PathLike, platform: str = "ios", rules: frozenset = DEFAULT_RULES,
           weight_limit: int | None = None) -> dict:
    """The census of a bundle folder or one package (JSON-ready; no machine paths: program labels only)."""
    if platform not in WEIGHT_LIMITS:
        raise AneCheckError(f"unknown platform {platform!r}; choose from {sorted(WEIGHT_LIMITS)}")
    programs = {label: program_census(pkg, platform, rules, weight_limit) for label, pkg in programs_of(path).items()}
    report = {
        "format": "cohere-coreml-ane-check", "version": REPORT_VERSION, "platform": platform,
        "weight_limit_bytes": WEIGHT_LIMITS[platform] if weight_limit is None else int(weight_limit),
        "rules": {rid: {"severity": r.severity, "what": r.what, "source": r.source}
                  for rid, r in RULES.items() if rid in rules},
        "errors": sum(p["errors"] for p in programs.values()),
        "programs": programs,
    }
    report["summary"] = summary_line(report)
    return report


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def summary_line(report: dict) -> str:
    """e.g. `ane-check (ios): 0 errors; decoder main 26 off-ANE ops / 10 partitions, bind_memory 4/1 (1.6 MB
    weights); encoder main 69 off-ANE ops / 11 partitions (5.2 MB weights); frontend fp32 program (CPU/GPU by
    design), 56 ops` (the first function of a program spelled out, the others `off-ANE ops/partitions`)."""
    parts = []
    for label, prog in report["programs"].items():
        if not prog["fp16_program"]:
            parts.append(f"{label} fp32 program (CPU/GPU by design), {prog['compute_ops']} ops")
            continue
        fns = []
        for i, (name, f) in enumerate(prog["functions"].items()):
            figures = (f"{_plural(f['off_ane_ops'], 'off-ANE op')} / {_plural(f['partitions'], 'partition')}"
                       if i == 0 else f"{f['off_ane_ops']}/{f['partitions']}")
            fns.append(f"{name} {figures}")
        size = prog["weights"]["bytes"]
        size = f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 1e6:.1f} MB"
        over = " OVER THE LIMIT" if prog["weights"]["errors"] else ""
        parts.append(f"{label} " + ", ".join(fns) + f" ({size} weights{over})")
    warnings = sum(f["warnings"] for p in report["programs"].values() for f in p["functions"].values())
    head = f"ane-check ({report['platform']}): {_plural(report['errors'], 'error')}"
    if warnings:
        head += f", {_plural(warnings, 'warning')}"
    return head + "; " + "; ".join(parts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def format_table(report: dict) -> str:
    """The human report: one row per function, then every error / warning and the off-ANE ops by rule."""
    lines = [f"{'program':<12} {'function':<16} {'compute':>7} {'fp16':>5} {'off-ANE':>7} {'parts':>5} "
             f"{'errors':>6}  off-ANE by type"]
    for label, prog in report["programs"].items():
        for name, f in prog["functions"].items():
            types = ", ".join(f"{t} {n}" for t, n in f["off_ane_by_type"].items())
            lines.append(f"{label:<12} {name:<16} {f['ops']['compute']:>7} {f['fp16_compute']:>5} "
                         f"{f['off_ane_ops']:>7} {f['partitions']:>5} {f['errors']:>6}  {types}")
        w = prog["weights"]
        shared = " (one file shared by every function)" if w["shared_by_functions"] else ""
        lines.append(f"{'':<12} weights {w['bytes']:,} bytes, limit {w['limit_bytes']:,}{shared}")
    notable = [f for p in report["programs"].values()
               for f in [*p["weights"]["errors"], *(x for fn in p["functions"].values() for x in fn["findings"])]
               if f["severity"] in ("error", "warning")]
    if notable:
        lines += ["", "errors and warnings:"]
        for f in notable:
            where = f"{f['function']}: {f['op_type']} {f['op']}"
            shape = f" {f.get('dtype')} {f['shape']}" if "shape" in f else ""
            lines.append(f"  {f['severity']} [{f['rule']}] {where}{shape} {f.get('detail', '')}".rstrip())
    runtime = [f for p in report["programs"].values() for fn in p["functions"].values() for f in fn["findings"]
               if f["rule"] == "state-write-runtime-position" and f["op_type"] in STATE_WRITES]
    if runtime:
        lines += ["", "state written at a runtime position (predicted off the ANE; counter-evidence: ANEMLL):"]
        lines += [f"  {f['function']}: {f['op']} {f.get('detail', '')}" for f in runtime]
    lines += ["", report["summary"]]
    return "\n".join(lines)


def write_report(bundle_dir: str | os.PathLike, platform: str = "ios", before_change=None) -> dict | None:
    """Write `ane_check.json` into a bundle (atomically, only when it changes; `before_change()` runs
    just before, e.g. removing a manifest the change makes stale). None when the folder has no package."""
    from ..storage.files import write_text_atomic

    root = Path(bundle_dir)
    if not any(_is_package(p) for p in root.glob("*.mlpackage")):
        return None
    report = census(root, platform=platform)
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    write_text_atomic(root / REPORT_FILE, text, if_changed=True, before_change=before_change)
    log = logger.warning if report["errors"] else logger.info
    log("%s", report["summary"])
    return report


def read_summary(bundle_dir: str | os.PathLike) -> str | None:
    """The summary line of a bundle's `ane_check.json`, if it has a readable one."""
    path = Path(bundle_dir) / REPORT_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("summary")
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------
# Core ML's placement (macOS): MLComputePlan per function, next to the static prediction
# --------------------------------------------------------------------------------------------


def _device_kind(device) -> str:
    name = type(device).__name__
    return {"MLNeuralEngineComputeDevice": "ane", "MLGPUComputeDevice": "gpu", "MLCPUComputeDevice": "cpu"}.get(
        name, name)


def device_placement(package: str | os.PathLike, compute_units: str = "ALL") -> dict:
    """{function: {"by_device": {ane|gpu|cpu|unknown: n}, "ops": {first output name: device}}} from
    coremltools 9's `MLComputePlan` of the compiled package (macOS only). The plan of a compiled
    multifunction package holds every function (`model_structure.program.functions[name]`)."""
    _require_macos()
    import coremltools as ct  # heavy: macOS only
    from coremltools.models.compute_plan import MLComputePlan
    from coremltools.models.utils import compile_model

    out = {}
    with tempfile.TemporaryDirectory(prefix="ane-check-") as tmp:
        compiled = compile_model(str(package), os.path.join(tmp, Path(package).stem + ".mlmodelc"))
        plan = MLComputePlan.load_from_path(compiled, compute_units=getattr(ct.ComputeUnit, compute_units))
        program = plan.model_structure.program
        if program is None:
            raise AneCheckError(f"{package}: Core ML's compute plan holds no ML program")
        for name, function in program.functions.items():
            by_device: Counter = Counter()
            ops = {}

            def visit(block, by_device=by_device, ops=ops):
                for op in block.operations:
                    if op.operator_name == "const" or op.operator_name.startswith(CONST_OPS_PREFIX):
                        continue
                    usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                    kind = _device_kind(usage.preferred_compute_device) if usage is not None else "unknown"
                    by_device[kind] += 1
                    if op.outputs:
                        ops[op.outputs[0].name] = {"device": kind, "op_type": op.operator_name}
                    for inner in op.blocks:
                        visit(inner)

            visit(function.block)
            out[name] = {"by_device": dict(sorted(by_device.items())), "ops": ops}
    return out


def _require_macos() -> None:
    if sys.platform != "darwin":
        raise AneCheckError("--device needs macOS: Core ML's MLComputePlan (coremltools.models.compute_plan) "
                            "is not available here; run ane-check without --device for the static census")


def compare_placement(static_fn: dict, device_fn: dict) -> dict:
    """Where Core ML's placement disagrees with the static prediction (by op output name)."""
    predicted_off = {f["op"] for f in static_fn["findings"] if f["severity"] == "off-ane"}
    on_ane_anyway = sorted(n for n, d in device_fn["ops"].items() if n in predicted_off and d["device"] == "ane")
    off_unpredicted = sorted(n for n, d in device_fn["ops"].items()
                             if n not in predicted_off and d["device"] not in ("ane", "unknown"))
    return {"predicted_off_but_on_ane": on_ane_anyway, "off_ane_not_predicted": off_unpredicted}


# --------------------------------------------------------------------------------------------
# Command: `cohere-coreml ane-check`
# --------------------------------------------------------------------------------------------


def cmd_ane_check(args) -> int:
    if args.device:
        _require_macos()
    report = census(args.path, platform=args.platform)
    if args.device:
        programs = programs_of(args.path)
        for label, pkg in programs.items():
            placement = device_placement(pkg)
            for name, fn in report["programs"][label]["functions"].items():
                if name in placement:
                    fn["device"] = {"by_device": placement[name]["by_device"],
                                    **compare_placement(fn, placement[name])}
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    elif args.summary:
        print(report["summary"])
    else:
        print(format_table(report))
        if args.device:
            for label, prog in report["programs"].items():
                for name, fn in prog["functions"].items():
                    d = fn.get("device")
                    if d:
                        print(f"device {label} {name}: {d['by_device']}; predicted off but on the ANE: "
                              f"{len(d['predicted_off_but_on_ane'])}; off the ANE, not predicted: "
                              f"{len(d['off_ane_not_predicted'])}")
    return 1 if report["errors"] else 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml ane-check`."""
    p = subparsers.add_parser(
        "ane-check", help="static census of a bundle's programs against the Neural Engine's published rules",
        description="Read every function of every program (protobuf only: no weights loaded, nothing compiled) "
        "and check it against the Neural Engine rules of docs/ane.md: weights per program against the platform's "
        "limit, op counts by dtype, ops predicted off the Neural Engine (non-fp16 compute, gathers, control flow, "
        "state writes at a runtime position...) and the partitions between them, rank / dimension limits and "
        "dynamic shapes (hard errors). Exit status 1 when a hard rule is broken, 2 for a bad path.")
    p.add_argument("path", metavar="BUNDLE_OR_PACKAGE", help="a bundle folder (every .mlpackage in it) or one .mlpackage")
    p.add_argument("--platform", choices=sorted(WEIGHT_LIMITS), default="ios",
                   help="weight-file limit: ios 1 GiB (default), macos 2 GiB per program")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON (what ane_check.json holds)")
    p.add_argument("--summary", action="store_true", help="print only the one-line summary")
    p.add_argument("--device", action="store_true",
                   help="macOS only: Core ML's own placement per op (coremltools MLComputePlan) next to the prediction")
    p.set_defaults(func=cmd_ane_check)
