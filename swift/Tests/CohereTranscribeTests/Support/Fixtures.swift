import CohereTranscribe
import Foundation
import XCTest

/// Reference data written by tools/data/make_swift_fixtures.py (`make swift-fixtures`, run by `make swift-test` / `make test`).
enum Fixtures {
    // this file: <repo>/swift/Tests/CohereTranscribeTests/Support/Fixtures.swift
    static let repoRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static var dir: URL {
        if let path = ProcessInfo.processInfo.environment["COHERE_SWIFT_FIXTURES"] { return URL(fileURLWithPath: path) }
        return repoRoot.appendingPathComponent("out/swift-fixtures")
    }

    static var bundle: URL { dir.appendingPathComponent("bundle") }
    /// The test bundle with the graph-state decoder (`--decoder-state graph`, bind_memory), same encoder.
    static var graphBundle: URL { dir.appendingPathComponent("bundle-graph") }

    /// This test process's scratch folder (bundle copies, caches, scripts): one folder under the system
    /// temporary directory, removed when the process exits, so runs leave nothing behind (each edited
    /// bundle copy is ~8 MB; earlier runs left gigabytes in /tmp).
    static let scratch: URL = {
        let url = FileManager.default.temporaryDirectory
            .appendingPathComponent("cohere-swift-tests-\(ProcessInfo.processInfo.processIdentifier)-\(UUID().uuidString)",
                                    isDirectory: true)
        try? FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        atexit { try? FileManager.default.removeItem(at: Fixtures.scratch) }
        return url
    }()

    /// The fixture folder. Without fixtures a plain `swift test` skips the test, naming the command that
    /// makes them; when `COHERE_SWIFT_FIXTURES` is set (as `make swift-test` and CI do) missing fixtures
    /// are a failure, never a skip.
    static func require() throws -> URL {
        guard FileManager.default.fileExists(atPath: dir.appendingPathComponent("READY").path) else {
            let message = "no Swift test fixtures in \(dir.path): run `make swift-fixtures` (make swift-test and make test do)"
            if ProcessInfo.processInfo.environment["COHERE_SWIFT_FIXTURES"] != nil { XCTFail(message) }
            throw XCTSkip(message)
        }
        return dir
    }

    static func json(_ name: String) throws -> Any {
        try JSONSerialization.jsonObject(with: Data(contentsOf: try require().appendingPathComponent(name)))
    }

    /// Why a test that needs a child process (`Process`: macOS and Linux only) is skipped elsewhere (iOS).
    static let noChildProcesses = "needs child processes (Foundation's Process: macOS and Linux only)"

    #if os(macOS) || os(Linux)
    /// The project's cohere-coreml command (after `make sync`) as the interpreter runtime, with
    /// `$COHERE_SWIFT_THREADS` (default 2) torch threads: the machine is shared with the build and CI.
    /// One child process serves every test (starting one costs ~15 s of Python imports); models and
    /// states are freed in the child when the tests drop them.
    static func interpreter() throws -> InterpreterRuntime { try sharedInterpreter.get() }
    #else
    /// No interpreter runtime on iOS (it is a child process): the test is skipped.
    static func interpreter() throws -> any ModelRuntime { throw XCTSkip("the interpreter runtime \(noChildProcesses)") }
    #endif

    /// The Core ML runtime of the package run on the Linux Core ML emulation (over the shared
    /// interpreter), with a fresh compiled-model cache under the temporary folder. On macOS: Core ML.
    static func coreML(cacheDirectory: URL? = nil) throws -> CoreMLRuntime {
        #if os(Linux)
        CoreMLEmulation.use(try interpreter())
        #endif
        let cache = cacheDirectory ?? Fixtures.scratch
            .appendingPathComponent("cohere-swift-cache-\(UUID().uuidString)", isDirectory: true)
        return try CoreMLRuntime(cacheDirectory: cache)
    }

    /// The runtimes the transcriber tests run through: the interpreter (macOS, Linux) and Core ML.
    static func runtimes() throws -> [(String, ModelRuntime)] {
        #if os(macOS) || os(Linux)
        [("interpreter", try interpreter()), ("coreml", try coreML())]
        #else
        [("coreml", try coreML())]
        #endif
    }

    #if os(macOS) || os(Linux)
    private static let sharedInterpreter = Result<InterpreterRuntime, Error> {
        _ = try require()
        let exe = repoRoot.appendingPathComponent(".venv/bin/cohere-coreml")
        let threads = ProcessInfo.processInfo.environment["COHERE_SWIFT_THREADS"] ?? "2"
        return try InterpreterRuntime(executable: exe, arguments: ["serve-runtime", "--num-threads", threads])
    }
    #endif

    #if os(macOS) || os(Linux)
    /// The `cohere-transcribe-swift` executable of the build these tests belong to: the one beside the
    /// test bundle (`.build/<triple>/debug` or `release`, whichever `swift test -c` ran), not a fixed
    /// `.build/debug` that may be another build's; `$COHERE_SWIFT_CLI` overrides. Missing: a failure when
    /// `COHERE_SWIFT_FIXTURES` is set (make swift-test), else a skip, as for the fixtures.
    static func swiftCLI() throws -> URL {
        let cli: URL
        if let path = ProcessInfo.processInfo.environment["COHERE_SWIFT_CLI"] {
            cli = URL(fileURLWithPath: path)
        } else {
            // macOS: the .xctest bundle sits in the products folder; Linux: the .xctest is the executable
            #if os(macOS)
            let products = Bundle(for: BuildProducts.self).bundleURL.deletingLastPathComponent()
            #else
            let products = URL(fileURLWithPath: CommandLine.arguments[0]).resolvingSymlinksInPath().deletingLastPathComponent()
            #endif
            cli = products.appendingPathComponent("cohere-transcribe-swift")
        }
        guard FileManager.default.isExecutableFile(atPath: cli.path) else {
            let message = "no \(cli.path): build it with `swift build --build-tests` (make swift-test does)"
            if ProcessInfo.processInfo.environment["COHERE_SWIFT_FIXTURES"] != nil { XCTFail(message) }
            throw XCTSkip(message)
        }
        return cli
    }

    private final class BuildProducts {}
    #endif

    static func floats(_ path: String) throws -> [Float] {
        let data = try Data(contentsOf: URL(fileURLWithPath: path))
        return data.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }
    }
}
