"""The README as a front door: short, code early, no measured figures or history, and snippets that work.

- Its measures: at most `MAX_LINES` lines, the first code block within the first `FIRST_CODE_BY` lines,
  every line shorter than `MAX_LINE_CHARS + 1` characters.
- No measured figure in its prose (figures live in BENCHMARKS.md and the model card) and no commit hash,
  date or issue number anywhere (history lives in git and CHANGELOG.md): `figures` and `hashes`, each
  shown to catch planted examples. CONTRIBUTING.md is held to the same.
- Its Python snippet runs as written against the session's exported bundle of the default model, with
  only the bundle folder (`"f16"`) and the audio file (`"clip.wav"`) replaced, and prints the clip's
  transcript.
- Its Swift snippet is, line for line, the body of `readmeSnippet()` in
  swift/Tests/CohereTranscribeTests/ReadmeSnippet.swift, which the Swift step compiles with the tests.
- The files it and CONTRIBUTING.md link exist, the make targets they name exist, and LICENSE is the
  Apache License 2.0 that pyproject.toml declares.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from .fixture_data import heldout_utterances

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
SWIFT_SNIPPET = ROOT / "swift" / "Tests" / "CohereTranscribeTests" / "ReadmeSnippet.swift"

MAX_LINES = 150
FIRST_CODE_BY = 40
MAX_LINE_CHARS = 99

# The placeholders the README's Python snippet shows, and what the test puts in their place.
BUNDLE_PLACEHOLDER = '"f16"'
AUDIO_PLACEHOLDER = '"clip.wav"'

# A measured figure: a number with a unit of time, size, share or ratio, a test count, a metric's value.
_NUMBER = r"\d+(?:[.,]\d+)*"
FIGURE_PATTERNS = [
    rf"\b{_NUMBER}\s?(?:ms|s|sec|seconds?|min|minutes?|h|hours?)\b",
    rf"\b{_NUMBER}\s?%",
    rf"\b{_NUMBER}\s?(?:[kKMGT]i?B|bytes)\b",
    rf"\b{_NUMBER}\s?dB\b",
    rf"\b{_NUMBER}\s?[x×](?![\w-])",
    rf"\b{_NUMBER}\s(?:passed|failed|skipped|tests|clips|core-min)\b",
    rf"\b(?:WER|CER|PSNR|RTF|RSS)\s?(?:of|=|:)?\s?{_NUMBER}",
]
# History: a date, an issue number.
HISTORY_PATTERNS = [r"\b(?:19|20)\d\d-\d\d-\d\d\b", r"\bissues? \d+", r"(?<![\w&])#\d+\b"]
# A commit-like hash: 7 to 40 hex digits with at least one digit and one letter (not an English word).
HASH_PATTERN = r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def prose(text: str) -> str:
    """`text` without its fenced code blocks (code may hold option values such as a window length)."""
    return re.sub(r"^```\w*\n.*?^```$", "", text, flags=re.M | re.S)


def figures(text: str) -> list[str]:
    """Measured figures and history in the prose of `text`."""
    body = prose(text)
    return [m.group(0) for pattern in FIGURE_PATTERNS + HISTORY_PATTERNS for m in re.finditer(pattern, body)]


def hashes(text: str) -> list[str]:
    """Commit-like hashes anywhere in `text`, code included."""
    return re.findall(HASH_PATTERN, text)


def the_block(text: str, language: str) -> str:
    blocks = [body for lang, body in code_blocks(text) if lang == language]
    assert len(blocks) == 1, f"README: expected one {language} block, found {len(blocks)}"
    return blocks[0]


# --------------------------------------------------------------------------------------------
# Measures
# --------------------------------------------------------------------------------------------


def test_readme_is_short_with_code_early_and_short_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README: {len(lines)} lines (at most {MAX_LINES}: move detail to docs/)"
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("```"))
    assert first <= FIRST_CODE_BY, f"README: the first code block starts on line {first}"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"README: lines longer than {MAX_LINE_CHARS} characters (line, length): {long}"


@pytest.mark.parametrize("doc", [README, CONTRIBUTING], ids=lambda p: p.name)
def test_no_measured_figures_history_or_hashes(doc):
    text = doc.read_text()
    assert figures(text) == [], f"{doc.name}: figures and history belong in BENCHMARKS.md / CHANGELOG.md"
    assert hashes(text) == []


@pytest.mark.parametrize("planted", [
    "An export takes 16.2 s here.", "The full suite took 19.3 min.", "It peaks at 637 MB.",
    "The q8 encoder is 2 GB.", "WER 1.1 on German.", "Robust on 55-70 % of clips.", "PSNR 60 dB.",
    "The stream is 1.5x faster.", "1101 passed, 5 skipped.", "Retrained on 2026-12-04.",
    "Measured for issue 30.", "See #42.",
])
def test_a_planted_figure_is_found(planted):
    text = README.read_text()
    assert figures(text + "\n" + planted + "\n"), planted
    # the same sentence inside a code block is an example, not a claim
    assert figures(f"{text}\n```bash\necho '{planted}'\n```\n") == []


def test_a_planted_hash_is_found_and_versions_are_not_figures():
    assert hashes("the first retraining (git 9212e56)") == ["9212e56"]
    assert hashes("a decade of defaced facades, sha256 digests") == []
    assert figures("Python 3.11 to 3.13, macOS 15 or iOS 18, Swift 6, a 14-language model.") == []


# --------------------------------------------------------------------------------------------
# Snippets
# --------------------------------------------------------------------------------------------


def test_the_python_snippet_runs_and_prints_the_transcript(trained_bundle, capsys):
    from cohere_coreml.evaluation.metrics import utterance_errors

    snippet = the_block(README.read_text(), "python")
    for placeholder in (BUNDLE_PLACEHOLDER, AUDIO_PLACEHOLDER):
        assert snippet.count(placeholder) == 1, f"the snippet shows {placeholder} once"
    clip = next(u for u in heldout_utterances(1) if u["language"] == "en")
    code = snippet.replace(BUNDLE_PLACEHOLDER, repr(str(trained_bundle))).replace(AUDIO_PLACEHOLDER,
                                                                                 repr(str(clip["path"])))
    exec(compile(code, str(README), "exec"), {"__name__": "readme_snippet"})
    printed = capsys.readouterr().out.strip()
    assert printed, "the snippet printed nothing"
    # the default model on its own held-out speech: the reference text, give or take a word
    (_, counts, units), = utterance_errors([clip["text"]], [printed], "en")["pairs"]
    errors = counts["substitutions"] + counts["deletions"] + counts["insertions"]
    assert errors <= max(1, units // 4), (printed, clip["text"])


def swift_snippet_parts(block: str) -> tuple[list[str], list[str]]:
    """(import lines, the rest without its leading blank lines) of the README's Swift block."""
    lines = block.splitlines()
    imports = [line for line in lines if line.startswith("import ")]
    rest = lines[len(imports):]
    while rest and not rest[0].strip():
        rest.pop(0)
    assert lines[:len(imports)] == imports, "the Swift snippet's imports come first"
    return imports, rest


def test_the_swift_snippet_is_the_compiled_one():
    imports, body = swift_snippet_parts(the_block(README.read_text(), "swift"))
    source = SWIFT_SNIPPET.read_text().splitlines()
    # exactly the snippet's imports (no @testable, nothing that would make a missing import compile)
    assert [line for line in source if re.match(r"\s*(@\w+\s+)?import\b", line)] == imports
    start = source.index("func readmeSnippet() async throws {")
    end = source.index("}", start)
    compiled = [line[4:] if line.startswith("    ") else line for line in source[start + 1:end]]
    assert compiled == body, "README's Swift block and ReadmeSnippet.swift differ: copy one into the other"


def test_the_swift_check_can_fail():
    imports, body = swift_snippet_parts("import A\nimport B\n\nlet x = 1\nprint(x)\n")
    assert imports == ["import A", "import B"] and body == ["let x = 1", "print(x)"]
    with pytest.raises(AssertionError):
        swift_snippet_parts("let x = 1\nimport A\n")


# --------------------------------------------------------------------------------------------
# Links, make targets, licence
# --------------------------------------------------------------------------------------------


def local_links(text: str) -> list[str]:
    """Relative link targets of Markdown links (anchors dropped)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("doc", [README, CONTRIBUTING], ids=lambda p: p.name)
def test_local_links_resolve(doc):
    links = local_links(doc.read_text())
    assert links, f"{doc.name} links no file"
    missing = [t for t in links if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links files that do not exist: {missing}"


@pytest.mark.parametrize("doc", [README, CONTRIBUTING], ids=lambda p: p.name)
def test_named_make_targets_exist(doc):
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set(re.findall(r"(?:^|`)make ([a-z][\w-]*)", doc.read_text(), re.M))  # in code
    assert {"demo", "test"} <= named if doc is README else named
    assert named <= targets, f"{doc.name} names make targets the Makefile lacks: {sorted(named - targets)}"


# sha256 of the first 177 lines of https://www.apache.org/licenses/LICENSE-2.0.txt: the licence's terms
# up to "END OF TERMS AND CONDITIONS", without the appendix on how to apply it to a file
APACHE_2_TERMS_SHA256 = "0d542e0c8804e39aa7f37eb00da5a762149dc682d7829451287e11b938e94594"


def test_license_is_the_apache_license_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert text.rstrip().endswith("END OF TERMS AND CONDITIONS")
    assert hashlib.sha256(text.encode()).hexdigest() == APACHE_2_TERMS_SHA256
