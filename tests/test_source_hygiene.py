"""Code reads as code: no commit hashes and no issue numbers in src/ and swift/Sources.

Comments and docstrings say what the code does and why, citing public sources; the history of a
decision (which commit measured what, which issue asked for it) lives in git, CHANGELOG.md and
BENCHMARKS.md. A citation of a public issue stays allowed when it names its repository
(`coremltools issue 2716`, `apple/coremltools#2716`, or a URL), since a reader can follow it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "src", ROOT / "swift" / "Sources")
SUFFIXES = {".py", ".swift"}

# A commit hash: a standalone token of 7-12 (git's abbreviations) or 40 hex digits holding both a digit and a
# letter (so neither a decimal number nor a word), not part of a longer token: `0x1f83d9ab`, `#a0b1c2d`, a
# UUID's dash-joined groups, a path or URL segment and a 64-digit sha256 stay out. Longer abbreviations
# (13-39 digits) count only next to a word that makes them a revision ("git", "commit", ...).
_HEX = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])"
HASH = re.compile(
    rf"(?<![\w.\-/#:]){_HEX}(?:[0-9a-f]{{7,12}}|[0-9a-f]{{40}})(?![\w\-])"
    rf"|\b(?:git|commits?|revision|rev|checkout)\s+{_HEX}[0-9a-f]{{13,39}}\b",
    re.I,
)
# An issue or pull request by number: "issue 27", "issues 21 and 28", "PR 30", "pull request 30", "#30".
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+\b|(?<![\w/&])#\d+\b", re.I)
# ... allowed when the word before it names the public repository it belongs to
PUBLIC_PROJECTS = {"coremltools", "anemll", "transformers", "pytorch", "torch", "swift", "swift-transformers",
                   "whisperkit", "whisper.cpp", "llama.cpp", "huggingface_hub", "numpy", "librosa", "jiwer", "cpython",
                   "mobius"}  # mobius: FluidInference/mobius (Core ML ports of speech models)
_QUALIFIER = re.compile(r"([\w.\-]+(?:/[\w.\-]+)?)\s*$")


def _is_public_citation(line: str, start: int) -> bool:
    before = _QUALIFIER.search(line[:start])
    if before is None:
        return False
    word = before.group(1)
    return "/" in word or word.lower() in PUBLIC_PROJECTS


def hygiene_hits(text: str) -> list[tuple[int, str]]:
    """(line number, offending text) for every commit hash and project issue number in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if "://" in line:  # a URL names its repository (github.com/owner/repo/issues/N, /commit/<sha>)
            line = re.sub(r"\w+://\S+", "", line)
        for match in HASH.finditer(line):
            found.append((number, match.group(0)))
        for match in ISSUE.finditer(line):
            if not _is_public_citation(line, match.start()):
                found.append((number, match.group(0)))
    return found


def scanned_files() -> list[Path]:
    return sorted(p for root in SCANNED for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def test_sources_hold_no_commit_hashes_or_issue_numbers():
    files = scanned_files()
    assert len(files) > 100  # both trees are seen
    hits = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
            for path in files for line, text in hygiene_hits(path.read_text(errors="replace"))]
    assert not hits, ("commit hashes / issue numbers in the sources (say what and why instead; history lives "
                      "in git, CHANGELOG.md and BENCHMARKS.md):\n" + "\n".join(hits))


@pytest.mark.parametrize("planted, expected", [
    ("# decided on the earlier model (git c61c6d2)", "c61c6d2"),
    ("# the model retrained again (0283ac4; quantize --sensitivity)", "0283ac4"),
    ("// measured at commit 9212e56ab", "9212e56ab"),
    ("# fixed at git 0283ac4d9e1f2a3b4c5d6 (a longer abbreviation)", "git 0283ac4d9e1f2a3b4c5d6"),
    ('"""The length masks are inputs (issue 30)."""', "issue 30"),
    ("// issues 21 and 28 asked for it", "issues 21"),
    ("# see #30", "#30"),
    ("# from PR 12", "PR 12"),
])
def test_a_planted_hash_or_issue_is_found(planted, expected):
    source = f"x = 1\n{planted}\n"
    assert hygiene_hits(source) == [(2, expected)]


@pytest.mark.parametrize("clean", [
    "# coremltools issue 2716: 4-bit palettized stateful models crash on device",
    "# coremltools issues 1764 (flexible shapes), 1909 (EnumeratedShapes)",
    "# FluidInference/mobius PR 77 ('ANECCompile -14'); apple/coremltools#2553",
    "# https://github.com/apple/coremltools/issues/2631 and https://github.com/o/r/commit/c61c6d2",
    "let digits = Array(\"0123456789abcdef\".utf8)",
    'EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of b""',
    "mask = 0x1f83d9ab  # a hex constant",
    'run_id = "123e4567-e89b-12d3-a456-426614174000"',
    "# 35 s -> 560000 samples; 3500 frames; deadline 1234567",
    "# the decoder's 2 functions, step 1, part 1 of 2",
    "#if os(macOS) || os(Linux)",
])
def test_public_citations_and_constants_are_not_flagged(clean):
    assert hygiene_hits(clean) == []
