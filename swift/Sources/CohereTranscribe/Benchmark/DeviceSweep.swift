// The candidate sweep of `cohere-transcribe-swift bench`: every candidate in a child process of its
// own, so that a Neural Engine compile failure that kills the process (coremltools issue 2758: a failed ANE compile
// can pass load and SIGKILL the first prediction) is a result, not a crash. Foundation's `Process` exists on macOS
// and Linux only (not iOS): the sweep is built there.
#if os(macOS) || os(Linux)
import Foundation
#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#endif

/// Runs `DeviceCandidate`s one child at a time and writes `device-choice.json` (DeviceChoice.swift).
///
/// Child protocol: the parent runs `EXECUTABLE bench <childArguments> --child-candidate ID --child-result FILE`; the
/// child runs `DeviceBenchmark` in that candidate's compute units (after checking the bundle holds its layout), writes
/// its bench report (the JSON `cohere-coreml bench --merge-engine` reads, with a "candidate" entry) to FILE atomically
/// and exits 0; it exits 2 when it cannot run. Its stdout and stderr go to a pipe the parent reads (the last 8 KB are
/// kept with the result; forwarded to the parent's stderr unless quiet). The parent waits up to `timeout` seconds, then
/// SIGKILLs the child. A child killed by a signal is "crashed" (signal number and name), one that exits non-zero or
/// writes no readable report "failed" (exit status), one past the timeout "timeout"; the parent goes on with the next.
public enum DeviceSweep {
    public struct Options: Sendable {
        /// The `cohere-transcribe-swift` executable (the parent passes its own).
        public var executable: URL
        /// `bench` arguments every child gets before its candidate (bundle, data, runtime, interpreter, cache, clips...).
        public var childArguments: [String]
        public var bundle: URL
        public var candidates: [DeviceCandidate]
        /// Where device-choice.json goes; each candidate's report goes to `<name>.candidates/` beside it.
        public var output: URL
        /// Seconds one child may run (a 2 B encoder's first Neural Engine compile takes minutes).
        public var timeout: Double
        /// The children's environment (nil: this process's).
        public var environment: [String: String]?
        /// Copy the children's output to this process's stderr as it comes.
        public var forwardChildOutput: Bool
        public var progress: (@Sendable (String) -> Void)?

        public init(executable: URL, childArguments: [String], bundle: URL, candidates: [DeviceCandidate], output: URL,
                    timeout: Double = 7200, environment: [String: String]? = nil, forwardChildOutput: Bool = false,
                    progress: (@Sendable (String) -> Void)? = nil) {
            self.executable = executable
            self.childArguments = childArguments
            self.bundle = bundle
            self.candidates = candidates
            self.output = output
            self.timeout = timeout
            self.environment = environment
            self.forwardChildOutput = forwardChildOutput
            self.progress = progress
        }
    }

    /// How one child ended.
    public struct ChildOutcome {
        /// "completed", "crashed", "failed" or "timeout".
        public var status: String
        /// "exit", "signal" or "timeout".
        public var termination: String
        public var exitStatus: Int32?
        public var signal: Int32?
        public var wallSeconds: Double
        public var outputTail: String
        /// The child's report (completed only).
        public var report: [String: Any]?
        public var problem: String?
    }

    /// What `run` wrote.
    public struct Result {
        /// The device-choice document as written.
        public var document: [String: Any]
        public var chosen: DeviceCandidate?
        /// The chosen candidate's bench report file.
        public var chosenReport: URL?
    }

    /// Runs every candidate, writes device-choice.json and every completed candidate's report; throws only when a
    /// file cannot be written or the executable cannot be started.
    public static func run(_ options: Options) throws -> Result {
        let say = options.progress ?? { _ in }
        let folder = options.output.deletingPathExtension().appendingPathExtension("candidates")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        var entries: [[String: Any]] = []
        var outcomes: [DeviceChoice.Outcome] = []
        var reportFiles: [String: URL] = [:]
        var firstReport: [String: Any]?
        for (i, candidate) in options.candidates.enumerated() {
            let name = "\(i + 1)-\(candidate.computeUnits.rawValue)-"
                + BundleLayout.axes.compactMap { candidate.layout.values[$0.key] }.joined(separator: "-") + ".json"
            let reportURL = folder.appendingPathComponent(name)
            try? FileManager.default.removeItem(at: reportURL)  // a stale report is never read as this run's
            say("[\(i + 1)/\(options.candidates.count)] \(candidate.id): child process")
            let outcome = try runChild(options, candidate: candidate, report: reportURL)
            say("[\(i + 1)/\(options.candidates.count)] \(candidate.id): \(outcome.status)"
                + (outcome.signal.map { " by signal \($0) (\(signalName($0)))" } ?? "")
                + (outcome.problem.map { ": \($0)" } ?? "") + String(format: " (%.1f s)", outcome.wallSeconds))
            var entry: [String: Any] = [
                "id": candidate.id, "compute_units": unitsObject(candidate.components), "layout": layoutObject(candidate.layout),
                "status": outcome.status, "wall_s": outcome.wallSeconds,
                "termination": [
                    "reason": outcome.termination, "exit_status": outcome.exitStatus.map { $0 as Any } ?? NSNull(),
                    "signal": outcome.signal.map { $0 as Any } ?? NSNull(),
                    "signal_name": outcome.signal.map { signalName($0) as Any } ?? NSNull(),
                    "timeout_s": options.timeout,
                ] as [String: Any],
                "output_tail": outcome.outputTail, "problem": outcome.problem ?? NSNull(),
            ]
            var clips: [Int: DeviceChoice.ClipTokens] = [:]
            var processing: Double?
            if let report = outcome.report {
                firstReport = firstReport ?? report
                reportFiles[candidate.id] = reportURL
                entry["report_file"] = folder.lastPathComponent + "/" + name
                entry["figures"] = figures(report)
                entry["placement"] = report["placement"] ?? NSNull()
                entry["placement_reason"] = report["placement_reason"] ?? NSNull()
                let totals = report["totals"] as? [String: Any] ?? [:]
                processing = totals["processing_s"] as? Double
                for clip in report["clips"] as? [[String: Any]] ?? [] {
                    guard let index = clip["index"] as? Int else { continue }
                    clips[index] = DeviceChoice.ClipTokens(status: clip["status"] as? String ?? "?",
                                                           tokenIds: clip["token_ids"] as? [[Int]])
                }
            } else {
                entry["report_file"] = NSNull()
            }
            outcomes.append(DeviceChoice.Outcome(id: candidate.id, computeUnits: candidate.computeUnits,
                                                 completed: outcome.report != nil, processingSeconds: processing, clips: clips))
            entries.append(entry)
        }

        let selection = DeviceChoice.select(outcomes)
        for (i, entry) in entries.enumerated() {
            let id = entry["id"] as! String
            entries[i]["tokens_match_reference"] = selection.matchesReference[id].map { $0 as Any } ?? NSNull()
            entries[i]["mismatched_clips"] = selection.mismatchedClips[id].map { $0 as Any } ?? NSNull()
            entries[i]["eligible"] = selection.matchesReference[id] == true && entries[i]["figures"] != nil
        }
        let chosen = options.candidates.first { $0.id == selection.chosen }
        let manifestSHA = try SHA256.hexDigest(ofFile: options.bundle.appendingPathComponent(BundleManifest.fileName))
        let layouts = (try? BundleLayout.layouts(bundle: options.bundle)) ?? []
        var machine: Any = NSNull()
        if let data = try? JSONEncoder().encode(DeviceBenchmark.MachineRecord.current()) {
            machine = (try? JSONSerialization.jsonObject(with: data)) ?? NSNull()
        }
        let dataset = firstReport?["dataset"] as? [String: Any]
        var document: [String: Any] = [
            "tool": DeviceBenchmark.tool, "kind": DeviceChoice.kind, "format_version": DeviceChoice.formatVersion,
            "created_utc": ISO8601DateFormatter().string(from: Date()), "machine": machine,
            "bundle": ["dir": options.bundle.path, "manifest_sha256": manifestSHA,
                       "layouts": layouts.map(layoutObject)] as [String: Any],
            "dataset": dataset.map { d -> Any in
                ["name": d["name"] ?? NSNull(), "manifest_sha256": d["manifest_sha256"] ?? NSNull(),
                 "benched_clips": d["benched_clips"] ?? NSNull()] as [String: Any]
            } ?? NSNull(),
            "rule": DeviceChoice.rule, "reference": selection.reference ?? NSNull(), "candidates": entries,
        ]
        if let chosen {
            document["chosen"] = ["candidate": chosen.id, "compute_units": unitsObject(chosen.components),
                                  "layout": layoutObject(chosen.layout),
                                  "report_file": folder.lastPathComponent + "/" + reportFiles[chosen.id]!.lastPathComponent]
                as [String: Any]
        } else {
            document["chosen"] = NSNull()
        }
        let data = try JSONSerialization.data(withJSONObject: document, options: [.prettyPrinted, .sortedKeys,
                                                                                  .withoutEscapingSlashes])
        try FileManager.default.createDirectory(at: options.output.deletingLastPathComponent(), withIntermediateDirectories: true)
        try data.write(to: options.output, options: .atomic)
        say("chosen: \(chosen?.id ?? "none") (reference \(selection.reference ?? "none")); wrote \(options.output.path)")
        return Result(document: document, chosen: chosen, chosenReport: chosen.flatMap { reportFiles[$0.id] })
    }

    static func unitsObject(_ u: ComponentComputeUnits) -> [String: Any] {
        ["front_end": u.frontEnd.rawValue, "encoder": u.encoder.rawValue, "decoder": u.decoder.rawValue]
    }

    static func layoutObject(_ l: BundleLayout) -> [String: Any] { ["id": l.id, "values": l.values] }

    /// A completed candidate's figures, from its report: loads (cold / warm), warm time, stages, memory.
    static func figures(_ report: [String: Any]) -> [String: Any] {
        let load = report["load"] as? [String: Any] ?? [:]
        let totals = report["totals"] as? [String: Any] ?? [:]
        let memory = report["memory"] as? [String: Any] ?? [:]
        var out: [String: Any] = [:]
        for key in ["cold_s", "warm_s", "cold_transcriber_load_s", "warm_transcriber_load_s", "compiled_cache_before"] {
            out["load_" + key] = load[key] ?? NSNull()
        }
        out["first_run_s"] = report["first_run_s"] ?? NSNull()
        for key in ["processing_s", "audio_s", "rtfx", "stages_s", "tokens_per_s", "ms_per_decoder_call", "decoder_calls",
                    "decode_tokens", "windows", "clips_ok", "clips_silent", "clips_failed"] {
            out[key] = totals[key] ?? NSNull()
        }
        out["peak_memory_mb"] = memory["peak_mb"] ?? NSNull()
        return out
    }

    /// The name of a signal a child died of.
    public static func signalName(_ signal: Int32) -> String {
        let names: [Int32: String] = [SIGKILL: "SIGKILL", SIGABRT: "SIGABRT", SIGSEGV: "SIGSEGV", SIGBUS: "SIGBUS",
                                      SIGILL: "SIGILL", SIGTERM: "SIGTERM", SIGTRAP: "SIGTRAP", SIGFPE: "SIGFPE",
                                      SIGINT: "SIGINT", SIGPIPE: "SIGPIPE"]
        return names[signal] ?? "signal \(signal)"
    }

    /// The last `limit` bytes of a child's output (thread-safe: the pipe's handler runs on another thread).
    final class Tail: @unchecked Sendable {
        private let lock = NSLock()
        private var data = Data()
        private let limit: Int
        init(limit: Int) { self.limit = limit }
        func append(_ d: Data) {
            lock.lock(); defer { lock.unlock() }
            data.append(d)
            if data.count > limit { data = data.suffix(limit) }
        }
        var text: String { lock.lock(); defer { lock.unlock() }; return String(decoding: data, as: UTF8.self) }
    }

    static func runChild(_ options: Options, candidate: DeviceCandidate, report: URL) throws -> ChildOutcome {
        let process = Process()
        process.executableURL = options.executable
        process.arguments = ["bench"] + options.childArguments
            + ["--child-candidate", candidate.id, "--child-result", report.path]
        if let environment = options.environment { process.environment = environment }
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        process.standardInput = FileHandle.nullDevice
        let tail = Tail(limit: 8192)
        let forward = options.forwardChildOutput
        // Read as it comes, never to end of file: a grandchild (the interpreter) may hold the pipe after a crash.
        pipe.fileHandleForReading.readabilityHandler = { handle in
            let data = handle.availableData
            if data.isEmpty { handle.readabilityHandler = nil; return }
            tail.append(data)
            if forward { FileHandle.standardError.write(data) }
        }
        let ended = DispatchSemaphore(value: 0)
        process.terminationHandler = { _ in ended.signal() }
        var clock = Stopwatch()
        do {
            try process.run()
        } catch {
            pipe.fileHandleForReading.readabilityHandler = nil
            throw BenchmarkError("cannot start the child \(options.executable.path): \(error.localizedDescription)")
        }
        var timedOut = false
        if ended.wait(timeout: .now() + options.timeout) == .timedOut {
            timedOut = true
            kill(process.processIdentifier, SIGKILL)  // our own child, by its pid
            ended.wait()
        }
        let wall = clock.lap()
        Thread.sleep(forTimeInterval: 0.05)  // the handler's last chunk
        pipe.fileHandleForReading.readabilityHandler = nil
        var outcome = ChildOutcome(status: "completed", termination: "exit", exitStatus: nil, signal: nil, wallSeconds: wall,
                                   outputTail: tail.text, report: nil, problem: nil)
        if timedOut {
            (outcome.status, outcome.termination) = ("timeout", "timeout")
            outcome.signal = SIGKILL
            outcome.problem = "no result within \(options.timeout) s: killed"
        } else if process.terminationReason == .uncaughtSignal {
            (outcome.status, outcome.termination) = ("crashed", "signal")
            outcome.signal = process.terminationStatus
            outcome.problem = "the child died of \(signalName(process.terminationStatus))"
        } else if process.terminationStatus != 0 {
            outcome.status = "failed"
            outcome.exitStatus = process.terminationStatus
            outcome.problem = "the child exited with status \(process.terminationStatus)"
        } else {
            outcome.exitStatus = 0
            if let data = try? Data(contentsOf: report),
               let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
               object["tool"] as? String == DeviceBenchmark.tool {
                outcome.report = object
            } else {
                outcome.status = "failed"
                outcome.problem = "the child exited 0 without a readable report at \(report.path)"
            }
        }
        return outcome
    }

    /// The path of this process's executable (the parent spawns itself).
    public static func currentExecutable() -> URL {
        #if os(Linux)
        if let path = try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe") {
            return URL(fileURLWithPath: path)
        }
        #endif
        if let url = Bundle.main.executableURL { return url }
        let arg0 = CommandLine.arguments[0]
        return arg0.hasPrefix("/") ? URL(fileURLWithPath: arg0)
            : URL(fileURLWithPath: FileManager.default.currentDirectoryPath).appendingPathComponent(arg0)
    }
}
#endif
