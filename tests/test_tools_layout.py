"""tools/ by purpose: a few folders at its top, an index (tools/README.md) naming every script in one
line, no orphan script, no path to a script that is not there.

A script is wired in when something outside the index names it: the Makefile, a test, the package, the
Swift tests, the docs, the README or another script, by its file name (`bench_runtime.py`, with or without
its folder) or as tests load it (`load_tool("bench/bench_runtime")`). The dev package
(tools/cohere_coreml_dev) is imported, not run: its modules are not scripts.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TOP_LEVEL = 8
DEV_PACKAGE = "cohere_coreml_dev"
INDEX = "tools/README.md"
THIS_TEST = "tests/test_tools_layout.py"  # plants stray and stale names in its copies of the repository
NOT_WIRING = (INDEX, THIS_TEST)  # they name scripts without running them
# where a script may be named; the changelog is history, not wiring
CODE_PLACES = ("Makefile", "pyproject.toml", "Package.swift", ".ci", "src", "swift", "tests", "tools", "models",
               "exports")
DOC_PLACES = ("README.md", "CONTRIBUTING.md", "BENCHMARKS.md", "docs")
TEXT_SUFFIXES = {".py", ".md", ".swift", ".toml", ".txt", ".sh", ".yml", ".yaml", ".cfg", ".json"}
TEXT_NAMES = {"Makefile", "run"}
SKIP_DIRS = {"__pycache__", ".build", ".venv", "out", ".git"}
# a repository path of a script: tools/<folders>/<name>.py (not coremltools/..., swift-tools-version)
TOOL_PATH = re.compile(r"(?<![\w.-])tools/((?:[\w-]+/)*[\w-]+\.py)\b")


def top_level(root: Path) -> list[str]:
    """The entries at the top of tools/ (not caches, not hidden files)."""
    return sorted(p.name for p in (root / "tools").iterdir() if p.name not in SKIP_DIRS and not p.name.startswith("."))


def scripts(root: Path) -> list[str]:
    """Every script under tools/, as a path relative to tools/ (the dev package's modules are not scripts)."""
    tools = root / "tools"
    return sorted(p.relative_to(tools).as_posix() for p in tools.rglob("*.py")
                  if DEV_PACKAGE not in p.relative_to(tools).parts and "__pycache__" not in p.parts)


def index_entries(root: Path) -> list[str]:
    """The scripts tools/README.md lists: the first `code` of each list item that names a .py file."""
    return re.findall(r"^- `([^`]+\.py)`", (root / INDEX).read_text(), flags=re.MULTILINE)


def text_files(root: Path, places) -> dict[str, str]:
    """path relative to root -> text, for the text files of `places` (files or folders)."""
    out = {}
    for place in places:
        base = root / place
        if base.is_file():
            out[place] = base.read_text(errors="replace")
            continue
        for folder, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            for name in files:
                path = Path(folder) / name
                if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                    out[path.relative_to(root).as_posix()] = path.read_text(errors="replace")
    return out


# a file name (bench_runtime.py, also inside tools/bench/bench_runtime.py) and a folder/name pair
# (load_tool("bench/bench_runtime"), bench/bench_runtime.py), every one of them, overlapping ones too
FILE_NAME = re.compile(r"(?<![\w-])([\w-]+\.py)\b")
FOLDER_NAME = re.compile(r"(?<![\w-])(?=([\w-]+/[\w-]+)\b)")


def orphans(root: Path) -> list[str]:
    """The scripts nothing but the index (and the script itself) names."""
    named: dict[str, set[str]] = {}  # file name or folder/stem -> files naming it
    for path, text in text_files(root, CODE_PLACES + DOC_PLACES).items():
        if path not in NOT_WIRING:
            for token in {*FILE_NAME.findall(text), *FOLDER_NAME.findall(text)}:
                named.setdefault(token, set()).add(path)
    found = []
    for script in scripts(root):
        folder, _, name = script.rpartition("/")
        tokens = [name] + ([f"{folder}/{name.removesuffix('.py')}"] if folder else [])
        if not set().union(*(named.get(t, set()) for t in tokens)) - {f"tools/{script}"}:
            found.append(script)
    return found


def stale_paths(root: Path, places) -> list[str]:
    """`file:line: tools/...py` for every named script path that does not exist."""
    found = []
    for path, text in sorted(text_files(root, places).items()):
        if path == THIS_TEST:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in TOOL_PATH.finditer(line):
                if not (root / "tools" / match.group(1)).is_file():
                    found.append(f"{path}:{number}: {match.group(0)}")
    return found


def layout_problems(root: Path) -> list[str]:
    """Everything wrong with tools/'s layout, one line each (empty when all is well)."""
    problems = []
    top = top_level(root)
    if len(top) > MAX_TOP_LEVEL:
        problems.append(f"tools/ has {len(top)} entries at its top (at most {MAX_TOP_LEVEL}): {', '.join(top)}")
    listed, present = index_entries(root), scripts(root)
    problems += [f"not in {INDEX}: tools/{s}" for s in present if s not in listed]
    problems += [f"{INDEX} names a script that is not there: tools/{s}" for s in listed if s not in present]
    problems += [f"{INDEX} names tools/{s} twice" for s in sorted({s for s in listed if listed.count(s) > 1})]
    names = [p.name for p in (root / "tools").rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"]
    problems += [f"two files named {n} under tools/" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"orphan (named nowhere but the index): tools/{s}" for s in orphans(root)]
    return problems


def test_tools_has_a_short_top_an_index_of_every_script_and_no_orphan():
    assert layout_problems(ROOT) == []
    assert len(scripts(ROOT)) >= 20 and "quantize_to_int8.py" in index_entries(ROOT)  # the index was read


def test_code_names_only_scripts_that_exist():
    """The Makefile, tests, package, Swift tests and scripts name tools/ paths that are there."""
    stale = stale_paths(ROOT, CODE_PLACES)
    assert not stale, "\n".join(stale)


def test_docs_name_only_scripts_that_exist():
    """README.md and docs/ name tools/ paths that are there."""
    stale = stale_paths(ROOT, DOC_PLACES)
    assert not stale, "\n".join(stale)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """The text files the checks read, copied (a planted mistake must not touch the checkout)."""
    copy = tmp_path_factory.mktemp("repo")
    for rel in text_files(ROOT, CODE_PLACES + DOC_PLACES):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, copy / rel)
    return copy


@pytest.fixture
def planted(repo_copy, tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(repo_copy, root)
    assert layout_problems(root) == []  # the copy is as good as the checkout
    return root


def test_a_stray_script_is_refused(planted):
    (planted / "tools" / "bench" / "stray.py").write_text('"""A script nobody runs."""\n')
    assert layout_problems(planted) == ["not in tools/README.md: tools/bench/stray.py",
                                        "orphan (named nowhere but the index): tools/bench/stray.py"]
    with (planted / INDEX).open("a") as f:
        f.write("- `bench/stray.py`: a script nobody runs.\n")
    assert layout_problems(planted) == ["orphan (named nowhere but the index): tools/bench/stray.py"]
    (planted / "Makefile").write_text((planted / "Makefile").read_text() + "\nstray:\n\tpython tools/bench/stray.py\n")
    assert layout_problems(planted) == []


def test_an_index_line_without_its_script_is_refused(planted):
    (planted / "tools" / "testing" / "hub_test_server.py").unlink()
    assert layout_problems(planted) == [
        "tools/README.md names a script that is not there: tools/testing/hub_test_server.py"]
    assert "swift/Tests/CohereTranscribeTests/Bundle/BundleDownloaderTests.swift" in "\n".join(
        stale_paths(planted, CODE_PLACES))


def test_a_ninth_top_level_entry_and_a_second_name_are_refused(planted):
    (planted / "tools" / "misc").mkdir()
    (planted / "tools" / "misc" / "remeasure.py").write_text("")
    with (planted / INDEX).open("a") as f:
        f.write("- `misc/remeasure.py`: a second remeasure.py.\n")
    problems = layout_problems(planted)
    assert problems[0].startswith("tools/ has 9 entries at its top (at most 8)")
    assert problems[1:] == ["two files named remeasure.py under tools/"]


def test_a_script_named_only_in_the_index_is_an_orphan(planted):
    """Every mention of tools/parity/frontend_parity.py but the index's and its own scrubbed: an orphan."""
    for path in planted.rglob("*"):
        if path.is_file() and path.relative_to(planted).as_posix() not in (INDEX, "tools/parity/frontend_parity.py"):
            text = path.read_text(errors="replace")
            if "frontend_parity" in text:
                path.write_text(text.replace("frontend_parity", "frontend_elsewhere"))
    assert layout_problems(planted) == ["orphan (named nowhere but the index): tools/parity/frontend_parity.py"]


def test_a_stale_path_is_found(planted):
    (planted / "docs" / "stale.md").write_text("Run `uv run python tools/front_end_parity.py`.\n")
    assert "docs/stale.md:1: tools/front_end_parity.py" in stale_paths(planted, DOC_PLACES)
    assert not any(s.startswith("docs/stale.md") for s in stale_paths(planted, CODE_PLACES))
