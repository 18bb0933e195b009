"""Source checks of the Swift package that Linux cannot compile for Apple platforms.

The Core ML path itself runs on Linux (swift/Sources/CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation.swift) and is
tested by `swift test`; what only an Apple SDK build would catch is checked here on the sources:
platform gates by OS (``canImport(CoreML)`` is also true on tvOS/watchOS/visionOS, ``Process`` does
not exist on iOS), every target's names compiled only where they exist (the ``#if`` conditions evaluated
for macOS and iOS), the emulation Sendable where the SDK is, the microphone's checks before its tap, no
per-process seeds in cache names, no process-wide signal handlers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SWIFT = Path(__file__).resolve().parents[2] / "swift"
SOURCES = SWIFT / "Sources"


def swift_files(root: Path = SOURCES) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.swift"))}


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
        assert guarded_by(text, "os(macOS) || os(Linux)"), f"{name} uses Process: build it for macOS and Linux only"


def test_core_ml_runtime_and_emulation_gates():
    files = swift_files()
    assert guarded_by(files["CohereTranscribe/Runtime/CoreMLRuntime.swift"], "os(macOS) || os(iOS) || os(Linux)")
    assert guarded_by(files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation.swift"], "os(Linux)")


# --- what each Apple platform compiles --------------------------------------------------------------
# Package.swift builds every target (library, CLI, tests) for macOS and iOS. A name used where a platform
# compiles the line must exist there: declared by the package in a region that platform compiles, or
# given by its SDK.
APPLE_PLATFORMS = ("macOS", "iOS")
# canImport(X) on macOS 15 / iOS 18 (unknown modules fail the check: add them here).
CAN_IMPORT = {"Darwin": True, "Glibc": False, "FoundationNetworking": False, "os": True, "Foundation": True,
              "CoreML": True, "AVFoundation": True, "AVFAudio": True, "XCTest": True}
# SDK names one Apple platform lacks: Foundation's Process (NSTask) is not in the iOS SDK; AVAudioSession
# is `API_UNAVAILABLE(macos)` (AVFAudio/AVAudioSession.h: `NS_SWIFT_SENDABLE API_AVAILABLE(ios(3.0), ...)
# API_UNAVAILABLE(macos) @interface AVAudioSession : NSObject`).
SDK_MISSING = {"iOS": {"Process", "NSTask"}, "macOS": {"AVAudioSession"}}
# CoreMLEmulation*.swift declares Core ML's own names (ML...) for Linux; Apple platforms get them from CoreML.
EMULATION_FILE = re.compile(r"(^|/)CoreMLEmulation[^/]*\.swift$")
DECLARATION = re.compile(r"(?:@\w+(?:\([^)]*\))?\s+)*(?:(?:public|internal|private|fileprivate|open|final|indirect)\s+)*"
                         r"(?:class|struct|enum|protocol|actor|typealias)\s+([A-Za-z_]\w*)")


def code_only(text: str) -> str:
    """`text` with comments and string literals blanked (newlines kept, so lines keep their numbers);
    the code inside string interpolations `\\(...)` is kept."""
    out = list(text)
    modes: list = []  # ("string", hashes, multiline) or ("interpolation", paren depth)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        mode = modes[-1] if modes else None
        if mode and mode[0] == "string":
            _, hashes, multiline = mode
            close = ('"""' if multiline else '"') + "#" * hashes
            if text.startswith(close, i):
                blank(i, i + len(close))
                modes.pop()
                i += len(close)
            elif text.startswith("\\" + "#" * hashes, i):
                j = i + 1 + hashes
                if j < n and text[j] == "(":
                    blank(i, j + 1)
                    modes.append(("interpolation", 1))
                    i = j + 1
                else:
                    blank(i, j + 1)
                    i = j + 1
            else:
                blank(i, i + 1)
                i += 1
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (m := re.match(r'(#*)("""|")', text[i:i + 64])) and (m.group(1) or text[i] == '"'):
            blank(i, i + m.end())
            modes.append(("string", len(m.group(1)), m.group(2) == '"""'))
            i += m.end()
        else:
            if mode and mode[0] == "interpolation":
                if text[i] == "(":
                    modes[-1] = ("interpolation", mode[1] + 1)
                elif text[i] == ")":
                    if mode[1] == 1:
                        out[i] = " "
                        modes.pop()
                    else:
                        modes[-1] = ("interpolation", mode[1] - 1)
            i += 1
    return "".join(out)


def evaluate(condition: str, platform: str) -> bool | None:
    """A Swift compilation condition on `platform` (macOS, iOS): True, False, or None when it depends on
    something the platform does not fix (targetEnvironment, arch, compiler, custom flags)."""
    tokens = re.findall(r"\w+\([^()]*\)|&&|\|\||!|\(|\)|\w+", condition)
    assert "".join(tokens) == re.sub(r"\s", "", condition), f"cannot parse #if {condition}"
    pos = 0

    def atom() -> bool | None:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "!":
            value = atom()
            return None if value is None else not value
        if token == "(":
            value = disjunction()
            assert tokens[pos] == ")", f"unbalanced #if {condition}"
            pos += 1
            return value
        if m := re.fullmatch(r"(\w+)\(\s*([^()]*?)\s*\)", token):
            kind, argument = m.groups()
            if kind == "os":
                return argument == platform
            if kind == "canImport":
                assert argument in CAN_IMPORT, f"canImport({argument}): add it to CAN_IMPORT"
                return CAN_IMPORT[argument]
            return None
        return {"true": True, "false": False}.get(token)

    def conjunction() -> bool | None:
        nonlocal pos
        values = [atom()]
        while pos < len(tokens) and tokens[pos] == "&&":
            pos += 1
            values.append(atom())
        return False if False in values else None if None in values else True

    def disjunction() -> bool | None:
        nonlocal pos
        values = [conjunction()]
        while pos < len(tokens) and tokens[pos] == "||":
            pos += 1
            values.append(conjunction())
        return True if True in values else None if None in values else False

    value = disjunction()
    assert pos == len(tokens), f"cannot parse #if {condition}"
    return value


def compiled_lines(text: str, platform: str) -> list[tuple[int, str, bool]]:
    """Per line of `text`: its number, its code (comments and strings blanked) and whether `platform`
    may compile it (False only when an enclosing #if / #elseif / #else branch is certainly off there)."""
    rows = []
    stack: list[tuple[bool | None, list[bool | None]]] = []  # per open #if: this branch's value, conditions seen

    def negated_all(seen: list[bool | None]) -> bool | None:
        values = [None if v is None else not v for v in seen]
        return False if False in values else None if None in values else True

    for number, line in enumerate(code_only(text).splitlines(), 1):
        stripped = line.strip()
        directive = re.match(r"#(if|elseif|else|endif)\b\s*(.*)", stripped)
        if directive:
            kind, condition = directive.groups()
            if kind == "if":
                value = evaluate(condition, platform)
                stack.append((value, [value]))
            elif kind == "elseif":
                value = evaluate(condition, platform)
                previous = negated_all(stack[-1][1])
                both = False if False in (previous, value) else None if None in (previous, value) else True
                stack[-1] = (both, stack[-1][1] + [value])
            elif kind == "else":
                stack[-1] = (negated_all(stack[-1][1]), stack[-1][1])
            else:
                stack.pop()
            continue
        rows.append((number, line, all(value is not False for value, _ in stack)))
    assert not stack, "unbalanced #if / #endif"
    return rows


def platform_violations(files: dict[str, str]) -> list[str]:
    """Uses of a name on a platform that lacks it: a type the package declares only in regions that
    platform does not compile (InterpreterRuntime, DeviceSweep, CoreMLEmulation, ...), or an SDK name of
    SDK_MISSING, in a line that platform compiles."""
    problems = []
    for platform in APPLE_PLATFORMS:
        lines = {name: compiled_lines(text, platform) for name, text in files.items()}
        declared: dict[str, bool] = {}  # type name -> declared somewhere this platform compiles
        for name, rows in lines.items():
            for _, code, compiled in rows:
                if m := DECLARATION.match(code):  # top level only (column 0): nested names are reached through theirs
                    if EMULATION_FILE.search(name) and m.group(1).startswith("ML"):
                        continue
                    declared[m.group(1)] = declared.get(m.group(1), False) or compiled
        missing = {type_name for type_name, anywhere in declared.items() if not anywhere} | SDK_MISSING[platform]
        pattern = re.compile(r"\b(" + "|".join(sorted(missing)) + r")\b")
        for name, rows in lines.items():
            for number, code, compiled in rows:
                if compiled and (m := pattern.search(code)):
                    problems.append(f"{name}:{number}: {m.group(1)} does not exist on {platform}: {code.strip()}")
    return problems


def test_every_target_compiles_names_only_where_they_exist():
    """iOS has no Process, so no InterpreterRuntime or DeviceSweep; only Linux has CoreMLEmulation: every
    use in the library, the CLI and the tests is behind a gate that excludes the platform."""
    files = {f"Sources/{k}": v for k, v in swift_files(SOURCES).items()}
    files |= {f"Tests/{k}": v for k, v in swift_files(SWIFT / "Tests").items()}
    assert any("class InterpreterRuntime" in text for text in files.values())
    problems = platform_violations(files)
    assert not problems, "\n".join(problems)


# Sendable as the iOS 18.3 SDK declares it. Classes: only MLState (MLState.h: `ML_EXPORT NS_SWIFT_SENDABLE
# __attribute__((objc_subclassing_restricted)) @interface MLState : NSObject`) and the compute devices
# (MLGPUComputeDevice.h, MLNeuralEngineComputeDevice.h: `ML_EXPORT NS_SWIFT_SENDABLE ...`); MLModel.h,
# MLMultiArray.h, MLModelConfiguration.h, MLFeatureValue.h, ... declare no NS_SWIFT_SENDABLE. The NS_ENUMs
# import as Sendable; CoreML.swiftinterface: `public enum MLComputeDevice : ..., Swift.Sendable`, `public enum
# MLModelStructure : Swift.Sendable`, `@available(*, unavailable) extension CoreML.MLComputePlan : Swift.Sendable {}`.
SDK_SENDABLE_CLASSES = {"MLState", "MLCPUComputeDevice", "MLGPUComputeDevice", "MLNeuralEngineComputeDevice"}
SDK_SENDABLE_ENUMS = {"MLComputeUnits", "MLMultiArrayDataType", "MLFeatureType", "MLComputeDevice", "MLModelStructure"}


def emulated_conformances(text: str) -> dict[str, tuple[str, str]]:
    """Per top-level ML... type of an emulation file: (kind, inheritance clause)."""
    found = {}
    for m in re.finditer(r"^(?:public |open )?(?:final )?(class|enum|struct) (ML\w+)\s*(?::\s*([^{]*))?\{", code_only(text), re.M):
        found[m.group(2)] = (m.group(1), (m.group(3) or "").strip())
    return found


def test_emulation_is_sendable_exactly_where_the_sdk_is():
    files = swift_files()
    types = emulated_conformances(files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation.swift"])
    types |= emulated_conformances(files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation+ComputePlan.swift"])
    assert {"MLModel", "MLMultiArray", "MLState", "MLComputePlan", "MLComputeDevice"} <= set(types)
    assert all("@unchecked" not in clause for _, clause in types.values()), types
    sendable = {name for name, (_, clause) in types.items() if re.search(r"\bSendable\b", clause)}
    assert sendable == SDK_SENDABLE_CLASSES | SDK_SENDABLE_ENUMS
    for name in SDK_SENDABLE_CLASSES:
        assert types[name][0] == "class" and re.search(rf"final class {name}\b", files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation.swift"]
                                                       + files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation+ComputePlan.swift"]), name
    plan = files["CohereTranscribe/Runtime/LinuxCoreMLEmulation/CoreMLEmulation+ComputePlan.swift"]
    assert re.search(r"@available\(\*, unavailable\)\s*extension MLComputePlan: Sendable \{\}", plan)


def test_microphone_source_checks_before_its_one_tap():
    """MicrophoneSource.swift cannot be built here: its order of calls is what the Linux-tested decisions
    (MicrophoneChecks.swift) rely on."""
    text = code_only(swift_files()["CohereTranscribe/Audio/MicrophoneSource.swift"])
    start = text[text.index("public func start("):text.index("public func stop(")]
    order = ["lifecycle.start()", "checkAccess()", "MicrophoneChecks.inputFormat(", "installTap(", "engine.start()"]
    positions = [start.index(call) for call in order]
    assert positions == sorted(positions), order
    assert start.count("installTap(") == 1 and "lifecycle.startFailed()" in start
    access = text[text.index("private func checkAccess("):]
    ios = access[access.index("#if os(iOS)"):access.index("#else")]
    for call in ["mustBeGranted: true", "AVAudioSession.sharedInstance()", "MicrophoneChecks.session(", "isInputAvailable",
                 "setActive(true)"]:
        assert call in ios, call
    assert "mustBeGranted: false" in access[access.index("#else"):]


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
    lib = "#if os(macOS) || os(Linux)\npublic final class Child {}\n#endif\n"
    use = "let c = Child()  // Child\nlet s = \"Child \\(1 + 1)\"\n"
    found = platform_violations({"a.swift": lib, "b.swift": use})
    assert len(found) == 1 and found[0].startswith("b.swift:1: Child does not exist on iOS"), found
    guarded = "#if os(iOS)\nlet x = 1\n#elseif os(macOS) || os(Linux)\nlet c = Child()\n#else\nlet c = Child()\n#endif\n"
    assert platform_violations({"a.swift": lib, "b.swift": guarded}) == []
    assert len(platform_violations({"a.swift": "let p = Process()\n#if !os(iOS)\nlet q = Process()\n#endif\n"})) == 1
    assert platform_violations({"a.swift": '#if os(Linux)\nenum CoreMLEmulation {}\n#endif\nlet t = "\\(CoreMLEmulation.self)"\n'})
    assert evaluate("os(macOS) || (canImport(Glibc) && !os(iOS))", "iOS") is False
    assert evaluate("targetEnvironment(simulator) && os(iOS)", "iOS") is None
    assert not guarded_by("import Foundation\nlet p = Process()\n", "os(macOS) || os(Linux)")
    assert guarded_by("// x\n#if os(macOS) || os(Linux)\nlet p = Process()\n#endif\n", "os(macOS) || os(Linux)")
