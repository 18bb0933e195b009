"""The package's layout: one folder per stage, imports one way between them, no import cycle, folders
and modules of a readable size.

Stages, lowest first: each may import only the stages before it, as its `__init__` docstring declares
("May import:"), and the top-level shared modules (settings, export errors, shared CLI options). The CLI
(`cohere_coreml.cli`) sits above all of them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cohere_coreml

PACKAGE_DIR = Path(cohere_coreml.__file__).parent
SWIFT_DIR = PACKAGE_DIR.parents[1] / "swift"

STAGES = ("runtime", "storage", "model", "bundle", "inference", "export", "evaluation", "publish", "quantize")
SHARED = {"cohere_coreml", "cohere_coreml.config", "cohere_coreml.export_errors", "cohere_coreml.cli_options"}
APEX = {"cohere_coreml.cli"}
PACKAGE_DATA = "cohere_coreml.data"  # files copied into bundles (example_inference.py), not imported
MAX_MODULES_PER_FOLDER = 15
MAX_MODULE_LINES = 700
# the interpreter's op table (one entry per MIL op); the example a bundle ships, one file an app developer copies
# and runs with coremltools alone (it cannot import a sibling module)
LONG_MODULES = {"runtime/ops.py", "data/example_inference.py"}
MAX_SWIFT_FILES_PER_FOLDER = 8


# --------------------------------------------------------------------------------------------
# Import graph
# --------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """module -> package modules it imports (module level AND inside functions; not the annotations-only
    imports under `if TYPE_CHECKING:`, which never run)."""
    modules = {_module_name(p): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix = base[: len(base) - node.level + 1] if node.level else []
                mod = ".".join(prefix + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module itself
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def stage_of(module: str) -> str:
    """The stage folder of a module, "shared" for the top-level shared modules, "cli" for the CLI."""
    if module in SHARED:
        return "shared"
    if module in APEX:
        return "cli"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in STAGES:
        return parts[1]
    raise AssertionError(f"{module} belongs to no stage: put it in a stage folder (tests/test_layout.py STAGES)")


def declared_imports(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """stage -> the stages its `__init__` docstring says it may import ("May import: a, b (and ...)")."""
    out = {}
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((package_dir / stage / "__init__.py").read_text())) or ""
        match = re.search(r"^May import: (.*?)(?:\n\s*\n|\Z)", doc, re.M | re.S)  # to the paragraph's end
        assert match, f"{stage}/__init__.py: its docstring has no 'May import:' line"
        text = re.sub(r"\([^)]*\)", "", match.group(1))  # "(the gates run ...)", "(and the config)": notes
        words = re.findall(r"[a-z_]+", text)
        out[stage] = {w for w in words if w in STAGES}
        assert out[stage] or "nothing" in words, f"{stage}: 'May import:' names no stage (or 'nothing')"
    return out


def layering_violations(graph: dict[str, set[str]], declared: dict[str, set[str]]) -> list[str]:
    """Every import that goes up (to a later stage) or across to a stage the importer does not declare."""
    found = []
    for module, targets in sorted(graph.items()):
        if module == PACKAGE_DATA or module.startswith(PACKAGE_DATA + "."):
            continue
        src = stage_of(module)
        for target in sorted(targets):
            dst = stage_of(target)
            if dst == src or dst == "shared" or src == "cli":
                continue
            if src == "shared" or dst == "cli" or dst not in declared[src]:
                found.append(f"{module} ({src}) imports {target} ({dst})")
    return found


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_package_has_no_import_cycle():
    graph = import_graph()
    assert "cohere_coreml.export.pipeline" in graph and "cohere_coreml.export.encoder" in graph["cohere_coreml.export.pipeline"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_each_stage_declares_only_stages_before_it():
    for stage, allowed in declared_imports().items():
        later = {s for s in allowed if STAGES.index(s) >= STAGES.index(stage)}
        assert not later, f"{stage}/__init__.py may import {sorted(later)}: a stage imports only the stages before it"


def test_imports_run_one_way_between_stages():
    graph = import_graph()
    assert len(graph) > 60  # the whole package is seen
    assert not layering_violations(graph, declared_imports())


def test_a_planted_back_import_is_refused():
    graph = import_graph()
    declared = declared_imports()
    for module, target in (("cohere_coreml.model.audio", "cohere_coreml.inference.transcribe"),  # up
                           ("cohere_coreml.bundle.load", "cohere_coreml.export.gate"),  # up
                           ("cohere_coreml.config", "cohere_coreml.storage.files"),  # shared -> a stage
                           ("cohere_coreml.runtime.interpreter", "cohere_coreml.cli")):  # to the CLI
        planted = {k: set(v) for k, v in graph.items()}
        planted[module].add(target)
        assert layering_violations(planted, declared) == [
            f"{module} ({stage_of(module)}) imports {target} ({stage_of(target)})"]
    # a declared stage is allowed, an undeclared lower one is not: inference declares no export
    planted = {k: set(v) for k, v in graph.items()}
    planted["cohere_coreml.export.gate"].add("cohere_coreml.inference.decoding")
    assert not layering_violations(planted, declared)
    declared_less = {**declared, "export": declared["export"] - {"inference"}}
    assert layering_violations(planted, declared_less)


def test_the_declared_lists_are_read_from_the_docstrings(tmp_path):
    for stage in STAGES:
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "__init__.py").write_text(f'"""{stage}.\n\nMay import: runtime (and config).\n"""\n')
    assert declared_imports(tmp_path)["model"] == {"runtime"}
    (tmp_path / "model" / "__init__.py").write_text('"""model."""\n')
    try:
        declared_imports(tmp_path)
    except AssertionError as err:
        assert "May import" in str(err)
    else:
        raise AssertionError("a stage without a 'May import:' line was accepted")


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def test_folders_and_modules_are_of_a_readable_size():
    folders = {p.parent for p in PACKAGE_DIR.rglob("*.py")}
    for folder in folders:
        modules = sorted(p.name for p in folder.glob("*.py"))
        assert len(modules) <= MAX_MODULES_PER_FOLDER, (folder.relative_to(PACKAGE_DIR), len(modules))
    for path in PACKAGE_DIR.rglob("*.py"):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        lines = len(path.read_text().splitlines())
        assert rel in LONG_MODULES or lines <= MAX_MODULE_LINES, f"{rel}: {lines} lines (split it by job)"


def duplicate_module_names(package_dir: Path = PACKAGE_DIR) -> dict[str, list[str]]:
    """file name -> the modules sharing it (`__init__.py` aside): a name says which module it is."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path.relative_to(package_dir).as_posix())
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_module_file_names_are_distinct(tmp_path):
    assert not duplicate_module_names(), duplicate_module_names()
    for folder in ("export", "quantize"):  # a planted second gate.py is found
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "gate.py").write_text("")
        (tmp_path / folder / "__init__.py").write_text("")
    assert duplicate_module_names(tmp_path) == {"gate.py": ["export/gate.py", "quantize/gate.py"]}


def test_every_module_lives_in_a_stage_folder():
    for module in import_graph():
        if module != PACKAGE_DATA and not module.startswith(PACKAGE_DATA + "."):
            stage_of(module)  # raises for a module outside every stage


def test_swift_folders_hold_at_most_eight_files():
    folders = {p.parent for p in SWIFT_DIR.rglob("*.swift")}
    assert len(folders) > 5
    for folder in folders:
        files = list(folder.glob("*.swift"))
        assert len(files) <= MAX_SWIFT_FILES_PER_FOLDER, (folder.relative_to(SWIFT_DIR), len(files))
