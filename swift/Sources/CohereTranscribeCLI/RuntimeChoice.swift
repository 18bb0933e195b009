// `--runtime` / `--interpreter` of both commands (main.swift, BenchCommand.swift). The interpreter runtime
// starts `cohere-coreml serve-runtime` with Foundation's `Process`, which exists on macOS and Linux only:
// on iOS the tool compiles, and `--runtime interpreter` is refused by name.
import CohereTranscribe
import Foundation

enum RuntimeChoice {
    /// `interpreter` on Linux (no Core ML there), `coreml` elsewhere.
    #if os(Linux)
    static let defaultName = "interpreter"
    #else
    static let defaultName = "coreml"
    #endif

    /// The runtime `name` (coreml | interpreter) names. On Linux `coreml` is Core ML's code path over the
    /// emulation, whose backend is the interpreter.
    static func make(_ name: String, interpreterPath: String?, cacheDir: String?) throws -> ModelRuntime {
        if name == "interpreter" {
            #if os(macOS) || os(Linux)
            return try interpreter(interpreterPath)
            #else
            throw TranscriptionError.invalidArgument(
                "--runtime interpreter is not available on this platform: it runs `cohere-coreml serve-runtime` "
                    + "as a child process (macOS, Linux); use --runtime coreml")
            #endif
        }
        #if os(Linux)
        CoreMLEmulation.use(try interpreter(interpreterPath))
        #endif
        return try CoreMLRuntime(cacheDirectory: cacheDir.map { URL(fileURLWithPath: $0, isDirectory: true) })
    }

    #if os(macOS) || os(Linux)
    /// `--interpreter PATH`, else `$COHERE_COREML`, else `cohere-coreml` on PATH.
    static func interpreter(_ path: String?) throws -> InterpreterRuntime {
        try path.map { try InterpreterRuntime(executable: URL(fileURLWithPath: $0)) } ?? InterpreterRuntime()
    }
    #endif
}
