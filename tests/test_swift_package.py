"""Source checks of the Swift package that Linux cannot compile for Apple platforms.

The Core ML path itself runs on Linux (swift/Sources/CohereTranscribe/CoreMLEmulation.swift) and is
tested by `swift test`; what only an Apple SDK build would catch is checked here on the sources:
platform gates by OS (``canImport(CoreML)`` is also true on tvOS/watchOS/visionOS, ``Process`` does
not exist on iOS), no per-process seeds in cache names, no process-wide signal handlers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parents[1] / "swift" / "Sources"


def swift_files() -> dict[str, str]:
    return {str(p.relative_to(SOURCES)): p.read_text() for p in sorted(SOURCES.rglob("*.swift"))}


def guarded_by(text: str, condition: str) -> bool:
    """Whether the first code line of `text` (after comments) opens `#if <condition>` and the file ends
    with `#endif`: the whole file is built only where `condition` holds."""
    code = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]
    return bool(code) and code[0] == f"#if {condition}" and code[-1] == "#endif"


def test_no_can_import_gates_for_apple_frameworks():
    for name, text in swift_files().items():
        for framework in ("CoreML", "AVFoundation", "AVFAudio"):
            assert f"canImport({framework})" not in text, f"{name}: gate Apple-only code by os(macOS) || os(iOS)"


def test_apple_frameworks_are_imported_only_on_macos_and_ios():
    for name, text in swift_files().items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*import (CoreML|AVFoundation)\b", line):
                assert lines[i - 1].strip() == "#if os(macOS) || os(iOS)", f"{name}:{i + 1}: {line.strip()}"


def test_process_only_where_it_exists():
    users = {name: text for name, text in swift_files().items() if re.search(r"\bProcess\(\)", text)}
    assert users, "the interpreter runtime starts a Process"
    for name, text in users.items():
        if name.startswith("CohereTranscribeCLI/"):
            continue  # the command-line tool is built for macOS and Linux only (no iOS executable)
        assert guarded_by(text, "os(macOS) || os(Linux)"), f"{name} uses Process: build it for macOS and Linux only"


def test_core_ml_runtime_and_emulation_gates():
    files = swift_files()
    assert guarded_by(files["CohereTranscribe/CoreMLRuntime.swift"], "os(macOS) || os(iOS) || os(Linux)")
    assert guarded_by(files["CohereTranscribe/CoreMLEmulation.swift"], "os(Linux)")


@pytest.mark.parametrize("pattern, why", [
    (r"\.hashValue\b", "hashValue is seeded per process: cache names must be stable digests"),
    (r"signal\(\s*SIGPIPE", "no process-wide signal disposition in a library"),
    (r"\"\.compiled", "compiled models belong in Caches, never beside or inside the bundle"),
    (r"bufferShape\.map", "MLStateConstraint.bufferShape is [Int] in Swift"),
])
def test_patterns_the_sdk_or_a_device_rejects(pattern, why):
    for name, text in swift_files().items():
        assert not re.search(pattern, text), f"{name}: {why}"


def test_the_checks_can_fail():
    assert not guarded_by("import Foundation\nlet p = Process()\n", "os(macOS) || os(Linux)")
    assert guarded_by("// x\n#if os(macOS) || os(Linux)\nlet p = Process()\n#endif\n", "os(macOS) || os(Linux)")
