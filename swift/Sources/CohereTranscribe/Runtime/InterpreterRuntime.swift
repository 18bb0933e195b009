// Foundation's `Process` exists on macOS and Linux only: this runtime is not built for iOS and the other
// Apple platforms (apps there use `CoreMLRuntime`).
#if os(macOS) || os(Linux)
import Foundation
#if canImport(Glibc)
import Glibc
private let systemWrite = Glibc.write
#elseif canImport(Darwin)
import Darwin
private let systemWrite = Darwin.write
#endif

/// Runs packages with the project's MIL interpreter in a child process (`cohere-coreml serve-runtime`),
/// so the same transcriber runs on Linux and in CI. Protocol (documented in
/// src/cohere_coreml/runtime/serve.py): one JSON header line per message, then the raw little-endian
/// bytes of the arrays listed in its "arrays". Requests are answered in order; one child serves all
/// models and states of this runtime.
public final class InterpreterRuntime: ModelRuntime, @unchecked Sendable {
    public let name = "interpreter"
    private let process: Process
    private let input: FileHandle
    private let output: FileHandle
    private var buffer = Data()
    private let lock = NSLock()
    private var nextID = 0

    /// Starts `executable arguments...` (e.g. `.venv/bin/cohere-coreml serve-runtime`) and checks its greeting.
    public init(executable: URL, arguments: [String] = ["serve-runtime"], workingDirectory: URL? = nil) throws {
        guard FileManager.default.isExecutableFile(atPath: executable.path) else {
            throw TranscriptionError.runtime("interpreter command not found or not executable: \(executable.path)")
        }
        let process = Process()
        process.executableURL = executable
        process.arguments = arguments
        if let workingDirectory { process.currentDirectoryURL = workingDirectory }
        let stdin = Pipe(), stdout = Pipe()
        process.standardInput = stdin
        process.standardOutput = stdout
        process.standardError = FileHandle.standardError
        do { try process.run() } catch {
            throw TranscriptionError.runtime("cannot start \(executable.path): \(error.localizedDescription)")
        }
        self.process = process
        self.input = stdin.fileHandleForWriting
        self.output = stdout.fileHandleForReading
        #if canImport(Darwin)
        _ = fcntl(stdin.fileHandleForWriting.fileDescriptor, F_SETNOSIGPIPE, 1)  // EPIPE, not SIGPIPE, for this pipe only
        #endif
        let (hello, _) = try readMessage()
        guard hello["protocol"] as? String == "cohere-coreml-serve-runtime", hello["version"] as? Int == 1 else {
            throw TranscriptionError.runtime("\(executable.path) does not speak serve-runtime protocol 1: \(hello)")
        }
    }

    /// `cohere-coreml serve-runtime` from the environment: `$COHERE_COREML` (path of the cohere-coreml
    /// command) or `cohere-coreml` on PATH.
    public convenience init() throws {
        let env = ProcessInfo.processInfo.environment
        if let path = env["COHERE_COREML"] {
            try self.init(executable: URL(fileURLWithPath: path))
            return
        }
        for dir in (env["PATH"] ?? "").split(separator: ":") {
            let candidate = URL(fileURLWithPath: String(dir)).appendingPathComponent("cohere-coreml")
            if FileManager.default.isExecutableFile(atPath: candidate.path) {
                try self.init(executable: candidate)
                return
            }
        }
        throw TranscriptionError.runtime(
            "cohere-coreml not found: set COHERE_COREML to its path (e.g. .venv/bin/cohere-coreml after `make sync`) or put it on PATH")
    }

    /// The child process's id (the bench reads its peak memory on Linux: it is not in the parent's).
    public var processIdentifier: Int32 { process.processIdentifier }

    deinit {
        try? input.close()
        if process.isRunning { process.waitUntilExit() }
    }

    public func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        var request: [String: Any] = ["op": "load", "path": package.path, "compute_units": computeUnits.rawValue]
        if let functionName { request["function"] = functionName }
        let (reply, _) = try call(request)
        guard let handle = reply["model"] as? String, let function = reply["function"] as? String else {
            throw TranscriptionError.runtime("bad load reply: \(reply)")
        }
        func describe(_ key: String) -> [String: ArrayDescription] {
            var out: [String: ArrayDescription] = [:]
            for (name, value) in reply[key] as? [String: [String: Any]] ?? [:] {
                out[name] = ArrayDescription(shape: value["shape"] as? [Int] ?? [], dtype: value["dtype"] as? String ?? "?")
            }
            return out
        }
        let io = ModelIO(inputs: describe("inputs"), outputs: describe("outputs"), states: describe("states"))
        return InterpreterModel(runtime: self, handle: handle, functionName: function, io: io)
    }

    // MARK: protocol

    func call(_ request: [String: Any], arrays: [(String, Tensor)] = []) throws -> ([String: Any], [String: Tensor]) {
        lock.lock()
        defer { lock.unlock() }
        nextID += 1
        var header = request
        header["id"] = nextID
        if !arrays.isEmpty {
            header["arrays"] = arrays.map { name, t in
                ["name": name, "dtype": t.dtype.rawValue, "shape": t.shape, "nbytes": t.data.count] as [String: Any]
            }
        }
        var message = try JSONSerialization.data(withJSONObject: header)
        message.append(0x0A)
        for (_, t) in arrays { message.append(t.data) }
        if let problem = InterpreterRuntime.write(message, to: input.fileDescriptor) {
            throw TranscriptionError.runtime("the interpreter process is gone (\(problem)); see its stderr")
        }
        let (reply, payload) = try readMessage()
        guard reply["ok"] as? Bool == true else {
            let type = reply["type"] as? String ?? "error"
            throw TranscriptionError.runtime("\(type): \(reply["error"] as? String ?? "\(reply)")")
        }
        return (reply, payload)
    }

    /// Writes all of `data` to `fd`; a closed pipe gives an error message, never a SIGPIPE for the host
    /// process (Darwin: F_SETNOSIGPIPE on the pipe; Linux: SIGPIPE blocked for this thread during the
    /// write and a pending one consumed), so no process-wide signal disposition is changed.
    static func write(_ data: Data, to fd: Int32) -> String? {
        #if os(Linux)
        var block = sigset_t(), previous = sigset_t()
        sigemptyset(&block)
        sigaddset(&block, SIGPIPE)
        pthread_sigmask(SIG_BLOCK, &block, &previous)
        defer {
            var pending = sigset_t()
            sigpending(&pending)
            if sigismember(&pending, SIGPIPE) == 1 {
                var zero = timespec(tv_sec: 0, tv_nsec: 0)
                _ = sigtimedwait(&block, nil, &zero)
            }
            pthread_sigmask(SIG_SETMASK, &previous, nil)
        }
        #endif
        return data.withUnsafeBytes { (raw: UnsafeRawBufferPointer) -> String? in
            var offset = 0
            while offset < raw.count {
                let n = systemWrite(fd, raw.baseAddress!.advanced(by: offset), raw.count - offset)
                if n < 0 {
                    if errno == EINTR { continue }
                    return String(cString: strerror(errno))
                }
                offset += n
            }
            return nil
        }
    }

    private func fill(_ count: Int) throws {
        while buffer.count < count {
            let chunk = output.availableData
            if chunk.isEmpty {
                throw TranscriptionError.runtime("the interpreter process ended (see its stderr for the cause)")
            }
            buffer.append(chunk)
        }
    }

    private func readMessage() throws -> ([String: Any], [String: Tensor]) {
        var newline = buffer.firstIndex(of: 0x0A)
        while newline == nil {
            try fill(buffer.count + 1)
            newline = buffer.firstIndex(of: 0x0A)
        }
        let line = buffer.subdata(in: buffer.startIndex..<newline!)
        buffer = Data(buffer[(newline! + 1)...])
        guard let header = try JSONSerialization.jsonObject(with: line) as? [String: Any] else {
            throw TranscriptionError.runtime("bad message from the interpreter: \(String(decoding: line, as: UTF8.self))")
        }
        var arrays: [String: Tensor] = [:]
        for d in header["arrays"] as? [[String: Any]] ?? [] {
            guard let name = d["name"] as? String, let dtypeName = d["dtype"] as? String,
                  let dtype = DType(rawValue: dtypeName), let shape = d["shape"] as? [Int], let n = d["nbytes"] as? Int else {
                throw TranscriptionError.runtime("bad array descriptor from the interpreter: \(d)")
            }
            try fill(n)
            let bytes = Data(buffer.prefix(n))
            buffer = Data(buffer.dropFirst(n))
            arrays[name] = try Tensor(dtype: dtype, shape: shape, data: bytes)
        }
        return (header, arrays)
    }
}

final class InterpreterState: RuntimeState {
    let handle: String
    let runtime: InterpreterRuntime
    init(handle: String, runtime: InterpreterRuntime) {
        self.handle = handle
        self.runtime = runtime
    }

    /// `serve-runtime`'s write_state with a start: the child writes the region in place.
    func write(_ name: String, _ value: Tensor, at start: [Int]) throws -> Int {
        _ = try runtime.call(["op": "write_state", "state": handle, "name": name, "start": start], arrays: [(name, value)])
        return value.data.count
    }

    deinit {
        _ = try? runtime.call(["op": "free", "state": handle])  // the child drops the buffers
    }
}

final class InterpreterModel: RuntimeModel, @unchecked Sendable {
    let runtime: InterpreterRuntime
    let handle: String
    let functionName: String
    let io: ModelIO

    init(runtime: InterpreterRuntime, handle: String, functionName: String, io: ModelIO) {
        self.runtime = runtime
        self.handle = handle
        self.functionName = functionName
        self.io = io
    }

    func makeState() throws -> RuntimeState {
        let (reply, _) = try runtime.call(["op": "make_state", "model": handle])
        guard let state = reply["state"] as? String else { throw TranscriptionError.runtime("bad make_state reply: \(reply)") }
        return InterpreterState(handle: state, runtime: runtime)
    }

    func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
        var request: [String: Any] = ["op": "predict", "model": handle]
        if let state {
            guard let s = state as? InterpreterState else {
                throw TranscriptionError.invalidArgument("a state of another runtime was passed to the interpreter")
            }
            request["state"] = s.handle
        }
        return try runtime.call(request, arrays: inputs.sorted { $0.key < $1.key }.map { ($0.key, $0.value) }).1
    }

    /// A state buffer (for tests and debugging).
    func readState(_ state: RuntimeState, name: String) throws -> Tensor {
        guard let s = state as? InterpreterState else { throw TranscriptionError.invalidArgument("not an interpreter state") }
        let (_, arrays) = try runtime.call(["op": "read_state", "state": s.handle, "name": name])
        guard let t = arrays[name] else { throw TranscriptionError.runtime("no state '\(name)' in the reply") }
        return t
    }

    deinit {
        _ = try? runtime.call(["op": "free", "model": handle])
    }
}
#endif
